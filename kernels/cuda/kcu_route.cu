/*
 * kcu_route.cu - the small kernels around the expert GEMMs: bf16 staging,
 * softmax + top-k, the device-built layout (counting sort and tile list),
 * the deterministic combine, loss statistics, and the router backward.
 * None of them needs a host round trip.
 */
#include <float.h>
#include <limits.h>
#include <string.h>

#include "kernels/cuda/kcu_internal.cuh"
#include "kernels/cuda/kcu_topk.cuh"

namespace
{

constexpr int CHUNK = 256; /* slots per block in the layout kernels */

/* x (n) f32 -> bf16 (round to nearest even) */
__global__ void k_f32_to_bf16(const float *__restrict__ x, bf16 *__restrict__ y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(x[i]);
}

using kcu_topk::warp_sum;

/* One warp per token. logits (T,Ep) in; probs (T,E), lse (T), idx (T,K),
 * tw (T,K) out. E <= 256, K <= 8. Ties go to the lower expert index. */
__global__ void k_softmax_topk(const float *__restrict__ logits, int T, int E, int Ep, int K,
                               int renorm, float *__restrict__ probs, float *__restrict__ lse,
                               int32_t *__restrict__ idx, float *__restrict__ tw)
{
    kcu_pdl_wait(); /* launched with PDL (kcu_route_pdl) */
    kcu_pdl_trigger();
    const int lane = threadIdx.x & 31, t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T)
        return;
    float v[8], lse_t, wk[8], wsum;
    int ik[8];
    kcu_topk::softmax_topk(logits + (size_t)t * Ep, E, K, v, lse_t, ik, wk, wsum);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        if (e < E)
            probs[(size_t)t * E + e] = v[i];
    }
    if (lane == 0)
        lse[t] = lse_t;
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < K) {
                idx[(size_t)t * K + j] = ik[j];
                tw[(size_t)t * K + j] = renorm ? wk[j] / wsum : wk[j];
            }
    }
}

/* the family router's parameters (kcu_route_config, resolved) */
struct route_fam {
    int sigmoid;    /* scores: sigmoid per expert, else softmax over E */
    int n_group;    /* > 1: groups of E / n_group experts */
    int topk_group; /* groups kept (< n_group: else no group selection) */
    int topn;       /* 1 or 2: a group's score sums its topn largest choices */
    int renorm;
    float scale; /* 1 = none */
    int m;       /* shared experts: slots K .. K+m-1 of a token */
    int gate;    /* shared slots weighted by sigmoid(logits[t, E]) (router row E = wsg) */
};

constexpr int FAM_WARPS = 8; /* tokens per block of k_route_family */

/* k_route_family: kern_route_cpu on the device, one warp per token, 8
 * warps per block. logits (T,Ep) in (column E: the shared gate's logit when
 * f.gate); bias (E) or NULL; probs (T,E) out: the scores s; lse (T) out:
 * logsumexp of the logits (for the z-loss, whatever the scoring); idx,
 * tw (T,Kt) out, Kt = K + f.m: the K routed experts in choice order then
 * the shared experts E .. E+m-1. E <= 256, K <= 8, n_group <= 64.
 * The CPU's operations are repeated in its order where they decide or
 * weigh (choice c = s + bias; group scores best1 + best2 in expert order;
 * wsum in choice order; / den then * scale), so that equal scores give
 * equal choices and weights; the selections follow its tie rules (lower
 * group, lower expert) through a strict total order. */
