/* router_backward.c - gradient of the router: through the top-k weights
 * (with or without renormalisation), the aux loss (via probs only, with the
 * global counts) and the z-loss, then softmax and the logits GEMM. */
#include <math.h>

#include "kernels/kern.h"

void kern_router_backward_cpu(const float *x, const float *wr, const float *logits,
                              const float *probs, const int32_t *topk_idx, const float *dw, int T,
                              int H, int E, int K, int renorm, const int32_t *counts_global,
                              int T_global, float aux_coef, float z_coef, float *dwr, float *dx)
{
    kern_route_cfg rc = {0};
    rc.renorm = renorm;
    kern_route_backward_cpu(x, wr, logits, probs, topk_idx, dw, T, H, E, K, &rc, counts_global,
                            T_global, aux_coef, z_coef, dwr, dx);
}

void kern_route_backward_cpu(const float *x, const float *wr, const float *logits,
                             const float *probs, const int32_t *topk_idx, const float *dw, int T,
                             int H, int E, int K, const kern_route_cfg *rc,
                             const int32_t *counts_global, int T_global, float aux_coef,
                             float z_coef, float *dwr, float *dx)
{
    /* x (T,H), wr (E,H), logits probs (T,E), topk_idx dw (T,K), counts_global (E);
     * dwr (E,H) +=, dx (T,H) += */
    kern_route_cfg def = {0};
    if (!rc)
        rc = &def;
    const int renorm = rc->renorm, sigmoid = rc->scoring == KERN_SCORE_SIGMOID;
    const float scale = kern_route_scale(rc);
    if (T_global <= 0)
        T_global = T > 0 ? T : 1;
    /* aux = E/(K Tg) sum_e c_e (1/Tg) sum_t p[t,e]  =>  daux/dp[t,e] = E c_e / (K Tg^2) */
    float aux_scale = aux_coef * (float)E / ((float)K * (float)T_global * (float)T_global);
    float z_scale = 2.0f * z_coef / (float)T_global;

    for (int t = 0; t < T; t++) {
        const float *pt = probs + (size_t)t * E;
        const float *lt = logits + (size_t)t * E;
        const int32_t *it = topk_idx + (size_t)t * K;
        const float *gt = dw + (size_t)t * K;
        const float *xt = x + (size_t)t * H;
        float *dxt = dx + (size_t)t * H;

        /* g_j = dL/dp[t, idx_j] through the top-k weights w_j = scale p_j
         * (/ S with renorm, S = sum of the chosen p, + 1e-20 for sigmoid):
         * dL/dp_j = scale (dw_j - sum_i dw_i p_i / S) / S. The bias only
         * chose the experts: it gets no gradient. */
        float S = 0.0f, gw = 0.0f;
        if (renorm) {
            for (int j = 0; j < K; j++)
                S += pt[it[j]];
            if (sigmoid)
                S += 1e-20f;
            for (int j = 0; j < K; j++)
                gw += gt[j] * (pt[it[j]] / S);
        }
        /* dp(e) = aux_scale c_e + sum_{j: idx_j = e} g_j, made on the fly */
#define DP(e, out)                                                                                 \
    do {                                                                                           \
        float d_ = aux_scale * (float)counts_global[(e)];                                          \
        for (int j_ = 0; j_ < K; j_++) {                                                           \
            if (it[j_] == (e))                                                                     \
                d_ += scale * (renorm ? (gt[j_] - gw) / S : gt[j_]);                               \
        }                                                                                          \
        (out) = d_;                                                                                \
    } while (0)

        float pdp = 0.0f; /* sum_e p_e dp_e (softmax backward) */
        for (int e = 0; e < E && !sigmoid; e++) {
            float d;
            DP(e, d);
            pdp += pt[e] * d;
        }
        float lse = 0.0f;
        if (z_coef != 0.0f) {
            float mx = lt[0];
            for (int e = 1; e < E; e++)
                mx = lt[e] > mx ? lt[e] : mx;
            double s = exp((double)lt[0] - mx);
            for (int e = 1; e < E; e++)
                s += exp((double)lt[e] - mx);
            lse = (float)(mx + log(s));
        }
        for (int e = 0; e < E; e++) {
            float d;
            DP(e, d);
            /* scores backward (softmax, or sigmoid: s (1 - s)), plus the
             * z-loss: dlse/dlogit = softmax(logits), which is p for softmax */
            float dl;
            if (sigmoid) {
                float q = z_coef != 0.0f ? expf(lt[e] - lse) : 0.0f;
                dl = d * pt[e] * (1.0f - pt[e]) + z_scale * lse * q;
            } else {
                dl = pt[e] * (d - pdp) + z_scale * lse * pt[e];
            }
            const float *we = wr + (size_t)e * H;
            float *dwe = dwr + (size_t)e * H;
            for (int h = 0; h < H; h++) {
                dwe[h] += dl * xt[h];
                dxt[h] += dl * we[h];
            }
        }
#undef DP
    }
}
