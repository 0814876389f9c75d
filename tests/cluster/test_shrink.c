/*
 * test_shrink.c - a cluster that re-forms with the survivors (--min-workers)
 * and grows back when the lost worker returns (docs/OPERATIONS.md,
 * "Faults").
 *
 * Three CPU workers, --min-workers 2, --shrink-after-ms 300, checkpoints
 * after every step. Two training steps, then worker 2 is SIGKILLed and not
 * restarted: the cluster forms generation 2 with the two survivors (the lost
 * worker's experts placed on them, restored from the newest checkpoint); the
 * model is at the last acknowledged step and answers as before. A third step
 * runs on two workers. Then the worker comes back: the cluster grows to
 * three again, still at step 3, with the same answers.
 *
 * Nothing here depends on timing beyond generous bounds on the waits: a slow
 * machine only makes them longer.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "common/rng.h"

#define ST 12 /* rows of a train forward and of the probe */
#define SH 16 /* d_model */
#define SN (ST * SH)

static void rm_rf(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    int rc = system(cmd);
    (void)rc;
}

/* the model "s": f32, 4 experts (2/1/1 on three workers, 2/2 on two) */
static void create_s(cluster *cl)
{
    moe_model_config cfg = MOE_MODEL_CONFIG_DEFAULT;
    cfg.name = "s";
    cfg.layers = 1;
    cfg.d_model = SH;
    cfg.d_ff = 24;
    cfg.n_experts = 4;
    cfg.top_k = 2;
    cfg.activation = "swiglu";
    cfg.renormalize = 1;
    cfg.dtype = MOE_F32;
    cfg.seed = 5;
    cr_assert_eq(moe_model_create(cl->cli, &cfg), MOE_OK, "%s", moe_last_error());
}

static moe_err probe(moe_client *cli, float *y)
{
    float x[SN];
    rng_fill_uniform(91, 1, -1, 1, x, SN);
    return moe_forward(cli, "s", 0, MOE_F32, x, ST, SH, y, NULL);
}

/* one forward(train) + backward + optimizer.step from step `expect` */
static void train_step(moe_client *cli, uint64_t k, int64_t expect)
{
    float x[SN], y[SN], dy[SN], dx[SN];
    moe_fwd_info info;
    rng_fill_uniform(k, 1, -1, 1, x, SN);
    rng_fill_uniform(k, 2, -1, 1, dy, SN);
    cr_assert_eq(moe_forward_train(cli, "s", 0, MOE_F32, x, ST, SH, y, &info), MOE_OK,
                 "forward_train: %s", moe_last_error());
    cr_assert_eq(moe_backward(cli, info.handle, MOE_F32, dy, ST, SH, dx), MOE_OK, "backward: %s",
                 moe_last_error());
    moe_fwd_info_free(&info);
    moe_adamw opt = MOE_ADAMW_DEFAULT;
    opt.lr = 1e-2;
    opt.expect_step = expect;
    int64_t at = -1;
    cr_assert_eq(moe_optimizer_step(cli, "s", &opt, &at, NULL), MOE_OK, "step: %s",
                 moe_last_error());
    cr_assert_eq(at, expect + 1);
}

/* the model's step, read with an expect_step no model is at */
static int64_t read_step(moe_client *cli)
{
    moe_adamw opt = MOE_ADAMW_DEFAULT;
    opt.expect_step = (int64_t)1 << 62;
    int64_t at = -1;
    cr_assert_eq(moe_optimizer_step(cli, "s", &opt, &at, NULL), MOE_EPRECOND, "%s",
                 moe_last_error());
    const char *p = strstr(moe_last_error(), "is at step ");
    cr_assert(p != NULL, "no step in: %s", moe_last_error());
    return atoll(p + 11);
}

/* wait until the cluster is ready with `world` members of a generation
 * after gen0 (bounded; a slow machine only waits longer) */
static uint64_t wait_world(cluster *cl, int world, uint64_t gen0)
{
    int64_t t0 = cluster_now_ms();
    cluster_state st = {0};
    for (;;) {
        memset(&st, 0, sizeof(st));
        if (cluster_get_state(cl, &st) == MOE_OK && st.ready && st.world == world &&
            st.generation > gen0)
            return st.generation;
        if (cluster_now_ms() - t0 > 120000) {
            cluster_dump_logs(cl, "no re-formation");
            cr_assert_fail(
                "not ready with %d workers after 120 s: ready %d world %d up %d gen %llu", world,
                st.ready, st.world, st.up, (unsigned long long)st.generation);
        }
        usleep(50 * 1000);
    }
}

/* probe until it answers (training calls of a restoring model are refused
 * `unavailable` for a moment after the re-formation) */
static void probe_ok(moe_client *cli, float *y)
{
    int64_t t0 = cluster_now_ms();
    moe_err e;
    while ((e = probe(cli, y)) != MOE_OK) {
        cr_assert(e == MOE_EUNAVAIL || e == MOE_ETIMEDOUT, "probe: %s: %s", moe_err_code(e),
                  moe_last_error());
        cr_assert_lt(cluster_now_ms() - t0, 60000, "probe refused for 60 s: %s", moe_last_error());
        usleep(20 * 1000);
    }
}

