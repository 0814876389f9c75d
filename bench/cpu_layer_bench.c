/*
 * cpu_layer_bench.c - one MoE layer forward on the CPU through the kernels
 * the CPU worker runs (worker/forward.c, one worker, dropless, f32):
 *   gate     kern_router_logits_blas, kern_softmax_topk_cpu (renormalised
 *            top-k), kern_layout_cpu
 *   dispatch the token rows copied into expert order (fwd_pack_by_owner:
 *            kern_rows_gather_par, on the BLAS's thread count)
 *   experts  kern_experts_ffn_blas (SwiGLU): every expert's rows at once,
 *            column blocks of their GEMMs on the threads, with the worker's
 *            (rows, d_ff) a/b buffers
 *   combine  rows back to slot order (fwd_unpack_sorted:
 *            kern_rows_scatter_par), kern_combine_par
 * Buffers are allocated once per T and kept across forwards, as the
 * worker's buffer pool keeps them (--fresh-buffers: malloc'd per forward,
 * as before the pool). Not a test: it times (bench/cpu_peer.py runs it
 * once per OpenBLAS core, beside PyTorch).
 *
 *   bin/cpu_layer_bench [--pick] [--fresh-buffers] [--T 1,4096] [--H 4096]
 *                       [--F 2048] [--E 8] [--K 2] [--warm-s 1] [--reps 5]
 *                       [--dump FILE] [--crossover NMAX]
 *
 * --pick calls blas_pick_reexec first, as the worker's main does.
 * --crossover NMAX times one expert's FFN on n = 1..NMAX rows through sgemm
 * and through one sgemv per row (what kern_expert_ffn_blas chooses between,
 * KERN_BLAS_GEMV_ROWS), prints "CROSSOVER n=.. sgemm_ms=.. gemv_ms=.."
 * (medians of reps) and exits. Prints once "BLAS <blas_pick_describe>", and
 * for each T "RESULT T=.. median_ms=.. min_ms=.. gflops=.. reps=.." and
 * "PHASES T=.. gate=.. dispatch=.. experts=.. combine=.. act_alone=..": the
 * medians of the phases, and of the SwiGLU activation timed alone on the
 * same number of values (it is part of "experts"). --dump FILE runs one forward at the
 * first T and writes int32 T,H,F,E,K then f32 x, wr, w1, w3, w2, y (the
 * weights in nn.Linear layout, kern.h) for the Python side's check.
 */
#include <cblas.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "worker/blas_pick.h"
#include "kernels/kern.h"
#include "common/rng.h"

typedef struct {
    int H, F, E, K;
    float *wr, *w1, *w3, *w2; /* (E,H), (E,F,H), (E,F,H), (E,H,F) */
    int fresh;                /* --fresh-buffers: malloc the buffers per forward */
} layer;

/* One forward's buffers (S = T*K slots): owned by the caller of bufs_alloc,
 * freed with bufs_free. */
typedef struct {
    float *logits, *probs, *tw;    /* (T,E), (T,E), (T,K) */
    int32_t *ti, *perm;            /* (T,K), (S) */
    int32_t *counts, *offsets;     /* (E), (E+1) */
    float *xe, *ye, *ys, *ae, *be; /* (S,H), (S,H), (S,H), (S,F), (S,F) */
    float *h;                      /* (S,F) the experts' workspace */
} bufs;

static void bufs_free(bufs *b)
{
    free(b->logits), free(b->probs), free(b->tw), free(b->ti), free(b->perm);
    free(b->counts), free(b->offsets);
    free(b->xe), free(b->ye), free(b->ys), free(b->ae), free(b->be), free(b->h);
    memset(b, 0, sizeof(*b));
}

/* bufs_alloc: 0, or -1 out of memory (nothing left allocated). */
static int bufs_alloc(const layer *L, int T, bufs *b)
{
    const size_t S = (size_t)T * L->K, E = (size_t)L->E;
    b->logits = malloc((size_t)T * E * sizeof(float));
    b->probs = malloc((size_t)T * E * sizeof(float));
    b->tw = malloc(S * sizeof(float));
    b->ti = malloc(S * sizeof(int32_t));
    b->perm = malloc(S * sizeof(int32_t));
    b->counts = malloc(E * sizeof(int32_t));
    b->offsets = malloc((E + 1) * sizeof(int32_t));
    b->xe = malloc(S * L->H * sizeof(float));
    b->ye = malloc(S * L->H * sizeof(float));
    b->ys = malloc(S * L->H * sizeof(float));
    b->ae = malloc(S * L->F * sizeof(float));
    b->be = malloc(S * L->F * sizeof(float));
    b->h = malloc(S * L->F * sizeof(float));
    if (!b->logits || !b->probs || !b->tw || !b->ti || !b->perm || !b->counts || !b->offsets ||
        !b->xe || !b->ye || !b->ys || !b->ae || !b->be || !b->h) {
        bufs_free(b);
        return -1;
    }
    return 0;
}

