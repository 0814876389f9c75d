/*
 * kcu_decode.cu - the decode path: inference forwards with few routed rows
 * per expert (small T), where the layer is bound by reading the touched
 * expert weights once. Three kernels instead of ~10, chained with
 * programmatic dependent launch (PDL) so that each one is resident and
 * waiting (griddepcontrol.wait) when its predecessor ends:
 *
 *  1. k_dec_router: logits (T,Ep) = xb wr^T; one CTA per 16 router rows,
 *     the 8 warps split H, partial sums added in warp order (fixed). After
 *     a barrier over its (at most 16) CTAs: softmax/top-k with one token
 *     per warp of the grid (probs, lse, topk, column sums for the
 *     statistics) - the routing once, in parallel (it was recomputed by
 *     every up CTA: ~5 us per token and warp, 40 us at T=64).
 *  2. k_dec_up: every CTA builds the layout of the router's choices
 *     (capacity, stable permutation, active experts) in shared memory -
 *     for S <= 32 slots in one warp, layout_small; the last CTA also
 *     writes it out (offs, perm, tok, spos) for the next kernel, and after
 *     its tiles counts, drops and the aux/z statistics. Then the
 *     CTAs stream the active experts' w13 rows: tile = 16 weight rows of
 *     one expert (w1/w3 interleaved by 8: 8 gate + 8 up rows = 8 features)
 *     x up to 8*NB of its rows per pass, mma.sync m16n8k16 with the weights
 *     as the A operand (16-byte loads straight from global into fragments:
 *     the k order is permuted identically in both operands), fp32
 *     accumulate, SwiGLU/GELU applied in registers, h (S,F) bf16 by sorted
 *     row as the GEMM path. A tile's H may be split over KS warps of one CTA
 *     (chosen on the device from the number of tiles so that the grid is
 *     filled), partials added in a fixed order.
 *  3. k_dec_down: CTA task = 16 output columns of all active experts; the
 *     16 warps take (expert, F part) items; the unweighted expert outputs
 *     (ye, rounded to bf16 as the GEMM path stores them) stay in shared
 *     memory and the CTA does the combine for its columns in j order
 *     (y[t] = sum_j bf16(w ye[t,j]), as kcu_combine) - or, for the experts
 *     object, writes the rows out.
 *
 * Routing families (kcu_route_family: sigmoid or softmax scores, a choice
 * bias, groups, a scale, shared experts): decode_forward_family runs the
 * router for the logits alone, the GEMM path's family router
 * (kcu_route_family_topk, one more kernel) and kernels 2 and 3 over the
 * routed and shared experts of the layout; a shared expert held apart
 * (E + m > 256) runs first and the combine adds its rows (k_dec_down<NB,
 * true>). The softmax path above is not touched by it.
 *
 * Taken for inference forwards only (train forwards keep the GEMM path
 * that saves the backward state), when T <= KCU_DECODE_TMAX (default 64), T*K <= 2048 and
 * the rows per expert average at most KCU_DECODE_ROWS (default 8: measured, Mixtral T=64 with
 * 16 rows per expert is faster on the GEMM path, Qwen3 T=64 with 4 on this one); KCU_DECODE=0 turns
 * it off, KCU_PDL=0 launches without PDL. All results are deterministic (no atomics on values,
 * fixed-order reductions); they can differ from the GEMM path in the last bits (another summation
 * order), within the bf16 tolerances.
 */
#include <float.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kcu_act.cuh"
#include "kernels/cuda/kcu_internal.cuh"
#include "kernels/cuda/kcu_topk.cuh"

int kcu_decode_override = -1;
int kcu_stats_mapped_override = -1;
long long kcu_decode_calls = 0;
int kcu_decode_force_ks = 0;

namespace
{

constexpr int DEC_SMAX = 2048; /* routed slots (layer) or rows (experts) at most */
constexpr int DEC_EMAX = 256;
constexpr int UP_NW = 8, UP_NT = UP_NW * 32;
constexpr int DN_NW = 16, DN_NT = DN_NW * 32;
constexpr int RT_NW = 8, RT_NT = RT_NW * 32;
constexpr int KU = 4;                   /* 32-wide k blocks loaded per batch */
constexpr int RT_KB = 8;                /* the router's batch: H = 2048 split over 8 warps in one */
constexpr int RT_CTAS = KCU_RT_CTAS;    /* the router grid at most */
constexpr int DN_COLS = 16;             /* output columns per down CTA task */
constexpr int DN_SMEM_PART = 96 * 1024; /* ys and the split-F partials, at most */
constexpr int DN_SMEM_MAX = 200 * 1024; /* ys alone at DEC_SMAX rows: 128 KB */

/* group offsets passed by value (experts object: counts are on the host) */
struct dec_offs {
    int32_t v[DEC_EMAX + 1];
};

struct rt_params {
    const bf16 *x;  /* (T,H) */
    const bf16 *wr; /* (Ep,H) */
    int T, H, E, Ep, K, cap, renorm;
    float *logits; /* (T,Ep) */
    float *probs;  /* (T,E) */
    float *lse;    /* (T) */
    int32_t *topk_idx;
    float *topk_w;  /* (T,K) */
    float *colpart; /* (gridDim, E+1): per-CTA column sums of probs, sum lse^2 */
    uint32_t *sync; /* (2) zeroed at layer create: barrier count, generation */
    int topk;       /* 0: logits only (the up CTAs route: few slots; or a routing
                     * family: kcu_route_family_topk routes between router and up) */
    int rows;       /* router rows computed: 0 = E; E+1 with a shared gate (row E) */
    int spread;     /* logits only, yet the token passes spread over CTAs (gridDim.y) */
    /* layout (the GEMM path, kcu_route_small): after a second barrier the
     * CTAs build the layout of the choices, each a slice of the slots */
    int layout;
    int32_t *offs, *perm, *tok, *spos, *counts, *dropped, *tile_e, *tile_r0, *ntiles;
    float *stats;
};

struct up_params {
    const bf16 *x;   /* (tokens or rows, H) */
    const bf16 *w13; /* (E,N1,H) */
    int N1, H, F, E;
    int act; /* kern_act: launch_up instantiates k_dec_up with its functor */
    bf16 *h; /* (rows,F) by sorted row */
    /* routing (layer) when topk_idx != NULL (the router's choices), else
     * the offsets in go */
    int32_t *topk_idx;   /* the router's choices (S), or written here when logits */
    const float *logits; /* (T,Ep): at most 32 slots, each CTA routes (dec_topk) */
    int Ep, renorm;
    float *probs, *lse, *topk_w;
    int T, K, cap;
    int Er, Kr; /* routed experts and slots (the statistics; probs (T,Er)): E and K
                 * but with shared experts in the layout (E + m, K + m) */
    int32_t *offs, *perm, *tok, *spos;
    const float *colpart; /* (nrt, E+1) the router CTAs' column sums (logits NULL),
                           * or NULL: the statistics from probs and lse (family) */
    int nrt;
    int32_t *counts, *dropped; /* (E) before / dropped by the capacity */
    float *stats;              /* (2) aux, z */
    int ks_force;              /* 0 = choose the split of H, else at most this (checks) */
    int small_layout;          /* layout_small where S <= 32 (KCU_DEC_SMALL_LAYOUT, default 1) */
    dec_offs go;
    /* the fan-out (kcu_decode_local): tiles of experts [e_lo, e_hi) of the
     * layout only, whose weights are w13's rows from e_lo on (e_hi 0: all) */
    int e_lo, e_hi;
};

struct dn_params {
    const bf16 *h;  /* (rows,F) */
    const bf16 *w2; /* (E,H,F) */
    int H, F, E;
    const int32_t *offs; /* (E+1) on the device (layer), or NULL: go */
    dec_offs go;
    /* combine (layer) when spos != NULL, else rows out */
    const int32_t *spos;
    const float *topk_w;
    int T, K;
    /* a shared expert held apart (k_dec_down<NB, true> only): its rows
     * srows (T,H) added after the K slots of token t, + bf16(g srows[t])
     * with g = sigmoid(glog[t * ldg]), or + srows[t] without glog, as
     * kcu_shared_combine */
    const bf16 *srows;
    const float *glog;
    int ldg;
    void *out;
    int out_f32;
    int smem_floats;
    int ks_force; /* 0 = choose the split of F, else at most this (checks) */
    /* span_out != NULL: CTA 0 copies span_words words of span_in (the
     * workspace's counts .. dropped, written by the up kernel) there at
     * its end - page-locked host memory, so no copy follows the chain */
    const uint32_t *span_in;
    uint32_t *span_out;
    int span_words;
    /* the fan-out (kcu_decode_local): experts [e_lo, e_hi) of the layout
     * only (w2 from e_lo on), their rows out at their sorted rows (e_hi 0:
     * all) */
    int e_lo, e_hi;
};

/* ---- device helpers ---- */

/* weights are read once: no L1 allocation */
__device__ __forceinline__ uint4 ld_stream(const bf16 *p)
{
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
/* activations are reused by the tiles of one expert: cached */
__device__ __forceinline__ uint4 ld_act(const bf16 *p)
{
    return __ldg(reinterpret_cast<const uint4 *>(p));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* One 32-wide k block: lane (g, c) holds physical k [8c, 8c+8) of weight
 * rows g (w0) and g+8 (w8) and of its token g (x). Logical k of the two
 * m16n8k16 steps: step s, pair 2c(+1) <-> physical 8c+4s(+1), pair 2c+8(+1)
 * <-> physical 8c+4s+2(+1): the same bijection on both operands. */
__device__ __forceinline__ void mma_block(float (&c)[4], const uint4 &w0, const uint4 &w8,
                                          const uint4 &x)
{
    mma_bf16(c, w0.x, w8.x, w0.y, w8.y, x.x, x.y);
    mma_bf16(c, w0.z, w8.z, w0.w, w8.w, x.z, x.w);
}

/* acc[nb] (+)= W[16 rows, k blocks kb0..kb1) . X[tokens nb*8 .. nb*8+7]^T.
 * wrow: weight row g of the tile (row g+8 is 8*ldw further); xr[nb]: the
 * lane's token row (valid when xv[nb]); ntok: tokens in this pass (warp
 * uniform). C fragment: acc[nb][0..1] = (row g, tokens 2c, 2c+1),
 * acc[nb][2..3] = (row g+8, same tokens). KB k blocks are loaded per batch
 * (the router, with registers to spare, takes its k range in one batch). */
template <int NB, int KB = KU>
__device__ __forceinline__ void warp_rows(const bf16 *__restrict__ wrow, size_t ldw, int kb0,
                                          int kb1, const bf16 *const (&xr)[NB],
                                          const bool (&xv)[NB], int ntok, float (&acc)[NB][4])
{
    const int c = threadIdx.x & 3;
    const bf16 *w0 = wrow + c * 8, *w8 = wrow + 8 * ldw + c * 8;
    const uint4 z = make_uint4(0, 0, 0, 0);
    int kb = kb0;
    for (; kb + KB <= kb1; kb += KB) {
        uint4 a0[KB], a8[KB];
#pragma unroll
        for (int u = 0; u < KB; u++) {
            a0[u] = ld_stream(w0 + (size_t)(kb + u) * 32);
            a8[u] = ld_stream(w8 + (size_t)(kb + u) * 32);
        }
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            if (nb * 8 >= ntok)
                break;
            uint4 b[KB];
#pragma unroll
            for (int u = 0; u < KB; u++)
                b[u] = xv[nb] ? ld_act(xr[nb] + (size_t)(kb + u) * 32 + c * 8) : z;
#pragma unroll
            for (int u = 0; u < KB; u++)
                mma_block(acc[nb], a0[u], a8[u], b[u]);
        }
    }
    for (; kb < kb1; kb++) {
        const uint4 a0 = ld_stream(w0 + (size_t)kb * 32), a8 = ld_stream(w8 + (size_t)kb * 32);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            if (nb * 8 >= ntok)
                break;
            const uint4 b = xv[nb] ? ld_act(xr[nb] + (size_t)kb * 32 + c * 8) : z;
            mma_block(acc[nb], a0, a8, b);
        }
    }
}

__device__ __forceinline__ float rbf(float x)
{
    return __bfloat162float(__float2bfloat16_rn(x));
}

/* a whole warp: the exclusive prefix sum of v over the lanes, and the total */
__device__ __forceinline__ int lane_excl_scan(int v, int &total)
{
    const int lane = threadIdx.x & 31;
    int inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o)
            inc += t;
    }
    total = __shfl_sync(0xffffffffu, inc, 31);
    return inc - v;
}

