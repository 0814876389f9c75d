/*
 * test_cluster_forward.c - the cluster's forward (real coordinator + 2 and 3
 * CPU workers on loopback, through libmoe) equals kern_moe_forward_ref on the
 * same seeded weights: rel. error < 1e-5 (f32) / 1e-2 (bf16); tokens per
 * expert equal the reference counts and dropped slots its `dropped`, in the
 * forward's info and in the cumulative `stats`. Cases: T=1, T not divisible
 * by W, experts with no token, k=1, k=E, GELU, SwiGLU, renormalize, a
 * capacity factor, bf16, both layers of a model. Plus the operator side:
 * /livez /readyz /metrics, and SIGTERM drains and exits 0.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <math.h>
#include <pthread.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

/* one forward case: a model and the batch sizes run through it */
typedef struct fcase {
    const char *name;
    int H, F, E, K;
    const char *act; /* "swiglu" | "gelu" */
    int renorm;
    double cf;
    moe_dtype dt;
    int layers;
    int T[4]; /* batch sizes, 0-terminated after the first */
} fcase;

/* ref_weights: one layer's full weights, as the workers build their slices. */
typedef struct ref_weights {
    float *wr, *w1, *w3, *w2; /* (E,H) (E,F,H) (E,F,H) (E,H,F) */
} ref_weights;

static void ref_build(const fcase *c, uint64_t seed, int layer, ref_weights *w)
{
    size_t fh = (size_t)c->F * c->H;
    int bf = c->dt == MOE_BF16, swiglu = strcmp(c->act, "swiglu") == 0;
    w->wr = malloc((size_t)c->E * c->H * sizeof(float));
    w->w1 = malloc((size_t)c->E * fh * sizeof(float));
    w->w2 = malloc((size_t)c->E * fh * sizeof(float));
    w->w3 = swiglu ? malloc((size_t)c->E * fh * sizeof(float)) : NULL;
    cr_assert(w->wr && w->w1 && w->w2 && (!swiglu || w->w3));
    kern_init_weight(seed, layer, 0, KERN_W_ROUTER, c->E, c->H, w->wr);
    for (int e = 0; e < c->E; e++) {
        kern_init_weight(seed, layer, e, KERN_W1, c->F, c->H, w->w1 + e * fh);
        kern_init_weight(seed, layer, e, KERN_W2, c->H, c->F, w->w2 + e * fh);
        if (w->w3)
            kern_init_weight(seed, layer, e, KERN_W3, c->F, c->H, w->w3 + e * fh);
    }
    if (bf) { /* worker/model.c rounds every weight of a bf16 model, router too */
        kern_bf16_round_n(w->wr, (size_t)c->E * c->H);
        kern_bf16_round_n(w->w1, (size_t)c->E * fh);
        kern_bf16_round_n(w->w2, (size_t)c->E * fh);
        if (w->w3)
            kern_bf16_round_n(w->w3, (size_t)c->E * fh);
    }
}

static void ref_free(ref_weights *w)
{
    free(w->wr);
    free(w->w1);
    free(w->w2);
    free(w->w3);
}

/* stats_layer_counts reads models.<name>.layers[layer].{tokens_per_expert,
 * dropped} from the `stats` RPC into tok, drop (E each). */
static void stats_layer_counts(cluster *cl, const char *name, int layer, int E, int64_t *tok,
                               int64_t *drop)
{
    moe_reply rep;
    moe_err e = moe_call(cl->cli, "stats", NULL, 0, &rep);
    cr_assert_eq(e, MOE_OK, "stats: %s", rep.message);
    mp_reader r = mp_reply_reader(&rep);
    uint32_t n;
    cr_assert(mp_map_find(&r, "models") == 0 && mp_map_find(&r, name) == 0 &&
              mp_map_find(&r, "layers") == 0);
    cr_assert(mp_read_array(&r, &n, NULL) == MOE_OK && (int)n > layer);
    for (int l = 0; l < layer; l++)
        cr_assert(mp_skip(&r, NULL) == MOE_OK);
    static const char *keys[2] = {"tokens_per_expert", "dropped"};
    int64_t *outs[2] = {tok, drop};
    for (int k = 0; k < 2; k++) {
        mp_reader m = r;
        cr_assert(mp_map_find(&m, keys[k]) == 0, "stats: no %s", keys[k]);
        cr_assert(mp_read_array(&m, &n, NULL) == MOE_OK && (int)n == E);
        for (int i = 0; i < E; i++)
            cr_assert(mp_read_i64(&m, &outs[k][i], NULL) == MOE_OK);
    }
    moe_reply_free(&rep);
}

