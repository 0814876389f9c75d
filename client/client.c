/* client.c - libmoe transport: nng req0 with contexts, msgpack-rpc calls. */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "client/client_dp.h"
#include "base/moe.h"
#include "proto/proto.h"
#include "common/tls.h"

struct moe_client {
    nng_socket sock;
    int timeout_ms;
    size_t max_msg;
    char *auth_token;   /* owned; NULL = none */
    char *cluster;      /* owned; NULL = none: the cluster secret (moe__set_cluster) */
    uint64_t client_id; /* random, drawn at open: the first half of every "rid" */
    atomic_uint next_msgid;
    /* the async calls in flight (moe_call_async), so that moe_client_close
     * can cancel them and wait for their callbacks before it closes the
     * socket: nng_close with a request context still waiting for a reply
     * from a server that died could block forever (seen in the tests) */
    pthread_mutex_t amu;
    pthread_cond_t acv;
    struct acall *alist;               /* doubly linked through acall.next / prev, under amu */
    int closing;                       /* under amu: no new receive is started */
    int cb_running;                    /* under amu: callbacks of finished calls still running */
    int data_path;                     /* MOE_PATH_*: how forward/backward rows travel */
    struct moe_dp *dp;                 /* owned: the data plane (client_dp.c), made on first use */
    char *tls_ca, *tls_cert, *tls_key; /* owned copies of the TLS paths (NULL = none) */
    pthread_mutex_t dpmu;              /* guards dp's creation */
};

static __thread char last_error[512];

const char *moe_last_error(void)
{
    return last_error;
}

static void set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
}

moe_err moe__from_nng(int rv)
{
    switch (rv) {
    case 0: return MOE_OK;
    case NNG_ETIMEDOUT: return MOE_ETIMEDOUT;
    case NNG_ENOMEM: return MOE_ENOMEM;
    case NNG_ECLOSED: return MOE_ECLOSED;
    case NNG_EMSGSIZE: return MOE_ETOOBIG;
    case NNG_EINVAL:
    case NNG_EADDRINVAL: return MOE_EINVAL;
    default: return MOE_EUNAVAIL;
    }
}

/* random_id draws the client id: getrandom, else /dev/urandom, else a mix of
 * time, pid and an address (unique enough for a per-process id). */
