/*
 * kernels/cuda/gemm/cluster.cuh - the 2-CTA cluster helpers of v7, v9
 * (gemm/clustered.cu) and v10's paired items (gemm/swapped.cu), moved out of
 * gemm/clustered.cu in session 35: this CTA's rank in its cluster, the
 * cluster barrier, TMA loads multicast to both CTAs of a pair, and the
 * launch configuration of a 2-CTA-cluster grid.
 */
#ifndef MOE_KCU_GEMM_CLUSTER_CUH
#define MOE_KCU_GEMM_CLUSTER_CUH

#include "kernels/cuda/gemm/common.cuh"

namespace
{

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
/* TMA loads into the same shared offset of every CTA in mask (bit r: rank r),
 * each completing its bytes on the mbarrier at offset bar there */
__device__ __forceinline__ void tma_3d_mc(uint32_t dst, const CUtensorMap *m, int c0, int c1,
                                          int c2, uint32_t bar, uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
                 : "memory");
}
__device__ __forceinline__ void tma_2d_mc(uint32_t dst, const CUtensorMap *m, int c0, int c1,
                                          uint32_t bar, uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
                 : "memory");
}

/* a 2-CTA-cluster launch (v7, v9, v10 paired) of `pairs` pair items for kernel `kern`:
 * cfg (smem bytes of dynamic shared memory, at[0] the cluster dimension) gets a grid of at most one
 * cluster per 2 SMs, and no more clusters than can be resident (measured once per device into
 * max_cl); *grid_ok = 0 when there is nothing to launch */
template <class KERN>
moe_err cluster2_config(KERN kern, unsigned long long &attr_done, int (&max_cl)[64],
                        long long pairs, int nsm, int smem, cudaStream_t st,
                        cudaLaunchConfig_t &cfg, cudaLaunchAttribute (&at)[2], int *grid_ok)
{
    int dev = 0;
    KCU_CHECK(cudaGetDevice(&dev));
    memset(&cfg, 0, sizeof(cfg));
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = 2;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(WS_NT);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    if (!(attr_done >> (dev & 63) & 1)) {
        KCU_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
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

} // namespace

#endif
