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
    /* the plain family of kern_route_cpu: softmax scores, no bias, no groups */
    kern_route_cfg rc = {.scoring = KERN_SCORE_SOFTMAX, .renorm = renorm};
    kern_route_cpu(logits, T, E, K, &rc, probs, topk_idx, topk_w);
}

float kern_route_scale(const kern_route_cfg *rc)
{
    return rc && rc->scale != 0.0f ? rc->scale : 1.0f;
}

/* group_pick marks (gsel, n_group) the topk_group groups with the largest
 * group scores; a group's score is the sum of its `topn` largest choice
 * scores (c, E). Ties go to the lower group index. */
static void group_pick(const float *c, int E, int n_group, int topk_group, int topn, uint8_t *gsel)
{
    int gs = E / n_group;
    float gscore[KERN_ROUTE_MAX_GROUPS];
    for (int g = 0; g < n_group; g++) {
        const float *cg = c + (size_t)g * gs;
        float best1 = cg[0], best2 = -INFINITY; /* the two largest, best1 >= best2 */
        for (int i = 1; i < gs; i++) {
            if (cg[i] > best1) {
                best2 = best1;
                best1 = cg[i];
            } else if (cg[i] > best2) {
                best2 = cg[i];
            }
        }
        gscore[g] = topn >= 2 && gs >= 2 ? best1 + best2 : best1;
        gsel[g] = 0;
    }
    for (int j = 0; j < topk_group; j++) {
        int best = -1;
        for (int g = 0; g < n_group; g++)
            if (!gsel[g] && (best < 0 || gscore[g] > gscore[best]))
                best = g;
        gsel[best] = 1;
    }
}

void kern_route_cpu(const float *logits, int T, int E, int K, const kern_route_cfg *rc,
                    float *probs, int32_t *topk_idx, float *topk_w)
{
    kern_route_cfg def = {0};
    if (!rc)
        rc = &def;
    int sigmoid = rc->scoring == KERN_SCORE_SIGMOID;
    int n_group = rc->n_group > 1 ? rc->n_group : 1;
    int topk_group = rc->topk_group > 0 && rc->topk_group < n_group ? rc->topk_group : n_group;
    int topn = rc->group_topn > 0 ? rc->group_topn : 2;
    int gs = E / n_group;
    float scale = kern_route_scale(rc);
    float c[KERN_ROUTE_MAX_E]; /* choice scores of one token */
    uint8_t gsel[KERN_ROUTE_MAX_GROUPS];
    for (int t = 0; t < T; t++) {
        const float *lt = logits + (size_t)t * E; /* (E) */
        float *pt = probs + (size_t)t * E;        /* (E) */
        int32_t *it = topk_idx + (size_t)t * K;   /* (K) */
        float *wt = topk_w + (size_t)t * K;       /* (K) */

        /* scores: softmax over E, or sigmoid of each logit */
        if (sigmoid) {
            for (int e = 0; e < E; e++)
                pt[e] = 1.0f / (1.0f + expf(-lt[e]));
        } else {
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
        }
        /* choice scores: the scores plus the bias; experts of groups not
         * picked are out of the choice */
        for (int e = 0; e < E; e++)
            c[e] = pt[e] + (rc->bias ? rc->bias[e] : 0.0f);
        if (n_group > 1 && topk_group < n_group) {
            group_pick(c, E, n_group, topk_group, topn, gsel);
            for (int e = 0; e < E; e++)
                if (!gsel[e / gs])
                    c[e] = -INFINITY;
        }
        /* K passes: the largest choice not yet chosen; strict > keeps the
         * lower index on ties (and the first unchosen one if all are NaN). */
        float wsum = 0.0f;
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++)
                    taken |= it[i] == e;
                if (taken)
                    continue;
                if (best < 0 || c[e] > c[best])
                    best = e;
            }
            it[j] = best;
            wt[j] = pt[best]; /* the weight is the score, never the bias */
            wsum += pt[best];
        }
        if (rc->renorm) {
            /* sigmoid scores are not a distribution: DeepSeek-V3 guards the
             * sum with 1e-20; softmax sums are divided as they are */
            float den = sigmoid ? wsum + 1e-20f : wsum;
            for (int j = 0; j < K; j++)
                wt[j] /= den;
        }
        if (scale != 1.0f)
            for (int j = 0; j < K; j++)
                wt[j] *= scale;
    }
}