/* Seconds of the last forward's phases: gate, dispatch, experts, combine. */
enum { PH_GATE, PH_DISPATCH, PH_EXPERTS, PH_COMBINE, NPH };
static const char *ph_name[NPH] = {"gate", "dispatch", "experts", "combine"};
static double ph_last[NPH];

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* run_experts: every expert's rows through the FFN at once, as the worker
 * runs them (kern_experts_ffn_blas; phase "experts"). */
static void run_experts(const layer *L, const bufs *b)
{
    (void)kern_experts_ffn_blas(b->xe, b->counts, b->counts, L->E, L->H, L->F, L->w1, L->w3, L->w2,
                                KERN_ACT_SWIGLU, 0, b->ae, b->be, b->h, b->ye, NULL);
}

/* forward: y (T,H) = the layer on x (T,H), in the buffers b (from
 * bufs_alloc for this T; with --fresh-buffers, allocated and freed here).
 * Returns 0, or -1 out of memory. */
static int forward(const layer *L, bufs *kept, const float *x, int T, float *y)
{
    const int H = L->H, E = L->E, K = L->K;
    const size_t S = (size_t)T * K;
    bufs fresh;
    bufs *b = kept;
    double t0 = now_s(), t1, t2, t3;
    if (L->fresh) {
        memset(&fresh, 0, sizeof(fresh));
        if (bufs_alloc(L, T, &fresh) != 0)
            return -1;
        b = &fresh;
    }
    kern_router_logits_blas(x, L->wr, T, H, E, b->logits);
    kern_softmax_topk_cpu(b->logits, T, E, K, 1, b->probs, b->ti, b->tw);
    kern_layout_cpu(b->ti, T, K, E, b->counts, b->offsets, b->perm, NULL);
    t1 = now_s();
    kern_rows_gather_par(b->xe, x, b->perm, K, S, H);
    t2 = now_s();
    run_experts(L, b);
    t3 = now_s();
    kern_rows_scatter_par(b->ys, b->ye, b->perm, S, H);
    kern_combine_par(b->ys, b->tw, NULL, T, K, H, 0, y);
    ph_last[PH_GATE] = t1 - t0;
    ph_last[PH_DISPATCH] = t2 - t1;
    ph_last[PH_EXPERTS] = t3 - t2;
    ph_last[PH_COMBINE] = now_s() - t3;
    if (L->fresh)
        bufs_free(&fresh);
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* act_ms: the SwiGLU activation alone over the layer's T*K*F values, as
 * kern_expert_ffn_blas runs it (kern_act_forward_par), median of reps. */
static double act_ms(const layer *L, int T, int reps)
{
    size_t n = (size_t)T * L->K * L->F;
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    float *h = malloc(n * sizeof(float));
    double *t = malloc((size_t)reps * sizeof(double)), med = -1;
    if (a && b && h && t) {
        rng_fill_uniform(9, 0, -4.0f, 4.0f, a, n);
        rng_fill_uniform(9, 1, -4.0f, 4.0f, b, n);
        kern_act_forward_par(KERN_ACT_SWIGLU, a, b, n, 0, h);
        for (int r = 0; r < reps; r++) {
            double t0 = now_s();
            kern_act_forward_par(KERN_ACT_SWIGLU, a, b, n, 0, h);
            t[r] = now_s() - t0;
        }
        med = median(t, reps) * 1e3;
    }
    free(a), free(b), free(h), free(t);
    return med;
}

/* ffn_sgemm, ffn_gemv: one expert's SwiGLU FFN on n rows, y (n,H) from
 * x (n,H), through sgemm (3 calls) or one sgemv per row and matrix; a b h
 * (n,F) scratch. What --crossover compares. */
static void ffn_sgemm(const layer *L, int n, const float *x, float *a, float *b, float *h, float *y)
{
    const int H = L->H, F = L->F;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, F, H, 1.0f, x, H, L->w1, H, 0.0f, a, F);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, F, H, 1.0f, x, H, L->w3, H, 0.0f, b, F);
    kern_act_forward_n(KERN_ACT_SWIGLU, a, b, (size_t)n * F, 0, h);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, H, F, 1.0f, h, F, L->w2, F, 0.0f, y, H);
}

