/* client_dp.c - libmoe's side of the data plane; see client_dp.h. */
#include "client/client_dp.h"
#include "client/client_bulk.h"
#include "client/client_nccl.h"
#include "client/fanout.h"
#include "client/client_ring.h"
#include "proto/ring_wire.h"
#include "common/hostid.h"
#include "common/nccl_pieces.h"
#include "common/parcopy.h"
#include "common/placement.h"
#include "common/step_trace.h"

#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DP_MAX_W    256
#define DP_MAX_SHM  8
#define DP_MAX_UBUF 64
#define DP_MAX_RING 4 /* rings to each worker: calls in flight through shared memory */
#define DP_MIN_SHM  ((size_t)1 << 20)
/* auto path: a rank's rows of at least this many bytes go to a worker on
 * another host over its bulk endpoint */
#define DP_MIN_BULK ((size_t)1 << 20)
/* inference forwards of at most this many rows fan out to every worker of
 * a cluster of CPU workers ($MOE_FANOUT_ROWS overrides) */
#define DP_FANOUT_ROWS 16
/* ... and of a cluster of GPU workers: on 2 H200 workers the fan-out beat
 * the ordered road at T=64 too (Qwen3 1.10 against 1.15 ms, Mixtral 1.31
 * against 1.44; bench/history/service.md "Session 31") */
#define DP_FANOUT_ROWS_GPU 64
/* a new map waits this long at most for its connections to the workers */
#define DP_CONNECT_WAIT_US 200000
/* a rank's bulk rows are split over several connections (each a thread on
 * both sides: one loopback TCP stream moves 2-4 GB/s on one core), one per
 * DP_BULK_PART_MIN bytes, at most DP_BULK_STREAMS ($MOE_BULK_STREAMS) */
#define DP_BULK_PART_MIN ((size_t)8 << 20)
#define DP_BULK_STREAMS  4
/* after the coordinator refused or failed a job: how long a worker may take
 * to answer the rows' cancel before the client stops waiting for it */
#define DP_GRACE_MS 2000

/* dp_shm: one shared-memory buffer, attached to every worker of its map;
 * a call uses [0, n) for its input rows and [n, 2n) for its output rows. */
typedef struct dp_shm {
    uint8_t *base; /* owned mapping */
    size_t size;
    int busy;         /* a call uses it (under dp->mu) */
    uint64_t *region; /* (W) its region id at each worker */
} dp_shm;

/* dp_map: the workers of one cluster generation, and connections to them.
 * Reference counted: calls hold it while they run; a refresh replaces it. */
typedef struct dp_map {
    int refs; /* under dp->mu */
    int stale;
    uint64_t gen;
    int W;
    int shm;             /* shared memory usable with every worker */
    int lane;            /* one worker that runs inference forwards itself (the lane) */
    int fanout;          /* several workers (one backend) that each run small inference forwards */
    int gpu;             /* every worker's backend is "cuda" */
    nng_socket *sock;    /* (W) req0 sockets, one per worker */
    moe_bulk_pool *bulk; /* (W) bulk connections per worker (url "" = it offers none) */
    int *remote;         /* (W) the worker is on another host */
    int *up;             /* (W) live connections of each socket (atomic, nng threads) */
    int *has_nccl;       /* (W) the worker offers data.nccl_open (dataplane.info nccl) */
    moe_nccl_link *nccl; /* (W) communicators with the workers (client_nccl.h) */
    dp_shm bufs[DP_MAX_SHM];
    int nbufs;
    uint64_t *uregion; /* (DP_MAX_UBUF, W) region id of user buffer i at worker q; 0 = none */
    moe_ring *rings;   /* (W, DP_MAX_RING) to each worker (client_ring.h): the lane's, fan-out's */
    int *nrings;       /* (W) made */
    int *no_ring;      /* (W) 0, or the smallest ring size (bytes) that could not be made
                        * (an older worker, /dev/shm full): none that large is tried again */
    /* fan-out answers seen, by (model, layer): their top_k and row size, so
     * that later calls know whether the largest answer fits a ring */
    struct {
        uint8_t key[160];
        size_t klen;
        int top_k;
        size_t es;
    } fo_seen[8];
    int nfo_seen;
} dp_map;

/* dp_ubuf: a buffer the application allocated with moe_buffer_alloc: rows
 * in it travel with no copy (its segment keeps its name until freed, so the
 * workers of a later map can attach it too). */
typedef struct dp_ubuf {
    uint8_t *base; /* owned, except for cuda: the application's device memory */
    size_t size;
    int shm;  /* 1: a shared segment (name below); 0: plain memory */
    int cuda; /* 1: a GPU allocation registered by moe_cuda_register (handle below) */
    char name[96];
    uint8_t handle[64]; /* cudaIpcMemHandle_t */
} dp_ubuf;

struct moe_dp {
    pthread_mutex_t mu;
    pthread_mutex_t att_mu; /* serialises attaching user buffers */
    dp_map *map;
    dp_ubuf ubuf[DP_MAX_UBUF]; /* under mu */
    int no_dp;                 /* the coordinator has no data plane: use the coordinator path */
    char host[128];            /* this host's boot id */
    unsigned next_shm;
};

moe_err moe_dp_parse_path(const char *s, int *out)
{
    if (!s || !*s || strcmp(s, "auto") == 0)
        *out = MOE_PATH_AUTO;
    else if (strcmp(s, "coordinator") == 0)
        *out = MOE_PATH_COORD;
    else if (strcmp(s, "socket") == 0)
        *out = MOE_PATH_SOCKET;
    else if (strcmp(s, "shm") == 0)
        *out = MOE_PATH_SHM;
    else if (strcmp(s, "bulk") == 0)
        *out = MOE_PATH_BULK;
    else if (strcmp(s, "nccl") == 0)
        *out = MOE_PATH_NCCL;
    else
        return MOE_EINVAL;
    return MOE_OK;
}

/* sweep_dead_segments unlinks /dev/shm/moe-<pid>-* of processes that are
 * gone: a client killed between creating a segment and unlinking it (the
 * workers attach by name) leaves nothing behind for long. */
static void sweep_dead_segments(void)
{
    DIR *d = opendir("/dev/shm");
    struct dirent *de;
    if (!d)
        return;
    while ((de = readdir(d))) {
        long pid;
        char name[300];
        if (strncmp(de->d_name, "moe-", 4) != 0 || sscanf(de->d_name + 4, "%ld-", &pid) != 1 ||
            pid <= 0)
            continue;
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) {
            snprintf(name, sizeof(name), "/%s", de->d_name);
            shm_unlink(name);
        }
    }
    closedir(d);
}

struct moe_dp *moe_dp_new(void)
{
    struct moe_dp *dp = calloc(1, sizeof(*dp));
    if (!dp)
        return NULL;
    pthread_mutex_init(&dp->mu, NULL);
    pthread_mutex_init(&dp->att_mu, NULL);
    moe_host_id(dp->host, sizeof(dp->host));
    sweep_dead_segments();
    return dp;
}

static void shm_free(dp_shm *b)
{
    if (b->base)
        munmap(b->base, b->size);
    free(b->region);
    memset(b, 0, sizeof(*b));
}

/* map_free closes the connections (the workers drop the regions of a
 * closed connection) and unmaps the buffers. */
static void map_free(dp_map *m)
{
    if (!m)
        return;
    for (int r = 0; m->nccl && r < m->W; r++) /* before the sockets: its worker aborts too */
        moe_nccl_link_fini(&m->nccl[r]);
    free(m->nccl);
    free(m->has_nccl);
    for (int r = 0; m->sock && r < m->W; r++)
        nng_close(m->sock[r]);
    for (int r = 0; m->bulk && r < m->W; r++)
        moe_bulk_pool_fini(&m->bulk[r]);
    for (int i = 0; i < m->nbufs; i++)
        shm_free(&m->bufs[i]);
    for (int q = 0; m->rings && q < m->W; q++)
        for (int i = 0; i < m->nrings[q]; i++)
            moe_ring_unmap(&m->rings[(size_t)q * DP_MAX_RING + i]);
    free(m->rings);
    free(m->nrings);
    free(m->no_ring);
    free(m->bulk);
    free(m->remote);
    free(m->sock);
    free(m->up);
    free(m->uregion);
    free(m);
}

static void ubuf_release(dp_ubuf *u)
{
    if (u->cuda) { /* the application's memory: only forgotten */
        memset(u, 0, sizeof(*u));
        return;
    }
    if (u->shm) {
        munmap(u->base, u->size);
        shm_unlink(u->name);
    } else {
        free(u->base);
    }
    memset(u, 0, sizeof(*u));
}

void moe_dp_free(struct moe_dp *dp)
{
    if (!dp)
        return;
    map_free(dp->map);
    for (int i = 0; i < DP_MAX_UBUF; i++)
        if (dp->ubuf[i].base)
            ubuf_release(&dp->ubuf[i]);
    pthread_mutex_destroy(&dp->att_mu);
    pthread_mutex_destroy(&dp->mu);
    free(dp);
}

static void map_put(struct moe_dp *dp, dp_map *m)
{
    pthread_mutex_lock(&dp->mu);
    int last = --m->refs == 0;
    pthread_mutex_unlock(&dp->mu);
    if (last)
        map_free(m);
}

/* ---- one request on a worker connection ---- */

/* dp_req: an in-flight request on one worker's socket. */
typedef struct dp_req {
    nng_ctx ctx;
    nng_aio *aio;
    int open, sent;
    int recv_posted; /* the receive of the answer was posted already (dp_nccl; atomic) */
    int ndone;       /* operations of aio completed (its callback; atomic) */
    int chain;       /* req_start_chained: the callback posts the receive */
    int timed_out;   /* the answer did not come in the time given */
    uint32_t msgid;
    nng_msg *reply; /* owned once received */
    /* or through a shared-memory ring (client_ring.h): no socket */
    moe_ring *ring;    /* held (busy) until req_close */
    int ring_answered; /* its answer came (read in place in the ring) */
    const int *up;     /* the worker connection's live pipes */
    int timeout_ms;
} dp_req;

/* bulk_started: rank q's rows went on its bulk connection (bx: NULL
 * where none did) */
static inline int bulk_started(const moe_bulk_xfer *bx, int q)
{
    return bx && bx[q].started;
}

/* req_done: aio's callback counts its completed operations (send, then
 * the answer's receive). A chained request's receive is posted here, the
 * moment its send is done: the caller is not woken in between, and its
 * nng_aio_wait covers both operations (the aio stays busy from the
 * callback's nng_ctx_recv on). So the answers of several workers complete
 * on nng's threads side by side, each waiting to be read, instead of the
 * caller posting each receive in turn and being woken once more for each. */
static void req_done(void *arg)
{
    dp_req *q = arg;
    /* one aio's callbacks run one at a time: ndone is written here alone;
     * recv_posted is stored before ndone counts the send, so that a reader
     * who sees the send counted also sees whether a receive follows */
    const int chain = __atomic_load_n(&q->ndone, __ATOMIC_RELAXED) == 0 && q->chain &&
                      nng_aio_result(q->aio) == 0;
    if (chain)
        __atomic_store_n(&q->recv_posted, 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&q->ndone, 1, __ATOMIC_ACQ_REL);
    if (chain)
        nng_ctx_recv(q->ctx, q->aio);
}

/* req_idle: every operation of q's aio is complete (the send, and the
 * receive when the send's callback posted one) */
static int req_idle(const dp_req *q)
{
    const int n = __atomic_load_n(&q->ndone, __ATOMIC_ACQUIRE);
    return n >= 1 + __atomic_load_n(&q->recv_posted, __ATOMIC_ACQUIRE);
}

static moe_err req_begin(dp_req *q, nng_socket sock, nng_msg *m, int timeout_ms, int chain)
{
    int rv;
    memset(q, 0, sizeof(*q));
    if ((rv = nng_ctx_open(&q->ctx, sock)) != 0) {
        nng_msg_free(m);
        return moe__from_nng(rv);
    }
    if ((rv = nng_aio_alloc(&q->aio, req_done, q)) != 0) {
        nng_ctx_close(q->ctx);
        nng_msg_free(m);
        return moe__from_nng(rv);
    }
    q->open = 1;
    q->chain = chain;
    nng_aio_set_timeout(q->aio, timeout_ms);
    nng_aio_set_msg(q->aio, m);
    nng_ctx_send(q->ctx, q->aio);
    q->sent = 1;
    return MOE_OK;
}

/* req_start sends m (owned from here) on sock; the reply is awaited by
 * req_finish. */
static moe_err req_start(dp_req *q, nng_socket sock, nng_msg *m, int timeout_ms)
{
    return req_begin(q, sock, m, timeout_ms, 0);
}

/* req_start_chained: req_start whose answer's receive is posted by the
 * send's callback (req_done), for requests to several workers awaited in
 * turn */
static moe_err req_start_chained(dp_req *q, nng_socket sock, nng_msg *m, int timeout_ms)
{
    return req_begin(q, sock, m, timeout_ms, 1);
}

/* parse_answer parses a worker's answer (len bytes at buf) into resp. */
static moe_err parse_answer(const dp_req *q, const void *buf, size_t len, moe_rpc_response *resp,
                            char *msg, size_t msglen)
{
    mp_errbuf eb = {{0}};
    if (moe_rpc_parse_response(buf, len, resp, &eb) != MOE_OK) {
        snprintf(msg, msglen, "malformed answer from a worker: %s", eb.msg);
        return MOE_EPROTO;
    }
    if (resp->msgid != q->msgid) {
        snprintf(msg, msglen, "answer msgid %u for request %u", resp->msgid, q->msgid);
        return MOE_EPROTO;
    }
    if (resp->err != MOE_OK) {
        snprintf(msg, msglen, "%.*s", (int)resp->errmsg_len, resp->errmsg);
        return resp->err;
    }
    return MOE_OK;
}

/* ring_finish: req_finish for a request posted on a ring */
static moe_err ring_finish(dp_req *q, int abort, int recv_timeout_ms, moe_rpc_response *resp,
                           char *msg, size_t msglen)
{
    const uint8_t *a;
    size_t n;
    if (abort) {
        q->ring->dead = 1; /* the worker may answer into it later */
        snprintf(msg, msglen, "the worker's connection is down");
        return MOE_EUNAVAIL;
    }
    moe_err e = moe_ring_wait(q->ring, recv_timeout_ms > 0 ? recv_timeout_ms : q->timeout_ms, q->up,
                              &a, &n);
    if (e != MOE_OK) {
        q->timed_out = e == MOE_ETIMEDOUT;
        snprintf(msg, msglen, "waiting for a worker's rows on a shared-memory ring: %s",
                 e == MOE_ETIMEDOUT  ? "no answer in time"
                 : e == MOE_EUNAVAIL ? "the worker's connection is down"
                                     : "a malformed answer");
        return e;
    }
    /* read in place: the ring stays held (busy) until req_close, and the
     * worker writes into it again only after the next post */
    q->ring_answered = 1;
    return parse_answer(q, a, n, resp, msg, msglen);
}

