/* expert_blas.c - expert FFN through OpenBLAS sgemm (CPU workers' fast
 * path). Same contract as expert.c; scratch is malloc'd per call and the
 * plain loops take over if that fails. Experts with few rows go through one
 * sgemv per row (KERN_BLAS_GEMV_ROWS); the activations run over threads
 * (par.c). */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"

void kern_expert_ffn_blas(const float *x, int N, int H, int F, const float *w1, const float *w3,
                          const float *w2, kern_act act, int bf16, float *a_out, float *b_out,
                          float *y)
{
    /* x (N,H), w1 w3 (F,H), w2 (H,F), a_out b_out (N,F), y (N,H) */
    if (N <= 0 || H <= 0)
        return;
    if (F <= 0) {
        memset(y, 0, (size_t)N * H * sizeof(float));
        return;
    }
    int gated = act_gated(act);
    size_t nf = (size_t)N * F;
    int need_a = a_out == NULL, need_b = gated && b_out == NULL;
    float *scratch = malloc((1 + need_a + need_b) * nf * sizeof(float));
    if (!scratch) {
        kern_expert_ffn_cpu(x, N, H, F, w1, w3, w2, act, bf16, a_out, b_out, y);
        return;
    }
    float *h = scratch;                                /* (N,F) */
    float *a = need_a ? scratch + nf : a_out;          /* (N,F) */
    float *b = need_b ? h + (1 + need_a) * nf : b_out; /* (N,F), SwiGLU only */

    if (N <= KERN_BLAS_GEMV_ROWS) {
        /* few rows (decode): matrix-vector products, row by row; sgemm would
         * pack the whole weight matrix for a handful of rows
         * (bench/history/service.md, CPU backend) */
        for (int r = 0; r < N; r++) {
            const float *xr = x + (size_t)r * H;
            float *ar = a + (size_t)r * F, *br = gated ? b + (size_t)r * F : NULL;
            float *hr = h + (size_t)r * F;
            cblas_sgemv(CblasRowMajor, CblasNoTrans, F, H, 1.0f, w1, H, xr, 1, 0.0f, ar, 1);
            if (gated)
                cblas_sgemv(CblasRowMajor, CblasNoTrans, F, H, 1.0f, w3, H, xr, 1, 0.0f, br, 1);
            kern_act_forward_n(act, ar, br, (size_t)F, bf16, hr);
            cblas_sgemv(CblasRowMajor, CblasNoTrans, H, F, 1.0f, w2, F, hr, 1, 0.0f,
                        y + (size_t)r * H, 1);
        }
        free(scratch);
        return;
    }
    /* a = x w1^T, b = x w3^T: (N,H) x (H,F) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, F, H, 1.0f, x, H, w1, H, 0.0f, a, F);
    if (gated)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, F, H, 1.0f, x, H, w3, H, 0.0f, b,
                    F);
    kern_act_forward_par(act, a, gated ? b : NULL, nf, bf16, h);
    /* y = h w2^T: (N,F) x (F,H) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, H, F, 1.0f, h, F, w2, F, 0.0f, y, H);
    free(scratch);
}

void kern_expert_ffn_backward_blas(const float *x, const float *a, const float *b, const float *dy,
                                   int N, int H, int F, const float *w1, const float *w3,
                                   const float *w2, kern_act act, float *dx, float *dw1, float *dw3,
                                   float *dw2)
{
    /* x (N,H), a b (N,F), dy (N,H), w1 w3 (F,H), w2 (H,F);
     * dx (N,H) out, dw1 dw3 (F,H) +=, dw2 (H,F) += */
    if (N <= 0 || H <= 0)
        return;
    if (F <= 0) {
        memset(dx, 0, (size_t)N * H * sizeof(float));
        return;
    }
    int gated = act_gated(act);
    size_t nf = (size_t)N * F;
    float *scratch = malloc((gated ? 3 : 2) * nf * sizeof(float));
    if (!scratch) {
        kern_expert_ffn_backward_cpu(x, a, b, dy, N, H, F, w1, w3, w2, act, dx, dw1, dw3, dw2);
        return;
    }
    float *h = scratch;                 /* (N,F) */
    float *da = scratch + nf;           /* (N,F): dh, then da in place */
    float *db = gated ? da + nf : NULL; /* (N,F) */

    kern_act_forward_par(act, a, gated ? b : NULL, nf, 0, h);
    /* dh = dy w2: (N,H) x (H,F) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, F, H, 1.0f, dy, H, w2, F, 0.0f, da,
                F);
    /* dw2 += dy^T h: (H,N) x (N,F) */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, F, N, 1.0f, dy, H, h, F, 1.0f, dw2, F);
    kern_act_backward_par(act, a, gated ? b : NULL, da, nf, da, db);
    /* dx = da w1 + db w3: (N,F) x (F,H) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, H, F, 1.0f, da, F, w1, H, 0.0f, dx,
                H);
    /* dw1 += da^T x, dw3 += db^T x: (F,N) x (N,H) */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, H, N, 1.0f, da, F, x, H, 1.0f, dw1, H);
    if (gated) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, H, F, 1.0f, db, F, w3, H, 1.0f,
                    dx, H);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, H, N, 1.0f, db, F, x, H, 1.0f, dw3,
                    H);
    }
    free(scratch);
}
