/*
 * kernels/cuda/gemm/sched.cuh - the tile scheduler of the wgmma GEMMs (v2, v4,
 * moved verbatim from kcu_gemm.cu, session 19): work item w of a persistent
 * CTA -> (expert or group, m0, n0, k range), rows mode over the tile list in
 * raster groups of group_m m-tiles, weight-gradient mode per group
 * (wgrad_raster). The clustered versions' pair schedules (wsc_decode,
 * wgc_decode) are in gemm/clustered.cu.
 */
#ifndef MOE_KCU_GEMM_SCHED_CUH
#define MOE_KCU_GEMM_SCHED_CUH

#include "kernels/cuda/gemm/common.cuh"

namespace
{

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

} // namespace

#endif
