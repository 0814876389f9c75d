/*
 * test_safe.c - safe by default, and bounds in bytes (docs/OPERATIONS.md,
 * "Security" and "Bounds"):
 *   - methods that take no params refuse unknown keys (drain {"bogus": 1} is
 *     invalid_argument and does not stop the coordinator); drain {} from a
 *     client without a token, on loopback with no --auth-token, still drains;
 *   - a worker's endpoint refuses worker.* calls without the cluster secret;
 *   - a daemon refuses to listen on a non-loopback address without
 *     --auth-token, unless --insecure;
 *   - --max-inflight-mb: concurrent large forwards beyond the budget get
 *     busy, and the coordinator's RSS stays bounded;
 *   - --max-conns: connections beyond the limit are closed, and served once
 *     another one goes;
 *   - --idle-timeout-ms: a connection holding half a message (or nothing)
 *     is closed after the bound.
 * No sleeps as synchronisation: every wait polls with a generous bound.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cluster.h"

/* ---- helpers ---- */

static cluster *start(cluster_opts o)
{
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    return cl;
}

/* call_with: method with params {key: 1} (key NULL: {}); returns the error */
static moe_err call_with(cluster *cl, const char *method, const char *key, char *msg, size_t cap)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, key ? 1 : 0);
    if (key) {
        mp_write_cstr(&w, key);
        mp_write_i64(&w, 1);
    }
    moe_reply rep;
    moe_err e = moe_call(cl->cli, method, w.buf, w.len, &rep);
    snprintf(msg, cap, "%s", rep.message);
    moe_reply_free(&rep);
    mp_writer_fini(&w);
    return e;
}

/* stats_u64: an unsigned field of the coordinator's stats */
static uint64_t stats_u64(cluster *cl, const char *key)
{
    moe_reply rep;
    moe_err e = moe_call(cl->cli, "stats", NULL, 0, &rep);
    cr_assert_eq(e, MOE_OK, "stats: %s", rep.message);
    mp_reader r = mp_reply_reader(&rep);
    uint64_t v = 0;
    cr_assert_eq(mp_map_find(&r, key), 0, "stats has no %s", key);
    cr_assert_eq(mp_read_u64(&r, &v, NULL), MOE_OK, "stats %s is not an integer", key);
    moe_reply_free(&rep);
    return v;
}

/* raw_req: a req0 socket dialed to url, with bounded receives */
static nng_socket raw_req(const char *url, int recv_timeout_ms)
{
    nng_socket s;
    cr_assert_eq(nng_req0_open(&s), 0);
    nng_socket_set_ms(s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, recv_timeout_ms);
    nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, 5000);
    nng_socket_set_ms(s, NNG_OPT_RECONNMINT, 20);
    nng_socket_set_ms(s, NNG_OPT_RECONNMAXT, 100);
    int rv = nng_dial(s, url, NULL, NNG_FLAG_NONBLOCK);
    cr_assert_eq(rv, 0, "dial %s: %s", url, nng_strerror(rv));
    return s;
}

/* raw_call sends [0, 1, method, [params]] (params: an encoded map, NULL =
 * {}) and returns the reply's error (its message in msg), or -1 with the
 * nng error in msg when no reply came. */
static int raw_call(nng_socket s, const char *method, const mp_writer *params, char *msg,
                    size_t cap)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_array(&w, 4);
    mp_write_i64(&w, 0);
    mp_write_i64(&w, 1);
    mp_write_cstr(&w, method);
    mp_write_array(&w, 1);
    if (params)
        mp_write_raw(&w, params->buf, params->len);
    else
        mp_write_map(&w, 0);
    int rv = nng_send(s, w.buf, w.len, 0);
    mp_writer_fini(&w);
    uint8_t *buf = NULL;
    size_t len = 0;
    if (rv == 0)
        rv = nng_recv(s, &buf, &len, NNG_FLAG_ALLOC);
    if (rv != 0) {
        snprintf(msg, cap, "%s", nng_strerror(rv));
        return -1;
    }
    moe_rpc_response resp;
    mp_errbuf eb = {{0}};
    cr_assert_eq(moe_rpc_parse_response(buf, len, &resp, &eb), MOE_OK, "%s", eb.msg);
    snprintf(msg, cap, "%.*s", (int)resp.errmsg_len, resp.errmsg ? resp.errmsg : "");
    int e = (int)resp.err;
    nng_free(buf, len);
    return e;
}

