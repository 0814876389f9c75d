/* test_kern_grad.c - every gradient of kern_moe_backward_ref (dx, dwr, dw1,
 * dw3, dw2), with the aux and z losses on, renorm on and off, SwiGLU and
 * GELU, with and without capacity drops, against central finite differences
 * of an independent float64 forward; and the router backward split over
 * token shards with global counts. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"
#include "common/rng.h"

enum { T = 5, H = 6, F = 7, E = 4, K = 2 };

/* The parameters of the objective, in double: one array, carved. */
typedef struct {
    double x[T * H], wr[E * H], w1[E * F * H], w3[E * F * H], w2[E * H * F];
} params64;

/* moe_objective_f64: <dy, y> + aux_coef*aux + z_coef*z in float64, written
 * from the formulas (not from the kernels). idx (T,K) out: the routing. */
static double moe_objective_f64(const kern_moe_shape *s, const params64 *p, const double *dy,
                                double aux_coef, double z_coef, int32_t *idx)
{
    double probs[T * E], lse[T], tw[T * K];
    int counts[E] = {0};
    memset(idx, 0, sizeof(int32_t) * T * K);
    for (int t = 0; t < T; t++) {
        double l[E], mx = -INFINITY, sum = 0.0;
        for (int e = 0; e < E; e++) {
            l[e] = 0.0;
            for (int h = 0; h < H; h++)
                l[e] += p->x[t * H + h] * p->wr[e * H + h];
            mx = fmax(mx, l[e]);
        }
        for (int e = 0; e < E; e++)
            sum += exp(l[e] - mx);
        for (int e = 0; e < E; e++)
            probs[t * E + e] = exp(l[e] - mx) / sum;
        lse[t] = mx + log(sum);
        double wsum = 0.0;
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++)
                    taken |= idx[t * K + i] == e;
                if (!taken && (best < 0 || probs[t * E + e] > probs[t * E + best]))
                    best = e;
            }
            idx[t * K + j] = best;
            tw[t * K + j] = probs[t * E + best];
            wsum += tw[t * K + j];
            counts[best]++;
        }
        if (s->renorm)
            for (int j = 0; j < K; j++)
                tw[t * K + j] /= wsum;
    }
    int32_t cap = kern_capacity(s->capacity_factor, T, K, E);
    int seen[E] = {0};
    double obj = 0.0;
    for (int slot = 0; slot < T * K; slot++) {
        int t = slot / K, e = idx[slot];
        if (seen[e]++ >= cap)
            continue; /* dropped */
        const double *xt = p->x + t * H;
        double hid[F];
        for (int f = 0; f < F; f++) {
            double a = 0.0, b = 0.0;
            for (int i = 0; i < H; i++) {
                a += xt[i] * p->w1[(e * F + f) * H + i];
                b += xt[i] * p->w3[(e * F + f) * H + i];
            }
            hid[f] = s->act == KERN_ACT_GELU ? 0.5 * a * (1.0 + erf(a / sqrt(2.0)))
                                             : a / (1.0 + exp(-a)) * b;
        }
        for (int i = 0; i < H; i++) {
            double ye = 0.0;
            for (int f = 0; f < F; f++)
                ye += hid[f] * p->w2[(e * H + i) * F + f];
            obj += dy[t * H + i] * tw[slot] * ye;
        }
    }
    double aux = 0.0, z = 0.0;
    for (int e = 0; e < E; e++) {
        double m = 0.0;
        for (int t = 0; t < T; t++)
            m += probs[t * E + e] / T;
        aux += counts[e] * m;
    }
    aux *= (double)E / ((double)K * T);
    for (int t = 0; t < T; t++)
        z += lse[t] * lse[t] / T;
    return obj + aux_coef * aux + z_coef * z;
}

static void expect_grad(const char *name, const float *got, const float *want, size_t n, double tol)
{
    double r = kern_rel_err(got, want, n);
    fprintf(stderr, "    %-4s rel err %.2e\n", name, r);
    if (!(r <= tol))
        kern_print_mismatches(name, got, want, n, tol, 8);
    cr_expect(r <= tol, "%s: rel err %.3g > %.3g", name, r, tol);
}

