/* test_kern_router.c - softmax and top-k (ties, renorm, K=1, K=E), layout
 * (stability, counts, offsets, inverse), capacity and its drop counts, and
 * the aux / z losses. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"
#include "common/rng.h"

Test(kern_router, softmax_matches_double)
{
    enum { T = 33, E = 7, K = 3 };
    float logits[T * E], probs[T * E], w[T * K];
    int32_t idx[T * K];
    rng_fill_uniform(11, 0, -4.0f, 4.0f, logits, T * E);
    logits[5] = 1000.0f; /* no overflow: the max is subtracted */
    kern_softmax_topk_cpu(logits, T, E, K, 0, probs, idx, w);
    for (int t = 0; t < T; t++) {
        double mx = -INFINITY, sum = 0.0;
        for (int e = 0; e < E; e++)
            mx = fmax(mx, logits[t * E + e]);
        for (int e = 0; e < E; e++)
            sum += exp(logits[t * E + e] - mx);
        for (int e = 0; e < E; e++) {
            double want = exp(logits[t * E + e] - mx) / sum;
            cr_expect(fabs(probs[t * E + e] - want) <= 1e-6 * (want + 1e-6), "p[%d,%d] %g vs %g", t,
                      e, (double)probs[t * E + e], want);
        }
        /* top-k: descending, each chosen >= each unchosen, weights = probs */
        for (int j = 0; j < K; j++) {
            int ej = idx[t * K + j];
            cr_assert(ej >= 0 && ej < E);
            cr_expect_eq(w[t * K + j], probs[t * E + ej]);
            if (j > 0)
                cr_expect(probs[t * E + idx[t * K + j - 1]] >= probs[t * E + ej]);
            for (int e = 0; e < E; e++) {
                int chosen = 0;
                for (int i = 0; i < K; i++)
                    chosen |= idx[t * K + i] == e;
                if (!chosen)
                    cr_expect(probs[t * E + ej] >= probs[t * E + e]);
            }
        }
    }
    cr_expect_eq(idx[0], 5);
}

Test(kern_router, topk_ties_go_to_lower_index)
{
    /* token 0: all equal; token 1: a tie at the top; token 2: a tie at the cut */
    const float logits[3 * 4] = {0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 3.0f,
                                 3.0f, 0.0f, 2.0f, 1.0f, 0.0f, 1.0f};
    float probs[12], w[6];
    int32_t idx[6];
    kern_softmax_topk_cpu(logits, 3, 4, 2, 1, probs, idx, w);
    cr_expect(idx[0] == 0 && idx[1] == 1, "all equal: %d %d", idx[0], idx[1]);
    cr_expect(idx[2] == 1 && idx[3] == 2, "top tie: %d %d", idx[2], idx[3]);
    cr_expect(idx[4] == 0 && idx[5] == 1, "cut tie: %d %d", idx[4], idx[5]);
    cr_expect_float_eq(w[0], 0.5f, 1e-7f);
    cr_expect_float_eq(w[1], 0.5f, 1e-7f);
    cr_expect_float_eq(w[2], 0.5f, 1e-7f);
    cr_expect_float_eq(w[4] + w[5], 1.0f, 1e-6f);
}

Test(kern_router, renorm_k1_and_k_equals_e)
{
    enum { T = 9, E = 5 };
    float logits[T * E], probs[T * E], w[T * E];
    int32_t idx[T * E];
    rng_fill_uniform(12, 0, -3.0f, 3.0f, logits, T * E);
    /* K = 1 with renorm: weight 1 */
    kern_softmax_topk_cpu(logits, T, E, 1, 1, probs, idx, w);
    for (int t = 0; t < T; t++)
        cr_expect_float_eq(w[t], 1.0f, 1e-6f);
    /* K = 1 without renorm: the max probability */
    kern_softmax_topk_cpu(logits, T, E, 1, 0, probs, idx, w);
    for (int t = 0; t < T; t++) {
        float mx = 0.0f;
        for (int e = 0; e < E; e++)
            mx = fmaxf(mx, probs[t * E + e]);
        cr_expect_eq(w[t], mx);
    }
    /* K = E: a permutation, weights sum to 1 with or without renorm */
    for (int renorm = 0; renorm < 2; renorm++) {
        kern_softmax_topk_cpu(logits, T, E, E, renorm, probs, idx, w);
        for (int t = 0; t < T; t++) {
            int seen = 0;
            float sum = 0.0f;
            for (int j = 0; j < E; j++) {
                seen |= 1 << idx[t * E + j];
                sum += w[t * E + j];
                cr_expect_float_eq(w[t * E + j], probs[t * E + idx[t * E + j]], 1e-6f);
            }
            cr_expect_eq(seen, (1 << E) - 1);
            cr_expect_float_eq(sum, 1.0f, 1e-5f);
        }
    }
    /* K = 2 renorm: ratios kept, sum 1 */
    kern_softmax_topk_cpu(logits, T, E, 2, 1, probs, idx, w);
    for (int t = 0; t < T; t++) {
        float p0 = probs[t * E + idx[2 * t]], p1 = probs[t * E + idx[2 * t + 1]];
        cr_expect_float_eq(w[2 * t], p0 / (p0 + p1), 1e-6f);
        cr_expect_float_eq(w[2 * t] + w[2 * t + 1], 1.0f, 1e-6f);
    }
}

