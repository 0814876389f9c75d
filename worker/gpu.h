/*
 * gpu.h - the worker's GPU backend: the layer math on the device through
 * kernels/cuda (kern_cuda.h). Two modes, chosen per model when it is built:
 *   - layer:   a cluster of one worker runs the whole layer (router, layout,
 *              experts, combine) on the device: kcu_layer.
 *   - ep:      a cluster of several GPU workers over NCCL (mode 3): every
 *              worker runs the whole layer for its tokens on its device,
 *              rows go GPU to GPU (kcu_ep: router, layout, NCCL
 *              all-to-all-v, grouped GEMMs, combine; chunked overlap).
 *              Dropless only; --ep off or a capacity factor falls back to:
 *   - experts: in a cluster of several workers the router runs on the host
 *              replica and rows travel through the exchange; the rows of the
 *              worker's own experts run on the device: kcu_experts.
 * The host copies of the weights (wkr_layer) stay authoritative: the
 * optimizer pulls the device gradients into the host gradients, runs AdamW
 * on the host and pushes the new weights back (kept simple; the device-side
 * AdamW of kcu_experts is the next step). Without CUDA every function
 * returns MOE_EINVAL and wkr_gpu_probe reports no device.
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
/* wkr_gpu_attach makes the device objects of every layer of m and uploads
 * the host weights (train: with gradients). max_tokens bounds T per call. */
moe_err wkr_gpu_attach(wkr *w, wkr_model *m, int train);
void wkr_gpu_detach(wkr_model *m);

/* layer mode (world == 1): the whole forward. x (T,H) of dtype xdt in, y
 * (T,H) of dtype ydt out (host pageable or pinned, or device); counts,
 * dropped (E) out; aux and z losses out. */
moe_err wkr_gpu_layer_forward(wkr_model *m, int layer, int T, const void *x, moe_dtype xdt, void *y,
                              moe_dtype ydt, int32_t *counts, int32_t *dropped, float *aux,
                              float *z, int train);
/* layer mode backward for the train forward whose x (T,H) is given: the
 * forward is recomputed when the device holds another one's state. */
moe_err wkr_gpu_layer_backward(wkr_model *m, int layer, uint64_t handle, int T, const float *x,
                               const float *dy, float *dx);

/* experts mode: rows (n_in,H) expert-major; kept (ne) rows of each expert
 * run (the first kept[i] of its n[i]); the rest give zero rows. */
moe_err wkr_gpu_experts_forward(wkr_model *m, int layer, const float *xe, const int32_t *n,
                                const int32_t *kept, float *ye, int keep);
moe_err wkr_gpu_experts_backward(wkr_model *m, int layer, const float *dye, const int32_t *n,
                                 const int32_t *kept, float *dxe);

/* ep mode: every rank calls these for every job, in the same order (all
 * ranks take part in the exchanges, T = 0 included). y (T,H) out; counts
 * (E) this rank's routed slots, probs_sum (E) and z_sum its router sums,
 * a2a_bytes sent to other ranks. An exchange failure aborts the NCCL
 * communicator and returns MOE_EUNAVAIL. */
moe_err wkr_gpu_ep_forward(wkr *w, wkr_model *m, int layer, int T, const void *x, moe_dtype xdt,
                           void *y, moe_dtype ydt, int32_t *counts, double *probs_sum,
                           double *z_sum, uint64_t *a2a_bytes, int train);
/* backward of the train forward `handle` whose x (T,H) is given (the
 * forward is recomputed, collectively, when the devices hold another). */
moe_err wkr_gpu_ep_backward(wkr *w, wkr_model *m, int layer, uint64_t handle, int T, const float *x,
                            const float *dy, float *dx);

/* optimizer support: add the device gradients into the host grads (and
 * clear them on the device); push the host weights back to the device. */
moe_err wkr_gpu_pull_grads(wkr_model *m);
moe_err wkr_gpu_push_weights(wkr_model *m);

#endif
