/*
 * test_model_delete.c - a model.create that cannot fit is refused before
 * any worker allocates (and the queue keeps serving), a create that fails
 * on the workers is rolled back everywhere (the name can be created
 * again), a re-creation after a re-formation that fails is retried by
 * forming again (its forwards refused unavailable meanwhile), and
 * model.delete.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tests/cluster.h"

#define H 32

static moe_model_config small_model(const char *name, int layers)
{
    moe_model_config mc = {.name = name,
                           .layers = layers,
                           .d_model = H,
                           .d_ff = 64,
                           .n_experts = 4,
                           .top_k = 2,
                           .dtype = MOE_F32,
                           .seed = 5};
    return mc;
}

static moe_err forward(moe_client *c, const char *model)
{
    enum { T = 4 };
    float x[T * H], y[T * H];
    for (int i = 0; i < T * H; i++)
        x[i] = (float)(i % 11) / 11.0f - 0.5f;
    moe_err e = moe_forward(c, model, 0, MOE_F32, x, T, H, y, NULL);
    for (int i = 0; e == MOE_OK && i < T * H; i++)
        cr_assert(isfinite(y[i]), "y[%d] = %f", i, y[i]);
    return e;
}

static moe_err info(moe_client *c, const char *model)
{
    mp_writer w;
    moe_reply r;
    mp_writer_init(&w);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, model);
    moe_err e = moe_call(c, "model.info", w.buf, w.len, &r);
    mp_writer_fini(&w);
    moe_reply_free(&r);
    return e;
}

Test(model_mem, maximal_create_refused_and_queue_keeps_serving, .timeout = 120,
     .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    moe_model_config a = small_model("a", 1);
    cr_assert_eq(moe_model_create(cl->cli, &a), MOE_OK, "%s", moe_last_error());
    /* 1024 layers x 4096 experts of 4096 x 14336: petabytes */
    moe_model_config big = {.name = "huge",
                            .layers = 1024,
                            .d_model = 4096,
                            .d_ff = 14336,
                            .n_experts = 4096,
                            .top_k = 2,
                            .dtype = MOE_BF16};
    moe_reply r;
    moe_err e = moe_model_create(cl->cli, &big);
    cr_assert_eq(e, MOE_ENOMEM, "maximal create: %s", moe_last_error());
    const char *msg = moe_last_error();
    cr_expect(strstr(msg, "resource_exhausted"), "%s", msg);
    cr_expect(strstr(msg, "needs") && strstr(msg, "GiB") && strstr(msg, "reports") &&
                  strstr(msg, "available"),
              "the refusal names the need and the worker's memory: %s", msg);
    /* right after: a forward is served, and no ghost of the model stays */
    cr_assert_eq(forward(cl->cli, "a"), MOE_OK, "forward after the refusal: %s", moe_last_error());
    cr_expect_eq(info(cl->cli, "huge"), MOE_ENOTFOUND, "a refused model is not there");
    moe_model_config again = small_model("huge", 1);
    cr_assert_eq(moe_model_create(cl->cli, &again), MOE_OK, "the name is free: %s",
                 moe_last_error());
    cr_assert_eq(forward(cl->cli, "huge"), MOE_OK, "%s", moe_last_error());
    (void)r;
    cr_assert_eq(cluster_stop(cl), 0);
}

