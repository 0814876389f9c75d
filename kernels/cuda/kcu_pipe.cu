/*
 * kcu_pipe.cu - kcu_forward_pipelined (kern_cuda.h): an inference forward
 * of host-resident x and y in chunks, the host-device copies overlapped
 * with the compute.
 *
 * Three streams of the layer (pp_st): copy-in (0), compute (1), copy-out
 * (2); two device slots s = i % 2, each an x chunk (chunk,H) and a y chunk
 * (chunk,H) in the call's dtypes. Chunk i:
 *   in:   [i >= 2: wait computed[s]]  x rows -> slot x   record in[s]
 *   comp: wait in[s]; [i >= 2: wait out[s]]  forward -> slot y,
 *         accumulate statistics          record computed[s]
 *   out:  wait computed[s]  slot y -> y rows             record out[s]
 * (cudaStreamWaitEvent waits for the event's most recent record when the
 * wait is enqueued: the record of chunk i-2 for the slot's reuse, the one
 * just made for chunk i's copy-out). So chunk i+1's copy-in runs beside
 * chunk i's compute, chunk i's copy-out beside chunk i+1's compute.
 *
 * Statistics: after each chunk's forward (its probs (Tc,E), lse (Tc) and
 * counts (Et) in the selected state) k_pipe_acc adds the per-expert sums of
 * the probabilities and the sum of lse^2 into pp_acc (double) and the counts
 * into pp_cnt, on the compute stream (no host synchronisation); at the end
 * k_pipe_final writes counts, dropped (0) and stats (aux, z: k_stats_final's
 * formula over the whole batch) where kcu_forward_stats reads them.
 */
#include <string.h>

#include "kernels/cuda/kcu_internal.cuh"