__global__ void __launch_bounds__(FAM_WARPS * 32)
    k_route_family(const float *__restrict__ logits, int T, int E, int Ep, int K, route_fam f,
                   const float *__restrict__ bias, float *__restrict__ probs,
                   float *__restrict__ lse, int32_t *__restrict__ idx, float *__restrict__ tw)
{
    __shared__ float s_sc[FAM_WARPS][256];            /* scores s of the warp's token */
    __shared__ float s_ch[FAM_WARPS][256];            /* choice values c */
    __shared__ float s_gs[FAM_WARPS][KCU_MAX_GROUPS]; /* group scores */
    __shared__ int s_keep[FAM_WARPS][KCU_MAX_GROUPS]; /* group kept */
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int t = blockIdx.x * FAM_WARPS + wid;
    if (t >= T) /* whole warps leave: only __syncwarp below */
        return;
    const float *lt = logits + (size_t)t * Ep; /* (E) used, (Ep) row */
    float *sc = s_sc[wid], *ch = s_ch[wid];

    /* scores; the softmax is also what gives lse */
    float v[8], lse_t;
    kcu_topk::softmax_slots<8>(lt, E, v, lse_t);
    float c[8]; /* choice values of experts lane + 32 i (-inf past E) */
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        c[i] = -INFINITY;
        if (e < E) {
            const float sv = f.sigmoid ? 1.0f / (1.0f + expf(-lt[e])) : v[i];
            sc[e] = sv;
            probs[(size_t)t * E + e] = sv;
            c[i] = sv + (bias ? bias[e] : 0.0f);
            ch[e] = c[i];
        }
    }
    if (lane == 0)
        lse[t] = lse_t;
    __syncwarp();

    /* groups: scores, then the topk_group first in (score desc, group asc)
     * order: group g is kept when fewer than topk_group groups come before
     * it (the CPU's repeated arg-max picks the same set) */
    if (f.n_group > 1 && f.topk_group < f.n_group) {
        const int ng = f.n_group, gs = E / ng;
        for (int g = lane; g < ng; g += 32) {
            const float *cg = ch + g * gs;
            float b1 = cg[0], b2 = -INFINITY; /* the two largest, b1 >= b2 */
            for (int i = 1; i < gs; i++) {
                if (cg[i] > b1) {
                    b2 = b1;
                    b1 = cg[i];
                } else if (cg[i] > b2) {
                    b2 = cg[i];
                }
            }
            s_gs[wid][g] = f.topn >= 2 && gs >= 2 ? b1 + b2 : b1;
        }
        __syncwarp();
        for (int g = lane; g < ng; g += 32) {
            const float mine = s_gs[wid][g];
            int rank = 0;
            for (int h = 0; h < ng; h++) {
                const float o = s_gs[wid][h];
                rank += o > mine || (o == mine && h < g);
            }
            s_keep[wid][g] = rank < f.topk_group;
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int e = lane + 32 * i;
            if (e < E && !s_keep[wid][e / gs])
                c[i] = -INFINITY;
        }
    }

    /* top-K by repeated warp arg-max over the choice values: the largest c
     * not taken, ties (and -inf) to the lower expert, as the CPU's strict >
     * over ascending e (kcu_topk::argmax_take, the plain router's too) */
    unsigned taken = 0;
    float wk[8], wsum = 0.0f;
    int ik[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        wk[j] = 0.0f;
        ik[j] = 0;
        if (j < K) {
            float bv;
            int bi;
            kcu_topk::argmax_take<8>(c, E, lane, -INFINITY, taken, bv, bi);
            ik[j] = bi;
            wk[j] = sc[bi]; /* the weight is the score, never the bias */
            wsum += wk[j];
        }
    }
    if (lane == 0) {
        const int Kt = K + f.m;
        const float den = f.sigmoid ? wsum + 1e-20f : wsum;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < K) {
                float w = f.renorm ? wk[j] / den : wk[j];
                if (f.scale != 1.0f)
                    w *= f.scale;
                idx[(size_t)t * Kt + j] = ik[j];
                tw[(size_t)t * Kt + j] = w;
            }
        const float g = f.gate ? 1.0f / (1.0f + expf(-lt[E])) : 1.0f;
        for (int j = 0; j < f.m; j++) {
            idx[(size_t)t * Kt + K + j] = E + j;
            tw[(size_t)t * Kt + K + j] = g;
        }
    }
}

