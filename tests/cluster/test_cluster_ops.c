/*
 * test_cluster_ops.c - the operator side of a real cluster: /livez, /readyz
 * and /metrics over HTTP; SIGTERM drains (in-flight forward answered, new
 * ones refused, exit 0); the drain RPC; a worker killed during a forward
 * (the forward gets an error answer, the cluster recovers).
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

static void create_model(cluster *cl, const char *name, int H, int F)
{
    moe_model_config mc = {0};
    mc.name = name;
    mc.layers = 2;
    mc.d_model = H;
    mc.d_ff = F;
    mc.n_experts = 4;
    mc.top_k = 2;
    mc.seed = 11;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "model.create: %s", moe_last_error());
}

Test(cluster_ops, livez_readyz_metrics, .timeout = 30, .fini = cluster_fini_all)
{
    /* the forward below goes through the coordinator's job order (its phase
     * histograms), not fanned out to the workers */
    setenv("MOE_FANOUT_ROWS", "0", 1);
    cluster_opts o = {.workers = 2, .metrics = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    static char body[1 << 20];
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/livez", NULL, 0, body, sizeof(body)), 200);
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/readyz", NULL, 0, body, sizeof(body)), 200,
                 "%s", body);
    create_model(cl, "m", 32, 64);
    const int T = 10, H = 32;
    float x[10 * 32], y[10 * 32];
    rng_fill_uniform(1, 2, -1, 1, x, (size_t)T * H);
    moe_fwd_info info;
    cr_assert_eq(moe_forward(cl->cli, "m", 1, MOE_F32, x, T, H, y, &info), MOE_OK, "%s",
                 moe_last_error());
    /* the text is rendered by the loop every 100 ms */
    int64_t t0 = cluster_now_ms();
    do {
        cr_assert_eq(cluster_http_get(cl->metrics_port, "/metrics", NULL, 0, body, sizeof(body)),
                     200);
        if (cluster_metric_value(body, "moe_forward_total") == 1)
            break;
        usleep(50000);
    } while (cluster_now_ms() - t0 < 5000);
    cr_assert_eq(cluster_metric_value(body, "moe_forward_total"), 1, "%s", body);
    cr_assert_eq(cluster_metric_value(body, "moe_tokens_total"), T);
    cr_assert_eq(cluster_metric_value(body, "moe_cluster_ready"), 1);
    cr_assert_eq(cluster_metric_value(body, "moe_workers_up"), 2);
    cr_assert_eq(cluster_metric_value(body, "moe_workers_expected"), 2);
    cr_assert_geq(cluster_metric_value(body, "moe_requests_total"), 2);
    cr_assert_eq(cluster_metric_value(body, "moe_forward_latency_seconds_count"), 1);
    cr_assert(strstr(body, "# TYPE moe_forward_latency_seconds histogram"));
    cr_assert(strstr(body, "moe_forward_latency_seconds_bucket{le=\"+Inf\"} 1"));
    cr_assert(strstr(body, "# TYPE moe_experts_latency_seconds histogram"));
    cr_assert_eq(cluster_metric_value(body, "moe_gate_latency_seconds_count"), 1);
    double sum = 0;
    for (int e = 0; e < 4; e++) {
        char name[96];
        snprintf(name, sizeof(name),
                 "moe_expert_tokens_total{model=\"m\",layer=\"1\",expert=\"%d\"}", e);
        double v = cluster_metric_value(body, name);
        cr_assert_eq(v, (double)info.tokens_per_expert[e], "%s = %g, forward said %lld", name, v,
                     (long long)info.tokens_per_expert[e]);
        sum += v;
        snprintf(name, sizeof(name),
                 "moe_expert_tokens_total{model=\"m\",layer=\"0\",expert=\"%d\"}", e);
        cr_assert_eq(cluster_metric_value(body, name), 0, "layer 0 saw no forward");
        snprintf(name, sizeof(name),
                 "moe_expert_dropped_total{model=\"m\",layer=\"1\",expert=\"%d\"}", e);
        cr_assert_eq(cluster_metric_value(body, name), 0);
    }
    cr_assert_eq(sum, T * 2);
    cr_assert_gt(cluster_metric_value(body, "moe_layer_imbalance{model=\"m\",layer=\"1\"}"), 0.99);
    cr_assert(strstr(body, "moe_worker_up{worker=\"0\"} 1"));
    cr_assert(strstr(body, "moe_worker_busy_seconds_total{worker=\"1\"}"));
    /* rows crossed between the two workers (dispatch and combine) */
    cr_assert_gt(cluster_metric_value(body, "moe_alltoall_bytes_total{worker=\"0\"}") +
                     cluster_metric_value(body, "moe_alltoall_bytes_total{worker=\"1\"}"),
                 0, "no all-to-all bytes counted");
    moe_fwd_info_free(&info);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());

    /* not ready: a coordinator waiting for its worker */
    cluster_opts o2 = {.workers = 0, .expected_workers = 1, .metrics = 1};
    cl = cluster_start(&o2);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/livez", NULL, 0, body, sizeof(body)), 200);
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/readyz", NULL, 0, body, sizeof(body)), 503,
                 "%s", body);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ---- forwards on a thread, to overlap with a signal or a kill ---- */

