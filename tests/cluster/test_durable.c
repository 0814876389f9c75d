/*
 * test_durable.c - "applied" means durable (docs/PROTOCOL.md, optimizer.step):
 * with --checkpoint-dir and --checkpoint-every 1, whatever optimizer.step
 * and its retries with expect_step answer agrees with the model's state
 * after any crash.
 *
 *   - a worker SIGKILLed at random moments around optimizer.step, many
 *     times: after each re-formation the model's step equals the last
 *     acknowledged one and a probe forward equals the one recorded after
 *     that step (bit for bit); no acknowledged step is lost;
 *   - a restarted coordinator refuses training calls (`unavailable`,
 *     "restoring") until the restore is done, never answering against
 *     step 0.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

#define DT 20 /* rows of a train forward and of the probe */
#define DH 16 /* d_model */
#define DN (DT * DH)

static void make_tmpdir(char *out, size_t len)
{
    snprintf(out, len, "/tmp/moe-durable-XXXXXX");
    cr_assert(mkdtemp(out) != NULL);
}

static void rm_rf(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    int rc = system(cmd);
    (void)rc;
}

static void create_model(cluster *cl)
{
    moe_model_config cfg = {0};
    cfg.name = "d";
    cfg.layers = 1;
    cfg.d_model = DH;
    cfg.d_ff = 24;
    cfg.n_experts = 4;
    cfg.top_k = 2;
    cfg.activation = "swiglu";
    cfg.renormalize = 1;
    cfg.dtype = MOE_F32;
    cfg.seed = 8;
    cr_assert_eq(moe_model_create(cl->cli, &cfg), MOE_OK, "model.create: %s", moe_last_error());
}

/* probe: an inference forward of fixed rows; MOE_OK with y filled */
static moe_err probe(moe_client *cli, float *y)
{
    float x[DN];
    rng_fill_uniform(77, 1, -1, 1, x, DN);
    return moe_forward(cli, "d", 0, MOE_F32, x, DT, DH, y, NULL);
}

/* one forward(train) + backward with rows of seed k; MOE_OK when both ran */
static moe_err grads(moe_client *cli, uint64_t k)
{
    float x[DN], y[DN], dy[DN], dx[DN];
    moe_fwd_info info;
    rng_fill_uniform(k, 1, -1, 1, x, DN);
    rng_fill_uniform(k, 2, -1, 1, dy, DN);
    moe_err e = moe_forward_train(cli, "d", 0, MOE_F32, x, DT, DH, y, &info);
    if (e != MOE_OK)
        return e;
    e = moe_backward(cli, info.handle, MOE_F32, dy, DT, DH, dx);
    moe_fwd_info_free(&info);
    return e;
}

/* step_guarded: optimizer.step with expect_step; *at = the new step */
static moe_err step_guarded(moe_client *cli, int64_t expect, int64_t *at)
{
    moe_adamw opt = {1e-2, 0.9, 0.99, 1e-8, 0, 0, 1, expect};
    return moe_optimizer_step(cli, "d", &opt, at, NULL);
}

/* parse_at reads N of "is at step N" (-1 when absent) */
static int64_t parse_at(const char *msg)
{
    const char *p = strstr(msg, "is at step ");
    return p ? atoll(p + 11) : -1;
}

/* read_step asks for the model's step without changing it (an expect_step
 * no model is at), polling while training calls are refused `unavailable`
 * (restoring, re-forming): every answer must be one of those two. */
static int64_t read_step(moe_client *cli, int64_t bound_ms)
{
    int64_t t0 = cluster_now_ms();
    for (;;) {
        int64_t at = -1;
        moe_err e = step_guarded(cli, (int64_t)1 << 62, &at);
        cr_assert_neq(e, MOE_OK, "a step with expect_step 2^62 was applied");
        if (e == MOE_EPRECOND) {
            int64_t n = parse_at(moe_last_error());
            cr_assert_geq(n, 0, "no step in: %s", moe_last_error());
            return n;
        }
        cr_assert(e == MOE_EUNAVAIL || e == MOE_ETIMEDOUT, "read_step: %s: %s", moe_err_code(e),
                  moe_last_error());
        cr_assert_lt(cluster_now_ms() - t0, bound_ms, "the model stayed untrainable: %s",
                     moe_last_error());
        usleep(20 * 1000);
    }
}

/* ---- the killer: SIGKILLs a worker a random moment after it is armed ---- */

