/*
 * kern.h - the MoE layer's operations. The *_cpu functions are the reference:
 * plain loops, the spec. Fast paths (OpenBLAS *_blas, CUDA in kernels/cuda/)
 * have the same meaning and are tested against these.
 *
 * Letters: T tokens, H d_model, F d_ff, E experts, K top-k, S = T*K routed
 * slots, N rows of one expert. Slot s = t*K + j is the j-th choice of token t.
 * Weights use the nn.Linear layout (out, in), as Hugging Face Mixtral stores
 * them:  wr (E,H) router;  w1 (E,F,H) gate;  w3 (E,F,H) up;  w2 (E,H,F) down.
 * Per-expert pointers point at that expert's (F,H) / (H,F) block.
 *
 * SwiGLU expert: a = x w1^T, b = x w3^T, h = silu(a) * b, y = h w2^T.
 * GELU expert:   a = x w1^T,             h = gelu(a) (erf form), y = h w2^T (w3 unused).
 *
 * bf16 models on the CPU keep values in float but rounded to bf16 (round to
 * nearest even) at the points where the GPU stores bf16: weights, layer input
 * x, h, each expert output row (after the gate weight), and the layer output y.
 * Accumulation is always fp32. The `bf16` flags below select this rounding.
 */
#ifndef MOE_KERN_H
#define MOE_KERN_H

#include <stddef.h>
#include <stdint.h>

#include "base/bf16.h"
#include "base/moe.h"
#include "common/act.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An expert activation: an id of common/act.h (its name and gating there,
 * act_gated(act) says whether the experts hold w3; its forward and backward
 * in kernels/act.c). The KERN_ACT_ names are the ids under the kernels'
 * prefix. */
typedef act_id kern_act;
#define KERN_ACT_SWIGLU ACT_SWIGLU
#define KERN_ACT_GELU   ACT_GELU

/* ---- bf16 ---- */
/* Inline forms for hot loops: the ground's conversion (base/bf16.h); the
 * functions below are the same conversions out of line. */
static inline uint16_t kern_f32_to_bf16_inl(float f)
{
    return bf16_from_f32_inl(f);
}
static inline float kern_bf16_to_f32_inl(uint16_t h)
{
    return bf16_to_f32_inl(h);
}
static inline float kern_bf16_round_inl(float f)
{
    return kern_bf16_to_f32_inl(kern_f32_to_bf16_inl(f));
}
uint16_t kern_f32_to_bf16(float f); /* round to nearest even, NaN stays NaN */
float kern_bf16_to_f32(uint16_t h);
float kern_bf16_round(float f); /* f rounded to the nearest bf16, as float */
void kern_bf16_round_n(float *x, size_t n);

/* ---- deterministic weights: independent of placement and worker count ---- */
typedef enum kern_wkind { KERN_W_ROUTER = 0, KERN_W1 = 1, KERN_W3 = 2, KERN_W2 = 3 } kern_wkind;
/* kern_init_weight fills out (rows, cols) for (seed, layer, expert, which);
 * expert is ignored for KERN_W_ROUTER. Values uniform in [-1/sqrt(cols),
 * 1/sqrt(cols)] from a counter-based hash of (seed, layer, expert, which,
 * index): the same numbers whichever process makes them. */
void kern_init_weight(uint64_t seed, int layer, int expert, kern_wkind which, int rows, int cols,
                      float *out);
/* Test inputs come from the same hash: rng_fill_uniform (common/rng.h). */

/* ---- router ---- */
/* logits (T,E) = x (T,H) wr^T, wr (E,H). */
void kern_router_logits_cpu(const float *x, const float *wr, int T, int H, int E, float *logits);
/* Same through OpenBLAS sgemm. */
void kern_router_logits_blas(const float *x, const float *wr, int T, int H, int E, float *logits);
/* Softmax over E per token, then top-K (descending probability; ties go to
 * the lower expert index); with renorm the K weights are divided by their
 * sum. probs (T,E) out; topk_idx (T,K) out; topk_w (T,K) out. */
void kern_softmax_topk_cpu(const float *logits, int T, int E, int K, int renorm, float *probs,
                           int32_t *topk_idx, float *topk_w);

