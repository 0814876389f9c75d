/*
 * cpu_layer_bench.c - one MoE layer forward on the CPU through the kernels
 * the CPU worker runs (worker/forward.c, one worker, dropless, f32):
 *   gate     kern_router_logits_blas, kern_softmax_topk_cpu (renormalised
 *            top-k), kern_layout_cpu
 *   dispatch the token rows copied into expert order (fwd_pack_by_owner)
 *   experts  kern_expert_ffn_blas (SwiGLU) on each expert's rows, with the
 *            worker's (rows, d_ff) a/b buffers
 *   combine  rows back to slot order (fwd_unpack_sorted), kern_combine_cpu
 * Buffers are malloc'd per forward, as the worker does. Not a test: it times
 * (bench/cpu_peer.py runs it once per OpenBLAS core, beside PyTorch).
 *
 *   bin/cpu_layer_bench [--pick] [--gemv1] [--T 1,4096] [--H 4096] [--F 2048]
 *                       [--E 8] [--K 2] [--warm-s 1] [--reps 5] [--dump FILE]
 *
 * --pick calls blas_pick_reexec first, as the worker's main does. --gemv1
 * runs experts with one row through three sgemv instead (not the worker's
 * path: it measures what that change would give, after checking that the
 * output is the sgemm path's). Prints once "BLAS <blas_pick_describe>", and
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

#include "blas_pick.h"
#include "kern.h"

typedef struct {
    int H, F, E, K;
    float *wr, *w1, *w3, *w2; /* (E,H), (E,F,H), (E,F,H), (E,H,F) */
    int gemv1;                /* --gemv1: one-row experts through sgemv */
} layer;

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

/* expert_gemv: kern_expert_ffn_blas's result for one row through three
 * sgemv (what --gemv1 measures; the worker's kernel takes sgemm). */
static void expert_gemv(const layer *L, const float *x, const float *w1, const float *w3,
                        const float *w2, float *a, float *b, float *h, float *y)
{
    const int H = L->H, F = L->F;
    cblas_sgemv(CblasRowMajor, CblasNoTrans, F, H, 1.0f, w1, H, x, 1, 0.0f, a, 1);
    cblas_sgemv(CblasRowMajor, CblasNoTrans, F, H, 1.0f, w3, H, x, 1, 0.0f, b, 1);
    kern_act_forward_n(KERN_ACT_SWIGLU, a, b, (size_t)F, 0, h);
    cblas_sgemv(CblasRowMajor, CblasNoTrans, H, F, 1.0f, w2, F, h, 1, 0.0f, y, 1);
}

/* run_experts: each expert's rows through the FFN (phase "experts"). */
static int run_experts(const layer *L, const int32_t *counts, const int32_t *offsets,
                       const float *xe, float *ae, float *be, float *ye)
{
    const int H = L->H, F = L->F;
    const size_t fh = (size_t)F * H;
    float *h = L->gemv1 ? malloc((size_t)F * sizeof(float)) : NULL;
    if (L->gemv1 && !h)
        return -1;
    for (int e = 0; e < L->E; e++) {
        size_t n0 = (size_t)offsets[e];
        if (counts[e] == 1 && h)
            expert_gemv(L, xe + n0 * H, L->w1 + e * fh, L->w3 + e * fh, L->w2 + e * fh, ae + n0 * F,
                        be + n0 * F, h, ye + n0 * H);
        else if (counts[e])
            kern_expert_ffn_blas(xe + n0 * H, counts[e], H, F, L->w1 + e * fh, L->w3 + e * fh,
                                 L->w2 + e * fh, KERN_ACT_SWIGLU, 0, ae + n0 * F, be + n0 * F,
                                 ye + n0 * H);
    }
    free(h);
    return 0;
}