typedef struct fwd_job {
    cluster *cl;
    int T, H;
    moe_err err;
    char msg[512];
    int64_t ms;
} fwd_job;

static void *fwd_thread(void *arg)
{
    fwd_job *j = arg;
    size_t n = (size_t)j->T * j->H;
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    rng_fill_uniform(4, 4, -1, 1, x, n);
    int64_t t0 = cluster_now_ms();
    j->err = moe_forward(j->cl->cli, "m", 0, MOE_F32, x, j->T, j->H, y, NULL);
    j->ms = cluster_now_ms() - t0;
    snprintf(j->msg, sizeof(j->msg), "%s", j->err ? moe_last_error() : "");
    free(x);
    free(y);
    return NULL;
}

/* inflight_bytes from `stats`: the request messages of the calls the
 * coordinator holds (this stats call's own included). */
static uint64_t inflight_bytes(cluster *cl)
{
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "stats", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    mp_reader r = mp_reply_reader(&rep);
    uint64_t v = 0;
    cr_assert(mp_map_find(&r, "inflight_bytes") == 0 && mp_read_u64(&r, &v, NULL) == MOE_OK);
    moe_reply_free(&rep);
    return v;
}

/* start_held_forward stops worker 1 (SIGSTOP), starts j on a thread and
 * returns once the coordinator holds the forward's request: until
 * release_worker, the forward cannot finish, so a drain that comes next
 * finds it in flight whatever the machine's load. */
static void start_held_forward(cluster *cl, fwd_job *j, pthread_t *th)
{
    /* the same forward first, while every worker runs: the client learns
     * the workers' addresses (dataplane.info), connects and maps its
     * shared-memory rows with every worker - what the held forward would
     * otherwise ask of the stopped worker before reaching the coordinator */
    fwd_thread(j);
    cr_assert_eq(j->err, MOE_OK, "%s", j->msg);
    /* the stats call alone; its size varies by a few bytes (the msgid's
     * encoding grows with it), a forward's control call is ~100 bytes */
    uint64_t base = inflight_bytes(cl) + 40;
    cr_assert_eq(kill(cl->worker_pid[1], SIGSTOP), 0);
    pthread_create(th, NULL, fwd_thread, j);
    int64_t t0 = cluster_now_ms();
    while (inflight_bytes(cl) <= base) {
        cr_assert(cluster_now_ms() - t0 < 30000, "the forward never reached the coordinator");
        usleep(5000);
    }
}

static void release_worker(cluster *cl)
{
    cr_assert_eq(kill(cl->worker_pid[1], SIGCONT), 0);
}

/* quiet: no heartbeats in the test's time, and a stopped worker's peer
 * waits for it in the exchange */
#define QUIET_COORD  "--heartbeat-timeout-ms", "600000"
#define QUIET_WORKER "--heartbeat-ms", "60000", "--xchg-timeout-ms", "60000"

/* a forward of about 0.3-1 s on one CPU thread per worker */
#define LONG_T 16384
#define LONG_H 256

/* SIGTERM with a forward in flight: the coordinator drains (not ready,
 * status still answered, new forwards refused "draining"), the forward
 * completes, the coordinator exits 0. */
