/*
 * kernels/cuda/gemm/tile.cuh - tile primitives and MMA helpers of the GEMMs
 * (moved verbatim from kcu_gemm.cu, session 19): the swizzled shared-memory
 * tile offsets, cp.async, ldmatrix and mma.sync m16n8k16 (v1 and the cp.async
 * loaders of v2 / v4), the wgmma descriptors and m64n256k16 steps (v2 and
 * later), the 1 KB aligned dynamic shared memory base, and the weight-
 * gradient cp.async tile loader of v4 / v9.
 *
 * Shared-memory tiles are 16 KB each, rows of 16-byte chunks XOR-swizzled
 * by the row index so that ldmatrix and cp.async are free of bank conflicts:
 *   K-contiguous tile  [128 rows][64 k]   (A rows / nn.Linear weight rows)
 *   MN-contiguous tile [64 k][128 cols]   (read with ldmatrix.trans)
 * The wgmma operand layouts (128-byte swizzle) are described in gemm/wgmma.cu.
 */
#ifndef MOE_KCU_GEMM_TILE_CUH
#define MOE_KCU_GEMM_TILE_CUH

#include "kernels/cuda/gemm/common.cuh"

namespace
{

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

/* a_rows_cp_async: one k step's A tile (rows m0 .. m0 + 127, columns k0 ..
 * k0 + 63) by cp.async from 128 producer threads into the K-major layout
 * of A's tensor-map boxes: thread tid copies 16 bytes (chunk tid & 7) of
 * rows (tid >> 3) + 16 j; row r is A's row gather[r] (r itself without
 * gather), zero-filled from rend on. The indices are read again each
 * stage (L1 hits): at a producer's 40 registers kept ones would spill. */
__device__ __forceinline__ void a_rows_cp_async(uint32_t sa, const bf16 *A, int lda,
                                                const int32_t *gather, int m0, int rend, int k0,
                                                int tid)
{
    const int ch = tid & 7;
    int src[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int r = m0 + (tid >> 3) + 16 * j;
        src[j] = r < rend ? (gather ? gather[r] : r) : -1;
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        cp_async16(sa + off_k((tid >> 3) + 16 * j, ch * 8),
                   A + (size_t)(src[j] < 0 ? 0 : src[j]) * lda + k0 + ch * 8, src[j] >= 0 ? 16 : 0);
}
/* the cp.async stage ring of the mma.sync kernels (v1, v1n): cp_ring_fill
 * loads k tiles 0 .. STAGES-2 (one commit group each, empty past ktiles);
 * cp_ring_step, before k tile kt is read: its stage has landed for every
 * thread, and the stage of k tile kt + STAGES - 1 is refilled (load(stage,
 * k tile)) */
template <int STAGES, class LOAD>
__device__ __forceinline__ void cp_ring_fill(int ktiles, LOAD &load)
{
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles)
            load(s, s);
        cp_async_commit();
    }
}
template <int STAGES, class LOAD>
__device__ __forceinline__ void cp_ring_step(int kt, int ktiles, LOAD &load)
{
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < ktiles)
        load(nk % STAGES, nk);
    cp_async_commit();
}
/* mma16816's B fragments (b0, b1) of n8 blocks 2 nj and 2 nj + 1 from one
 * ldmatrix.x4 (t4) */
__device__ __forceinline__ void b_frag_pair(uint32_t (&bfr)[4][2], int nj, const uint32_t (&t4)[4])
{
    bfr[2 * nj][0] = t4[0];
    bfr[2 * nj][1] = t4[1];
    bfr[2 * nj + 1][0] = t4[2];
    bfr[2 * nj + 1][1] = t4[3];
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

/* the kernel's dynamic shared memory from its first 1024-byte boundary (the
 * 128-byte swizzle of the wgmma and TMA tiles needs it; the launches ask
 * for 1 KB more than they use) */
__device__ __forceinline__ uint32_t smem_base_1k()
{
    extern __shared__ uint8_t smem_raw[];
    return ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
}

/* keep the compiler from moving accumulator reads above a wgmma wait */
__device__ __forceinline__ void wg_pin(float (&d)[128])
{
#pragma unroll
    for (int i = 0; i < 128; i++)
        asm volatile("" : "+f"(d[i])::"memory");
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

} // namespace

#endif
