/*
 * kcu_gemm.cu - grouped GEMM on tensor cores (mma.sync m16n8k16 bf16, fp32
 * accumulate) over the block-sparse tile list, with the MoE gathers and
 * epilogues fused. Version 1 (all modes): ldmatrix + cp.async, 3 stages,
 * 128x128x64 tiles, 8 warps (2 x 4, warp tile 64x32), persistent grid, 2 CTAs
 * per SM. Version 2 (k_gemm_wg, every mode when N % 256 == 0): wgmma, see below.
 * Version 4 (k_gemm_ws, the default where v2 fits): v2's tiles and wgmma with a
 * producer warpgroup (TMA / cp.async into mbarrier stages) and two consumer
 * warpgroups, see below. KCU_GEMM=mma|wgmma|ws forces v1 / v2 / v4.
 * bench/NOTES.md records each version's timings.
 *
 * Shared-memory tiles are 16 KB each, rows of 16-byte chunks XOR-swizzled
 * by the row index so that ldmatrix and cp.async are free of bank conflicts:
 *   K-contiguous tile  [128 rows][64 k]   (A rows / nn.Linear weight rows)
 *   MN-contiguous tile [64 k][128 cols]   (read with ldmatrix.trans)
 */
#include <cuda.h> /* CUtensorMap and its enums; the functions come by entry point */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kcu_act.cuh"
#include "kernels/cuda/kcu_internal.cuh"

/* the portable image (kcu_arch.cu) compiles the Hopper kernels empty: their
 * device helpers are then unreferenced there, which is expected */
#pragma nv_diag_suppress 177

namespace
{

constexpr int BM = KCU_BM, BN = KCU_BN, BK = KCU_BK;
constexpr int STAGES = 3, NT = 256;
constexpr int TILE_BYTES = 128 * 64 * 2;
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES; /* 96 KB */
constexpr int GROUP_M = 8;                       /* raster: 8 m-tiles share B in L2 */

static_assert(BM == 128 && BN == 128 && BK == 64, "tile shape is baked into the loaders");

__device__ __forceinline__ uint32_t off_k(int row, int col)
{
    return row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2;
}
__device__ __forceinline__ uint32_t off_mn(int k, int col)
{
    return k * 256 + (((col >> 3) ^ (k & 7)) << 4) + (col & 7) * 2;
}

__device__ __forceinline__ void cp_async16(uint32_t s, const void *g, int bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t a)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], uint32_t a)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* the activation functor of an activation epilogue EPI (kcu_act.cuh; the
 * arithmetic lives there): SWIGLU/DSWIGLU -> act_swiglu, GELU/DGELU ->
 * act_gelu; the other epilogues get act_of<0>, which they never call */
template <int EPI> using epi_act = act_of<(kcu_epi_act(EPI) < 0 ? 0 : kcu_epi_act(EPI))>;

__device__ __forceinline__ void st_bf2(bf16 *p, float x, float y)
{
    *reinterpret_cast<__nv_bfloat162 *>(p) = __floats2bfloat162_rn(x, y);
}
/* a quad's 4-byte values a (16 contiguous bytes at base, lane q4's at
 * base + 2 q4) and b (likewise at base2) leave as 8-byte stores: lanes q4
 * and q4 ^ 1 swap one value, the even lane stores its a and its partner's,
 * the odd lane its partner's b and its own (half the store instructions).
 * mask: the active lanes (both of a pair or neither). */
__device__ __forceinline__ void quad_pair_store(bf16 *base, bf16 *base2, uint32_t a, uint32_t b,
                                                int q4, unsigned mask)
{
    const uint32_t got = __shfl_xor_sync(mask, (q4 & 1) ? a : b, 1);
    if (q4 & 1)
        *reinterpret_cast<uint2 *>(base2 + 2 * (q4 - 1)) = make_uint2(got, b);
    else
        *reinterpret_cast<uint2 *>(base + 2 * q4) = make_uint2(a, got);
}
/* quad_pair_store for fp32 pairs: (x0, y0) of lane q4 at base + 2 q4 and
 * (x1, y1) at base2 + 2 q4 leave as 16-byte stores, or as 16-byte
 * reductions (red.add) when add */
__device__ __forceinline__ void quad_pair_f32(float *base, float *base2, float x0, float y0,
                                              float x1, float y1, int q4, unsigned mask, bool add)
{
    const bool odd = q4 & 1;
    const float gx = __shfl_xor_sync(mask, odd ? x0 : x1, 1);
    const float gy = __shfl_xor_sync(mask, odd ? y0 : y1, 1);
    float *dst = odd ? base2 + 2 * (q4 - 1) : base + 2 * q4;
    const float4 v = odd ? make_float4(gx, gy, x1, y1) : make_float4(x0, y0, gx, gy);
    if (add)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x),
                     "f"(v.y), "f"(v.z), "f"(v.w)
                     : "memory");
    else
        asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y),
                     "f"(v.z), "f"(v.w)
                     : "memory");
}
/* row half hr of a wgmma fragment d (see wg_epilogue) as 256 fp32 columns
 * at row: stored, or added (red.add) when add; 16 bytes per lane and
 * instruction (quad_pair_f32). mask: the lanes whose row exists. */
__device__ __forceinline__ void row_f32(float *row, const float (&d)[128], int hr, int q4,
                                        unsigned mask, bool add)
{
#pragma unroll
    for (int j = 0; j < 32; j += 2)
        quad_pair_f32(row + 8 * j, row + 8 * j + 8, d[4 * j + hr * 2], d[4 * j + hr * 2 + 1],
                      d[4 * j + 4 + hr * 2], d[4 * j + 4 + hr * 2 + 1], q4, mask, add);
}
__device__ __forceinline__ uint32_t pack_bf2(float x, float y)
{
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t *>(&v);
}
__device__ __forceinline__ float2 ld_bf2(const bf16 *p)
{
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
}
__device__ __forceinline__ float rbf(float x)
{
    return __bfloat162float(__float2bfloat16_rn(x));
}

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
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < ktiles)
                load(s, s);
            cp_async_commit();
        }
        const int q = lane >> 3, r8 = lane & 7;
        for (int kt = 0; kt < ktiles; kt++) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            const int nk = kt + STAGES - 1;
            if (nk < ktiles)
                load(nk % STAGES, nk);
            cp_async_commit();
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
                    bfr[2 * nj][0] = t4[0];
                    bfr[2 * nj][1] = t4[1];
                    bfr[2 * nj + 1][0] = t4[2];
                    bfr[2 * nj + 1][1] = t4[3];
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

/* the dynamic shared memory limit of kernel k, set once per device (a
 * per-device function attribute; one process may drive several GPUs; benign race: the call is
 * idempotent) */
template <typename Kern> moe_err smem_limit_once(unsigned long long &done, Kern k, int bytes)
{
    int dev = 0;
    KCU_CHECK(cudaGetDevice(&dev));
    if (!(done >> (dev & 63) & 1)) {
        KCU_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        done |= 1ull << (dev & 63);
    }
    return MOE_OK;
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

/* ---- v2: wgmma (sm_90a), every mode ----
 * 128x256x64 tiles, 2 warpgroups each computing 64x256 with wgmma.m64n256k16
 * from shared memory, 4 cp.async stages (the token gathers stay fused into
 * the loads), prefetch distance 2 with one wgmma batch left in flight, 1 CTA
 * per SM, persistent. The next work item's first two stages are issued
 * before the current item's epilogue (the epilogues touch no shared memory),
 * so the epilogue's global traffic overlaps the next item's loads.
 * Operand tiles, 128-byte swizzle on a 1024-byte aligned base:
 *  K-major  (rows A, B_K): [row][64 k] rows of 128 B = the off_k layout;
 *           descriptor LBO unused, SBO = 1024 B (8-row groups).
 *  MN-major (wgrad A, B_N): atoms of 64 m/n columns x 64 k rows (8 KB),
 *           row k at k*128 B, its 16-byte chunk c at (c ^ (k&7))*16;
 *           descriptor LBO = 8 KB (next 64 columns), SBO = 1024 B (next 8 k
 *           rows); the instruction's transpose bit set for that operand. */
constexpr int WG_BN = 256, WG_STAGES = 4;
constexpr int WG_A_BYTES = 128 * 64 * 2, WG_B_BYTES = WG_BN * 64 * 2;
constexpr int WG_STAGE_BYTES = WG_A_BYTES + WG_B_BYTES;
constexpr int WG_SMEM_BYTES = WG_STAGES * WG_STAGE_BYTES + 1024;
constexpr int WG_ATOM = 64 * 128; /* bytes of one MN-major atom: 64 k rows x 128 B */

__device__ __forceinline__ uint32_t off_mnw(int k, int c16)
{
    return (c16 >> 3) * WG_ATOM + k * 128 + (((c16 & 7) ^ (k & 7)) << 4);
}
__device__ __forceinline__ uint64_t wg_desc_k(uint32_t saddr)
{
    /* start >> 4 | LBO 16 B (unused for swizzled K-major) | SBO 1024 B | 128B swizzle */
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)64 << 32) |
           ((uint64_t)1 << 62);
}
__device__ __forceinline__ uint64_t wg_desc_mn(uint32_t saddr)
{
    /* start >> 4 | LBO 8 KB (next atom along m/n) | SBO 1024 B (next 8 k rows) | 128B swizzle */
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)(WG_ATOM >> 4) << 16) |
           ((uint64_t)64 << 32) | ((uint64_t)1 << 62);
}
__device__ __forceinline__ void wg_fence()
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wg_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* d += A B^T on one 64x256x16 step; TA/TB: 1 = that operand is MN-major */
template <int TA, int TB>
__device__ __forceinline__ void wg_mma(float (&d)[128], uint64_t da, uint64_t db)
{
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%"
        "24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%"
        "46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%"
        "68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%"
        "90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%"
        "110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127},"
        " %128, %129, p, 1, 1, %131, %132;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
          "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
          "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
          "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}

/* wg_stage_mma: the 4 wgmma (k 16 each) of one 64-deep stage at shared
 * address st, for the consumer warpgroup computing rows half*64 .. +64 of
 * the item, committed as one group */
template <int AM, int BMODE>
__device__ __forceinline__ void wg_stage_mma(float (&d)[128], uint32_t st, int half)
{
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        if (AM == KCU_A_K) {
            const uint64_t da = wg_desc_k(st + half * (64 * 128) + kk * 32);
            if (BMODE == KCU_B_K)
                wg_mma<0, 0>(d, da, wg_desc_k(st + WG_A_BYTES + kk * 32));
            else
                wg_mma<0, 1>(d, da, wg_desc_mn(st + WG_A_BYTES + kk * 2048));
        } else {
            wg_mma<1, 1>(d, wg_desc_mn(st + half * WG_ATOM + kk * 2048),
                         wg_desc_mn(st + WG_A_BYTES + kk * 2048));
        }
    }
    wg_commit();
}

/* wgrad item `in` of one group (ntm x ntn tiles of 128 x 256) -> (m0, n0):
 * groups of gm m-tiles walk n together, so one wave's A and B blocks
 * stay in L2 (row-major order re-read all of B once per m-tile row: dW2 of
 * Mixtral, 58 MB of w*h per expert, came from DRAM 32 times) */
__device__ __forceinline__ void wgrad_raster(int gm, int ntm, int ntn, int in, int &m0, int &n0)
{
    const int grp = in / (gm * ntn), first = grp * gm;
    const int gsz = min(gm, ntm - first), r = in - grp * gm * ntn;
    m0 = (first + r % gsz) * BM;
    n0 = (r / gsz) * WG_BN;
}

/* DSWIGLU's (da, db) of column f to global memory, over its (a, b) */
__device__ __forceinline__ void st_pair_global(int, int, bf16 *arow, int f, __nv_bfloat162 da,
                                               __nv_bfloat162 db, unsigned okm)
{
    bf16 *pa = arow + (f >> 3) * 16;
    quad_pair_store(pa, pa + 8, *reinterpret_cast<const uint32_t *>(&da),
                    *reinterpret_cast<const uint32_t *>(&db), (f & 7) >> 1, okm);
}

/* the backward epilogues (DSWIGLU / DGELU: d = dy.W2, the unweighted dh) of
 * this warp's 16 rows m0 + rb + [0, 16), as wg_epilogue; ld(hr, jj, arow,
 * a, b) loads the pre-activation pairs of fragment column jj (0..31) of
 * row half hr, arow being the row's (a, b) in global memory, and st(hr,
 * jj, arow, f, da, db, okm) stores DSWIGLU's gradients over them: in global
 * memory (wg_epilogue; okm: the lanes whose row exists) or in the staged
 * copy (stage_dswiglu) */
template <int EPI, class LD, class ST>
__device__ __forceinline__ void wg_dact(const kcu_gemm_args &p, const float (&d)[128], int m0,
                                        int n0, int rend, int rb, int lane, LD ld, ST st)
{
    using A = epi_act<EPI>;                    /* DSWIGLU: act_swiglu, DGELU: act_gelu */
    auto rnd = [](float x) { return rbf(x); }; /* the stored h's rounding */
    const int g = lane >> 2, q4 = lane & 3;
    /* both rows' gate weights before any store (a store could alias them:
     * loaded inside the loop they made a dependent round trip per row) */
    float wgts[2];
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int r = m0 + rb + g + hr * 8;
        wgts[hr] = p.gate_w && r < rend ? p.gate_w[p.scatter ? p.scatter[r] : r] : 1.f;
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int r = m0 + rb + g + hr * 8;
        const bool ok = r < rend;
        const unsigned okm = __ballot_sync(0xffffffffu, ok);
        float rsum = 0.f;
        if (ok) {
            const float wgt = wgts[hr];
            bf16 *arow = p.ab + (size_t)r * p.ld_ab;
            bf16 *hrow = p.h + (size_t)r * p.F;
            /* the (a, b) of CH column pairs loaded before any store */
            constexpr int CH = EPI == KCU_EPI_DSWIGLU ? 8 : 16; /* no spills */
            static_assert(CH % 2 == 0, "h leaves in column pairs");
            uint32_t hv[2];
#pragma unroll
            for (int jc = 0; jc < 32; jc += CH) {
                __nv_bfloat162 av[CH], bv[CH];
#pragma unroll
                for (int j = 0; j < CH; j++)
                    ld(hr, jc + j, arow, av[j], bv[j]);
#pragma unroll
                for (int j = 0; j < CH; j++) {
                    const int f = n0 + 8 * (jc + j) + q4 * 2;
                    const float d0 = d[4 * (jc + j) + hr * 2];
                    const float d1 = d[4 * (jc + j) + hr * 2 + 1];
                    const float2 a = __bfloat1622float2(av[j]);
                    const float2 b = __bfloat1622float2(bv[j]);
                    float h0, h1;
                    float da0, da1, db0, db1;
                    A::bwd(a.x, b.x, wgt * d0, &h0, &da0, &db0);
                    A::bwd(a.y, b.y, wgt * d1, &h1, &da1, &db1);
                    h0 = rnd(h0);
                    h1 = rnd(h1);
                    if (EPI == KCU_EPI_DSWIGLU) {
                        st(hr, jc + j, arow, f, __floats2bfloat162_rn(da0, da1),
                           __floats2bfloat162_rn(db0, db1), okm);
                    } else {
                        st_bf2(arow + f, da0, da1);
                    }
                    /* h of columns jj and jj + 1 (16 bytes apart per quad)
                     * in 8-byte pieces */
                    hv[j & 1] = pack_bf2(wgt * h0, wgt * h1);
                    if (j & 1) {
                        bf16 *hp = hrow + n0 + 8 * (jc + j - 1);
                        quad_pair_store(hp, hp + 8, hv[0], hv[1], q4, okm);
                    }
                    rsum += d0 * h0 + d1 * h1;
                }
            }
        }
        if (p.dwpart) { /* uniform branch: the shuffles need all lanes */
            rsum += __shfl_xor_sync(0xffffffffu, rsum, 1);
            rsum += __shfl_xor_sync(0xffffffffu, rsum, 2);
            if (ok && q4 == 0) { /* partials in KCU_BN columns: 2 per item */
                float *dp = p.dwpart + (size_t)r * (p.N / BN) + n0 / BN;
                dp[0] = rsum;
                dp[1] = 0.f;
            }
        }
    }
}

