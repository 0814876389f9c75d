/* act.c - expert activations (SwiGLU, GELU erf form), forward and backward,
 * on arrays: one function pair per activation in act_ops (indexed by the
 * act_id of common/act.h), plain loops inside. */
#include <math.h>

#include "kernels/kern.h"

#define INV_SQRT2    0.70710678118654752f
#define INV_SQRT_2PI 0.39894228040143268f

/* SwiGLU: h = silu(a) b. */
static void swiglu_forward(const float *a, const float *b, size_t n, float *h)
{
    for (size_t i = 0; i < n; i++)
        h[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
}

/* silu'(a) = sig(a) (1 + a (1 - sig(a))); dh may alias da (read first). */
static void swiglu_backward(const float *a, const float *b, const float *dh, size_t n, float *da,
                            float *db)
{
    for (size_t i = 0; i < n; i++) {
        float sg = 1.0f / (1.0f + expf(-a[i]));
        float g = dh[i];
        db[i] = g * a[i] * sg;
        da[i] = g * b[i] * sg * (1.0f + a[i] * (1.0f - sg));
    }
}

/* GELU (erf form): h = a Phi(a); b unused. */
static void gelu_forward(const float *a, const float *b, size_t n, float *h)
{
    for (size_t i = 0; i < n; i++)
        h[i] = 0.5f * a[i] * (1.0f + erff(a[i] * INV_SQRT2));
}

/* gelu'(a) = Phi(a) + a phi(a); b and db unused. */
static void gelu_backward(const float *a, const float *b, const float *dh, size_t n, float *da,
                          float *db)
{
    for (size_t i = 0; i < n; i++) {
        float cdf = 0.5f * (1.0f + erff(a[i] * INV_SQRT2));
        float pdf = INV_SQRT_2PI * expf(-0.5f * a[i] * a[i]);
        da[i] = dh[i] * (cdf + a[i] * pdf);
    }
}

/* One row per act_id, in the order of common/act.h's act_rows. */
static const kern_act_ops act_ops[] = {
    [ACT_SWIGLU] = {swiglu_forward, swiglu_backward},
    [ACT_GELU] = {gelu_forward, gelu_backward},
};
_Static_assert(sizeof act_ops / sizeof act_ops[0] == ACT_COUNT,
               "kernels/act.c act_ops needs one row per act_id of common/act.h");

const kern_act_ops *kern_act_ops_of(kern_act act)
{
    return act_valid((int)act) ? &act_ops[act] : NULL;
}

void kern_act_forward_n(kern_act act, const float *a, const float *b, size_t n, int bf16, float *h)
{
    act_ops[act].forward(a, b, n, h);
    if (bf16)
        kern_bf16_round_n(h, n);
}

void kern_act_backward_n(kern_act act, const float *a, const float *b, const float *dh, size_t n,
                         float *da, float *db)
{
    act_ops[act].backward(a, b, dh, n, da, db);
}