/* req_finish waits for the reply (q->reply) and parses its envelope into
 * resp. Returns the transport's or the server's error (message in msg). */
static moe_err req_finish(dp_req *q, int abort, int recv_timeout_ms, moe_rpc_response *resp,
                          char *msg, size_t msglen)
{
    int rv;
    if (!q->open)
        return MOE_EINTERNAL;
    if (q->ring)
        return ring_finish(q, abort, recv_timeout_ms, resp, msg, msglen);
    int grace_over = 0;
    if (abort && q->chain) {
        nng_aio_stop(q->aio); /* also a receive its callback may be posting now */
    } else if (abort) {
        nng_aio_cancel(q->aio);
    } else if (q->chain && recv_timeout_ms > 0) {
        /* the answer of a call that failed elsewhere: given recv_timeout_ms
         * more (the receive was posted with the call's whole timeout), then
         * given up on as timed out (a failure path: 1 ms polls) */
        for (int ms = 0; !req_idle(q) && ms < recv_timeout_ms; ms++)
            usleep(1000);
        if (!req_idle(q)) {
            nng_aio_cancel(q->aio);
            grace_over = 1;
        }
    }
    nng_aio_wait(q->aio);
    const int recv_posted = __atomic_load_n(&q->recv_posted, __ATOMIC_ACQUIRE);
    if (recv_posted && (rv = nng_aio_result(q->aio)) == 0 && !abort)
        goto received; /* the answer is here already */
    if (recv_posted) {
        if (grace_over && rv == NNG_ECANCELED)
            rv = NNG_ETIMEDOUT;
        snprintf(msg, msglen, "waiting for a worker's rows: %s",
                 abort ? "the worker's connection is down" : nng_strerror(rv));
        q->timed_out = !abort && rv == NNG_ETIMEDOUT;
        return abort ? MOE_EUNAVAIL : moe__from_nng(rv);
    }
    if ((rv = nng_aio_result(q->aio)) != 0) {
        nng_msg_free(nng_aio_get_msg(q->aio));
        snprintf(msg, msglen, "sending rows to a worker: %s", nng_strerror(rv));
        return moe__from_nng(rv);
    }
    if (abort) {
        snprintf(msg, msglen, "the worker's connection is down");
        return MOE_EUNAVAIL;
    }
    if (recv_timeout_ms > 0)
        nng_aio_set_timeout(q->aio, recv_timeout_ms);
    nng_ctx_recv(q->ctx, q->aio);
    nng_aio_wait(q->aio);
    if ((rv = nng_aio_result(q->aio)) != 0) {
        snprintf(msg, msglen, "waiting for a worker's rows: %s", nng_strerror(rv));
        q->timed_out = rv == NNG_ETIMEDOUT;
        return moe__from_nng(rv);
    }
received:
    q->reply = nng_aio_get_msg(q->aio);
    return parse_answer(q, nng_msg_body(q->reply), nng_msg_len(q->reply), resp, msg, msglen);
}

/* req_on_ring: q awaits the answer of the request just posted on ring
 * (to the worker whose live pipes are *up) */
static void req_on_ring(dp_req *q, moe_ring *ring, const int *up, int timeout_ms)
{
    q->ring = ring;
    q->open = 1;
    q->msgid = ring->seq; /* the answer's msgid */
    q->up = up;
    q->timeout_ms = timeout_ms;
}

/* resp_was_answer: the worker answered (an error of its own), as opposed to
 * a transport failure */
static int resp_was_answer(const dp_req *q)
{
    return q->reply != NULL || q->ring_answered;
}

static void req_close(dp_req *q)
{
    if (q->reply)
        nng_msg_free(q->reply);
    if (q->ring) {
        __atomic_store_n(&q->ring->busy, 0, __ATOMIC_RELEASE);
    } else if (q->open) {
        nng_aio_free(q->aio);
        nng_ctx_close(q->ctx);
    }
    memset(q, 0, sizeof(*q));
}

/* msg_from_writer copies w (a complete request) plus `extra` bytes into a
 * new message: the rows go from the caller's memory into the message once. */
static moe_err msg_from_writer(const mp_writer *w, const void *extra, size_t extra_len,
                               nng_msg **out)
{
    nng_msg *m;
    if (w->failed || nng_msg_alloc(&m, w->len + extra_len) != 0)
        return MOE_ENOMEM;
    memcpy(nng_msg_body(m), w->buf, w->len);
    if (extra_len)
        par_memcpy((uint8_t *)nng_msg_body(m) + w->len, extra, extra_len);
    *out = m;
    return MOE_OK;
}

/* requests waiting on a worker's socket (fan-outs, attaches): a request
 * that nng had no connection to send on when the worker died would wait
 * for one until the call's timeout; when the worker's last connection goes
 * (on_pipe), they are cancelled - unavailable at once, as the ordered
 * road's coordinator says */
#define DP_WATCH_MAX 256
static struct {
    pthread_mutex_t mu;
    const int *up[DP_WATCH_MAX]; /* the worker's live-pipe count */
    nng_aio *aio[DP_WATCH_MAX];
} g_watch = {PTHREAD_MUTEX_INITIALIZER, {0}, {0}};

/* watch_add: aio waits on the worker whose pipes *up counts; -1 when the
 * table is full (then it is not cancelled early) */
static int watch_add(const int *up, nng_aio *aio)
{
    int slot = -1;
    pthread_mutex_lock(&g_watch.mu);
    for (int i = 0; i < DP_WATCH_MAX && slot < 0; i++)
        if (!g_watch.aio[i]) {
            g_watch.up[i] = up;
            g_watch.aio[i] = aio;
            slot = i;
        }
    pthread_mutex_unlock(&g_watch.mu);
    if (slot >= 0 && __atomic_load_n(up, __ATOMIC_RELAXED) <= 0)
        nng_aio_cancel(aio); /* it went before we were watching */
    return slot;
}

static void watch_del(int slot)
{
    if (slot < 0)
        return;
    pthread_mutex_lock(&g_watch.mu);
    g_watch.aio[slot] = NULL;
    g_watch.up[slot] = NULL;
    pthread_mutex_unlock(&g_watch.mu);
}

/* sync_call: method {params pairs} on one worker, waiting for the answer;
 * the result reader is valid until req_close. */
static moe_err sync_call_t(moe_client *c, nng_socket sock, const int *up, const char *method,
                           const mp_writer *pairs, uint32_t npairs, int timeout_ms, dp_req *q,
                           moe_rpc_response *resp, char *msg, size_t msglen)
{
    mp_writer w;
    nng_msg *m;
    uint32_t msgid = moe__next_msgid(c);
    const char *auth = moe__auth(c);
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, msgid, method);
    mp_write_map(&w, npairs + (auth ? 1 : 0));
    if (auth) {
        mp_write_cstr(&w, "auth");
        mp_write_cstr(&w, auth);
    }
    moe_err e = msg_from_writer(&w, pairs->buf, pairs->len, &m);
    mp_writer_fini(&w);
    if (e != MOE_OK)
        return e;
    e = req_start(q, sock, m, timeout_ms);
    q->msgid = msgid;
    if (e == MOE_OK) {
        int slot = up ? watch_add(up, q->aio) : -1;
        e = req_finish(q, 0, timeout_ms, resp, msg, msglen);
        watch_del(slot);
        if (e != MOE_OK && up && !resp_was_answer(q) &&
            __atomic_load_n(up, __ATOMIC_RELAXED) <= 0) {
            e = MOE_EUNAVAIL;
            snprintf(msg, msglen, "the worker's connection is down");
        }
    }
    return e;
}

static moe_err sync_call(moe_client *c, nng_socket sock, const int *up, const char *method,
                         const mp_writer *pairs, uint32_t npairs, dp_req *q, moe_rpc_response *resp,
                         char *msg, size_t msglen)
{
    return sync_call_t(c, sock, up, method, pairs, npairs, moe__timeout_ms(c), q, resp, msg,
                       msglen);
}

/* ---- the worker map ---- */

static moe_err read_str_key(mp_reader *r, const char *key, char *out, size_t len)
{
    uint32_t n;
    if (mp_read_map(r, &n, NULL) != MOE_OK)
        return MOE_EPROTO;
    out[0] = 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *k, *v;
        uint32_t kl, vl;
        if (mp_read_str(r, &k, &kl, NULL) != MOE_OK)
            return MOE_EPROTO;
        if (mp_str_eq(k, kl, key) && mp_peek(r) == MP_STR) {
            if (mp_read_str(r, &v, &vl, NULL) != MOE_OK || vl >= len)
                return MOE_EPROTO;
            memcpy(out, v, vl);
            out[vl] = 0;
        } else if (mp_skip(r, NULL) != MOE_OK) {
            return MOE_EPROTO;
        }
    }
    return MOE_OK;
}

/* read_bool_key: the map's bool value of key (0 when absent or not a bool). */
static int read_bool_key(mp_reader *r, const char *key)
{
    uint32_t n;
    bool v = false;
    if (mp_read_map(r, &n, NULL) != MOE_OK)
        return 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(r, &k, &kl, NULL) != MOE_OK)
            return 0;
        if (mp_str_eq(k, kl, key) && mp_peek(r) == MP_BOOL)
            return mp_read_bool(r, &v, NULL) == MOE_OK && v;
        if (mp_skip(r, NULL) != MOE_OK)
            return 0;
    }
    return 0;
}

/* on_pipe counts a socket's live connections (nng thread). */
static void on_pipe(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    (void)p;
    int now = __atomic_add_fetch((int *)arg, ev == NNG_PIPE_EV_ADD_POST ? 1 : -1, __ATOMIC_RELAXED);
    if (ev == NNG_PIPE_EV_REM_POST && now <= 0) {
        pthread_mutex_lock(&g_watch.mu);
        for (int i = 0; i < DP_WATCH_MAX; i++)
            if (g_watch.aio[i] && g_watch.up[i] == (const int *)arg)
                nng_aio_cancel(g_watch.aio[i]);
        pthread_mutex_unlock(&g_watch.mu);
    }
}

/* map_load asks the coordinator for the worker map and dials the workers.
 * MOE_ENOMETHOD: no data plane here; MOE_EUNAVAIL: not ready. */
