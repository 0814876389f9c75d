/* test_kern_route.c - the routing families (kern_route_cpu): sigmoid scoring
 * with a choice bias, group-limited top-k (top-2 sum and max group scores),
 * renormalisation and the routed scale, against hand-computed cases; the
 * plain case against kern_softmax_topk_cpu; and the layer's gradients with
 * these routings and a gated shared expert against central differences. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"
#include "common/rng.h"

static double sig(double v)
{
    return 1.0 / (1.0 + exp(-v));
}

Test(kern_route, sigmoid_bias_renorm_scale)
{
    /* E = 4, K = 2. s = sigmoid(logits) = .5, .731, .269, .881; the bias
     * lifts expert 2 (c = 1.269) above the others: chosen 2, then 3. The
     * weights are the scores (not the bias), renormalised, times 2.5. */
    const float logits[4] = {0.0f, 1.0f, -1.0f, 2.0f}, bias[4] = {0, 0, 1.0f, 0};
    float probs[4], w[2];
    int32_t idx[2];
    kern_route_cfg rc = {KERN_SCORE_SIGMOID, 1, bias, 0, 0, 0, 2.5f};
    kern_route_cpu(logits, 1, 4, 2, &rc, probs, idx, w);
    cr_expect(idx[0] == 2 && idx[1] == 3, "chosen %d %d", idx[0], idx[1]);
    double s2 = sig(-1), s3 = sig(2);
    cr_expect(fabs(w[0] - 2.5 * s2 / (s2 + s3)) < 1e-6, "w0 %g", (double)w[0]);
    cr_expect(fabs(w[1] - 2.5 * s3 / (s2 + s3)) < 1e-6, "w1 %g", (double)w[1]);
    for (int e = 0; e < 4; e++)
        cr_expect(fabs(probs[e] - sig(logits[e])) < 1e-7, "p[%d] = %g", e, (double)probs[e]);
    /* without renorm: the raw scores times the scale */
    rc.renorm = 0;
    kern_route_cpu(logits, 1, 4, 2, &rc, probs, idx, w);
    cr_expect(fabs(w[0] - 2.5 * s2) < 1e-6 && fabs(w[1] - 2.5 * s3) < 1e-6, "w %g %g", (double)w[0],
              (double)w[1]);
}

Test(kern_route, group_limited)
{
    /* E = 8 in 4 groups of 2, keep 2 groups, K = 2, sigmoid scores:
     *   group 0: .953 .047  top-2 sum 1.000  max .953
     *   group 1: .731 .731            1.462      .731
     *   group 2: .881 .007            0.888      .881
     *   group 3: .622 .622            1.245      .622
     * top-2 sums keep groups 1 and 3: experts 2, 3 (a tie: lower first).
     * The max (DeepSeek-V2's group score) keeps groups 0 and 2: experts 0, 4.
     * Unlimited, the best two are experts 0 and 4 as well. */
    const float logits[8] = {3.0f, -3.0f, 1.0f, 1.0f, 2.0f, -5.0f, 0.5f, 0.5f};
    float probs[8], w[2];
    int32_t idx[2];
    kern_route_cfg rc = {KERN_SCORE_SIGMOID, 0, NULL, 4, 2, 2, 0};
    kern_route_cpu(logits, 1, 8, 2, &rc, probs, idx, w);
    cr_expect(idx[0] == 2 && idx[1] == 3, "top-2 sums: chosen %d %d", idx[0], idx[1]);
    cr_expect(fabs(w[0] - sig(1)) < 1e-7 && fabs(w[1] - sig(1)) < 1e-7);
    rc.group_topn = 1;
    kern_route_cpu(logits, 1, 8, 2, &rc, probs, idx, w);
    cr_expect(idx[0] == 0 && idx[1] == 4, "max: chosen %d %d", idx[0], idx[1]);
    /* the bias moves the group choice too: +1 on expert 7 lifts group 3
     * (sum 2.245) over group 1; then expert 7 (c = 1.622) and 2 */
    const float bias[8] = {0, 0, 0, 0, 0, 0, 0, 1.0f};
    rc.group_topn = 2;
    rc.bias = bias;
    kern_route_cpu(logits, 1, 8, 2, &rc, probs, idx, w);
    cr_expect(idx[0] == 7 && idx[1] == 2, "bias: chosen %d %d", idx[0], idx[1]);
    cr_expect(fabs(w[0] - sig(0.5)) < 1e-7, "the weight is the score: %g", (double)w[0]);
}

Test(kern_route, softmax_is_softmax_topk)
{
    enum { T = 40, E = 16, K = 4 };
    static float logits[T * E], p1[T * E], p2[T * E], w1[T * K], w2[T * K];
    static int32_t i1[T * K], i2[T * K];
    rng_fill_uniform(5, 0, -3.0f, 3.0f, logits, T * E);
    for (int renorm = 0; renorm < 2; renorm++) {
        kern_route_cfg rc = {0};
        rc.renorm = renorm;
        kern_softmax_topk_cpu(logits, T, E, K, renorm, p1, i1, w1);
        kern_route_cpu(logits, T, E, K, &rc, p2, i2, w2);
        cr_expect(memcmp(p1, p2, sizeof(p1)) == 0 && memcmp(i1, i2, sizeof(i1)) == 0 &&
                      memcmp(w1, w2, sizeof(w1)) == 0,
                  "renorm=%d: not the same bits", renorm);
    }
    /* softmax with a routed scale: the weights times the scale */
    kern_route_cfg rc = {0};
    rc.scale = 16.0f;
    kern_route_cpu(logits, T, E, K, &rc, p2, i2, w2);
    kern_softmax_topk_cpu(logits, T, E, K, 0, p1, i1, w1);
    for (int i = 0; i < T * K; i++)
        cr_expect(w2[i] == 16.0f * w1[i] && i2[i] == i1[i]);
}

