/* nccl_client.c - a client's rows over NCCL; see nccl_client.h. */
#include "worker/nccl_client.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "common/nccl_pieces.h"
#include "common/params.h"

#define WNC_MAX_PER_PIPE 4
#define WNC_ID_BYTES     128               /* sizeof(ncclUniqueId) */
#define WNC_MAX_BYTES    ((size_t)1 << 34) /* one request's x: 16 GiB at most */
#define WNC_SEND_MIN_MS  5000              /* y may take this long at least */
#define WNC_SPIN_NS      (20ull * 1000000) /* after x: y's send is awaited awake this long */
#define WNC_SPIN_NEXT_NS (2ull * 1000000)  /* after y: the next x is awaited awake this long */
#define WNC_KEEP         256               /* requests whose phase times are kept */

/* refuse: the reply to data.nccl_open where this worker has no GPU */
static const char wnc_no_gpu[] =
    "this worker has no GPU (backend cpu, or built without CUDA): it offers no NCCL path; send "
    "the rows on the socket, shm or bulk path (dataplane.info says nccl: false)";

#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "kernels/cuda/kcu_abort.h"

_Static_assert(sizeof(ncclUniqueId) == WNC_ID_BYTES, "ncclUniqueId size");

enum { WNC_RECV_X = 1, WNC_SEND_Y, WNC_ECHO };

/* wnc_job: one transfer, in the order the client posts its side. */
typedef struct wnc_job {
    int kind;
    dp_ticket *tk; /* RECV_X: owned until filed (or answered and freed) */
    dp_run run;    /* RECV_X: the lane's run, when has_run */
    int has_run;
    int piece, pieces; /* RECV_X: pieces (x's receives); SEND_Y: this one's of y's */
    size_t n;          /* bytes of x, or of y (this piece) */
    const void *ydev;  /* SEND_Y: y (n bytes) in the comm's buffer */
    rpc_call *echo;    /* ECHO: data.nccl_echo, answered when its rounds are done */
    int rounds;        /* ECHO: receive n bytes and send them back, this many times */
    uint64_t deadline_ns;
    uint64_t
        queued_ns; /* RECV_X: when data.rows queued it; SEND_Y: when the forward handed y over */
    uint64_t picked_ns; /* when this thread took it */
    struct wnc_job *next;
} wnc_job;

struct wnc {
    uint64_t id;
    uint32_t pipe; /* the connection it was opened on */
    dp_table *t;
    int device;           /* this worker's GPU */
    int open_ms;          /* bound on the communicator's initialisation */
    int refs;             /* its thread's, and each ticket's (under t->mu) */
    int dead;             /* abort asked: connection closed, nccl_close, stopping (atomic) */
    int failed;           /* no new request is taken (under t->mu) */
    wnc_job *head, *tail; /* queued transfers (under t->mu) */
    pthread_cond_t cv;    /* a job was queued, or dead */
    uint8_t uid[WNC_ID_BYTES];
    /* the thread's own */
    ncclComm_t comm;
    cudaStream_t stream;
    dp_region *buf; /* (cap bytes, device) x at 0, y at n; the thread's reference */
    size_t cap;
    cudaEvent_t ev[NCCL_PIECES_MAX]; /* recorded behind x's receive of each piece */
    int nev;                         /* of them created */
    /* x's pieces received on this communicator so far, all requests
     * (atomic: the compute thread reads it, wnc_x_piece_wait), and x's
     * receive failed after its ticket was filed (atomic, sticky: the
     * thread ends, the communicator is aborted) */
    uint64_t xpieces;
    int xfail;
    /* where a request's time goes (the thread's; logged when it closes):
     * x's receive from its post to its last piece in (the client's send
     * and the control message's way included), x in (the first piece: the
     * ticket is filed) -> y handed over (the last piece's: the ticket's
     * hand-in, the forwards, their statistics), y handed over -> ncclSend
     * posted (this thread's wake), y's send (the last piece's); sums in ns
     * over nreq requests */
    uint64_t xdone_ns, nx, nreq, sum_x, sum_mid, sum_hand, sum_y;
    /* the same per request, for medians: [0] x queued -> taken by this
     * thread, [1] x received from its post, [2] mid, [3] hand, [4] y sent
     * (us), [5] pieces; cur holds this request's [0], [1] and pieces until
     * its y is sent */
    int32_t keep[WNC_KEEP][6], cur[3];
    uint32_t nkeep;
    struct wnc *next; /* in t->wncs */
};

