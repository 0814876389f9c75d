/*
 * gpu.h - the worker's GPU backend: the layer math on the device through
 * kernels/cuda (kern_cuda.h), behind one interface, an ops table
 * (wkr_gpu_ops) that wkr_gpu_attach picks per model when it is built:
 *   - layer:   a cluster of one worker runs the whole layer (router, layout,
 *              experts, combine) on the device: kcu_layer.
 *   - ep:      a cluster of several GPU workers over NCCL: every worker runs
 *              the whole layer for its tokens on its device, rows go GPU to
 *              GPU (kcu_ep: router, layout, NCCL all-to-all-v, grouped
 *              GEMMs, combine; chunked overlap). Dropless only; --ep off or
 *              a capacity factor falls back to:
 *   - experts: in a cluster of several workers the router runs on the host
 *              replica and rows travel through the exchange; the rows of the
 *              worker's own experts run on the device: kcu_experts.
 * layer and ep are "whole-layer" backends (forward, backward: the worker's
 * tokens in, its outputs out); experts runs the owner side only
 * (experts_forward, experts_backward) inside the host's layer. A model with
 * no ops (wkr_model.gpu_ops NULL) runs on the CPU.
 * The host copies of the weights (wkr_layer) stay authoritative: the
 * optimizer pulls the device gradients into the host gradients, runs AdamW
 * on the host and pushes the new weights back (kept simple; the device-side
 * AdamW of kcu_experts is the next step). Without CUDA wkr_gpu_attach
 * returns MOE_EINVAL (gpu_ops stays NULL) and wkr_gpu_probe reports no device.
 */
#ifndef MOE_WKR_GPU_H
#define MOE_WKR_GPU_H

#include "worker/worker.h"

/* wkr_gpu_build_info: what this build can do on a GPU, one line ("cuda:
 * runtime .., NCCL .., kernel images .." or "cuda: not in this build"). */
void wkr_gpu_build_info(char *buf, size_t len);
/* wkr_gpu_probe: 1 if CUDA device `device` exists (its name in name), else 0. */
int wkr_gpu_probe(int device, char *name, size_t len);
/* wkr_gpu_host_register pins [p, p+n) for the device's copy engines
 * (cudaHostRegister); wkr_gpu_host_unregister undoes it. MOE_EINVAL without
 * CUDA or when the driver refuses. */
moe_err wkr_gpu_host_register(void *p, size_t n);
void wkr_gpu_host_unregister(void *p);
/* wkr_gpu_abort_stuck_ms: how long the oldest ncclCommAbort still running
 * in this process has run, ms (kcu_abort_stuck_ms); 0 when none or without
 * CUDA. */
int64_t wkr_gpu_abort_stuck_ms(void);
/* wkr_gpu_mem_free: free memory of CUDA device `device` in bytes (cudaMemGetInfo);
 * -1 without CUDA or when it cannot be read. */
int64_t wkr_gpu_mem_free(int device);
/* wkr_gpu_pinned_alloc: n bytes of pinned host memory (plain malloc without
 * CUDA); free with wkr_gpu_pinned_free. */
void *wkr_gpu_pinned_alloc(size_t n);
void wkr_gpu_pinned_free(void *p);
/* wkr_gpu_ipc_open maps another process's device allocation (a 64-byte
 * cudaIpcMemHandle_t) into this one on `device`: *dptr. MOE_EINVAL with the
 * driver's reason in err (no CUDA, a bad or foreign handle). Close with
 * wkr_gpu_ipc_close. */
moe_err wkr_gpu_ipc_open(int device, const void *handle, size_t len, void **dptr, char *err,
                         size_t errlen);
void wkr_gpu_ipc_close(int device, void *dptr);
/* wkr_gpu_copy: n bytes between any host and device memory (synchronous). */
moe_err wkr_gpu_copy(void *dst, const void *src, size_t n);
/* What a whole-layer forward reports besides y. The caller zeroes the
 * arrays; a backend fills what it computes, the rest stays zero. */
typedef struct wkr_gpu_out {
    int32_t *counts;    /* (E) routed slots of this rank's tokens */
    int32_t *dropped;   /* (E) dropped slots (layer; ep is dropless) */
    double *probs_sum;  /* (E) router probability sums (ep; not with aux_whole) */
    double z_sum;       /* z-loss sum over this rank's tokens */
    int aux_whole;      /* the backend computed the aux loss itself: aux */
    double aux;         /* (aux_whole) the aux loss */
    uint64_t a2a_bytes; /* bytes sent to other ranks (not with aux_whole) */
} wkr_gpu_out;

