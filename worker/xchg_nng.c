/*
 * xchg_nng.c - the nng backend of the exchange layer (CPU workers, host
 * buffers). See xchg.h for the interface.
 *
 * Sockets: each rank has one pull0 socket listening on its data URL and one
 * push0 socket per peer dialing that peer's URL, so messages from q to r
 * travel on one connection, in order.
 *
 * Rounds: a collective runs as one or two rounds. In a round every rank
 * sends one part to every peer (possibly 0 bytes, still one message) and
 * receives one part from every peer. A part is cut into chunks that fit the
 * receiver's NNG_OPT_RECVMAXSZ (announced in the handshake); every chunk is
 * one nng message: an nx_hdr followed by the chunk bytes. Sends are
 * asynchronous (nng_send_aio, all submitted first), then the caller's thread
 * receives synchronously: pull0 reads a connection only when the
 * application receives, so two ranks sending big parts to each other with
 * blocking sends would deadlock.
 *
 * Matching: the header carries the generation (other generations are
 * dropped), the round's sequence number (rounds are numbered alike on every
 * rank because every rank calls the same collectives in the same order) and
 * the kind of collective (a mismatch means the ranks are out of step:
 * MOE_EPROTO). A peer can be at most one round ahead (it cannot finish round
 * s+1 without our part of it), so messages of round s+1 received during
 * round s are stashed; anything further ahead is a protocol error.
 *
 * Failure: every round is bounded by timeout_ms. A peer that leaves (BYE
 * message, sent by a graceful close) or whose connection to us closes (pull
 * pipe removed: process died) fails the round at once if its part is
 * incomplete; the receive is polled in NX_POLL_MS slices so the flags are
 * seen even if the wake-up from the pipe callback is missed. Sends still
 * queued for a peer whose connection from us closed (push pipe removed)
 * are cancelled, which fails the round too.
 */
#include <arpa/inet.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nng/nng.h>
#include <nng/protocol/pipeline0/pull.h>
#include <nng/protocol/pipeline0/push.h>

#include "common/log.h"
#include "common/parcopy.h"
#include "worker/pool.h"
#include "worker/xchg.h"

#define NX_MAGIC        0x4843584du /* "MXCH" read as a little-endian u32 */
#define NX_VERSION      1
#define NX_POLL_MS      100  /* receive slice: flags and deadline checked this often */
#define NX_RECV_MAX_MIN 4096 /* smallest per-message cap accepted */
#define NX_BYE_SEND_MS  50   /* send timeout of BYE on a failed communicator */

enum nx_kind { NX_HELLO = 1, NX_A2A, NX_AG, NX_RS, NX_RAG, NX_BYE, NX_KIND_COUNT };

static const char *const nx_kind_name[NX_KIND_COUNT] = {
    [NX_HELLO] = "handshake",
    [NX_A2A] = "alltoallv",
    [NX_AG] = "allgather",
    [NX_RS] = "allreduce (reduce-scatter)",
    [NX_RAG] = "allreduce (allgather)",
    [NX_BYE] = "bye",
};

/* nx_hdr: the first 48 bytes of every message, host byte order (all ranks
 * run on one architecture; the magic catches a mismatch). */
typedef struct nx_hdr {
    uint32_t magic;
    uint8_t version;
    uint8_t kind; /* enum nx_kind */
    uint16_t reserved;
    uint32_t src; /* sender's rank */
    uint32_t reserved2;
    uint64_t gen;   /* communicator generation */
    uint64_t seq;   /* round number: 0 = handshake, then 1, 2, ... */
    uint64_t total; /* bytes of the whole part */
    uint64_t off;   /* offset of this chunk in the part */
} nx_hdr;
_Static_assert(sizeof(nx_hdr) == 48, "nx_hdr layout");

struct xchg_nng_listener {
    nng_socket pull;
    size_t recv_max; /* NNG_OPT_RECVMAXSZ, 0 = unlimited */
    /* messages of a newer generation than the communicator receiving
     * them: a peer that already joined the next generation sent them; they
     * wait here for that generation's open (bounded) */
    nng_msg **future;
    size_t nfuture, future_cap;
};
#define NX_FUTURE_MAX 65536

/* nx_rx: one peer's part of the current round, as received chunks. */
typedef struct nx_rx {
    nng_msg **m; /* [n] chunks in order */
    size_t n, cap;
    uint64_t total; /* from the first chunk */
    uint64_t got;   /* payload bytes received */
    int started;
} nx_rx;

typedef struct nx_peer {
    struct nx *x;
    int q;
    nng_socket push;
    int push_open;
    size_t chunk;       /* payload bytes per message to this peer */
    atomic_int rx_pipe; /* id of the pipe its messages arrive on (0 = unknown) */
    atomic_int rx_gone; /* that pipe closed: the peer left or died */
    atomic_int tx_gone; /* our connection to it closed: sends to it cannot complete */
    int bye;            /* the peer announced it leaves */
} nx_peer;

typedef struct nx {
    xchg pub; /* must be first */
    uint64_t gen;
    int timeout_ms;
    nng_socket pull;               /* borrowed from lis */
    struct xchg_nng_listener *lis; /* borrowed: outlives the communicator */
    size_t recv_max;
    nx_peer *peer;   /* [world] */
    nx_rx *rx;       /* [world] */
    const void **sp; /* [world] scratch: part for each rank */
    size_t *sn;      /* [world] scratch: its bytes */
    nng_msg **stash; /* messages of round cur_seq + 1 */
    size_t nstash, stash_cap;
    nng_aio *raio;  /* receive */
    nng_aio **saio; /* [saio_cap] sends of one round */
    int *saio_peer; /* [saio_cap] destination of each */
    size_t saio_cap;
    size_t nactive;      /* sends of the running round (guarded by mtx) */
    pthread_mutex_t mtx; /* saio, saio_peer, nactive vs. nx_push_rem */
    uint64_t seq;        /* last round number used */
    uint64_t cur_seq;    /* round being run */
    uint8_t cur_kind;
    atomic_int opened;
} nx;