static void grad_check(kern_act act, int renorm, float cf, uint64_t seed)
{
    const float aux_coef = 0.3f, z_coef = 0.2f;
    kern_moe_shape s = {.T = T,
                        .H = H,
                        .F = F,
                        .E = E,
                        .K = K,
                        .act = act,
                        .renorm = renorm,
                        .capacity_factor = cf,
                        .bf16 = 0};
    /* float inputs; the router weights are larger so that routing margins
     * are wide compared with the FD step */
    static float x[T * H], wr[E * H], w1[E * F * H], w3[E * F * H], w2[E * H * F], dy[T * H];
    rng_fill_uniform(seed, 0, -1.0f, 1.0f, x, T * H);
    rng_fill_uniform(seed, 1, -1.0f, 1.0f, wr, E * H);
    rng_fill_uniform(seed, 2, -0.5f, 0.5f, w1, E * F * H);
    rng_fill_uniform(seed, 3, -0.5f, 0.5f, w3, E * F * H);
    rng_fill_uniform(seed, 4, -0.5f, 0.5f, w2, E * H * F);
    rng_fill_uniform(seed, 5, -1.0f, 1.0f, dy, T * H);
    kern_layer_weights w = {.wr = wr, .w1 = w1, .w3 = act == KERN_ACT_GELU ? NULL : w3, .w2 = w2};

    static float dx[T * H], dwr[E * H], dw1[E * F * H], dw3[E * F * H], dw2[E * H * F];
    memset(dw3, 0, sizeof(dw3));
    moe_err err = kern_moe_backward_ref(&s, &w, x, dy, aux_coef, z_coef, dx, dwr, dw1,
                                        act == KERN_ACT_GELU ? NULL : dw3, dw2);
    cr_assert_eq(err, MOE_OK);

    static params64 p;
    double dyd[T * H];
    for (int i = 0; i < T * H; i++)
        p.x[i] = x[i], dyd[i] = dy[i];
    for (int i = 0; i < E * H; i++)
        p.wr[i] = wr[i];
    for (int i = 0; i < E * F * H; i++)
        p.w1[i] = w1[i], p.w3[i] = w3[i], p.w2[i] = w2[i];

    /* the float forward and the double objective agree, and route alike */
    int32_t idx0[T * K], idx[T * K];
    double obj = moe_objective_f64(&s, &p, dyd, aux_coef, z_coef, idx0);
    float y[T * H];
    int32_t counts[E], dropped[E];
    kern_fwd_stats st = {counts, dropped, 0, 0};
    cr_assert_eq(kern_moe_forward_ref(&s, &w, x, y, &st), MOE_OK);
    double objf = aux_coef * st.aux_loss + z_coef * st.z_loss;
    for (int i = 0; i < T * H; i++)
        objf += (double)dy[i] * y[i];
    cr_expect(fabs(objf - obj) <= 1e-5 * fabs(obj), "objective f32 %.9g f64 %.9g", objf, obj);
    int ndrop = 0;
    for (int e = 0; e < E; e++)
        ndrop += dropped[e];
    fprintf(stderr, "  grad check act=%d renorm=%d cf=%g: objective %.6f, %d dropped\n", act,
            renorm, (double)cf, obj, ndrop);
    if (cf > 0.0f)
        cr_expect(ndrop > 0, "the capacity case should drop slots");

    /* central differences over every parameter */
    const double eps = 1e-6;
    struct {
        const char *name;
        double *v;
        const float *g;
        size_t n;
    } ts[] = {{"dx", p.x, dx, T * H},
              {"dwr", p.wr, dwr, E * H},
              {"dw1", p.w1, dw1, E * F * H},
              {"dw3", p.w3, dw3, E * F * H},
              {"dw2", p.w2, dw2, E * H * F}};
    static float fd[E * F * H];
    int flips = 0;
    for (size_t k = 0; k < sizeof(ts) / sizeof(ts[0]); k++) {
        if (act == KERN_ACT_GELU && strcmp(ts[k].name, "dw3") == 0)
            continue;
        for (size_t i = 0; i < ts[k].n; i++) {
            double keep = ts[k].v[i];
            ts[k].v[i] = keep + eps;
            double lp = moe_objective_f64(&s, &p, dyd, aux_coef, z_coef, idx);
            flips += memcmp(idx, idx0, sizeof(idx)) != 0;
            ts[k].v[i] = keep - eps;
            double lm = moe_objective_f64(&s, &p, dyd, aux_coef, z_coef, idx);
            flips += memcmp(idx, idx0, sizeof(idx)) != 0;
            ts[k].v[i] = keep;
            fd[i] = (float)((lp - lm) / (2 * eps));
        }
        expect_grad(ts[k].name, ts[k].g, fd, ts[k].n, 1e-4);
    }
    cr_expect_eq(flips, 0, "routing changed at %d FD points: pick another seed", flips);
}