/* chunk (nch,E) out: slots of expert e in chunk c. idx (S). */
__global__ void k_layout_count(const int32_t *__restrict__ idx, int S, int E,
                               int32_t *__restrict__ chunk)
{
    __shared__ int hist[256];
    kcu_pdl_wait(); /* launched with PDL (kcu_route_pdl) */
    kcu_pdl_trigger();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        hist[e] = 0;
    __syncthreads();
    const int s = blockIdx.x * CHUNK + threadIdx.x;
    if (s < S)
        atomicAdd(&hist[idx[s]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        chunk[(size_t)blockIdx.x * E + e] = hist[e];
}

/* One block. chunk (nch,E) in: counts; out: each chunk's rank base within
 * its expert (stable order). counts (E) out (before the capacity), dropped
 * (E) out (may be NULL), offs (E+1) out over the kept rows (min(count, cap)
 * per expert e < ncap: the routed experts; the shared ones after them are
 * never capped); tile list (tile_e, tile_r0, *ntiles) out: ceil(kept_e /
 * BM) tiles per expert; pairs: an expert's tiles two by two from the front
 * of the list (every pair 2q, 2q+1 of one expert: v7's clusters then
 * multicast its weight tile, read once), the odd ones' last tiles after
 * them in expert order; else each expert's tiles in turn. */
__global__ void k_layout_scan(int32_t *__restrict__ chunk, int nch, int E, int cap, int ncap,
                              int32_t *__restrict__ counts, int32_t *__restrict__ dropped,
                              int32_t *__restrict__ offs, int32_t *__restrict__ tile_e,
                              int32_t *__restrict__ tile_r0, int32_t *__restrict__ ntiles,
                              int pairs)
{
    __shared__ int kc[257], base[257], toff[257], soff[257];
    kcu_pdl_wait(); /* launched with PDL (kcu_route_pdl) */
    kcu_pdl_trigger();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        /* 16 counts loaded before any is rewritten: the loads in flight
         * together instead of one round trip per chunk (20 us at 64 chunks) */
        int run = 0;
        for (int c0 = 0; c0 < nch; c0 += 16) {
            int v[16];
#pragma unroll
            for (int j = 0; j < 16; j++)
                v[j] = c0 + j < nch ? chunk[(size_t)(c0 + j) * E + e] : 0;
#pragma unroll
            for (int j = 0; j < 16; j++)
                if (c0 + j < nch) {
                    chunk[(size_t)(c0 + j) * E + e] = run;
                    run += v[j];
                }
        }
        counts[e] = run;
        const int ce = e < ncap ? cap : INT_MAX;
        const int k = run < ce ? run : ce;
        kc[e] = k;
        if (dropped)
            dropped[e] = run - k;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        /* toff[e]: e's first tile (its even part with pairs); soff[e]: the
         * slot of its odd last tile with pairs (after every pair) */
        int o = 0, to = 0, so = 0;
        for (int e = 0; e < E; e++) {
            const int nt = KCU_CEIL_DIV(kc[e], KCU_BM);
            offs[e] = o;
            base[e] = o;
            toff[e] = to;
            soff[e] = so;
            o += kc[e];
            to += pairs ? nt & ~1 : nt;
            so += pairs ? nt & 1 : 0;
        }
        offs[E] = o;
        toff[E] = to;
        soff[E] = so;
        *ntiles = to + so;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        for (int i = toff[e]; i < toff[e + 1]; i++) {
            tile_e[i] = e;
            tile_r0[i] = base[e] + (i - toff[e]) * KCU_BM;
        }
        if (soff[e + 1] > soff[e]) { /* pairs: the odd last tile */
            const int i = toff[E] + soff[e];
            tile_e[i] = e;
            tile_r0[i] = base[e] + (toff[e + 1] - toff[e]) * KCU_BM;
        }
    }
}

/* Stable scatter of the kept slots: perm (S_kept) sorted row -> slot, tok
 * sorted row -> token (K slots per token), spos (S) slot -> sorted row or -1
 * (dropped: its rank within an expert e < ncap is >= cap). */
__global__ void k_layout_scatter(const int32_t *__restrict__ idx, int S, int E, int K, int cap,
                                 int ncap, const int32_t *__restrict__ chunk,
                                 const int32_t *__restrict__ offs, int32_t *__restrict__ perm,
                                 int32_t *__restrict__ tok, int32_t *__restrict__ spos)
{
    __shared__ int ids[CHUNK];
    kcu_pdl_wait(); /* launched with PDL (kcu_route_pdl) */
    kcu_pdl_trigger();
    const int s = blockIdx.x * CHUNK + threadIdx.x;
    ids[threadIdx.x] = s < S ? idx[s] : -1;
    __syncthreads();
    if (s >= S)
        return;
    const int e = ids[threadIdx.x];
    int rank = 0;
    for (int j = 0; j < (int)threadIdx.x; j++)
        rank += ids[j] == e;
    rank += chunk[(size_t)blockIdx.x * E + e];
    if (rank < cap || e >= ncap) {
        const int pos = offs[e] + rank;
        perm[pos] = s;
        tok[pos] = s / K;
        spos[s] = pos;
    } else {
        spos[s] = -1;
    }
}

/* out (T,H) = sum_j in order of [w ? bf16(w[s] ye[s]) : ye[s]] (+ extra (T,H) f32),
 * over the kept slots (spos NULL or spos[s] >= 0). ye (S,H) bf16 in slot
 * order. One thread per 8 columns. BATCH (kcu_combine: K >= 8): the slots'
 * rows loaded 8 at a time before any is added (8 loads in flight, where the
 * loop had one round trip per slot: Qwen3's combine at half the copy
 * bandwidth), then added in j order as before, the same bits; not for
 * fewer slots (Mixtral's K = 2 with it: 0.09 -> 0.12 ms on H200, one run;
 * more registers for the same two loads a thread, a likely cause). */
template <bool BATCH>
__global__ void k_combine(const bf16 *__restrict__ ye, const float *__restrict__ w,
                          const float *__restrict__ extra, const int32_t *__restrict__ spos, int T,
                          int K, int H, void *out, int out_f32)
{
    kcu_pdl_wait(); /* launched with PDL */
    kcu_pdl_trigger();
    const int hc = H / 8;
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * hc)
        return;
    const int t = (int)(i / hc), c = (int)(i % hc) * 8;
    float acc[8];
    if (extra) {
        const float4 *ex = reinterpret_cast<const float4 *>(extra + (size_t)t * H + c);
        const float4 a = ex[0], b = ex[1];
        acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w;
        acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++)
            acc[k] = 0.f;
    }
    if (BATCH) {
        for (int j0 = 0; j0 < K; j0 += 8) {
            uint4 raw[8];
            int kept[8];
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const size_t s = (size_t)t * K + j0 + q;
                kept[q] = j0 + q < K && !(spos && spos[s] < 0);
                raw[q] = kept[q] ? __ldg(reinterpret_cast<const uint4 *>(ye + s * H + c))
                                 : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int q = 0; q < 8; q++)
                if (kept[q])
                    kcu_combine_add(acc, raw[q], w != nullptr, w ? w[(size_t)t * K + j0 + q] : 1.f);
        }
    } else { /* the loop as it was before BATCH (the same PTX) */
        for (int j = 0; j < K; j++) {
            const size_t s = (size_t)t * K + j;
            if (spos && spos[s] < 0)
                continue;
            const uint4 raw = *reinterpret_cast<const uint4 *>(ye + s * H + c);
            kcu_combine_add(acc, raw, w != nullptr, w ? w[s] : 1.f);
        }
    }
    if (out_f32) {
        float4 *o = reinterpret_cast<float4 *>((float *)out + (size_t)t * H + c);
        o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
        uint4 raw;
        __nv_bfloat162 *v = reinterpret_cast<__nv_bfloat162 *>(&raw);
#pragma unroll
        for (int k = 0; k < 4; k++)
            v[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
        *reinterpret_cast<uint4 *>((bf16 *)out + (size_t)t * H + c) = raw;
    }
}

