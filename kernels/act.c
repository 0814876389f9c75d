/* act.c - expert activations (SwiGLU, GELU erf form), forward and backward,
 * on arrays: one switch per call, plain loops inside. */
#include <math.h>

#include "kernels/kern.h"

#define INV_SQRT2    0.70710678118654752f
#define INV_SQRT_2PI 0.39894228040143268f

void kern_act_forward_n(kern_act act, const float *a, const float *b, size_t n, int bf16, float *h)
{
    if (act == KERN_ACT_GELU) {
        for (size_t i = 0; i < n; i++)
            h[i] = 0.5f * a[i] * (1.0f + erff(a[i] * INV_SQRT2));
    } else {
        for (size_t i = 0; i < n; i++)
            h[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
    }
    if (bf16)
        kern_bf16_round_n(h, n);
}

void kern_act_backward_n(kern_act act, const float *a, const float *b, const float *dh, size_t n,
                         float *da, float *db)
{
    if (act == KERN_ACT_GELU) {
        /* gelu'(a) = Phi(a) + a * phi(a) */
        for (size_t i = 0; i < n; i++) {
            float cdf = 0.5f * (1.0f + erff(a[i] * INV_SQRT2));
            float pdf = INV_SQRT_2PI * expf(-0.5f * a[i] * a[i]);
            da[i] = dh[i] * (cdf + a[i] * pdf);
        }
    } else {
        /* h = silu(a) b; silu'(a) = sig(a) (1 + a (1 - sig(a))) */
        for (size_t i = 0; i < n; i++) {
            float sg = 1.0f / (1.0f + expf(-a[i]));
            float g = dh[i];
            db[i] = g * a[i] * sg;
            da[i] = g * b[i] * sg * (1.0f + a[i] * (1.0f - sg));
        }
    }
}
