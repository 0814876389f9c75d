/* test_act.c - the activation table (common/act.h: name, gated; kernels/act.c:
 * forward, backward) walked row by row, so a new row is checked without a
 * new test: every row has a unique name that round-trips through the model
 * config (the client's request, the coordinator's parse and write); a bad
 * name's error lists every row; gated rows refuse experts without w3 and
 * ungated rows need none; each row's backward matches a central finite
 * difference of its own forward on random inputs. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/act.h"
#include "common/model_cfg.h"
#include "common/rng.h"
#include "kernels/kern.h"
#include "proto/proto.h"

/* parse_request: model.create's params for activation name (as the client
 * writes them) parsed by the coordinator into out; returns its result. */
static moe_err parse_request(const char *name, model_cfg *out, char *err, size_t errlen)
{
    mp_writer w;
    mp_writer_init(&w);
    cr_assert_eq(
        model_cfg_write_request(&w, "m", 1, 16, 32, 4, 2, name, 1, 0.0, "f32", 7, 0.01, 0.0),
        MOE_OK);
    mp_reader r;
    uint32_t n;
    mp_reader_init(&r, w.buf, w.len);
    cr_assert_eq(mp_read_map(&r, &n, NULL), MOE_OK);
    memset(out, 0, sizeof(*out));
    moe_err e = model_cfg_parse(&r, n, out, err, errlen);
    mp_writer_fini(&w);
    return e;
}

/* reparse: c written by model_cfg_write and parsed again into out. */
static void reparse(const model_cfg *c, model_cfg *out)
{
    mp_writer w;
    mp_writer_init(&w);
    model_cfg_write(&w, c);
    mp_reader r;
    uint32_t n;
    char err[256];
    mp_reader_init(&r, w.buf, w.len);
    cr_assert_eq(mp_read_map(&r, &n, NULL), MOE_OK);
    memset(out, 0, sizeof(*out));
    cr_assert_eq(model_cfg_parse(&r, n, out, err, sizeof(err)), MOE_OK, "%s", err);
    mp_writer_fini(&w);
}

Test(act_table, rows_are_complete)
{
    for (int i = 0; i < ACT_COUNT; i++) {
        const char *name = act_rows[i].name;
        cr_assert(name, "row %d has no name", i);
        cr_expect(strlen(name) > 0 && strlen(name) < ACT_NAME_MAX, "row %d: \"%s\"", i, name);
        cr_expect(act_rows[i].gated == 0 || act_rows[i].gated == 1, "row %d", i);
        cr_expect_eq(act_parse(name), i, "\"%s\" parses to another row", name);
        cr_expect_str_eq(act_name(i), name);
        cr_expect_eq(act_gated(i), act_rows[i].gated);
        cr_expect(act_valid(i));
        const kern_act_ops *ops = kern_act_ops_of((kern_act)i);
        cr_assert(ops && ops->forward && ops->backward, "row %d (%s) has no kernels", i, name);
    }
    /* ids outside the table */
    cr_expect(!act_valid(-1) && !act_valid(ACT_COUNT));
    cr_expect_str_eq(act_name(ACT_COUNT), "?");
    cr_expect_eq(act_gated(ACT_COUNT), 0);
    cr_expect_null(kern_act_ops_of((kern_act)ACT_COUNT));
    cr_expect_eq(act_parse("no-such-act"), -1);
    cr_expect_eq(act_parse(NULL), -1);
    cr_expect_eq(act_parse("SWIGLU"), -1); /* exact, case-sensitive */
}

Test(act_table, names_round_trip_through_the_model_config)
{
    for (int i = 0; i < ACT_COUNT; i++) {
        model_cfg c, back;
        char err[256] = "";
        cr_assert_eq(parse_request(act_rows[i].name, &c, err, sizeof(err)), MOE_OK, "%s: %s",
                     act_rows[i].name, err);
        cr_expect_eq(c.act, i, "\"%s\"", act_rows[i].name);
        reparse(&c, &back);
        cr_expect_eq(back.act, i, "\"%s\" after model_cfg_write", act_rows[i].name);
        cr_expect(model_cfg_same(&c, &back));
        /* the parameter count: w1, w2, and w3 when gated */
        int64_t per_expert = (int64_t)c.d_model * c.d_ff * (act_rows[i].gated ? 3 : 2);
        cr_expect_eq(model_cfg_params(&c),
                     c.layers * (c.n_experts * c.d_model + c.n_experts * per_expert));
    }
}

Test(act_table, bad_name_lists_every_row)
{
    model_cfg c;
    char err[512] = "";
    cr_assert_eq(parse_request("swish", &c, err, sizeof(err)), MOE_EINVAL);
    cr_expect(strstr(err, "\"swish\""), "%s", err);
    for (int i = 0; i < ACT_COUNT; i++) {
        char quoted[ACT_NAME_MAX + 2];
        snprintf(quoted, sizeof(quoted), "\"%s\"", act_rows[i].name);
        cr_expect(strstr(err, quoted), "%s lacks %s", err, quoted);
    }
}

#define T_ 6
#define H_ 8
#define F_ 12
#define E_ 4
#define K_ 2

/* layer_ok: kern_moe_forward_ref on a small random layer, with or without
 * w3, for activation act; returns its result. */