/* the epilogue of the wgmma kernels (v2 and v4): this warp's 16 rows m0 + rb
 * + [0, 16) of the item, 256 columns from n0, fragment d as wgmma leaves it:
 * d[4j + c]: row m0 + rb + g + (c>>1)*8, col n0 + 8j + q4*2 + (c&1) */
template <int EPI>
__device__ __forceinline__ void wg_epilogue(const kcu_gemm_args &p, const float (&d)[128], int e,
                                            int m0, int n0, int rend, int ktiles, int rb, int lane)
{
    using A = epi_act<EPI>; /* SWIGLU: act_swiglu, GELU: act_gelu */
    const int g = lane >> 2, q4 = lane & 3;
    if (EPI == KCU_EPI_DSWIGLU || EPI == KCU_EPI_DGELU) {
        wg_dact<EPI>(
            p, d, m0, n0, rend, rb, lane,
            [&](int, int jj, const bf16 *arow, __nv_bfloat162 &av, __nv_bfloat162 &bv) {
                const int f = n0 + 8 * jj + q4 * 2;
                if (EPI == KCU_EPI_DSWIGLU) {
                    const bf16 *pa = arow + (f >> 3) * 16 + (f & 7);
                    av = *reinterpret_cast<const __nv_bfloat162 *>(pa);
                    bv = *reinterpret_cast<const __nv_bfloat162 *>(pa + 8);
                } else {
                    av = *reinterpret_cast<const __nv_bfloat162 *>(arow + f);
                    bv = av;
                }
            },
            st_pair_global);
    } else if (EPI == KCU_EPI_ACC && p.Cb) { /* bf16 store: C = bf16(C + acc) */
        if (ktiles > 0 || p.beta0) {
            bf16 *C = p.Cb + (size_t)e * p.c_gstride;
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int m = m0 + rb + g + hr * 8;
                __nv_bfloat162 *crow =
                    reinterpret_cast<__nv_bfloat162 *>(C + (size_t)m * p.ldc + n0 + q4 * 2);
#pragma unroll
                for (int jc = 0; jc < 32; jc += 16) {
                    float2 o[16];
#pragma unroll
                    for (int j = 0; j < 16; j++)
                        o[j] = p.beta0 ? make_float2(0.f, 0.f)
                                       : __bfloat1622float2(crow[4 * (jc + j)]);
#pragma unroll
                    for (int j = 0; j < 16; j++)
                        crow[4 * (jc + j)] =
                            __floats2bfloat162_rn(o[j].x + d[4 * (jc + j) + hr * 2],
                                                  o[j].y + d[4 * (jc + j) + hr * 2 + 1]);
                }
            }
        }
    } else if (EPI == KCU_EPI_ACC) {
        /* fp32 C: no read back; each value leaves as a fire-and-forget
         * reduction (red.add, L2 applies C + acc, one rounding: the bits of
         * a load, an add and a store, except that PTX flushes subnormal
         * f32 reduction inputs and results to zero) or a plain store for
         * beta0, so the warpgroup goes on to its next item without a global
         * round trip; 16 bytes per instruction (quad_pair_f32). Every item
         * owns its C tile: one reduction per element and call, so the order
         * of the reductions cannot change a bit. */
        if (ktiles > 0 || p.beta0) {
            float *C = p.Cf + (size_t)e * p.c_gstride;
#pragma unroll
            for (int hr = 0; hr < 2; hr++)
                row_f32(C + (size_t)(m0 + rb + g + hr * 8) * p.ldc + n0, d, hr, q4, 0xffffffffu,
                        !p.beta0);
        }
    } else {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int r = m0 + rb + g + hr * 8;
            const bool ok = r < rend;
            /* the lanes whose row exists: the 8-byte stores pair lanes */
            const unsigned okm = __ballot_sync(0xffffffffu, ok);
            if (!ok)
                continue;
            if (EPI == KCU_EPI_F32) {
                row_f32(p.Cf + (size_t)r * p.ldc + n0, d, hr, q4, okm, false);
            } else if (EPI == KCU_EPI_SCATTER) {
                bf16 *row = p.Cb + (size_t)(p.scatter ? p.scatter[r] : r) * p.ldc + n0;
#pragma unroll
                for (int j = 0; j < 32; j += 2)
                    quad_pair_store(row + 8 * j, row + 8 * j + 8,
                                    pack_bf2(d[4 * j + hr * 2], d[4 * j + hr * 2 + 1]),
                                    pack_bf2(d[4 * j + 4 + hr * 2], d[4 * j + 4 + hr * 2 + 1]), q4,
                                    okm);
            } else if (EPI == KCU_EPI_SWIGLU) {
                /* column blocks j (gate) and j + 1 (up) of the item give h
                 * block j / 2; two such pairs per step, stored in 8-byte
                 * pieces (quad_pair_store) */
#pragma unroll
                for (int j = 0; j < 32; j += 4) {
                    uint32_t hv[2];
#pragma unroll
                    for (int jj = 0; jj < 2; jj++) {
                        const int jb = j + 2 * jj;
                        const float g0 = d[4 * jb + hr * 2], g1 = d[4 * jb + hr * 2 + 1];
                        const float u0 = d[4 * jb + 4 + hr * 2], u1 = d[4 * jb + 4 + hr * 2 + 1];
                        hv[jj] = pack_bf2(A::fwd(g0, u0), A::fwd(g1, u1));
                        if (p.ab) {
                            bf16 *ab = p.ab + (size_t)r * p.ld_ab + n0 + 8 * jb;
                            quad_pair_store(ab, ab + 8, pack_bf2(g0, g1), pack_bf2(u0, u1), q4,
                                            okm);
                        }
                    }
                    bf16 *hp = p.h + (size_t)r * p.F + (n0 + 8 * j) / 2;
                    quad_pair_store(hp, hp + 8, hv[0], hv[1], q4, okm);
                }
            } else if (EPI == KCU_EPI_GELU) {
#pragma unroll
                for (int j = 0; j < 32; j += 2) {
                    const float a0 = d[4 * j + hr * 2], a1 = d[4 * j + hr * 2 + 1];
                    const float c0 = d[4 * j + 4 + hr * 2], c1 = d[4 * j + 4 + hr * 2 + 1];
                    bf16 *hp = p.h + (size_t)r * p.F + n0 + 8 * j;
                    quad_pair_store(hp, hp + 8, pack_bf2(A::fwd(a0, 0.f), A::fwd(a1, 0.f)),
                                    pack_bf2(A::fwd(c0, 0.f), A::fwd(c1, 0.f)), q4, okm);
                    if (p.ab) {
                        bf16 *ap = p.ab + (size_t)r * p.ld_ab + n0 + 8 * j;
                        quad_pair_store(ap, ap + 8, pack_bf2(a0, a1), pack_bf2(c0, c1), q4, okm);
                    }
                }
            }
        }
    }
}

/* one work item of k_gemm_wg and this thread's load sources for it */
struct ws_item {
    int e, m0, n0, kbeg, kend, rend, ktiles;
};

template <int AM>
__device__ __forceinline__ void ws_decode(const kcu_gemm_args &p, int w, int ntm, int ntn, int tpg,
                                          ws_item &t)
{
    if (AM == KCU_A_K) {
        const int gm = p.group_m;
        const int grp = w / (gm * ntn), first = grp * gm;
        const int gsz = min(gm, ntm - first), in = w - grp * gm * ntn;
        const int mt = first + in % gsz;
        t.n0 = (in / gsz) * WG_BN;
        if (p.tile_e) {
            t.e = p.tile_e[mt];
            t.m0 = p.tile_r0[mt];
            t.rend = p.offs[t.e + 1];
        } else {
            t.e = 0;
            t.m0 = mt * BM;
            t.rend = p.M;
        }
        t.kbeg = 0;
        t.kend = p.K;
        t.ktiles = p.K / BK;
    } else {
        t.e = w / tpg;
        wgrad_raster(p.group_m, p.M / BM, ntn, w - t.e * tpg, t.m0, t.n0);
        t.kbeg = p.offs ? p.offs[t.e] : 0;
        t.kend = p.offs ? p.offs[t.e + 1] : p.K;
        t.ktiles = t.kend > t.kbeg ? (t.kend - t.kbeg + BK - 1) / BK : 0;
        t.rend = 0;
    }
}

/* the kernel's dynamic shared memory from its first 1024-byte boundary (the
 * 128-byte swizzle of the wgmma and TMA tiles needs it; the launches ask
 * for 1 KB more than they use) */
__device__ __forceinline__ uint32_t smem_base_1k()
{
    extern __shared__ uint8_t smem_raw[];
    return ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
}

/* v2's item: the decoded item plus this thread's load addresses */
struct wg_item : ws_item {
    const bf16 *a[4]; /* rows mode: this thread's 4 A rows (chunk offset included) */
    const bf16 *b;    /* B_K: row n0 + tid/8; B_N rows mode: column n0 + chunk */
    unsigned aok;     /* rows mode: bit j = A row j exists */
};

template <int AM, int BMODE, int EPI>
__global__ void __launch_bounds__(NT, 1) k_gemm_wg(const kcu_gemm_args p)
{
#if KCU_SM90 /* Hopper only: never launched from the portable image */
    const uint32_t sbase = smem_base_1k();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int ntn = p.N / WG_BN;
    int ntm = 0, tpg = 0, total;
    if (AM == KCU_A_K) {
        ntm = p.tile_e ? *p.ntiles_m : KCU_CEIL_DIV(p.M, BM);
        total = ntm * ntn;
    } else {
        tpg = (p.M / BM) * ntn;
        total = p.ngroups * tpg;
    }

    auto decode = [&](int w, wg_item &t) {
        ws_decode<AM>(p, w, ntm, ntn, tpg, t);
        t.aok = 0;
        if (AM == KCU_A_K) {
            const bf16 *Bg = p.B + (size_t)t.e * p.b_gstride;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int r = t.m0 + (tid >> 3) + 32 * j;
                const int ok = r < t.rend;
                const int sr = ok ? (p.a_gather ? p.a_gather[r] : r) : 0;
                t.aok |= (unsigned)ok << j;
                t.a[j] = p.A + (size_t)sr * p.lda + (tid & 7) * 8;
            }
            if (BMODE == KCU_B_K)
                t.b = Bg + (size_t)(t.n0 + (tid >> 3)) * p.ldb + (tid & 7) * 8;
            else
                t.b = Bg + (size_t)(tid >> 5) * p.ldb + t.n0 + (tid & 31) * 8;
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                t.a[j] = p.A;
            t.b = p.B;
        }
    };
    /* wgrad: the source rows of the next stage to load, fetched one stage
     * ahead so that the gather-index loads stay off the load-issue path;
     * -1 = past the group's rows (zero fill) */
    int ia[4], ib[8];
    auto fetch = [&](const wg_item &t, int kt) {
        const int k0 = t.kbeg + kt * BK;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int k = k0 + (tid >> 4) + 16 * j;
            ia[j] = k < t.kend ? (p.a_gather ? p.a_gather[k] : k) : -1;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int k = k0 + (tid >> 5) + 8 * j;
            ib[j] = k < t.kend ? (p.b_gather ? p.b_gather[k] : k) : -1;
        }
    };
    auto load = [&](const wg_item &t, int stage, int kt) {
        const uint32_t sa = sbase + stage * WG_STAGE_BYTES, sb = sa + WG_A_BYTES;
        const int k0 = kt * BK;
        if (AM == KCU_A_K) {
            const int row = tid >> 3, ch = tid & 7;
#pragma unroll
            for (int j = 0; j < 4; j++)
                cp_async16(sa + off_k(row + 32 * j, ch * 8), t.a[j] + k0,
                           (t.aok >> j) & 1 ? 16 : 0);
        } else {
            const int ch = tid & 15;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int kr = (tid >> 4) + 16 * j;
                cp_async16(sa + off_mnw(kr, ch),
                           p.A + (size_t)(ia[j] < 0 ? 0 : ia[j]) * p.lda + t.m0 + ch * 8,
                           ia[j] >= 0 ? 16 : 0);
            }
        }
        if (BMODE == KCU_B_K) {
            const int row = tid >> 3, ch = tid & 7;
            const size_t bstep = (size_t)32 * p.ldb;
#pragma unroll
            for (int j = 0; j < 8; j++)
                cp_async16(sb + off_k(row + 32 * j, ch * 8), t.b + j * bstep + k0, 16);
        } else {
            const int ch = tid & 31;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int kr = (tid >> 5) + 8 * j;
                if (AM == KCU_A_K)
                    cp_async16(sb + off_mnw(kr, ch), t.b + (size_t)(k0 + 8 * j) * p.ldb, 16);
                else
                    cp_async16(sb + off_mnw(kr, ch),
                               p.B + (size_t)(ib[j] < 0 ? 0 : ib[j]) * p.ldb + t.n0 + ch * 8,
                               ib[j] >= 0 ? 16 : 0);
            }
        }
    };
    auto prologue = [&](const wg_item &t) {
#pragma unroll
        for (int s = 0; s < 2; s++) {
            if (s < t.ktiles) {
                if (AM == KCU_A_M)
                    fetch(t, s);
                load(t, s, s);
            }
            cp_async_commit();
        }
        if (AM == KCU_A_M && 2 < t.ktiles)
            fetch(t, 2);
    };

    int w = blockIdx.x;
    if (w >= total)
        return;
    wg_item cur;
    decode(w, cur);
    prologue(cur);
    while (true) {
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; i++)
            d[i] = 0.f;
        for (int kt = 0; kt < cur.ktiles; kt++) {
            cp_async_wait<1>();
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            if (kt + 2 < cur.ktiles) {
                load(cur, (kt + 2) % WG_STAGES, kt + 2);
                if (AM == KCU_A_M && kt + 3 < cur.ktiles)
                    fetch(cur, kt + 3);
            }
            cp_async_commit();
            wg_stage_mma<AM, BMODE>(d, sbase + (kt % WG_STAGES) * WG_STAGE_BYTES, wg);
            wg_wait<1>();
        }
        wg_wait<0>();
        __syncthreads(); /* every warpgroup is done with the stages */

        /* issue the next item's first stages, then run this item's epilogue
         * (p.wg_ovl; else after it) */
        const int wn = w + gridDim.x;
        wg_item nxt;
        if (p.wg_ovl && wn < total) {
            decode(wn, nxt);
            prologue(nxt);
        }

        wg_epilogue<EPI>(p, d, cur.e, cur.m0, cur.n0, cur.rend, cur.ktiles,
                         wg * 64 + (warp & 3) * 16, lane);
        if (wn >= total)
            break;
        if (!p.wg_ovl) {
            decode(wn, nxt);
            prologue(nxt);
        }
        cur = nxt;
        w = wn;
    }
    cp_async_wait<0>();
