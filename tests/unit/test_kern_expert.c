/* test_kern_expert.c - the OpenBLAS fast paths (expert FFN forward and
 * backward, router logits) against the plain-loop reference: SwiGLU and
 * GELU, N = 0, N = 1, the few-row sgemv path (N <= KERN_BLAS_GEMV_ROWS) and
 * the row count after it, odd sizes, and a size whose activation is split
 * over threads; f32 within 1e-5 relative. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"
#include "common/rng.h"

static void expect_rel(const char *name, const float *got, const float *want, size_t n, double tol)
{
    double r = kern_rel_err(got, want, n);
    if (!(r <= tol))
        kern_print_mismatches(name, got, want, n, tol, 8);
    cr_expect(r <= tol, "%s: rel err %.3g > %.3g", name, r, tol);
}

static float *rnd(uint64_t seed, uint64_t stream, size_t n, float scale)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    cr_assert(p);
    rng_fill_uniform(seed, stream, -scale, scale, p, n);
    return p;
}

typedef struct {
    int N, H, F;
} ffn_shape;

static const ffn_shape shapes[] = {
    {0, 8, 12},
    {1, 8, 12},
    {1, 1, 1},
    {13, 17, 23},
    {5, 3, 29},
    {64, 96, 160},
    {37, 64, 45},
    {2, 33, 20},
    {KERN_BLAS_GEMV_ROWS, 19, 31},
    {KERN_BLAS_GEMV_ROWS + 1, 19, 31},
    {300, 24, 2 * KERN_PAR_GRAIN_ACT / 300 + 64}, /* N*F > 2 grains: split act */
};

static void check_forward(ffn_shape sh, kern_act act, int bf16, double tol)
{
    int N = sh.N, H = sh.H, F = sh.F;
    size_t nh = (size_t)N * H, nf = (size_t)N * F, fh = (size_t)F * H;
    uint64_t seed = 100 + (uint64_t)N * 7 + (uint64_t)H * 13 + (uint64_t)F;
    float *x = rnd(seed, 0, nh, 1.0f);
    float *w1 = rnd(seed, 1, fh, 1.0f / sqrtf((float)H));
    float *w3 = rnd(seed, 2, fh, 1.0f / sqrtf((float)H));
    float *w2 = rnd(seed, 3, fh, 1.0f / sqrtf((float)F));
    if (bf16) {
        kern_bf16_round_n(x, nh);
        kern_bf16_round_n(w1, fh);
        kern_bf16_round_n(w3, fh);
        kern_bf16_round_n(w2, fh);
    }
    float *ya = rnd(seed, 4, nh, 1.0f), *yb = rnd(seed, 5, nh, 1.0f);
    float *aa = rnd(seed, 6, nf, 1.0f), *ab = rnd(seed, 7, nf, 1.0f);
    float *ba = rnd(seed, 8, nf, 1.0f), *bb = rnd(seed, 9, nf, 1.0f);
    float *yc = rnd(seed, 10, nh, 1.0f);
    int swiglu = act == KERN_ACT_SWIGLU;

    kern_expert_ffn_cpu(x, N, H, F, w1, swiglu ? w3 : NULL, w2, act, bf16, aa, swiglu ? ba : NULL,
                        ya);
    kern_expert_ffn_blas(x, N, H, F, w1, swiglu ? w3 : NULL, w2, act, bf16, ab, swiglu ? bb : NULL,
                         yb);
    /* and with no a/b outputs: the blas path allocates its own */
    kern_expert_ffn_blas(x, N, H, F, w1, swiglu ? w3 : NULL, w2, act, bf16, NULL, NULL, yc);
    char name[64];
    snprintf(name, sizeof(name), "y N=%d H=%d F=%d act=%d bf16=%d", N, H, F, act, bf16);
    expect_rel(name, yb, ya, nh, tol);
    expect_rel("y (no a/b out)", yc, ya, nh, tol);
    expect_rel("a", ab, aa, nf, 1e-5);
    if (swiglu)
        expect_rel("b", bb, ba, nf, 1e-5);
    if (bf16) {
        for (size_t i = 0; i < nh; i++)
            cr_assert(isfinite(ya[i]));
    }
    free(x), free(w1), free(w3), free(w2), free(ya), free(yb), free(yc);
    free(aa), free(ab), free(ba), free(bb);
}