/* warp 0: active experts (kept rows > 0, in expert order) from offsets
 * off (E+1, shared memory). E <= 256: 8 experts per lane. */
__device__ void build_active(const int *off, int E, int *act_e, int *act_off, int *act_n, int *na)
{
    const int lane = threadIdx.x & 31;
    int cnt = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane * 8 + i;
        cnt += e < E && off[e + 1] > off[e];
    }
    int total;
    int pos = lane_excl_scan(cnt, total);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane * 8 + i;
        if (e < E && off[e + 1] > off[e]) {
            act_e[pos] = e;
            act_off[pos] = off[e];
            act_n[pos] = off[e + 1] - off[e];
            pos++;
        }
    }
    if (lane == 31)
        *na = total;
}

/* thread 0: the active list cut to experts [e_lo, e_hi) (the fan-out's:
 * this rank's experts of a layout of every expert), order kept; the caller
 * synchronises */
__device__ void keep_range(int e_lo, int e_hi, int *act_e, int *act_off, int *act_n, int *na)
{
    if (threadIdx.x != 0)
        return;
    int k = 0;
    for (int a = 0; a < *na; a++) {
        const int e = act_e[a];
        if (e >= e_lo && e < e_hi) {
            act_e[k] = e;
            act_off[k] = act_off[a];
            act_n[k] = act_n[a];
            k++;
        }
    }
    *na = k;
}

/* warp 0: off[e] = exclusive scan of cnt[e] (E <= 256), off[E] = total */
__device__ void scan_offsets(const int *cnt, int E, int *off)
{
    const int lane = threadIdx.x & 31;
    int v[8], sum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane * 8 + i;
        v[i] = e < E ? cnt[e] : 0;
        sum += v[i];
    }
    int total;
    int run = lane_excl_scan(sum, total);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane * 8 + i;
        if (e < E)
            off[e] = run;
        run += v[i];
    }
    if (lane == 31)
        off[E] = total;
}

/* column e of the router CTAs' column sums (nrt rows of E+1: the
 * probabilities of expert e, or at e = E lse^2) added in row order, 16
 * loads in flight */
__device__ float colpart_sum(const float *colpart, int nrt, int E, int e)
{
    float sum = 0.f;
    for (int b0 = 0; b0 < nrt; b0 += 16) {
        float x[16];
#pragma unroll
        for (int q = 0; q < 16; q++)
            x[q] = b0 + q < nrt ? __ldcg(colpart + (size_t)(b0 + q) * (E + 1) + e) : 0.f;
#pragma unroll
        for (int q = 0; q < 16; q++)
            sum += x[q];
    }
    return sum;
}

/* warp 0: aux = E/(K T) sum_e cnt_e col_e / T and z = col_E / T (as
 * k_stats_final, in another summation order) */
__device__ void write_stats(const int *cnt, const float *col, int E, int K, int T, float *stats)
{
    const int lane = threadIdx.x & 31;
    if (threadIdx.x >= 32)
        return;
    float aux = 0.f;
    for (int e = lane; e < E; e += 32)
        aux += (float)cnt[e] * (col[e] / (float)T);
    aux = kcu_topk::warp_sum(aux);
    if (lane == 0) {
        stats[0] = aux * (float)E / ((float)K * (float)T);
        stats[1] = col[E] / (float)T;
    }
}