static moe_err map_load(moe_client *c, struct moe_dp *dp, dp_map **out)
{
    moe_reply r;
    moe_err e = moe_call(c, "dataplane.info", NULL, 0, &r);
    if (e != MOE_OK) {
        /* no answer at all: the caller's error; any answer but the map (an
         * older coordinator, an error): the coordinator path */
        int transport = r.transport;
        moe_reply_free(&r);
        return transport ? e : MOE_ENOMETHOD;
    }
    mp_reader rd, rw;
    uint32_t n, W = 0;
    int64_t gen = -1;
    bool ready = false, direct = false, lane = false, fanout = false;
    int have_workers = 0;
    mp_reader_init(&rd, r.buf + r.result_off, r.len - r.result_off);
    e = mp_read_map(&rd, &n, NULL);
    for (uint32_t i = 0; e == MOE_OK && i < n; i++) {
        const char *k;
        uint32_t kl;
        if ((e = mp_read_str(&rd, &k, &kl, NULL)) != MOE_OK)
            break;
        if (mp_str_eq(k, kl, "generation"))
            e = mp_read_i64(&rd, &gen, NULL);
        else if (mp_str_eq(k, kl, "ready"))
            e = mp_read_bool(&rd, &ready, NULL);
        else if (mp_str_eq(k, kl, "direct"))
            e = mp_read_bool(&rd, &direct, NULL);
        else if (mp_str_eq(k, kl, "lane"))
            e = mp_read_bool(&rd, &lane, NULL);
        else if (mp_str_eq(k, kl, "fanout"))
            e = mp_read_bool(&rd, &fanout, NULL);
        else if (mp_str_eq(k, kl, "workers")) {
            rw = rd;
            have_workers = 1;
            e = mp_read_array(&rd, &W, NULL) == MOE_OK ? MOE_OK : MOE_EPROTO;
            rd = rw;
            if (e == MOE_OK)
                e = mp_skip(&rd, NULL);
        } else
            e = mp_skip(&rd, NULL);
    }
    if (e != MOE_OK || gen < 0 || !have_workers || W > DP_MAX_W) {
        moe_reply_free(&r);
        return MOE_ENOMETHOD; /* not a map this client understands */
    }
    if (!ready || W == 0) {
        moe_reply_free(&r);
        return MOE_EUNAVAIL;
    }
    if (!direct) {
        moe_reply_free(&r);
        return MOE_ENOMETHOD;
    }
    dp_map *m = calloc(1, sizeof(*m));
    if (!m || !(m->sock = calloc(W, sizeof(nng_socket))) || !(m->up = calloc(W, sizeof(int))) ||
        !(m->uregion = calloc((size_t)DP_MAX_UBUF * W, sizeof(uint64_t))) ||
        !(m->bulk = calloc(W ? W : 1, sizeof(moe_bulk_pool))) ||
        !(m->remote = calloc(W ? W : 1, sizeof(int))) ||
        !(m->rings = calloc((size_t)W * DP_MAX_RING, sizeof(moe_ring))) ||
        !(m->nrings = calloc(W, sizeof(int))) || !(m->no_ring = calloc(W, sizeof(int))) ||
        !(m->has_nccl = calloc(W ? W : 1, sizeof(int))) ||
        !(m->nccl = calloc(W ? W : 1, sizeof(moe_nccl_link)))) {
        if (m) {
            free(m->has_nccl);
            free(m->nccl);
            free(m->sock);
            free(m->up);
            free(m->uregion);
            free(m->bulk);
            free(m->remote);
            free(m->rings);
            free(m->nrings);
            free(m->no_ring);
        }
        free(m);
        moe_reply_free(&r);
        return MOE_ENOMEM;
    }
    m->refs = 1;
    m->gen = (uint64_t)gen;
    m->lane = lane && W == 1;
    m->fanout = fanout && W > 1;
    m->gpu = 1; /* until a worker of another backend */
    m->shm = moe__data_path(c) != MOE_PATH_SOCKET && moe__data_path(c) != MOE_PATH_BULK &&
             moe__data_path(c) != MOE_PATH_NCCL;
    uint32_t nw;
    mp_read_array(&rw, &nw, NULL);
    for (uint32_t q = 0; q < W; q++) {
        char url[512], host[128], bulk[256], backend[32] = "";
        mp_reader one = rw, one2 = rw, one3 = rw, one4 = rw, one5 = rw;
        if (read_str_key(&one, "url", url, sizeof(url)) != MOE_OK ||
            read_str_key(&one2, "host", host, sizeof(host)) != MOE_OK ||
            read_str_key(&one3, "bulk_url", bulk, sizeof(bulk)) != MOE_OK ||
            mp_skip(&rw, NULL) != MOE_OK) {
            e = MOE_EPROTO;
            break;
        }
        moe_bulk_pool_init(&m->bulk[q], bulk); /* "" when absent: no bulk path */
        moe_nccl_link_init(&m->nccl[q]);
        m->has_nccl[q] = read_bool_key(&one4, "nccl");
        if (read_str_key(&one5, "backend", backend, sizeof(backend)) != MOE_OK ||
            strcmp(backend, "cuda") != 0)
            m->gpu = 0;
        m->remote[q] = !host[0] || strcmp(host, dp->host) != 0;
        if (m->remote[q])
            m->shm = 0;
        int rv = nng_req0_open(&m->sock[q]);
        if (rv != 0) {
            e = MOE_EINTERNAL;
            break;
        }
        m->W = (int)q + 1;
        nng_pipe_notify(m->sock[q], NNG_PIPE_EV_ADD_POST, on_pipe, &m->up[q]);
        nng_pipe_notify(m->sock[q], NNG_PIPE_EV_REM_POST, on_pipe, &m->up[q]);
        nng_socket_set_ms(m->sock[q], NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
        nng_socket_set_size(m->sock[q], NNG_OPT_RECVMAXSZ, moe__max_msg(c));
        nng_socket_set_ms(m->sock[q], NNG_OPT_RECONNMINT, 20);
        nng_socket_set_ms(m->sock[q], NNG_OPT_RECONNMAXT, 500);
        if ((e = moe__dial(c, m->sock[q], url, "worker")) != MOE_OK)
            break;
    }
    moe_reply_free(&r);
    if (e != MOE_OK) {
        map_free(m);
        return e;
    }
    /* the dials run in the background: the call that loaded the map uses
     * the connections at once, and a fan-out takes them only when all are
     * up - give them a moment (loopback: well under a millisecond) */
    for (int waited_us = 0; waited_us < DP_CONNECT_WAIT_US; waited_us += 100) {
        int up = 0;
        for (uint32_t q = 0; q < W; q++)
            up += __atomic_load_n(&m->up[q], __ATOMIC_RELAXED) > 0;
        if (up == (int)W)
            break;
        usleep(100);
    }
    if (moe__data_path(c) == MOE_PATH_SHM && !m->shm) {
        moe__set_error("data path shm: a worker is on another host");
        map_free(m);
        return MOE_EINVAL;
    }
    m->W = (int)W;
    *out = m;
    return MOE_OK;
}

/* map_get returns the current map with a reference (loading it if needed). */
static moe_err map_get(moe_client *c, struct moe_dp *dp, dp_map **out)
{
    pthread_mutex_lock(&dp->mu);
    dp_map *m = dp->map;
    if (m && !m->stale) {
        m->refs++;
        pthread_mutex_unlock(&dp->mu);
        *out = m;
        return MOE_OK;
    }
    pthread_mutex_unlock(&dp->mu);
    dp_map *fresh = NULL;
    moe_err e = map_load(c, dp, &fresh);
    if (e != MOE_OK)
        return e;
    pthread_mutex_lock(&dp->mu);
    dp_map *old = dp->map;
    dp->map = fresh;
    fresh->refs++; /* the caller's */
    int last = old && --old->refs == 0;
    pthread_mutex_unlock(&dp->mu);
    if (last)
        map_free(old);
    *out = fresh;
    return MOE_OK;
}

static void map_mark_stale(struct moe_dp *dp, dp_map *m)
{
    pthread_mutex_lock(&dp->mu);
    m->stale = 1;
    pthread_mutex_unlock(&dp->mu);
}

/* ---- shared memory ---- */

/* attach_call sends method {params (2 pairs in p)} to worker q and reads
 * the region id of its answer. */
/* attach_call_key2: attach_call_key, and the optional unsigned key2 (when
 * not NULL and answered) into *v2, left as it is otherwise */
static moe_err attach_call_key2(moe_client *c, dp_map *m, int q, const char *method,
                                const mp_writer *p, uint32_t npairs, const char *key, uint64_t *id,
                                const char *key2, uint64_t *v2)
{
    dp_req rq;
    moe_rpc_response resp;
    char msg[300];
    moe_err e =
        sync_call(c, m->sock[q], &m->up[q], method, p, npairs, &rq, &resp, msg, sizeof(msg));
    if (e == MOE_OK) {
        uint32_t n;
        mp_reader rd = resp.result;
        e = MOE_EPROTO;
        if (mp_read_map(&rd, &n, NULL) == MOE_OK)
            for (uint32_t i = 0; i < n; i++) {
                const char *k;
                uint32_t kl;
                if (mp_read_str(&rd, &k, &kl, NULL) != MOE_OK)
                    break;
                if (mp_str_eq(k, kl, key)) {
                    if (mp_read_u64(&rd, id, NULL) == MOE_OK)
                        e = MOE_OK;
                } else if (key2 && mp_str_eq(k, kl, key2)) {
                    if (mp_read_u64(&rd, v2, NULL) != MOE_OK)
                        break;
                } else if (mp_skip(&rd, NULL) != MOE_OK)
                    break;
            }
    } else {
        moe__set_error("%s on worker %d: %s", method, q, msg);
    }
    req_close(&rq);
    return e;
}

/* attach_call_key: method {npairs pairs in p} on worker q, answered {key:
 * uint, ...}: *id */
static moe_err attach_call_key(moe_client *c, dp_map *m, int q, const char *method,
                               const mp_writer *p, uint32_t npairs, const char *key, uint64_t *id)
{
    return attach_call_key2(c, m, q, method, p, npairs, key, id, NULL, NULL);
}

/* attach_call: method {2 pairs} on worker q, answered {region} */
static moe_err attach_call(moe_client *c, dp_map *m, int q, const char *method, const mp_writer *p,
                           uint64_t *region)
{
    return attach_call_key(c, m, q, method, p, 2, "region", region);
}

/* attach_one maps segment name (size bytes) on worker q: its region id. */
static moe_err attach_one(moe_client *c, dp_map *m, int q, const char *name, size_t size,
                          uint64_t *region)
{
    mp_writer p;
    mp_writer_init(&p);
    mp_write_cstr(&p, "name");
    mp_write_cstr(&p, name);
    mp_write_cstr(&p, "size");
    mp_write_u64(&p, size);
    moe_err e = attach_call(c, m, q, "data.shm_attach", &p, region);
    mp_writer_fini(&p);
    return e;
}

/* attach_cuda_one opens the application's GPU allocation (IPC handle) on
 * worker q: its region id. */
static moe_err attach_cuda_one(moe_client *c, dp_map *m, int q, const uint8_t *handle, size_t size,
                               uint64_t *region)
{
    mp_writer p;
    mp_writer_init(&p);
    mp_write_cstr(&p, "handle");
    mp_write_bin(&p, handle, 64);
    mp_write_cstr(&p, "size");
    mp_write_u64(&p, size);
    moe_err e = attach_call(c, m, q, "data.cuda_attach", &p, region);
    mp_writer_fini(&p);
    return e;
}

/* shm_create makes a segment of size bytes, attaches it to every worker of
 * m and unlinks its name (the mappings keep it alive). */
static moe_err shm_create(moe_client *c, struct moe_dp *dp, dp_map *m, size_t size, dp_shm *b)
{
    char name[96];
    memset(b, 0, sizeof(*b));
    snprintf(name, sizeof(name), "/moe-%ld-%016llx-%u", (long)getpid(),
             (unsigned long long)moe_client_id(c), __atomic_add_fetch(&dp->next_shm, 1, 0));
    void *base;
    moe_err me = moe_shm_make(name, size, &base);
    if (me != MOE_OK)
        return me;
    b->base = base;
    b->region = calloc((size_t)m->W, sizeof(uint64_t));
    if (!b->region) {
        munmap(b->base, size);
        b->base = NULL;
        shm_unlink(name);
        return MOE_ENOMEM;
    }
    b->size = size;
    moe_err e = MOE_OK;
    for (int q = 0; q < m->W && e == MOE_OK; q++)
        e = attach_one(c, m, q, name, size, &b->region[q]);
    shm_unlink(name);
    if (e != MOE_OK)
        shm_free(b); /* the workers drop what they mapped when the map goes */
    return e;
}

/* ring_make maps a fresh ring of size bytes and attaches it to worker q
 * of m: its segment (data.shm_attach), then the ring in it. */
static moe_err ring_make(moe_client *c, struct moe_dp *dp, dp_map *m, int q, size_t size,
                         moe_ring *r)
{
    char name[96];
    snprintf(name, sizeof(name), "/moe-%ld-%016llx-r%u", (long)getpid(),
             (unsigned long long)moe_client_id(c), __atomic_add_fetch(&dp->next_shm, 1, 0));
    moe_err e = moe_ring_map(r, name, size);
    if (e != MOE_OK)
        return e;
    e = attach_one(c, m, q, name, r->size, &r->region);
    shm_unlink(name);
    if (e == MOE_OK) {
        mp_writer p;
        mp_writer_init(&p);
        mp_write_cstr(&p, "region");
        mp_write_u64(&p, r->region);
        mp_write_cstr(&p, "offset");
        mp_write_u64(&p, 0);
        mp_write_cstr(&p, "size");
        mp_write_u64(&p, r->size);
        e = attach_call_key(c, m, q, "data.ring_attach", &p, 3, "ring", &r->id);
        mp_writer_fini(&p);
    }
    if (e != MOE_OK)
        moe_ring_unmap(r); /* the worker drops its mapping with the map's connection */
    return e;
}

/* ring_bytes: the size of a ring whose answer area holds rep bytes:
 * MOE_RING_BYTES, or for a larger answer the power of two that holds it
 * (at most RING_MAX); 0 when none does */
static size_t ring_bytes(size_t rep)
{
    size_t size = MOE_RING_BYTES;
    while (size <= RING_MAX && size - RING_HEAD - ring_req_cap((uint32_t)size) < rep)
        size *= 2;
    return size <= RING_MAX ? size : 0;
}

/* ring_get: a free ring to worker q of at least size bytes (busy on
 * return), or NULL (rings off: $MOE_RING=0, none offered, all busy, or
 * every slot taken by smaller ones). A ring larger than MOE_RING_BYTES is
 * made only for an answer that needs it (a fan-out of many rows): shared
 * memory grows with what the calls carry. */
static moe_ring *ring_get(moe_client *c, struct moe_dp *dp, dp_map *m, int q, size_t size)
{
    const char *env = getenv("MOE_RING");
    if ((env && !strcmp(env, "0")) || size == 0)
        return NULL;
    moe_ring *rings = m->rings + (size_t)q * DP_MAX_RING;
    pthread_mutex_lock(&dp->mu);
    for (int i = 0; i < m->nrings[q]; i++) {
        moe_ring *r = &rings[i];
        if (r->id && !r->dead && r->size >= size && !__atomic_load_n(&r->busy, __ATOMIC_ACQUIRE)) {
            r->busy = 1;
            pthread_mutex_unlock(&dp->mu);
            return r;
        }
    }
    moe_ring *r = NULL;
    if (!m->no_ring[q] || size < (size_t)m->no_ring[q]) {
        /* a slot a ring could not be made in, else the next one */
        for (int i = 0; i < m->nrings[q] && !r; i++)
            if (!rings[i].id && !rings[i].busy && !rings[i].dead)
                r = &rings[i];
        if (!r && m->nrings[q] < DP_MAX_RING)
            r = &rings[m->nrings[q]++];
    }
    if (!r) {
        pthread_mutex_unlock(&dp->mu);
        return NULL;
    }
    r->busy = 1; /* reserved while it is made */
    pthread_mutex_unlock(&dp->mu);
    moe_ring made;
    moe_err e = ring_make(c, dp, m, q, size, &made);
    pthread_mutex_lock(&dp->mu);
    if (e == MOE_OK) {
        *r = made;
        r->busy = 1;
    } else {
        /* an older worker, or no shared memory for this size (/dev/shm
         * full): rings of this size and larger are not tried again (the
         * socket); the slot stays empty for a smaller one */
        if (!m->no_ring[q] || size < (size_t)m->no_ring[q])
            m->no_ring[q] = (int)size;
        memset(r, 0, sizeof(*r));
        r = NULL;
    }
    pthread_mutex_unlock(&dp->mu);
    return r;
}

/* shm_get: a free buffer of at least need bytes (busy on return), or NULL
 * with *why: MOE_EUNAVAIL when a worker of m could not be reached to attach
 * a new one (m then keeps shared memory: a fresh map may reach them all),
 * else MOE_ENOMEM (shared memory does not work here: m's calls take the
 * socket from then on, and one that asked for shm by name is refused). */
static dp_shm *shm_get(moe_client *c, struct moe_dp *dp, dp_map *m, size_t need, moe_err *why)
{
    *why = MOE_ENOMEM;
    pthread_mutex_lock(&dp->mu);
    dp_shm *best = NULL, *empty = NULL;
    for (int i = 0; i < m->nbufs; i++) {
        dp_shm *s = &m->bufs[i];
        if (!s->busy && s->size >= need && (!best || s->size < best->size))
            best = s;
        if (!s->busy && s->size == 0 && !empty)
            empty = s; /* left by an attach a worker missed */
    }
    if (best || (!empty && m->nbufs == DP_MAX_SHM) || !m->shm) {
        if (best)
            best->busy = 1;
        pthread_mutex_unlock(&dp->mu);
        return best;
    }
    dp_shm *b = empty ? empty : &m->bufs[m->nbufs++];
    b->busy = 1; /* reserved while it is made */
    pthread_mutex_unlock(&dp->mu);
    size_t size = DP_MIN_SHM;
    while (size < need)
        size *= 2;
    dp_shm made;
    moe_err e = shm_create(c, dp, m, size, &made);
    pthread_mutex_lock(&dp->mu);
    if (e == MOE_OK) {
        *b = made;
        b->busy = 1;
    } else if (e == MOE_EUNAVAIL) {
        /* a worker's connection is down (killed, restarting): the slot
         * free again, shared memory still on for this map's next try */
        memset(b, 0, sizeof(*b));
        *why = MOE_EUNAVAIL;
        b = NULL;
    } else {
        m->shm = 0;  /* shared memory does not work here: the socket path */
        b->busy = 1; /* an empty slot never handed out */
        b->size = 0;
        b = NULL;
    }
    pthread_mutex_unlock(&dp->mu);
    return b;
}

static void shm_put(struct moe_dp *dp, dp_shm *b)
{
    if (!b)
        return;
    pthread_mutex_lock(&dp->mu);
    b->busy = 0;
    pthread_mutex_unlock(&dp->mu);
}

/* shm_drop retires a buffer a worker might still write into: unmapped here
 * (the worker's mapping keeps its pages), its slot never handed out again. */
static void shm_drop(struct moe_dp *dp, dp_shm *b)
{
    pthread_mutex_lock(&dp->mu);
    shm_free(b);
    b->busy = 1;
    pthread_mutex_unlock(&dp->mu);
}

/* ---- the application's buffers (moe_buffer_alloc) ---- */

/* ubuf_find: the user buffer holding [p, p+n), or -1. */
static int ubuf_find(struct moe_dp *dp, const void *p, size_t n)
{
    int found = -1;
    pthread_mutex_lock(&dp->mu);
    for (int i = 0; i < DP_MAX_UBUF && found < 0; i++) {
        const dp_ubuf *u = &dp->ubuf[i];
        if (u->base && (u->shm || u->cuda) && (const uint8_t *)p >= u->base &&
            (const uint8_t *)p + n <= u->base + u->size)
            found = i;
    }
    pthread_mutex_unlock(&dp->mu);
    return found;
}

/* ubuf_attached: user buffer i is mapped on every worker of m (attaching
 * it where it is not yet); 0 when that fails. */
static int ubuf_attached(moe_client *c, struct moe_dp *dp, dp_map *m, int i)
{
    int ok = m->shm;
    pthread_mutex_lock(&dp->att_mu);
    for (int q = 0; ok && q < m->W; q++) {
        uint64_t *rg = &m->uregion[(size_t)i * m->W + q];
        if (*rg)
            continue;
        if (dp->ubuf[i].cuda ? attach_cuda_one(c, m, q, dp->ubuf[i].handle, dp->ubuf[i].size, rg)
                             : attach_one(c, m, q, dp->ubuf[i].name, dp->ubuf[i].size, rg))
            ok = 0;
    }
    pthread_mutex_unlock(&dp->att_mu);
    return ok;
}

void *moe_dp_buffer_alloc(moe_client *c, size_t n)
{
    struct moe_dp *dp = moe__dp(c);
    if (!dp || n == 0)
        return NULL;
    pthread_mutex_lock(&dp->mu);
    int i = 0;
    while (i < DP_MAX_UBUF && dp->ubuf[i].base)
        i++;
    if (i == DP_MAX_UBUF) {
        pthread_mutex_unlock(&dp->mu);
        moe__set_error("moe_buffer_alloc: %d buffers already allocated", DP_MAX_UBUF);
        return NULL;
    }
    dp_ubuf *u = &dp->ubuf[i];
    u->base = (uint8_t *)1; /* reserved while it is made */
    pthread_mutex_unlock(&dp->mu);
    dp_ubuf made;
    memset(&made, 0, sizeof(made));
    made.size = n;
    snprintf(made.name, sizeof(made.name), "/moe-%ld-%016llx-u%u", (long)getpid(),
             (unsigned long long)moe_client_id(c), __atomic_add_fetch(&dp->next_shm, 1, 0));
    int fd = moe__data_path(c) == MOE_PATH_COORD || moe__data_path(c) == MOE_PATH_SOCKET ||
                     moe__data_path(c) == MOE_PATH_BULK
                 ? -1
                 : shm_open(made.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, (off_t)n) == 0 && posix_fallocate(fd, 0, (off_t)n) == 0) {
        void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
            made.base = p;
            made.shm = 1;
        }
    }
    if (fd >= 0)
        close(fd);
    if (!made.shm) { /* no shared memory here: plain memory, rows copied */
        if (fd >= 0)
            shm_unlink(made.name);
        made.base = malloc(n);
    }
    pthread_mutex_lock(&dp->mu);
    *u = made;
    pthread_mutex_unlock(&dp->mu);
    if (!made.base)
        moe__set_error("moe_buffer_alloc: out of memory for %zu bytes", n);
    return made.base;
}