/* run_case creates the model and checks every (layer, T) of the case. */
static void run_case(cluster *cl, const fcase *c, int W)
{
    char name[64];
    snprintf(name, sizeof(name), "%s-w%d", c->name, W);
    uint64_t seed = 1000u + (uint64_t)c->E * 31u + (uint64_t)c->K * 7u + (uint64_t)c->H;
    moe_model_config mc = {0};
    mc.name = name;
    mc.layers = c->layers;
    mc.d_model = c->H;
    mc.d_ff = c->F;
    mc.n_experts = c->E;
    mc.top_k = c->K;
    mc.activation = c->act;
    mc.renormalize = c->renorm;
    mc.capacity_factor = c->cf;
    mc.dtype = c->dt;
    mc.seed = seed;
    moe_err e = moe_model_create(cl->cli, &mc);
    cr_assert_eq(e, MOE_OK, "%s: model.create: %s", name, moe_last_error());

    const int bf = c->dt == MOE_BF16, E = c->E, H = c->H;
    const double tol = bf ? 1e-2 : 1e-5;
    int64_t *sum_tok = calloc((size_t)c->layers * E, sizeof(int64_t));
    int64_t *sum_drop = calloc((size_t)c->layers * E, sizeof(int64_t));
    for (int layer = 0; layer < c->layers; layer++) {
        ref_weights w;
        ref_build(c, seed, layer, &w);
        kern_layer_weights lw = {.wr = w.wr, .w1 = w.w1, .w3 = w.w3, .w2 = w.w2};
        for (int ti = 0; ti < 4 && (ti == 0 || c->T[ti]); ti++) {
            const int T = c->T[ti];
            size_t n = (size_t)T * H;
            float *x = malloc((n ? n : 1) * sizeof(float));
            float *y = malloc((n ? n : 1) * sizeof(float));
            float *yref = malloc((n ? n : 1) * sizeof(float));
            uint16_t *xb = malloc((n ? n : 1) * 2), *yb = malloc((n ? n : 1) * 2);
            int32_t *cnt = calloc((size_t)E, 4), *drop = calloc((size_t)E, 4);
            cr_assert(x && y && yref && xb && yb && cnt && drop);
            rng_fill_uniform(seed + (uint64_t)ti, (uint64_t)layer, -1.0f, 1.0f, x, n);
            if (bf) /* the client sends bf16: the reference sees the same values */
                for (size_t i = 0; i < n; i++) {
                    xb[i] = kern_f32_to_bf16(x[i]);
                    x[i] = kern_bf16_to_f32(xb[i]);
                }
            for (size_t i = 0; i < n; i++)
                y[i] = yref[i] = NAN; /* poison */
            kern_moe_shape s = {.T = T,
                                .H = H,
                                .F = c->F,
                                .E = E,
                                .K = c->K,
                                .act = strcmp(c->act, "gelu") ? KERN_ACT_SWIGLU : KERN_ACT_GELU,
                                .renorm = c->renorm,
                                .capacity_factor = (float)c->cf,
                                .bf16 = bf};
            kern_fwd_stats rs = {cnt, drop, 0, 0};
            cr_assert_eq(kern_moe_forward_ref(&s, &lw, x, yref, &rs), MOE_OK);

            moe_fwd_info info;
            memset(&info, 0, sizeof(info));
            e = moe_forward(cl->cli, name, layer, c->dt, bf ? (const void *)xb : (const void *)x, T,
                            H, bf ? (void *)yb : (void *)y, &info);
            cr_assert_eq(e, MOE_OK, "%s layer %d T=%d: forward: %s", name, layer, T,
                         moe_last_error());
            if (bf)
                for (size_t i = 0; i < n; i++)
                    y[i] = kern_bf16_to_f32(yb[i]);
            double rel = n ? kern_rel_err(y, yref, n) : 0;
            if (!(rel < tol))
                kern_print_mismatches(name, y, yref, n, tol, 8);
            cr_assert(rel < tol, "%s layer %d T=%d: rel err %.3g >= %.0e (W=%d)", name, layer, T,
                      rel, tol, W);

            /* load balance: exact */
            cr_assert_eq(info.n_experts, E, "%s: info has %d experts", name, info.n_experts);
            cr_assert(info.tokens_per_expert && info.dropped);
            int64_t routed = 0, dropped = 0, idle = 0;
            for (int i = 0; i < E; i++) {
                cr_assert_eq(info.tokens_per_expert[i], cnt[i],
                             "%s layer %d T=%d: expert %d got %lld slots, reference %d", name,
                             layer, T, i, (long long)info.tokens_per_expert[i], cnt[i]);
                cr_assert_eq(info.dropped[i], drop[i],
                             "%s layer %d T=%d: expert %d dropped %lld, reference %d", name, layer,
                             T, i, (long long)info.dropped[i], drop[i]);
                routed += info.tokens_per_expert[i];
                dropped += info.dropped[i];
                idle += info.tokens_per_expert[i] == 0;
                sum_tok[(size_t)layer * E + i] += cnt[i];
                sum_drop[(size_t)layer * E + i] += drop[i];
            }
            cr_assert_eq(routed, (int64_t)T * c->K, "%s: %lld slots routed, want T*K", name,
                         (long long)routed);
            if (c->cf == 0)
                cr_assert_eq(dropped, 0, "%s: dropless model dropped %lld", name,
                             (long long)dropped);
            if (T * c->K < E) /* some experts must see no token at all */
                cr_assert(idle >= E - T * c->K, "%s T=%d: %lld idle experts", name, T,
                          (long long)idle);
            moe_fwd_info_free(&info);
            free(x);
            free(y);
            free(yref);
            free(xb);
            free(yb);
            free(cnt);
            free(drop);
        }
        ref_free(&w);
    }
    if (c->cf > 0) { /* the capacity cases are chosen so that slots are dropped */
        int64_t total_dropped = 0;
        for (size_t i = 0; i < (size_t)c->layers * E; i++)
            total_dropped += sum_drop[i];
        cr_assert_gt(total_dropped, 0, "%s: capacity factor %g dropped nothing", name, c->cf);
    }
    /* the cumulative stats of this (fresh) model match the sums (small
     * forwards fanned out to the workers are counted with their next
     * heartbeats: wait for them, boundedly) */
    int64_t *tok = calloc((size_t)E, sizeof(int64_t)), *drp = calloc((size_t)E, sizeof(int64_t));
    for (int64_t t0 = cluster_now_ms(); cluster_now_ms() - t0 < 30000; usleep(20000)) {
        int same = 1;
        for (int layer = 0; layer < c->layers && same; layer++) {
            stats_layer_counts(cl, name, layer, E, tok, drp);
            for (int i = 0; i < E; i++)
                same &= tok[i] == sum_tok[(size_t)layer * E + i] &&
                        drp[i] == sum_drop[(size_t)layer * E + i];
        }
        if (same)
            break;
    }
    for (int layer = 0; layer < c->layers; layer++) {
        stats_layer_counts(cl, name, layer, E, tok, drp);
        for (int i = 0; i < E; i++) {
            cr_assert_eq(tok[i], sum_tok[(size_t)layer * E + i],
                         "%s: stats layer %d expert %d tokens %lld, want %lld", name, layer, i,
                         (long long)tok[i], (long long)sum_tok[(size_t)layer * E + i]);
            cr_assert_eq(drp[i], sum_drop[(size_t)layer * E + i],
                         "%s: stats layer %d expert %d dropped %lld, want %lld", name, layer, i,
                         (long long)drp[i], (long long)sum_drop[(size_t)layer * E + i]);
        }
    }
    free(tok);
    free(drp);
    free(sum_tok);
    free(sum_drop);
}

