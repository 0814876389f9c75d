/*
 * kcu_route.cu - the small kernels around the expert GEMMs: bf16 staging,
 * softmax + top-k, the device-built layout (counting sort and tile list),
 * the deterministic combine, loss statistics, and the router backward.
 * None of them needs a host round trip.
 */
#include <float.h>
#include <limits.h>

#include "kcu_internal.cuh"

namespace
{

constexpr int CHUNK = 256; /* slots per block in the layout kernels */

/* x (n) f32 -> bf16 (round to nearest even) */
__global__ void k_f32_to_bf16(const float *__restrict__ x, bf16 *__restrict__ y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(x[i]);
}

__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* One warp per token. logits (T,Ep) in; probs (T,E), lse (T), idx (T,K),
 * tw (T,K) out. E <= 256, K <= 8. Ties go to the lower expert index. */
__global__ void k_softmax_topk(const float *__restrict__ logits, int T, int E, int Ep, int K,
                               int renorm, float *__restrict__ probs, float *__restrict__ lse,
                               int32_t *__restrict__ idx, float *__restrict__ tw)
{
    const int lane = threadIdx.x & 31, t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T)
        return;
    const float *lt = logits + (size_t)t * Ep;
    float v[8], mx = -FLT_MAX;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        v[i] = e < E ? lt[e] : -FLT_MAX;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        v[i] = e < E ? expf(v[i] - mx) : 0.f;
        sum += v[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        v[i] = v[i] / sum;
        if (e < E)
            probs[(size_t)t * E + e] = v[i];
    }
    if (lane == 0)
        lse[t] = mx + logf(sum);
    unsigned taken = 0;
    float wk[8], wsum = 0.f;
    int ik[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        wk[j] = 0.f;
        ik[j] = 0;
        if (j < K) {
            float bv = -1.f;
            int bi = INT_MAX;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int e = lane + 32 * i;
                if (e < E && !((taken >> i) & 1u) && (bi == INT_MAX || v[i] > bv)) {
                    bv = v[i];
                    bi = e;
                }
            }
            for (int o = 16; o; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (oi != INT_MAX && (bi == INT_MAX || ov > bv || (ov == bv && oi < bi))) {
                    bv = ov;
                    bi = oi;
                }
            }
            if ((bi & 31) == lane)
                taken |= 1u << (bi >> 5);
            wk[j] = bv;
            ik[j] = bi;
            wsum += bv;
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < K) {
                idx[(size_t)t * K + j] = ik[j];
                tw[(size_t)t * K + j] = renorm ? wk[j] / wsum : wk[j];
            }
    }
}

