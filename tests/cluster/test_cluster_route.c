/* test_cluster_route.c - model.create with the routing families over the
 * protocol (2 workers): DeepSeek-V3 style (sigmoid, bias, groups, scale,
 * shared expert) and Qwen2-MoE style (softmax, gated shared expert) forwards
 * against the CPU reference with the same deterministic weights, and bad
 * values refused with a message naming the key. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "proto/proto.h"
#include "common/rng.h"

enum { H = 16, F = 8, FS = 12, E = 8, K = 2, T = 24 };
static const uint64_t SEED = 7;

/* rcase: the routing keys of one model.create (NULL / -1 = left out) */
typedef struct rcase {
    const char *name, *scoring;
    int renorm, score_bias, n_group, topk_group, shared_d_ff, shared_gate, top_k;
    double scale;
} rcase;

static moe_err create(cluster *cl, const rcase *c, moe_reply *rep)
{
    mp_writer w;
    mp_writer_init(&w);
    int n = 8 + (c->scoring != NULL) + (c->score_bias >= 0) + (c->n_group >= 0) +
            (c->topk_group >= 0) + (c->shared_d_ff >= 0) + (c->shared_gate >= 0) + (c->scale != 0);
    mp_write_map(&w, (uint32_t)n);
    mp_write_cstr(&w, "name"), mp_write_cstr(&w, c->name);
    mp_write_cstr(&w, "layers"), mp_write_i64(&w, 1);
    mp_write_cstr(&w, "d_model"), mp_write_i64(&w, H);
    mp_write_cstr(&w, "d_ff"), mp_write_i64(&w, F);
    mp_write_cstr(&w, "n_experts"), mp_write_i64(&w, E);
    mp_write_cstr(&w, "top_k"), mp_write_i64(&w, c->top_k);
    mp_write_cstr(&w, "renormalize"), mp_write_bool(&w, c->renorm);
    mp_write_cstr(&w, "seed"), mp_write_i64(&w, (int64_t)SEED);
    if (c->scoring)
        mp_write_cstr(&w, "scoring"), mp_write_cstr(&w, c->scoring);
    if (c->score_bias >= 0)
        mp_write_cstr(&w, "score_bias"), mp_write_bool(&w, c->score_bias);
    if (c->n_group >= 0)
        mp_write_cstr(&w, "n_group"), mp_write_i64(&w, c->n_group);
    if (c->topk_group >= 0)
        mp_write_cstr(&w, "topk_group"), mp_write_i64(&w, c->topk_group);
    if (c->shared_d_ff >= 0)
        mp_write_cstr(&w, "shared_d_ff"), mp_write_i64(&w, c->shared_d_ff);
    if (c->shared_gate >= 0)
        mp_write_cstr(&w, "shared_gate"), mp_write_bool(&w, c->shared_gate);
    if (c->scale != 0)
        mp_write_cstr(&w, "routed_scaling_factor"), mp_write_f64(&w, c->scale);
    moe_err e = moe_call(cl->cli, "model.create", w.buf, w.len, rep);
    mp_writer_fini(&w);
    return e;
}

/* check_forward: the cluster's layer 0 against kern_moe_forward_ref with the
 * workers' initial weights (worker/model.c: the shared expert is expert E of
 * the layer, its gate row expert E + 1's w1 row, the bias 0). */
