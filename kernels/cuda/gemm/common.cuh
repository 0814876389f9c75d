/*
 * kernels/cuda/gemm/common.cuh - what every GEMM of kernels/cuda/gemm/ shares
 * (split out of kcu_gemm.cu, session 19; no kernel changed, tools/sass_diff.py):
 * the tile shapes and shared-memory budgets of each version, the tensor maps
 * of the TMA versions (ws_maps), the (mode, epilogue) switch that names the
 * built combinations (gemm_dispatch) and the launchers each mechanism's .cu
 * exports to gemm/dispatch.cu (no relocatable device code: a kernel is
 * launched only from its own translation unit).
 *
 * The versions keep their history numbers (bench/NOTES.md):
 *   v1 gemm/mma_sync.cu          mma.sync m16n8k16, 128x128x64, sm_80 and up
 *   v2 gemm/wgmma.cu             wgmma m64n256k16, 128x256x64, cp.async stages
 *   v4 gemm/warp_specialised.cu  v2's tiles, producer warpgroup + 2 consumers
 *   v7 gemm/clustered.cu         v4 on 2-CTA clusters, weight tile multicast
 *   v9 gemm/clustered.cu         the weight gradients on 2-CTA clusters
 *   v10 gemm/swapped.cu          rows mode, operands swapped: weights as A,
 *                                an expert's rows as B (n in steps of 16)
 * and gemm/dispatch.cu (host only) picks one per call and builds the maps.
 *
 * Ownership: device helpers and kernels live in an anonymous namespace of
 * each translation unit (each .cu has its own copy of the inline helpers);
 * what crosses translation units (ws_maps, the launchers, the host helpers
 * with state) is in namespace kgemm, defined once.
 */
#ifndef MOE_KCU_GEMM_COMMON_CUH
#define MOE_KCU_GEMM_COMMON_CUH

#include <cuda.h> /* CUtensorMap and its enums; the functions come by entry point */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kcu_act.cuh"
#include "kernels/cuda/kcu_internal.cuh"

/* the portable image (kcu_arch.cu) compiles the Hopper kernels empty: their
 * device helpers are then unreferenced there, which is expected */
#pragma nv_diag_suppress 177

namespace kgemm
{

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

} // namespace kgemm

