/*
 * kcu_ep.h - one MoE layer with expert parallelism across GPUs: each of the
 * W ranks (one GPU each, one NCCL communicator between them) holds T tokens
 * and the experts [placement_first(E,W,rank), +placement_count) of the
 * layer. Everything stays on the device: router and layout on the token
 * side, rows sent to the experts' owners with grouped ncclSend/ncclRecv,
 * grouped GEMMs on the owner, rows sent back and combined in a fixed order.
 *
 * Overlap: the routed rows of every expert are cut into `chunks` parts
 * (rows j of an expert with n rows go to chunk c when
 * floor(c n / C) <= j < floor((c+1) n / C)). Every chunk's dispatch is
 * issued first on the communication stream; chunk c's GEMMs start on the
 * compute stream as soon as its rows arrived, and its return starts as
 * soon as they finish, overlapping the next chunks' transfers and GEMMs.
 * While chunks > 1 the GEMMs leave `comm_sms` SMs to NCCL. chunks = 1 is
 * the plain sequence; chunks = 0 picks per forward by shape and the rows
 * routed over all ranks (kcu_ep_auto_chunks).
 *
 * One host synchronisation per call: the per-expert counts of every rank
 * (an ncclAllGather of W*E int32) are read back to size the transfers;
 * everything after it is enqueued without waiting. The call returns once
 * the work is enqueued; kcu_ep_wait waits for it, watching NCCL's
 * asynchronous error state and the timeout.
 *
 * Numerics as kcu_forward / kcu_backward (bf16 storage, fp32 accumulation,
 * deterministic: the same inputs give the same bits),
 * dropless. Forward outputs and dx do not depend on `chunks`; weight
 * gradients are summed in an order that does (same chunks, same bits).
 * Backward: the gate weight is applied on the token side (the
 * owner receives bf16(w * dy) rows), so dx agrees with the single-GPU layer
 * to bf16 rounding, not bit for bit.
 *
 * Ownership: a kcu_ep owns its device memory (router, a kcu_experts for
 * the local experts, token-side buffers for T_max tokens, owner-side
 * buffers grown on demand to the rows it receives) and a communication
 * stream; the NCCL communicator is borrowed (the caller keeps it alive and
 * destroys or aborts it after kcu_ep_destroy, or after a failed call). Not
 * thread safe.
 */
#ifndef MOE_KCU_EP_H
#define MOE_KCU_EP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/kern.h"
#include "kernels/cuda/kern_cuda.h"
#include "base/moe.h"

typedef struct kcu_ep kcu_ep;

typedef struct kcu_ep_config {
    int H, F, E, K;
    kern_act act;
    int renorm;
    int rank, world; /* experts in contiguous blocks (common/placement.h) */
    int T_max;       /* most tokens of this rank per call */
    int train;
    int chunks;     /* overlap degree, 1..8; 0 = per forward by kcu_ep_auto_chunks */
    int comm_sms;   /* SMs the GEMMs leave free while chunks > 1 (0 = default 32) */
    int timeout_ms; /* bound on each wait for peers (0 = 60000) */
    /* routing family and shared experts, as kcu_layer_create_ex's (all zero:
     * the plain softmax top-k); see "Routing families and shared experts"
     * below. Last, so that code that sets the fields above by name (after a
     * memset) needs no change. */
    kcu_route_config route;
    /* deduplicated dispatch (see "Deduplicated dispatch" below): -1 off, 1
     * inference forwards, 2 training forwards (and their backward) too; 0
     * the default: KCU_EP_DEDUP (0, 1 or 2) where set, else 1. */
    int dedup;
    /* train states (see "Train states" below): train forwards kept at once
     * for their backward, 1..KCU_EP_MAX_STATES (0 or 1: one) */
    int states;
} kcu_ep_config;

enum { KCU_EP_MAX_STATES = 16 };

/* Train states (c.states > 1 in a training layer without a shared expert;
 * otherwise one). Each state holds one forward's token-side workspace
 * (routing, layout, dispatch and return rows), its owner-side buffers
 * (received rows, pre-activations, activations, tables) and its plan (the
 * counts and chunk bases): a forward and the backward that follows it use
 * the state selected when each is called (kcu_ep_use_state), so a pipeline
 * schedule keeps up to c.states train forwards of a layer on the device
 * and runs their backwards in any order without recomputing. The weights,
 * their gradients, the router and the scratch no forward hands to its
 * backward are shared. Every rank must select the same state for the same
 * call (the worker chooses by the job's handle, least recently used, from
 * the job sequence all ranks see). Memory: one token side per state used
 * (about T_max x K x H x 4 bytes plus the routing) and an owner side per
 * state grown to its rows. An inference forward or a fan-out forward uses the
 * selected state too, and its kept train forward is gone. */