static int64_t nx_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---------------------------------------------------------------- listener */

static moe_err nx_format_addr(const nng_sockaddr *sa, const char *url, char *buf, size_t len)
{
    char ip[INET6_ADDRSTRLEN];
    int n;
    if (sa->s_family == NNG_AF_INET) {
        struct in_addr a = {.s_addr = sa->s_in.sa_addr};
        if (a.s_addr == htonl(INADDR_ANY))
            snprintf(ip, sizeof(ip), "127.0.0.1");
        else
            inet_ntop(AF_INET, &a, ip, sizeof(ip));
        n = snprintf(buf, len, "tcp://%s:%u", ip, (unsigned)ntohs(sa->s_in.sa_port));
    } else if (sa->s_family == NNG_AF_INET6) {
        static const uint8_t any[16];
        if (memcmp(sa->s_in6.sa_addr, any, 16) == 0)
            snprintf(ip, sizeof(ip), "::1");
        else
            inet_ntop(AF_INET6, sa->s_in6.sa_addr, ip, sizeof(ip));
        n = snprintf(buf, len, "tcp://[%s]:%u", ip, (unsigned)ntohs(sa->s_in6.sa_port));
    } else {
        n = snprintf(buf, len, "%s", url);
    }
    return (n < 0 || (size_t)n >= len) ? MOE_EINVAL : MOE_OK;
}

moe_err xchg_nng_listen_max(const char *url, size_t recv_max, xchg_nng_listener **out,
                            char *bound_url, size_t bound_len)
{
    if (out)
        *out = NULL;
    if (!url || !out || (recv_max != 0 && recv_max < NX_RECV_MAX_MIN)) {
        LOG_E("xchg_nng_listen: invalid argument (url %s, recv_max %zu, minimum %d)",
              url ? url : "NULL", recv_max, NX_RECV_MAX_MIN);
        return MOE_EINVAL;
    }
    xchg_nng_listener *lis = calloc(1, sizeof(*lis));
    if (!lis)
        return MOE_ENOMEM;
    moe_err err = MOE_EUNAVAIL;
    nng_listener l;
    int rv;
    if ((rv = nng_pull0_open(&lis->pull)) != 0) {
        LOG_E("xchg_nng_listen: nng_pull0_open: %s", nng_strerror(rv));
        free(lis);
        return MOE_EUNAVAIL;
    }
    lis->recv_max = recv_max;
    if ((rv = nng_socket_set_size(lis->pull, NNG_OPT_RECVMAXSZ, recv_max)) != 0) {
        LOG_E("xchg_nng_listen: set recv-size-max: %s", nng_strerror(rv));
        goto fail;
    }
    if ((rv = nng_listener_create(&l, lis->pull, url)) != 0) {
        LOG_E("xchg_nng_listen: %s: %s", url, nng_strerror(rv));
        err = (rv == NNG_EADDRINVAL || rv == NNG_ENOTSUP || rv == NNG_EINVAL) ? MOE_EINVAL
                                                                              : MOE_EUNAVAIL;
        goto fail;
    }
    rv = nng_listener_set_size(l, NNG_OPT_RECVMAXSZ, recv_max);
    if (rv != 0 && rv != NNG_ENOTSUP) {
        LOG_E("xchg_nng_listen: %s: set recv-size-max: %s", url, nng_strerror(rv));
        goto fail;
    }
    if ((rv = nng_listener_start(l, 0)) != 0) {
        LOG_E("xchg_nng_listen: cannot listen on %s: %s", url, nng_strerror(rv));
        goto fail;
    }
    if (bound_url && bound_len) {
        nng_sockaddr sa;
        memset(&sa, 0, sizeof(sa));
        if (nng_listener_get_addr(l, NNG_OPT_LOCADDR, &sa) != 0)
            sa.s_family = NNG_AF_UNSPEC;
        if (nx_format_addr(&sa, url, bound_url, bound_len) != MOE_OK) {
            LOG_E("xchg_nng_listen: bound_url buffer of %zu bytes too small", bound_len);
            err = MOE_EINVAL;
            goto fail;
        }
    }
    LOG_D("xchg_nng_listen: listening on %s (recv max %zu)", bound_url ? bound_url : url, recv_max);
    *out = lis;
    return MOE_OK;
fail:
    nng_close(lis->pull);
    free(lis);
    return err;
}

moe_err xchg_nng_listen(const char *url, xchg_nng_listener **out, char *bound_url, size_t bound_len)
{
    return xchg_nng_listen_max(url, XCHG_NNG_RECV_MAX_DEFAULT, out, bound_url, bound_len);
}

void xchg_nng_listener_close(xchg_nng_listener *lis)
{
    if (!lis)
        return;
    nng_close(lis->pull);
    for (size_t i = 0; i < lis->nfuture; i++)
        nng_msg_free(lis->future[i]);
    free(lis->future);
    free(lis);
}

/* ------------------------------------------------------------------ helpers */

static size_t nx_chunk_for(size_t peer_recv_max)
{
    size_t c = XCHG_NNG_CHUNK_MAX;
    if (peer_recv_max != 0 && peer_recv_max - sizeof(nx_hdr) < c)
        c = peer_recv_max - sizeof(nx_hdr);
    return c & ~(size_t)63; /* keeps every chunk but the last a multiple of 4 (f32) */
}