/* run_cmd runs a shell command, its output (stdout and stderr) in out;
 * returns its exit code, or -1 when it did not exit */
static int run_cmd(const char *cmd, char *out, size_t cap)
{
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* ---- item 4: safe by default ---- */

/* Methods that take no params refuse unknown keys: `drain {"bogus": 1}` used
 * to stop the coordinator. A plain drain from a client without a token is
 * allowed on loopback with no --auth-token (documented), and drains. */
Test(safe, no_params_methods_refuse_unknown_keys, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 0, .expected_workers = 1});
    static const char *methods[] = {"drain", "ping", "stats", "cluster.status", "dataplane.info"};
    char msg[512];
    for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++) {
        moe_err e = call_with(cl, methods[i], "bogus", msg, sizeof(msg));
        cr_expect_eq(e, MOE_EINVAL, "%s {bogus: 1}: %s (%s)", methods[i], moe_err_code(e), msg);
        cr_expect(strstr(msg, "bogus"), "%s: the message names the key: %s", methods[i], msg);
    }
    /* still serving: the bogus drain did not drain */
    cluster_state st;
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(st.draining, 0, "a drain with an unknown key started a drain");
    cr_assert_eq(moe_ping(cl->cli), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(call_with(cl, "drain", NULL, msg, sizeof(msg)), MOE_OK, "drain {}: %s", msg);
    int status = cluster_coord_wait(cl, 20000);
    cr_assert(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "the coordinator did not exit 0 after drain (status %d)", status);
    cluster_stop(cl);
}

/* worker_rpc_url: the rpc_url of the first worker of cluster.status */
static void worker_rpc_url(cluster *cl, char *out, size_t cap)
{
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "cluster.status", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    mp_reader r = mp_reply_reader(&rep);
    uint32_t n = 0;
    cr_assert_eq(mp_map_find(&r, "workers"), 0);
    cr_assert_eq(mp_read_array(&r, &n, NULL), MOE_OK);
    cr_assert_geq(n, 1u);
    cr_assert_eq(mp_map_find(&r, "rpc_url"), 0);
    const char *s;
    uint32_t len;
    cr_assert_eq(mp_read_str(&r, &s, &len, NULL), MOE_OK);
    snprintf(out, cap, "%.*s", (int)len, s);
    moe_reply_free(&rep);
}

/* The worker's endpoint refuses worker.* calls that do not carry the
 * cluster secret; the coordinator's own calls carry it (the cluster works). */