/* sorted rows: dst[r] (S,H) bf16 = src[tok[r]] for r < *nrows (src (T,H) f32
 * when src_f32, else bf16). One warp per row, 8 columns per lane and step;
 * rows >= *nrows are left as they are (no GEMM stores their outputs). */
__global__ void k_gather_rows(const void *__restrict__ src, int src_f32,
                              const int32_t *__restrict__ tok, const int32_t *__restrict__ nrows,
                              int S, int H, bf16 *__restrict__ dst)
{
    kcu_pdl_wait(); /* launched with PDL */
    kcu_pdl_trigger();
    const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    const int n = min(*nrows, S);
    for (int r = blockIdx.x * wpb + (threadIdx.x >> 5); r < n; r += gridDim.x * wpb) {
        const size_t t = (size_t)tok[r];
        uint4 *d = reinterpret_cast<uint4 *>(dst + (size_t)r * H);
        if (src_f32) {
            const float4 *s = reinterpret_cast<const float4 *>((const float *)src + t * H);
            for (int i = lane; i < H / 8; i += 32) {
                const float4 a = s[2 * i], b = s[2 * i + 1];
                uint4 raw;
                __nv_bfloat162 *v = reinterpret_cast<__nv_bfloat162 *>(&raw);
                v[0] = __floats2bfloat162_rn(a.x, a.y);
                v[1] = __floats2bfloat162_rn(a.z, a.w);
                v[2] = __floats2bfloat162_rn(b.x, b.y);
                v[3] = __floats2bfloat162_rn(b.z, b.w);
                d[i] = raw;
            }
        } else {
            const uint4 *s = reinterpret_cast<const uint4 *>((const bf16 *)src + t * H);
            for (int i = lane; i < H / 8; i += 32)
                d[i] = s[i];
        }
    }
}