/* ---- gradients: the layer with sigmoid group routing and a shared expert */
enum { GT = 6, GH = 5, GF = 4, GFS = 3, GE = 8, GK = 2 };

static double objective(const kern_moe_shape *s, const kern_layer_weights *w, const float *x,
                        const float *dy)
{
    float y[GT * GH];
    cr_assert_eq(kern_moe_forward_ref(s, w, x, y, NULL), MOE_OK);
    double o = 0;
    for (int i = 0; i < GT * GH; i++)
        o += (double)dy[i] * y[i];
    return o;
}

static void fd_check(kern_scoring scoring, int n_group, int shared_gate, uint64_t seed)
{
    kern_moe_shape s = {.T = GT,
                        .H = GH,
                        .F = GF,
                        .E = GE,
                        .K = GK,
                        .act = KERN_ACT_SWIGLU,
                        .renorm = 1,
                        .scoring = scoring,
                        .n_group = n_group,
                        .topk_group = n_group > 1 ? n_group / 2 : 0,
                        .route_scale = 2.5f,
                        .Fs = GFS,
                        .shared_gate = shared_gate};
    static float x[GT * GH], wr[GE * GH], w1[GE * GF * GH], w3[GE * GF * GH], w2[GE * GH * GF];
    static float ws1[GFS * GH], ws3[GFS * GH], ws2[GH * GFS], wsg[GH], bias[GE], dy[GT * GH];
    rng_fill_uniform(seed, 0, -1.0f, 1.0f, x, GT * GH);
    rng_fill_uniform(seed, 1, -2.0f, 2.0f, wr, GE * GH);
    rng_fill_uniform(seed, 2, -0.5f, 0.5f, w1, GE * GF * GH);
    rng_fill_uniform(seed, 3, -0.5f, 0.5f, w3, GE * GF * GH);
    rng_fill_uniform(seed, 4, -0.5f, 0.5f, w2, GE * GH * GF);
    rng_fill_uniform(seed, 5, -0.5f, 0.5f, ws1, GFS * GH);
    rng_fill_uniform(seed, 6, -0.5f, 0.5f, ws3, GFS * GH);
    rng_fill_uniform(seed, 7, -0.5f, 0.5f, ws2, GH * GFS);
    rng_fill_uniform(seed, 8, -1.0f, 1.0f, wsg, GH);
    rng_fill_uniform(seed, 9, -0.1f, 0.1f, bias, GE);
    rng_fill_uniform(seed, 10, -1.0f, 1.0f, dy, GT * GH);
    kern_layer_weights w = {.wr = wr,
                            .w1 = w1,
                            .w3 = w3,
                            .w2 = w2,
                            .bias = bias,
                            .ws1 = ws1,
                            .ws3 = ws3,
                            .ws2 = ws2,
                            .wsg = wsg};
    static float dx[GT * GH], dwr[GE * GH], dw1[GE * GF * GH], dw3[GE * GF * GH], dw2[GE * GH * GF],
        dws1[GFS * GH], dws3[GFS * GH], dws2[GH * GFS], dwsg[GH];
    kern_layer_grads g = {dwr, dw1, dw3, dw2, dws1, dws3, dws2, dwsg};
    cr_assert_eq(kern_moe_backward_ref_g(&s, &w, x, dy, 0, 0, dx, &g), MOE_OK);
    struct {
        const char *name;
        float *v;
        const float *g;
        int n;
    } ts[] = {{"dx", x, dx, GT * GH},         {"dwr", wr, dwr, GE * GH},
              {"dw1", w1, dw1, GE * GF * GH}, {"dws1", ws1, dws1, GFS * GH},
              {"dws3", ws3, dws3, GFS * GH},  {"dws2", ws2, dws2, GH * GFS},
              {"dwsg", wsg, dwsg, GH}};
    const float eps = 1e-2f;
    static float fd[GE * GF * GH];
    for (size_t k = 0; k < sizeof(ts) / sizeof(ts[0]); k++) {
        if (!shared_gate && strcmp(ts[k].name, "dwsg") == 0)
            continue;
        for (int i = 0; i < ts[k].n; i++) {
            float keep = ts[k].v[i];
            ts[k].v[i] = keep + eps;
            double lp = objective(&s, &w, x, dy);
            ts[k].v[i] = keep - eps;
            double lm = objective(&s, &w, x, dy);
            ts[k].v[i] = keep;
            fd[i] = (float)((lp - lm) / (2.0 * eps));
        }
        double r = kern_rel_err(ts[k].g, fd, (size_t)ts[k].n);
        fprintf(stderr, "  scoring=%d n_group=%d gate=%d %-5s rel err %.2e\n", scoring, n_group,
                shared_gate, ts[k].name, r);
        cr_expect(r < 2e-3, "%s: rel err %.3g", ts[k].name, r);
    }
    /* the bias only chooses: the gradients do not depend on it as long as
     * the choice stays (objective() above never moves it) */
}

Test(kern_route, grad_sigmoid_groups_shared)
{
    fd_check(KERN_SCORE_SIGMOID, 4, 0, 3);
}

Test(kern_route, grad_softmax_gated_shared)
{
    fd_check(KERN_SCORE_SOFTMAX, 0, 1, 4);
}
