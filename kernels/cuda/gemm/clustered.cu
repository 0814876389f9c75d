/*
 * kernels/cuda/gemm/clustered.cu - v7 and v9: the warp-specialised wgmma GEMM
 * (v4) on 2-CTA clusters (sm_90a), the weight tile multicast to both CTAs of
 * a pair: v7 the rows mode over a tile list with A dense and every operand by
 * TMA (with its dynamic schedule, kcu_gemm_args.sched, and SwiGLU epilogue
 * through the stages), v9 the weight gradients (A_M / B_N, ACC) with A and B
 * dense. History: v7 and v9 of bench/NOTES.md (were k_gemm_wsc / launch_wsc
 * and k_gemm_wgc / launch_wgc in kcu_gemm.cu, moved verbatim in session 19);
 * KCU_WS_CLUSTER=0 / KCU_WS_CLUSTER_W=0 turn them off. Launch: a cluster
 * dimension of 2, at most one cluster per 2 SMs (cluster2_config). The
 * sections below keep their original descriptions.
 */
#include "kernels/cuda/gemm/common.cuh"
#include "kernels/cuda/gemm/tile.cuh"
#include "kernels/cuda/gemm/sched.cuh"
#include "kernels/cuda/gemm/tma.cuh"
#include "kernels/cuda/gemm/cluster.cuh"
#include "kernels/cuda/gemm/epilogue.cuh"

namespace
{

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

/* v7's weight tile of one k step into stage sb: by TMA, multicast to both
 * CTAs where the pair shares its expert (each CTA loads its half), else
 * the whole tile here; completes on fb */
template <int BMODE>
__device__ __forceinline__ void wsc_load_b(const ws_maps &mp, uint32_t sb, int k0,
                                           const wsc_item &t, uint32_t fb, uint32_t rank)
{
    constexpr uint32_t HALF_B = WG_B_BYTES / 2;
    if (t.mc) {
        if (BMODE == KCU_B_K) {
            tma_3d_mc(sb + rank * HALF_B, &mp.b, k0, t.n0 + 128 * (int)rank, t.e, fb, (uint16_t)3);
        } else {
#pragma unroll
            for (int a2 = 0; a2 < 2; a2++) {
                const int a4 = 2 * (int)rank + a2;
                tma_3d_mc(sb + a4 * WG_ATOM, &mp.b, t.n0 + 64 * a4, k0, t.e, fb, (uint16_t)3);
            }
        }
    } else if (BMODE == KCU_B_K) {
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++)
            tma_3d(sb + h2 * HALF_B, &mp.b, k0, t.n0 + 128 * h2, t.e, fb);
    } else {
#pragma unroll
        for (int a4 = 0; a4 < 4; a4++)
            tma_3d(sb + a4 * WG_ATOM, &mp.b, t.n0 + 64 * a4, k0, t.e, fb);
    }
}

/* v7's producer where A is gathered (p.a_gather: rows of p.A by index):
 * the 128 producer threads walk the static schedule together; thread 0
 * loads the weight tile by TMA (multicast where the pair shares its
 * expert) as the plain producer does, and every thread copies 8 rows' 16
 * bytes of A per stage by cp.async into the layout the A map's boxes give
 * (rows past the expert's end zero-filled), then arrives on the stage */
template <int BMODE>
__device__ __forceinline__ void wsc_gather_producer(const kcu_gemm_args &p, const ws_maps &mp,
                                                    uint32_t full0, uint32_t empty0, uint32_t sbase,
                                                    int total, int ntm, int ntn, int ktiles,
                                                    int cid, int ncl, uint32_t rank, int tid)
{
#if KCU_SM90
    if (tid == 0)
        prefetch_tmap(&mp.b);
    uint32_t it = 0;
    for (int w = cid; w < total; w += ncl) {
        wsc_item t;
        wsc_decode(p, w, ntm, ntn, (int)rank, t);
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const ws_slot g = ws_slot_take(full0, empty0, sbase, it);
            const uint32_t fb = g.fb, sa = g.sa, sb = g.sb;
            const int k0 = kt * BK;
            if (tid == 0) {
                if (!t.has) {
                    mbar_arrive(fb);
                } else {
                    mbar_arrive_tx(fb, WG_B_BYTES);
                    wsc_load_b<BMODE>(mp, sb, k0, t, fb, rank);
                }
            }
            if (t.has)
                a_rows_cp_async(sa, p.A, p.lda, p.a_gather, t.m0, t.rend, k0, tid);
            cp_async_arrive(fb);
        }
    }
    cp_async_wait<0>(); /* leave no cp.async of this thread in flight */
    if (tid == 0)
        ws_stages_drained(empty0, it);