/* kcu_ep_states: the states this layer has (1 unless c.states > 1 took) */
int kcu_ep_states(const kcu_ep *ep);
/* kcu_ep_use_state selects state s (0..states-1) for the calls that follow
 * (host only: the previous calls' work stays enqueued). A state's token side
 * is allocated at its first use (state 0's at create). MOE_EINVAL: s out of
 * range; MOE_ENOMEM: its first allocation failed (the selection unchanged). */
moe_err kcu_ep_use_state(kcu_ep *ep, int s);

/* Deduplicated dispatch (c.dedup or KCU_EP_DEDUP: 1 for inference
 * forwards, the default, 2 for training ones too, 0 off; world > 1,
 * T_max < 2^24; otherwise, and for train forwards with 1, the path above
 * as it is). On by default since it measured faster or equal on every
 * shape of 2x and 4x H100 (bench/RESULTS.md section 2).
 *
 * A forward sends a token routed to several experts of one rank there ONCE (a unique row, with K
 * int32 of metadata: which of the owner's experts the token's slots take and each slot's place),
 * instead of one row per slot: with Qwen3's shape on 4 GPUs ~3.6 of the 8 slots fall on distinct
 * ranks, ~2.2x fewer dispatch bytes. The owner expands the unique rows into its expert-sorted GEMM
 * rows on the device (the up-projection gathers through an index; with sorted rows a copy), and
 * returns one row per (token, slot) as without dedup, so the combine (fixed
 * order, fp32) is the same and y is bit-identical to the forward without
 * dedup, whatever the chunks.
 *
 * Chunks cut the TOKENS (chunk c = this rank's tokens [floor(cT/C),
 * floor((c+1)T/C))): chunk c's unique rows go out, the owner runs chunk
 * c's rows of all its experts and returns them while later chunks fly.
 * The counts exchange (still the one host synchronisation) carries per rank
 * P slices (P = chunks, or 8 with chunks 0) of E slot counts and W unique
 * row counts (kcu_ep_dedup.cuh). kcu_ep_last_send_bytes counts the unique
 * rows and their metadata; kcu_ep_bench_exchange repeats the dedup
 * transfers after a dedup forward.
 *
 * Training (dedup 2; measured and checked on GPUs after the inference path):
 * a train forward dedups its dispatch the same way; its backward
 * sends the bf16(w dy) rows and returns the dx rows along the return's
 * paths (one row per slot, as without dedup), so dx is the same bits as
 * without dedup; the weight gradients sum each expert's rows chunk by chunk
 * (token chunks here), so with chunks > 1 their bits differ from the path
 * without dedup (with one chunk the order is the same). */

