/*
 * xchg_shm.c - the shared-memory backend of the exchange layer: CPU
 * workers on one host exchange rows through memory they all map, with no
 * socket in the way (xchg.h has the interface). At one row of decode the
 * nng backend's two all-to-all rounds cost two network round trips each
 * way; here a round costs a few cache-line writes and a futex wake-up.
 *
 * Segments: rank r creates /moe-x<token>-g<generation>-r<r> holding a
 * header and W inbound rings, ring q carrying the bytes rank q sends to r
 * (q = r unused). Every rank maps every peer's segment, counts itself in
 * the owner's header, and the owner unlinks its name once all W-1 peers
 * mapped it (nothing is left in /dev/shm while the ranks run; a rank killed
 * before that point leaves a segment that xchg_shm_sweep removes later).
 *
 * Rings: single producer, single consumer; `head` counts the bytes the
 * sender wrote, `tail` those the receiver took (monotonic, position modulo
 * the ring's size); each on its own cache line, stored with release and
 * read with acquire. A collective sends every peer a 16-byte header
 * (sequence number, length) and then the bytes; a receiver learns every
 * size before it places the bytes (a sender one round ahead finds the ring
 * holding at most the last round's bytes, which the receiver takes before
 * it starts this round). One loop pushes what fits and pulls what arrived
 * for every peer until all parts are through: no rank blocks on a full
 * ring while its own inbound rings fill, so there is no deadlock.
 *
 * Waiting: a rank with nothing to do spins XS_SPIN_US, then sleeps on its
 * doorbell (a counter in its header that a peer bumps after it wrote into
 * or read from a ring of this rank's; FUTEX_WAKE when the header says the
 * owner sleeps), waking every XS_POLL_MS to check the deadline, the
 * coordinator's abort (xchg_aborted), peers that left (their header's
 * `left`) or died (kill(pid, 0); only for peers whose pid this process can
 * see). Any of these fails the communicator: MOE_EUNAVAIL from then on.
 *
 * Sums (allreduce) run in rank order 0..W-1 over every element, the bits of
 * the nng backend's.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/parcopy.h"
#include "common/procstat.h"
#include "worker/pool.h"
#include "worker/xchg.h"

#define XS_MAGIC   0x4d53584du /* "MXSM" */
#define XS_HDR     4096        /* header bytes; the rings follow */
#define XS_RING    ((size_t)1 << 20)
#define XS_POLL_MS 5
#define XS_SPIN_US 20
#define XS_MSG     16    /* a part's header: u64 sequence, u64 length */
#define XS_OPEN_MS 10000 /* the most an open waits for its peers */

/* the header of a rank's segment (shared; words at fixed offsets) */
typedef struct xs_hdr {
    uint32_t magic; /* stored last, with release: the rest is valid */
    uint32_t world, rank, pid;
    uint64_t generation;
    uint8_t pad0[40];
    uint32_t doorbell; /* bumped by peers; the owner's futex word */
    uint32_t sleeping; /* 1 while the owner sleeps on doorbell */
    uint32_t mapped;   /* peers that mapped this segment */
    uint32_t left;     /* the owner closed its communicator */
} xs_hdr;

/* one inbound ring's control words, 128 bytes before its data */
typedef struct xs_ring {
    uint64_t head; /* bytes written by the sender */
    uint8_t pad0[56];
    uint64_t tail; /* bytes taken by the receiver */
    uint8_t pad1[56];
} xs_ring;

#define XS_RING_STRIDE (sizeof(xs_ring) + XS_RING)

typedef struct xs_peer {
    uint8_t *seg; /* the peer's mapped segment (ours for q = rank) */
    int pid_visible;
    /* the current collective */
    const uint8_t *sp; /* what we send it */
    size_t sn, sent;   /* bytes, bytes written (header included) */
    uint8_t mhdr[XS_MSG];
    size_t got;      /* bytes read (header included) */
    uint64_t rlen;   /* its part's length, once its header is read */
    uint8_t *dst;    /* where its part goes (NULL until placed) */
    int64_t last_ms; /* when it last made progress (for the log) */
} xs_peer;

