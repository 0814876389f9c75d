/*
 * kernels/cuda/gemm/wgmma.cu - v2: the grouped GEMM on Hopper wgmma (sm_90a),
 * every mode, operands by cp.async (the token gathers fused into the loads).
 * History: v2 of bench/NOTES.md (was k_gemm_wg / launch_wg in kcu_gemm.cu,
 * moved verbatim in session 19); KCU_GEMM=wgmma forces it, and the default
 * dispatch runs it where the streamed operand is gathered.
 *
 * 128x256x64 tiles, 2 warpgroups each computing 64x256 with wgmma.m64n256k16
 * from shared memory, 4 cp.async stages (the token gathers stay fused into
 * the loads), prefetch distance 2 with one wgmma batch left in flight, 1 CTA
 * per SM, persistent. The next work item's first two stages are issued
 * before the current item's epilogue (the epilogues touch no shared memory),
 * so the epilogue's global traffic overlaps the next item's loads.
 * Operand tiles, 128-byte swizzle on a 1024-byte aligned base:
 *  K-major  (rows A, B_K): [row][64 k] rows of 128 B = the off_k layout;
 *           descriptor LBO unused, SBO = 1024 B (8-row groups).
 *  MN-major (wgrad A, B_N): atoms of 64 m/n columns x 64 k rows (8 KB),
 *           row k at k*128 B, its 16-byte chunk c at (c ^ (k&7))*16;
 *           descriptor LBO = 8 KB (next 64 columns), SBO = 1024 B (next 8 k
 *           rows); the instruction's transpose bit set for that operand.
 */
#include "kernels/cuda/gemm/common.cuh"
#include "kernels/cuda/gemm/tile.cuh"
#include "kernels/cuda/gemm/sched.cuh"
#include "kernels/cuda/gemm/epilogue.cuh"