static uint64_t random_id(const void *salt)
{
    uint64_t id = 0;
    if (getrandom(&id, sizeof(id), GRND_NONBLOCK) == (ssize_t)sizeof(id))
        return id;
    FILE *f = fopen("/dev/urandom", "rb");
    if (f) {
        size_t n = fread(&id, sizeof(id), 1, f);
        fclose(f);
        if (n == 1)
            return id;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    id = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    id ^= (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)salt;
    id *= 0x9e3779b97f4a7c15ull;
    return id ^ (id >> 29);
}

/* the client's memory (the socket closed or never opened) */
static void client_free(moe_client *c)
{
    moe_dp_free(c->dp);
    pthread_mutex_destroy(&c->dpmu);
    pthread_cond_destroy(&c->acv);
    pthread_mutex_destroy(&c->amu);
    free(c->auth_token);
    free(c->cluster);
    free(c->tls_ca);
    free(c->tls_cert);
    free(c->tls_key);
    free(c);
}

/* dup_opt copies an optional string option into *out; -1 when out of memory */
static int dup_opt(const char *s, char **out)
{
    *out = s && s[0] ? strdup(s) : NULL;
    return s && s[0] && !*out ? -1 : 0;
}

moe_err moe__dial(moe_client *c, nng_socket s, const char *url, const char *what)
{
    nng_dialer d;
    char err[512];
    const moe_tls_files tls = {c->tls_cert, c->tls_key, c->tls_ca};
    int rv = nng_dialer_create(&d, s, url);
    if (rv != 0) {
        set_error("cannot dial %s at %s: %s", what, url, nng_strerror(rv));
        return rv == NNG_EADDRINVAL || rv == NNG_ENOTSUP ? MOE_EINVAL : MOE_EUNAVAIL;
    }
    moe_err e = moe_tls_dialer_setup(d, url, &tls, err, sizeof(err));
    if (e != MOE_OK) {
        nng_dialer_close(d);
        set_error("cannot dial %s at %s: %s", what, url, err);
        return e == MOE_EIO ? MOE_EINVAL : e;
    }
    /* Non-blocking dial: the server may come up later; calls time out. */
    if ((rv = nng_dialer_start(d, NNG_FLAG_NONBLOCK)) != 0) {
        nng_dialer_close(d);
        set_error("cannot dial %s at %s: %s", what, url, nng_strerror(rv));
        return MOE_EUNAVAIL;
    }
    return MOE_OK;
}

moe_err moe_client_open(const char *url, const moe_client_opts *opts, moe_client **out)
{
    moe_client *c = calloc(1, sizeof(*c));
    int rv;
    if (!c)
        return MOE_ENOMEM;
    c->timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : 60000;
    c->max_msg = opts && opts->max_msg ? opts->max_msg : ((size_t)1 << 30);
    if ((opts && opts->auth_token && !(c->auth_token = strdup(opts->auth_token))) ||
        (opts && (dup_opt(opts->tls_ca, &c->tls_ca) || dup_opt(opts->tls_cert, &c->tls_cert) ||
                  dup_opt(opts->tls_key, &c->tls_key)))) {
        set_error("out of memory");
        free(c->auth_token);
        free(c->tls_ca);
        free(c->tls_cert);
        free(c);
        return MOE_ENOMEM;
    }
    c->client_id = random_id(c);
    atomic_init(&c->next_msgid, 1);
    pthread_mutex_init(&c->dpmu, NULL);
    const char *path = opts && opts->data_path ? opts->data_path : getenv("MOE_DATA_PATH");
    if (moe_dp_parse_path(path, &c->data_path) != MOE_OK) {
        set_error("data path must be auto, coordinator, socket or shm; got '%s'", path);
        pthread_mutex_init(&c->amu, NULL);
        pthread_cond_init(&c->acv, NULL);
        client_free(c);
        return MOE_EINVAL;
    }
    pthread_mutex_init(&c->amu, NULL);
    pthread_cond_init(&c->acv, NULL);
    if ((rv = nng_req0_open(&c->sock)) != 0) {
        set_error("nng_req0_open: %s", nng_strerror(rv));
        client_free(c);
        return MOE_EINTERNAL;
    }
    /* A training step must never run twice: no automatic resend on a timer.
     * nng still resends a request whose connection dropped before the reply;
     * the "rid" in every request lets the coordinator answer such a
     * duplicate without running it again (docs/PROTOCOL.md). */
    nng_socket_set_ms(c->sock, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
    nng_socket_set_size(c->sock, NNG_OPT_RECVMAXSZ, c->max_msg);
    nng_socket_set_ms(c->sock, NNG_OPT_RECONNMINT, 20);
    nng_socket_set_ms(c->sock, NNG_OPT_RECONNMAXT, 500);
    moe_err e = moe__dial(c, c->sock, url, "the server");
    if (e != MOE_OK) {
        nng_close(c->sock);
        client_free(c);
        return e;
    }
    *out = c;
    return MOE_OK;
}

uint64_t moe_client_id(const moe_client *c)
{
    return c ? c->client_id : 0;
}

uint32_t moe__next_msgid(moe_client *c)
{
    return atomic_fetch_add(&c->next_msgid, 1);
}

const char *moe__auth(const moe_client *c)
{
    return c->auth_token;
}

moe_err moe__set_cluster(moe_client *c, const char *secret)
{
    char *dup = secret && secret[0] ? strdup(secret) : NULL;
    if (secret && secret[0] && !dup)
        return MOE_ENOMEM;
    free(c->cluster);
    c->cluster = dup;
    return MOE_OK;
}

int moe__timeout_ms(const moe_client *c)
{
    return c->timeout_ms;
}

size_t moe__max_msg(const moe_client *c)
{
    return c->max_msg;
}

int moe__data_path(const moe_client *c)
{
    return c->data_path;
}

struct moe_dp *moe__dp(moe_client *c)
{
    pthread_mutex_lock(&c->dpmu);
    if (!c->dp)
        c->dp = moe_dp_new();
    struct moe_dp *dp = c->dp;
    pthread_mutex_unlock(&c->dpmu);
    return dp;
}

void moe__set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
}

static void acall_cancel_all(moe_client *c);

void moe_client_close(moe_client *c)
{
    if (!c)
        return;
    acall_cancel_all(c);
    nng_close(c->sock);
    client_free(c);
}

void moe_reply_free(moe_reply *r)
{
    if (!r)
        return;
    free(r->buf);
    r->buf = NULL;
    r->len = 0;
}

/* build_request encodes [0, msgid, method, [params + rid + auth + cluster]] into an
 * nng_msg. The rid is [client_id, msgid]: unique per call of this client
 * (msgid wraps after 2^32 calls), the same in nng's resends of the message. */
static moe_err build_request(moe_client *c, uint32_t msgid, const char *method, const void *params,
                             size_t params_len, nng_msg **out)
{
    mp_writer w;
    mp_reader r;
    uint32_t npairs = 0;
    mp_errbuf eb;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, msgid, method);
    if (params && params_len) {
        mp_reader_init(&r, params, params_len);
        if (mp_read_map(&r, &npairs, &eb) != MOE_OK) {
            mp_writer_fini(&w);
            set_error("params must be an encoded msgpack map: %s", eb.msg);
            return MOE_EINVAL;
        }
    }
    mp_write_map(&w, npairs + 1 + (c->auth_token ? 1 : 0) + (c->cluster ? 1 : 0));
    mp_write_cstr(&w, "rid");
    mp_write_array(&w, 2);
    mp_write_u64(&w, c->client_id);
    mp_write_u64(&w, msgid);
    if (c->auth_token) {
        mp_write_cstr(&w, "auth");
        mp_write_cstr(&w, c->auth_token);
    }
    if (c->cluster) {
        mp_write_cstr(&w, "cluster");
        mp_write_cstr(&w, c->cluster);
    }
    if (w.failed) {
        mp_writer_fini(&w);
        set_error("out of memory encoding the request");
        return MOE_ENOMEM;
    }
    /* the envelope, then the params pairs straight from the caller's buffer
     * (one copy of a large tensor, not two) */
    size_t body = npairs ? mp_left(&r) : 0;
    nng_msg *m;
    if (nng_msg_alloc(&m, w.len + body) != 0) {
        mp_writer_fini(&w);
        set_error("out of memory for the request message");
        return MOE_ENOMEM;
    }
    memcpy(nng_msg_body(m), w.buf, w.len);
    if (body)
        memcpy((uint8_t *)nng_msg_body(m) + w.len, r.p, body);
    mp_writer_fini(&w);
    *out = m;
    return MOE_OK;
}