Test(safe, worker_endpoint_requires_cluster_secret, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 1});
    char url[256], msg[512];
    worker_rpc_url(cl, url, sizeof(url));
    nng_socket s = raw_req(url, 20000);
    mp_writer p;
    mp_writer_init(&p);
    mp_write_map(&p, 1);
    mp_write_cstr(&p, "generation");
    mp_write_i64(&p, 1);
    int e = raw_call(s, "worker.abort", &p, msg, sizeof(msg));
    cr_expect_eq(e, MOE_EUNAUTH, "worker.abort without the secret: %d (%s)", e, msg);
    e = raw_call(s, "worker.xchg_id", NULL, msg, sizeof(msg));
    cr_expect_eq(e, MOE_EUNAUTH, "worker.xchg_id without the secret: %d (%s)", e, msg);
    mp_writer_fini(&p);
    mp_writer_init(&p);
    mp_write_map(&p, 2);
    mp_write_cstr(&p, "cluster");
    mp_write_cstr(&p, "wrong");
    mp_write_cstr(&p, "generation");
    mp_write_i64(&p, 1);
    e = raw_call(s, "worker.abort", &p, msg, sizeof(msg));
    cr_expect_eq(e, MOE_EUNAUTH, "worker.abort with a wrong secret: %d (%s)", e, msg);
    mp_writer_fini(&p);
    /* with the secret: served (generation 999 is not the worker's: no abort) */
    mp_writer_init(&p);
    mp_write_map(&p, 2);
    mp_write_cstr(&p, "cluster");
    mp_write_cstr(&p, cl->secret);
    mp_write_cstr(&p, "generation");
    mp_write_i64(&p, 999);
    e = raw_call(s, "worker.abort", &p, msg, sizeof(msg));
    cr_expect_eq(e, MOE_OK, "worker.abort with the secret: %d (%s)", e, msg);
    mp_writer_fini(&p);
    e = raw_call(s, "ping", NULL, msg, sizeof(msg));
    cr_expect_eq(e, MOE_OK, "worker ping: %d (%s)", e, msg);
    nng_close(s);
    /* the coordinator's calls carry the secret: a model is created on the worker */
    moe_model_config mc = {
        .name = "m", .layers = 1, .d_model = 8, .d_ff = 8, .n_experts = 2, .top_k = 1};
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "%s", moe_last_error());
    float x[2 * 8] = {1, 2, 3}, y[2 * 8];
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 2, 8, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0);
}

/* A daemon refuses to listen where other hosts reach it without
 * --auth-token; --insecure or a token allows it. */
Test(safe, non_loopback_listen_refused_without_token, .timeout = 60, .fini = cluster_fini_all)
{
    char cmd[1024], out[4096];
    const char *bin = cluster_bin_dir();
    snprintf(cmd, sizeof(cmd),
             "%s/moe-coordinator --listen tcp://0.0.0.0:0 --cluster-secret s 2>&1 </dev/null", bin);
    int rc = run_cmd(cmd, out, sizeof(out));
    cr_expect_eq(rc, 2, "coordinator on 0.0.0.0 without a token: exit %d: %s", rc, out);
    cr_expect(strstr(out, "--auth-token") && strstr(out, "--insecure"), "%s", out);
    snprintf(cmd, sizeof(cmd),
             "%s/moe-coordinator --metrics http://0.0.0.0:0 --cluster-secret s 2>&1 </dev/null",
             bin);
    rc = run_cmd(cmd, out, sizeof(out));
    cr_expect_eq(rc, 2, "metrics on 0.0.0.0 without a token: exit %d: %s", rc, out);
    static const char *wflags[] = {"--listen tcp://0.0.0.0:0", "--data tcp://0.0.0.0:0",
                                   "--client-listen tcp://0.0.0.0:0"};
    for (int i = 0; i < 3; i++) {
        snprintf(cmd, sizeof(cmd),
                 "%s/moe-worker --backend cpu --coordinator tcp://127.0.0.1:1 "
                 "--cluster-secret s %s 2>&1 </dev/null",
                 bin, wflags[i]);
        rc = run_cmd(cmd, out, sizeof(out));
        cr_expect_eq(rc, 2, "worker %s without a token: exit %d: %s", wflags[i], rc, out);
        cr_expect(strstr(out, "refusing"), "%s", out);
    }
    /* --insecure: it starts and serves (dialing 0.0.0.0 reaches this host) */
    cluster *cl =
        start((cluster_opts){.workers = 0,
                             .expected_workers = 1,
                             .coord_args = {"--listen", "tcp://0.0.0.0:0", "--insecure"}});
    cr_assert_eq(moe_ping(cl->cli), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0);
    /* an auth token: it starts too */
    cl = start((cluster_opts){.workers = 0,
                              .expected_workers = 1,
                              .auth_token = "tok",
                              .coord_args = {"--listen", "tcp://0.0.0.0:0"}});
    cr_assert_eq(moe_ping(cl->cli), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0);
}

/* ---- item 6: bounds in bytes and connections ---- */