typedef struct xs {
    xchg pub;
    char name[96]; /* our segment's name (unlinked once mapped by all) */
    size_t seg_bytes;
    int timeout_ms;
    uint64_t gen, seq;
    xs_peer *peer; /* (W) */
} xs;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000;
}

static xs_hdr *hdr_of(const uint8_t *seg)
{
    return (xs_hdr *)seg;
}

/* ring_of: ring `from` in segment seg (the bytes rank `from` sends to the
 * segment's owner) */
static xs_ring *ring_of(const uint8_t *seg, int from)
{
    return (xs_ring *)(seg + XS_HDR + (size_t)from * XS_RING_STRIDE);
}

static uint8_t *ring_data(xs_ring *rg)
{
    return (uint8_t *)(rg + 1);
}

static void ring_bell(uint8_t *seg)
{
    xs_hdr *h = hdr_of(seg);
    __atomic_add_fetch(&h->doorbell, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&h->sleeping, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &h->doorbell, FUTEX_WAKE, 1, NULL, NULL, 0);
}

static void seg_name(char *buf, size_t len, const char *token, uint64_t gen, int rank)
{
    snprintf(buf, len, "/moe-x%s-g%llu-r%d", token, (unsigned long long)gen, rank);
}

/* push writes what fits of our part for peer q into its ring; 1 if any */
static int push(xs *x, int q)
{
    xs_peer *p = &x->peer[q];
    size_t total = XS_MSG + p->sn;
    if (p->sent == total)
        return 0;
    xs_ring *rg = ring_of(p->seg, x->pub.rank);
    uint64_t head = rg->head; /* ours alone */
    uint64_t tail = __atomic_load_n(&rg->tail, __ATOMIC_ACQUIRE);
    size_t room = XS_RING - (size_t)(head - tail);
    size_t moved = 0;
    while (room && p->sent < total) {
        size_t at = (size_t)(head % XS_RING), span = XS_RING - at;
        size_t n = total - p->sent;
        if (n > room)
            n = room;
        if (n > span)
            n = span;
        if (p->sent < XS_MSG) { /* the header first (rings are empty then: it fits whole) */
            uint64_t m[2] = {x->seq, p->sn};
            size_t k = XS_MSG - p->sent;
            if (k > n)
                k = n;
            memcpy(ring_data(rg) + at, (const uint8_t *)m + p->sent, k);
            n = k;
        } else {
            memcpy(ring_data(rg) + at, p->sp + (p->sent - XS_MSG), n);
        }
        p->sent += n;
        head += n;
        room -= n;
        moved += n;
    }
    if (!moved)
        return 0;
    __atomic_store_n(&rg->head, head, __ATOMIC_RELEASE);
    ring_bell(p->seg);
    return 1;
}

/* pull reads what arrived from peer q: its header, then (once dst is
 * placed) its bytes; 1 if any. MOE_EPROTO on a header of another round. */
static int pull(xs *x, int q, moe_err *err)
{
    xs_peer *p = &x->peer[q];
    uint8_t *own = x->peer[x->pub.rank].seg;
    xs_ring *rg = ring_of(own, q);
    if (p->got >= XS_MSG && p->got == XS_MSG + p->rlen)
        return 0;
    if (p->got >= XS_MSG && !p->dst && p->rlen)
        return 0;             /* its bytes wait until every size is known */
    uint64_t tail = rg->tail; /* ours alone */
    uint64_t head = __atomic_load_n(&rg->head, __ATOMIC_ACQUIRE);
    size_t avail = (size_t)(head - tail), moved = 0;
    while (avail) {
        size_t at = (size_t)(tail % XS_RING), span = XS_RING - at, n = avail;
        if (n > span)
            n = span;
        if (p->got < XS_MSG) {
            size_t k = XS_MSG - p->got;
            if (k > n)
                k = n;
            memcpy(p->mhdr + p->got, ring_data(rg) + at, k);
            p->got += k;
            n = k;
            if (p->got == XS_MSG) {
                uint64_t m[2];
                memcpy(m, p->mhdr, sizeof(m));
                if (m[0] != x->seq) {
                    LOG_E("xchg_shm: rank %d: rank %d sent round %llu during round %llu",
                          x->pub.rank, q, (unsigned long long)m[0], (unsigned long long)x->seq);
                    *err = MOE_EPROTO;
                    return 0;
                }
                p->rlen = m[1];
            }
        } else {
            size_t left = (size_t)(XS_MSG + p->rlen - p->got);
            if (!p->dst || !left)
                break;
            if (n > left)
                n = left;
            memcpy(p->dst + (p->got - XS_MSG), ring_data(rg) + at, n);
            p->got += n;
        }
        tail += n;
        avail -= n;
        moved += n;
        if (p->got >= XS_MSG && (!p->dst || p->got == XS_MSG + p->rlen))
            break;
    }
    if (!moved)
        return 0;
    __atomic_store_n(&rg->tail, tail, __ATOMIC_RELEASE);
    ring_bell(p->seg); /* the sender may wait for room */
    return 1;
}

