/* client_nccl.c - libmoe's side of the NCCL path; see client_nccl.h. */
#include "client/client_nccl.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void moe_nccl_link_init(moe_nccl_link *l)
{
    memset(l, 0, sizeof(*l));
    pthread_mutex_init(&l->mu, NULL);
    l->device = -1;
    nccl_trace_init(&l->trace);
}

#ifdef MOE_HAVE_CUDA
#include "client/cuda_dl.h"

_Static_assert(sizeof(ncclUniqueId) == MOE_NCCL_ID_BYTES, "ncclUniqueId size");

static int64_t cn_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int moe_nccl_built(void)
{
    return 1;
}

int moe_nccl_version(void)
{
    const moe_cudl *F = moe_cudl_get(1, NULL, 0);
    int v = 0;
    if (!F || F->ncclGetVersion(&v) != ncclSuccess)
        return 0;
    return v;
}

int moe_nccl_device_of(const void *p)
{
    /* called on the NCCL path only: the runtime is loaded if not yet here
     * (an application with a static CUDA runtime has none to find) */
    const moe_cudl *F = moe_cudl_get(1, NULL, 0);
    if (!F)
        return -1;
    struct cudaPointerAttributes a;
    if (!p || F->cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)F->cudaGetLastError();
        return -1;
    }
    return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

moe_err moe_nccl_begin(moe_nccl_link *l, int device, uint8_t *id, char *msg, size_t msglen)
{
    const moe_cudl *F = moe_cudl_get(1, msg, msglen);
    if (!F)
        return MOE_EUNAVAIL;
    ncclUniqueId uid;
    ncclResult_t r = F->ncclGetUniqueId(&uid);
    if (r != ncclSuccess) {
        snprintf(msg, msglen, "ncclGetUniqueId: %s", F->ncclGetErrorString(r));
        return MOE_EUNAVAIL;
    }
    memcpy(id, &uid, sizeof(uid));
    int prev = -1;
    (void)F->cudaGetDevice(&prev);
    cudaStream_t s = NULL;
    cudaError_t ce = F->cudaSetDevice(device);
    if (ce == cudaSuccess)
        ce = F->cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        (void)F->cudaGetLastError();
        snprintf(msg, msglen, "GPU %d: %s", device, F->cudaGetErrorString(ce));
        if (prev >= 0)
            F->cudaSetDevice(prev);
        return MOE_EINVAL;
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* returns at once; moe_nccl_wait polls */
    ncclComm_t comm = NULL;
    r = F->ncclCommInitRankConfig(&comm, 2, uid, 0, &cfg);
    if (prev >= 0)
        F->cudaSetDevice(prev); /* the caller's current device is its own */
    if ((r != ncclSuccess && r != ncclInProgress) || !comm) {
        if (comm)
            F->ncclCommAbort(comm);
        F->cudaStreamDestroy(s);
        snprintf(msg, msglen, "ncclCommInitRankConfig: %s", F->ncclGetErrorString(r));
        return MOE_EUNAVAIL;
    }
    l->comm = comm;
    l->stream = s;
    l->device = device;
    return MOE_OK;
}

moe_err moe_nccl_post(moe_nccl_link *l, int send, void *p, size_t n, char *msg, size_t msglen)
{
    const moe_cudl *F = moe_cudl_get(1, msg, msglen);
    if (!F)
        return MOE_EUNAVAIL;
    /* the communicator's GPU is current while NCCL enqueues (the caller's
     * own is given back) */
    int prev = -1;
    (void)F->cudaGetDevice(&prev);
    if (prev != l->device)
        (void)F->cudaSetDevice(l->device);
    ncclResult_t r = send ? F->ncclSend(p, n, ncclUint8, 1, (ncclComm_t)l->comm, l->stream)
                          : F->ncclRecv(p, n, ncclUint8, 1, (ncclComm_t)l->comm, l->stream);
    if (prev >= 0 && prev != l->device)
        (void)F->cudaSetDevice(prev);
    if (r != ncclSuccess && r != ncclInProgress) {
        snprintf(msg, msglen, "%s: %s (%s)", send ? "ncclSend" : "ncclRecv",
                 F->ncclGetErrorString(r), F->ncclGetLastError((ncclComm_t)l->comm));
        return MOE_EUNAVAIL;
    }
    return MOE_OK; /* ncclInProgress: moe_nccl_wait sees it through */
}

