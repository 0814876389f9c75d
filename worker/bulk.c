/* bulk.c - the worker's bulk listener; see bulk.h. */
#include "worker/bulk.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "proto/bulk_wire.h"
#include "common/log.h"
#include "worker/pool.h"
#include "rpc/rpcsrv.h"

#define DRAIN_CHUNK ((size_t)1 << 20)

typedef struct bconn {
    struct wkr_bulk *srv;
    int fd;  /* the connection */
    int efd; /* eventfd: the ticket's answer is ready */
    struct bconn *next;
} bconn;

/* bset: a transfer split over several connections (header parts > 1),
 * gathered into one buffer. Each part's thread reads its rows into buf;
 * the one that completes the set parks it as one dp_bulk (its "owner":
 * it waits for the answer and wakes the others), and every part's thread
 * writes its rows of y. Under the server's mu; freed by the last part's
 * thread to leave. */
enum { BSET_GATHER, BSET_PARKED, BSET_ANSWERED, BSET_FAILED };
typedef struct bset {
    moe_bulk_req h; /* the first part's header: ticket, dtype, shape, parts */
    uint8_t *buf;   /* wpool, nbytes reserved in the data plane: until b owns it */
    dp_bulk *b;     /* once parked (the set holds the park's reference) */
    uint8_t here[MOE_BULK_MAX_PARTS]; /* part p's header came */
    int efd[MOE_BULK_MAX_PARTS];      /* part p's connection's eventfd, -1 when gone */
    int attached;                     /* part threads holding the set */
    int received;                     /* parts read in full */
    int state;                        /* BSET_* */
    uint64_t deadline_ns;             /* every part in by then, or the set fails */
    moe_err err;                      /* BSET_FAILED: why */
    char msg[256];
    struct bset *next;
} bset;

struct wkr_bulk {
    wkr_bulk_opts o;
    char auth[MOE_BULK_AUTH_MAX + 1];
    int lfd; /* listening socket */
    pthread_t accept_th;
    pthread_mutex_t mu; /* conns, nconns, stopping */
    pthread_cond_t cv;  /* a connection thread ended */
    bconn *conns;
    int nconns, stopping;
    bset *sets; /* split transfers being gathered or answered */
};

/* ---- socket i/o (blocking, bounded by SO_RCVTIMEO / SO_SNDTIMEO) ---- */

/* read_full reads n bytes: 0, or -1 (EOF, error, or no progress within
 * the timeout: errno says which, 0 for EOF). */
