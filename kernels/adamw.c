/* adamw.c - AdamW step and the sum of squares for global-norm clipping. */
#include <math.h>

#include "kernels/kern.h"

void kern_adamw_cpu(float *p, const float *g, float *m, float *v, size_t n, float lr, float beta1,
                    float beta2, float eps, float wd, int64_t step, float grad_scale)
{
    /* p g m v (n) */
    if (step < 1)
        step = 1;
    float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
    float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * grad_scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1;
        float vhat = vi / bc2;
        p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p[i]);
    }
}

double kern_sumsq_cpu(const float *g, size_t n)
{
    double acc = 0.0;
    for (size_t i = 0; i < n; i++)
        acc += (double)g[i] * g[i];
    return acc;
}