moe_err moe_nccl_wait(moe_nccl_link *l, int stream, int timeout_ms, const int *up,
                      int (*give_up)(void *), void *arg, char *msg, size_t msglen)
{
    const moe_cudl *F = moe_cudl_get(1, msg, msglen);
    if (!F)
        return MOE_EUNAVAIL;
    const int64_t deadline = cn_now_ms() + timeout_ms;
    ncclComm_t comm = l->comm;
    for (int spins = 0;; spins++) {
        ncclResult_t st = ncclSuccess;
        ncclResult_t q = F->ncclCommGetAsyncError(comm, &st);
        ncclResult_t bad = q != ncclSuccess ? q : st;
        if (bad != ncclSuccess && bad != ncclInProgress) {
            snprintf(msg, msglen, "NCCL: %s (%s)", F->ncclGetErrorString(bad),
                     F->ncclGetLastError(comm));
            return MOE_EUNAVAIL;
        }
        if (bad == ncclSuccess) {
            cudaError_t ce = stream ? F->cudaStreamQuery(l->stream) : cudaSuccess;
            if (ce == cudaSuccess)
                return MOE_OK;
            if (ce != cudaErrorNotReady) {
                snprintf(msg, msglen, "CUDA: %s", F->cudaGetErrorString(ce));
                (void)F->cudaGetLastError();
                return MOE_EUNAVAIL;
            }
        }
        if (up && __atomic_load_n(up, __ATOMIC_RELAXED) <= 0) {
            snprintf(msg, msglen, "the worker's connection is down");
            return MOE_EUNAVAIL;
        }
        if (give_up && give_up(arg)) {
            snprintf(msg, msglen, "the worker answered before the transfer ended");
            return MOE_ECLOSED;
        }
        if (cn_now_ms() > deadline) {
            snprintf(msg, msglen, "the NCCL transfer did not end within %d ms", timeout_ms);
            return MOE_ETIMEDOUT;
        }
        if (spins < 2000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
}

void *moe_nccl_dev_alloc(int device, size_t n)
{
    const moe_cudl *F = moe_cudl_get(1, NULL, 0);
    if (!F)
        return NULL;
    int prev = -1;
    void *p = NULL;
    (void)F->cudaGetDevice(&prev);
    if (F->cudaSetDevice(device) != cudaSuccess || F->cudaMalloc(&p, n ? n : 1) != cudaSuccess) {
        (void)F->cudaGetLastError();
        p = NULL;
    }
    if (prev >= 0)
        F->cudaSetDevice(prev);
    return p;
}

moe_err moe_nccl_copy(void *dst, const void *src, size_t n)
{
    const moe_cudl *F = moe_cudl_get(1, NULL, 0);
    if (!F)
        return MOE_EINTERNAL;
    if (n && F->cudaMemcpy(dst, src, n, cudaMemcpyDefault) != cudaSuccess) {
        (void)F->cudaGetLastError();
        return MOE_EINTERNAL;
    }
    return MOE_OK;
}

void moe_nccl_dev_free(void *p)
{
    const moe_cudl *F = moe_cudl_get(1, NULL, 0);
    if (!F)
        return;
    if (p)
        F->cudaFree(p);
}

void moe_nccl_abort(moe_nccl_link *l)
{
    nccl_trace_print(&l->trace, l->device);
    const moe_cudl *F = l->comm || l->stream ? moe_cudl_get(1, NULL, 0) : NULL;
    if (F && l->comm)
        F->ncclCommAbort((ncclComm_t)l->comm);
    if (F && l->stream)
        F->cudaStreamDestroy((cudaStream_t)l->stream);
    l->comm = NULL;
    l->stream = NULL;
    l->open = 0;
    l->comm_id = 0;
}

#else /* built without CUDA */

int moe_nccl_built(void)
{
    return 0;
}

int moe_nccl_version(void)
{
    return 0;
}

int moe_nccl_device_of(const void *p)
{
    (void)p;
    return -1;
}

moe_err moe_nccl_begin(moe_nccl_link *l, int device, uint8_t *id, char *msg, size_t msglen)
{
    (void)l, (void)device, (void)id;
    snprintf(msg, msglen, "libmoe was built without CUDA: no NCCL path");
    return MOE_EUNAVAIL;
}

moe_err moe_nccl_post(moe_nccl_link *l, int send, void *p, size_t n, char *msg, size_t msglen)
{
    (void)l, (void)send, (void)p, (void)n;
    snprintf(msg, msglen, "libmoe was built without CUDA: no NCCL path");
    return MOE_EUNAVAIL;
}

moe_err moe_nccl_wait(moe_nccl_link *l, int stream, int timeout_ms, const int *up,
                      int (*give_up)(void *), void *arg, char *msg, size_t msglen)
{
    (void)l, (void)stream, (void)timeout_ms, (void)up, (void)give_up, (void)arg;
    snprintf(msg, msglen, "libmoe was built without CUDA: no NCCL path");
    return MOE_EUNAVAIL;
}

void *moe_nccl_dev_alloc(int device, size_t n)
{
    (void)device, (void)n;
    return NULL;
}

moe_err moe_nccl_copy(void *dst, const void *src, size_t n)
{
    (void)dst, (void)src, (void)n;
    return MOE_EINTERNAL;
}

void moe_nccl_dev_free(void *p)
{
    (void)p;
}

void moe_nccl_abort(moe_nccl_link *l)
{
    nccl_trace_print(&l->trace, l->device);
    l->open = 0;
    l->comm = NULL;
    l->stream = NULL;
}

#endif

int moe_nccl_stage_device(void)
{
    const char *s = getenv("MOE_NCCL_DEVICE");
    return s && *s ? atoi(s) : 0;
}

void moe_nccl_link_fini(moe_nccl_link *l)
{
    moe_nccl_abort(l);
    pthread_mutex_destroy(&l->mu);
}