/* Copy-engine exchange (KCU_EP_CE, read at create; on unless KCU_EP_CE=0; the same
 * value on every rank: the worker reports it at registration and the
 * coordinator refuses one that differs). Inference forwards of the
 * deduplicated dispatch move their rows on the copy engines, so that while
 * chunks overlap the expert GEMMs keep every SM (comm_sms is not reserved).
 * Every (chunk, pair) gets a slot of the chunk's largest count, the same
 * on every rank from the gathered counts; the layout tables point into the
 * padded slots, so the kernels, the combine and y (bit-identical to the
 * forward without it) do not change. Two windows (token side: xsend |
 * msend | yrecv; owner side: xrecv | mrecv | ysend) with the same layout on
 * every rank. The transport (KCU_EP_CE_IMPL, agreed by every rank at
 * setup):
 *   - unset (default): this library's, unless two ranks are threads of one
 *     process (bin/ep_bench: the process ids are gathered at setup), which
 *     take NCCL's - there this library's hung on 4 GPUs (a lazily loaded
 *     kernel's first launch holding the driver's lock, with peer access on,
 *     while the devices waited on handshakes: kcu_ep.cu ce_setup);
 *   - "own", this library's: the windows are cudaMalloc buffers
 *     every rank maps (CUDA IPC handles all-gathered on the exchange
 *     communicator; a rank of the same process by its address, with peer
 *     access on); each all-to-all is, on the layer's exchange stream: READY
 *     to every peer, a wait for every peer's READY, cudaMemcpyAsync of each
 *     slot into the peer's window, DONE to every peer (fenced after the
 *     copies), a wait for every peer's DONE - 64-bit stream memory
 *     operations (cuStreamWriteValue64 / cuStreamWaitValue64) on a page of
 *     POSIX shared memory every rank maps and registers (rank 0 makes it,
 *     its name broadcast, unlinked once all have it). A rank whose exchange
 *     fails (a dead peer, the timeout, the abort hook) stores past every
 *     number it waits for, so its stream drains: no stream is left waiting
 *     on a peer that is gone (a dead exporter's memory stays mapped and
 *     writable here: checked on 2x H200).
 *   - "nccl": ncclAlltoAll on a second communicator over the borrowed
 *     one's ranks (ncclCommInitRankConfig over a unique id the borrowed one
 *     broadcasts; blocking; CTAPolicy NCCL_CTA_POLICY_ZERO) over two
 *     ncclMemAlloc buffers registered as symmetric windows (NCCL >= 2.28 on
 *     one node). Its handshake waits on flags in NCCL's memory, which
 *     ncclCommAbort does not release: a peer killed mid-exchange can leave
 *     the survivor's stream waiting for good (the worker's --abort-exit-ms
 *     then restarts it). The CE communicator's blocking collective calls run
 *     under a watchdog thread that aborts it on the timeout or the abort hook.
 * Set up at the first forward that takes it (collective), windows grown in
 * lockstep (1.25x the need). A forward takes the send/recv path instead
 * (same results, no error) when padding would exceed 1.25x the real rows
 * (skewed routing), for training forwards, or when the setup, allocation,
 * mapping or registration failed on any rank (one stderr line, then every
 * later forward). Every rank takes the same decision (from data all ranks
 * share). One state and one pair of windows per borrowed communicator,
 * shared by every kcu_ep on it (a worker's layers: refcounted, set up at the
 * first CE forward of any layer, grown to the largest need; the next CE
 * forward of any layer waits on the GPU for the previous one to be done
 * with the windows). Released (local, no collective) by the last
 * kcu_ep_destroy on it, or when a wait fails (every layer then falls back),
 * on a thread of its own. 2x H200, Qwen3 16384 tokens per GPU: 3.76-3.78 /
 * 3.40-3.41 ms at chunks 1 / 4 against NCCL's 3.82-3.83 / 3.41-3.44
 * (bench/NOTES.md "Copy-engine exchange"). kcu_ep_bytes counts the shared
 * windows in one layer only. kcu_ep_last_send_bytes / kcu_ep_last_a2a_bytes
 * count real rows; kcu_ep_last_ce gives what the padded slots put on the
 * wire. */

/* The exchange communicator (KCU_EP_BLOCKING, read at the first forward;
 * on unless 0; agreed by every rank). The borrowed communicator may be
 * non-blocking (the worker's is, so that a dead peer cannot hold its
 * compute thread); on one, NCCL hands every group end to a thread it
 * creates for the call and answers ncclInProgress until that is done, which
 * cost a T=1 forward on 2 GPUs 0.4-0.5 ms of host time. So at the first
 * forward of any layer on a borrowed communicator, rank 0 makes a unique
 * id, the borrowed communicator broadcasts it, and every rank joins a
 * BLOCKING communicator over the same ranks (the join on a thread of its
 * own, waited for under the timeout and the abort hook). From then every
 * NCCL call of the layers on that borrowed communicator (counts, dispatch,
 * return, agreements) runs on it, each under a watchdog thread that aborts
 * it (ncclCommAbort from that thread: the blocked call returns) on the
 * layer's timeout or the abort hook; the CE communicator's all-to-alls run
 * under the same watchdog. One per borrowed communicator, shared by its
 * layers with the CE state; aborted (local, on a reaper thread) by the last
 * kcu_ep_destroy on it or when the exchange fails (then every later call
 * of its layers fails: the caller re-forms). Where any rank does not want
 * it or cannot make it, every rank stays on the borrowed communicator (one
 * stderr line). The results do not depend on it. */

