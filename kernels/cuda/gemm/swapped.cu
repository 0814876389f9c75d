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
 * empty[s] 8 (each consumer warp; 16 paired, below).
 *
 * Epilogues (through 16 KB of shared memory per consumer warpgroup: the
 * fragments stored transposed by stmatrix, then 16-byte rows out):
 *   SWIGLU: h (rows, F) of the item's 64 h columns m0 / 2 .. (w13's rows
 *     interleave gate and up by 8, so a lane holds both of a column: its
 *     fragment rows g and g + 8); inference only (no (a, b) kept);
 *   SCATTER: bf16 out[scatter[r]] (rows, N) of the item's 128 columns, in
 *     two passes of 128 rows; wide items take the chunk's scatter entries
 *     into shared memory by cp.async during its k loop.
 * Each output is the same sum of the same products, k ascending in steps
 * of 16, as v4 / v7 compute it with the operands in their places.
 *
 * Wide items (swp_cfg<1>, the default where N is a multiple of 256 and the
 * rows average at most kgemm::V10_WIDE_MAX_AVG an expert): 256 output columns an item,
 * each consumer warpgroup two m64 accumulators over the same rows, chunks
 * of at most 192 rows, 3 stages of 56 KB (the weight tile in two boxes of
 * 128 columns, then the rows). Why: ncu of the narrow items at qwen235
 * T=2048 (H200) put L2 at 94% of its peak and DRAM at 78%: the rows, re-read
 * by each of their expert's N / 128 items, are as many L2 bytes as the
 * weights. Wide items read them half as often and carry twice the math a
 * stage. Same sums in the same order: bits == narrow == v4.
 *
 * Paired wide items (KCU_V10_PAIR=1, off by default; k_gemm_swap<EPI, 1,
 * 2>): 2-CTA clusters, the two CTAs on the two 256-column halves of one
 * expert's 512 columns, walking the same chunks; CTA b % 2 loads row box b
 * with .multicast::cluster into both, full[s] expects all the row bytes in
 * each CTA, empty[s] 16 arrivals (every consumer warp of both CTAs
 * releases the stage in both), and each producer waits for the last
 * stages' releases before it exits. Measured neutral on H200: ncu counted
 * as many L2 reads as without (bench/NOTES.md "v10 paired").
 *
 * Wide items in 4 stages (the default; KCU_V10_HELD=0 gives the 3 stages
 * of swp_cfg<1>; swp_cfg<2>): bench/tma_stream's consumer model says a
 * stage held under the math costs 5-6% of the loads' rate with 3 stages and
 * 1-2% with 4. A 4th stage of 56 KB fits when the epilogue buffers go: each
 * chunk's epilogue stages its outputs through the chunk's last stage (each
 * consumer warpgroup through the 16 KB of weights only it read), which the
 * consumer warps release after the epilogue (a proxy fence first, as the
 * TMA refills it); SCATTER's entries sit in slots beside the barriers.
 * Measured on H200: the up-projection 851-873 us against 890-893, the
 * down 444-454 against 472-475 (ncu, qwen235 T=2048).
 *
 * Rows paired (KCU_V10_ROWPAIR; k_gemm_swap<EPI, 2, 3>, or <EPI, 1, 3> in 3 stages):
 * where the rows average 177-384 an expert, wide items on 2-CTA clusters,
 * both CTAs on the same 256 output columns, the expert's rows in chunks of
 * up to 384 each split in two halves (a multiple of 16 rows first, the
 * rest, possibly none, second); CTA b loads weight box b with
 * .multicast::cluster into both, each CTA its own rows; full[s] expects
 * both weight boxes and its rows, empty[s] 16 arrivals. An expert's
 * weights stream once for up to 384 rows padded to 16, where plain wide
 * items stream them once a 192-row chunk and v7 pads to 128. In 4 held
 * stages (KCU_V10_ROWPAIR_HELD) as the wide items' (swp_cfg<2>): the peer's
 * multicast into the held stage waits for this CTA's release after the
 * epilogue, as empty[s] counts both CTAs' consumer warps. Measured on H200
 * (bench/NOTES.md "v10 rows paired"): qwen235 T=4096 2.535-2.579 ms against
 * 2.80-2.92 on v7; at 128 rows an expert 30% slower than plain wide items,
 * so it runs only above V10_WIDE_MAX_AVG.
 *
 * Store warps (SW, swp_cfg<3>, the held up-projection; KCU_V10_SW=0 turns
 * it off): the consumers stage both h tiles of a chunk at once (tile 0 in
 * their warpgroup's weight half of the held stage, tile 1 in its half of
 * the rows, after a barrier over both warpgroups), arrive on their
 * warpgroup's barrier and go on to the next chunk; warp 1 + cw of the
 * producer warpgroup stores warpgroup cw's tiles (128-byte h rows, where
 * the consumers stored 64-byte halves) and releases the stage for that
 * warpgroup's four warps. Measured on H200: 846-851 us against 866-883.
 * The down-projection's two tiles (256-byte rows, 48 KB a warpgroup) need
 * the chunk's last two stages held: tried in two forms, both slower
 * (473-480 us against 445-455; bench/NOTES.md "v10 held"), removed.
 */