static int read_full(int fd, void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n) {
        size_t want = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t got = recv(fd, p, want, MSG_WAITALL);
        if (got == 0) {
            errno = 0;
            return -1;
        }
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

static int write_full(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n) {
        size_t want = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t put = send(fd, p, want, MSG_NOSIGNAL);
        if (put < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += put;
        n -= (size_t)put;
    }
    return 0;
}

/* drain reads and drops n bytes (rows refused after their header) */
static int drain(int fd, uint64_t n)
{
    uint8_t *tmp = malloc(DRAIN_CHUNK);
    int rc = tmp ? 0 : -1;
    while (rc == 0 && n) {
        size_t k = n > DRAIN_CHUNK ? DRAIN_CHUNK : (size_t)n;
        rc = read_full(fd, tmp, k);
        n -= k;
    }
    free(tmp);
    return rc;
}

/* send_rep writes a reply header (and the error text for kind error) */
static int send_rep(int fd, int kind, moe_err st, const char *msg, uint64_t cid, uint64_t seq,
                    int64_t rows, uint64_t nbytes)
{
    uint8_t h[MOE_BULK_REP_LEN + MOE_BULK_MSG_MAX];
    size_t ml = msg ? strlen(msg) : 0;
    if (ml > MOE_BULK_MSG_MAX)
        ml = MOE_BULK_MSG_MAX;
    moe_bulk_rep r = {MOE_BULK_MAGIC,
                      MOE_BULK_VERSION,
                      (uint16_t)kind,
                      (uint32_t)st,
                      (uint32_t)ml,
                      cid,
                      seq,
                      rows,
                      nbytes};
    moe_bulk_rep_encode(&r, h);
    memcpy(h + MOE_BULK_REP_LEN, msg ? msg : "", ml);
    return write_full(fd, h, MOE_BULK_REP_LEN + ml);
}

static uint64_t now_ns(void)
{
    return rpc_now_ns();
}

/* ---- one connection ---- */

/* conn_poll waits up to ms for the connection's eventfd (drained) or its
 * socket: -1 when the client closed it or sent bytes before its answer
 * (both end the connection), 0 otherwise. */
static int conn_poll(bconn *k, int ms)
{
    struct pollfd pf[2] = {{k->fd, POLLIN | POLLRDHUP, 0}, {k->efd, POLLIN, 0}};
    int n = poll(pf, 2, ms);
    if (n < 0 && errno != EINTR)
        return -1;
    if (n > 0 && pf[1].revents) {
        uint64_t v;
        ssize_t r = read(k->efd, &v, sizeof(v));
        (void)r;
    }
    return n > 0 && pf[0].revents ? -1 : 0;
}

/* wait_answer waits until b's answer is ready (1), the client went away
 * or broke the protocol (-1), or b was dropped unclaimed at its deadline
 * (0: b's state is DONE with deadline_exceeded). */
static int wait_answer(bconn *k, dp_bulk *b)
{
    dp_table *t = k->srv->o.dp;
    for (;;) {
        pthread_mutex_lock(b->mu);
        int st = b->state;
        pthread_mutex_unlock(b->mu);
        if (st == DP_BULK_DONE)
            return 1;
        int64_t left_ms = 1000;
        if (st == DP_BULK_PARKED) {
            uint64_t now = now_ns();
            left_ms = now >= b->park_deadline_ns
                          ? 0
                          : (int64_t)((b->park_deadline_ns - now) / 1000000ull) + 1;
            if (left_ms > 1000)
                left_ms = 1000;
        }
        if (conn_poll(k, (int)left_ms) < 0)
            return -1; /* closed, or bytes before the answer: both end it */
        if (st == DP_BULK_PARKED && now_ns() >= b->park_deadline_ns && dp_bulk_unpark(t, b, 0)) {
            pthread_mutex_lock(b->mu);
            b->err = MOE_ETIMEDOUT;
            snprintf(b->msg, sizeof(b->msg),
                     "bulk rows of ticket [%llu, %llu] were not named by a data.rows within "
                     "%d ms",
                     (unsigned long long)b->cid, (unsigned long long)b->seq, k->srv->o.park_ms);
            pthread_mutex_unlock(b->mu);
            return 0;
        }
    }
}

/* ---- a transfer split over several connections ---- */

/* set_wake writes every other part's eventfd (s->mu held) */
static void set_wake(bset *a, int self)
{
    uint64_t one = 1;
    for (int p = 0; p < a->h.parts; p++)
        if (p != self && a->efd[p] >= 0) {
            ssize_t r = write(a->efd[p], &one, sizeof(one));
            (void)r;
        }
}

/* set_fail marks a failed (once) and wakes the other parts (s->mu held) */
static void set_fail(bset *a, int self, moe_err e, const char *msg)
{
    if (a->state == BSET_FAILED || a->state == BSET_ANSWERED)
        return;
    a->state = BSET_FAILED;
    a->err = e;
    snprintf(a->msg, sizeof(a->msg), "%s", msg);
    set_wake(a, self);
}

/* set_leave: part `part`'s thread lets go of a; the last one frees it
 * (s->mu held) */
static void set_leave(wkr_bulk *s, bset *a, int part)
{
    a->efd[part] = -1;
    if (--a->attached > 0)
        return;
    for (bset **pp = &s->sets; *pp; pp = &(*pp)->next)
        if (*pp == a) {
            *pp = a->next;
            break;
        }
    if (a->b) {
        dp_bulk_unpark(s->o.dp, a->b, 1); /* a no-op unless nobody claimed it */
        dp_bulk_put(s->o.dp, a->b);
    } else if (a->buf) {
        wpool_free(a->buf);
        dp_bulk_unreserve(s->o.dp, a->h.nbytes);
    }
    free(a);
}

/* set_join finds or makes the set of h's ticket and attaches part h->part
 * to it: the set, or NULL with the error in e/err (the part's rows are
 * then to be dropped). */
static bset *set_join(wkr_bulk *s, bconn *k, const moe_bulk_req *h, moe_err *e, char *err,
                      size_t errlen)
{
    dp_table *t = s->o.dp;
    pthread_mutex_lock(&s->mu);
    bset *a = s->sets;
    while (a && !(a->h.cid == h->cid && a->h.seq == h->seq))
        a = a->next;
    if (!a) {
        a = calloc(1, sizeof(*a));
        *e = a ? dp_bulk_reserve(t, h->nbytes, err, errlen) : MOE_ENOMEM;
        if (*e == MOE_OK && !(a->buf = wpool_alloc(h->nbytes))) {
            dp_bulk_unreserve(t, h->nbytes);
            *e = MOE_ENOMEM;
        }
        if (*e != MOE_OK) {
            if (*e == MOE_ENOMEM)
                snprintf(err, errlen, "out of memory for %llu bytes of rows",
                         (unsigned long long)h->nbytes);
            free(a);
            pthread_mutex_unlock(&s->mu);
            return NULL;
        }
        a->h = *h;
        for (int p = 0; p < MOE_BULK_MAX_PARTS; p++)
            a->efd[p] = -1;
        a->state = BSET_GATHER;
        a->deadline_ns = now_ns() + (uint64_t)s->o.timeout_ms * 1000000ull;
        a->next = s->sets;
        s->sets = a;
    } else if (a->h.dtype != h->dtype || a->h.rows != h->rows || a->h.cols != h->cols ||
               a->h.parts != h->parts) {
        *e = MOE_EINVAL;
        snprintf(err, errlen,
                 "part %u of ticket [%llu, %llu] disagrees with its first part (%lld x %lld of "
                 "%s in %d parts)",
                 h->part, (unsigned long long)h->cid, (unsigned long long)h->seq,
                 (long long)a->h.rows, (long long)a->h.cols, moe_dtype_name((moe_dtype)a->h.dtype),
                 a->h.parts);
        a = NULL;
    } else if (a->here[h->part] || a->state != BSET_GATHER) {
        *e = MOE_EPRECOND;
        snprintf(err, errlen, "part %u of ticket [%llu, %llu] is %s", h->part,
                 (unsigned long long)h->cid, (unsigned long long)h->seq,
                 a->here[h->part] ? "already here" : "late: the transfer is over");
        a = NULL;
    }
    if (a) {
        a->here[h->part] = 1;
        a->efd[h->part] = k->efd;
        a->attached++;
    }
    pthread_mutex_unlock(&s->mu);
    return a;
}

/* set_park (s->mu held): the last part is in; a becomes one parked
 * dp_bulk, answered to the calling part's connection */
static void set_park(wkr_bulk *s, bconn *k, bset *a, int part)
{
    char err[300];
    dp_bulk *b = calloc(1, sizeof(*b));
    if (!b) {
        set_fail(a, part, MOE_ENOMEM, "worker out of memory");
        return;
    }
    b->cid = a->h.cid;
    b->seq = a->h.seq;
    b->dtype = (moe_dtype)a->h.dtype;
    b->rows = a->h.rows;
    b->cols = a->h.cols;
    b->buf = a->buf;
    b->nbytes = a->h.nbytes;
    b->reserved = a->h.nbytes;
    b->wake_fd = k->efd;
    b->park_deadline_ns = now_ns() + (uint64_t)s->o.park_ms * 1000000ull;
    moe_err e = dp_bulk_park(s->o.dp, b, err, sizeof(err));
    if (e != MOE_OK) {
        free(b);
        set_fail(a, part, e, err);
        return;
    }
    a->buf = NULL; /* b's now */
    a->b = b;
    a->state = BSET_PARKED;
}

/* set_wait: a part that does not own the parked rows waits until the set
 * is answered or failed (1), its client goes (-1), or the set's parts do
 * not all come in time (the set fails: 1). */
static int set_wait(wkr_bulk *s, bconn *k, bset *a, int part)
{
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int st = a->state;
        uint64_t now = now_ns();
        if (st == BSET_GATHER && now >= a->deadline_ns) {
            char m[200];
            snprintf(m, sizeof(m), "bulk ticket [%llu, %llu]: %d of its %d parts came within %d ms",
                     (unsigned long long)a->h.cid, (unsigned long long)a->h.seq, a->received,
                     a->h.parts, s->o.timeout_ms);
            set_fail(a, part, MOE_ETIMEDOUT, m);
            st = a->state;
        }
        int64_t left_ms =
            st == BSET_GATHER ? (int64_t)((a->deadline_ns - now) / 1000000ull) + 1 : 1000;
        pthread_mutex_unlock(&s->mu);
        if (st == BSET_ANSWERED || st == BSET_FAILED)
            return 1;
        if (left_ms > 1000)
            left_ms = 1000;
        if (conn_poll(k, (int)left_ms) < 0)
            return -1;
    }
}

