/*
 * xchg_nccl.c - the NCCL backend of the exchange layer (GPU workers, device
 * buffers). See xchg.h for the interface. Compiled only with MOE_HAVE_CUDA;
 * plain C against the CUDA runtime and NCCL (2.28.3 on the GPU machines:
 * nothing newer is called).
 *
 * The communicator is non-blocking (config.blocking = 0): NCCL calls may
 * return ncclInProgress and are then polled with ncclCommGetAsyncError, and
 * every collective waits for its stream by polling cudaStreamQuery, both
 * under the communicator's timeout. On an error or a timeout the
 * communicator is marked failed, and aborted (ncclCommAbort: also stops
 * kernels stuck on a dead peer) by xchg_nccl_settle once the failed call
 * has been answered, or at close.
 *
 * alltoallv: the byte counts go first (an ncclAllGather of each rank's W
 * counts, W*W u64 in all, read back to the host to size the receive
 * buffer), then one group of ncclSend/ncclRecv moves the data from the
 * caller's device buffer straight into a device buffer allocated with
 * cudaMallocAsync on the backend's stream; the rank's own part is a
 * device-to-device copy. No host staging for device buffers.
 */
#ifdef MOE_HAVE_CUDA

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "common/log.h"
#include "kernels/cuda/kcu_abort.h"
#include "worker/pool.h"
#include "worker/xchg.h"

_Static_assert(sizeof(ncclUniqueId) == XCHG_NCCL_ID_BYTES, "ncclUniqueId size");

typedef struct nc {
    xchg pub;        /* must be first */
    ncclComm_t comm; /* NULL once aborted */
    cudaStream_t stream;
    int device;
    int timeout_ms;
    uint64_t *cnt_d; /* (W + W*W) device: our counts, then everyone's */
    uint64_t *cnt_h; /* (W + W*W) pinned host mirror */
    void *scratch;   /* device staging for host buffers */
    size_t scratch_cap;
} nc;

static int64_t nc_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* nc_pause: spin (yield) about the first millisecond, then sleep 50 us. */
static void nc_pause(int *spins)
{
    if ((*spins)++ < 2000) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
}

/* nc_fail marks the communicator failed: nothing is enqueued on it again.
 * The ncclCommAbort itself is owed (nc_settle): it takes hundreds of
 * milliseconds, and the failed call's caller answers its client first. */
static void nc_fail(nc *x, const char *what)
{
    if (!x->pub.failed)
        LOG_W("xchg: rank %d: NCCL communicator failed after %s; it must be rebuilt", x->pub.rank,
              what);
    x->pub.failed = 1;
}

/* nc_settle runs the abort nc_fail left owed: kernels stuck on a dead peer
 * stop, NCCL's resources go. */
static void nc_settle(nc *x)
{
    if (!x->pub.failed || !x->comm)
        return;
    const int64_t t0 = nc_now_ms();
    kcu_comm_abort(x->comm);
    x->comm = NULL;
    LOG_I("xchg: rank %d: ncclCommAbort took %lld ms", x->pub.rank, (long long)(nc_now_ms() - t0));
}

static moe_err nc_cuda(nc *x, cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return MOE_OK;
    LOG_W("xchg: rank %d: %s: %s (%s)", x->pub.rank, what, cudaGetErrorString(e),
          cudaGetErrorName(e));
    return e == cudaErrorMemoryAllocation ? MOE_ENOMEM : MOE_EUNAVAIL;
}

/* nc_nccl checks the result r of an NCCL call on x->comm, waiting while the
 * non-blocking communicator reports ncclInProgress (until deadline). */
static moe_err nc_nccl(nc *x, ncclResult_t r, const char *what, int64_t deadline)
{
    int spins = 0;
    while (r == ncclInProgress) {
        if (xchg_aborted()) {
            LOG_W("xchg: rank %d: %s: generation given up (a member is gone)", x->pub.rank, what);
            return MOE_EUNAVAIL;
        }
        if (nc_now_ms() > deadline) {
            LOG_W("xchg: rank %d: %s: still in progress after %d ms", x->pub.rank, what,
                  x->timeout_ms);
            return MOE_EUNAVAIL;
        }
        nc_pause(&spins);
        ncclResult_t st;
        ncclResult_t q = ncclCommGetAsyncError(x->comm, &st);
        r = q != ncclSuccess ? q : st;
    }
    if (r != ncclSuccess) {
        LOG_W("xchg: rank %d: %s: %s (%s)", x->pub.rank, what, ncclGetErrorString(r),
              ncclGetLastError(x->comm));
        return MOE_EUNAVAIL;
    }
    return MOE_OK;
}

