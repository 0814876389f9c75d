/*
 * kernels/cuda/gemm/mma_sync.cu - v1: the grouped GEMM on mma.sync tensor
 * cores (m16n8k16 bf16, fp32 accumulate), the version of every GPU from sm_80
 * on and the only one of the portable image (KCU_GEMM=mma forces it on Hopper).
 * History: v1 of bench/NOTES.md (was k_gemm / launch in kcu_gemm.cu, moved
 * verbatim in session 19).
 *
 * Over the block-sparse tile list with the MoE gathers and epilogues fused,
 * all modes (AM: A_K rows mode or A_M weight gradients; BMODE: B_K or B_N;
 * EPI: every kcu_epi): ldmatrix + cp.async, 3 stages, 128x128x64 tiles, 8
 * warps (2 x 4, warp tile 64x32), persistent grid, 2 CTAs per SM. Shared
 * memory: STAGES x (A tile + B tile), the swizzled layouts of gemm/tile.cuh.
 * Launched only through kgemm::launch_v1 (gemm/dispatch.cu).
 */
#include "kernels/cuda/gemm/common.cuh"
#include "kernels/cuda/gemm/tile.cuh"
#include "kernels/cuda/gemm/epilogue.cuh"

namespace
{

/* k_gemm: one persistent CTA walks work items w = blockIdx.x, +gridDim.x.
 * AM: A_K (rows mode) or A_M (wgrad mode); BMODE: B_K or B_N; EPI: kcu_epi. */
template <int AM, int BMODE, int EPI>
__global__ void __launch_bounds__(NT, 2) k_gemm(const kcu_gemm_args p)
{
    using A = epi_act<EPI>;                    /* the activation epilogues' functor (kcu_act.cuh) */
    auto rnd = [](float x) { return rbf(x); }; /* the stored h's rounding */
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int ntn = p.N / BN;
    int ntm = 0, tpg = 0, total;
    if (AM == KCU_A_K) {
        ntm = p.tile_e ? *p.ntiles_m : KCU_CEIL_DIV(p.M, BM);
        total = ntm * ntn;
    } else {
        tpg = (p.M / BM) * ntn;
        total = p.ngroups * tpg;
    }

    for (int w = blockIdx.x; w < total; w += gridDim.x) {
        int e, m0, n0, kbeg, kend, rend = 0;
        if (AM == KCU_A_K) {
            const int grp = w / (GROUP_M * ntn), first = grp * GROUP_M;
            const int gsz = min(GROUP_M, ntm - first), in = w - grp * GROUP_M * ntn;
            const int mt = first + in % gsz;
            n0 = (in / gsz) * BN;
            if (p.tile_e) {
                e = p.tile_e[mt];
                m0 = p.tile_r0[mt];
                rend = p.offs[e + 1];
            } else {
                e = 0;
                m0 = mt * BM;
                rend = p.M;
            }
            kbeg = 0;
            kend = p.K;
        } else {
            e = w / tpg;
            const int in = w - e * tpg;
            m0 = (in / ntn) * BM;
            n0 = (in % ntn) * BN;
            kbeg = p.offs ? p.offs[e] : 0;
            kend = p.offs ? p.offs[e + 1] : p.K;
            if (kend <= kbeg && !p.beta0)
                continue; /* no rows: gradient unchanged (zero with beta0) */
        }
        const bf16 *Bg = p.B + (AM == KCU_A_K ? (size_t)e * p.b_gstride : 0);

        /* rows-mode A and B_K rows are fixed for the tile: resolve once */
        const bf16 *asrc[4];
        int aok[4];
        /* B_K rows: thread's row j is row0 + 32 j */
        const bf16 *bsrc = Bg + (size_t)(n0 + (tid >> 3)) * p.ldb + (tid & 7) * 8;
        const size_t bstep = (size_t)32 * p.ldb;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int idx = tid + j * NT, row = idx >> 3, ch = idx & 7;
            if (AM == KCU_A_K) {
                const int r = m0 + row;
                aok[j] = r < rend;
                const int sr = aok[j] ? (p.a_gather ? p.a_gather[r] : r) : 0;
                asrc[j] = p.A + (size_t)sr * p.lda + ch * 8;
            } else {
                asrc[j] = p.A;
                aok[j] = 0;
            }
        }

        auto load = [&](int stage, int kt) {
            const uint32_t sa = sbase + stage * STAGE_BYTES, sb = sa + TILE_BYTES;
            const int k0 = kt * BK;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int idx = tid + j * NT;
                if (AM == KCU_A_K) {
                    const int row = idx >> 3, ch = idx & 7;
                    cp_async16(sa + off_k(row, ch * 8), asrc[j] + k0, aok[j] ? 16 : 0);
                } else {
                    const int kr = idx >> 4, ch = idx & 15, k = kbeg + k0 + kr;
                    const int ok = k < kend;
                    const int sr = ok ? (p.a_gather ? p.a_gather[k] : k) : 0;
                    cp_async16(sa + off_mn(kr, ch * 8), p.A + (size_t)sr * p.lda + m0 + ch * 8,
                               ok ? 16 : 0);
                }
                if (BMODE == KCU_B_K) {
                    const int row = idx >> 3, ch = idx & 7;
                    cp_async16(sb + off_k(row, ch * 8), bsrc + j * bstep + k0, 16);
                } else {
                    const int kr = idx >> 4, ch = idx & 15, k = kbeg + k0 + kr;
                    const int ok = k < kend;
                    const int sr = ok ? (p.b_gather ? p.b_gather[k] : k) : 0;
                    cp_async16(sb + off_mn(kr, ch * 8), Bg + (size_t)sr * p.ldb + n0 + ch * 8,
                               ok ? 16 : 0);
                }
            }
        };