#include "kernels/cuda/gemm/common.cuh"
#include "kernels/cuda/gemm/tile.cuh"
#include "kernels/cuda/gemm/tma.cuh"
#include "kernels/cuda/gemm/cluster.cuh"
#include "kernels/cuda/gemm/epilogue.cuh"
#include "kernels/cuda/gemm/wgmma_n.cuh"

namespace
{

constexpr int SWP_BOX_BYTES = 64 * 64 * 2; /* one TMA box of the rows: 64 rows x 64 k */
constexpr int SWP_EPI_BYTES = 16 * 1024;   /* per consumer warpgroup */

/* the item shapes: narrow (W 0: 128 output columns, v4's 48 KB stage,
 * chunks of 256 rows), wide (W 1: 256 columns, two m64 accumulators a
 * consumer warpgroup, chunks of 192 rows, 3 stages of 56 KB) and wide in 4
 * stages (W 2, HELD: no epilogue buffers of their own - a chunk's epilogue
 * stages its outputs through the chunk's last stage, which the consumers
 * hold until it ends; SCATTER's entries in slots beside the barriers) */
template <int W> struct swp_cfg {
    static constexpr int ROWS = W ? 192 : 256;    /* rows of a chunk at most (wgmma's n) */
    static constexpr int COLS = W ? 256 : 128;    /* output columns of an item */
    static constexpr int TILES = COLS / 128;      /* m64 tiles a consumer warpgroup */
    static constexpr int A_BYTES = COLS * 64 * 2; /* the weight tile: COLS x 64 k */
    static constexpr int STAGE = A_BYTES + ROWS * 64 * 2;
    static constexpr bool HELD = W >= 2;
    /* SW (W 3, SWIGLU): the chunk's two h tiles staged at once in its held
     * stage and stored to h by a store warp of the producer warpgroup, which
     * then releases the stage: the consumers go on to the next chunk */
    static constexpr bool SW = W == 3;
    static constexpr int STAGES = HELD ? 4 : W ? 3 : WS_STAGES;
    static constexpr int BAR_OFF = STAGES * STAGE;
    /* SW: a barrier per consumer warpgroup after full[] and empty[] (its
     * staged tiles ready for its store warp) */
    static constexpr int EPI_FULL_OFF = BAR_OFF + 2 * STAGES * 8;
    static constexpr int EPI_OFF = BAR_OFF + 1024;
    /* SCATTER's entries of a chunk in shared memory (ENT, wide items; the
     * narrow ones' 4 stages leave no room), a slot per consumer warpgroup:
     * after its epilogue buffer, or (HELD) at ENT_OFF beside the barriers */
    static constexpr bool ENT = W;
    static constexpr int ENT_OFF = BAR_OFF + 128;
    static constexpr int EPI_STRIDE = HELD ? 0 : SWP_EPI_BYTES + (ENT ? ROWS * 4 : 0);
    static constexpr int SMEM = HELD ? BAR_OFF + 2048 + 1024 : EPI_OFF + 2 * EPI_STRIDE + 1024;
    static_assert(SMEM <= 227 * 1024, "v10's stages do not fit in shared memory");
    static_assert(STAGE % 1024 == 0, "a stage must keep its boxes 1024-byte aligned");
    static_assert(!HELD || (ENT_OFF + 2 * ROWS * 4 <= BAR_OFF + 2048 && 2 * SWP_EPI_BYTES <= STAGE),
                  "the held stage holds both epilogue buffers, the slots fit by the barriers");
    static_assert(
        !SW || (EPI_FULL_OFF + 16 <= ENT_OFF && 2 * ROWS * 64 <= STAGE - A_BYTES &&
                ROWS * 64 <= SWP_EPI_BYTES),
        "SW: the barriers before the slots; each warpgroup's two h tiles in its held stage");
};
static_assert(swp_cfg<0>::STAGE == WG_STAGE_BYTES && swp_cfg<0>::BAR_OFF == WS_BAR_OFF,
              "narrow items keep v4's stage layout");

/* the chunks of one expert's rows [rb, re): n chunks of cs rows (the last
 * one shorter), cs a multiple of 16 and at most CAP */
struct swp_chunks {
    int n, cs;
};
template <int CAP> __device__ __forceinline__ swp_chunks swp_split(int rows)
{
    const int n = (rows + CAP - 1) / CAP;
    const int per = (rows + n - 1) / n;
    return swp_chunks{n, (per + 15) & ~15};
}

/* CL: 1 one CTA an item; 2 (paired) and 3 (rows paired) 2-CTA clusters */
template <int CL> constexpr int swp_ctas = CL == 1 ? 1 : 2;

/* the walk every role of a CTA makes, in the same order: its items (w =
 * CTA, + grid; mt items an expert), each expert's rows in chunks;
 * chunk(e, m0, r0, nr) for each chunk of nr rows from row r0 of expert e,
 * output columns m0 .. m0 + C::COLS. Paired (CL 2): item w is the cluster's
 * (w = cluster, + clusters), mt pairs an expert, and CTA `rank` takes the
 * pair's half rank of 2 x C::COLS columns: both CTAs of a cluster walk the
 * same chunks of the same rows in the same order. Rows paired (CL 3): item
 * w is the cluster's, both CTAs on its C::COLS columns; the expert's rows
 * in chunks of up to 2 x C::ROWS, CTA `rank` taking half rank of each (the
 * first half cn / 2 rounded up to 16, the second the rest, possibly none:
 * nr 0 still walks the chunk's stages) */
template <class C, int CL, class CHUNK>
__device__ __forceinline__ void swp_walk(const kcu_gemm_args &p, int mt, int total, int rank,
                                         CHUNK &&chunk)
{
    constexpr int CTAS = swp_ctas<CL>;
    for (int w = blockIdx.x / CTAS; w < total; w += gridDim.x / CTAS) {
        const int e = w / mt;
        const int m0 = CL == 3 ? (w % mt) * C::COLS : ((w % mt) * CL + rank) * C::COLS;
        const int rb = p.offs[e], rows = p.offs[e + 1] - rb;
        if (rows <= 0)
            continue;
        if (CL == 3) {
            const swp_chunks c = swp_split<2 * C::ROWS>(rows);
            for (int ci = 0; ci < c.n; ci++) {
                const int cr0 = ci * c.cs, cn = min(c.cs, rows - cr0);
                const int h = min(cn, (((cn + 1) >> 1) + 15) & ~15);
                chunk(e, m0, rb + cr0 + (rank ? h : 0), rank ? cn - h : h);
            }
        } else {
            const swp_chunks c = swp_split<C::ROWS>(rows);
            for (int ci = 0; ci < c.n; ci++)
                chunk(e, m0, rb + ci * c.cs, min(c.cs, rows - ci * c.cs));
        }
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
/* keep the compiler from moving reads of d[0 .. N/2) above a wgmma wait
 * (wg_pin of the first N/2: the rest never becomes live) */
template <int N> __device__ __forceinline__ void swp_pin(float (&d)[128])
{
#pragma unroll
    for (int i = 0; i < N / 2; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* releases stage barrier eb: in this CTA, and on a 2-CTA cluster (CL 2, 3)
 * in the peer's too (its producer multicasts rows (2) or a weight box (3)
 * into this CTA's stage) */
template <int CL> __device__ __forceinline__ void swp_release(uint32_t eb, uint32_t peer)
{
    mbar_arrive(eb);
    if (CL != 1)
        mbar_arrive_cluster(eb, peer);
}

/* one chunk's K / 64 stages for consumer warpgroup cw: d[t][0 .. N/2) = its
 * m64 tile t (output columns C::COLS / 2 x cw + 64 t ..) x N rows
 * (sequence numbers it..; it moves past them) */
template <class C, int CL, int N>
__device__ __forceinline__ void swp_k_loop(float (&d)[C::TILES][128], uint32_t full0,
                                           uint32_t empty0, uint32_t sbase, uint32_t &it,
                                           int ktiles, int cw, int lane, uint32_t peer)
{
#pragma unroll
    for (int t = 0; t < C::TILES; t++) {
#pragma unroll
        for (int i = 0; i < N / 2; i++)
            d[t][i] = 0.f;
        swp_pin<N>(d[t]);
    }
    for (int kt = 0; kt < ktiles; kt++, it++) {
        const int s = it % C::STAGES;
        mbar_wait(full0 + 8 * s, (it / C::STAGES) & 1);
        const uint32_t st = sbase + s * C::STAGE;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++)
#pragma unroll
            for (int t = 0; t < C::TILES; t++)
                wg_mma_n<N>(d[t], wg_desc_k(st + (C::TILES * cw + t) * (64 * 128) + kk * 32),
                            wg_desc_k(st + C::A_BYTES + kk * 32));
        wg_commit();
        wg_wait<1>();
        if (kt > 0 && lane == 0)
            swp_release<CL>(empty0 + 8 * ((it + C::STAGES - 1) % C::STAGES), peer);
    }
    wg_wait<0>();
#pragma unroll
    for (int t = 0; t < C::TILES; t++)
        swp_pin<N>(d[t]);
    /* HELD: the last stage stays with the consumers for the epilogue */
    if (!C::HELD && ktiles > 0 && lane == 0)
        swp_release<CL>(empty0 + 8 * ((it + C::STAGES - 1) % C::STAGES), peer);
}

/* SW: the SWIGLU of one m64 tile staged at buf as swp_epi_swiglu stages it
 * ([row][32 h columns], 64 bytes a row, swizzled by row / 2), not stored */
template <int N>
__device__ __forceinline__ void swp_stage_swiglu(const float (&d)[128], uint32_t buf, int wq,
                                                 int lane)
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
}

/* SWIGLU, one m64 tile of output columns col .. col + 64: warp wq's
 * fragment rows 16 wq + g (gate) and + 8 (up) are h column col / 2 + 8 wq +
 * g; rows (tokens) 8 j + 2 q4 (+1). Staged as [row][32 columns] (64 bytes a
 * row, its four 16-byte pieces swizzled by row / 2), then nr rows x 64
 * bytes to h; bar: the warpgroup's named barrier */
template <int N>
__device__ __forceinline__ void swp_epi_swiglu(const kcu_gemm_args &p, const float (&d)[128],
                                               uint32_t buf, int r0, int nr, int col, int bar,
                                               int wq, int lane, int tid)
{
    swp_stage_swiglu<N>(d, buf, wq, lane);
    bar_wg(bar);
    bf16 *h = p.h + (size_t)r0 * p.F + col / 2;
    for (int i = tid; i < nr * 4; i += 128) {
        const int row = i >> 2, ch = i & 3;
        const uint4 v = lds_u128(buf + row * 64 + ((ch ^ ((row >> 1) & 3)) << 4));
        *reinterpret_cast<uint4 *>(h + (size_t)row * p.F + ch * 8) = v;
    }
    bar_wg(bar);
}

/* SW: the two h tiles a consumer warpgroup staged (tile 0 at b0, tile 1 at
 * b1, swp_stage_swiglu's layout) to h rows r0 .. r0 + nr, h columns hc ..
 * hc + 64: 128 bytes a row, each lane 16 of them, a warp four rows a step */
__device__ __forceinline__ void swp_store_swiglu(const kcu_gemm_args &p, uint32_t b0, uint32_t b1,
                                                 int r0, int nr, int hc, int lane)
{
    const int t = (lane >> 2) & 1, ch = lane & 3; /* this lane's piece of a row */
    const uint32_t src = t ? b1 : b0;
    bf16 *h = p.h + (size_t)r0 * p.F + hc + 32 * t + 8 * ch;
    for (int row = lane >> 3; row < nr; row += 4) {
        const uint4 v = lds_u128(src + row * 64 + ((ch ^ ((row >> 1) & 3)) << 4));
        *reinterpret_cast<uint4 *>(h + (size_t)row * p.F) = v;
    }
}

/* SCATTER, one m64 tile of output columns col .. col + 64: warp wq's
 * fragment rows 16 wq + g + 8 hr are output column col + 16 wq + 8 hr + g.
 * Rows in passes of 128: staged as [row][64 columns] (128 bytes a row, its
 * eight 16-byte pieces swizzled by row), then each row's 128 bytes to
 * out[scatter[r]], warp wq the pass's rows 32 wq .. + 32, four a step. ENT
 * (wide items): the chunk's scatter entries are in shared memory at ent
 * (swp_scatter_fetch, by cp.async before the k loop), so the epilogue no
 * longer waits for an L2 load before each step's stores, eight in a row
 * while the stage ring sat full (bench/NOTES.md "v10 paired"). bar: the
 * warpgroup's named barrier */
template <bool ENT, int N>
__device__ __forceinline__ void swp_epi_scatter(const kcu_gemm_args &p, const float (&d)[128],
                                                uint32_t buf, uint32_t ent, int r0, int nr, int col,
                                                int bar, int wq, int lane, int tid)
{
    const int t8 = lane & 7, hr = (lane >> 3) & 1, mj = lane >> 4;
#pragma unroll
    for (int pass = 0; pass < (N + 127) / 128; pass++) {
        const int rows = min(128, nr - 128 * pass), rp = r0 + 128 * pass;
#pragma unroll
        for (int j = 16 * pass; j < N / 8 && j < 16 * (pass + 1); j += 2) {
            const int b0 = 4 * j, b1 = 4 * (j + 1);
            const int row = 8 * (j - 16 * pass + mj) + t8;
            stsm_x4_t(buf + row * 128 + (((2 * wq + hr) ^ (row & 7)) << 4),
                      pack_bf2(d[b0], d[b0 + 1]), pack_bf2(d[b0 + 2], d[b0 + 3]),
                      pack_bf2(d[b1], d[b1 + 1]), pack_bf2(d[b1 + 2], d[b1 + 3]));
        }
        cp_async_wait<0>(); /* this thread's copies of the chunk's entries */
        bar_wg(bar);
        const int ch = lane & 7;
#pragma unroll 4
        for (int j = 0; j < 8; j++) {
            const int row = 32 * wq + 4 * j + (lane >> 3);
            if (row < rows) {
                const int dq = !p.scatter ? rp + row
                               : ENT      ? (int)lds_u32(ent + 4 * (128 * pass + row))
                                          : __ldg(p.scatter + rp + row);
                const uint4 v = lds_u128(buf + row * 128 + ((ch ^ (row & 7)) << 4));
                *reinterpret_cast<uint4 *>(p.Cb + (size_t)dq * p.ldc + col + ch * 8) = v;
            }
        }
        bar_wg(bar);
    }
}

/* SCATTER: the chunk's scatter entries scatter[r0 .. r0 + nr) into shared
 * memory at ent (the warpgroup's slot) by cp.async, 4 bytes each, waited
 * for in the epilogue: in flight while the k loop runs */
__device__ __forceinline__ void swp_scatter_fetch(const kcu_gemm_args &p, uint32_t ent, int r0,
                                                  int nr, int tid)
{
    if (!p.scatter)
        return;
    for (int i = tid; i < nr; i += 128)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(ent + 4 * i),
                     "l"(p.scatter + r0 + i)
                     : "memory");
    cp_async_commit();
}

/* one chunk for consumer warpgroup cw: the k loop and the epilogue of each
 * of its m64 tiles at the chunk's n extent N (16 ... C::ROWS) */
template <class C, int CL, int EPI, int N>
__device__ __forceinline__ void swp_chunk(const kcu_gemm_args &p, uint32_t full0, uint32_t empty0,
                                          uint32_t sbase, uint32_t &it, int ktiles, int r0, int nr,
                                          int m0, int cw, int wq, int lane, int tid, uint32_t peer)
{
    float d[C::TILES][128];
    /* this warpgroup's epilogue buffer (not HELD) and SCATTER's entry slot */
    const uint32_t buf = sbase + C::EPI_OFF + cw * C::EPI_STRIDE;
    const uint32_t ent = C::HELD ? sbase + C::ENT_OFF + cw * (C::ROWS * 4) : buf + SWP_EPI_BYTES;
    if (EPI == KCU_EPI_SCATTER && C::ENT)
        swp_scatter_fetch(p, ent, r0, nr, tid);
    swp_k_loop<C, CL, N>(d, full0, empty0, sbase, it, ktiles, cw, lane, peer);
    /* HELD: the epilogue's buffer is this warpgroup's 16 KB of the chunk's
     * last stage (its wgmma have retired: wg_wait<0> in the k loop) */
    const uint32_t held = (it + C::STAGES - 1) % C::STAGES;
    const uint32_t eb = C::HELD ? sbase + held * C::STAGE + cw * SWP_EPI_BYTES : buf;
    if constexpr (C::SW) {
        /* tile 0 in this warpgroup's weight half, tile 1 in its half of the
         * rows (the other warpgroup's wgmma on them retired: barrier 3 over
         * both), then the store warp takes them and releases the stage */
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
        swp_stage_swiglu<N>(d[0], eb, wq, lane);
        swp_stage_swiglu<N>(d[1], sbase + held * C::STAGE + C::A_BYTES + cw * (C::ROWS * 64), wq,
                            lane);
        __syncwarp(); /* stmatrix is the warp's: its writes before any lane's arrival */
        mbar_arrive(sbase + C::EPI_FULL_OFF + 8 * cw);
    } else {
#pragma unroll
        for (int t = 0; t < C::TILES; t++) {
            const int col = m0 + (C::TILES * cw + t) * 64;
            if (EPI == KCU_EPI_SWIGLU)
                swp_epi_swiglu<N>(p, d[t], eb, r0, nr, col, 1 + cw, wq, lane, tid);
            else
                swp_epi_scatter<C::ENT, N>(p, d[t], eb, ent, r0, nr, col, 1 + cw, wq, lane, tid);
        }
        if (C::HELD && ktiles > 0) {
            /* the stage goes back to the producer: this thread's shared-memory
             * accesses ordered before the TMA writes that refill it */
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncwarp();
            if (lane == 0)
                swp_release<CL>(empty0 + 8 * held, peer);
        }
    }
}

template <class C, int CL, int EPI>
__device__ __forceinline__ void
swp_chunk_n(const kcu_gemm_args &p, uint32_t full0, uint32_t empty0, uint32_t sbase, uint32_t &it,
            int ktiles, int r0, int nr, int m0, int cw, int wq, int lane, int tid, uint32_t peer)
{
    if (CL == 3 && nr <= 0) {
        /* rows paired: no rows of this chunk here; its stages (the weights
         * the peer also multiplies) pass through, released unread */
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % C::STAGES;
            mbar_wait(full0 + 8 * s, (it / C::STAGES) & 1);
            __syncwarp();
            if (lane == 0)
                swp_release<CL>(empty0 + 8 * s, peer);
        }
        return;
    }
#define SWP_CASE(n16)                                                                              \
    case n16:                                                                                      \
        if (16 * (n16) <= C::ROWS)                                                                 \
            swp_chunk<C, CL, EPI, 16 * (n16) <= C::ROWS ? 16 * (n16) : 16>(                        \
                p, full0, empty0, sbase, it, ktiles, r0, nr, m0, cw, wq, lane, tid, peer);         \
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

/* a stage's weight tile (C::COLS columns from m0 of expert e, 64 k from
 * k0) into sa, on barrier fb: its 128-column boxes, or (rows paired, CL 3)
 * box `rank` multicast to both CTAs, the peer loading the other */
template <class C, int CL>
__device__ __forceinline__ void swp_load_weights(const ws_maps &mp, uint32_t sa, int k0, int m0,
                                                 int e, uint32_t fb, int rank)
{
    for (int b = 0; b < C::COLS / 128; b++) {
        if (CL != 3)
            tma_3d(sa + b * (128 * 64 * 2), &mp.b, k0, m0 + 128 * b, e, fb);
        else if (b == rank)
            tma_3d_mc(sa + b * (128 * 64 * 2), &mp.b, k0, m0 + 128 * b, e, fb, (uint16_t)3);
    }
}

/* the producer (thread 0): each chunk's k stages, the weight tile
 * (swp_load_weights) and the chunk's rows into each, on the stage's full
 * barrier; the rows padded to 16, in boxes of 64 rows; paired, box b comes
 * from CTA b % 2's load, multicast to both; rows paired, the rows each
 * CTA's own */
template <class C, int CL>
__device__ __forceinline__ void swp_producer(const kcu_gemm_args &p, const ws_maps &mp,
                                             uint32_t full0, uint32_t empty0, uint32_t sbase,
                                             int mt, int total, int ktiles, int rank)
{
    prefetch_tmap(&mp.a);
    prefetch_tmap(&mp.b);
    uint32_t it = 0;
    swp_walk<C, CL>(p, mt, total, rank, [&](int e, int m0, int r0, int nr) {
        const int nbox = (((nr + 15) & ~15) + 63) / 64;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % C::STAGES;
            const uint32_t fb = full0 + 8 * s, sa = sbase + s * C::STAGE, sb = sa + C::A_BYTES;
            mbar_wait(empty0 + 8 * s, ((it / C::STAGES) & 1) ^ 1);
            const int k0 = kt * BK;
            mbar_arrive_tx(fb, C::A_BYTES + nbox * SWP_BOX_BYTES);
            swp_load_weights<C, CL>(mp, sa, k0, m0, e, fb, rank);
            for (int b = 0; b < nbox; b++) {
                if (CL != 2)
                    tma_2d(sb + b * SWP_BOX_BYTES, &mp.a, k0, r0 + 64 * b, fb);
                else if (b % 2 == rank)
                    tma_2d_mc(sb + b * SWP_BOX_BYTES, &mp.a, k0, r0 + 64 * b, fb, (uint16_t)3);
            }
        }
    });
    /* on a 2-CTA cluster, the last stages released by both CTAs' consumers
     * before this CTA exits (no remote arrival may reach an exited CTA) */
    for (int i = 0; CL != 1 && i < C::STAGES; i++, it++)
        mbar_wait(empty0 + 8 * (it % C::STAGES), ((it / C::STAGES) & 1) ^ 1);
}

template <int EPI, int W, int CL>
__global__ void __launch_bounds__(WS_NT, 1)
    k_gemm_swap(const kcu_gemm_args p, const __grid_constant__ ws_maps mp)
{
#if KCU_SM90 /* Hopper only: never launched from the portable image */
    using C = swp_cfg<W>;
    static_assert(!C::SW || EPI == KCU_EPI_SWIGLU, "store warps: the up-projection only");
    static_assert(CL != 3 || ((W == 1 || W == 2) && C::COLS == 256),
                  "rows paired: wide items in 3 stages, or 4 held");
    constexpr int CTAS = swp_ctas<CL>;
    const uint32_t sbase = smem_base_1k(), full0 = sbase + C::BAR_OFF,
                   empty0 = full0 + C::STAGES * 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int rank = CL != 1 ? (int)cluster_rank() : 0;
    const uint32_t peer = (uint32_t)(rank ^ 1);
    if (tid == 0) {
        for (int s = 0; s < C::STAGES; s++) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 8 * CTAS); /* each consumer warp of the cluster */
        }
        for (int w = 0; C::SW && w < 2; w++)
            mbar_init(sbase + C::EPI_FULL_OFF + 8 * w, 128); /* each consumer thread */
        ws_bars_fence();
    }
    __syncthreads();
    if (CL != 1)
        cluster_sync_all(); /* the peer's barriers exist before any remote access */
    kcu_pdl_wait();
    kcu_pdl_trigger();
    const int mt = p.N / (C::COLS * (CL == 2 ? 2 : 1)), total = p.ngroups * mt, ktiles = p.K / BK;

    if (wg == 0) {
        /* ---------------- producer: thread 0 ---------------- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WS_PRODUCER_REGS));
        if (C::SW && (warp == 1 || warp == 2)) {
            /* SW: warp 1 + cw stores consumer warpgroup cw's h tiles of each
             * chunk, then releases the chunk's held stage for that
             * warpgroup's four warps. One barrier phase a chunk: the
             * consumers cannot arrive for the next chunk before this one is
             * released (its k loop of >= STAGES steps needs the stage) */
            const int cw = warp - 1;
            uint32_t it = 0, n = 0;
            swp_walk<C, CL>(p, mt, total, rank, [&](int, int m0, int r0, int nr) {
                it += ktiles;
                const uint32_t held = (it + C::STAGES - 1) % C::STAGES,
                               st = sbase + held * C::STAGE;
                mbar_wait(sbase + C::EPI_FULL_OFF + 8 * cw, n++ & 1);
                swp_store_swiglu(p, st + cw * SWP_EPI_BYTES, st + C::A_BYTES + cw * (C::ROWS * 64),
                                 r0, nr, m0 / 2 + 64 * cw, lane);
                /* the reads ordered before the TMA writes that refill it */
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                __syncwarp();
                if (lane == 0) /* for the warpgroup's four warps */
                    asm volatile(
                        "mbarrier.arrive.shared::cta.b64 _, [%0], 4;\n" ::"r"(empty0 + 8 * held)
                        : "memory");
            });
            return;
        }
        if (tid != 0)
            return;
        swp_producer<C, CL>(p, mp, full0, empty0, sbase, mt, total, ktiles, rank);
        return;
    }

    /* ---------------- consumers ---------------- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WS_CONSUMER_REGS));
    const int cw = wg - 1, wq = warp & 3;
    uint32_t it = 0;
    swp_walk<C, CL>(p, mt, total, rank, [&](int, int m0, int r0, int nr) {
        swp_chunk_n<C, CL, EPI>(p, full0, empty0, sbase, it, ktiles, r0, nr, m0, cw, wq, lane,
                                tid & 127, peer);
    });
#endif
}

template <int EPI, int W>
moe_err launch_swap(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
{
    using C = swp_cfg<W>;
    static unsigned long long attr_done;
    KCU_TRY(smem_limit_once(attr_done, k_gemm_swap<EPI, W, 1>, C::SMEM));
    const long long total = (long long)a->ngroups * (a->N / C::COLS);
    if (total <= 0)
        return MOE_OK;
    const int grid = (int)(total < nsm ? total : nsm);
    KCU_CHECK(
        kcu_launch(k_gemm_swap<EPI, W, 1>, dim3(grid), dim3(WS_NT), C::SMEM, st, a->pdl, 0, *a, m));
    return MOE_OK;
}

/* wide items (W 1, or 2 held) on 2-CTA clusters: paired (CL 2,
 * kgemm::v10_paired) or rows paired (CL 3, kgemm::v10_rowpair) */
