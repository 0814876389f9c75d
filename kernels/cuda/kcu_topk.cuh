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

/* softmax_topk_nv: softmax_topk for E <= 32 NV: each lane holds NV
 * logits (experts lane + 32 i, i < NV), so the selection loops run over
 * NV slots instead of 8 (the same choices, fewer instructions). The
 * logits are read through L2 (ld.global.cg): within one kernel they may
 * come from other CTAs. */
template <int NV>
__device__ __forceinline__ void softmax_topk_nv(const float *lt, int E, int K, float (&v)[8],
                                                float &lse, int (&ik)[8], float (&wk)[8],
                                                float &wsum)
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
    unsigned taken = 0;
    wsum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        wk[j] = 0.f;
        ik[j] = 0;
        if (j < K) {
            float bv = -1.f;
            int bi = INT_MAX;
#pragma unroll
            for (int i = 0; i < NV; i++) {
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
}

/* softmax_topk: the E (<= 256) logits lt of one token -> in v[i] the
 * probability of expert lane + 32 i (0 past E), lse = log sum exp, and the
 * K (<= 8) largest probabilities in descending order, ties to the lower
 * expert index: ik[j], wk[j] (j >= K: 0), their sum wsum. Every lane of the
 * warp calls it and gets the same ik, wk, wsum, lse. */
__device__ __forceinline__ void softmax_topk(const float *lt, int E, int K, float (&v)[8],
                                             float &lse, int (&ik)[8], float (&wk)[8], float &wsum)
{
    if (E <= 32)
        softmax_topk_nv<1>(lt, E, K, v, lse, ik, wk, wsum);
    else if (E <= 64)
        softmax_topk_nv<2>(lt, E, K, v, lse, ik, wk, wsum);
    else if (E <= 128)
        softmax_topk_nv<4>(lt, E, K, v, lse, ik, wk, wsum);
    else
        softmax_topk_nv<8>(lt, E, K, v, lse, ik, wk, wsum);
}

} // namespace kcu_topk

#endif /* MOE_KCU_TOPK_CUH */
