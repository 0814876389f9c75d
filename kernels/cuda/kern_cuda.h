/*
 * kern_cuda.h - the MoE layer on one GPU: router, layout, grouped expert
 * GEMMs (forward and backward), callable from C. Same meaning as the *_cpu
 * reference in kernels/kern.h; checked against it by bin/check-gpu.
 *
 * Letters as in kern.h: T tokens, H d_model, F d_ff, E experts, K top-k,
 * S = T*K routed slots. Storage is bf16, accumulation fp32, dropless.
 * One forward or backward call enqueues kernels on the given stream and never
 * synchronises with the host (except when x/y are host pointers, which are
 * copied through the stream); kcu_forward_pipelined is synchronous.
 *
 * Ownership: a kcu_layer owns two device allocations - `params` (bf16
 * weights, fp32 gradients when cfg.train) and `ws` (activations and scratch
 * for up to cfg.T_max tokens, once per state: cfg.states copies). Nothing
 * the caller passes in is retained beyond the call, except that backward
 * uses the state saved by the most recent forward with train=1 in the
 * selected state (the layer copies x); a backward consumes that state (a
 * second backward without a new train forward in that state returns
 * MOE_EPRECOND).
 * States (kcu_config.states, kcu_layer_set_state): a layer with n states
 * keeps up to n train forwards at once, one per state, for pipeline
 * schedules (forward 1, forward 2, backward 2, backward 1); forward,
 * backward and forward_stats use the selected state (0 after create).
 * Results do not depend on the state a call uses.
 * A layer is not thread safe: one stream at a time.
 *
 * Limits: H and F multiples of 128, 1 <= K <= E <= 256, K <= 8 (routing
 * families and shared experts: kcu_route_config, "Routing families" below).
 * Capacity factor: 0 = dropless; cf > 0 caps each expert at
 * kern_capacity(cf, T, K, E) slots per forward call, keeping the first ones
 * in stable (slot) order; dropped slots add zero to y and get no gradient,
 * and are counted (kcu_forward_stats).
 *
 * Gradients: kcu_layer_zero_grads (and upload) only mark them zero; the
 * next backward then stores instead of adding (no memset pass, no read).
 */
#ifndef MOE_KERN_CUDA_H
#define MOE_KERN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" { /* kern.h and moe.h carry no C++ guards of their own */
#endif

#include "kernels/kern.h"
#include "base/moe.h"

typedef struct kcu_layer kcu_layer;

/* the kernels that run on the current device: "sm_90a kernels (wgmma,
 * TMA)" on Hopper, else "portable kernels (mma.sync)" (sm_80 code, or the
 * compute_80 PTX compiled by the driver). Static string. */
const char *kcu_arch_name(void);
/* the image the driver loaded for the current device: its PTX and binary
 * versions (90 and 90 for sm_90a, 80 and 80 for sm_80 code, 80 and the
 * device's for JIT-compiled PTX). Returns 0, or -1 if no image of this build
 * loads on the device (older than sm_80). */
int kcu_arch_image(int *ptx, int *binary);

typedef struct kcu_config {
    int H, F, E, K;
    kern_act act;
    int renorm;            /* divide the K gate weights by their sum */
    int T_max;             /* most tokens one forward/backward call may carry */
    int train;             /* allocate gradients and keep forward state for backward */
    float capacity_factor; /* 0 = dropless (default); see kcu_layer_set_capacity */
    int grad_bf16;         /* expert weight gradients stored in bf16 (half the memory):
                            * each backward adds its fp32 sums to the stored value and
                            * rounds once, as PyTorch's bf16 .grad; 0 = fp32 (default,
                            * exact accumulation over micro-batches) */
    int states;            /* train-forward states kept (0 or 1: one, as before; at most
                            * KCU_MAX_STATES): each state is a full copy of the workspace
                            * (kcu_layer_bytes), selected by kcu_layer_set_state */
} kcu_config;

enum { KCU_MAX_STATES = 16, KCU_MAX_GROUPS = 64 };

/* kcu_route_config: the routing family and shared experts of a layer
 * (kcu_layer_create_ex). A separate struct rather than more kcu_config
 * fields, so that existing positional kcu_config initialisers (worker/gpu.c)
 * stay complete under -Wmissing-field-initializers; all zero (or NULL) =
 * the plain softmax top-k of kcu_layer_create. */
