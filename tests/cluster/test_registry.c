/*
 * test_registry.c - the coordinator's worker registry does not fill up with
 * dead workers (docs/OPERATIONS.md, "Worker registry"):
 *   - 300 registrations of fake workers (raw worker.register on their own
 *     connection, closed right after: each worker is then down) - more than
 *     the default capacity of 256 - and then real workers still join, the
 *     cluster is ready, and /metrics has series for the live workers only;
 *   - a real worker restarted (SIGKILL) three times the capacity of a
 *     registry of 4 entries: each restart takes the old rank, the cluster is
 *     ready every time, and only the live worker is listed;
 *   - a registry of live workers that is full refuses a new one with a clear
 *     error, logged at warn.
 * No sleeps: every wait polls cluster.status with a generous bound.
 */
#include <criterion/criterion.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "common/hostid.h"
#include "common/procstat.h"

/* fake_register sends worker.register for rpc_url on a fresh connection,
 * with the cluster secret (NULL: none); the connection stays open (*sock)
 * so the entry stays up until closed. Returns the reply's error code; msg
 * gets its message. */
/* the process a fake worker claims to be (fake_register_as): pid, its start
 * time, and the host id; NULL: none given */
typedef struct fake_proc {
    int pid;
    unsigned long long start_ticks;
    const char *host;
} fake_proc;

static moe_err fake_register_as(const char *coord_url, const char *secret, const char *rpc_url,
                                const fake_proc *proc, int ep_dedup, nng_socket *sock, char *msg,
                                size_t cap);

/* KCU_EP_CE a fake worker reports (fake_register_as; -1: none) */
static int fake_ep_ce = -1;

static moe_err fake_register(const char *coord_url, const char *secret, const char *rpc_url,
                             nng_socket *sock, char *msg, size_t cap)
{
    return fake_register_as(coord_url, secret, rpc_url, NULL, -1, sock, msg, cap);
}

static moe_err fake_register_as(const char *coord_url, const char *secret, const char *rpc_url,
                                const fake_proc *proc, int ep_dedup, nng_socket *sock, char *msg,
                                size_t cap)
{
    nng_socket s;
    cr_assert_eq(nng_req0_open(&s), 0);
    nng_socket_set_ms(s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, 20000);
    nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, 20000);
    cr_assert_eq(nng_dial(s, coord_url, NULL, 0), 0);
    mp_writer w;
    mp_writer_init(&w);
    mp_write_array(&w, 4);
    mp_write_i64(&w, 0);
    mp_write_i64(&w, 1);
    mp_write_cstr(&w, "worker.register");
    mp_write_array(&w, 1);
    mp_write_map(&w, (secret ? 3 : 2) + (proc ? 3 : 0) + (ep_dedup >= 0 ? 1 : 0) +
                         (fake_ep_ce >= 0 ? 1 : 0));
    if (ep_dedup >= 0) {
        mp_write_cstr(&w, "ep_dedup");
        mp_write_i64(&w, ep_dedup);
    }
    if (fake_ep_ce >= 0) {
        mp_write_cstr(&w, "ep_ce");
        mp_write_i64(&w, fake_ep_ce);
    }
    if (secret) {
        mp_write_cstr(&w, "cluster");
        mp_write_cstr(&w, secret);
    }
    if (proc) {
        mp_write_cstr(&w, "pid");
        mp_write_i64(&w, proc->pid);
        mp_write_cstr(&w, "start_ticks");
        mp_write_i64(&w, (int64_t)proc->start_ticks);
        mp_write_cstr(&w, "host");
        mp_write_cstr(&w, proc->host);
    }
    mp_write_cstr(&w, "rpc_url");
    mp_write_cstr(&w, rpc_url);
    mp_write_cstr(&w, "data_url");
    mp_write_cstr(&w, rpc_url);
    cr_assert_eq(nng_send(s, w.buf, w.len, 0), 0);
    mp_writer_fini(&w);
    uint8_t *buf;
    size_t len;
    int rv = nng_recv(s, &buf, &len, NNG_FLAG_ALLOC);
    cr_assert_eq(rv, 0, "worker.register: no reply: %s", nng_strerror(rv));
    moe_rpc_response resp;
    mp_errbuf eb = {{0}};
    cr_assert_eq(moe_rpc_parse_response(buf, len, &resp, &eb), MOE_OK, "%s", eb.msg);
    snprintf(msg, cap, "%.*s", (int)resp.errmsg_len, resp.errmsg ? resp.errmsg : "");
    moe_err e = resp.err;
    nng_free(buf, len);
    *sock = s;
    return e;
}

