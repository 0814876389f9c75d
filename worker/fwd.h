/*
 * fwd.h - the pieces of the distributed layer shared by forward.c and
 * backward.c: packing rows by owner rank in sorted (expert, slot) order,
 * and the owner side's gather/scatter between per-source segments and
 * expert-major rows.
 */
#ifndef MOE_WKR_FWD_H
#define MOE_WKR_FWD_H

#include "worker/worker.h"

double fwd_now_s(void);
/* fwd_pack_by_owner: for each rank q, [counts of q's experts if with_counts]
 * then the rows of the slots q owns in sorted order. A row is
 * rows[perm[i] / K] when by_token (token rows), else rows[perm[i]] (slot
 * rows). *out malloc'ed (caller frees); returns total bytes or (size_t)-1. */
size_t fwd_pack_by_owner(const wkr_fwd_state *st, int W, int E, int H, int K, const float *rows,
                         int by_token, int with_counts, int bf16, uint8_t **out,
                         size_t *send_bytes);
/* fwd_unpack_sorted: rows that come back in sorted order -> slot_rows (S,H). */
void fwd_unpack_sorted(const wkr_fwd_state *st, const uint8_t *buf, int H, int bf16,
                       float *slot_rows);
/* fwd_owner_gather: per-source segments (starting at byte row0[q] of buf) ->
 * expert-major rows (n_in,H), using st->src_cnt. */
void fwd_owner_gather(const wkr_fwd_state *st, int W, const uint8_t *buf, const size_t *row0, int H,
                      int bf16, float *rows);
/* fwd_owner_scatter: expert-major rows (n_in,H) -> per-source segments in
 * rank order; *out malloc'ed; back_bytes[q] filled; returns total or -1. */
size_t fwd_owner_scatter(const wkr_fwd_state *st, int W, int H, const float *rows, int bf16,
                         uint8_t **out, size_t *back_bytes);

#endif