Test(kern_expert, forward_blas_matches_ref)
{
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        check_forward(shapes[i], KERN_ACT_SWIGLU, 0, 1e-5);
        check_forward(shapes[i], KERN_ACT_GELU, 0, 1e-5);
    }
}

Test(kern_expert, forward_blas_same_bits_for_any_thread_count)
{
    /* only the activation's split changes with kern_par_set_threads (the
     * BLAS keeps its own threads): y, a, b must not change by one bit */
    const int N = 300, H = 24, F = 2 * KERN_PAR_GRAIN_ACT / 300 + 64;
    size_t nh = (size_t)N * H, nf = (size_t)N * F, fh = (size_t)F * H;
    float *x = rnd(7, 0, nh, 1.0f), *w1 = rnd(7, 1, fh, 0.2f), *w3 = rnd(7, 2, fh, 0.2f);
    float *w2 = rnd(7, 3, fh, 0.1f);
    float *y[2] = {rnd(7, 4, nh, 1.0f), rnd(7, 5, nh, 1.0f)};
    float *a[2] = {rnd(7, 6, nf, 1.0f), rnd(7, 7, nf, 1.0f)};
    float *b[2] = {rnd(7, 8, nf, 1.0f), rnd(7, 9, nf, 1.0f)};
    const int th[2] = {1, 3};
    for (int act = 0; act < 2; act++) {
        for (int k = 0; k < 2; k++) {
            kern_par_set_threads(th[k]);
            kern_expert_ffn_blas(x, N, H, F, w1, w3, w2, (kern_act)act, act == 0, a[k], b[k], y[k]);
        }
        cr_expect(memcmp(y[0], y[1], nh * sizeof(float)) == 0, "y differs, act %d", act);
        cr_expect(memcmp(a[0], a[1], nf * sizeof(float)) == 0, "a differs, act %d", act);
    }
    kern_par_set_threads(0);
    free(x), free(w1), free(w3), free(w2);
    for (int k = 0; k < 2; k++)
        free(y[k]), free(a[k]), free(b[k]);
}

Test(kern_expert, forward_bf16_blas_matches_ref)
{
    /* h is rounded to bf16: a one-ulp difference at a rounding boundary is
     * allowed, so the tolerance is looser than f32's */
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        check_forward(shapes[i], KERN_ACT_SWIGLU, 1, 2e-3);
        check_forward(shapes[i], KERN_ACT_GELU, 1, 2e-3);
    }
}