/* coord_warned: 1 when a warning line of the coordinator's log holds what */
static int coord_warned(cluster *cl, const char *what)
{
    FILE *f = fopen(cl->paths_coord_log, "r");
    cr_assert(f, "%s", cl->paths_coord_log);
    char line[1200];
    int warned = 0;
    while (fgets(line, sizeof(line), f))
        warned |= strstr(line, " W ") && strstr(line, what);
    fclose(f);
    return warned;
}

/* wait_state polls cluster.status until up == want_up (and, with
 * want_listed >= 0, listed == want_listed). */
static cluster_state wait_state(cluster *cl, int want_up, int want_listed, int ready)
{
    cluster_state st;
    int64_t t0 = cluster_now_ms();
    for (;;) {
        cr_assert_eq(cluster_get_state(cl, &st), MOE_OK, "%s", moe_last_error());
        if (st.up == want_up && (want_listed < 0 || st.listed == want_listed) &&
            (!ready || st.ready))
            return st;
        cr_assert(cluster_now_ms() - t0 < 30000,
                  "cluster.status: up %d listed %d ready %d, want up %d listed %d ready %d", st.up,
                  st.listed, st.ready, want_up, want_listed, ready);
        usleep(2000); /* polling interval, not a synchronisation */
    }
}

/* count lines of /metrics that start with prefix */
static int metric_lines(cluster *cl, const char *prefix)
{
    static char body[1 << 20];
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/metrics", NULL, 0, body, sizeof(body)), 200);
    int n = 0;
    for (const char *p = body; (p = strstr(p, prefix)); p++)
        n += p == body || p[-1] == '\n';
    return n;
}

/* wait_metric_lines polls /metrics (rendered every 100 ms) for want lines. */
static void wait_metric_lines(cluster *cl, const char *prefix, int want)
{
    int64_t t0 = cluster_now_ms();
    int n;
    while ((n = metric_lines(cl, prefix)) != want) {
        cr_assert(cluster_now_ms() - t0 < 30000, "%d lines %s, want %d", n, prefix, want);
        usleep(20000);
    }
}

Test(registry, fake_registrations_beyond_capacity_do_not_fill_it, .timeout = 150,
     .fini = cluster_fini_all)
{
    cluster_opts o = {
        .workers = 0, .expected_workers = 2, .no_wait = 1, .metrics = 1, .checkpoint_root = ""};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    char msg[512], url[64];
    for (int i = 0; i < 300; i++) {
        nng_socket s;
        /* a new address each time, like a worker restarted on port 0 */
        snprintf(url, sizeof(url), "tcp://127.0.0.1:%d", 20000 + i);
        moe_err e = fake_register(cl->url, cl->secret, url, &s, msg, sizeof(msg));
        cr_assert_eq(e, MOE_OK, "registration %d: %s: %s", i, moe_err_code(e), msg);
        nng_close(s); /* the worker is gone: its connection closed */
        wait_state(cl, 0, -1, 0);
    }
    /* real workers join and the cluster forms */
    for (int i = 0; i < 2; i++)
        cr_assert_eq(cluster_worker_start(cl, i), 0, "%s", cluster_error());
    cr_assert_eq(cluster_wait_ready(cl, 60000), 0, "%s", cluster_error());
    /* the dead fakes are gone from cluster.status and /metrics */
    wait_state(cl, 2, 2, 1);
    char body[64];
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/readyz", NULL, 0, body, sizeof(body)), 200);
    wait_metric_lines(cl, "moe_worker_up{", 2);
    wait_metric_lines(cl, "moe_worker_busy_seconds_total{", 2);
    cr_assert_eq(cluster_stop(cl), 0);
}