Test(model_mem, worker_reported_memory_bounds_create, .timeout = 120, .fini = cluster_fini_all)
{
    /* every worker offers 16 MiB: a share of 1 layer x 4 experts of 512 x
     * 2048 (2 experts per worker, 3 matrices: 24 MiB) does not fit */
    cluster_opts o = {.workers = 2, .worker_args = {"--mem-report-mb", "16"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    moe_model_config big = small_model("wide", 1);
    big.d_model = 512;
    big.d_ff = 2048;
    cr_assert_eq(moe_model_create(cl->cli, &big), MOE_ENOMEM, "%s", moe_last_error());
    cr_expect(strstr(moe_last_error(), "16.000 GiB") == NULL &&
                  strstr(moe_last_error(), "(16777216 bytes) available"),
              "names the worker's reported 16 MiB: %s", moe_last_error());
    moe_model_config fits = small_model("narrow", 2);
    cr_assert_eq(moe_model_create(cl->cli, &fits), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(forward(cl->cli, "narrow"), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0);
}

Test(model_mem, failed_create_rolled_back_and_name_reusable, .timeout = 120,
     .fini = cluster_fini_all)
{
    /* the workers fail their first worker.model_create of "flaky" */
    cluster_opts o = {.workers = 2, .worker_args = {"--fail-create-for-tests", "flaky"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    moe_model_config a = small_model("steady", 1);
    cr_assert_eq(moe_model_create(cl->cli, &a), MOE_OK, "%s", moe_last_error());
    moe_model_config f = small_model("flaky", 2);
    moe_err e = moe_model_create(cl->cli, &f);
    cr_assert_eq(e, MOE_ENOMEM, "failing create: %s", moe_last_error());
    cr_expect(strstr(moe_last_error(), "cannot allocate"), "%s", moe_last_error());
    /* nothing left behind: not at the coordinator, and forwards of it fail */
    cr_expect_eq(info(cl->cli, "flaky"), MOE_ENOTFOUND, "%s", moe_last_error());
    cr_expect_eq(forward(cl->cli, "flaky"), MOE_ENOTFOUND, "%s", moe_last_error());
    cr_assert_eq(forward(cl->cli, "steady"), MOE_OK, "%s", moe_last_error());
    /* the name is free: another config of it is created (and runs) */
    moe_model_config f2 = small_model("flaky", 1);
    f2.seed = 9;
    cr_assert_eq(moe_model_create(cl->cli, &f2), MOE_OK, "re-create: %s", moe_last_error());
    cr_assert_eq(forward(cl->cli, "flaky"), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0);
}

Test(model_mem, a_failed_re_creation_forms_again_instead_of_not_found, .timeout = 150,
     .fini = cluster_fini_all)
{
    /* the model is on both workers; both are killed and started again, the
     * first to register (rank 0 of the next generation) with a flag that
     * fails its first worker.model_create of "m": the coordinator's
     * re-creation after the re-formation fails on rank 0. Its forwards
     * must not reach workers that do not hold the model (rank 0's not_found
     * came first and the cluster stayed as it was: every forward not_found
     * until some later re-formation): they are refused unavailable and the
     * cluster forms again, where the re-creation succeeds */
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    moe_model_config m = small_model("m", 1);
    cr_assert_eq(moe_model_create(cl->cli, &m), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(forward(cl->cli, "m"), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(cluster_worker_kill(cl, 0, SIGKILL), 0, "%s", cl->err);
    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cl->err);
    cl->opts.worker_args[0] = "--fail-create-for-tests"; /* the restarts' flags */
    cl->opts.worker_args[1] = "m";
    cl->opts.worker_args[2] = NULL;
    cr_assert_eq(cluster_worker_start(cl, 1), 0, "%s", cl->err);
    cluster_state st = {0};
    for (int64_t t0 = cluster_now_ms(); cluster_now_ms() - t0 < 30000; usleep(20 * 1000))
        if (cluster_get_state(cl, &st) == MOE_OK && st.up == 1)
            break;
    cr_assert_eq(st.up, 1, "the flagged worker did not register in 30 s");
    cl->opts.worker_args[0] = NULL;
    cr_assert_eq(cluster_worker_start(cl, 0), 0, "%s", cl->err);
    moe_err e = MOE_EUNAVAIL;
    for (int64_t t0 = cluster_now_ms(); cluster_now_ms() - t0 < 90000; usleep(50 * 1000)) {
        e = forward(cl->cli, "m");
        cr_assert_neq(e, MOE_ENOTFOUND, "a forward reached a worker without the model: %s",
                      moe_last_error());
        if (e == MOE_OK)
            break;
        cr_assert_eq(e, MOE_EUNAVAIL, "%s", moe_last_error());
    }
    cr_assert_eq(e, MOE_OK, "no forward succeeded within 90 s: %s", moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0);
}

Test(model_delete, delete_then_not_found_and_recreate, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    moe_model_config d = small_model("d", 1);
    cr_assert_eq(moe_model_create(cl->cli, &d), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(forward(cl->cli, "d"), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_model_delete(cl->cli, "d"), MOE_OK, "delete: %s", moe_last_error());
    cr_expect_eq(forward(cl->cli, "d"), MOE_ENOTFOUND, "forward after delete: %s",
                 moe_last_error());
    cr_expect_eq(info(cl->cli, "d"), MOE_ENOTFOUND);
    cr_expect_eq(moe_model_delete(cl->cli, "d"), MOE_ENOTFOUND, "second delete: %s",
                 moe_last_error());
    /* the same name with another config */
    moe_model_config d2 = small_model("d", 2);
    d2.n_experts = 8;
    cr_assert_eq(moe_model_create(cl->cli, &d2), MOE_OK, "re-create: %s", moe_last_error());
    cr_assert_eq(forward(cl->cli, "d"), MOE_OK, "%s", moe_last_error());
    /* a training handle of a deleted model expires */
    enum { T = 2 };
    float x[T * H], y[T * H], dy[T * H], dx[T * H];
    for (int i = 0; i < T * H; i++)
        x[i] = dy[i] = 0.01f * (float)i;
    moe_fwd_info fi;
    memset(&fi, 0, sizeof(fi));
    cr_assert_eq(moe_forward_train(cl->cli, "d", 0, MOE_F32, x, T, H, y, &fi), MOE_OK, "%s",
                 moe_last_error());
    moe_fwd_info_free(&fi);
    cr_assert_eq(moe_model_delete(cl->cli, "d"), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_backward(cl->cli, fi.handle, MOE_F32, dy, T, H, dx), MOE_EEXPIRED, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0);
}