/* parse_reply fills out from a received message (consumed). */
static moe_err parse_reply(nng_msg *m, uint32_t msgid, moe_reply *out)
{
    moe_rpc_response resp;
    mp_errbuf eb = {{0}};
    size_t len = nng_msg_len(m);
    out->buf = malloc(len ? len : 1);
    if (!out->buf) {
        nng_msg_free(m);
        snprintf(out->message, sizeof(out->message), "out of memory for the reply");
        return out->err = MOE_ENOMEM;
    }
    memcpy(out->buf, nng_msg_body(m), len);
    out->len = len;
    nng_msg_free(m);
    moe_err e = moe_rpc_parse_response(out->buf, len, &resp, &eb);
    if (e != MOE_OK) {
        snprintf(out->message, sizeof(out->message), "malformed response: %s", eb.msg);
        return out->err = MOE_EPROTO;
    }
    if (resp.msgid != msgid) {
        snprintf(out->message, sizeof(out->message), "response msgid %u for request %u", resp.msgid,
                 msgid);
        return out->err = MOE_EPROTO;
    }
    out->err = resp.err;
    if (resp.err != MOE_OK) {
        snprintf(out->message, sizeof(out->message), "%.*s", (int)resp.errmsg_len, resp.errmsg);
        return resp.err;
    }
    out->result_off = (size_t)(resp.result.p - out->buf);
    return MOE_OK;
}