/* nc_sync waits for the stream, watching NCCL's async error and the
 * deadline: a peer that died or hangs leaves our kernels spinning. */
static moe_err nc_sync(nc *x, const char *what, int64_t deadline)
{
    int spins = 0;
    for (;;) {
        cudaError_t e = cudaStreamQuery(x->stream);
        ncclResult_t st = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(x->comm, &st);
        if (q != ncclSuccess || (st != ncclSuccess && st != ncclInProgress)) {
            ncclResult_t bad = q != ncclSuccess ? q : st;
            LOG_W("xchg: rank %d: %s: %s (%s)", x->pub.rank, what, ncclGetErrorString(bad),
                  ncclGetLastError(x->comm));
            return MOE_EUNAVAIL;
        }
        if (e == cudaSuccess)
            return MOE_OK;
        if (e != cudaErrorNotReady)
            return nc_cuda(x, e, what);
        if (xchg_aborted()) {
            LOG_W("xchg: rank %d: %s: generation given up (a member is gone)", x->pub.rank, what);
            return MOE_EUNAVAIL;
        }
        if (nc_now_ms() > deadline) {
            LOG_W("xchg: rank %d: %s timed out after %d ms (a peer is gone or hangs)", x->pub.rank,
                  what, x->timeout_ms);
            return MOE_EUNAVAIL;
        }
        nc_pause(&spins);
    }
}

/* nc_to_host copies n bytes of device memory src to dst, which may be
 * pageable host memory. Called only once nc_sync saw the stream idle: a copy
 * to pageable memory blocks the calling thread until the stream reaches it,
 * so enqueued behind a collective that a dead peer never completes it would
 * block the compute thread for good, out of reach of the abort (a survivor
 * of a kill inside optimizer.step did exactly that). Then the copy can wait
 * only on itself; it is still waited for through nc_sync. */
static moe_err nc_to_host(nc *x, void *dst, const void *src, size_t n, const char *what,
                          int64_t deadline)
{
    moe_err err = nc_cuda(x, cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, x->stream), what);
    return err == MOE_OK ? nc_sync(x, what, deadline) : err;
}

/* nc_is_host: 1 if p is host memory (pageable or pinned): it needs staging. */
static int nc_is_host(const void *p)
{
    struct cudaPointerAttributes a;
    if (!p)
        return 0;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* older runtimes flag unregistered memory as an error */
        return 1;
    }
    return a.type == cudaMemoryTypeUnregistered || a.type == cudaMemoryTypeHost;
}

static moe_err nc_scratch(nc *x, size_t bytes, void **out)
{
    if (bytes > x->scratch_cap) {
        if (x->scratch)
            cudaFreeAsync(x->scratch, x->stream);
        x->scratch = NULL;
        x->scratch_cap = 0;
        moe_err err = nc_cuda(x, cudaMallocAsync(&x->scratch, bytes, x->stream), "cudaMallocAsync");
        if (err != MOE_OK)
            return err;
        x->scratch_cap = bytes;
    }
    *out = x->scratch;
    return MOE_OK;
}

/* nc_begin: fail fast when failed; make the device current; set deadline. */
static moe_err nc_begin(nc *x, int64_t *deadline)
{
    if (x->pub.failed || !x->comm) {
        LOG_D("xchg: rank %d: communicator failed earlier", x->pub.rank);
        return MOE_EUNAVAIL;
    }
    *deadline = nc_now_ms() + x->timeout_ms;
    return nc_cuda(x, cudaSetDevice(x->device), "cudaSetDevice");
}

/* nc_end: any error once a collective started breaks the ranks' common
 * sequence: abort. */
static moe_err nc_end(nc *x, moe_err err, const char *what)
{
    if (err != MOE_OK)
        nc_fail(x, what);
    return err;
}

/* -------------------------------------------------------------- collectives */