/* forward: y (T,H) = the layer on x (T,H). Returns 0, or -1 out of memory. */
static int forward(const layer *L, const float *x, int T, float *y)
{
    const int H = L->H, F = L->F, E = L->E, K = L->K;
    const size_t S = (size_t)T * K;
    float *logits = malloc((size_t)T * E * sizeof(float));
    float *probs = malloc((size_t)T * E * sizeof(float));
    float *tw = malloc(S * sizeof(float));
    int32_t *ti = malloc(S * sizeof(int32_t)), *perm = malloc(S * sizeof(int32_t));
    int32_t *counts = malloc((size_t)E * sizeof(int32_t));
    int32_t *offsets = malloc(((size_t)E + 1) * sizeof(int32_t));
    float *xe = malloc(S * H * sizeof(float)), *ye = malloc(S * H * sizeof(float));
    float *ys = malloc(S * H * sizeof(float));
    float *ae = malloc(S * F * sizeof(float)), *be = malloc(S * F * sizeof(float));
    int rc = -1;
    double t0 = now_s(), t1, t2, t3;
    if (!logits || !probs || !tw || !ti || !perm || !counts || !offsets || !xe || !ye || !ys ||
        !ae || !be)
        goto out;
    kern_router_logits_blas(x, L->wr, T, H, E, logits);
    kern_softmax_topk_cpu(logits, T, E, K, 1, probs, ti, tw);
    kern_layout_cpu(ti, T, K, E, counts, offsets, perm, NULL);
    t1 = now_s();
    for (size_t i = 0; i < S; i++)
        memcpy(xe + i * H, x + (size_t)(perm[i] / K) * H, (size_t)H * sizeof(float));
    t2 = now_s();
    if (run_experts(L, counts, offsets, xe, ae, be, ye) != 0)
        goto out;
    t3 = now_s();
    for (size_t i = 0; i < S; i++)
        memcpy(ys + (size_t)perm[i] * H, ye + i * H, (size_t)H * sizeof(float));
    kern_combine_cpu(ys, tw, NULL, T, K, H, 0, y);
    ph_last[PH_GATE] = t1 - t0;
    ph_last[PH_DISPATCH] = t2 - t1;
    ph_last[PH_EXPERTS] = t3 - t2;
    ph_last[PH_COMBINE] = now_s() - t3;
    rc = 0;
out:
    free(logits), free(probs), free(tw), free(ti), free(perm), free(counts), free(offsets);
    free(xe), free(ye), free(ys), free(ae), free(be);
    return rc;
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

/* act_ms: the SwiGLU activation alone over the layer's T*K*F values
 * (single-threaded, inside kern_expert_ffn_blas), median of reps. */
static double act_ms(const layer *L, int T, int reps)
{
    size_t n = (size_t)T * L->K * L->F;
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    float *h = malloc(n * sizeof(float));
    double *t = malloc((size_t)reps * sizeof(double)), med = -1;
    if (a && b && h && t) {
        kern_fill_uniform(9, 0, -4.0f, 4.0f, a, n);
        kern_fill_uniform(9, 1, -4.0f, 4.0f, b, n);
        kern_act_forward_n(KERN_ACT_SWIGLU, a, b, n, 0, h);
        for (int r = 0; r < reps; r++) {
            double t0 = now_s();
            kern_act_forward_n(KERN_ACT_SWIGLU, a, b, n, 0, h);
            t[r] = now_s() - t0;
        }
        med = median(t, reps) * 1e3;
    }
    free(a), free(b), free(h), free(t);
    return med;
}

/* gemv1_check: rel err of the --gemv1 forward against the sgemm one. */
static double gemv1_check(layer *L, const float *x, int T)
{
    size_t n = (size_t)T * L->H;
    float *y0 = malloc(n * sizeof(float)), *y1 = malloc(n * sizeof(float));
    double r = -1;
    int g = L->gemv1;
    L->gemv1 = 0;
    if (y0 && y1 && forward(L, x, T, y0) == 0) {
        L->gemv1 = 1;
        if (forward(L, x, T, y1) == 0)
            r = kern_rel_err(y1, y0, n);
    }
    L->gemv1 = g;
    free(y0), free(y1);
    return r;
}

/* time_T: warm-up for warm_s (at least one call), then reps timed calls;
 * prints the medians of the whole forward and of its phases. */
static int time_T(layer *L, int T, double warm_s, int reps)
{
    float *x = malloc((size_t)T * L->H * sizeof(float));
    float *y = malloc((size_t)T * L->H * sizeof(float));
    double *t = malloc((size_t)reps * (NPH + 1) * sizeof(double));
    int rc = -1;
    if (!x || !y || !t)
        goto out;
    kern_fill_uniform(7, (uint64_t)T, -1.0f, 1.0f, x, (size_t)T * L->H);
    if (L->gemv1)
        printf("GEMV1_CHECK T=%d rel_err_vs_sgemm=%.3g\n", T, gemv1_check(L, x, T));
    double w0 = now_s();
    do {
        if (forward(L, x, T, y) != 0)
            goto out;
    } while (now_s() - w0 < warm_s);
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        if (forward(L, x, T, y) != 0)
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
    free(x), free(y), free(t);
    return rc;
}

static int dump(const layer *L, int T, const char *path)
{
    size_t th = (size_t)T * L->H, eh = (size_t)L->E * L->H, efh = eh * L->F;
    float *x = malloc(th * sizeof(float)), *y = malloc(th * sizeof(float));
    FILE *f = fopen(path, "wb");
    int rc = -1;
    if (!x || !y || !f)
        goto out;
    kern_fill_uniform(7, (uint64_t)T, -1.0f, 1.0f, x, th);
    if (forward(L, x, T, y) != 0)
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
        L.gemv1 |= strcmp(argv[i], "--gemv1") == 0;
    }
    const char *Ts = "1,4096", *dump_path = NULL;
    double warm_s = 1.0;
    int reps = 5;
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