/* part (nblk, E+1): per 256-token block, column sums of probs and sum lse^2. */
__global__ void k_stats_part(const float *__restrict__ probs, const float *__restrict__ lse, int T,
                             int E, float *__restrict__ part)
{
    kcu_pdl_wait(); /* launched with PDL (kcu_route_pdl) */
    kcu_pdl_trigger();
    const int t0 = blockIdx.x * 256, t1 = min(T, t0 + 256);
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        float s = 0.f;
        if (e < E)
            for (int t = t0; t < t1; t++)
                s += probs[(size_t)t * E + e];
        else
            for (int t = t0; t < t1; t++)
                s += lse[t] * lse[t];
        part[(size_t)blockIdx.x * (E + 1) + e] = s;
    }
}

/* One block: stats[0] = aux = E/(K T) sum_e counts_e mean_t p[t,e];
 * stats[1] = z = mean_t lse_t^2. */
__global__ void k_stats_final(const float *__restrict__ part, int nblk, int T, int E, int K,
                              const int32_t *__restrict__ counts, float *__restrict__ stats)
{
    kcu_pdl_wait(); /* launched with PDL (kcu_route_pdl) */
    kcu_pdl_trigger();
    /* mean[e] = col_e / T and cnt[e] = counts_e as floats, each by its own
     * thread: thread 0's sum below is then one fma a term (the divisions off
     * its chain; the same operations, so the same bits) */
    __shared__ float mean[257], cnt[256];
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        float s = 0.f;
        for (int b = 0; b < nblk; b++)
            s += part[(size_t)b * (E + 1) + e];
        mean[e] = s / (float)T;
        if (e < E)
            cnt[e] = (float)counts[e];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float aux = 0.f;
        for (int e = 0; e < E; e++)
            aux = fmaf(mean[e], cnt[e], aux);
        stats[0] = aux * (float)E / ((float)K * (float)T);
        stats[1] = mean[E];
    }
}

/* dw[perm[r]] = sum_i dwpart[r, i] over the kept rows r < *nrows: fixed
 * order, deterministic. */
__global__ void k_dw_reduce(const float *__restrict__ part, const int32_t *__restrict__ perm, int S,
                            const int32_t *__restrict__ nrows, int nt, float *__restrict__ dw)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= S || r >= *nrows)
        return;
    float s = 0.f;
    for (int i = 0; i < nt; i++)
        s += part[(size_t)r * nt + i];
    dw[perm[r]] = s;
}

/* One warp per token: dlogits (T,Ep) bf16 out (zero beyond E), as
 * kern_route_backward_cpu before its GEMMs. idx, dw (T,Kt): the K routed
 * slots first (Kt = K without shared experts). sigmoid: the scores are
 * sigmoid(logits) (d s / d l = s (1 - s); the z-loss term then needs the
 * softmax of the logits (T,Ep), from lse); scale: the routed weights'
 * factor (1 = none). m shared slots after the routed ones with gate (their
 * weight tw is sigmoid(logit E)): dlogits[t, E] = g (1 - g) sum_j dw[t,
 * K+j] (the gate's logit is router row E). */
__global__ void k_router_bwd(const float *__restrict__ probs, const float *__restrict__ lse,
                             const int32_t *__restrict__ idx, const float *__restrict__ dw, int T,
                             int E, int Ep, int K, int Kt, int renorm, int sigmoid, float scale,
                             int m, int gate, const float *__restrict__ logits,
                             const float *__restrict__ tw, const int32_t *__restrict__ cglob,
                             float aux_scale, float z_scale, bf16 *__restrict__ dlog)
{
    const int lane = threadIdx.x & 31, t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T)
        return;
    const float *pt = probs + (size_t)t * E;
    const int32_t *it = idx + (size_t)t * Kt;
    const float *gt = dw + (size_t)t * Kt;
    float S = 0.f, gw = 0.f;
    if (renorm) {
        for (int j = 0; j < K; j++)
            S += pt[it[j]];
        if (sigmoid)
            S += 1e-20f;
        for (int j = 0; j < K; j++)
            gw += gt[j] * (pt[it[j]] / S);
    }
    float d[8], p[8], pdp = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        d[i] = 0.f;
        p[i] = 0.f;
        if (e < E) {
            p[i] = pt[e];
            float dd = aux_scale * (float)cglob[e];
            for (int j = 0; j < K; j++)
                if (it[j] == e) {
                    const float g = renorm ? (gt[j] - gw) / S : gt[j];
                    dd += scale != 1.f ? scale * g : g;
                }
            d[i] = dd;
            pdp += p[i] * dd;
        }
    }
    pdp = warp_sum(pdp);
    const float zl = z_scale * lse[t];
    const float *lt = logits + (size_t)t * Ep;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = lane + 32 * i;
        if (e < Ep) {
            float v = 0.f;
            if (e < E) {
                if (sigmoid) /* z-loss: softmax of the logits = exp(l - lse) */
                    v = d[i] * p[i] * (1.f - p[i]) +
                        (zl != 0.f ? zl * expf(__ldg(lt + e) - lse[t]) : 0.f);
                else
                    v = p[i] * (d[i] - pdp) + zl * p[i];
            }
            dlog[(size_t)t * Ep + e] = __float2bfloat16_rn(v);
        }
    }
    for (int e = 256 + lane; e < Ep; e += 32)
        dlog[(size_t)t * Ep + e] = __float2bfloat16_rn(0.f);
    __syncwarp();
    if (gate && lane == 0) { /* the shared gate's logit (column E < Ep) */
        const float g = tw[(size_t)t * Kt + K];
        float dg = 0.f;
        for (int j = 0; j < m; j++)
            dg += gt[K + j];
        dlog[(size_t)t * Ep + E] = __float2bfloat16_rn(g * (1.f - g) * dg);
    }
}

