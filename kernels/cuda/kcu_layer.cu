/*
 * kcu_layer.cu - the kcu_layer object (kern_cuda.h): allocation, weight
 * upload, and the forward / backward sequences of kernels on one stream.
 *
 * Forward:  x -> bf16 xs; logits = xs wr^T; softmax/top-k; layout (counts,
 *   offsets, stable perm, tile list); h = act(xs[tok] w13_e^T) (grouped, with
 *   the gather in the load and the activation in the epilogue); ye[slot] =
 *   h w2_e^T (scatter in the store); y[t] = sum_j in order bf16(w ye[t,j]).
 * Backward: dh = w * dy[tok] w2_e -> (da, db) in place of (a, b), w*h in
 *   place of h, dL/dw partial sums; dx per slot = dab w13_e; router dlogits;
 *   dx = sum_j dx[t,j] + dlogits wr; dW13 += dab^T xs[tok];
 *   dW2 += dy[tok]^T (w h); dwr += dlogits^T xs.
 * dW2 runs right after dh (while the dy rows are in ye; h is then free for
 *   the router part of dx). Sorted modes (kcu_sorted_mode): x[tok] and
 *   dy[tok] are first copied into sorted rows so the grouped GEMMs stream
 *   dense tiles.
 * Shared expert: E + m <= 256: m extra experts (E .. E+m-1) that every
 *   token takes in slots K .. K+m-1; E + m > 256: held apart (l->sh, as
 *   kcu_ep): one kcu_experts of d_ff m*F on all T rows into sy, added in
 *   kcu_shared_combine (gated by logits column E), its backward after the
 *   router's (kcu_shared_gate_bwd for dlogits[:, E]), its dx rows added in
 *   the dx combine.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kcu_ffn.cuh"

void (*kcu_phase_hook)(const char *phase, cudaStream_t st) = nullptr;
#define PHASE(name)                                                                                \
    do {                                                                                           \
        if (kcu_phase_hook)                                                                        \
            kcu_phase_hook(name, st);                                                              \
    } while (0)

/* whether p is host memory (pageable or page-locked; a pointer CUDA does
 * not know counts as host); *mapped, when asked: p's device-visible address
 * where it is page-locked and mapped into the device's address space
 * (cudaHostRegister, cudaHostAlloc on a UVA system), else NULL */
static int host_ptr(const void *p, void **mapped)
{
    cudaPointerAttributes a;
    if (mapped)
        *mapped = nullptr;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1;
    }
    if (mapped && a.type == cudaMemoryTypeHost)
        *mapped = a.devicePointer;
    return a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered;
}

int kcu_is_host_ptr(const void *p)
{
    return host_ptr(p, nullptr);
}

/* KCU_Y_MAPPED: the most bytes of a decode forward's y that its last kernel
 * writes straight into page-locked host memory instead of staging it and
 * copying it out (default 65536: T <= 8 at d_model 4096 in bf16; 0 = always
 * staged). Small writes over PCIe are posted and cost less than a copy's
 * round trip; large ones go faster as one DMA copy. Measured on an H100
 * (bench/history/service.md "Session 26"): with KCU_STATS_MAPPED, a T=1
 * Qwen3 forward through a ring 0.071-0.076 ms against 0.077-0.089 copied. */
static size_t y_mapped_max()
{
    static long long v = -1;
    if (v < 0) {
        const char *s = getenv("KCU_Y_MAPPED");
        v = s && *s ? atoll(s) : 65536;
        if (v < 0)
            v = 0;
    }
    return (size_t)v;
}

uint16_t kcu_host_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int32_t kcu_capacity(float cf, int T, int K, int E)
{
    if (!(cf > 0.0f))
        return INT32_MAX;
    if (T <= 0 || K <= 0 || E <= 0)
        return 0;
    const double v = (double)cf * T * K / E;
    const double c = ceil(v * (1.0 - 1.2e-7)); /* as kern_capacity: shave the float's error */
    if (c >= (double)INT32_MAX)
        return INT32_MAX;
    return (int32_t)c;
}

int kcu_w13_src(int c, int swiglu, int *from_w3)
{
    if (!swiglu) {
        *from_w3 = 0;
        return c;
    }
    *from_w3 = (c & 15) >= 8;
    return (c >> 4) * 8 + (c & 7);
}

int kcu_sorted_override = -1;

int kcu_sorted_mode(const kcu_config *c)
{
    int m = kcu_sorted_override;
    if (m < 0) {
        const char *s = getenv("KCU_SORTED");
        if (s && *s)
            m = atoi(s);
    }
    if (m >= 0 && m <= 2)
        return m;
    /* default (measured, bench/NOTES.md version 6): a copy costs ~4H bytes of
     * traffic per row and saves a share of the 6HF-FLOP GEMMs per row:
     * Mixtral (F 14336) gains ~0.8 ms fwd / ~5 ms fwd+bwd with mode 2;
     * Qwen3 (F 768) gains nothing reliable in the forward with mode 1 (+-0.2
     * ms between runs), loses 0.2-0.3 ms fwd+bwd, and mode 2 costs 536 MB
     * (its fwd+bwd 4% faster, session 11). With bf16 gradients the store is
     * half the size and mode 2's rows fit beside it: mode 2 for training */
    return c->F >= 2048 || (c->train && c->grad_bf16) ? 2 : 0;
}