#endif
}

/* raster_group: m-tiles per raster group of the wgmma kernels, rows mode
 * (KCU_GROUP_M) and weight gradients (KCU_GROUP_W), default GROUP_M */
int raster_group(int am)
{
    static int g[2] = {-1, -1};
    if (g[am] < 0) {
        const char *s = getenv(am == KCU_A_K ? "KCU_GROUP_M" : "KCU_GROUP_W");
        const int v = s ? atoi(s) : 0;
        g[am] = v >= 1 && v <= 64 ? v : GROUP_M;
    }
    return g[am];
}

/* work items (128-row m-tiles x 256-wide n tiles) of a wgmma GEMM */
long long wg_items(int am, const kcu_gemm_args *a)
{
    if (am == KCU_A_K)
        return (long long)(a->tile_e ? a->max_tiles_m : KCU_CEIL_DIV(a->M, BM)) * (a->N / WG_BN);
    return (long long)a->ngroups * (a->M / BM) * (a->N / WG_BN);
}

template <int AM, int BMODE, int EPI>
moe_err launch_wg(const kcu_gemm_args *a, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    KCU_TRY(smem_limit_once(attr_done, k_gemm_wg<AM, BMODE, EPI>, WG_SMEM_BYTES));
    const long long total = wg_items(AM, a);
    if (total <= 0)
        return MOE_OK;
    const int grid = (int)(total < nsm ? total : nsm);
    /* KCU_WG_OVL=0|1 forces the overlap of the next item's loads with the
     * epilogue off or on (A/B timing); default: on except for the forward
     * K-major GEMMs */
    static int ovl = -2;
    if (ovl == -2) {
        const char *o = getenv("KCU_WG_OVL");
        ovl = o ? atoi(o) != 0 : -1;
    }
    kcu_gemm_args b = *a;
    b.wg_ovl = ovl >= 0 ? ovl : !(AM == KCU_A_K && BMODE == KCU_B_K);
    b.group_m = raster_group(AM);
    k_gemm_wg<AM, BMODE, EPI><<<grid, NT, WG_SMEM_BYTES, st>>>(b);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

/* ---- v4: warp-specialised wgmma (sm_90a), every mode ----
 * Same 128x256x64 tiles, shared-memory layouts, wgmma sequence and
 * epilogues as v2 (so the same results bit for bit), 384 threads:
 *  warpgroup 0, producer (setmaxnreg 40): fills WS_STAGES stages guarded by
 *    mbarriers full[s] / empty[s]. Dense row-major operands come by TMA
 *    (cp.async.bulk.tensor, 128-byte swizzle; tensor maps built on the host):
 *    the expert weights B in rows mode, A in rows mode when not gathered, A
 *    and B of the weight gradients when not gathered (except a group's last,
 *    partial k tile, whose rows past the group must read as zero). Gathered
 *    rows (and everything when KCU_WS_TMA=0) come by cp.async from the 128
 *    producer threads, each completing with cp.async.mbarrier.arrive.noinc.
 *  warpgroups 1, 2, consumers (setmaxnreg 232): each computes 64x256 of the
 *    item as in v2: wait full[s], 4 wgmma, commit, wait_group 1, then release
 *    the previous stage (empty, one arrival per warp); epilogue from
 *    registers straight to global memory while the producer already fills
 *    the next item's stages.
 * full[s] expects 1 arrival (thread 0's arrive.expect_tx, with the TMA
 * bytes) plus 128 (the cp.async arrivals) unless every operand comes by TMA;
 * empty[s] expects 8 (one per consumer warp). Stage it of the kernel's
 * sequence is it % WS_STAGES, round parity (it / WS_STAGES) & 1; both roles
 * walk the same items in the same order. 4 stages: 48 KB each, 5 would not
 * fit in 227 KB. */
constexpr int WS_STAGES = 4, WS_NT = 384, WS_PRODUCER_REGS = 40, WS_CONSUMER_REGS = 232;
constexpr int WS_BAR_OFF = WS_STAGES * WG_STAGE_BYTES;
/* the staged epilogue's slots (ws_stage): 2 per consumer warpgroup, each one
 * TMA box of 64 rows x 128 bytes, 1024-byte aligned for the 128-byte swizzle */
constexpr int WS_EPI_SLOT = 64 * 128;
constexpr int WS_EPI_OFF = WS_BAR_OFF + 1024;
constexpr int WS_SMEM_BYTES = WS_EPI_OFF + 4 * WS_EPI_SLOT + 1024;
static_assert(WS_SMEM_BYTES <= 227 * 1024, "v4 stages do not fit in shared memory");
static_assert(128 * WS_PRODUCER_REGS + 256 * WS_CONSUMER_REGS <= 65536 / WS_NT / 8 * 8 * WS_NT,
              "setmaxnreg budget exceeds the launch allocation");

/* tensor maps of the dense operands (kernel parameter, __grid_constant__) */
struct ws_maps {
    CUtensorMap a;  /* ta: rows mode (K, rows) box (64, 128); wgrad (M, rows) box (64, 64) */
    CUtensorMap b;  /* tb: rows mode B_K (K, N, E) box (64, 256, 1), B_N (N, K, E) box (64, 64,
                     * 1); wgrad (N, rows) box (64, 64) */
    CUtensorMap c;  /* tc, staged epilogue: ACC fp32 C (N, M, groups) box (32, 64, 1) */
    CUtensorMap ab; /* tab, staged epilogue: DSWIGLU's (a, b) (2F, rows) box (64, 128); tsw:
                     * SWIGLU's (a, b) output, the same map */
    CUtensorMap h;  /* tsw: SWIGLU's h (F, rows) box (64, 128) */
    int ta, tb, tc, tab, tsw;
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* wait until the phase of parity `parity` of bar has completed; CLUSTER:
 * with acquire at cluster scope (the arrivals came from a peer CTA with
 * data written there, the dynamic schedule's item ring) */
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    uint32_t done;
    do {
        if (CLUSTER)
            asm volatile("{\n.reg .pred p;\n"
                         "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done)
                         : "r"(bar), "r"(parity)
                         : "memory");
        else
            asm volatile("{\n.reg .pred p;\n"
                         "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done)
                         : "r"(bar), "r"(parity)
                         : "memory");
    } while (!done);
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* the shared::cluster address of this CTA's shared offset `addr` in CTA `rank` */
__device__ __forceinline__ uint32_t cluster_smem(uint32_t addr, uint32_t rank)
{
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
/* arrive on the mbarrier at the same shared offset in CTA `rank` of the cluster */
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank)
{
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_smem(bar, rank))
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
/* arrive on bar when this thread's earlier cp.async have landed; counted in
 * the barrier's expected arrivals (.noinc) */
__device__ __forceinline__ void cp_async_arrive(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap *m, int c0, int c1,
                                       uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap *m, int c0, int c1, int c2,
                                       uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}
/* keep the compiler from moving accumulator reads above a wgmma wait */
__device__ __forceinline__ void wg_pin(float (&d)[128])
{
#pragma unroll
    for (int i = 0; i < 128; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* ---- the staged epilogue of v4 (KCU_WS_TMA_STORE=0 turns it off) ----
 * The accumulators leave through shared memory and TMA stores
 * (cp.async.bulk.tensor; an accumulating fp32 C by the .add reduction, which
 * L2 applies) instead of the threads' own global stores: the bulk stores
 * drain while the warpgroup already runs the next item's wgmma, where the
 * register epilogue (wg_epilogue) kept the tensor cores idle for its whole
 * global round trip. Each consumer warpgroup owns two slots; box n of its
 * sequence goes to slot n & 1. Per box: every thread writes its values
 * (128-byte swizzle: row r's 16-byte chunk c at (c ^ (r & 7)) * 16),
 * fence.proxy.async, the leader (the warpgroup's thread 0) waits until every
 * earlier store has read its slot (the previous box's, in the other slot),
 * a named barrier over the warpgroup, and the leader issues the store. So a
 * slot is rewritten only after the store that read it is done reading.
 * Same values and roundings as wg_epilogue (the .add reduction rounds
 * C + acc once, as the register path does), so the same bits. Used for ACC
 * with an fp32 C: the weight gradients. Measured on Mixtral's dW13 (H100):
 * 6.7-6.9 ms here, 7.7 with the register epilogue's old read-back, 7.4-7.7
 * with its fire-and-forget reductions (which do help v2: bench/NOTES.md). */
struct ws_stage {
    uint32_t slot0; /* this warpgroup's two slots */
    uint32_t n;     /* boxes staged so far */
    int bar;        /* named barrier of the warpgroup: 1 + its consumer index */
    bool leader;    /* the warpgroup's thread 0: issues the stores, waits on them */
};
__device__ __forceinline__ uint32_t stage_slot(const ws_stage &s)
{
    return s.slot0 + (s.n & 1) * WS_EPI_SLOT;
}
/* shared address of byte `byte` (< 128) of row `row` in a swizzled box */
__device__ __forceinline__ uint32_t box_addr(uint32_t slot, int row, int byte)
{
    return slot + row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
}
__device__ __forceinline__ void sts_f2(uint32_t a, float x, float y)
{
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(x), "f"(y) : "memory");
}
/* the current slot holds a whole box: store it at (c0, c1, c2) of the
 * rank-3 map m (add: reduce into the destination instead) */
__device__ __forceinline__ void stage_issue(ws_stage &s, const CUtensorMap *m, int c0, int c1,
                                            int c2, int add)
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if (s.leader)
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(s.bar) : "memory");
    if (s.leader) {
        const uint32_t src = stage_slot(s);
        const uint64_t mp = reinterpret_cast<uint64_t>(m);
        if (add)
            asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group "
                         "[%0, {%1, %2, %3}], [%4];\n" ::"l"(mp),
                         "r"(c0), "r"(c1), "r"(c2), "r"(src)
                         : "memory");
        else
            asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group "
                         "[%0, {%1, %2, %3}], [%4];\n" ::"l"(mp),
                         "r"(c0), "r"(c1), "r"(c2), "r"(src)
                         : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
    s.n++;
}
/* the warpgroup's stores complete (before the CTA exits) */
__device__ __forceinline__ void stage_drain(const ws_stage &s)
{
    if (s.leader)
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

/* ACC, fp32 C: this warpgroup's 64 x 256 of C_e at (m0, n0) (+)= acc as 8
 * boxes of 64 rows x 32 columns; rw: this warp's first row in the box,
 * fragment d as in wg_epilogue */
__device__ __forceinline__ void stage_acc(const kcu_gemm_args &p, const ws_maps &mp,
                                          const float (&d)[128], int e, int m0, int n0, int rw,
                                          int lane, ws_stage &s)
{
    const int g = lane >> 2, q4 = lane & 3;
#pragma unroll
    for (int c = 0; c < 8; c++) {
        const uint32_t slot = stage_slot(s);
#pragma unroll
        for (int hr = 0; hr < 2; hr++)
#pragma unroll
            for (int jj = 0; jj < 4; jj++)
                sts_f2(box_addr(slot, rw + g + 8 * hr, (8 * jj + 2 * q4) * 4),
                       d[4 * (4 * c + jj) + 2 * hr], d[4 * (4 * c + jj) + 2 * hr + 1]);
        stage_issue(s, &mp.c, n0 + 32 * c, m0, e, !p.beta0);
    }
}

/* ---- dh's (a, b) by TMA into the stages (KCU_WS_TMA_AB=0 turns it off) ----
 * DSWIGLU reads the item's pre-activations, 128 rows x 512 bf16 (a and b
 * interleaved by 8, 128 KB); the register epilogue loads them in 8
 * dependent rounds of global loads while the tensor cores wait (the whole
 * epilogue: 22 of a 73 us item on Mixtral's dh, measured; 19-20 with this
 * staging, bench/NOTES.md). Here the producer loads them into
 * the AB_STAGES stages that follow the item's k steps, as AB_BOXES boxes of
 * 64 columns x 128 rows (128-byte swizzle, three per stage), right after the
 * item's last k step: they land while the consumers finish the item's math.
 * Both roles count those stages in their stage sequence; the consumers
 * release them after the epilogue. Same values, same bits. */
constexpr int AB_BOXES = 8, AB_BOX_BYTES = 128 * 128, AB_PER_STAGE = 3;
constexpr int AB_STAGES = (AB_BOXES + AB_PER_STAGE - 1) / AB_PER_STAGE;
static_assert(AB_PER_STAGE * AB_BOX_BYTES <= WG_STAGE_BYTES, "(a, b) boxes exceed a stage");
static_assert(AB_STAGES < WS_STAGES, "(a, b) stages leave no stage for the next item");

__device__ __forceinline__ uint32_t lds_u32(uint32_t a)
{
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a) : "memory");
    return v;
}

/* producer (one thread): stage j (0..AB_STAGES-1) of item (m0, n0)'s (a, b)
 * into shared stage address sa, completing on fb */
__device__ __forceinline__ void ab_issue(const ws_maps &mp, uint32_t sa, uint32_t fb, int j, int m0,
                                         int n0)
{
    const int b0 = AB_PER_STAGE * j, nb = min(AB_PER_STAGE, AB_BOXES - b0);
    mbar_arrive_tx(fb, (uint32_t)nb * AB_BOX_BYTES);
    for (int i = 0; i < nb; i++)
        tma_2d(sa + i * AB_BOX_BYTES, &mp.ab, 2 * n0 + 64 * (b0 + i), m0, fb);
}

/* consumers: wait for the item's AB_STAGES stages (sequence numbers it..)
 * and take their shared addresses */
__device__ __forceinline__ void ab_wait(uint32_t full0, uint32_t sbase, uint32_t it,
                                        uint32_t (&sta)[AB_STAGES])
{
#pragma unroll
    for (int j = 0; j < AB_STAGES; j++) {
        const uint32_t s = (it + j) % WS_STAGES;
        mbar_wait(full0 + 8 * s, ((it + j) / WS_STAGES) & 1);
        sta[j] = sbase + s * WG_STAGE_BYTES;
    }
}

__device__ __forceinline__ void sts_u32(uint32_t a, uint32_t v)
{
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 lds_u128(uint32_t a)
{
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(a)
                 : "memory");
    return v;
}

/* consumer warpgroup cw: DSWIGLU of its 64 rows of the item from the staged
 * (a, b); sta: the shared addresses of the item's AB_STAGES stages. (da,
 * db) overwrite (a, b) in the boxes, then the warpgroup copies its rows out
 * in 16-byte chunks, a warp writing 512 contiguous bytes of a row, instead
 * of every thread's 4-byte stores (8 rows x 16 bytes per warp instruction).
 * Rows past rend are not written (they are the next expert's). */
__device__ __forceinline__ void stage_dswiglu(const kcu_gemm_args &p, const float (&d)[128],
                                              const uint32_t (&sta)[AB_STAGES], int m0, int n0,
                                              int rend, int cw, int warp, int lane)
{
    const int g = lane >> 2, q4 = lane & 3, rb = cw * 64 + (warp & 3) * 16;
    /* pair jj of row half hr: item columns 16 jj + 2 q4 (a) and + 8 (b), box
     * jj / 4; b is the next 16-byte chunk, which the swizzle puts elsewhere */
    auto at = [&](int hr, int jj, int b) {
        const int box = jj >> 2;
        return box_addr(sta[box / AB_PER_STAGE] + (box % AB_PER_STAGE) * AB_BOX_BYTES,
                        rb + g + 8 * hr, (jj & 3) * 32 + 4 * q4 + 16 * b);
    };
    wg_dact<KCU_EPI_DSWIGLU>(
        p, d, m0, n0, rend, rb, lane,
        [&](int hr, int jj, const bf16 *, __nv_bfloat162 &av, __nv_bfloat162 &bv) {
            const uint32_t a = lds_u32(at(hr, jj, 0)), b = lds_u32(at(hr, jj, 1));
            av = *reinterpret_cast<const __nv_bfloat162 *>(&a);
            bv = *reinterpret_cast<const __nv_bfloat162 *>(&b);
        },
        [&](int hr, int jj, bf16 *, int, __nv_bfloat162 da, __nv_bfloat162 db, unsigned) {
            sts_u32(at(hr, jj, 0), *reinterpret_cast<const uint32_t *>(&da));
            sts_u32(at(hr, jj, 1), *reinterpret_cast<const uint32_t *>(&db));
        });
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
    /* the warpgroup's 64 rows x 64 chunks of 16 bytes (8 boxes of 8) */
    const int t = (warp & 3) * 32 + lane;
#pragma unroll 4
    for (int i = t; i < 64 * 64; i += 128) {
        const int row = i >> 6, ch = i & 63, box = ch >> 3;
        const int r = m0 + 64 * cw + row;
        if (r >= rend)
            break; /* rows grow with i */
        const uint32_t base = sta[box / AB_PER_STAGE] + (box % AB_PER_STAGE) * AB_BOX_BYTES;
        const uint4 v = lds_u128(box_addr(base, 64 * cw + row, (ch & 7) * 16));
        *reinterpret_cast<uint4 *>(p.ab + (size_t)r * p.ld_ab + 2 * n0 + ch * 8) = v;
    }
}

/* producer (one thread): the AB_STAGES stages after item (m0, n0)'s k steps,
 * sequence numbers it.. (it moves past them); has = 0 (a v7 CTA without a
 * tile): the stages complete empty, so that both CTAs walk one sequence */
__device__ __forceinline__ void ab_produce(const ws_maps &mp, uint32_t full0, uint32_t empty0,
                                           uint32_t sbase, uint32_t &it, int m0, int n0, bool has)
{
    for (int j = 0; j < AB_STAGES; j++, it++) {
        const int s = it % WS_STAGES;
        const uint32_t fb = full0 + 8 * s;
        mbar_wait(empty0 + 8 * s, ((it / WS_STAGES) & 1) ^ 1);
        if (has)
            ab_issue(mp, sbase + s * WG_STAGE_BYTES, fb, j, m0, n0);
        else
            mbar_arrive(fb);
    }
}

/* consumer warpgroup cw: DSWIGLU of the item from its staged (a, b) (when
 * has), then the stages handed back to this CTA's producer and, for v7
 * (peer >= 0), to the cluster peer's; it moves past them */
__device__ __forceinline__ void ab_epilogue(const kcu_gemm_args &p, const float (&d)[128],
                                            uint32_t full0, uint32_t empty0, uint32_t sbase,
                                            uint32_t &it, int m0, int n0, int rend, int cw,
                                            int warp, int lane, bool has, int peer)
{
    uint32_t sta[AB_STAGES];
    ab_wait(full0, sbase, it, sta);
    if (has)
        stage_dswiglu(p, d, sta, m0, n0, rend, cw, warp, lane);
    __syncwarp(); /* every lane's reads of the stages before lane 0 frees them */
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < AB_STAGES; j++) {
            const uint32_t eb = empty0 + 8 * ((it + j) % WS_STAGES);
            mbar_arrive(eb);
            if (peer >= 0)
                mbar_arrive_cluster(eb, (uint32_t)peer);
        }
    it += AB_STAGES;
}

/* the epilogue of one v4 / v7 item for consumer warpgroup cw: staged where
 * it applies, else wg_epilogue */
template <int EPI>
__device__ __forceinline__ void ws_epilogue(const kcu_gemm_args &p, const ws_maps &mp,
                                            const float (&d)[128], int e, int m0, int n0, int rend,
                                            int ktiles, int cw, int warp, int lane, ws_stage &s)
{
    const int rw = (warp & 3) * 16, mw = m0 + 64 * cw;
    if (EPI == KCU_EPI_ACC && mp.tc) {
        if (ktiles > 0 || p.beta0)
            stage_acc(p, mp, d, e, mw, n0, rw, lane, s);
    } else {
        wg_epilogue<EPI>(p, d, e, m0, n0, rend, ktiles, cw * 64 + rw, lane);
    }
}

/* thread 0 of a warp-specialised kernel (v4, v7, v9): the stage ring's
 * barriers, full[s] expecting nfull arrivals and empty[s] nempty */
__device__ __forceinline__ void ws_stage_bars_init(uint32_t full0, uint32_t empty0, uint32_t nfull,
                                                   uint32_t nempty)
{
#pragma unroll
    for (int s = 0; s < WS_STAGES; s++) {
        mbar_init(full0 + 8 * s, nfull);
        mbar_init(empty0 + 8 * s, nempty);
    }
}
/* after every barrier init: visible to the cluster and to the async proxy */
__device__ __forceinline__ void ws_bars_fence()
{
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void prefetch_tmap(const CUtensorMap *m)
{
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(m)) : "memory");
}
/* a clustered producer's tail (v7, v9): its last WS_STAGES stages released by
 * both CTAs' consumers, so that no remote arrival reaches an exited CTA */
__device__ __forceinline__ void ws_stages_drained(uint32_t empty0, uint32_t it)
{
    for (int i = 0; i < WS_STAGES; i++, it++)
        mbar_wait(empty0 + 8 * (it % WS_STAGES), ((it / WS_STAGES) & 1) ^ 1);
}

/* v4 / v9 producer threads (tid 0..127), weight-gradient mode: the k tile
 * k0 of rows up to kend by cp.async - A's 128 columns from m0 into stage
 * address sa (ldA), B's 256 from n0 into sb (ldB); rows past kend read as
 * zero (a group's last, partial tile). GATHER = 0: the rows are dense (no
 * index loads; v9's producer has no registers for them) */
template <bool GATHER>
__device__ __forceinline__ void wgrad_cp_async(const kcu_gemm_args &p, int m0, int n0, int k0,
                                               int kend, uint32_t sa, uint32_t sb, int tid,
                                               bool ldA, bool ldB)
{
    if (ldA) { /* rows (tid >> 4) + 8 j, 16-byte chunk tid & 15 */
        const int ch = tid & 15;
        int src[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int k = k0 + (tid >> 4) + 8 * j;
            src[j] = k < kend ? (GATHER && p.a_gather ? p.a_gather[k] : k) : -1;
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
            cp_async16(sa + off_mnw((tid >> 4) + 8 * j, ch),
                       p.A + (size_t)(src[j] < 0 ? 0 : src[j]) * p.lda + m0 + ch * 8,
                       src[j] >= 0 ? 16 : 0);
    }
    if (ldB) { /* rows (tid >> 5) + 4 j, 16-byte chunk tid & 31 */
        const int ch = tid & 31;
#pragma unroll
        for (int jh = 0; jh < 16; jh += 8) {
            int src[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int k = k0 + (tid >> 5) + 4 * (jh + j);
                src[j] = k < kend ? (GATHER && p.b_gather ? p.b_gather[k] : k) : -1;
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
                cp_async16(sb + off_mnw((tid >> 5) + 4 * (jh + j), ch),
                           p.B + (size_t)(src[j] < 0 ? 0 : src[j]) * p.ldb + n0 + ch * 8,
                           src[j] >= 0 ? 16 : 0);
        }
    }
}

template <int AM, int BMODE, int EPI>
__global__ void __launch_bounds__(WS_NT, 1)
    k_gemm_ws(const kcu_gemm_args p, const __grid_constant__ ws_maps mp)
{
#if KCU_SM90 /* Hopper only: never launched from the portable image */
    const uint32_t sbase = smem_base_1k(), full0 = sbase + WS_BAR_OFF,
                   empty0 = full0 + WS_STAGES * 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    /* every operand by TMA (rows mode only): thread 0 alone produces */
    const bool cpa = !(AM == KCU_A_K && mp.ta && mp.tb);
    if (tid == 0) {
        ws_stage_bars_init(full0, empty0, cpa ? 129 : 1, 8);
        ws_bars_fence();
    }
    __syncthreads();
    kcu_pdl_wait(); /* launched with PDL: the predecessor's outputs from here on */
    kcu_pdl_trigger();

    const int ntn = p.N / WG_BN;
    int ntm = 0, tpg = 0, total;
    if (AM == KCU_A_K) {
        ntm = p.tile_e ? *p.ntiles_m : KCU_CEIL_DIV(p.M, BM);
        total = ntm * ntn;
    } else {
        tpg = (p.M / BM) * ntn;
        total = p.ngroups * tpg;
    }

    if (wg == 0) {
        /* ---------------- producer ---------------- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WS_PRODUCER_REGS));
        if (!cpa && tid != 0) /* every operand by TMA: thread 0 produces alone */
            return;
        if (tid == 0) {
            if (mp.ta)
                prefetch_tmap(&mp.a);
            if (mp.tb)
                prefetch_tmap(&mp.b);
        }
        uint32_t it = 0;
        for (int w = blockIdx.x; w < total; w += gridDim.x) {
            ws_item t;
            ws_decode<AM>(p, w, ntm, ntn, tpg, t);
            if (AM == KCU_A_K) {
                const bf16 *Bg = p.B + (size_t)t.e * p.b_gstride;
                for (int kt = 0; kt < t.ktiles; kt++, it++) {
                    const int s = it % WS_STAGES;
                    const uint32_t fb = full0 + 8 * s, sa = sbase + s * WG_STAGE_BYTES,
                                   sb = sa + WG_A_BYTES;
                    const int k0 = kt * BK;
                    mbar_wait(empty0 + 8 * s, ((it / WS_STAGES) & 1) ^ 1);
                    if (tid == 0) {
                        const uint32_t tx = (mp.ta ? WG_A_BYTES : 0) + (mp.tb ? WG_B_BYTES : 0);
                        if (tx) {
                            mbar_arrive_tx(fb, tx);
                            if (mp.ta)
                                tma_2d(sa, &mp.a, k0, t.m0, fb);
                            if (mp.tb) {
                                if (BMODE == KCU_B_K) {
                                    tma_3d(sb, &mp.b, k0, t.n0, t.e, fb);
                                } else {
#pragma unroll
                                    for (int a4 = 0; a4 < 4; a4++)
                                        tma_3d(sb + a4 * WG_ATOM, &mp.b, t.n0 + 64 * a4, k0, t.e,
                                               fb);
                                }
                            }
                        } else {
                            mbar_arrive(fb);
                        }
                    }
                    if (!cpa)
                        continue;
                    if (!mp.ta) {
                        /* rows (tid >> 3) + 16 j, 16-byte chunk tid & 7; the source
                         * rows are loaded again for each stage (L1 hits): kept in
                         * registers they would spill at 40 registers */
                        const int ch = tid & 7;
                        int src[8];
#pragma unroll
                        for (int j = 0; j < 8; j++) {
                            const int r = t.m0 + (tid >> 3) + 16 * j;
                            src[j] = r < t.rend ? (p.a_gather ? p.a_gather[r] : r) : -1;
                        }
#pragma unroll
                        for (int j = 0; j < 8; j++)
                            cp_async16(sa + off_k((tid >> 3) + 16 * j, ch * 8),
                                       p.A + (size_t)(src[j] < 0 ? 0 : src[j]) * p.lda + k0 +
                                           ch * 8,
                                       src[j] >= 0 ? 16 : 0);
                    }
                    if (!mp.tb) {
                        if (BMODE == KCU_B_K) {
                            const int ch = tid & 7;
                            const bf16 *src =
                                Bg + (size_t)(t.n0 + (tid >> 3)) * p.ldb + k0 + ch * 8;
#pragma unroll
                            for (int j = 0; j < 16; j++)
                                cp_async16(sb + off_k((tid >> 3) + 16 * j, ch * 8),
                                           src + (size_t)(16 * j) * p.ldb, 16);
                        } else {
                            const int ch = tid & 31;
                            const bf16 *src =
                                Bg + (size_t)(k0 + (tid >> 5)) * p.ldb + t.n0 + ch * 8;
#pragma unroll
                            for (int j = 0; j < 16; j++)
                                cp_async16(sb + off_mnw((tid >> 5) + 4 * j, ch),
                                           src + (size_t)(4 * j) * p.ldb, 16);
                        }
                    }
                    cp_async_arrive(fb);
                }
                if (EPI == KCU_EPI_DSWIGLU && mp.tab)
                    ab_produce(mp, full0, empty0, sbase, it, t.m0, t.n0, true);
            } else {
                for (int kt = 0; kt < t.ktiles; kt++, it++) {
                    const int s = it % WS_STAGES;
                    const uint32_t fb = full0 + 8 * s, sa = sbase + s * WG_STAGE_BYTES,
                                   sb = sa + WG_A_BYTES;
                    const int k0 = t.kbeg + kt * BK;
                    /* a group's last partial k tile: cp.async with zero fill */
                    const bool whole = k0 + BK <= t.kend;
                    const bool tA = mp.ta && whole, tB = mp.tb && whole;
                    mbar_wait(empty0 + 8 * s, ((it / WS_STAGES) & 1) ^ 1);
                    if (tid == 0) {
                        const uint32_t tx = (tA ? WG_A_BYTES : 0) + (tB ? WG_B_BYTES : 0);
                        if (tx) {
                            mbar_arrive_tx(fb, tx);
                            if (tA) {
#pragma unroll
                                for (int a2 = 0; a2 < 2; a2++)
                                    tma_2d(sa + a2 * WG_ATOM, &mp.a, t.m0 + 64 * a2, k0, fb);
                            }
                            if (tB) {
#pragma unroll
                                for (int a4 = 0; a4 < 4; a4++)
                                    tma_2d(sb + a4 * WG_ATOM, &mp.b, t.n0 + 64 * a4, k0, fb);
                            }
                        } else {
                            mbar_arrive(fb);
                        }
                    }
                    wgrad_cp_async<true>(p, t.m0, t.n0, k0, t.kend, sa, sb, tid, !tA, !tB);
                    cp_async_arrive(fb);
                }
            }
        }
        if (cpa)
            cp_async_wait<0>(); /* leave no cp.async of this thread in flight */
        return;
    }

    /* ---------------- consumers ---------------- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WS_CONSUMER_REGS));
    const int cw = wg - 1; /* rows cw*64 .. +64 of the item */
    ws_stage stg = {sbase + WS_EPI_OFF + 2u * WS_EPI_SLOT * cw, 0u, 1 + cw, (tid & 127) == 0};
    uint32_t it = 0;
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
        ws_item t;
        ws_decode<AM>(p, w, ntm, ntn, tpg, t);
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; i++)
            d[i] = 0.f;
        wg_pin(d); /* zeroed before the first wgmma.fence */
        for (int kt = 0; kt < t.ktiles; kt++, it++) {
            const int s = it % WS_STAGES;
            mbar_wait(full0 + 8 * s, (it / WS_STAGES) & 1);
            if (cpa) /* stages written by cp.async (generic proxy), read by wgmma (async proxy) */
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            wg_stage_mma<AM, BMODE>(d, sbase + s * WG_STAGE_BYTES, cw);
            wg_wait<1>();
            /* the previous stage's wgmma are complete: hand it back */
            if (kt > 0 && lane == 0)
                mbar_arrive(empty0 + 8 * ((it + WS_STAGES - 1) % WS_STAGES));
        }
        wg_wait<0>();
        wg_pin(d);
        if (t.ktiles > 0 && lane == 0)
            mbar_arrive(empty0 + 8 * ((it + WS_STAGES - 1) % WS_STAGES));
        if (EPI == KCU_EPI_DSWIGLU && mp.tab) {
            ab_epilogue(p, d, full0, empty0, sbase, it, t.m0, t.n0, t.rend, cw, warp, lane, true,
                        -1);
        } else {
            ws_epilogue<EPI>(p, mp, d, t.e, t.m0, t.n0, t.rend, t.ktiles, cw, warp, lane, stg);
        }
    }
    stage_drain(stg);
#endif
}

template <int AM, int BMODE, int EPI>
moe_err launch_ws(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    KCU_TRY(smem_limit_once(attr_done, k_gemm_ws<AM, BMODE, EPI>, WS_SMEM_BYTES));
    const long long total = wg_items(AM, a);
    if (total <= 0)
        return MOE_OK;
    const int grid = (int)(total < nsm ? total : nsm);
    kcu_gemm_args b = *a;
    b.group_m = raster_group(AM);
    KCU_CHECK(kcu_launch(k_gemm_ws<AM, BMODE, EPI>, dim3(grid), dim3(WS_NT), WS_SMEM_BYTES, st,
                         a->pdl, 0, b, m));
    return MOE_OK;
}

/* ---- v7: v4 on 2-CTA clusters with the weight tile multicast (rows mode,
 * every operand by TMA) ----
 * The two CTAs of a cluster take the m-tiles 2q and 2q+1 of the tile list at
 * the same n0 (pair item q x n). When both tiles exist and belong to the same
 * expert they need the same B (weight) tile at every k step: CTA r loads half
 * r of it (128 of the 256 n rows, or 2 of the 4 MN-major atoms) with
 * .multicast::cluster into both CTAs' shared memory, so L2 serves each weight
 * byte once per pair instead of twice (A stays per CTA). Otherwise (expert
 * boundary, or the last tile of an odd count) each CTA loads its whole B; a
 * CTA without a tile runs the stages empty so that both walk the same stage
 * sequence. full[s] expects 1 arrival (the local producer's expect_tx with
 * A + B bytes; the peer's half lands on it too), empty[s] 16: every consumer
 * warp of both CTAs releases the stage in both CTAs (a CTA may refill its
 * half of the peer's stage only when the peer is done with it). The producer
 * waits for the last stages' releases before it exits (no remote arrival
 * may reach an exited CTA). Same tiles, wgmma sequence and epilogue as v4:
 * the same bits. */
__device__ __forceinline__ uint32_t cluster_rank()
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync_all()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}
__device__ __forceinline__ void tma_3d_mc(uint32_t dst, const CUtensorMap *m, int c0, int c1,
                                          int c2, uint32_t bar, uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
                 : "memory");
}

