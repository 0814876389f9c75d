/*
 * kernels/cuda/gemm/swapped.cu - v10: the rows-mode GEMM with its operands
 * swapped (sm_90a), for layers whose experts get few rows each (a tile list
 * in pairs of one expert, kcu_gemm_args.few_tiles: inference forwards at
 * most ~1.5 m-tiles per expert). History: bench/NOTES.md "v10".
 *
 * Why: v4 / v7 give each item 128 rows of one expert in two 64-row halves,
 * so an expert of 133 rows costs 192 rows of tensor work (the third half
 * for 5 rows) and one of 70 costs 128: at 128 rows per expert on average
 * about a fifth of the math is padding. Here the weights are wgmma's A
 * (64 output columns per consumer warpgroup, 128 per item) and the expert's
 * rows its B, whose n extent wgmma takes in steps of 16 (wg_mma_n<N>,
 * gemm/wgmma_n.cuh): the rows are padded to 16, not 64.
 *
 * Item w = (expert e = w / (N / 128), output columns m0 = (w % (N / 128)) x
 * 128); the expert's rows offs[e] .. offs[e+1] in chunks of at most 256
 * (equal, rounded up to 16), one pass of K / 64 stages per chunk. Every
 * weight byte is read by one item, once; the rows, re-read by the N / 128
 * items of their expert, come from L2 (consecutive items share an expert).
 * Static schedule (w = CTA, + grid). Stage s (48 KB, v4's layout): the
 * weight tile (128 output columns x 64 k, one TMA box of the 3D weight map,
 * 128-byte swizzle) where v4 has A, the chunk's rows (up to 256 x 64 k, in
 * TMA boxes of 64 rows) where v4 has B; rows past the chunk (the next
 * expert's, or zero past the allocation) are multiplied and never stored.
 * Producer: thread 0 of warpgroup 0; full[s] 1 arrival + the bytes,
 * empty[s] 8 (each consumer warp).
 *
 * Epilogues (through 16 KB of shared memory per consumer warpgroup: the
 * fragments stored transposed by stmatrix, then 16-byte rows out):
 *   SWIGLU: h (rows, F) of the item's 64 h columns m0 / 2 .. (w13's rows
 *     interleave gate and up by 8, so a lane holds both of a column: its
 *     fragment rows g and g + 8); inference only (no (a, b) kept);
 *   SCATTER: bf16 out[scatter[r]] (rows, N) of the item's 128 columns, in
 *     two passes of 128 rows.
 * Each output is the same sum of the same products, k ascending in steps
 * of 16, as v4 / v7 compute it with the operands in their places.
 */
#include "kernels/cuda/gemm/common.cuh"
#include "kernels/cuda/gemm/tile.cuh"
#include "kernels/cuda/gemm/tma.cuh"
#include "kernels/cuda/gemm/epilogue.cuh"
#include "kernels/cuda/gemm/wgmma_n.cuh"

namespace
{

constexpr int SWP_ROWS = 256;              /* rows of a chunk at most (wgmma's n) */
constexpr int SWP_BOX_BYTES = 64 * 64 * 2; /* one TMA box of the rows: 64 rows x 64 k */
constexpr int SWP_EPI_BYTES = 16 * 1024;   /* per consumer warpgroup */
constexpr int SWP_EPI_OFF = WS_BAR_OFF + 1024;
constexpr int SWP_SMEM_BYTES = SWP_EPI_OFF + 2 * SWP_EPI_BYTES + 1024;
static_assert(SWP_SMEM_BYTES <= 227 * 1024, "v10's stages do not fit in shared memory");
static_assert(SWP_ROWS * 64 * 2 <= WG_B_BYTES, "a chunk's rows exceed the stage's B part");

/* the chunks of one expert's rows [rb, re): n chunks of cs rows (the last
 * one shorter), cs a multiple of 16 and at most SWP_ROWS */
struct swp_chunks {
    int n, cs;
};
__device__ __forceinline__ swp_chunks swp_split(int rows)
{
    const int n = (rows + SWP_ROWS - 1) / SWP_ROWS;
    const int per = (rows + n - 1) / n;
    return swp_chunks{n, (per + 15) & ~15};
}

/* the walk every role of a CTA makes, in the same order: its items (w =
 * CTA, + grid), each expert's rows in chunks; chunk(e, m0, r0, nr) for
 * each chunk of nr rows from row r0 of expert e, output columns m0 */
template <class CHUNK>
__device__ __forceinline__ void swp_walk(const kcu_gemm_args &p, int mt, int total, CHUNK &&chunk)
{
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
        const int e = w / mt, m0 = (w % mt) * 128;
        const int rb = p.offs[e], rows = p.offs[e + 1] - rb;
        if (rows <= 0)
            continue;
        const swp_chunks c = swp_split(rows);
        for (int ci = 0; ci < c.n; ci++)
            chunk(e, m0, rb + ci * c.cs, min(c.cs, rows - ci * c.cs));
    }
}