/* serve_part serves one part of a split transfer (h->parts > 1): 0 to go
 * on with the next transfer, -1 to close. */
static int serve_part(bconn *k, const moe_bulk_req *h)
{
    wkr_bulk *s = k->srv;
    const int part = h->part;
    int64_t row0, nrows;
    moe_bulk_part_rows(h->rows, h->parts, part, &row0, &nrows);
    const size_t rowb = (size_t)h->cols * moe_dtype_size((moe_dtype)h->dtype);
    const size_t off = (size_t)row0 * rowb, len = (size_t)nrows * rowb;
    char err[300];
    moe_err e = MOE_OK;
    bset *a = set_join(s, k, h, &e, err, sizeof(err));
    if (!a) {
        if (drain(k->fd, len) != 0)
            return -1;
        return send_rep(k->fd, MOE_BULK_ERR, e, err, h->cid, h->seq, 0, 0);
    }
    if (read_full(k->fd, a->buf + off, len) != 0) {
        int en = errno;
        snprintf(err, sizeof(err), "bulk rows of ticket [%llu, %llu] part %d cut off (%s)",
                 (unsigned long long)h->cid, (unsigned long long)h->seq, part,
                 en ? strerror(en) : "the client closed it");
        LOG_W("bulk: %s: connection closed", err);
        pthread_mutex_lock(&s->mu);
        set_fail(a, part, MOE_EUNAVAIL, err);
        set_leave(s, a, part);
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    pthread_mutex_lock(&s->mu);
    int owner = 0;
    if (++a->received == a->h.parts && a->state == BSET_GATHER) {
        set_park(s, k, a, part);
        owner = a->state == BSET_PARKED;
    }
    int st = a->state;
    pthread_mutex_unlock(&s->mu);
    int rc = 0;
    /* a->err and a->msg are written once, when the state becomes FAILED,
     * and read only after that under mu: stable from then on */
    if (st == BSET_FAILED) { /* its rows were read: the connection goes on */
        rc = send_rep(k->fd, MOE_BULK_ERR, a->err, a->msg, h->cid, h->seq, 0, 0);
        goto out;
    }
    if (send_rep(k->fd, MOE_BULK_ACK, MOE_OK, NULL, h->cid, h->seq, nrows, len) != 0) {
        rc = -1;
        pthread_mutex_lock(&s->mu);
        set_fail(a, part, MOE_EUNAVAIL, "a part's connection closed");
        pthread_mutex_unlock(&s->mu);
        goto out;
    }
    if (owner) {
        int w = wait_answer(k, a->b);
        if (w < 0) /* its eventfd closes with this connection: never written again */
            dp_bulk_unpark(s->o.dp, a->b, 1);
        pthread_mutex_lock(&s->mu);
        if (w < 0)
            set_fail(a, part, MOE_EUNAVAIL, "the connection of the part holding the rows closed");
        else if (a->state == BSET_PARKED) {
            a->state = BSET_ANSWERED;
            set_wake(a, part);
        }
        pthread_mutex_unlock(&s->mu);
        if (w < 0) {
            rc = -1;
            goto out;
        }
    } else if (set_wait(s, k, a, part) < 0) {
        rc = -1;
        goto out;
    }
    /* ANSWERED: b is DONE (no longer written by others); or FAILED */
    pthread_mutex_lock(&s->mu);
    st = a->state;
    pthread_mutex_unlock(&s->mu);
    if (st == BSET_FAILED) {
        rc = send_rep(k->fd, MOE_BULK_ERR, a->err, a->msg, h->cid, h->seq, 0, 0);
    } else if (a->b->err != MOE_OK) {
        rc = send_rep(k->fd, MOE_BULK_ERR, a->b->err, a->b->msg, h->cid, h->seq, 0, 0);
    } else { /* this part's rows of y (y has its own row count and size) */
        const dp_bulk *b = a->b;
        int64_t y0, yn;
        moe_bulk_part_rows(b->rows, a->h.parts, part, &y0, &yn);
        const size_t yrow = b->rows ? b->nbytes / (size_t)b->rows : 0;
        rc = send_rep(k->fd, MOE_BULK_Y, MOE_OK, NULL, h->cid, h->seq, yn, (uint64_t)yn * yrow) ==
                         0 &&
                     write_full(k->fd, b->buf + (size_t)y0 * yrow, (size_t)yn * yrow) == 0
                 ? 0
                 : -1;
    }
out:
    pthread_mutex_lock(&s->mu);
    set_leave(s, a, part);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* serve_one serves one transfer: 0 to go on with the next, -1 to close. */
static int serve_one(bconn *k)
{
    wkr_bulk *s = k->srv;
    dp_table *t = s->o.dp;
    uint8_t hb[MOE_BULK_REQ_LEN];
    char err[300], auth[MOE_BULK_AUTH_MAX + 1];
    moe_bulk_req h;
    /* idle until the next header */
    struct pollfd pf = {k->fd, POLLIN, 0};
    int n = poll(&pf, 1, s->o.idle_ms);
    if (n <= 0)
        return -1;
    if (read_full(k->fd, hb, sizeof(hb)) != 0)
        return -1; /* a clean close between transfers, or a torn header */
    moe_err e = moe_bulk_req_decode(hb, s->o.max_bytes, &h, err, sizeof(err));
    if (e != MOE_OK) {
        LOG_W("bulk: %s: connection closed", err);
        send_rep(k->fd, MOE_BULK_ERR, e, err, h.cid, h.seq, 0, 0);
        return -1;
    }
    if (read_full(k->fd, auth, h.auth_len) != 0)
        return -1;
    auth[h.auth_len] = 0;
    if (s->auth[0] && (h.auth_len != strlen(s->auth) || memcmp(auth, s->auth, h.auth_len) != 0)) {
        send_rep(k->fd, MOE_BULK_ERR, MOE_EUNAUTH, "missing or wrong auth token", h.cid, h.seq, 0,
                 0);
        return -1;
    }
    if (h.parts > 1)
        return serve_part(k, &h);
    if ((e = dp_bulk_reserve(t, h.nbytes, err, sizeof(err))) != MOE_OK) {
        /* busy: the rows are read and dropped, the connection stays */
        if (drain(k->fd, h.nbytes) != 0)
            return -1;
        return send_rep(k->fd, MOE_BULK_ERR, e, err, h.cid, h.seq, 0, 0);
    }
    dp_bulk *b = calloc(1, sizeof(*b));
    uint8_t *buf = b ? wpool_alloc(h.nbytes) : NULL;
    if (!buf) {
        free(b);
        dp_bulk_unreserve(t, h.nbytes);
        snprintf(err, sizeof(err), "out of memory for %llu bytes of rows",
                 (unsigned long long)h.nbytes);
        if (drain(k->fd, h.nbytes) != 0)
            return -1;
        return send_rep(k->fd, MOE_BULK_ERR, MOE_ENOMEM, err, h.cid, h.seq, 0, 0);
    }
    if (read_full(k->fd, buf, h.nbytes) != 0) {
        int en = errno;
        LOG_W("bulk: rows of ticket [%llu, %llu] cut off (%s): connection closed",
              (unsigned long long)h.cid, (unsigned long long)h.seq,
              en ? strerror(en) : "the client closed it");
        wpool_free(buf);
        free(b);
        dp_bulk_unreserve(t, h.nbytes);
        return -1;
    }
    b->cid = h.cid;
    b->seq = h.seq;
    b->dtype = (moe_dtype)h.dtype;
    b->rows = h.rows;
    b->cols = h.cols;
    b->buf = buf;
    b->nbytes = h.nbytes;
    b->reserved = h.nbytes;
    b->wake_fd = k->efd;
    b->park_deadline_ns = now_ns() + (uint64_t)s->o.park_ms * 1000000ull;
    if ((e = dp_bulk_park(t, b, err, sizeof(err))) != MOE_OK) {
        wpool_free(buf);
        free(b);
        dp_bulk_unreserve(t, h.nbytes);
        return send_rep(k->fd, MOE_BULK_ERR, e, err, h.cid, h.seq, 0, 0);
    }
    int ok = send_rep(k->fd, MOE_BULK_ACK, MOE_OK, NULL, h.cid, h.seq, h.rows, h.nbytes) == 0;
    int w = ok ? wait_answer(k, b) : -1;
    if (w < 0) { /* the client is gone: nobody reads an answer */
        dp_bulk_unpark(t, b, 1);
        dp_bulk_put(t, b);
        return -1;
    }
    /* DONE: y in b->buf, or the error (b is no longer written by others) */
    int rc;
    if (b->err == MOE_OK)
        rc = send_rep(k->fd, MOE_BULK_Y, MOE_OK, NULL, b->cid, b->seq, b->rows, b->nbytes) == 0 &&
                     write_full(k->fd, b->buf, b->nbytes) == 0
                 ? 0
                 : -1;
    else
        rc = send_rep(k->fd, MOE_BULK_ERR, b->err, b->msg, b->cid, b->seq, 0, 0);
    if (rc != 0) {
        pthread_mutex_lock(b->mu);
        b->dead = 1;
        pthread_mutex_unlock(b->mu);
    }
    dp_bulk_put(t, b);
    return rc;
}

static void *conn_main(void *arg)
{
    bconn *k = arg;
    wkr_bulk *s = k->srv;
    while (serve_one(k) == 0) {
    }
    pthread_mutex_lock(&s->mu);
    for (bconn **pp = &s->conns; *pp; pp = &(*pp)->next)
        if (*pp == k) {
            *pp = k->next;
            break;
        }
    s->nconns--;
    close(k->fd);
    close(k->efd);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    dp_bulk_conn_count(s->o.dp, -1);
    free(k);
    return NULL;
}

static void *accept_main(void *arg)
{
    wkr_bulk *s = arg;
    for (;;) {
        int fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
        pthread_mutex_lock(&s->mu);
        int stop = s->stopping;
        pthread_mutex_unlock(&s->mu);
        if (stop) {
            if (fd >= 0)
                close(fd);
            return NULL;
        }
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                struct timespec ts = {0, 20 * 1000000}; /* out of descriptors: back off */
                nanosleep(&ts, NULL);
            }
            continue;
        }
        int one = 1;
        struct timeval tv = {s->o.timeout_ms / 1000, (s->o.timeout_ms % 1000) * 1000};
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        bconn *k = calloc(1, sizeof(*k));
        int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        pthread_mutex_lock(&s->mu);
        int full = s->nconns >= s->o.max_conns;
        if (!full && k && efd >= 0) {
            k->srv = s;
            k->fd = fd;
            k->efd = efd;
            k->next = s->conns;
            s->conns = k;
            s->nconns++;
        }
        pthread_mutex_unlock(&s->mu);
        if (full || !k || efd < 0) {
            if (full)
                LOG_W("bulk: %d connections open: one more refused", s->o.max_conns);
            close(fd);
            if (efd >= 0)
                close(efd);
            free(k);
            continue;
        }
        dp_bulk_conn_count(s->o.dp, 1);
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &at, conn_main, k) != 0) {
            pthread_mutex_lock(&s->mu);
            s->conns = k->next; /* still the head: only this thread adds */
            s->nconns--;
            pthread_mutex_unlock(&s->mu);
            dp_bulk_conn_count(s->o.dp, -1);
            close(fd);
            close(efd);
            free(k);
        }
        pthread_attr_destroy(&at);
    }
}