Test(kern_layout, stable_counts_offsets_inverse)
{
    enum { T = 50, K = 3, E = 6, S = T * K };
    float logits[T * E], probs[T * E], w[S];
    int32_t idx[S], counts[E], offsets[E + 1], perm[S], inv[S];
    rng_fill_uniform(13, 0, -2.0f, 2.0f, logits, T * E);
    kern_softmax_topk_cpu(logits, T, E, K, 0, probs, idx, w);
    kern_layout_cpu(idx, T, K, E, counts, offsets, perm, inv);
    int32_t want[E] = {0};
    for (int s = 0; s < S; s++)
        want[idx[s]]++;
    cr_expect_eq(offsets[0], 0);
    for (int e = 0; e < E; e++) {
        cr_expect_eq(counts[e], want[e], "counts[%d]", e);
        cr_expect_eq(offsets[e + 1], offsets[e] + want[e]);
        for (int32_t p = offsets[e]; p < offsets[e + 1]; p++) {
            cr_expect_eq(idx[perm[p]], e, "perm[%d] in the wrong expert", p);
            if (p > offsets[e])
                cr_expect(perm[p] > perm[p - 1], "unstable at %d", p);
        }
    }
    cr_expect_eq(offsets[E], S);
    for (int s = 0; s < S; s++)
        cr_expect_eq(perm[inv[s]], s);
    /* inv may be NULL */
    int32_t perm2[S];
    kern_layout_cpu(idx, T, K, E, counts, offsets, perm2, NULL);
    cr_expect(memcmp(perm, perm2, sizeof(perm)) == 0);
    /* T = 0 */
    kern_layout_cpu(idx, 0, K, E, counts, offsets, perm2, NULL);
    for (int e = 0; e <= E; e++)
        cr_expect_eq(offsets[e], 0);
}

Test(kern_layout, capacity_values)
{
    cr_expect_eq(kern_capacity(0.0f, 100, 2, 8), INT32_MAX);
    cr_expect_eq(kern_capacity(-1.0f, 100, 2, 8), INT32_MAX);
    cr_expect_eq(kern_capacity(1.0f, 10, 2, 4), 5);
    cr_expect_eq(kern_capacity(1.1f, 10, 2, 2), 11); /* not 12 from 1.1f's error */
    cr_expect_eq(kern_capacity(1.25f, 7, 2, 4), 5);  /* ceil(4.375) */
    cr_expect_eq(kern_capacity(2.0f, 3, 1, 4), 2);   /* ceil(1.5) */
    cr_expect_eq(kern_capacity(0.01f, 1, 1, 8), 1);
    cr_expect_eq(kern_capacity(1.0f, 0, 2, 4), 0);
}

Test(kern_layout, capacity_drops_in_stable_order)
{
    /* T=6, K=2, E=3: expert 0 gets slots 0,2,5,6,8 */
    const int32_t idx[12] = {0, 1, 0, 2, 1, 0, 0, 2, 0, 1, 2, 1};
    int32_t counts[3], offsets[4], perm[12], dropped[3];
    uint8_t keep[12];
    kern_layout_cpu(idx, 6, 2, 3, counts, offsets, perm, NULL);
    cr_expect(counts[0] == 5 && counts[1] == 4 && counts[2] == 3);
    kern_apply_capacity_cpu(counts, offsets, perm, 3, 2, keep, dropped);
    cr_expect(dropped[0] == 3 && dropped[1] == 2 && dropped[2] == 1, "dropped %d %d %d", dropped[0],
              dropped[1], dropped[2]);
    const uint8_t want[12] = {1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0};
    for (int s = 0; s < 12; s++)
        cr_expect_eq(keep[s], want[s], "keep[%d]", s);
    /* a cap at or above every count drops nothing */
    kern_apply_capacity_cpu(counts, offsets, perm, 3, INT32_MAX, keep, dropped);
    for (int s = 0; s < 12; s++)
        cr_expect_eq(keep[s], 1);
    cr_expect(dropped[0] == 0 && dropped[1] == 0 && dropped[2] == 0);
    kern_apply_capacity_cpu(counts, offsets, perm, 3, 0, keep, dropped);
    cr_expect(dropped[0] == 5 && dropped[1] == 4 && dropped[2] == 3);
}

Test(kern_loss, aux_and_z)
{
    enum { T = 8, E = 4, K = 2 };
    /* uniform probs and counts: aux = 1 */
    float probs[T * E], logits[T * E];
    for (int i = 0; i < T * E; i++)
        probs[i] = 1.0f / E;
    int32_t counts[E] = {4, 4, 4, 4};
    cr_expect_float_eq(kern_aux_loss_cpu(probs, counts, T, E, K), 1.0f, 1e-6f);
    /* random: against the formula in double */
    float w[T * K];
    int32_t idx[T * K], offsets[E + 1], perm[T * K];
    rng_fill_uniform(14, 0, -2.0f, 2.0f, logits, T * E);
    kern_softmax_topk_cpu(logits, T, E, K, 0, probs, idx, w);
    kern_layout_cpu(idx, T, K, E, counts, offsets, perm, NULL);
    double aux = 0.0, z = 0.0;
    for (int e = 0; e < E; e++) {
        double m = 0.0;
        for (int t = 0; t < T; t++)
            m += probs[t * E + e] / T;
        aux += counts[e] * m;
    }
    aux *= (double)E / (K * T);
    for (int t = 0; t < T; t++) {
        double s = 0.0;
        for (int e = 0; e < E; e++)
            s += exp(logits[t * E + e]);
        z += log(s) * log(s) / T;
    }
    cr_expect(fabs(kern_aux_loss_cpu(probs, counts, T, E, K) - aux) < 1e-6 * aux);
    cr_expect(fabs(kern_z_loss_cpu(logits, T, E) - z) < 1e-6 * z);
    cr_expect_eq(kern_aux_loss_cpu(probs, counts, 0, E, K), 0.0f);
    cr_expect_eq(kern_z_loss_cpu(logits, 0, E), 0.0f);
}
