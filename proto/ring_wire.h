/*
 * ring_wire.h - the layout of a shared-memory ring (docs/PROTOCOL.md,
 * "Data plane", "8. Rings"): a data.rows request posted through memory
 * that the client and the worker both map. Little-endian u32 words at
 * fixed byte offsets from the ring's start, then the request area and the
 * answer area:
 *
 *   off  word         written by  meaning
 *     0  req_seq      client      bumped to post a request (the worker's futex word)
 *     4  req_len      client      bytes of the request at RING_HEAD
 *     8  worker_idle  worker      1 while the worker sleeps on req_seq
 *    64  rep_seq      worker      = req_seq once the answer is whole (the client's futex word)
 *    68  rep_len      worker      bytes of the answer
 *    72  client_idle  client      1 while the client sleeps on rep_seq
 *   128  request area (ring_req_cap(size) bytes), then the answer area
 */
#ifndef MOE_RING_WIRE_H
#define MOE_RING_WIRE_H

#include <stdint.h>

#define RING_REQ_SEQ     0
#define RING_REQ_LEN     4
#define RING_WORKER_IDLE 8
#define RING_REP_SEQ     64
#define RING_REP_LEN     68
#define RING_CLIENT_IDLE 72
#define RING_HEAD        128
#define RING_MIN         4096u      /* smallest ring (bytes, a multiple of 64) */
#define RING_MAX         (8u << 20) /* largest */

/* ring_req_cap: the request area of a ring of size bytes (its answer area
 * is the rest: size - RING_HEAD - ring_req_cap(size)) */
static inline uint32_t ring_req_cap(uint32_t size)
{
    return ((size - RING_HEAD) / 2) & ~63u;
}

#endif