moe_err moe_dp_cuda_register(moe_client *c, void *dptr, size_t n, const void *ipc_handle)
{
    struct moe_dp *dp = moe__dp(c);
    if (!dp)
        return MOE_ENOMEM;
    if (!dptr || !n || !ipc_handle) {
        moe__set_error("moe_cuda_register: a device pointer, its size and its IPC handle");
        return MOE_EINVAL;
    }
    pthread_mutex_lock(&dp->mu);
    int i = 0;
    while (i < DP_MAX_UBUF && dp->ubuf[i].base)
        i++;
    if (i == DP_MAX_UBUF) {
        pthread_mutex_unlock(&dp->mu);
        moe__set_error("moe_cuda_register: %d buffers already registered", DP_MAX_UBUF);
        return MOE_ENOMEM;
    }
    dp_ubuf *u = &dp->ubuf[i];
    u->base = dptr;
    u->size = n;
    u->cuda = 1;
    memcpy(u->handle, ipc_handle, 64);
    pthread_mutex_unlock(&dp->mu);
    return MOE_OK;
}

int moe_dp_on_device(moe_client *c, const void *p, size_t n)
{
    struct moe_dp *dp = moe__dp(c);
    int on = 0;
    if (!dp || !n)
        return 0;
    pthread_mutex_lock(&dp->mu);
    for (int i = 0; i < DP_MAX_UBUF && !on; i++) { /* where it starts is enough */
        const dp_ubuf *u = &dp->ubuf[i];
        on = u->cuda && (const uint8_t *)p >= u->base && (const uint8_t *)p < u->base + u->size;
    }
    pthread_mutex_unlock(&dp->mu);
    return on;
}

void moe_dp_buffer_free(moe_client *c, void *p)
{
    struct moe_dp *dp = moe__dp(c);
    if (!dp || !p)
        return;
    pthread_mutex_lock(&dp->mu);
    int i = 0;
    while (i < DP_MAX_UBUF && dp->ubuf[i].base != p)
        i++;
    dp_map *m = dp->map;
    if (m)
        m->refs++;
    pthread_mutex_unlock(&dp->mu);
    if (i == DP_MAX_UBUF) {
        if (m)
            map_put(dp, m);
        return;
    }
    /* the workers of the current map unmap it now (older maps' connections
     * drop theirs when they close) */
    pthread_mutex_lock(&dp->att_mu);
    for (int q = 0; m && q < m->W; q++) {
        uint64_t *rg = &m->uregion[(size_t)i * m->W + q];
        if (*rg) {
            mp_writer pw;
            dp_req rq;
            moe_rpc_response resp;
            char msg[300];
            mp_writer_init(&pw);
            mp_write_cstr(&pw, "region");
            mp_write_u64(&pw, *rg);
            sync_call(c, m->sock[q], &m->up[q],
                      dp->ubuf[i].cuda ? "data.cuda_detach" : "data.shm_detach", &pw, 1, &rq, &resp,
                      msg, sizeof(msg));
            mp_writer_fini(&pw);
            req_close(&rq);
            *rg = 0;
        }
    }
    pthread_mutex_unlock(&dp->att_mu);
    if (m)
        map_put(dp, m);
    pthread_mutex_lock(&dp->mu);
    dp_ubuf u = dp->ubuf[i];
    memset(&dp->ubuf[i], 0, sizeof(dp->ubuf[i]));
    pthread_mutex_unlock(&dp->mu);
    ubuf_release(&u);
}

/* ---- one call ---- */

/* read_y checks a data.rows answer's y (rows,H) of dtype dt: inline bytes
 * are copied to out; a region answer must name (region, y_off). */
static moe_err read_y_value(mp_reader *rd, moe_dtype dt, int64_t rows, int64_t H, void *out,
                            uint64_t region, uint64_t y_off, int bulk);

/* read_y reads a worker's answer to data.rows: {y} (written into out, or
 * checked to be where it was asked in region), and on the lane also
 * {stats}: its encoded value is returned in *stats / *stats_len (a view into
 * the answer; NULL when absent). */
static moe_err read_y(mp_reader *rd, moe_dtype dt, int64_t rows, int64_t H, void *out,
                      uint64_t region, uint64_t y_off, int bulk, const uint8_t **stats,
                      size_t *stats_len)
{
    uint32_t n;
    int got_y = 0;
    *stats = NULL;
    *stats_len = 0;
    if (mp_read_map(rd, &n, NULL) != MOE_OK || n < 1 || n > 2)
        return MOE_EPROTO;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(rd, &k, &kl, NULL) != MOE_OK)
            return MOE_EPROTO;
        if (mp_str_eq(k, kl, "y") && !got_y) {
            moe_err e = read_y_value(rd, dt, rows, H, out, region, y_off, bulk);
            if (e != MOE_OK)
                return e;
            got_y = 1;
        } else if (mp_str_eq(k, kl, "stats") && !*stats) {
            const uint8_t *a = rd->p;
            if (mp_skip(rd, NULL) != MOE_OK)
                return MOE_EPROTO;
            *stats = a;
            *stats_len = (size_t)(rd->p - a);
        } else {
            return MOE_EPROTO;
        }
    }
    return got_y ? MOE_OK : MOE_EPROTO;
}

static moe_err read_y_value(mp_reader *rd, moe_dtype dt, int64_t rows, int64_t H, void *out,
                            uint64_t region, uint64_t y_off, int bulk)
{
    bool bulk_y = false, nccl_y = false;
    uint32_t m;
    const char *k;
    uint32_t kl;
    if (mp_read_map(rd, &m, NULL) != MOE_OK)
        return MOE_EPROTO;
    size_t nbytes = (size_t)rows * (size_t)H * moe_dtype_size(dt);
    int got_data = 0, got_region = 0, got_shape = 0;
    uint64_t rg = 0, off = 0;
    for (uint32_t i = 0; i < m; i++) {
        if (mp_read_str(rd, &k, &kl, NULL) != MOE_OK)
            return MOE_EPROTO;
        if (mp_str_eq(k, kl, "dtype")) {
            const char *v;
            uint32_t vl;
            moe_dtype got;
            if (mp_read_str(rd, &v, &vl, NULL) != MOE_OK ||
                moe_dtype_parse(v, vl, &got) != MOE_OK || got != dt)
                return MOE_EPROTO;
        } else if (mp_str_eq(k, kl, "shape")) {
            uint32_t nd;
            int64_t a, b;
            if (mp_read_array(rd, &nd, NULL) != MOE_OK || nd != 2 ||
                mp_read_i64(rd, &a, NULL) != MOE_OK || mp_read_i64(rd, &b, NULL) != MOE_OK ||
                a != rows || b != H)
                return MOE_EPROTO;
            got_shape = 1;
        } else if (mp_str_eq(k, kl, "data")) {
            const void *d;
            uint32_t dl;
            if (mp_read_bin(rd, &d, &dl, NULL) != MOE_OK || dl != nbytes || region || bulk)
                return MOE_EPROTO;
            par_memcpy(out, d, nbytes);
            got_data = 1;
        } else if (mp_str_eq(k, kl, "region")) {
            if (mp_read_u64(rd, &rg, NULL) != MOE_OK)
                return MOE_EPROTO;
            got_region = 1;
        } else if (mp_str_eq(k, kl, "bulk")) { /* y follows on the bulk connection */
            if (mp_read_bool(rd, &bulk_y, NULL) != MOE_OK)
                return MOE_EPROTO;
        } else if (mp_str_eq(k, kl, "nccl")) { /* y follows on the communicator */
            if (mp_read_bool(rd, &nccl_y, NULL) != MOE_OK)
                return MOE_EPROTO;
        } else if (mp_str_eq(k, kl, "offset")) {
            if (mp_read_u64(rd, &off, NULL) != MOE_OK)
                return MOE_EPROTO;
        } else if (mp_skip(rd, NULL) != MOE_OK) {
            return MOE_EPROTO;
        }
    }
    if (!got_shape)
        return MOE_EPROTO;
    if (bulk) /* 1: bulk, 2: nccl */
        return (bulk == 2 ? nccl_y : bulk_y) && !got_data && !got_region ? MOE_OK : MOE_EPROTO;
    if (region)
        return got_region && rg == region && off == y_off ? MOE_OK : MOE_EPROTO;
    return got_data ? MOE_OK : MOE_EPROTO;
}

/* lane_reply makes the lane's answer look like the coordinator's reply to
 * the caller: {direct: true, stats} in ctl (owned by ctl). */
static moe_err lane_reply(moe_reply *ctl, const uint8_t *stats, size_t len, char *msg,
                          size_t msglen)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, stats ? 2 : 1);
    mp_write_cstr(&w, "direct");
    mp_write_bool(&w, true);
    if (stats) {
        mp_write_cstr(&w, "stats");
        mp_write_raw(&w, stats, len);
    }
    if (w.failed) {
        mp_writer_fini(&w);
        snprintf(msg, msglen, "out of memory");
        return MOE_ENOMEM;
    }
    moe_reply_free(ctl);
    memset(ctl, 0, sizeof(*ctl));
    ctl->buf = w.buf; /* the writer's buffer, owned by ctl from here */
    ctl->len = w.len;
    return MOE_OK;
}

/* gone_ranks: the ranks the coordinator's error answer to the control call
 * names "gone" (docs/PROTOCOL.md, "Error object"): workers it knows dead.
 * Their rows are never answered, and their connections drop only once the
 * kernel has torn the process down (tens to hundreds of ms): the caller
 * stops waiting for them at once. */
static moe_rpc_response gone_ranks(const moe_reply *ctl, moe_err e)
{
    moe_rpc_response r = {0};
    mp_errbuf eb;
    if (e != MOE_OK && !ctl->transport && ctl->buf &&
        moe_rpc_parse_response(ctl->buf, ctl->len, &r, &eb) != MOE_OK)
        r.ngone = 0; /* a malformed answer names no one */
    return r;
}

/* rank_down: worker q will not answer - its connection is down, or the
 * coordinator's error names it gone */
static int rank_down(const dp_map *m, const moe_rpc_response *g, int q)
{
    if (__atomic_load_n(&m->up[q], __ATOMIC_RELAXED) <= 0)
        return 1;
    for (int i = 0; i < g->ngone; i++)
        if (g->gone[i] == q)
            return 1;
    return 0;
}

/* send_cancel asks worker q to drop the ticket's rows (best effort); 0 when
 * the worker did not answer within the grace (stopped or hung). */
static int send_cancel(moe_client *c, dp_map *m, int q, uint64_t cid, uint64_t seq)
{
    mp_writer p;
    dp_req rq;
    moe_rpc_response resp;
    char msg[300];
    mp_writer_init(&p);
    mp_write_cstr(&p, "ticket");
    mp_write_array(&p, 2);
    mp_write_u64(&p, cid);
    mp_write_u64(&p, seq);
    moe_err e = sync_call_t(c, m->sock[q], &m->up[q], "data.cancel", &p, 1, DP_GRACE_MS, &rq, &resp,
                            msg, sizeof(msg));
    mp_writer_fini(&p);
    req_close(&rq);
    return e == MOE_OK;
}

/* use_bulk: rank q's n bytes of rows go over its bulk endpoint - always on
 * the bulk path, on auto when the worker is on another host and the rows
 * are large */
static int use_bulk(moe_client *c, const dp_map *m, int q, size_t n)
{
    int path = moe__data_path(c);
    if (path == MOE_PATH_BULK)
        return 1;
    return path == MOE_PATH_AUTO && m->remote[q] && m->bulk[q].url[0] && n >= DP_MIN_BULK;
}