static int nx_complete_from(const nx *x, int q)
{
    return x->rx[q].started && x->rx[q].got == x->rx[q].total;
}

static int nx_complete(const nx *x)
{
    for (int q = 0; q < x->pub.world; q++)
        if (q != x->pub.rank && !nx_complete_from(x, q))
            return 0;
    return 1;
}

/* nx_missing writes the ranks whose part is incomplete ("1,3") into buf. */
static void nx_missing(const nx *x, char *buf, size_t len)
{
    size_t n = 0;
    buf[0] = '\0';
    for (int q = 0; q < x->pub.world && n + 16 < len; q++)
        if (q != x->pub.rank && !nx_complete_from(x, q))
            n += (size_t)snprintf(buf + n, len - n, "%s%d", n ? "," : "", q);
}

static void nx_rx_clear(nx *x)
{
    for (int q = 0; q < x->pub.world; q++) {
        nx_rx *rx = &x->rx[q];
        for (size_t i = 0; i < rx->n; i++)
            nng_msg_free(rx->m[i]);
        rx->n = 0;
        rx->total = rx->got = 0;
        rx->started = 0;
    }
}

static const uint8_t *nx_payload(nng_msg *m, size_t *len)
{
    *len = nng_msg_len(m) - sizeof(nx_hdr);
    return (const uint8_t *)nng_msg_body(m) + sizeof(nx_hdr);
}

/* nx_rx_copy copies peer q's part (rx->total bytes) to dst. */
static void nx_rx_copy(const nx_rx *rx, void *dst)
{
    uint8_t *d = dst;
    for (size_t i = 0; i < rx->n; i++) {
        size_t len;
        const uint8_t *p = nx_payload(rx->m[i], &len);
        if (len)
            memcpy(d, p, len);
        d += len;
    }
}

/* nx_rx_add adds the part (floats) elementwise into acc. */
static void nx_rx_add(const nx_rx *rx, float *acc)
{
    for (size_t i = 0; i < rx->n; i++) {
        size_t len;
        const uint8_t *p = nx_payload(rx->m[i], &len);
        for (size_t k = 0; k < len / sizeof(float); k++) {
            float v;
            memcpy(&v, p + k * sizeof(float), sizeof(v));
            acc[k] += v;
        }
        acc += len / sizeof(float);
    }
}

static int nx_push(nng_msg ***arr, size_t *n, size_t *cap, nng_msg *m)
{
    if (*n == *cap) {
        size_t nc = *cap ? 2 * *cap : 8;
        nng_msg **na = realloc(*arr, nc * sizeof(*na));
        if (!na)
            return -1;
        *arr = na;
        *cap = nc;
    }
    (*arr)[(*n)++] = m;
    return 0;
}

static void nx_fail(nx *x, moe_err err)
{
    if (!x->pub.failed)
        LOG_W("xchg: rank %d: communicator (generation %llu) failed: %s; it must be rebuilt",
              x->pub.rank, (unsigned long long)x->gen, moe_strerror(err));
    x->pub.failed = 1;
    nx_rx_clear(x);
    for (size_t i = 0; i < x->nstash; i++)
        nng_msg_free(x->stash[i]);
    x->nstash = 0;
}

/* nx_pipe_rem runs on an nng thread when a pipe of the pull socket closes:
 * if it carried a peer's messages, that peer is gone. */
static void nx_pipe_rem(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    nx *x = arg;
    int id = nng_pipe_id(p);
    (void)ev;
    for (int q = 0; q < x->pub.world; q++) {
        if (q != x->pub.rank && id > 0 && atomic_load(&x->peer[q].rx_pipe) == id) {
            atomic_store(&x->peer[q].rx_gone, 1);
            nng_aio_cancel(x->raio); /* wake the receive */
        }
    }
}

/* nx_push_rem runs on an nng thread when our connection to a peer closes
 * (it closed its communicator or died): sends still queued for it cannot
 * complete, so they are cancelled now rather than at the timeout. */
static void nx_push_rem(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    nx_peer *pe = arg;
    nx *x = pe->x;
    (void)p;
    (void)ev;
    atomic_store(&pe->tx_gone, 1);
    pthread_mutex_lock(&x->mtx);
    for (size_t i = 0; i < x->nactive; i++)
        if (x->saio_peer[i] == pe->q)
            nng_aio_cancel(x->saio[i]);
    pthread_mutex_unlock(&x->mtx);
}

/* nx_accept routes one received message: into the current round, the
 * stash, or the bin. Takes ownership of m. */
