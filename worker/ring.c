/*
 * ring.c - the doorbell: data.rows through shared memory, without a socket
 * (docs/PROTOCOL.md, "Data plane", 8). A client on this host lays a small
 * ring inside a region it attached (data.shm_attach) and names it with
 * data.ring_attach; from then on it posts a data.rows request by writing
 * its params into the ring and bumping a counter, and reads the answer from
 * the ring when the worker bumps another. One request at a time per ring.
 *
 * A ring is watched by a thread of its own: it spins on the request counter
 * for --ring-spin-us after each answer (a decode loop posts again within
 * that time and pays no wake-up), then sleeps on it (FUTEX_WAIT on the
 * shared word; the client wakes it when the ring says the worker sleeps).
 * A request becomes a local call of data.rows on the ring's connection
 * (regions and tickets belong to it, as on the socket) and goes through
 * the same handler; the answer - the msgpack-rpc response the socket would
 * have carried - is written into the ring by the call's reply hook.
 *
 * Lifetime: a ring holds a reference on its region. It stops when the
 * region is dropped (detach, or its connection closed); its thread then
 * waits for the answer of a request in progress (every ticket is answered:
 * by its job, its deadline or the connection's close), gives the region
 * back and frees the ring. dp_close waits for every ring thread.
 *
 * Threads: attach on the loop thread; the ring's thread; the reply hook on
 * whichever thread answers (the compute thread, the loop thread, with the
 * table's mu held when a connection closes: it takes only the ring's mu).
 */
#include <errno.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/params.h"
#include "proto/ring_wire.h"
#include "worker/dataplane.h"
#include "worker/lane_trace.h"

struct dp_ring {
    uint64_t id;
    uint32_t pipe;
    dp_table *t;
    dp_region *region; /* a reference held until the ring is freed */
    uint8_t *base;     /* the ring: size bytes inside the region's mapping */
    uint32_t size, req_cap, rep_off, rep_cap;
    atomic_int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int busy;          /* a request's local call is not answered yet (mu) */
    uint32_t seq_done; /* the last request answered */
    struct dp_ring *next;
};