        float acc[4][4][4];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    acc[a][b][c] = 0.f;

        const int ktiles = (kend - kbeg + BK - 1) / BK;
        cp_ring_fill<STAGES>(ktiles, load);
        const int q = lane >> 3, r8 = lane & 7;
        for (int kt = 0; kt < ktiles; kt++) {
            cp_ring_step<STAGES>(kt, ktiles, load);
            const uint32_t sa = sbase + (kt % STAGES) * STAGE_BYTES, sb = sa + TILE_BYTES;
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                uint32_t af[4][4], bfr[4][2];
#pragma unroll
                for (int mi = 0; mi < 4; mi++) {
                    if (AM == KCU_A_K)
                        ldsm4(af[mi], sa + off_k(wm * 64 + mi * 16 + (q & 1) * 8 + r8,
                                                 kk * 16 + (q >> 1) * 8));
                    else
                        ldsm4t(af[mi], sa + off_mn(kk * 16 + (q >> 1) * 8 + r8,
                                                   wm * 64 + mi * 16 + (q & 1) * 8));
                }
#pragma unroll
                for (int nj = 0; nj < 2; nj++) {
                    uint32_t t4[4];
                    if (BMODE == KCU_B_K)
                        ldsm4(t4, sb + off_k(wn * 32 + nj * 16 + (q >> 1) * 8 + r8,
                                             kk * 16 + (q & 1) * 8));
                    else
                        ldsm4t(t4, sb + off_mn(kk * 16 + (q & 1) * 8 + r8,
                                               wn * 32 + nj * 16 + (q >> 1) * 8));
                    b_frag_pair(bfr, nj, t4);
                }
#pragma unroll
                for (int mi = 0; mi < 4; mi++)
#pragma unroll
                    for (int ni = 0; ni < 4; ni++)
                        mma16816(acc[mi][ni], af[mi], bfr[ni][0], bfr[ni][1]);
            }
        }
        cp_async_wait<0>();
        __syncthreads();

        /* ---- epilogue: fragment (mi, ni, c) is row wm*64+mi*16+g+(c>>1)*8,
         * col wn*32+ni*8+q4*2+(c&1) of the tile ---- */
        const int g = lane >> 2, q4 = lane & 3;
        if (EPI == KCU_EPI_ACC) {
            const size_t ce = (size_t)e * p.c_gstride;
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    const int m = m0 + wm * 64 + mi * 16 + g + hr * 8;
#pragma unroll
                    for (int ni = 0; ni < 4; ni++) {
                        const size_t o = ce + (size_t)m * p.ldc + n0 + wn * 32 + ni * 8 + q4 * 2;
                        float2 v = make_float2(acc[mi][ni][hr * 2], acc[mi][ni][hr * 2 + 1]);
                        if (p.Cb) { /* bf16 store: C = bf16(C + acc) */
                            __nv_bfloat162 *cp = reinterpret_cast<__nv_bfloat162 *>(p.Cb + o);
                            if (!p.beta0) {
                                const float2 c = __bfloat1622float2(*cp);
                                v.x += c.x;
                                v.y += c.y;
                            }
                            *cp = __floats2bfloat162_rn(v.x, v.y);
                        } else {
                            float2 *cp = reinterpret_cast<float2 *>(p.Cf + o);
                            if (!p.beta0) {
                                const float2 c = *cp;
                                v.x += c.x;
                                v.y += c.y;
                            }
                            *cp = v;
                        }
                    }
                }
        } else {
            float *red = reinterpret_cast<float *>(smem); /* (4, BM) dw row sums */
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    const int rl = wm * 64 + mi * 16 + g + hr * 8, r = m0 + rl;
                    const bool ok = r < rend;
                    float rsum = 0.f;
                    if (ok) {
                        if (EPI == KCU_EPI_F32) {
#pragma unroll
                            for (int ni = 0; ni < 4; ni++) {
                                const int n = n0 + wn * 32 + ni * 8 + q4 * 2;
                                *reinterpret_cast<float2 *>(p.Cf + (size_t)r * p.ldc + n) =
                                    make_float2(acc[mi][ni][hr * 2], acc[mi][ni][hr * 2 + 1]);
                            }
                        } else if (EPI == KCU_EPI_SCATTER) {
                            const size_t so = (size_t)(p.scatter ? p.scatter[r] : r) * p.ldc;
#pragma unroll
                            for (int ni = 0; ni < 4; ni++) {
                                const int n = n0 + wn * 32 + ni * 8 + q4 * 2;
                                st_bf2(p.Cb + so + n, acc[mi][ni][hr * 2], acc[mi][ni][hr * 2 + 1]);
                            }
                        } else if (EPI == KCU_EPI_SWIGLU) {
#pragma unroll
                            for (int np = 0; np < 2; np++) {
                                const float g0 = acc[mi][2 * np][hr * 2];
                                const float g1 = acc[mi][2 * np][hr * 2 + 1];
                                const float u0 = acc[mi][2 * np + 1][hr * 2];
                                const float u1 = acc[mi][2 * np + 1][hr * 2 + 1];
                                const int cg = n0 + wn * 32 + np * 16 + q4 * 2;
                                const int f = (n0 + wn * 32 + np * 16) / 2 + q4 * 2;
                                st_bf2(p.h + (size_t)r * p.F + f, A::fwd(g0, u0), A::fwd(g1, u1));
                                if (p.ab) {
                                    st_bf2(p.ab + (size_t)r * p.ld_ab + cg, g0, g1);
                                    st_bf2(p.ab + (size_t)r * p.ld_ab + cg + 8, u0, u1);
                                }
                            }
                        } else if (EPI == KCU_EPI_GELU) {
#pragma unroll
                            for (int ni = 0; ni < 4; ni++) {
                                const int n = n0 + wn * 32 + ni * 8 + q4 * 2;
                                const float a0 = acc[mi][ni][hr * 2], a1 = acc[mi][ni][hr * 2 + 1];
                                st_bf2(p.h + (size_t)r * p.F + n, A::fwd(a0, 0.f), A::fwd(a1, 0.f));
                                if (p.ab)
                                    st_bf2(p.ab + (size_t)r * p.ld_ab + n, a0, a1);
                            }
                        } else { /* DSWIGLU / DGELU: acc = dy.W2 (unweighted dh) */
                            const float wg =
                                p.gate_w ? p.gate_w[p.scatter ? p.scatter[r] : r] : 1.f;
#pragma unroll
                            for (int ni = 0; ni < 4; ni++) {
                                const int f = n0 + wn * 32 + ni * 8 + q4 * 2;
                                const float d0 = acc[mi][ni][hr * 2], d1 = acc[mi][ni][hr * 2 + 1];
                                float h0, h1;
                                if (EPI == KCU_EPI_DSWIGLU) {
                                    bf16 *pa = p.ab + (size_t)r * p.ld_ab + (f >> 3) * 16 + (f & 7);
                                    const float2 a = ld_bf2(pa), b = ld_bf2(pa + 8);
                                    A::bwd2(a, b, wg, d0, d1, rnd, &h0, &h1, [&](auto da, auto db) {
                                        const float2 ga = da();
                                        st_bf2(pa, ga.x, ga.y);
                                        const float2 gb = db();
                                        st_bf2(pa + 8, gb.x, gb.y);
                                    });
                                } else {
                                    bf16 *pa = p.ab + (size_t)r * p.ld_ab + f;
                                    const float2 a = ld_bf2(pa);
                                    A::bwd2(a, a, wg, d0, d1, rnd, &h0, &h1, [&](auto da, auto) {
                                        const float2 ga = da();
                                        st_bf2(pa, ga.x, ga.y);
                                    });
                                }
                                st_bf2(p.h + (size_t)r * p.F + f, wg * h0, wg * h1);
                                rsum += d0 * h0 + d1 * h1;
                            }
                        }
                    }
                    if (EPI == KCU_EPI_DSWIGLU || EPI == KCU_EPI_DGELU) {
                        rsum += __shfl_xor_sync(0xffffffffu, rsum, 1);
                        rsum += __shfl_xor_sync(0xffffffffu, rsum, 2);
                        if (q4 == 0)
                            red[wn * BM + rl] = rsum;
                    }
                }
            if (EPI == KCU_EPI_DSWIGLU || EPI == KCU_EPI_DGELU) {
                __syncthreads();
                if (p.dwpart && tid < BM && m0 + tid < rend)
                    p.dwpart[(size_t)(m0 + tid) * ntn + n0 / BN] =
                        red[tid] + red[BM + tid] + red[2 * BM + tid] + red[3 * BM + tid];
            }
        }
        __syncthreads(); /* smem is reused by the next work item */
    }
}