/* bulk_parts: the connections n bytes of one rank's rows are split over:
 * one per DP_BULK_PART_MIN bytes, at most $MOE_BULK_STREAMS (default
 * DP_BULK_STREAMS; 1 = never split) */
static int bulk_parts(size_t n)
{
    const char *env = getenv("MOE_BULK_STREAMS");
    long most = env && *env ? strtol(env, NULL, 10) : DP_BULK_STREAMS;
    if (most < 1)
        most = 1;
    if (most > MOE_BULK_MAX_PARTS)
        most = MOE_BULK_MAX_PARTS;
    size_t k = n / DP_BULK_PART_MIN;
    return k < 1 ? 1 : k > (size_t)most ? (int)most : (int)k;
}

/* fanout_rows: the most rows a forward fans out on map m ($MOE_FANOUT_ROWS,
 * default DP_FANOUT_ROWS, DP_FANOUT_ROWS_GPU on GPU workers; 0 = never):
 * each worker answers T x top_k / W expert rows, so fan-out pays for small
 * batches (decode) only */
static int64_t fanout_rows(const dp_map *m)
{
    const char *env = getenv("MOE_FANOUT_ROWS");
    long v = env && *env ? strtol(env, NULL, 10) : m->gpu ? DP_FANOUT_ROWS_GPU : DP_FANOUT_ROWS;
    return v < 0 ? 0 : v;
}

/* dp_fanout: an inference forward of T <= fanout_rows() rows on a cluster
 * of several workers: the same rows to every worker (data.rows with
 * run.fanout), each answering the expert rows of its own experts' slots;
 * y is their sum (client/fanout.c). No coordinator, no exchange. */
/* fo_ring_size: the ring a fan-out of (model, layer) of T rows needs
 * (ring_bytes): its answer area holds the largest answer (every slot on one
 * worker, the shared rows, the weights and stats of up to 1024 experts, 128
 * bytes of head); 0 before the first answer (unknown) or when no ring
 * holds it */
static size_t fo_ring_size(struct moe_dp *dp, dp_map *m, const void *key, size_t klen, int64_t T,
                           int64_t H)
{
    size_t most = 0;
    pthread_mutex_lock(&dp->mu);
    for (int i = 0; i < m->nfo_seen; i++)
        if (m->fo_seen[i].klen == klen && !memcmp(m->fo_seen[i].key, key, klen)) {
            size_t K = (size_t)m->fo_seen[i].top_k, es = m->fo_seen[i].es;
            most = (size_t)T * K * (size_t)H * es + (size_t)T * (size_t)H * es + (size_t)T * K * 4 +
                   ((size_t)24 << 10) + 128;
        }
    pthread_mutex_unlock(&dp->mu);
    return most ? ring_bytes(most) : 0;
}

static void fo_remember(struct moe_dp *dp, dp_map *m, const void *key, size_t klen, int top_k,
                        size_t es)
{
    if (klen > sizeof(m->fo_seen[0].key))
        return;
    pthread_mutex_lock(&dp->mu);
    int i = 0;
    while (i < m->nfo_seen &&
           !(m->fo_seen[i].klen == klen && !memcmp(m->fo_seen[i].key, key, klen)))
        i++;
    if (i == m->nfo_seen && m->nfo_seen < 8)
        m->nfo_seen++;
    if (i < m->nfo_seen) {
        memcpy(m->fo_seen[i].key, key, klen);
        m->fo_seen[i].klen = klen;
        m->fo_seen[i].top_k = top_k;
        m->fo_seen[i].es = es;
    }
    pthread_mutex_unlock(&dp->mu);
}

/* write_rows_head: a data.rows request's ticket, deadline_ms and, on the
 * lane or the fan-out (run_pairs not NULL: the caller's {model, layer}
 * pairs), run with the map's generation (and fanout: true) */
static void write_rows_head(mp_writer *w, uint64_t cid, uint64_t seq, int64_t deadline_ms,
                            const void *run_pairs, size_t run_len, uint64_t gen, int fanout)
{
    mp_write_cstr(w, "ticket");
    mp_write_array(w, 2);
    mp_write_u64(w, cid);
    mp_write_u64(w, seq);
    mp_write_cstr(w, "deadline_ms");
    mp_write_i64(w, deadline_ms);
    if (run_pairs) {
        mp_write_cstr(w, "run");
        mp_write_map(w, fanout ? 4 : 3);
        mp_write_raw(w, run_pairs, run_len);
        mp_write_cstr(w, "generation");
        mp_write_u64(w, gen);
        if (fanout) {
            mp_write_cstr(w, "fanout");
            mp_write_bool(w, true);
        }
    }
}

/* fo_write_params writes a fan-out data.rows' params map up to x's tensor
 * head (its T x H rows of dt follow): auth (NULL: none), ticket,
 * deadline_ms, run {model, layer, generation, fanout: true}, x. */
static void fo_write_params(mp_writer *w, const char *auth, uint64_t cid, uint64_t seq,
                            int deadline_ms, const void *ctl_pairs, size_t ctl_len, uint64_t gen,
                            moe_dtype dt, int64_t T, int64_t H)
{
    const int64_t shape[2] = {T, H};
    mp_write_map(w, 4u + (auth ? 1u : 0u));
    if (auth) {
        mp_write_cstr(w, "auth");
        mp_write_cstr(w, auth);
    }
    write_rows_head(w, cid, seq, deadline_ms, ctl_pairs, ctl_len, gen, 1);
    mp_write_cstr(w, "x");
    moe_tensor_write_head(w, dt, 2, shape);
}

/* MOE_FANOUT_TRACE=N: where a fan-out forward's time goes in libmoe
 * (common/step_trace.h): posting the rows, the answers, reading them, the
 * sum, the statistics */
static step_trace fo_tr = {"MOE_FANOUT_TRACE",
                           "libmoe fan-out",
                           5,
                           {"post", "answers", "read", "sum", "stats"},
                           -1,
                           0,
                           {0}};

static moe_err dp_fanout(moe_client *c, struct moe_dp *dp, dp_map *m, const char *method,
                         const void *ctl_pairs, size_t ctl_len, moe_dtype dt, const void *in,
                         int64_t T, int64_t H, void *out, moe_reply *ctl, int *stale)
{
    double t_last = 0;
    step_trace_begin(&fo_tr, &t_last);
    const int W = m->W;
    const size_t nbytes = (size_t)T * (size_t)H * moe_dtype_size(dt);
    const uint64_t cid = moe_client_id(c), seq = moe__next_msgid(c);
    const char *auth = moe__auth(c);
    dp_req *rq = calloc((size_t)W, sizeof(dp_req));
    moe_fanout_part *parts = calloc((size_t)W, sizeof(moe_fanout_part));
    int *watch = malloc((size_t)W * sizeof(int)); /* (W) watch_add slots, -1 = none */
    moe_err e = MOE_OK;
    char msg[400] = "";
    int bad = -1;
    if (!rq || !parts || !watch) {
        free(rq);
        free(parts);
        free(watch);
        return MOE_ENOMEM;
    }
    for (int q = 0; q < W; q++)
        watch[q] = -1;
    /* 1. the same rows to every worker, all at once: through a ring on this
     * host when the largest answer fits one, else over the socket */
    const size_t ring_size = m->shm ? fo_ring_size(dp, m, ctl_pairs, ctl_len, T, H) : 0;
    for (int q = 0; q < W && e == MOE_OK; q++) {
        mp_writer w;
        moe_ring *ring = ring_size ? ring_get(c, dp, m, q, ring_size) : NULL;
        if (ring) { /* the params map alone, rows inline (the ring's connection is
                     * authenticated) */
            mp_writer_init(&w);
            fo_write_params(&w, NULL, cid, seq, moe__timeout_ms(c), ctl_pairs, ctl_len, m->gen, dt,
                            T, H);
            moe_err pe = w.failed ? MOE_ENOMEM : moe_ring_post2(ring, w.buf, w.len, in, nbytes);
            mp_writer_fini(&w);
            if (pe == MOE_OK) {
                req_on_ring(&rq[q], ring, &m->up[q], moe__timeout_ms(c));
                continue;
            }
            __atomic_store_n(&ring->busy, 0, __ATOMIC_RELEASE); /* the socket, then */
        }
        nng_msg *nm = NULL;
        uint32_t msgid = moe__next_msgid(c);
        mp_writer_init(&w);
        moe_rpc_write_request_head(&w, msgid, "data.rows");
        fo_write_params(&w, auth, cid, seq, moe__timeout_ms(c), ctl_pairs, ctl_len, m->gen, dt, T,
                        H);
        e = msg_from_writer(&w, in, nbytes, &nm);
        mp_writer_fini(&w);
        if (e == MOE_OK)
            e = req_start_chained(&rq[q], m->sock[q], nm, moe__timeout_ms(c));
        rq[q].msgid = msgid;
        if (e == MOE_OK)
            watch[q] = watch_add(&m->up[q], rq[q].aio);
        if (e != MOE_OK)
            bad = q, snprintf(msg, sizeof(msg), "sending rows: %s", moe_strerror(e));
    }
    step_trace_stamp(&fo_tr, 0, &t_last);
    /* 2. every answer (each worker may still be at work until it answered) */
    for (int q = 0; q < W; q++) {
        if (!rq[q].open)
            continue;
        moe_rpc_response resp;
        char qm[400];
        moe_err qe =
            req_finish(&rq[q], e != MOE_OK, e != MOE_OK ? DP_GRACE_MS : 0, &resp, qm, sizeof(qm));
        step_trace_stamp(&fo_tr, 1, &t_last);
        watch_del(watch[q]);
        if (qe != MOE_OK && !resp_was_answer(&rq[q]) &&
            __atomic_load_n(&m->up[q], __ATOMIC_RELAXED) <= 0) {
            qe = MOE_EUNAVAIL; /* cancelled or cut off: the worker's connection went */
            snprintf(qm, sizeof(qm), "the worker's connection is down");
        }
        if (qe == MOE_OK) {
            mp_reader rd = resp.result;
            qe = moe_fanout_read(&rd, &parts[q], qm, sizeof(qm));
        }
        step_trace_stamp(&fo_tr, 2, &t_last);
        if (qe != MOE_OK && e == MOE_OK) {
            e = qe;
            bad = q;
            snprintf(msg, sizeof(msg), "%s", qm);
            /* a worker that says the fan-out is closed (a new generation):
             * the map is stale, as the coordinator's would be */
            if (qe == MOE_EUNAVAIL && resp_was_answer(&rq[q]))
                *stale = 1;
        }
    }
    if (e == MOE_OK) /* rings may carry this model's next calls */
        fo_remember(dp, m, ctl_pairs, ctl_len, parts[0].top_k, moe_dtype_size(parts[0].dtype));
    /* 3. y: the workers' rows summed in the layer's order */
    if (e == MOE_OK &&
        (e = moe_fanout_combine(parts, W, T, H, dt, out, msg, sizeof(msg))) != MOE_OK)
        bad = 0;
    step_trace_stamp(&fo_tr, 3, &t_last);
    if (e == MOE_OK) {
        mp_writer sw;
        mp_writer_init(&sw);
        int st = moe_fanout_stats(parts, W, &sw);
        e = lane_reply(ctl, st == 0 && !sw.failed ? sw.buf : NULL, sw.len, msg, sizeof(msg));
        mp_writer_fini(&sw);
    }
    step_trace_stamp(&fo_tr, 4, &t_last);
    step_trace_end(&fo_tr);
    for (int q = 0; q < W; q++)
        req_close(&rq[q]);
    free(rq);
    free(parts);
    free(watch);
    if (e != MOE_OK) {
        ctl->err = e;
        snprintf(ctl->message, sizeof(ctl->message), "worker rank %d: %s", bad, msg);
        moe__set_error("%s: %s: worker rank %d: %s", method, moe_err_code(e), bad, msg);
    }
    return e;
}

/* one attempt on map m; *stale set when the coordinator answered
 * unavailable (its map may be old) */
/* ---- the NCCL path: rows in GPU memory (client_nccl.h) ---- */

/* nccl_open opens worker q's communicator on GPU dev (link locked):
 * data.nccl_open with a fresh unique id, then both sides' initialisation
 * is awaited (the worker answers at once; ours completes when both joined). */
static moe_err nccl_open(moe_client *c, dp_map *m, int q, int dev)
{
    moe_nccl_link *l = &m->nccl[q];
    uint8_t id[MOE_NCCL_ID_BYTES];
    char msg[300];
    moe_err e = moe_nccl_begin(l, dev, id, msg, sizeof(msg));
    if (e != MOE_OK) {
        moe__set_error("data path nccl: worker rank %d: %s", q, msg);
        return e;
    }
    mp_writer p;
    mp_writer_init(&p);
    mp_write_cstr(&p, "id");
    mp_write_bin(&p, id, sizeof(id));
    mp_write_cstr(&p, "device");
    mp_write_i64(&p, dev);
    mp_write_cstr(&p, "timeout_ms");
    mp_write_i64(&p, moe__timeout_ms(c) < 600000 ? moe__timeout_ms(c) : 600000);
    mp_write_cstr(&p, "nccl_version"); /* the worker refuses another version clearly */
    mp_write_i64(&p, moe_nccl_version());
    uint64_t comm = 0, pieces_max = 1; /* an older worker says nothing: one piece */
    e = attach_call_key2(c, m, q, "data.nccl_open", &p, 4, "comm", &comm, "pieces_max",
                         &pieces_max);
    mp_writer_fini(&p);
    if (e == MOE_OK && (e = moe_nccl_wait(l, 0, moe__timeout_ms(c), &m->up[q], NULL, NULL, msg,
                                          sizeof(msg))) != MOE_OK)
        moe__set_error("data path nccl: worker rank %d: joining the communicator: %s", q, msg);
    if (e != MOE_OK) {
        moe_nccl_abort(l);
        return e;
    }
    l->open = 1;
    l->comm_id = comm;
    l->pieces_max = pieces_max < NCCL_PIECES_MAX ? (int)pieces_max : NCCL_PIECES_MAX;
    return MOE_OK;
}

/* nccl_drop aborts worker q's communicator after a failed transfer and
 * tells the worker (best effort: its connection closing does it too). */
static void nccl_drop(moe_client *c, dp_map *m, int q)
{
    moe_nccl_link *l = &m->nccl[q];
    uint64_t id = l->comm_id;
    moe_nccl_abort(l);
    if (!id || __atomic_load_n(&m->up[q], __ATOMIC_RELAXED) <= 0)
        return;
    mp_writer p;
    dp_req rq;
    moe_rpc_response resp;
    char msg[300];
    mp_writer_init(&p);
    mp_write_cstr(&p, "comm");
    mp_write_u64(&p, id);
    (void)sync_call_t(c, m->sock[q], &m->up[q], "data.nccl_close", &p, 1, DP_GRACE_MS, &rq, &resp,
                      msg, sizeof(msg));
    mp_writer_fini(&p);
    req_close(&rq);
}

