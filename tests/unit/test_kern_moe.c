/* test_kern_moe.c - kern_moe_forward_ref: against a per-token computation
 * from the pieces (dropless and with capacity), dropped counts reported and
 * dropped slots adding zero, bf16 output, argument errors. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"
#include "common/rng.h"

enum { T = 16, H = 24, F = 20, E = 4, K = 2 };

static float x[T * H], wr[E * H], w1[E * F * H], w3[E * F * H], w2[E * H * F];

static void make_inputs(uint64_t seed, int bf16)
{
    rng_fill_uniform(seed, 0, -1.0f, 1.0f, x, T * H);
    kern_init_weight(seed, 0, 0, KERN_W_ROUTER, E, H, wr);
    for (int e = 0; e < E; e++) {
        kern_init_weight(seed, 0, e, KERN_W1, F, H, w1 + e * F * H);
        kern_init_weight(seed, 0, e, KERN_W3, F, H, w3 + e * F * H);
        kern_init_weight(seed, 0, e, KERN_W2, H, F, w2 + e * H * F);
    }
    if (bf16) {
        kern_bf16_round_n(wr, E * H);
        kern_bf16_round_n(w1, E * F * H);
        kern_bf16_round_n(w3, E * F * H);
        kern_bf16_round_n(w2, E * H * F);
    }
}

/* per_token: y (T,H) computed token by token: each kept slot's expert run
 * on that one row (blas path), weighted, summed in j order. */
static void per_token(const kern_moe_shape *s, float *y, int32_t *dropped_out)
{
    float logits[T * E], probs[T * E], tw[T * K], ye[H];
    int32_t idx[T * K];
    kern_router_logits_cpu(x, wr, T, H, E, logits);
    kern_softmax_topk_cpu(logits, T, E, K, s->renorm, probs, idx, tw);
    int32_t cap = kern_capacity(s->capacity_factor, T, K, E), seen[E] = {0};
    memset(dropped_out, 0, E * sizeof(int32_t));
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < H; i++)
            y[t * H + i] = 0.0f;
        for (int j = 0; j < K; j++) {
            int e = idx[t * K + j];
            if (seen[e]++ >= cap) {
                dropped_out[e]++;
                continue;
            }
            kern_expert_ffn_blas(x + t * H, 1, H, F, w1 + e * F * H, w3 + e * F * H, w2 + e * H * F,
                                 s->act, 0, NULL, NULL, ye);
            for (int i = 0; i < H; i++)
                y[t * H + i] += tw[t * K + j] * ye[i];
        }
    }
}

static void check_forward(kern_act act, int renorm, float cf)
{
    make_inputs(60 + (uint64_t)act, 0);
    kern_moe_shape s = {.T = T,
                        .H = H,
                        .F = F,
                        .E = E,
                        .K = K,
                        .act = act,
                        .renorm = renorm,
                        .capacity_factor = cf,
                        .bf16 = 0};
    kern_layer_weights w = {.wr = wr, .w1 = w1, .w3 = w3, .w2 = w2};
    float y[T * H], want[T * H];
    int32_t counts[E], dropped[E], want_dropped[E];
    kern_fwd_stats st = {counts, dropped, 0, 0};
    cr_assert_eq(kern_moe_forward_ref(&s, &w, x, y, &st), MOE_OK);
    per_token(&s, want, want_dropped);
    double r = kern_rel_err(y, want, T * H);
    if (r > 1e-5)
        kern_print_mismatches("y", y, want, T * H, 1e-5, 8);
    cr_expect(r <= 1e-5, "act=%d renorm=%d cf=%g: rel err %.3g", act, renorm, (double)cf, r);
    int total = 0, ndrop = 0;
    int32_t cap = kern_capacity(cf, T, K, E);
    for (int e = 0; e < E; e++) {
        total += counts[e];
        ndrop += dropped[e];
        cr_expect_eq(dropped[e], want_dropped[e], "dropped[%d]", e);
        cr_expect_eq(dropped[e], counts[e] > cap ? counts[e] - cap : 0);
    }
    cr_expect_eq(total, T * K);
    if (cf > 0.0f && cf < 1.0f)
        cr_expect(ndrop > 0, "cf=%g dropped nothing", (double)cf);
    if (cf == 0.0f)
        cr_expect_eq(ndrop, 0);
    cr_expect(st.aux_loss > 0.0f && st.z_loss > 0.0f);
}

Test(kern_moe, forward_dropless_matches_per_token)
{
    check_forward(KERN_ACT_SWIGLU, 1, 0.0f);
    check_forward(KERN_ACT_SWIGLU, 0, 0.0f);
    check_forward(KERN_ACT_GELU, 1, 0.0f);
}

