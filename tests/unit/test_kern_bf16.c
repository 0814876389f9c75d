/* test_kern_bf16.c - bf16 rounding (nearest even, NaN, inf, exact values)
 * and the determinism of kern_init_weight / rng_fill_uniform. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"
#include "common/rng.h"

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static uint32_t to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

Test(kern_bf16, exact_values_round_trip)
{
    const float exact[] = {0.0f,       1.0f,      -2.5f,    0.15625f, 65536.0f,
                           -1.0f / 64, 0x1p-130f, 0x1p-133f /* smallest bf16 subnormal */};
    for (size_t i = 0; i < sizeof(exact) / sizeof(exact[0]); i++) {
        cr_expect_eq(kern_bf16_round(exact[i]), exact[i], "value %g", (double)exact[i]);
        cr_expect_eq(to_bits(kern_bf16_to_f32(kern_f32_to_bf16(exact[i]))), to_bits(exact[i]));
    }
    cr_expect_eq(kern_f32_to_bf16(1.0f), 0x3f80);
    cr_expect_eq(kern_f32_to_bf16(-0.0f), 0x8000);
    cr_expect_eq(kern_bf16_to_f32(0x7f7f), from_bits(0x7f7f0000u)); /* largest finite */
    cr_expect_eq(kern_f32_to_bf16(from_bits(0x7f7f0000u)), 0x7f7f);
}