moe_err moe_call(moe_client *c, const char *method, const void *params, size_t params_len,
                 moe_reply *out)
{
    nng_ctx ctx;
    nng_aio *aio = NULL;
    nng_msg *m = NULL;
    int rv;
    memset(out, 0, sizeof(*out));
    uint32_t msgid = atomic_fetch_add(&c->next_msgid, 1);
    moe_err e = build_request(c, msgid, method, params, params_len, &m);
    if (e != MOE_OK) {
        out->err = e;
        snprintf(out->message, sizeof(out->message), "%s", last_error);
        return e;
    }
    if ((rv = nng_ctx_open(&ctx, c->sock)) != 0) {
        nng_msg_free(m);
        e = moe__from_nng(rv);
        goto fail;
    }
    if ((rv = nng_aio_alloc(&aio, NULL, NULL)) != 0) {
        nng_msg_free(m);
        nng_ctx_close(ctx);
        e = moe__from_nng(rv);
        goto fail;
    }
    nng_aio_set_timeout(aio, c->timeout_ms);
    nng_aio_set_msg(aio, m);
    nng_ctx_send(ctx, aio);
    nng_aio_wait(aio);
    if ((rv = nng_aio_result(aio)) != 0) {
        nng_msg_free(nng_aio_get_msg(aio));
        e = moe__from_nng(rv);
        goto fail_ctx;
    }
    nng_ctx_recv(ctx, aio);
    nng_aio_wait(aio);
    if ((rv = nng_aio_result(aio)) != 0) {
        e = moe__from_nng(rv);
        goto fail_ctx;
    }
    e = parse_reply(nng_aio_get_msg(aio), msgid, out);
    nng_aio_free(aio);
    nng_ctx_close(ctx);
    if (e != MOE_OK)
        set_error("%s: %s: %s", method, moe_err_code(e), out->message);
    return e;
fail_ctx:
    nng_aio_free(aio);
    nng_ctx_close(ctx);
fail:
    out->err = e;
    out->transport = 1;
    snprintf(out->message, sizeof(out->message), "%s: transport: %s", method,
             rv ? nng_strerror(rv) : moe_strerror(e));
    set_error("%s", out->message);
    return e;
}

/* ---- async calls: one state machine per call ---- */

typedef enum { ACALL_SEND, ACALL_RECV } acall_state;

typedef struct acall {
    struct acall *next, *prev; /* c->alist, under c->amu */
    moe_client *c;
    nng_ctx ctx;
    nng_aio *aio;
    acall_state state;
    uint32_t msgid;
    char method[64];
    moe_call_cb cb;
    void *arg;
} acall;

static void acall_finish(acall *a, moe_err e, moe_reply *r)
{
    moe_call_cb cb = a->cb;
    void *arg = a->arg;
    moe_client *c = a->c;
    nng_ctx_close(a->ctx);
    /* off the in-flight list before the aio goes (acall_cancel_all uses it
     * under amu); counted in cb_running until the callback has returned, so
     * that moe_client_close returns only after every callback ran */
    pthread_mutex_lock(&c->amu);
    if (a->prev)
        a->prev->next = a->next;
    else
        c->alist = a->next;
    if (a->next)
        a->next->prev = a->prev;
    c->cb_running++;
    pthread_mutex_unlock(&c->amu);
    /* The aio is freed by a reaper-safe path: nng_aio_free must not run in
     * its own callback, so use nng_aio_reap (nng >= 1.3). */
    nng_aio_reap(a->aio);
    free(a);
    cb(e, r, arg);
    pthread_mutex_lock(&c->amu);
    if (--c->cb_running == 0 && !c->alist)
        pthread_cond_broadcast(&c->acv);
    pthread_mutex_unlock(&c->amu);
}