static moe_err nc_alltoallv(xchg *xp, const void *sendbuf, const size_t *send_bytes, void **recvbuf,
                            size_t *recv_bytes)
{
    nc *x = (nc *)xp;
    int r = xp->rank, W = xp->world;
    int64_t deadline;
    moe_err err;
    if (recvbuf)
        *recvbuf = NULL;
    if (!send_bytes || !recvbuf || !recv_bytes)
        return MOE_EINVAL;
    size_t send_total = 0;
    for (int q = 0; q < W; q++)
        send_total += send_bytes[q];
    if (send_total && !sendbuf)
        return MOE_EINVAL;
    if ((err = nc_begin(x, &deadline)) != MOE_OK)
        return err;

    int host = nc_is_host(sendbuf);
    const uint8_t *src = sendbuf;
    uint8_t *dst = NULL; /* (recv_total) device, host memory once dst_host */
    int dst_host = 0;
    if (host && send_total) {
        void *s;
        if ((err = nc_scratch(x, send_total, &s)) != MOE_OK)
            return nc_end(x, err, "alltoallv staging");
        err = nc_cuda(x, cudaMemcpyAsync(s, sendbuf, send_total, cudaMemcpyHostToDevice, x->stream),
                      "alltoallv: copy to device");
        if (err != MOE_OK)
            return nc_end(x, err, "alltoallv staging");
        src = s;
    }

    /* counts: cnt_h[0..W) ours, then cnt_h[W + q*W + p] = bytes q sends p */
    for (int q = 0; q < W; q++)
        x->cnt_h[q] = send_bytes[q];
    err = nc_cuda(x,
                  cudaMemcpyAsync(x->cnt_d, x->cnt_h, (size_t)W * sizeof(uint64_t),
                                  cudaMemcpyHostToDevice, x->stream),
                  "alltoallv: counts to device");
    if (err == MOE_OK)
        err = nc_nccl(
            x, ncclAllGather(x->cnt_d, x->cnt_d + W, (size_t)W, ncclUint64, x->comm, x->stream),
            "alltoallv: ncclAllGather(counts)", deadline);
    if (err == MOE_OK)
        err = nc_cuda(x,
                      cudaMemcpyAsync(x->cnt_h + W, x->cnt_d + W,
                                      (size_t)W * (size_t)W * sizeof(uint64_t),
                                      cudaMemcpyDeviceToHost, x->stream),
                      "alltoallv: counts to host");
    if (err == MOE_OK)
        err = nc_sync(x, "alltoallv (counts)", deadline);
    if (err != MOE_OK)
        return nc_end(x, err, "alltoallv (counts)");

    size_t recv_total = 0;
    for (int q = 0; q < W; q++) {
        recv_bytes[q] = (size_t)x->cnt_h[W + (size_t)q * W + r];
        recv_total += recv_bytes[q];
    }
    if (recv_total) {
        err = nc_cuda(x, cudaMallocAsync((void **)&dst, recv_total, x->stream),
                      "alltoallv: cudaMallocAsync(recv)");
        if (err != MOE_OK)
            return nc_end(x, err, "alltoallv allocation");
    }

    size_t soff = 0, roff = 0, self_soff = 0, self_roff = 0;
    ncclResult_t first = ncclGroupStart();
    for (int q = 0; q < W; q++) {
        ncclResult_t rr = ncclSuccess;
        if (q == r) {
            self_soff = soff;
            self_roff = roff;
        } else {
            if (send_bytes[q])
                rr = ncclSend(src + soff, send_bytes[q], ncclUint8, q, x->comm, x->stream);
            if (rr == ncclSuccess && recv_bytes[q])
                rr = ncclRecv(dst + roff, recv_bytes[q], ncclUint8, q, x->comm, x->stream);
        }
        if (first == ncclSuccess && rr != ncclSuccess && rr != ncclInProgress)
            first = rr;
        soff += send_bytes[q];
        roff += recv_bytes[q];
    }
    ncclResult_t end = ncclGroupEnd();
    err = nc_nccl(x, first != ncclSuccess ? first : end, "alltoallv: ncclSend/ncclRecv group",
                  deadline);
    if (err == MOE_OK && send_bytes[r])
        err = nc_cuda(x,
                      cudaMemcpyAsync(dst + self_roff, src + self_soff, send_bytes[r],
                                      cudaMemcpyDeviceToDevice, x->stream),
                      "alltoallv: own part");
    if (err == MOE_OK)
        err = nc_sync(x, "alltoallv", deadline);
    if (err == MOE_OK && host && recv_total) { /* host caller: hand back host memory */
        uint8_t *h = wpool_alloc(recv_total);
        err = h ? MOE_OK : MOE_ENOMEM;
        if (err == MOE_OK)
            err = nc_to_host(x, h, dst, recv_total, "alltoallv: copy to host", deadline);
        cudaFreeAsync(dst, x->stream);
        dst = h;
        dst_host = 1;
    }
    if (err != MOE_OK) {
        if (dst_host)
            wpool_free(dst);
        else if (dst)
            cudaFreeAsync(dst, x->stream);
        return nc_end(x, err, "alltoallv");
    }
    *recvbuf = dst;
    return MOE_OK;
}