static void ffn_gemv(const layer *L, int n, const float *x, float *a, float *b, float *h, float *y)
{
    const int H = L->H, F = L->F;
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * H;
        float *ar = a + (size_t)r * F, *br = b + (size_t)r * F, *hr = h + (size_t)r * F;
        cblas_sgemv(CblasRowMajor, CblasNoTrans, F, H, 1.0f, L->w1, H, xr, 1, 0.0f, ar, 1);
        cblas_sgemv(CblasRowMajor, CblasNoTrans, F, H, 1.0f, L->w3, H, xr, 1, 0.0f, br, 1);
        kern_act_forward_n(KERN_ACT_SWIGLU, ar, br, (size_t)F, 0, hr);
        cblas_sgemv(CblasRowMajor, CblasNoTrans, H, F, 1.0f, L->w2, F, hr, 1, 0.0f,
                    y + (size_t)r * H, 1);
    }
}

/* crossover: for n = 1..nmax, medians of reps calls of ffn_sgemm and
 * ffn_gemv on expert 0 (alternating, after one call of each). */
static int crossover(const layer *L, int nmax, int reps)
{
    const size_t nh = (size_t)nmax * L->H, nf = (size_t)nmax * L->F;
    float *x = malloc(nh * sizeof(float)), *y = malloc(nh * sizeof(float));
    float *y2 = malloc(nh * sizeof(float)), *a = malloc(nf * sizeof(float));
    float *b = malloc(nf * sizeof(float)), *h = malloc(nf * sizeof(float));
    double *tg = malloc((size_t)reps * sizeof(double)), *tv = malloc((size_t)reps * sizeof(double));
    int rc = -1;
    if (!x || !y || !y2 || !a || !b || !h || !tg || !tv)
        goto out;
    rng_fill_uniform(7, 0, -1.0f, 1.0f, x, nh);
    for (int n = 1; n <= nmax; n++) {
        ffn_sgemm(L, n, x, a, b, h, y);
        ffn_gemv(L, n, x, a, b, h, y2);
        double err = kern_rel_err(y2, y, (size_t)n * L->H);
        for (int r = 0; r < reps; r++) {
            double t0 = now_s();
            ffn_sgemm(L, n, x, a, b, h, y);
            double t1 = now_s();
            ffn_gemv(L, n, x, a, b, h, y2);
            tg[r] = t1 - t0;
            tv[r] = now_s() - t1;
        }
        printf("CROSSOVER n=%d sgemm_ms=%.4f gemv_ms=%.4f rel_err=%.3g\n", n,
               median(tg, reps) * 1e3, median(tv, reps) * 1e3, err);
        fflush(stdout);
    }
    rc = 0;
out:
    free(x), free(y), free(y2), free(a), free(b), free(h), free(tg), free(tv);
    return rc;
}

/* time_T: warm-up for warm_s (at least one call), then reps timed calls;
 * prints the medians of the whole forward and of its phases. */
static int time_T(const layer *L, int T, double warm_s, int reps)
{
    float *x = malloc((size_t)T * L->H * sizeof(float));
    float *y = malloc((size_t)T * L->H * sizeof(float));
    double *t = malloc((size_t)reps * (NPH + 1) * sizeof(double));
    bufs b;
    int rc = -1;
    memset(&b, 0, sizeof(b));
    if (!x || !y || !t || (!L->fresh && bufs_alloc(L, T, &b) != 0))
        goto out;
    rng_fill_uniform(7, (uint64_t)T, -1.0f, 1.0f, x, (size_t)T * L->H);
    double w0 = now_s();
    do {
        if (forward(L, &b, x, T, y) != 0)
            goto out;
    } while (now_s() - w0 < warm_s);
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        if (forward(L, &b, x, T, y) != 0)
            goto out;
        t[r] = now_s() - t0;
        for (int p = 0; p < NPH; p++)
            t[(size_t)(p + 1) * reps + r] = ph_last[p];
    }
    double mn = t[0];
    for (int r = 1; r < reps; r++)
        mn = t[r] < mn ? t[r] : mn;
    double med = median(t, reps);
    double flop = 2.0 * T * L->K * 3.0 * L->H * L->F + 2.0 * T * L->H * L->E;
    printf("RESULT T=%d median_ms=%.4f min_ms=%.4f gflops=%.2f reps=%d\n", T, med * 1e3, mn * 1e3,
           flop / med * 1e-9, reps);
    printf("PHASES T=%d", T);
    for (int p = 0; p < NPH; p++)
        printf(" %s=%.4f", ph_name[p], median(t + (size_t)(p + 1) * reps, reps) * 1e3);
    printf(" act_alone=%.4f (ms, medians)\n", act_ms(L, T, reps));
    fflush(stdout);
    rc = 0;
out:
    bufs_free(&b);
    free(x), free(y), free(t);
    return rc;
}