/* Routing families and shared experts (kern_cuda.h "Routing families").
 *
 * Token side: the router GEMM and the family router of kcu_layer
 * (k_route_family: the same kernel, so the same choices and weights for the
 * same logits), the layout of the K routed slots only, the statistics
 * (counts over the E routed experts, probs_sum of the scores s as they are,
 * z_sum of logsumexp(logits)^2 for both scorings) and the router backward
 * through the family (sigmoid, renorm, route_scale; the bias and the
 * selections get no gradient).
 *
 * Shared expert (route.shared_experts = m > 0, d_ff Fs = m*F): replicated
 * on every rank (kcu_ep_upload_shared), applied by each rank to its own T
 * tokens with no exchange: a kcu_experts of ONE expert of d_ff Fs
 * (kcu_ep_shared_experts) receives all T rows; its output ys (T,H) is added
 * to y in the combine after the K routed slots, times the gate
 * g = sigmoid(x . wsg) (route.shared_gate; wsg is router row E, as in
 * kcu_layer) or 1. kcu_layer holds the same expert as m experts of d_ff F
 * and rounds each one's output to bf16 separately: the two agree to bf16
 * rounding, not bit for bit (where E + m > 256 kcu_layer holds it apart as
 * here, with the same kernels: kcu_shared.cu). Backward: the shared expert gets dy rows
 * (bf16(g dy) with a gate) and returns its part of dx; its weight
 * gradients (kcu_ep_download_shared_grads) and the gate's (router row E's:
 * its logit's gradient g (1 - g) <dy, ys>) are this rank's tokens' only:
 * the caller all-reduces them over the ranks, as the router's.
 *
 * Limits: those of kcu_layer_create_ex (kern_cuda.h): E + shared_experts
 * may exceed 256 (the shared expert is not held as extra routed experts);
 * Fs <= 65536. */

/* kcu_ep_create on the current CUDA device; comm is an ncclComm_t of
 * `world` ranks in which this process is `rank`. MOE_EINVAL for unsupported
 * shapes (as kcu_layer_create; world <= 64), MOE_ENOMEM. */
moe_err kcu_ep_create(const kcu_ep_config *cfg, void *comm, kcu_ep **out);
void kcu_ep_destroy(kcu_ep *ep);
/* kcu_ep_auto_chunks: the overlap degree of a forward with chunks 0, chosen
 * after the counts exchange from the rows routed per rank (the mean over
 * ranks: the same choice on every rank). Overlap pays when the all-to-all
 * is a good part of the layer: its time per row ~ 4H bytes at ~300 GB/s
 * against ~6HF flops at ~600 TFLOP/s, a ratio of ~1333/F (bench/NOTES.md:
 * Qwen3, F=768, gains; Mixtral, F=14336, loses the SMs it leaves to NCCL;
 * on 2 GPUs one chunk is faster at every batch size measured), and when the
 * batch is large enough that the extra transfers and launches of several
 * chunks do not dominate. 4 chunks when world > 2, F < 5333 and at least
 * KCU_EP_CHUNK_ROWS (inference, default 49152) or KCU_EP_CHUNK_ROWS_TRAIN
 * (a training forward, whose backward runs the same chunks; default 98304)
 * rows per rank (both measured on 4x H200), else 1. */
int kcu_ep_auto_chunks(int world, int F, long long rows_per_rank, int train);
/* kcu_ep_last_chunks: the overlap degree the last forward used */
int kcu_ep_last_chunks(const kcu_ep *ep);
/* kcu_ep_set_chunks changes the overlap degree (0..8) for later calls;
 * not while any state keeps a train forward (MOE_EPRECOND). */
moe_err kcu_ep_set_chunks(kcu_ep *ep, int chunks, int comm_sms);

/* host fp32: wr (E,H) the whole router; w1, w3 (ne,F,H), w2 (ne,H,F) the
 * local experts (nn.Linear layout); w3 NULL for GELU. Synchronous. */
moe_err kcu_ep_upload(kcu_ep *ep, const float *wr, const float *w1, const float *w3,
                      const float *w2);

/* kcu_ep_forward: y (T,H) from x (T,H) on every rank (T may differ between
 * ranks, 0 included; every rank must call). x, y host or device, f32 or
 * bf16. Enqueued on `stream` (cudaStream_t) and the communication stream;
 * returns after the counts exchange. Errors: MOE_EINVAL, MOE_EUNAVAIL (a
 * peer failed or the timeout passed: abort the communicator), MOE_ENOMEM. */
moe_err kcu_ep_forward(kcu_ep *ep, int T, const void *x, moe_dtype x_dtype, void *y,
                       moe_dtype y_dtype, int train, void *stream);