template <int AM, int BMODE, int EPI>
moe_err launch(const kcu_gemm_args *a, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    KCU_TRY(smem_limit_once(attr_done, k_gemm<AM, BMODE, EPI>, SMEM_BYTES));
    long long total;
    if (AM == KCU_A_K)
        total = (long long)(a->tile_e ? a->max_tiles_m : KCU_CEIL_DIV(a->M, BM)) * (a->N / BN);
    else
        total = (long long)a->ngroups * (a->M / BM) * (a->N / BN);
    if (total <= 0)
        return MOE_OK;
    const int grid = (int)(total < 2LL * nsm ? total : 2LL * nsm);
    k_gemm<AM, BMODE, EPI><<<grid, NT, SMEM_BYTES, st>>>(*a);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

/* ---- v1n: v1 for few rows (A_K, B_K, EPI_F32, A dense, no tile list: the
 * router's logits) ----
 * v1's 128-row tiles leave most SMs idle when a batch has few of them (the
 * router at T = 2048, E = 128: 16 CTAs, 70 us on an H100). v1n takes tiles
 * of 16 MI rows x 128 columns with 4 warps (warp tile 16 MI x 32) through
 * v1's k steps and m16n8k16 fragments: every output element is the same
 * chain of the same instructions on the same operands as in v1, so its bits
 * are v1's (the logits do not depend on the batch the router ran in: the
 * layer and each kcu_ep rank route alike). 4 stages of (A tile, 16 KB B). */
constexpr int N_NT = 128, N_STAGES = 4;
template <int MI> __host__ __device__ constexpr int n_stage_bytes()
{
    return 16 * MI * 128 + TILE_BYTES;
}

template <int MI> __global__ void __launch_bounds__(N_NT) k_gemm_narrow(const kcu_gemm_args p)
{
    constexpr int BMN = 16 * MI, A_BYTES = BMN * 128, STG = n_stage_bytes<MI>();
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, wn = tid >> 5;
    const int ntn = p.N / BN, total = KCU_CEIL_DIV(p.M, BMN) * ntn;
    const int q = lane >> 3, r8 = lane & 7, g = lane >> 2, q4 = lane & 3;
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
        const int m0 = (w / ntn) * BMN, n0 = (w % ntn) * BN;
        auto load = [&](int stage, int kt) {
            const uint32_t sa = sbase + stage * STG, sb = sa + A_BYTES;
            const int k0 = kt * BK;
#pragma unroll
            for (int j = 0; j < MI; j++) { /* A: BMN rows of 8 chunks */
                const int idx = tid + j * N_NT, row = idx >> 3, ch = idx & 7, r = m0 + row;
                const int ok = r < p.M;
                cp_async16(sa + off_k(row, ch * 8),
                           p.A + (size_t)(ok ? r : 0) * p.lda + k0 + ch * 8, ok ? 16 : 0);
            }
#pragma unroll
            for (int j = 0; j < 8; j++) { /* B: 128 rows of 8 chunks */
                const int idx = tid + j * N_NT, row = idx >> 3, ch = idx & 7;
                cp_async16(sb + off_k(row, ch * 8), p.B + (size_t)(n0 + row) * p.ldb + k0 + ch * 8,
                           16);
            }
        };
        float acc[MI][4][4];
#pragma unroll
        for (int a = 0; a < MI; a++)
#pragma unroll
            for (int b = 0; b < 4; b++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    acc[a][b][c] = 0.f;
        const int ktiles = p.K / BK;
        cp_ring_fill<N_STAGES>(ktiles, load);
        for (int kt = 0; kt < ktiles; kt++) {
            cp_ring_step<N_STAGES>(kt, ktiles, load);
            const uint32_t sa = sbase + (kt % N_STAGES) * STG, sb = sa + A_BYTES;
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                uint32_t af[MI][4], bfr[4][2];
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
                    ldsm4(af[mi], sa + off_k(mi * 16 + (q & 1) * 8 + r8, kk * 16 + (q >> 1) * 8));
#pragma unroll
                for (int nj = 0; nj < 2; nj++) {
                    uint32_t t4[4];
                    ldsm4(t4,
                          sb + off_k(wn * 32 + nj * 16 + (q >> 1) * 8 + r8, kk * 16 + (q & 1) * 8));
                    b_frag_pair(bfr, nj, t4);
                }
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
#pragma unroll
                    for (int ni = 0; ni < 4; ni++)
                        mma16816(acc[mi][ni], af[mi], bfr[ni][0], bfr[ni][1]);
            }
        }
        cp_async_wait<0>();
        __syncthreads(); /* every stage read before the next item's loads */
                         /* fragment (mi, ni, c): row mi*16+g+(c>>1)*8, col wn*32+ni*8+q4*2+(c&1) */
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int r = m0 + mi * 16 + g + hr * 8;
                if (r >= p.M)
                    continue;
#pragma unroll
                for (int ni = 0; ni < 4; ni++) {
                    const int n = n0 + wn * 32 + ni * 8 + q4 * 2;
                    *reinterpret_cast<float2 *>(p.Cf + (size_t)r * p.ldc + n) =
                        make_float2(acc[mi][ni][hr * 2], acc[mi][ni][hr * 2 + 1]);
                }
            }
    }
}