/* ---- v7's dynamic schedule (kcu_gemm_args.sched) ----
 * Statically each cluster walks w = cid, cid + ncl, ...; the clusters drift
 * apart over a kernel, so the pairs of one raster group that need the same
 * weight tile reach it at different times, and it comes from DRAM more than
 * once (Mixtral's f.up read ~4.7x its weights from DRAM whatever the group
 * size, bench/NOTES.md). With sched, CTA 0's producer of each cluster takes
 * its next item from a global counter (sched[0], atomicAdd) as it starts
 * one, so the items in flight are always the ~ncl most recently dealt.
 * It publishes each item number in a ring of WQ slots in both CTAs' shared
 * memory (qfull: 1 arrival, a release at cluster scope); each consumer warp
 * of both CTAs and CTA 1's producer read it and arrive on CTA 0's qempty
 * (WQ_READERS arrivals) before the slot is written again. A number >= total
 * ends every role. The last cluster out (sched[1] counts them) sets both
 * words back to zero for the next launch. */
constexpr int WQ = 4, WQ_READERS = 2 * 8 + 1;
constexpr int WQ_OFF = 2 * WS_STAGES * 8; /* from full0: qfull[WQ], qempty[WQ], slots */
static_assert(WQ_OFF + 16 * WQ + 4 * WQ <= 1024, "the item ring exceeds the barrier area");

