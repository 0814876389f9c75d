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
}

#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

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

int moe_nccl_device_of(const void *p)
{
    struct cudaPointerAttributes a;
    if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

moe_err moe_nccl_begin(moe_nccl_link *l, int device, uint8_t *id, char *msg, size_t msglen)
{
    ncclUniqueId uid;
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) {
        snprintf(msg, msglen, "ncclGetUniqueId: %s", ncclGetErrorString(r));
        return MOE_EUNAVAIL;
    }
    memcpy(id, &uid, sizeof(uid));
    int prev = -1;
    (void)cudaGetDevice(&prev);
    cudaStream_t s = NULL;
    cudaError_t ce = cudaSetDevice(device);
    if (ce == cudaSuccess)
        ce = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(msg, msglen, "GPU %d: %s", device, cudaGetErrorString(ce));
        if (prev >= 0)
            cudaSetDevice(prev);
        return MOE_EINVAL;
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* returns at once; moe_nccl_wait polls */
    ncclComm_t comm = NULL;
    r = ncclCommInitRankConfig(&comm, 2, uid, 0, &cfg);
    if (prev >= 0)
        cudaSetDevice(prev); /* the caller's current device is its own */
    if ((r != ncclSuccess && r != ncclInProgress) || !comm) {
        if (comm)
            ncclCommAbort(comm);
        cudaStreamDestroy(s);
        snprintf(msg, msglen, "ncclCommInitRankConfig: %s", ncclGetErrorString(r));
        return MOE_EUNAVAIL;
    }
    l->comm = comm;
    l->stream = s;
    l->device = device;
    return MOE_OK;
}

moe_err moe_nccl_post(moe_nccl_link *l, int send, void *p, size_t n, char *msg, size_t msglen)
{
    /* the communicator's GPU is current while NCCL enqueues (the caller's
     * own is given back) */
    int prev = -1;
    (void)cudaGetDevice(&prev);
    if (prev != l->device)
        (void)cudaSetDevice(l->device);
    ncclResult_t r = send ? ncclSend(p, n, ncclUint8, 1, (ncclComm_t)l->comm, l->stream)
                          : ncclRecv(p, n, ncclUint8, 1, (ncclComm_t)l->comm, l->stream);
    if (prev >= 0 && prev != l->device)
        (void)cudaSetDevice(prev);
    if (r != ncclSuccess && r != ncclInProgress) {
        snprintf(msg, msglen, "%s: %s (%s)", send ? "ncclSend" : "ncclRecv", ncclGetErrorString(r),
                 ncclGetLastError((ncclComm_t)l->comm));
        return MOE_EUNAVAIL;
    }
    return MOE_OK; /* ncclInProgress: moe_nccl_wait sees it through */
}

moe_err moe_nccl_wait(moe_nccl_link *l, int stream, int timeout_ms, const int *up,
                      int (*give_up)(void *), void *arg, char *msg, size_t msglen)
{
    const int64_t deadline = cn_now_ms() + timeout_ms;
    ncclComm_t comm = l->comm;
    for (int spins = 0;; spins++) {
        ncclResult_t st = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(comm, &st);
        ncclResult_t bad = q != ncclSuccess ? q : st;
        if (bad != ncclSuccess && bad != ncclInProgress) {
            snprintf(msg, msglen, "NCCL: %s (%s)", ncclGetErrorString(bad), ncclGetLastError(comm));
            return MOE_EUNAVAIL;
        }
        if (bad == ncclSuccess) {
            cudaError_t ce = stream ? cudaStreamQuery(l->stream) : cudaSuccess;
            if (ce == cudaSuccess)
                return MOE_OK;
            if (ce != cudaErrorNotReady) {
                snprintf(msg, msglen, "CUDA: %s", cudaGetErrorString(ce));
                (void)cudaGetLastError();
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
    int prev = -1;
    void *p = NULL;
    (void)cudaGetDevice(&prev);
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&p, n ? n : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        p = NULL;
    }
    if (prev >= 0)
        cudaSetDevice(prev);
    return p;
}

moe_err moe_nccl_copy(void *dst, const void *src, size_t n)
{
    if (n && cudaMemcpy(dst, src, n, cudaMemcpyDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        return MOE_EINTERNAL;
    }
    return MOE_OK;
}

void moe_nccl_dev_free(void *p)
{
    if (p)
        cudaFree(p);
}

void moe_nccl_abort(moe_nccl_link *l)
{
    if (l->comm)
        ncclCommAbort((ncclComm_t)l->comm);
    if (l->stream)
        cudaStreamDestroy((cudaStream_t)l->stream);
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