/* What a fan-out forward (worker/fanout.c) gets from a backend that routes
 * on the device: host arrays the caller owns, sized for T tokens. */
typedef struct wkr_gpu_fanout {
    int32_t *counts;   /* (E) out: slots routed to each expert */
    double *probs_sum; /* (E) out: router probability sums */
    double z_sum;      /* out: sum of lse^2 */
    float *topk_w;     /* (T*K) out: the slots' gate weights */
    int32_t *slots;    /* (T*K) room; out: this rank's experts' slots (expert-major) */
    const void *ye_at; /* out: their unweighted expert rows (n,H) bf16, in the
                        * backend's memory: valid until the layer's next call */
    int64_t n;         /* out: their number */
    int sh0, shn;      /* in: the shared expert's rows [sh0, sh0+shn) (shn 0: none) */
    float *ys;         /* (shn,H) out: its output of them, gated as the layer gates it */
} wkr_gpu_fanout;

/* wkr_gpu_ops: one GPU backend. dev is one layer's device object
 * (m->gpu[layer]). forward/backward/experts_* keep m->gpu_handle[layer]: the
 * train forward whose state the device holds; a backward for another one
 * recomputes its forward first. err (errlen) gets the message of a failure
 * other than MOE_EUNAVAIL from a collective backend (an exchange failure:
 * the communicator is already aborted). */
typedef struct wkr_gpu_ops {
    const char *name; /* for the log: "whole-layer", ... */
    int whole_layer;  /* forward/backward run router..combine (else experts_*) */
    int collective;   /* every rank calls forward/backward for every job, in
                       * the same order (T = 0 included) */
    /* create one layer's device object (*dev; NULL: nothing on the device
     * for it, e.g. no local experts), and upload the host weights to it */
    moe_err (*create)(wkr *w, wkr_model *m, int layer, int train, void **dev);
    void (*destroy)(void *dev);
    moe_err (*upload)(void *dev, const wkr_layer *L);
    /* the device gradients out (router: gr (E,H), whole-layer backends only;
     * the local experts' w1, w3 (g3 NULL: not gated), w2 rows) and cleared */
    moe_err (*pull_grads)(void *dev, float *gr, float *g1, float *g3, float *g2);
    /* whole-layer: x (T,H) of dtype xdt in, y (T,H) of dtype ydt out (host
     * pageable or pinned, or device); handle: the train forward's */
    moe_err (*forward)(wkr *w, wkr_model *m, int layer, uint64_t handle, int T, const void *x,
                       moe_dtype xdt, void *y, moe_dtype ydt, int train, wkr_gpu_out *out,
                       char *err, size_t errlen);
    /* whole-layer: backward of the train forward `handle` whose x (T,H) is
     * given; dx (T,H) out */
    moe_err (*backward)(wkr *w, wkr_model *m, int layer, uint64_t handle, int T, const float *x,
                        const float *dy, float *dx, char *err, size_t errlen);
    /* experts: rows (sum n, H) expert-major; kept (ne) rows of each expert
     * run (the first kept[i] of its n[i]); the rest give zero rows. The
     * backward recomputes the forward from xe when the device holds
     * another handle's activations. */
    moe_err (*experts_forward)(wkr_model *m, int layer, uint64_t handle, const float *xe,
                               const int32_t *n, const int32_t *kept, float *ye, int train);
    moe_err (*experts_backward)(wkr_model *m, int layer, uint64_t handle, const float *xe,
                                const float *dye, const int32_t *n, const int32_t *kept,
                                float *dxe);
    /* fan-out (the decode lane of several workers; fanout.c): route all T
     * tokens of x (T,H) host, of dtype xdt, on the device and run this
     * rank's experts on their slots; no collective. NULL: the backend's
     * fan-out routes on the host (experts_forward runs the experts). */
    moe_err (*fanout)(wkr *w, wkr_model *m, int layer, int T, const void *x, moe_dtype xdt,
                      wkr_gpu_fanout *out, char *err, size_t errlen);
} wkr_gpu_ops;

/* wkr_gpu_attach picks the backend of m (m->gpu_ops), makes the device
 * objects of every layer and uploads the host weights (train: with
 * gradients). w->gpu_max_tokens bounds T per call. On failure m stays on
 * the CPU (gpu_ops NULL). */
moe_err wkr_gpu_attach(wkr *w, wkr_model *m, int train);
void wkr_gpu_detach(wkr_model *m);

/* optimizer support (m->gpu_ops set): add the device gradients into the
 * host grads (and clear them on the device); push the host weights back to
 * the device. */
moe_err wkr_gpu_pull_grads(wkr_model *m);
moe_err wkr_gpu_push_weights(wkr_model *m);

#endif