namespace
{

/* the GEMM path's routing: logits (T,Ep) = xb wr^T by the grouped GEMM
 * kernel, then kcu_route (softmax/top-k and the layout with capacity) */
moe_err route_gemm(kcu_layer *l, int T, const bf16 *xb, int cap, int pairs, cudaStream_t st)
{
    kcu_gemm_args a;
    memset(&a, 0, sizeof(a));
    a.A = xb;
    a.lda = l->c.H;
    a.B = l->wr;
    a.ldb = l->c.H;
    a.M = T;
    a.N = l->Ep;
    a.K = l->c.H;
    a.Cf = l->logits;
    a.ldc = l->Ep;
    KCU_TRY(kcu_gemm(KCU_A_K, KCU_B_K, KCU_EPI_F32, &a, l->nsm, st));
    return kcu_route(l, T, cap, pairs, st);
}

/* the split of the router's weight gradient over k (tokens): enough work
 * items for two waves, at least 256 rows per part, partials fitting in h
 * and their offsets in chunk; 1 = no split (KCU_DWR_SPLIT=0 too) */
int dwr_split(const kcu_layer *l, int T)
{
    static int on = -1;
    if (on < 0) {
        const char *s = getenv("KCU_DWR_SPLIT");
        on = !(s && *s && atoi(s) == 0);
    }
    const kcu_config *c = &l->c;
    if (!on || c->H % 256)
        return 1;
    const long long tiles = (long long)(l->Ep / KCU_BM) * (c->H / 256); /* >= 1 */
    int P = (int)((2LL * l->nsm + tiles - 1) / tiles);
    P = P > 32 ? 32 : P;
    const size_t Kt = kcu_nslot(l), Et = kcu_nexp(l);
    while (P > 1 && (T / P < 256 || (size_t)P * l->Ep * c->H * 4 > (size_t)T * Kt * c->F * 2 ||
                     (size_t)(P + 1) > KCU_CEIL_DIV((size_t)T * Kt, (size_t)256) * Et))
        P--;
    return P;
}

/* inference forwards with few routed rows copy x[tok] into sorted rows
 * (in ye, as mode 1) even where the layer's mode is 0: the copy is small
 * and the up-projection then streams dense tiles by TMA (v7) instead of
 * gathering rows (v2). So do those with few rows per expert (bytes-bound:
 * their time is the weights streamed, and v7's clusters stream them best).
 * KCU_SORTED_INFER: the most routed rows that take it (default 8192; 0 =
 * never); KCU_SORTED_INFER_RPE: the most rows per expert (mean) that take
 * it whatever their total (default 256; 0 = none: at 256 rows an expert
 * the gathered up-projection ran on v4, 2.15 ms at qwen235 T=4096 on H200
 * against 1.65-1.69 + 0.11 for the row copy on v7, bench/NOTES.md "The
 * bytes-bound layer at the power cap"). */
int sorted_infer(const kcu_layer *l, int T, int train)
{
    static int rows = -1, rpe = -1;
    if (rows < 0) {
        const char *s = getenv("KCU_SORTED_INFER");
        rows = s && *s ? atoi(s) : 8192;
        if (rows < 0)
            rows = 0;
        s = getenv("KCU_SORTED_INFER_RPE");
        rpe = s && *s ? atoi(s) : 256;
        if (rpe < 0)
            rpe = 0;
    }
    const long long S = (long long)T * kcu_nslot(l);
    return !train && (S <= rows || S <= (long long)rpe * kcu_nexp(l));
}

using carve = kcu_carve;

void carve_params(kcu_layer *l, carve *cv)
{
    const kcu_config *c = &l->c;
    const size_t Et = kcu_nexp(l); /* routed, then shared experts */
    cv->take(&l->wr, (size_t)l->Ep * c->H * 2);
    cv->take(&l->w13, Et * l->N1 * c->H * 2);
    cv->take(&l->w2, Et * c->H * c->F * 2);
    cv->take(&l->bias, (size_t)c->E * 4);
    if (c->train) {
        cv->take(&l->g_wr, (size_t)l->Ep * c->H * 4);
        const size_t gb = c->grad_bf16 ? 2 : 4;
        if (c->grad_bf16) {
            cv->take(&l->gb_w13, Et * l->N1 * c->H * gb);
            cv->take(&l->gb_w2, Et * c->H * c->F * gb);
        } else {
            cv->take(&l->g_w13, Et * l->N1 * c->H * gb);
            cv->take(&l->g_w2, Et * c->H * c->F * gb);
        }
    }
}

/* dW2 runs right after dh, so h (S,F bf16) is free when the router part of
 * dx is computed: it holds dxr (T,H f32) if large enough */
int dxr_borrows_h(const kcu_layer *l)
{
    const kcu_config *c = &l->c;
    return (size_t)kcu_nslot(l) * c->F * 2 >= (size_t)c->H * 4;
}

/* ye (S,H bf16) is live from the down-projection to the combine, and in the
 * backward from its start to the dx combine - all before the backward's
 * last GEMM (dW13) writes the expert-gradient store. While the gradients
 * are logically zero (kcu_layer_zero_grads: the next backward stores them)
 * that store is free, so a training layer carves no ye of its own when the
 * store is large enough (E*N1*H elements >= S*H). With several states
 * (kcu_layer_set_state) this stays safe: ye carries nothing from a forward
 * to its backward (the backward refills it with dy rows), so forwards and
 * backwards of different states may interleave; the first backward after
 * zeroing stores the gradients over it, and later calls use ye_own */
int ye_borrows_grads(const kcu_layer *l)
{
    const kcu_config *c = &l->c;
    return c->train && (size_t)kcu_nexp(l) * l->N1 >= (size_t)c->T_max * kcu_nslot(l);
}

void carve_ws(kcu_layer *l, carve *cv)
{
    const kcu_config *c = &l->c;
    /* S slots (routed and shared), Et experts held in the layout; E routed
     * in probs, cglob and statpart */
    const size_t T = c->T_max, S = T * kcu_nslot(l), H = c->H, F = c->F, E = c->E;
    const size_t Et = kcu_nexp(l);
    const size_t nch = KCU_CEIL_DIV(S, (size_t)256);
    const size_t mt = (S < S / KCU_BM + Et ? S : S / KCU_BM + Et) + 1;
    cv->take(&l->xs, T * H * 2);
    cv->take(&l->logits, T * l->Ep * 4);
    cv->take(&l->probs, T * E * 4);
    cv->take(&l->lse, T * 4);
    cv->take(&l->topk_idx, S * 4);
    cv->take(&l->topk_w, S * 4);
    /* counts, stats and dropped side by side: kcu_forward_stats reads the
     * three back in one copy (stats_span) */
    cv->take(&l->counts, Et * 4);
    cv->take(&l->stats, 2 * 4);
    cv->take(&l->dropped, Et * 4);
    cv->take(&l->offs, (Et + 1) * 4);
    cv->take(&l->chunk, nch * Et * 4);
    cv->take(&l->perm, S * 4);
    cv->take(&l->tok, S * 4);
    cv->take(&l->tile_e, mt * 4);
    cv->take(&l->tile_r0, mt * 4);
    cv->take(&l->ntiles, 4);
    cv->take(&l->cglob, E * 4);
    /* k_stats_part's blocks of 256 tokens, or the decode router's CTAs */
    const size_t nstat = KCU_CEIL_DIV(T, (size_t)256), nrt = KCU_RT_CTAS;
    cv->take(&l->statpart, (nstat > nrt ? nstat : nrt) * (E + 1) * 4);
    cv->take(&l->spos, S * 4);
    cv->take(&l->h, S * F * 2);
    if (!ye_borrows_grads(l))
        cv->take(&l->ye, S * H * 2);
    if (c->train) {
        cv->take(&l->ab, S * l->N1 * 2);
        cv->take(&l->dwpart, S * (F / KCU_BN) * 4);
        cv->take(&l->dw, S * 4);
        cv->take(&l->dlogits, T * l->Ep * 2);
        if (l->sorted == 2)
            cv->take(&l->xg, S * H * 2);
        if (!dxr_borrows_h(l))
            cv->take(&l->dxr, T * H * 4);
    }
    l->max_tiles = (int)(mt - 1);
}

/* ensure_stage: the f32 (T_max,H) staging buffer for host inputs and
 * outputs, allocated on first use (device-resident callers never pay it) */
moe_err ensure_stage(kcu_layer *l)
{
    if (l->stage)
        return MOE_OK;
    const size_t b = (size_t)l->c.T_max * l->c.H * 4;
    if (cudaMalloc(&l->stage, b) != cudaSuccess) {
        (void)cudaGetLastError();
        l->stage = nullptr;
        fprintf(stderr, "kcu_layer: cudaMalloc of %zu staging bytes failed\n", b);
        return MOE_ENOMEM;
    }
    l->stage_bytes = b;
    return MOE_OK;
}

/* ye_for_call: the (S,H) bf16 buffer of this call's expert outputs / dx
 * rows: the carved one, else the expert-gradient store while the gradients
 * are logically zero, else one allocated on first need (gradient
 * accumulation without zeroing) */
moe_err ye_for_call(kcu_layer *l, bf16 **ye)
{
    if (l->ye) {
        *ye = l->ye;
        return MOE_OK;
    }
    if (l->grads_clean) {
        *ye = l->g_w13 ? reinterpret_cast<bf16 *>(l->g_w13) : l->gb_w13;
        return MOE_OK;
    }
    if (!l->ye_own) {
        const size_t b = (size_t)l->c.T_max * kcu_nslot(l) * l->c.H * 2;
        if (cudaMalloc(&l->ye_own, b) != cudaSuccess) {
            (void)cudaGetLastError();
            l->ye_own = nullptr;
            fprintf(stderr, "kcu_layer: cudaMalloc of %zu bytes (expert outputs) failed\n", b);
            return MOE_ENOMEM;
        }
        l->ye_own_bytes = b;
    }
    *ye = l->ye_own;
    return MOE_OK;
}

/* stage_in: src (T,H) of dtype dt, host or device -> bf16 device dst. */
moe_err stage_in(kcu_layer *l, const void *src, moe_dtype dt, bf16 *dst, size_t n, cudaStream_t st)
{
    if (dt == MOE_F32 && kcu_is_host_ptr(src)) {
        KCU_TRY(ensure_stage(l));
        KCU_CHECK(cudaMemcpyAsync(l->stage, src, n * 4, cudaMemcpyHostToDevice, st));
        src = l->stage;
    }
    return kcu_to_bf16(src, dt, dst, n, st);
}

/* the layer's expert FFNs (routed and shared experts) over its layout, in
 * the selected state's workspace */
kcu_ffn layer_ffn(const kcu_layer *l)
{
    kcu_ffn f;
    memset(&f, 0, sizeof(f));
    f.H = l->c.H;
    f.F = l->c.F;
    f.N1 = l->N1;
    f.act = l->c.act;
    f.nsm = l->nsm;
    f.w13 = l->w13;
    f.w2 = l->w2;
    f.h = l->h;
    f.ab = l->ab;
    f.t.offs = l->offs;
    f.t.tile_e = l->tile_e;
    f.t.tile_r0 = l->tile_r0;
    f.t.ntiles = l->ntiles;
    f.t.max_tiles = l->max_tiles;
    f.t.sched = reinterpret_cast<int *>(l->dsync + KCU_SCHED_WORD);
    f.E = kcu_nexp(l); /* routed and shared experts */
    f.goffs = l->offs;
    f.g_w13 = l->g_w13;
    f.g_w2 = l->g_w2;
    f.gb_w13 = l->gb_w13;
    f.gb_w2 = l->gb_w2;
    f.beta0 = l->grads_clean;
    return f;
}

} // namespace

