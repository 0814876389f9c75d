/* rpcsrv.c - async msgpack-rpc endpoint over nng rep0; see rpcsrv.h. */
#include "rpc/rpcsrv.h"

#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/supplemental/util/platform.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "common/tls.h"

typedef enum slot_state { SLOT_RECV, SLOT_WAIT, SLOT_SEND, SLOT_CLOSED } slot_state;

/* rpc_slot: one nng context and its aio; cycles RECV -> WAIT (handler) -> SEND. */
typedef struct rpc_slot {
    rpcsrv *srv;
    nng_ctx ctx;
    nng_aio *aio;
    slot_state state;
    rpc_call call;
    struct rpc_slot *next_ready; /* queue link, guarded by srv->mu */
    uint32_t pipe;               /* the request's connection while it is in progress (0 = none) */
    uint64_t held;               /* its bytes counted in srv->held_bytes (0 = none) */
} rpc_slot;

/* rpc_pipe: one open connection (with max_conns): requests in progress on
 * it and when it last completed a message */
typedef struct rpc_pipe {
    nng_pipe p;
    uint32_t inflight;
    uint64_t last_ns;
    int keep; /* never closed as idle (rpcsrv_pipe_keep) */
} rpc_pipe;

struct rpcsrv {
    nng_socket sock;
    nng_listener lis;
    uv_async_t wake; /* the doorbell from nng threads */
    pthread_mutex_t mu;
    rpc_slot *ready_head, *ready_tail; /* received, waiting for the loop */
    rpc_slot *slots;
    int nslots;
    size_t max_msg;
    rpc_handler handler;
    void *handler_arg;
    void (*on_pipe_closed)(uint32_t pipe, void *arg);
    uint64_t held_bytes; /* rpcsrv_held_bytes (atomic) */
    /* connections (max_conns > 0), guarded by pmu */
    pthread_mutex_t pmu;
    rpc_pipe *pipes; /* npipes of max_conns, unordered */
    int npipes, max_conns;
    uint64_t idle_ns; /* 0 = no idle bound */
    uint64_t conns_refused_total, idle_closed_total;
    uv_timer_t idle_timer; /* the idle scan (idle_ns > 0) */
    int nhandles;          /* uv handles still to close before the server is freed */
    int closing;
    uint64_t last_send_ns;  /* when the last reply was handed to nng (atomic) */
    uint64_t last_send_len; /* its size in bytes (atomic) */
};

uint64_t rpc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* pipe_find returns the entry of pipe id, or NULL. Under pmu. */
static rpc_pipe *pipe_find(rpcsrv *s, uint32_t id)
{
    for (int i = 0; i < s->npipes; i++)
        if (nng_pipe_id(s->pipes[i].p) == (int)id)
            return &s->pipes[i];
    return NULL;
}

/* pipe_touch: a request on pipe id arrived (delta 1) or was answered (-1). */
static void pipe_touch(rpcsrv *s, uint32_t id, int delta)
{
    if (!s->pipes || id == 0)
        return;
    pthread_mutex_lock(&s->pmu);
    rpc_pipe *p = pipe_find(s, id);
    if (p) {
        if (delta > 0)
            p->inflight++;
        else if (p->inflight > 0)
            p->inflight--;
        p->last_ns = rpc_now_ns();
    }
    pthread_mutex_unlock(&s->pmu);
}

/* pipe_added: a connection is about to join (nng thread). Beyond max_conns
 * it is closed at once and never seen by the socket. */
static void pipe_added(rpcsrv *s, nng_pipe p)
{
    int refuse = 0;
    pthread_mutex_lock(&s->pmu);
    if (s->npipes >= s->max_conns) {
        refuse = 1;
        s->conns_refused_total++;
    } else {
        s->pipes[s->npipes++] = (rpc_pipe){p, 0, rpc_now_ns(), 0};
    }
    pthread_mutex_unlock(&s->pmu);
    if (refuse) {
        LOG_D("rpcsrv: %d connections open: closing a new one", s->max_conns);
        nng_pipe_close(p);
    }
}

