/* client_bulk.c - libmoe's side of the bulk path; see client_bulk.h. */
#include "client/client_bulk.h"
#include "proto/bulk_wire.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void moe_bulk_pool_init(moe_bulk_pool *p, const char *url)
{
    memset(p, 0, sizeof(*p));
    snprintf(p->url, sizeof(p->url), "%s", url);
    pthread_mutex_init(&p->mu, NULL);
}

void moe_bulk_pool_fini(moe_bulk_pool *p)
{
    for (int i = 0; i < p->nidle; i++)
        close(p->idle[i]);
    p->nidle = 0;
    pthread_mutex_destroy(&p->mu);
}

/* conn_alive: an idle connection the worker has not closed (nothing to
 * read on it, no EOF) */
static int conn_alive(int fd)
{
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* pool_take: an idle live connection, or -1 */
static int pool_take(moe_bulk_pool *p)
{
    int fd = -1;
    pthread_mutex_lock(&p->mu);
    while (fd < 0 && p->nidle > 0) {
        fd = p->idle[--p->nidle];
        if (!conn_alive(fd)) {
            close(fd);
            fd = -1;
        }
    }
    pthread_mutex_unlock(&p->mu);
    return fd;
}

static void pool_put(moe_bulk_pool *p, int fd)
{
    pthread_mutex_lock(&p->mu);
    if (p->nidle < MOE_BULK_POOL_MAX) {
        p->idle[p->nidle++] = fd;
        fd = -1;
    }
    pthread_mutex_unlock(&p->mu);
    if (fd >= 0)
        close(fd);
}

static void set_timeouts(int fd, int ms)
{
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

/* dial connects to url within timeout_ms: the socket, or -1 (msg set) */
static int dial(const char *url, int timeout_ms, char *msg, size_t msglen)
{
    char host[256], port[16];
    struct addrinfo hints, *ai = NULL;
    if (moe_bulk_url_split(url, host, sizeof(host), port, sizeof(port)) != MOE_OK) {
        snprintf(msg, msglen, "bad bulk address %s", url);
        return -1;
    }
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &ai) != 0 || !ai) {
        snprintf(msg, msglen, "cannot resolve %s", host);
        return -1;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int rc = fd < 0 ? -1 : connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (fd >= 0 && rc != 0 && errno == EINPROGRESS) {
        struct pollfd pf = {fd, POLLOUT, 0};
        int soerr = 0;
        socklen_t sl = sizeof(soerr);
        if (poll(&pf, 1, timeout_ms) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0)
            rc = soerr ? -1 : 0, errno = soerr;
        else
            errno = ETIMEDOUT;
    }
    freeaddrinfo(ai);
    if (rc != 0) {
        snprintf(msg, msglen, "cannot connect to %s: %s", url, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    set_timeouts(fd, timeout_ms);
    return fd;
}

/* io_full: n bytes out (wr) or in; 0, or -1 with errno (0 = EOF) */
static int io_full(int fd, void *buf, size_t n, int wr)
{
    uint8_t *p = buf;
    while (n) {
        size_t want = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t k = wr ? send(fd, p, want, MSG_NOSIGNAL) : recv(fd, p, want, MSG_WAITALL);
        if (k == 0 && !wr) {
            errno = 0;
            return -1;
        }
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* read_rep reads a reply header and, for an error, its text into p->msg:
 * the header's kind, or -1 (p->e and p->msg set). */
static int read_rep(moe_bulk_part *p, moe_bulk_rep *h, const char *when)
{
    moe_bulk_xfer *t = p->t;
    uint8_t b[MOE_BULK_REP_LEN];
    if (io_full(p->fd, b, sizeof(b), 0) != 0) {
        p->e = errno == EAGAIN || errno == EWOULDBLOCK ? MOE_ETIMEDOUT : MOE_EUNAVAIL;
        snprintf(p->msg, sizeof(p->msg), "bulk connection to %s %s: %s", t->pool->url, when,
                 errno ? strerror(errno) : "closed by the worker");
        return -1;
    }
    if (moe_bulk_rep_decode(b, h) != MOE_OK || h->cid != t->cid || h->seq != t->seq) {
        p->e = MOE_EPROTO;
        snprintf(p->msg, sizeof(p->msg), "bulk connection to %s: malformed reply header",
                 t->pool->url);
        return -1;
    }
    if (h->kind == MOE_BULK_ERR) {
        char text[MOE_BULK_MSG_MAX + 1];
        if (io_full(p->fd, text, h->msg_len, 0) != 0)
            h->msg_len = 0;
        text[h->msg_len] = 0;
        p->e = h->status > 0 && h->status < MOE_ERR_COUNT ? (moe_err)h->status : MOE_EINTERNAL;
        snprintf(p->msg, sizeof(p->msg), "%s", text);
        return -1;
    }
    return h->kind;
}

static void set_state(moe_bulk_part *p, int st)
{
    moe_bulk_xfer *t = p->t;
    pthread_mutex_lock(&t->mu);
    p->state = st;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

/* part_bytes: bytes of p's rows (x and y alike) */
static size_t part_bytes(const moe_bulk_part *p)
{
    return (size_t)p->rows * (size_t)p->t->cols * moe_dtype_size(p->t->dt);
}

/* send_rows: header, auth, p's rows of x on p->fd, then the ack. 1 =
 * acked, 0 = the connection failed before any answer (a fresh one may be
 * tried), -1 = failed (p->e set). */
static int send_rows(moe_bulk_part *p)
{
    moe_bulk_xfer *t = p->t;
    uint8_t hb[MOE_BULK_REQ_LEN];
    size_t al = t->auth ? strlen(t->auth) : 0;
    size_t es = moe_dtype_size(t->dt), nb = (size_t)t->rows * (size_t)t->cols * es;
    moe_bulk_req h = {MOE_BULK_MAGIC,     MOE_BULK_VERSION, (uint16_t)al, t->cid, t->seq,
                      (uint32_t)t->dt,    t->rows,          t->cols,      nb,     (uint16_t)p->idx,
                      (uint16_t)t->nparts};
    moe_bulk_req_encode(&h, hb);
    const uint8_t *x = (const uint8_t *)t->x + (size_t)p->row0 * (size_t)t->cols * es;
    if (io_full(p->fd, hb, sizeof(hb), 1) != 0 || io_full(p->fd, (void *)t->auth, al, 1) != 0 ||
        io_full(p->fd, (void *)x, part_bytes(p), 1) != 0) {
        /* the worker may have answered why before closing */
        moe_bulk_rep r;
        int en = errno;
        if (read_rep(p, &r, "while sending") < 0 && p->e != MOE_EUNAVAIL && p->e != MOE_ETIMEDOUT)
            return -1;
        p->e = en == EAGAIN || en == EWOULDBLOCK ? MOE_ETIMEDOUT : MOE_EUNAVAIL;
        snprintf(p->msg, sizeof(p->msg), "sending rows to %s: %s", t->pool->url,
                 en ? strerror(en) : "closed");
        return 0;
    }
    moe_bulk_rep r;
    int k = read_rep(p, &r, "waiting for the ack");
    if (k < 0)
        return p->e == MOE_EUNAVAIL ? 0 : -1;
    if (k != MOE_BULK_ACK) {
        p->e = MOE_EPROTO;
        snprintf(p->msg, sizeof(p->msg), "bulk connection to %s: no ack", t->pool->url);
        return -1;
    }
    return 1;
}

/* set_fd publishes the part's connection (moe_bulk_finish may shut it
 * from another thread): 0, or -1 when the transfer was aborted (fd closed) */
static int set_fd(moe_bulk_part *p, int fd)
{
    moe_bulk_xfer *t = p->t;
    pthread_mutex_lock(&t->mu);
    int old = p->fd, ab = t->aborted;
    p->fd = ab ? -1 : fd;
    pthread_mutex_unlock(&t->mu);
    if (old >= 0 && old != fd)
        close(old);
    if (ab && fd >= 0)
        close(fd);
    return ab ? -1 : 0;
}

static void *part_main(void *arg)
{
    moe_bulk_part *p = arg;
    moe_bulk_xfer *t = p->t;
    int sent = -1;
    for (int attempt = 0; attempt < 2 && sent != 1; attempt++) {
        int reused = 1;
        int fd = attempt == 0 ? pool_take(t->pool) : -1;
        if (fd < 0) {
            reused = 0;
            fd = dial(t->pool->url, t->timeout_ms, p->msg, sizeof(p->msg));
            if (fd < 0) {
                p->e = MOE_EUNAVAIL;
                break;
            }
        } else {
            set_timeouts(fd, t->timeout_ms);
        }
        if (set_fd(p, fd) != 0) {
            p->e = MOE_ECLOSED;
            snprintf(p->msg, sizeof(p->msg), "bulk transfer aborted");
            break;
        }
        p->e = MOE_OK;
        sent = send_rows(p);
        if (sent != 1)
            set_fd(p, -1);
        if (sent < 0 || !reused) /* only a stale pooled connection is retried */
            break;
    }
    if (sent != 1) {
        if (p->e == MOE_OK)
            p->e = MOE_EUNAVAIL;
        set_state(p, 2);
        return NULL;
    }
    set_state(p, 1);
    moe_bulk_rep r;
    int k = read_rep(p, &r, "waiting for the output rows");
    size_t nb = part_bytes(p);
    uint8_t *y = (uint8_t *)t->y + (size_t)p->row0 * (size_t)t->cols * moe_dtype_size(t->dt);
    if (k == MOE_BULK_Y && (r.rows != p->rows || r.nbytes != nb)) {
        p->e = MOE_EPROTO;
        snprintf(p->msg, sizeof(p->msg), "bulk connection to %s: %llu bytes of y, want %zu",
                 t->pool->url, (unsigned long long)r.nbytes, nb);
    } else if (k == MOE_BULK_Y && io_full(p->fd, y, nb, 0) != 0) {
        p->e = MOE_EUNAVAIL;
        snprintf(p->msg, sizeof(p->msg), "bulk connection to %s: output rows cut off",
                 t->pool->url);
    } else if (k == MOE_BULK_Y) {
        p->got_y = 1;
    } else if (k >= 0) {
        p->e = MOE_EPROTO;
        snprintf(p->msg, sizeof(p->msg), "bulk connection to %s: a second ack", t->pool->url);
    }
    set_state(p, 2);
    return NULL;
}

moe_err moe_bulk_start(moe_bulk_xfer *t)
{
    int n = t->parts < 1 ? 1 : t->parts > MOE_BULK_MAX_PARTS ? MOE_BULK_MAX_PARTS : t->parts;
    if (n > t->rows)
        n = t->rows > 0 ? (int)t->rows : 1;
    t->nparts = n;
    t->aborted = 0;
    t->e = MOE_OK;
    t->msg[0] = 0;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    t->started = 1;
    for (int i = 0; i < n; i++) {
        moe_bulk_part *p = &t->part[i];
        memset(p, 0, sizeof(*p));
        p->t = t;
        p->idx = i;
        p->fd = -1;
        moe_bulk_part_rows(t->rows, n, i, &p->row0, &p->rows);
        if (pthread_create(&p->th, NULL, part_main, p) != 0) {
            p->e = MOE_ENOMEM;
            snprintf(p->msg, sizeof(p->msg), "cannot start a bulk transfer thread");
            p->state = 2;
        } else {
            p->started = 1;
        }
    }
    return MOE_OK;
}

moe_err moe_bulk_wait_ack(moe_bulk_xfer *t)
{
    moe_err e = MOE_OK;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        int acked = 0;
        e = MOE_OK;
        for (int i = 0; i < t->nparts && e == MOE_OK; i++) {
            const moe_bulk_part *p = &t->part[i];
            if (p->state == 2 && !p->got_y) /* ended without y: failed */
                e = p->e != MOE_OK ? p->e : MOE_EUNAVAIL;
            acked += p->state >= 1;
        }
        if (e != MOE_OK || acked == t->nparts)
            break;
        pthread_cond_wait(&t->cv, &t->mu);
    }
    for (int i = 0; i < t->nparts && e != MOE_OK; i++)
        if (t->part[i].state == 2 && !t->part[i].got_y) {
            t->e = e;
            snprintf(t->msg, sizeof(t->msg), "%s", t->part[i].msg);
            break;
        }
    pthread_mutex_unlock(&t->mu);
    return e;
}

moe_err moe_bulk_finish(moe_bulk_xfer *t, int abort)
{
    if (!t->started)
        return t->e;
    if (abort) {
        pthread_mutex_lock(&t->mu);
        t->aborted = 1;
        for (int i = 0; i < t->nparts; i++)
            if (t->part[i].fd >= 0)
                shutdown(t->part[i].fd, SHUT_RDWR); /* the thread's reads and writes return */
        pthread_mutex_unlock(&t->mu);
    }
    int all_y = 1;
    t->e = MOE_OK;
    for (int i = 0; i < t->nparts; i++) {
        moe_bulk_part *p = &t->part[i];
        if (p->started)
            pthread_join(p->th, NULL);
        p->started = 0;
        all_y &= p->got_y;
        if (p->e != MOE_OK && t->e == MOE_OK) {
            t->e = p->e;
            snprintf(t->msg, sizeof(t->msg), "%s", p->msg);
        }
        if (p->fd >= 0) {
            if (p->got_y && !abort)
                pool_put(t->pool, p->fd);
            else
                close(p->fd);
            p->fd = -1;
        }
    }
    t->started = 0;
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    if (t->e == MOE_OK && !all_y) {
        t->e = abort ? MOE_ECLOSED : MOE_EUNAVAIL;
        snprintf(t->msg, sizeof(t->msg), "bulk transfer %s before its output rows came",
                 abort ? "aborted" : "ended");
    }
    return t->e;
}