static moe_err layer_ok(int act, int with_w3)
{
    float x[T_ * H_], y[T_ * H_], wr[E_ * H_], w1[E_ * F_ * H_], w3[E_ * F_ * H_], w2[E_ * H_ * F_];
    rng_fill_uniform(90, 1, -1, 1, x, T_ * H_);
    rng_fill_uniform(90, 2, -0.5f, 0.5f, wr, E_ * H_);
    rng_fill_uniform(90, 3, -0.3f, 0.3f, w1, E_ * F_ * H_);
    rng_fill_uniform(90, 4, -0.3f, 0.3f, w3, E_ * F_ * H_);
    rng_fill_uniform(90, 5, -0.3f, 0.3f, w2, E_ * H_ * F_);
    kern_moe_shape s = {.T = T_, .H = H_, .F = F_, .E = E_, .K = K_, .act = (kern_act)act};
    kern_layer_weights w = {.wr = wr, .w1 = w1, .w3 = with_w3 ? w3 : NULL, .w2 = w2};
    return kern_moe_forward_ref(&s, &w, x, y, NULL);
}

Test(act_table, gated_rows_need_w3)
{
    for (int i = 0; i < ACT_COUNT; i++) {
        cr_expect_eq(layer_ok(i, 1), MOE_OK, "%s with w3", act_rows[i].name);
        cr_expect_eq(layer_ok(i, 0), act_rows[i].gated ? MOE_EINVAL : MOE_OK, "%s without w3",
                     act_rows[i].name);
    }
}

#define N_  256
#define EPS 1e-2f

/* fd_check: row act's backward against central differences of its forward:
 * da[i] ~ dh[i] (h(a+eps) - h(a-eps)) / 2eps, and db likewise in b when
 * gated. The activation is elementwise, so one shifted array gives every
 * element's difference at once. */
static void fd_check(int act, uint64_t seed)
{
    const kern_act_ops *ops = kern_act_ops_of((kern_act)act);
    int gated = act_gated(act);
    static float a[N_], b[N_], dh[N_], da[N_], db[N_], hp[N_], hm[N_], sh[N_], da2[N_];
    rng_fill_uniform(seed, 1, -4, 4, a, N_);
    rng_fill_uniform(seed, 2, -2, 2, b, N_);
    rng_fill_uniform(seed, 3, -1, 1, dh, N_);
    ops->backward(a, gated ? b : NULL, dh, N_, da, gated ? db : NULL);
    /* d/da */
    for (int i = 0; i < N_; i++)
        sh[i] = a[i] + EPS;
    ops->forward(sh, gated ? b : NULL, N_, hp);
    for (int i = 0; i < N_; i++)
        sh[i] = a[i] - EPS;
    ops->forward(sh, gated ? b : NULL, N_, hm);
    for (int i = 0; i < N_; i++) {
        double fd = (double)dh[i] * ((double)hp[i] - hm[i]) / (2.0 * EPS);
        cr_expect(fabs(fd - da[i]) <= 2e-3 * (1.0 + fabs(fd)), "%s da[%d] = %g, fd %g",
                  act_rows[act].name, i, da[i], fd);
    }
    /* d/db (gated rows) */
    if (gated) {
        for (int i = 0; i < N_; i++)
            sh[i] = b[i] + EPS;
        ops->forward(a, sh, N_, hp);
        for (int i = 0; i < N_; i++)
            sh[i] = b[i] - EPS;
        ops->forward(a, sh, N_, hm);
        for (int i = 0; i < N_; i++) {
            double fd = (double)dh[i] * ((double)hp[i] - hm[i]) / (2.0 * EPS);
            cr_expect(fabs(fd - db[i]) <= 2e-3 * (1.0 + fabs(fd)), "%s db[%d] = %g, fd %g",
                      act_rows[act].name, i, db[i], fd);
        }
    }
    /* dh may alias da: the same bits */
    memcpy(da2, dh, sizeof(da2));
    ops->backward(a, gated ? b : NULL, da2, N_, da2, gated ? db : NULL);
    cr_expect(memcmp(da2, da, sizeof(da)) == 0, "%s: dh aliasing da", act_rows[act].name);
}

Test(act_table, backward_matches_finite_difference_of_forward)
{
    for (int i = 0; i < ACT_COUNT; i++)
        for (uint64_t seed = 1; seed <= 3; seed++)
            fd_check(i, 100 * (uint64_t)i + seed);
}

Test(act_table, dispatch_is_the_row)
{
    /* kern_act_forward_n / backward_n give the row's bits; with bf16 the
     * forward is the row's output rounded */
    static float a[N_], b[N_], dh[N_], h0[N_], h1[N_], da0[N_], da1[N_], db0[N_], db1[N_];
    rng_fill_uniform(5, 1, -4, 4, a, N_);
    rng_fill_uniform(5, 2, -2, 2, b, N_);
    rng_fill_uniform(5, 3, -1, 1, dh, N_);
    for (int i = 0; i < ACT_COUNT; i++) {
        const kern_act_ops *ops = kern_act_ops_of((kern_act)i);
        const float *bb = act_gated(i) ? b : NULL;
        ops->forward(a, bb, N_, h0);
        kern_act_forward_n((kern_act)i, a, bb, N_, 0, h1);
        cr_expect(memcmp(h0, h1, sizeof(h0)) == 0, "%s forward", act_rows[i].name);
        kern_bf16_round_n(h0, N_);
        kern_act_forward_n((kern_act)i, a, bb, N_, 1, h1);
        cr_expect(memcmp(h0, h1, sizeof(h0)) == 0, "%s bf16 forward", act_rows[i].name);
        ops->backward(a, bb, dh, N_, da0, act_gated(i) ? db0 : NULL);
        kern_act_backward_n((kern_act)i, a, bb, dh, N_, da1, act_gated(i) ? db1 : NULL);
        cr_expect(memcmp(da0, da1, sizeof(da0)) == 0, "%s backward da", act_rows[i].name);
        if (act_gated(i))
            cr_expect(memcmp(db0, db1, sizeof(db0)) == 0, "%s backward db", act_rows[i].name);
    }
}