static void pipe_removed(rpcsrv *s, nng_pipe p)
{
    pthread_mutex_lock(&s->pmu);
    rpc_pipe *e = pipe_find(s, (uint32_t)nng_pipe_id(p));
    if (e)
        *e = s->pipes[--s->npipes];
    pthread_mutex_unlock(&s->pmu);
}

/* on_idle_timer closes the connections idle longer than the bound (loop). */
static void on_idle_timer(uv_timer_t *t)
{
    rpcsrv *s = t->data;
    nng_pipe idle[64];
    int n = 0;
    uint64_t now = rpc_now_ns();
    pthread_mutex_lock(&s->pmu);
    for (int i = 0; i < s->npipes && n < 64; i++) {
        rpc_pipe *p = &s->pipes[i];
        if (!p->keep && p->inflight == 0 && now - p->last_ns > s->idle_ns) {
            idle[n++] = p->p;
            p->last_ns = now; /* closed below: not again on the next scan */
        }
    }
    s->idle_closed_total += (uint64_t)n;
    pthread_mutex_unlock(&s->pmu);
    for (int i = 0; i < n; i++) {
        LOG_D("rpcsrv: closing connection %d: idle for more than %llu ms", nng_pipe_id(idle[i]),
              (unsigned long long)(s->idle_ns / 1000000ull));
        nng_pipe_close(idle[i]);
    }
}

/* release_request frees the request message of sl and takes it out of the
 * counts (held bytes, its connection's requests in progress). */
static void release_request(rpc_slot *sl)
{
    if (sl->call.msg) {
        nng_msg_free(sl->call.msg);
        sl->call.msg = NULL;
    }
    if (sl->held) {
        __atomic_sub_fetch(&sl->srv->held_bytes, sl->held, __ATOMIC_RELAXED);
        sl->held = 0;
    }
    if (sl->pipe) {
        pipe_touch(sl->srv, sl->pipe, -1);
        sl->pipe = 0;
    }
}

static void slot_recv(rpc_slot *sl)
{
    __atomic_store_n(&sl->state, SLOT_RECV, __ATOMIC_RELEASE);
    nng_ctx_recv(sl->ctx, sl->aio);
}

/* slot_cb runs on an nng thread: after a receive, queue for the loop; after
 * a send, wait for the next request. Never blocks beyond the queue mutex. */
static void slot_cb(void *arg)
{
    rpc_slot *sl = arg;
    rpcsrv *s = sl->srv;
    int rv = nng_aio_result(sl->aio);
    switch (sl->state) {
    case SLOT_RECV:
        if (rv != 0) {
            if (rv == NNG_ECLOSED || rv == NNG_ECANCELED) {
                sl->state = SLOT_CLOSED;
                return;
            }
            slot_recv(sl);
            return;
        }
        sl->call.msg = nng_aio_get_msg(sl->aio);
        sl->call.recv_ns = rpc_now_ns();
        sl->pipe = rpc_call_pipe(&sl->call);
        pipe_touch(s, sl->pipe, 1);
        sl->state = SLOT_WAIT;
        pthread_mutex_lock(&s->mu);
        sl->next_ready = NULL;
        if (s->ready_tail)
            s->ready_tail->next_ready = sl;
        else
            s->ready_head = sl;
        s->ready_tail = sl;
        pthread_mutex_unlock(&s->mu);
        uv_async_send(&s->wake);
        return;
    case SLOT_SEND:
        if (rv != 0) {
            nng_msg *m = nng_aio_get_msg(sl->aio);
            if (m)
                nng_msg_free(m);
            if (rv == NNG_ECLOSED) {
                sl->state = SLOT_CLOSED;
                return;
            }
        }
        slot_recv(sl);
        return;
    default: return;
    }
}