extern "C" moe_err kcu_layer_create(const kcu_config *cfg, kcu_layer **out)
{
    return kcu_layer_create_ex(cfg, nullptr, out);
}

extern "C" moe_err kcu_layer_create_ex(const kcu_config *cfg, const kcu_route_config *rc,
                                       kcu_layer **out)
{
    kcu_route_config r0;
    memset(&r0, 0, sizeof(r0));
    const kcu_route_config *r = rc ? rc : &r0;
    *out = NULL;
    if (cfg->H <= 0 || cfg->F <= 0 || cfg->H % 128 || cfg->F % 128 || cfg->E < 1 || cfg->E > 256 ||
        cfg->K < 1 || cfg->K > 8 || cfg->K > cfg->E || cfg->T_max < 1 ||
        (cfg->act != KERN_ACT_SWIGLU && cfg->act != KERN_ACT_GELU) ||
        !(cfg->capacity_factor >= 0.0f) || cfg->states < 0 || cfg->states > KCU_MAX_STATES) {
        fprintf(stderr,
                "kcu_layer_create: unsupported shape H=%d F=%d E=%d K=%d T_max=%d states=%d\n",
                cfg->H, cfg->F, cfg->E, cfg->K, cfg->T_max, cfg->states);
        return MOE_EINVAL;
    }
    /* routing family and shared experts (kern_cuda.h "Routing families");
     * E + m > 256: the shared expert held apart (kcu_layer.sh), d_ff m*F <=
     * 65536 as kcu_ep's, one state (its kept forward is not per state) */
    const int apart = kcu_shared_apart(cfg->E, r->shared_experts);
    const int ng = r->n_group > 1 ? r->n_group : 1;
    const int tg = r->topk_group > 0 ? r->topk_group : ng;
    if ((r->scoring != KERN_SCORE_SOFTMAX && r->scoring != KERN_SCORE_SIGMOID) || r->n_group < 0 ||
        r->n_group > KCU_MAX_GROUPS || cfg->E % ng != 0 || r->topk_group < 0 || tg > ng ||
        cfg->K > tg * (cfg->E / ng) || r->group_topn < 0 || r->group_topn > 2 ||
        !(r->route_scale >= 0.0f) || isinf(r->route_scale) || r->shared_experts < 0 ||
        (apart && ((long long)r->shared_experts * cfg->F > 65536 || cfg->states > 1)) ||
        (r->shared_gate && r->shared_experts == 0)) {
        fprintf(stderr,
                "kcu_layer_create: unsupported routing scoring=%d n_group=%d topk_group=%d "
                "group_topn=%d route_scale=%g shared_experts=%d shared_gate=%d (E=%d K=%d F=%d "
                "states=%d)\n",
                r->scoring, r->n_group, r->topk_group, r->group_topn, (double)r->route_scale,
                r->shared_experts, r->shared_gate, cfg->E, cfg->K, cfg->F, cfg->states);
        return MOE_EINVAL;
    }
    kcu_layer *l = (kcu_layer *)calloc(1, sizeof(*l));
    if (!l)
        return MOE_ENOMEM;
    l->c = *cfg;
    l->r = *r;
    if (apart) { /* the layout holds the K routed slots only (kcu_nexp E, kcu_nslot K) */
        l->sh_m = r->shared_experts;
        l->sh_gate = r->shared_gate;
        l->r.shared_experts = 0;
        l->r.shared_gate = 0;
    }
    /* a shared gate's wsg is router row E: one more row, padded to KCU_BN */
    const int gate_row = r->shared_experts > 0 && r->shared_gate;
    l->Ep = KCU_CEIL_DIV(cfg->E + gate_row, KCU_BN) * KCU_BN;
    l->family = r->scoring != KERN_SCORE_SOFTMAX || ng > 1 ||
                (r->route_scale != 0.0f && r->route_scale != 1.0f) || r->shared_experts > 0;
    l->N1 = cfg->act == KERN_ACT_SWIGLU ? 2 * cfg->F : cfg->F;
    l->sorted = kcu_sorted_mode(cfg);
    l->nstates = cfg->states > 1 ? cfg->states : 1;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&l->nsm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        fprintf(stderr, "kcu_layer_create: no CUDA device\n");
        free(l);
        return MOE_EUNAVAIL;
    }
    carve cv = {nullptr, 0};
    carve_params(l, &cv);
    l->params_bytes = cv.off;
    cv = {nullptr, 0};
    carve_ws(l, &cv);
    l->ws_state_bytes = cv.off; /* a multiple of 256: every state's base stays aligned */
    l->ws_bytes = l->ws_state_bytes * l->nstates;
    if (cudaMalloc(&l->params, l->params_bytes) != cudaSuccess ||
        cudaMalloc(&l->ws, l->ws_bytes) != cudaSuccess ||
        cudaMalloc(&l->dsync, KCU_DSYNC_WORDS * 4) != cudaSuccess ||
        cudaMemset(l->dsync, 0, KCU_DSYNC_WORDS * 4) != cudaSuccess) {
        (void)cudaGetLastError();
        fprintf(stderr, "kcu_layer_create: cudaMalloc of %zu + %zu bytes failed\n", l->params_bytes,
                l->ws_bytes);
        kcu_layer_destroy(l);
        return MOE_ENOMEM;
    }
    cv = {(char *)l->params, 0};
    carve_params(l, &cv);
    cv = {(char *)l->ws, 0}; /* state 0 selected */
    carve_ws(l, &cv);
    if (apart) { /* one expert of d_ff m*F over all T_max rows, and its (T_max,H) rows */
        const moe_err e = kcu_experts_create(cfg->H, l->sh_m * cfg->F, 1, cfg->act, cfg->T_max,
                                             cfg->train, &l->sh);
        l->sy_bytes = (size_t)cfg->T_max * cfg->H * 2;
        if (e != MOE_OK || cudaMalloc(&l->sy, l->sy_bytes) != cudaSuccess) {
            (void)cudaGetLastError();
            l->sy = nullptr;
            fprintf(stderr, "kcu_layer_create: the shared expert (d_ff %d) failed\n",
                    l->sh_m * cfg->F);
            kcu_layer_destroy(l);
            return e != MOE_OK ? e : MOE_ENOMEM;
        }
        l->sh->nsm = l->nsm;
    }
    /* no bias; router rows zero (the shared gate's row E until
     * kcu_layer_upload_shared) */
    if (cudaMemset(l->bias, 0, (size_t)cfg->E * 4) != cudaSuccess ||
        cudaMemset(l->wr, 0, (size_t)l->Ep * cfg->H * 2) != cudaSuccess) {
        (void)cudaGetLastError();
        fprintf(stderr, "kcu_layer_create: cudaMemset failed\n");
        kcu_layer_destroy(l);
        return MOE_EINTERNAL;
    }
    *out = l;
    return MOE_OK;
}