/* Routing families (model.create's scoring, score_bias, n_group, ...). A
 * zeroed kern_route_cfg is today's softmax top-k without renormalisation.
 *   scores  s = softmax(logits) over E, or sigmoid(logits) per expert;
 *   choice  c = s + bias (bias (E) may be NULL = 0); with n_group > 1 the E
 *           experts form n_group contiguous groups of E/n_group, a group's
 *           score is the sum of its group_topn (0 = 2) largest c, the
 *           topk_group best groups are kept and the other experts' c = -inf;
 *   top-K   the K largest c (descending; ties go to the lower index);
 *   weights w_j = s[idx_j] (never the bias); with renorm divided by their
 *           sum (plus 1e-20 for sigmoid, as DeepSeek-V3 does); then times
 *           scale (routed_scaling_factor; 0 means 1).
 * Mixtral / Qwen3-MoE / OLMoE / Qwen2-MoE: softmax, renorm per model.
 * DeepSeek-V3 / Kimi-K2: sigmoid, bias, groups (top-2 sum), renorm, scale.
 * DeepSeek-V2: softmax, groups with group_topn = 1 (the group's max), scale. */
typedef enum kern_scoring { KERN_SCORE_SOFTMAX = 0, KERN_SCORE_SIGMOID = 1 } kern_scoring;
#define KERN_ROUTE_MAX_E      4096 /* E limit of kern_route_cpu (model.create's) */
#define KERN_ROUTE_MAX_GROUPS 256
typedef struct kern_route_cfg {
    kern_scoring scoring;
    int renorm;
    const float *bias; /* (E) or NULL; choice only */
    int n_group;       /* 0 or 1: no groups; else divides E, <= KERN_ROUTE_MAX_GROUPS */
    int topk_group;    /* groups kept, 1..n_group (0 = all) */
    int group_topn;    /* 1 or 2 (0 = 2) */
    float scale;       /* 0 = 1 */
} kern_route_cfg;
/* kern_route_scale: rc's scale with 0 read as 1. */
float kern_route_scale(const kern_route_cfg *rc);
/* kern_route_cpu: the routing above for T tokens; rc NULL = zeroed. E <=
 * KERN_ROUTE_MAX_E; K <= topk_group * E / n_group. probs (T,E) out: the
 * scores s; topk_idx (T,K) out; topk_w (T,K) out. With a zeroed rc (or only
 * renorm set) it gives kern_softmax_topk_cpu's bits. */
void kern_route_cpu(const float *logits, int T, int E, int K, const kern_route_cfg *rc,
                    float *probs, int32_t *topk_idx, float *topk_w);

/* ---- layout: counting sort of slots by expert ---- */
/* counts (E) out: slots per expert. offsets (E+1) out: exclusive prefix sum.
 * topk_idx values must lie in [0, E) (kern_softmax_topk_cpu guarantees it).
 * perm (S) out: sorted position -> slot, stable (slots of one expert in
 * increasing slot order). inv (S) out, may be NULL: slot -> sorted position. */
void kern_layout_cpu(const int32_t *topk_idx, int T, int K, int E, int32_t *counts,
                     int32_t *offsets, int32_t *perm, int32_t *inv);
/* kern_capacity returns the per-expert cap for a capacity factor over a batch
 * of T tokens: ceil(cf * T * K / E); cf <= 0 means dropless (returns INT32_MAX). */
int32_t kern_capacity(float capacity_factor, int T, int K, int E);
/* kern_apply_capacity_cpu keeps, per expert, the first `cap` slots in sorted
 * (stable) order and drops the rest: keep (S) out, 1/0 per slot; dropped (E)
 * out, count of dropped slots per expert. */
void kern_apply_capacity_cpu(const int32_t *counts, const int32_t *offsets, const int32_t *perm,
                             int E, int32_t cap, uint8_t *keep, int32_t *dropped);

/* ---- expert FFN on N rows of one expert ---- */
/* x (N,H) in; w1,w3 (F,H); w2 (H,F); a_out,b_out (N,F) out, pre-activation
 * values kept for backward, may be NULL (b_out unused for GELU); y (N,H) out.
 * With bf16 set, h is rounded to bf16 before the down projection. */
void kern_expert_ffn_cpu(const float *x, int N, int H, int F, const float *w1, const float *w3,
                         const float *w2, kern_act act, int bf16, float *a_out, float *b_out,
                         float *y);