namespace
{

enum { PP_IN = 0, PP_COMP = 1, PP_OUT = 2 };
/* pp_ev: in[s] = s, computed[s] = 2 + s, out[s] = 4 + s, start = 6 */
enum { EV_IN = 0, EV_COMP = 2, EV_OUT = 4, EV_START = 6, PP_NEV = 7 };
constexpr int ACC_THREADS = 256;

/* One block per column e <= E: acc[e] += sum_t probs[t,e] (e < E) or
 * sum_t lse[t]^2 (e = E), over the chunk's T tokens, in a fixed order
 * (thread strides, then a tree): deterministic. Block E also adds the
 * chunk's counts (Et) into cnt. */
__global__ void k_pipe_acc(const float *__restrict__ probs, const float *__restrict__ lse, int T,
                           int E, const int32_t *__restrict__ counts, int Et,
                           double *__restrict__ acc, int32_t *__restrict__ cnt)
{
    __shared__ double red[ACC_THREADS];
    const int e = blockIdx.x;
    double s = 0.0;
    for (int t = threadIdx.x; t < T; t += ACC_THREADS) {
        const float v = e < E ? probs[(size_t)t * E + e] : lse[t] * lse[t];
        s += (double)v;
    }
    red[threadIdx.x] = s;
    __syncthreads();
    for (int w = ACC_THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w)
            red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        acc[e] += red[0];
    if (e == E)
        for (int i = threadIdx.x; i < Et; i += ACC_THREADS)
            cnt[i] += counts[i];
}

/* One block: counts (Et) = cnt, dropped (Et) = 0, stats[0] = aux = E/(K T)
 * sum_e counts_e (acc_e / T), stats[1] = z = acc_E / T (k_stats_final's
 * formula in float, the column sums rounded from double) */
__global__ void k_pipe_final(const double *__restrict__ acc, const int32_t *__restrict__ cnt, int T,
                             int E, int Et, int K, int32_t *__restrict__ counts,
                             int32_t *__restrict__ dropped, float *__restrict__ stats)
{
    for (int i = threadIdx.x; i < Et; i += blockDim.x) {
        counts[i] = cnt[i];
        dropped[i] = 0;
    }
    if (threadIdx.x == 0) {
        float aux = 0.f;
        for (int e = 0; e < E; e++)
            aux += (float)cnt[e] * ((float)acc[e] / (float)T);
        stats[0] = aux * (float)E / ((float)K * (float)T);
        stats[1] = (float)acc[E] / (float)T;
    }
}

size_t round256(size_t b)
{
    return (b + 255) & ~(size_t)255;
}

/* the streams and events, once per layer */
moe_err pipe_init(kcu_layer *l)
{
    if (l->pp_ready)
        return MOE_OK;
    for (int i = 0; i < 3; i++)
        if (!l->pp_st[i])
            KCU_CHECK(cudaStreamCreateWithFlags(&l->pp_st[i], cudaStreamNonBlocking));
    for (int i = 0; i < PP_NEV; i++)
        if (!l->pp_ev[i])
            KCU_CHECK(cudaEventCreateWithFlags(&l->pp_ev[i], cudaEventDisableTiming));
    l->pp_ready = 1;
    return MOE_OK;
}

/* pp_buf of at least `need` bytes (no work of the pipeline is in flight
 * between calls: each call synchronises its streams before returning) */
moe_err pipe_buffers(kcu_layer *l, size_t need)
{
    if (l->pp_buf && l->pp_bytes >= need)
        return MOE_OK;
    if (l->pp_buf) {
        cudaFree(l->pp_buf);
        l->pp_buf = nullptr;
        l->pp_bytes = 0;
    }
    if (cudaMalloc(&l->pp_buf, need) != cudaSuccess) {
        (void)cudaGetLastError();
        l->pp_buf = nullptr;
        fprintf(stderr, "kcu_layer: cudaMalloc of %zu bytes (pipelined chunks) failed\n", need);
        return MOE_ENOMEM;
    }
    l->pp_bytes = need;
    return MOE_OK;
}

/* the chunks, enqueued on the three streams; returns at the first error
 * (the caller synchronises the streams in every case) */
moe_err pipe_run(kcu_layer *l, int T, const char *x, size_t xrow, moe_dtype x_dtype, char *y,
                 size_t yrow, moe_dtype y_dtype, int chunk, char *slot[2][2])
{
    const kcu_config *c = &l->c;
    const int E = c->E, Et = kcu_nexp(l);
    cudaStream_t sin = l->pp_st[PP_IN], scomp = l->pp_st[PP_COMP], sout = l->pp_st[PP_OUT];
    cudaEvent_t *ev = l->pp_ev;
    KCU_CHECK(cudaMemsetAsync(l->pp_acc, 0, (size_t)(E + 1) * sizeof(double), scomp));
    KCU_CHECK(cudaMemsetAsync(l->pp_cnt, 0, (size_t)Et * 4, scomp));
    const int n = KCU_CEIL_DIV(T, chunk);
    for (int i = 0; i < n; i++) {
        const int s = i & 1, t0 = i * chunk, Tc = T - t0 < chunk ? T - t0 : chunk;
        char *xd = slot[s][0], *yd = slot[s][1];
        /* copy-in: the slot's x was last read by chunk i-2's compute */
        if (i >= 2)
            KCU_CHECK(cudaStreamWaitEvent(sin, ev[EV_COMP + s], 0));
        KCU_CHECK(
            cudaMemcpyAsync(xd, x + (size_t)t0 * xrow, (size_t)Tc * xrow, cudaMemcpyDefault, sin));
        KCU_CHECK(cudaEventRecord(ev[EV_IN + s], sin));
        /* compute: the slot's y was last read by chunk i-2's copy-out; the
         * path chosen as for all T tokens */
        KCU_CHECK(cudaStreamWaitEvent(scomp, ev[EV_IN + s], 0));
        if (i >= 2)
            KCU_CHECK(cudaStreamWaitEvent(scomp, ev[EV_OUT + s], 0));
        KCU_TRY(kcu_forward_path(l, Tc, xd, x_dtype, yd, y_dtype, 0, scomp, T));
        k_pipe_acc<<<E + 1, ACC_THREADS, 0, scomp>>>(l->probs, l->lse, Tc, E, l->counts, Et,
                                                     l->pp_acc, l->pp_cnt);
        KCU_CHECK_LAUNCH();
        KCU_CHECK(cudaEventRecord(ev[EV_COMP + s], scomp));
        /* copy-out */
        KCU_CHECK(cudaStreamWaitEvent(sout, ev[EV_COMP + s], 0));
        KCU_CHECK(
            cudaMemcpyAsync(y + (size_t)t0 * yrow, yd, (size_t)Tc * yrow, cudaMemcpyDefault, sout));
        KCU_CHECK(cudaEventRecord(ev[EV_OUT + s], sout));
    }
    /* the whole batch's statistics where kcu_forward_stats reads them */
    k_pipe_final<<<1, 256, 0, scomp>>>(l->pp_acc, l->pp_cnt, T, E, Et, c->K, l->counts, l->dropped,
                                       l->stats);
    l->stats_in_host = 0; /* the chunks' decode kernels never wrote the whole batch's */
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

} // namespace

void kcu_pipe_release(kcu_layer *l)
{
    if (l->pp_buf)
        cudaFree(l->pp_buf);
    for (int i = 0; i < PP_NEV; i++)
        if (l->pp_ev[i])
            cudaEventDestroy(l->pp_ev[i]);
    for (int i = 0; i < 3; i++)
        if (l->pp_st[i])
            cudaStreamDestroy(l->pp_st[i]);
    l->pp_buf = nullptr;
    l->pp_bytes = 0;
    l->pp_acc = nullptr;
    l->pp_cnt = nullptr;
    memset(l->pp_ev, 0, sizeof(l->pp_ev));
    memset(l->pp_st, 0, sizeof(l->pp_st));
    l->pp_ready = 0;
}

extern "C" moe_err kcu_forward_pipelined(kcu_layer *l, int T, const void *x, moe_dtype x_dtype,
                                         void *y, moe_dtype y_dtype, int chunk, void *stream)
{
    const kcu_config *c = &l->c;
    cudaStream_t st = (cudaStream_t)stream;
    if (T < 0 || (x_dtype != MOE_F32 && x_dtype != MOE_BF16) ||
        (y_dtype != MOE_F32 && y_dtype != MOE_BF16))
        return MOE_EINVAL;
    if (chunk > c->T_max)
        chunk = c->T_max;
    if (chunk <= 0 || T <= chunk || c->capacity_factor > 0.0f) {
        /* one call: the capacity of a chunk would not be the batch's */
        KCU_TRY(kcu_forward(l, T, x, x_dtype, y, y_dtype, 0, stream));
        KCU_CHECK(cudaStreamSynchronize(st));
        return MOE_OK;
    }
    KCU_TRY(pipe_init(l));
    const size_t H = c->H, xrow = H * (x_dtype == MOE_F32 ? 4 : 2),
                 yrow = H * (y_dtype == MOE_F32 ? 4 : 2);
    /* pp_buf: acc (E+1 doubles), cnt (Et int32), then slot 0 x, y, slot 1 x, y */
    const size_t b_acc = round256((size_t)(c->E + 1) * sizeof(double));
    const size_t b_cnt = round256((size_t)kcu_nexp(l) * 4);
    const size_t b_x = round256((size_t)chunk * xrow), b_y = round256((size_t)chunk * yrow);
    KCU_TRY(pipe_buffers(l, b_acc + b_cnt + 2 * (b_x + b_y)));
    char *base = (char *)l->pp_buf;
    l->pp_acc = reinterpret_cast<double *>(base);
    l->pp_cnt = reinterpret_cast<int32_t *>(base + b_acc);
    char *slot[2][2];
    for (int s = 0; s < 2; s++) {
        slot[s][0] = base + b_acc + b_cnt + (size_t)s * (b_x + b_y);
        slot[s][1] = slot[s][0] + b_x;
    }
    /* the pipeline starts after the work queued on the caller's stream (an
     * earlier call may still use the layer's workspace) */
    KCU_CHECK(cudaEventRecord(l->pp_ev[EV_START], st));
    for (int i = 0; i < 3; i++)
        KCU_CHECK(cudaStreamWaitEvent(l->pp_st[i], l->pp_ev[EV_START], 0));
    const moe_err rc =
        pipe_run(l, T, (const char *)x, xrow, x_dtype, (char *)y, yrow, y_dtype, chunk, slot);
    /* everything finished (also after an error: no copy may still touch
     * the caller's memory or the slots when we return) */
    cudaError_t ce = cudaSuccess;
    for (int i = 0; i < 3; i++) {
        const cudaError_t e = cudaStreamSynchronize(l->pp_st[i]);
        if (ce == cudaSuccess)
            ce = e;
    }
    if (rc != MOE_OK)
        return rc;
    if (ce != cudaSuccess) {
        fprintf(stderr, "kcu: kcu_forward_pipelined: %s\n", cudaGetErrorString(ce));
        return MOE_EINTERNAL;
    }
    return MOE_OK;
}