Test(kern_expert, forward_n0_leaves_y_alone)
{
    float w[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, y = 42.0f;
    kern_expert_ffn_blas(w, 0, 3, 4, w, w, w, KERN_ACT_SWIGLU, 0, NULL, NULL, &y);
    kern_expert_ffn_cpu(w, 0, 3, 4, w, w, w, KERN_ACT_SWIGLU, 0, NULL, NULL, &y);
    cr_expect_eq(y, 42.0f);
}

static void check_backward(ffn_shape sh, kern_act act)
{
    int N = sh.N, H = sh.H, F = sh.F;
    size_t nh = (size_t)N * H, nf = (size_t)N * F, fh = (size_t)F * H;
    uint64_t seed = 500 + (uint64_t)N * 7 + (uint64_t)H * 13 + (uint64_t)F;
    int swiglu = act == KERN_ACT_SWIGLU;
    float *x = rnd(seed, 0, nh, 1.0f);
    float *w1 = rnd(seed, 1, fh, 1.0f / sqrtf((float)H));
    float *w3 = rnd(seed, 2, fh, 1.0f / sqrtf((float)H));
    float *w2 = rnd(seed, 3, fh, 1.0f / sqrtf((float)F));
    float *dy = rnd(seed, 4, nh, 1.0f);
    float *a = malloc((nf + 1) * sizeof(float)), *b = malloc((nf + 1) * sizeof(float));
    float *y = malloc((nh + 1) * sizeof(float));
    kern_expert_ffn_cpu(x, N, H, F, w1, w3, w2, act, 0, a, b, y);
    /* gradients accumulate: start both from the same nonzero values */
    float *g[2][3], *dx[2];
    for (int k = 0; k < 2; k++) {
        for (int j = 0; j < 3; j++)
            g[k][j] = rnd(seed, 10 + j, fh, 0.5f);
        dx[k] = rnd(seed, 20 + k, nh, 3.0f); /* overwritten */
    }
    float *g0[3] = {rnd(seed, 10, fh, 0.5f), rnd(seed, 11, fh, 0.5f), rnd(seed, 12, fh, 0.5f)};
    kern_expert_ffn_backward_cpu(x, a, swiglu ? b : NULL, dy, N, H, F, w1, swiglu ? w3 : NULL, w2,
                                 act, dx[0], g[0][0], swiglu ? g[0][1] : NULL, g[0][2]);
    kern_expert_ffn_backward_blas(x, a, swiglu ? b : NULL, dy, N, H, F, w1, swiglu ? w3 : NULL, w2,
                                  act, dx[1], g[1][0], swiglu ? g[1][1] : NULL, g[1][2]);
    char name[80];
    snprintf(name, sizeof(name), "dx N=%d H=%d F=%d act=%d", N, H, F, act);
    expect_rel(name, dx[1], dx[0], nh, 1e-5);
    /* compare the increments, so that the accumulated base does not hide errors */
    for (int j = 0; j < 3; j++) {
        if (j == 1 && !swiglu) {
            cr_expect(memcmp(g[0][1], g0[1], fh * sizeof(float)) == 0, "GELU touched dw3");
            cr_expect(memcmp(g[1][1], g0[1], fh * sizeof(float)) == 0, "GELU touched dw3");
            continue;
        }
        for (size_t i = 0; i < fh; i++) {
            g[0][j][i] -= g0[j][i];
            g[1][j][i] -= g0[j][i];
        }
        snprintf(name, sizeof(name), "%s N=%d H=%d F=%d act=%d",
                 j == 0   ? "dw1"
                 : j == 1 ? "dw3"
                          : "dw2",
                 N, H, F, act);
        if (N == 0) {
            for (size_t i = 0; i < fh; i++)
                cr_assert(g[0][j][i] == 0.0f && g[1][j][i] == 0.0f, "%s changed with N=0", name);
        } else {
            expect_rel(name, g[1][j], g[0][j], fh, 1e-5);
        }
    }
    free(x), free(w1), free(w3), free(w2), free(dy), free(a), free(b), free(y);
    for (int k = 0; k < 2; k++) {
        free(dx[k]);
        for (int j = 0; j < 3; j++)
            free(g[k][j]);
    }
    for (int j = 0; j < 3; j++)
        free(g0[j]);
}

Test(kern_expert, backward_blas_matches_ref)
{
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        check_backward(shapes[i], KERN_ACT_SWIGLU);
        check_backward(shapes[i], KERN_ACT_GELU);
    }
}

Test(kern_expert, router_logits_blas_matches_ref)
{
    enum { T = 19, H = 33, E = 7 };
    float *x = rnd(1, 0, T * H, 1.0f), *wr = rnd(1, 1, E * H, 0.2f);
    float la[T * E], lb[T * E];
    kern_router_logits_cpu(x, wr, T, H, E, la);
    kern_router_logits_blas(x, wr, T, H, E, lb);
    expect_rel("logits", lb, la, T * E, 1e-5);
    free(x), free(wr);
}

/* kern_experts_ffn_blas (all of a worker's experts at once, column blocks on
 * threads) against kern_expert_ffn_blas expert by expert: rows 0, 1, the
 * sgemv count and after it, several blocks of d_ff (256) and d_model (512)
 * with ragged ends, kept < n (dropped rows zero), gated and not, bf16
 * rounding; and the abort callback stops it. */
static int abort_now(void)
{
    return 1;
}