/* AdamW as kern_adamw_cpu, rounded op by op (no contraction), and the bf16
 * compute copy refreshed. n % 4 == 0. */
__global__ void k_adamw(float4 *__restrict__ p, const float4 *__restrict__ g,
                        float4 *__restrict__ m, float4 *__restrict__ v, uint2 *__restrict__ w,
                        size_t n4, float lr, float b1, float b2, float eps, float wd, float bc1,
                        float bc2, float gs)
{
    const float c1 = 1.0f - b1, c2 = 1.0f - b2;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4;
         i += (size_t)gridDim.x * blockDim.x) {
        float4 pp = p[i], gg = g[i], mm = m[i], vv = v[i];
        float *pe = &pp.x, *ge = &gg.x, *me = &mm.x, *ve = &vv.x;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float gi = __fmul_rn(ge[k], gs);
            const float mi = __fadd_rn(__fmul_rn(b1, me[k]), __fmul_rn(c1, gi));
            const float vi = __fadd_rn(__fmul_rn(b2, ve[k]), __fmul_rn(__fmul_rn(c2, gi), gi));
            me[k] = mi;
            ve[k] = vi;
            const float mh = __fdiv_rn(mi, bc1), vh = __fdiv_rn(vi, bc2);
            const float u =
                __fadd_rn(__fdiv_rn(mh, __fadd_rn(__fsqrt_rn(vh), eps)), __fmul_rn(wd, pe[k]));
            pe[k] = __fsub_rn(pe[k], __fmul_rn(lr, u));
        }
        p[i] = pp;
        m[i] = mm;
        v[i] = vv;
        uint2 o;
        __nv_bfloat162 lo = __floats2bfloat162_rn(pp.x, pp.y),
                       hi = __floats2bfloat162_rn(pp.z, pp.w);
        memcpy(&o.x, &lo, 4);
        memcpy(&o.y, &hi, 4);
        w[i] = o;
    }
}