/* send_msg hands the reply m (owned from here) to nng. */
static void send_msg(rpc_slot *sl, nng_msg *m)
{
    size_t len = nng_msg_len(m);
    rpc_reply_hook hook = sl->call.on_reply;
    if (hook) { /* once, while the request is still readable */
        sl->call.on_reply = NULL;
        hook(&sl->call, nng_msg_body(m), len, sl->call.on_reply_arg);
    }
    release_request(sl);
    __atomic_store_n(&sl->srv->last_send_len, (uint64_t)len, __ATOMIC_RELAXED);
    __atomic_store_n(&sl->srv->last_send_ns, rpc_now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&sl->state, SLOT_SEND, __ATOMIC_RELEASE);
    nng_aio_set_msg(sl->aio, m);
    nng_ctx_send(sl->ctx, sl->aio);
}

/* a local call (rpc_call_local): no slot, no nng; the answer goes to its
 * hook and the call is freed */
static void local_answer(rpc_call *c, const void *buf, size_t len)
{
    rpc_reply_hook hook = c->on_reply;
    c->on_reply = NULL;
    if (hook)
        hook(c, buf, len, c->on_reply_arg);
    free(c);
}

static void send_bytes(rpc_slot *sl, const void *buf, size_t len)
{
    nng_msg *m;
    if (nng_msg_alloc(&m, len) != 0) {
        LOG_E("rpcsrv: out of memory for a %zu byte reply", len);
        release_request(sl);
        slot_recv(sl);
        return;
    }
    memcpy(nng_msg_body(m), buf, len);
    send_msg(sl, m);
}

void rpc_reply_msg(rpc_call *c, void *msg)
{
    if (!c->slot) {
        local_answer(c, nng_msg_body(msg), nng_msg_len(msg));
        nng_msg_free(msg);
        return;
    }
    send_msg(c->slot, msg);
}

rpc_call *rpc_call_local(const char *method, const void *params, size_t len, rpc_reply_hook hook,
                         void *arg)
{
    rpc_call *c = calloc(1, sizeof(*c) + len + strlen(method) + 1);
    if (!c)
        return NULL;
    uint8_t *p = (uint8_t *)(c + 1);
    char *name = (char *)p + len;
    memcpy(p, params, len);
    strcpy(name, method);
    mp_reader r;
    mp_reader_init(&r, p, len);
    if (mp_read_map(&r, &c->req.nparams, NULL) != MOE_OK) {
        free(c);
        return NULL;
    }
    c->req.params = r;
    c->req.method = name;
    c->req.method_len = (uint32_t)strlen(name);
    c->recv_ns = rpc_now_ns();
    c->on_reply = hook;
    c->on_reply_arg = arg;
    return c;
}

void rpc_call_set_pipe(rpc_call *c, uint32_t pipe)
{
    c->local_pipe = pipe;
}

uint32_t rpc_call_pipe(const rpc_call *c)
{
    if (!c->msg)
        return c->local_pipe;
    nng_pipe p = nng_msg_get_pipe((nng_msg *)c->msg);
    return nng_pipe_id(p) > 0 ? (uint32_t)nng_pipe_id(p) : 0;
}

static void on_pipe_event(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    rpcsrv *s = arg;
    if (ev == NNG_PIPE_EV_ADD_PRE) {
        pipe_added(s, p);
        return;
    }
    if (s->pipes)
        pipe_removed(s, p);
    if (s->on_pipe_closed && nng_pipe_id(p) > 0)
        s->on_pipe_closed((uint32_t)nng_pipe_id(p), s->handler_arg);
}

void rpcsrv_pipe_keep(rpcsrv *s, uint32_t pipe)
{
    if (!s || !s->pipes)
        return;
    pthread_mutex_lock(&s->pmu);
    rpc_pipe *p = pipe_find(s, pipe);
    if (p)
        p->keep = 1;
    pthread_mutex_unlock(&s->pmu);
}