/* Same contract through OpenBLAS sgemm (the CPU workers' fast path). It
 * mallocs an (N,F) scratch for h; if that fails it falls back to the plain
 * loops (same result within rounding), so it cannot fail. N <=
 * KERN_BLAS_GEMV_ROWS rows go through one sgemv per row and matrix instead
 * of sgemm (same result within rounding); the activation runs over
 * kern_par_threads() threads. */
#define KERN_BLAS_GEMV_ROWS 4
void kern_expert_ffn_blas(const float *x, int N, int H, int F, const float *w1, const float *w3,
                          const float *w2, kern_act act, int bf16, float *a_out, float *b_out,
                          float *y);

/* kern_experts_ffn_blas: the FFNs of ne experts of one layer at once (a
 * CPU worker's owned experts; kernels/experts_blas.c). xe (sum n, H):
 * expert i's n[i] rows from row0 = n[0] + .. + n[i-1] on; its first kept[i]
 * rows run, the others give zero rows of ye. w1, w3 (ne, F, H), w2 (ne, H,
 * F), expert i at + i*F*H (w3 unused for an ungated act). a, b (sum n, F)
 * out: the pre-activation values (b: gated acts only); h (sum n, F)
 * workspace; ye (sum n, H) out. The experts with more than
 * KERN_BLAS_GEMV_ROWS kept rows run as column blocks of their GEMMs, one
 * one-thread sgemm per block, kern_par_threads() blocks at a time (the
 * BLAS's own thread count is set to 1 meanwhile and restored: one such call
 * in a process at a time); the others as kern_expert_ffn_blas. Each output
 * is what kern_expert_ffn_blas gives for the expert within rounding (the
 * same bits where the BLAS's dot product does not depend on the block).
 * abort_fn (may be NULL) is asked before each block: nonzero stops the
 * call, which returns 1 (outputs incomplete). Returns 0, or -1 out of
 * memory (nothing computed). */
int kern_experts_ffn_blas(const float *xe, const int32_t *n, const int32_t *kept, int ne, int H,
                          int F, const float *w1, const float *w3, const float *w2, kern_act act,
                          int bf16, float *a, float *b, float *h, float *ye, int (*abort_fn)(void));

/* ---- combine ---- */
/* y (T,H) out: y[t] = sum over j = 0..K-1 in that order of
 * topk_w[t,j] * ye[t*K+j] for kept slots (keep may be NULL = all kept),
 * accumulated in fp32 from 0. ye (S,H): expert output rows in slot order.
 * With bf16, each weighted row topk_w[t,j] * ye[t*K+j] is rounded to bf16
 * before the sum (the GPU stores it so) and y is rounded. */
void kern_combine_cpu(const float *ye, const float *topk_w, const uint8_t *keep, int T, int K,
                      int H, int bf16, float *y);

/* ---- losses (training) ---- */
/* Switch/GShard load-balancing loss over the batch:
 *   aux = E / (K*T) * sum_e count_e * mean_t probs[t,e]   (= 1 when uniform)
 * z-loss: z = mean_t (logsumexp_e logits[t,e])^2. */
float kern_aux_loss_cpu(const float *probs, const int32_t *counts, int T, int E, int K);
float kern_z_loss_cpu(const float *logits, int T, int E);

/* ---- backward pieces ---- */
/* Combine backward: dye (S,H) out = topk_w[t,j] * dy[t] (0 for dropped
 * slots); dw (T,K) out = dot(dy[t], ye[s]) (0 for dropped). */
void kern_combine_backward_cpu(const float *dy, const float *ye_unweighted, const float *topk_w,
                               const uint8_t *keep, int T, int K, int H, float *dye, float *dw);
/* Expert backward on N rows: x (N,H), a,b (N,F) from forward, dy (N,H) in.
 * dx (N,H) out; dw1,dw3 (F,H) and dw2 (H,F) ACCUMULATED (+=). For GELU, b,
 * w3 and dw3 are unused and may be NULL. h is recomputed from a, b without
 * bf16 rounding (rounding is treated as the identity in backward). The blas
 * version mallocs 3 (N,F) scratch arrays and falls back to the loops if that
 * fails. */
void kern_expert_ffn_backward_cpu(const float *x, const float *a, const float *b, const float *dy,
                                  int N, int H, int F, const float *w1, const float *w3,
                                  const float *w2, kern_act act, float *dx, float *dw1, float *dw3,
                                  float *dw2);