/* ---- 1. router: logits, softmax/top-k, counts and statistics ---- */

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t *p)
{
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* every CTA of the router grid waits here until all have arrived (their
 * logits written). The grid is at most RT_CTAS CTAs, launched cooperatively
 * (all resident). sync[0] counts arrivals (the last one resets it), sync[1]
 * is the generation the others wait to change. */
__device__ void router_grid_sync(uint32_t *sync)
{
    const uint32_t ncta = gridDim.x * gridDim.y;
    __syncthreads();
    if (threadIdx.x == 0 && ncta > 1) {
        const uint32_t gen = ld_acquire(sync + 1);
        __threadfence();
        if (atomicAdd(sync, 1u) == ncta - 1) {
            atomicExch(sync, 0u);
            __threadfence();
            atomicAdd(sync + 1, 1u);
        } else {
            while (ld_acquire(sync + 1) == gen)
                __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}

/* the layout of the router's choices for the GEMM path, spread over the
 * router's CTAs (after the barrier that follows the top-k): every CTA counts
 * all S slots (and those before its own slice [s0, s1)), scans kept counts
 * and tiles per expert; warp 0 ranks its slice in chunks of 32 (stable:
 * the slots before it of each expert, then match_any within a chunk) and
 * writes perm, tok, spos; each CTA writes its share of the tile list; CTA 0
 * offs, counts, drops, the tile count and the statistics. The same rows as
 * k_layout_* and dec_route. */
__device__ void router_layout(const rt_params &p, int cta, int ncta)
{
    __shared__ int cnt[DEC_EMAX], pre[DEC_EMAX], off[DEC_EMAX + 1], toff[DEC_EMAX + 1];
    __shared__ int tmp[DEC_EMAX];
    __shared__ float col[DEC_EMAX + 1];
    const int tid = threadIdx.x, lane = tid & 31, E = p.E, K = p.K, cap = p.cap;
    const int S = p.T * K, s0 = (int)((long long)cta * S / ncta);
    const int s1 = (int)((long long)(cta + 1) * S / ncta);
    for (int e = tid; e < E; e += RT_NT)
        cnt[e] = pre[e] = 0;
    __syncthreads();
    for (int s = tid; s < S; s += RT_NT) {
        const int e = __ldcg(p.topk_idx + s);
        atomicAdd(&cnt[e], 1);
        if (s < s0)
            atomicAdd(&pre[e], 1);
    }
    __syncthreads();
    for (int e = tid; e < E; e += RT_NT)
        tmp[e] = min(cnt[e], cap);
    __syncthreads();
    if (tid < 32)
        scan_offsets(tmp, E, off);
    __syncthreads();
    for (int e = tid; e < E; e += RT_NT)
        tmp[e] = KCU_CEIL_DIV(min(cnt[e], cap), KCU_BM);
    __syncthreads();
    if (tid < 32)
        scan_offsets(tmp, E, toff);
    __syncthreads();
    if (tid < 32) {
        for (int b = s0; b < s1; b += 32) {
            const int s = b + lane;
            const int e = s < s1 ? __ldcg(p.topk_idx + s) : -1;
            const unsigned peers = __match_any_sync(0xffffffffu, e);
            const unsigned lower = peers & ((1u << lane) - 1u);
            const int rank = (e >= 0 ? pre[e] : 0) + __popc(lower);
            __syncwarp();
            if (e >= 0 && lower == 0)
                pre[e] += __popc(peers);
            __syncwarp();
            if (s < s1) {
                if (rank < min(cnt[e], cap)) {
                    const int row = off[e] + rank;
                    p.perm[row] = s;
                    p.tok[row] = s / K;
                    p.spos[s] = row;
                } else {
                    p.spos[s] = -1;
                }
            }
        }
    }
    const int nt = toff[E], i0 = (int)((long long)cta * nt / ncta);
    const int i1 = (int)((long long)(cta + 1) * nt / ncta);
    for (int i = i0 + tid; i < i1; i += RT_NT) {
        int lo = 0, hi = E - 1; /* the expert whose tiles hold i: toff[e] <= i < toff[e+1] */
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (toff[mid] <= i)
                lo = mid;
            else
                hi = mid - 1;
        }
        p.tile_e[i] = lo;
        p.tile_r0[i] = off[lo] + (i - toff[lo]) * KCU_BM;
    }
    if (cta != 0)
        return;
    for (int e = tid; e <= E; e += RT_NT) {
        p.offs[e] = off[e];
        col[e] = colpart_sum(p.colpart, ncta, E, e);
        if (e < E) {
            p.counts[e] = cnt[e];
            p.dropped[e] = cnt[e] - min(cnt[e], cap);
        }
    }
    if (tid == 0)
        *p.ntiles = nt;
    __syncthreads();
    write_stats(cnt, col, E, K, p.T, p.stats);
}

/* logits (T,Ep) = xb wr^T: CTA (bx, by) takes router rows [16bx, 16bx+16)
 * of the token passes by, by + gridDim.y, ... (32 tokens per pass at NB=4),
 * its 8 warps split H, partial sums added in warp order (fixed). Then, once every
 * CTA's rows are written, softmax/top-k with one token per warp of the grid
 * (kcu_topk, as k_softmax_topk) and per-CTA column sums of the
 * probabilities and of lse^2 for the statistics (dec_stats). The routing is
 * computed here once instead of in every CTA of the up kernel. */
template <int NB>
__global__ void __launch_bounds__(RT_NT) k_dec_router(const __grid_constant__ rt_params p)
{
    __shared__ float red[RT_NW][NB * 4][32];
    __shared__ float colw[RT_NW][DEC_EMAX + 1];
    kcu_pdl_wait();
    kcu_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int tid = threadIdx.x, T = p.T, E = p.E, K = p.K;
    const int nkb = p.H / 32;
    const int kb0 = warp * nkb / RT_NW, kb1 = (warp + 1) * nkb / RT_NW;
    const int row0 = blockIdx.x * 16;
    const int cta = blockIdx.y * gridDim.x + blockIdx.x, ncta = gridDim.x * gridDim.y;
    const bf16 *wrow = p.wr + (size_t)(row0 + g) * p.H;
    for (int t0 = blockIdx.y * 8 * NB; t0 < T; t0 += gridDim.y * 8 * NB) {
        const int ntok = min(8 * NB, T - t0);
        const bf16 *xr[NB];
        bool xv[NB];
        float acc[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            xv[nb] = nb * 8 + g < ntok;
            xr[nb] = p.x + (size_t)(xv[nb] ? t0 + nb * 8 + g : 0) * p.H;
            acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
        }
        warp_rows<NB, RT_KB>(wrow, p.H, kb0, kb1, xr, xv, ntok, acc);
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                red[warp][nb * 4 + q][lane] = acc[nb][q];
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int nb = 0; nb < NB; nb++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float v = red[0][nb * 4 + q][lane];
                    for (int w = 1; w < RT_NW; w++)
                        v += red[w][nb * 4 + q][lane];
                    const int t = t0 + nb * 8 + 2 * c + (q & 1), r = row0 + g + (q >> 1) * 8;
                    if (t < T)
                        p.logits[(size_t)t * p.Ep + r] = v;
                }
        }
        __syncthreads();
    }
    if (!p.topk)
        return;
    router_grid_sync(p.sync);

    /* softmax/top-k: token t on warp t of the grid (strided) */
    float cs[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, z = 0.f;
    for (int t = cta * RT_NW + warp; t < T; t += ncta * RT_NW) {
        float v[8], lse_t, wk[8], wsum;
        int ik[8];
        kcu_topk::softmax_topk(p.logits + (size_t)t * p.Ep, E, K, v, lse_t, ik, wk, wsum);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int e = lane + 32 * i;
            if (e < E)
                p.probs[(size_t)t * E + e] = v[i];
            cs[i] += v[i];
        }
        z += lse_t * lse_t;
        if (lane == 0) {
            p.lse[t] = lse_t;
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < K) {
                    p.topk_idx[(size_t)t * K + j] = ik[j];
                    p.topk_w[(size_t)t * K + j] = p.renorm ? wk[j] / wsum : wk[j];
                }
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        if (e < E)
            colw[warp][e] = cs[i];
    }
    if (lane == 0)
        colw[warp][E] = z;
    __syncthreads();
    for (int e = tid; e <= E; e += RT_NT) {
        float sum = 0.f;
        for (int w = 0; w < RT_NW; w++)
            sum += colw[w][e];
        p.colpart[(size_t)cta * (E + 1) + e] = sum;
    }
    if (!p.layout)
        return;
    router_grid_sync(p.sync); /* every CTA's choices and column sums written */
    router_layout(p, cta, ncta);
}

/* ---- 2. routing + up-projection ---- */
struct up_smem {
    union {
        float red[UP_NW][16][32]; /* split-H partials (NB <= 4) */
        struct {
            int idx[DEC_SMAX];         /* slot -> expert */
            int rank[DEC_SMAX];        /* rank within the warp's segment */
            int wcnt[UP_NW][DEC_EMAX]; /* per warp segment counts, then bases */
        } r;
    } u;
    int perm[DEC_SMAX]; /* sorted row -> slot (layer) */
    int cnt[DEC_EMAX], kept[DEC_EMAX];
    int off[DEC_EMAX + 1];
    int act_e[DEC_EMAX], act_off[DEC_EMAX], act_n[DEC_EMAX];
    float col[DEC_EMAX + 1];
    int na;
};