extern "C" void kcu_layer_destroy(kcu_layer *l)
{
    if (!l)
        return;
    if (l->params)
        cudaFree(l->params);
    if (l->ws)
        cudaFree(l->ws);
    if (l->dsync)
        cudaFree(l->dsync);
    if (l->stage)
        cudaFree(l->stage);
    if (l->ye_own)
        cudaFree(l->ye_own);
    if (l->stats_h)
        cudaFreeHost(l->stats_h);
    if (l->sh)
        kcu_experts_destroy(l->sh);
    if (l->sy)
        cudaFree(l->sy);
    kcu_pipe_release(l);
    free(l);
}

extern "C" moe_err kcu_layer_set_state(kcu_layer *l, int state)
{
    if (state < 0 || state >= l->nstates)
        return MOE_EINVAL;
    /* re-point the workspace pointers into state `state`'s copy (same
     * layout in each); the per-state host fields are indexed by l->state */
    l->state = state;
    carve cv = {(char *)l->ws + (size_t)state * l->ws_state_bytes, 0};
    carve_ws(l, &cv);
    return MOE_OK;
}

extern "C" void kcu_layer_bytes(const kcu_layer *l, size_t *params_bytes, size_t *ws_bytes)
{
    size_t sp = 0, sw = 0; /* the shared expert held apart */
    if (l->sh)
        kcu_experts_bytes(l->sh, &sp, &sw);
    if (params_bytes)
        *params_bytes = l->params_bytes + sp;
    if (ws_bytes)
        *ws_bytes = l->ws_bytes + l->stage_bytes + l->ye_own_bytes + l->pp_bytes + sw + l->sy_bytes;
}

extern "C" moe_err kcu_layer_zero_grads(kcu_layer *l, void *stream)
{
    if (!l->c.train)
        return MOE_EPRECOND;
    (void)stream; /* lazy: the next backward stores its gradients instead of adding them */
    l->grads_clean = 1;
    if (l->sh)
        KCU_TRY(kcu_experts_zero_grads(l->sh, nullptr));
    return MOE_OK;
}

namespace
{

/* upload_expert: expert e's weights (host fp32, rounded to bf16) into w13
 * (gate/up interleaved for SwiGLU) and w2: w1e, w3e (F,H) rows of H; w2e
 * (H,F) with row h at w2e + h * ld2 (ld2 = F for a routed expert, Fs for a
 * column slice of the shared ws2). buf: host scratch of max(N1*H, H*F)
 * uint16. */
moe_err upload_expert(kcu_layer *l, int e, const float *w1e, const float *w3e, const float *w2e,
                      size_t ld2, uint16_t *buf)
{
    const kcu_config *c = &l->c;
    const int swiglu = c->act == KERN_ACT_SWIGLU;
    const size_t H = c->H, F = c->F, per = (size_t)l->N1 * H;
    for (int r = 0; r < l->N1; r++) {
        int from3;
        const int sr = kcu_w13_src(r, swiglu, &from3);
        const float *src = (from3 ? w3e : w1e) + (size_t)sr * H;
        for (size_t i = 0; i < H; i++)
            buf[(size_t)r * H + i] = kcu_host_bf16(src[i]);
    }
    if (cudaMemcpy(l->w13 + (size_t)e * per, buf, per * 2, cudaMemcpyHostToDevice) != cudaSuccess)
        return MOE_EINTERNAL;
    for (size_t h = 0; h < H; h++)
        for (size_t f = 0; f < F; f++)
            buf[h * F + f] = kcu_host_bf16(w2e[h * ld2 + f]);
    if (cudaMemcpy(l->w2 + (size_t)e * H * F, buf, H * F * 2, cudaMemcpyHostToDevice) !=
        cudaSuccess)
        return MOE_EINTERNAL;
    return MOE_OK;
}

} // namespace

extern "C" moe_err kcu_layer_upload(kcu_layer *l, const float *wr, const float *w1, const float *w3,
                                    const float *w2)
{
    const kcu_config *c = &l->c;
    const int swiglu = c->act == KERN_ACT_SWIGLU;
    if (!wr || !w1 || !w2 || (swiglu && !w3))
        return MOE_EINVAL;
    const size_t H = c->H, F = c->F, per = (size_t)l->N1 * H;
    size_t nb = per > H * F ? per : H * F;
    nb = nb > (size_t)l->Ep * H ? nb : (size_t)l->Ep * H;
    uint16_t *buf = (uint16_t *)malloc(nb * 2);
    if (!buf)
        return MOE_ENOMEM;
    moe_err rc = MOE_OK;
    /* router rows 0 .. E-1; the padded rows stay zero (create) and a shared
     * gate's row E is kcu_layer_upload_shared's */
    for (size_t i = 0; i < (size_t)c->E * H; i++)
        buf[i] = kcu_host_bf16(wr[i]);
    if (cudaMemcpy(l->wr, buf, (size_t)c->E * H * 2, cudaMemcpyHostToDevice) != cudaSuccess)
        rc = MOE_EINTERNAL;
    /* the routed experts; the shared ones (E ..) are kcu_layer_upload_shared's */
    for (int e = 0; e < c->E && rc == MOE_OK; e++)
        rc = upload_expert(l, e, w1 + (size_t)e * F * H, swiglu ? w3 + (size_t)e * F * H : w1,
                           w2 + (size_t)e * H * F, F, buf);
    free(buf);
    if (rc != MOE_OK) {
        fprintf(stderr, "kcu_layer_upload: %s\n", cudaGetErrorString(cudaGetLastError()));
        return rc;
    }
    if (c->train)
        KCU_TRY(kcu_layer_zero_grads(l, NULL));
    return MOE_OK;
}