void kern_expert_ffn_backward_blas(const float *x, const float *a, const float *b, const float *dy,
                                   int N, int H, int F, const float *w1, const float *w3,
                                   const float *w2, kern_act act, float *dx, float *dw1, float *dw3,
                                   float *dw2);
/* Router backward for T local tokens. In: x (T,H), wr (E,H), logits (T,E),
 * probs (T,E), topk_idx (T,K), dw (T,K) = dL/dtopk_w, renorm.
 * Loss terms: aux_coef * aux + z_coef * z where aux uses the GLOBAL batch:
 * counts_global (E) and T_global (the mean over tokens in aux and z is over
 * T_global tokens, so local contributions sum to the global gradient).
 * dwr (E,H) ACCUMULATED; dx (T,H) ACCUMULATED (+=). */
void kern_router_backward_cpu(const float *x, const float *wr, const float *logits,
                              const float *probs, const int32_t *topk_idx, const float *dw, int T,
                              int H, int E, int K, int renorm, const int32_t *counts_global,
                              int T_global, float aux_coef, float z_coef, float *dwr, float *dx);

/* kern_route_backward_cpu: kern_router_backward_cpu for any routing rc
 * (NULL = zeroed): probs are kern_route_cpu's scores; the aux loss uses them
 * as they are, the z-loss the logits' logsumexp; the bias gets no gradient.
 * With rc = {.renorm = renorm} it is kern_router_backward_cpu, bit for bit. */
void kern_route_backward_cpu(const float *x, const float *wr, const float *logits,
                             const float *probs, const int32_t *topk_idx, const float *dw, int T,
                             int H, int E, int K, const kern_route_cfg *rc,
                             const int32_t *counts_global, int T_global, float aux_coef,
                             float z_coef, float *dwr, float *dx);

/* ---- shared expert: a dense expert every token goes through ----
 * ys = expert(x) with d_ff Fs (the layer's activation); with a gate wsg (H)
 * ys is multiplied by sigmoid(x . wsg) (Qwen2-MoE); y += ys. With bf16 the
 * gated row is rounded, then y + row is rounded (bf16 tensors added).
 * x (T,H); ws1, ws3 (Fs,H); ws2 (H,Fs); wsg (H) or NULL; y (T,H) in/out.
 * blas picks kern_expert_ffn_blas over the plain loops. MOE_ENOMEM when its
 * (T,H) scratch cannot be allocated (y untouched). */
moe_err kern_shared_forward_cpu(const float *x, int T, int H, int Fs, const float *ws1,
                                const float *ws3, const float *ws2, const float *wsg, kern_act act,
                                int bf16, int blas, float *y);
/* kern_shared_rows_cpu: the gated rows alone, rows (T,H) out (rounded to
 * bf16 with bf16): kern_shared_forward_cpu is these rows, then
 * moe_rows_add (common/combine.h). */
void kern_shared_rows_cpu(const float *x, int T, int H, int Fs, const float *ws1, const float *ws3,
                          const float *ws2, const float *wsg, kern_act act, int bf16, int blas,
                          float *rows);
/* kern_shared_backward_cpu: the shared expert's part of the backward for
 * dy (T,H) (recomputes its forward): dx (T,H) +=; dws1, dws3 (Fs,H), dws2
 * (H,Fs), dwsg (H) += (dws3 NULL for GELU, dwsg NULL without a gate). */
moe_err kern_shared_backward_cpu(const float *x, const float *dy, int T, int H, int Fs,
                                 const float *ws1, const float *ws3, const float *ws2,
                                 const float *wsg, kern_act act, int bf16, int blas, float *dx,
                                 float *dws1, float *dws3, float *dws2, float *dwsg);

/* ---- AdamW (decoupled weight decay, bias corrected, step counted from 1) ---- */
/* p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p), with grad g scaled by
 * grad_scale first (for clipping). m, v updated in place. m = b1 m + (1-b1) g,
 * v = b2 v + (1-b2) g^2, mhat = m / (1 - b1^step), vhat = v / (1 - b2^step);
 * the wd term uses p before this step. step < 1 is treated as 1. */
void kern_adamw_cpu(float *p, const float *g, float *m, float *v, size_t n, float lr, float beta1,
                    float beta2, float eps, float wd, int64_t step, float grad_scale);
/* sum of squares of g (double accumulation), for global-norm clipping. */
double kern_sumsq_cpu(const float *g, size_t n);