uint64_t rpcsrv_held_bytes(const rpcsrv *s)
{
    if (!s) /* no server (a daemon's handlers driven by local calls) */
        return 0;
    return __atomic_load_n(&s->held_bytes, __ATOMIC_RELAXED);
}

void rpcsrv_counters_get(rpcsrv *s, rpcsrv_counters *out)
{
    memset(out, 0, sizeof(*out));
    if (!s)
        return;
    out->held_bytes = rpcsrv_held_bytes(s);
    pthread_mutex_lock(&s->pmu);
    out->conns = (uint64_t)s->npipes;
    out->conns_refused_total = s->conns_refused_total;
    out->idle_closed_total = s->idle_closed_total;
    pthread_mutex_unlock(&s->pmu);
}

void rpc_reply(rpc_call *c, mp_writer *w)
{
    rpc_slot *sl = c->slot;
    if (w->failed) {
        mp_writer_fini(w);
        mp_writer_init(w);
        rpc_reply_err(c, MOE_ENOMEM, "reply too large to encode");
        return;
    }
    if (!sl)
        local_answer(c, w->buf, w->len);
    else
        send_bytes(sl, w->buf, w->len);
    mp_writer_fini(w);
    mp_writer_init(w);
}

void rpc_reply_bytes(rpc_call *c, const void *buf, size_t len)
{
    if (!c->slot)
        local_answer(c, buf, len);
    else
        send_bytes(c->slot, buf, len);
}

static void reply_err_v(rpc_call *c, moe_err err, const int *gone, int ngone, const char *fmt,
                        va_list ap)
{
    char text[512];
    vsnprintf(text, sizeof(text), fmt, ap);
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_err_gone(&w, c->req.msgid, err, text, gone, ngone);
    MOE_LOG(LOG_DEBUG, c->req.msgid, "reply error %s: %s", moe_err_code(err), text);
    if (!c->slot)
        local_answer(c, w.buf, w.len);
    else
        send_bytes(c->slot, w.buf, w.len);
    mp_writer_fini(&w);
}

void rpc_reply_err(rpc_call *c, moe_err err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    reply_err_v(c, err, NULL, 0, fmt, ap);
    va_end(ap);
}

void rpc_reply_err_gone(rpc_call *c, moe_err err, const int *gone, int ngone, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    reply_err_v(c, err, gone, ngone, fmt, ap);
    va_end(ap);
}

/* on_wake drains the whole ready queue on the loop thread. */
static void on_wake(uv_async_t *h)
{
    rpcsrv *s = h->data;
    pthread_mutex_lock(&s->mu);
    rpc_slot *sl = s->ready_head;
    s->ready_head = s->ready_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    while (sl) {
        rpc_slot *next = sl->next_ready;
        rpc_call *c = &sl->call;
        nng_msg *m = c->msg;
        mp_errbuf eb = {{0}};
        uint32_t msgid = 0;
        c->data = NULL;
        c->on_reply = NULL;
        moe_err e = moe_rpc_parse_request(nng_msg_body(m), nng_msg_len(m), s->max_msg, &c->req,
                                          &msgid, &eb);
        if (e != MOE_OK) {
            c->req.msgid = msgid;
            LOG_W("rejected request (msgid %u, %zu bytes): %s: %s", msgid, nng_msg_len(m),
                  moe_err_code(e), eb.msg);
            rpc_reply_err(c, e, "%s", eb.msg[0] ? eb.msg : moe_strerror(e));
        } else if (s->closing) {
            rpc_reply_err(c, MOE_EUNAVAIL, "server is shutting down");
        } else {
            sl->held = nng_msg_len(m);
            __atomic_add_fetch(&s->held_bytes, sl->held, __ATOMIC_RELAXED);
            s->handler(c, s->handler_arg);
        }
        sl = next;
    }
}