static void check_forward(cluster *cl, const rcase *c)
{
    const int Fs = c->shared_d_ff > 0 ? c->shared_d_ff : 0;
    float *wr = malloc(sizeof(float) * E * H), *w1 = malloc(sizeof(float) * E * F * H);
    float *w3 = malloc(sizeof(float) * E * F * H), *w2 = malloc(sizeof(float) * E * H * F);
    float *ws1 = malloc(sizeof(float) * FS * H), *ws3 = malloc(sizeof(float) * FS * H);
    float *ws2 = malloc(sizeof(float) * H * FS), *wsg = malloc(sizeof(float) * H);
    float *bias = calloc(E, sizeof(float));
    float *x = malloc(sizeof(float) * T * H), *y = malloc(sizeof(float) * T * H);
    float *yref = malloc(sizeof(float) * T * H);
    cr_assert(wr && w1 && w3 && w2 && ws1 && ws3 && ws2 && wsg && bias && x && y && yref);
    kern_init_weight(SEED, 0, 0, KERN_W_ROUTER, E, H, wr);
    for (int e = 0; e < E; e++) {
        kern_init_weight(SEED, 0, e, KERN_W1, F, H, w1 + (size_t)e * F * H);
        kern_init_weight(SEED, 0, e, KERN_W3, F, H, w3 + (size_t)e * F * H);
        kern_init_weight(SEED, 0, e, KERN_W2, H, F, w2 + (size_t)e * H * F);
    }
    if (Fs) {
        kern_init_weight(SEED, 0, E, KERN_W1, Fs, H, ws1);
        kern_init_weight(SEED, 0, E, KERN_W3, Fs, H, ws3);
        kern_init_weight(SEED, 0, E, KERN_W2, H, Fs, ws2);
    }
    kern_init_weight(SEED, 0, E + 1, KERN_W1, 1, H, wsg);
    kern_layer_weights lw = {.wr = wr,
                             .w1 = w1,
                             .w3 = w3,
                             .w2 = w2,
                             .bias = c->score_bias > 0 ? bias : NULL,
                             .ws1 = ws1,
                             .ws3 = ws3,
                             .ws2 = ws2,
                             .wsg = wsg};
    kern_moe_shape s = {.T = T,
                        .H = H,
                        .F = F,
                        .E = E,
                        .K = c->top_k,
                        .act = KERN_ACT_SWIGLU,
                        .renorm = c->renorm,
                        .scoring = c->scoring && strcmp(c->scoring, "sigmoid") == 0
                                       ? KERN_SCORE_SIGMOID
                                       : KERN_SCORE_SOFTMAX,
                        .n_group = c->n_group > 0 ? c->n_group : 0,
                        .topk_group = c->topk_group > 0 ? c->topk_group : 0,
                        .route_scale = (float)c->scale,
                        .Fs = Fs,
                        .shared_gate = c->shared_gate > 0};
    rng_fill_uniform(SEED, 99, -1.0f, 1.0f, x, (size_t)T * H);
    int32_t cnt[E], drop[E];
    kern_fwd_stats rs = {cnt, drop, 0, 0};
    cr_assert_eq(kern_moe_forward_ref(&s, &lw, x, yref, &rs), MOE_OK);
    moe_fwd_info info;
    memset(&info, 0, sizeof(info));
    cr_assert_eq(moe_forward(cl->cli, c->name, 0, MOE_F32, x, T, H, y, &info), MOE_OK, "%s: %s",
                 c->name, moe_last_error());
    double rel = kern_rel_err(y, yref, (size_t)T * H);
    fprintf(stderr, "  %s: forward rel err %.2e against the reference\n", c->name, rel);
    cr_expect(rel <= 1e-5, "%s: rel err %.3g", c->name, rel);
    for (int e = 0; e < E; e++)
        cr_expect_eq(info.tokens_per_expert[e], cnt[e], "%s: expert %d: %lld vs %d", c->name, e,
                     (long long)info.tokens_per_expert[e], cnt[e]);
    moe_fwd_info_free(&info);
    free(wr), free(w1), free(w3), free(w2), free(ws1), free(ws3), free(ws2), free(wsg);
    free(bias), free(x), free(y), free(yref);
}

Test(cluster_route, families_forward, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    static const rcase cs[] = {
        {"dsv3", "sigmoid", 1, 1, 4, 2, FS, 0, K, 2.5},
        {"qwen2", "softmax", 0, -1, -1, -1, FS, 1, K, 0},
        {"plain", NULL, 1, -1, -1, -1, -1, -1, K, 0},
    };
    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
        moe_reply rep;
        moe_err e = create(cl, &cs[i], &rep);
        cr_assert_eq(e, MOE_OK, "%s: model.create: %s", cs[i].name, rep.message);
        moe_reply_free(&rep);
        check_forward(cl, &cs[i]);
    }
}

Test(cluster_route, bad_values_refused, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    static const struct {
        rcase c;
        const char *want; /* in the message */
    } bad[] = {
        {{"b1", "tanh", 1, -1, -1, -1, -1, -1, K, 0}, "scoring"},
        {{"b2", "sigmoid", 1, -1, 3, -1, -1, -1, K, 0}, "n_group"},
        {{"b3", "sigmoid", 1, -1, 4, 5, -1, -1, K, 0}, "topk_group"},
        {{"b4", "sigmoid", 1, -1, 4, 1, -1, -1, 3, 0}, "top_k"},
        {{"b5", "sigmoid", 1, -1, -1, -1, -1, -1, K, -1.0}, "routed_scaling_factor"},
        {{"b6", NULL, 1, -1, -1, -1, 0, 1, K, 0}, "shared_gate"},
        {{"b7", NULL, 1, -1, -1, -1, -5, -1, K, 0}, "shared_d_ff"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        rcase c = bad[i].c;
        if (c.shared_d_ff == -5) /* sent as a negative value */
            c.shared_d_ff = 0, c.n_group = -1;
        moe_reply rep;
        moe_err e;
        if (strcmp(c.name, "b7") == 0) {
            mp_writer w;
            mp_writer_init(&w);
            mp_write_map(&w, 7);
            mp_write_cstr(&w, "name"), mp_write_cstr(&w, "b7");
            mp_write_cstr(&w, "layers"), mp_write_i64(&w, 1);
            mp_write_cstr(&w, "d_model"), mp_write_i64(&w, H);
            mp_write_cstr(&w, "d_ff"), mp_write_i64(&w, F);
            mp_write_cstr(&w, "n_experts"), mp_write_i64(&w, E);
            mp_write_cstr(&w, "top_k"), mp_write_i64(&w, K);
            mp_write_cstr(&w, "shared_d_ff"), mp_write_i64(&w, -5);
            e = moe_call(cl->cli, "model.create", w.buf, w.len, &rep);
            mp_writer_fini(&w);
        } else {
            e = create(cl, &c, &rep);
        }
        fprintf(stderr, "  %s: %s\n", c.name, rep.message);
        cr_expect_eq(e, MOE_EINVAL, "%s: %d", c.name, e);
        cr_expect(strstr(rep.message, bad[i].want), "%s: message '%s'", c.name, rep.message);
        moe_reply_free(&rep);
    }
}