Test(kern_bf16, round_to_nearest_even)
{
    /* between 1 (0x3f80, even) and 1+2^-7 (0x3f81, odd): the tie goes to even */
    cr_expect_eq(kern_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
    cr_expect_eq(kern_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
    cr_expect_eq(kern_f32_to_bf16(1.0f + 0x1p-8f - 0x1p-20f), 0x3f80);
    /* between 0x3f81 (odd) and 0x3f82 (even): the tie goes up to even */
    cr_expect_eq(kern_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
    cr_expect_eq(kern_f32_to_bf16(-(1.0f + 3 * 0x1p-8f)), 0xbf82);
    cr_expect_eq(kern_f32_to_bf16(-(1.0f + 0x1p-8f)), 0xbf80);
    /* the carry runs into the exponent: 2 - 2^-9 rounds to 2 */
    cr_expect_eq(kern_bf16_round(2.0f - 0x1p-9f), 2.0f);
    /* every f32 rounds to one of its two bf16 neighbours, the nearer one */
    float in[4096];
    rng_fill_uniform(1, 0, -1000.0f, 1000.0f, in, 4096);
    for (int i = 0; i < 4096; i++) {
        uint32_t lo = to_bits(in[i]) & 0xffff0000u;
        float down = from_bits(lo), up = from_bits(lo + 0x10000u);
        float r = kern_bf16_round(in[i]);
        cr_assert(r == down || r == up, "%g -> %g", (double)in[i], (double)r);
        double dr = fabs((double)r - in[i]), dother = fabs((double)(r == down ? up : down) - in[i]);
        cr_assert(dr <= dother, "%g -> %g not nearest", (double)in[i], (double)r);
    }
    float copy[4096];
    memcpy(copy, in, sizeof(in));
    kern_bf16_round_n(copy, 4096);
    for (int i = 0; i < 4096; i++)
        cr_assert_eq(to_bits(copy[i]), to_bits(kern_bf16_round(in[i])));
}

Test(kern_bf16, nan_and_inf)
{
    cr_expect(isnan(kern_bf16_round(NAN)));
    /* payload only in the low bits: truncation would give inf */
    cr_expect(isnan(kern_bf16_round(from_bits(0x7f800001u))));
    cr_expect(isnan(kern_bf16_round(from_bits(0xff800001u))));
    cr_expect(isnan(kern_bf16_round(from_bits(0x7fffffffu))));
    cr_expect_eq(kern_f32_to_bf16(INFINITY), 0x7f80);
    cr_expect_eq(kern_f32_to_bf16(-INFINITY), 0xff80);
    cr_expect(isinf(kern_bf16_to_f32(0x7f80)));
    /* above the largest bf16 by more than half an ulp: inf, as RNE says */
    cr_expect(isinf(kern_bf16_round(3.4e38f)));
    cr_expect_eq(kern_bf16_round(-3.38e38f), -from_bits(0x7f7e0000u));
}

Test(kern_init, deterministic_and_order_independent)
{
    enum { R = 24, C = 40, NE = 4 };
    float a[NE][R * C], b[R * C];
    /* forwards */
    for (int e = 0; e < NE; e++)
        kern_init_weight(42, 3, e, KERN_W1, R, C, a[e]);
    /* backwards, one at a time, interleaved with other tensors */
    for (int e = NE - 1; e >= 0; e--) {
        float junk[R * C];
        kern_init_weight(42, 3, e, KERN_W2, C, R, junk);
        kern_init_weight(42, 3, e, KERN_W1, R, C, b);
        cr_assert(memcmp(a[e], b, sizeof(b)) == 0, "expert %d differs by call order", e);
    }
    float bound = 1.0f / sqrtf((float)C);
    double mean = 0.0;
    for (int i = 0; i < R * C; i++) {
        cr_assert(fabsf(a[0][i]) <= bound, "a[%d]=%g out of bound %g", i, (double)a[0][i],
                  (double)bound);
        mean += a[0][i];
    }
    mean /= R * C;
    cr_expect(fabs(mean) < 0.1 * bound, "mean %g", mean);
    /* each key component changes the values */
    float c[R * C];
    kern_init_weight(43, 3, 0, KERN_W1, R, C, c);
    cr_expect(memcmp(a[0], c, sizeof(c)) != 0, "seed ignored");
    kern_init_weight(42, 4, 0, KERN_W1, R, C, c);
    cr_expect(memcmp(a[0], c, sizeof(c)) != 0, "layer ignored");
    cr_expect(memcmp(a[0], a[1], sizeof(c)) != 0, "expert ignored");
    kern_init_weight(42, 3, 0, KERN_W3, R, C, c);
    cr_expect(memcmp(a[0], c, sizeof(c)) != 0, "which ignored");
    /* the router ignores expert */
    float r0[R * C], r1[R * C];
    kern_init_weight(42, 3, 0, KERN_W_ROUTER, R, C, r0);
    kern_init_weight(42, 3, 7, KERN_W_ROUTER, R, C, r1);
    cr_expect(memcmp(r0, r1, sizeof(r0)) == 0, "router depends on expert");
    /* value i depends only on the key and i: a (R/2, C) block is a prefix */
    kern_init_weight(42, 3, 2, KERN_W1, R / 2, C, c);
    cr_expect(memcmp(a[2], c, sizeof(float) * (R / 2) * C) == 0);
}

Test(kern_init, pinned_values)
{
    /* Checkpoints and cross-process checks rely on these exact numbers: a
     * change to the hash must be deliberate. */
    float w[4];
    kern_init_weight(1234, 0, 5, KERN_W2, 1, 4, w);
    uint32_t want[4] = {0xbef1eed0u, 0xbef9b04eu, 0x3e6f8c80u, 0x3edad04cu};
    for (int i = 0; i < 4; i++)
        cr_expect_eq(to_bits(w[i]), want[i], "w[%d] = %.9g (0x%08x)", i, (double)w[i],
                     to_bits(w[i]));
}

Test(kern_init, fill_uniform)
{
    enum { N = 10000 };
    float *u = malloc(N * sizeof(float)), *v = malloc(N * sizeof(float));
    rng_fill_uniform(7, 1, -2.0f, 3.0f, u, N);
    rng_fill_uniform(7, 1, -2.0f, 3.0f, v, N);
    cr_expect(memcmp(u, v, N * sizeof(float)) == 0);
    double mean = 0.0;
    int zeros = 0;
    for (int i = 0; i < N; i++) {
        cr_assert(u[i] >= -2.0f && u[i] < 3.0f, "u[%d] = %g", i, (double)u[i]);
        mean += u[i];
        zeros += u[i] == 0.0f;
    }
    mean /= N;
    cr_expect(fabs(mean - 0.5) < 0.05, "mean %g", mean);
    cr_expect(zeros < 3);
    rng_fill_uniform(7, 2, -2.0f, 3.0f, v, N);
    cr_expect(memcmp(u, v, N * sizeof(float)) != 0, "stream ignored");
    free(u);
    free(v);
}