extern "C" moe_err kcu_layer_upload_bias(kcu_layer *l, const float *bias)
{
    const size_t E = l->c.E;
    if (!bias) {
        KCU_CHECK(cudaMemset(l->bias, 0, E * 4));
        l->has_bias = 0;
        return MOE_OK;
    }
    KCU_CHECK(cudaMemcpy(l->bias, bias, E * 4, cudaMemcpyHostToDevice));
    l->has_bias = 1;
    return MOE_OK;
}

extern "C" moe_err kcu_shared_split(int Fs, int F, int *m)
{
    if (Fs < 0 || F < 1 || Fs % F != 0)
        return MOE_EINVAL;
    *m = Fs / F;
    return MOE_OK;
}

namespace
{

/* the shared expert held apart: ws1, ws3 (Fs,H) and ws2 (H,Fs) are
 * kcu_experts_upload's shapes of one expert (its gradients marked zero, the
 * kept forward gone: the layer's train forward is then gone too, as
 * kcu_ep_upload_shared); wsg (H) or NULL -> router row E, bf16 */
moe_err upload_shared_apart(kcu_layer *l, const float *ws1, const float *ws3, const float *ws2,
                            const float *wsg)
{
    KCU_TRY(kcu_experts_upload(l->sh, ws1, ws3, ws2));
    l->T_fwd[l->state] = 0;
    if (!wsg)
        return MOE_OK;
    const size_t H = l->c.H;
    uint16_t *b = (uint16_t *)malloc(H * 2);
    if (!b)
        return MOE_ENOMEM;
    for (size_t i = 0; i < H; i++)
        b[i] = kcu_host_bf16(wsg[i]);
    const cudaError_t e = cudaMemcpy(l->wr + (size_t)l->c.E * H, b, H * 2, cudaMemcpyHostToDevice);
    free(b);
    KCU_CHECK(e);
    return MOE_OK;
}

} // namespace

extern "C" moe_err kcu_layer_upload_shared(kcu_layer *l, const float *ws1, const float *ws3,
                                           const float *ws2, const float *wsg)
{
    const kcu_config *c = &l->c;
    const int swiglu = c->act == KERN_ACT_SWIGLU;
    const int m = l->sh ? l->sh_m : l->r.shared_experts;
    const int gate = m > 0 && (l->sh ? l->sh_gate : l->r.shared_gate);
    if (m < 1 || !ws1 || !ws2 || (swiglu && !ws3) || (gate && !wsg))
        return MOE_EINVAL;
    if (l->sh)
        return upload_shared_apart(l, ws1, swiglu ? ws3 : nullptr, ws2, gate ? wsg : nullptr);
    const size_t H = c->H, F = c->F, Fs = (size_t)m * F, per = (size_t)l->N1 * H;
    uint16_t *buf = (uint16_t *)malloc((per > H * F ? per : H * F) * 2);
    if (!buf)
        return MOE_ENOMEM;
    moe_err rc = MOE_OK;
    /* chunk k of d_ff: ws1 / ws3 rows kF .. kF+F-1 (contiguous (F,H)), ws2
     * columns kF .. kF+F-1 (rows of Fs) -> expert E + k */
    for (int k = 0; k < m && rc == MOE_OK; k++)
        rc = upload_expert(l, c->E + k, ws1 + (size_t)k * F * H,
                           swiglu ? ws3 + (size_t)k * F * H : ws1, ws2 + (size_t)k * F, Fs, buf);
    if (rc == MOE_OK && gate) { /* wsg (H) -> router row E */
        for (size_t i = 0; i < H; i++)
            buf[i] = kcu_host_bf16(wsg[i]);
        if (cudaMemcpy(l->wr + (size_t)c->E * H, buf, H * 2, cudaMemcpyHostToDevice) != cudaSuccess)
            rc = MOE_EINTERNAL;
    }
    free(buf);
    if (rc != MOE_OK)
        fprintf(stderr, "kcu_layer_upload_shared: %s\n", cudaGetErrorString(cudaGetLastError()));
    return rc;
}

namespace
{

/* fetch_grad: n gradient values to host f32 dst, from the fp32 store gf or
 * the bf16 store gb (exactly widened) */
moe_err fetch_grad(float *dst, const float *gf, const bf16 *gb, size_t n)
{
    if (gf) {
        KCU_CHECK(cudaMemcpy(dst, gf, n * 4, cudaMemcpyDeviceToHost));
        return MOE_OK;
    }
    uint16_t *tmp = (uint16_t *)malloc(n * 2);
    if (!tmp)
        return MOE_ENOMEM;
    if (cudaMemcpy(tmp, gb, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
        free(tmp);
        KCU_CHECK(cudaGetLastError());
        return MOE_EINTERNAL;
    }
    for (size_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)tmp[i] << 16;
        memcpy(dst + i, &u, 4);
    }
    free(tmp);
    return MOE_OK;
}

} // namespace

extern "C" moe_err kcu_layer_download_grads(kcu_layer *l, float *dwr, float *dw1, float *dw3,
                                            float *dw2)
{
    const kcu_config *c = &l->c;
    if (!c->train)
        return MOE_EPRECOND;
    const size_t H = c->H, F = c->F, per = (size_t)l->N1 * H;
    const int swiglu = c->act == KERN_ACT_SWIGLU;
    KCU_CHECK(cudaDeviceSynchronize());
    if (l->grads_clean) {
        if (dwr)
            memset(dwr, 0, (size_t)c->E * H * 4);
        if (dw1)
            memset(dw1, 0, (size_t)c->E * F * H * 4);
        if (dw3 && swiglu)
            memset(dw3, 0, (size_t)c->E * F * H * 4);
        if (dw2)
            memset(dw2, 0, (size_t)c->E * H * F * 4);
        return MOE_OK;
    }
    if (dwr)
        KCU_CHECK(cudaMemcpy(dwr, l->g_wr, (size_t)c->E * H * 4, cudaMemcpyDeviceToHost));
    if (dw2)
        KCU_TRY(fetch_grad(dw2, l->g_w2, l->gb_w2, (size_t)c->E * H * F));
    if (!dw1 && !dw3)
        return MOE_OK;
    float *buf = (float *)malloc(per * 4);
    if (!buf)
        return MOE_ENOMEM;
    for (int e = 0; e < c->E; e++) {
        const moe_err rc = fetch_grad(buf, l->g_w13 ? l->g_w13 + (size_t)e * per : nullptr,
                                      l->gb_w13 ? l->gb_w13 + (size_t)e * per : nullptr, per);
        if (rc != MOE_OK) {
            free(buf);
            return rc;
        }
        for (int r = 0; r < l->N1; r++) {
            int from3;
            const int sr = kcu_w13_src(r, swiglu, &from3);
            float *dst = from3 ? dw3 : dw1;
            if (dst)
                memcpy(dst + ((size_t)e * F + sr) * H, buf + (size_t)r * H, H * 4);
        }
    }
    free(buf);
    return MOE_OK;
}