template <int MI> moe_err launch_narrow_t(const kcu_gemm_args *a, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    constexpr int smem = N_STAGES * n_stage_bytes<MI>();
    KCU_TRY(smem_limit_once(attr_done, k_gemm_narrow<MI>, smem));
    const long long total = (long long)KCU_CEIL_DIV(a->M, 16 * MI) * (a->N / BN);
    if (total <= 0)
        return MOE_OK;
    const int grid = (int)(total < 2LL * nsm ? total : 2LL * nsm);
    k_gemm_narrow<MI><<<grid, N_NT, smem, st>>>(*a);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

struct run_v1 {
    template <int AM, int BM, int EPI>
    static moe_err run(const kcu_gemm_args *a, const ws_maps &, int nsm, cudaStream_t st)
    {
        return launch<AM, BM, EPI>(a, nsm, st);
    }
};

} // namespace

moe_err kgemm::launch_v1(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a,
                         const ws_maps &m, int nsm, cudaStream_t st)
{
    return gemm_dispatch<run_v1>(am, bm, epi, a, m, nsm, st);
}

moe_err kgemm::launch_v1n(const kcu_gemm_args *a, int mi, int nsm, cudaStream_t st)
{
    return mi == 1 ? launch_narrow_t<1>(a, nsm, st) : launch_narrow_t<2>(a, nsm, st);
}