__device__ __forceinline__ void bar_wg(int id)
{
    asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void stsm_x2_t(uint32_t addr, uint32_t r0, uint32_t r1)
{
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr),
                 "r"(r0), "r"(r1)
                 : "memory");
}
__device__ __forceinline__ void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                          uint32_t r3)
{
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
        "r"(r0), "r"(r1), "r"(r2), "r"(r3)
        : "memory");
}
/* one chunk's K / 64 stages for consumer warpgroup cw: d[0 .. N/2) = its
 * 64 weight columns x N rows (sequence numbers it..; it moves past them) */
template <int N>
__device__ __forceinline__ void swp_k_loop(float (&d)[128], uint32_t full0, uint32_t empty0,
                                           uint32_t sbase, uint32_t &it, int ktiles, int cw,
                                           int lane)
{
#pragma unroll
    for (int i = 0; i < N / 2; i++)
        d[i] = 0.f;
    wg_pin(d);
    for (int kt = 0; kt < ktiles; kt++, it++) {
        const int s = it % WS_STAGES;
        mbar_wait(full0 + 8 * s, (it / WS_STAGES) & 1);
        const uint32_t st = sbase + s * WG_STAGE_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++)
            wg_mma_n<N>(d, wg_desc_k(st + cw * (64 * 128) + kk * 32),
                        wg_desc_k(st + WG_A_BYTES + kk * 32));
        wg_commit();
        wg_wait<1>();
        if (kt > 0 && lane == 0)
            mbar_arrive(empty0 + 8 * ((it + WS_STAGES - 1) % WS_STAGES));
    }
    wg_wait<0>();
    wg_pin(d);
    if (ktiles > 0 && lane == 0)
        mbar_arrive(empty0 + 8 * ((it + WS_STAGES - 1) % WS_STAGES));
}

/* SWIGLU: warp wq's fragment rows 16 wq + g (gate) and + 8 (up) are h column
 * 32 cw + 8 wq + g of the item; rows (tokens) 8 j + 2 q4 (+1). Staged as
 * [row][32 columns] (64 bytes a row, its four 16-byte pieces swizzled by
 * row / 2), then nr rows x 64 bytes to h */
template <int N>
__device__ __forceinline__ void swp_epi_swiglu(const kcu_gemm_args &p, const float (&d)[128],
                                               uint32_t buf, int r0, int nr, int m0, int cw, int wq,
                                               int lane, int tid)
{
    const int t8 = lane & 7, mi = (lane >> 3) & 1;
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
        uint32_t v[2];
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
            const int b = 4 * (j + jj);
            v[jj] = pack_bf2(act_swiglu::fwd(d[b], d[b + 2]), act_swiglu::fwd(d[b + 1], d[b + 3]));
        }
        const int row = 8 * (j + mi) + t8;
        stsm_x2_t(buf + row * 64 + ((wq ^ ((row >> 1) & 3)) << 4), v[0], v[1]);
    }
    bar_wg(1 + cw);
    bf16 *h = p.h + (size_t)r0 * p.F + m0 / 2 + 32 * cw;
    for (int i = tid; i < nr * 4; i += 128) {
        const int row = i >> 2, ch = i & 3;
        const uint4 v = lds_u128(buf + row * 64 + ((ch ^ ((row >> 1) & 3)) << 4));
        *reinterpret_cast<uint4 *>(h + (size_t)row * p.F + ch * 8) = v;
    }
    bar_wg(1 + cw);
}