namespace
{

/* v2's item: the decoded item plus this thread's load addresses */
struct wg_item : ws_item {
    const bf16 *a[4]; /* rows mode: this thread's 4 A rows (chunk offset included) */
    const bf16 *b;    /* B_K: row n0 + tid/8; B_N rows mode: column n0 + chunk */
    unsigned aok;     /* rows mode: bit j = A row j exists */
};

template <int AM, int BMODE, int EPI>
__global__ void __launch_bounds__(NT, 1) k_gemm_wg(const kcu_gemm_args p)
{
#if KCU_SM90 /* Hopper only: never launched from the portable image */
    const uint32_t sbase = smem_base_1k();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int ntn = p.N / WG_BN;
    int ntm = 0, tpg = 0, total;
    if (AM == KCU_A_K) {
        ntm = p.tile_e ? *p.ntiles_m : KCU_CEIL_DIV(p.M, BM);
        total = ntm * ntn;
    } else {
        tpg = (p.M / BM) * ntn;
        total = p.ngroups * tpg;
    }

    auto decode = [&](int w, wg_item &t) {
        ws_decode<AM>(p, w, ntm, ntn, tpg, t);
        t.aok = 0;
        if (AM == KCU_A_K) {
            const bf16 *Bg = p.B + (size_t)t.e * p.b_gstride;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int r = t.m0 + (tid >> 3) + 32 * j;
                const int ok = r < t.rend;
                const int sr = ok ? (p.a_gather ? p.a_gather[r] : r) : 0;
                t.aok |= (unsigned)ok << j;
                t.a[j] = p.A + (size_t)sr * p.lda + (tid & 7) * 8;
            }
            if (BMODE == KCU_B_K)
                t.b = Bg + (size_t)(t.n0 + (tid >> 3)) * p.ldb + (tid & 7) * 8;
            else
                t.b = Bg + (size_t)(tid >> 5) * p.ldb + t.n0 + (tid & 31) * 8;
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                t.a[j] = p.A;
            t.b = p.B;
        }
    };
    /* wgrad: the source rows of the next stage to load, fetched one stage
     * ahead so that the gather-index loads stay off the load-issue path;
     * -1 = past the group's rows (zero fill) */
    int ia[4], ib[8];
    auto fetch = [&](const wg_item &t, int kt) {
        const int k0 = t.kbeg + kt * BK;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int k = k0 + (tid >> 4) + 16 * j;
            ia[j] = k < t.kend ? (p.a_gather ? p.a_gather[k] : k) : -1;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int k = k0 + (tid >> 5) + 8 * j;
            ib[j] = k < t.kend ? (p.b_gather ? p.b_gather[k] : k) : -1;
        }
    };
    auto load = [&](const wg_item &t, int stage, int kt) {
        const uint32_t sa = sbase + stage * WG_STAGE_BYTES, sb = sa + WG_A_BYTES;
        const int k0 = kt * BK;
        if (AM == KCU_A_K) {
            const int row = tid >> 3, ch = tid & 7;
#pragma unroll
            for (int j = 0; j < 4; j++)
                cp_async16(sa + off_k(row + 32 * j, ch * 8), t.a[j] + k0,
                           (t.aok >> j) & 1 ? 16 : 0);
        } else {
            const int ch = tid & 15;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int kr = (tid >> 4) + 16 * j;
                cp_async16(sa + off_mnw(kr, ch),
                           p.A + (size_t)(ia[j] < 0 ? 0 : ia[j]) * p.lda + t.m0 + ch * 8,
                           ia[j] >= 0 ? 16 : 0);
            }
        }
        if (BMODE == KCU_B_K) {
            const int row = tid >> 3, ch = tid & 7;
            const size_t bstep = (size_t)32 * p.ldb;
#pragma unroll
            for (int j = 0; j < 8; j++)
                cp_async16(sb + off_k(row + 32 * j, ch * 8), t.b + j * bstep + k0, 16);
        } else {
            const int ch = tid & 31;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int kr = (tid >> 5) + 8 * j;
                if (AM == KCU_A_K)
                    cp_async16(sb + off_mnw(kr, ch), t.b + (size_t)(k0 + 8 * j) * p.ldb, 16);
                else
                    cp_async16(sb + off_mnw(kr, ch),
                               p.B + (size_t)(ib[j] < 0 ? 0 : ib[j]) * p.ldb + t.n0 + ch * 8,
                               ib[j] >= 0 ? 16 : 0);
            }
        }
    };
    auto prologue = [&](const wg_item &t) {
#pragma unroll
        for (int s = 0; s < 2; s++) {
            if (s < t.ktiles) {
                if (AM == KCU_A_M)
                    fetch(t, s);
                load(t, s, s);
            }
            cp_async_commit();
        }
        if (AM == KCU_A_M && 2 < t.ktiles)
            fetch(t, 2);
    };

    int w = blockIdx.x;
    if (w >= total)
        return;
    wg_item cur;
    decode(w, cur);
    prologue(cur);
    while (true) {
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; i++)
            d[i] = 0.f;
        for (int kt = 0; kt < cur.ktiles; kt++) {
            cp_async_wait<1>();
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            if (kt + 2 < cur.ktiles) {
                load(cur, (kt + 2) % WG_STAGES, kt + 2);
                if (AM == KCU_A_M && kt + 3 < cur.ktiles)
                    fetch(cur, kt + 3);
            }
            cp_async_commit();
            wg_stage_mma<AM, BMODE>(d, sbase + (kt % WG_STAGES) * WG_STAGE_BYTES, wg);
            wg_wait<1>();
        }
        wg_wait<0>();
        __syncthreads(); /* every warpgroup is done with the stages */

        /* issue the next item's first stages, then run this item's epilogue
         * (p.wg_ovl; else after it) */
        const int wn = w + gridDim.x;
        wg_item nxt;
        if (p.wg_ovl && wn < total) {
            decode(wn, nxt);
            prologue(nxt);
        }

        wg_epilogue<EPI>(p, d, cur.e, cur.m0, cur.n0, cur.rend, cur.ktiles,
                         wg * 64 + (warp & 3) * 16, lane);
        if (wn >= total)
            break;
        if (!p.wg_ovl) {
            decode(wn, nxt);
            prologue(nxt);
        }
        cur = nxt;
        w = wn;
    }
    cp_async_wait<0>();
#endif
}

template <int AM, int BMODE, int EPI>
moe_err launch_wg(const kcu_gemm_args *a, int nsm, cudaStream_t st)
{
    static unsigned long long attr_done;
    KCU_TRY(smem_limit_once(attr_done, k_gemm_wg<AM, BMODE, EPI>, WG_SMEM_BYTES));
    const long long total = wg_items(AM, a);
    if (total <= 0)
        return MOE_OK;
    const int grid = (int)(total < nsm ? total : nsm);
    /* KCU_WG_OVL=0|1 forces the overlap of the next item's loads with the
     * epilogue off or on (A/B timing); default: on except for the forward
     * K-major GEMMs */
    static int ovl = -2;
    if (ovl == -2) {
        const char *o = getenv("KCU_WG_OVL");
        ovl = o ? atoi(o) != 0 : -1;
    }
    kcu_gemm_args b = *a;
    b.wg_ovl = ovl >= 0 ? ovl : !(AM == KCU_A_K && BMODE == KCU_B_K);
    b.group_m = raster_group(AM);
    k_gemm_wg<AM, BMODE, EPI><<<grid, NT, WG_SMEM_BYTES, st>>>(b);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

struct run_v2 {
    template <int AM, int BM, int EPI>
    static moe_err run(const kcu_gemm_args *a, const ws_maps &, int nsm, cudaStream_t st)
    {
        return launch_wg<AM, BM, EPI>(a, nsm, st);
    }
};

} // namespace

moe_err kgemm::launch_v2(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a,
                         const ws_maps &m, int nsm, cudaStream_t st)
{
    return gemm_dispatch<run_v2>(am, bm, epi, a, m, nsm, st);
}