/* arrive on bar in CTA `rank` with release at cluster scope: this thread's
 * earlier shared-memory reads and writes, in either CTA, come before it */
__device__ __forceinline__ void mbar_arrive_release_cluster(uint32_t bar, uint32_t rank)
{
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(
                     cluster_smem(bar, rank))
                 : "memory");
}
__device__ __forceinline__ void sts_cluster_u32(uint32_t addr, uint32_t rank, uint32_t v)
{
    asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(cluster_smem(addr, rank)), "r"(v)
                 : "memory");
}
/* CTA 0's producer: item w as the cluster's n-th, into both CTAs' slot */
__device__ __forceinline__ void wq_publish(uint32_t qb, uint32_t n, int w)
{
    const uint32_t q = n % WQ;
    mbar_wait<true>(qb + 8 * WQ + 8 * q, ((n / WQ) & 1) ^ 1); /* its readers are done */
    sts_cluster_u32(qb + 16 * WQ + 4 * q, 0, (uint32_t)w);
    sts_cluster_u32(qb + 16 * WQ + 4 * q, 1, (uint32_t)w);
    mbar_arrive_release_cluster(qb + 8 * q, 0);
    mbar_arrive_release_cluster(qb + 8 * q, 1);
}
/* a reader (lane < 0: one thread; else the whole warp calls it and lane 0
 * reads for all): the cluster's n-th item. The slot is freed with a
 * CTA-scope release, as the stages are: a cluster-scope one would first
 * wait for the epilogue's global stores (measured: Qwen3's f.down 13%
 * slower). */
__device__ __forceinline__ int wq_take(uint32_t qb, uint32_t n, int lane)
{
    const uint32_t q = n % WQ;
    mbar_wait<true>(qb + 8 * q, (n / WQ) & 1);
    int w = 0;
    if (lane <= 0) {
        w = (int)lds_u32(qb + 16 * WQ + 4 * q);
        mbar_arrive_cluster(qb + 8 * WQ + 8 * q, 0);
    }
    return lane < 0 ? w : __shfl_sync(0xffffffffu, w, 0);
}
/* the end of a dynamic-schedule kernel: every thread still running in both
 * CTAs (exited ones count as arrived), so that no shared-memory access of
 * the item ring can reach a CTA that has exited */
__device__ __forceinline__ void cluster_sync_exit()
{
    asm volatile("barrier.cluster.arrive.release;\n"
                 "barrier.cluster.wait.acquire;\n" ::
                     : "memory");
}

struct wsc_item {
    int e, m0, n0, rend, has, mc;
};

/* pair item w -> this CTA's tile (rank r of the pair), raster groups of
 * group_m m-tiles (group_m / 2 pairs) walking n together */
__device__ __forceinline__ void wsc_decode(const kcu_gemm_args &p, int w, int ntm, int ntn,
                                           int rank, wsc_item &t)
{
    const int npair = (ntm + 1) / 2, gm = max(1, p.group_m / 2);
    const int grp = w / (gm * ntn), first = grp * gm;
    const int gsz = min(gm, npair - first), in = w - grp * gm * ntn;
    const int q = first + in % gsz;
    t.n0 = (in / gsz) * WG_BN;
    const int mt = 2 * q + rank, other = 2 * q + (rank ^ 1);
    t.has = mt < ntm;
    t.e = t.has ? p.tile_e[mt] : 0;
    t.m0 = t.has ? p.tile_r0[mt] : 0;
    t.rend = t.has ? p.offs[t.e + 1] : 0;
    t.mc = t.has && other < ntm && p.tile_e[other] == t.e;
}

/* v7 / v9 consumer warpgroup cw: d = the item's ktiles k steps from the
 * stage ring (sequence numbers it..; it moves past them), each stage
 * released in this CTA and at the cluster peer once its wgmma are complete
 * (has = 0: the stages are walked without math); FENCE: a stage may have
 * been written by cp.async (generic proxy) before wgmma reads it */
template <int AM, int BMODE, bool FENCE>
__device__ __forceinline__ void cl_k_loop(float (&d)[128], uint32_t full0, uint32_t empty0,
                                          uint32_t sbase, uint32_t &it, int ktiles, bool has,
                                          int cw, int lane, uint32_t peer)
{
#pragma unroll
    for (int i = 0; i < 128; i++)
        d[i] = 0.f;
    wg_pin(d);
    for (int kt = 0; kt < ktiles; kt++, it++) {
        const int s = it % WS_STAGES;
        mbar_wait(full0 + 8 * s, (it / WS_STAGES) & 1);
        if (FENCE)
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        if (has)
            wg_stage_mma<AM, BMODE>(d, sbase + s * WG_STAGE_BYTES, cw);
        wg_wait<1>();
        if (kt > 0 && lane == 0) {
            const uint32_t eb = empty0 + 8 * ((it + WS_STAGES - 1) % WS_STAGES);
            mbar_arrive(eb);
            mbar_arrive_cluster(eb, peer);
        }
    }
    wg_wait<0>();
    wg_pin(d);
    if (ktiles > 0 && lane == 0) {
        const uint32_t eb = empty0 + 8 * ((it + WS_STAGES - 1) % WS_STAGES);
        mbar_arrive(eb);
        mbar_arrive_cluster(eb, peer);
    }
}

/* ---- v7's SwiGLU epilogue through shared memory (mp.tsw) ----
 * The up-projection's item leaves as 128 rows x 256 bf16 of (a, b) (in the
 * accumulator's column order, training only) and 128 x 128 of h: 96 KB, the
 * 2 stages (SW_STAGES) that follow the item's k steps in the stage sequence.
 * The producer hands them over empty (ab_produce without loads); the
 * consumer warps write their fragments into them as 6 boxes of 64 columns x
 * 128 rows (128-byte swizzle: 4 of (a, b), 2 of h), fence, and arrive on
 * `swr` - and go on to the next item. Warp 1 of the producer warpgroup (the
 * store warp) waits on swr, hands the boxes to TMA stores, waits until they
 * have read shared memory and releases the 2 stages for the consumer warps
 * of its CTA (8 arrivals here, 8 at the cluster peer). One record in shared
 * memory (item rows, columns, what to store) travels with each swr phase;
 * an item whose rows run past its expert's end (or a CTA without a tile)
 * stores from registers as before and sends "nothing to store". Same values,
 * same bits. */
constexpr int SW_STAGES = 2, SW_BOXES = 6;
constexpr int SW_BAR_OFF = 512; /* from full0: swr, then the record (4 words) */
static_assert(SW_BOXES * AB_BOX_BYTES <= SW_STAGES * WG_STAGE_BYTES,
              "SwiGLU boxes exceed 2 stages");
