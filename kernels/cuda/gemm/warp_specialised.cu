/*
 * kernels/cuda/gemm/warp_specialised.cu - v4: the warp-specialised wgmma GEMM
 * (sm_90a), every mode: a producer warpgroup fills mbarrier-guarded stages by
 * TMA or cp.async, two consumer warpgroups run wgmma and the epilogues
 * (gemm/epilogue.cuh: register or staged through TMA stores). The default
 * where v2 fits; also the fallback of v7 / v9 when an operand has no map.
 * History: v4 of bench/NOTES.md (was k_gemm_ws / launch_ws in kcu_gemm.cu,
 * moved verbatim in session 19); KCU_GEMM=ws forces it.
 *
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
 * fit in 227 KB.
 */
#include "kernels/cuda/gemm/common.cuh"
#include "kernels/cuda/gemm/tile.cuh"
#include "kernels/cuda/gemm/sched.cuh"
#include "kernels/cuda/gemm/tma.cuh"
#include "kernels/cuda/gemm/epilogue.cuh"

namespace
{

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
                    const int k0 = kt * BK;
                    const ws_slot g = ws_slot_take(full0, empty0, sbase, it);
                    const uint32_t fb = g.fb, sa = g.sa, sb = g.sb;
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
                    if (!mp.ta)
                        a_rows_cp_async(sa, p.A, p.lda, p.a_gather, t.m0, t.rend, k0, tid);
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
                    const int k0 = t.kbeg + kt * BK;
                    /* a group's last partial k tile: cp.async with zero fill */
                    const bool whole = k0 + BK <= t.kend;
                    const bool tA = mp.ta && whole, tB = mp.tb && whole;
                    const ws_slot g = ws_slot_take(full0, empty0, sbase, it);
                    const uint32_t fb = g.fb, sa = g.sa, sb = g.sb;
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

struct run_v4 {
    template <int AM, int BM, int EPI>
    static moe_err run(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
    {
        return launch_ws<AM, BM, EPI>(a, m, nsm, st);
    }
};

} // namespace

moe_err kgemm::launch_v4(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a,
                         const ws_maps &m, int nsm, cudaStream_t st)
{
    return gemm_dispatch<run_v4>(am, bm, epi, a, m, nsm, st);
}