#define NBIG      8
#define BIG_H     1024
#define BIG_T     10240 /* 40 MiB of f32 rows: above glibc's mmap threshold */
#define BUDGET_MB 100

typedef struct big_state {
    pthread_mutex_t mu;
    int done;
    moe_err err[NBIG];
    char msg[NBIG][256];
} big_state;
typedef struct big_arg {
    big_state *st;
    int i;
} big_arg;

static void on_big(moe_err err, moe_reply *rep, void *arg)
{
    big_arg *a = arg;
    pthread_mutex_lock(&a->st->mu);
    a->st->err[a->i] = err;
    snprintf(a->st->msg[a->i], sizeof(a->st->msg[a->i]), "%s", rep ? rep->message : "");
    a->st->done++;
    pthread_mutex_unlock(&a->st->mu);
    moe_reply_free(rep);
    free(rep);
}

static int big_done(big_state *st)
{
    pthread_mutex_lock(&st->mu);
    int n = st->done;
    pthread_mutex_unlock(&st->mu);
    return n;
}

/* vm_rss_mb: VmRSS of pid in MiB, from /proc/PID/status */
static long vm_rss_mb(pid_t pid)
{
    char path[64], line[256];
    long kb = -1;
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    cr_assert(f, "open %s", path);
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
            break;
    fclose(f);
    cr_assert_geq(kb, 0, "no VmRSS in %s", path);
    return kb / 1024;
}

/* With the workers stopped, the first forwards stay in progress and hold
 * their bytes: of 8 concurrent 40 MiB forwards and a 100 MiB budget, two are
 * taken and six answered busy at once; the coordinator's RSS stays near the
 * budget (without the budget it held all eight). Once the workers go on,
 * the two complete and the bytes are released. */
Test(safe, byte_budget_busy_and_rss_bounded, .timeout = 180, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 2,
                                       .client_timeout_ms = 150000,
                                       .coord_args = {"--max-msg-mb", "48", "--max-inflight-mb",
                                                      "100", "--heartbeat-timeout-ms", "600000",
                                                      "--idle-timeout-ms", "0"}});
    moe_model_config mc = {
        .name = "big", .layers = 1, .d_model = BIG_H, .d_ff = 8, .n_experts = 2, .top_k = 1};
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "%s", moe_last_error());
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 3);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "big");
    mp_write_cstr(&w, "layer");
    mp_write_i64(&w, 0);
    mp_write_cstr(&w, "x");
    size_t nbytes = (size_t)BIG_T * BIG_H * sizeof(float);
    float *x = calloc((size_t)BIG_T * BIG_H, sizeof(float));
    cr_assert(x);
    moe_tensor t = {MOE_F32, 2, {BIG_T, BIG_H, 0, 0}, x, nbytes};
    moe_tensor_write(&w, &t);
    free(x);
    cr_assert(!w.failed);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(kill(cl->worker_pid[i], SIGSTOP), 0);
    long rss0 = vm_rss_mb(cl->coord_pid);

    static big_state st;
    static big_arg args[NBIG];
    memset(&st, 0, sizeof(st));
    pthread_mutex_init(&st.mu, NULL);
    for (int i = 0; i < NBIG; i++) {
        args[i] = (big_arg){&st, i};
        cr_assert_eq(moe_call_async(cl->cli, "forward", w.buf, w.len, on_big, &args[i]), MOE_OK);
    }
    mp_writer_fini(&w);
    /* the six over the budget are answered while the workers are stopped */
    int64_t t0 = cluster_now_ms();
    while (big_done(&st) < NBIG - 2) {
        cr_assert(cluster_now_ms() - t0 < 90000, "%d of %d answered", big_done(&st), NBIG - 2);
        usleep(10000); /* polling interval */
    }
    uint64_t held = stats_u64(cl, "inflight_bytes");
    long rss = vm_rss_mb(cl->coord_pid);
    cr_log_info("budget %d MiB: held %llu MiB, RSS %ld MiB (%ld before the forwards)", BUDGET_MB,
                (unsigned long long)(held >> 20), rss, rss0);
    pthread_mutex_lock(&st.mu);
    int busy = 0;
    for (int i = 0; i < NBIG; i++) {
        if (st.err[i] == MOE_EBUSY) {
            busy++;
            cr_expect(strstr(st.msg[i], "max-inflight-mb"), "busy message: %s", st.msg[i]);
        }
    }
    pthread_mutex_unlock(&st.mu);
    cr_expect_eq(busy, NBIG - 2, "%d busy, want %d", busy, NBIG - 2);
    cr_expect_geq(held, 2 * nbytes, "held %llu bytes", (unsigned long long)held);
    cr_expect_leq(held, (uint64_t)BUDGET_MB << 20, "held %llu bytes", (unsigned long long)held);
    /* two requests held (80 MiB) and their rows on the way to the workers
     * (40 MiB): far below the 8 x 40 MiB of an unbounded coordinator */
    cr_expect_lt(rss - rss0, 2 * BUDGET_MB, "RSS grew by %ld MiB", rss - rss0);

    for (int i = 0; i < 2; i++)
        cr_assert_eq(kill(cl->worker_pid[i], SIGCONT), 0);
    t0 = cluster_now_ms();
    while (big_done(&st) < NBIG) {
        cr_assert(cluster_now_ms() - t0 < 120000, "%d of %d answered", big_done(&st), NBIG);
        usleep(10000);
    }
    int ok = 0;
    for (int i = 0; i < NBIG; i++) {
        ok += st.err[i] == MOE_OK;
        cr_expect(st.err[i] == MOE_OK || st.err[i] == MOE_EBUSY, "call %d: %s: %s", i,
                  moe_err_code(st.err[i]), st.msg[i]);
    }
    cr_expect_eq(ok, 2, "%d forwards served", ok);
    /* released when answered: only the stats request itself is held */
    cr_expect_lt(stats_u64(cl, "inflight_bytes"), 1u << 20);
    cr_assert_eq(cluster_stop(cl), 0);
}

