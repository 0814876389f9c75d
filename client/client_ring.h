/*
 * client_ring.h - libmoe's end of a shared-memory ring (internal): a
 * data.rows request posted to a worker on this host through memory both
 * map, with no socket in the way (docs/PROTOCOL.md, "Data plane", 8). The
 * ring lives at the start of a segment of its own; client_dp.c attaches
 * it (data.shm_attach, data.ring_attach) on the worker's connection.
 *
 * One request at a time per ring: moe_ring_post, then moe_ring_wait, which
 * spins $MOE_RING_SPIN_US microseconds (default 0: a spinning client
 * competes with the worker for the cores of a small host) on the answer counter
 * and then sleeps on it (FUTEX_WAIT), waking every 10 ms to look at the
 * deadline and the connection. A ring whose answer did not come (deadline,
 * connection down) is dead: the worker may still write into it later, so
 * it is never posted to again.
 */
#ifndef MOE_CLIENT_RING_H
#define MOE_CLIENT_RING_H

#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"

/* 2 MiB: the largest fan-out answer of a decode step of 16 tokens of a
 * top-8 layer of d_model 2048 in bf16 (every slot on one worker: 512 KiB
 * of rows) fits its half (1 MiB), as does one token of d_model 7168; a
 * fan-out whose answers need more gets a ring of their size (client_dp.c
 * ring_bytes, up to RING_MAX) */
#define MOE_RING_BYTES ((size_t)2 << 20)

typedef struct moe_ring {
    uint8_t *base; /* owned mapping of size bytes (the ring at offset 0) */
    size_t size;
    uint64_t region; /* the segment's region id at the worker */
    uint64_t id;     /* the ring's id at the worker (0 = not attached) */
    uint32_t seq;    /* the last request posted */
    uint32_t req_cap, rep_off, rep_cap;
    int busy; /* a call uses it (under the owner's lock) */
    int dead; /* never posted to again */
} moe_ring;

/* moe_shm_make creates the shared-memory segment `name` of size bytes
 * (its pages reserved now: a full /dev/shm fails here, not as SIGBUS
 * later) and maps it: *base, owned by the caller (munmap size bytes). The
 * name stays until the caller unlinks it. MOE_EIO (it exists or cannot be
 * made), MOE_ENOMEM. */
moe_err moe_shm_make(const char *name, size_t size, void **base);
/* moe_ring_map creates segment `name` (/moe-<pid>-...) of size bytes (a
 * multiple of 64, 4096 .. 8 MiB; libmoe uses MOE_RING_BYTES), maps it into
 * r and lays out an empty ring over all of it. The caller attaches it to
 * the worker (the ring at offset 0, this size) and then unlinks the name.
 * MOE_EINVAL / MOE_EIO / MOE_ENOMEM. */
moe_err moe_ring_map(moe_ring *r, const char *name, size_t size);
/* moe_ring_unmap releases the mapping (the worker keeps its own). */
void moe_ring_unmap(moe_ring *r);
/* moe_ring_post writes the params map of a data.rows (len bytes) and rings
 * the worker. MOE_ETOOBIG when they do not fit the request area. */
moe_err moe_ring_post(moe_ring *r, const void *params, size_t len);
/* moe_ring_post2 posts a request written in two parts, head then tail (the
 * params map's rows inline: they go from the caller's memory into the ring
 * once). */
moe_err moe_ring_post2(moe_ring *r, const void *head, size_t hlen, const void *tail, size_t tlen);
/* moe_ring_wait waits up to timeout_ms for the answer of the last post: a
 * view of the msgpack-rpc response in the ring (*ans, *len; valid until the
 * next post). *up (may be NULL) is the connection's count of live pipes:
 * at 0 the worker is gone (MOE_EUNAVAIL). MOE_ETIMEDOUT at the deadline;
 * both make the ring dead. */
moe_err moe_ring_wait(moe_ring *r, int timeout_ms, const int *up, const uint8_t **ans, size_t *len);

#endif