/* Shapes small (H 32-128) so the whole file runs in seconds on 2 cores. */
static const fcase cases_w2[] = {
    {"swiglu-f32", 64, 128, 8, 2, "swiglu", 0, 0, MOE_F32, 2, {1, 7, 64, 0}},
    {"idle-experts-k1", 32, 64, 16, 1, "swiglu", 0, 0, MOE_F32, 1, {1, 3, 0}},
    {"k-equals-e", 32, 64, 4, 4, "swiglu", 0, 0, MOE_F32, 1, {5, 16, 0}},
    {"gelu-f32", 64, 96, 8, 2, "gelu", 0, 0, MOE_F32, 1, {9, 0}},
    {"renorm-k3", 48, 64, 8, 3, "swiglu", 1, 0, MOE_F32, 1, {13, 0}},
    {"capacity", 32, 64, 4, 2, "swiglu", 0, 0.5, MOE_F32, 2, {33, 8, 0}},
    {"swiglu-bf16", 128, 256, 8, 2, "swiglu", 0, 0, MOE_BF16, 1, {1, 31, 0}},
    {"gelu-bf16-renorm-cap", 64, 128, 8, 2, "gelu", 1, 1.0, MOE_BF16, 1, {40, 0}},
};

static const fcase cases_w3[] = {
    {"swiglu-f32", 64, 128, 8, 2, "swiglu", 0, 0, MOE_F32, 2, {1, 10, 0}},
    {"idle-experts-k1", 32, 64, 16, 1, "swiglu", 0, 0, MOE_F32, 1, {1, 0}},
    {"k-equals-e-gelu", 32, 64, 5, 5, "gelu", 1, 0, MOE_F32, 1, {7, 0}},
    {"capacity", 32, 64, 6, 2, "swiglu", 0, 0.75, MOE_F32, 1, {29, 0}},
    {"swiglu-bf16", 96, 192, 8, 2, "swiglu", 1, 0, MOE_BF16, 1, {1, 20, 0}},
};