static uint32_t *word(const dp_ring *r, int off)
{
    return (uint32_t *)(r->base + off);
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

/* ring_write puts the answer to request seq (a msgpack-rpc response of
 * len bytes) into the answer area, then the answer counter, wakes a
 * sleeping client, and marks the request done for the ring's thread. */
static void ring_write(dp_ring *r, uint32_t seq, const void *buf, size_t len)
{
    mp_writer w;
    lane_trace(LT_ANSWER);
    mp_writer_init(&w);
    if (len > r->rep_cap) { /* an inline y larger than the ring: say so */
        char text[200];
        snprintf(text, sizeof(text),
                 "the answer (%zu bytes) does not fit the ring's answer area of %u bytes: put y "
                 "in a region, or make the ring larger",
                 len, r->rep_cap);
        moe_rpc_write_response_err(&w, seq, MOE_ENOMEM, text);
        buf = w.buf;
        len = w.len;
    }
    memcpy(r->base + r->rep_off, buf, len);
    mp_writer_fini(&w);
    __atomic_store_n(word(r, RING_REP_LEN), (uint32_t)len, __ATOMIC_RELAXED);
    __atomic_store_n(word(r, RING_REP_SEQ), seq, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(word(r, RING_CLIENT_IDLE), __ATOMIC_SEQ_CST))
        futex(word(r, RING_REP_SEQ), FUTEX_WAKE, 1, NULL);
    lane_trace(LT_DONE);
    pthread_mutex_lock(&r->mu);
    r->busy = 0;
    r->seq_done = seq;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* ring_answered: the reply hook of a ring request's local call */
static void ring_answered(rpc_call *call, const void *buf, size_t len, void *arg)
{
    ring_write(arg, call->req.msgid, buf, len);
}

/* wait_request: the next request's counter (!= seq_done), or 0 once the
 * ring stops. Spins spin_us first, then sleeps on the shared word. */
static int wait_request(dp_ring *r, uint32_t *seq)
{
    uint32_t *req = word(r, RING_REQ_SEQ), *idle = word(r, RING_WORKER_IDLE);
    uint64_t spin_until = rpc_now_ns() + (uint64_t)r->t->ring_spin_us * 1000ull;
    for (;;) {
        if (atomic_load(&r->stop))
            return 0;
        uint32_t s = __atomic_load_n(req, __ATOMIC_ACQUIRE);
        if (s != r->seq_done) {
            *seq = s;
            return 1;
        }
        if (rpc_now_ns() < spin_until)
            continue;
        /* sleep: say so first, then look again (the client reads idle after
         * it wrote its counter: one of the two sees the other) */
        __atomic_store_n(idle, 1u, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(req, __ATOMIC_SEQ_CST) == r->seq_done && !atomic_load(&r->stop)) {
            struct timespec ts = {0, 50 * 1000000}; /* a stop is seen within 50 ms */
            futex(req, FUTEX_WAIT, r->seq_done, &ts);
        }
        __atomic_store_n(idle, 0u, __ATOMIC_SEQ_CST);
        spin_until = rpc_now_ns() + (uint64_t)r->t->ring_spin_us * 1000ull;
    }
}

/* answer_error: the answer to a request that never became a call */
static void answer_error(dp_ring *r, uint32_t seq, moe_err e, const char *text)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_err(&w, seq, e, text);
    ring_write(r, seq, w.buf, w.len);
    mp_writer_fini(&w);
}

static void *ring_main(void *arg)
{
    dp_ring *r = arg;
    dp_table *t = r->t;
    uint32_t seq;
    while (wait_request(r, &seq)) {
        lane_trace(LT_SEEN);
        uint32_t len = __atomic_load_n(word(r, RING_REQ_LEN), __ATOMIC_ACQUIRE);
        if (len == 0 || len > r->req_cap) {
            char text[160];
            snprintf(text, sizeof(text), "ring request of %u bytes: the request area holds 1 .. %u",
                     len, r->req_cap);
            answer_error(r, seq, MOE_EPROTO, text);
            continue;
        }
        /* the params are copied out before they are read: the client's
         * later writes cannot change a request under the parser */
        rpc_call *c = rpc_call_local("data.rows", r->base + RING_HEAD, len, ring_answered, r);
        if (!c) {
            answer_error(r, seq, MOE_EPROTO,
                         "a ring request must be a msgpack map (the params "
                         "of data.rows)");
            continue;
        }
        c->req.msgid = seq;
        rpc_call_set_pipe(c, r->pipe);
        pthread_mutex_lock(&r->mu);
        r->busy = 1;
        pthread_mutex_unlock(&r->mu);
        dp_rows_call(t, c);
        /* one request at a time: its answer before the next is read */
        pthread_mutex_lock(&r->mu);
        while (r->busy)
            pthread_cond_wait(&r->cv, &r->mu);
        pthread_mutex_unlock(&r->mu);
    }
    /* stopped: a request in progress was answered above (the loop waits
     * for it), so nothing writes into the ring after this */
    pthread_mutex_lock(&t->mu);
    for (dp_ring **pp = &t->rings; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    t->nrings--;
    dp_region_release_locked(t, r->region);
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    LOG_D("data plane: ring %llu stopped", (unsigned long long)r->id);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
    return NULL;
}

void dp_rings_stop_region(dp_table *t, dp_region *g)
{
    for (dp_ring *r = t->rings; r; r = r->next)
        if (r->region == g && !atomic_exchange(&r->stop, 1))
            futex(word(r, RING_REQ_SEQ), FUTEX_WAKE, 1, NULL);
}

void dp_rings_wait(dp_table *t, int timeout_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&t->mu);
    while (t->nrings > 0 && pthread_cond_timedwait(&t->cv, &t->mu, &ts) != ETIMEDOUT)
        ;
    if (t->nrings > 0)
        LOG_W("data plane: %d ring threads did not stop in %d ms", t->nrings, timeout_ms);
    pthread_mutex_unlock(&t->mu);
}

int dp_rings_active(dp_table *t)
{
    return __atomic_load_n(&t->nrings, __ATOMIC_RELAXED) > 0;
}

/* data.ring_attach {region, offset, size}: watch the ring laid at
 * [offset, offset + size) of a shared-memory region of this connection. */
void dp_on_ring_attach(dp_table *t, rpc_call *c)
{
    char err[256];
    int64_t region = 0, off = 0, size = 0;
    pspec sp[] = {
        {"region", P_INT, &region, true, 1, 9e18, 0, false},
        {"offset", P_INT, &off, true, 0, 9e18, 0, false},
        {"size", P_INT, &size, true, RING_MIN, RING_MAX, 0, false},
    };
    mp_reader rd = c->req.params;
    moe_err e = params_parse(&rd, c->req.nparams, sp, 3, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    if (off % 64 || size % 64) {
        rpc_reply_err(c, MOE_EINVAL,
                      "a ring's offset and size must be multiples of 64 (got %lld, "
                      "%lld)",
                      (long long)off, (long long)size);
        return;
    }
    dp_ring *r = calloc(1, sizeof(*r));
    if (!r) {
        rpc_reply_err(c, MOE_ENOMEM, "out of memory");
        return;
    }
    uint32_t pipe = rpc_call_pipe(c);
    pthread_mutex_lock(&t->mu);
    uint8_t *base = NULL;
    size_t rsize = 0;
    int cuda = 0;
    dp_region *g = dp_region_find_locked(t, pipe, (uint64_t)region, &base, &rsize, &cuda);
    if (!g || cuda) {
        pthread_mutex_unlock(&t->mu);
        free(r);
        rpc_reply_err(c, !g ? MOE_ENOTFOUND : MOE_EINVAL,
                      !g ? "region %lld is not attached on this connection"
                         : "region %lld is GPU memory: a ring lives in shared host memory",
                      (long long)region);
        return;
    }
    if ((uint64_t)off > rsize || (uint64_t)size > rsize - (uint64_t)off) {
        pthread_mutex_unlock(&t->mu);
        free(r);
        rpc_reply_err(c, MOE_EINVAL, "ring [%lld, +%lld) outside region %lld of %zu bytes",
                      (long long)off, (long long)size, (long long)region, rsize);
        return;
    }
    if (t->nrings >= DP_MAX_RINGS) {
        pthread_mutex_unlock(&t->mu);
        free(r);
        rpc_reply_err(c, MOE_ENOMEM, "%d rings already run on this worker (the most)",
                      DP_MAX_RINGS);
        return;
    }
    r->t = t;
    r->pipe = pipe;
    r->region = g;
    r->base = base + off;
    r->size = (uint32_t)size;
    r->req_cap = ring_req_cap(r->size);
    r->rep_off = RING_HEAD + r->req_cap;
    r->rep_cap = r->size - r->rep_off;
    r->id = ++t->next_ring;
    r->seq_done = __atomic_load_n(word(r, RING_REQ_SEQ), __ATOMIC_ACQUIRE);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    dp_region_hold_locked(g);
    r->next = t->rings;
    t->rings = r;
    t->nrings++;
    if (pthread_create(&th, &at, ring_main, r) != 0) {
        t->rings = r->next;
        t->nrings--;
        dp_region_release_locked(t, g);
        pthread_mutex_unlock(&t->mu);
        pthread_attr_destroy(&at);
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv);
        free(r);
        rpc_reply_err(c, MOE_ENOMEM, "cannot start the ring's thread");
        return;
    }
    uint64_t id = r->id; /* r may be gone as soon as mu is released */
    pthread_mutex_unlock(&t->mu);
    pthread_attr_destroy(&at);
    LOG_D("data plane: ring %llu in region %lld [%lld, +%lld) on connection %u",
          (unsigned long long)id, (long long)region, (long long)off, (long long)size, pipe);
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, c->req.msgid);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "ring");
    mp_write_u64(&w, id);
    rpc_reply(c, &w);
}