/* expert e routed c slots: its kept rows (capacity) */
__device__ __forceinline__ void set_count(const up_params &p, up_smem &sm, int e, int c)
{
    sm.cnt[e] = c;
    sm.kept[e] = c < p.cap ? c : p.cap;
}

/* the layout for S <= 32 routed slots (T=1: K of them): warp 0 holds a
 * slot per lane and ranks it by comparing it with every slot - the same
 * rows, kept flags and active list as the counting sort in dec_route, with
 * one barrier instead of six on the path to the up tiles */
__device__ void layout_small(const up_params &p, up_smem &sm, bool out)
{
    const unsigned FULL = 0xffffffffu;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    const int E = p.E, K = p.K, S = p.T * K, cap = p.cap;
    if (out)
        for (int e = tid; e < E; e += UP_NT)
            sm.cnt[e] = 0;
    __syncthreads(); /* idx (and the zeroed counts) */
    if (warp == 0) {
        const int e = lane < S ? sm.u.r.idx[lane] : INT_MAX;
        int before = 0, same = 0; /* slots of expert e: before this one, all */
        for (int q = 0; q < S; q++) {
            const int eq = __shfl_sync(FULL, e, q);
            before += eq == e && q < lane;
            same += eq == e;
        }
        const int keep = lane < S && before < cap;
        const int first = keep && before == 0; /* the expert's first slot, kept */
        int row = before, act = 0;             /* sorted row; index in the active list */
        for (int q = 0; q < S; q++) {          /* every lane shuffles: no short-circuit */
            const int eq = __shfl_sync(FULL, e, q), kq = __shfl_sync(FULL, keep, q);
            const int fq = __shfl_sync(FULL, first, q);
            row += eq < e ? kq : 0;
            act += eq < e ? fq : 0;
        }
        if (first) {
            sm.cnt[e] = same;
            sm.act_e[act] = e;
            sm.act_off[act] = row;
            sm.act_n[act] = same < cap ? same : cap;
        }
        if (keep)
            sm.perm[row] = lane;
        const int na = __popc(__ballot_sync(FULL, first));
        if (lane == 0)
            sm.na = na;
        if (out && lane < S) {
            if (keep) {
                p.perm[row] = lane;
                p.tok[row] = lane / K;
            }
            p.spos[lane] = keep ? row : -1;
        }
    }
    if (!out)
        return;
    __syncthreads();
    for (int e = tid; e < E; e += UP_NT)
        set_count(p, sm, e, sm.cnt[e]);
    __syncthreads();
    if (warp == 0)
        scan_offsets(sm.kept, E, sm.off);
    __syncthreads();
    for (int e = tid; e <= E; e += UP_NT)
        p.offs[e] = sm.off[e];
}

/* the counting sort with capacity for any S <= DEC_SMAX: stable ranks per
 * warp segment, per-expert bases, kept counts, offsets, active list */
__device__ void layout_general(const up_params &p, up_smem &sm, bool out)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    const int E = p.E, K = p.K, S = p.T * K;
    for (int i = tid; i < UP_NW * DEC_EMAX; i += UP_NT)
        (&sm.u.r.wcnt[0][0])[i] = 0;
    __syncthreads();
    /* stable ranks: warp w takes slots [w*seg, (w+1)*seg) in chunks of 32 */
    const int seg = KCU_CEIL_DIV(S, 32 * UP_NW) * 32;
    for (int b = warp * seg; b < min(S, (warp + 1) * seg); b += 32) {
        const int s = b + lane;
        const int e = s < S ? sm.u.r.idx[s] : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const unsigned lower = peers & ((1u << lane) - 1u);
        const int prior = e >= 0 ? sm.u.r.wcnt[warp][e] : 0;
        __syncwarp();
        if (e >= 0 && lower == 0)
            sm.u.r.wcnt[warp][e] = prior + __popc(peers);
        __syncwarp();
        if (s < S)
            sm.u.r.rank[s] = prior + __popc(lower);
    }
    __syncthreads();
    for (int e = tid; e < E; e += UP_NT) {
        int run = 0;
        for (int w = 0; w < UP_NW; w++) {
            const int v = sm.u.r.wcnt[w][e];
            sm.u.r.wcnt[w][e] = run;
            run += v;
        }
        set_count(p, sm, e, run);
    }
    __syncthreads();
    if (warp == 0)
        scan_offsets(sm.kept, E, sm.off);
    __syncthreads();
    if (warp == 0)
        build_active(sm.off, E, sm.act_e, sm.act_off, sm.act_n, &sm.na);
    if (out)
        for (int e = tid; e <= E; e += UP_NT)
            p.offs[e] = sm.off[e];
    for (int s = tid; s < S; s += UP_NT) {
        const int e = sm.u.r.idx[s];
        const int rank = sm.u.r.wcnt[s / seg][e] + sm.u.r.rank[s];
        if (rank < sm.kept[e]) {
            const int row = sm.off[e] + rank;
            sm.perm[row] = s;
            if (out) {
                p.perm[row] = s;
                p.tok[row] = s / K;
                p.spos[s] = row;
            }
        } else if (out) {
            p.spos[s] = -1;
        }
    }
}

/* the layout of the router's choices (counting sort with capacity, as
 * k_layout_*), in every CTA; the last CTA, which has the fewest up tiles
 * (task = blockIdx.x + i gridDim.x), also writes it out (offs, perm, tok,
 * spos) for the down kernel and kcu_forward_stats */
__device__ void dec_route(const up_params &p, up_smem &sm)
{
    const int S = p.T * p.K, K = p.K, lane = threadIdx.x & 31;
    const bool out = blockIdx.x == gridDim.x - 1;
    if (!p.logits) {
        for (int s = threadIdx.x; s < S; s += UP_NT)
            sm.u.r.idx[s] = p.topk_idx[s];
    } else { /* few slots: softmax/top-k here, a token per warp, without the
              * router's grid barrier on the path (faster at T=1) */
        for (int t = threadIdx.x >> 5; t < p.T; t += UP_NW) {
            float v[8], lse_t, wk[8], wsum;
            int ik[8];
            kcu_topk::softmax_topk(p.logits + (size_t)t * p.Ep, p.E, K, v, lse_t, ik, wk, wsum);
            if (out) {
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (lane + 32 * i < p.E)
                        p.probs[(size_t)t * p.E + lane + 32 * i] = v[i];
            }
            if (lane == 0) {
                if (out)
                    p.lse[t] = lse_t;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (j < K) {
                        sm.u.r.idx[t * K + j] = ik[j];
                        if (out) {
                            p.topk_idx[(size_t)t * K + j] = ik[j];
                            p.topk_w[(size_t)t * K + j] = p.renorm ? wk[j] / wsum : wk[j];
                        }
                    }
            }
        }
    }
    if (S <= 32 && p.small_layout)
        layout_small(p, sm, out);
    else
        layout_general(p, sm, out);
    __syncthreads();
}

/* the writing CTA, after its up tiles (off the critical path): counts and
 * drops from its layout, and the aux/z statistics from the router CTAs'
 * column sums, or from the probs it wrote (as k_stats_part + k_stats_final, in another summation
 * order: aux = E/(K T) sum_e counts_e mean_t p[t,e], z = mean_t lse_t^2) */
__device__ void dec_stats(const up_params &p, up_smem &sm)
{
    /* counts and drops over the E experts of the layout; the statistics
     * over the Er routed ones (Er = E without shared experts in it) */
    const int E = p.E, Er = p.Er, T = p.T;
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += UP_NT) {
        if (e <= Er) {
            float sum = 0.f;
            if (!p.logits && p.colpart)
                sum = colpart_sum(p.colpart, p.nrt, Er, e);
            else if (e < Er) /* dec_route or the family router wrote probs and lse */
                for (int t = 0; t < T; t++)
                    sum += p.probs[(size_t)t * Er + e];
            else
                for (int t = 0; t < T; t++)
                    sum += p.lse[t] * p.lse[t];
            sm.col[e] = sum;
        }
        if (e < E) {
            p.counts[e] = sm.cnt[e];
            p.dropped[e] = sm.cnt[e] - sm.kept[e];
        }
    }
    __syncthreads();
    write_stats(sm.cnt, sm.col, Er, p.Kr, T, p.stats);
}

/* A: the activation functor (kcu_act.cuh); the decode path uses its fwd_div
 * form (SwiGLU's logistic by __expf and a division, unlike the GEMMs) */