static_assert(SW_STAGES < WS_STAGES, "no stage left for the next item");

__device__ __forceinline__ uint32_t sw_box(const uint32_t (&sta)[SW_STAGES], int box)
{
    return sta[box / AB_PER_STAGE] + (box % AB_PER_STAGE) * AB_BOX_BYTES;
}

/* consumer warp (cw, warp, lane): its 16 rows of the item's (a, b) (when
 * p.ab) and h into the boxes; fragment d as in wg_epilogue */
__device__ __forceinline__ void stage_swiglu(const kcu_gemm_args &p, const float (&d)[128],
                                             const uint32_t (&sta)[SW_STAGES], int cw, int warp,
                                             int lane)
{
    const int g = lane >> 2, q4 = lane & 3, rb = cw * 64 + (warp & 3) * 16;
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int row = rb + g + 8 * hr;
#pragma unroll
        for (int jb = 0; jb < 32; jb += 2) {
            const float g0 = d[4 * jb + hr * 2], g1 = d[4 * jb + hr * 2 + 1];
            const float u0 = d[4 * jb + 4 + hr * 2], u1 = d[4 * jb + 4 + hr * 2 + 1];
            if (p.ab) {
                /* item columns 8 jb + 2 q4 (gate) and 8 (jb + 1) + 2 q4 (up) */
                const int c0 = 8 * jb + 2 * q4, c1 = c0 + 8;
                sts_u32(box_addr(sw_box(sta, c0 >> 6), row, (c0 & 63) * 2), pack_bf2(g0, g1));
                sts_u32(box_addr(sw_box(sta, c1 >> 6), row, (c1 & 63) * 2), pack_bf2(u0, u1));
            }
            const int hc = 4 * jb + 2 * q4; /* h column of the item */
            sts_u32(box_addr(sw_box(sta, 4 + (hc >> 6)), row, (hc & 63) * 2),
                    pack_bf2(act_swiglu::fwd(g0, u0), act_swiglu::fwd(g1, u1)));
        }
    }
}

__device__ __forceinline__ void tma_store_2d(const CUtensorMap *m, int c0, int c1, uint32_t src)
{
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
            reinterpret_cast<uint64_t>(m)),
        "r"(c0), "r"(c1), "r"(src)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive_n(uint32_t bar, uint32_t n)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive_cluster_n(uint32_t bar, uint32_t rank, uint32_t n)
{
    asm volatile(
        "mbarrier.arrive.shared::cluster.b64 _, [%0], %1;\n" ::"r"(cluster_smem(bar, rank)), "r"(n)
        : "memory");
}

/* the store warp's lane 0 (v7 with mp.tsw): item after item, the boxes the
 * consumers staged go out by TMA, then the stages return to the ring;
 * ktiles: k steps per item (the stage sequence: ktiles + SW_STAGES each) */
__device__ __forceinline__ void sw_store_loop(const ws_maps &mp, uint32_t full0, uint32_t empty0,
                                              uint32_t sbase, int ktiles, uint32_t peer)
{
    const uint32_t swr = full0 + SW_BAR_OFF, rec = swr + 8;
    for (uint32_t n = 0;; n++) {
        mbar_wait(swr, n & 1);
        const int what = (int)lds_u32(rec + 8); /* 0 nothing, 1 h, 2 h and (a, b), 3 end */
        if (what == 3)
            return;
        const uint32_t it = n * (uint32_t)(ktiles + SW_STAGES) + (uint32_t)ktiles;
        uint32_t sta[SW_STAGES];
#pragma unroll
        for (int j = 0; j < SW_STAGES; j++)
            sta[j] = sbase + ((it + j) % WS_STAGES) * WG_STAGE_BYTES;
        if (what) {
            const int m0 = (int)lds_u32(rec), n0 = (int)lds_u32(rec + 4);
            if (what == 2)
                for (int b = 0; b < 4; b++)
                    tma_store_2d(&mp.ab, n0 + 64 * b, m0, sw_box(sta, b));
            for (int b = 0; b < 2; b++)
                tma_store_2d(&mp.h, n0 / 2 + 64 * b, m0, sw_box(sta, 4 + b));
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        }
#pragma unroll
        for (int j = 0; j < SW_STAGES; j++) {
            const uint32_t eb = empty0 + 8 * ((it + j) % WS_STAGES);
            mbar_arrive_n(eb, 8);
            mbar_arrive_cluster_n(eb, peer, 8);
        }
    }
}

/* consumer warp: its part of one swr phase - the record (what, item rows
 * m0, columns n0: written by warp 0 of warpgroup 0 before its arrival, read
 * by the store warp after the phase completes) and the arrival */
__device__ __forceinline__ void sw_signal(uint32_t full0, int m0, int n0, int what, int cw,
                                          int warp, int lane)
{
    const uint32_t swr = full0 + SW_BAR_OFF, rec = swr + 8;
    __syncwarp();
    if (lane == 0) {
        if (cw == 0 && (warp & 3) == 0) {
            sts_u32(rec, (uint32_t)m0);
            sts_u32(rec + 4, (uint32_t)n0);
            sts_u32(rec + 8, (uint32_t)what);
        }
        mbar_arrive(swr);
    }
}

/* consumer warp: the item's SwiGLU epilogue into the SW_STAGES stages that
 * follow its k steps (sequence numbers it..; it moves past them), handed to
 * the store warp */
__device__ __forceinline__ void sw_epilogue(const kcu_gemm_args &p, const float (&d)[128],
                                            uint32_t full0, uint32_t sbase, uint32_t &it,
                                            int ktiles, const wsc_item &t, int cw, int warp,
                                            int lane)
{
    uint32_t sta[SW_STAGES];
#pragma unroll
    for (int j = 0; j < SW_STAGES; j++) {
        const uint32_t s = (it + j) % WS_STAGES;
        mbar_wait(full0 + 8 * s, ((it + j) / WS_STAGES) & 1);
        sta[j] = sbase + s * WG_STAGE_BYTES;
    }
    it += SW_STAGES;
    const bool whole = t.has && t.m0 + BM <= t.rend;
    if (whole)
        stage_swiglu(p, d, sta, cw, warp, lane);
    else if (t.has)
        wg_epilogue<KCU_EPI_SWIGLU>(p, d, t.e, t.m0, t.n0, t.rend, ktiles,
                                    cw * 64 + (warp & 3) * 16, lane);
    /* the boxes' generic-proxy writes before the TMA stores read them */
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    sw_signal(full0, t.m0, t.n0, whole ? (p.ab ? 2 : 1) : 0, cw, warp, lane);
}

template <int BMODE, int EPI>
__global__ void __launch_bounds__(WS_NT, 1)
    k_gemm_wsc(const kcu_gemm_args p, const __grid_constant__ ws_maps mp)
{
#if KCU_SM90 /* Hopper only: never launched from the portable image */
    const uint32_t sbase = smem_base_1k(), full0 = sbase + WS_BAR_OFF,
                   empty0 = full0 + WS_STAGES * 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const uint32_t rank = cluster_rank(), peer = rank ^ 1u;
    const uint32_t qb = full0 + WQ_OFF;
    const bool dyn = p.sched != nullptr;
    if (tid == 0) {
        ws_stage_bars_init(full0, empty0, 1, 16);
#pragma unroll
        for (int q = 0; q < WQ; q++) {
            mbar_init(qb + 8 * q, 1);
            mbar_init(qb + 8 * WQ + 8 * q, WQ_READERS);
        }
        if (EPI == KCU_EPI_SWIGLU && mp.tsw)
            mbar_init(full0 + SW_BAR_OFF, 8);
        ws_bars_fence();
    }
    __syncthreads();
    cluster_sync_all(); /* the peer's barriers exist before any remote access */
    kcu_pdl_wait();     /* launched with PDL: the predecessor's outputs from here on */
    kcu_pdl_trigger();

    const int ntn = p.N / WG_BN, ntm = *p.ntiles_m;
    const int total = (ntm + 1) / 2 * ntn, ktiles = p.K / BK;
    const int cid = blockIdx.x >> 1, ncl = gridDim.x >> 1;
    constexpr uint32_t HALF_B = WG_B_BYTES / 2;

    if (wg == 0) {
        /* ---------------- producer: thread 0 ---------------- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WS_PRODUCER_REGS));
        if (tid != 0) {
            if (EPI == KCU_EPI_SWIGLU && mp.tsw && tid == 32)
                sw_store_loop(mp, full0, empty0, sbase, ktiles, peer);
            return;
        }
        prefetch_tmap(&mp.a);
        prefetch_tmap(&mp.b);
        /* dynamic schedule: CTA 0's producer deals, CTA 1's takes from the ring */
        const bool deals = dyn && rank == 0;
        uint32_t it = 0, n = 0;
        int w = deals ? atomicAdd(p.sched, 1) : cid;
        for (;; n++) {
            if (deals)
                wq_publish(qb, n, w);
            else if (dyn)
                w = wq_take(qb, n, -1);
            if (w >= total)
                break;
            /* the next item's number travels while this item's stages load */
            const int wn = deals ? atomicAdd(p.sched, 1) : w + ncl;
            wsc_item t;
            wsc_decode(p, w, ntm, ntn, (int)rank, t);
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % WS_STAGES;
                const uint32_t fb = full0 + 8 * s, sa = sbase + s * WG_STAGE_BYTES,
                               sb = sa + WG_A_BYTES;
                const int k0 = kt * BK;
                mbar_wait(empty0 + 8 * s, ((it / WS_STAGES) & 1) ^ 1);
                if (!t.has) {
                    mbar_arrive(fb);
                    continue;
                }
                mbar_arrive_tx(fb, WG_A_BYTES + WG_B_BYTES);
                tma_2d(sa, &mp.a, k0, t.m0, fb);
                if (t.mc) {
                    if (BMODE == KCU_B_K) {
                        tma_3d_mc(sb + rank * HALF_B, &mp.b, k0, t.n0 + 128 * (int)rank, t.e, fb,
                                  (uint16_t)3);
                    } else {
#pragma unroll
                        for (int a2 = 0; a2 < 2; a2++) {
                            const int a4 = 2 * (int)rank + a2;
                            tma_3d_mc(sb + a4 * WG_ATOM, &mp.b, t.n0 + 64 * a4, k0, t.e, fb,
                                      (uint16_t)3);
                        }
                    }
                } else {
                    if (BMODE == KCU_B_K) {
#pragma unroll
                        for (int h2 = 0; h2 < 2; h2++)
                            tma_3d(sb + h2 * HALF_B, &mp.b, k0, t.n0 + 128 * h2, t.e, fb);
                    } else {
#pragma unroll
                        for (int a4 = 0; a4 < 4; a4++)
                            tma_3d(sb + a4 * WG_ATOM, &mp.b, t.n0 + 64 * a4, k0, t.e, fb);
                    }
                }
            }
            if (EPI == KCU_EPI_DSWIGLU && mp.tab)
                ab_produce(mp, full0, empty0, sbase, it, t.m0, t.n0, t.has);
            if (EPI == KCU_EPI_SWIGLU && mp.tsw) /* handed over empty (sw_epilogue) */
                for (int j = 0; j < SW_STAGES; j++, it++) {
                    const int s = it % WS_STAGES;
                    mbar_wait(empty0 + 8 * s, ((it / WS_STAGES) & 1) ^ 1);
                    mbar_arrive(full0 + 8 * s);
                }
            w = wn;
        }
        ws_stages_drained(empty0, it);
        if (deals) {
            /* every reader has taken the last number (no remote arrival
             * may reach an exited CTA); the last cluster out resets */
            mbar_wait<true>(qb + 8 * WQ + 8 * (n % WQ), (n / WQ) & 1);
            __threadfence();
            if (atomicAdd(p.sched + 1, 1) == ncl - 1) {
                atomicExch(p.sched, 0);
                atomicExch(p.sched + 1, 0);
            }
        }
        if (dyn)
            cluster_sync_exit();
        return;
    }

    /* ---------------- consumers ---------------- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WS_CONSUMER_REGS));
    const int cw = wg - 1;
    uint32_t it = 0;
    for (int w = cid, n = 0;; w += ncl, n++) {
        if (dyn)
            w = wq_take(qb, (uint32_t)n, lane);
        if (w >= total)
            break;
        wsc_item t;
        wsc_decode(p, w, ntm, ntn, (int)rank, t);
        float d[128];
        cl_k_loop<KCU_A_K, BMODE, false>(d, full0, empty0, sbase, it, ktiles, t.has, cw, lane,
                                         peer);
        if (EPI == KCU_EPI_DSWIGLU && mp.tab) {
            ab_epilogue(p, d, full0, empty0, sbase, it, t.m0, t.n0, t.rend, cw, warp, lane, t.has,
                        (int)peer);
        } else if (EPI == KCU_EPI_SWIGLU && mp.tsw) {
            sw_epilogue(p, d, full0, sbase, it, ktiles, t, cw, warp, lane);
        } else if (t.has) {
            wg_epilogue<EPI>(p, d, t.e, t.m0, t.n0, t.rend, ktiles, cw * 64 + (warp & 3) * 16,
                             lane);
        }
    }
    if (EPI == KCU_EPI_SWIGLU && mp.tsw) {
        /* the store warp has taken the last item's record (both CTAs' store
         * warps released its last stage) before the end record overwrites it
         * and a second phase of swr could complete behind its wait */
        if (it > 0)
            mbar_wait(empty0 + 8 * ((it - 1) % WS_STAGES), ((it - 1) / WS_STAGES) & 1);
        sw_signal(full0, 0, 0, 3, cw, warp, lane);
    }
    if (dyn)
        cluster_sync_exit();
#endif
}

/* a 2-CTA-cluster launch (v7, v9) of `pairs` pair items for kernel `kern`:
 * cfg (with at[0] the cluster dimension) gets a grid of at most one cluster
 * per 2 SMs, and no more clusters than can be resident (measured once per
 * device into max_cl); *grid_ok = 0 when there is nothing to launch */