typedef struct kcu_route_config {
    int scoring;       /* kern_scoring: KERN_SCORE_SOFTMAX (0) or KERN_SCORE_SIGMOID */
    int n_group;       /* 0 or 1: no groups; else divides E, at most KCU_MAX_GROUPS */
    int topk_group;    /* groups kept, 1..n_group (0 = all) */
    int group_topn;    /* 1 or 2 (0 = 2): a group's score is the sum of its best choices */
    float route_scale; /* routed_scaling_factor on the K routed weights (0 = 1) */
    /* shared expert of d_ff Fs = shared_experts * F, held as that many
     * extra experts (kcu_shared_split, kcu_layer_upload_shared) */
    int shared_experts; /* m = Fs / F (0 = none); E + m > 256: held apart (below) */
    int shared_gate;    /* the shared output is scaled by sigmoid(x . wsg) (else 1) */
} kcu_route_config;

/* Routing families on the device (kcu_route_config, kcu_layer_upload_bias).
 * kcu_forward routes as kern_route_cpu: scores s (softmax over E, or
 * sigmoid per expert); choice c = s + bias; groups (n_group contiguous
 * groups of E/n_group, a group's score the sum of its group_topn largest c,
 * the topk_group best groups kept, ties to the lower group); the K largest
 * c (ties to the lower expert); weights w = s (never the bias), with renorm
 * divided by their sum (+ 1e-20 for sigmoid), times route_scale. NaN
 * scores are outside the contract (CPU and GPU may then pick differently).
 *
 * Shared expert: its FFN splits over d_ff, so a shared expert of d_ff m*F
 * is m experts of d_ff F (experts E .. E+m-1 on the device) to which every
 * token is routed after its K routed ones, with weight 1 or the gate
 * sigmoid(x . wsg) (wsg is held as router row E, in bf16): S = T*(K+m)
 * slots, combined in slot order into one bf16 rounding of y (the CPU
 * oracle rounds the routed sum and the shared output separately: the two
 * agree to bf16 tolerance, not bit for bit).
 *
 * Statistics (kcu_forward_stats) cover the E routed experts only: counts
 * and dropped (E); aux = E/(K T) sum_e counts_e mean_t s[t,e] with the
 * scores s as they are (for sigmoid not a distribution, so aux is not 1 at
 * uniform load: it is kern_moe_forward_ref's value); z = mean_t
 * logsumexp_e(logits[t,e])^2 for both scorings (as the oracle). The
 * capacity factor caps the routed experts only (kern_capacity(cf, T, K,
 * E)); the shared experts are never capped.
 *
 * Paths: the general (GEMM) path supports every family. The decode path
 * and the small router (kcu_decode.cu) take only the plain softmax top-k: a
 * layer with a family, shared experts or a bias always takes the general
 * path. kcu_backward supports every family, as kern_moe_backward_ref_g:
 * the router gradient through the scores (softmax, or sigmoid s (1 - s)),
 * the renorm (+ 1e-20 for sigmoid) and the scale; the bias and the group
 * and top-k choices get none; the z-loss is that of the logits' logsumexp
 * for both scorings; the shared experts' weight gradients land in the m
 * extra experts (kcu_layer_download_shared_grads reassembles dws1, dws3,
 * dws2) and the gate's in router row E (dwsg): its logit's gradient is
 * g (1 - g) <dy, shared output>, rounded to bf16 with the router's.
 *
 * Shared expert held apart (E + m > 256, e.g. DeepSeek-V3 / Kimi-K2: 256
 * routed + 1 shared): the m extra experts would not fit the kernels' 256,
 * so the layer holds the shared expert as kcu_ep does: one expert of d_ff
 * m*F (a kcu_experts, its own fp32 gradients even with grad_bf16) that
 * takes all T rows; its output ys (bf16) is added after the K routed
 * slots in the combine, as bf16(g ys) with the gate or ys without, one
 * rounding of y. Backward: the gate logit's gradient g (1 - g) <bf16(dy),
 * ys>, the expert's backward on g dy (or dy), its dx rows added into dx.
 * kcu_layer_upload_shared and kcu_layer_download_shared_grads take the same
 * shapes; upload_shared also marks the shared gradients zero and drops the
 * kept train forward. Needs m*F <= 65536 and cfg.states <= 1 (its kept
 * forward is one); the pipelined forward runs it per chunk. E + m <= 256
 * keeps the m extra experts above.
 *
 * Limits (kcu_layer_create_ex: MOE_EINVAL and a stderr line otherwise):
 * scoring 0 or 1; n_group 0, 1 or a divisor of E up to KCU_MAX_GROUPS;
 * 0 <= topk_group <= n_group; 0 <= group_topn <= 2; K <= topk_group *
 * E / n_group; route_scale >= 0 and finite; shared_experts >= 0 (with
 * E + shared_experts > 256: shared_experts * F <= 65536 and states <= 1);
 * shared_gate only with shared experts. */

