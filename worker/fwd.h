/*
 * fwd.h - the pieces of the distributed layer shared by forward.c and
 * backward.c: packing rows by owner rank in sorted (expert, slot) order,
 * and the owner side's gather/scatter between per-source segments and
 * expert-major rows.
 */
#ifndef MOE_WKR_FWD_H
#define MOE_WKR_FWD_H

#include "kernels/kern.h"
#include "worker/worker.h"

double fwd_now_s(void);
/* fwd_gate: the router on st's T tokens (st->x): fills logits, probs,
 * top-k, counts, offsets and perm; probs_sum (E) and z_sum for the aux and
 * z losses. The logits are computed in `shards` GEMMs over the rows the
 * ordered road would give each of that many ranks (placement.h), so that
 * a fan-out rank that routes every token gets the ordered road's bits
 * (BLAS may round a row differently in a GEMM of another height). */
moe_err fwd_gate(const wkr_layer *L, wkr_fwd_state *st, int shards, double *probs_sum,
                 double *z_sum);
/* wkr_forward_fanout runs a fan-out lane forward (worker/fanout.c) on the
 * one request of batch: answers its ticket with this rank's experts' rows
 * and c with the counts lane.c records. */
void wkr_forward_fanout(wkr *w, rpc_call *c, wkr_model *m, int layer, dp_batch *batch);
/* fwd_route_cfg: the layer's routing (model_cfg's family knobs, the layer's
 * bias). */
static inline kern_route_cfg fwd_route_cfg(const model_cfg *c, const wkr_layer *L)
{
    kern_route_cfg rc = {
        (kern_scoring)c->scoring, c->renormalize, L->bias, c->n_group, c->topk_group, c->group_topn,
        (float)c->routed_scale};
    return rc;
}
/* fwd_shared_grads: layer l's shared expert gradients in its extra params
 * (NULL where the config has none). */
static inline void fwd_shared_grads(wkr_model *m, int l, float **dws1, float **dws3, float **dws2,
                                    float **dwsg)
{
    wkr_param *p = wkr_layer_extra(m, l) + (m->cfg.score_bias ? 1 : 0);
    *dws1 = *dws3 = *dws2 = *dwsg = NULL;
    if (m->cfg.shared_d_ff > 0) {
        *dws1 = (p++)->grad;
        if (act_gated(m->cfg.act))
            *dws3 = (p++)->grad;
        *dws2 = (p++)->grad;
    }
    if (m->cfg.shared_gate)
        *dwsg = p->grad;
}
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
