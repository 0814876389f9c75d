/*
 * kcu_ep_dedup.cuh - the layout kernels of kcu_ep's deduplicated dispatch
 * (kcu_ep.h "Deduplicated dispatch"; the call sequence in kcu_ep.cu). Host
 * launchers over plain device pointers; kcu_ep.cu owns every buffer.
 *
 * Notation: this rank has T tokens of K slots (topk_idx (T,K)), W ranks own
 * the E experts in contiguous blocks (common/placement.h). Tokens are cut
 * into P slices (slice s = tokens [floor(sT/P), floor((s+1)T/P))) and the
 * forward into C chunks the same way, C dividing P: chunk c = slices
 * [c P/C, (c+1) P/C). A token is "on" rank q when one of its K slots has
 * an expert of q; it is then sent to q once (a unique row).
 *
 * The counts block of a rank (int32, exchanged by the all-gather):
 *   [P][E]  slots of slice s routed to expert e
 *   [P][W]  unique rows of slice s for destination rank q
 *
 * The per-unique-row metadata (int32, K per row, sent beside the rows):
 * entry k is (i << 24) | j when slot k of the token has local expert i of
 * the destination (i < 128), j the slot's rank among this source's chunk-c
 * slots of that expert in token order (j < 2^24), else -1.
 */
#pragma once

#include "kernels/cuda/kcu_internal.cuh"

/* kcu_epd_count: (before the counts exchange) cnt (P*(E+W)) the counts
 * block (zeroed here), mask (T) the destination ranks of each token (bit q),
 * bcnt (ceil(T/256), W) each 256-token block's tokens per destination */
moe_err kcu_epd_count(const int32_t *topk_idx, int T, int K, int E, int W, int P, int32_t *cnt,
                      uint64_t *mask, int32_t *bcnt, cudaStream_t st);
/* kcu_epd_rank: urank (T,W): for each token t on rank q, the number of
 * tokens before t on q (all T tokens; entries of tokens not on q are left
 * alone); bcnt is scanned in place */
moe_err kcu_epd_rank(const uint64_t *mask, int T, int W, int32_t *bcnt, int32_t *urank,
                     cudaStream_t st);
/* kcu_epd_pack: (after the plan) the token side's send rows of C chunks.
 * perm, offs, topk_idx: the expert-sorted layout (stable: an expert's rows
 * in token order). Tables: ctab (C,E) return row where (chunk c, expert e)
 * starts, cpre (C,E) expert e's slots in chunks before c, utab (C,W) unique
 * send row where (chunk c, destination q) starts, upre (C,W) tokens on q
 * in chunks before c. Out: sendpos (S) slot -> return row (the combine's),
 * xsend (unique rows, H) the rows x[t], msend (unique rows, K) the
 * metadata. */
moe_err kcu_epd_pack(const bf16 *x, const int32_t *perm, const int32_t *offs,
                     const int32_t *topk_idx, const uint64_t *mask, const int32_t *urank, int T,
                     int K, int E, int W, int H, int C, const int32_t *ctab, const int32_t *cpre,
                     const int32_t *utab, const int32_t *upre, int32_t *sendpos, bf16 *xsend,
                     int32_t *msend, cudaStream_t st);
/* kcu_epd_index: (owner, chunk c, once its rows arrived) from the received
 * metadata mrecv (unique rows, K): gidx[rb + g] = the received unique row
 * (absolute) of GEMM row g and sidx[rb + g] = its return row (absolute).
 * Tables of chunk c: ur0 (W) first received unique row from source q
 * (absolute), urn (W) their number (host max_urn), goff (W,ne) GEMM row
 * (within the chunk) of (source q, local expert i)'s first row, roff (W,ne)
 * return row (within the chunk) of the same. Training (wgx non-NULL): wbase
 * (W,ne) the same rows' first global expert-major row G (every chunk's rows
 * of expert i, chunk-major, as the weight gradients group them): wgx[G] the
 * received row, wgh[G] the activation row rb + g, wgy[G] the return row. */
moe_err kcu_epd_index(const int32_t *mrecv, int K, int W, int ne, int rb, const int32_t *ur0,
                      const int32_t *urn, int max_urn, const int32_t *goff, const int32_t *roff,
                      const int32_t *wbase, int32_t *gidx, int32_t *sidx, int32_t *wgx,
                      int32_t *wgh, int32_t *wgy, cudaStream_t st);