static moe_err nx_accept(nx *x, nng_msg *m)
{
    size_t len = nng_msg_len(m);
    nx_hdr h;
    int r = x->pub.rank;
    if (len < sizeof(h)) {
        LOG_W("xchg: rank %d: dropped a %zu-byte message without header", r, len);
        goto drop;
    }
    memcpy(&h, nng_msg_body(m), sizeof(h));
    if (h.magic != NX_MAGIC || h.version != NX_VERSION || h.kind == 0 || h.kind >= NX_KIND_COUNT) {
        LOG_W("xchg: rank %d: dropped a message with a bad header (magic %08x version %u)", r,
              h.magic, h.version);
        goto drop;
    }
    if (h.gen > x->gen && x->lis->nfuture < NX_FUTURE_MAX) {
        /* a peer already in a newer generation: keep it for that open */
        if (nx_push(&x->lis->future, &x->lis->nfuture, &x->lis->future_cap, m) != 0)
            goto drop;
        return MOE_OK;
    }
    if (h.gen != x->gen) {
        LOG_D("xchg: rank %d: dropped a message of generation %llu (ours %llu)", r,
              (unsigned long long)h.gen, (unsigned long long)x->gen);
        goto drop;
    }
    if (h.src >= (uint32_t)x->pub.world || (int)h.src == r) {
        LOG_W("xchg: rank %d: dropped a message from invalid rank %u", r, h.src);
        goto drop;
    }
    if (h.kind == NX_BYE) {
        LOG_D("xchg: rank %d: rank %u leaves", r, h.src);
        x->peer[h.src].bye = 1;
        goto drop;
    }
    if (h.seq == x->cur_seq + 1) {
        if (nx_push(&x->stash, &x->nstash, &x->stash_cap, m) != 0) {
            nng_msg_free(m);
            return MOE_ENOMEM;
        }
        return MOE_OK;
    }
    if (h.seq < x->cur_seq) {
        LOG_W("xchg: rank %d: dropped a stale message of round %llu from rank %u (now %llu)", r,
              (unsigned long long)h.seq, h.src, (unsigned long long)x->cur_seq);
        goto drop;
    }
    if (h.seq != x->cur_seq || h.kind != x->cur_kind) {
        LOG_E("xchg: rank %d: rank %u sent %s round %llu while we run %s round %llu: ranks "
              "called collectives in different orders",
              r, h.src, nx_kind_name[h.kind], (unsigned long long)h.seq, nx_kind_name[x->cur_kind],
              (unsigned long long)x->cur_seq);
        nng_msg_free(m);
        return MOE_EPROTO;
    }
    nx_rx *rx = &x->rx[h.src];
    size_t body = len - sizeof(h);
    if (!rx->started) {
        rx->started = 1;
        rx->total = h.total;
    }
    if (h.total != rx->total || h.off != rx->got || body > rx->total - rx->got ||
        (body == 0 && rx->total != 0)) {
        LOG_E("xchg: rank %d: bad chunk from rank %u in %s round %llu (total %llu off %llu len "
              "%zu, expected total %llu off %llu)",
              r, h.src, nx_kind_name[h.kind], (unsigned long long)h.seq,
              (unsigned long long)h.total, (unsigned long long)h.off, body,
              (unsigned long long)rx->total, (unsigned long long)rx->got);
        nng_msg_free(m);
        return MOE_EPROTO;
    }
    if (nx_push(&rx->m, &rx->n, &rx->cap, m) != 0) {
        nng_msg_free(m);
        return MOE_ENOMEM;
    }
    rx->got += body;
    return MOE_OK;
drop:
    nng_msg_free(m);
    return MOE_OK;
}

static moe_err nx_saio(nx *x, size_t i, nng_aio **out)
{
    if (i >= x->saio_cap) {
        size_t nc = x->saio_cap ? 2 * x->saio_cap : 16;
        while (nc <= i)
            nc *= 2;
        nng_aio **na = realloc(x->saio, nc * sizeof(*na));
        if (!na)
            return MOE_ENOMEM;
        x->saio = na;
        int *np = realloc(x->saio_peer, nc * sizeof(*np));
        if (!np)
            return MOE_ENOMEM;
        x->saio_peer = np;
        for (size_t k = x->saio_cap; k < nc; k++) {
            if (nng_aio_alloc(&x->saio[k], NULL, NULL) != 0) {
                x->saio_cap = k;
                return MOE_ENOMEM;
            }
        }
        x->saio_cap = nc;
    }
    *out = x->saio[i];
    return MOE_OK;
}

static int nx_left_ms(int64_t deadline)
{
    int64_t left = deadline - nx_now_ms();
    return left < 1 ? 1 : (int)left;
}

/* nx_send_part queues part p (n bytes) for peer q as chunks; *nsend counts
 * the send aios in use. */
static moe_err nx_send_part(nx *x, int q, uint8_t kind, uint64_t seq, const void *p, size_t n,
                            int send_ms, size_t *nsend)
{
    size_t chunk = x->peer[q].chunk, off = 0;
    do {
        size_t len = n - off < chunk ? n - off : chunk;
        nng_msg *m;
        nng_aio *a;
        int rv;
        if ((rv = nng_msg_alloc(&m, sizeof(nx_hdr) + len)) != 0) {
            LOG_E("xchg: rank %d: nng_msg_alloc(%zu): %s", x->pub.rank, sizeof(nx_hdr) + len,
                  nng_strerror(rv));
            return MOE_ENOMEM;
        }
        nx_hdr h = {.magic = NX_MAGIC,
                    .version = NX_VERSION,
                    .kind = kind,
                    .src = (uint32_t)x->pub.rank,
                    .gen = x->gen,
                    .seq = seq,
                    .total = n,
                    .off = off};
        uint8_t *b = nng_msg_body(m);
        memcpy(b, &h, sizeof(h));
        if (len)
            memcpy(b + sizeof(h), (const uint8_t *)p + off, len);
        pthread_mutex_lock(&x->mtx);
        moe_err err = nx_saio(x, *nsend, &a);
        if (err == MOE_OK) {
            x->saio_peer[*nsend] = q;
            x->nactive = *nsend + 1;
        }
        pthread_mutex_unlock(&x->mtx);
        if (err != MOE_OK) {
            nng_msg_free(m);
            return MOE_ENOMEM;
        }
        nng_aio_set_msg(a, m);
        nng_aio_set_timeout(a, send_ms);
        nng_send_aio(x->peer[q].push, a);
        (*nsend)++;
        off += len;
    } while (off < n);
    return MOE_OK;
}

