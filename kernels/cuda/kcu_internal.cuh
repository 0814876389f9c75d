/*
 * kcu_internal.cuh - shared between the CUDA kernel files and tests/gpu/check_gpu.cu:
 * error checks, bf16 helpers, the layer struct and the launchers.
 */
#ifndef MOE_KCU_INTERNAL_CUH
#define MOE_KCU_INTERNAL_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/kern_cuda.h"

typedef __nv_bfloat16 bf16;

#define KCU_CEIL_DIV(a, b) (((a) + (b)-1) / (b))

/* KCU_CHECK: on a CUDA error log the CUDA text once and return MOE_EINTERNAL
 * from the enclosing function (which returns moe_err). */
#define KCU_CHECK(call)                                                                            \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "kcu: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,                     \
                    cudaGetErrorString(e_));                                                       \
            return MOE_EINTERNAL;                                                                  \
        }                                                                                          \
    } while (0)
#define KCU_CHECK_LAUNCH() KCU_CHECK(cudaGetLastError())
#define KCU_TRY(call)                                                                              \
    do {                                                                                           \
        moe_err r_ = (call);                                                                       \
        if (r_ != MOE_OK)                                                                          \
            return r_;                                                                             \
    } while (0)

/* ---- the kernels this build has for the current device ----
 * The library is built for sm_90a (Hopper: wgmma, TMA, clusters, PDL) and for
 * sm_80 plus compute_80 PTX (every other GPU from Ampere on, newer ones by the
 * driver's JIT: mma.sync GEMMs, no PDL). KCU_SM90 is 1 in device code compiled
 * for sm_90a; the Hopper-only kernels have empty bodies elsewhere and are
 * never launched there: kcu_sm90() says at run time whether the image loaded
 * for the current device is the sm_90a one (kcu_arch.cu). */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KCU_SM90 1
#else
#define KCU_SM90 0
#endif
/* an on/off switch from the environment, read once into *cache (-1: not read
 * yet; the checks may set it): unset or empty = dflt, else atoi(value) != 0 */
static inline int kcu_env_flag(int *cache, const char *name, int dflt)
{
    if (*cache < 0) {
        const char *s = getenv(name);
        *cache = s && *s ? atoi(s) != 0 : dflt;
    }
    return *cache;
}

/* 1: the sm_90a kernels run on the current device; 0: the portable ones
 * (cached per device; KCU_ARCH=portable forces 0, for checks) */
int kcu_sm90(void);

/* ---- programmatic dependent launch (PDL; KCU_PDL=0 turns it off) ----
 * A kernel launched by kcu_launch / with kcu_pdl_attr may start while its
 * predecessor in the stream is ending, so it must call kcu_pdl_wait() before
 * it touches any memory (read or write) that earlier kernels use: the wait
 * returns when they are complete and their writes visible. Set-up before it
 * (shared memory, barriers, tensor-map prefetch) overlaps the predecessor's
 * tail. kcu_pdl_trigger() lets this kernel's own successor start launching.
 * Both are no-ops in a kernel launched without the attribute. */
__device__ __forceinline__ void kcu_pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void kcu_pdl_trigger()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
/* whether launches take the PDL attribute: KCU_PDL (default 1) and the
 * sm_90a kernels on the current device (the portable ones do not wait), off
 * for good once the runtime refused it (kcu_launch_ex) */
int kcu_pdl_on(void);
void kcu_pdl_refused(void);
/* whether the router's and the statistics' small kernels (kcu_route,
 * kcu_stats: top-k, the three layout kernels, the two statistics kernels)
 * are chained with PDL: KCU_PDL_ROUTE (default 1; KCU_PDL=0 turns every
 * PDL launch off) */
int kcu_route_pdl(void);
/* appends the PDL attribute to cfg's attributes when pdl and PDL is on
 * (the array behind cfg->attrs needs room for one more) */
