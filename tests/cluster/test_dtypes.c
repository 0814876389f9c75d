/*
 * test_dtypes.c - a forward whose x is f16 (IEEE half) on an f32 model: the
 * service converts it exactly, computes in f32 and answers y in f16, equal to
 * the reference on the same (converted) x within f16 rounding.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

Test(dtypes, f16_input_and_output, .timeout = 60, .fini = cluster_fini_all)
{
    const int T = 9, H = 32, F = 48, E = 4, K = 2;
    cluster_opts o = {0};
    o.workers = 2;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    moe_model_config cfg = {"h", 1, H, F, E, K, "swiglu", 1, 0, MOE_F32, 6, 0, 0};
    cr_assert_eq(moe_model_create(cl->cli, &cfg), MOE_OK, "%s", moe_last_error());
    size_t n = (size_t)T * H, fh = (size_t)F * H;
    float *x = malloc(n * 4), *yr = malloc(n * 4);
    _Float16 *xh = malloc(n * 2), *yh = malloc(n * 2);
    rng_fill_uniform(3, 3, -1, 1, x, n);
    for (size_t i = 0; i < n; i++) {
        xh[i] = (_Float16)x[i];
        x[i] = (float)xh[i]; /* the reference sees what the service sees */
    }
    cr_assert_eq(moe_forward(cl->cli, "h", 0, MOE_F16, xh, T, H, yh, NULL), MOE_OK, "%s",
                 moe_last_error());
    float *wr = malloc((size_t)E * H * 4), *w1 = malloc(E * fh * 4), *w3 = malloc(E * fh * 4),
          *w2 = malloc(E * fh * 4);
    kern_init_weight(6, 0, 0, KERN_W_ROUTER, E, H, wr);
    for (int e = 0; e < E; e++) {
        kern_init_weight(6, 0, e, KERN_W1, F, H, w1 + e * fh);
        kern_init_weight(6, 0, e, KERN_W3, F, H, w3 + e * fh);
        kern_init_weight(6, 0, e, KERN_W2, H, F, w2 + e * fh);
    }
    kern_moe_shape sh = {.T = T,
                         .H = H,
                         .F = F,
                         .E = E,
                         .K = K,
                         .act = KERN_ACT_SWIGLU,
                         .renorm = 1,
                         .capacity_factor = 0,
                         .bf16 = 0};
    kern_layer_weights lw = {.wr = wr, .w1 = w1, .w3 = w3, .w2 = w2};
    cr_assert_eq(kern_moe_forward_ref(&sh, &lw, x, yr, NULL), MOE_OK);
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        double v = (double)yh[i];
        cr_assert(!isnan(v), "y[%zu] is NaN", i);
        d += (v - yr[i]) * (v - yr[i]);
        r += (double)yr[i] * yr[i];
    }
    double e = sqrt(d / r);
    cr_log_info("f16 forward: rel err %.2e", e);
    cr_expect(e < 2e-3, "f16 forward rel err %g", e);
    free(x), free(yr), free(xh), free(yh), free(wr), free(w1), free(w3), free(w2);
    cr_assert_eq(cluster_stop(cl), 0);
}