/* ---- the whole layer, single process: the oracle for the cluster ---- */
typedef struct kern_moe_shape {
    int T, H, F, E, K;
    kern_act act;
    int renorm;
    float capacity_factor; /* 0 = dropless */
    int bf16;
    /* routing family (kern_route_cfg; all 0 = softmax top-k as above) */
    kern_scoring scoring;
    int n_group, topk_group, group_topn;
    float route_scale; /* routed_scaling_factor, 0 = 1 */
    /* shared expert: Fs = its d_ff (0 = none); shared_gate: sigmoid gate */
    int Fs, shared_gate;
} kern_moe_shape;

/* With bf16 set, the weights must already hold bf16 values (round them once
 * with kern_bf16_round_n when they are made or loaded); x is rounded inside.
 * For GELU, w3 may be NULL (and dw3 in backward may be NULL). */
typedef struct kern_layer_weights {
    const float *wr;   /* (E,H) */
    const float *w1;   /* (E,F,H) */
    const float *w3;   /* (E,F,H) */
    const float *w2;   /* (E,H,F) */
    const float *bias; /* (E) choice bias (e_score_correction_bias), NULL = none */
    const float *ws1;  /* (Fs,H) shared expert gate proj, when Fs > 0 */
    const float *ws3;  /* (Fs,H) shared up proj (SwiGLU) */
    const float *ws2;  /* (H,Fs) shared down proj */
    const float *wsg;  /* (H) shared expert gate, when shared_gate */
} kern_layer_weights;

/* kern_layer_grads: kern_moe_backward_ref_g's outputs (overwritten); the
 * shared ones only when the shape has a shared expert (and gate). */
typedef struct kern_layer_grads {
    float *dwr, *dw1, *dw3, *dw2;
    float *dws1, *dws3, *dws2, *dwsg;
} kern_layer_grads;

typedef struct kern_fwd_stats {
    int32_t *counts;  /* (E) out, slots routed per expert (before capacity) */
    int32_t *dropped; /* (E) out, slots dropped per expert */
    float aux_loss;   /* out */
    float z_loss;     /* out */
} kern_fwd_stats;

/* kern_moe_forward_ref: y (T,H) out from x (T,H). stats may be NULL. Returns
 * MOE_EINVAL for a bad shape (T < 0, H, F, E < 1, K not in [1, E]) or a NULL
 * pointer, MOE_ENOMEM if its scratch cannot be allocated. Capacity: cap =
 * kern_capacity(cf, T, K, E) over this batch; dropped slots add zero. */
moe_err kern_moe_forward_ref(const kern_moe_shape *s, const kern_layer_weights *w, const float *x,
                             float *y, kern_fwd_stats *stats);
/* kern_moe_backward_ref: recomputes the forward, then dx (T,H) out and
 * gradients dwr (E,H), dw1, dw3 (E,F,H), dw2 (E,H,F) out (overwritten) for
 * the objective  <dy, y> + aux_coef*aux + z_coef*z. Routing (top-k choice,
 * counts, capacity drops) is piecewise constant and gets no gradient; bf16
 * rounding is treated as the identity. Errors as kern_moe_forward_ref. */
moe_err kern_moe_backward_ref(const kern_moe_shape *s, const kern_layer_weights *w, const float *x,
                              const float *dy, float aux_coef, float z_coef, float *dx, float *dwr,
                              float *dw1, float *dw3, float *dw2);

/* kern_moe_backward_ref_g: kern_moe_backward_ref with every gradient,
 * shared expert included, in one struct. */
moe_err kern_moe_backward_ref_g(const kern_moe_shape *s, const kern_layer_weights *w,
                                const float *x, const float *dy, float aux_coef, float z_coef,
                                float *dx, const kern_layer_grads *g);
/* kern_route_of_shape: the routing of a shape and its weights (bias). */
kern_route_cfg kern_route_of_shape(const kern_moe_shape *s, const kern_layer_weights *w);

/* ---- additions: shared pieces and test helpers ---- */
/* kern_act_fwd: one activation's forward over n values: h = f(a) * b when
 * gated, h = f(a) when not (b unused, may be NULL). */
typedef void (*kern_act_fwd)(const float *a, const float *b, size_t n, float *h);
/* kern_act_bwd: its backward from dh = dL/dh: da = dL/da; db = dL/db when
 * gated (b, db unused and may be NULL when not). dh may alias da. */