/* --max-conns 3: the harness client and two raw ones fill it; a fourth
 * connection is closed as it arrives (counted), and is served once one of
 * the others goes. */
Test(safe, connection_limit, .timeout = 90, .fini = cluster_fini_all)
{
    cluster *cl = start(
        (cluster_opts){.workers = 0, .expected_workers = 1, .coord_args = {"--max-conns", "3"}});
    char msg[256];
    cr_assert_eq(moe_ping(cl->cli), MOE_OK, "%s", moe_last_error());
    nng_socket s[3];
    for (int i = 0; i < 2; i++) {
        s[i] = raw_req(cl->url, 20000);
        cr_assert_eq(raw_call(s[i], "ping", NULL, msg, sizeof(msg)), MOE_OK, "%s", msg);
    }
    cr_assert_eq(stats_u64(cl, "connections"), 3);
    s[2] = raw_req(cl->url, 30000);
    int64_t t0 = cluster_now_ms();
    while (stats_u64(cl, "connections_refused_total") < 1) {
        cr_assert(cluster_now_ms() - t0 < 30000, "the fourth connection was not refused");
        usleep(10000);
    }
    cr_expect_eq(stats_u64(cl, "connections"), 3);
    nng_close(s[0]); /* a place frees up: the fourth gets in (its dialer retries) */
    /* a retry that arrives before the coordinator saw s[0] go is closed
     * again, and a request sent on it fails with "Connection reset" (req0
     * without resends): the caller sends it again, as a client would */
    int e;
    t0 = cluster_now_ms();
    while ((e = raw_call(s[2], "ping", NULL, msg, sizeof(msg))) == -1 && strstr(msg, "reset") &&
           cluster_now_ms() - t0 < 30000)
        usleep(20000);
    cr_expect_eq(e, MOE_OK, "ping on the fourth connection after another closed: %d (%s)", e, msg);
    cr_expect_eq(raw_call(s[1], "ping", NULL, msg, sizeof(msg)), MOE_OK, "%s", msg);
    nng_close(s[1]);
    nng_close(s[2]);
    cr_assert_eq(cluster_stop(cl), 0);
}