#endif
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
    /* A gathered (p.a_gather: launch_wsc makes the schedule static and the
     * SwiGLU epilogue the register one): its rows by cp.async from all 128
     * producer threads, each stage's full barrier then 1 + 128 arrivals */
    const bool gat = p.a_gather != nullptr;
    if (tid == 0) {
        ws_stage_bars_init(full0, empty0, gat ? 129 : 1, 16);
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

    if (wg == 0) {
        /* ---------------- producer: thread 0 ---------------- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WS_PRODUCER_REGS));
        if (gat) {
            wsc_gather_producer<BMODE>(p, mp, full0, empty0, sbase, total, ntm, ntn, ktiles, cid,
                                       ncl, rank, tid);
            return;
        }
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
                const ws_slot g = ws_slot_take(full0, empty0, sbase, it);
                const uint32_t fb = g.fb, sa = g.sa, sb = g.sb;
                const int k0 = kt * BK;
                if (!t.has) {
                    mbar_arrive(fb);
                    continue;
                }
                mbar_arrive_tx(fb, WG_A_BYTES + WG_B_BYTES);
                tma_2d(sa, &mp.a, k0, t.m0, fb);
                wsc_load_b<BMODE>(mp, sb, k0, t, fb, rank);
            }
            if (EPI == KCU_EPI_DSWIGLU && mp.tab)
                ab_produce(mp, full0, empty0, sbase, it, t.m0, t.n0, t.has);
            if (EPI == KCU_EPI_SWIGLU && mp.tsw) /* handed over empty (sw_epilogue) */
                for (int j = 0; j < SW_STAGES; j++, it++)
                    mbar_arrive(ws_slot_take(full0, empty0, sbase, it).fb);
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
        /* a warpgroup whose 64 rows all lie past the expert's end (the last
         * tile of an expert, 64 rows or fewer) walks the stages without
         * math: the epilogues store no row past rend, so the bits are the
         * same and the item's tensor work halves (at 128 rows per expert
         * about a third of the tiles are such tails) */
        const bool math = t.has && t.m0 + 64 * cw < t.rend;
        if (gat) /* A written by cp.async (generic proxy): fenced before wgmma */
            cl_k_loop<KCU_A_K, BMODE, true>(d, full0, empty0, sbase, it, ktiles, math, cw, lane,
                                            peer);
        else
            cl_k_loop<KCU_A_K, BMODE, false>(d, full0, empty0, sbase, it, ktiles, math, cw, lane,
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

template <int BMODE, int EPI>
moe_err launch_wsc(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    static int max_cl[64];
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute at[2];
    int ok = 0;
    const long long pairs = (long long)(a->max_tiles_m + 1) / 2 * (a->N / WG_BN);
    KCU_TRY(cluster2_config(k_gemm_wsc<BMODE, EPI>, attr_done, max_cl, pairs, nsm, WS_SMEM_BYTES,
                            st, cfg, at, &ok));
    if (!ok)
        return MOE_OK;
    kcu_gemm_args b = *a;
    b.group_m = raster_group_rows(a);
    if (!ws_sched_on(a->K) || a->a_gather) /* gathered A: its producers walk the static order */
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
                /* the same for both CTAs: one group, one k range */
                const bool whole = k0 + BK <= t.kend;
                const ws_slot g = ws_slot_take(full0, empty0, sbase, it);
                const uint32_t fb = g.fb, sa = g.sa, sb = g.sb;
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
    KCU_TRY(cluster2_config(k_gemm_wgc<EPI>, attr_done, max_cl, pairs, nsm, WS_SMEM_BYTES, st, cfg,
                            at, &ok));
    if (!ok)
        return MOE_OK;
    kcu_gemm_args b = *a;
    b.group_m = raster_group(KCU_A_M);
    kcu_pdl_attr(&cfg, at, a->pdl);
    KCU_CHECK(kcu_launch_ex(&cfg, k_gemm_wgc<EPI>, b, m));
    return MOE_OK;
}

struct run_v7 { /* rows mode only */
    template <int AM, int BM, int EPI>
    static moe_err run(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
    {
        if constexpr (AM == KCU_A_K)
            return launch_wsc<BM, EPI>(a, m, nsm, st);
        return MOE_EINVAL;
    }
};

} // namespace

moe_err kgemm::launch_v7(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a,
                         const ws_maps &m, int nsm, cudaStream_t st)
{
    return gemm_dispatch<run_v7>(am, bm, epi, a, m, nsm, st);
}

moe_err kgemm::launch_v9(const kcu_gemm_args *a, const ws_maps &m, int nsm, cudaStream_t st)
{
    return launch_wgc<KCU_EPI_ACC>(a, m, nsm, st);
}