typedef void (*kern_act_bwd)(const float *a, const float *b, const float *dh, size_t n, float *da,
                             float *db);
/* kern_act_ops: the forward and backward of one activation (kernels/act.c
 * holds one per act_id). */
typedef struct kern_act_ops {
    kern_act_fwd forward;
    kern_act_bwd backward;
} kern_act_ops;
/* kern_act_ops_of: the functions of act, or NULL for an id with no row. */
const kern_act_ops *kern_act_ops_of(kern_act act);
/* kern_act_forward_n: h (n) out = the row's forward, e.g. silu(a)*b (SwiGLU)
 * or gelu(a) (GELU; an ungated row leaves b unused, may be NULL); with bf16,
 * h is rounded. a, b, h: n values each. act must be valid (act_valid). */
void kern_act_forward_n(kern_act act, const float *a, const float *b, size_t n, int bf16, float *h);
/* kern_act_backward_n: from dh (n) = dL/dh: da (n) out = dL/da; db (n) out =
 * dL/db (gated only; an ungated row leaves b and db unused, may be NULL). dh
 * may alias da. act must be valid. */
void kern_act_backward_n(kern_act act, const float *a, const float *b, const float *dh, size_t n,
                         float *da, float *db);

/* ---- threads: the CPU phases around the GEMMs (par.c) ----
 * The fast paths split their elementwise and row-copy work over threads;
 * every split function gives the bits of its one-thread form (the parts are
 * disjoint and each item is computed as the one-thread code does). */
/* kern_par_threads: threads a split uses: kern_par_set_threads's number, or
 * else the BLAS's (openblas_set_num_threads, the worker's --threads). */
int kern_par_threads(void);
/* kern_par_set_threads: n > 0 fixes the thread count, 0 follows the BLAS. */
void kern_par_set_threads(int n);
/* kern_par_fn does items [i0, i1) of a split job. */
typedef void (*kern_par_fn)(void *arg, size_t i0, size_t i1);
/* kern_par_for: fn over [0, n) in contiguous parts, one per thread, each of
 * at least grain items (so a small n runs on the caller alone); returns
 * when all parts are done. fn must write disjoint memory per part. */
void kern_par_for(size_t n, size_t grain, kern_par_fn fn, void *arg);
#define KERN_PAR_GRAIN     ((size_t)1 << 17) /* floats moved per thread, at least */
#define KERN_PAR_GRAIN_ACT ((size_t)1 << 14) /* activations per thread, at least */
/* kern_act_forward_par: kern_act_forward_n split over threads. */
void kern_act_forward_par(kern_act act, const float *a, const float *b, size_t n, int bf16,
                          float *h);
/* kern_act_backward_par: kern_act_backward_n split over threads. */
void kern_act_backward_par(kern_act act, const float *a, const float *b, const float *dh, size_t n,
                           float *da, float *db);
/* kern_combine_par: kern_combine_cpu split over tokens. */
void kern_combine_par(const float *ye, const float *topk_w, const uint8_t *keep, int T, int K,
                      int H, int bf16, float *y);
/* kern_combine_backward_par: kern_combine_backward_cpu split over tokens. */
void kern_combine_backward_par(const float *dy, const float *ye_unweighted, const float *topk_w,
                               const uint8_t *keep, int T, int K, int H, float *dye, float *dw);
/* kern_rows_gather_par: dst (n,H) out, row r = src row idx[r] / div (div >= 1:
 * slot -> token with div = K). */
void kern_rows_gather_par(float *dst, const float *src, const int32_t *idx, int div, size_t n,
                          int H);
/* kern_rows_scatter_par: dst row idx[r] out = src row r, r < n (idx distinct). */
void kern_rows_scatter_par(float *dst, const float *src, const int32_t *idx, size_t n, int H);

/* kern_rel_err returns ||a - b|| / ||b|| (2-norms, double accumulation);
 * ||a - b|| when ||b|| = 0. NaN anywhere gives NaN. */
double kern_rel_err(const float *a, const float *b, size_t n);
/* kern_print_mismatches prints to stderr, under `name`, the first `max_print`
 * indices where |a-b| > tol * (|b| + max|b|/100), and the totals. Returns the
 * number of such indices. For test and check programs. */
size_t kern_print_mismatches(const char *name, const float *a, const float *b, size_t n, double tol,
                             int max_print);

#ifdef __cplusplus
}
#endif
#endif /* MOE_KERN_H */