static void fail(xs *x, moe_err e)
{
    (void)e;
    x->pub.failed = 1;
}

/* pid_gone: the process is gone, or a zombie nobody reaped yet */
static int pid_gone(uint32_t pid)
{
    if (kill((pid_t)pid, 0) != 0)
        return errno == ESRCH;
    procstat ps;
    return procstat_read((int)pid, &ps) == 0 && ps.state == 'Z';
}

/* check_peers: a peer that left or died while this round still needs it:
 * bytes of ours it has not taken, or bytes of its that are not in our ring
 * (a peer that finished its last round and closed has written all of its
 * part before it left: what is in the ring is still read) */
static moe_err check_peers(xs *x)
{
    uint8_t *own = x->peer[x->pub.rank].seg;
    for (int q = 0; q < x->pub.world; q++) {
        if (q == x->pub.rank)
            continue;
        xs_peer *p = &x->peer[q];
        xs_hdr *h = hdr_of(p->seg);
        xs_ring *in = ring_of(own, q);
        int need_out = p->sent != XS_MSG + p->sn;
        int need_in = !(p->got >= XS_MSG && p->got == XS_MSG + p->rlen);
        int waiting = __atomic_load_n(&in->head, __ATOMIC_ACQUIRE) != in->tail;
        if (!need_out && (!need_in || waiting))
            continue;
        if (__atomic_load_n(&h->left, __ATOMIC_ACQUIRE)) {
            LOG_W("xchg_shm: rank %d: rank %d left during round %llu", x->pub.rank, q,
                  (unsigned long long)x->seq);
            return MOE_EUNAVAIL;
        }
        if (p->pid_visible && pid_gone(h->pid)) {
            LOG_W("xchg_shm: rank %d: rank %d (pid %u) is gone during round %llu", x->pub.rank, q,
                  h->pid, (unsigned long long)x->seq);
            return MOE_EUNAVAIL;
        }
    }
    return MOE_OK;
}

/* round: every peer's part out (x->peer[q].sp/sn) and in; place() is
 * called once every size is known and must set each peer's dst. */
static moe_err round_run(xs *x, moe_err (*place)(xs *x, void *arg), void *arg)
{
    const int r = x->pub.rank, W = x->pub.world;
    const int64_t deadline = now_ms() + x->timeout_ms;
    xs_hdr *me = hdr_of(x->peer[r].seg);
    int placed = 0;
    moe_err err = MOE_OK;
    x->seq++;
    for (int q = 0; q < W; q++) {
        x->peer[q].sent = x->peer[q].got = 0;
        x->peer[q].rlen = 0;
        x->peer[q].dst = NULL;
    }
    uint64_t spin_until = now_us() + XS_SPIN_US;
    for (;;) {
        uint32_t bell = __atomic_load_n(&me->doorbell, __ATOMIC_ACQUIRE);
        int progress = 0, done = 1, sizes = 1;
        for (int i = 1; i < W; i++) {
            int q = (r + i) % W;
            progress |= push(x, q);
            progress |= pull(x, q, &err);
            if (err != MOE_OK)
                goto out;
            xs_peer *p = &x->peer[q];
            sizes &= p->got >= XS_MSG;
            done &= p->sent == XS_MSG + p->sn && p->got >= XS_MSG && p->got == XS_MSG + p->rlen;
        }
        if (sizes && !placed) {
            if ((err = place(x, arg)) != MOE_OK)
                goto out;
            placed = 1;
            continue; /* the bytes waiting in the rings go to their places now */
        }
        if (done && placed)
            break;
        if (progress) {
            spin_until = now_us() + XS_SPIN_US;
            continue;
        }
        if (now_us() < spin_until)
            continue;
        if ((err = check_peers(x)) != MOE_OK)
            goto out;
        if (xchg_abort_requested(x->gen)) {
            LOG_W("xchg_shm: rank %d: round %llu: generation %llu given up (a member is gone)", r,
                  (unsigned long long)x->seq, (unsigned long long)x->gen);
            err = MOE_EUNAVAIL;
            goto out;
        }
        int64_t left = deadline - now_ms();
        if (left <= 0) {
            LOG_W("xchg_shm: rank %d: round %llu timed out after %d ms", r,
                  (unsigned long long)x->seq, x->timeout_ms);
            err = MOE_EUNAVAIL;
            goto out;
        }
        __atomic_store_n(&me->sleeping, 1u, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&me->doorbell, __ATOMIC_SEQ_CST) == bell) {
            struct timespec ts = {0, XS_POLL_MS * 1000000L};
            syscall(SYS_futex, &me->doorbell, FUTEX_WAIT, bell, &ts, NULL, 0);
        }
        __atomic_store_n(&me->sleeping, 0u, __ATOMIC_SEQ_CST);
    }