Test(kern_moe, forward_capacity_drops_counted_and_zero)
{
    check_forward(KERN_ACT_SWIGLU, 1, 0.5f);
    check_forward(KERN_ACT_GELU, 0, 0.25f);
    check_forward(KERN_ACT_SWIGLU, 1, 2.0f);
    /* a cap of 1 per expert over 16 tokens: at most 4 slots survive, so at
     * least 12 tokens have all slots dropped and output exactly zero */
    make_inputs(70, 0);
    kern_moe_shape s = {.T = T,
                        .H = H,
                        .F = F,
                        .E = E,
                        .K = K,
                        .act = KERN_ACT_SWIGLU,
                        .renorm = 1,
                        .capacity_factor = 0.125f,
                        .bf16 = 0};
    cr_assert_eq(kern_capacity(s.capacity_factor, T, K, E), 1);
    kern_layer_weights w = {.wr = wr, .w1 = w1, .w3 = w3, .w2 = w2};
    float y[T * H];
    int32_t counts[E], dropped[E];
    kern_fwd_stats st = {counts, dropped, 0, 0};
    cr_assert_eq(kern_moe_forward_ref(&s, &w, x, y, &st), MOE_OK);
    int zero_rows = 0, ndrop = 0;
    for (int e = 0; e < E; e++)
        ndrop += dropped[e];
    for (int t = 0; t < T; t++) {
        int z = 1;
        for (int i = 0; i < H; i++)
            z &= y[t * H + i] == 0.0f;
        zero_rows += z;
    }
    cr_expect_geq(ndrop, T * K - E);
    cr_expect_geq(zero_rows, T - E, "only %d zero rows", zero_rows);
}

Test(kern_moe, forward_bf16_output_is_bf16)
{
    make_inputs(80, 1);
    kern_moe_shape s = {.T = T,
                        .H = H,
                        .F = F,
                        .E = E,
                        .K = K,
                        .act = KERN_ACT_SWIGLU,
                        .renorm = 1,
                        .capacity_factor = 0.0f,
                        .bf16 = 1};
    kern_layer_weights w = {.wr = wr, .w1 = w1, .w3 = w3, .w2 = w2};
    float y[T * H], y32[T * H];
    cr_assert_eq(kern_moe_forward_ref(&s, &w, x, y, NULL), MOE_OK);
    for (int i = 0; i < T * H; i++)
        cr_assert_eq(y[i], kern_bf16_round(y[i]), "y[%d] = %.9g not bf16", i, (double)y[i]);
    /* close to the f32 result on the bf16-rounded input */
    kern_bf16_round_n(x, T * H);
    s.bf16 = 0;
    cr_assert_eq(kern_moe_forward_ref(&s, &w, x, y32, NULL), MOE_OK);
    double r = kern_rel_err(y, y32, T * H);
    cr_expect(r < 2e-2 && r > 0.0, "bf16 vs f32 rel err %.3g", r);
}

Test(kern_moe, bad_arguments)
{
    make_inputs(90, 0);
    kern_layer_weights w = {.wr = wr, .w1 = w1, .w3 = w3, .w2 = w2};
    float y[T * H], dx[T * H], dwr[E * H], dw1[E * F * H], dw3[E * F * H], dw2[E * H * F];
    kern_moe_shape s = {.T = T,
                        .H = H,
                        .F = F,
                        .E = E,
                        .K = E + 1,
                        .act = KERN_ACT_SWIGLU,
                        .renorm = 1,
                        .capacity_factor = 0.0f,
                        .bf16 = 0};
    cr_expect_eq(kern_moe_forward_ref(&s, &w, x, y, NULL), MOE_EINVAL);
    s.K = 0;
    cr_expect_eq(kern_moe_forward_ref(&s, &w, x, y, NULL), MOE_EINVAL);
    s.K = K;
    cr_expect_eq(kern_moe_forward_ref(NULL, &w, x, y, NULL), MOE_EINVAL);
    cr_expect_eq(kern_moe_forward_ref(&s, &w, NULL, y, NULL), MOE_EINVAL);
    cr_expect_eq(kern_moe_forward_ref(&s, &w, x, NULL, NULL), MOE_EINVAL);
    s.act = (kern_act)7;
    cr_expect_eq(kern_moe_forward_ref(&s, &w, x, y, NULL), MOE_EINVAL);
    s.act = KERN_ACT_SWIGLU;
    kern_layer_weights no_w3 = {.wr = wr, .w1 = w1, .w3 = NULL, .w2 = w2};
    cr_expect_eq(kern_moe_forward_ref(&s, &no_w3, x, y, NULL), MOE_EINVAL);
    cr_expect_eq(kern_moe_backward_ref(&s, &w, x, x, 0, 0, dx, dwr, dw1, NULL, dw2), MOE_EINVAL);
    /* T = 0 is fine: nothing out, gradients zeroed */
    s.T = 0;
    dwr[0] = 1.0f;
    cr_expect_eq(kern_moe_forward_ref(&s, &w, x, y, NULL), MOE_OK);
    cr_expect_eq(kern_moe_backward_ref(&s, &w, x, x, 0.1f, 0.1f, dx, dwr, dw1, dw3, dw2), MOE_OK);
    cr_expect_eq(dwr[0], 0.0f);
}