/* allreduce: ncclAllReduce(sum). Determinism: for a fixed world size,
 * topology, NCCL version and environment, NCCL picks the same algorithm
 * and protocol for a given size and reduces in a fixed order (the ring's
 * order for NCCL_ALGO=Ring), and every rank receives the same reduced
 * chunks, so all ranks get identical bits and reruns repeat them. The order
 * is not rank order: the bits can differ from the nng backend's. */
static moe_err nc_allreduce_f32(xchg *xp, float *buf, size_t n)
{
    nc *x = (nc *)xp;
    int64_t deadline;
    moe_err err;
    if (n && !buf)
        return MOE_EINVAL;
    if ((err = nc_begin(x, &deadline)) != MOE_OK || n == 0)
        return err;
    size_t bytes = n * sizeof(float);
    int host = nc_is_host(buf);
    void *p = buf;
    if (host) {
        if ((err = nc_scratch(x, bytes, &p)) != MOE_OK)
            return nc_end(x, err, "allreduce staging");
        err = nc_cuda(x, cudaMemcpyAsync(p, buf, bytes, cudaMemcpyHostToDevice, x->stream),
                      "allreduce: copy to device");
    }
    if (err == MOE_OK)
        err = nc_nccl(x, ncclAllReduce(p, p, n, ncclFloat32, ncclSum, x->comm, x->stream),
                      "ncclAllReduce", deadline);
    if (err == MOE_OK)
        err = nc_sync(x, "allreduce", deadline);
    if (err == MOE_OK && host)
        err = nc_to_host(x, buf, p, bytes, "allreduce: copy to host", deadline);
    return nc_end(x, err, "allreduce");
}

static moe_err nc_allgather(xchg *xp, const void *sendbuf, size_t nbytes, void *recvbuf)
{
    nc *x = (nc *)xp;
    int r = xp->rank, W = xp->world;
    int64_t deadline;
    moe_err err;
    if (nbytes && (!sendbuf || !recvbuf))
        return MOE_EINVAL;
    if ((err = nc_begin(x, &deadline)) != MOE_OK || nbytes == 0)
        return err;
    size_t total = nbytes * (size_t)W;
    int host = nc_is_host(sendbuf) || nc_is_host(recvbuf);
    const void *s = sendbuf;
    void *d = recvbuf;
    if (host) {
        if ((err = nc_scratch(x, total, &d)) != MOE_OK)
            return nc_end(x, err, "allgather staging");
        s = (uint8_t *)d + (size_t)r * nbytes; /* in place */
        err = nc_cuda(x, cudaMemcpyAsync((void *)s, sendbuf, nbytes, cudaMemcpyDefault, x->stream),
                      "allgather: copy to device");
    }
    if (err == MOE_OK)
        err = nc_nccl(x, ncclAllGather(s, d, nbytes, ncclUint8, x->comm, x->stream),
                      "ncclAllGather", deadline);
    if (err == MOE_OK)
        err = nc_sync(x, "allgather", deadline);
    if (err == MOE_OK && host)
        err = nc_to_host(x, recvbuf, d, total, "allgather: copy out", deadline);
    return nc_end(x, err, "allgather");
}

static void nc_free_buf(xchg *xp, void *buf)
{
    nc *x = (nc *)xp;
    if (!buf)
        return;
    if (nc_is_host(buf)) {
        wpool_free(buf);
        return;
    }
    cudaSetDevice(x->device);
    cudaFreeAsync(buf, x->stream);
}

/* ---------------------------------------------------------- open and close */

static void nc_destroy(nc *x)
{
    nc_settle(x);
    if (x->comm) { /* not failed: finalize (flush), then destroy */
        int64_t deadline = nc_now_ms() + x->timeout_ms;
        if (nc_nccl(x, ncclCommFinalize(x->comm), "ncclCommFinalize", deadline) == MOE_OK)
            ncclCommDestroy(x->comm);
        else
            kcu_comm_abort(x->comm);
        x->comm = NULL;
    }
    if (x->stream)
        cudaStreamSynchronize(x->stream);
    if (x->scratch)
        cudaFree(x->scratch);
    if (x->cnt_d)
        cudaFree(x->cnt_d);
    if (x->cnt_h)
        cudaFreeHost(x->cnt_h);
    if (x->stream)
        cudaStreamDestroy(x->stream);
    free(x);
}