/* nx_wait_sends waits for the nsend send aios (cancelled first if err). */
static moe_err nx_wait_sends(nx *x, size_t nsend, moe_err err)
{
    if (err != MOE_OK)
        for (size_t i = 0; i < nsend; i++)
            nng_aio_cancel(x->saio[i]);
    for (size_t i = 0; i < nsend; i++) {
        nng_aio *a = x->saio[i];
        int q = x->saio_peer[i];
        if (atomic_load(&x->peer[q].tx_gone))
            nng_aio_cancel(a); /* (nx_push_rem cancels those that go later) */
        nng_aio_wait(a);
        int rv = nng_aio_result(a);
        if (rv != 0) {
            nng_msg *m = nng_aio_get_msg(a);
            if (m)
                nng_msg_free(m);
            nng_aio_set_msg(a, NULL);
            if (err == MOE_OK) {
                if (atomic_load(&x->peer[q].tx_gone))
                    LOG_W("xchg: rank %d: rank %d disconnected during %s round %llu", x->pub.rank,
                          q, nx_kind_name[x->cur_kind], (unsigned long long)x->cur_seq);
                else
                    LOG_W("xchg: rank %d: %s round %llu: send to rank %d failed: %s", x->pub.rank,
                          nx_kind_name[x->cur_kind], (unsigned long long)x->cur_seq, q,
                          nng_strerror(rv));
                err = MOE_EUNAVAIL;
            }
        }
    }
    pthread_mutex_lock(&x->mtx);
    x->nactive = 0;
    pthread_mutex_unlock(&x->mtx);
    return err;
}

/* nx_check_peers fails the round if a peer whose part is incomplete left. */
static moe_err nx_check_peers(nx *x)
{
    for (int q = 0; q < x->pub.world; q++) {
        if (q == x->pub.rank || nx_complete_from(x, q))
            continue;
        int gone = atomic_load(&x->peer[q].rx_gone);
        if (gone || x->peer[q].bye) {
            LOG_W("xchg: rank %d: rank %d %s during %s round %llu", x->pub.rank, q,
                  x->peer[q].bye ? "left (closed its communicator)" : "disconnected",
                  nx_kind_name[x->cur_kind], (unsigned long long)x->cur_seq);
            return MOE_EUNAVAIL;
        }
    }
    return MOE_OK;
}

/* nx_round runs one round: part x->sp[q] (x->sn[q] bytes) goes to each peer
 * q and each peer's part lands in x->rx[q]. On failure the communicator is
 * failed. */
static moe_err nx_round(nx *x, uint8_t kind, uint64_t seq)
{
    int64_t deadline = nx_now_ms() + x->timeout_ms;
    int r = x->pub.rank, W = x->pub.world;
    size_t nsend = 0;
    moe_err err = MOE_OK;

    nx_rx_clear(x);
    x->cur_seq = seq;
    x->cur_kind = kind;
    /* the stash holds only messages of this round: accept them (the
     * array is swapped out because nx_accept may stash again) */
    nng_msg **st = x->stash;
    size_t nst = x->nstash;
    x->stash = NULL;
    x->nstash = x->stash_cap = 0;
    for (size_t i = 0; i < nst; i++) {
        if (err == MOE_OK)
            err = nx_accept(x, st[i]);
        else
            nng_msg_free(st[i]);
    }
    free(st);

    for (int i = 1; i < W && err == MOE_OK; i++) {
        int q = (r + i) % W; /* spread: rank r starts with r+1 */
        err = nx_send_part(x, q, kind, seq, x->sp[q], x->sn[q], nx_left_ms(deadline), &nsend);
    }

    while (err == MOE_OK && !nx_complete(x)) {
        if ((err = nx_check_peers(x)) != MOE_OK)
            break;
        if (xchg_abort_requested(x->gen)) {
            LOG_W("xchg: rank %d: %s round %llu: generation %llu given up (a member is gone)", r,
                  nx_kind_name[kind], (unsigned long long)seq, (unsigned long long)x->gen);
            err = MOE_EUNAVAIL;
            break;
        }
        int64_t left = deadline - nx_now_ms();
        if (left <= 0) {
            char miss[256];
            nx_missing(x, miss, sizeof(miss));
            LOG_W("xchg: rank %d: %s round %llu timed out after %d ms waiting for ranks %s", r,
                  nx_kind_name[kind], (unsigned long long)seq, x->timeout_ms, miss);
            err = MOE_EUNAVAIL;
            break;
        }
        nng_aio_set_timeout(x->raio, left < NX_POLL_MS ? (nng_duration)left : NX_POLL_MS);
        nng_recv_aio(x->pull, x->raio);
        nng_aio_wait(x->raio);
        int rv = nng_aio_result(x->raio);
        if (rv == 0) {
            nng_msg *m = nng_aio_get_msg(x->raio);
            nng_aio_set_msg(x->raio, NULL);
            err = nx_accept(x, m);
        } else if (rv != NNG_ETIMEDOUT && rv != NNG_ECANCELED) {
            LOG_W("xchg: rank %d: %s round %llu: receive failed: %s", r, nx_kind_name[kind],
                  (unsigned long long)seq, nng_strerror(rv));
            err = MOE_EUNAVAIL;
        }
    }
    err = nx_wait_sends(x, nsend, err);
    if (err != MOE_OK)
        nx_fail(x, err);
    return err;
}

static moe_err nx_check(nx *x)
{
    if (x->pub.failed) {
        LOG_D("xchg: rank %d: communicator failed earlier", x->pub.rank);
        return MOE_EUNAVAIL;
    }
    return MOE_OK;
}

/* -------------------------------------------------------------- collectives */