static void format_bound(nng_listener lis, const char *url, char *out, size_t len)
{
    nng_sockaddr sa;
    if (!out || len == 0)
        return;
    snprintf(out, len, "%s", url);
    if (nng_listener_get_addr(lis, NNG_OPT_LOCADDR, &sa) != 0)
        return;
    if (sa.s_family == NNG_AF_INET) {
        const uint8_t *ip = (const uint8_t *)&sa.s_in.sa_addr;
        /* the url's own scheme (tcp://, tls+tcp://) */
        const char *sep = strstr(url, "://");
        int slen = sep ? (int)(sep - url) : 3;
        snprintf(out, len, "%.*s://%u.%u.%u.%u:%u", slen, sep ? url : "tcp", ip[0], ip[1], ip[2],
                 ip[3], (unsigned)ntohs(sa.s_in.sa_port));
    }
}

/* srv_free releases what rpcsrv_open allocated (the socket is closed) */
static void srv_free(rpcsrv *s)
{
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->pmu);
    free(s->pipes);
    free(s->slots);
    free(s);
}

moe_err rpcsrv_open(uv_loop_t *loop, const rpcsrv_opts *o, rpcsrv **out, char *bound_url,
                    size_t bound_len)
{
    rpcsrv *s = calloc(1, sizeof(*s));
    int rv;
    if (!s)
        return MOE_ENOMEM;
    s->max_msg = o->max_msg;
    s->handler = o->handler;
    s->handler_arg = o->handler_arg;
    s->on_pipe_closed = o->on_pipe_closed;
    s->nslots = o->nctx > 0 ? o->nctx : 16;
    s->max_conns = o->max_conns > 0 ? o->max_conns : 0;
    s->idle_ns =
        s->max_conns && o->idle_timeout_ms > 0 ? (uint64_t)o->idle_timeout_ms * 1000000ull : 0;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->pmu, NULL);
    if (s->max_conns && !(s->pipes = calloc((size_t)s->max_conns, sizeof(rpc_pipe)))) {
        srv_free(s);
        return MOE_ENOMEM;
    }
    if ((rv = nng_rep0_open(&s->sock)) != 0) {
        LOG_E("nng_rep0_open: %s", nng_strerror(rv));
        srv_free(s);
        return MOE_EINTERNAL;
    }
    /* Transport hard cap: twice the protocol cap, so requests a little over
     * the cap still get a "too_large" answer; beyond it nng drops the pipe. */
    nng_socket_set_size(s->sock, NNG_OPT_RECVMAXSZ, o->max_msg * 2 + 4096);
    if (s->on_pipe_closed || s->pipes)
        nng_pipe_notify(s->sock, NNG_PIPE_EV_REM_POST, on_pipe_event, s);
    if (s->pipes)
        nng_pipe_notify(s->sock, NNG_PIPE_EV_ADD_PRE, on_pipe_event, s);
    if ((rv = nng_listener_create(&s->lis, s->sock, o->url)) != 0) {
        LOG_E("cannot listen on %s: %s", o->url, nng_strerror(rv));
        nng_close(s->sock);
        srv_free(s);
        return MOE_EINVAL;
    }
    char terr[512];
    if (moe_tls_listener_setup(s->lis, o->url, o->tls, terr, sizeof(terr)) != MOE_OK) {
        LOG_E("cannot listen on %s: %s", o->url, terr);
        nng_close(s->sock);
        srv_free(s);
        return MOE_EINVAL;
    }
    if ((rv = nng_listener_start(s->lis, 0)) != 0) {
        LOG_E("cannot listen on %s: %s", o->url, nng_strerror(rv));
        nng_close(s->sock);
        srv_free(s);
        return MOE_EINVAL;
    }
    format_bound(s->lis, o->url, bound_url, bound_len);
    s->slots = calloc((size_t)s->nslots, sizeof(rpc_slot));
    if (!s->slots) {
        LOG_E("rpcsrv: out of memory for %d contexts", s->nslots);
        nng_close(s->sock);
        srv_free(s);
        return MOE_ENOMEM;
    }
    uv_async_init(loop, &s->wake, on_wake);
    s->wake.data = s;
    s->nhandles = 1;
    if (s->idle_ns) {
        uint64_t period = s->idle_ns / 4000000ull; /* a quarter of the bound, in ms */
        period = period < 10 ? 10 : period > 1000 ? 1000 : period;
        uv_timer_init(loop, &s->idle_timer);
        s->idle_timer.data = s;
        uv_timer_start(&s->idle_timer, on_idle_timer, period, period);
        s->nhandles = 2;
    }
    for (int i = 0; i < s->nslots; i++) {
        rpc_slot *sl = &s->slots[i];
        sl->srv = s;
        sl->call.slot = sl;
        if (nng_ctx_open(&sl->ctx, s->sock) != 0 || nng_aio_alloc(&sl->aio, slot_cb, sl) != 0) {
            LOG_E("rpcsrv: cannot allocate context %d", i);
            s->nslots = i;
            break;
        }
        slot_recv(sl);
    }
    *out = s;
    return MOE_OK;
}