template <class KERN>
moe_err cluster2_config(KERN kern, unsigned long long &attr_done, int (&max_cl)[64],
                        long long pairs, int nsm, cudaStream_t st, cudaLaunchConfig_t &cfg,
                        cudaLaunchAttribute (&at)[2], int *grid_ok)
{
    int dev = 0;
    KCU_CHECK(cudaGetDevice(&dev));
    memset(&cfg, 0, sizeof(cfg));
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = 2;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(WS_NT);
    cfg.dynamicSmemBytes = WS_SMEM_BYTES;
    cfg.stream = st;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    if (!(attr_done >> (dev & 63) & 1)) {
        KCU_CHECK(
            cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, WS_SMEM_BYTES));
        cfg.gridDim = dim3(2 * (nsm / 2));
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess) {
            (void)cudaGetLastError();
            n = 0;
        }
        max_cl[dev & 63] = n;
        attr_done |= 1ull << (dev & 63);
        if (getenv("KCU_DEBUG"))
            fprintf(stderr, "kcu: %d active 2-CTA clusters at most\n", n);
    }
    *grid_ok = pairs > 0;
    if (!*grid_ok)
        return MOE_OK;
    long long ncl = max_cl[dev & 63] > 0 ? max_cl[dev & 63] : nsm / 2;
    if (ncl > nsm / 2)
        ncl = nsm / 2;
    if (ncl > pairs)
        ncl = pairs;
    if (ncl < 1)
        ncl = 1;
    cfg.gridDim = dim3((unsigned)(2 * ncl));
    return MOE_OK;
}

int ws_sched_on(int K);

template <int BMODE, int EPI>
moe_err launch_wsc(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    static int max_cl[64];
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute at[2];
    int ok = 0;
    const long long pairs = (long long)(a->max_tiles_m + 1) / 2 * (a->N / WG_BN);
    KCU_TRY(
        cluster2_config(k_gemm_wsc<BMODE, EPI>, attr_done, max_cl, pairs, nsm, st, cfg, at, &ok));
    if (!ok)
        return MOE_OK;
    kcu_gemm_args b = *a;
    b.group_m = raster_group(KCU_A_K);
    if (!ws_sched_on(a->K))
        b.sched = nullptr;
    kcu_pdl_attr(&cfg, at, a->pdl);
    KCU_CHECK(kcu_launch_ex(&cfg, k_gemm_wsc<BMODE, EPI>, b, m));
    return MOE_OK;
}

/* ---- v9: the weight gradients (v4's A_M / B_N mode) on 2-CTA clusters ----
 * The two CTAs of a cluster take m-tiles 2q and 2q+1 of one group at the
 * same n0 (pair item: group, q, n). Both sum over the same rows (the
 * group's) and need the same B tile (those rows x 256 columns) at every k
 * step, so CTA r loads B's atoms 2r and 2r+1 with .multicast::cluster into
 * both CTAs' stage, and its own A (its 128 columns) alone: L2 serves B once
 * per pair. A group's last, partial k tile comes by cp.async with zero fill
 * in each CTA (no multicast), as in v4; a CTA without a tile (odd m-tile
 * count) runs its stages empty and its peer loads its whole B. full[s]
 * expects 1 + 128 arrivals (thread 0's expect_tx with the TMA bytes, the
 * producer threads' cp.async arrivals; the peer's half of B lands on it
 * too), empty[s] 16 (every consumer warp of both CTAs, as in v7). Same tiles,
 * wgmma sequence and epilogue as v4: the same bits. */
__device__ __forceinline__ void tma_2d_mc(uint32_t dst, const CUtensorMap *m, int c0, int c1,
                                          uint32_t bar, uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
                 : "memory");
}

struct wgc_item {
    int e, m0, n0, kbeg, kend, ktiles, has, mc;
};

/* pair item w -> this CTA's tile (rank r of the pair): raster groups of
 * group_m / 2 pairs walking n together, as v4's wgrad_raster */
__device__ __forceinline__ void wgc_decode(const kcu_gemm_args &p, int w, int ntm, int ntn,
                                           int rank, wgc_item &t)
{
    const int npair = (ntm + 1) / 2, ppg = npair * ntn;
    int q0;
    t.e = w / ppg;
    wgrad_raster(max(1, p.group_m / 2), npair, ntn, w - t.e * ppg, q0, t.n0);
    const int mt = 2 * (q0 / BM) + rank;
    t.has = mt < ntm;
    t.mc = 2 * (q0 / BM) + 1 < ntm; /* both CTAs have a tile */
    t.m0 = mt * BM;
    t.kbeg = p.offs ? p.offs[t.e] : 0;
    t.kend = p.offs ? p.offs[t.e + 1] : p.K;
    t.ktiles = t.kend > t.kbeg ? (t.kend - t.kbeg + BK - 1) / BK : 0;
}

template <int EPI>
__global__ void __launch_bounds__(WS_NT, 1)
    k_gemm_wgc(const kcu_gemm_args p, const __grid_constant__ ws_maps mp)
{
#if KCU_SM90 /* Hopper only: never launched from the portable image */
    const uint32_t sbase = smem_base_1k(), full0 = sbase + WS_BAR_OFF,
                   empty0 = full0 + WS_STAGES * 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const uint32_t rank = cluster_rank(), peer = rank ^ 1u;
    if (tid == 0) {
        ws_stage_bars_init(full0, empty0, 129, 16);
        ws_bars_fence();
    }
    __syncthreads();
    cluster_sync_all(); /* the peer's barriers exist before any remote access */
    kcu_pdl_wait();
    kcu_pdl_trigger();

    const int ntn = p.N / WG_BN, ntm = p.M / BM;
    const int total = p.ngroups * ((ntm + 1) / 2) * ntn;
    const int cid = blockIdx.x >> 1, ncl = gridDim.x >> 1;

    if (wg == 0) {
        /* ---------------- producer: 128 threads ---------------- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WS_PRODUCER_REGS));
        if (tid == 0) {
            prefetch_tmap(&mp.a);
            prefetch_tmap(&mp.b);
        }
        uint32_t it = 0;
        for (int w = cid; w < total; w += ncl) {
            /* the rank read again here: at 40 registers it would spill */
            const int r = (int)cluster_rank();
            wgc_item t;
            wgc_decode(p, w, ntm, ntn, r, t);
            for (int k0 = t.kbeg; k0 < t.kend; k0 += BK, it++) {
                const int s = it % WS_STAGES;
                const uint32_t fb = full0 + 8 * s, sa = sbase + s * WG_STAGE_BYTES,
                               sb = sa + WG_A_BYTES;
                /* the same for both CTAs: one group, one k range */
                const bool whole = k0 + BK <= t.kend;
                mbar_wait(empty0 + 8 * s, ((it / WS_STAGES) & 1) ^ 1);
                if (tid == 0) {
                    if (t.has && whole) {
                        mbar_arrive_tx(fb, WG_A_BYTES + WG_B_BYTES);
#pragma unroll
                        for (int a2 = 0; a2 < 2; a2++)
                            tma_2d(sa + a2 * WG_ATOM, &mp.a, t.m0 + 64 * a2, k0, fb);
                        if (t.mc) {
#pragma unroll
                            for (int a2 = 0; a2 < 2; a2++) {
                                const int a4 = 2 * r + a2;
                                tma_2d_mc(sb + a4 * WG_ATOM, &mp.b, t.n0 + 64 * a4, k0, fb,
                                          (uint16_t)3);
                            }
                        } else {
#pragma unroll
                            for (int a4 = 0; a4 < 4; a4++)
                                tma_2d(sb + a4 * WG_ATOM, &mp.b, t.n0 + 64 * a4, k0, fb);
                        }
                    } else {
                        mbar_arrive(fb);
                    }
                }
                if (t.has && !whole)
                    wgrad_cp_async<false>(p, t.m0, t.n0, k0, t.kend, sa, sb, tid, true, true);
                cp_async_arrive(fb);
            }
        }
        cp_async_wait<0>(); /* leave no cp.async of this thread in flight */
        if (tid == 0)
            ws_stages_drained(empty0, it);
        return;
    }

    /* ---------------- consumers ---------------- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WS_CONSUMER_REGS));
    const int cw = wg - 1;
    ws_stage stg = {sbase + WS_EPI_OFF + 2u * WS_EPI_SLOT * cw, 0u, 1 + cw, (tid & 127) == 0};
    uint32_t it = 0;
    for (int w = cid; w < total; w += ncl) {
        wgc_item t;
        wgc_decode(p, w, ntm, ntn, (int)rank, t);
        float d[128];
        /* a partial tile was written by cp.async (generic proxy): fence */
        cl_k_loop<KCU_A_M, KCU_B_N, true>(d, full0, empty0, sbase, it, t.ktiles, t.has, cw, lane,
                                          peer);
        if (t.has)
            ws_epilogue<EPI>(p, mp, d, t.e, t.m0, t.n0, 0, t.ktiles, cw, warp, lane, stg);
    }
    stage_drain(stg);
#endif
}

template <int EPI>
moe_err launch_wgc(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    static int max_cl[64];
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute at[2];
    int ok = 0;
    const long long pairs = (long long)a->ngroups * ((a->M / BM + 1) / 2) * (a->N / WG_BN);
    KCU_TRY(cluster2_config(k_gemm_wgc<EPI>, attr_done, max_cl, pairs, nsm, st, cfg, at, &ok));
    if (!ok)
        return MOE_OK;
    kcu_gemm_args b = *a;
    b.group_m = raster_group(KCU_A_M);
    kcu_pdl_attr(&cfg, at, a->pdl);
    KCU_CHECK(kcu_launch_ex(&cfg, k_gemm_wgc<EPI>, b, m));
    return MOE_OK;
}