static void check_cases(int W, const fcase *cases, int ncases)
{
    cluster_opts o = {.workers = W};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    for (int i = 0; i < ncases; i++)
        run_case(cl, &cases[i], W);
    cr_assert_eq(cluster_stop(cl), 0, "cluster_stop: %s", cluster_error());
}

Test(cluster_forward, matches_reference_two_workers, .timeout = 60, .fini = cluster_fini_all)
{
    check_cases(2, cases_w2, (int)(sizeof(cases_w2) / sizeof(cases_w2[0])));
}

Test(cluster_forward, matches_reference_three_workers, .timeout = 60, .fini = cluster_fini_all)
{
    check_cases(3, cases_w3, (int)(sizeof(cases_w3) / sizeof(cases_w3[0])));
}

/* ---- several clients at once: every reply carries its own request's y ---- */

#define NTHREADS 4
#define NITER    4

typedef struct conc_arg {
    const char *url;
    const ref_weights *w;
    const fcase *c;
    int id;
    char fail[256];
} conc_arg;

static void *conc_main(void *p)
{
    conc_arg *a = p;
    const fcase *c = a->c;
    moe_client *cli;
    if (moe_client_open(a->url, NULL, &cli) != MOE_OK) {
        snprintf(a->fail, sizeof(a->fail), "open: %s", moe_last_error());
        return NULL;
    }
    kern_layer_weights lw = {.wr = a->w->wr, .w1 = a->w->w1, .w3 = a->w->w3, .w2 = a->w->w2};
    for (int it = 0; it < NITER && !a->fail[0]; it++) {
        int T = 3 + 5 * a->id + it; /* every call a different shape and input */
        size_t n = (size_t)T * c->H;
        float *x = malloc(n * 4), *y = malloc(n * 4), *yref = malloc(n * 4);
        rng_fill_uniform(77, (uint64_t)(a->id * 100 + it), -1, 1, x, n);
        kern_moe_shape s = {.T = T,
                            .H = c->H,
                            .F = c->F,
                            .E = c->E,
                            .K = c->K,
                            .act = KERN_ACT_SWIGLU,
                            .renorm = 0,
                            .capacity_factor = 0,
                            .bf16 = 0};
        kern_moe_forward_ref(&s, &lw, x, yref, NULL);
        moe_err e = moe_forward(cli, "conc", 0, MOE_F32, x, T, c->H, y, NULL);
        double rel = e == MOE_OK ? kern_rel_err(y, yref, n) : 1;
        if (e != MOE_OK)
            snprintf(a->fail, sizeof(a->fail), "client %d call %d: %s", a->id, it,
                     moe_last_error());
        else if (!(rel < 1e-5))
            snprintf(a->fail, sizeof(a->fail), "client %d call %d (T=%d): rel err %g", a->id, it, T,
                     rel);
        free(x);
        free(y);
        free(yref);
    }
    moe_client_close(cli);
    return NULL;
}

Test(cluster_forward, concurrent_clients, .timeout = 60, .fini = cluster_fini_all)
{
    static const fcase c = {"conc", 64, 128, 8, 2, "swiglu", 0, 0, MOE_F32, 1, {0}};
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    moe_model_config mc = {0};
    mc.name = "conc";
    mc.layers = 1;
    mc.d_model = c.H;
    mc.d_ff = c.F;
    mc.n_experts = c.E;
    mc.top_k = c.K;
    mc.seed = 99;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "%s", moe_last_error());
    ref_weights w;
    ref_build(&c, 99, 0, &w);
    pthread_t th[NTHREADS];
    static conc_arg args[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        args[i] = (conc_arg){cl->url, &w, &c, i, ""};
        pthread_create(&th[i], NULL, conc_main, &args[i]);
    }
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < NTHREADS; i++)
        cr_assert(!args[i].fail[0], "%s", args[i].fail);
    ref_free(&w);
    cr_assert_eq(cluster_stop(cl), 0, "cluster_stop: %s", cluster_error());
}