static void on_handle_closed(uv_handle_t *h)
{
    rpcsrv *s = h->data;
    if (--s->nhandles == 0)
        srv_free(s);
}

/* RPCSRV_FLUSH_MS bounds how long rpcsrv_close waits for replies in flight. */
#define RPCSRV_FLUSH_MS 5000

/* flush answers requests that were received but never handed to the loop
 * (unavailable: shutting down) and waits, bounded, for the replies in flight:
 * a drained server must not cut its last replies short. nng completes a send
 * when the message is queued on the pipe, not when the bytes are written, and
 * closing the socket drops what is queued; so after the last send completes
 * we linger 50 ms plus the time to write the last reply at 64 MiB/s. */
static void flush(rpcsrv *s)
{
    uint64_t t0 = rpc_now_ns(), limit = (uint64_t)RPCSRV_FLUSH_MS * 1000000ull;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        rpc_slot *sl = s->ready_head;
        s->ready_head = s->ready_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        while (sl) {
            rpc_slot *next = sl->next_ready;
            nng_msg *m = sl->call.msg;
            mp_errbuf eb = {{0}};
            uint32_t msgid = 0;
            sl->call.on_reply = NULL;
            moe_rpc_parse_request(nng_msg_body(m), nng_msg_len(m), s->max_msg, &sl->call.req,
                                  &msgid, &eb);
            sl->call.req.msgid = msgid;
            rpc_reply_err(&sl->call, MOE_EUNAVAIL, "server is shutting down");
            sl = next;
        }
        int sending = 0;
        for (int i = 0; i < s->nslots; i++)
            sending += __atomic_load_n(&s->slots[i].state, __ATOMIC_ACQUIRE) == SLOT_SEND;
        uint64_t now = rpc_now_ns();
        uint64_t last = __atomic_load_n(&s->last_send_ns, __ATOMIC_RELAXED);
        uint64_t len = __atomic_load_n(&s->last_send_len, __ATOMIC_RELAXED);
        uint64_t linger = 50000000ull + len * 1000000000ull / (64ull << 20);
        if (!sending && (last == 0 || now - last >= linger))
            return;
        if (now - t0 > limit) {
            LOG_W("rpcsrv: %d replies still being sent after %d ms: closing anyway", sending,
                  RPCSRV_FLUSH_MS);
            return;
        }
        nng_msleep(5);
    }
}

void rpcsrv_close(rpcsrv *s)
{
    if (!s)
        return;
    s->closing = 1;
    flush(s);
    for (int i = 0; i < s->nslots; i++)
        nng_aio_stop(s->slots[i].aio);
    nng_close(s->sock);
    for (int i = 0; i < s->nslots; i++) {
        if (s->slots[i].call.msg)
            nng_msg_free(s->slots[i].call.msg);
        nng_aio_free(s->slots[i].aio);
    }
    if (s->idle_ns)
        uv_close((uv_handle_t *)&s->idle_timer, on_handle_closed);
    uv_close((uv_handle_t *)&s->wake, on_handle_closed);
}
