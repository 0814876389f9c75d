/*
 * kernels/cuda/gemm/tma.cuh - mbarrier and TMA helpers of the warp-specialised
 * GEMMs (v4, v7, v9; moved verbatim from kcu_gemm.cu, session 19): mbarrier
 * init / wait / arrive (local and at cluster scope), cp.async arrivals,
 * tensor-map loads (cp.async.bulk.tensor 2d / 3d), the stage ring's barriers
 * and the clustered producers' drain. The cluster-only helpers (multicast
 * loads, cluster barriers) are in gemm/clustered.cu.
 */
#ifndef MOE_KCU_GEMM_TMA_CUH
#define MOE_KCU_GEMM_TMA_CUH

#include "kernels/cuda/gemm/common.cuh"

namespace
{

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
/* ws_slot_take: the producer's stage of pipeline step `it` of the ring - its
 * full barrier and its A and B tiles - once the consumers released it (its
 * empty barrier's phase of that round) */
struct ws_slot {
    uint32_t fb, sa, sb;
};
__device__ __forceinline__ ws_slot ws_slot_take(uint32_t full0, uint32_t empty0, uint32_t sbase,
                                                uint32_t it)
{
    const int s = it % WS_STAGES;
    const uint32_t fb = full0 + 8 * s, sa = sbase + s * WG_STAGE_BYTES, sb = sa + WG_A_BYTES;
    mbar_wait(empty0 + 8 * s, ((it / WS_STAGES) & 1) ^ 1);
    return ws_slot{fb, sa, sb};
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

} // namespace

#endif