/* SCATTER: warp wq's fragment rows 16 wq + g + 8 hr are output column
 * 64 cw + 16 wq + 8 hr + g of the item. Rows in passes of 128: staged as
 * [row][64 columns] (128 bytes a row, its eight 16-byte pieces swizzled
 * by row), then each row's 128 bytes to out[scatter[r]] */
template <int N>
__device__ __forceinline__ void swp_epi_scatter(const kcu_gemm_args &p, const float (&d)[128],
                                                uint32_t buf, int r0, int nr, int m0, int cw,
                                                int wq, int lane, int tid)
{
    const int t8 = lane & 7, hr = (lane >> 3) & 1, mj = lane >> 4;
#pragma unroll
    for (int pass = 0; pass < (N + 127) / 128; pass++) {
#pragma unroll
        for (int j = 16 * pass; j < N / 8 && j < 16 * (pass + 1); j += 2) {
            const int b0 = 4 * j, b1 = 4 * (j + 1);
            const int row = 8 * (j - 16 * pass + mj) + t8;
            stsm_x4_t(buf + row * 128 + (((2 * wq + hr) ^ (row & 7)) << 4),
                      pack_bf2(d[b0], d[b0 + 1]), pack_bf2(d[b0 + 2], d[b0 + 3]),
                      pack_bf2(d[b1], d[b1 + 1]), pack_bf2(d[b1 + 2], d[b1 + 3]));
        }
        bar_wg(1 + cw);
        const int rows = min(128, nr - 128 * pass);
        for (int i = tid; i < rows * 8; i += 128) {
            const int row = i >> 3, ch = i & 7;
            const int r = r0 + 128 * pass + row;
            const uint4 v = lds_u128(buf + row * 128 + ((ch ^ (row & 7)) << 4));
            bf16 *dst = p.Cb + (size_t)(p.scatter ? p.scatter[r] : r) * p.ldc + m0 + 64 * cw;
            *reinterpret_cast<uint4 *>(dst + ch * 8) = v;
        }
        bar_wg(1 + cw);
    }
}

/* one chunk for consumer warpgroup cw: the k loop and the epilogue at the
 * chunk's n extent N (16 ... 256) */
template <int EPI, int N>
__device__ __forceinline__ void swp_chunk(const kcu_gemm_args &p, uint32_t full0, uint32_t empty0,
                                          uint32_t sbase, uint32_t &it, int ktiles, uint32_t buf,
                                          int r0, int nr, int m0, int cw, int wq, int lane, int tid)
{
    float d[128];
    swp_k_loop<N>(d, full0, empty0, sbase, it, ktiles, cw, lane);
    if (EPI == KCU_EPI_SWIGLU)
        swp_epi_swiglu<N>(p, d, buf, r0, nr, m0, cw, wq, lane, tid);
    else
        swp_epi_scatter<N>(p, d, buf, r0, nr, m0, cw, wq, lane, tid);
}

template <int EPI>
__device__ __forceinline__ void
swp_chunk_n(const kcu_gemm_args &p, uint32_t full0, uint32_t empty0, uint32_t sbase, uint32_t &it,
            int ktiles, uint32_t buf, int r0, int nr, int m0, int cw, int wq, int lane, int tid)
{
#define SWP_CASE(n16)                                                                              \
    case n16:                                                                                      \
        swp_chunk<EPI, 16 * (n16)>(p, full0, empty0, sbase, it, ktiles, buf, r0, nr, m0, cw, wq,   \
                                   lane, tid);                                                     \
        break;
    switch ((nr + 15) >> 4) {
        SWP_CASE(1)
        SWP_CASE(2)
        SWP_CASE(3)
        SWP_CASE(4)
        SWP_CASE(5)
        SWP_CASE(6)
        SWP_CASE(7)
        SWP_CASE(8)
        SWP_CASE(9)
        SWP_CASE(10)
        SWP_CASE(11)
        SWP_CASE(12)
        SWP_CASE(13)
        SWP_CASE(14)
        SWP_CASE(15)
        SWP_CASE(16)
    default: break;
    }
#undef SWP_CASE
}