/* answered: the worker's answer to the request has arrived (give_up of
 * moe_nccl_wait while x is still on its way) */
static int answered(void *arg)
{
    dp_req *q = arg;
    return __atomic_load_n(&q->ndone, __ATOMIC_ACQUIRE) >= 2; /* sent, and answered */
}

/* nccl_await: moe_nccl_wait on link l, given up when q (the request whose
 * rows or echo the transfer carries) is answered first; an answer can
 * come a moment before our side of the last transfer is seen done, so it
 * gets 200 ms more. MOE_ECLOSED: answered and the transfer never ended
 * (the worker refused it): the caller aborts the link. */
static moe_err nccl_await(moe_nccl_link *l, int stream, int tmo, const int *up, dp_req *q,
                          char *msg, size_t msglen)
{
    moe_err e = moe_nccl_wait(l, stream, tmo, up, answered, q, msg, msglen);
    if (e != MOE_ECLOSED)
        return e;
    e = moe_nccl_wait(l, stream, 200, up, NULL, NULL, msg, msglen);
    if (e == MOE_ETIMEDOUT) {
        snprintf(msg, msglen, "the worker answered and the NCCL transfer did not end (refused)");
        return MOE_ECLOSED;
    }
    return e;
}

/* nccl_post_pieces posts the sends (send) or receives of rows rows at p
 * (row bytes each) in P pieces, cut as both sides cut them (common/
 * nccl_pieces.h), in order on the link's stream. Between two posts the
 * previous one is seen through (stream 0: a non-blocking communicator
 * takes no call while one is in progress); the last is left to the
 * caller's wait. MOE_OK, or the error with the reason in msg. */
static moe_err nccl_post_pieces(moe_nccl_link *l, int send, uint8_t *p, int64_t rows, size_t row,
                                int P, int tmo, const int *up, char *msg, size_t msglen)
{
    moe_err e = MOE_OK;
    for (int i = 0; i < P && e == MOE_OK; i++) {
        const int64_t a = nccl_piece_first(rows, P, i);
        const size_t n = (size_t)(nccl_piece_first(rows, P, i + 1) - a) * row;
        if (i > 0)
            e = moe_nccl_wait(l, 0, tmo, up, NULL, NULL, msg, msglen);
        if (e == MOE_OK)
            e = moe_nccl_post(l, send, p + (size_t)a * row, n, msg, msglen);
    }
    return e;
}

/* lane_fail: the lane's error is the call's (returned, in ctl and the last
 * error); a closed lane (the cluster re-formed) makes the map stale, as
 * the coordinator's would */
static moe_err lane_fail(moe_reply *ctl, const char *method, moe_err qe, const char *msg, dp_req *r,
                         int *stale)
{
    ctl->err = qe;
    snprintf(ctl->message, sizeof(ctl->message), "%s", msg);
    moe__set_error("%s: %s: %s", method, moe_err_code(qe), msg);
    if (qe == MOE_EUNAVAIL && resp_was_answer(r))
        *stale = 1;
    return qe;
}

/* direct_call: the coordinator's control call of a data-plane request:
 * method {ctl pairs, direct: {H, ticket, generation, dtype, T}}; its
 * answer in *ctl */
static moe_err direct_call(moe_client *c, const char *method, const void *ctl_pairs, size_t ctl_len,
                           uint32_t nctl, int64_t H, uint64_t cid, uint64_t seq, uint64_t gen,
                           moe_dtype dt, int64_t T, moe_reply *ctl)
{
    mp_writer p;
    mp_writer_init(&p);
    mp_write_map(&p, nctl + 1);
    if (ctl_len)
        mp_write_raw(&p, ctl_pairs, ctl_len);
    mp_write_cstr(&p, "direct");
    mp_write_map(&p, 5);
    mp_write_cstr(&p, "H");
    mp_write_i64(&p, H);
    mp_write_cstr(&p, "ticket");
    mp_write_array(&p, 2);
    mp_write_u64(&p, cid);
    mp_write_u64(&p, seq);
    mp_write_cstr(&p, "generation");
    mp_write_u64(&p, gen);
    mp_write_cstr(&p, "dtype");
    mp_write_cstr(&p, moe_dtype_name(dt));
    mp_write_cstr(&p, "T");
    mp_write_i64(&p, T);
    moe_err e = p.failed ? MOE_ENOMEM : moe_call(c, method, p.buf, p.len, ctl);
    mp_writer_fini(&p);
    return e;
}

/* dp_nccl: dp_attempt on the NCCL path. x (in) and y (out), (T,H) of dt,
 * are device memory of one GPU; each rank's rows go over its worker's
 * communicator: data.rows {ticket, dtype, shape, nccl: comm, pieces?} on
 * nng, then ncclSend of the rows and, once that is done, ncclRecv of y,
 * posted before the answer comes: the worker sends y before it answers, so
 * y waits for no control round trip. The answer {y: {nccl: true, ...}} says
 * y came or is coming; an error answer means it never will: the link is
 * aborted (reopened by the next call). One call at a time on each link (its
 * mutex).
 * Pieces (a lane forward to a worker that takes them: nccl_pieces_choose):
 * x goes as P sends and y comes as P receives of rows, so that the worker
 * computes piece i while piece i+1's x arrives and piece i-1's y leaves.
 * No deadlock: on our stream the P sends come first, then the P receives;
 * the worker posts its P receives at once, then its sends in order, each
 * when its piece is computed - which needs only x's pieces. NCCL matches
 * each direction's operations in order, and both sides cut the rows alike,
 * so every send meets its receive and no side waits on an operation queued
 * behind one of its own that waits on the other side. */
static moe_err dp_nccl(moe_client *c, dp_map *m, const char *method, const void *ctl_pairs,
                       size_t ctl_len, uint32_t nctl, moe_dtype dt, const void *in, int64_t T,
                       int64_t H, void *out, moe_reply *ctl, int *stale, int ordered)
{
    const int W = m->W;
    const size_t es = moe_dtype_size(dt), nbytes = (size_t)T * (size_t)H * es;
    const uint64_t cid = moe_client_id(c), seq = moe__next_msgid(c);
    const char *auth = moe__auth(c);
    const int lane = !ordered && m->lane && W == 1 && nctl == 2 && !strcmp(method, "forward");
    const int tmo = moe__timeout_ms(c);
    int dev = nbytes ? moe_nccl_device_of(in) : -1;
    moe_err e = MOE_OK, derr = MOE_OK;
    char dmsg[400] = "";
    if (!moe_nccl_built()) {
        moe__set_error("%s: data path nccl: libmoe was built without CUDA", method);
        snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
        return MOE_EUNAVAIL;
    }
    for (int q = 0; q < W; q++)
        if (shard_first(T, W, q + 1) > shard_first(T, W, q) && !m->has_nccl[q]) {
            moe__set_error("%s: data path nccl: worker rank %d offers no NCCL path (not a CUDA "
                           "worker)",
                           method, q);
            snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
            return MOE_EUNAVAIL;
        }
    /* host rows (moectl, Python's NumPy arrays): staged through a device
     * buffer of GPU $MOE_NCCL_DEVICE, x then y */
    uint8_t *stage = NULL;
    void *host_out = NULL;
    if (nbytes && dev < 0 && moe_nccl_device_of(out) < 0) {
        dev = moe_nccl_stage_device();
        stage = moe_nccl_dev_alloc(dev, 2 * nbytes);
        if (!stage || moe_nccl_copy(stage, in, nbytes) != MOE_OK) {
            moe_nccl_dev_free(stage);
            moe__set_error("%s: data path nccl: no %zu bytes of GPU %d memory for host rows",
                           method, 2 * nbytes, dev);
            snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
            return MOE_ENOMEM;
        }
        in = stage;
        host_out = out;
        out = stage + nbytes;
    }
    if (!nbytes || dev < 0 || moe_nccl_device_of(out) != dev) {
        moe__set_error("%s: data path nccl: x and the output must both be device memory "
                       "(cudaMalloc) of one GPU, or both host memory",
                       method);
        snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
        return MOE_EINVAL;
    }
    dp_req *rq = calloc((size_t)W, sizeof(dp_req));
    int *held = calloc((size_t)W, sizeof(int)), *early = calloc((size_t)W, sizeof(int));
    int *xdone = calloc((size_t)W, sizeof(int));  /* x's send seen done (not pending) */
    int *ypost = calloc((size_t)W, sizeof(int));  /* y's receive posted (pending until y) */
    int *pieces = calloc((size_t)W, sizeof(int)); /* x and y of rank q travel in pieces[q] */
    if (!rq || !held || !early || !xdone || !ypost || !pieces) {
        free(rq), free(held), free(early), free(xdone), free(ypost), free(pieces);
        moe_nccl_dev_free(stage);
        return MOE_ENOMEM;
    }
    /* 0. the links, in rank order (one call at a time on each) */
    for (int q = 0; q < W && e == MOE_OK; q++) {
        if (shard_first(T, W, q + 1) == shard_first(T, W, q))
            continue;
        moe_nccl_link *l = &m->nccl[q];
        pthread_mutex_lock(&l->mu);
        held[q] = 1;
        if (l->open && l->device != dev)
            nccl_drop(c, m, q); /* rows on another GPU now */
        if (!l->open && (e = nccl_open(c, m, q, dev)) != MOE_OK)
            snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
    }
    /* 1. data.rows to each rank, then its rows on the communicator */
    for (int q = 0; q < W && e == MOE_OK; q++) {
        int64_t a = shard_first(T, W, q), rows = shard_first(T, W, q + 1) - a;
        if (rows == 0)
            continue;
        size_t off = (size_t)a * (size_t)H * es, n = (size_t)rows * (size_t)H * es;
        mp_writer w;
        nng_msg *msg = NULL;
        uint32_t msgid = moe__next_msgid(c);
        /* pieces: a lane forward's (the worker computes the rows alone) */
        pieces[q] =
            lane ? nccl_pieces_choose(n, rows, m->nccl[q].pieces_max, getenv("MOE_NCCL_PIECES"))
                 : 1;
        nccl_trace_mark(&m->nccl[q].trace, NT_START);
        nccl_trace_pieces(&m->nccl[q].trace, pieces[q]);
        mp_writer_init(&w);
        moe_rpc_write_request_head(&w, msgid, "data.rows");
        mp_write_map(&w, 5u + (auth ? 1u : 0u) + (lane ? 1u : 0u) + (pieces[q] > 1 ? 1u : 0u));
        if (auth) {
            mp_write_cstr(&w, "auth");
            mp_write_cstr(&w, auth);
        }
        write_rows_head(&w, cid, seq, tmo, lane ? ctl_pairs : NULL, ctl_len, m->gen, 0);
        mp_write_cstr(&w, "dtype");
        mp_write_cstr(&w, moe_dtype_name(dt));
        mp_write_cstr(&w, "shape");
        mp_write_array(&w, 2);
        mp_write_i64(&w, rows);
        mp_write_i64(&w, H);
        mp_write_cstr(&w, "nccl");
        mp_write_u64(&w, m->nccl[q].comm_id);
        if (pieces[q] > 1) { /* absent: one (an older worker knows no pieces) */
            mp_write_cstr(&w, "pieces");
            mp_write_i64(&w, pieces[q]);
        }
        e = msg_from_writer(&w, NULL, 0, &msg);
        mp_writer_fini(&w);
        if (e == MOE_OK)
            e = req_start(&rq[q], m->sock[q], msg, tmo);
        rq[q].msgid = msgid;
        if (e != MOE_OK)
            break;
        /* the answer's receive is posted now: a refusal can end the wait for x */
        nng_aio_wait(rq[q].aio);
        int rv = nng_aio_result(rq[q].aio);
        if (rv != 0) { /* the message is freed by req_finish (3) */
            e = moe__from_nng(rv);
            moe__set_error("%s: sending data.rows to worker rank %d: %s", method, q,
                           nng_strerror(rv));
            break;
        }
        nng_ctx_recv(rq[q].ctx, rq[q].aio);
        rq[q].recv_posted = 1;
        nccl_trace_mark(&m->nccl[q].trace, NT_ROWS_SENT);
        char nm[300];
        if ((e = nccl_post_pieces(&m->nccl[q], 1, (uint8_t *)in + off, rows, (size_t)H * es,
                                  pieces[q], tmo, &m->up[q], nm, sizeof(nm))) != MOE_OK) {
            moe__set_error("%s: worker rank %d: %s", method, q, nm);
            nccl_drop(c, m, q);
            break;
        }
        nccl_trace_mark(&m->nccl[q].trace, NT_X_POSTED);
    }
    /* x has left once every send is done; a worker that answers first
     * refused the rows (its communicator is dropped, the answer read in 3).
     * Each y's receive is posted as soon as its x is sent (the send no
     * longer ncclInProgress: the communicator takes the next call): the
     * worker sends y before answering, so y's transfer does not wait for
     * the answer. Pending until y comes: an error answer aborts the link. */
    for (int q = 0; q < W && e == MOE_OK; q++) {
        if (!rq[q].open)
            continue;
        int64_t a = shard_first(T, W, q), rows = shard_first(T, W, q + 1) - a;
        size_t off = (size_t)a * (size_t)H * es;
        char nm[300];
        const char *what = "sending x";
        /* answered first: an error, or x arrived a moment before */
        moe_err xe = nccl_await(&m->nccl[q], 1, tmo, &m->up[q], &rq[q], nm, sizeof(nm));
        if (xe == MOE_OK) {
            xdone[q] = 1;
            nccl_trace_mark(&m->nccl[q].trace, NT_X_DONE);
            what = "receiving y";
            xe = nccl_post_pieces(&m->nccl[q], 0, (uint8_t *)out + off, rows, (size_t)H * es,
                                  pieces[q], tmo, &m->up[q], nm, sizeof(nm));
            ypost[q] = xe == MOE_OK;
            if (ypost[q])
                nccl_trace_mark(&m->nccl[q].trace, NT_Y_POSTED);
        }
        if (xe != MOE_OK) {
            early[q] = 1; /* its answer (if any) says why */
            nccl_drop(c, m, q);
            if (derr == MOE_OK) {
                derr = xe;
                snprintf(dmsg, sizeof(dmsg), "worker rank %d: %s: %s", q, what, nm);
            }
        }
    }
    if (e == MOE_OK && derr != MOE_OK && !lane)
        e = derr; /* no control call: the others' rows are cancelled below */
    /* 2. the control call (not on the lane) */
    moe_rpc_response gone = {0}; /* the ranks the coordinator's error names gone */
    if (e == MOE_OK && !lane) {
        e = direct_call(c, method, ctl_pairs, ctl_len, nctl, H, cid, seq, m->gen, dt, T, ctl);
        if (e == MOE_EUNAVAIL && !ctl->transport)
            *stale = 1;
        gone = gone_ranks(ctl, e);
    }
    /* 3. the answers, then y on each communicator (its receive posted in 1,
     * else here once x's send has left: the call failed before 1 posted it;
     * the answer usually comes while y is on its way) */
    for (int q = 0; q < W; q++) {
        if (!rq[q].open)
            continue;
        int down = e != MOE_OK && rank_down(m, &gone, q);
        if (e != MOE_OK && !down && !early[q] && !send_cancel(c, m, q, cid, seq))
            down = 1;
        moe_rpc_response resp;
        char msg[400];
        int64_t a = shard_first(T, W, q), rows = shard_first(T, W, q + 1) - a;
        size_t off = (size_t)a * (size_t)H * es;
        moe_err qe = req_finish(&rq[q], down, e != MOE_OK || early[q] ? DP_GRACE_MS : 0, &resp, msg,
                                sizeof(msg));
        if (qe == MOE_OK && early[q]) {
            qe = derr;
            snprintf(msg, sizeof(msg), "%s", dmsg);
        }
        if (qe == MOE_OK) {
            mp_reader rd = resp.result;
            const uint8_t *st = NULL;
            size_t stlen = 0;
            nccl_trace_mark(&m->nccl[q].trace, NT_ANSWERED);
            qe = read_y(&rd, dt, rows, H, NULL, 0, 0, 2, &st, &stlen);
            if (qe != MOE_OK) {
                snprintf(msg, sizeof(msg), "malformed answer from worker %d", q);
                nccl_drop(c, m, q); /* y may be on its way */
            } else if ((!ypost[q] &&
                        ((qe = moe_nccl_wait(&m->nccl[q], 0, tmo, &m->up[q], NULL, NULL, msg,
                                             sizeof(msg))) != MOE_OK ||
                         (qe = nccl_post_pieces(&m->nccl[q], 0, (uint8_t *)out + off, rows,
                                                (size_t)H * es, pieces[q], tmo, &m->up[q], msg,
                                                sizeof(msg))) != MOE_OK)) ||
                       (qe = moe_nccl_wait(&m->nccl[q], 1, tmo, &m->up[q], NULL, NULL, msg,
                                           sizeof(msg))) != MOE_OK) {
                nccl_drop(c, m, q);
            } else {
                nccl_trace_mark(&m->nccl[q].trace, NT_Y_DONE);
                nccl_trace_end(&m->nccl[q].trace);
                if (lane)
                    qe = lane_reply(ctl, st, stlen, msg, sizeof(msg));
            }
        } else {
            /* an error answer, or none: the worker sends no y. y's receive
             * was posted (1), or x was posted and never seen sent (the
             * worker refused it or the call failed before the wait): an
             * operation that can never end is pending on the communicator,
             * which takes nothing more: aborted, the next call opens another */
            if (!early[q] && (ypost[q] || !xdone[q]) && m->nccl[q].open) {
                if (down) /* dead or unreachable: nothing to tell it, no grace to wait */
                    moe_nccl_abort(&m->nccl[q]);
                else
                    nccl_drop(c, m, q);
            }
            if (lane && e == MOE_OK) {
                e = lane_fail(ctl, method, qe, msg, &rq[q], stale);
                qe = MOE_OK;
            }
        }
        if (qe != MOE_OK && derr == MOE_OK) {
            derr = qe;
            snprintf(dmsg, sizeof(dmsg), "worker rank %d: %s", q, msg);
        }
        req_close(&rq[q]);
    }
    for (int q = 0; q < W; q++)
        if (held[q])
            pthread_mutex_unlock(&m->nccl[q].mu);
    free(rq), free(held), free(early), free(xdone), free(ypost), free(pieces);
    if (e == MOE_OK && derr != MOE_OK) {
        e = derr;
        moe__set_error("%s: %s: %s", method, moe_err_code(e), dmsg);
        snprintf(ctl->message, sizeof(ctl->message), "%s", dmsg);
    }
    if (stage) {
        if (e == MOE_OK && moe_nccl_copy(host_out, out, nbytes) != MOE_OK) {
            e = MOE_EINTERNAL;
            moe__set_error("%s: data path nccl: copying y back from GPU %d failed", method, dev);
            snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
        }
        moe_nccl_dev_free(stage);
    }
    return e;
}