template <int EPI, int W, int CL>
moe_err launch_swap_paired(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
{
    using C = swp_cfg<W>;
    static unsigned long long attr_done;
    static int max_cl[64];
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute at[2];
    int ok = 0;
    const long long pairs = (long long)a->ngroups * (a->N / ((CL == 2 ? 2 : 1) * C::COLS));
    KCU_TRY(cluster2_config(k_gemm_swap<EPI, W, CL>, attr_done, max_cl, pairs, nsm, C::SMEM, st,
                            cfg, at, &ok));
    if (!ok)
        return MOE_OK;
    kcu_pdl_attr(&cfg, at, a->pdl);
    KCU_CHECK(kcu_launch_ex(&cfg, k_gemm_swap<EPI, W, CL>, *a, m));
    return MOE_OK;
}

} // namespace

int kcu_gemm_swap_wide_override = -1;
int kcu_gemm_v10_pair_override = -1;
int kcu_gemm_v10_rowpair_override = -1;
int kcu_gemm_v10_held_override = -1;
int kcu_gemm_v10_sw_override = -1;

/* wide items where they apply: N a multiple of 256 and the rows averaging
 * at most V10_WIDE_MAX_AVG an expert (more would split an expert's rows
 * into chunks that each stream its weights); kcu_gemm_swap_wide_override,
 * then KCU_GEMM_SWAP_WIDE: bit 1 the up-projection (SWIGLU), bit 2 the down
 * (SCATTER); 3 when unset */