template <int EPI>
__global__ void __launch_bounds__(WS_NT, 1)
    k_gemm_swap(const kcu_gemm_args p, const __grid_constant__ ws_maps mp)
{
#if KCU_SM90 /* Hopper only: never launched from the portable image */
    const uint32_t sbase = smem_base_1k(), full0 = sbase + WS_BAR_OFF,
                   empty0 = full0 + WS_STAGES * 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    if (tid == 0) {
        ws_stage_bars_init(full0, empty0, 1, 8);
        ws_bars_fence();
    }
    __syncthreads();
    kcu_pdl_wait();
    kcu_pdl_trigger();
    const int mt = p.N / 128, total = p.ngroups * mt, ktiles = p.K / BK;

    if (wg == 0) {
        /* ---------------- producer: thread 0 ---------------- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WS_PRODUCER_REGS));
        if (tid != 0)
            return;
        prefetch_tmap(&mp.a);
        prefetch_tmap(&mp.b);
        uint32_t it = 0;
        swp_walk(p, mt, total, [&](int e, int m0, int r0, int nr) {
            const int nbox = (((nr + 15) & ~15) + 63) / 64;
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const ws_slot g = ws_slot_take(full0, empty0, sbase, it);
                const int k0 = kt * BK;
                mbar_arrive_tx(g.fb, WG_A_BYTES + nbox * SWP_BOX_BYTES);
                tma_3d(g.sa, &mp.b, k0, m0, e, g.fb);
                for (int b = 0; b < nbox; b++)
                    tma_2d(g.sb + b * SWP_BOX_BYTES, &mp.a, k0, r0 + 64 * b, g.fb);
            }
        });
        return;
    }

    /* ---------------- consumers ---------------- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WS_CONSUMER_REGS));
    const int cw = wg - 1, wq = warp & 3;
    const uint32_t buf = sbase + SWP_EPI_OFF + cw * SWP_EPI_BYTES;
    uint32_t it = 0;
    swp_walk(p, mt, total, [&](int, int m0, int r0, int nr) {
        swp_chunk_n<EPI>(p, full0, empty0, sbase, it, ktiles, buf, r0, nr, m0, cw, wq, lane,
                         tid & 127);
    });
#endif
}

template <int EPI>
moe_err launch_swap(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    KCU_TRY(smem_limit_once(attr_done, k_gemm_swap<EPI>, SWP_SMEM_BYTES));
    const long long total = (long long)a->ngroups * (a->N / 128);
    if (total <= 0)
        return MOE_OK;
    const int grid = (int)(total < nsm ? total : nsm);
    KCU_CHECK(kcu_launch(k_gemm_swap<EPI>, dim3(grid), dim3(WS_NT), SWP_SMEM_BYTES, st, a->pdl, 0,
                         *a, m));
    return MOE_OK;
}

} // namespace

moe_err kgemm::launch_v10(kcu_epi epi, const kcu_gemm_args *a, const ws_maps &m, int nsm,
                          cudaStream_t st)
{
    if (epi == KCU_EPI_SWIGLU)
        return launch_swap<KCU_EPI_SWIGLU>(a, m, nsm, st);
    if (epi == KCU_EPI_SCATTER)
        return launch_swap<KCU_EPI_SCATTER>(a, m, nsm, st);
    fprintf(stderr, "kcu_gemm: v10 has no epilogue %d\n", epi);
    return MOE_EINVAL;
}
