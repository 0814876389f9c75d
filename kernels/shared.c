/* shared.c - the shared expert (Qwen2-MoE, DeepSeek-V2/V3): a dense expert
 * that every token goes through, optionally gated by sigmoid(x . wsg). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"

/* gate_of: sigmoid(x_t . wsg) for one row x_t (H). */
static float gate_of(const float *xt, const float *wsg, int H)
{
    float acc = 0.0f;
    for (int h = 0; h < H; h++)
        acc += xt[h] * wsg[h];
    return 1.0f / (1.0f + expf(-acc));
}

moe_err kern_shared_forward_cpu(const float *x, int T, int H, int Fs, const float *ws1,
                                const float *ws3, const float *ws2, const float *wsg, kern_act act,
                                int bf16, int blas, float *y)
{
    if (T <= 0 || Fs <= 0)
        return MOE_OK;
    float *ys = malloc((size_t)T * H * sizeof(float)); /* (T,H) shared expert output */
    if (!ys)
        return MOE_ENOMEM;
    if (blas)
        kern_expert_ffn_blas(x, T, H, Fs, ws1, ws3, ws2, act, bf16, NULL, NULL, ys);
    else
        kern_expert_ffn_cpu(x, T, H, Fs, ws1, ws3, ws2, act, bf16, NULL, NULL, ys);
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * H;
        const float *st = ys + (size_t)t * H;
        float *yt = y + (size_t)t * H;
        float g = wsg ? gate_of(xt, wsg, H) : 1.0f;
        for (int h = 0; h < H; h++) {
            float row = g * st[h];
            if (bf16)
                row = kern_bf16_round_inl(row);
            float sum = yt[h] + row;
            yt[h] = bf16 ? kern_bf16_round_inl(sum) : sum;
        }
    }
    free(ys);
    return MOE_OK;
}

moe_err kern_shared_backward_cpu(const float *x, const float *dy, int T, int H, int Fs,
                                 const float *ws1, const float *ws3, const float *ws2,
                                 const float *wsg, kern_act act, int bf16, int blas, float *dx,
                                 float *dws1, float *dws3, float *dws2, float *dwsg)
{
    if (T <= 0 || Fs <= 0)
        return MOE_OK;
    size_t th = (size_t)T * H, tf = (size_t)T * Fs;
    /* ys, dys, dxs (T,H); a, b (T,Fs) */
    float *buf = malloc((3 * th + 2 * tf) * sizeof(float));
    if (!buf)
        return MOE_ENOMEM;
    float *ys = buf, *dys = buf + th, *dxs = buf + 2 * th, *a = buf + 3 * th, *b = a + tf;
    if (blas)
        kern_expert_ffn_blas(x, T, H, Fs, ws1, ws3, ws2, act, bf16, a, b, ys);
    else
        kern_expert_ffn_cpu(x, T, H, Fs, ws1, ws3, ws2, act, bf16, a, b, ys);
    /* y += g ys:  dys = g dy;  dg = <dy, ys>;  dlogit = g (1 - g) dg */
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * H, *dyt = dy + (size_t)t * H;
        const float *st = ys + (size_t)t * H;
        float *dst = dys + (size_t)t * H;
        if (!wsg) {
            memcpy(dst, dyt, (size_t)H * sizeof(float));
            continue;
        }
        float g = gate_of(xt, wsg, H), dg = 0.0f;
        for (int h = 0; h < H; h++) {
            dst[h] = g * dyt[h];
            dg += dyt[h] * st[h];
        }
        float dl = g * (1.0f - g) * dg;
        float *dxt = dx + (size_t)t * H;
        for (int h = 0; h < H; h++) {
            dwsg[h] += dl * xt[h];
            dxt[h] += dl * wsg[h];
        }
    }
    if (blas)
        kern_expert_ffn_backward_blas(x, a, b, dys, T, H, Fs, ws1, ws3, ws2, act, dxs, dws1, dws3,
                                      dws2);
    else
        kern_expert_ffn_backward_cpu(x, a, b, dys, T, H, Fs, ws1, ws3, ws2, act, dxs, dws1, dws3,
                                     dws2);
    for (size_t i = 0; i < th; i++)
        dx[i] += dxs[i];
    free(buf);
    return MOE_OK;
}
