/* combine.c - the weighted sum of expert rows and the shared rows' sum;
 * see combine.h. */
#include "common/combine.h"

#include <stddef.h>

#include "base/bf16.h"

void moe_combine_rows(const float *ye, const float *topk_w, const uint8_t *keep, int T, int K,
                      int H, int bf16, float *y)
{
    /* ye (S,H), topk_w (T,K), keep (S) or NULL, y (T,H) */
    for (int t = 0; t < T; t++) {
        float *yt = y + (size_t)t * H;
        for (int i = 0; i < H; i++)
            yt[i] = 0.0f;
        for (int j = 0; j < K; j++) {
            size_t s = (size_t)t * K + j;
            if (keep && !keep[s])
                continue;
            float w = topk_w[s];
            const float *ys = ye + s * H;
            if (bf16) {
                for (int i = 0; i < H; i++)
                    yt[i] += bf16_round_inl(w * ys[i]);
            } else {
                for (int i = 0; i < H; i++)
                    yt[i] += w * ys[i];
            }
        }
        if (bf16)
            for (int i = 0; i < H; i++)
                yt[i] = bf16_round_inl(yt[i]);
    }
}

void moe_rows_add(float *y, const float *add, size_t n, int bf16)
{
    for (size_t i = 0; i < n; i++) {
        float sum = y[i] + add[i];
        y[i] = bf16 ? bf16_round_inl(sum) : sum;
    }
}