moe_err wkr_bulk_open(const wkr_bulk_opts *o, wkr_bulk **out, char *bound, size_t boundlen)
{
    char host[256], port[16];
    *out = NULL;
    if (moe_bulk_url_split(o->url, host, sizeof(host), port, sizeof(port)) != MOE_OK) {
        LOG_E("bulk-listen %s: want tcp://host:port", o->url);
        return MOE_EINVAL;
    }
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(host, port, &hints, &ai) != 0 || !ai) {
        LOG_E("bulk-listen %s: cannot resolve %s", o->url, host);
        return MOE_EINVAL;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd >= 0)
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        LOG_E("bulk-listen %s: %s", o->url, strerror(errno));
        if (fd >= 0)
            close(fd);
        freeaddrinfo(ai);
        return MOE_EIO;
    }
    freeaddrinfo(ai);
    struct sockaddr_storage sa;
    socklen_t sl = sizeof(sa);
    char nh[INET6_ADDRSTRLEN], np[16];
    if (getsockname(fd, (struct sockaddr *)&sa, &sl) != 0 ||
        getnameinfo((struct sockaddr *)&sa, sl, nh, sizeof(nh), np, sizeof(np),
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
        close(fd);
        return MOE_EIO;
    }
    snprintf(bound, boundlen, sa.ss_family == AF_INET6 ? "tcp://[%s]:%s" : "tcp://%s:%s", nh, np);
    wkr_bulk *s = calloc(1, sizeof(*s));
    if (!s) {
        close(fd);
        return MOE_ENOMEM;
    }
    s->o = *o;
    snprintf(s->auth, sizeof(s->auth), "%s", o->auth_token ? o->auth_token : "");
    s->o.auth_token = s->auth;
    s->lfd = fd;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->accept_th, NULL, accept_main, s) != 0) {
        close(fd);
        free(s);
        return MOE_ENOMEM;
    }
    *out = s;
    return MOE_OK;
}

void wkr_bulk_close(wkr_bulk *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_mutex_unlock(&s->mu);
    shutdown(s->lfd, SHUT_RDWR); /* accept returns */
    pthread_join(s->accept_th, NULL);
    close(s->lfd);
    pthread_mutex_lock(&s->mu);
    for (bconn *k = s->conns; k; k = k->next)
        shutdown(k->fd, SHUT_RDWR); /* reads, writes and polls return */
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 5;
    while (s->nconns > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &dl) == 0) {
    }
    int left = s->nconns;
    pthread_mutex_unlock(&s->mu);
    if (left) { /* a thread still inside a call: leave it its memory */
        LOG_W("bulk: %d connections did not end in time", left);
        return;
    }
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