/* kcu_layer_create allocates a layer on the current CUDA device. Weights are
 * uninitialised until kcu_layer_upload. *out owned by the caller, freed with
 * kcu_layer_destroy. Returns MOE_EINVAL for unsupported shapes, MOE_ENOMEM if
 * the device allocations fail. */
moe_err kcu_layer_create(const kcu_config *cfg, kcu_layer **out);
/* kcu_layer_create_ex: kcu_layer_create with a routing family and shared
 * experts (rc NULL = all zero = kcu_layer_create); MOE_EINVAL (and a stderr
 * line) outside the limits of "Routing families" above. */
moe_err kcu_layer_create_ex(const kcu_config *cfg, const kcu_route_config *rc, kcu_layer **out);
/* kcu_layer_destroy frees both device allocations; NULL is a no-op. */
void kcu_layer_destroy(kcu_layer *l);

/* kcu_layer_upload copies host fp32 weights (nn.Linear layout, rounded to
 * bf16 on the way): wr (E,H), w1, w3 (E,F,H), w2 (E,H,F); w3 is ignored (may
 * be NULL) for GELU. Synchronous. Gradients are zeroed. */
moe_err kcu_layer_upload(kcu_layer *l, const float *wr, const float *w1, const float *w3,
                         const float *w2);
/* kcu_layer_upload_bias: the routing choice bias (E) host fp32 (DeepSeek-V3's
 * e_score_correction_bias; kept in fp32), NULL = zero (the default after
 * create). Any non-NULL bias makes kcu_forward use the family router (even
 * when all zero). Synchronous. */
moe_err kcu_layer_upload_bias(kcu_layer *l, const float *bias);
/* kcu_layer_upload_shared: the shared expert (kern_layer_weights' ws1, ws3
 * (Fs,H), ws2 (H,Fs), wsg (H); Fs = rc.shared_experts * F) split into the
 * m extra experts: expert E+c gets rows cF..cF+F-1 of ws1 / ws3 and those
 * columns of ws2; wsg becomes router row E (ignored, may be NULL, without
 * shared_gate; ws3 may be NULL for GELU). Rounded to bf16. Call it after
 * kcu_layer_upload whenever the shared weights change (kcu_layer_upload
 * leaves the shared experts and the gate row alone). Synchronous.
 * MOE_EINVAL when the layer has no shared experts or a needed pointer is
 * NULL. With E + m > 256 (held apart) the same arrays go to the one expert
 * of d_ff Fs as they are; its gradients are then marked zero and the kept
 * train forward is dropped. */
moe_err kcu_layer_upload_shared(kcu_layer *l, const float *ws1, const float *ws3, const float *ws2,
                                const float *wsg);
/* kcu_shared_split: *m = Fs / F, the kcu_route_config.shared_experts of a shared
 * expert of d_ff Fs (0 for Fs = 0). MOE_EINVAL when Fs < 0, F < 1 or Fs %
 * F != 0: such a shared expert cannot be split into experts of d_ff F and
 * the layer cannot hold it. */
moe_err kcu_shared_split(int Fs, int F, int *m);
/* KCU_MAX_EXPERTS: the experts a layer's kernels hold; kcu_shared_apart:
 * a layer of E routed experts holds a shared expert of m pieces apart
 * (E + m above that), with one state (kcu_config.states <= 1) */
#define KCU_MAX_EXPERTS 256
static inline int kcu_shared_apart(int E, int m)
{
    return E + m > KCU_MAX_EXPERTS;
}
/* kcu_layer_download_grads copies the gradients (accumulated since the last
 * zeroing; widened to f32 when stored in bf16) to host arrays of the same
 * shapes as upload; any may be NULL. Synchronous. MOE_EPRECOND when the
 * layer was created without train. */
moe_err kcu_layer_download_grads(kcu_layer *l, float *dwr, float *dw1, float *dw3, float *dw2);
/* kcu_layer_download_shared_grads: the shared expert's gradients, the m
 * extra experts' reassembled into kern_layer_grads' shapes: dws1, dws3
 * (Fs,H), dws2 (H,Fs), dwsg (H) (router row E's gradient; only with
 * shared_gate); any may be NULL. Synchronous. MOE_EPRECOND without train,
 * MOE_EINVAL without shared experts. The routed experts' and the router's
 * (E rows) come from kcu_layer_download_grads. */
moe_err kcu_layer_download_shared_grads(kcu_layer *l, float *dws1, float *dws3, float *dws2,
                                        float *dwsg);
/* kcu_layer_zero_grads zeroes the gradients on `stream` (cudaStream_t). */
moe_err kcu_layer_zero_grads(kcu_layer *l, void *stream);