/* fanout_staged: a fan-out whose rows are in GPU memory (moe_cuda_register).
 * The fan-out sends host rows, so a decode batch is staged through host
 * memory with two small copies (an engine's hidden states on its GPU then
 * pay them instead of the ordered road), when both buffers are device
 * memory of this process as CUDA itself says (a registered pointer is the
 * caller's word only). 1 with the call's result in *e; 0 when it cannot be
 * staged here (not device memory, no CUDA): the ordered road then, where
 * the workers read the rows. */
static int fanout_staged(moe_client *c, struct moe_dp *dp, dp_map *m, const char *method,
                         const void *ctl_pairs, size_t ctl_len, moe_dtype dt, const void *in,
                         int64_t T, int64_t H, void *out, moe_reply *ctl, int *stale, moe_err *e)
{
    const size_t nbytes = (size_t)T * (size_t)H * moe_dtype_size(dt);
    const uint8_t *ib = in, *ob = out;
    if (moe_nccl_device_of(ib) < 0 || moe_nccl_device_of(ib + nbytes - 1) < 0 ||
        moe_nccl_device_of(ob) < 0 || moe_nccl_device_of(ob + nbytes - 1) < 0)
        return 0;
    void *hin = malloc(nbytes), *hout = malloc(nbytes);
    int staged = hin && hout && moe_nccl_copy(hin, in, nbytes) == MOE_OK;
    if (staged) {
        *e = dp_fanout(c, dp, m, method, ctl_pairs, ctl_len, dt, hin, T, H, hout, ctl, stale);
        if (*e == MOE_OK && moe_nccl_copy(out, hout, nbytes) != MOE_OK) {
            *e = ctl->err = MOE_EINTERNAL;
            snprintf(ctl->message, sizeof(ctl->message),
                     "%s: copying y into the caller's GPU buffer failed", method);
        }
    }
    free(hin);
    free(hout);
    return staged;
}

/* MOE_DIRECT_TRACE=N: where an ordered-road call's time goes in libmoe
 * (common/step_trace.h): the rows sent to the workers, the coordinator's
 * answer (the job ordered and run), the workers' answers read, y copied
 * out */
static step_trace dr_tr = {
    "MOE_DIRECT_TRACE", "libmoe ordered road", 4, {"post", "order", "answers", "out"}, -1, 0, {0}};

/* dp_attempt: one try of a data-plane call on map m. ordered: never the
 * lane or the fan-out - the coordinator orders the job (the retry of a
 * forward they could not place) */
static moe_err dp_attempt(moe_client *c, struct moe_dp *dp, dp_map *m, const char *method,
                          const void *ctl_pairs, size_t ctl_len, uint32_t nctl, moe_dtype dt,
                          const void *in, int64_t T, int64_t H, void *out, moe_reply *ctl,
                          int *stale, int ordered)
{
    const int W = m->W;
    const size_t es = moe_dtype_size(dt), nbytes = (size_t)T * (size_t)H * es;
    const uint64_t cid = moe_client_id(c), seq = moe__next_msgid(c);
    const char *auth = moe__auth(c);
    dp_req *rq = calloc((size_t)W, sizeof(dp_req));
    moe_err e = MOE_OK, derr = MOE_OK;
    char dmsg[400] = "";
    /* the lane: an inference forward (params model and layer only) on a
     * cluster of one worker goes to the worker alone, which runs it */
    const int lane = !ordered && m->lane && W == 1 && nctl == 2 && !strcmp(method, "forward");
    if (!rq)
        return MOE_ENOMEM;
    if (moe__data_path(c) == MOE_PATH_NCCL) { /* rows in GPU memory, over NCCL */
        free(rq);
        return dp_nccl(c, m, method, ctl_pairs, ctl_len, nctl, dt, in, T, H, out, ctl, stale,
                       ordered);
    }
    /* a small inference forward on several workers: fanned out, while
     * every worker's connection is up (a request to one that is down would
     * wait for it until the call's timeout; the ordered road asks the
     * coordinator, which knows) */
    int all_up = 1;
    for (int q = 0; q < W; q++)
        all_up &= __atomic_load_n(&m->up[q], __ATOMIC_RELAXED) > 0;
    const int on_gpu = moe_dp_on_device(c, in, nbytes) || moe_dp_on_device(c, out, nbytes);
    if (!ordered && m->fanout && all_up && nctl == 2 && !strcmp(method, "forward") && T >= 1 &&
        T <= fanout_rows(m) && (dt == MOE_F32 || dt == MOE_BF16) &&
        moe__data_path(c) != MOE_PATH_BULK) {
        if (!on_gpu) {
            free(rq);
            return dp_fanout(c, dp, m, method, ctl_pairs, ctl_len, dt, in, T, H, out, ctl, stale);
        }
        moe_err fe;
        if (fanout_staged(c, dp, m, method, ctl_pairs, ctl_len, dt, in, T, H, out, ctl, stale,
                          &fe)) {
            free(rq);
            return fe;
        }
    }
    double t_tr = 0;
    step_trace_begin(&dr_tr, &t_tr);
    /* x and out in the application's shared buffers: no copy at all */
    int ux = nbytes && m->shm ? ubuf_find(dp, in, nbytes) : -1;
    int uy = ux >= 0 ? ubuf_find(dp, out, nbytes) : -1;
    int zero_copy = uy >= 0 && ubuf_attached(c, dp, m, ux) && ubuf_attached(c, dp, m, uy);
    if (on_gpu && !zero_copy) { /* GPU memory is never read or written here */
        char why[400];
        snprintf(why, sizeof(why), "%s", uy >= 0 ? moe_last_error() : "");
        free(rq);
        moe__set_error("%s: rows on a GPU need x and the output both inside registered buffers "
                       "(moe_cuda_register / moe_buffer_alloc) and every worker on this host%s%s",
                       method, why[0] ? ": " : "", why);
        return MOE_EINVAL;
    }
    moe_err shm_why = MOE_OK;
    dp_shm *b = nbytes && !zero_copy ? shm_get(c, dp, m, 2 * nbytes, &shm_why) : NULL;
    if (!b && shm_why == MOE_EUNAVAIL) {
        /* a worker of this map went away: nothing was sent, so the call
         * may go again on a newer map (moe_dp_call does where the cluster
         * re-formed since); else unavailable (never a silent switch of a
         * path asked for by name) */
        *stale = 1;
        char why[400];
        snprintf(why, sizeof(why), "%s", moe_last_error());
        free(rq);
        moe__set_error("%s: a worker could not attach the shared-memory buffer: %s", method, why);
        return MOE_EUNAVAIL;
    }
    if (!b && !zero_copy && moe__data_path(c) == MOE_PATH_SHM && nbytes) {
        free(rq);
        moe__set_error("%s: no shared-memory buffer could be made (see the workers' logs)", method);
        return MOE_ENOMEM;
    }
    if (b)
        par_memcpy(b->base, in, nbytes);
    /* 0. large rows for workers with a bulk endpoint: on their own
     * connections, all at once (each waits for its ack before data.rows);
     * bx made where the first one goes (a decode call never needs it) */
    moe_bulk_xfer *bx = NULL;
    for (int q = 0; q < W && e == MOE_OK && !zero_copy && !b; q++) {
        int64_t a = shard_first(T, W, q), rows = shard_first(T, W, q + 1) - a;
        size_t off = (size_t)a * (size_t)H * es, n = (size_t)rows * (size_t)H * es;
        if (rows == 0 || !use_bulk(c, m, q, n))
            continue;
        if (!bx && !(bx = calloc((size_t)W, sizeof(moe_bulk_xfer)))) {
            free(rq);
            shm_put(dp, b);
            return MOE_ENOMEM;
        }
        if (!m->bulk[q].url[0]) { /* asked for by name: never replaced in silence */
            e = MOE_EUNAVAIL;
            moe__set_error("%s: data path bulk: worker rank %d offers no bulk endpoint "
                           "(--bulk-listen off)",
                           method, q);
            snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
            break;
        }
        moe_bulk_xfer *t = &bx[q];
        t->pool = &m->bulk[q];
        t->auth = auth;
        t->cid = cid;
        t->seq = seq;
        t->dt = dt;
        t->rows = rows;
        t->cols = H;
        t->x = (const uint8_t *)in + off;
        t->y = (uint8_t *)out + off;
        t->timeout_ms = moe__timeout_ms(c);
        t->parts = bulk_parts(n);
        e = moe_bulk_start(t);
    }
    /* 1. the rows, to their workers (rank r gets rows [T*r/W, T*(r+1)/W)) */
    for (int q = 0; q < W && e == MOE_OK; q++) {
        int64_t a = shard_first(T, W, q), rows = shard_first(T, W, q + 1) - a;
        if (rows == 0)
            continue;
        size_t off = (size_t)a * (size_t)H * es, n = (size_t)rows * (size_t)H * es;
        if (bulk_started(bx, q) && (e = moe_bulk_wait_ack(&bx[q])) != MOE_OK) {
            moe__set_error("%s: bulk rows to worker rank %d: %s: %s", method, q, moe_err_code(e),
                           bx[q].msg);
            snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
            break;
        }
        mp_writer w;
        nng_msg *msg = NULL;
        uint32_t msgid = moe__next_msgid(c);
        /* on the lane, rows in shared memory: the request goes through a
         * ring (its params only; the ring's connection is authenticated) */
        moe_ring *ring = lane && (zero_copy || b) ? ring_get(c, dp, m, 0, MOE_RING_BYTES) : NULL;
        mp_writer_init(&w);
        if (!ring)
            moe_rpc_write_request_head(&w, msgid, "data.rows");
        mp_write_map(&w, (zero_copy ? 8u
                          : b       ? 7u
                                    : 3u) +
                             (auth && !ring ? 1u : 0u) + (lane ? 1u : 0u));
        /* (bulk: ticket, deadline_ms, bulk = 3 pairs, as inline) */
        if (auth && !ring) {
            mp_write_cstr(&w, "auth");
            mp_write_cstr(&w, auth);
        }
        /* on the lane: run {model, layer} as the caller gave them, and the map's generation */
        write_rows_head(&w, cid, seq, moe__timeout_ms(c), lane ? ctl_pairs : NULL, ctl_len, m->gen,
                        0);
        if (zero_copy) {
            size_t xo = (size_t)((const uint8_t *)in - dp->ubuf[ux].base) + off;
            size_t yo = (size_t)((uint8_t *)out - dp->ubuf[uy].base) + off;
            mp_write_cstr(&w, "dtype");
            mp_write_cstr(&w, moe_dtype_name(dt));
            mp_write_cstr(&w, "shape");
            mp_write_array(&w, 2);
            mp_write_i64(&w, rows);
            mp_write_i64(&w, H);
            mp_write_cstr(&w, "region");
            mp_write_u64(&w, m->uregion[(size_t)ux * W + q]);
            mp_write_cstr(&w, "x_offset");
            mp_write_u64(&w, xo);
            mp_write_cstr(&w, "y_region");
            mp_write_u64(&w, m->uregion[(size_t)uy * W + q]);
            mp_write_cstr(&w, "y_offset");
            mp_write_u64(&w, yo);
            e = ring ? MOE_OK : msg_from_writer(&w, NULL, 0, &msg);
        } else if (b) {
            mp_write_cstr(&w, "dtype");
            mp_write_cstr(&w, moe_dtype_name(dt));
            mp_write_cstr(&w, "shape");
            mp_write_array(&w, 2);
            mp_write_i64(&w, rows);
            mp_write_i64(&w, H);
            mp_write_cstr(&w, "region");
            mp_write_u64(&w, b->region[q]);
            mp_write_cstr(&w, "x_offset");
            mp_write_u64(&w, off);
            mp_write_cstr(&w, "y_offset");
            mp_write_u64(&w, nbytes + off);
            e = ring ? MOE_OK : msg_from_writer(&w, NULL, 0, &msg);
        } else if (bulk_started(bx, q)) { /* the rows are at the worker already */
            mp_write_cstr(&w, "bulk");
            mp_write_bool(&w, true);
            e = msg_from_writer(&w, NULL, 0, &msg);
        } else {
            const int64_t shape[2] = {rows, H};
            mp_write_cstr(&w, "x");
            moe_tensor_write_head(&w, dt, 2, shape);
            e = msg_from_writer(&w, (const uint8_t *)in + off, n, &msg);
        }
        if (ring) {
            if (e == MOE_OK)
                e = w.failed ? MOE_ENOMEM : moe_ring_post(ring, w.buf, w.len);
            if (e == MOE_OK) {
                req_on_ring(&rq[q], ring, &m->up[q], moe__timeout_ms(c));
            } else {
                __atomic_store_n(&ring->busy, 0, __ATOMIC_RELEASE);
            }
            mp_writer_fini(&w);
            continue;
        }
        mp_writer_fini(&w);
        if (e == MOE_OK)
            e = req_start_chained(&rq[q], m->sock[q], msg, moe__timeout_ms(c));
        rq[q].msgid = msgid;
    }
    step_trace_stamp(&dr_tr, 0, &t_tr);
    /* 2. the control call: the coordinator orders the job and names the
     * ticket to every worker (not on the lane: the worker runs it) */
    moe_rpc_response gone = {0}; /* the ranks the coordinator's error names gone */
    if (e == MOE_OK && !lane) {
        e = direct_call(c, method, ctl_pairs, ctl_len, nctl, H, cid, seq, m->gen, dt, T, ctl);
        /* the coordinator itself said unavailable (a stale map, a lost
         * worker): the job did not complete; a new map may serve a retry */
        if (e == MOE_EUNAVAIL && !ctl->transport)
            *stale = 1;
        gone = gone_ranks(ctl, e);
    }
    step_trace_stamp(&dr_tr, 1, &t_tr);
    /* 3. the answers: the rows back from each worker (always awaited: a
     * worker may still write into our buffer until it has answered) */
    int poisoned = 0;
    for (int q = 0; q < W; q++) {
        if (!rq[q].open)
            continue;
        /* the job failed: a live worker drops the rows (data.cancel); for
         * one whose connection is down, or that the coordinator says is
         * gone, nothing will come - stop waiting, and never reuse a shared
         * buffer it may still write */
        int down = e != MOE_OK && rank_down(m, &gone, q);
        if (e != MOE_OK && !down && !send_cancel(c, m, q, cid, seq))
            down = 1; /* connected but not answering: do not wait for it either */
        poisoned |= down;
        moe_rpc_response resp;
        char msg[400];
        int64_t a = shard_first(T, W, q), rows = shard_first(T, W, q + 1) - a;
        size_t off = (size_t)a * (size_t)H * es;
        /* after a failed job, a worker that does not answer within the grace
         * (stopped, hung) is given up on; its buffer is not reused */
        moe_err qe =
            req_finish(&rq[q], down, e != MOE_OK ? DP_GRACE_MS : 0, &resp, msg, sizeof(msg));
        poisoned |= rq[q].timed_out;
        if (qe == MOE_OK) {
            mp_reader rd = resp.result;
            uint64_t rg = zero_copy ? m->uregion[(size_t)uy * W + q] : b ? b->region[q] : 0;
            uint64_t yo =
                zero_copy ? (uint64_t)((uint8_t *)out - dp->ubuf[uy].base) + off : nbytes + off;
            const uint8_t *st = NULL;
            size_t stlen = 0;
            qe = read_y(&rd, dt, rows, H, (uint8_t *)out + off, rg, yo, bulk_started(bx, q), &st,
                        &stlen);
            if (qe != MOE_OK)
                snprintf(msg, sizeof(msg), "malformed rows from worker %d", q);
            else if (bulk_started(bx, q) && (qe = moe_bulk_finish(&bx[q], 0)) != MOE_OK)
                snprintf(msg, sizeof(msg), "%s", bx[q].msg); /* y did not come in bulk */
            else if (lane)
                qe = lane_reply(ctl, st, stlen, msg, sizeof(msg));
        } else if (lane && e == MOE_OK) {
            e = lane_fail(ctl, method, qe, msg, &rq[q], stale);
            qe = MOE_OK;
        }
        if (qe != MOE_OK && derr == MOE_OK) {
            derr = qe;
            snprintf(dmsg, sizeof(dmsg), "worker rank %d: %s", q, msg);
        }
        req_close(&rq[q]);
    }
    step_trace_stamp(&dr_tr, 2, &t_tr);
    for (int q = 0; q < W; q++) /* not answered in bulk: the call failed, the connection shut */
        if (bulk_started(bx, q))
            (void)moe_bulk_finish(&bx[q], 1);
    free(bx);
    free(rq);
    if (e == MOE_OK && derr != MOE_OK) {
        e = derr;
        moe__set_error("%s: %s: %s", method, moe_err_code(e), dmsg);
        snprintf(ctl->message, sizeof(ctl->message), "%s", dmsg);
    }
    if (e == MOE_OK && b)
        par_memcpy(out, b->base + nbytes, nbytes);
    step_trace_stamp(&dr_tr, 3, &t_tr);
    step_trace_end(&dr_tr);
    if (poisoned && b)
        shm_drop(dp, b);
    else
        shm_put(dp, b);
    return e;
}

