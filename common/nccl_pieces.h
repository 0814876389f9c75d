/*
 * nccl_pieces.h - a request's rows on the NCCL client path in pieces
 * (docs/PROTOCOL.md, "9. NCCL", "Pieces"): x goes client -> worker and y
 * worker -> client as P ncclSend/ncclRecv of rows each, so that the worker
 * computes piece i while piece i+1's x arrives and piece i-1's y leaves.
 * Both sides cut the rows the same way (nccl_piece_first); NCCL matches the
 * operations of one direction in order and their counts must be equal, so
 * the request carries P (data.rows "pieces") and the worker refuses one it
 * cannot honour before it posts any receive (nccl_pieces_check).
 * Pure functions: the client (client/client_dp.c), the worker
 * (worker/dataplane.c, worker/nccl_client.c, worker/forward.c) and the
 * tests (tests/unit/test_nccl_pieces.c) share them.
 */
#ifndef MOE_COMMON_NCCL_PIECES_H
#define MOE_COMMON_NCCL_PIECES_H

#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"

#define NCCL_PIECES_MAX 8 /* the most pieces one request may ask for */
/* the client cuts x in 2 pieces from this many bytes (smaller: the
 * per-operation cost outweighs the overlap) */
#define NCCL_PIECES_MIN_BYTES ((size_t)16 << 20)

/* nccl_piece_first: the first row of piece i (0 <= i <= P) of R rows cut in
 * P pieces: floor(i * R / P); piece i is [first(i), first(i + 1)). R is at
 * most 2^31 and P at most NCCL_PIECES_MAX: no overflow. */
static inline int64_t nccl_piece_first(int64_t R, int P, int i)
{
    return P > 0 ? R * (int64_t)i / (int64_t)P : 0;
}

/* nccl_pieces_check: may a data.rows of R rows over NCCL travel in pieces?
 * lane: it carries "run" (the worker computes the rows alone, an inference
 * forward); fanout: run.fanout (several workers). MOE_OK, or MOE_EINVAL with
 * the reason in err: pieces outside [1, NCCL_PIECES_MAX], more pieces than
 * rows (a piece of no rows), or pieces > 1 where the rows are not a lane
 * forward of one worker (a coordinator's job or a fan-out: one piece). */
moe_err nccl_pieces_check(int64_t pieces, int64_t R, int lane, int fanout, char *err,
                          size_t errlen);

/* nccl_pieces_choose: the pieces a client asks for, a request of R rows
 * and xbytes bytes of x that may travel in pieces (a lane forward), to a
 * worker that takes up to pieces_max (0 or 1: an older worker, or none:
 * one piece). env: $MOE_NCCL_PIECES (NULL or "" = the default: 2 from
 * NCCL_PIECES_MIN_BYTES of x, else 1; N forces N, 1 disables). The result
 * is clamped to [1, min(pieces_max, R, NCCL_PIECES_MAX)]. */
int nccl_pieces_choose(size_t xbytes, int64_t R, int pieces_max, const char *env);

#endif