int kgemm::v10_wide(kcu_epi epi, const kcu_gemm_args *a)
{
    static int env = -2;
    if (env == -2) {
        const char *v = getenv("KCU_GEMM_SWAP_WIDE");
        env = v && v[0] ? atoi(v) : 3;
    }
    if (a->N % swp_cfg<1>::COLS)
        return 0;
    if (kcu_gemm_swap_wide_override >= 0)
        return kcu_gemm_swap_wide_override > 0;
    const int bit = epi == KCU_EPI_SWIGLU ? 1 : 2;
    return (env & bit) && a->avg_rows <= kgemm::V10_WIDE_MAX_AVG;
}

/* wide items paired on 2-CTA clusters, the rows multicast (where wide
 * items run and N is a multiple of 512): kcu_gemm_v10_pair_override, then
 * KCU_V10_PAIR (0 when unset: measured neutral on H200, bench/NOTES.md
 * "v10 paired") */
int kgemm::v10_paired(kcu_epi epi, const kcu_gemm_args *a)
{
    static int env = -1;
    if (!kgemm::v10_wide(epi, a) || a->N % (2 * swp_cfg<1>::COLS))
        return 0;
    if (kcu_gemm_v10_pair_override >= 0)
        return kcu_gemm_v10_pair_override > 0;
    return kcu_env_flag(&env, "KCU_V10_PAIR", 0);
}

