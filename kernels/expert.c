/* expert.c - expert FFN reference (plain loops), forward and backward, on
 * the N rows routed to one expert. No scratch: one (n, f) element at a time. */
#include "kernels/kern.h"

void kern_expert_ffn_cpu(const float *x, int N, int H, int F, const float *w1, const float *w3,
                         const float *w2, kern_act act, int bf16, float *a_out, float *b_out,
                         float *y)
{
    /* x (N,H), w1 w3 (F,H), w2 (H,F), a_out b_out (N,F), y (N,H) */
    int gated = act_gated(act);
    for (int n = 0; n < N; n++) {
        const float *xn = x + (size_t)n * H;
        float *yn = y + (size_t)n * H;
        for (int i = 0; i < H; i++)
            yn[i] = 0.0f;
        for (int f = 0; f < F; f++) {
            const float *w1f = w1 + (size_t)f * H;
            float a = 0.0f, b = 0.0f, h;
            for (int i = 0; i < H; i++)
                a += xn[i] * w1f[i];
            if (gated) {
                const float *w3f = w3 + (size_t)f * H;
                for (int i = 0; i < H; i++)
                    b += xn[i] * w3f[i];
            }
            kern_act_forward_n(act, &a, &b, 1, bf16, &h);
            if (a_out)
                a_out[(size_t)n * F + f] = a;
            if (b_out && gated)
                b_out[(size_t)n * F + f] = b;
            for (int i = 0; i < H; i++) /* y[n,:] += h w2[:,f], summed over f in order */
                yn[i] += h * w2[(size_t)i * F + f];
        }
    }
}

void kern_expert_ffn_backward_cpu(const float *x, const float *a, const float *b, const float *dy,
                                  int N, int H, int F, const float *w1, const float *w3,
                                  const float *w2, kern_act act, float *dx, float *dw1, float *dw3,
                                  float *dw2)
{
    /* x (N,H), a b (N,F), dy (N,H), w1 w3 (F,H), w2 (H,F);
     * dx (N,H) out, dw1 dw3 (F,H) +=, dw2 (H,F) += */
    int gated = act_gated(act);
    for (int n = 0; n < N; n++) {
        const float *xn = x + (size_t)n * H;
        const float *dyn = dy + (size_t)n * H;
        float *dxn = dx + (size_t)n * H;
        for (int i = 0; i < H; i++)
            dxn[i] = 0.0f;
        for (int f = 0; f < F; f++) {
            float an = a[(size_t)n * F + f];
            float bn = gated ? b[(size_t)n * F + f] : 0.0f;
            float h, dh = 0.0f, da, db = 0.0f;
            kern_act_forward_n(act, &an, &bn, 1, 0, &h);
            for (int i = 0; i < H; i++) {
                dh += dyn[i] * w2[(size_t)i * F + f];
                dw2[(size_t)i * F + f] += dyn[i] * h;
            }
            kern_act_backward_n(act, &an, &bn, &dh, 1, &da, &db);
            const float *w1f = w1 + (size_t)f * H;
            float *dw1f = dw1 + (size_t)f * H;
            for (int i = 0; i < H; i++) {
                dxn[i] += da * w1f[i];
                dw1f[i] += da * xn[i];
            }
            if (gated) {
                const float *w3f = w3 + (size_t)f * H;
                float *dw3f = dw3 + (size_t)f * H;
                for (int i = 0; i < H; i++) {
                    dxn[i] += db * w3f[i];
                    dw3f[i] += db * xn[i];
                }
            }
        }
    }
}
