/*
 * kernels/cuda/gemm/epilogue.cuh - the GEMM epilogues (moved verbatim from
 * kcu_gemm.cu, session 19): store helpers (bf16 pairs, quad-paired 8- and
 * 16-byte stores and reductions), the register epilogues of the wgmma
 * versions (wg_epilogue, wg_dact: every kcu_epi from the 64x256 fragment),
 * v4's staged epilogue through shared memory and TMA stores (ws_stage,
 * stage_acc), dh's (a, b) by TMA into the stages (ab_*), and ws_epilogue,
 * which picks among them for v4 / v7 / v9. v1's epilogue is inline in its
 * kernel (gemm/mma_sync.cu); v7's SwiGLU epilogue through the stages is in
 * gemm/clustered.cu.
 */
#ifndef MOE_KCU_GEMM_EPILOGUE_CUH
#define MOE_KCU_GEMM_EPILOGUE_CUH

#include "kernels/cuda/gemm/common.cuh"
#include "kernels/cuda/gemm/tile.cuh"
#include "kernels/cuda/gemm/tma.cuh"

namespace
{

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
        const ws_slot g = ws_slot_take(full0, empty0, sbase, it);
        if (has)
            ab_issue(mp, g.sa, g.fb, j, m0, n0);
        else
            mbar_arrive(g.fb);
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

} // namespace

#endif