typedef struct killer {
    cluster *cl;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int armed; /* the trainer is about to send a step: kill soon */
    int done;  /* the kill of this round happened (the worker was restarted) */
    int stop;
    int kills, fails;
    int victim; /* the worker killed this round (restarted by the test's thread: the
                 * harness's daemons die with the thread that started them) */
    unsigned seed;
} killer;

static void *killer_main(void *arg)
{
    killer *k = arg;
    pthread_mutex_lock(&k->mu);
    for (;;) {
        while (!k->armed && !k->stop)
            pthread_cond_wait(&k->cv, &k->mu);
        if (k->stop)
            break;
        k->armed = 0;
        /* 0-3 ms or 0-40 ms after the step was sent: in the step, in its
         * checkpoint, or after the reply */
        int delay_us = rand_r(&k->seed) % (rand_r(&k->seed) % 2 ? 3000 : 40000);
        int victim = rand_r(&k->seed) % k->cl->nworkers;
        pthread_mutex_unlock(&k->mu);
        usleep((useconds_t)delay_us);
        int rc = cluster_worker_kill(k->cl, victim, SIGKILL);
        pthread_mutex_lock(&k->mu);
        k->kills++;
        k->fails += rc != 0;
        k->victim = victim;
        k->done = 1;
        pthread_cond_broadcast(&k->cv);
    }
    pthread_mutex_unlock(&k->mu);
    return NULL;
}

static void killer_arm(killer *k)
{
    pthread_mutex_lock(&k->mu);
    k->done = 0;
    k->armed = 1;
    pthread_cond_broadcast(&k->cv);
    pthread_mutex_unlock(&k->mu);
}

/* killer_wait waits for this round's kill and restarts the worker */
static void killer_wait(killer *k)
{
    pthread_mutex_lock(&k->mu);
    while (!k->done)
        pthread_cond_wait(&k->cv, &k->mu);
    int victim = k->victim;
    pthread_mutex_unlock(&k->mu);
    cr_assert_eq(k->fails, 0, "kill: %s", cluster_error());
    cr_assert_eq(cluster_worker_start(k->cl, victim), 0, "restart: %s", cluster_error());
}

#define MAX_STEPS 256
#define KILLS     30

/* generation: the cluster's current generation */
static uint64_t generation(cluster *cl)
{
    cluster_state st;
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK, "%s", moe_last_error());
    return st.generation;
}

/* verify: once the cluster re-formed after generation gen (the kill's), the
 * model is at the last acknowledged step, with its weights */
static void verify(cluster *cl, uint64_t gen, int64_t acked, float (*ref)[DN], int *have_ref)
{
    cluster_state st = {0};
    int64_t t0 = cluster_now_ms();
    while (cluster_get_state(cl, &st) != MOE_OK || !st.ready || st.generation <= gen) {
        cr_assert_lt(cluster_now_ms() - t0, 60000, "the cluster did not re-form after the kill");
        usleep(20 * 1000);
    }
    int64_t at = read_step(cl->cli, 60000);
    cr_assert_eq(at, acked,
                 "after the re-formation the model is at step %lld, the last "
                 "acknowledged step is %lld",
                 (long long)at, (long long)acked);
    static float y[DN];
    moe_err e;
    t0 = cluster_now_ms();
    while ((e = probe(cl->cli, y)) != MOE_OK) {
        cr_assert_lt(cluster_now_ms() - t0, 60000, "probe: %s", moe_last_error());
        usleep(20 * 1000);
    }
    if (!have_ref[acked]) { /* its probe right after the ack did not get through */
        memcpy(ref[acked], y, sizeof(y));
        have_ref[acked] = 1;
        return;
    }
    cr_assert(memcmp(ref[acked], y, sizeof(y)) == 0,
              "the weights after the restore are not those of step %lld", (long long)acked);
}