/* kcu_ep_backward: dx from dy of the selected state's train forward
 * (MOE_EPRECOND: it keeps none); expert gradients
 * (in the local kcu_experts) and router gradients ACCUMULATED. The aux and
 * z losses use the global counts and T_global = sum of T over ranks. */
moe_err kcu_ep_backward(kcu_ep *ep, const void *dy, moe_dtype dy_dtype, void *dx,
                        moe_dtype dx_dtype, float aux_coef, float z_coef, void *stream);
/* kcu_ep_wait: waits for `stream`, bounded by the timeout, failing fast when
 * NCCL reports an error (MOE_EUNAVAIL). */
moe_err kcu_ep_wait(kcu_ep *ep, void *stream);

/* routing statistics of the last forward (host, valid after it returned):
 * counts_local (E) slots routed by this rank, counts_global (E) by all
 * ranks, T_global, rows_in (rows this rank's experts received). Any may be
 * NULL. */
void kcu_ep_last_counts(const kcu_ep *ep, int32_t *counts_local, int32_t *counts_global,
                        int *T_global, int64_t *rows_in);
/* kcu_ep_stats: this rank's sums over its tokens of the last forward:
 * probs_sum (E) of the router probabilities, z_sum of lse^2 (the aux and
 * z losses follow from these summed over ranks, with the global counts).
 * Either may be NULL. Synchronises `stream`. */
moe_err kcu_ep_stats(kcu_ep *ep, double *probs_sum, double *z_sum, void *stream);
/* bytes this rank sent to other ranks in the last forward, dispatch and
 * return together (dedup: the unique rows with their metadata, then the
 * slot rows back) */
int64_t kcu_ep_last_a2a_bytes(const kcu_ep *ep);

/* kcu_ep_upload_bias: the routing choice bias (E) host fp32 (kept in fp32),
 * NULL = none (the default), as kcu_layer_upload_bias: any non-NULL bias
 * makes the token side use the family router. Every rank uploads the same
 * bias. Synchronous. */
moe_err kcu_ep_upload_bias(kcu_ep *ep, const float *bias);
/* kcu_ep_upload_shared: the shared expert, host fp32 in kern_layer_weights'
 * shapes: ws1, ws3 (Fs,H), ws2 (H,Fs), wsg (H) (the gate row; ignored, may
 * be NULL, without route.shared_gate; ws3 may be NULL for GELU). Every rank
 * uploads the same weights (replicated). Call it after kcu_ep_upload
 * (which leaves the shared expert and the gate row alone). Synchronous;
 * zeroes the shared expert's gradients and optimizer moments. MOE_EINVAL
 * without shared experts or with a needed pointer NULL. */
moe_err kcu_ep_upload_shared(kcu_ep *ep, const float *ws1, const float *ws3, const float *ws2,
                             const float *wsg);
/* kcu_ep_download_shared_grads: this rank's gradients of the shared expert
 * (accumulated since the last zeroing): dws1, dws3 (Fs,H), dws2 (H,Fs),
 * dwsg (H) (router row E's, only with shared_gate); any may be NULL.
 * Synchronous. MOE_EPRECOND without train, MOE_EINVAL without shared
 * experts. */
moe_err kcu_ep_download_shared_grads(kcu_ep *ep, float *dws1, float *dws3, float *dws2,
                                     float *dwsg);
/* the shared expert's kcu_experts (one expert of d_ff Fs, replicated: its
 * weights, gradients and AdamW state) for the optimizer; NULL without
 * shared experts. The gate row wsg lives with the router (row E). */
struct kcu_experts *kcu_ep_shared_experts(kcu_ep *ep);

/* gradients / weights: router (E,H) (rows 0..E-1: the gate row's gradient
 * comes from kcu_ep_download_shared_grads) and local experts as in
 * upload; kcu_ep_zero_grads marks the router's, the local experts' and the
 * shared expert's zero. The
 * experts object is exposed for the optimizer (kcu_experts_adamw etc.). */
moe_err kcu_ep_download_router_grad(kcu_ep *ep, float *dwr);
moe_err kcu_ep_upload_router(kcu_ep *ep, const float *wr);
moe_err kcu_ep_zero_grads(kcu_ep *ep);
struct kcu_experts *kcu_ep_experts(kcu_ep *ep);
/* bytes of device memory held (all buffers, the shared expert's included;
 * the CE windows, shared by the layers on one communicator, in one layer
 * only: the one that set them up, or after its destroy the next whose
 * forward takes the CE path) */
