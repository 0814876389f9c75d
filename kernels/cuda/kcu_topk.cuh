/*
 * kcu_topk.cuh - the router's softmax and top-k for one token, done by one
 * warp: shared by the layout kernels (kcu_route.cu) and the decode path
 * (kcu_decode.cu), which must pick the same experts bit for bit.
 */
#ifndef MOE_KCU_TOPK_CUH
#define MOE_KCU_TOPK_CUH

#include <float.h>
#include <limits.h>

namespace kcu_topk
{

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

/* softmax_slots: the probabilities of the E <= 32 NV logits lt in v[i]
 * (expert lane + 32 i; 0 past E) and lse = log sum exp. The logits are read
 * through L2 (ld.global.cg): within one kernel they may come from other
 * CTAs. */
template <int NV>
__device__ __forceinline__ void softmax_slots(const float *lt, int E, float (&v)[8], float &lse)
{
    const int lane = threadIdx.x & 31;
    float mx = -FLT_MAX;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        v[i] = i < NV && e < E ? __ldcg(lt + e) : -FLT_MAX;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        v[i] = i < NV && e < E ? expf(v[i] - mx) : 0.f;
        sum += v[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < NV; i++)
        v[i] = v[i] / sum;
    lse = mx + logf(sum);
}

/* argmax_take: one pick of a top-k by repeated warp arg-max. Each lane
 * holds the values x[i] of experts lane + 32 i (i < NV, e < E; lane: its
 * index in the warp); the pick
 * is the largest value not yet taken, equal values (-inf included) to the
 * lower expert - the CPU's strict > over ascending experts. Every lane gets
 * it in (bv, bi) (bv = none, bi = INT_MAX when nothing is left), and the
 * owning lane marks it in its taken bits. Used by the plain router
 * (softmax_topk_nv) and the family router (kcu_route.cu), which must agree
 * with each other and with the CPU. */
template <int NV>
__device__ __forceinline__ void argmax_take(const float (&x)[8], int E, int lane, float none,
                                            unsigned &taken, float &bv, int &bi)
{
    bv = none;
    bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int e = lane + 32 * i;
        if (e < E && !((taken >> i) & 1u) && (bi == INT_MAX || x[i] > bv)) {
            bv = x[i];
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
}

/* softmax_topk_nv: softmax_topk for E <= 32 NV: each lane holds NV
 * logits (experts lane + 32 i, i < NV), so the selection loops run over
 * NV slots instead of 8 (the same choices, fewer instructions). */
template <int NV>
__device__ __forceinline__ void softmax_topk_nv(const float *lt, int E, int K, float (&v)[8],
                                                float &lse, int (&ik)[8], float (&wk)[8],
                                                float &wsum)
{
    softmax_slots<NV>(lt, E, v, lse);
    const int lane = threadIdx.x & 31;
    unsigned taken = 0;
    wsum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        wk[j] = 0.f;
        ik[j] = 0;
        if (j < K) {
            float bv;
            int bi;
            argmax_take<NV>(v, E, lane, -1.f, taken, bv, bi);
            wk[j] = bv;
            ik[j] = bi;
            wsum += bv;
        }
    }
}

/* (value, index) a comes before b: larger value, then lower index */
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib)
{
    return va > vb || (va == vb && ia < ib);
}
/* compare-exchange: (a, ia) before (b, ib) afterwards */
__device__ __forceinline__ void cex(float &a, int &ia, float &b, int &ib)
{
    const bool sw = before(b, ib, a, ia);
    const float t = sw ? b : a;
    const int ti = sw ? ib : ia;
    b = sw ? a : b;
    ib = sw ? ia : ib;
    a = t;
    ia = ti;
}

/* topk_merge: the 8 first (value, index) pairs of the warp in the order of
 * `before`, every lane holding them sorted in (a, ai) at the end. Each lane
 * starts with its own pairs sorted (padding: value -1, index INT_MAX, last);
 * five butterfly levels each take the partner's 8 and keep the first 8 of
 * the 16 (a bitonic merge: pairwise better of a[j] and b[7-j], then three
 * compare-exchange stages). Latency: 5 x (16 shuffles + 4 dependent stages)
 * instead of 8 x 5 dependent shuffle rounds of repeated arg-max. */