out:
    if (err != MOE_OK)
        fail(x, err);
    return err;
}

/* ---- the collectives ---- */

typedef struct a2a_out {
    size_t *recv_bytes;
    uint8_t *buf; /* owned by the caller on success */
} a2a_out;

static moe_err a2a_place(xs *x, void *arg)
{
    a2a_out *o = arg;
    const int r = x->pub.rank, W = x->pub.world;
    size_t total = 0;
    for (int q = 0; q < W; q++) {
        o->recv_bytes[q] = q == r ? x->peer[r].sn : (size_t)x->peer[q].rlen;
        total += o->recv_bytes[q];
    }
    if (total && !(o->buf = wpool_alloc(total))) {
        LOG_E("xchg_alltoallv: rank %d: cannot allocate %zu bytes", r, total);
        return MOE_ENOMEM; /* the peers cannot finish this round without us: failed */
    }
    size_t off = 0;
    for (int q = 0; q < W; q++) {
        if (q == r) {
            if (o->recv_bytes[q])
                par_memcpy(o->buf + off, x->peer[r].sp, o->recv_bytes[q]);
        } else {
            x->peer[q].dst = o->buf + off;
        }
        off += o->recv_bytes[q];
    }
    return MOE_OK;
}

static moe_err xs_alltoallv(xchg *xp, const void *sendbuf, const size_t *send_bytes, void **recvbuf,
                            size_t *recv_bytes)
{
    xs *x = (xs *)xp;
    const int W = xp->world;
    if (recvbuf)
        *recvbuf = NULL;
    if (!send_bytes || !recvbuf || !recv_bytes)
        return MOE_EINVAL;
    if (xp->failed)
        return MOE_EUNAVAIL;
    const uint8_t *p = sendbuf;
    for (int q = 0; q < W; q++) {
        if (!p && send_bytes[q])
            return MOE_EINVAL;
        x->peer[q].sp = p;
        x->peer[q].sn = send_bytes[q];
        if (p)
            p += send_bytes[q];
    }
    a2a_out o = {recv_bytes, NULL};
    moe_err e = round_run(x, a2a_place, &o);
    if (e != MOE_OK) {
        wpool_free(o.buf);
        return e;
    }
    *recvbuf = o.buf;
    return MOE_OK;
}

typedef struct ag_out {
    uint8_t *buf; /* (W * nbytes) */
    size_t nbytes;
} ag_out;

static moe_err ag_place(xs *x, void *arg)
{
    ag_out *o = arg;
    for (int q = 0; q < x->pub.world; q++) {
        if (q == x->pub.rank)
            continue;
        if (x->peer[q].rlen != o->nbytes) {
            LOG_E("xchg_allgather: rank %d: rank %d sends %llu bytes, we expect %zu", x->pub.rank,
                  q, (unsigned long long)x->peer[q].rlen, o->nbytes);
            return MOE_EPROTO;
        }
        x->peer[q].dst = o->buf + (size_t)q * o->nbytes;
    }
    return MOE_OK;
}