static moe_err nx_alltoallv(xchg *xp, const void *sendbuf, const size_t *send_bytes, void **recvbuf,
                            size_t *recv_bytes)
{
    nx *x = (nx *)xp;
    int r = xp->rank, W = xp->world;
    if (recvbuf)
        *recvbuf = NULL;
    if (!send_bytes || !recvbuf || !recv_bytes)
        return MOE_EINVAL;
    moe_err err = nx_check(x);
    if (err != MOE_OK)
        return err;
    const uint8_t *p = sendbuf;
    for (int q = 0; q < W; q++) {
        if (!p && send_bytes[q]) {
            LOG_E("xchg_alltoallv: rank %d: sendbuf NULL with %zu bytes for rank %d", r,
                  send_bytes[q], q);
            return MOE_EINVAL;
        }
        x->sp[q] = p;
        x->sn[q] = send_bytes[q];
        if (p)
            p += send_bytes[q];
    }
    if ((err = nx_round(x, NX_A2A, ++x->seq)) != MOE_OK)
        return err;
    size_t total = 0;
    for (int q = 0; q < W; q++) {
        recv_bytes[q] = q == r ? send_bytes[r] : (size_t)x->rx[q].total;
        total += recv_bytes[q];
    }
    uint8_t *out = NULL;
    if (total && !(out = wpool_alloc(total))) {
        LOG_E("xchg_alltoallv: rank %d: cannot allocate %zu bytes", r, total);
        nx_rx_clear(x); /* the peers are in step: the communicator stays usable */
        return MOE_ENOMEM;
    }
    size_t off = 0;
    for (int q = 0; q < W; q++) {
        if (q == r) {
            if (recv_bytes[q])
                par_memcpy(out + off, x->sp[r], recv_bytes[q]);
        } else {
            nx_rx_copy(&x->rx[q], out + off);
        }
        off += recv_bytes[q];
    }
    nx_rx_clear(x);
    *recvbuf = out;
    return MOE_OK;
}

static moe_err nx_allgather(xchg *xp, const void *sendbuf, size_t nbytes, void *recvbuf)
{
    nx *x = (nx *)xp;
    int r = xp->rank, W = xp->world;
    if (nbytes && (!sendbuf || !recvbuf))
        return MOE_EINVAL;
    moe_err err = nx_check(x);
    if (err != MOE_OK)
        return err;
    for (int q = 0; q < W; q++) {
        x->sp[q] = sendbuf;
        x->sn[q] = nbytes;
    }
    if ((err = nx_round(x, NX_AG, ++x->seq)) != MOE_OK)
        return err;
    for (int q = 0; q < W; q++) {
        if (q != r && x->rx[q].total != nbytes) {
            LOG_E("xchg_allgather: rank %d: rank %d sent %llu bytes, we expect %zu", r, q,
                  (unsigned long long)x->rx[q].total, nbytes);
            nx_fail(x, MOE_EPROTO);
            return MOE_EPROTO;
        }
    }
    uint8_t *out = recvbuf;
    if (nbytes)
        memmove(out + (size_t)r * nbytes, sendbuf, nbytes);
    for (int q = 0; q < W; q++)
        if (q != r)
            nx_rx_copy(&x->rx[q], out + (size_t)q * nbytes);
    nx_rx_clear(x);
    return MOE_OK;
}

/* The allreduce is a reduce-scatter then an allgather: rank q owns segment q
 * of the buffer (n split as evenly as possible), receives every rank's copy
 * of it and sums them in rank order 0..W-1 (so the bits depend only on the
 * inputs and W), then every rank gathers all reduced segments. Each rank
 * moves about 2 n (W-1)/W floats each way. */
static void nx_seg(size_t n, int W, int q, size_t *off, size_t *len)
{
    size_t base = n / (size_t)W, rem = n % (size_t)W, uq = (size_t)q;
    *off = uq * base + (uq < rem ? uq : rem);
    *len = base + (uq < rem ? 1 : 0);
}

static moe_err nx_allreduce_f32(xchg *xp, float *buf, size_t n)
{
    nx *x = (nx *)xp;
    int r = xp->rank, W = xp->world;
    if (n && !buf)
        return MOE_EINVAL;
    moe_err err = nx_check(x);
    if (err != MOE_OK || W == 1)
        return err;
    size_t off, len;
    nx_seg(n, W, r, &off, &len);
    float *acc = NULL; /* (len) our reduced segment */
    if (len && !(acc = malloc(len * sizeof(float)))) {
        LOG_E("xchg_allreduce_f32: rank %d: cannot allocate %zu floats", r, len);
        return MOE_ENOMEM;
    }
    for (int q = 0; q < W; q++) {
        size_t qo, ql;
        nx_seg(n, W, q, &qo, &ql);
        x->sp[q] = buf + qo;
        x->sn[q] = ql * sizeof(float);
    }
    if ((err = nx_round(x, NX_RS, ++x->seq)) != MOE_OK)
        goto out;
    for (int q = 0; q < W; q++) {
        if (q != r && x->rx[q].total != len * sizeof(float)) {
            LOG_E("xchg_allreduce_f32: rank %d: rank %d sent %llu bytes for our segment, we "
                  "expect %zu (different n on the ranks?)",
                  r, q, (unsigned long long)x->rx[q].total, len * sizeof(float));
            err = MOE_EPROTO;
            nx_fail(x, err);
            goto out;
        }
    }
    if (len) {
        if (r == 0)
            memcpy(acc, buf + off, len * sizeof(float));
        else
            nx_rx_copy(&x->rx[0], acc);
        for (int q = 1; q < W; q++) {
            if (q == r) {
                for (size_t i = 0; i < len; i++)
                    acc[i] += buf[off + i];
            } else {
                nx_rx_add(&x->rx[q], acc);
            }
        }
        memcpy(buf + off, acc, len * sizeof(float));
    }
    nx_rx_clear(x);
    for (int q = 0; q < W; q++) {
        x->sp[q] = buf + off;
        x->sn[q] = len * sizeof(float);
    }
    if ((err = nx_round(x, NX_RAG, ++x->seq)) != MOE_OK)
        goto out;
    for (int q = 0; q < W; q++) {
        size_t qo, ql;
        nx_seg(n, W, q, &qo, &ql);
        if (q == r)
            continue;
        if (x->rx[q].total != ql * sizeof(float)) {
            LOG_E("xchg_allreduce_f32: rank %d: rank %d sent a %llu-byte segment, expected %zu", r,
                  q, (unsigned long long)x->rx[q].total, ql * sizeof(float));
            err = MOE_EPROTO;
            nx_fail(x, err);
            goto out;
        }
        nx_rx_copy(&x->rx[q], buf + qo);
    }
    nx_rx_clear(x);
out:
    free(acc);
    return err;
}