/* chunk (nch,E) out: slots of expert e in chunk c. idx (S). */
__global__ void k_layout_count(const int32_t *__restrict__ idx, int S, int E,
                               int32_t *__restrict__ chunk)
{
    __shared__ int hist[256];
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        hist[e] = 0;
    __syncthreads();
    const int s = blockIdx.x * CHUNK + threadIdx.x;
    if (s < S)
        atomicAdd(&hist[idx[s]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        chunk[(size_t)blockIdx.x * E + e] = hist[e];
}

/* One block. chunk (nch,E) in: counts, out: absolute base of each chunk's
 * run of expert e in sorted order. counts (E), offs (E+1) out; tile list
 * (tile_e, tile_r0, *ntiles) out: ceil(count_e / BM) tiles per expert. */
__global__ void k_layout_scan(int32_t *__restrict__ chunk, int nch, int E,
                              int32_t *__restrict__ counts, int32_t *__restrict__ offs,
                              int32_t *__restrict__ tile_e, int32_t *__restrict__ tile_r0,
                              int32_t *__restrict__ ntiles)
{
    __shared__ int cnt[257], toff[257];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = 0;
        for (int c = 0; c < nch; c++) {
            const int v = chunk[(size_t)c * E + e];
            chunk[(size_t)c * E + e] = run;
            run += v;
        }
        counts[e] = run;
        cnt[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int o = 0, to = 0;
        for (int e = 0; e < E; e++) {
            offs[e] = o;
            const int c = cnt[e];
            cnt[e] = o;
            toff[e] = to;
            o += c;
            to += KCU_CEIL_DIV(c, KCU_BM);
        }
        offs[E] = o;
        cnt[E] = o;
        toff[E] = to;
        *ntiles = to;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int base = cnt[e];
        for (int c = 0; c < nch; c++)
            chunk[(size_t)c * E + e] += base;
        for (int i = toff[e]; i < toff[e + 1]; i++) {
            tile_e[i] = e;
            tile_r0[i] = base + (i - toff[e]) * KCU_BM;
        }
    }
}

/* Stable scatter: perm (S) sorted row -> slot, tok (S) sorted row -> token. */
__global__ void k_layout_scatter(const int32_t *__restrict__ idx, int S, int E, int K,
                                 const int32_t *__restrict__ chunk, int32_t *__restrict__ perm,
                                 int32_t *__restrict__ tok)
{
    __shared__ int ids[CHUNK];
    const int s = blockIdx.x * CHUNK + threadIdx.x;
    ids[threadIdx.x] = s < S ? idx[s] : -1;
    __syncthreads();
    if (s >= S)
        return;
    const int e = ids[threadIdx.x];
    int rank = 0;
    for (int j = 0; j < (int)threadIdx.x; j++)
        rank += ids[j] == e;
    const int pos = chunk[(size_t)blockIdx.x * E + e] + rank;
    perm[pos] = s;
    tok[pos] = s / K;
}

/* out (T,H) = sum_j in order of [w ? bf16(w[s] ye[s]) : ye[s]] (+ extra (T,H) f32).
 * ye (S,H) bf16 in slot order. One thread per 8 columns. */
__global__ void k_combine(const bf16 *__restrict__ ye, const float *__restrict__ w,
                          const float *__restrict__ extra, int T, int K, int H, void *out,
                          int out_f32)
{
    const int hc = H / 8;
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * hc)
        return;
    const int t = (int)(i / hc), c = (int)(i % hc) * 8;
    float acc[8];
    if (extra) {
        const float4 *ex = reinterpret_cast<const float4 *>(extra + (size_t)t * H + c);
        const float4 a = ex[0], b = ex[1];
        acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w;
        acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++)
            acc[k] = 0.f;
    }
    for (int j = 0; j < K; j++) {
        const size_t s = (size_t)t * K + j;
        const uint4 raw = *reinterpret_cast<const uint4 *>(ye + s * H + c);
        const __nv_bfloat162 *v = reinterpret_cast<const __nv_bfloat162 *>(&raw);
        const float wj = w ? w[s] : 1.f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float2 f = __bfloat1622float2(v[k]);
            if (w) {
                acc[2 * k] += __bfloat162float(__float2bfloat16_rn(wj * f.x));
                acc[2 * k + 1] += __bfloat162float(__float2bfloat16_rn(wj * f.y));
            } else {
                acc[2 * k] += f.x;
                acc[2 * k + 1] += f.y;
            }
        }
    }
    if (out_f32) {
        float4 *o = reinterpret_cast<float4 *>((float *)out + (size_t)t * H + c);
        o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
        uint4 raw;
        __nv_bfloat162 *v = reinterpret_cast<__nv_bfloat162 *>(&raw);
#pragma unroll
        for (int k = 0; k < 4; k++)
            v[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
        *reinterpret_cast<uint4 *>((bf16 *)out + (size_t)t * H + c) = raw;
    }
}

/* part (nblk, E+1): per 256-token block, column sums of probs and sum lse^2. */
__global__ void k_stats_part(const float *__restrict__ probs, const float *__restrict__ lse, int T,
                             int E, float *__restrict__ part)
{
    const int t0 = blockIdx.x * 256, t1 = min(T, t0 + 256);
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        float s = 0.f;
        if (e < E)
            for (int t = t0; t < t1; t++)
                s += probs[(size_t)t * E + e];
        else
            for (int t = t0; t < t1; t++)
                s += lse[t] * lse[t];
        part[(size_t)blockIdx.x * (E + 1) + e] = s;
    }
}

/* One block: stats[0] = aux = E/(K T) sum_e counts_e mean_t p[t,e];
 * stats[1] = z = mean_t lse_t^2. */
__global__ void k_stats_final(const float *__restrict__ part, int nblk, int T, int E, int K,
                              const int32_t *__restrict__ counts, float *__restrict__ stats)
{
    __shared__ float col[257];
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        float s = 0.f;
        for (int b = 0; b < nblk; b++)
            s += part[(size_t)b * (E + 1) + e];
        col[e] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float aux = 0.f;
        for (int e = 0; e < E; e++)
            aux += (float)counts[e] * (col[e] / (float)T);
        stats[0] = aux * (float)E / ((float)K * (float)T);
        stats[1] = col[E] / (float)T;
    }
}

/* dw[perm[r]] = sum_i dwpart[r, i]: fixed order, deterministic. */
__global__ void k_dw_reduce(const float *__restrict__ part, const int32_t *__restrict__ perm, int S,
                            int nt, float *__restrict__ dw)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= S)
        return;
    float s = 0.f;
    for (int i = 0; i < nt; i++)
        s += part[(size_t)r * nt + i];
    dw[perm[r]] = s;
}

/* One warp per token: dlogits (T,Ep) bf16 out (zero beyond E), as
 * kern_router_backward_cpu before its GEMMs. */