/* wide items on 2-CTA clusters split by rows (the walk's CL 3; where N is
 * a multiple of 256 and the experts of offs are given):
 * kcu_gemm_v10_rowpair_override, then KCU_V10_ROWPAIR where the rows
 * average at most 384 an expert - 1 (when unset) more than
 * kgemm::V10_WIDE_MAX_AVG: there wide items split an expert's rows into
 * chunks of 192 that each stream its weights, and v7 pads them to 128
 * (measured on H200, bench/NOTES.md "v10 rows paired"); 2 at any such
 * average (for measurements); 0 never */
int kgemm::v10_rowpair(kcu_epi epi, const kcu_gemm_args *a)
{
    static int env = -2;
    if (env == -2) {
        const char *v = getenv("KCU_V10_ROWPAIR");
        env = v && v[0] ? atoi(v) : 1;
    }
    if (a->N % swp_cfg<1>::COLS || a->K < BK || a->ngroups < 1 ||
        (epi != KCU_EPI_SWIGLU && epi != KCU_EPI_SCATTER))
        return 0;
    if (kcu_gemm_v10_rowpair_override >= 0)
        return kcu_gemm_v10_rowpair_override > 0;
    static_assert(KCU_V10_MAX_AVG == 2 * swp_cfg<1>::ROWS, "rows paired: chunks of two halves");
    if (env <= 0 || a->avg_rows > KCU_V10_MAX_AVG)
        return 0;
    return env >= 2 || a->avg_rows > kgemm::V10_WIDE_MAX_AVG;
}