static void nx_free_buf(xchg *xp, void *buf)
{
    (void)xp;
    wpool_free(buf);
}

/* ---------------------------------------------------------- open and close */

/* nx_bye tells every peer we leave; with wait, then waits (timeout_ms at
 * most) until each peer left too, so that none loses data in flight. */
static void nx_bye(nx *x, int wait)
{
    int r = x->pub.rank, W = x->pub.world;
    size_t nsend = 0;
    int send_ms = wait ? x->timeout_ms : NX_BYE_SEND_MS;
    for (int q = 0; q < W; q++) {
        if (q != r && !atomic_load(&x->peer[q].rx_gone) && !atomic_load(&x->peer[q].tx_gone) &&
            nx_send_part(x, q, NX_BYE, x->seq, NULL, 0, send_ms, &nsend) != MOE_OK)
            break;
    }
    if (wait) {
        int64_t deadline = nx_now_ms() + x->timeout_ms;
        for (;;) {
            int pending = 0;
            for (int q = 0; q < W; q++)
                if (q != r && !x->peer[q].bye && !atomic_load(&x->peer[q].rx_gone) &&
                    !atomic_load(&x->peer[q].tx_gone))
                    pending = 1;
            if (!pending)
                break;
            int64_t left = deadline - nx_now_ms();
            if (left <= 0) {
                LOG_W("xchg: rank %d: close: peers still up after %d ms; closing anyway", r,
                      x->timeout_ms);
                break;
            }
            nng_aio_set_timeout(x->raio, left < NX_POLL_MS ? (nng_duration)left : NX_POLL_MS);
            nng_recv_aio(x->pull, x->raio);
            nng_aio_wait(x->raio);
            int rv = nng_aio_result(x->raio);
            if (rv == 0) {
                nng_msg *m = nng_aio_get_msg(x->raio);
                nng_aio_set_msg(x->raio, NULL);
                nx_hdr h;
                if (nng_msg_len(m) >= sizeof(h)) {
                    memcpy(&h, nng_msg_body(m), sizeof(h));
                    if (h.magic == NX_MAGIC && h.gen == x->gen && h.kind == NX_BYE &&
                        h.src < (uint32_t)W)
                        x->peer[h.src].bye = 1;
                    if (h.magic == NX_MAGIC && h.gen > x->gen && x->lis->nfuture < NX_FUTURE_MAX &&
                        nx_push(&x->lis->future, &x->lis->nfuture, &x->lis->future_cap, m) == 0)
                        continue; /* kept for the next generation */
                }
                nng_msg_free(m);
            } else if (rv != NNG_ETIMEDOUT && rv != NNG_ECANCELED) {
                break;
            }
        }
    }
    /* BYEs to peers that left are pointless; cancel what is still queued */
    nx_wait_sends(x, nsend, MOE_EUNAVAIL);
}

static void nx_destroy(nx *x)
{
    if (!x)
        return;
    nng_pipe_notify(x->pull, NNG_PIPE_EV_REM_POST, NULL, NULL);
    if (x->peer)
        for (int q = 0; q < x->pub.world; q++)
            if (x->peer[q].push_open) {
                nng_pipe_notify(x->peer[q].push, NNG_PIPE_EV_REM_POST, NULL, NULL);
                nng_close(x->peer[q].push);
            }
    /* the pull socket belongs to the listener, which outlives us */
    if (x->rx) {
        nx_rx_clear(x);
        for (int q = 0; q < x->pub.world; q++)
            free(x->rx[q].m);
    }
    for (size_t i = 0; i < x->nstash; i++)
        nng_msg_free(x->stash[i]);
    free(x->stash);
    for (size_t i = 0; i < x->saio_cap; i++)
        nng_aio_free(x->saio[i]);
    free(x->saio);
    free(x->saio_peer);
    if (x->raio)
        nng_aio_free(x->raio);
    free(x->peer);
    free(x->rx);
    free(x->sp);
    free(x->sn);
    pthread_mutex_destroy(&x->mtx);
    free(x);
}

static void nx_close(xchg *xp)
{
    nx *x = (nx *)xp;
    if (atomic_load(&x->opened) && x->pub.world > 1)
        nx_bye(x, !x->pub.failed);
    LOG_D("xchg: rank %d: closed", xp->rank);
    nx_destroy(x);
}

static const xchg_ops nx_ops = {
    .alltoallv = nx_alltoallv,
    .allreduce_f32 = nx_allreduce_f32,
    .allgather = nx_allgather,
    .free_buf = nx_free_buf,
    .close = nx_close,
};

