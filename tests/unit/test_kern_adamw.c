/* test_kern_adamw.c - AdamW against hand-computed values (one step) and an
 * independent float64 loop (several steps, clipping scale, weight decay);
 * sum of squares. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "kernels/kern.h"
#include "common/rng.h"

Test(kern_adamw, one_step_by_hand)
{
    /* step 1 from m = v = 0: mhat = g, vhat = g^2, so the update is
     * lr * (g / (|g| + eps) + wd * p) */
    float p[3] = {1.0f, -2.0f, 0.5f};
    const float g[3] = {0.5f, -0.25f, 0.0f};
    float m[3] = {0}, v[3] = {0};
    kern_adamw_cpu(p, g, m, v, 3, 0.1f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1.0f);
    cr_expect_float_eq(p[0], 1.0f - 0.1f * (1.0f + 0.01f * 1.0f), 1e-6f, "p0 %.9g", (double)p[0]);
    cr_expect_float_eq(p[1], -2.0f - 0.1f * (-1.0f + 0.01f * -2.0f), 1e-6f, "p1 %.9g",
                       (double)p[1]);
    cr_expect_float_eq(p[2], 0.5f - 0.1f * 0.01f * 0.5f, 1e-7f, "p2 %.9g", (double)p[2]);
    cr_expect_float_eq(m[0], 0.05f, 1e-7f);
    cr_expect_float_eq(v[0], 0.001f * 0.25f, 1e-8f);
    cr_expect_float_eq(m[1], -0.025f, 1e-7f);
    /* grad_scale halves g: the first step is unchanged (scale cancels, up
     * to eps) but m and v see the scaled gradient */
    float q = 1.0f, mq = 0.0f, vq = 0.0f;
    const float gq = 0.5f;
    kern_adamw_cpu(&q, &gq, &mq, &vq, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 0.5f);
    cr_expect_float_eq(q, 0.9f, 1e-6f);
    cr_expect_float_eq(mq, 0.025f, 1e-7f);
    /* step 0 counts as 1 */
    float r = 1.0f, mr = 0.0f, vr = 0.0f;
    kern_adamw_cpu(&r, &gq, &mr, &vr, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, 0, 1.0f);
    cr_expect_float_eq(r, 0.9f, 1e-6f);
}

Test(kern_adamw, several_steps_vs_double)
{
    enum { N = 257, STEPS = 6 };
    float *p = malloc(N * sizeof(float)), *g = malloc(N * sizeof(float));
    float *m = calloc(N, sizeof(float)), *v = calloc(N, sizeof(float));
    double *pd = malloc(N * sizeof(double)), *md = calloc(N, sizeof(double)),
           *vd = calloc(N, sizeof(double));
    rng_fill_uniform(50, 0, -1.0f, 1.0f, p, N);
    for (int i = 0; i < N; i++)
        pd[i] = p[i];
    const double lr = 3e-3, b1 = 0.9, b2 = 0.95, eps = 1e-6, wd = 0.1, scale = 0.7;
    for (int step = 1; step <= STEPS; step++) {
        rng_fill_uniform(50, (uint64_t)step, -2.0f, 2.0f, g, N);
        kern_adamw_cpu(p, g, m, v, N, (float)lr, (float)b1, (float)b2, (float)eps, (float)wd, step,
                       (float)scale);
        for (int i = 0; i < N; i++) {
            double gi = g[i] * scale;
            md[i] = b1 * md[i] + (1 - b1) * gi;
            vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
            double mh = md[i] / (1 - pow(b1, step)), vh = vd[i] / (1 - pow(b2, step));
            pd[i] -= lr * (mh / (sqrt(vh) + eps) + wd * pd[i]);
        }
    }
    double maxerr = 0.0;
    int worst = 0;
    for (int i = 0; i < N; i++) {
        double d = fabs(p[i] - pd[i]);
        if (d > maxerr)
            maxerr = d, worst = i;
    }
    cr_expect(maxerr < 1e-6, "p[%d] = %.9g, want %.9g", worst, (double)p[worst], pd[worst]);
    for (int i = 0; i < N; i++) {
        cr_expect(fabs(m[i] - md[i]) < 1e-6, "m[%d]", i);
        cr_expect(fabs(v[i] - vd[i]) < 1e-6, "v[%d]", i);
    }
    free(p), free(g), free(m), free(v), free(pd), free(md), free(vd);
}

Test(kern_adamw, sumsq)
{
    const float g[4] = {1.0f, -2.0f, 3.0f, 0.5f};
    cr_expect_eq(kern_sumsq_cpu(g, 4), 14.25);
    cr_expect_eq(kern_sumsq_cpu(g, 0), 0.0);
    enum { N = 100000 };
    float *r = malloc(N * sizeof(float));
    rng_fill_uniform(51, 0, -1.0f, 1.0f, r, N);
    double want = 0.0;
    for (int i = 0; i < N; i++)
        want += (double)r[i] * r[i];
    cr_expect(fabs(kern_sumsq_cpu(r, N) - want) <= 1e-12 * want);
    free(r);
}
