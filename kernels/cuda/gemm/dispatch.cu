/*
 * kernels/cuda/gemm/dispatch.cu - the host side of the grouped GEMM (kcu_gemm,
 * kcu_gemm_version, kcu_gemm_select of kcu_internal.cuh; moved verbatim from
 * kcu_gemm.cu, session 19): picks a version per call (v1 mma.sync, v2 wgmma,
 * v4 warp-specialised, v7 / v9 on clusters; KCU_GEMM and the KCU_WS_*
 * switches), builds the TMA tensor maps of v4 / v7 / v9 through the driver
 * entry points (no -lcuda) and calls the version's launcher (kgemm::launch_*,
 * in the mechanism's .cu). No device code. State: the switches (g_*, read
 * from the environment once), the driver entry points (drv) and the raster
 * group sizes (raster_group), one copy each per process.
 */
#include "kernels/cuda/gemm/common.cuh"

namespace kgemm
{

/* raster_group: m-tiles per raster group of the wgmma kernels, rows mode
 * (KCU_GROUP_M) and weight gradients (KCU_GROUP_W), default GROUP_M */
int raster_group(int am)
{
    static int g[2] = {-1, -1};
    if (g[am] < 0) {
        const char *s = getenv(am == KCU_A_K ? "KCU_GROUP_M" : "KCU_GROUP_W");
        const int v = s ? atoi(s) : 0;
        g[am] = v >= 1 && v <= 64 ? v : GROUP_M;
    }
    return g[am];
}

/* one pair per group where each pair is one expert's whole rows: the n
 * tiles that read the pair's A rows are dealt one after another, so they
 * find those rows in L2 (qwen235 T=2048: 75% of copy against 73% with 4
 * pairs, bench/NOTES.md). With many n tiles (Mixtral's up-projection, 112)
 * one pair's walk spans the whole GPU and the default group measured better
 * (80% against 76%). */
int raster_group_rows(const kcu_gemm_args *a)
{
    static int env_set = -1; /* KCU_GROUP_M given: it rules */
    if (env_set < 0)
        env_set = getenv("KCU_GROUP_M") != nullptr;
    if (!env_set && a->few_tiles && a->N / WG_BN <= 16)
        return 2;
    return raster_group(KCU_A_K);
}

/* work items (128-row m-tiles x 256-wide n tiles) of a wgmma GEMM */
long long wg_items(int am, const kcu_gemm_args *a)
{
    if (am == KCU_A_K)
        return (long long)(a->tile_e ? a->max_tiles_m : KCU_CEIL_DIV(a->M, BM)) * (a->N / WG_BN);
    return (long long)a->ngroups * (a->M / BM) * (a->N / WG_BN);
}

} // namespace kgemm