template <int NB, class A>
__global__ void __launch_bounds__(UP_NT, 2) k_dec_up(const __grid_constant__ up_params p)
{
    __shared__ up_smem sm;
    kcu_pdl_wait();
    kcu_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int tid = threadIdx.x;
    const bool route = p.topk_idx != nullptr;
    if (route) {
        dec_route(p, sm);
    } else {
        for (int e = tid; e <= p.E; e += UP_NT)
            sm.off[e] = p.go.v[e];
        __syncthreads();
        if (warp == 0)
            build_active(sm.off, p.E, sm.act_e, sm.act_off, sm.act_n, &sm.na);
        __syncthreads();
    }
    if (p.e_hi > 0) {
        keep_range(p.e_lo, p.e_hi, sm.act_e, sm.act_off, sm.act_n, &sm.na);
        __syncthreads();
    }
    const int na = sm.na, H = p.H, F = p.F;
    const int tpe = p.N1 / 16, tiles = na * tpe, nkb = H / 32;
    /* split of H over KS warps: the fewest waves per unit of work, a small
     * cost per split; the same choice in every CTA */
    int KS = 1;
    {
        float best = 0.f;
        for (int ks = 1; ks <= UP_NW && ks <= nkb; ks *= 2) {
            const int ntask = KCU_CEIL_DIV(tiles * ks, UP_NW);
            const int waves = KCU_CEIL_DIV(ntask, (int)gridDim.x);
            const float cost =
                p.ks_force ? (float)(ks > p.ks_force) : (float)waves * (1.f + 0.03f * ks) / ks;
            if (ks == 1 || cost < best || (p.ks_force && cost == 0.f)) {
                best = cost;
                KS = ks;
            }
        }
    }
    const int tpt = UP_NW / KS, ntask = KCU_CEIL_DIV(tiles, tpt), TP = 8 * NB;
    const int part = warp % KS, kb0 = part * nkb / KS, kb1 = (part + 1) * nkb / KS;
    for (int task = blockIdx.x; task < ntask; task += gridDim.x) {
        const int tl = task * tpt + warp / KS;
        const bool has = tl < tiles;
        int j = 0, e = 0, off = 0, n = 0;
        if (has) {
            const int a = tl / tpe;
            j = tl - a * tpe;
            e = sm.act_e[a];
            off = sm.act_off[a];
            n = sm.act_n[a];
        }
        const int npass = KCU_CEIL_DIV(n, TP);
        int mpass = npass;
        if (KS > 1) { /* CTA-uniform pass count over the task's tiles */
            mpass = 0;
            for (int q = 0; q < tpt; q++) {
                const int tq = task * tpt + q;
                if (tq < tiles)
                    mpass = max(mpass, KCU_CEIL_DIV(sm.act_n[tq / tpe], TP));
            }
        }
        const bf16 *wrow = p.w13 + ((size_t)(e - p.e_lo) * p.N1 + (size_t)j * 16 + g) * H;
        for (int pass = 0; pass < mpass; pass++) {
            float acc[NB][4];
#pragma unroll
            for (int nb = 0; nb < NB; nb++)
                acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
            const int ntok = pass < npass ? min(TP, n - pass * TP) : 0;
            if (ntok > 0) {
                const bf16 *xr[NB];
                bool xv[NB];
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    const int i = nb * 8 + g;
                    xv[nb] = i < ntok;
                    const int row = off + pass * TP + (xv[nb] ? i : 0);
                    const int xrow = route ? sm.perm[row] / p.K : row;
                    xr[nb] = p.x + (size_t)xrow * H;
                }
                warp_rows<NB>(wrow, H, kb0, kb1, xr, xv, ntok, acc);
            }
            bool epi = ntok > 0;
            if (KS > 1) {
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        sm.u.red[warp][nb * 4 + q][lane] = acc[nb][q];
                __syncthreads();
                if (part == 0 && epi) {
                    for (int w = warp + 1; w < warp + KS; w++)
#pragma unroll
                        for (int nb = 0; nb < NB; nb++)
#pragma unroll
                            for (int q = 0; q < 4; q++)
                                acc[nb][q] += sm.u.red[w][nb * 4 + q][lane];
                } else {
                    epi = false;
                }
            }
            if (epi) {
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
#pragma unroll
                    for (int hh = 0; hh < 2; hh++) {
                        const int i = pass * TP + nb * 8 + 2 * c + hh;
                        if (i < n) {
                            bf16 *hr = p.h + (size_t)(off + i) * F;
                            const float a = acc[nb][hh], b = acc[nb][2 + hh];
                            if (A::gated) { /* rows 16j + g: gate (a), up (b) */
                                hr[j * 8 + g] = __float2bfloat16_rn(A::fwd_div(a, b));
                            } else {
                                hr[j * 16 + g] = __float2bfloat16_rn(A::fwd_div(a, 0.f));
                                hr[j * 16 + g + 8] = __float2bfloat16_rn(A::fwd_div(b, 0.f));
                            }
                        }
                    }
            }
            if (KS > 1)
                __syncthreads();
        }
    }
    if (route && blockIdx.x == gridDim.x - 1)
        dec_stats(p, sm);
}

/* ---- 3. down-projection + combine ---- */
/* SH: the combine adds a shared expert's rows held apart (p.srows; layers
 * with E + m > 256 only): its own instantiation, so the others' code is
 * unchanged */
template <int NB, bool SH>
__global__ void __launch_bounds__(DN_NT, 1) k_dec_down(const __grid_constant__ dn_params p)
{
    extern __shared__ float dsm[];
    __shared__ int off[DEC_EMAX + 1], act_e[DEC_EMAX], act_off[DEC_EMAX], act_n[DEC_EMAX], na_s;
    kcu_pdl_wait();
    kcu_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int tid = threadIdx.x;
    for (int e = tid; e <= p.E; e += DN_NT)
        off[e] = p.offs ? p.offs[e] : p.go.v[e];
    __syncthreads();
    if (warp == 0)
        build_active(off, p.E, act_e, act_off, act_n, &na_s);
    __syncthreads();
    if (p.e_hi > 0) {
        keep_range(p.e_lo, p.e_hi, act_e, act_off, act_n, &na_s);
        __syncthreads();
    }
    const int na = na_s, nrows = off[p.E], H = p.H, F = p.F, nkb = F / 32, TP = 8 * NB;
    /* the rows written out: all, or the fan-out's experts' */
    const int r_lo = p.e_hi > 0 ? off[p.e_lo] : 0, r_hi = p.e_hi > 0 ? off[p.e_hi] : nrows;
    int KS = 1;
    {
        float best = 0.f;
        for (int ks = 1; ks <= DN_NW && ks <= nkb; ks *= 2) {
            if (ks > 1 && (size_t)(1 + ks) * nrows * DN_COLS > (size_t)p.smem_floats)
                break;
            const float cost = p.ks_force
                                   ? (float)(ks > p.ks_force)
                                   : (float)KCU_CEIL_DIV(na * ks, DN_NW) * (1.f + 0.03f * ks) / ks;
            if (ks == 1 || cost < best || (p.ks_force && cost == 0.f)) {
                best = cost;
                KS = ks;
            }
        }
    }
    float *ys = dsm, *part = dsm + (size_t)nrows * DN_COLS;
    const int items = na * KS;
    for (int cb = blockIdx.x; cb < H / DN_COLS; cb += gridDim.x) {
        const int n0 = cb * DN_COLS;
        for (int it = warp; it < items; it += DN_NW) {
            const int a = it / KS, pp = it - a * KS;
            const int e = act_e[a], o = act_off[a], n = act_n[a];
            const int kb0 = pp * nkb / KS, kb1 = (pp + 1) * nkb / KS;
            const bf16 *wrow = p.w2 + ((size_t)(e - p.e_lo) * H + n0 + g) * F;
            float *dst = KS > 1 ? part + (size_t)pp * nrows * DN_COLS : ys;
            for (int pass = 0; pass * TP < n; pass++) {
                const int ntok = min(TP, n - pass * TP);
                const bf16 *xr[NB];
                bool xv[NB];
                float acc[NB][4];
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    const int i = nb * 8 + g;
                    xv[nb] = i < ntok;
                    xr[nb] = p.h + (size_t)(o + pass * TP + (xv[nb] ? i : 0)) * F;
                    acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
                }
                warp_rows<NB>(wrow, F, kb0, kb1, xr, xv, ntok, acc);
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
#pragma unroll
                    for (int hh = 0; hh < 2; hh++) {
                        const int i = pass * TP + nb * 8 + 2 * c + hh;
                        if (i < n) {
                            float *d = dst + (size_t)(o + i) * DN_COLS;
                            d[g] = acc[nb][hh];
                            d[g + 8] = acc[nb][2 + hh];
                        }
                    }
            }
        }
        __syncthreads();
        if (KS > 1) {
            for (int i = tid; i < nrows * DN_COLS; i += DN_NT) {
                float v = part[i];
                for (int q = 1; q < KS; q++)
                    v += part[(size_t)q * nrows * DN_COLS + i];
                ys[i] = v;
            }
            __syncthreads();
        }
        if (p.spos) { /* combine in j order, as k_combine */
            for (int i = tid; i < p.T * DN_COLS; i += DN_NT) {
                const int t = i / DN_COLS, cc = i % DN_COLS;
                float acc = 0.f;
                for (int jj = 0; jj < p.K; jj++) {
                    const size_t s = (size_t)t * p.K + jj;
                    const int r = p.spos[s];
                    if (r < 0)
                        continue;
                    const float ye = rbf(ys[r * DN_COLS + cc]);
                    acc += rbf(p.topk_w[s] * ye);
                }
                const size_t oi = (size_t)t * H + n0 + cc;
                if (SH) { /* the shared row, as k_shared_combine (sh_gate) */
                    const float sv = __bfloat162float(p.srows[oi]);
                    if (p.glog) {
                        const float gl = p.glog[(size_t)t * p.ldg];
                        acc += rbf(1.0f / (1.0f + expf(-gl)) * sv);
                    } else {
                        acc += sv;
                    }
                }
                if (p.out_f32)
                    ((float *)p.out)[oi] = acc;
                else
                    ((bf16 *)p.out)[oi] = __float2bfloat16_rn(acc);
            }
        } else { /* rows out (experts object; the fan-out's experts) */
            for (int i = r_lo * DN_COLS + tid; i < r_hi * DN_COLS; i += DN_NT) {
                const int r = i / DN_COLS, cc = i % DN_COLS;
                const size_t oi = (size_t)r * H + n0 + cc;
                if (p.out_f32)
                    ((float *)p.out)[oi] = ys[i];
                else
                    ((bf16 *)p.out)[oi] = __float2bfloat16_rn(ys[i]);
            }
        }
        __syncthreads();
    }
    /* the up kernel ended before kcu_pdl_wait returned: its span is final */
    if (p.span_out && blockIdx.x == 0)
        for (int i = tid; i < p.span_words; i += DN_NT)
            p.span_out[i] = p.span_in[i];
}