/* rows paired in 4 stages, the epilogue through the chunk's last stage
 * (swp_cfg<2> on the clusters of kgemm::v10_rowpair):
 * kcu_gemm_v10_held_override, then KCU_V10_ROWPAIR_HELD (1 when unset:
 * measured on H200, bench/NOTES.md "v10 rows paired": qwen235 T=4096
 * 2.535-2.579 ms against 2.617-2.626 in 3 stages) */
int kgemm::v10_rowpair_held(kcu_epi epi, const kcu_gemm_args *a)
{
    static int env = -1;
    if (!kgemm::v10_rowpair(epi, a))
        return 0;
    if (kcu_gemm_v10_held_override >= 0)
        return kcu_gemm_v10_held_override > 0;
    return kcu_env_flag(&env, "KCU_V10_ROWPAIR_HELD", 1);
}

/* wide items in 4 stages, the epilogue through the chunk's last stage
 * (swp_cfg<2>; where wide items run unpaired): kcu_gemm_v10_held_override,
 * then KCU_V10_HELD (1 when unset: measured on H200, bench/NOTES.md "v10
 * held": qwen235 T=2048 1.53-1.54 ms against 1.60-1.64 with 3 stages) */
int kgemm::v10_held(kcu_epi epi, const kcu_gemm_args *a)
{
    static int env = -1;
    if (!kgemm::v10_wide(epi, a) || kgemm::v10_paired(epi, a) || a->K < BK)
        return 0;
    if (kcu_gemm_v10_held_override >= 0)
        return kcu_gemm_v10_held_override > 0;
    return kcu_env_flag(&env, "KCU_V10_HELD", 1);
}