Test(cluster_ops, sigterm_drains_then_exits_0, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2,
                      .metrics = 1,
                      .client_timeout_ms = 20000,
                      .coord_args = {QUIET_COORD},
                      .worker_args = {QUIET_WORKER}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    create_model(cl, "m", LONG_H, 1024);
    fwd_job j = {cl, LONG_T, LONG_H, MOE_OK, "", 0};
    pthread_t th;
    start_held_forward(cl, &j, &th);
    cr_assert_eq(cluster_coord_signal(cl, SIGTERM), 0, "%s", cluster_error());
    /* draining while the forward is held: status answered, not ready */
    cluster_state st = {0};
    int64_t t0 = cluster_now_ms();
    while (cluster_get_state(cl, &st) != MOE_OK || !st.draining) {
        cr_assert(cluster_now_ms() - t0 < 30000, "the coordinator never said draining");
        usleep(5000);
    }
    static char body[4096];
    int code = cluster_http_get(cl->metrics_port, "/readyz", NULL, 0, body, sizeof(body));
    cr_assert_eq(code, 503, "readyz during drain: %s", body);
    release_worker(cl);
    pthread_join(th, NULL);
    cr_assert_eq(j.err, MOE_OK, "the in-flight forward should complete during the drain: %s",
                 j.msg);
    int status = cluster_coord_wait(cl, 20000);
    cr_assert(status != -1, "%s", cluster_error());
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "coordinator should exit 0 after SIGTERM, status 0x%x", status);
    cr_log_info("in-flight forward took %lld ms", (long long)j.ms);
    cr_assert_eq(cluster_stop(cl), 0, "workers should exit 0 on SIGTERM: %s", cluster_error());
}

/* The drain RPC with a forward in flight: a new forward (rows on the data
 * plane, a control call to the coordinator) is refused `unavailable`
 * "draining" at once, the held one completes, the coordinator exits 0. */