Test(durable, acknowledged_steps_survive_worker_kills, .timeout = 240, .fini = cluster_fini_all)
{
    char ck[128];
    make_tmpdir(ck, sizeof(ck));
    cluster_opts o = {.workers = 2,
                      .client_timeout_ms = 30000,
                      .coord_args = {"--checkpoint-dir", ck, "--checkpoint-every", "1"},
                      .worker_args = {"--xchg-timeout-ms", "3000"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    create_model(cl);
    static float ref[MAX_STEPS][DN];
    static int have_ref[MAX_STEPS];
    cr_assert_eq(probe(cl->cli, ref[0]), MOE_OK, "%s", moe_last_error());
    have_ref[0] = 1;

    killer k = {.cl = cl, .seed = (unsigned)getpid() ^ (unsigned)cluster_now_ms()};
    pthread_mutex_init(&k.mu, NULL);
    pthread_cond_init(&k.cv, NULL);
    pthread_t th;
    pthread_create(&th, NULL, killer_main, &k);
    cr_log_info("seed %u", k.seed);

    int64_t acked = 0, t0 = cluster_now_ms();
    int applied = 0, unknown = 0, refused = 0;
    uint64_t rows = 1;
    /* each round: gradients, a guarded step with a kill around it, then the
     * state checked against the last acknowledged step */
    while (k.kills < KILLS && acked < MAX_STEPS - 1 && cluster_now_ms() - t0 < 150000) {
        uint64_t gen = generation(cl);
        if (grads(cl->cli, rows++) != MOE_OK) { /* the last round's kill, late: again */
            usleep(20 * 1000);
            continue;
        }
        killer_arm(&k);
        int64_t at = -1;
        moe_err e = step_guarded(cl->cli, acked, &at);
        char msg[600];
        snprintf(msg, sizeof(msg), "%s", moe_last_error());
        if (e == MOE_OK) {
            cr_assert_eq(at, acked + 1, "step went from %lld to %lld", (long long)acked,
                         (long long)at);
            acked = at;
            applied++;
            have_ref[acked] = probe(cl->cli, ref[acked]) == MOE_OK;
        } else if (e == MOE_EPRECOND) {
            /* the only refusal a worker's crash may cause: the restore
             * dropped the gradients (never "is at step": no step was
             * applied that was not acknowledged) */
            cr_assert(strstr(msg, "no gradients"), "step %lld refused: %s", (long long)acked, msg);
            refused++;
        } else {
            cr_assert(e == MOE_EUNAVAIL || e == MOE_ETIMEDOUT, "step: %s: %s", moe_err_code(e),
                      msg);
            unknown += strstr(msg, "outcome unknown") != NULL;
            /* retried at once, as a client would: whatever it answers is
             * what the state will be */
            e = step_guarded(cl->cli, acked, &at);
            snprintf(msg, sizeof(msg), "%s", moe_last_error());
            if (e == MOE_OK) {
                acked = at;
                have_ref[acked] = probe(cl->cli, ref[acked]) == MOE_OK;
            } else if (e == MOE_EPRECOND && parse_at(msg) != acked) {
                /* "already applied": the service says step acked+1 happened */
                cr_assert_eq(parse_at(msg), acked + 1, "retry of step %lld: %s", (long long)acked,
                             msg);
                acked++;
                have_ref[acked] = 0;
            }
        }
        killer_wait(&k);
        verify(cl, gen, acked, ref, have_ref);
    }
    pthread_mutex_lock(&k.mu);
    k.stop = 1;
    pthread_cond_broadcast(&k.cv);
    pthread_mutex_unlock(&k.mu);
    pthread_join(th, NULL);
    cr_log_info("%d kills: %d steps acknowledged, %d outcome unknown, %d refused", k.kills, applied,
                unknown, refused);
    cr_assert_geq(k.kills, 10, "only %d kills in the time budget", k.kills);
    /* training goes on after the last kill */
    cr_assert_eq(grads(cl->cli, rows++), MOE_OK, "%s", moe_last_error());
    int64_t at = -1;
    cr_assert_eq(step_guarded(cl->cli, acked, &at), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(at, acked + 1);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
    rm_rf(ck);
}

/* A coordinator killed and started again restores the model when the
 * cluster forms; until then every training call is refused `unavailable`
 * ("restoring"), never answered against step 0. */
Test(durable, restarted_coordinator_refuses_training_until_restored, .timeout = 120,
     .fini = cluster_fini_all)
{
    char ck[128];
    make_tmpdir(ck, sizeof(ck));
    cluster_opts o = {.workers = 2,
                      .coord_args = {"--checkpoint-dir", ck, "--checkpoint-every", "1"}};
    cluster *a = cluster_start(&o);
    cr_assert(a, "cluster: %s", cluster_error());
    create_model(a);
    int64_t at = 0;
    for (int64_t s = 0; s < 3; s++) {
        cr_assert_eq(grads(a->cli, (uint64_t)s + 1), MOE_OK, "%s", moe_last_error());
        cr_assert_eq(step_guarded(a->cli, s, &at), MOE_OK, "%s", moe_last_error());
    }
    cr_assert_eq(at, 3);
    static float ya[DN], yb[DN];
    cr_assert_eq(probe(a->cli, ya), MOE_OK, "%s", moe_last_error());
    kill(a->coord_pid, SIGKILL);
    for (int i = 0; i < a->nworkers; i++)
        cluster_worker_kill(a, i, SIGKILL);
    cluster_stop(a);

    /* not waiting for ready: the calls start while the workers register */
    o.no_wait = 1;
    cluster *b = cluster_start(&o);
    cr_assert(b, "cluster: %s", cluster_error());
    int restoring = 0;
    int64_t t0 = cluster_now_ms();
    for (;;) {
        moe_err e = step_guarded(b->cli, 0, &at); /* step 0: what a fresh model is at */
        const char *msg = moe_last_error();
        cr_assert_neq(e, MOE_OK, "a step was applied to a model with no gradients");
        if (e == MOE_EUNAVAIL) {
            cr_assert(strstr(msg, "restoring"), "refused without saying why: %s", msg);
            restoring++;
        } else {
            cr_assert_eq(e, MOE_EPRECOND, "%s: %s", moe_err_code(e), msg);
            cr_assert_eq(parse_at(msg), 3, "answered against another step than 3: %s", msg);
            break;
        }
        cr_assert_lt(cluster_now_ms() - t0, 60000, "never restored: %s", msg);
        usleep(10 * 1000);
    }
    cr_log_info("%d training calls refused while restoring", restoring);
    /* a train forward and a step now work from step 3 */
    cr_assert_eq(probe(b->cli, yb), MOE_OK, "%s", moe_last_error());
    cr_assert(memcmp(ya, yb, sizeof(ya)) == 0, "the restored weights differ");
    cr_assert_eq(grads(b->cli, 9), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(step_guarded(b->cli, 3, &at), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(at, 4);
    cr_assert_eq(cluster_stop(b), 0, "%s", cluster_error());
    rm_rf(ck);
}

/* a step whose checkpoint's durable writes are slow (the coordinator's
 * index and LATEST fsyncs behind the workers' shard writes) */
typedef struct slow_step {
    cluster *cl;
    moe_err e;
    int done; /* atomic: the step was answered */
} slow_step;

static void *slow_step_main(void *arg)
{
    slow_step *s = arg;
    moe_client_opts co = {.timeout_ms = 120000};
    moe_client *c = NULL;
    s->e = moe_client_open(s->cl->url, &co, &c);
    if (s->e == MOE_OK) {
        moe_adamw opt = MOE_ADAMW_DEFAULT;
        s->e = moe_optimizer_step(c, "d", &opt, NULL, NULL);
        moe_client_close(c);
    }
    __atomic_store_n(&s->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* shards: how many worker shards the newest ckpt-* directory under dir holds */
static int shards(const char *dir)
{
    char cmd[600], line[64];
    snprintf(cmd, sizeof(cmd),
             "ls -d '%s'/d/ckpt-* 2>/dev/null | tail -n 1 | xargs -r -I{} sh -c "
             "'ls {}/model-*-of-*.safetensors 2>/dev/null' | wc -l",
             dir);
    FILE *p = popen(cmd, "r");
    int n = 0;
    if (p && fgets(line, sizeof(line), p))
        n = atoi(line);
    if (p)
        pclose(p);
    return n;
}

/* The coordinator's loop never waits on the disk: while a checkpoint's
 * index and LATEST become durable (made 6 s slow here), a worker SIGKILLed
 * is seen down at once and cluster.status answers - before the step that
 * waits on that checkpoint is answered. (The fsyncs once ran on the loop,
 * the likely cause of two kills inside optimizer.step on 4 H100 workers
 * answered 0.18 and 0.26 s late.)
 * Ordering, not timing: the step cannot be answered before the 6 s pass,
 * and the check is that the death was seen while it was still pending. */
Test(durable, the_loop_serves_while_a_checkpoint_becomes_durable, .timeout = 180,
     .fini = cluster_fini_all)
{
    char ck[128];
    make_tmpdir(ck, sizeof(ck));
    cluster_opts o = {.workers = 2,
                      .client_timeout_ms = 60000,
                      .coord_args = {"--checkpoint-dir", ck, "--checkpoint-every", "1",
                                     "--slow-durable-ms-for-tests", "6000"},
                      .worker_args = {"--xchg-timeout-ms", "3000"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    create_model(cl);
    cr_assert_eq(grads(cl->cli, 1), MOE_OK, "%s", moe_last_error());

    slow_step s = {.cl = cl};
    pthread_t th;
    pthread_create(&th, NULL, slow_step_main, &s);
    /* the workers' shards are on disk: the coordinator is at the durable part */
    int64_t t0 = cluster_now_ms();
    while (shards(ck) < 2 && !__atomic_load_n(&s.done, __ATOMIC_ACQUIRE) &&
           cluster_now_ms() - t0 < 60000)
        usleep(20 * 1000);
    cr_assert_eq(shards(ck), 2, "the checkpoint's shards never appeared");
    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cluster_error());
    cluster_state st = {0};
    int seen = 0;
    while (!__atomic_load_n(&s.done, __ATOMIC_ACQUIRE) && !seen) {
        moe_err e = cluster_get_state(cl, &st);
        cr_assert_eq(e, MOE_OK, "cluster.status while a checkpoint becomes durable: %s",
                     moe_last_error());
        seen = st.down >= 1 || st.up < 2;
        if (!seen)
            usleep(10 * 1000);
    }
    int done_then = __atomic_load_n(&s.done, __ATOMIC_ACQUIRE);
    pthread_join(th, NULL);
    cr_assert(seen && !done_then,
              "the worker's death was seen only after the step waiting on the checkpoint was "
              "answered (the loop was blocked by the durable writes)");
    cr_log_info("step answered after the kill: %s", moe_err_code(s.e));
    cr_assert(s.e == MOE_OK || s.e == MOE_EUNAVAIL, "step: %s", moe_err_code(s.e));
    rm_rf(ck);
}

/* model_ready: model.info's ready (created in the current generation) */
static int model_ready(cluster *cl)
{
    mp_writer p;
    mp_writer_init(&p);
    mp_write_map(&p, 1);
    mp_write_cstr(&p, "model");
    mp_write_cstr(&p, "d");
    moe_reply rep;
    int ready = 0;
    if (moe_call(cl->cli, "model.info", p.buf, p.len, &rep) == MOE_OK) {
        mp_reader rd = mp_reply_reader(&rep);
        bool b = false;
        ready = mp_map_find(&rd, "ready") == 0 && mp_read_bool(&rd, &b, NULL) == MOE_OK && b;
    }
    moe_reply_free(&rep);
    mp_writer_fini(&p);
    return ready;
}

/* The lane runs outside the coordinator's job order: right after a
 * re-formation the worker rebuilds the model from its seed and only then
 * gets its checkpoint. An inference forward in between must not answer
 * with the seed's weights. The restore's prepare is made slow (3 s), so a
 * forward sent once the model exists again waits in the worker's queue
 * behind the prepare and runs before the commit: the worker refuses it on
 * the lane (not settled), the client sends it through the coordinator,
 * which orders it behind the commit - and y equals the acknowledged
 * step's, bit for bit. (Without the refusal the lane answered with the
 * seed's weights; seen as a fan-out "routed the tokens differently" on 3
 * CPU workers under load.) */
Test(durable, the_lane_waits_for_the_restore_after_a_reformation, .timeout = 180,
     .fini = cluster_fini_all)
{
    char ck[128];
    make_tmpdir(ck, sizeof(ck));
    cluster_opts o = {.workers = 1,
                      .client_timeout_ms = 60000,
                      .coord_args = {"--checkpoint-dir", ck, "--checkpoint-every", "1"},
                      .worker_args = {"--slow-load-ms-for-tests", "3000"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    create_model(cl);
    cr_assert_eq(grads(cl->cli, 1), MOE_OK, "%s", moe_last_error());
    int64_t at = 0;
    cr_assert_eq(step_guarded(cl->cli, 0, &at), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(at, 1);
    static float ref[DN], y[DN];
    cr_assert_eq(probe(cl->cli, ref), MOE_OK, "%s", moe_last_error());

    cr_assert_eq(cluster_worker_kill(cl, 0, SIGKILL), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_start(cl, 0), 0, "%s", cluster_error());
    /* the model exists again (from its seed): its restore is on its way */
    int64_t t0 = cluster_now_ms();
    while (!model_ready(cl)) {
        cr_assert_lt(cluster_now_ms() - t0, 60000, "the model was not re-created");
        usleep(5 * 1000); /* polling interval, not a synchronisation */
    }
    moe_err e;
    while ((e = probe(cl->cli, y)) != MOE_OK) {
        cr_assert(e == MOE_EUNAVAIL, "probe: %s: %s", moe_err_code(e), moe_last_error());
        cr_assert_lt(cluster_now_ms() - t0, 60000, "probe refused for 60 s: %s", moe_last_error());
        usleep(20 * 1000);
    }
    cr_assert_eq(memcmp(y, ref, sizeof(y)), 0,
                 "a forward right after the re-formation did not answer with the acknowledged "
                 "step's weights");
    cr_assert_eq(cluster_stop(cl), 0);
    rm_rf(ck);
}