Test(registry, worker_restarts_take_the_old_rank, .timeout = 150, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1, .metrics = 1, .checkpoint_root = ""};
    o.coord_args[0] = "--max-workers";
    o.coord_args[1] = "4";
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    cluster_state st;
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
    uint64_t gen = st.generation;
    for (int i = 0; i < 12; i++) {
        cr_assert_eq(cluster_worker_kill(cl, 0, SIGKILL), 0, "%s", cluster_error());
        cr_assert_eq(cluster_worker_start(cl, 0), 0, "%s", cluster_error());
        /* a new generation with the restarted worker */
        int64_t t0 = cluster_now_ms();
        for (;;) {
            cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
            if (st.ready && st.generation > gen)
                break;
            cr_assert(cluster_now_ms() - t0 < 30000, "restart %d: not ready again: up %d, gen %llu",
                      i, st.up, (unsigned long long)st.generation);
            usleep(2000);
        }
        gen = st.generation;
    }
    wait_state(cl, 1, 1, 1);
    wait_metric_lines(cl, "moe_worker_up{", 1);
    char body[64];
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/readyz", NULL, 0, body, sizeof(body)), 200);
    cr_assert_eq(cluster_stop(cl), 0);
}

Test(registry, full_of_live_workers_refuses_clearly, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 0, .expected_workers = 3, .no_wait = 1, .checkpoint_root = ""};
    o.coord_args[0] = "--max-workers";
    o.coord_args[1] = "2";
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    nng_socket s[3];
    char msg[512];
    cr_assert_eq(
        fake_register(cl->url, cl->secret, "tcp://127.0.0.1:21001", &s[0], msg, sizeof(msg)),
        MOE_OK);
    cr_assert_eq(
        fake_register(cl->url, cl->secret, "tcp://127.0.0.1:21002", &s[1], msg, sizeof(msg)),
        MOE_OK);
    wait_state(cl, 2, 2, 0);
    moe_err e =
        fake_register(cl->url, cl->secret, "tcp://127.0.0.1:21003", &s[2], msg, sizeof(msg));
    cr_assert_eq(e, MOE_ENOMEM, "third worker: %s: %s", moe_err_code(e), msg);
    cr_assert(strstr(msg, "registry full"), "%s", msg);
    /* once one is gone, there is room again */
    nng_close(s[0]);
    wait_state(cl, 1, -1, 0);
    nng_close(s[2]);
    cr_assert_eq(
        fake_register(cl->url, cl->secret, "tcp://127.0.0.1:21004", &s[2], msg, sizeof(msg)),
        MOE_OK, "%s", msg);
    nng_close(s[1]);
    nng_close(s[2]);
    /* the refusal is in the coordinator's log at warn */
    cr_assert(coord_warned(cl, "registry full"), "no warning about the full registry in %s",
              cl->paths_coord_log);
    cr_assert_eq(cluster_stop(cl), 0);
}

/* Without the cluster secret nobody can register a worker (a fake one used
 * to break every re-formation): refused `unauthenticated`, with a wrong
 * secret too, and the registry stays empty; with the secret it registers. */
Test(registry, register_without_cluster_secret_refused, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 0, .expected_workers = 1, .no_wait = 1, .checkpoint_root = ""};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    char msg[512];
    nng_socket s;
    moe_err e = fake_register(cl->url, NULL, "tcp://127.0.0.1:21011", &s, msg, sizeof(msg));
    cr_expect_eq(e, MOE_EUNAUTH, "no secret: %s: %s", moe_err_code(e), msg);
    cr_expect(strstr(msg, "cluster secret"), "%s", msg);
    nng_close(s);
    e = fake_register(cl->url, "not-the-secret", "tcp://127.0.0.1:21012", &s, msg, sizeof(msg));
    cr_expect_eq(e, MOE_EUNAUTH, "wrong secret: %s: %s", moe_err_code(e), msg);
    nng_close(s);
    cluster_state st;
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(st.listed, 0, "%d workers listed after refused registrations", st.listed);
    e = fake_register(cl->url, cl->secret, "tcp://127.0.0.1:21013", &s, msg, sizeof(msg));
    cr_expect_eq(e, MOE_OK, "with the secret: %s: %s", moe_err_code(e), msg);
    nng_close(s);
    cr_assert_eq(cluster_stop(cl), 0);
}