static inline void kcu_pdl_attr(cudaLaunchConfig_t *cfg, cudaLaunchAttribute *attrs, int pdl)
{
    cfg->attrs = attrs;
    if (pdl && kcu_pdl_on()) {
        attrs[cfg->numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[cfg->numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
}
/* kcu_launch_ex: cudaLaunchKernelEx; if it fails with the PDL attribute
 * (last in cfg's list, from kcu_pdl_attr) PDL goes off for good and the
 * kernel is launched without it */
template <typename... Exp, typename... Act>
cudaError_t kcu_launch_ex(cudaLaunchConfig_t *cfg, void (*k)(Exp...), Act &&...args)
{
    const bool pdl = cfg->numAttrs > 0 && cfg->attrs[cfg->numAttrs - 1].id ==
                                              cudaLaunchAttributeProgrammaticStreamSerialization;
    cudaError_t e = cudaLaunchKernelEx(cfg, k, args...);
    if (e != cudaSuccess && pdl) {
        (void)cudaGetLastError();
        kcu_pdl_refused();
        cfg->numAttrs--;
        e = cudaLaunchKernelEx(cfg, k, args...);
    }
    return e;
}
/* kcu_launch: k<<<grid, block, smem, st>>>(args); pdl: with PDL (the
 * kernel calls kcu_pdl_wait first); coop: a cooperative launch (every CTA
 * resident at once, for grid barriers) */
template <typename... Exp, typename... Act>
cudaError_t kcu_launch(void (*k)(Exp...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                       int pdl, int coop, Act &&...args)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[2];
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = at;
    if (coop) {
        at[cfg.numAttrs].id = cudaLaunchAttributeCooperative;
        at[cfg.numAttrs++].val.cooperative = 1;
    }
    kcu_pdl_attr(&cfg, at, pdl);
    return kcu_launch_ex(&cfg, k, args...);
}

/* GEMM tile: BM x BN output, BK deep. The layout's tile list uses KCU_BM. */
enum { KCU_BM = 128, KCU_BN = 128, KCU_BK = 64 };
/* the fewest rows an expert on average at which v10 takes an inference
 * forward's GEMMs (gemm/dispatch.cu swap_applies; below it v7) */
enum { KCU_V10_MIN_AVG = 96 };
/* the most rows an expert on average that v10 takes (rows paired: chunks of
 * up to 384 rows split between a cluster's two CTAs; gemm/swapped.cu) */
enum { KCU_V10_MAX_AVG = 384 };

/* ---- grouped GEMM (kernels/cuda/gemm/) ----
 * Two schedules:
 *  rows mode (A K-contiguous): C rows are the sorted routed rows; the m-tiles
 *    come from the device tile list (tile_e, tile_r0, *ntiles_m), tile rows
 *    [tile_r0, min(tile_r0 + BM, offs[e+1])). Without a tile list, one group
 *    of M_fixed rows. B_e = B + e * b_gstride; A row r is a_gather[r] (or r).
 *  wgrad mode (A M-contiguous): per group e, C_e (M,N) += A_e^T B_e summed
 *    over the group's rows k in [offs[e], offs[e+1]) (or [0, K_fixed)); A row
 *    k is A[a_gather[k] or k], B row k is B[b_gather[k] or k].
 */
typedef enum kcu_amode { KCU_A_K = 0, KCU_A_M = 1 } kcu_amode;
typedef enum kcu_bmode { KCU_B_K = 0, KCU_B_N = 1 } kcu_bmode;
typedef enum kcu_epi {
    KCU_EPI_F32 = 0,     /* Cf[r*ldc + n] = acc */
    KCU_EPI_SWIGLU = 1,  /* h[r*F + f] = silu(a)*b, gate/up interleaved by 8; ab raw if given */
    KCU_EPI_GELU = 2,    /* h[r*F + n] = gelu(acc); ab raw if given */
    KCU_EPI_SCATTER = 3, /* Cb[scatter[r]*ldc + n] = bf16(acc); scatter NULL = identity */
    KCU_EPI_DSWIGLU = 4, /* dh = w*acc; ab <- (da, db) in place; h <- bf16(w*h); dwpart;
                          * w = gate_w[scatter[r]] (1 when gate_w is NULL); no dwpart if NULL */
    KCU_EPI_DGELU = 5,   /* same for GELU */
    KCU_EPI_ACC = 6      /* wgrad: Cf_e[m*ldc + n] += acc (= acc with beta0); with Cb
                          * set instead: Cb_e = bf16(Cb_e + acc) (bf16 gradients) */
} kcu_epi;

/* kcu_epi_act: the activation (kern_act, the functor's id in kcu_act.cuh)
 * of an activation epilogue (SWIGLU, GELU, DSWIGLU, DGELU), else -1.
 * kcu_epi_fwd / kcu_epi_bwd: the forward / backward epilogue of an
 * activation (callers pass a valid id: the layers check it at create). */
constexpr int kcu_epi_act(int epi)
{
    return epi == KCU_EPI_SWIGLU || epi == KCU_EPI_DSWIGLU ? KERN_ACT_SWIGLU
           : epi == KCU_EPI_GELU || epi == KCU_EPI_DGELU   ? KERN_ACT_GELU
                                                           : -1;
}
constexpr kcu_epi kcu_epi_fwd(kern_act act)
{
    return act == KERN_ACT_SWIGLU ? KCU_EPI_SWIGLU : KCU_EPI_GELU;
}
constexpr kcu_epi kcu_epi_bwd(kern_act act)
{
    return act == KERN_ACT_SWIGLU ? KCU_EPI_DSWIGLU : KCU_EPI_DGELU;
}

typedef struct kcu_gemm_args {
    const bf16 *A;
    int lda;
    const int32_t *a_gather;
    const bf16 *B;
    int ldb;
    long long b_gstride;
    const int32_t *b_gather;
    int M, N, K; /* rows mode: N, K; M_fixed when no tile list. wgrad: M, N; K_fixed when no offs */
    int ngroups; /* wgrad: groups; rows mode: the experts of offs where few_tiles (v10) */
    const int32_t *offs;     /* (E+1) group row offsets, or NULL */
    const int32_t *tile_e;   /* rows mode tile list, or NULL */
    const int32_t *tile_r0;  /* rows mode tile list */
    const int32_t *ntiles_m; /* device count of tiles in the list */
    int max_tiles_m;         /* host bound on *ntiles_m */
    /* epilogue. The wgmma epilogues store 8 bytes (bf16) or 16 bytes (fp32)
     * per lane: Cf, Cb, h and ab rows (base + row * ld) must be aligned to
     * that; a caller with a user pointer stages it otherwise (kcu_experts) */
    float *Cf;
    bf16 *Cb;
    int ldc;
    long long c_gstride;
    const int32_t *scatter; /* sorted row -> slot */
    bf16 *ab;               /* (rows, ld_ab) pre-activations */
    int ld_ab;
    bf16 *h; /* (rows, F) */
    int F;
    const float *gate_w; /* (S) slot -> gate weight */
    float *dwpart;       /* (rows, N/BN) */
    int beta0;           /* ACC: overwrite C instead of accumulating (C known to be zero) */
    int wg_ovl;          /* wgmma kernel: next item's loads before the epilogue (set inside) */
    int group_m;         /* wgmma kernels: m-tiles that walk n together (set inside) */
    int few_tiles;       /* rows mode: at most ~2 m-tiles per expert, in pairs of one expert
                          * (k_layout_scan's pairs): v7 walks each pair's n tiles alone */
    int pdl;             /* v4/v7: launch with PDL (small inference batches: measured to
                          * help there, to cost ~1.5% on Mixtral's training rows) */
    int avg_rows;        /* rows mode: the call's rows per expert on average (host), 0
                          * unknown (v10's choice, kcu_gemm_swap_override) */
    int *sched;          /* v7: 2 words, zero before the launch and left zero by it: items
                          * dealt to the clusters in order from a counter (gemm/clustered.cu);
                          * NULL (or KCU_WS_SCHED=0): each cluster walks w += clusters.
                          * One launch at a time may use a given pair. */
} kcu_gemm_args;

moe_err kcu_gemm(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, int nsm,
                 cudaStream_t st);
/* kcu_gemm_version: 1 (mma.sync), 2 (wgmma), 4 (warp-specialised wgmma), 7
 * (v4 on 2-CTA clusters with the weight tile multicast), 9 (the weight
 * gradients on 2-CTA clusters) or 10 (the rows mode with the operands
 * swapped), the kernel kcu_gemm picks (7 and 9 fall back to 4, 10 to 7, if a
 * tensor map cannot be built); always 1 where the portable image runs
 * (kcu_sm90() == 0) */
int kcu_gemm_version(kcu_amode am, kcu_bmode bm, kcu_epi epi, const kcu_gemm_args *a, int nsm);
/* kcu_gemm_select overrides the environment for checks (not thread safe:
 * call between GEMMs); -1 keeps the environment's choice of each:
 * version (KCU_GEMM): 0 default, 1 mma.sync, 2 wgmma, 4 warp-specialised
 *   (2 and 4 where the shape fits: N % 256 == 0, else 1);
 * tma (KCU_WS_TMA, v4 only): 0 cp.async only, 1 TMA where possible;
 * cluster (KCU_WS_CLUSTER): 0 off, 1 v7 where it fits;
 * staged (KCU_WS_TMA_STORE, KCU_WS_TMA_AB; v4, v7): 0 register epilogues,
 *   1 the staged ones where they apply (the weight gradients' TMA stores,
 *   dh's (a, b) by TMA);
 * sched (KCU_WS_SCHED; v7 given kcu_gemm_args.sched): 0 never, 1 always,
 *   2 for items of 64 k steps or more. */
void kcu_gemm_select(int version, int tma, int cluster, int staged, int sched);
/* kcu_gemm_narrow_override: v1n, v1 in tiles of 16 or 32 rows (A_K, B_K,
 * EPI_F32, A dense, no tile list: the router's logits; v1's bits), for
 * checks: -1 the default (KCU_GEMM_NARROW, on unless 0: where v1 runs and
 * its 128-row tiles number fewer than half the SMs), 0 never, 1 / 2 always
 * where it applies, in tiles of 16 / 32 rows */
extern int kcu_gemm_narrow_override;
/* kcu_gemm_swap_override: v10, the rows-mode GEMM with its operands swapped
 * (gemm/swapped.cu: the weights as wgmma's A, an expert's rows as its B,
 * padded to 16 rows instead of 64), for checks: -1 the default
 * (KCU_GEMM_SWAP: 1 when unset), 0 never, 1 both projections where the
 * rows average 96 to 176 an expert (the down-projection where its items
 * can be wide: N a multiple of 256), 2 both at any average, 3 the
 * up-projection at any average. It runs where the tile list is in pairs of
 * one expert (few_tiles, with ngroups the experts of offs), A dense, B_K.
 * Measured on H200 (bench/NOTES.md "v10 wide"): qwen235 T=2048 1.68 ms
 * against 1.85 on v7; slower than v7 at 64 and 256 rows an expert */
extern int kcu_gemm_swap_override;
/* kcu_gemm_swap_wide_override: v10's items of 256 output columns (two m64
 * accumulators a consumer warpgroup, chunks of 192 rows) instead of 128,
 * for checks: -1 the default (KCU_GEMM_SWAP_WIDE: bit 1 the up-projection,
 * bit 2 the down, 3 when unset; where N is a multiple of 256 and the rows
 * average at most 176 an expert), 0 never, 1 wherever N allows */
extern int kcu_gemm_swap_wide_override;
/* kcu_gemm_v10_pair_override: v10's wide items in pairs on 2-CTA clusters
 * (the two CTAs take 256 output columns each of one expert's chunk, and the
 * chunk's rows come from L2 once, multicast to both), for checks: -1 the
 * default (KCU_V10_PAIR, off unless 1; where wide items run and N is a
 * multiple of 512), 0 never, 1 wherever N allows. Measured on H200
 * (bench/NOTES.md "v10 paired"): neutral, the L2 no less busy */
extern int kcu_gemm_v10_pair_override;
/* kcu_gemm_v10_rowpair_override: v10's wide items on 2-CTA clusters split
 * by rows (each CTA half of a chunk of up to 384 rows, the same 256 output
 * columns, the weights multicast to both: one pass over an expert's
 * weights for up to 384 rows, padded to 16), for checks: -1 the default
 * (KCU_V10_ROWPAIR, 1 when unset: where the rows average 177-384 an
 * expert), 0 never, 1 wherever N allows; its 4 held stages
 * (KCU_V10_ROWPAIR_HELD) follow kcu_gemm_v10_held_override */
extern int kcu_gemm_v10_rowpair_override;
/* kcu_gemm_v10_held_override: v10's wide items (unpaired) in 4 stages of 56
 * KB, each chunk's epilogue staged through its last stage, which the
 * consumers hold until the epilogue ends (no epilogue buffers of their own),
 * for checks: -1 the default (KCU_V10_HELD, on unless 0), 0 never, 1
 * wherever wide items run unpaired. Measured on H200 (bench/NOTES.md "v10
 * held"): qwen235 T=2048 4-5% faster than with 3 stages and buffers */
extern int kcu_gemm_v10_held_override;
/* kcu_gemm_v10_sw_override: the held wide up-projection (SWIGLU, K >= 256)
 * stages each chunk's two h tiles in the held stage and a store warp of the
 * producer warpgroup stores them and releases the stage, the consumers
 * going on to the next chunk; for checks: -1 the default (KCU_V10_SW, on
 * unless 0), 0 never, 1 wherever held up-projections run with K >= 256 */
extern int kcu_gemm_v10_sw_override;
/* kcu_stats_mapped_override: the decode path's last kernel writes counts,
 * aux/z and drops into mapped page-locked memory (1), or they are copied
 * out by kcu_forward_stats (0); -1 = KCU_STATS_MAPPED (checks set it) */
extern int kcu_stats_mapped_override;
/* kcu_v7_gather_on: KCU_V7_GATHER=1 (experimental, off): gathered rows-mode
 * A on v7, its producers copying the rows by cp.async; the bytes-bound
 * inference forwards then skip their row copy (read once) */
int kcu_v7_gather_on();
size_t kcu_stats_span(const kcu_layer *l);
moe_err kcu_stats_host(kcu_layer *l);

/* ---- the layer ---- */
/* kcu_carve: hands out 256-byte aligned pieces of one allocation (or, with
 * base == NULL, only counts the bytes: a first pass sizes the allocation) */
struct kcu_carve {
    char *base;
    size_t off;
    template <typename P> void take(P **p, size_t bytes)
    {
        *p = base ? reinterpret_cast<P *>(base + off) : nullptr;
        off += (bytes + 255) & ~(size_t)255;
    }
};

/* dsync: words 0-1 the decode router's grid barrier, 2-3 the v7 schedule
 * counter of the layer's rows-mode GEMMs (kcu_gemm_args.sched) */
#define KCU_DSYNC_WORDS 4
#define KCU_SCHED_WORD  2
#define KCU_RT_CTAS     128 /* the decode router's grid at most: rows of statpart it writes */

struct kcu_layer {
    kcu_config c;
    kcu_route_config r; /* routing family, shared experts (zero: plain; the EP
                         * router view leaves it zero) */
    int Ep;             /* E (E+1 with a shared gate: row E is wsg) rounded up to KCU_BN:
                         * padded router rows */
    int family;         /* r sets a routing family or shared experts (kcu_route_family) */
    int has_bias;       /* kcu_layer_upload_bias gave a bias */
    float *bias;        /* (E) fp32 choice bias, zero until uploaded (in params) */
    int N1;             /* 2F (SwiGLU, w1/w3 interleaved by 8 rows) or F (GELU) */
    int nsm;
    void *params;
    size_t params_bytes;
    bf16 *wr;              /* (Ep,H), rows >= E zero */
    bf16 *w13;             /* (Et,N1,H), Et = kcu_nexp: routed then shared experts */
    bf16 *w2;              /* (Et,H,F) */
    float *g_wr;           /* (Ep,H) */
    float *g_w13;          /* (Et,N1,H) */
    float *g_w2;           /* (Et,H,F) */
    bf16 *gb_w13;          /* (Et,N1,H) instead of g_w13 when c.grad_bf16 */
    bf16 *gb_w2;           /* (Et,H,F) instead of g_w2 when c.grad_bf16 */
    void *ws;              /* nstates workspaces of ws_state_bytes each, one allocation */
    size_t ws_bytes;       /* all states: nstates * ws_state_bytes */
    size_t ws_state_bytes; /* one state's carve_ws (a multiple of 256) */
    int nstates;           /* max(c.states, 1) */
    int state;             /* the selected state: the ws pointers below point into it */
    uint32_t *dsync;       /* (KCU_DSYNC_WORDS) the decode router's grid barrier and the
                            * v7 schedule counter:
                            * its own allocation, zeroed at create (never poisoned with ws) */
    /* Carved by carve_ws into the selected state's workspace: xs, logits ..
     * dropped below, except stage, ye_own (own allocations) and ye when
     * borrowed from the gradient store. Each state has all of them (scratch
     * too: the simple layout, identical to the one-state layer). Shared by
     * the states and safe, since none carries data from a forward to its
     * backward (each call writes them before it reads them, on one stream):
     * stage (host transfers within one call), ye_own and the borrowed ye
     * (expert outputs until the forward's combine; dy rows and dx rows
     * within one backward), dsync (left zero by every launch).
     * Sizes below: S = T_max * kcu_nslot (routed and shared slots), E of
     * the layout arrays = kcu_nexp (Et); probs, cglob, statpart: routed E. */
    bf16 *xs;           /* (T,H) staged input */
    float *stage;       /* (T,H) f32 staging for host inputs and outputs: its own
                         * allocation, made on the first host transfer (NULL before) */
    size_t stage_bytes; /* 0 until stage is allocated */
    bf16 *xg;           /* (S,H) x in sorted row order kept for dW13 (sorted 2, train) */
    float *logits;      /* (T,Ep) */
    float *probs;       /* (T,E) */
    float *lse;         /* (T) */
    int32_t *topk_idx;  /* (S) */
    float *topk_w;      /* (S) */
    int32_t *counts;    /* (Et): routed experts first */
    int32_t *offs;      /* (Et+1) */
    int32_t *chunk;     /* (nchunks,Et) */
    int32_t *perm;      /* (S) sorted row -> slot */
    int32_t *tok;       /* (S) sorted row -> token */
    int32_t *tile_e;    /* (max_tiles) */
    int32_t *tile_r0;   /* (max_tiles) */
    int32_t *ntiles;    /* (1) */
    int32_t *cglob;     /* (E) global counts for backward */
    float *stats;       /* (2) aux, z */
    float *statpart;    /* (nblk, E+1) */
    bf16 *ab;           /* (S,N1) pre-activations, then their gradients */
    bf16 *h;            /* (S,F) activations, then w*h */
    bf16 *ye;           /* (S,H) expert outputs (slot order), then dx per slot; NULL in
                         * training layers whose gradient store can lend it (ye_for_call) */
    bf16 *ye_own;       /* (S,H) allocated on first need when ye is NULL and the
                         * gradients hold values (accumulation) */
    size_t ye_own_bytes;
    float *dwpart;    /* (S,F/BN) */
    float *dw;        /* (S) dL/dtopk_w */
    bf16 *dlogits;    /* (T,Ep) */
    float *dxr;       /* (T,H) router part of dx; NULL: it borrows h (free after
                       * dW2) when S*F*2 >= T*H*4 bytes */
    int32_t *spos;    /* (S) slot -> sorted row, -1 when dropped by the capacity */
    int32_t *dropped; /* (Et) slots dropped per expert (shared: 0) */
    int max_tiles;    /* bound on the tile list length */
    int sorted;       /* kcu_sorted_mode at create */
    /* per state s (index l->state for the selected one): */
    int T_fwd[KCU_MAX_STATES];   /* tokens of state s's last train forward, 0 if none */
    int cap_fwd[KCU_MAX_STATES]; /* capacity of its last forward (INT32_MAX = dropless) */
    int grads_clean;             /* gradients are logically zero: the next backward stores */
    int32_t *stats_h;            /* pinned, the span counts .. dropped of the workspace:
                                  * counts, aux and z, dropped read back by
                                  * kcu_forward_stats in one copy and one wait; made on
                                  * its first call, freed by kcu_layer_destroy */
    int32_t *stats_map;          /* stats_h's device-visible address (mapped), or NULL */
    int stats_in_host;           /* the last forward's decode kernels wrote the span into
                                  * stats_h themselves (KCU_STATS_MAPPED): no copy */
    /* kcu_forward_pipelined (kcu_pipe.cu): created on its first call (all
     * zero before), freed by kcu_layer_destroy (kcu_pipe_release). Shared
     * by the states (nothing in it outlives one call). */
    cudaStream_t pp_st[3]; /* copy-in, compute, copy-out: non-blocking streams */
    cudaEvent_t pp_ev[7];  /* x in[2], computed[2], y out[2] per slot; start */
    int pp_ready;          /* streams and events created */
    void *pp_buf;          /* device: pp_acc, pp_cnt, then 2 slots of x chunk
                            * (chunk,H) and y chunk (chunk,H) in the call's dtypes */
    size_t pp_bytes;       /* bytes of pp_buf (0 until allocated) */
    double *pp_acc;        /* (E+1) in pp_buf: per-expert sums of the router
                            * probabilities over the chunks so far, then sum lse^2 */
    int32_t *pp_cnt;       /* (Et) in pp_buf: slots routed per expert, summed */
    /* shared expert held apart (E + m > 256 only: kcu_layer_create_ex, as
     * kcu_ep holds it): r.shared_experts and r.shared_gate are then 0 (the
     * layout holds the K routed slots of E experts) and these hold it; all
     * zero / NULL otherwise (the m extra experts above). */
    int sh_m;        /* m: the shared expert's d_ff is m*F */
    int sh_gate;     /* its output times sigmoid(logits[t, E]) (router row E = wsg) */
    kcu_experts *sh; /* one expert of d_ff m*F over all T rows (owned) */
    bf16 *sy;        /* (T_max,H) own allocation: its output ys (kept for the gate's
                      * gradient), then in the backward its dy rows (g dy) and
                      * its dx rows */
    size_t sy_bytes;
};

/* experts held and slots per token: the E routed experts plus the m =
 * r.shared_experts shared ones (experts E .. E+m-1, slots K .. K+m-1 of
 * each token); E and K without shared experts */
static inline int kcu_nexp(const kcu_layer *l)
{
    return l->c.E + l->r.shared_experts;
}
static inline int kcu_nslot(const kcu_layer *l)
{
    return l->c.K + l->r.shared_experts;
}

/* Sorted-rows mode of a layer (decided at kcu_layer_create):
 *  0: the gathered operands (x[tok] of the up-projection and dW13, dy[tok] of
 *     dh and dW2) are gathered row by row inside the GEMM loads;
 *  1: they are copied once into sorted order (kcu_gather_rows) in the ye
 *     buffer, so the up-projection, dh and dW2 stream dense tiles (TMA on
 *     sm_90); dW13 still gathers x; no extra memory;
 *  2: as 1, and training keeps the sorted x (S,H) for dW13 (+S*H*2 bytes).
 * kcu_sorted_override: -1 = KCU_SORTED (0|1|2) or the default by shape,
 * else the mode (for checks and A/B benches). */
extern int kcu_sorted_override;
int kcu_sorted_mode(const kcu_config *c);

/* ---- experts-only object (kcu_experts.cu) ---- */
struct kcu_experts {
    int H, F, ne, N1, N_max, train, nsm;
    kern_act act;
    void *params;
    size_t params_bytes;
    bf16 *w13;     /* (ne,N1,H), followed by */
    bf16 *w2;      /* (ne,H,F) */
    float *master; /* fp32 master weights, same layout as w13|w2 (train) */
    float *g;      /* gradients, same layout (train) */
    float *m, *v;  /* AdamW moments, same layout (train) */
    size_t nparam; /* ne*(N1*H + H*F) */
    void *ws;
    size_t ws_bytes;
    bf16 *xs;         /* (N_max,H) staged input, kept for backward */
    bf16 *io;         /* (N_max,H) staged dy */
    float *stage;     /* (N_max,H) f32 staging for host inputs and outputs */
    bf16 *ab;         /* (N_max,N1) pre-activations (train) */
    bf16 *h;          /* (N_max,F) */
    int32_t *cnt;     /* (ne) counts, then scan scratch */
    int32_t *counts;  /* (ne) */
    int32_t *offs;    /* (ne+1) */
    int32_t *tile_e;  /* (max_tiles) */
    int32_t *tile_r0; /* (max_tiles) */
    int32_t *ntiles;  /* (1) */
    double *sumsq;    /* (KCU_SUMSQ_BLOCKS + 1) partial sums */
    int max_tiles;
    int N_fwd;       /* rows of the last kept forward, 0 if none */
    int tiles_fwd;   /* exact tile count of the last forward */
    int grads_clean; /* gradients are logically zero: the next backward stores */
};
enum { KCU_SUMSQ_BLOCKS = 528 };

/* kcu_phase_hook: when set (by the bench), called on the stream between the
 * layer's phases with the name of the phase that starts */
extern void (*kcu_phase_hook)(const char *phase, cudaStream_t st);

/* ---- helpers shared by kcu_layer.cu and kcu_experts.cu ---- */
int kcu_is_host_ptr(const void *p);
uint16_t kcu_host_bf16(float f);
/* kcu_capacity: the same number as kern_capacity (kernels/layout.c) */
int32_t kcu_capacity(float cf, int T, int K, int E);
/* w13 device row c (gate/up interleaved by 8 rows for SwiGLU) comes from
 * row kcu_w13_src(c) of w1, or of w3 when *from_w3 */
int kcu_w13_src(int c, int swiglu, int *from_w3);

/* kcu_forward_path: kcu_forward on stream st, its path choices (decode
 * path, small router, sorted rows for inference) made as for a call of
 * T_path >= T tokens: the chunks of kcu_forward_pipelined take the path the
 * whole batch would (kcu_forward: T_path = T) */
moe_err kcu_forward_path(kcu_layer *l, int T, const void *x, moe_dtype x_dtype, void *y,
                         moe_dtype y_dtype, int train, cudaStream_t st, int T_path);
/* kcu_pipe_release: frees kcu_forward_pipelined's streams, events and
 * buffers (kcu_layer_destroy); synchronises nothing */
void kcu_pipe_release(kcu_layer *l);

/* ---- small kernels (kcu_route.cu) ---- */
moe_err kcu_to_bf16(const void *src, moe_dtype dt, bf16 *dst, size_t n, cudaStream_t st);
/* kcu_route: routing (plain softmax top-k, or the family router when
 * kcu_route_family) and the layout with capacity cap on the routed experts;
 * pairs: the tile list in pairs of one expert (k_layout_scan; the forward
 * decides, KCU_TILE_PAIRS=0 turns it off) - for GEMMs on v7 with ~2 m-tiles
 * per expert at most, where it saves reading a weight tile twice; with more
 * tiles per expert it parts an odd expert's last tile from the rest (its
 * weights read again) */
moe_err kcu_route(kcu_layer *l, int T, int cap, int pairs, cudaStream_t st);
/* kcu_route_family_topk: the family router (k_route_family) alone on the
 * layer's logits (T,Ep): probs (T,E), lse (T), topk_idx and topk_w (T,Kt),
 * the K routed slots then the shared ones; kcu_route and the decode path
 * (kcu_decode.cu) both call it, so both choose and weigh alike */
moe_err kcu_route_family_topk(kcu_layer *l, int T, cudaStream_t st);
/* whether layer l routes with the family router (a routing family, shared
 * experts or a bias): the decode path takes it (kcu_route_family_topk
 * between its router and up kernels), the small router does not */
static inline int kcu_route_family(const kcu_layer *l)
{
    return l->family || l->has_bias;
}
/* kcu_tiles_from_counts: cnt (E) device counts in (overwritten) -> counts,
 * offs, tile list, as the layer's layout scan with one chunk */
moe_err kcu_tiles_from_counts(int32_t *cnt, int E, int32_t *counts, int32_t *offs, int32_t *tile_e,
                              int32_t *tile_r0, int32_t *ntiles, cudaStream_t st);
/* kcu_gather_rows: dst (S,H) bf16 sorted rows, dst[r] = src[tok[r]] for r <
 * *nrows (a device count, e.g. offs + E); src (T,H) device f32 or bf16 */
moe_err kcu_gather_rows(const void *src, moe_dtype dt, const int32_t *tok, const int32_t *nrows,
                        int S, int H, bf16 *dst, int pdl, cudaStream_t st);
/* the combine's term: acc[0 .. 8) += the 8 bf16 of raw, each product
 * wj x value rounded to bf16 first when weighted (the CPU reference's
 * order of operations; k_combine, kcu_shared's combine) */
__device__ __forceinline__ void kcu_combine_add(float (&acc)[8], const uint4 &raw, bool weighted,
                                                float wj)
{
    const __nv_bfloat162 *v = reinterpret_cast<const __nv_bfloat162 *>(&raw);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 f = __bfloat1622float2(v[k]);
        if (weighted) {
            acc[2 * k] += __bfloat162float(__float2bfloat16_rn(wj * f.x));
            acc[2 * k + 1] += __bfloat162float(__float2bfloat16_rn(wj * f.y));
        } else {
            acc[2 * k] += f.x;
            acc[2 * k + 1] += f.y;
        }
    }
}

/* kcu_combine: spos (S) may be NULL; slots with spos < 0 add nothing. pdl
 * (both): launched with PDL */
moe_err kcu_combine(const bf16 *ye, const float *w, const float *extra, const int32_t *spos, int T,
                    int K, int H, void *out, moe_dtype dt, int pdl, cudaStream_t st);
/* ---- a shared expert held apart (kcu_shared.cu): one kcu_experts of d_ff
 * m*F that gets every token's row, as kcu_ep holds it and kcu_layer when
 * E + m > 256. ---- */
/* kcu_shared_combine: out (T,H) of dtype dt = extra (T,H f32, or NULL) +
 * the K slots of each token in order, slot s's row rows[pos[s]] (pos
 * given) or rows[s] (pos NULL: slot order), weighted bf16(w[s] row) or
 * not (w NULL), skipped when spos && spos[s] < 0; then the shared row
 * srows[t] (T,H bf16, or NULL): + bf16(g srows[t]) with g =
 * sigmoid(glog[t * ldg]) (glog: the gate's logit column of the router
 * logits), or + srows[t] without glog. Rounded once into out. */
moe_err kcu_shared_combine(const bf16 *rows, const int32_t *pos, const int32_t *spos,
                           const float *w, const float *extra, const bf16 *srows, const float *glog,
                           int ldg, int T, int K, int H, void *out, moe_dtype dt, cudaStream_t st);
/* kcu_shared_gate_bwd: the gate's backward for T tokens: dlog[t * ld] =
 * bf16(g (1-g) <bf16(dy[t]), ys[t]>) with g = sigmoid(glog[t * ld]), and
 * out (T,H bf16) = bf16(g dy) (the shared expert's dy rows); dy (T,H) device
 * f32 or bf16; out may be dy (bf16) or ys (in place) */
moe_err kcu_shared_gate_bwd(const void *dy, moe_dtype dy_dtype, const bf16 *ys, const float *glog,
                            int ld, int T, int H, bf16 *out, bf16 *dlog, cudaStream_t st);
moe_err kcu_adamw(float *p, const float *g, float *m, float *v, bf16 *w, size_t n, float lr,
                  float b1, float b2, float eps, float wd, float bc1, float bc2, float gscale,
                  cudaStream_t st);
/* kcu_sumsq: part (KCU_SUMSQ_BLOCKS + 1) doubles; part[KCU_SUMSQ_BLOCKS] = sum g^2 */
moe_err kcu_sumsq(const float *g, size_t n, double *part, cudaStream_t st);
moe_err kcu_stats(kcu_layer *l, int T, cudaStream_t st);
moe_err kcu_dw_reduce(kcu_layer *l, int S, cudaStream_t st);
/* split-K weight gradients: offs (P+1) = p * n / P on the device; then
 * g (n floats, n % 4 == 0) = [g +] sum of the P partials part (P, n) in
 * order (fixed: deterministic), g overwritten when clean */
moe_err kcu_split_offs(int32_t *offs, int n, int P, cudaStream_t st);
moe_err kcu_sum_parts(const float *part, int P, size_t n, float *g, int clean, cudaStream_t st);
moe_err kcu_router_bwd(kcu_layer *l, int T, int T_global, float aux_coef, float z_coef,
                       cudaStream_t st);

/* ---- decode path (kcu_decode.cu): inference forwards with few rows per
 * expert; router GEMV, routing + up-projection, down-projection + combine,
 * chained with programmatic dependent launch. KCU_DECODE=0 turns it off,
 * KCU_DECODE_TMAX (default 64) is the largest T (layer) or rows per expert
 * (experts object) it takes, KCU_DECODE_ROWS (default 8) the largest
 * average of rows per expert, KCU_PDL=0 launches without PDL. ---- */
/* kcu_decode_override: -1 = environment (default), 0 = never, 1 = always
 * where supported (ignores KCU_DECODE_TMAX and KCU_DECODE_ROWS); for checks
 * and the bench */
extern int kcu_decode_override;
/* kcu_decode_calls: forwards that took the decode path (layer + experts) */
extern long long kcu_decode_calls;
/* kcu_decode_force_ks: 0 = the kernels choose how many warps split one
 * tile's k range; n > 0 = at most n (the largest power of two allowed);
 * for checks */
extern int kcu_decode_force_ks;
/* kcu_decode_use: whether kcu_forward takes the decode path (host only) */
int kcu_decode_use(const kcu_layer *l, int T, int train);
/* kcu_decode_forward: logits, routing (probs, lse, topk, counts, dropped,
 * offs, perm, tok, spos, stats as the GEMM path) and y (T,H) from the bf16
 * device input xb; y a device pointer of y_dtype */
moe_err kcu_decode_forward(kcu_layer *l, int T, const bf16 *xb, int cap, void *y, moe_dtype y_dtype,
                           cudaStream_t st);
/* kcu_route_small_use: whether an inference forward on the GEMM path routes
 * with kcu_route_small (few slots) instead of the router GEMM, kcu_route and
 * kcu_stats (host only) */
int kcu_route_small_use(const kcu_layer *l, int T, int train);
/* kcu_layer_route_small: whether the whole layer's forward takes it - where
 * kcu_route_small_use says so and the rows average fewer than
 * KCU_V10_MIN_AVG an expert (kcu_layer.cu) */
int kcu_layer_route_small(const kcu_layer *l, int T, int train);
/* kcu_route_small: logits, probs, lse, topk, counts, dropped, offs, perm,
 * tok, spos, the tile list and the statistics in one kernel (the decode
 * router; its CTAs meet at grid barriers). *stat_rows (may be NULL): the rows
 * of statpart it wrote (one per router CTA, zero for a CTA without tokens),
 * all of which the column sums of probs and lse^2 need */
moe_err kcu_route_small(kcu_layer *l, int T, const bf16 *xb, int cap, int *stat_rows,
                        cudaStream_t st);
int kcu_decode_use_experts(const kcu_experts *x, int N, const int32_t *counts, int keep);
/* kcu_decode_local_use: whether the fan-out's chain (kcu_decode_local) takes
 * an inference forward of T tokens on the router view l (plain softmax
 * top-k, dropless, the decode path's sizes) */
int kcu_decode_local_use(const kcu_layer *l, int T);
/* kcu_decode_local: the fan-out's decode chain (kcu_ep_forward_local) on
 * the router view l of all E experts and the experts x, which are experts
 * [e_lo, e_lo + x->ne) of the layer: the router and the layout of the T
 * tokens of xb (T,H) bf16 (device-visible; the layout, weights, probs and
 * lse land in l as kcu_decode_forward leaves them), the up and down
 * projections of x's experts only, their rows written as bf16 at their
 * sorted rows of rows (S,H) (device-visible; other rows untouched); h
 * (S,F) bf16 device workspace. Three kernels chained with PDL, nothing
 * waited for. */
moe_err kcu_decode_local(kcu_layer *l, const kcu_experts *x, int e_lo, int T, const bf16 *xb,
                         bf16 *h, void *rows, cudaStream_t st);
/* y (N,H) device of y_dtype from the bf16 device rows xb grouped by counts */
moe_err kcu_decode_experts_forward(kcu_experts *x, int N, const bf16 *xb, const int32_t *counts,
                                   void *y, moe_dtype y_dtype, cudaStream_t st);

#endif /* MOE_KCU_INTERNAL_CUH */