static uint64_t wnc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void wnc_pause(int *spins)
{
    if ((*spins)++ < 2000) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
}

/* wnc_poll waits for NCCL result r (ncclInProgress: the non-blocking
 * communicator is still at it) and, with stream, for the stream (ev: for
 * the work queued ahead of that event only): until deadline_ns, NCCL's
 * async error, or dead. MOE_OK or MOE_EUNAVAIL / MOE_ETIMEDOUT with the
 * reason in err. */
static moe_err wnc_poll(struct wnc *x, ncclResult_t r, int stream, cudaEvent_t ev,
                        uint64_t deadline_ns, const char *what, char *err, size_t errlen)
{
    int spins = 0;
    for (;;) {
        if (__atomic_load_n(&x->dead, __ATOMIC_ACQUIRE)) {
            snprintf(err, errlen,
                     "%s: aborted (the client's connection closed or the "
                     "communicator was closed)",
                     what);
            return MOE_EUNAVAIL;
        }
        if (r != ncclSuccess && r != ncclInProgress) {
            snprintf(err, errlen, "%s: %s (%s)", what, ncclGetErrorString(r),
                     x->comm ? ncclGetLastError(x->comm) : "");
            return MOE_EUNAVAIL;
        }
        if (r == ncclSuccess && !stream)
            return MOE_OK;
        if (r == ncclSuccess) {
            cudaError_t ce = ev ? cudaEventQuery(ev) : cudaStreamQuery(x->stream);
            if (ce == cudaSuccess)
                return MOE_OK;
            if (ce != cudaErrorNotReady) {
                snprintf(err, errlen, "%s: %s", what, cudaGetErrorString(ce));
                return MOE_EUNAVAIL;
            }
        }
        if (wnc_now_ns() > deadline_ns) {
            snprintf(err, errlen, "%s: not done before the deadline (client gone or stalled)",
                     what);
            return MOE_ETIMEDOUT;
        }
        wnc_pause(&spins);
        ncclResult_t st = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(x->comm, &st);
        if (q != ncclSuccess)
            r = q;
        else if (r == ncclInProgress || st != ncclInProgress)
            r = st; /* still in progress, done, or the communicator's error */
    }
}

/* wnc_buffer: the comm's device buffer holds need bytes (thread). */
static moe_err wnc_buffer(struct wnc *x, size_t need, char *err, size_t errlen)
{
    if (x->buf && x->cap >= need)
        return MOE_OK;
    void *p = NULL;
    cudaError_t ce = cudaMalloc(&p, need);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(err, errlen, "no %zu bytes of GPU memory for the rows: %s", need,
                 cudaGetErrorString(ce));
        return MOE_ENOMEM;
    }
    dp_region *g = dp_ncclbuf_region(x->device, p, need);
    if (!g) {
        cudaFree(p);
        snprintf(err, errlen, "out of memory");
        return MOE_ENOMEM;
    }
    pthread_mutex_lock(&x->t->mu);
    if (x->buf) /* tickets may still hold the old one: freed with the last */
        dp_region_abandon_locked(x->t, x->buf);
    pthread_mutex_unlock(&x->t->mu);
    x->buf = g;
    x->cap = need;
    return MOE_OK;
}

/* wnc_recv_post posts x's receives, one per piece of rows (common/
 * nccl_pieces.h) into base, each followed by its event when there are
 * several (thread). */
static moe_err wnc_recv_post(struct wnc *x, wnc_job *j, uint8_t *base, int64_t R, char *err,
                             size_t errlen)
{
    const size_t row = j->n / (size_t)R; /* bytes of one row */
    moe_err e = MOE_OK;
    for (int i = 0; i < j->pieces && e == MOE_OK; i++) {
        const int64_t a = nccl_piece_first(R, j->pieces, i);
        const size_t n = (size_t)(nccl_piece_first(R, j->pieces, i + 1) - a) * row;
        /* the enqueue is seen through before the next NCCL call (a
         * non-blocking communicator takes none while one is in progress) */
        e = wnc_poll(x, ncclRecv(base + (size_t)a * row, n, ncclUint8, 0, x->comm, x->stream), 0,
                     NULL, j->deadline_ns, "posting x's receive", err, errlen);
        if (e == MOE_OK && j->pieces > 1 && cudaEventRecord(x->ev[i], x->stream) != cudaSuccess) {
            snprintf(err, errlen, "recording x's piece %d: %s", i,
                     cudaGetErrorString(cudaGetLastError()));
            e = MOE_EUNAVAIL;
        }
    }
    return e;
}