/* moe_client_close: every async call in flight ends now (its callback gets
 * a transport error) and has ended before the socket closes */
static void acall_cancel_all(moe_client *c)
{
    pthread_mutex_lock(&c->amu);
    c->closing = 1;
    for (acall *a = c->alist; a; a = a->next)
        nng_aio_cancel(a->aio); /* the callback runs on nng's thread, after we unlock */
    while (c->alist || c->cb_running)
        pthread_cond_wait(&c->acv, &c->amu);
    pthread_mutex_unlock(&c->amu);
}

static void acall_cb(void *arg)
{
    acall *a = arg;
    int rv = nng_aio_result(a->aio);
    moe_reply *r = calloc(1, sizeof(*r));
    if (!r) {
        /* cannot even report: still must call back once */
        acall_finish(a, MOE_ENOMEM, NULL);
        return;
    }
    if (rv != 0) {
        if (a->state == ACALL_SEND)
            nng_msg_free(nng_aio_get_msg(a->aio));
        r->err = moe__from_nng(rv);
        r->transport = 1;
        snprintf(r->message, sizeof(r->message), "%s: transport: %s", a->method, nng_strerror(rv));
        acall_finish(a, r->err, r);
        return;
    }
    if (a->state == ACALL_SEND) {
        /* sent; the client closing cancels no receive it has not seen
         * start, so none starts once it closes */
        pthread_mutex_lock(&a->c->amu);
        const int closing = a->c->closing;
        if (!closing) {
            a->state = ACALL_RECV;
            nng_ctx_recv(a->ctx, a->aio);
        }
        pthread_mutex_unlock(&a->c->amu);
        if (!closing) {
            free(r);
            return;
        }
        r->err = MOE_EUNAVAIL;
        r->transport = 1;
        snprintf(r->message, sizeof(r->message), "%s: transport: the client closed", a->method);
        acall_finish(a, r->err, r);
        return;
    }
    moe_err e = parse_reply(nng_aio_get_msg(a->aio), a->msgid, r);
    acall_finish(a, e, r);
}

moe_err moe_call_async(moe_client *c, const char *method, const void *params, size_t params_len,
                       moe_call_cb cb, void *arg)
{
    acall *a = calloc(1, sizeof(*a));
    nng_msg *m = NULL;
    int rv;
    if (!a)
        return MOE_ENOMEM;
    a->c = c;
    a->cb = cb;
    a->arg = arg;
    a->msgid = atomic_fetch_add(&c->next_msgid, 1);
    snprintf(a->method, sizeof(a->method), "%s", method);
    moe_err e = build_request(c, a->msgid, method, params, params_len, &m);
    if (e != MOE_OK) {
        free(a);
        return e;
    }
    if ((rv = nng_ctx_open(&a->ctx, c->sock)) != 0) {
        nng_msg_free(m);
        free(a);
        set_error("nng_ctx_open: %s", nng_strerror(rv));
        return moe__from_nng(rv);
    }
    if ((rv = nng_aio_alloc(&a->aio, acall_cb, a)) != 0) {
        nng_msg_free(m);
        nng_ctx_close(a->ctx);
        free(a);
        return MOE_ENOMEM;
    }
    nng_aio_set_timeout(a->aio, c->timeout_ms);
    a->state = ACALL_SEND;
    nng_aio_set_msg(a->aio, m);
    /* listed and sent under amu: acall_cancel_all cancels every operation
     * it can see, and none starts after it */
    pthread_mutex_lock(&c->amu);
    if (c->closing) {
        pthread_mutex_unlock(&c->amu);
        nng_aio_free(a->aio);
        nng_msg_free(m);
        nng_ctx_close(a->ctx);
        free(a);
        set_error("%s: the client is closing", method);
        return MOE_EUNAVAIL;
    }
    a->next = c->alist;
    if (c->alist)
        c->alist->prev = a;
    c->alist = a;
    nng_ctx_send(a->ctx, a->aio);
    pthread_mutex_unlock(&c->amu);
    return MOE_OK;
}