static moe_err xs_allgather(xchg *xp, const void *sendbuf, size_t nbytes, void *recvbuf)
{
    xs *x = (xs *)xp;
    const int r = xp->rank, W = xp->world;
    if (nbytes && (!sendbuf || !recvbuf))
        return MOE_EINVAL;
    if (xp->failed)
        return MOE_EUNAVAIL;
    uint8_t *out = recvbuf;
    if (nbytes)
        memmove(out + (size_t)r * nbytes, sendbuf, nbytes);
    for (int q = 0; q < W; q++) {
        x->peer[q].sp = out + (size_t)r * nbytes;
        x->peer[q].sn = nbytes;
    }
    ag_out o = {out, nbytes};
    return round_run(x, ag_place, &o);
}

static moe_err xs_allreduce_f32(xchg *xp, float *buf, size_t n)
{
    const int W = xp->world;
    if (n && !buf)
        return MOE_EINVAL;
    if (xp->failed)
        return MOE_EUNAVAIL;
    if (W == 1 || n == 0)
        return MOE_OK;
    float *all = malloc((size_t)W * n * sizeof(float)); /* (W, n) every rank's buffer */
    if (!all)
        return MOE_ENOMEM;
    moe_err e = xs_allgather(xp, buf, n * sizeof(float), all);
    if (e == MOE_OK) {
        /* in rank order, as the nng backend sums each segment */
        memcpy(buf, all, n * sizeof(float));
        for (int q = 1; q < W; q++) {
            const float *b = all + (size_t)q * n;
            for (size_t i = 0; i < n; i++)
                buf[i] += b[i];
        }
    }
    free(all);
    return e;
}

static void xs_free_buf(xchg *xp, void *buf)
{
    (void)xp;
    wpool_free(buf);
}

static void xs_destroy(xs *x)
{
    const int W = x->pub.world;
    for (int q = 0; x->peer && q < W; q++)
        if (x->peer[q].seg)
            munmap(x->peer[q].seg, x->seg_bytes);
    free(x->peer);
    free(x);
}

static void xs_close(xchg *xp)
{
    xs *x = (xs *)xp;
    const int r = xp->rank, W = xp->world;
    uint8_t *own = x->peer[r].seg;
    if (own) {
        __atomic_store_n(&hdr_of(own)->left, 1u, __ATOMIC_RELEASE);
        for (int q = 0; q < W; q++) /* a peer asleep in a round sees it at once */
            if (q != r && x->peer[q].seg)
                ring_bell(x->peer[q].seg);
    }
    shm_unlink(x->name); /* normally gone already */
    xs_destroy(x);
}

static const xchg_ops xs_ops = {xs_alltoallv, xs_allreduce_f32, xs_allgather, xs_free_buf,
                                xs_close};

/* map_peer opens peer q's segment, waiting (until deadline) for it to exist
 * and to be of this generation. */
static moe_err map_peer(xs *x, const char *token, int q, int64_t deadline)
{
    char name[96];
    seg_name(name, sizeof(name), token, x->gen, q);
    for (;;) {
        int fd = shm_open(name, O_RDWR, 0);
        if (fd >= 0) {
            struct stat st;
            uint8_t *seg = MAP_FAILED;
            if (fstat(fd, &st) == 0 && (size_t)st.st_size == x->seg_bytes)
                seg = mmap(NULL, x->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (seg != MAP_FAILED) {
                xs_hdr *h = hdr_of(seg);
                if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == XS_MAGIC &&
                    h->generation == x->gen && (int)h->rank == q && (int)h->world == x->pub.world) {
                    x->peer[q].seg = seg;
                    int rv = kill((pid_t)h->pid, 0);
                    x->peer[q].pid_visible = rv == 0 || errno == EPERM;
                    __atomic_add_fetch(&h->mapped, 1, __ATOMIC_SEQ_CST);
                    ring_bell(seg);
                    return MOE_OK;
                }
                munmap(seg, x->seg_bytes); /* not filled in yet */
            }
        }
        if (now_ms() >= deadline) {
            LOG_W("xchg_shm: rank %d: rank %d's segment %s did not appear", x->pub.rank, q, name);
            return MOE_EUNAVAIL;
        }
        usleep(1000);
    }
}

