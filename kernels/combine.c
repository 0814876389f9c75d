/* combine.c - weighted sum of a token's K expert rows, in fixed order, and
 * its backward. */
#include "kernels/kern.h"
#include "common/combine.h"

void kern_combine_cpu(const float *ye, const float *topk_w, const uint8_t *keep, int T, int K,
                      int H, int bf16, float *y)
{
    /* ye (S,H), topk_w (T,K), keep (S) or NULL, y (T,H): the one sum that
     * libmoe's fan-out makes too (common/combine.c) */
    moe_combine_rows(ye, topk_w, keep, T, K, H, bf16, y);
}

void kern_combine_backward_cpu(const float *dy, const float *ye_unweighted, const float *topk_w,
                               const uint8_t *keep, int T, int K, int H, float *dye, float *dw)
{
    /* dy (T,H), ye_unweighted (S,H), topk_w (T,K), keep (S) or NULL;
     * dye (S,H) out, dw (T,K) out */
    for (int t = 0; t < T; t++) {
        const float *dyt = dy + (size_t)t * H;
        for (int j = 0; j < K; j++) {
            size_t s = (size_t)t * K + j;
            float *dys = dye + s * H;
            if (keep && !keep[s]) {
                for (int i = 0; i < H; i++)
                    dys[i] = 0.0f;
                dw[s] = 0.0f;
                continue;
            }
            const float *ys = ye_unweighted + s * H;
            float w = topk_w[s], acc = 0.0f;
            for (int i = 0; i < H; i++) {
                dys[i] = w * dyt[i];
                acc += dyt[i] * ys[i];
            }
            dw[s] = acc;
        }
    }
}