moe_err moe_dp_call(moe_client *c, const char *method, const void *ctl_pairs, size_t ctl_len,
                    uint32_t nctl, moe_dtype dt, const void *in, int64_t T, int64_t H, void *out,
                    moe_reply *ctl)
{
    struct moe_dp *dp = moe__dp(c);
    memset(ctl, 0, sizeof(*ctl));
    if (!dp)
        return MOE_ENOMEM;
    if (dp->no_dp && moe__data_path(c) == MOE_PATH_AUTO)
        return MOE_ENOMETHOD;
    moe_reply first; /* the first attempt's answer, while a retry is tried */
    moe_err first_e = MOE_OK;
    uint64_t first_gen = 0;
    for (int attempt = 0;; attempt++) {
        dp_map *m = NULL;
        moe_err e = map_get(c, dp, &m);
        if (attempt == 1 && (e != MOE_OK || m->gen == first_gen)) {
            /* no newer map (not ready again yet, or the same generation):
             * the first attempt's answer stands */
            if (e == MOE_OK)
                map_put(dp, m);
            *ctl = first;
            return first_e;
        }
        if (attempt == 1)
            moe_reply_free(&first);
        if (e == MOE_ENOMETHOD && moe__data_path(c) == MOE_PATH_AUTO)
            dp->no_dp = 1;
        if ((e == MOE_ENOMETHOD || e == MOE_EUNAVAIL) && moe__data_path(c) == MOE_PATH_AUTO)
            return MOE_ENOMETHOD; /* the coordinator path answers (or explains) */
        if (e == MOE_ENOMETHOD || e == MOE_EUNAVAIL) {
            /* a path asked for by name is never replaced by another in silence */
            moe__set_error("%s: data path %s: %s", method,
                           moe__data_path(c) == MOE_PATH_SHM    ? "shm"
                           : moe__data_path(c) == MOE_PATH_BULK ? "bulk"
                           : moe__data_path(c) == MOE_PATH_NCCL ? "nccl"
                                                                : "socket",
                           e == MOE_ENOMETHOD ? "this cluster offers no data plane (workers "
                                                "with --client-listen off, or an older "
                                                "coordinator)"
                                              : "the cluster is not ready");
            snprintf(ctl->message, sizeof(ctl->message), "%s", moe_last_error());
            return MOE_EUNAVAIL;
        }
        if (e != MOE_OK)
            return e;
        int stale = 0;
        e = dp_attempt(c, dp, m, method, ctl_pairs, ctl_len, nctl, dt, in, T, H, out, ctl, &stale,
                       0);
        if (e == MOE_ENOTFOUND && nctl == 2 && !strcmp(method, "forward") &&
            (m->lane || m->fanout)) {
            /* an inference forward the lane or the fan-out could not place:
             * they run outside the coordinator's job order, and a worker
             * refuses a model it does not hold, or holds but has not seen
             * settled (its first ordered forward, or a checkpoint's commit,
             * since it was built: after a re-formation its checkpoint may
             * still be on its way). Once more through the ordered road of
             * the same transport: the coordinator queues it behind the
             * model's re-creation and restore, or answers not_found for a
             * model that does not exist. */
            moe_reply_free(ctl);
            memset(ctl, 0, sizeof(*ctl));
            stale = 0;
            e = dp_attempt(c, dp, m, method, ctl_pairs, ctl_len, nctl, dt, in, T, H, out, ctl,
                           &stale, 1);
        }
        if (stale || e == MOE_EUNAVAIL)
            map_mark_stale(dp, m); /* ask for the map again next time */
        uint64_t gen = m->gen;
        map_put(dp, m);
        if (!stale || attempt == 1)
            return e;
        /* once more if the cluster is at another generation now */
        first = *ctl;
        first_e = e;
        first_gen = gen;
        memset(ctl, 0, sizeof(*ctl));
    }
}

static double dp_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

moe_err moe_dp_nccl_floor(moe_client *c, int rank, void *dev, size_t n, int iters, double *seconds)
{
    struct moe_dp *dp = moe__dp(c);
    dp_map *m = NULL;
    char msg[400];
    *seconds = 0;
    if (!dp || moe__data_path(c) != MOE_PATH_NCCL || iters < 1 || !n) {
        moe__set_error("moe_nccl_floor: a client on data path nccl, n > 0 and iters > 0");
        return MOE_EINVAL;
    }
    moe_err e = map_get(c, dp, &m);
    if (e != MOE_OK) {
        moe__set_error("moe_nccl_floor: no data plane map: %s", moe_err_code(e));
        return e;
    }
    int d = moe_nccl_device_of(dev);
    if (rank < 0 || rank >= m->W || !m->has_nccl[rank] || d < 0) {
        map_put(dp, m);
        moe__set_error("moe_nccl_floor: rank %d is not a CUDA worker of %d, or the buffer is not "
                       "device memory",
                       rank, m->W);
        return MOE_EINVAL;
    }
    moe_nccl_link *l = &m->nccl[rank];
    double *t = calloc((size_t)iters, sizeof(double));
    pthread_mutex_lock(&l->mu);
    if (l->open && l->device != d)
        nccl_drop(c, m, rank);
    if (!t)
        e = MOE_ENOMEM;
    else if (!l->open)
        e = nccl_open(c, m, rank, d);
    dp_req rq;
    memset(&rq, 0, sizeof(rq));
    if (e == MOE_OK) {
        mp_writer w;
        nng_msg *mm = NULL;
        const char *auth = moe__auth(c);
        uint32_t msgid = moe__next_msgid(c);
        mp_writer_init(&w);
        moe_rpc_write_request_head(&w, msgid, "data.nccl_echo");
        mp_write_map(&w, 4u + (auth ? 1u : 0u));
        if (auth) {
            mp_write_cstr(&w, "auth");
            mp_write_cstr(&w, auth);
        }
        mp_write_cstr(&w, "comm");
        mp_write_u64(&w, l->comm_id);
        mp_write_cstr(&w, "bytes");
        mp_write_u64(&w, n);
        mp_write_cstr(&w, "rounds");
        mp_write_i64(&w, iters);
        mp_write_cstr(&w, "deadline_ms");
        mp_write_i64(&w, moe__timeout_ms(c));
        e = msg_from_writer(&w, NULL, 0, &mm);
        mp_writer_fini(&w);
        if (e == MOE_OK)
            e = req_start(&rq, m->sock[rank], mm, moe__timeout_ms(c));
        rq.msgid = msgid;
        if (e == MOE_OK) { /* the answer's receive is posted now: a refusal ends the waits */
            nng_aio_wait(rq.aio);
            int rv = nng_aio_result(rq.aio);
            if (rv != 0) { /* the message is freed by req_finish */
                e = moe__from_nng(rv);
                moe__set_error("moe_nccl_floor: sending data.nccl_echo: %s", nng_strerror(rv));
            } else {
                nng_ctx_recv(rq.ctx, rq.aio);
                rq.recv_posted = 1;
            }
        }
    }
    for (int i = 0; i < iters && e == MOE_OK; i++) {
        double t0 = dp_now_s();
        /* a non-blocking communicator takes its next call only once the
         * last one left ncclInProgress: the send is seen through its
         * enqueue (stream 0) before the receive is posted */
        if ((e = moe_nccl_post(l, 1, dev, n, msg, sizeof(msg))) == MOE_OK &&
            (e = nccl_await(l, 0, moe__timeout_ms(c), &m->up[rank], &rq, msg, sizeof(msg))) ==
                MOE_OK &&
            (e = moe_nccl_post(l, 0, dev, n, msg, sizeof(msg))) == MOE_OK)
            e = nccl_await(l, 1, moe__timeout_ms(c), &m->up[rank], &rq, msg, sizeof(msg));
        t[i] = dp_now_s() - t0;
        if (e != MOE_OK) {
            moe__set_error("moe_nccl_floor: %s", msg);
            nccl_drop(c, m, rank);
        }
    }
    if (rq.open) {
        moe_rpc_response resp;
        moe_err qe =
            req_finish(&rq, e != MOE_OK, e != MOE_OK ? DP_GRACE_MS : 0, &resp, msg, sizeof(msg));
        if (e == MOE_OK && qe != MOE_OK) {
            e = qe;
            moe__set_error("moe_nccl_floor: data.nccl_echo: %s", msg);
        }
        req_close(&rq);
    }
    pthread_mutex_unlock(&l->mu);
    if (e == MOE_OK) {
        qsort(t, (size_t)iters, sizeof(double), cmp_double);
        *seconds = t[iters / 2];
    }
    free(t);
    map_put(dp, m);
    return e;
}
