/* gpu.c - the worker's GPU backend; see gpu.h. */
#include "worker/gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/step_trace.h"

#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "kernels/cuda/kcu_abort.h"
#include "kernels/cuda/kcu_ep.h"
#include "kernels/cuda/kern_cuda.h"

int64_t wkr_gpu_abort_stuck_ms(void)
{
    return kcu_abort_stuck_ms();
}

int64_t wkr_gpu_mem_free(int device)
{
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess)
        return -1;
    return (int64_t)free_b;
}

int wkr_gpu_probe(int device, char *name, size_t len)
{
    int n = 0;
    struct cudaDeviceProp prop;
    if (cudaGetDeviceCount(&n) != cudaSuccess || device >= n)
        return 0;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaGetDeviceProperties(&prop, device) != cudaSuccess)
        return 0;
    int ptx = 0, bin = 0;
    if (prop.major < 8 || kcu_arch_image(&ptx, &bin) != 0) { /* bf16 mma.sync needs sm_80 */
        LOG_W("GPU %d (%s, sm_%d%d): no kernels of this build run on it (sm_80 or newer)", device,
              prop.name, prop.major, prop.minor);
        return 0;
    }
    snprintf(name, len, "%s, %s", prop.name, kcu_arch_name());
    return 1;
}

void wkr_gpu_build_info(char *buf, size_t len)
{
    int rt = 0, nccl = 0;
    cudaRuntimeGetVersion(&rt);
    ncclGetVersion(&nccl);
    snprintf(buf, len,
             "cuda: runtime %d.%d (built with %d.%d), NCCL %d.%d.%d (built with %d.%d.%d), kernel "
             "images sm_90a, sm_80 and compute_80 PTX",
             rt / 1000, rt % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10,
             nccl / 10000, nccl / 100 % 100, nccl % 100, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
}

moe_err wkr_gpu_host_register(void *p, size_t n)
{
    if (cudaHostRegister(p, n, cudaHostRegisterPortable) != cudaSuccess) {
        LOG_W("cudaHostRegister of %zu bytes failed: %s (copies stay pageable)", n,
              cudaGetErrorString(cudaGetLastError()));
        return MOE_EINVAL;
    }
    return MOE_OK;
}

void wkr_gpu_host_unregister(void *p)
{
    if (cudaHostUnregister(p) != cudaSuccess)
        (void)cudaGetLastError();
}

moe_err wkr_gpu_ipc_open(int device, const void *handle, size_t len, void **dptr, char *err,
                         size_t errlen)
{
    cudaIpcMemHandle_t h;
    if (len != sizeof(h)) {
        snprintf(err, errlen, "a CUDA IPC handle has %zu bytes, not %zu", sizeof(h), len);
        return MOE_EINVAL;
    }
    memcpy(&h, handle, sizeof(h));
    cudaError_t ce = cudaSetDevice(device);
    if (ce == cudaSuccess)
        ce = cudaIpcOpenMemHandle(dptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (ce != cudaSuccess) {
        snprintf(err, errlen, "cudaIpcOpenMemHandle: %s", cudaGetErrorString(ce));
        (void)cudaGetLastError();
        return MOE_EINVAL;
    }
    return MOE_OK;
}

void wkr_gpu_ipc_close(int device, void *dptr)
{
    if (cudaSetDevice(device) != cudaSuccess || cudaIpcCloseMemHandle(dptr) != cudaSuccess)
        (void)cudaGetLastError();
}

moe_err wkr_gpu_copy(void *dst, const void *src, size_t n)
{
    if (n && cudaMemcpy(dst, src, n, cudaMemcpyDefault) != cudaSuccess) {
        LOG_E("cudaMemcpy of %zu bytes: %s", n, cudaGetErrorString(cudaGetLastError()));
        return MOE_EINTERNAL;
    }
    return MOE_OK;
}

void *wkr_gpu_pinned_alloc(size_t n)
{
    void *p = NULL;
    if (cudaMallocHost(&p, n ? n : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

void wkr_gpu_pinned_free(void *p)
{
    if (p)
        cudaFreeHost(p);
}

/* route_config_of: the device routing of model c (kcu_route_config: its
 * family, and a shared expert of d_ff Fs = m F as m experts); MOE_EINVAL
 * (logged) when Fs is not a whole number of experts of d_ff F */
static moe_err route_config_of(const model_cfg *c, kcu_route_config *rc)
{
    memset(rc, 0, sizeof(*rc));
    rc->scoring = c->scoring;
    rc->n_group = c->n_group;
    rc->topk_group = c->topk_group;
    rc->group_topn = c->group_topn;
    rc->route_scale = (float)c->routed_scale;
    rc->shared_gate = c->shared_gate;
    if (kcu_shared_split(c->shared_d_ff, c->d_ff, &rc->shared_experts) != MOE_OK) {
        LOG_E("model %s: a shared expert of d_ff %d is not a whole number of experts of d_ff %d: "
              "not on the GPU",
              c->name, c->shared_d_ff, c->d_ff);
        return MOE_EINVAL;
    }
    return MOE_OK;
}

/* dev_model: what a device layer needs of its model - where the layer's
 * extra tensors are (the choice bias, the shared expert and its gate) */
typedef struct dev_model {
    wkr_model *m;
    int layer;
    int bias, shared; /* the layer has a choice bias, a shared expert */
} dev_model;

static void dev_model_init(dev_model *dm, wkr_model *m, int layer)
{
    dm->m = m;
    dm->layer = layer;
    dm->bias = m->cfg.score_bias;
    dm->shared = m->cfg.shared_d_ff > 0;
}

/* ---- layer: the whole layer on one device (kcu_layer) ---- */

/* layer_dev: a kcu_layer and what its states hold. A training layer keeps
 * up to --gpu-train-states train forwards on the device (kcu_layer_set_state):
 * a pipeline schedule (forward 1, forward 2, backward 2, backward 1) does
 * not recompute. A forward takes a free state, else the least recently used
 * one (whose train forward is then recomputed by its backward). */
#define LAYER_MAX_STATES 16
typedef struct layer_dev {
    kcu_layer *kl;
    dev_model dm;
    int nstates;
    uint64_t handle[LAYER_MAX_STATES]; /* the train forward a state holds, 0 = none */
    uint64_t used[LAYER_MAX_STATES];   /* when it was last used (clock) */
    uint64_t clock;
    uint64_t recomputes; /* backwards whose forward had been pushed out */
} layer_dev;

/* lru_pick: of n states, the first free one (handle 0), else the least
 * recently used (layer_dev's and ep_dev's) */
static int lru_pick(const uint64_t *handle, const uint64_t *used, int n)
{
    int s = 0;
    for (int i = 0; i < n; i++) {
        if (!handle[i])
            return i;
        if (used[i] < used[s])
            s = i;
    }
    return s;
}

/* layer_take: a state for the next forward (lru_pick), selected on the
 * layer; -1 on a kernel error */
static int layer_take(layer_dev *d)
{
    const int s = lru_pick(d->handle, d->used, d->nstates);
    if (kcu_layer_set_state(d->kl, s) != MOE_OK)
        return -1;
    d->handle[s] = 0;
    d->used[s] = ++d->clock;
    return s;
}

static moe_err layer_create(wkr *w, wkr_model *m, int layer, int train, void **dev)
{
    const model_cfg *c = &m->cfg;
    layer_dev *d = calloc(1, sizeof(*d));
    if (!d)
        return MOE_ENOMEM;
    dev_model_init(&d->dm, m, layer);
    /* the routing family; a shared expert of d_ff Fs = n F runs as n more
     * experts that every token takes (kcu_route_config) */
    kcu_route_config rc;
    if (route_config_of(c, &rc) != MOE_OK) {
        free(d);
        return MOE_EINVAL;
    }
    d->nstates = train ? (int)w->gpu_train_states : 1;
    if (d->nstates < 1 || d->nstates > LAYER_MAX_STATES)
        d->nstates = 1;
    /* E + m > 256: the layer holds the shared expert apart, whose kept
     * forward is one (kern_cuda.h): one state, a backward whose forward was
     * pushed out recomputes it */
    if (kcu_shared_apart(c->n_experts, rc.shared_experts))
        d->nstates = 1;
    kcu_config kc = {c->d_model,
                     c->d_ff,
                     c->n_experts,
                     c->top_k,
                     (kern_act)c->act,
                     c->renormalize,
                     (int)w->gpu_max_tokens,
                     train,
                     (float)c->capacity_factor,
                     (int)w->gpu_grad_bf16,
                     d->nstates};
    moe_err e = kcu_layer_create_ex(&kc, &rc, &d->kl);
    if (e != MOE_OK) {
        free(d);
        d = NULL;
    }
    *dev = d;
    return e;
}

static void layer_destroy(void *dev)
{
    layer_dev *d = dev;
    if (!d)
        return;
    if (d->recomputes)
        LOG_I("GPU layer: %llu backwards recomputed their forward (more --gpu-train-states "
              "would keep them)",
              (unsigned long long)d->recomputes);
    kcu_layer_destroy(d->kl);
    free(d);
}

/* upload: new weights; the forwards the states hold are stale */
static moe_err layer_upload(void *dev, const wkr_layer *L)
{
    layer_dev *d = dev;
    memset(d->handle, 0, sizeof(d->handle));
    moe_err e = kcu_layer_upload(d->kl, L->wr, L->w1, L->w3, L->w2);
    if (e == MOE_OK && d->dm.bias)
        e = kcu_layer_upload_bias(d->kl, L->bias);
    if (e == MOE_OK && d->dm.shared)
        e = kcu_layer_upload_shared(d->kl, L->ws1, L->ws3, L->ws2, L->wsg);
    return e;
}

/* shared_grads_add adds a device layer's shared-expert gradients (and its
 * gate's: download(obj, dws1, dws3, dws2, dwsg), kcu_layer's or kcu_ep's)
 * into the host grads of layer's extra tensors, before the device
 * gradients are zeroed */
typedef moe_err (*shared_download_fn)(void *obj, float *s1, float *s3, float *s2, float *sg);

static moe_err layer_shared_download(void *obj, float *s1, float *s3, float *s2, float *sg)
{
    return kcu_layer_download_shared_grads(obj, s1, s3, s2, sg);
}

static moe_err ep_shared_download(void *obj, float *s1, float *s3, float *s2, float *sg)
{
    return kcu_ep_download_shared_grads(obj, s1, s3, s2, sg);
}

static moe_err shared_grads_add(const dev_model *dm, void *obj, shared_download_fn download)
{
    wkr_model *m = dm->m;
    const model_cfg *c = &m->cfg;
    const size_t H = (size_t)c->d_model, sfh = (size_t)c->shared_d_ff * H;
    const int gated = act_gated(c->act);
    float *s1 = malloc(sfh * 4), *s3 = gated ? malloc(sfh * 4) : NULL, *s2 = malloc(sfh * 4),
          *sg = c->shared_gate ? malloc(H * 4) : NULL;
    moe_err e = s1 && s2 && (!gated || s3) && (!c->shared_gate || sg) ? MOE_OK : MOE_ENOMEM;
    if (e == MOE_OK)
        e = download(obj, s1, s3, s2, sg);
    /* the extra tensors in wkr_layer_extra's order: bias (frozen), ws1,
     * (ws3,) ws2, wsg */
    wkr_param *p = wkr_layer_extra(m, dm->layer) + (c->score_bias ? 1 : 0);
    const float *src[4] = {s1, gated ? s3 : s2, gated ? s2 : sg, sg};
    const int n = (gated ? 3 : 2) + (c->shared_gate ? 1 : 0);
    for (int k = 0; e == MOE_OK && k < n; k++)
        for (size_t t = 0; t < p[k].n; t++)
            p[k].grad[t] += src[k][t];
    free(s1), free(s3), free(s2), free(sg);
    return e;
}

static moe_err layer_pull_grads(void *dev, float *gr, float *g1, float *g3, float *g2)
{
    layer_dev *d = dev;
    moe_err e = kcu_layer_download_grads(d->kl, gr, g1, g3, g2);
    if (e == MOE_OK && d->dm.shared && d->dm.m->train_ready)
        e = shared_grads_add(&d->dm, d->kl, layer_shared_download);
    if (e == MOE_OK)
        e = kcu_layer_zero_grads(d->kl, NULL);
    return e;
}

/* page_locked: p is page-locked host memory (cudaMallocHost, or a segment
 * registered with cudaHostRegister): the copies of kcu_forward_pipelined
 * run asynchronously only from and to such memory (a copy to pageable
 * memory returns when it is done, which would serialise the chunks) */
static int page_locked(const void *p)
{
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return a.type == cudaMemoryTypeHost;
}

/* mem_kind: what p is, for an error message */
static const char *mem_kind(const void *p)
{
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return "unknown memory";
    }
    return a.type == cudaMemoryTypeDevice    ? "device memory"
           : a.type == cudaMemoryTypeHost    ? "page-locked host memory"
           : a.type == cudaMemoryTypeManaged ? "managed memory"
                                             : "pageable host memory";
}

static moe_err layer_forward(wkr *w, wkr_model *m, int layer, uint64_t handle, int T, const void *x,
                             moe_dtype xdt, void *y, moe_dtype ydt, int train, wkr_gpu_out *out,
                             char *err, size_t errlen)
{
    layer_dev *d = m->gpu[layer];
    kcu_layer *kl = d->kl;
    float aux = 0, z = 0;
    moe_err e = MOE_OK;
    int s = 0;
    /* an inference forward of page-locked host rows (a client's registered
     * segment, pinned buffers), dropless, of at least two chunks: chunked,
     * the copies overlapped with the compute (same y and statistics) */
    const long long chunk = w->gpu_chunk_tokens;
    /* more rows than the workspace holds (--gpu-max-tokens): an inference
     * forward, dropless, goes in chunks whatever its memory (device rows
     * too, e.g. a client's over NCCL: the copies are device to device);
     * else kcu_forward would refuse it (invalid argument) */
    const int over = (long long)T > w->gpu_max_tokens;
    if (over && (train || m->cfg.capacity_factor != 0)) {
        snprintf(err, errlen,
                 "GPU layer forward: %d rows exceed --gpu-max-tokens=%lld (only a dropless "
                 "inference forward is chunked): send fewer rows per call, or raise it",
                 T, w->gpu_max_tokens);
        LOG_W("model %s layer %d: %s", m->cfg.name, layer, err);
        return MOE_EINVAL;
    }
    const int pipelined = over || (!train && chunk > 0 && m->cfg.capacity_factor == 0 &&
                                   (long long)T >= 2 * chunk && page_locked(x) && page_locked(y));
    long long pchunk = chunk; /* kcu_forward_pipelined takes at most T_max per chunk */
    if (pchunk <= 0 || pchunk > w->gpu_max_tokens)
        pchunk = w->gpu_max_tokens;
    if (T > 0 && (s = layer_take(d)) < 0)
        e = MOE_EINTERNAL;
    if (e == MOE_OK && T > 0) {
        if (pipelined)
            e = kcu_forward_pipelined(kl, T, x, xdt, y, ydt, (int)pchunk, NULL);
        else
            e = kcu_forward(kl, T, x, xdt, y, ydt, train, NULL);
        if (e == MOE_OK)
            e = kcu_forward_stats(kl, out->counts, out->dropped, &aux, &z, NULL);
        /* kcu_forward_stats waits on the legacy stream, which follows the
         * plain forward's work; the pipelined one also ran copy streams */
        if (e == MOE_OK && pipelined && cudaDeviceSynchronize() != cudaSuccess)
            e = MOE_EINTERNAL;
    }
    if (e != MOE_OK) {
        snprintf(err, errlen,
                 "GPU layer forward failed: %s (T %d, --gpu-max-tokens %lld, x %s in %s, y %s "
                 "in %s, %s; a kcu line on stderr says more)",
                 moe_strerror(e), T, w->gpu_max_tokens, moe_dtype_name(xdt), mem_kind(x),
                 moe_dtype_name(ydt), mem_kind(y), pipelined ? "chunked" : "one call");
        LOG_W("model %s layer %d: %s", m->cfg.name, layer, err);
        return e;
    }
    if (train && T > 0)
        d->handle[s] = handle;
    /* the loss comes whole: probs_sum is not computed on this path */
    out->aux_whole = 1;
    out->aux = aux;
    out->z_sum = (double)z * T;
    return MOE_OK;
}

static moe_err layer_backward(wkr *w, wkr_model *m, int layer, uint64_t handle, int T,
                              const float *x, const float *dy, float *dx, char *err, size_t errlen)
{
    layer_dev *d = m->gpu[layer];
    kcu_layer *kl = d->kl;
    const model_cfg *c = &m->cfg;
    (void)w;
    if (T == 0)
        return MOE_OK;
    moe_err e = MOE_OK;
    int s = -1;
    for (int i = 0; i < d->nstates && s < 0; i++)
        if (d->handle[i] == handle)
            s = i;
    if (s >= 0 && kcu_layer_set_state(kl, s) != MOE_OK) {
        e = MOE_EINTERNAL;
        goto out;
    }
    if (s < 0) {
        /* its state was taken by later forwards: recompute it */
        float *y = malloc((size_t)T * c->d_model * sizeof(float));
        if (!y || (s = layer_take(d)) < 0) {
            free(y);
            e = !y ? MOE_ENOMEM : MOE_EINTERNAL;
            goto out;
        }
        d->recomputes++;
        e = kcu_forward(kl, T, x, MOE_F32, y, MOE_F32, 1, NULL);
        free(y);
    }
    if (e == MOE_OK)
        e = kcu_backward(kl, dy, MOE_F32, dx, MOE_F32, (float)c->aux_loss_coef,
                         (float)c->z_loss_coef, NULL, 0, NULL);
    if (e == MOE_OK && cudaDeviceSynchronize() != cudaSuccess)
        e = MOE_EINTERNAL;
    d->handle[s] = 0;
out:
    if (e != MOE_OK)
        snprintf(err, errlen, "GPU layer backward failed: %s", moe_strerror(e));
    return e;
}

static const wkr_gpu_ops layer_ops = {
    .name = "whole-layer",
    .whole_layer = 1,
    .collective = 0,
    .create = layer_create,
    .destroy = layer_destroy,
    .upload = layer_upload,
    .pull_grads = layer_pull_grads,
    .forward = layer_forward,
    .backward = layer_backward,
};

/* ---- ep: the whole layer on every rank's device, rows over NCCL (kcu_ep) ---- */

/* ep_dev: a kcu_ep and what its model's routing family needs (the bias,
 * the shared expert replicated on every rank, whose gradients join the
 * layer's extra tensors), and its train states. A training layer keeps
 * --gpu-ep-train-states train forwards on the device (kcu_ep.h "Train
 * states"), taken as layer_dev's are (free first, else least recently
 * used): every rank takes the same one, since train forwards and backwards
 * are cluster jobs that every rank sees in one order. Inference and
 * fan-out forwards - a fan-out reaches the ranks in no common order - run
 * in one more state of their own (ntrain, allocated at its first use), so
 * they never displace a train forward on one rank and not on another.
 * ntrain 0 (an inference layer, or a shared expert: one state): the train
 * forward's handle in m->gpu_handle. */
typedef struct ep_dev {
    kcu_ep *ep;
    dev_model dm;
    int train; /* a training layer */
    int ntrain;
    uint64_t handle[KCU_EP_MAX_STATES]; /* the train forward a state holds, 0 = none */
    uint64_t used[KCU_EP_MAX_STATES];   /* when it was last used (clock) */
    uint64_t clock;
    uint64_t recomputes; /* backwards whose forward had been pushed out */
} ep_dev;

/* ep_take: a train state for the next train forward (lru_pick), selected
 * on the layer; -1 on an error */
static int ep_take(ep_dev *d)
{
    const int s = lru_pick(d->handle, d->used, d->ntrain);
    if (kcu_ep_use_state(d->ep, s) != MOE_OK)
        return -1;
    d->handle[s] = 0;
    d->used[s] = ++d->clock;
    return s;
}

static moe_err ep_create(wkr *w, wkr_model *m, int layer, int train, void **dev)
{
    const model_cfg *c = &m->cfg;
    ep_dev *d = calloc(1, sizeof(*d));
    if (!d)
        return MOE_ENOMEM;
    dev_model_init(&d->dm, m, layer);
    kcu_ep_config ec;
    memset(&ec, 0, sizeof(ec));
    ec.H = c->d_model;
    ec.F = c->d_ff;
    ec.E = c->n_experts;
    ec.K = c->top_k;
    ec.act = (kern_act)c->act;
    ec.renorm = c->renormalize;
    ec.rank = w->rank;
    ec.world = w->world;
    ec.T_max = (int)w->gpu_max_tokens;
    ec.train = train;
    ec.chunks = (int)w->ep_chunks;
    ec.timeout_ms = (int)w->xchg_timeout_ms;
    /* the train states and one for the other forwards (see ep_dev) */
    if (train)
        ec.states = w->gpu_ep_train_states + 1 < KCU_EP_MAX_STATES ? (int)w->gpu_ep_train_states + 1
                                                                   : KCU_EP_MAX_STATES;
    /* the routing family: the same router as the one-GPU layer's; a shared
     * expert is replicated and runs on each rank's own tokens */
    if (route_config_of(c, &ec.route) != MOE_OK) {
        free(d);
        return MOE_EINVAL;
    }
    kcu_ep_abort_hook = xchg_aborted; /* worker.abort stops its waits */
    moe_err e = kcu_ep_create(&ec, xchg_nccl_comm(w->xc), &d->ep);
    if (e != MOE_OK) {
        free(d);
        d = NULL;
    } else {
        const int ns = kcu_ep_states(d->ep);
        d->ntrain = ns > 1 ? ns - 1 : 0;
        d->train = train;
    }
    *dev = d;
    return e;
}

static void ep_destroy(void *dev)
{
    ep_dev *d = dev;
    if (!d)
        return;
    if (d->recomputes)
        LOG_I("GPU expert-parallel layer: %llu backwards recomputed their forward (more "
              "--gpu-ep-train-states would keep them)",
              (unsigned long long)d->recomputes);
    kcu_ep_destroy(d->ep);
    free(d);
}

static moe_err ep_upload(void *dev, const wkr_layer *L)
{
    ep_dev *d = dev;
    memset(d->handle, 0, sizeof(d->handle)); /* the kept forwards are stale */
    moe_err e = kcu_ep_upload(d->ep, L->wr, L->w1, L->w3, L->w2);
    if (e == MOE_OK && d->dm.bias)
        e = kcu_ep_upload_bias(d->ep, L->bias);
    if (e == MOE_OK && d->dm.shared)
        e = kcu_ep_upload_shared(d->ep, L->ws1, L->ws3, L->ws2, L->wsg);
    return e;
}

static moe_err ep_pull_grads(void *dev, float *gr, float *g1, float *g3, float *g2)
{
    ep_dev *d = dev;
    /* the router gradient of this rank's tokens (all-reduced at the step
     * with the host ones), the local experts' gradients, and this rank's
     * part of the shared expert's (replicated: all-reduced too) */
    moe_err e = kcu_ep_download_router_grad(d->ep, gr);
    if (e == MOE_OK)
        e = kcu_experts_download_grads(kcu_ep_experts(d->ep), g1, g3, g2);
    if (e == MOE_OK && d->dm.shared && d->dm.m->train_ready)
        e = shared_grads_add(&d->dm, d->ep, ep_shared_download);
    if (e == MOE_OK)
        e = kcu_ep_zero_grads(d->ep);
    return e;
}

/* ep_failed: an exchange that failed or timed out leaves NCCL work stuck on
 * a peer: abort the communicator so that the kernels stop and the cluster
 * re-forms. Other errors get their message in err. */
static moe_err ep_failed(wkr *w, moe_err e, const char *what, char *err, size_t errlen)
{
    if (e == MOE_EUNAVAIL) {
        LOG_W("%s: exchange failed; aborting the NCCL communicator", what);
        xchg_nccl_abort_comm(w->xc, what);
    } else if (e != MOE_OK) {
        snprintf(err, errlen, "GPU %s failed on rank %d: %s", what, w->rank, moe_strerror(e));
    }
    return e;
}

/* MOE_EP_TRACE=N: where an expert-parallel forward's host time goes on
 * the ordered road (common/step_trace.h): the forward's launches, the wait
 * for it (the exchange included), the counts and statistics */
static step_trace ep_tr = {
    "MOE_EP_TRACE", "worker ep_forward", 3, {"launch", "wait", "stats"}, -1, 0, {0}};

static moe_err ep_forward(wkr *w, wkr_model *m, int layer, uint64_t handle, int T, const void *x,
                          moe_dtype xdt, void *y, moe_dtype ydt, int train, wkr_gpu_out *out,
                          char *err, size_t errlen)
{
    ep_dev *d = m->gpu[layer];
    kcu_ep *ep = d->ep;
    double t_last = 0;
    step_trace_begin(&ep_tr, &t_last);
    moe_err e = MOE_OK;
    int s = -1;
    if (d->ntrain) /* a train state, or the other forwards' one */
        e = train ? ((s = ep_take(d)) < 0 ? MOE_EINTERNAL : MOE_OK)
                  : kcu_ep_use_state(ep, d->ntrain);
    wkr_busy_at(w, "expert-parallel forward: kcu_ep_forward");
    if (e == MOE_OK)
        e = kcu_ep_forward(ep, T, x, xdt, y, ydt, train, NULL);
    step_trace_stamp(&ep_tr, 0, &t_last);
    wkr_busy_at(w, "expert-parallel forward: kcu_ep_wait");
    if (e == MOE_OK)
        e = kcu_ep_wait(ep, NULL);
    step_trace_stamp(&ep_tr, 1, &t_last);
    wkr_busy_at(w, "expert-parallel forward: counts and stats");
    if (e == MOE_OK) {
        kcu_ep_last_counts(ep, out->counts, NULL, NULL, NULL);
        out->a2a_bytes = (uint64_t)kcu_ep_last_a2a_bytes(ep);
        e = kcu_ep_stats(ep, out->probs_sum, &out->z_sum, NULL);
    }
    step_trace_stamp(&ep_tr, 2, &t_last);
    step_trace_end(&ep_tr);
    if (d->ntrain) {
        if (s >= 0 && e == MOE_OK)
            d->handle[s] = handle;
    } else {
        m->gpu_handle[layer] = 0;
        if (e == MOE_OK && train)
            m->gpu_handle[layer] = handle;
    }
    return ep_failed(w, e, "expert-parallel forward", err, errlen);
}

static moe_err ep_backward(wkr *w, wkr_model *m, int layer, uint64_t handle, int T, const float *x,
                           const float *dy, float *dx, char *err, size_t errlen)
{
    ep_dev *d = m->gpu[layer];
    kcu_ep *ep = d->ep;
    const model_cfg *c = &m->cfg;
    moe_err e = MOE_OK;
    int s = -1;
    for (int i = 0; i < d->ntrain && s < 0; i++)
        if (d->handle[i] == handle)
            s = i;
    const int kept = s >= 0 || (!d->ntrain && m->gpu_handle[layer] == handle);
    if (s >= 0)
        e = kcu_ep_use_state(ep, s);
    if (e == MOE_OK && !kept) {
        /* the devices hold other forwards: every rank recomputes this one
         * (they all see the same sequence of jobs, and take the same state) */
        float *y = malloc((size_t)(T ? T : 1) * c->d_model * sizeof(float));
        if (!y)
            return ep_failed(w, MOE_ENOMEM, "expert-parallel backward", err, errlen);
        if (d->ntrain && (s = ep_take(d)) < 0) {
            free(y);
            return ep_failed(w, MOE_EINTERNAL, "expert-parallel backward", err, errlen);
        }
        d->recomputes++;
        wkr_busy_at(w, "expert-parallel backward: the forward again");
        e = kcu_ep_forward(ep, T, x, MOE_F32, y, MOE_F32, 1, NULL);
        if (e == MOE_OK)
            e = kcu_ep_wait(ep, NULL);
        free(y);
    }
    wkr_busy_at(w, "expert-parallel backward: kcu_ep_backward");
    if (e == MOE_OK)
        e = kcu_ep_backward(ep, dy, MOE_F32, dx, MOE_F32, (float)c->aux_loss_coef,
                            (float)c->z_loss_coef, NULL);
    wkr_busy_at(w, "expert-parallel backward: kcu_ep_wait");
    if (e == MOE_OK)
        e = kcu_ep_wait(ep, NULL);
    m->gpu_handle[layer] = 0;
    if (s >= 0)
        d->handle[s] = 0;
    return ep_failed(w, e, "expert-parallel backward", err, errlen);
}

static moe_err ep_fanout(wkr *w, wkr_model *m, int layer, int T, const void *x, moe_dtype xdt,
                         wkr_gpu_fanout *out, char *err, size_t errlen)
{
    ep_dev *d = m->gpu[layer];
    kcu_ep *ep = d->ep;
    kcu_ep_local lo;
    memset(&lo, 0, sizeof(lo));
    lo.counts = out->counts;
    lo.topk_w = out->topk_w;
    lo.slots = out->slots;
    lo.sh0 = out->sh0;
    lo.shn = out->shn;
    lo.ys = out->ys;
    lo.probs_sum = out->probs_sum;
    if (d->train && !d->ntrain) {
        /* a training layer of one state (a shared expert): a fan-out, which
         * reaches the ranks in no common order, would displace the kept
         * train forward on each rank at its own moment. Every rank refuses
         * it alike (not_found: libmoe takes the ordered road instead). */
        err[0] = 0;
        return MOE_ENOTFOUND;
    }
    wkr_busy_at(w, "fan-out forward: kcu_ep_forward_local");
    /* with train states, in the other forwards' state (an inference layer
     * has one state and no kept train forward) */
    moe_err e = d->ntrain ? kcu_ep_use_state(ep, d->ntrain) : MOE_OK;
    if (e == MOE_OK)
        e = kcu_ep_forward_local(ep, T, x, xdt, &lo, NULL);
    if (!d->ntrain)
        m->gpu_handle[layer] = 0;
    out->n = lo.n;
    out->ye_at = lo.ye_at;
    out->z_sum = lo.z_sum;
    if (e != MOE_OK)
        snprintf(err, errlen, "GPU fan-out forward failed on rank %d: %s", w->rank,
                 moe_strerror(e));
    return e;
}

static const wkr_gpu_ops ep_ops = {
    .name = "expert-parallel (rows stay on the GPUs, NCCL)",
    .whole_layer = 1,
    .collective = 1,
    .create = ep_create,
    .destroy = ep_destroy,
    .upload = ep_upload,
    .pull_grads = ep_pull_grads,
    .forward = ep_forward,
    .backward = ep_backward,
    .fanout = ep_fanout,
};

/* ---- experts: the local experts' rows on the device (kcu_experts) ---- */

static moe_err experts_create(wkr *w, wkr_model *m, int layer, int train, void **dev)
{
    const model_cfg *c = &m->cfg;
    (void)layer;
    *dev = NULL;
    if (m->ne == 0) /* no local experts: nothing on the device */
        return MOE_OK;
    kcu_experts *ex = NULL;
    moe_err e = kcu_experts_create(c->d_model, c->d_ff, m->ne, (kern_act)c->act,
                                   (int)(w->gpu_max_tokens * c->top_k), train, &ex);
    *dev = ex;
    return e;
}

static void experts_destroy(void *dev)
{
    kcu_experts_destroy(dev);
}

static moe_err experts_upload(void *dev, const wkr_layer *L)
{
    return kcu_experts_upload(dev, L->w1, L->w3, L->w2);
}

static moe_err experts_pull_grads(void *dev, float *gr, float *g1, float *g3, float *g2)
{
    (void)gr;
    moe_err e = kcu_experts_download_grads(dev, g1, g3, g2);
    if (e == MOE_OK)
        e = kcu_experts_zero_grads(dev, NULL);
    return e;
}

/* compact copies the kept rows of each expert together; returns their count */
static int compact(const float *rows, const int32_t *n, const int32_t *kept, int ne, int H,
                   float *out)
{
    size_t src = 0, dst = 0;
    for (int i = 0; i < ne; i++) {
        memcpy(out + dst * H, rows + src * H, (size_t)kept[i] * H * sizeof(float));
        dst += (size_t)kept[i];
        src += (size_t)n[i];
    }
    return (int)dst;
}

static void expand(const float *in, const int32_t *n, const int32_t *kept, int ne, int H,
                   float *rows)
{
    size_t src = 0, dst = 0;
    for (int i = 0; i < ne; i++) {
        memcpy(rows + dst * H, in + src * H, (size_t)kept[i] * H * sizeof(float));
        memset(rows + (dst + (size_t)kept[i]) * H, 0, (size_t)(n[i] - kept[i]) * H * sizeof(float));
        src += (size_t)kept[i];
        dst += (size_t)n[i];
    }
}

static moe_err experts_call(wkr_model *m, int layer, const float *in, const int32_t *n,
                            const int32_t *kept, float *out, int backward, int keep)
{
    const int H = m->cfg.d_model, ne = m->ne;
    kcu_experts *ex = m->gpu[layer];
    size_t total = 0, nk = 0;
    for (int i = 0; i < ne; i++) {
        total += (size_t)n[i];
        nk += (size_t)kept[i];
    }
    if (!ex || total == 0)
        return MOE_OK;
    float *ci = malloc((nk ? nk : 1) * H * sizeof(float)), *co = malloc((nk ? nk : 1) * H * 4);
    if (!ci || !co) {
        free(ci), free(co);
        return MOE_ENOMEM;
    }
    compact(in, n, kept, ne, H, ci);
    moe_err e = backward
                    ? kcu_experts_backward(ex, ci, MOE_F32, co, MOE_F32, NULL)
                    : kcu_experts_forward(ex, (int)nk, ci, MOE_F32, kept, co, MOE_F32, keep, NULL);
    if (e == MOE_OK && cudaDeviceSynchronize() != cudaSuccess)
        e = MOE_EINTERNAL;
    if (e == MOE_OK)
        expand(co, n, kept, ne, H, out);
    free(ci), free(co);
    return e;
}

static moe_err experts_forward(wkr_model *m, int layer, uint64_t handle, const float *xe,
                               const int32_t *n, const int32_t *kept, float *ye, int train)
{
    moe_err e = experts_call(m, layer, xe, n, kept, ye, 0, train);
    /* an inference forward (the fan-out's too) drops a kept train forward:
     * its backward recomputes */
    m->gpu_handle[layer] = train && e == MOE_OK ? handle : 0;
    return e;
}

static moe_err experts_backward(wkr_model *m, int layer, uint64_t handle, const float *xe,
                                const float *dye, const int32_t *n, const int32_t *kept, float *dxe)
{
    moe_err e = MOE_OK;
    if (m->gpu_handle[layer] != handle) {
        /* the device keeps the last train forward's activations: recompute
         * when another forward ran since this one */
        size_t total = 0;
        for (int i = 0; i < m->ne; i++)
            total += (size_t)n[i];
        float *ye = malloc((total ? total : 1) * m->cfg.d_model * sizeof(float));
        e = ye ? experts_call(m, layer, xe, n, kept, ye, 0, 1) : MOE_ENOMEM;
        free(ye);
    }
    if (e == MOE_OK)
        e = experts_call(m, layer, dye, n, kept, dxe, 1, 0);
    m->gpu_handle[layer] = 0;
    return e;
}

static const wkr_gpu_ops experts_ops = {
    .name = "experts",
    .whole_layer = 0,
    .collective = 0,
    .create = experts_create,
    .destroy = experts_destroy,
    .upload = experts_upload,
    .pull_grads = experts_pull_grads,
    .experts_forward = experts_forward,
    .experts_backward = experts_backward,
};

/* ---- attach, detach, the optimizer's copies: through the ops ---- */

void wkr_gpu_detach(wkr_model *m)
{
    for (int l = 0; m->gpu && m->gpu_ops && l < m->cfg.layers; l++)
        m->gpu_ops->destroy(m->gpu[l]);
    free(m->gpu);
    m->gpu = NULL;
    m->gpu_ops = NULL;
    free(m->gpu_handle);
    m->gpu_handle = NULL;
}

moe_err wkr_gpu_attach(wkr *w, wkr_model *m, int train)
{
    const model_cfg *c = &m->cfg;
    wkr_gpu_detach(m);
    if (cudaSetDevice((int)w->device_index) != cudaSuccess)
        return MOE_EUNAVAIL;
    m->gpu = calloc((size_t)c->layers, sizeof(void *));
    m->gpu_handle = calloc((size_t)c->layers, sizeof(uint64_t));
    if (!m->gpu || !m->gpu_handle) {
        wkr_gpu_detach(m);
        return MOE_ENOMEM;
    }
    /* several GPU workers over NCCL: the device-resident layer (dropless) */
    void *comm = w->world > 1 ? xchg_nccl_comm(w->xc) : NULL;
    const int ep = comm && c->capacity_factor == 0 && strcmp(w->ep_cfg, "off") != 0;
    /* the experts backend serves the routing families too: it runs only
     * the owned experts' FFNs on rows grouped by expert; the router (the
     * family's scoring, bias, groups and scale: fwd_gate, kern_route_cpu),
     * the combine, the shared expert (kern_shared_forward_cpu, replicated
     * on the worker's own tokens) and their backward stay on the host, the
     * code and host weights of a CPU worker */
    const wkr_gpu_ops *ops = w->world == 1 ? &layer_ops : ep ? &ep_ops : &experts_ops;
    m->gpu_ops = ops;
    m->gpu_train = train;
    moe_err e = MOE_OK;
    for (int l = 0; l < c->layers && e == MOE_OK; l++) {
        void *dev = NULL;
        e = ops->create(w, m, l, train, &dev);
        if (e == MOE_OK && dev)
            e = ops->upload(dev, &m->layers[l]);
        m->gpu[l] = dev;
    }
    if (e != MOE_OK) {
        LOG_E("model %s: cannot place layers on GPU %lld: %s", c->name, w->device_index,
              moe_strerror(e));
        wkr_gpu_detach(m);
        return e;
    }
    LOG_I("model %s on GPU %lld: %s mode%s", c->name, w->device_index, ops->name,
          train ? ", training" : "");
    return MOE_OK;
}

moe_err wkr_gpu_pull_grads(wkr_model *m)
{
    const wkr_gpu_ops *ops = m->gpu_ops;
    const model_cfg *c = &m->cfg;
    const int E = c->n_experts, H = c->d_model, F = c->d_ff, ne = m->ne;
    const size_t fh = (size_t)F * H;
    int nmat = act_gated(c->act) ? 3 : 2;
    /* layer: the device holds all E experts (world 1: ne == E) */
    int rows_e = ops == &layer_ops ? E : ne;
    float *gr = malloc((size_t)E * H * 4), *g1 = malloc((rows_e ? rows_e : 1) * fh * 4),
          *g3 = malloc((rows_e ? rows_e : 1) * fh * 4),
          *g2 = malloc((rows_e ? rows_e : 1) * fh * 4);
    moe_err e = gr && g1 && g3 && g2 ? MOE_OK : MOE_ENOMEM;
    for (int l = 0; e == MOE_OK && l < c->layers; l++) {
        if (!m->gpu[l])
            continue;
        wkr_param *p = wkr_layer_params(m, l);
        e = ops->pull_grads(m->gpu[l], gr, g1, nmat == 3 ? g3 : NULL, g2);
        /* whole-layer backends: the router gradient of this rank's tokens
         * (all-reduced at the step with the host ones) */
        for (size_t k = 0; e == MOE_OK && ops->whole_layer && k < p[0].n; k++)
            p[0].grad[k] += gr[k];
        for (int i = 0; e == MOE_OK && i < ne; i++) {
            float *srcs[3] = {g1 + i * fh, g3 + i * fh, g2 + i * fh};
            for (int k = 0; k < nmat; k++) {
                wkr_param *q = &p[1 + i * nmat + k];
                const float *src = nmat == 3 ? srcs[k] : (k == 0 ? srcs[0] : srcs[2]);
                for (size_t t = 0; t < q->n; t++)
                    q->grad[t] += src[t];
            }
        }
    }
    if (e == MOE_OK && cudaDeviceSynchronize() != cudaSuccess)
        e = MOE_EINTERNAL;
    free(gr), free(g1), free(g3), free(g2);
    return e;
}

moe_err wkr_gpu_push_weights(wkr_model *m)
{
    moe_err e = MOE_OK;
    for (int l = 0; e == MOE_OK && l < m->cfg.layers; l++) {
        if (!m->gpu[l])
            continue;
        e = m->gpu_ops->upload(m->gpu[l], &m->layers[l]);
        m->gpu_handle[l] = 0;
    }
    return e;
}

#else /* no CUDA */

void wkr_gpu_build_info(char *buf, size_t len)
{
    snprintf(buf, len, "cuda: not in this build");
}

moe_err wkr_gpu_host_register(void *p, size_t n)
{
    (void)p, (void)n;
    return MOE_EINVAL;
}
void wkr_gpu_host_unregister(void *p)
{
    (void)p;
}
void *wkr_gpu_pinned_alloc(size_t n)
{
    return malloc(n ? n : 1);
}
moe_err wkr_gpu_ipc_open(int device, const void *handle, size_t len, void **dptr, char *err,
                         size_t errlen)
{
    (void)device, (void)handle, (void)len, (void)dptr;
    snprintf(err, errlen, "this worker has no CUDA");
    return MOE_EINVAL;
}
void wkr_gpu_ipc_close(int device, void *dptr)
{
    (void)device, (void)dptr;
}
moe_err wkr_gpu_copy(void *dst, const void *src, size_t n)
{
    (void)dst, (void)src, (void)n;
    return MOE_EINVAL;
}
void wkr_gpu_pinned_free(void *p)
{
    free(p);
}

int64_t wkr_gpu_abort_stuck_ms(void)
{
    return 0;
}

int64_t wkr_gpu_mem_free(int device)
{
    (void)device;
    return -1;
}

int wkr_gpu_probe(int device, char *name, size_t len)
{
    (void)device, (void)name, (void)len;
    return 0;
}
moe_err wkr_gpu_attach(wkr *w, wkr_model *m, int train)
{
    (void)w, (void)m, (void)train;
    return MOE_EINVAL;
}
void wkr_gpu_detach(wkr_model *m)
{
    (void)m;
}
moe_err wkr_gpu_pull_grads(wkr_model *m)
{
    (void)m;
    return MOE_EINVAL;
}
moe_err wkr_gpu_push_weights(wkr_model *m)
{
    (void)m;
    return MOE_EINVAL;
}
#endif