size_t kcu_ep_bytes(const kcu_ep *ep);
/* kcu_ep_bench_exchange repeats the transfers of the last forward (every
 * chunk's dispatch, then every chunk's return; no GEMMs) and waits: the
 * time a caller measures around it is the layer's all-to-all time. The
 * forward's outputs are overwritten with garbage (a benchmark hook).
 * MOE_EPRECOND after a CE forward whose shared windows have since moved
 * (another layer grew them) or failed. */
moe_err kcu_ep_bench_exchange(kcu_ep *ep, void *stream);
/* bytes this rank sent to other ranks (dispatch, one direction) in the
 * last forward: real rows (on the CE path the padded slots add what
 * kcu_ep_last_ce's wire_bytes counts beyond these) */
int64_t kcu_ep_last_send_bytes(const kcu_ep *ep);
/* kcu_ep_last_ce: 1 when the last forward took the copy-engine path (see
 * "Copy-engine exchange"); *wire_bytes (may be NULL) the bytes its
 * all-to-alls moved to other ranks, padding included (0 on the send/recv
 * path); *n_ce, *n_fallback (may be NULL) this layer's inference dedup
 * forwards on the CE path and fallen back since create (both 0 with
 * KCU_EP_CE=0) */
int kcu_ep_last_ce(const kcu_ep *ep, int64_t *wire_bytes, int64_t *n_ce, int64_t *n_fallback);
/* number of local experts; *first (may be NULL) the first one's index */
int kcu_ep_local_experts(const kcu_ep *ep, int *first);

/* The fan-out forward (the decode lane of several GPU workers; the worker's
 * fanout.c): an inference forward that every rank runs on the SAME T
 * tokens with no exchange and no collective - each routes all of them (the
 * same kernels, so the same choices and weights on every rank of one GPU
 * type) and runs its own experts on their slots; whoever holds the tokens
 * combines the ranks' rows. Host arrays the caller owns: */
typedef struct kcu_ep_local {
    int32_t *counts; /* (E) out: slots routed to each expert */
    float *topk_w;   /* (T*K) out: the gate weights of the slots */
    int32_t *slots;  /* (T*K) room; out: the slots of this rank's experts, expert by
                      * expert (the sorted rows of the layout) */
    const void *ye_at; /* out: those slots' unweighted expert rows (n,H), bf16 as
                        * the GEMMs store them, in the layer's page-locked mirror:
                        * valid until its next call */
    int64_t n;       /* out: how many slots (rows) */
    int sh0, shn;    /* in: the shared expert's rows [sh0, sh0+shn) of the T (shn 0:
                      * none; needs route.shared_experts) */
    float *ys;       /* (shn,H) out: the shared expert's output of those rows,
                      * bf16 values times the gate sigmoid(x . wsg) when gated */
    double *probs_sum; /* (E) out (may be NULL): router probability sums, as
                        * kcu_ep_stats would give them */
    double z_sum;      /* out: the sum of lse^2 over the T tokens */
} kcu_ep_local;
/* kcu_ep_forward_local: x (T,H) host memory, f32 or bf16, 1 <= T <=
 * T_max. Synchronous. The host's copies go through a page-locked mirror
 * the layer keeps (grown to the largest call), mapped into the device's
 * address space. A plain softmax top-k layer's decode batch runs the decode
 * chain over this rank's experts (kcu_decode_local) with one host
 * synchronisation, as one CUDA graph per T <= 16 on the layer's own stream
 * (KCU_LOCAL_GRAPH=0: kernel by kernel on `stream`); other layers (routing
 * families, shared experts) and KCU_LOCAL_CHAIN=0 take two steps on
 * `stream` (routing, a synchronisation, the experts' rows, one more). Drops
 * a kept train forward (as any inference forward). MOE_EINVAL: bad
 * arguments. */
moe_err kcu_ep_forward_local(kcu_ep *ep, int T, const void *x, moe_dtype x_dtype,
                             kcu_ep_local *out, void *stream);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
extern "C" {
#endif
/* kcu_ep_abort_hook: when set (the worker: "a member of this generation is
 * gone"), the layer's waits return MOE_EUNAVAIL as soon as it returns
 * nonzero, instead of waiting for the timeout. */
extern int (*kcu_ep_abort_hook)(void);
#ifdef __cplusplus
}
#endif

#endif /* MOE_KCU_EP_H */
