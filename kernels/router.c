/* router.c - router logits, softmax and top-k selection. */
#include <cblas.h>
#include <math.h>

#include "kernels/kern.h"

void kern_router_logits_cpu(const float *x, const float *wr, int T, int H, int E, float *logits)
{
    /* x (T,H), wr (E,H), logits (T,E) */
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * H;
        for (int e = 0; e < E; e++) {
            const float *we = wr + (size_t)e * H;
            float acc = 0.0f;
            for (int h = 0; h < H; h++)
                acc += xt[h] * we[h];
            logits[(size_t)t * E + e] = acc;
        }
    }
}

void kern_router_logits_blas(const float *x, const float *wr, int T, int H, int E, float *logits)
{
    if (T <= 0 || E <= 0)
        return;
    if (H <= 0) {
        for (size_t i = 0; i < (size_t)T * E; i++)
            logits[i] = 0.0f;
        return;
    }
    /* logits (T,E) = x (T,H) * wr^T (H,E) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, E, H, 1.0f, x, H, wr, H, 0.0f, logits,
                E);
}

void kern_softmax_topk_cpu(const float *logits, int T, int E, int K, int renorm, float *probs,
                           int32_t *topk_idx, float *topk_w)
{
    for (int t = 0; t < T; t++) {
        const float *lt = logits + (size_t)t * E; /* (E) */
        float *pt = probs + (size_t)t * E;        /* (E) */
        int32_t *it = topk_idx + (size_t)t * K;   /* (K) */
        float *wt = topk_w + (size_t)t * K;       /* (K) */

        float mx = lt[0];
        for (int e = 1; e < E; e++)
            mx = lt[e] > mx ? lt[e] : mx;
        float sum = 0.0f;
        for (int e = 0; e < E; e++) {
            pt[e] = expf(lt[e] - mx);
            sum += pt[e];
        }
        for (int e = 0; e < E; e++)
            pt[e] /= sum;

        /* K passes: the largest not yet chosen; strict > keeps the lower
         * index on ties (and the first unchosen one if all are NaN). */
        float wsum = 0.0f;
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++)
                    taken |= it[i] == e;
                if (taken)
                    continue;
                if (best < 0 || pt[e] > pt[best])
                    best = e;
            }
            it[j] = best;
            wt[j] = pt[best];
            wsum += pt[best];
        }
        if (renorm) {
            for (int j = 0; j < K; j++)
                wt[j] /= wsum;
        }
    }
}