Test(cluster_ops, draining_refuses_new_forwards, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2,
                      .client_timeout_ms = 20000,
                      .coord_args = {QUIET_COORD},
                      .worker_args = {QUIET_WORKER}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    create_model(cl, "m", LONG_H, 1024);
    fwd_job j = {cl, LONG_T, LONG_H, MOE_OK, "", 0};
    pthread_t th;
    start_held_forward(cl, &j, &th);
    /* the drain RPC: answered, then the coordinator drains */
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "drain", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    moe_reply_free(&rep);
    /* new forwards, on the data plane (rows to the workers over sockets, a
     * new client: a new shared-memory region would need the stopped worker)
     * and on the coordinator path: refused "draining" */
    static const char *paths[2] = {"socket", "coordinator"};
    for (int p = 0; p < 2; p++) {
        float x[4 * LONG_H], y[4 * LONG_H];
        memset(x, 0, sizeof(x));
        moe_client *c2;
        moe_client_opts co = {.timeout_ms = 20000, .data_path = paths[p]};
        cr_assert_eq(moe_client_open(cl->url, &co, &c2), MOE_OK, "%s", moe_last_error());
        moe_err e = moe_forward(c2, "m", 0, MOE_F32, x, 4, LONG_H, y, NULL);
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", moe_last_error());
        moe_client_close(c2);
        cr_assert_eq(e, MOE_EUNAVAIL, "%s forward during drain: %s: %s", paths[p], moe_err_code(e),
                     msg);
        cr_assert(strstr(msg, "draining"), "message: %s", msg);
    }
    release_worker(cl);
    pthread_join(th, NULL);
    cr_assert_eq(j.err, MOE_OK, "in-flight forward during drain: %s", j.msg);
    int status = cluster_coord_wait(cl, 20000);
    cr_assert(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "coordinator after drain: status 0x%x", status);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* The lane (a one-worker cluster): forwards go to the worker alone, so a
 * drain of the coordinator does not stop them: one sent on the lane after
 * the coordinator drained and exited is answered by the worker, with the
 * same rows as before. */
Test(cluster_ops, lane_forwards_answered_after_drain, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1, .client_timeout_ms = 10000};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    create_model(cl, "m", 64, 128);
    float x[8 * 64], y0[8 * 64], y1[8 * 64];
    rng_fill_uniform(3, 3, -1, 1, x, sizeof(x) / sizeof(x[0]));
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 8, 64, y0, NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "drain", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    moe_reply_free(&rep);
    int status = cluster_coord_wait(cl, 20000);
    cr_assert(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "coordinator after drain: status 0x%x", status);
    moe_err e = moe_forward(cl->cli, "m", 0, MOE_F32, x, 8, 64, y1, NULL);
    cr_assert_eq(e, MOE_OK, "lane forward after the drain: %s: %s", moe_err_code(e),
                 moe_last_error());
    cr_assert(memcmp(y0, y1, sizeof(y0)) == 0, "the lane answered other rows");
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* A worker SIGKILLed in the middle of a forward: the forward is answered
 * with an error (never hangs), the dead worker is marked down, a restarted
 * worker brings the cluster back. --xchg-timeout-ms bounds how long the
 * survivor waits for its dead peer in the next handshake. */
Test(cluster_ops, worker_killed_during_forward, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2,
                      .coord_args = {"--heartbeat-timeout-ms", "1000"},
                      .worker_args = {"--heartbeat-ms", "100", "--xchg-timeout-ms", "2000"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    create_model(cl, "m", LONG_H, 1024);
    fwd_job j = {cl, LONG_T, LONG_H, MOE_OK, "", 0};
    pthread_t th;
    pthread_create(&th, NULL, fwd_thread, &j);
    usleep(150000);
    int64_t t_kill = cluster_now_ms();
    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cluster_error());
    pthread_join(th, NULL);
    int64_t answered = cluster_now_ms() - t_kill;
    cr_log_info("forward answered %lld ms after the kill: %s: %s", (long long)answered,
                moe_err_code(j.err), j.msg);
    if (j.err == MOE_OK) /* finished before the kill landed: nothing to check there */
        cr_log_info("the forward completed before the worker died");
    else
        cr_assert_eq(j.err, MOE_EUNAVAIL, "%s", j.msg);
    cr_assert_lt(answered, 5000, "the forward hung for %lld ms", (long long)answered);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    cr_assert_eq(cluster_worker_start(cl, 1), 0, "%s", cluster_error());
    cr_assert_eq(cluster_wait_ready(cl, 20000), 0, "%s", cluster_error());
    cr_log_info("ready again %lld ms after the kill", (long long)(cluster_now_ms() - t_kill));
    float x[4 * LONG_H], y[4 * LONG_H];
    rng_fill_uniform(1, 1, -1, 1, x, 4 * LONG_H);
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 4, LONG_H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* A worker stuck (SIGSTOP: its connections stay open, it sends nothing) in
 * the middle of a forward: the coordinator marks it lost when its
 * heartbeats stop and tells the survivor to give up the generation
 * (worker.abort), so the forward is answered unavailable long before the
 * exchange's own timeout (60 s here). */
Test(cluster_ops, stuck_worker_aborts_the_exchange, .timeout = 150, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2,
                      .client_timeout_ms = 120000,
                      .coord_args = {"--heartbeat-timeout-ms", "1000"},
                      .worker_args = {"--heartbeat-ms", "100", "--xchg-timeout-ms", "60000"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    create_model(cl, "m", LONG_H, 1024);
    fwd_job j = {cl, LONG_T, LONG_H, MOE_OK, "", 0};
    pthread_t th;
    pthread_create(&th, NULL, fwd_thread, &j);
    usleep(150000);
    int64_t t_stop = cluster_now_ms();
    cr_assert_gt(cl->worker_pid[1], 0);
    cr_log_info("stopping worker pid %d", (int)cl->worker_pid[1]);
    cr_assert_eq(kill(cl->worker_pid[1], SIGSTOP), 0);
    pthread_join(th, NULL);
    int64_t answered = cluster_now_ms() - t_stop;
    cr_log_info("forward answered %lld ms after the stop: %s: %s", (long long)answered,
                moe_err_code(j.err), j.msg);
    kill(cl->worker_pid[1], SIGCONT);
    if (j.err == MOE_OK) {
        cr_log_info("the forward completed before the worker stopped");
    } else {
        cr_assert_eq(j.err, MOE_EUNAVAIL, "%s", j.msg);
        /* the exchange's timeout is 60 s: anything well under it is the abort */
        cr_assert_lt(answered, 30000, "the forward waited %lld ms: no abort", (long long)answered);
    }
    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_start(cl, 1), 0, "%s", cluster_error());
    cr_assert_eq(cluster_wait_ready(cl, 30000), 0, "%s", cluster_error());
    float x[4 * LONG_H], y[4 * LONG_H];
    rng_fill_uniform(1, 1, -1, 1, x, 4 * LONG_H);
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 4, LONG_H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* A device that cannot be recovered: the survivor's compute thread is stuck
 * inside a forward (a test hook hangs it, deaf to aborts, as a kernel that
 * never ends would). When the coordinator gives the generation up (the
 * other member is killed), the stuck worker exits with status 3 after
 * --stuck-exit-ms so that its supervisor restarts it; restarted, both
 * workers form the cluster again. Before it exits it runs $MOE_STUCK_STACKS
 * with its pid (here an echo: the line must be in its log). */
Test(cluster_ops, stuck_device_exits_for_its_supervisor, .timeout = 120, .fini = cluster_fini_all)
{
    setenv("MOE_FANOUT_ROWS", "0", 1); /* a cluster job that hangs on the workers */
    setenv("MOE_STUCK_STACKS", "echo stacks-of-pid", 1);
    cluster_opts o = {.workers = 2,
                      .client_timeout_ms = 60000,
                      .coord_args = {QUIET_COORD},
                      .worker_args = {QUIET_WORKER, "--stuck-exit-ms", "1000",
                                      "--test-hang-forward-ms", "600000"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    create_model(cl, "m", LONG_H, 1024);
    /* start_forward's warm-up forward would hang too: the rows' map first,
     * through a call that is no forward */
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "dataplane.info", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    moe_reply_free(&rep);
    fwd_job j = {cl, 4, LONG_H, MOE_OK, "", 0};
    pthread_t th;
    /* held: the coordinator holds the forward's control call (its bytes in
     * progress; the stats call alone is under 40 bytes), so the job went to
     * the workers, where it hangs */
    uint64_t base = inflight_bytes(cl) + 40;
    pthread_create(&th, NULL, fwd_thread, &j);
    int64_t t0 = cluster_now_ms();
    while (inflight_bytes(cl) <= base) {
        cr_assert(cluster_now_ms() - t0 < 30000, "the forward never reached the coordinator");
        usleep(5000);
    }
    const int stuck_pid = (int)cl->worker_pid[0];
    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cluster_error());
    int st = cluster_worker_wait(cl, 0, 60000);
    cr_assert(st != -1, "the stuck worker did not exit: %s", cluster_error());
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 3, "stuck worker: status 0x%x, want exit 3", st);
    unsetenv("MOE_STUCK_STACKS");
    char want[64];
    snprintf(want, sizeof(want), "stacks-of-pid %d", stuck_pid);
    cr_assert(cluster_log_has(cl->paths_worker_log[0], want), "no \"%s\" in the stuck worker's log",
              want);
    pthread_join(th, NULL);
    cr_assert_neq(j.err, MOE_OK, "the forward cannot have completed");
    cr_log_info("forward answered %s: %s", moe_err_code(j.err), j.msg);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* A worker process that dies is marked down when its connection to the
 * coordinator closes, not after the heartbeat timeout (10 minutes here, so
 * only the connection can tell): the cluster is not ready, and after a
 * restart it re-forms and serves. */
Test(cluster_ops, dead_worker_noticed_by_its_connection, .timeout = 90, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2,
                      .coord_args = {"--heartbeat-timeout-ms", "600000"},
                      .worker_args = {"--heartbeat-ms", "100"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    create_model(cl, "m", LONG_H, 1024);
    int64_t t_kill = cluster_now_ms();
    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cluster_error());
    cluster_state st = {0};
    int64_t seen = -1;
    while (cluster_now_ms() - t_kill < 60000) {
        if (cluster_get_state(cl, &st) == MOE_OK && st.down >= 1 && !st.ready) {
            seen = cluster_now_ms() - t_kill;
            break;
        }
        usleep(20000);
    }
    cr_log_info("worker shown down %lld ms after the kill", (long long)seen);
    cr_assert(seen >= 0,
              "the dead worker was not marked down within 60 s (heartbeat timeout 600 s)");
    cr_assert_eq(cluster_worker_start(cl, 1), 0, "%s", cluster_error());
    cr_assert_eq(cluster_wait_ready(cl, 30000), 0, "%s", cluster_error());
    float x[4 * LONG_H], y[4 * LONG_H];
    rng_fill_uniform(2, 2, -1, 1, x, 4 * LONG_H);
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 4, LONG_H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}