moe_err xchg_shm_open(int rank, int world, const char *token, uint64_t generation, int timeout_ms,
                      xchg **out)
{
    *out = NULL;
    if (world < 1 || rank < 0 || rank >= world || timeout_ms <= 0 || !token || !*token ||
        strlen(token) > 40)
        return MOE_EINVAL;
    for (const char *p = token; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')))
            return MOE_EINVAL;
    xs *x = calloc(1, sizeof(*x));
    if (!x || !(x->peer = calloc((size_t)world, sizeof(xs_peer)))) {
        free(x);
        return MOE_ENOMEM;
    }
    x->pub.ops = &xs_ops;
    x->pub.rank = rank;
    x->pub.world = world;
    x->gen = generation;
    x->timeout_ms = timeout_ms;
    x->seg_bytes = XS_HDR + (size_t)world * XS_RING_STRIDE;
    seg_name(x->name, sizeof(x->name), token, generation, rank);
    shm_unlink(x->name); /* a leftover of a rank that died here before */
    int fd = shm_open(x->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, (off_t)x->seg_bytes) != 0 ||
        posix_fallocate(fd, 0, (off_t)x->seg_bytes) != 0) {
        LOG_E("xchg_shm: rank %d: cannot make segment %s of %zu bytes: %s", rank, x->name,
              x->seg_bytes, strerror(errno));
        if (fd >= 0)
            close(fd);
        shm_unlink(x->name);
        xs_destroy(x);
        return MOE_EUNAVAIL;
    }
    uint8_t *seg = mmap(NULL, x->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (seg == MAP_FAILED) {
        shm_unlink(x->name);
        xs_destroy(x);
        return MOE_ENOMEM;
    }
    x->peer[rank].seg = seg;
    xs_hdr *h = hdr_of(seg);
    h->world = (uint32_t)world;
    h->rank = (uint32_t)rank;
    h->pid = (uint32_t)getpid();
    h->generation = generation;
    __atomic_store_n(&h->magic, XS_MAGIC, __ATOMIC_RELEASE);
    /* peers that share a boot id but not /dev/shm never appear: bounded */
    const int64_t deadline = now_ms() + (timeout_ms < XS_OPEN_MS ? timeout_ms : XS_OPEN_MS);
    moe_err e = MOE_OK;
    for (int i = 1; i < world && e == MOE_OK; i++)
        e = map_peer(x, token, (rank + i) % world, deadline);
    /* every peer mapped ours: its name can go */
    while (e == MOE_OK && __atomic_load_n(&h->mapped, __ATOMIC_ACQUIRE) < (uint32_t)(world - 1)) {
        if (now_ms() >= deadline) {
            LOG_W("xchg_shm: rank %d: %u of %d peers mapped our segment", rank,
                  __atomic_load_n(&h->mapped, __ATOMIC_ACQUIRE), world - 1);
            e = MOE_EUNAVAIL;
            break;
        }
        usleep(200);
    }
    shm_unlink(x->name);
    if (e != MOE_OK) {
        xs_close(&x->pub);
        return e;
    }
    *out = &x->pub;
    return MOE_OK;
}

void xchg_shm_sweep(void)
{
    /* segments of ranks that died before their peers mapped them: unlinked
     * once their owner's pid is gone (the header says which) */
    DIR *d = opendir("/dev/shm");
    struct dirent *de;
    if (!d)
        return;
    while ((de = readdir(d))) {
        if (strncmp(de->d_name, "moe-x", 5) != 0)
            continue;
        char name[300];
        snprintf(name, sizeof(name), "/%s", de->d_name);
        int fd = shm_open(name, O_RDONLY, 0);
        if (fd < 0)
            continue;
        xs_hdr h;
        ssize_t n = pread(fd, &h, sizeof(h), 0);
        close(fd);
        if (n == (ssize_t)sizeof(h) && h.magic == XS_MAGIC && kill((pid_t)h.pid, 0) != 0 &&
            errno == ESRCH)
            shm_unlink(name);
    }
    closedir(d);
}