/* held wide up-projections with a store warp per consumer warpgroup
 * (swp_cfg<3>; K of at least 4 stages, so that a warpgroup's staged tiles
 * are stored before it stages the next chunk's): kcu_gemm_v10_sw_override,
 * then KCU_V10_SW (1 when unset: measured on H200, bench/NOTES.md "v10
 * held": the qwen235 up-projection 846-851 us against 866-883, its h stores
 * 1.59 M L2 sectors against 4.57 M) */
int kgemm::v10_sw(kcu_epi epi, const kcu_gemm_args *a)
{
    static int env = -1;
    if (epi != KCU_EPI_SWIGLU || !kgemm::v10_held(epi, a) || a->K < swp_cfg<3>::STAGES * BK)
        return 0;
    if (kcu_gemm_v10_sw_override >= 0)
        return kcu_gemm_v10_sw_override > 0;
    return kcu_env_flag(&env, "KCU_V10_SW", 1);
}

moe_err kgemm::launch_v10(kcu_epi epi, const kcu_gemm_args *a, const ws_maps &m, int nsm,
                          cudaStream_t st)
{
    if (kgemm::v10_rowpair(epi, a)) {
        if (kgemm::v10_rowpair_held(epi, a))
            return epi == KCU_EPI_SWIGLU ? launch_swap_paired<KCU_EPI_SWIGLU, 2, 3>(a, m, nsm, st)
                                         : launch_swap_paired<KCU_EPI_SCATTER, 2, 3>(a, m, nsm, st);
        return epi == KCU_EPI_SWIGLU ? launch_swap_paired<KCU_EPI_SWIGLU, 1, 3>(a, m, nsm, st)
                                     : launch_swap_paired<KCU_EPI_SCATTER, 1, 3>(a, m, nsm, st);
    }
    const int wide = kgemm::v10_wide(epi, a), paired = kgemm::v10_paired(epi, a),
              held = kgemm::v10_held(epi, a), sw = kgemm::v10_sw(epi, a);
    if (epi == KCU_EPI_SWIGLU)
        return paired ? launch_swap_paired<KCU_EPI_SWIGLU, 1, 2>(a, m, nsm, st)
               : sw   ? launch_swap<KCU_EPI_SWIGLU, 3>(a, m, nsm, st)
               : held ? launch_swap<KCU_EPI_SWIGLU, 2>(a, m, nsm, st)
               : wide ? launch_swap<KCU_EPI_SWIGLU, 1>(a, m, nsm, st)
                      : launch_swap<KCU_EPI_SWIGLU, 0>(a, m, nsm, st);
    if (epi == KCU_EPI_SCATTER)
        return paired ? launch_swap_paired<KCU_EPI_SCATTER, 1, 2>(a, m, nsm, st)
               : held ? launch_swap<KCU_EPI_SCATTER, 2>(a, m, nsm, st)
               : wide ? launch_swap<KCU_EPI_SCATTER, 1>(a, m, nsm, st)
                      : launch_swap<KCU_EPI_SCATTER, 0>(a, m, nsm, st);
    fprintf(stderr, "kcu_gemm: v10 has no epilogue %d\n", epi);
    return MOE_EINVAL;
}