/* worker_state: the state cluster.status lists for rpc_url ("" if none) */
static void worker_state(cluster *cl, const char *rpc_url, char *out, size_t cap)
{
    moe_reply rep;
    out[0] = 0;
    cr_assert_eq(moe_call(cl->cli, "cluster.status", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    mp_reader rd = mp_reply_reader(&rep);
    uint32_t n = 0;
    cr_assert(mp_map_find(&rd, "workers") == 0 && mp_read_array(&rd, &n, NULL) == MOE_OK);
    for (uint32_t i = 0; i < n; i++) {
        mp_reader e = rd;
        char url[128] = "", st[32] = "";
        const char *v;
        uint32_t vl;
        if (mp_map_find(&e, "rpc_url") == 0 && mp_read_str(&e, &v, &vl, NULL) == MOE_OK)
            snprintf(url, sizeof(url), "%.*s", (int)vl, v);
        e = rd;
        if (mp_map_find(&e, "state") == 0 && mp_read_str(&e, &v, &vl, NULL) == MOE_OK)
            snprintf(st, sizeof(st), "%.*s", (int)vl, v);
        if (strcmp(url, rpc_url) == 0)
            snprintf(out, cap, "%s", st);
        cr_assert_eq(mp_skip(&rd, NULL), MOE_OK);
    }
    moe_reply_free(&rep);
}

/* A worker on the coordinator's host is lost as soon as /proc shows its
 * process gone or exiting, though its connection to the coordinator is
 * still open and its heartbeats would be missed only after 10 minutes: a
 * SIGKILLed process closes its sockets only after the kernel has torn its
 * memory down (85-305 ms for a CPU worker with a training model on this
 * machine, the coordinator seeing it 3 ms after the kill). Two fakes name
 * one child process: A with its start time (watched), B with another (a
 * pid that names another process: not watched). The child is killed: A
 * goes down, B stays up - both are checked in the same timer pass, so B
 * still being up when A is seen down is no matter of timing. */
Test(registry, a_local_workers_death_is_seen_in_proc, .timeout = 90, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 0,
                      .expected_workers = 2,
                      .no_wait = 1,
                      .checkpoint_root = "",
                      .coord_args = {"--heartbeat-timeout-ms", "600000"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    pid_t child = fork();
    cr_assert(child >= 0);
    if (child == 0) {
        for (;;)
            pause();
    }
    procstat ps;
    cr_assert_eq(procstat_read(child, &ps), 0, "the child in /proc");
    char host[128], msg[512], st[32];
    moe_host_id(host, sizeof(host));
    fake_proc a = {child, ps.start_ticks, host}, b = {child, ps.start_ticks + 1, host};
    nng_socket sa, sb;
    moe_err e =
        fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:1", &a, -1, &sa, msg, sizeof(msg));
    cr_assert_eq(e, MOE_OK, "%s: %s", moe_err_code(e), msg);
    e = fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:2", &b, -1, &sb, msg, sizeof(msg));
    cr_assert_eq(e, MOE_OK, "%s: %s", moe_err_code(e), msg);
    wait_state(cl, 2, -1, 0);

    kill(child, SIGKILL);
    int status;
    waitpid(child, &status, 0);
    int64_t t0 = cluster_now_ms();
    for (;;) {
        worker_state(cl, "tcp://127.0.0.1:1", st, sizeof(st));
        if (strcmp(st, "down") == 0)
            break;
        cr_assert(cluster_now_ms() - t0 < 30000, "a watched worker whose process is gone: %s", st);
        usleep(2000); /* polling interval, not a synchronisation */
    }
    worker_state(cl, "tcp://127.0.0.1:2", st, sizeof(st));
    cr_assert_str_eq(st, "up", "a fake whose start time names no process was lost: %s", st);
    nng_close(sa);
    nng_close(sb);
    cr_assert_eq(cluster_stop(cl), 0);
}

/* Workers must agree on KCU_EP_DEDUP (their expert-parallel layers size
 * the counts exchange by it): a worker reporting another value than one in
 * the registry is refused failed_precondition, naming both values, and
 * the coordinator warns; a worker that reports none is not compared; one
 * with the same value registers; once the workers of the old value are
 * down, one with the new value registers. */
Test(registry, workers_disagreeing_on_ep_dedup_refused, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 0, .expected_workers = 3, .no_wait = 1, .checkpoint_root = ""};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    nng_socket s[4];
    char msg[512];
    cr_assert_eq(fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21011", NULL, 1, &s[0], msg,
                                  sizeof(msg)),
                 MOE_OK, "%s", msg);
    moe_err e = fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21012", NULL, 0, &s[1], msg,
                                 sizeof(msg));
    cr_assert_eq(e, MOE_EPRECOND, "%s: %s", moe_err_code(e), msg);
    cr_assert(strstr(msg, "KCU_EP_DEDUP=0 on this worker, 1 on worker"), "%s", msg);
    cr_assert_eq(fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21013", NULL, -1, &s[2],
                                  msg, sizeof(msg)),
                 MOE_OK, "%s", msg);
    cr_assert_eq(fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21014", NULL, 1, &s[3], msg,
                                  sizeof(msg)),
                 MOE_OK, "%s", msg);
    wait_state(cl, 3, 3, 0);
    /* once the workers with 1 are gone (a change over every worker in
     * turn), a worker with 0 registers: down entries are not compared */
    nng_close(s[0]);
    nng_close(s[3]);
    nng_close(s[1]); /* the refused one's connection */
    wait_state(cl, 1, -1, 0);
    cr_assert_eq(fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21012", NULL, 0, &s[1], msg,
                                  sizeof(msg)),
                 MOE_OK, "%s", msg);
    nng_close(s[1]);
    nng_close(s[2]);
    cr_assert(coord_warned(cl, "KCU_EP_DEDUP=0 there, 1 on worker"),
              "no warning about KCU_EP_DEDUP in %s", cl->paths_coord_log);
    cr_assert_eq(cluster_stop(cl), 0);
}