/* wnc_recv_file files the job's ticket, x's first piece in (thread). */
static void wnc_recv_file(struct wnc *x, wnc_job *j, uint8_t *base, uint64_t mark)
{
    dp_ticket *tk = j->tk;
    tk->x.data = base;
    tk->x.nbytes = j->n;
    tk->nccl_pieces = j->pieces;
    tk->nccl_mark = mark;
    pthread_mutex_lock(&x->t->mu);
    dp_region_hold_locked(x->buf);
    dp_region_hold_locked(x->buf);
    tk->region = tk->yregion = x->buf;
    tk->y_off = j->n;
    tk->nccl = x;
    x->refs++;
    pthread_mutex_unlock(&x->t->mu);
    j->tk = NULL;
    dp_rows_file(x->t, tk, j->has_run ? &j->run : NULL);
}

/* wnc_recv_x: the job's ticket gets its x over NCCL. Its receives (one per
 * piece) are all posted at once, then awaited in order; the ticket is filed
 * once piece 0 is in, and xpieces counts the pieces in, so that the
 * compute thread (wnc_x_piece_wait) computes piece i while the next ones
 * arrive. A piece that never comes: before the filing the ticket is
 * discarded with the error (by the thread's loop), after it xfail tells
 * the compute thread; either way the error ends this thread. */
static moe_err wnc_recv_x(struct wnc *x, wnc_job *j, char *err, size_t errlen)
{
    const int64_t R = j->tk->x.shape[0];
    moe_err e = wnc_buffer(x, 2 * j->n, err, errlen);
    if (e != MOE_OK)
        return e;
    uint8_t *base = dp_region_base(x->buf);
    const uint64_t t0 = wnc_now_ns(), mark = x->xpieces;
    e = wnc_recv_post(x, j, base, R, err, errlen);
    for (int i = 0; i < j->pieces && e == MOE_OK; i++) {
        e = wnc_poll(x, ncclSuccess, 1, j->pieces > 1 ? x->ev[i] : NULL, j->deadline_ns,
                     "receiving x", err, errlen);
        if (e != MOE_OK)
            break;
        __atomic_store_n(&x->xpieces, mark + (uint64_t)i + 1, __ATOMIC_RELEASE);
        if (i > 0)
            continue;
        x->xdone_ns = wnc_now_ns();
        x->cur[0] = (int32_t)((j->picked_ns - j->queued_ns) / 1000);
        x->cur[2] = j->pieces;
        wnc_recv_file(x, j, base, mark);
    }
    if (e != MOE_OK && !j->tk) /* filed: its forward waits for the pieces */
        __atomic_store_n(&x->xfail, 1, __ATOMIC_RELEASE);
    if (e != MOE_OK)
        return e;
    const uint64_t now = wnc_now_ns();
    x->sum_x += now - t0;
    x->nx++;
    x->cur[1] = (int32_t)((now - t0) / 1000);
    return MOE_OK;
}

/* wnc_echo: the floor of the path (no compute, no nng): n bytes in and
 * back, rounds times, then data.nccl_echo is answered. */
static moe_err wnc_echo(struct wnc *x, wnc_job *j, char *err, size_t errlen)
{
    moe_err e = wnc_buffer(x, j->n ? j->n : 1, err, errlen);
    uint8_t *base = e == MOE_OK ? dp_region_base(x->buf) : NULL;
    for (int i = 0; i < j->rounds && e == MOE_OK; i++) {
        e = wnc_poll(x, ncclRecv(base, j->n, ncclUint8, 0, x->comm, x->stream), 1, NULL,
                     j->deadline_ns, "echo: receiving", err, errlen);
        if (e == MOE_OK)
            e = wnc_poll(x, ncclSend(base, j->n, ncclUint8, 0, x->comm, x->stream), 1, NULL,
                         j->deadline_ns, "echo: sending", err, errlen);
    }
    if (e != MOE_OK) {
        rpc_reply_err(j->echo, e, "%s", err);
    } else {
        mp_writer w;
        mp_writer_init(&w);
        moe_rpc_write_response_ok_head(&w, j->echo->req.msgid);
        mp_write_map(&w, 0);
        rpc_reply(j->echo, &w);
    }
    j->echo = NULL;
    return e;
}

/* wnc_send: one piece of y to the client; the request's phases are kept
 * with its last piece */
