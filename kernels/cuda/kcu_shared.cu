/*
 * kcu_shared.cu - the kernels of a shared expert held apart from the routed
 * experts (one kcu_experts of d_ff m*F that every token takes), used by
 * kcu_ep (always) and by kcu_layer when E + m > 256 (kcu_internal.cuh
 * "shared expert held apart"): the combine that adds its output rows after
 * the routed slots, gated or not, and the gate's backward.
 */
#include "kernels/cuda/kcu_internal.cuh"

namespace
{

/* sigmoid of a gate logit, as k_route_family computes the shared weight */
__device__ __forceinline__ float sh_gate(float logit)
{
    return 1.0f / (1.0f + expf(-logit));
}

/* out (T,H) = extra + sum_j [w ? bf16(w[s] * row_s) : row_s], j in order
 * (as k_combine), then the shared row srows[t] (T,H) if given: +
 * bf16(g srows[t]) with g = sigmoid(glog[t * ldg]) (the gate logit, column
 * E of the router logits (T,Ep)), or + srows[t] without glog. row_s =
 * rows[pos[s]] (pos given: kcu_ep's send rows) or rows[s] (slot order:
 * kcu_layer's ye); a slot with spos[s] < 0 (dropped by the capacity) adds
 * nothing. One thread per 8 columns. */
__global__ void k_shared_combine(const bf16 *__restrict__ rows, const int32_t *__restrict__ pos,
                                 const int32_t *__restrict__ spos, const float *__restrict__ w,
                                 const float *__restrict__ extra, const bf16 *__restrict__ srows,
                                 const float *__restrict__ glog, int ldg, int T, int K, int H,
                                 void *out, int out_f32)
{
    const int hc = H / 8;
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * hc)
        return;
    const int t = (int)(i / hc), col = (int)(i % hc) * 8;
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
        acc[k] = extra ? extra[(size_t)t * H + col + k] : 0.f;
    for (int j = 0; j < K; j++) {
        const size_t s = (size_t)t * K + j;
        if (spos && spos[s] < 0)
            continue;
        const size_t r = pos ? (size_t)pos[s] : s;
        const uint4 raw = *reinterpret_cast<const uint4 *>(rows + r * H + col);
        kcu_combine_add(acc, raw, w != nullptr, w ? w[s] : 1.f);
    }
    if (srows) {
        const uint4 raw = *reinterpret_cast<const uint4 *>(srows + (size_t)t * H + col);
        kcu_combine_add(acc, raw, glog != nullptr, glog ? sh_gate(glog[(size_t)t * ldg]) : 1.f);
    }
    if (out_f32) {
        float *o = (float *)out + (size_t)t * H + col;
#pragma unroll
        for (int k = 0; k < 8; k++)
            o[k] = acc[k];
    } else {
        uint4 raw;
        __nv_bfloat162 *v = reinterpret_cast<__nv_bfloat162 *>(&raw);
#pragma unroll
        for (int k = 0; k < 4; k++)
            v[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
        *reinterpret_cast<uint4 *>((bf16 *)out + (size_t)t * H + col) = raw;
    }
}

/* two dy values at i of row t (f32 or bf16), rounded to bf16 as staged dy */
__device__ __forceinline__ float2 sh_dy2(const void *dy, int dy_f32, size_t i)
{
    if (dy_f32) {
        const float2 a = *reinterpret_cast<const float2 *>((const float *)dy + i);
        return __bfloat1622float2(__floats2bfloat162_rn(a.x, a.y));
    }
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>((const bf16 *)dy + i));
}

/* one warp per token t of a gated shared expert: g = sigmoid(glog[t*ld])
 * (the forward's gate), dot = <dy[t], ys[t]> (fp32, fixed order, dy
 * rounded to bf16); the gate logit's gradient dlog[t*ld] (column E of
 * dlogits (T,Ep)) = bf16(g (1-g) dot) (k_router_bwd's formula with one
 * shared slot); out row t = bf16(g dy[t]): the shared expert's dy rows.
 * out may be dy (bf16) or ys: each element is read before it is written,
 * by the same lane (no __restrict__ on these three) */
__global__ void k_shared_gate_bwd(const void *dy, int dy_f32, const bf16 *ys,
                                  const float *__restrict__ glog, int ld, int T, int H, bf16 *out,
                                  bf16 *__restrict__ dlog)
{
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T)
        return;
    const float g = sh_gate(glog[(size_t)t * ld]);
    const size_t row = (size_t)t * H;
    float dot = 0.f;
    for (int i = lane * 2; i < H; i += 64) {
        const float2 a = sh_dy2(dy, dy_f32, row + i);
        const float2 b =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(ys + row + i));
        dot += a.x * b.x + a.y * b.y;
        *reinterpret_cast<__nv_bfloat162 *>(out + row + i) =
            __floats2bfloat162_rn(g * a.x, g * a.y);
    }
    for (int o = 16; o; o >>= 1)
        dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0)
        dlog[(size_t)t * ld] = __float2bfloat16_rn(g * (1.f - g) * dot);
}

} // namespace

moe_err kcu_shared_combine(const bf16 *rows, const int32_t *pos, const int32_t *spos,
                           const float *w, const float *extra, const bf16 *srows, const float *glog,
                           int ldg, int T, int K, int H, void *out, moe_dtype dt, cudaStream_t st)
{
    const size_t n = (size_t)T * (H / 8);
    if (n == 0)
        return MOE_OK;
    k_shared_combine<<<(unsigned)KCU_CEIL_DIV(n, (size_t)256), 256, 0, st>>>(
        rows, pos, spos, w, extra, srows, glog, ldg, T, K, H, out, dt == MOE_F32);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_shared_gate_bwd(const void *dy, moe_dtype dy_dtype, const bf16 *ys, const float *glog,
                            int ld, int T, int H, bf16 *out, bf16 *dlog, cudaStream_t st)
{
    if (dy_dtype != MOE_F32 && dy_dtype != MOE_BF16)
        return MOE_EINVAL;
    if (T <= 0)
        return MOE_OK;
    k_shared_gate_bwd<<<KCU_CEIL_DIV(T, 8), 256, 0, st>>>(dy, dy_dtype == MOE_F32, ys, glog, ld, T,
                                                          H, out, dlog);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}