/* part[b] = sum of g^2 over a fixed strided share, in double; fixed tree */
__global__ void k_sumsq(const float *__restrict__ g, size_t n, double *__restrict__ part)
{
    __shared__ double red[256];
    double s = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        s += (double)g[i] * (double)g[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (int o = 128; o; o >>= 1) {
        if ((int)threadIdx.x < o)
            red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        part[blockIdx.x] = red[0];
}
__global__ void k_sumsq_final(double *part, int nb)
{
    double s = 0.0;
    for (int b = 0; b < nb; b++)
        s += part[b];
    part[nb] = s;
}

} // namespace

moe_err kcu_to_bf16(const void *src, moe_dtype dt, bf16 *dst, size_t n, cudaStream_t st)
{
    if (dt == MOE_BF16) {
        KCU_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(bf16), cudaMemcpyDefault, st));
        return MOE_OK;
    }
    if (dt != MOE_F32)
        return MOE_EINVAL;
    if (n == 0)
        return MOE_OK;
    const size_t blocks = KCU_CEIL_DIV(n, (size_t)256);
    k_f32_to_bf16<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, st>>>((const float *)src,
                                                                             dst, n);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_route_family_topk(kcu_layer *l, int T, cudaStream_t st)
{
    const kcu_config *c = &l->c;
    const kcu_route_config *r = &l->r;
    route_fam f;
    f.sigmoid = r->scoring == KERN_SCORE_SIGMOID;
    f.n_group = r->n_group > 1 ? r->n_group : 1;
    f.topk_group = r->topk_group > 0 && r->topk_group < f.n_group ? r->topk_group : f.n_group;
    f.topn = r->group_topn > 0 ? r->group_topn : 2;
    f.renorm = c->renorm;
    f.scale = r->route_scale != 0.0f ? r->route_scale : 1.0f;
    f.m = r->shared_experts;
    f.gate = r->shared_experts > 0 && r->shared_gate;
    k_route_family<<<KCU_CEIL_DIV(T, FAM_WARPS), FAM_WARPS * 32, 0, st>>>(
        l->logits, T, c->E, l->Ep, c->K, f, l->has_bias ? l->bias : nullptr, l->probs, l->lse,
        l->topk_idx, l->topk_w);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_route(kcu_layer *l, int T, int cap, int pairs, cudaStream_t st)
{
    const kcu_config *c = &l->c;
    /* E routed experts of K slots, Et experts held of Kt slots per token */
    const int E = c->E, K = c->K, Et = kcu_nexp(l), Kt = kcu_nslot(l);
    const int S = T * Kt, nch = KCU_CEIL_DIV(S, CHUNK);
    const int pdl = kcu_route_pdl();
    if (kcu_route_family(l)) {
        KCU_TRY(kcu_route_family_topk(l, T, st));
    } else {
        KCU_CHECK(kcu_launch(k_softmax_topk, dim3(KCU_CEIL_DIV(T, 8)), dim3(256), 0, st, pdl, 0,
                             l->logits, T, E, l->Ep, K, c->renorm, l->probs, l->lse, l->topk_idx,
                             l->topk_w));
    }
    KCU_CHECK(kcu_launch(k_layout_count, dim3(nch), dim3(CHUNK), 0, st, pdl, 0, l->topk_idx, S, Et,
                         l->chunk));
    KCU_CHECK(kcu_launch(k_layout_scan, dim3(1), dim3(256), 0, st, pdl, 0, l->chunk, nch, Et, cap,
                         E, l->counts, l->dropped, l->offs, l->tile_e, l->tile_r0, l->ntiles,
                         pairs));
    KCU_CHECK(kcu_launch(k_layout_scatter, dim3(nch), dim3(CHUNK), 0, st, pdl, 0, l->topk_idx, S,
                         Et, Kt, cap, E, l->chunk, l->offs, l->perm, l->tok, l->spos));
    return MOE_OK;
}

moe_err kcu_tiles_from_counts(int32_t *cnt, int E, int32_t *counts, int32_t *offs, int32_t *tile_e,
                              int32_t *tile_r0, int32_t *ntiles, cudaStream_t st)
{
    k_layout_scan<<<1, 256, 0, st>>>(cnt, 1, E, INT_MAX, E, counts, nullptr, offs, tile_e, tile_r0,
                                     ntiles, 0);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_combine(const bf16 *ye, const float *w, const float *extra, const int32_t *spos, int T,
                    int K, int H, void *out, moe_dtype dt, int pdl, cudaStream_t st)
{
    const size_t n = (size_t)T * (H / 8);
    if (n == 0)
        return MOE_OK;
    const dim3 grid((unsigned)KCU_CEIL_DIV(n, (size_t)256));
    if (K >= 8)
        KCU_CHECK(kcu_launch(k_combine<true>, grid, dim3(256), 0, st, pdl, 0, ye, w, extra, spos, T,
                             K, H, out, (int)(dt == MOE_F32)));
    else
        KCU_CHECK(kcu_launch(k_combine<false>, grid, dim3(256), 0, st, pdl, 0, ye, w, extra, spos,
                             T, K, H, out, (int)(dt == MOE_F32)));
    return MOE_OK;
}

moe_err kcu_gather_rows(const void *src, moe_dtype dt, const int32_t *tok, const int32_t *nrows,
                        int S, int H, bf16 *dst, int pdl, cudaStream_t st)
{
    if (dt != MOE_F32 && dt != MOE_BF16)
        return MOE_EINVAL;
    if (S <= 0)
        return MOE_OK;
    const int need = KCU_CEIL_DIV(S, 8), blocks = need < 8192 ? need : 8192;
    KCU_CHECK(kcu_launch(k_gather_rows, dim3(blocks), dim3(256), 0, st, pdl, 0, src,
                         (int)(dt == MOE_F32), tok, nrows, S, H, dst));
    return MOE_OK;
}

moe_err kcu_adamw(float *p, const float *g, float *m, float *v, bf16 *w, size_t n, float lr,
                  float b1, float b2, float eps, float wd, float bc1, float bc2, float gscale,
                  cudaStream_t st)
{
    if (n % 4)
        return MOE_EINVAL;
    const size_t n4 = n / 4;
    if (n4 == 0)
        return MOE_OK;
    const size_t blocks = KCU_CEIL_DIV(n4, (size_t)256);
    k_adamw<<<(unsigned)(blocks < 8192 ? blocks : 8192), 256, 0, st>>>(
        (float4 *)p, (const float4 *)g, (float4 *)m, (float4 *)v, (uint2 *)w, n4, lr, b1, b2, eps,
        wd, bc1, bc2, gscale);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_sumsq(const float *g, size_t n, double *part, cudaStream_t st)
{
    k_sumsq<<<KCU_SUMSQ_BLOCKS, 256, 0, st>>>(g, n, part);
    KCU_CHECK_LAUNCH();
    k_sumsq_final<<<1, 1, 0, st>>>(part, KCU_SUMSQ_BLOCKS);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_stats(kcu_layer *l, int T, cudaStream_t st)
{
    const int nblk = KCU_CEIL_DIV(T, 256), pdl = kcu_route_pdl();
    KCU_CHECK(kcu_launch(k_stats_part, dim3(nblk), dim3(256), 0, st, pdl, 0, l->probs, l->lse, T,
                         l->c.E, l->statpart));
    KCU_CHECK(kcu_launch(k_stats_final, dim3(1), dim3(256), 0, st, pdl, 0, l->statpart, nblk, T,
                         l->c.E, l->c.K, l->counts, l->stats));
    return MOE_OK;
}

/* offs (P+1): p * n / P, the row ranges of a split-K weight gradient */
__global__ void k_split_offs(int32_t *__restrict__ offs, int n, int P)
{
    for (int p = threadIdx.x; p <= P; p += blockDim.x)
        offs[p] = (int32_t)((long long)p * n / P);
}

/* g[i] (+)= sum_p part[p][i] in p order (store when clean); n % 4 == 0 */
__global__ void k_sum_parts(const float4 *__restrict__ part, int P, size_t n4, float4 *g, int clean)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4;
         i += (size_t)gridDim.x * blockDim.x) {
        float4 acc = part[i];
        for (int p = 1; p < P; p++) {
            const float4 v = part[(size_t)p * n4 + i];
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        if (!clean) {
            const float4 c = g[i];
            acc.x += c.x;
            acc.y += c.y;
            acc.z += c.z;
            acc.w += c.w;
        }
        g[i] = acc;
    }
}

moe_err kcu_split_offs(int32_t *offs, int n, int P, cudaStream_t st)
{
    k_split_offs<<<1, 64, 0, st>>>(offs, n, P);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_sum_parts(const float *part, int P, size_t n, float *g, int clean, cudaStream_t st)
{
    const size_t n4 = n / 4, blocks = KCU_CEIL_DIV(n4, (size_t)256);
    k_sum_parts<<<(unsigned)(blocks < 2048 ? blocks : 2048), 256, 0, st>>>(
        reinterpret_cast<const float4 *>(part), P, n4, reinterpret_cast<float4 *>(g), clean);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_dw_reduce(kcu_layer *l, int S, cudaStream_t st)
{
    k_dw_reduce<<<KCU_CEIL_DIV(S, 256), 256, 0, st>>>(l->dwpart, l->perm, S, l->offs + kcu_nexp(l),
                                                      l->c.F / KCU_BN, l->dw);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_router_bwd(kcu_layer *l, int T, int T_global, float aux_coef, float z_coef,
                       cudaStream_t st)
{
    /* the aux loss over the E routed experts and their K slots */
    const int E = l->c.E, K = l->c.K, Kt = kcu_nslot(l);
    const kcu_route_config *r = &l->r;
    const float Tg = (float)T_global;
    const float aux_scale = aux_coef * (float)E / ((float)K * Tg * Tg);
    const float z_scale = 2.f * z_coef / Tg;
    const int sigmoid = r->scoring == KERN_SCORE_SIGMOID;
    const float scale = r->route_scale != 0.f ? r->route_scale : 1.f;
    const int m = r->shared_experts, gate = m > 0 && r->shared_gate;
    k_router_bwd<<<KCU_CEIL_DIV(T, 8), 256, 0, st>>>(
        l->probs, l->lse, l->topk_idx, l->dw, T, E, l->Ep, K, Kt, l->c.renorm, sigmoid, scale, m,
        gate, l->logits, l->topk_w, l->cglob, aux_scale, z_scale, l->dlogits);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}