__global__ void k_router_bwd(const float *__restrict__ probs, const float *__restrict__ lse,
                             const int32_t *__restrict__ idx, const float *__restrict__ dw, int T,
                             int E, int Ep, int K, int renorm, const int32_t *__restrict__ cglob,
                             float aux_scale, float z_scale, bf16 *__restrict__ dlog)
{
    const int lane = threadIdx.x & 31, t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T)
        return;
    const float *pt = probs + (size_t)t * E;
    const int32_t *it = idx + (size_t)t * K;
    const float *gt = dw + (size_t)t * K;
    float S = 0.f, gw = 0.f;
    if (renorm) {
        for (int j = 0; j < K; j++)
            S += pt[it[j]];
        for (int j = 0; j < K; j++)
            gw += gt[j] * (pt[it[j]] / S);
    }
    float d[8], p[8], pdp = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        d[i] = 0.f;
        p[i] = 0.f;
        if (e < E) {
            p[i] = pt[e];
            float dd = aux_scale * (float)cglob[e];
            for (int j = 0; j < K; j++)
                if (it[j] == e)
                    dd += renorm ? (gt[j] - gw) / S : gt[j];
            d[i] = dd;
            pdp += p[i] * dd;
        }
    }
    pdp = warp_sum(pdp);
    const float zl = z_scale * lse[t];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        if (e < Ep)
            dlog[(size_t)t * Ep + e] =
                __float2bfloat16_rn(e < E ? p[i] * (d[i] - pdp) + zl * p[i] : 0.f);
    }
    for (int e = 256 + lane; e < Ep; e += 32)
        dlog[(size_t)t * Ep + e] = __float2bfloat16_rn(0.f);
}

} // namespace

moe_err kcu_to_bf16(const void *src, moe_dtype dt, bf16 *dst, size_t n, cudaStream_t st)
{
    if (dt == MOE_BF16) {
        KCU_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(bf16), cudaMemcpyDefault, st));
        return MOE_OK;
    }
    if (dt != MOE_F32)
        return MOE_EINVAL;
    if (n == 0)
        return MOE_OK;
    const size_t blocks = KCU_CEIL_DIV(n, (size_t)256);
    k_f32_to_bf16<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, st>>>((const float *)src,
                                                                             dst, n);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_route(kcu_layer *l, int T, cudaStream_t st)
{
    const int E = l->c.E, K = l->c.K, S = T * K, nch = KCU_CEIL_DIV(S, CHUNK);
    k_softmax_topk<<<KCU_CEIL_DIV(T, 8), 256, 0, st>>>(l->logits, T, E, l->Ep, K, l->c.renorm,
                                                       l->probs, l->lse, l->topk_idx, l->topk_w);
    KCU_CHECK_LAUNCH();
    k_layout_count<<<nch, CHUNK, 0, st>>>(l->topk_idx, S, E, l->chunk);
    KCU_CHECK_LAUNCH();
    k_layout_scan<<<1, 256, 0, st>>>(l->chunk, nch, E, l->counts, l->offs, l->tile_e, l->tile_r0,
                                     l->ntiles);
    KCU_CHECK_LAUNCH();
    k_layout_scatter<<<nch, CHUNK, 0, st>>>(l->topk_idx, S, E, K, l->chunk, l->perm, l->tok);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_combine(const bf16 *ye, const float *w, const float *extra, int T, int K, int H,
                    void *out, moe_dtype dt, cudaStream_t st)
{
    const size_t n = (size_t)T * (H / 8);
    if (n == 0)
        return MOE_OK;
    k_combine<<<(unsigned)KCU_CEIL_DIV(n, (size_t)256), 256, 0, st>>>(ye, w, extra, T, K, H, out,
                                                                      dt == MOE_F32);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_stats(kcu_layer *l, int T, cudaStream_t st)
{
    const int nblk = KCU_CEIL_DIV(T, 256);
    k_stats_part<<<nblk, 256, 0, st>>>(l->probs, l->lse, T, l->c.E, l->statpart);
    KCU_CHECK_LAUNCH();
    k_stats_final<<<1, 256, 0, st>>>(l->statpart, nblk, T, l->c.E, l->c.K, l->counts, l->stats);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_dw_reduce(kcu_layer *l, int S, cudaStream_t st)
{
    k_dw_reduce<<<KCU_CEIL_DIV(S, 256), 256, 0, st>>>(l->dwpart, l->perm, S, l->c.F / KCU_BN,
                                                      l->dw);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_router_bwd(kcu_layer *l, int T, int T_global, float aux_coef, float z_coef,
                       cudaStream_t st)
{
    const int E = l->c.E, K = l->c.K;
    const float Tg = (float)T_global;
    const float aux_scale = aux_coef * (float)E / ((float)K * Tg * Tg);
    const float z_scale = 2.f * z_coef / Tg;
    k_router_bwd<<<KCU_CEIL_DIV(T, 8), 256, 0, st>>>(l->probs, l->lse, l->topk_idx, l->dw, T, E,
                                                     l->Ep, K, l->c.renorm, l->cglob, aux_scale,
                                                     z_scale, l->dlogits);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}
