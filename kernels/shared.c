/* shared.c - the shared expert (Qwen2-MoE, DeepSeek-V2/V3): a dense expert
 * that every token goes through, optionally gated by sigmoid(x . wsg). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"
#include "common/combine.h"

/* gate_of: sigmoid(x_t . wsg) for one row x_t (H). */
static float gate_of(const float *xt, const float *wsg, int H)
{
    float acc = 0.0f;
    for (int h = 0; h < H; h++)
        acc += xt[h] * wsg[h];
    return 1.0f / (1.0f + expf(-acc));
}

void kern_shared_rows_cpu(const float *x, int T, int H, int Fs, const float *ws1, const float *ws3,
                          const float *ws2, const float *wsg, kern_act act, int bf16, int blas,
                          float *rows)
{
    if (T <= 0 || Fs <= 0)
        return;
    if (blas)
        kern_expert_ffn_blas(x, T, H, Fs, ws1, ws3, ws2, act, bf16, NULL, NULL, rows);
    else
        kern_expert_ffn_cpu(x, T, H, Fs, ws1, ws3, ws2, act, bf16, NULL, NULL, rows);
    for (int t = 0; t < T; t++) {
        float *rt = rows + (size_t)t * H;
        float g = wsg ? gate_of(x + (size_t)t * H, wsg, H) : 1.0f;
        for (int h = 0; h < H; h++) {
            float row = g * rt[h];
            rt[h] = bf16 ? kern_bf16_round_inl(row) : row;
        }
    }
}

moe_err kern_shared_forward_cpu(const float *x, int T, int H, int Fs, const float *ws1,
                                const float *ws3, const float *ws2, const float *wsg, kern_act act,
                                int bf16, int blas, float *y)
{
    if (T <= 0 || Fs <= 0)
        return MOE_OK;
    float *rows = malloc((size_t)T * H * sizeof(float)); /* (T,H) the gated shared rows */
    if (!rows)
        return MOE_ENOMEM;
    kern_shared_rows_cpu(x, T, H, Fs, ws1, ws3, ws2, wsg, act, bf16, blas, rows);
    moe_rows_add(y, rows, (size_t)T * H, bf16); /* as libmoe's fan-out adds them */
    free(rows);
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