static void check_experts(kern_act act, int bf16)
{
    enum { NE = 6, H = 600, F = 300 };
    static const int32_t n[NE] = {0, 1, KERN_BLAS_GEMV_ROWS, KERN_BLAS_GEMV_ROWS + 1, 37, 70};
    static const int32_t kept[NE] = {0, 1, KERN_BLAS_GEMV_ROWS, KERN_BLAS_GEMV_ROWS + 1, 30, 70};
    const int gated = act_gated(act);
    size_t rows = 0;
    for (int i = 0; i < NE; i++)
        rows += (size_t)n[i];
    const size_t fh = (size_t)F * H;
    uint64_t seed = 900 + (uint64_t)act * 3 + (uint64_t)bf16;
    float *x = rnd(seed, 0, rows * H, 1.0f);
    float *w1 = rnd(seed, 1, NE * fh, 1.0f / sqrtf((float)H));
    float *w3 = rnd(seed, 2, NE * fh, 1.0f / sqrtf((float)H));
    float *w2 = rnd(seed, 3, NE * fh, 1.0f / sqrtf((float)F));
    float *a = calloc(rows * F, sizeof(float)), *b = calloc(rows * F, sizeof(float));
    float *h = calloc(rows * F, sizeof(float)), *y = malloc(rows * H * sizeof(float));
    float *a1 = calloc(rows * F, sizeof(float)), *b1 = calloc(rows * F, sizeof(float));
    float *y1 = calloc(rows * H, sizeof(float));
    cr_assert(a && b && h && y && a1 && b1 && y1);
    for (size_t i = 0; i < rows * H; i++)
        y[i] = NAN; /* every row written, the dropped ones with zeros */
    cr_assert_eq(kern_experts_ffn_blas(x, n, kept, NE, H, F, w1, gated ? w3 : NULL, w2, act, bf16,
                                       a, gated ? b : NULL, h, y, NULL),
                 0);
    size_t r0 = 0;
    for (int i = 0; i < NE; i++) {
        if (kept[i])
            kern_expert_ffn_blas(x + r0 * H, kept[i], H, F, w1 + i * fh, gated ? w3 + i * fh : NULL,
                                 w2 + i * fh, act, bf16, a1 + r0 * F, gated ? b1 + r0 * F : NULL,
                                 y1 + r0 * H);
        char name[64];
        snprintf(name, sizeof(name), "expert %d (n %d kept %d) y", i, n[i], kept[i]);
        expect_rel(name, y + r0 * H, y1 + r0 * H, (size_t)kept[i] * H, 1e-5);
        snprintf(name, sizeof(name), "expert %d a", i);
        expect_rel(name, a + r0 * F, a1 + r0 * F, (size_t)kept[i] * F, 1e-5);
        if (gated) {
            snprintf(name, sizeof(name), "expert %d b", i);
            expect_rel(name, b + r0 * F, b1 + r0 * F, (size_t)kept[i] * F, 1e-5);
        }
        for (size_t k = (r0 + (size_t)kept[i]) * H; k < (r0 + (size_t)n[i]) * H; k++)
            cr_assert(y[k] == 0.0f, "expert %d: dropped row value %g at %zu", i, y[k], k);
        r0 += (size_t)n[i];
    }
    /* asked to stop before the first block: returns 1 */
    cr_expect_eq(kern_experts_ffn_blas(x, n, kept, NE, H, F, w1, gated ? w3 : NULL, w2, act, bf16,
                                       a, gated ? b : NULL, h, y, abort_now),
                 1);
    free(x), free(w1), free(w3), free(w2), free(a), free(b), free(h), free(y);
    free(a1), free(b1), free(y1);
}

Test(kern_expert, experts_at_once_swiglu)
{
    check_experts(KERN_ACT_SWIGLU, 0);
}

Test(kern_expert, experts_at_once_swiglu_bf16)
{
    check_experts(KERN_ACT_SWIGLU, 1);
}

Test(kern_expert, experts_at_once_gelu)
{
    check_experts(KERN_ACT_GELU, 0);
}