Test(kern_grad, swiglu_renorm)
{
    grad_check(KERN_ACT_SWIGLU, 1, 0.0f, 31);
}

Test(kern_grad, swiglu_no_renorm)
{
    grad_check(KERN_ACT_SWIGLU, 0, 0.0f, 32);
}

Test(kern_grad, gelu_renorm)
{
    grad_check(KERN_ACT_GELU, 1, 0.0f, 33);
}

Test(kern_grad, gelu_no_renorm)
{
    grad_check(KERN_ACT_GELU, 0, 0.0f, 34);
}

Test(kern_grad, swiglu_renorm_capacity)
{
    grad_check(KERN_ACT_SWIGLU, 1, 0.75f, 35);
}

Test(kern_grad, gelu_no_renorm_capacity)
{
    grad_check(KERN_ACT_GELU, 0, 0.75f, 36);
}

/* Router backward over token shards with the global counts and T_global
 * sums to the backward over the whole batch. */
Test(kern_grad, router_backward_shards_sum_to_global)
{
    enum { TT = 12, HH = 5, EE = 6, KK = 2, S = TT * KK };
    float x[TT * HH], wr[EE * HH], logits[TT * EE], probs[TT * EE], tw[S], dw[S];
    int32_t idx[S], counts[EE], offsets[EE + 1], perm[S];
    rng_fill_uniform(40, 0, -1.0f, 1.0f, x, TT * HH);
    rng_fill_uniform(40, 1, -1.0f, 1.0f, wr, EE * HH);
    rng_fill_uniform(40, 2, -1.0f, 1.0f, dw, S);
    kern_router_logits_cpu(x, wr, TT, HH, EE, logits);
    kern_softmax_topk_cpu(logits, TT, EE, KK, 1, probs, idx, tw);
    kern_layout_cpu(idx, TT, KK, EE, counts, offsets, perm, NULL);
    for (int renorm = 0; renorm < 2; renorm++) {
        float dwr_all[EE * HH] = {0}, dx_all[TT * HH] = {0};
        float dwr_sh[EE * HH] = {0}, dx_sh[TT * HH] = {0};
        kern_router_backward_cpu(x, wr, logits, probs, idx, dw, TT, HH, EE, KK, renorm, counts, TT,
                                 0.5f, 0.1f, dwr_all, dx_all);
        const int cut[3] = {0, 5, TT};
        for (int k = 0; k < 2; k++) {
            int t0 = cut[k], n = cut[k + 1] - cut[k];
            kern_router_backward_cpu(x + t0 * HH, wr, logits + t0 * EE, probs + t0 * EE,
                                     idx + t0 * KK, dw + t0 * KK, n, HH, EE, KK, renorm, counts, TT,
                                     0.5f, 0.1f, dwr_sh, dx_sh + t0 * HH);
        }
        double r1 = kern_rel_err(dwr_sh, dwr_all, EE * HH);
        double r2 = kern_rel_err(dx_sh, dx_all, TT * HH);
        cr_expect(r1 < 1e-6 && r2 < 1e-6, "renorm=%d: dwr %.3g dx %.3g", renorm, r1, r2);
    }
}