/* Workers must agree on KCU_EP_CE too (the copy-engine exchange's setup is
 * collective): as KCU_EP_DEDUP, a differing value is refused naming both,
 * with a warning; a worker reporting ep_dedup but no ep_ce is of a build
 * without the exchange: 0, refused beside one that has it on; a worker
 * reporting neither is not compared; the same value registers. */
Test(registry, workers_disagreeing_on_ep_ce_refused, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 0, .expected_workers = 3, .no_wait = 1, .checkpoint_root = ""};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    nng_socket s[5];
    char msg[512];
    fake_ep_ce = 1;
    cr_assert_eq(fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21021", NULL, 1, &s[0], msg,
                                  sizeof(msg)),
                 MOE_OK, "%s", msg);
    fake_ep_ce = 0;
    moe_err e = fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21022", NULL, 1, &s[1], msg,
                                 sizeof(msg));
    cr_assert_eq(e, MOE_EPRECOND, "%s: %s", moe_err_code(e), msg);
    cr_assert(strstr(msg, "KCU_EP_CE=0 on this worker, 1 on worker"), "%s", msg);
    fake_ep_ce = -1; /* a build before the exchange: ep_dedup only */
    e = fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21023", NULL, 1, &s[2], msg,
                         sizeof(msg));
    cr_assert_eq(e, MOE_EPRECOND, "ep_dedup without ep_ce: %s: %s", moe_err_code(e), msg);
    cr_assert(strstr(msg, "KCU_EP_CE=0 on this worker, 1 on worker"), "%s", msg);
    cr_assert_eq(fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21025", NULL, -1, &s[4],
                                  msg, sizeof(msg)),
                 MOE_OK, "neither reported: not compared: %s", msg);
    fake_ep_ce = 1;
    cr_assert_eq(fake_register_as(cl->url, cl->secret, "tcp://127.0.0.1:21024", NULL, 1, &s[3], msg,
                                  sizeof(msg)),
                 MOE_OK, "%s", msg);
    fake_ep_ce = -1;
    wait_state(cl, 3, 3, 0);
    for (int i = 0; i < 5; i++)
        nng_close(s[i]);
    cr_assert(coord_warned(cl, "KCU_EP_CE=0 there, 1 on worker"),
              "no warning about KCU_EP_CE in %s", cl->paths_coord_log);
    cr_assert_eq(cluster_stop(cl), 0);
}