/* ---- host side ---- */

int env_int(const char *name, int dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return dflt;
    return atoi(s);
}

/* the most dynamic shared memory a block may take on the current device
 * (cached per device; 227 KB on Hopper, 163 KB on an A100, 99 KB on Ada) */
int smem_optin()
{
    static int cache[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return DN_SMEM_PART;
    }
    if (!cache[dev]) {
        int v = 0;
        if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
                cudaSuccess ||
            v <= 0) {
            (void)cudaGetLastError();
            v = DN_SMEM_PART;
        }
        cache[dev] = v;
    }
    return cache[dev];
}

/* routed slots (layer) or rows (experts) the decode path takes at most here:
 * DEC_SMAX, fewer where the down kernel's ys (DN_COLS floats a row) would
 * not fit the device's shared memory */
int dec_smax()
{
    const int fit = smem_optin() / (DN_COLS * 4);
    return fit < DEC_SMAX ? fit : DEC_SMAX;
}

/* resident CTAs per SM of a kernel (cached per kernel) */
template <typename P> int blocks_per_sm(void (*k)(P), int nt, size_t smem)
{
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, nt, smem) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 1;
    }
    return n < 1 ? 1 : n;
}

int nb_for(int rows)
{
    return rows <= 8 ? 1 : rows <= 16 ? 2 : 4;
}

/* the router grid: ceil(E/16) x token groups of 8 NB tokens, at most
 * RT_CTAS CTAs and what the GPU holds at once (cooperative launch when it
 * routes: grid barrier); *ncta: its CTAs (the column-sum rows it writes) */
template <int NB> moe_err launch_router_t(const rt_params &rp, int nsm, cudaStream_t st, int *ncta)
{
    static int occ = 0;
    if (!occ)
        occ = blocks_per_sm(k_dec_router<NB>, RT_NT, 0);
    const int gx = KCU_CEIL_DIV(rp.rows ? rp.rows : rp.E, 16), cap = min(RT_CTAS, nsm * occ);
    int gy = rp.topk || rp.spread ? KCU_CEIL_DIV(rp.T, 8 * NB) : 1;
    gy = max(1, min(gy, cap / gx));
    *ncta = gx * gy;
    KCU_CHECK(kcu_launch(k_dec_router<NB>, dim3(gx, gy), dim3(RT_NT), 0, st, 1, rp.topk != 0, rp));
    return MOE_OK;
}

moe_err launch_router(const rt_params &rp, int nsm, cudaStream_t st, int *ncta)
{
    const int nb = nb_for(rp.T);
    return nb == 1   ? launch_router_t<1>(rp, nsm, st, ncta)
           : nb == 2 ? launch_router_t<2>(rp, nsm, st, ncta)
                     : launch_router_t<4>(rp, nsm, st, ncta);
}

template <int NB, class A> moe_err launch_up_t(const up_params &up, int nsm, cudaStream_t st)
{
    static int occ = 0;
    if (!occ)
        occ = blocks_per_sm(k_dec_up<NB, A>, UP_NT, 0);
    KCU_CHECK(kcu_launch(k_dec_up<NB, A>, dim3(nsm * occ), dim3(UP_NT), 0, st, 1, 0, up));
    return MOE_OK;
}

moe_err launch_up(const up_params &up, int rows, int nsm, cudaStream_t st)
{
    const int nb = nb_for(rows);
    /* one k_dec_up per (NB, functor) */
    return with_act((kern_act)up.act, [&](auto a) {
        using A = decltype(a);
        return nb == 1   ? launch_up_t<1, A>(up, nsm, st)
               : nb == 2 ? launch_up_t<2, A>(up, nsm, st)
                         : launch_up_t<4, A>(up, nsm, st);
    });
}

template <int NB, bool SH>
moe_err launch_down_t(dn_params &dp, int nrows_max, int nsm, cudaStream_t st)
{
    /* the shared memory limit is a per-device function attribute (one
     * process may drive several GPUs) */
    static int occ[64];
    int dev = 0;
    KCU_CHECK(cudaGetDevice(&dev));
    const int di = dev >= 0 && dev < 64 ? dev : 0;
    if (!occ[di] || dev != di) {
        KCU_CHECK(cudaFuncSetAttribute(k_dec_down<NB, SH>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       smem_optin() < DN_SMEM_MAX ? smem_optin() : DN_SMEM_MAX));
        occ[di] = blocks_per_sm(k_dec_down<NB, SH>, DN_NT, DN_SMEM_PART);
    }
    /* ys + up to 8 partials, within DN_SMEM_PART; past that ys alone (the
     * split of F then stays 1) */
    const size_t ys = (size_t)nrows_max * DN_COLS * 4;
    size_t smem = ys * 9;
    if (smem > DN_SMEM_PART)
        smem = ys > DN_SMEM_PART ? ys : DN_SMEM_PART;
    if (smem > DN_SMEM_MAX || smem > (size_t)smem_optin())
        return MOE_EINVAL; /* not reached: nrows_max <= dec_smax() */
    dp.smem_floats = (int)(smem / 4);
    int grid = dp.H / DN_COLS;
    if (grid > nsm * occ[di])
        grid = nsm * occ[di];
    KCU_CHECK(kcu_launch(k_dec_down<NB, SH>, dim3(grid), dim3(DN_NT), smem, st, 1, 0, dp));
    return MOE_OK;
}

moe_err launch_down(dn_params &dp, int rows, int nrows_max, int nsm, cudaStream_t st)
{
    const int nb = nb_for(rows);
    if (dp.srows) /* a shared expert held apart (family layers) */
        return nb == 1   ? launch_down_t<1, true>(dp, nrows_max, nsm, st)
               : nb == 2 ? launch_down_t<2, true>(dp, nrows_max, nsm, st)
                         : launch_down_t<4, true>(dp, nrows_max, nsm, st);
    return nb == 1   ? launch_down_t<1, false>(dp, nrows_max, nsm, st)
           : nb == 2 ? launch_down_t<2, false>(dp, nrows_max, nsm, st)
                     : launch_down_t<4, false>(dp, nrows_max, nsm, st);
}