extern "C" moe_err kcu_layer_download_shared_grads(kcu_layer *l, float *dws1, float *dws3,
                                                   float *dws2, float *dwsg)
{
    const kcu_config *c = &l->c;
    const int m = l->r.shared_experts, gate = m > 0 && l->r.shared_gate;
    if (!c->train)
        return MOE_EPRECOND;
    if (l->sh) { /* held apart: its own gradients (synchronises), the gate's in row E */
        const size_t H = c->H;
        KCU_TRY(kcu_experts_download_grads(l->sh, dws1, c->act == KERN_ACT_SWIGLU ? dws3 : nullptr,
                                           dws2));
        if (dwsg && l->sh_gate) {
            if (l->grads_clean)
                memset(dwsg, 0, H * 4);
            else
                KCU_CHECK(
                    cudaMemcpy(dwsg, l->g_wr + (size_t)c->E * H, H * 4, cudaMemcpyDeviceToHost));
        }
        return MOE_OK;
    }
    if (m < 1)
        return MOE_EINVAL;
    const size_t H = c->H, F = c->F, Fs = (size_t)m * F, per = (size_t)l->N1 * H;
    const int swiglu = c->act == KERN_ACT_SWIGLU;
    KCU_CHECK(cudaDeviceSynchronize());
    if (l->grads_clean) {
        if (dws1)
            memset(dws1, 0, Fs * H * 4);
        if (dws3 && swiglu)
            memset(dws3, 0, Fs * H * 4);
        if (dws2)
            memset(dws2, 0, H * Fs * 4);
        if (dwsg && gate)
            memset(dwsg, 0, H * 4);
        return MOE_OK;
    }
    /* the gate's gradient is router row E's */
    if (dwsg && gate)
        KCU_CHECK(cudaMemcpy(dwsg, l->g_wr + (size_t)c->E * H, H * 4, cudaMemcpyDeviceToHost));
    float *buf = (float *)malloc((per > H * F ? per : H * F) * 4);
    if (!buf)
        return MOE_ENOMEM;
    moe_err rc = MOE_OK;
    /* expert E + k is chunk k of d_ff: rows kF .. of dws1 / dws3, columns
     * kF .. of dws2 (H,Fs) */
    for (int k = 0; k < m && rc == MOE_OK; k++) {
        const size_t e = (size_t)c->E + k;
        if (dws1 || dws3) {
            rc = fetch_grad(buf, l->g_w13 ? l->g_w13 + e * per : nullptr,
                            l->gb_w13 ? l->gb_w13 + e * per : nullptr, per);
            for (int r = 0; r < l->N1 && rc == MOE_OK; r++) {
                int from3;
                const int sr = kcu_w13_src(r, swiglu, &from3);
                float *dst = from3 ? dws3 : dws1;
                if (dst)
                    memcpy(dst + ((size_t)k * F + sr) * H, buf + (size_t)r * H, H * 4);
            }
        }
        if (dws2 && rc == MOE_OK) {
            rc = fetch_grad(buf, l->g_w2 ? l->g_w2 + e * H * F : nullptr,
                            l->gb_w2 ? l->gb_w2 + e * H * F : nullptr, H * F);
            for (size_t h = 0; h < H && rc == MOE_OK; h++)
                memcpy(dws2 + h * Fs + (size_t)k * F, buf + h * F, F * 4);
        }
    }
    free(buf);
    return rc;
}

extern "C" moe_err kcu_forward(kcu_layer *l, int T, const void *x, moe_dtype x_dtype, void *y,
                               moe_dtype y_dtype, int train, void *stream)
{
    return kcu_forward_path(l, T, x, x_dtype, y, y_dtype, train, (cudaStream_t)stream, T);
}

/* the one-kernel router (kcu_route_small) where the rows average fewer than
 * KCU_V10_MIN_AVG an expert; from there on the router GEMM and kcu_route,
 * whose tile list in pairs (or the walk of offs) lets v10 take the GEMMs
 * where the small router's list kept them on v7 (measured on H200,
 * bench/NOTES.md "The small router kept few-expert layers off v10":
 * Mixtral T=512 0.851-0.852 ms against 1.023-1.043, T=1024 1.335-1.372
 * against 1.543-1.547) */
int kcu_layer_route_small(const kcu_layer *l, int T, int train)
{
    return kcu_route_small_use(l, T, train) &&
           (long long)T * kcu_nslot(l) < (long long)KCU_V10_MIN_AVG * kcu_nexp(l);
}