static void nc_close(xchg *xp)
{
    nc *x = (nc *)xp;
    cudaSetDevice(x->device);
    LOG_D("xchg: rank %d: closing NCCL communicator", xp->rank);
    nc_destroy(x);
}

static const xchg_ops nc_ops = {
    .alltoallv = nc_alltoallv,
    .allreduce_f32 = nc_allreduce_f32,
    .allgather = nc_allgather,
    .free_buf = nc_free_buf,
    .close = nc_close,
};

moe_err xchg_nccl_get_unique_id(void *out)
{
    ncclUniqueId id;
    if (!out)
        return MOE_EINVAL;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
        LOG_E("xchg_nccl_get_unique_id: ncclGetUniqueId: %s (%s)", ncclGetErrorString(r),
              ncclGetLastError(NULL));
        return MOE_EUNAVAIL;
    }
    memcpy(out, &id, sizeof(id));
    return MOE_OK;
}

moe_err xchg_nccl_open(int rank, int world, const void *unique_id, int device, int timeout_ms,
                       xchg **out)
{
    if (out)
        *out = NULL;
    if (!out || !unique_id || world < 1 || rank < 0 || rank >= world || device < 0 ||
        timeout_ms <= 0) {
        LOG_E("xchg_nccl_open: invalid argument (rank %d world %d device %d timeout %d ms)", rank,
              world, device, timeout_ms);
        return MOE_EINVAL;
    }
    const int64_t t_open = nc_now_ms();
    nc *x = calloc(1, sizeof(*x));
    if (!x)
        return MOE_ENOMEM;
    x->pub.ops = &nc_ops;
    x->pub.rank = rank;
    x->pub.world = world;
    x->device = device;
    x->timeout_ms = timeout_ms;
    int64_t deadline = nc_now_ms() + timeout_ms;
    size_t ncnt = (size_t)world + (size_t)world * (size_t)world;
    moe_err err = nc_cuda(x, cudaSetDevice(device), "cudaSetDevice");
    if (err == MOE_OK)
        err = nc_cuda(x, cudaStreamCreateWithFlags(&x->stream, cudaStreamNonBlocking),
                      "cudaStreamCreate");
    if (err == MOE_OK)
        err = nc_cuda(x, cudaMalloc((void **)&x->cnt_d, ncnt * sizeof(uint64_t)), "cudaMalloc");
    if (err == MOE_OK)
        err = nc_cuda(x, cudaMallocHost((void **)&x->cnt_h, ncnt * sizeof(uint64_t)),
                      "cudaMallocHost");
    if (err != MOE_OK)
        goto fail;

    ncclUniqueId id;
    memcpy(&id, unique_id, sizeof(id));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&x->comm, world, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        LOG_E("xchg_nccl_open: rank %d of %d: ncclCommInitRankConfig: %s (%s)", rank, world,
              ncclGetErrorString(r), ncclGetLastError(x->comm));
        err = MOE_EUNAVAIL;
        goto fail;
    }
    if ((err = nc_nccl(x, r, "ncclCommInitRankConfig", deadline)) != MOE_OK) {
        LOG_E("xchg_nccl_open: rank %d of %d on device %d: communicator not formed within %d ms",
              rank, world, device, timeout_ms);
        err = MOE_EUNAVAIL;
        goto fail;
    }
    int ver = 0; /* the library this process runs, not the headers it was built with */
    (void)ncclGetVersion(&ver);
    LOG_I("xchg: rank %d of %d up in %lld ms (NCCL %d, device %d, timeout %d ms)", rank, world,
          (long long)(nc_now_ms() - t_open), ver, device, timeout_ms);
    *out = &x->pub;
    return MOE_OK;
fail:
    if (x->comm) {
        kcu_comm_abort(x->comm);
        x->comm = NULL;
    }
    nc_destroy(x);
    return err;
}

void *xchg_nccl_stream(xchg *xp)
{
    return xp && xp->ops == &nc_ops ? (void *)((nc *)xp)->stream : NULL;
}

void xchg_nccl_abort_comm(xchg *xp, const char *why)
{
    if (xp && xp->ops == &nc_ops)
        nc_fail((nc *)xp, why);
}

void xchg_nccl_settle(xchg *xp)
{
    if (xp && xp->ops == &nc_ops)
        nc_settle((nc *)xp);
}

void *xchg_nccl_comm(xchg *xp)
{
    return xp && xp->ops == &nc_ops && !xp->failed ? (void *)((nc *)xp)->comm : NULL;
}

#endif /* MOE_HAVE_CUDA */
