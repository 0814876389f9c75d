/*
 * client_ring.c - libmoe's end of a shared-memory ring (client_ring.h; the
 * layout is docs/PROTOCOL.md's, "Data plane", 8).
 */
#include "client/client_ring.h"
#include "proto/ring_wire.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static uint32_t *word(const moe_ring *r, int off)
{
    return (uint32_t *)(r->base + off);
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

moe_err moe_shm_make(const char *name, size_t size, void **base)
{
    *base = NULL;
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return MOE_EIO;
    /* reserve the pages now: a full /dev/shm fails here, not as SIGBUS later */
    if (ftruncate(fd, (off_t)size) != 0 || posix_fallocate(fd, 0, (off_t)size) != 0) {
        close(fd);
        shm_unlink(name);
        return MOE_ENOMEM;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(name);
        return MOE_ENOMEM;
    }
    *base = p;
    return MOE_OK;
}

moe_err moe_ring_map(moe_ring *r, const char *name, size_t size)
{
    memset(r, 0, sizeof(*r));
    if (size < RING_MIN || size > RING_MAX || size % 64)
        return MOE_EINVAL;
    void *p;
    moe_err e = moe_shm_make(name, size, &p);
    if (e != MOE_OK)
        return e;
    r->base = p; /* a fresh segment reads zero: counters 0, nobody idle */
    r->size = size;
    r->req_cap = ring_req_cap((uint32_t)r->size);
    r->rep_off = RING_HEAD + r->req_cap;
    r->rep_cap = (uint32_t)r->size - r->rep_off;
    return MOE_OK;
}

void moe_ring_unmap(moe_ring *r)
{
    if (r->base)
        munmap(r->base, r->size);
    memset(r, 0, sizeof(*r));
}

moe_err moe_ring_post(moe_ring *r, const void *params, size_t len)
{
    return moe_ring_post2(r, params, len, NULL, 0);
}

moe_err moe_ring_post2(moe_ring *r, const void *head, size_t hlen, const void *tail, size_t tlen)
{
    const size_t len = hlen + tlen;
    if (len == 0 || len > r->req_cap)
        return MOE_ETOOBIG;
    memcpy(r->base + RING_HEAD, head, hlen);
    if (tlen)
        memcpy(r->base + RING_HEAD + hlen, tail, tlen);
    __atomic_store_n(word(r, RING_REQ_LEN), (uint32_t)len, __ATOMIC_RELAXED);
    __atomic_store_n(word(r, RING_REQ_SEQ), ++r->seq, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(word(r, RING_WORKER_IDLE), __ATOMIC_SEQ_CST))
        futex(word(r, RING_REQ_SEQ), FUTEX_WAKE, 1, NULL);
    return MOE_OK;
}

static uint64_t spin_ns(void)
{
    static long us = -1;
    long v = __atomic_load_n(&us, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *s = getenv("MOE_RING_SPIN_US");
        v = s && *s ? strtol(s, NULL, 10) : 0;
        if (v < 0 || v > 1000000)
            v = 0;
        __atomic_store_n(&us, v, __ATOMIC_RELAXED);
    }
    return (uint64_t)v * 1000ull;
}

moe_err moe_ring_wait(moe_ring *r, int timeout_ms, const int *up, const uint8_t **ans, size_t *len)
{
    uint32_t *rep = word(r, RING_REP_SEQ), *idle = word(r, RING_CLIENT_IDLE);
    const uint64_t t0 = now_ns(), spin_until = t0 + spin_ns();
    const uint64_t deadline = t0 + (uint64_t)(timeout_ms > 0 ? timeout_ms : 1) * 1000000ull;
    for (;;) {
        uint32_t s = __atomic_load_n(rep, __ATOMIC_ACQUIRE);
        if (s == r->seq) {
            uint32_t n = __atomic_load_n(word(r, RING_REP_LEN), __ATOMIC_RELAXED);
            if (n == 0 || n > r->rep_cap) {
                r->dead = 1;
                return MOE_EPROTO;
            }
            *ans = r->base + r->rep_off;
            *len = n;
            return MOE_OK;
        }
        uint64_t now = now_ns();
        if (now < spin_until)
            continue;
        if (now >= deadline) {
            r->dead = 1;
            return MOE_ETIMEDOUT;
        }
        if (up && __atomic_load_n(up, __ATOMIC_RELAXED) <= 0) {
            r->dead = 1;
            return MOE_EUNAVAIL;
        }
        /* sleep on the answer counter: say so, then look once more */
        __atomic_store_n(idle, 1u, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(rep, __ATOMIC_SEQ_CST) != r->seq) {
            struct timespec ts = {0, 10 * 1000000};
            futex(rep, FUTEX_WAIT, s, &ts);
        }
        __atomic_store_n(idle, 0u, __ATOMIC_SEQ_CST);
    }
}