moe_err kcu_forward_path(kcu_layer *l, int T, const void *x, moe_dtype x_dtype, void *y,
                         moe_dtype y_dtype, int train, cudaStream_t st, int T_path)
{
    const kcu_config *c = &l->c;
    if (T < 0 || T > c->T_max || (train && !c->train) ||
        (x_dtype != MOE_F32 && x_dtype != MOE_BF16) || (y_dtype != MOE_F32 && y_dtype != MOE_BF16))
        return MOE_EINVAL;
    l->T_fwd[l->state] = 0;
    l->stats_in_host = 0; /* the decode chain sets it where its last kernel writes them */
    if (T == 0)
        return MOE_OK;
    /* K routed slots (capacity); Kt slots per token and Et experts held,
     * the shared experts after the routed ones (kcu_nslot, kcu_nexp) */
    const int H = c->H, K = c->K, Kt = kcu_nslot(l), Et = kcu_nexp(l);
    const size_t n = (size_t)T * H;

    /* x -> bf16 on the device (kept in xs for backward) */
    const bf16 *xb = l->xs;
    if (x_dtype == MOE_BF16 && !train && !kcu_is_host_ptr(x))
        xb = (const bf16 *)x;
    else
        KCU_TRY(stage_in(l, x, x_dtype, l->xs, n, st));

    /* few rows per expert: kcu_decode.cu (a routing family too: its
     * router between the decode kernels, shared experts included) */
    if (kcu_decode_use(l, T_path, train)) {
        const int cap = kcu_capacity(c->capacity_factor, T, K, c->E);
        l->cap_fwd[l->state] = cap;
        /* small y in page-locked host memory: written there by the last
         * kernel (visible once the stream is waited for, as the copy's) */
        void *ymap = nullptr;
        const int yhost = host_ptr(y, &ymap);
        const size_t ybytes = n * (y_dtype == MOE_F32 ? 4 : 2);
        if (ybytes > y_mapped_max())
            ymap = nullptr;
        const int staged = yhost && !ymap;
        if (staged)
            KCU_TRY(ensure_stage(l));
        PHASE("f.decode");
        KCU_TRY(kcu_decode_forward(l, T, xb, cap,
                                   ymap     ? ymap
                                   : staged ? (void *)l->stage
                                            : y,
                                   y_dtype, st));
        if (staged)
            KCU_CHECK(cudaMemcpyAsync(y, l->stage, ybytes, cudaMemcpyDeviceToHost, st));
        PHASE("f.end");
        return MOE_OK;
    }

    bf16 *ye;
    KCU_TRY(ye_for_call(l, &ye));

    PHASE("f.router");
    const int cap = kcu_capacity(c->capacity_factor, T, K, c->E);
    const int small = kcu_layer_route_small(l, T_path, train);
    /* sorted rows (the sorted modes, or an inference forward with few rows)
     * take v7; with 1.5 m-tiles per expert or fewer on average, the tile
     * list in pairs of one expert (kcu_route: each weight tile read once) */
    const int sorted_rows = l->sorted || sorted_infer(l, T_path, train);
    static int pairs_on = -1; /* KCU_TILE_PAIRS=0: never */
    const int pairs = sorted_rows && !train && 2LL * T * Kt <= 3LL * KCU_BM * Et &&
                      kcu_env_flag(&pairs_on, "KCU_TILE_PAIRS", 1);
    if (small) /* few slots: one kernel (kcu_decode.cu) */
        KCU_TRY(kcu_route_small(l, T, xb, cap, nullptr, st));
    else
        KCU_TRY(route_gemm(l, T, xb, cap, pairs, st));
    l->cap_fwd[l->state] = cap;
    const int32_t *spos = cap < INT32_MAX ? l->spos : nullptr;

    /* sorted modes: x[tok] copied once into sorted rows (in ye, which the
     * down-projection overwrites later, or kept in xg for dW13) */
    const bf16 *xrows = xb;
    /* KCU_V7_GATHER: the bytes-bound inference forwards (the list in pairs)
     * gather x[tok] inside the up-projection's producer instead of copying
     * the rows first */
    const int gather_in_gemm = pairs && !l->sorted && kcu_v7_gather_on();
    if (sorted_rows && !gather_in_gemm) {
        bf16 *dst = train && l->xg ? l->xg : ye;
        PHASE("f.gather");
        KCU_TRY(kcu_gather_rows(xb, MOE_BF16, l->tok, l->offs + Et, T * Kt, H, dst, small, st));
        xrows = dst;
    }

    PHASE("f.up");
    /* up: h (S,F) [, ab (S,N1)] = act(x[tok] w13_e^T) over the tile list */
    kcu_ffn f = layer_ffn(l);
    f.pdl = small;             /* small inference batches: the kernel chain with PDL */
    f.t.few = pairs && !small; /* kcu_route_small's list is not in pairs */
    f.t.walk = sorted_rows && !gather_in_gemm && !train && !small;
    f.t.avg_rows = (int)((long long)T * Kt / Et);
    KCU_TRY(kcu_ffn_up(&f, xrows, xrows != xb ? nullptr : l->tok, train, st));

    PHASE("f.down");
    /* down: ye[perm[r]] (S,H) = h w2_e^T */
    KCU_TRY(kcu_ffn_down(&f, ye, MOE_BF16, l->perm, st));

    if (l->sh) {
        /* the shared expert held apart on all T rows: ys (T,H) = expert(xb)
         * into sy, kept for the gate's gradient (and its x, a, h in the
         * kcu_experts for its backward when training) */
        PHASE("f.shared");
        const int32_t rows = T;
        KCU_TRY(kcu_experts_forward(l->sh, T, xb, MOE_BF16, &rows, l->sy, MOE_BF16, train, st));
    }

    PHASE("f.combine");
    /* combine, in j order (then the shared rows held apart, gated by the
     * logits' column E or not) */
    const int yhost = kcu_is_host_ptr(y);
    if (yhost)
        KCU_TRY(ensure_stage(l));
    if (l->sh)
        KCU_TRY(kcu_shared_combine(ye, nullptr, spos, l->topk_w, nullptr, l->sy,
                                   l->sh_gate ? l->logits + c->E : nullptr, l->Ep, T, Kt, H,
                                   yhost ? (void *)l->stage : y, y_dtype, st));
    else
        KCU_TRY(kcu_combine(ye, l->topk_w, nullptr, spos, T, Kt, H, yhost ? (void *)l->stage : y,
                            y_dtype, small, st));
    if (yhost)
        KCU_CHECK(cudaMemcpyAsync(y, l->stage, n * (y_dtype == MOE_F32 ? 4 : 2),
                                  cudaMemcpyDeviceToHost, st));
    if (!small) /* kcu_route_small wrote them */
        KCU_TRY(kcu_stats(l, T, st));
    PHASE("f.end");
    l->T_fwd[l->state] = train ? T : 0;
    return MOE_OK;
}