static moe_err wnc_send(struct wnc *x, wnc_job *j, char *err, size_t errlen)
{
    const uint64_t t0 = wnc_now_ns();
    ncclResult_t r = ncclSend(j->ydev, j->n, ncclUint8, 0, x->comm, x->stream);
    moe_err e = wnc_poll(x, r, 1, NULL, j->deadline_ns, "sending y", err, errlen);
    if (e == MOE_OK && j->piece + 1 == j->pieces && x->xdone_ns && j->queued_ns >= x->xdone_ns) {
        const uint64_t now = wnc_now_ns();
        int32_t *k = x->keep[x->nkeep++ % WNC_KEEP];
        x->nreq++;
        x->sum_mid += j->queued_ns - x->xdone_ns;
        x->sum_hand += t0 - j->queued_ns;
        x->sum_y += now - t0;
        k[0] = x->cur[0];
        k[1] = x->cur[1];
        k[2] = (int32_t)((j->queued_ns - x->xdone_ns) / 1000);
        k[3] = (int32_t)((t0 - j->queued_ns) / 1000);
        k[4] = (int32_t)((now - t0) / 1000);
        k[5] = x->cur[2];
    }
    return e;
}

static int wnc_cmp(const void *a, const void *b)
{
    int32_t p = *(const int32_t *)a, q = *(const int32_t *)b;
    return (p > q) - (p < q);
}

/* wnc_log_medians: the kept requests' phase medians (the first request,
 * which opens NCCL's connections, left out when it is kept with others) */
static void wnc_log_medians(const struct wnc *x)
{
    const uint32_t n = x->nkeep < WNC_KEEP ? x->nkeep : WNC_KEEP;
    const uint32_t skip = x->nkeep <= WNC_KEEP && n > 1 ? 1 : 0;
    int32_t med[6], col[WNC_KEEP];
    if (n <= skip)
        return;
    for (int p = 0; p < 6; p++) {
        for (uint32_t i = skip; i < n; i++)
            col[i - skip] = x->keep[i][p];
        qsort(col, n - skip, sizeof(col[0]), wnc_cmp);
        med[p] = col[(n - skip) / 2];
    }
    LOG_I("data plane: NCCL communicator %llu: median us of %u requests (pieces %d): x queued -> "
          "taken %d, x received %d (from its post, every piece), x in -> y handed over %d "
          "(first piece in -> last piece's y; forwards included), y handed over -> sent %d, y "
          "sent %d (the last piece)",
          (unsigned long long)x->id, n - skip, med[5], med[0], med[1], med[2], med[3], med[4]);
}

/* wnc_free: the last reference went (mu held). */
static void wnc_free_locked(struct wnc *x)
{
    pthread_cond_destroy(&x->cv);
    free(x);
}

void wnc_put_locked(struct wnc *x)
{
    if (x && --x->refs == 0)
        wnc_free_locked(x);
}