static double rel_diff(const float *a, const float *b, int n)
{
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

Test(shrink, survivors_reform_and_the_cluster_grows_back, .timeout = 600)
{
    char dir[64] = "/tmp/moe-shrink-XXXXXX";
    cr_assert(mkdtemp(dir) != NULL);
    cluster_opts o = {.workers = 3,
                      .expected_workers = 3,
                      .ready_timeout_ms = 60000,
                      .coord_args = {"--min-workers", "2", "--shrink-after-ms", "300",
                                     "--checkpoint-dir", dir, "--checkpoint-every", "1", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    create_s(cl);
    train_step(cl->cli, 1, 0);
    train_step(cl->cli, 2, 1);
    float y_before[SN], y_after[SN];
    cr_assert_eq(probe(cl->cli, y_before), MOE_OK, "%s", moe_last_error());
    cluster_state st = {0};
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
    cr_assert_eq(st.world, 3);
    const uint64_t gen1 = st.generation;

    /* lost and not restarted: the two survivors form without it */
    cr_assert_eq(cluster_worker_kill(cl, 2, SIGKILL), 0);
    const uint64_t gen2 = wait_world(cl, 2, gen1);
    probe_ok(cl->cli, y_after);
    double d = rel_diff(y_after, y_before, SN);
    cr_assert_lt(d, 1e-5, "probe on the survivors differs from before the loss: %.3e", d);
    cr_assert_eq(read_step(cl->cli), 2, "an acknowledged step was lost");
    train_step(cl->cli, 3, 2); /* training goes on, on two workers */
    cr_assert_eq(probe(cl->cli, y_before), MOE_OK, "%s", moe_last_error());

    /* the lost worker returns: the cluster grows back to three */
    cr_assert_eq(cluster_worker_start(cl, 2), 0, "%s", cluster_error());
    wait_world(cl, 3, gen2);
    probe_ok(cl->cli, y_after);
    d = rel_diff(y_after, y_before, SN);
    cr_assert_lt(d, 1e-5, "probe after growing back differs: %.3e", d);
    cr_assert_eq(read_step(cl->cli), 3, "a step was lost when growing back");
    cluster_stop(cl);
    rm_rf(dir);
}

/* survivors that cannot hold the model: the coordinator gives their
 * generation up (no re-formation loop) and waits for every worker */
Test(shrink, survivors_that_cannot_hold_the_model_wait_for_all, .timeout = 600)
{
    char dir[64] = "/tmp/moe-shrink-XXXXXX";
    cr_assert(mkdtemp(dir) != NULL);
    cluster_opts o = {.workers = 3,
                      .expected_workers = 3,
                      .ready_timeout_ms = 60000,
                      .coord_args = {"--min-workers", "2", "--shrink-after-ms", "300",
                                     "--checkpoint-dir", dir, "--checkpoint-every", "1", NULL},
                      .worker_args = {"--fail-create-below-world", "3", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    create_s(cl);
    train_step(cl->cli, 1, 0);
    float y_before[SN], y_after[SN];
    cr_assert_eq(probe(cl->cli, y_before), MOE_OK, "%s", moe_last_error());
    cluster_state st = {0};
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
    const uint64_t gen1 = st.generation;

    cr_assert_eq(cluster_worker_kill(cl, 2, SIGKILL), 0);
    /* the survivors' generation forms, fails to hold the model, is given up
     * (it reads ready for the moment between its join and the model's
     * re-creation failing: what counts is that it does not stay so) */
    int64_t t0 = cluster_now_ms();
    for (;;) {
        memset(&st, 0, sizeof(st));
        cr_assert_eq(cluster_get_state(cl, &st), MOE_OK, "%s", moe_last_error());
        if (st.generation > gen1 && st.world == 2 && st.waiting_for_all) {
            cr_assert(!st.ready, "ready while waiting for all workers");
            break;
        }
        cr_assert_lt(cluster_now_ms() - t0, 120000, "no generation of survivors: gen %llu world %d",
                     (unsigned long long)st.generation, st.world);
        usleep(20 * 1000);
    }
    const uint64_t gen2 = st.generation;
    /* and it stays given up: no loop of new generations, never ready */
    usleep(1500 * 1000);
    memset(&st, 0, sizeof(st));
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
    cr_assert(!st.ready, "ready with %d workers", st.world);
    cr_assert_eq(st.generation, gen2, "generations kept forming: %llu -> %llu",
                 (unsigned long long)gen2, (unsigned long long)st.generation);
    cr_assert_neq(probe(cl->cli, y_after), MOE_OK, "a forward was served without its model");

    /* the worker returns: whole again, at the acknowledged step */
    cr_assert_eq(cluster_worker_start(cl, 2), 0, "%s", cluster_error());
    wait_world(cl, 3, gen2);
    probe_ok(cl->cli, y_after);
    cr_assert_lt(rel_diff(y_after, y_before, SN), 1e-5);
    cr_assert_eq(read_step(cl->cli), 1);
    cluster_stop(cl);
    rm_rf(dir);
}

Test(shrink, min_workers_above_workers_is_refused)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "%s/moe-coordinator --listen tcp://127.0.0.1:0 --workers 2 --min-workers 3 "
             "--insecure >/dev/null 2>&1",
             cluster_bin_dir());
    int rc = system(cmd);
    cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "the coordinator did not refuse: %d", rc);
}