extern "C" moe_err kcu_backward(kcu_layer *l, const void *dy, moe_dtype dy_dtype, void *dx,
                                moe_dtype dx_dtype, float aux_coef, float z_coef,
                                const int32_t *counts_global, int T_global, void *stream)
{
    const kcu_config *c = &l->c;
    cudaStream_t st = (cudaStream_t)stream;
    const int T = l->T_fwd[l->state];
    if (!c->train || T <= 0)
        return MOE_EPRECOND;
    if ((dy_dtype != MOE_F32 && dy_dtype != MOE_BF16) ||
        (dx_dtype != MOE_F32 && dx_dtype != MOE_BF16))
        return MOE_EINVAL;
    /* E routed experts (counts for the aux loss); Et experts held and Kt
     * slots per token, the shared experts and their slots after them */
    const int H = c->H, E = c->E, Et = kcu_nexp(l), Kt = kcu_nslot(l), S = T * Kt;
    const size_t n = (size_t)T * H;
    /* dy rows for dh and dW2, in ye (free since the forward's combine; b.dx
     * overwrites it after dW2): sorted copies (sorted modes), or dy (T,H)
     * bf16 read through tok - the caller's buffer when it is bf16 on the
     * device, else a converted copy */
    bf16 *ye;
    KCU_TRY(ye_for_call(l, &ye));
    const int on_host = kcu_is_host_ptr(dy);
    const void *dysrc = dy;
    if (on_host) {
        KCU_TRY(ensure_stage(l));
        KCU_CHECK(cudaMemcpyAsync(l->stage, dy, n * (dy_dtype == MOE_F32 ? 4 : 2),
                                  cudaMemcpyHostToDevice, st));
        dysrc = l->stage;
    }
    const bf16 *dyrows = (const bf16 *)dysrc;
    if (l->sorted) {
        PHASE("b.gather");
        KCU_TRY(kcu_gather_rows(dysrc, dy_dtype, l->tok, l->offs + Et, S, H, ye, 0, st));
        dyrows = ye;
    } else if (dy_dtype != MOE_BF16 || on_host) {
        KCU_TRY(kcu_to_bf16(dysrc, dy_dtype, ye, n, st));
        dyrows = ye;
    }
    if (counts_global)
        KCU_CHECK(cudaMemcpyAsync(l->cglob, counts_global, E * 4, cudaMemcpyHostToDevice, st));
    else
        KCU_CHECK(cudaMemcpyAsync(l->cglob, l->counts, E * 4, cudaMemcpyDeviceToDevice, st));

    PHASE("b.dh");
    /* dh: (da, db) in place of (a, b), w*h in place of h, dwpart */
    const kcu_ffn f = layer_ffn(l);
    KCU_TRY(
        kcu_ffn_dh(&f, dyrows, l->sorted ? nullptr : l->tok, l->topk_w, l->perm, l->dwpart, st));
    const int32_t *spos = l->cap_fwd[l->state] < INT32_MAX ? l->spos : nullptr;
    if (spos) /* dropped slots get dL/dw = 0 */
        KCU_CHECK(cudaMemsetAsync(l->dw, 0, (size_t)S * 4, st));
    KCU_TRY(kcu_dw_reduce(l, S, st));
    KCU_TRY(kcu_router_bwd(l, T, T_global > 0 ? T_global : T, aux_coef, z_coef, st));
    if (l->sh) {
        /* the shared expert held apart: with a gate, dlogits[:, E] (which
         * k_router_bwd left zero) and its dy rows g dy into sy (ys is read
         * there first, element by element); its backward (dy from sy or
         * the staged dy, dx rows into sy, weight gradients accumulated in
         * the kcu_experts), before the router part of dx reads dlogits */
        PHASE("b.shared");
        const void *sdy = dysrc;
        moe_dtype sdt = dy_dtype;
        if (l->sh_gate) {
            KCU_TRY(kcu_shared_gate_bwd(dysrc, dy_dtype, l->sy, l->logits + E, l->Ep, T, H, l->sy,
                                        l->dlogits + E, st));
            sdy = l->sy;
            sdt = MOE_BF16;
        }
        KCU_TRY(kcu_experts_backward(l->sh, sdy, sdt, l->sy, MOE_BF16, st));
    }
    PHASE("b.dw2"); /* before b.dx overwrites the dy rows in ye */
    /* dW2_e += dy_e^T (w h)_e: dy sorted rows, or token rows through tok */
    KCU_TRY(kcu_ffn_dw2(&f, dyrows, l->sorted ? nullptr : l->tok, st));

    PHASE("b.dx");
    /* dx per slot (into ye) = dab w13_e */
    KCU_TRY(kcu_ffn_dx(&f, ye, MOE_BF16, l->perm, st));

    PHASE("b.router_dx");
    /* router part: dxr (T,H) = dlogits (T,Ep) wr (Ep,H); in h when dW2 is done */
    float *dxr = l->dxr ? l->dxr : reinterpret_cast<float *>(l->h);
    kcu_gemm_args a;
    memset(&a, 0, sizeof(a));
    a.A = l->dlogits;
    a.lda = l->Ep;
    a.B = l->wr;
    a.ldb = H;
    a.M = T;
    a.N = H;
    a.K = l->Ep;
    a.Cf = dxr;
    a.ldc = H;
    KCU_TRY(kcu_gemm(KCU_A_K, KCU_B_N, KCU_EPI_F32, &a, l->nsm, st));

    const int xhost = kcu_is_host_ptr(dx);
    if (xhost)
        KCU_TRY(ensure_stage(l));
    if (l->sh) /* plus the shared expert's dx rows */
        KCU_TRY(kcu_shared_combine(ye, nullptr, spos, nullptr, dxr, l->sy, nullptr, 0, T, Kt, H,
                                   xhost ? (void *)l->stage : dx, dx_dtype, st));
    else
        KCU_TRY(kcu_combine(ye, nullptr, dxr, spos, T, Kt, H, xhost ? (void *)l->stage : dx,
                            dx_dtype, 0, st));
    if (xhost)
        KCU_CHECK(cudaMemcpyAsync(dx, l->stage, n * (dx_dtype == MOE_F32 ? 4 : 2),
                                  cudaMemcpyDeviceToHost, st));

    PHASE("b.dw13");
    /* weight gradients, grouped over each expert's rows */
    /* sorted x (S,H), or x (T,H) through tok */
    KCU_TRY(kcu_ffn_dw13(&f, l->xg ? l->xg : l->xs, l->xg ? nullptr : l->tok, st));

    memset(&a, 0, sizeof(a));
    a.A = l->dlogits; /* (T,Ep): k = token, m = expert */
    a.lda = l->Ep;
    a.B = l->xs;
    a.ldb = H;
    a.M = l->Ep;
    a.N = H;
    a.K = T;
    a.ngroups = 1;
    a.ldc = H;
    PHASE("b.dwr");
    /* dWr has Ep/128 x H/256 output tiles over T-deep k (8 tiles for
     * Qwen3): split k into P row ranges whose partials go to h (free since
     * the router part of dx), then add them in order */
    const int P = dwr_split(l, T);
    if (P > 1) {
        KCU_TRY(kcu_split_offs(l->chunk, T, P, st));
        a.ngroups = P;
        a.offs = l->chunk;
        a.Cf = reinterpret_cast<float *>(l->h);
        a.c_gstride = (long long)l->Ep * H;
        a.beta0 = 1;
        KCU_TRY(kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, l->nsm, st));
        KCU_TRY(kcu_sum_parts(a.Cf, P, (size_t)l->Ep * H, l->g_wr, l->grads_clean, st));
    } else {
        a.Cf = l->g_wr;
        a.beta0 = l->grads_clean;
        KCU_TRY(kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, l->nsm, st));
    }
    PHASE("end");
    l->grads_clean = 0;
    l->T_fwd[l->state] = 0; /* the saved state was consumed in place */
    return MOE_OK;
}

extern "C" moe_err kcu_layer_set_capacity(kcu_layer *l, float capacity_factor)
{
    if (!(capacity_factor >= 0.0f)) /* NaN too */
        return MOE_EINVAL;
    l->c.capacity_factor = capacity_factor;
    return MOE_OK;
}

/* kcu_stats_span: bytes of the workspace's span counts .. dropped (carve_ws
 * lays them side by side) */
size_t kcu_stats_span(const kcu_layer *l)
{
    const char *d0 = reinterpret_cast<const char *>(l->counts);
    return (size_t)(reinterpret_cast<const char *>(l->dropped) - d0) + (size_t)l->c.E * 4;
}

/* kcu_stats_host: l->stats_h (page-locked, mapped: l->stats_map its device
 * address, NULL where the device cannot address it), made once */
moe_err kcu_stats_host(kcu_layer *l)
{
    if (l->stats_h)
        return MOE_OK;
    void *p = nullptr;
    if (cudaHostAlloc(&p, kcu_stats_span(l), cudaHostAllocMapped) != cudaSuccess) {
        (void)cudaGetLastError();
        return MOE_ENOMEM;
    }
    l->stats_h = (int32_t *)p;
    void *d = nullptr;
    if (cudaHostGetDevicePointer(&d, p, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        d = nullptr;
    }
    l->stats_map = (int32_t *)d;
    return MOE_OK;
}

extern "C" moe_err kcu_forward_stats(kcu_layer *l, int32_t *counts, int32_t *dropped,
                                     float *aux_loss, float *z_loss, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    const int E = l->c.E;
    /* counts, stats and dropped lie side by side in the workspace
     * (carve_ws): one copy into pinned memory and one wait for all three
     * (a decode call is tens of microseconds: each copy's launch counts);
     * no copy where the decode chain's last kernel wrote them there */
    const char *d0 = reinterpret_cast<const char *>(l->counts);
    const size_t o_stats = reinterpret_cast<const char *>(l->stats) - d0;
    const size_t o_drop = reinterpret_cast<const char *>(l->dropped) - d0;
    KCU_TRY(kcu_stats_host(l));
    const char *h0 = reinterpret_cast<const char *>(l->stats_h);
    if (!l->stats_in_host)
        KCU_CHECK(cudaMemcpyAsync(l->stats_h, d0, kcu_stats_span(l), cudaMemcpyDeviceToHost, st));
    KCU_CHECK(cudaStreamSynchronize(st));
    const float *hs = reinterpret_cast<const float *>(h0 + o_stats);
    if (counts)
        memcpy(counts, h0, (size_t)E * 4);
    if (dropped)
        memcpy(dropped, h0 + o_drop, (size_t)E * 4);
    if (aux_loss)
        *aux_loss = hs[0];
    if (z_loss)
        *z_loss = hs[1];
    return MOE_OK;
}