__device__ __forceinline__ void topk_merge(float (&a)[8], int (&ai)[8])
{
    /* one level's code run five times, not five copies: the routing runs
     * once per call with a cold instruction cache (ncu: stall_no_inst in
     * the top-k). Measured (H100): the router kernel 17432 -> 13328 SASS
     * instructions, topk_bench warm 3803 -> 3033 cycles at E=128 K=8 (cold
     * 3880 -> 4344), decode end to end equal or 1-2 us faster */
#pragma unroll 1
    for (int o = 1; o < 32; o <<= 1) {
        float b[8];
        int bi[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            b[j] = __shfl_xor_sync(0xffffffffu, a[7 - j], o);
            bi[j] = __shfl_xor_sync(0xffffffffu, ai[7 - j], o);
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (before(b[j], bi[j], a[j], ai[j])) {
                a[j] = b[j];
                ai[j] = bi[j];
            }
#pragma unroll
        for (int d = 4; d; d >>= 1)
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (!(j & d))
                    cex(a[j], ai[j], a[j + d], ai[j + d]);
    }
}

/* softmax_topk_bm: softmax_topk_nv with the top-k by topk_merge: the same
 * probabilities and the same choices in the same order */
template <int NV>
__device__ __forceinline__ void softmax_topk_bm(const float *lt, int E, int K, float (&v)[8],
                                                float &lse, int (&ik)[8], float (&wk)[8],
                                                float &wsum)
{
    softmax_slots<NV>(lt, E, v, lse);
    const int lane = threadIdx.x & 31;
    float a[8];
    int ai[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        const bool ok = i < NV && e < E;
        a[i] = ok ? v[i] : -1.f;
        ai[i] = ok ? e : INT_MAX;
    }
    /* the lane's own NV pairs sorted (indices already ascend with i) */
    if (NV == 2) {
        cex(a[0], ai[0], a[1], ai[1]);
    } else if (NV == 4) {
        cex(a[0], ai[0], a[1], ai[1]);
        cex(a[2], ai[2], a[3], ai[3]);
        cex(a[0], ai[0], a[2], ai[2]);
        cex(a[1], ai[1], a[3], ai[3]);
        cex(a[1], ai[1], a[2], ai[2]);
    } else if (NV == 8) {
#pragma unroll
        for (int s = 0; s < 8; s++) /* odd-even transposition: 8 rounds */
#pragma unroll
            for (int j = s & 1; j + 1 < 8; j += 2)
                cex(a[j], ai[j], a[j + 1], ai[j + 1]);
    }
    topk_merge(a, ai);
    wsum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        ik[j] = j < K ? ai[j] : 0;
        wk[j] = j < K ? a[j] : 0.f;
        wsum += wk[j];
    }
}

/* softmax_topk: the E (<= 256) logits lt of one token -> in v[i] the
 * probability of expert lane + 32 i (0 past E), lse = log sum exp, and the
 * K (<= 8) largest probabilities in descending order, ties to the lower
 * expert index: ik[j], wk[j] (j >= K: 0), their sum wsum. Every lane of the
 * warp calls it and gets the same ik, wk, wsum, lse. */
__device__ __forceinline__ void softmax_topk(const float *lt, int E, int K, float (&v)[8],
                                             float &lse, int (&ik)[8], float (&wk)[8], float &wsum)
{
    /* measured (bench/topk_bench.cu, H100): the merge takes ~1950 cycles of
     * the arg-max's ~5900 off at E=128 K=8 and is slower at K=1; the
     * arg-max is kept below K=4 and for E <= 32 */
    if (E <= 32)
        softmax_topk_nv<1>(lt, E, K, v, lse, ik, wk, wsum);
    else if (E <= 64)
        K < 4 ? softmax_topk_nv<2>(lt, E, K, v, lse, ik, wk, wsum)
              : softmax_topk_bm<2>(lt, E, K, v, lse, ik, wk, wsum);
    else if (E <= 128)
        K < 4 ? softmax_topk_nv<4>(lt, E, K, v, lse, ik, wk, wsum)
              : softmax_topk_bm<4>(lt, E, K, v, lse, ik, wk, wsum);
    else
        K < 4 ? softmax_topk_nv<8>(lt, E, K, v, lse, ik, wk, wsum)
              : softmax_topk_bm<8>(lt, E, K, v, lse, ik, wk, wsum);
}

} // namespace kcu_topk

#endif /* MOE_KCU_TOPK_CUH */