/* ---- v4 host side: tensor maps through the driver entry points (no -lcuda) ---- */
typedef CUresult (*pfn_encode_tiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                     const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                     const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                     CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
typedef CUresult (*pfn_addr_range)(CUdeviceptr *, size_t *, CUdeviceptr);

struct drv_fns {
    pfn_encode_tiled encode;
    pfn_addr_range range;
};

const drv_fns &drv()
{
    static const drv_fns f = [] {
        drv_fns r = {nullptr, nullptr};
        void *fp = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fp, 12000,
                                             cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            r.encode = (pfn_encode_tiled)fp;
        fp = nullptr;
        if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fp, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            r.range = (pfn_addr_range)fp;
        (void)cudaGetLastError(); /* a failed lookup leaves no error behind */
        if (!r.encode || !r.range)
            fprintf(stderr,
                    "kcu_gemm: no driver entry point for TMA (encode %p, range %p): "
                    "v4 loads with cp.async only\n",
                    (void *)r.encode, (void *)r.range);
        return r;
    }();
    return f;
}

/* how many slabs of `slab` bytes, `stride` bytes apart, start at p and end
 * inside p's allocation (0 when unknown) */
long long slabs_in_alloc(const void *p, size_t slab, size_t stride)
{
    const drv_fns &f = drv();
    if (!f.range)
        return 0;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (f.range(&base, &size, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS)
        return 0;
    const size_t left = (size_t)(base + size - (CUdeviceptr)(uintptr_t)p);
    return left < slab ? 0 : (long long)((left - slab) / stride + 1);
}

/* a bf16 (or dt) tensor map of rank 2 or 3 with 128-byte swizzle; 0 on success */
int encode_map(CUtensorMap *m, const void *p, int rank, const uint64_t *dim,
               const uint64_t *strideb, const uint32_t *box,
               CUtensorMapDataType dt = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
{
    const drv_fns &f = drv();
    if (!f.encode || ((uintptr_t)p & 15))
        return -1;
    cuuint64_t gd[3], gs[2];
    cuuint32_t bx[3], es[3] = {1, 1, 1};
    for (int i = 0; i < rank; i++) {
        if (dim[i] < 1 || dim[i] > (1ull << 32) || box[i] > dim[i])
            return -1;
        gd[i] = dim[i];
        bx[i] = box[i];
    }
    for (int i = 0; i < rank - 1; i++) {
        if (strideb[i] % 16 || strideb[i] >= (1ull << 40))
            return -1;
        gs[i] = strideb[i];
    }
    return f.encode(m, dt, (cuuint32_t)rank, const_cast<void *>(p), gd, gs, bx, es,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS
               ? 0
               : -1;
}

int g_ws_tstore = -1;  /* v4/v7 staged epilogue (ws_stage): 1, 0; -1: read KCU_WS_TMA_STORE */
int g_ws_tab = -1;     /* v4/v7 dh's (a, b) by TMA (ab_issue): 1, 0; -1: read KCU_WS_TMA_AB */
int g_ws_sw = -1;      /* v7 SwiGLU epilogue through the stages (sw_epilogue): 1, 0; -1: read
                        * KCU_WS_SW_STAGE (off too where the staged epilogues are) */
int g_gemm_mode = -1;  /* 0 default, 1 mma, 2 wgmma, 4 ws; -1: read KCU_GEMM */
int g_ws_tma = -1;     /* v4 operands by TMA where possible: 1, 0; -1: read KCU_WS_TMA */
int g_ws_cluster = -1; /* v7 (v4 on 2-CTA clusters) where it fits: 1, 0; -1: KCU_WS_CLUSTER */
int g_ws_sched = -1;   /* v7 dynamic schedule where sched is given: 1 always, 0 never,
                        * 2 items of >= WS_SCHED_MIN_K; -1: KCU_WS_SCHED (default 2) */

/* items of fewer k steps lose a little with the dynamic schedule (Qwen3's
 * f.down, 12 k steps: 0.78 vs 0.75 ms; dx, 24: 1.32 vs 1.29) and have little
 * weight traffic to save; Mixtral's (64 to 448 k steps) gain (bench/NOTES.md) */
constexpr int WS_SCHED_MIN_K = 64 * BK;

int ws_sched_on(int K)
{
    if (g_ws_sched < 0) {
        const char *s = getenv("KCU_WS_SCHED");
        g_ws_sched = s ? atoi(s) : 2;
    }
    return g_ws_sched == 1 || (g_ws_sched == 2 && K >= WS_SCHED_MIN_K);
}

int ws_tma_on()
{
    return kcu_env_flag(&g_ws_tma, "KCU_WS_TMA", 1);
}

int ws_cluster_on()
{
    return kcu_env_flag(&g_ws_cluster, "KCU_WS_CLUSTER", 1);
}

/* v9 (the weight gradients on clusters): on unless KCU_WS_CLUSTER_W=0, and
 * only where v7 is (ws_cluster_on) */
int g_ws_cluster_w = -1;
int ws_cluster_w_on()
{
    return kcu_env_flag(&g_ws_cluster_w, "KCU_WS_CLUSTER_W", 1) && ws_cluster_on();
}

/* the maps of one v4 call: TMA for each dense operand where a map can be
 * built (its rows' extent from the allocation), cp.async otherwise */
void ws_build_maps(kcu_amode am, kcu_bmode bm, const kcu_gemm_args *a, ws_maps *m, int half_b)
{
    memset(m, 0, sizeof(*m));
    if (!ws_tma_on())
        return;
    if (am == KCU_A_K) {
        if (!a->a_gather) {
            /* rows past the tile list's end read as zero when M is fixed; with a
             * tile list they are rows of the allocation (their outputs are
             * never stored) */
            const long long rows =
                a->tile_e ? slabs_in_alloc(a->A, (size_t)a->K * 2, (size_t)a->lda * 2) : a->M;
            const uint64_t dim[2] = {(uint64_t)a->K, (uint64_t)rows},
                           sb[1] = {(uint64_t)a->lda * 2};
            const uint32_t box[2] = {64, 128};
            m->ta = rows >= 1 && encode_map(&m->a, a->A, 2, dim, sb, box) == 0;
        }
        /* B_e = B + e b_gstride: (N, K) K-contiguous or (K, N) N-contiguous */
        const int inner = bm == KCU_B_K ? a->K : a->N, outer = bm == KCU_B_K ? a->N : a->K;
        const size_t slab = ((size_t)(outer - 1) * a->ldb + inner) * 2;
        const long long ne =
            a->b_gstride ? slabs_in_alloc(a->B, slab, (size_t)a->b_gstride * 2) : 1;
        const uint64_t dim[3] = {(uint64_t)inner, (uint64_t)outer, (uint64_t)ne},
                       sb[2] = {(uint64_t)a->ldb * 2, a->b_gstride ? (uint64_t)a->b_gstride * 2
                                                                   : (uint64_t)outer * a->ldb * 2};
        /* half_b (v7): B_K boxes of 128 n rows, one per CTA of a cluster */
        const uint32_t box[3] = {64, bm == KCU_B_K ? (half_b ? 128u : 256u) : 64u, 1};
        m->tb = ne >= 1 && encode_map(&m->b, a->B, 3, dim, sb, box) == 0;
    } else {
        /* only whole k tiles inside a group use TMA: any row bound that covers
         * the groups works */
        const uint32_t box[2] = {64, 64};
        if (!a->a_gather) {
            const long long rows =
                a->offs ? slabs_in_alloc(a->A, (size_t)a->M * 2, (size_t)a->lda * 2) : a->K;
            const uint64_t dim[2] = {(uint64_t)a->M, (uint64_t)rows},
                           sb[1] = {(uint64_t)a->lda * 2};
            m->ta = rows >= 64 && encode_map(&m->a, a->A, 2, dim, sb, box) == 0;
        }
        if (!a->b_gather) {
            const long long rows =
                a->offs ? slabs_in_alloc(a->B, (size_t)a->N * 2, (size_t)a->ldb * 2) : a->K;
            const uint64_t dim[2] = {(uint64_t)a->N, (uint64_t)rows},
                           sb[1] = {(uint64_t)a->ldb * 2};
            m->tb = rows >= 64 && encode_map(&m->b, a->B, 2, dim, sb, box) == 0;
        }
    }
}

/* the staged epilogue's map of one v4 call (mp.tc = 1 when built): ACC
 * with an fp32 C (the weight gradients) */
void ws_build_epi_maps(kcu_epi epi, const kcu_gemm_args *a, ws_maps *m)
{
    m->tc = 0;
    m->tab = 0;
    /* only where every operand comes by TMA (m built by ws_build_maps): with
     * cp.async producers their generic-proxy writes would follow the
     * epilogue's reads of a stage with only an mbarrier between, which
     * compute-sanitizer's racecheck does not follow (and the default
     * dispatch runs gathered dh on v2) */
    if (kcu_env_flag(&g_ws_tab, "KCU_WS_TMA_AB", 1) && epi == KCU_EPI_DSWIGLU && m->ta && m->tb &&
        a->ab && !(a->ld_ab & 7) && a->N % WG_BN == 0) {
        /* the (a, b) columns of the F outputs: 2F per row */
        const long long rows = slabs_in_alloc(a->ab, (size_t)a->N * 4, (size_t)a->ld_ab * 2);
        const uint64_t dim[2] = {(uint64_t)a->N * 2, (uint64_t)rows},
                       sb[1] = {(uint64_t)a->ld_ab * 2};
        const uint32_t box[2] = {64, 128};
        m->tab = rows >= 128 && encode_map(&m->ab, a->ab, 2, dim, sb, box) == 0;
        return;
    }
    const int tstore = kcu_env_flag(&g_ws_tstore, "KCU_WS_TMA_STORE", 1);
    m->tsw = 0;
    /* v7's SwiGLU epilogue through the stages (sw_epilogue): h, and (a, b)
     * when kept, by TMA stores; at least WS_STAGES k steps per item (the
     * store warp's record is rewritten only after it freed the stages) */
    if (epi == KCU_EPI_SWIGLU && tstore && kcu_env_flag(&g_ws_sw, "KCU_WS_SW_STAGE", 1) && m->ta &&
        m->tb && a->h && a->F > 0 && !(a->F & 7) && a->N == 2 * a->F && a->N % WG_BN == 0 &&
        a->K / BK >= WS_STAGES && (!a->ab || !(a->ld_ab & 7))) {
        const long long rows = slabs_in_alloc(a->h, (size_t)a->F * 2, (size_t)a->F * 2);
        const uint64_t dim[2] = {(uint64_t)a->F, (uint64_t)rows}, sb[1] = {(uint64_t)a->F * 2};
        const uint32_t box[2] = {64, 128};
        int ok = rows >= 128 && encode_map(&m->h, a->h, 2, dim, sb, box) == 0;
        if (ok && a->ab) {
            const long long ra = slabs_in_alloc(a->ab, (size_t)a->N * 2, (size_t)a->ld_ab * 2);
            const uint64_t da[2] = {(uint64_t)a->N, (uint64_t)ra}, sa[1] = {(uint64_t)a->ld_ab * 2};
            ok = ra >= 128 && encode_map(&m->ab, a->ab, 2, da, sa, box) == 0;
        }
        m->tsw = ok;
        return;
    }
    if (!tstore || epi != KCU_EPI_ACC || !a->Cf || a->Cb || (a->ldc & 3) || (a->c_gstride & 3) ||
        a->ngroups < 1)
        return;
    const uint64_t dim[3] = {(uint64_t)a->N, (uint64_t)a->M, (uint64_t)a->ngroups};
    const uint64_t sb[2] = {(uint64_t)a->ldc * 4,
                            (uint64_t)(a->c_gstride ? a->c_gstride : (long long)a->M * a->ldc) * 4};
    const uint32_t box[3] = {32, 64, 1};
    m->tc = encode_map(&m->c, a->Cf, 3, dim, sb, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32) == 0;
}

} // namespace

void kcu_gemm_select(int version, int tma, int cluster, int staged, int sched)
{
    g_ws_sched = sched < 0 ? -1 : sched;
    g_gemm_mode = version < 0 ? -1 : version == 1 || version == 2 || version == 4 ? version : 0;
    g_ws_tma = tma < 0 ? -1 : tma != 0;
    g_ws_cluster = cluster < 0 ? -1 : cluster != 0;
    g_ws_tstore = staged < 0 ? -1 : staged != 0;
    g_ws_tab = staged < 0 ? -1 : staged != 0;
}

int kcu_gemm_version(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, int nsm)
{
    /* KCU_GEMM=mma forces the mma.sync version (v1), KCU_GEMM=wgmma the v2
     * wgmma kernel and KCU_GEMM=ws the v4 warp-specialised one wherever their
     * shape fits (for checks and A/B timing); default: v4 when the shape fits
     * and there are at least nsm 128x256 work items, else v1. */
    if (g_gemm_mode < 0) {
        const char *m = getenv("KCU_GEMM");
        g_gemm_mode = m && !strcmp(m, "mma")     ? 1
                      : m && !strcmp(m, "wgmma") ? 2
                      : m && !strcmp(m, "ws")    ? 4
                                                 : 0;
    }
    const int mode = g_gemm_mode;
    if (mode == 1 || a->N % WG_BN || !kcu_sm90()) /* the portable image: mma.sync only */
        return 1;
    long long items;
    if (am == KCU_A_K)
        items = (long long)(a->tile_e ? a->max_tiles_m : KCU_CEIL_DIV(a->M, BM)) * (a->N / WG_BN);
    else if (bm == KCU_B_N && epi == KCU_EPI_ACC)
        items = (long long)a->ngroups * (a->M / BM) * (a->N / WG_BN);
    else
        return 1;
    if (mode == 0 && items < nsm)
        return 1;
    if (mode == 0) {
        /* measured per phase (bench/NOTES.md, v4): v4 wins where its
         * producer loads dense tiles by TMA, v2 where the streamed operand
         * is gathered row by row (up-projection, dh, dW13) */
        const int gathered = am == KCU_A_K ? a->a_gather != NULL : a->b_gather != NULL;
        if (gathered)
            return 2;
    }
    if (mode == 2)
        return 2;
    /* v9: weight gradients with A and B dense (by TMA but for partial tiles) */
    if (am == KCU_A_M && bm == KCU_B_N && epi == KCU_EPI_ACC && !a->a_gather && !a->b_gather &&
        ws_cluster_w_on() && (a->M / BM) >= 2) {
        if (ws_tma_on())
            return 9;
    }
    /* v7: rows mode over a tile list with A dense, every operand by TMA */
    if (am == KCU_A_K && a->tile_e && !a->a_gather && ws_cluster_on()) {
        if (ws_tma_on())
            return 7;
    }
    return 4;
}

namespace
{

/* the launchers of each version behind one signature, so that a single
 * switch (gemm_dispatch) names the built (mode, epilogue) combinations */
struct run_v1 {
    template <int AM, int BM, int EPI>
    static moe_err run(const kcu_gemm_args *a, const ws_maps &, int nsm, cudaStream_t st)
    {
        return launch<AM, BM, EPI>(a, nsm, st);
    }
};
struct run_v2 {
    template <int AM, int BM, int EPI>
    static moe_err run(const kcu_gemm_args *a, const ws_maps &, int nsm, cudaStream_t st)
    {
        return launch_wg<AM, BM, EPI>(a, nsm, st);
    }
};
struct run_v4 {
    template <int AM, int BM, int EPI>
    static moe_err run(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
    {
        return launch_ws<AM, BM, EPI>(a, m, nsm, st);
    }
};
struct run_v7 { /* rows mode only */
    template <int AM, int BM, int EPI>
    static moe_err run(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
    {
        if constexpr (AM == KCU_A_K)
            return launch_wsc<BM, EPI>(a, m, nsm, st);
        return MOE_EINVAL;
    }
};

/* gemm_dispatch: launches version V for (am, bm, epi); MOE_EINVAL with a
 * message when that combination is not built */
template <class V>
moe_err gemm_dispatch(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a,
                      const ws_maps &m, int nsm, cudaStream_t st)
{
    if (am == KCU_A_K && bm == KCU_B_K) {
        switch (epi) {
        case KCU_EPI_F32: return V::template run<KCU_A_K, KCU_B_K, KCU_EPI_F32>(a, m, nsm, st);
        case KCU_EPI_SWIGLU:
            return V::template run<KCU_A_K, KCU_B_K, KCU_EPI_SWIGLU>(a, m, nsm, st);
        case KCU_EPI_GELU: return V::template run<KCU_A_K, KCU_B_K, KCU_EPI_GELU>(a, m, nsm, st);
        case KCU_EPI_SCATTER:
            return V::template run<KCU_A_K, KCU_B_K, KCU_EPI_SCATTER>(a, m, nsm, st);
        default: break;
        }
    } else if (am == KCU_A_K && bm == KCU_B_N) {
        switch (epi) {
        case KCU_EPI_F32: return V::template run<KCU_A_K, KCU_B_N, KCU_EPI_F32>(a, m, nsm, st);
        case KCU_EPI_SCATTER:
            return V::template run<KCU_A_K, KCU_B_N, KCU_EPI_SCATTER>(a, m, nsm, st);
        case KCU_EPI_DSWIGLU:
            return V::template run<KCU_A_K, KCU_B_N, KCU_EPI_DSWIGLU>(a, m, nsm, st);
        case KCU_EPI_DGELU: return V::template run<KCU_A_K, KCU_B_N, KCU_EPI_DGELU>(a, m, nsm, st);
        default: break;
        }
    } else if (am == KCU_A_M && bm == KCU_B_N && epi == KCU_EPI_ACC) {
        return V::template run<KCU_A_M, KCU_B_N, KCU_EPI_ACC>(a, m, nsm, st);
    }
    fprintf(stderr, "kcu_gemm: combination %d/%d/%d not built\n", am, bm, epi);
    return MOE_EINVAL;
}

} // namespace

moe_err kcu_gemm(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, int nsm,
                 cudaStream_t st)
{
    if (a->N % BN || a->lda % 8 || a->ldb % 8 || (am == KCU_A_K && a->K % BK) ||
        (am == KCU_A_M && a->M % BM)) {
        fprintf(stderr, "kcu_gemm: unsupported shape M=%d N=%d K=%d lda=%d ldb=%d\n", a->M, a->N,
                a->K, a->lda, a->ldb);
        return MOE_EINVAL;
    }
    ws_maps m;
    memset(&m, 0, sizeof(m));
    switch (kcu_gemm_version(am, bm, epi, a, nsm)) {
    case 9:
        ws_build_maps(am, bm, a, &m, 0);
        ws_build_epi_maps(epi, a, &m);
        if (m.ta && m.tb)
            return launch_wgc<KCU_EPI_ACC>(a, m, nsm, st);
        return gemm_dispatch<run_v4>(am, bm, epi, a, m, nsm, st);
    case 7:
        ws_build_maps(am, bm, a, &m, 1);
        ws_build_epi_maps(epi, a, &m);
        if (am == KCU_A_K && m.ta && m.tb)
            return gemm_dispatch<run_v7>(am, bm, epi, a, m, nsm, st);
        ws_build_maps(am, bm, a, &m, 0); /* no map for an operand: v4, cp.async for it */
        ws_build_epi_maps(epi, a, &m);
        return gemm_dispatch<run_v4>(am, bm, epi, a, m, nsm, st);
    case 4:
        ws_build_maps(am, bm, a, &m, 0);
        ws_build_epi_maps(epi, a, &m);
        return gemm_dispatch<run_v4>(am, bm, epi, a, m, nsm, st);
    case 2: return gemm_dispatch<run_v2>(am, bm, epi, a, m, nsm, st);
    default: return gemm_dispatch<run_v1>(am, bm, epi, a, m, nsm, st);
    }
}