static void *wnc_thread(void *arg)
{
    struct wnc *x = arg;
    dp_table *t = x->t;
    char err[400] = "";
    moe_err e = MOE_OK;
    ncclUniqueId uid;
    memcpy(&uid, x->uid, sizeof(uid));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    if (cudaSetDevice(x->device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&x->stream, cudaStreamNonBlocking) != cudaSuccess) {
        (void)cudaGetLastError();
        x->stream = NULL;
        snprintf(err, sizeof(err), "cannot make a CUDA stream on GPU %d", x->device);
        e = MOE_EINTERNAL;
    }
    for (; e == MOE_OK && x->nev < NCCL_PIECES_MAX; x->nev++)
        if (cudaEventCreateWithFlags(&x->ev[x->nev], cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            snprintf(err, sizeof(err), "cannot make CUDA events on GPU %d", x->device);
            e = MOE_EINTERNAL;
            break;
        }
    if (e == MOE_OK) {
        ncclResult_t r = ncclCommInitRankConfig(&x->comm, 2, uid, 1, &cfg);
        if (r != ncclSuccess && r != ncclInProgress)
            x->comm = NULL;
        e = x->comm ? wnc_poll(x, r, 0, NULL, wnc_now_ns() + (uint64_t)x->open_ms * 1000000ull,
                               "joining the client's communicator", err, sizeof(err))
                    : MOE_EUNAVAIL;
        if (!x->comm)
            snprintf(err, sizeof(err), "ncclCommInitRankConfig: %s", ncclGetErrorString(r));
        if (e == MOE_OK)
            LOG_I("data plane: NCCL communicator %llu with a client is up (GPU %d)",
                  (unsigned long long)x->id, x->device);
    }
    uint64_t spin_ns =
        0; /* x was filed (y comes when the forward is done) or y sent (the next x) */
    for (;;) {
        if (spin_ns) {
            /* the forward takes a few ms, a client's next request comes
             * right after its y: wait for the next job awake rather than be
             * woken from the condition variable (tens of us on the path of
             * every request); bounded, then asleep as usual */
            const uint64_t until = wnc_now_ns() + spin_ns;
            while (!__atomic_load_n(&x->head, __ATOMIC_ACQUIRE) &&
                   !__atomic_load_n(&x->dead, __ATOMIC_ACQUIRE) && wnc_now_ns() < until)
                sched_yield();
            spin_ns = 0;
        }
        pthread_mutex_lock(&t->mu);
        while (e == MOE_OK && !x->head && !__atomic_load_n(&x->dead, __ATOMIC_ACQUIRE))
            pthread_cond_wait(&x->cv, &t->mu);
        wnc_job *j = x->head;
        if (j) {
            x->head = j->next;
            if (!x->head)
                x->tail = NULL;
        }
        if (e != MOE_OK || __atomic_load_n(&x->dead, __ATOMIC_ACQUIRE))
            x->failed = 1;
        int stop = x->failed;
        pthread_mutex_unlock(&t->mu);
        if (j)
            j->picked_ns = wnc_now_ns();
        if (!j && stop)
            break;
        if (!stop)
            e = j->kind == WNC_RECV_X ? wnc_recv_x(x, j, err, sizeof(err))
                : j->kind == WNC_ECHO ? wnc_echo(x, j, err, sizeof(err))
                                      : wnc_send(x, j, err, sizeof(err));
        spin_ns = stop || e != MOE_OK     ? 0
                  : j->kind == WNC_RECV_X ? WNC_SPIN_NS
                  : j->kind == WNC_SEND_Y ? WNC_SPIN_NEXT_NS
                                          : 0;
        if (j->echo) /* never ran */
            rpc_reply_err(j->echo, MOE_EUNAVAIL, "%s", err[0] ? err : "the communicator failed");
        if (j->tk) /* not filed: refused, or its x never came */
            dp_ticket_discard(t, j->tk, e == MOE_ETIMEDOUT ? MOE_ETIMEDOUT : MOE_EUNAVAIL,
                              err[0] ? err : "the NCCL communicator failed");
        free(j);
    }
    if (x->nreq) /* where the time went (bench/nccl_client_check.sh shows it) */
        LOG_I("data plane: NCCL communicator %llu: %llu requests, mean us: x received %.0f "
              "(from its post), x in -> y handed over %.0f (forward included), y handed over "
              "-> sent %.0f, y sent %.0f",
              (unsigned long long)x->id, (unsigned long long)x->nreq,
              (double)x->sum_x / (double)x->nx * 1e-3, (double)x->sum_mid / (double)x->nreq * 1e-3,
              (double)x->sum_hand / (double)x->nreq * 1e-3,
              (double)x->sum_y / (double)x->nreq * 1e-3);
    if (x->nreq)
        wnc_log_medians(x);
    if (e != MOE_OK || x->comm) /* the reason, once */
        LOG_W("data plane: NCCL communicator %llu closes: %s", (unsigned long long)x->id,
              err[0] ? err : "closed");
    if (x->comm) { /* stops kernels stuck on a dead peer too */
        kcu_comm_abort(x->comm);
        x->comm = NULL;
    }
    for (int i = 0; i < x->nev; i++)
        cudaEventDestroy(x->ev[i]);
    if (x->stream)
        cudaStreamDestroy(x->stream);
    pthread_mutex_lock(&t->mu);
    for (struct wnc **pp = &t->wncs; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    if (x->buf)
        dp_region_abandon_locked(t, x->buf);
    t->wnc_threads--;
    wnc_put_locked(x);
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

void wnc_buf_free(int device, void *dev)
{
    cudaSetDevice(device);
    cudaFree(dev);
}

/* wnc_queue appends j (mu held). */
static void wnc_queue_locked(struct wnc *x, wnc_job *j)
{
    if (x->tail)
        x->tail->next = j;
    else
        x->head = j;
    x->tail = j;
    pthread_cond_signal(&x->cv);
}

moe_err wnc_send_y(struct wnc *x, const void *dev, size_t n, uint64_t deadline_ns, int piece,
                   int pieces)
{
    wnc_job *j = calloc(1, sizeof(*j));
    uint64_t floor_ns = wnc_now_ns() + WNC_SEND_MIN_MS * 1000000ull;
    pthread_mutex_lock(&x->t->mu);
    if (!j || x->failed) { /* the client's receive is aborted on the error answer */
        if (j && !x->failed)
            __atomic_store_n(&x->dead, 1, __ATOMIC_RELEASE);
        pthread_cond_signal(&x->cv);
        pthread_mutex_unlock(&x->t->mu);
        free(j);
        return MOE_EUNAVAIL;
    }
    j->kind = WNC_SEND_Y;
    j->ydev = dev;
    j->n = n;
    j->piece = piece;
    j->pieces = pieces;
    j->queued_ns = wnc_now_ns();
    j->deadline_ns = deadline_ns > floor_ns ? deadline_ns : floor_ns;
    wnc_queue_locked(x, j);
    pthread_mutex_unlock(&x->t->mu);
    return MOE_OK;
}

static struct wnc *wnc_find_locked(dp_table *t, uint32_t pipe, uint64_t id)
{
    for (struct wnc *x = t->wncs; x; x = x->next)
        if (x->id == id && x->pipe == pipe)
            return x;
    return NULL;
}

moe_err wnc_x_piece_wait(const dp_ticket *tk, int piece, char *err, size_t errlen)
{
    struct wnc *x = tk->nccl;
    if (!x || piece < 1) /* filed with piece 0 in */
        return MOE_OK;
    const uint64_t want = tk->nccl_mark + (uint64_t)piece + 1;
    int spins = 0;
    for (;;) {
        if (__atomic_load_n(&x->xpieces, __ATOMIC_ACQUIRE) >= want)
            return MOE_OK;
        if (__atomic_load_n(&x->xfail, __ATOMIC_ACQUIRE) ||
            __atomic_load_n(&x->dead, __ATOMIC_ACQUIRE)) {
            snprintf(err, errlen,
                     "piece %d of %d of x never came: the NCCL communicator failed (the worker's "
                     "log says why)",
                     piece + 1, tk->nccl_pieces);
            return MOE_EUNAVAIL;
        }
        if (wnc_now_ns() > tk->deadline_ns) {
            snprintf(err, errlen, "piece %d of %d of x did not come before the deadline", piece + 1,
                     tk->nccl_pieces);
            return MOE_ETIMEDOUT;
        }
        wnc_pause(&spins);
    }
}

void wnc_submit(dp_table *t, dp_ticket *tk, uint64_t comm, moe_dtype dt, int64_t R, int64_t H,
                const dp_run *run, int pieces)
{
    size_t n = (size_t)R * (size_t)H * moe_dtype_size(dt);
    if (R < 1 || n > WNC_MAX_BYTES) {
        dp_ticket_discard(t, tk, MOE_EINVAL,
                          "rows over NCCL: shape [R, H] with R >= 1 and at "
                          "most 16 GiB");
        return;
    }
    wnc_job *j = calloc(1, sizeof(*j));
    if (!j) {
        dp_ticket_discard(t, tk, MOE_ENOMEM, "out of memory");
        return;
    }
    tk->x.dtype = dt;
    tk->x.ndim = 2;
    tk->x.shape[0] = R;
    tk->x.shape[1] = H;
    j->kind = WNC_RECV_X;
    j->tk = tk;
    j->n = n;
    j->pieces = pieces >= 1 && pieces <= R ? pieces : 1; /* checked by data.rows */
    j->queued_ns = wnc_now_ns();
    j->deadline_ns = tk->deadline_ns;
    if (run) {
        j->run = *run;
        j->has_run = 1;
    }
    pthread_mutex_lock(&t->mu);
    struct wnc *x = wnc_find_locked(t, tk->pipe, comm);
    if (x && !x->failed)
        wnc_queue_locked(x, j);
    pthread_mutex_unlock(&t->mu);
    if (!x || x->failed) {
        free(j);
        dp_ticket_discard(t, tk, MOE_ENOTFOUND,
                          "NCCL communicator %llu is not open on this connection (closed, "
                          "failed or never opened): open another with data.nccl_open",
                          (unsigned long long)comm);
    }
}

/* wnc_version_refused: 1 (and the call answered failed_precondition) when
 * the client's NCCL (ncclGetVersion's code, e.g. 22803) is not the one this
 * worker runs: NCCL refuses to join ranks of different versions, and the
 * client would learn it only from a failed initialisation */
static int wnc_version_refused(rpc_call *c, int client_ver)
{
    int mine = 0;
    if (ncclGetVersion(&mine) != ncclSuccess || mine == client_ver)
        return 0;
    rpc_reply_err(c, MOE_EPRECOND,
                  "NCCL versions differ: the client runs NCCL %d.%d.%d, this worker %d.%d.%d; "
                  "both ends of a communicator need the same one (a PyTorch client brings its "
                  "own: start the worker with that library first on LD_LIBRARY_PATH, see "
                  "docs/OPERATIONS.md)",
                  client_ver / 10000, client_ver / 100 % 100, client_ver % 100, mine / 10000,
                  mine / 100 % 100, mine % 100);
    return 1;
}

void wnc_on_open(dp_table *t, rpc_call *c)
{
    char err[256];
    int64_t dev = -1, timeout_ms = 30000, client_ver = 0;
    mp_reader rid;
    const void *id;
    uint32_t idl;
    pspec sp[] = {
        {"id", P_RAW, &rid, true, 0, 0, 0, false},
        {"device", P_INT, &dev, false, -1, 1024, 0, false},
        {"timeout_ms", P_INT, &timeout_ms, false, 100, 600000, 0, false},
        {"nccl_version", P_INT, &client_ver, false, 0, INT32_MAX, 0, false},
    };
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 4, err, sizeof(err));
    if (e == MOE_OK && client_ver > 0 && wnc_version_refused(c, (int)client_ver))
        return;
    if (e == MOE_OK && t->gpu_device < 0) {
        rpc_reply_err(c, MOE_EPRECOND, "%s", wnc_no_gpu);
        return;
    }
    if (e == MOE_OK && (mp_read_bin(&rid, &id, &idl, NULL) != MOE_OK || idl != WNC_ID_BYTES)) {
        e = MOE_EINVAL;
        snprintf(err, sizeof(err), "id must be a bin of %d bytes (ncclUniqueId)", WNC_ID_BYTES);
    }
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    uint32_t pipe = rpc_call_pipe(c);
    struct wnc *x = calloc(1, sizeof(*x));
    if (!x) {
        rpc_reply_err(c, MOE_ENOMEM, "out of memory");
        return;
    }
    x->pipe = pipe;
    x->t = t;
    x->device = t->gpu_device;
    x->open_ms = (int)timeout_ms;
    x->refs = 1; /* the thread's */
    memcpy(x->uid, id, WNC_ID_BYTES);
    pthread_cond_init(&x->cv, NULL);
    pthread_mutex_lock(&t->mu);
    int mine = 0;
    for (struct wnc *o = t->wncs; o; o = o->next)
        mine += o->pipe == pipe;
    if (mine >= WNC_MAX_PER_PIPE) {
        pthread_mutex_unlock(&t->mu);
        pthread_cond_destroy(&x->cv);
        free(x);
        rpc_reply_err(c, MOE_ENOMEM, "%d NCCL communicators are open on this connection already",
                      mine);
        return;
    }
    x->id = ++t->next_wnc;
    x->next = t->wncs;
    t->wncs = x;
    t->wnc_threads++;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    int rc = pthread_create(&th, &at, wnc_thread, x);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        t->wncs = x->next;
        t->wnc_threads--;
        pthread_mutex_unlock(&t->mu);
        pthread_cond_destroy(&x->cv);
        free(x);
        rpc_reply_err(c, MOE_ENOMEM, "cannot start a thread for the communicator");
        return;
    }
    uint64_t cid = x->id;
    pthread_mutex_unlock(&t->mu);
    LOG_I("data plane: NCCL communicator %llu opening on connection %u (client GPU %lld)",
          (unsigned long long)cid, pipe, (long long)dev);
    /* answered at once: the loop thread never waits for the peer; the
     * client's own initialisation completes only when both sides join */
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, c->req.msgid);
    mp_write_map(&w, 2);
    mp_write_cstr(&w, "comm");
    mp_write_u64(&w, cid);
    mp_write_cstr(&w, "pieces_max"); /* data.rows may ask for pieces (a newer client) */
    mp_write_i64(&w, NCCL_PIECES_MAX);
    rpc_reply(c, &w);
}