int decode_on()
{
    if (kcu_decode_override >= 0)
        return kcu_decode_override;
    static int on = -1;
    if (on < 0)
        on = env_int("KCU_DECODE", 1) != 0;
    return on;
}

/* a non-negative setting from the environment, read once into cache */
int env_setting(int &cache, const char *name, int dflt)
{
    if (cache < 0) {
        cache = env_int(name, dflt);
        if (cache < 0)
            cache = 0;
    }
    return cache;
}

/* layout_small and routing in the up CTAs for at most 32 slots
 * (KCU_DEC_SMALL_LAYOUT, default 1; 0: the general layout, routing in the
 * router) */
int dec_small_layout()
{
    static int small = -1;
    return env_setting(small, "KCU_DEC_SMALL_LAYOUT", 1);
}

int decode_tmax()
{
    static int t = -1;
    return env_setting(t, "KCU_DECODE_TMAX", 64);
}

/* the decode kernels re-read an expert's rows for every 16-row weight tile:
 * past ~8 rows per expert on average the GEMM path streams the weights
 * faster (measured: Mixtral T=64, 16 rows per expert, 83% vs 91% of copy
 * bandwidth; Qwen3 T=64, 4 per expert, 84% vs 79%) */
int decode_rows()
{
    static int r = -1;
    return env_setting(r, "KCU_DECODE_ROWS", 8);
}

} // namespace

int kcu_decode_use(const kcu_layer *l, int T, int train)
{
    const kcu_config *c = &l->c;
    /* E experts and K slots a token in the layout: the routed ones, and a
     * routing family's shared experts held in it (kcu_nexp, kcu_nslot; plain
     * layers: c->E, c->K). Families route with kcu_route_family_topk
     * (decode_forward_family). */
    const int E = kcu_nexp(l), K = kcu_nslot(l);
    if (train || T < 1 || !decode_on())
        return 0;
    /* shared experts in the layout take T rows each: the decode layout caps
     * every expert (the GEMM path the routed ones only), so a capacity that
     * could drop a shared row (cf K < E: cap < T for some T) keeps the
     * general path */
    if (l->r.shared_experts > 0 && c->capacity_factor > 0.0f &&
        (double)c->capacity_factor * c->K < (double)c->E)
        return 0;
    if (kcu_route_family(l)) {
        /* the family router is one kernel more than softmax's: measured on
         * an H100 with DeepSeek-V3 (256 routed, 1 shared held apart, top-8),
         * T=1 0.323 ms against the general path's 0.479, T=64 (2 rows per
         * expert) 4.890 against 4.653: at most one row per expert on
         * average here (between the two measured points) */
        if (kcu_decode_override != 1 && (long long)T * K > (long long)E)
            return 0;
    }
    if (kcu_decode_override != 1 &&
        (T > decode_tmax() || (long long)T * K > (long long)decode_rows() * E))
        return 0;
    return (long long)T * K <= dec_smax() && E <= DEC_EMAX && c->H % 128 == 0 && c->F % 128 == 0;
}

namespace
{

/* the router's parameters for layer l (topk: softmax/top-k in the router) */
rt_params router_params(const kcu_layer *l, int T, const bf16 *xb, int cap, int topk)
{
    rt_params rp;
    memset(&rp, 0, sizeof(rp));
    rp.x = xb;
    rp.wr = l->wr;
    rp.T = T;
    rp.H = l->c.H;
    rp.E = l->c.E;
    rp.Ep = l->Ep;
    rp.K = l->c.K;
    rp.cap = cap;
    rp.renorm = l->c.renorm;
    rp.logits = l->logits;
    rp.probs = l->probs;
    rp.lse = l->lse;
    rp.topk_idx = l->topk_idx;
    rp.topk_w = l->topk_w;
    rp.colpart = l->statpart;
    rp.sync = l->dsync;
    rp.topk = topk;
    return rp;
}

/* the layout's parameters for layer l after the router (nrt CTAs) */
up_params layout_params(const kcu_layer *l, int T, int cap, int nrt)
{
    up_params up;
    memset(&up, 0, sizeof(up));
    up.E = l->c.E;
    up.topk_idx = l->topk_idx;
    up.T = T;
    up.K = l->c.K;
    up.Er = l->c.E;
    up.Kr = l->c.K;
    up.cap = cap;
    up.offs = l->offs;
    up.perm = l->perm;
    up.tok = l->tok;
    up.spos = l->spos;
    up.colpart = l->statpart;
    up.nrt = nrt;
    up.counts = l->counts;
    up.dropped = l->dropped;
    up.stats = l->stats;
    up.small_layout = dec_small_layout();
    return up;
}

} // namespace

int kcu_route_small_use(const kcu_layer *l, int T, int train)
{
    const kcu_config *c = &l->c;
    static int on = -1;
    return !train && !kcu_route_family(l) /* plain softmax top-k only */ &&
           env_setting(on, "KCU_ROUTE_SMALL", 1) && (long long)T * c->K <= DEC_SMAX &&
           c->E <= DEC_EMAX && c->H % 128 == 0;
}

moe_err kcu_route_small(kcu_layer *l, int T, const bf16 *xb, int cap, int *stat_rows,
                        cudaStream_t st)
{
    rt_params rp = router_params(l, T, xb, cap, 1);
    rp.layout = 1;
    rp.offs = l->offs;
    rp.perm = l->perm;
    rp.tok = l->tok;
    rp.spos = l->spos;
    rp.counts = l->counts;
    rp.dropped = l->dropped;
    rp.tile_e = l->tile_e;
    rp.tile_r0 = l->tile_r0;
    rp.ntiles = l->ntiles;
    rp.stats = l->stats;
    int nrt = 0;
    KCU_TRY(launch_router(rp, l->nsm, st, &nrt));
    if (stat_rows)
        *stat_rows = nrt;
    return MOE_OK;
}