static int dump(const layer *L, int T, const char *path)
{
    size_t th = (size_t)T * L->H, eh = (size_t)L->E * L->H, efh = eh * L->F;
    float *x = malloc(th * sizeof(float)), *y = malloc(th * sizeof(float));
    FILE *f = fopen(path, "wb");
    bufs b;
    int rc = -1;
    memset(&b, 0, sizeof(b));
    if (!x || !y || !f || bufs_alloc(L, T, &b) != 0)
        goto out;
    rng_fill_uniform(7, (uint64_t)T, -1.0f, 1.0f, x, th);
    if (forward(L, &b, x, T, y) != 0)
        goto out;
    int32_t hdr[5] = {T, L->H, L->F, L->E, L->K};
    int ok = fwrite(hdr, sizeof(hdr), 1, f) == 1 && fwrite(x, sizeof(float), th, f) == th &&
             fwrite(L->wr, sizeof(float), eh, f) == eh &&
             fwrite(L->w1, sizeof(float), efh, f) == efh &&
             fwrite(L->w3, sizeof(float), efh, f) == efh &&
             fwrite(L->w2, sizeof(float), efh, f) == efh && fwrite(y, sizeof(float), th, f) == th;
    rc = ok ? 0 : -1;
out:
    if (f && fclose(f) != 0)
        rc = -1;
    bufs_free(&b);
    free(x), free(y);
    return rc;
}

static int layer_init(layer *L)
{
    size_t fh = (size_t)L->F * L->H, efh = fh * L->E;
    L->wr = malloc((size_t)L->E * L->H * sizeof(float));
    L->w1 = malloc(efh * sizeof(float));
    L->w3 = malloc(efh * sizeof(float));
    L->w2 = malloc(efh * sizeof(float));
    if (!L->wr || !L->w1 || !L->w3 || !L->w2)
        return -1;
    kern_init_weight(1, 0, 0, KERN_W_ROUTER, L->E, L->H, L->wr);
    for (int e = 0; e < L->E; e++) {
        kern_init_weight(1, 0, e, KERN_W1, L->F, L->H, L->w1 + e * fh);
        kern_init_weight(1, 0, e, KERN_W3, L->F, L->H, L->w3 + e * fh);
        kern_init_weight(1, 0, e, KERN_W2, L->H, L->F, L->w2 + e * fh);
    }
    return 0;
}

int main(int argc, char **argv)
{
    layer L = {4096, 2048, 8, 2, NULL, NULL, NULL, NULL, 0};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--pick") == 0)
            blas_pick_reexec(argc, argv);
        L.fresh |= strcmp(argv[i], "--fresh-buffers") == 0;
    }
    const char *Ts = "1,4096", *dump_path = NULL;
    double warm_s = 1.0;
    int reps = 5, nmax = 0;
    for (int i = 1; i + 1 < argc; i++) {
        const char *k = argv[i], *v = argv[i + 1];
        int used = 1;
        if (strcmp(k, "--T") == 0)
            Ts = v;
        else if (strcmp(k, "--H") == 0)
            L.H = atoi(v);
        else if (strcmp(k, "--F") == 0)
            L.F = atoi(v);
        else if (strcmp(k, "--E") == 0)
            L.E = atoi(v);
        else if (strcmp(k, "--K") == 0)
            L.K = atoi(v);
        else if (strcmp(k, "--warm-s") == 0)
            warm_s = atof(v);
        else if (strcmp(k, "--reps") == 0)
            reps = atoi(v);
        else if (strcmp(k, "--dump") == 0)
            dump_path = v;
        else if (strcmp(k, "--crossover") == 0)
            nmax = atoi(v);
        else
            used = 0;
        i += used;
    }
    if (L.H < 1 || L.F < 1 || L.E < 1 || L.K < 1 || L.K > L.E || reps < 1) {
        fprintf(stderr, "cpu_layer_bench: bad shape or reps\n");
        return 2;
    }
    char desc[256];
    printf("BLAS %s\n", blas_pick_describe(desc, sizeof(desc)));
    if (layer_init(&L) != 0) {
        fprintf(stderr, "cpu_layer_bench: out of memory for the weights\n");
        return 1;
    }
    if (nmax > 0)
        return crossover(&L, nmax, reps) == 0 ? 0 : 1;
    const char *p = Ts;
    while (*p) {
        int T = atoi(p);
        if (T < 1) {
            fprintf(stderr, "cpu_layer_bench: bad T list '%s'\n", Ts);
            return 2;
        }
        if (dump_path)
            return dump(&L, T, dump_path) == 0 ? 0 : 1;
        if (time_T(&L, T, warm_s, reps) != 0) {
            fprintf(stderr, "cpu_layer_bench: out of memory at T=%d\n", T);
            return 1;
        }
        p += strcspn(p, ",");
        p += *p == ',';
    }
    return 0;
}