void wnc_on_echo(dp_table *t, rpc_call *c)
{
    char err[256];
    int64_t id = 0, bytes = 0, rounds = 1, deadline_ms = 60000;
    pspec sp[] = {
        {"comm", P_INT, &id, true, 1, 9e18, 0, false},
        {"bytes", P_INT, &bytes, true, 0, (double)WNC_MAX_BYTES, 0, false},
        {"rounds", P_INT, &rounds, false, 1, 100000, 0, false},
        {"deadline_ms", P_INT, &deadline_ms, false, 1, 3600000, 0, false},
    };
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 4, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    wnc_job *j = calloc(1, sizeof(*j));
    if (!j) {
        rpc_reply_err(c, MOE_ENOMEM, "out of memory");
        return;
    }
    j->kind = WNC_ECHO;
    j->echo = c;
    j->n = (size_t)bytes;
    j->rounds = (int)rounds;
    j->deadline_ns = wnc_now_ns() + (uint64_t)deadline_ms * 1000000ull;
    pthread_mutex_lock(&t->mu);
    struct wnc *x = wnc_find_locked(t, rpc_call_pipe(c), (uint64_t)id);
    if (x && !x->failed)
        wnc_queue_locked(x, j);
    pthread_mutex_unlock(&t->mu);
    if (!x || x->failed) {
        free(j);
        rpc_reply_err(c, MOE_ENOTFOUND, "NCCL communicator %lld is not open on this connection",
                      (long long)id);
    }
}