/* tcp_connect_sp: a TCP connection to the coordinator that completed the
 * SP handshake as a req0 peer (raw bytes: nothing but what we write) */
static int tcp_connect_sp(const char *url)
{
    unsigned port = 0;
    cr_assert_eq(sscanf(url, "tcp://127.0.0.1:%u", &port), 1, "url %s", url);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0, "%s", strerror(errno));
    static const uint8_t hello[8] = {0, 'S', 'P', 0, 0x00, 0x30, 0, 0}; /* req0 */
    cr_assert_eq(write(fd, hello, 8), 8);
    uint8_t peer[8];
    size_t got = 0;
    while (got < 8) {
        ssize_t n = read(fd, peer + got, 8 - got);
        cr_assert_gt(n, 0, "SP handshake: %s", n == 0 ? "closed" : strerror(errno));
        got += (size_t)n;
    }
    cr_assert(peer[1] == 'S' && peer[2] == 'P' && peer[5] == 0x31, "not a rep0 peer");
    return fd;
}

/* wait_closed polls fd until the peer closes it; the time it took in ms,
 * or -1 after bound_ms */
static int64_t wait_closed(int fd, int bound_ms)
{
    int64_t t0 = cluster_now_ms();
    while (cluster_now_ms() - t0 < bound_ms) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 100) == 1) {
            char b[64];
            ssize_t n = read(fd, b, sizeof(b));
            if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN))
                return cluster_now_ms() - t0;
        }
    }
    return -1;
}

/* --idle-timeout-ms 300: a connection that sent half a message and stalled
 * is closed, and so is one that sent nothing; a client whose connection was
 * closed while idle is still served (it dials again); a worker heartbeating
 * every 2 s keeps its connection (the cluster does not re-form). */
Test(safe, half_message_dropped_after_idle_timeout, .timeout = 90, .fini = cluster_fini_all)
{
    int64_t t_start = cluster_now_ms();
    cluster *cl = start((cluster_opts){.workers = 1,
                                       .coord_args = {"--idle-timeout-ms", "300"},
                                       .worker_args = {"--heartbeat-ms", "2000"}});
    cluster_state st0, st;
    cr_assert_eq(cluster_get_state(cl, &st0), MOE_OK, "%s", moe_last_error());
    int half = tcp_connect_sp(cl->url);
    /* an SP frame announcing 1000 bytes, of which 100 come */
    uint8_t frame[8 + 100] = {0, 0, 0, 0, 0, 0, 0x03, 0xe8};
    memset(frame + 8, 0x94, 100);
    cr_assert_eq(write(half, frame, sizeof(frame)), (ssize_t)sizeof(frame));
    int idle = tcp_connect_sp(cl->url);
    int64_t ms = wait_closed(half, 30000);
    cr_expect_geq(ms, 0, "a half message was held for 30 s");
    cr_log_info("half message: connection closed after %lld ms", (long long)ms);
    cr_expect_geq(wait_closed(idle, 30000), 0, "an idle connection was held for 30 s");
    close(half);
    close(idle);
    cr_expect_geq(stats_u64(cl, "connections_idle_closed_total"), 2);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK, "%s", moe_last_error());
    /* over a window longer than the worker's heartbeat period: its
     * connection stays (else the coordinator would lose it and re-form) */
    do {
        cr_assert_eq(cluster_get_state(cl, &st), MOE_OK, "%s", moe_last_error());
        cr_assert(st.ready && st.generation == st0.generation && st.down == 0,
                  "the worker's connection was closed: ready %d generation %llu -> %llu", st.ready,
                  (unsigned long long)st0.generation, (unsigned long long)st.generation);
        usleep(50000); /* polling interval of the observation window */
    } while (cluster_now_ms() - t_start < 5000);
    cr_assert_eq(cluster_stop(cl), 0);
}