/* kcu_forward: y (T,H) from x (T,H). x and y may be device or host memory,
 * dtype MOE_F32 or MOE_BF16 each. With train=1, the layer keeps what
 * backward needs (in the selected state) until the next forward in that
 * state. stream is a cudaStream_t (NULL =
 * default stream). Asynchronous for device pointers: device inputs are read
 * in place by the queued work (keep them until the stream has run it). Host
 * f32 transfers go through a staging buffer allocated on first use. */
moe_err kcu_forward(kcu_layer *l, int T, const void *x, moe_dtype x_dtype, void *y,
                    moe_dtype y_dtype, int train, void *stream);

/* kcu_forward_pipelined: an inference forward (train = 0) of T tokens whose
 * x and y (T,H) are host memory - pinned (cudaMallocHost) or registered
 * (cudaHostRegister) for the overlap; pageable memory works but its copies
 * do not overlap - MOE_F32 or MOE_BF16 each, cut into chunks of `chunk`
 * tokens (the last one shorter): chunk i's x is copied to the device on a
 * copy-in stream while chunk i-1 computes on a compute stream and chunk
 * i-2's y is copied back on a copy-out stream. The device side is double
 * buffered (two slots of x chunk and y chunk, in the call's dtypes); events
 * order the streams: a slot's x is overwritten only after the compute that
 * read it finished, its y only after its copy-out finished.
 * Synchronous: returns after everything finished (y is in host memory). It
 * first waits for the work queued on `stream` (cudaStream_t, NULL = the
 * default stream); the pipeline itself runs on the layer's own streams.
 * Each chunk takes the path (decode, small router, sorted rows) that one
 * kcu_forward of all T tokens would, so that in a dropless layer each
 * token's y is the same bits as kcu_forward's (a token's output does not
 * depend on the other tokens; the exception: a router of more than 128 rows
 * - E > 128, or E = 128 with a shared gate - whose GEMM kernel, mma.sync or
 * wgmma, is chosen by the row count (wgmma from about 132 * 128 rows): when
 * T and the chunk fall on different sides, the logits may differ in their
 * last bits, and so y to bf16 rounding and, at a near tie, an expert
 * choice).
 * Statistics: kcu_forward_stats (selected state) then reports the whole
 * batch, as one kcu_forward of T tokens would: counts summed over the
 * chunks (exact), dropped 0, aux and z from the per-expert sums of the
 * router probabilities and the sum of lse^2 accumulated on the device
 * (double) chunk by chunk, with k_stats_final's formula once at the end;
 * summed in another order than kcu_forward's, so they may differ from its
 * values in the last bits (relative ~1e-6).
 * Dropless only: chunk <= 0, T <= chunk, or a layer with a capacity factor
 * (chunks would change the capacity) fall back to one kcu_forward on
 * `stream` (then T <= T_max as there), followed by a synchronisation of
 * `stream`. Otherwise T may exceed T_max (chunk is clamped to T_max).
 * Memory: on first use the layer creates three streams and seven events
 * and allocates 2 * chunk * H * (x and y element sizes) device bytes plus
 * (E+1)*8 + Et*4 for the statistics (kcu_layer_bytes counts them); a later
 * call needing more reallocates. The last forward's train state in the
 * selected state is dropped (as any inference forward). */
moe_err kcu_forward_pipelined(kcu_layer *l, int T, const void *x, moe_dtype x_dtype, void *y,
                              moe_dtype y_dtype, int chunk, void *stream);

/* kcu_backward: dx (T,H) from dy (T,H) for the objective
 * <dy, y> + aux_coef*aux + z_coef*z, T being the selected state's train
 * forward's (MOE_EPRECOND when that state holds none).
 * Expert and router gradients are ACCUMULATED (+=) into the layer.
 * counts_global (E, host, may be NULL = this call's counts) and T_global
 * (0 = T) describe the global batch for the aux and z losses (as
 * kern_router_backward_cpu). Asynchronous as kcu_forward (a device dy is
 * read in place). */
moe_err kcu_backward(kcu_layer *l, const void *dy, moe_dtype dy_dtype, void *dx, moe_dtype dx_dtype,
                     float aux_coef, float z_coef, const int32_t *counts_global, int T_global,
                     void *stream);

/* kcu_forward_stats reads the selected state's last forward's routing statistics: counts (E)
 * slots routed per expert before the capacity, dropped (E) slots dropped by
 * the capacity, aux and z losses; any may be NULL. Synchronises `stream`. */
moe_err kcu_forward_stats(kcu_layer *l, int32_t *counts, int32_t *dropped, float *aux_loss,
                          float *z_loss, void *stream);