moe_err xchg_nng_open(xchg_nng_listener *lis, int rank, int world, const char *const *peer_urls,
                      uint64_t generation, int timeout_ms, xchg **out)
{
    if (out)
        *out = NULL;
    if (!lis || !out || world < 1 || rank < 0 || rank >= world || timeout_ms <= 0 ||
        (world > 1 && !peer_urls)) {
        LOG_E("xchg_nng_open: invalid argument (rank %d world %d timeout %d ms)", rank, world,
              timeout_ms);
        return MOE_EINVAL;
    }
    for (int q = 0; q < world; q++) {
        if (q != rank && !peer_urls[q]) {
            LOG_E("xchg_nng_open: rank %d: no URL for rank %d", rank, q);
            return MOE_EINVAL;
        }
    }
    nx *x = calloc(1, sizeof(*x));
    if (!x) {
        return MOE_ENOMEM;
    }
    x->pub.ops = &nx_ops;
    x->pub.rank = rank;
    x->pub.world = world;
    x->gen = generation;
    x->timeout_ms = timeout_ms;
    x->pull = lis->pull;
    x->lis = lis;
    x->recv_max = lis->recv_max;
    pthread_mutex_init(&x->mtx, NULL);
    /* messages of this generation that arrived early (a peer joined first)
     * are this handshake's: stash them; older ones are dropped */
    {
        size_t keep = 0;
        for (size_t i = 0; i < lis->nfuture; i++) {
            nng_msg *m = lis->future[i];
            nx_hdr h;
            memcpy(&h, nng_msg_body(m), sizeof(h));
            if (h.gen == generation && nx_push(&x->stash, &x->nstash, &x->stash_cap, m) == 0)
                continue;
            if (h.gen > generation)
                lis->future[keep++] = m;
            else
                nng_msg_free(m);
        }
        lis->nfuture = keep;
    }

    moe_err err = MOE_ENOMEM;
    int rv;
    x->peer = calloc((size_t)world, sizeof(*x->peer));
    x->rx = calloc((size_t)world, sizeof(*x->rx));
    x->sp = calloc((size_t)world, sizeof(*x->sp));
    x->sn = calloc((size_t)world, sizeof(*x->sn));
    if (!x->peer || !x->rx || !x->sp || !x->sn || nng_aio_alloc(&x->raio, NULL, NULL) != 0)
        goto fail;
    if ((rv = nng_pipe_notify(x->pull, NNG_PIPE_EV_REM_POST, nx_pipe_rem, x)) != 0) {
        LOG_E("xchg_nng_open: nng_pipe_notify: %s", nng_strerror(rv));
        err = MOE_EINTERNAL;
        goto fail;
    }
    for (int q = 0; q < world; q++) {
        nx_peer *p = &x->peer[q];
        if (q == rank)
            continue;
        p->chunk = nx_chunk_for(NX_RECV_MAX_MIN);
        if ((rv = nng_push0_open(&p->push)) != 0) {
            LOG_E("xchg_nng_open: nng_push0_open: %s", nng_strerror(rv));
            err = MOE_EUNAVAIL;
            goto fail;
        }
        p->push_open = 1;
        p->x = x;
        p->q = q;
        if ((rv = nng_pipe_notify(p->push, NNG_PIPE_EV_REM_POST, nx_push_rem, p)) != 0) {
            LOG_E("xchg_nng_open: nng_pipe_notify: %s", nng_strerror(rv));
            err = MOE_EINTERNAL;
            goto fail;
        }
        nng_socket_set_ms(p->push, NNG_OPT_RECONNMINT, 10);
        nng_socket_set_ms(p->push, NNG_OPT_RECONNMAXT, 200);
        if ((rv = nng_dial(p->push, peer_urls[q], NULL, NNG_FLAG_NONBLOCK)) != 0) {
            LOG_E("xchg_nng_open: rank %d: cannot dial rank %d at %s: %s", rank, q, peer_urls[q],
                  nng_strerror(rv));
            err = MOE_EINVAL;
            goto fail;
        }
    }

    /* handshake: round 0 carries each rank's receive cap */
    uint64_t my_max = x->recv_max;
    for (int q = 0; q < world; q++) {
        x->sp[q] = &my_max;
        x->sn[q] = sizeof(my_max);
    }
    if ((err = nx_round(x, NX_HELLO, 0)) != MOE_OK) {
        LOG_E("xchg_nng_open: rank %d of %d: cluster not formed within %d ms (%s)", rank, world,
              timeout_ms, moe_strerror(err));
        if (err != MOE_ENOMEM)
            err = MOE_EUNAVAIL;
        goto fail;
    }
    for (int q = 0; q < world; q++) {
        uint64_t peer_max;
        if (q == rank)
            continue;
        if (x->rx[q].total != sizeof(peer_max)) {
            LOG_E("xchg_nng_open: rank %d: bad handshake from rank %d", rank, q);
            err = MOE_EUNAVAIL;
            goto fail;
        }
        nx_rx_copy(&x->rx[q], &peer_max);
        x->peer[q].chunk = nx_chunk_for((size_t)peer_max);
        atomic_store(&x->peer[q].rx_pipe, nng_pipe_id(nng_msg_get_pipe(x->rx[q].m[0])));
    }
    nx_rx_clear(x);
    atomic_store(&x->opened, 1);
    LOG_I("xchg: rank %d of %d up (nng, generation %llu, timeout %d ms)", rank, world,
          (unsigned long long)generation, timeout_ms);
    *out = &x->pub;
    return MOE_OK;
fail:
    nx_destroy(x);
    return err;
}