namespace
{

/* the decode path of a layer with a routing family (kcu_route_family:
 * sigmoid or softmax scores, a choice bias, groups, a scale, shared
 * experts): the router kernel for the logits alone (row E too: a shared
 * gate's logit), then the GEMM path's family router (kcu_route_family_topk:
 * the same kernel, so the same choices and weights from the same logits;
 * probs (T,E), lse, and Kt = K + m slots a token, the m shared experts E ..
 * E+m-1 held in the layout after the K routed ones), then the up and down
 * kernels over Et = E + m experts and Kt slots, the down kernel's combine
 * summing all Kt slots in order as kcu_combine does. A shared expert held
 * apart (l->sh, E + m > 256) runs first on all T rows (its kcu_experts,
 * itself on the decode path where it qualifies) and the combine adds its
 * rows after the routed slots, gated, as kcu_shared_combine. Counts and
 * drops over the Et experts, the statistics over the E routed ones and K
 * slots from probs and lse. One more kernel than the softmax decode path
 * (the family router, launched without PDL); the softmax path is not
 * touched. */
/* up_ffn: the up kernel's operands every decode forward shares - rows x
 * (bf16), the experts' w13 (E, N1, H), h out (rows, F) by sorted row */
void up_ffn(up_params &up, const bf16 *x, const bf16 *w13, int N1, int H, int F, int act, bf16 *h)
{
    up.x = x;
    up.w13 = w13;
    up.N1 = N1;
    up.H = H;
    up.F = F;
    up.act = act;
    up.h = h;
    up.ks_force = kcu_decode_force_ks;
}

/* dn_ffn: the down kernel's - h (rows, F), w2 (E, H, F), y out in y_dtype;
 * the caller adds the slot map (offs, spos, topk_w, T, K) or the groups */
dn_params dn_ffn(const bf16 *h, const bf16 *w2, int H, int F, int E, void *y, moe_dtype y_dtype)
{
    dn_params dp;
    memset(&dp, 0, sizeof(dp));
    dp.h = h;
    dp.w2 = w2;
    dp.H = H;
    dp.F = F;
    dp.E = E;
    dp.out = y;
    dp.out_f32 = y_dtype == MOE_F32;
    dp.ks_force = kcu_decode_force_ks;
    return dp;
}

/* stats_span_out: where the decode chain's statistics go (kcu_forward_stats
 * reads them): the workspace's span counts .. dropped copied by the down
 * kernel into l->stats_h where the device maps it (KCU_STATS_MAPPED, default
 * 1: no copy and its round trip after the chain; 0 = kcu_forward_stats
 * copies them) */
static void stats_span_out(kcu_layer *l, dn_params *dp)
{
    static int env_on = -1;
    const int on = kcu_stats_mapped_override >= 0 ? kcu_stats_mapped_override
                                                  : kcu_env_flag(&env_on, "KCU_STATS_MAPPED", 1);
    if (!on || kcu_stats_host(l) != MOE_OK || !l->stats_map)
        return;
    dp->span_in = reinterpret_cast<const uint32_t *>(l->counts);
    dp->span_out = reinterpret_cast<uint32_t *>(l->stats_map);
    dp->span_words = (int)(kcu_stats_span(l) / 4);
    l->stats_in_host = 1;
}

moe_err decode_forward_family(kcu_layer *l, int T, const bf16 *xb, int cap, void *y,
                              moe_dtype y_dtype, cudaStream_t st)
{
    const kcu_config *c = &l->c;
    const int H = c->H, F = c->F, E = c->E, Et = kcu_nexp(l), Kt = kcu_nslot(l), S = T * Kt;
    const int gate_row = (l->r.shared_experts > 0 && l->r.shared_gate) || (l->sh && l->sh_gate);
    if (l->sh) { /* ys (T,H) = the shared expert on every row, into sy */
        const int32_t rows = T;
        KCU_TRY(kcu_experts_forward(l->sh, T, xb, MOE_BF16, &rows, l->sy, MOE_BF16, 0, st));
    }
    rt_params rp = router_params(l, T, xb, cap, 0);
    rp.rows = E + gate_row;
    rp.spread = 1; /* no grid barrier: the token passes over the CTAs as with topk */
    int nrt = 0;
    KCU_TRY(launch_router(rp, l->nsm, st, &nrt));
    KCU_TRY(kcu_route_family_topk(l, T, st)); /* kcu_route.cu */

    up_params up = layout_params(l, T, cap, nrt);
    up.E = Et;
    up.K = Kt;
    up.Er = E;
    up.Kr = c->K;
    /* the statistics from probs (T,E) and lse (T), which the family router
     * wrote: dec_stats reads them when colpart is NULL (layout_params
     * leaves both NULL: the softmax path sets them only where the up CTAs
     * route) */
    up.colpart = nullptr;
    up.probs = l->probs;
    up.lse = l->lse;
    up_ffn(up, xb, l->w13, l->N1, H, F, c->act, l->h);
    /* rows per expert at most; shared experts in the layout take T (kcu_decode_use: cap >= T) */
    const int rows = T < cap ? T : cap;
    KCU_TRY(launch_up(up, rows, l->nsm, st));

    dn_params dp = dn_ffn(l->h, l->w2, H, F, Et, y, y_dtype);
    dp.offs = l->offs;
    dp.spos = l->spos;
    dp.topk_w = l->topk_w;
    dp.T = T;
    dp.K = Kt;
    if (l->sh) {
        dp.srows = l->sy;
        dp.glog = l->sh_gate ? l->logits + E : nullptr;
        dp.ldg = l->Ep;
    }
    stats_span_out(l, &dp);
    KCU_TRY(launch_down(dp, rows, S, l->nsm, st));
    kcu_decode_calls++;
    return MOE_OK;
}

} // namespace

/* router_up: the softmax path's first two kernels - the router (at
 * most 32 slots: logits only, the up CTAs route, no grid barrier on the
 * path), then the up projection over w13 (N1 rows per expert) of the
 * experts [e_lo, e_hi) of the layout (e_hi 0: all) into h */
static moe_err router_up(kcu_layer *l, int T, const bf16 *xb, int cap, const bf16 *w13, int N1,
                         bf16 *h, int e_lo, int e_hi, cudaStream_t st)
{
    const kcu_config *c = &l->c;
    const rt_params rp = router_params(l, T, xb, cap, T * c->K > 32 || !dec_small_layout());
    int nrt = 0;
    KCU_TRY(launch_router(rp, l->nsm, st, &nrt));
    up_params up = layout_params(l, T, cap, nrt);
    up_ffn(up, xb, w13, N1, c->H, c->F, c->act, h);
    if (!rp.topk) {
        up.logits = l->logits;
        up.Ep = l->Ep;
        up.renorm = c->renorm;
        up.probs = l->probs;
        up.lse = l->lse;
        up.topk_w = l->topk_w;
    }
    up.e_lo = e_lo;
    up.e_hi = e_hi;
    return launch_up(up, T < cap ? T : cap, l->nsm, st); /* rows per expert at most */
}

moe_err kcu_decode_forward(kcu_layer *l, int T, const bf16 *xb, int cap, void *y, moe_dtype y_dtype,
                           cudaStream_t st)
{
    if (kcu_route_family(l)) /* a host branch: the softmax path below is unchanged */
        return decode_forward_family(l, T, xb, cap, y, y_dtype, st);
    const kcu_config *c = &l->c;
    const int H = c->H, F = c->F, E = c->E, K = c->K, S = T * K;
    KCU_TRY(router_up(l, T, xb, cap, l->w13, l->N1, l->h, 0, 0, st));
    const int rows = T < cap ? T : cap; /* rows per expert at most */
    dn_params dp = dn_ffn(l->h, l->w2, H, F, E, y, y_dtype);
    dp.offs = l->offs;
    dp.spos = l->spos;
    dp.topk_w = l->topk_w;
    dp.T = T;
    dp.K = K;
    stats_span_out(l, &dp);
    KCU_TRY(launch_down(dp, rows, S, l->nsm, st));
    kcu_decode_calls++;
    return MOE_OK;
}

int kcu_decode_use_experts(const kcu_experts *x, int N, const int32_t *counts, int keep)
{
    if (keep || N < 1 || N > dec_smax() || x->ne > DEC_EMAX || !decode_on())
        return 0;
    if (kcu_decode_override == 1)
        return 1;
    int mx = 0;
    for (int e = 0; e < x->ne; e++)
        mx = counts[e] > mx ? counts[e] : mx;
    return mx <= decode_tmax() && N <= (long long)decode_rows() * x->ne;
}

moe_err kcu_decode_experts_forward(kcu_experts *x, int N, const bf16 *xb, const int32_t *counts,
                                   void *y, moe_dtype y_dtype, cudaStream_t st)
{
    up_params up;
    memset(&up, 0, sizeof(up));
    int mx = 0;
    up.go.v[0] = 0;
    for (int e = 0; e < x->ne; e++) {
        up.go.v[e + 1] = up.go.v[e] + counts[e];
        mx = counts[e] > mx ? counts[e] : mx;
    }
    up_ffn(up, xb, x->w13, x->N1, x->H, x->F, x->act, x->h);
    up.E = x->ne;
    KCU_TRY(launch_up(up, mx, x->nsm, st));

    dn_params dp = dn_ffn(x->h, x->w2, x->H, x->F, x->ne, y, y_dtype);
    dp.go = up.go;
    KCU_TRY(launch_down(dp, mx, N, x->nsm, st));
    kcu_decode_calls++;
    return MOE_OK;
}

int kcu_decode_local_use(const kcu_layer *l, int T)
{
    return !kcu_route_family(l) && l->c.capacity_factor <= 0.0f && kcu_decode_use(l, T, 0);
}

moe_err kcu_decode_local(kcu_layer *l, const kcu_experts *x, int e_lo, int T, const bf16 *xb,
                         bf16 *h, void *rows, cudaStream_t st)
{
    const kcu_config *c = &l->c;
    const int H = c->H, F = c->F, E = c->E, S = T * c->K;
    if (x->H != H || x->F != F || e_lo < 0 || e_lo + x->ne > E)
        return MOE_EINVAL;
    /* as kcu_decode_forward, dropless, over x's experts only */
    KCU_TRY(router_up(l, T, xb, INT_MAX, x->w13, x->N1, h, e_lo, e_lo + x->ne, st));
    dn_params dp = dn_ffn(h, x->w2, H, F, E, rows, MOE_BF16);
    dp.offs = l->offs; /* written by the up kernel's last CTA; no spos: rows out */
    dp.e_lo = e_lo;
    dp.e_hi = e_lo + x->ne;
    KCU_TRY(launch_down(dp, T, S, l->nsm, st));
    kcu_decode_calls++;
    return MOE_OK;
}