/* kcu_layer_set_capacity switches the capacity factor for the next forward
 * calls (0 = dropless). MOE_EINVAL for a negative or NaN factor. */
moe_err kcu_layer_set_capacity(kcu_layer *l, float capacity_factor);

/* kcu_layer_set_state selects the state (0 <= state < max(cfg.states, 1))
 * that the next kcu_forward, kcu_backward and kcu_forward_stats calls use
 * (host only, cheap: enqueues nothing). A state keeps its train forward
 * until its backward or its next forward (train or not). Calls on different
 * states still share one stream (the layer's scratch outside the states -
 * host staging, the expert-output buffer - is reused from call to call).
 * MOE_EINVAL for a state out of range. */
moe_err kcu_layer_set_state(kcu_layer *l, int state);

/* kcu_layer_bytes reports the device bytes of the two allocations (ws: all
 * states, plus staging and expert-output buffers allocated on demand, and
 * kcu_forward_pipelined's chunk slots once it ran). */
void kcu_layer_bytes(const kcu_layer *l, size_t *params_bytes, size_t *ws_bytes);

/* ---- experts only: the distributed path ----
 * A worker that owns ne experts gets, after the dispatch all-to-all, N rows
 * grouped by local expert (counts[i] rows for local expert i, in order) and
 * returns the unweighted expert outputs in the same order (what
 * kern_expert_ffn_cpu gives per expert, bf16 rounding of h included); the
 * gate weighting and combine happen where the tokens live.
 *
 * A kcu_experts owns two device allocations: params (bf16 compute weights;
 * with train also fp32 master weights, fp32 gradients and AdamW m, v: 18
 * bytes per parameter) and ws (activations for up to N_max rows). The
 * optimizer updates the fp32 master copy (kern_adamw_cpu's formula) and
 * refreshes the bf16 copy from it; download_weights returns the master
 * copy (train) or the bf16 values (inference). One stream at a time.
 * Limits: H, F multiples of 128, 1 <= ne <= 256. */
typedef struct kcu_experts kcu_experts;

moe_err kcu_experts_create(int H, int F, int ne, kern_act act, int N_max, int train,
                           kcu_experts **out);
void kcu_experts_destroy(kcu_experts *ex);
/* host fp32, nn.Linear layout of the ne local experts: w1, w3 (ne,F,H), w2
 * (ne,H,F); w3 ignored for GELU. Synchronous. Gradients zeroed, moments
 * zeroed. */
moe_err kcu_experts_upload(kcu_experts *ex, const float *w1, const float *w3, const float *w2);
/* y (N,H) = expert_i(x rows of group i); counts (ne) on the host, summing to
 * N <= N_max. x, y host or device, MOE_F32 or MOE_BF16. keep_for_backward
 * (needs train) keeps x and the pre-activations until the next forward. */
moe_err kcu_experts_forward(kcu_experts *ex, int N, const void *x, moe_dtype x_dtype,
                            const int32_t *counts, void *y, moe_dtype y_dtype,
                            int keep_for_backward, void *stream);
/* dx (N,H) from dy (N,H) of the last kept forward; dW1, dW3, dW2 ACCUMULATED. */
moe_err kcu_experts_backward(kcu_experts *ex, const void *dy, moe_dtype dy_dtype, void *dx,
                             moe_dtype dx_dtype, void *stream);
/* gradients marked zero (the next backward stores them). */
moe_err kcu_experts_zero_grads(kcu_experts *ex, void *stream);
/* *sumsq = sum of squares of all gradients (double, deterministic order) for
 * global-norm clipping. Synchronises `stream`. */
moe_err kcu_experts_grad_sumsq(kcu_experts *ex, double *sumsq, void *stream);
/* AdamW step on every parameter, as kern_adamw_cpu (grad_scale multiplies
 * the gradient first, e.g. a clipping factor); gradients are left as they
 * are (zero them for the next step). */
moe_err kcu_experts_adamw(kcu_experts *ex, float lr, float beta1, float beta2, float eps, float wd,
                          int64_t step, float grad_scale, void *stream);
/* host fp32 arrays of the upload shapes; any may be NULL. Synchronous. */
moe_err kcu_experts_download_grads(kcu_experts *ex, float *dw1, float *dw3, float *dw2);
moe_err kcu_experts_download_weights(kcu_experts *ex, float *w1, float *w3, float *w2);
void kcu_experts_bytes(const kcu_experts *ex, size_t *params_bytes, size_t *ws_bytes);

#ifdef __cplusplus
}
#endif

#endif /* MOE_KERN_CUDA_H */