void wnc_on_close(dp_table *t, rpc_call *c)
{
    char err[256];
    int64_t id = 0;
    pspec sp[] = {{"comm", P_INT, &id, true, 1, 9e18, 0, false}};
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 1, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    pthread_mutex_lock(&t->mu);
    struct wnc *x = wnc_find_locked(t, rpc_call_pipe(c), (uint64_t)id);
    if (x) {
        __atomic_store_n(&x->dead, 1, __ATOMIC_RELEASE);
        x->failed = 1;
        pthread_cond_signal(&x->cv);
    }
    pthread_mutex_unlock(&t->mu);
    if (!x) {
        rpc_reply_err(c, MOE_ENOTFOUND, "NCCL communicator %lld is not open on this connection",
                      (long long)id);
        return;
    }
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, c->req.msgid);
    mp_write_map(&w, 0);
    rpc_reply(c, &w);
}

void wnc_pipe_closed_locked(dp_table *t, uint32_t pipe, int all)
{
    for (struct wnc *x = t->wncs; x; x = x->next)
        if (all || x->pipe == pipe) {
            __atomic_store_n(&x->dead, 1, __ATOMIC_RELEASE);
            x->failed = 1;
            pthread_cond_signal(&x->cv);
        }
}

#else /* no CUDA: every worker refuses */