namespace
{

/* ---- v4 host side: tensor maps through the driver entry points (no -lcuda) ---- */
typedef CUresult (*pfn_encode_tiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                     const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                     const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                     CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
typedef CUresult (*pfn_addr_range)(CUdeviceptr *, size_t *, CUdeviceptr);

struct drv_fns {
    pfn_encode_tiled encode;
    pfn_addr_range range;
};

const drv_fns &drv()
{
    static const drv_fns f = [] {
        drv_fns r = {nullptr, nullptr};
        void *fp = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fp, 12000,
                                             cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            r.encode = (pfn_encode_tiled)fp;
        fp = nullptr;
        if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fp, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            r.range = (pfn_addr_range)fp;
        (void)cudaGetLastError(); /* a failed lookup leaves no error behind */
        if (!r.encode || !r.range)
            fprintf(stderr,
                    "kcu_gemm: no driver entry point for TMA (encode %p, range %p): "
                    "v4 loads with cp.async only\n",
                    (void *)r.encode, (void *)r.range);
        return r;
    }();
    return f;
}

/* how many slabs of `slab` bytes, `stride` bytes apart, start at p and end
 * inside p's allocation (0 when unknown) */
long long slabs_in_alloc(const void *p, size_t slab, size_t stride)
{
    const drv_fns &f = drv();
    if (!f.range)
        return 0;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (f.range(&base, &size, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS)
        return 0;
    const size_t left = (size_t)(base + size - (CUdeviceptr)(uintptr_t)p);
    return left < slab ? 0 : (long long)((left - slab) / stride + 1);
}

/* a bf16 (or dt) tensor map of rank 2 or 3 with 128-byte swizzle; 0 on success */
int encode_map(CUtensorMap *m, const void *p, int rank, const uint64_t *dim,
               const uint64_t *strideb, const uint32_t *box,
               CUtensorMapDataType dt = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
{
    const drv_fns &f = drv();
    if (!f.encode || ((uintptr_t)p & 15))
        return -1;
    cuuint64_t gd[3], gs[2];
    cuuint32_t bx[3], es[3] = {1, 1, 1};
    for (int i = 0; i < rank; i++) {
        if (dim[i] < 1 || dim[i] > (1ull << 32) || box[i] > dim[i])
            return -1;
        gd[i] = dim[i];
        bx[i] = box[i];
    }
    for (int i = 0; i < rank - 1; i++) {
        if (strideb[i] % 16 || strideb[i] >= (1ull << 40))
            return -1;
        gs[i] = strideb[i];
    }
    /* KCU_TMA_L2_PROMO: the L2 promotion of every map, 0..3 = none, 64, 128,
     * 256 bytes (3 when unset; for measurements) */
    static int promo = -1;
    if (promo < 0) {
        const char *v = getenv("KCU_TMA_L2_PROMO");
        promo = v && v[0] ? atoi(v) : 3;
        if (promo < 0 || promo > 3) {
            fprintf(stderr, "kcu_gemm: KCU_TMA_L2_PROMO=%s is not 0..3: 3 (256 bytes)\n", v);
            promo = 3;
        }
    }
    return f.encode(m, dt, (cuuint32_t)rank, const_cast<void *>(p), gd, gs, bx, es,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    (CUtensorMapL2promotion)promo,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS
               ? 0
               : -1;
}

int g_ws_tstore = -1;  /* v4/v7 staged epilogue (ws_stage): 1, 0; -1: read KCU_WS_TMA_STORE */
int g_ws_tab = -1;     /* v4/v7 dh's (a, b) by TMA (ab_issue): 1, 0; -1: read KCU_WS_TMA_AB */
int g_ws_sw = -1;      /* v7 SwiGLU epilogue through the stages (sw_epilogue): 1, 0; -1: read
                        * KCU_WS_SW_STAGE (off too where the staged epilogues are) */
int g_gemm_mode = -1;  /* 0 default, 1 mma, 2 wgmma, 4 ws; -1: read KCU_GEMM */
int g_ws_tma = -1;     /* v4 operands by TMA where possible: 1, 0; -1: read KCU_WS_TMA */
int g_ws_cluster = -1; /* v7 (v4 on 2-CTA clusters) where it fits: 1, 0; -1: KCU_WS_CLUSTER */
int g_ws_sched = -1;   /* v7 dynamic schedule where sched is given: 1 always, 0 never,
                        * 2 items of >= WS_SCHED_MIN_K; -1: KCU_WS_SCHED (default 2) */

/* items of fewer k steps lose a little with the dynamic schedule (Qwen3's
 * f.down, 12 k steps: 0.78 vs 0.75 ms; dx, 24: 1.32 vs 1.29) and have little
 * weight traffic to save; Mixtral's (64 to 448 k steps) gain (bench/NOTES.md) */
constexpr int WS_SCHED_MIN_K = 64 * BK;

} // namespace

int kgemm::ws_sched_on(int K)
{
    if (g_ws_sched < 0) {
        const char *s = getenv("KCU_WS_SCHED");
        g_ws_sched = s ? atoi(s) : 2;
    }
    return g_ws_sched == 1 || (g_ws_sched == 2 && K >= WS_SCHED_MIN_K);
}

namespace
{

int ws_tma_on()
{
    return kcu_env_flag(&g_ws_tma, "KCU_WS_TMA", 1);
}

int ws_cluster_on()
{
    return kcu_env_flag(&g_ws_cluster, "KCU_WS_CLUSTER", 1);
}

/* v9 (the weight gradients on clusters): on unless KCU_WS_CLUSTER_W=0, and
 * only where v7 is (ws_cluster_on) */
int g_ws_cluster_w = -1;
int ws_cluster_w_on()
{
    return kcu_env_flag(&g_ws_cluster_w, "KCU_WS_CLUSTER_W", 1) && ws_cluster_on();
}

/* the maps of one v4 call: TMA for each dense operand where a map can be
 * built (its rows' extent from the allocation), cp.async otherwise */
void ws_build_maps(kcu_amode am, kcu_bmode bm, const kcu_gemm_args *a, ws_maps *m, int half_b)
{
    memset(m, 0, sizeof(*m));
    if (!ws_tma_on())
        return;
    if (am == KCU_A_K) {
        if (!a->a_gather) {
            /* rows past the tile list's end read as zero when M is fixed; with a
             * tile list they are rows of the allocation (their outputs are
             * never stored) */
            const long long rows =
                a->tile_e ? slabs_in_alloc(a->A, (size_t)a->K * 2, (size_t)a->lda * 2) : a->M;
            const uint64_t dim[2] = {(uint64_t)a->K, (uint64_t)rows},
                           sb[1] = {(uint64_t)a->lda * 2};
            const uint32_t box[2] = {64, 128};
            m->ta = rows >= 1 && encode_map(&m->a, a->A, 2, dim, sb, box) == 0;
        }
        /* B_e = B + e b_gstride: (N, K) K-contiguous or (K, N) N-contiguous */
        const int inner = bm == KCU_B_K ? a->K : a->N, outer = bm == KCU_B_K ? a->N : a->K;
        const size_t slab = ((size_t)(outer - 1) * a->ldb + inner) * 2;
        const long long ne =
            a->b_gstride ? slabs_in_alloc(a->B, slab, (size_t)a->b_gstride * 2) : 1;
        const uint64_t dim[3] = {(uint64_t)inner, (uint64_t)outer, (uint64_t)ne},
                       sb[2] = {(uint64_t)a->ldb * 2, a->b_gstride ? (uint64_t)a->b_gstride * 2
                                                                   : (uint64_t)outer * a->ldb * 2};
        /* half_b (v7): B_K boxes of 128 n rows, one per CTA of a cluster */
        const uint32_t box[3] = {64, bm == KCU_B_K ? (half_b ? 128u : 256u) : 64u, 1};
        m->tb = ne >= 1 && encode_map(&m->b, a->B, 3, dim, sb, box) == 0;
    } else {
        /* only whole k tiles inside a group use TMA: any row bound that covers
         * the groups works */
        const uint32_t box[2] = {64, 64};
        if (!a->a_gather) {
            const long long rows =
                a->offs ? slabs_in_alloc(a->A, (size_t)a->M * 2, (size_t)a->lda * 2) : a->K;
            const uint64_t dim[2] = {(uint64_t)a->M, (uint64_t)rows},
                           sb[1] = {(uint64_t)a->lda * 2};
            m->ta = rows >= 64 && encode_map(&m->a, a->A, 2, dim, sb, box) == 0;
        }
        if (!a->b_gather) {
            const long long rows =
                a->offs ? slabs_in_alloc(a->B, (size_t)a->N * 2, (size_t)a->ldb * 2) : a->K;
            const uint64_t dim[2] = {(uint64_t)a->N, (uint64_t)rows},
                           sb[1] = {(uint64_t)a->ldb * 2};
            m->tb = rows >= 64 && encode_map(&m->b, a->B, 2, dim, sb, box) == 0;
        }
    }
}

/* the staged epilogue's map of one v4 call (mp.tc = 1 when built): ACC
 * with an fp32 C (the weight gradients) */
void ws_build_epi_maps(kcu_epi epi, const kcu_gemm_args *a, ws_maps *m)
{
    m->tc = 0;
    m->tab = 0;
    /* only where every operand comes by TMA (m built by ws_build_maps): with
     * cp.async producers their generic-proxy writes would follow the
     * epilogue's reads of a stage with only an mbarrier between, which
     * compute-sanitizer's racecheck does not follow (and the default
     * dispatch runs gathered dh on v2) */
    if (kcu_env_flag(&g_ws_tab, "KCU_WS_TMA_AB", 1) && epi == KCU_EPI_DSWIGLU && m->ta && m->tb &&
        a->ab && !(a->ld_ab & 7) && a->N % WG_BN == 0) {
        /* the (a, b) columns of the F outputs: 2F per row */
        const long long rows = slabs_in_alloc(a->ab, (size_t)a->N * 4, (size_t)a->ld_ab * 2);
        const uint64_t dim[2] = {(uint64_t)a->N * 2, (uint64_t)rows},
                       sb[1] = {(uint64_t)a->ld_ab * 2};
        const uint32_t box[2] = {64, 128};
        m->tab = rows >= 128 && encode_map(&m->ab, a->ab, 2, dim, sb, box) == 0;
        return;
    }
    const int tstore = kcu_env_flag(&g_ws_tstore, "KCU_WS_TMA_STORE", 1);
    m->tsw = 0;
    /* v7's SwiGLU epilogue through the stages (sw_epilogue): h, and (a, b)
     * when kept, by TMA stores; at least WS_STAGES k steps per item (the
     * store warp's record is rewritten only after it freed the stages) */
    if (epi == KCU_EPI_SWIGLU && tstore && kcu_env_flag(&g_ws_sw, "KCU_WS_SW_STAGE", 1) && m->ta &&
        m->tb && a->h && a->F > 0 && !(a->F & 7) && a->N == 2 * a->F && a->N % WG_BN == 0 &&
        a->K / BK >= WS_STAGES && (!a->ab || !(a->ld_ab & 7))) {
        const long long rows = slabs_in_alloc(a->h, (size_t)a->F * 2, (size_t)a->F * 2);
        const uint64_t dim[2] = {(uint64_t)a->F, (uint64_t)rows}, sb[1] = {(uint64_t)a->F * 2};
        const uint32_t box[2] = {64, 128};
        int ok = rows >= 128 && encode_map(&m->h, a->h, 2, dim, sb, box) == 0;
        if (ok && a->ab) {
            const long long ra = slabs_in_alloc(a->ab, (size_t)a->N * 2, (size_t)a->ld_ab * 2);
            const uint64_t da[2] = {(uint64_t)a->N, (uint64_t)ra}, sa[1] = {(uint64_t)a->ld_ab * 2};
            ok = ra >= 128 && encode_map(&m->ab, a->ab, 2, da, sa, box) == 0;
        }
        m->tsw = ok;
        return;
    }
    if (!tstore || epi != KCU_EPI_ACC || !a->Cf || a->Cb || (a->ldc & 3) || (a->c_gstride & 3) ||
        a->ngroups < 1)
        return;
    const uint64_t dim[3] = {(uint64_t)a->N, (uint64_t)a->M, (uint64_t)a->ngroups};
    const uint64_t sb[2] = {(uint64_t)a->ldc * 4,
                            (uint64_t)(a->c_gstride ? a->c_gstride : (long long)a->M * a->ldc) * 4};
    const uint32_t box[3] = {32, 64, 1};
    m->tc = encode_map(&m->c, a->Cf, 3, dim, sb, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32) == 0;
}

/* v10's maps (gemm/swapped.cu): the rows (K, rows in the allocation) in
 * boxes of 64 k x 64 rows (a), the weights (K, N, E) in boxes of 64 k x 128
 * n (b); 1 when both are built */
int swap_build_maps(const kcu_gemm_args *a, ws_maps *m)
{
    memset(m, 0, sizeof(*m));
    const long long rows = slabs_in_alloc(a->A, (size_t)a->K * 2, (size_t)a->lda * 2);
    const uint64_t da[2] = {(uint64_t)a->K, (uint64_t)rows}, sa[1] = {(uint64_t)a->lda * 2};
    const uint32_t boxa[2] = {64, 64};
    m->ta = rows >= 64 && encode_map(&m->a, a->A, 2, da, sa, boxa) == 0;
    const size_t slab = ((size_t)(a->N - 1) * a->ldb + a->K) * 2;
    const long long ne = slabs_in_alloc(a->B, slab, (size_t)a->b_gstride * 2);
    const uint64_t db[3] = {(uint64_t)a->K, (uint64_t)a->N, (uint64_t)ne},
                   sb[2] = {(uint64_t)a->ldb * 2, (uint64_t)a->b_gstride * 2};
    const uint32_t boxb[3] = {64, 128, 1};
    m->tb = ne >= a->ngroups && encode_map(&m->b, a->B, 3, db, sb, boxb) == 0;
    return m->ta && m->tb;
}

} // namespace

int kcu_gemm_swap_override = -1;

namespace
{

int g_swap = -1; /* KCU_GEMM_SWAP: 0, 1 (up), 2 (up and down), 3 (up, any rows); -1 not read */

/* v10 where it applies (kcu_internal.cuh kcu_gemm_swap_override): the
 * projections the mode names - mode 1 (the default) both where the rows
 * average 96 to V10_WIDE_MAX_AVG an expert, the down-projection only in
 * wide items (kgemm::v10_wide; measured on H200, bench/NOTES.md "v10
 * wide"); mode 2 both at any average, mode 3 the up-projection at any
 * average (for measurements) - over a tile list in pairs of one expert (an
 * inference forward's few rows per expert), A dense, the weights K-major
 * with a stride per expert, and an epilogue it has: SWIGLU's h without
 * (a, b), or SCATTER to bf16 rows */
int swap_applies(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a)
{
    if (g_swap < 0) {
        const char *v = getenv("KCU_GEMM_SWAP");
        g_swap = v && v[0] ? atoi(v) : 1;
    }
    const int mode = kcu_gemm_swap_override >= 0 ? kcu_gemm_swap_override : g_swap;
    if (mode <= 0 || (mode == 3 && epi != KCU_EPI_SWIGLU))
        return 0;
    /* rows paired (kgemm::v10_rowpair): dense rows in expert order, not
     * necessarily a tile list in pairs */
    const int rowpair = kgemm::v10_rowpair(epi, a);
    if (mode == 1 && !rowpair &&
        (a->avg_rows < KCU_V10_MIN_AVG || a->avg_rows > kgemm::V10_WIDE_MAX_AVG ||
         (epi != KCU_EPI_SWIGLU && !kgemm::v10_wide(epi, a))))
        return 0;
    if (am != KCU_A_K || bm != KCU_B_K || (!a->few_tiles && !rowpair) || !a->offs ||
        a->ngroups < 1 || a->a_gather || !a->b_gstride || a->N % 128 || a->K % BK ||
        (uintptr_t)a->A & 15)
        return 0;
    if (epi == KCU_EPI_SWIGLU)
        return !a->ab && a->h && a->N == 2 * a->F && !(a->F & 7) && !((uintptr_t)a->h & 15);
    if (epi == KCU_EPI_SCATTER)
        return a->Cb && !(a->ldc & 7) && !((uintptr_t)a->Cb & 15);
    return 0;
}

} // namespace

void kcu_gemm_select(int version, int tma, int cluster, int staged, int sched)
{
    g_ws_sched = sched < 0 ? -1 : sched;
    g_gemm_mode = version < 0 ? -1 : version == 1 || version == 2 || version == 4 ? version : 0;
    g_ws_tma = tma < 0 ? -1 : tma != 0;
    g_ws_cluster = cluster < 0 ? -1 : cluster != 0;
    g_ws_tstore = staged < 0 ? -1 : staged != 0;
    g_ws_tab = staged < 0 ? -1 : staged != 0;
}

int kcu_v7_gather_on()
{
    static int on = -1;
    return kcu_env_flag(&on, "KCU_V7_GATHER", 0);
}

namespace
{

/* kcu_gemm_version, with v10 considered or not (kcu_gemm's fallback where
 * v10's maps cannot be built) */
int gemm_version(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, int nsm,
                 int swap_ok)
{
    /* KCU_GEMM=mma forces the mma.sync version (v1), KCU_GEMM=wgmma the v2
     * wgmma kernel and KCU_GEMM=ws the v4 warp-specialised one wherever their
     * shape fits (for checks and A/B timing); default: v4 when the shape fits
     * and there are at least nsm 128x256 work items, else v1. */
    if (g_gemm_mode < 0) {
        const char *m = getenv("KCU_GEMM");
        g_gemm_mode = m && !strcmp(m, "mma")     ? 1
                      : m && !strcmp(m, "wgmma") ? 2
                      : m && !strcmp(m, "ws")    ? 4
                                                 : 0;
    }
    const int mode = g_gemm_mode;
    if (mode == 1 || a->N % WG_BN || !kcu_sm90()) /* the portable image: mma.sync only */
        return 1;
    long long items;
    if (am == KCU_A_K)
        items = (long long)(a->tile_e ? a->max_tiles_m : KCU_CEIL_DIV(a->M, BM)) * (a->N / WG_BN);
    else if (bm == KCU_B_N && epi == KCU_EPI_ACC)
        items = (long long)a->ngroups * (a->M / BM) * (a->N / WG_BN);
    else
        return 1;
    if (mode == 0 && items < nsm)
        return 1;
    if (mode == 0) {
        /* measured per phase (bench/NOTES.md, v4): v4 wins where its
         * producer loads dense tiles by TMA, v2 where the streamed operand
         * is gathered row by row (up-projection, dh, dW13) */
        const int gathered = am == KCU_A_K ? a->a_gather != NULL : a->b_gather != NULL;
        if (gathered && !(am == KCU_A_K && a->tile_e && kcu_v7_gather_on()))
            return 2;
    }
    if (mode == 2)
        return 2;
    if (mode == 0 && swap_ok && swap_applies(am, bm, epi, a) && ws_tma_on())
        return 10;
    /* v9: weight gradients with A and B dense (by TMA but for partial tiles) */
    if (am == KCU_A_M && bm == KCU_B_N && epi == KCU_EPI_ACC && !a->a_gather && !a->b_gather &&
        ws_cluster_w_on() && (a->M / BM) >= 2) {
        if (ws_tma_on())
            return 9;
    }
    /* v7: rows mode over a tile list with A dense, every operand by TMA;
     * with KCU_V7_GATHER=1 also A gathered (its rows by cp.async from the
     * 128 producer threads, B still by TMA and multicast) */
    if (am == KCU_A_K && a->tile_e && ws_cluster_on() && (!a->a_gather || kcu_v7_gather_on())) {
        if (ws_tma_on())
            return 7;
    }
    return 4;
}

} // namespace

int kcu_gemm_version(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, int nsm)
{
    return gemm_version(am, bm, epi, a, nsm, 1);
}

int kcu_gemm_narrow_override = -1;

namespace
{

int g_narrow = -2; /* KCU_GEMM_NARROW: 0 off, 16 or 32 the tile rows, else 1 (the rule) */

/* v1n's rows per tile / 16 (1 or 2) where it takes this v1 call, else 0:
 * fewer than nsm / 2 of v1's 128-row tiles; 32-row tiles where they give at
 * least nsm / 2 CTAs (KCU_GEMM_NARROW=16 or 32: those rows wherever v1n
 * applies, for measurements: at qwen235 T=2048 on H200 the rule's 16-row
 * tiles take 19.6 us, 32-row ones 24.6, bench/NOTES.md "The bytes-bound
 * layer at the power cap") */
int narrow_mi(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, int nsm)
{
    if (am != KCU_A_K || bm != KCU_B_K || epi != KCU_EPI_F32 || a->tile_e || a->a_gather ||
        a->scatter || !a->Cf || a->M < 1 || kcu_gemm_narrow_override == 0)
        return 0;
    if (kcu_gemm_narrow_override > 0)
        return kcu_gemm_narrow_override == 1 ? 1 : 2;
    if (g_narrow == -2) {
        const char *v = getenv("KCU_GEMM_NARROW");
        g_narrow = v && *v ? atoi(v) : 1;
    }
    if (g_narrow == 0)
        return 0;
    const long long ntn = a->N / BN, v1_tiles = (long long)KCU_CEIL_DIV(a->M, BM) * ntn;
    if (2 * v1_tiles >= nsm)
        return 0;
    if (g_narrow == 16 || g_narrow == 32)
        return g_narrow / 16;
    return 2 * (long long)KCU_CEIL_DIV(a->M, 32) * ntn >= nsm ? 2 : 1;
}

} // namespace

moe_err kcu_gemm(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, int nsm,
                 cudaStream_t st)
{
    if (a->N % BN || a->lda % 8 || a->ldb % 8 || (am == KCU_A_K && a->K % BK) ||
        (am == KCU_A_M && a->M % BM)) {
        fprintf(stderr, "kcu_gemm: unsupported shape M=%d N=%d K=%d lda=%d ldb=%d\n", a->M, a->N,
                a->K, a->lda, a->ldb);
        return MOE_EINVAL;
    }
    ws_maps m;
    memset(&m, 0, sizeof(m));
    int v = kcu_gemm_version(am, bm, epi, a, nsm);
    if (v == 10) {
        if (swap_build_maps(a, &m))
            return kgemm::launch_v10(epi, a, m, nsm, st);
        v = gemm_version(am, bm, epi, a, nsm, 0); /* no map: as without v10 */
    }
    switch (v) {
    case 9:
        ws_build_maps(am, bm, a, &m, 0);
        ws_build_epi_maps(epi, a, &m);
        if (m.ta && m.tb)
            return kgemm::launch_v9(a, m, nsm, st);
        return kgemm::launch_v4(am, bm, epi, a, m, nsm, st);
    case 7:
        ws_build_maps(am, bm, a, &m, 1);
        ws_build_epi_maps(epi, a, &m);
        if (am == KCU_A_K && (m.ta || a->a_gather) && m.tb)
            return kgemm::launch_v7(am, bm, epi, a, m, nsm, st);
        ws_build_maps(am, bm, a, &m, 0); /* no map for an operand: v4, cp.async for it */
        ws_build_epi_maps(epi, a, &m);
        return kgemm::launch_v4(am, bm, epi, a, m, nsm, st);
    case 4:
        ws_build_maps(am, bm, a, &m, 0);
        ws_build_epi_maps(epi, a, &m);
        return kgemm::launch_v4(am, bm, epi, a, m, nsm, st);
    case 2: return kgemm::launch_v2(am, bm, epi, a, m, nsm, st);
    default: {
        const int mi = narrow_mi(am, bm, epi, a, nsm);
        if (mi)
            return kgemm::launch_v1n(a, mi, nsm, st);
        return kgemm::launch_v1(am, bm, epi, a, m, nsm, st);
    }
    }
}
