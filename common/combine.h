/*
 * combine.h - the last arithmetic of an MoE layer, in one place: the
 * weighted sum of a token's K expert rows in fixed order, and adding the
 * shared expert's rows. The CPU kernels (kernels/combine.c, kernels/shared.c)
 * and libmoe's fan-out (client/client_dp.c: the workers send their experts'
 * rows, the client sums them) both call these, so that both give the same
 * bits. Plain loops over caller-owned arrays; nothing allocated.
 */
#ifndef MOE_COMMON_COMBINE_H
#define MOE_COMMON_COMBINE_H

#include <stddef.h>
#include <stdint.h>

/* moe_combine_rows: y (T,H) = sum over j < K of topk_w[t,K] * ye[t*K+j]
 * (rows of ye (T*K,H)), skipping slots with keep[s] == 0 (keep may be
 * NULL); with bf16, each weighted row and the sum are rounded to bf16. */
void moe_combine_rows(const float *ye, const float *topk_w, const uint8_t *keep, int T, int K,
                      int H, int bf16, float *y);

/* moe_rows_add: y[i] += add[i] for n values, the sum rounded to bf16 with
 * bf16 (add is the shared expert's gated rows, already rounded). */
void moe_rows_add(float *y, const float *add, size_t n, int bf16);

#endif