void wnc_on_open(dp_table *t, rpc_call *c)
{
    (void)t;
    rpc_reply_err(c, MOE_EPRECOND, "%s", wnc_no_gpu);
}

void wnc_on_echo(dp_table *t, rpc_call *c)
{
    (void)t;
    rpc_reply_err(c, MOE_EPRECOND, "%s", wnc_no_gpu);
}

void wnc_on_close(dp_table *t, rpc_call *c)
{
    (void)t;
    rpc_reply_err(c, MOE_ENOTFOUND, "no NCCL communicator is open on this connection");
}

void wnc_submit(dp_table *t, dp_ticket *tk, uint64_t comm, moe_dtype dt, int64_t R, int64_t H,
                const dp_run *run, int pieces)
{
    (void)comm, (void)dt, (void)R, (void)H, (void)run, (void)pieces;
    dp_ticket_discard(t, tk, MOE_EPRECOND, "%s", wnc_no_gpu);
}

moe_err wnc_x_piece_wait(const dp_ticket *tk, int piece, char *err, size_t errlen)
{
    (void)tk, (void)piece, (void)err, (void)errlen;
    return MOE_OK; /* no ticket comes over NCCL here */
}

moe_err wnc_send_y(struct wnc *x, const void *dev, size_t n, uint64_t deadline_ns, int piece,
                   int pieces)
{
    (void)x, (void)dev, (void)n, (void)deadline_ns, (void)piece, (void)pieces;
    return MOE_EUNAVAIL;
}

void wnc_put_locked(struct wnc *x)
{
    (void)x;
}

void wnc_pipe_closed_locked(dp_table *t, uint32_t pipe, int all)
{
    (void)t, (void)pipe, (void)all;
}

void wnc_buf_free(int device, void *dev)
{
    (void)device, (void)dev;
}

#endif

void wnc_wait_all(dp_table *t, int timeout_ms)
{
    for (int waited = 0; waited < timeout_ms; waited += 10) {
        pthread_mutex_lock(&t->mu);
        int n = t->wnc_threads;
        pthread_mutex_unlock(&t->mu);
        if (!n)
            return;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
}