namespace
{

using kgemm::ws_maps;

/* ---- v1 (gemm/mma_sync.cu) ---- */
constexpr int BM = KCU_BM, BN = KCU_BN, BK = KCU_BK;
constexpr int STAGES = 3, NT = 256;
constexpr int TILE_BYTES = 128 * 64 * 2;
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES; /* 96 KB */
constexpr int GROUP_M = 8;                       /* raster: 8 m-tiles share B in L2 */

static_assert(BM == 128 && BN == 128 && BK == 64, "tile shape is baked into the loaders");

/* ---- v2 (gemm/wgmma.cu): its tile layouts are described there ---- */
constexpr int WG_BN = 256, WG_STAGES = 4;
constexpr int WG_A_BYTES = 128 * 64 * 2, WG_B_BYTES = WG_BN * 64 * 2;
constexpr int WG_STAGE_BYTES = WG_A_BYTES + WG_B_BYTES;
constexpr int WG_SMEM_BYTES = WG_STAGES * WG_STAGE_BYTES + 1024;
constexpr int WG_ATOM = 64 * 128; /* bytes of one MN-major atom: 64 k rows x 128 B */

/* ---- v4, v7, v9 (gemm/warp_specialised.cu, gemm/clustered.cu) ---- */
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

/* gemm_dispatch: launches version V for (am, bm, epi); MOE_EINVAL with a
 * message when that combination is not built. V::run<AM, BM, EPI>(a, m, nsm,
 * st): the launcher of one version (run_v1, run_v2, run_v4, run_v7 in the
 * mechanisms' .cu files), so that this single switch names the built (mode,
 * epilogue) combinations of every version */
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

namespace kgemm
{

/* raster_group: m-tiles per raster group of the wgmma kernels, rows mode
 * (KCU_GROUP_M) and weight gradients (KCU_GROUP_W), default GROUP_M (read
 * once per process; gemm/dispatch.cu) */
int raster_group(int am);
/* raster_group_rows: v7's group for a rows-mode call: KCU_GROUP_M where
 * set; else 2 (one pair) over a tile list in pairs of one expert
 * (kcu_gemm_args.few_tiles) with at most 16 n tiles, else GROUP_M */
int raster_group_rows(const kcu_gemm_args *a);
/* work items (128-row m-tiles x 256-wide n tiles) of a wgmma GEMM */
long long wg_items(int am, const kcu_gemm_args *a);
/* v7's dynamic schedule for K (KCU_WS_SCHED; gemm/dispatch.cu) */
int ws_sched_on(int K);

/* the launchers of each version for (am, bm, epi) (gemm_dispatch over the
 * built combinations; MOE_EINVAL when not built), each in its mechanism's .cu */
moe_err launch_v1(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, const ws_maps &m,
                  int nsm, cudaStream_t st); /* gemm/mma_sync.cu */
/* v1n: v1's bits for A_K, B_K, EPI_F32 with A dense and no tile list, in
 * tiles of 16 mi rows (mi 1 or 2) x 128 columns (gemm/mma_sync.cu) */
moe_err launch_v1n(const kcu_gemm_args *a, int mi, int nsm, cudaStream_t st);
moe_err launch_v2(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, const ws_maps &m,
                  int nsm, cudaStream_t st); /* gemm/wgmma.cu */
moe_err launch_v4(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, const ws_maps &m,
                  int nsm, cudaStream_t st); /* gemm/warp_specialised.cu */
moe_err launch_v7(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, const ws_maps &m,
                  int nsm, cudaStream_t st); /* gemm/clustered.cu */
/* v9: ACC weight gradients, A_M / B_N, every operand by TMA (gemm/clustered.cu) */
moe_err launch_v9(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st);
/* v10: the rows mode with the operands swapped, SWIGLU (no (a, b)) or
 * SCATTER (bf16); m.a the rows (K, rows) in boxes of (64, 64), m.b the
 * weights (K, N, E) in boxes of (64, 128, 1) (gemm/swapped.cu) */
moe_err launch_v10(kcu_epi epi, const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st);
/* v10's items of 256 output columns where the rows average at most this an
 * expert (chunks of 192 rows: more would stream an expert's weights twice) */
constexpr int V10_WIDE_MAX_AVG = 176;
/* 1 where v10 takes items of 256 output columns for this call (gemm/swapped.cu) */
int v10_wide(kcu_epi epi, const kcu_gemm_args *a);
/* 1 where v10's wide items run in pairs on 2-CTA clusters, the rows
 * multicast to both (gemm/swapped.cu) */
int v10_paired(kcu_epi epi, const kcu_gemm_args *a);
/* v10's wide items on 2-CTA clusters split by rows (swapped.cu): the two
 * CTAs take the two halves of each chunk of up to 384 rows over the same
 * 256 output columns, the weight tile multicast to both */
int v10_rowpair(kcu_epi epi, const kcu_gemm_args *a);
/* 1 where those clusters run in 4 stages with the epilogue staged through
 * the chunk's last stage, as v10_held's items (gemm/swapped.cu) */
int v10_rowpair_held(kcu_epi epi, const kcu_gemm_args *a);
/* 1 where v10's wide items run in 4 stages with the epilogue staged through
 * the chunk's last stage (gemm/swapped.cu) */
int v10_held(kcu_epi epi, const kcu_gemm_args *a);
/* 1 where v10's held wide up-projection hands each chunk's h tiles to
 * store warps (gemm/swapped.cu) */
int v10_sw(kcu_epi epi, const kcu_gemm_args *a);

} // namespace kgemm

namespace
{

using kgemm::raster_group;
using kgemm::raster_group_rows;
using kgemm::wg_items;
using kgemm::ws_sched_on;

} // namespace

#endif
