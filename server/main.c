/*
 * main.c - moe-coordinator: the RPC front end. Parses config, starts the
 * libuv loop with the nng endpoint, routes each request by method.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "server/coord.h"
#include "rpc/dedupe.h"
#include "common/hostid.h"
#include "common/log.h"
#include "common/prio.h"
#include "common/params.h"
#include "common/sdnotify.h"
#include "common/secret.h"
#include "common/tls.h"

static coord C;
static sdn S;     /* systemd notifications (Type=notify); loop thread */
static dedupe *D; /* replies of mutating requests by "rid"; loop thread */

static const cfg_entry coord_cfg[] = {
    {"listen", CFG_STR, "tcp://127.0.0.1:7000", 0, 0, C.listen_url,
     "RPC address for clients and workers (port 0 = any)"},
    {"workers", CFG_INT, "2", 1, 256, &C.expected_workers, "workers that form the cluster"},
    {"min-workers", CFG_INT, "0", 0, 256, &C.min_workers,
     "when members are lost and not back within shrink-after-ms, form with the workers up "
     "if at least this many (their experts spread over them, restored from the newest "
     "checkpoint); the cluster grows back when workers come; 0 = wait for all"},
    {"shrink-after-ms", CFG_INT, "10000", 0, 86400000, &C.shrink_after_ms,
     "with min-workers: how long to wait for lost workers before forming without them"},
    {"metrics", CFG_STR, "", 0, 0, C.metrics_url,
     "HTTP address for /metrics /livez /readyz, e.g. http://127.0.0.1:9100 (empty = off)"},
    {"auth-token", CFG_STR, "", 0, 0, C.auth_token, "require this token in every request"},
    {"cluster-secret", CFG_STR, "", 0, 0, C.cluster_secret,
     "the secret workers prove themselves with (empty = read or create cluster-secret-file)"},
    {"cluster-secret-file", CFG_STR, "~/.moe/cluster-secret", 0, 0, C.cluster_secret_file,
     "without cluster-secret: read the secret here, or create the file (mode 0600) with a "
     "random one"},
    {"insecure", CFG_BOOL, "0", 0, 1, &C.insecure,
     "allow listening on non-loopback addresses without auth-token"},
    {"max-inflight-mb", CFG_INT, "1024", 1, 1 << 20, &C.max_inflight_mb,
     "request bytes held by queued and running requests, MiB; beyond it: busy "
     "(>= max-msg-mb)"},
    {"max-conns", CFG_INT, "1024", 1, 1 << 20, &C.max_conns,
     "open client and worker connections; more are closed at once"},
    {"idle-timeout-ms", CFG_INT, "30000", 0, 86400000, &C.idle_timeout_ms,
     "close a connection with no request in progress that completed no message for this long "
     "(a stalled half message included; 0 = never; workers' connections are exempt)"},
    {"tls-cert", CFG_STR, "", 0, 0, C.tls_cert,
     "PEM certificate chain a tls+tcp:// listen address presents"},
    {"tls-key", CFG_STR, "", 0, 0, C.tls_key, "PEM private key of tls-cert"},
    {"tls-ca", CFG_STR, "", 0, 0, C.tls_ca,
     "PEM CA certificates that workers' tls+tcp:// certificates must chain to (the "
     "coordinator's calls to workers)"},
    {"max-msg-mb", CFG_INT, "256", 1, 2048, &C.max_msg_mb, "largest request accepted, MiB"},
    {"queue-depth", CFG_INT, "256", 1, 16384, &C.queue_depth, "queued jobs before answering busy"},
    {"deadline-ms", CFG_INT, "60000", 0, 86400000, &C.deadline_ms,
     "default request deadline in the queue (0 = none)"},
    {"heartbeat-timeout-ms", CFG_INT, "3000", 100, 600000, &C.heartbeat_timeout_ms,
     "a worker silent this long is marked down"},
    {"worker-timeout-ms", CFG_INT, "120000", 100, 86400000, &C.worker_timeout_ms,
     "bound on one call to a worker"},
    {"max-handles", CFG_INT, "64", 1, 16384, &C.max_handles,
     "train forwards kept for backward (match the workers' max-handles)"},
    {"handle-ttl-ms", CFG_INT, "600000", 1, 86400000, &C.handle_ttl_ms,
     "a train forward not backwarded within this expires (match the workers')"},
    {"lane", CFG_INT, "1", 0, 1, &C.lane,
     "1: a one-worker cluster serves clients' inference forwards without the coordinator in "
     "the path (the lane); 0: every request through the coordinator"},
    {"batch-max-tokens", CFG_INT, "8192", 0, 1000000000, &C.batch_max_tokens,
     "merge queued inference forwards of one layer up to this many tokens (0 = off)"},
    {"contexts", CFG_INT, "64", 1, 4096, &C.nctx, "concurrent requests received"},
    {"xchg", CFG_STR, "auto", 0, 0, C.xchg_cfg,
     "worker exchange: auto (NCCL when every worker has a GPU, else shared memory when all "
     "workers are on one host, else nng) | nng | nccl | shm"},
    {"drain-timeout-ms", CFG_INT, "120000", 0, 86400000, &C.drain_timeout_ms,
     "bound on a drain (SIGTERM, drain RPC): then queued jobs fail and the coordinator exits "
     "(0 = wait for ever)"},
    {"checkpoint-dir", CFG_STR, "", 0, 0, C.ckpt_dir,
     "automatic checkpoints under DIR/<model> (restored when the cluster forms; empty = off)"},
    {"checkpoint-root", CFG_STR, "", 0, 0, C.ckpt_root,
     "explicit checkpoint.save/load paths must lie under DIR (empty = checkpoint-dir)"},
    {"max-workers", CFG_INT, "256", 1, COORD_MAX_WORKERS, &C.max_workers,
     "registry entries (workers up, or down and still holding a rank)"},
    {"history-ms", CFG_INT, "5000", 100, 60000, &C.history_ms,
     "the dashboard's history: one point per this many ms (180 points are kept)"},
    {"checkpoint-every", CFG_INT, "0", 0, 1000000000, &C.ckpt_every,
     "with checkpoint-dir: save every N optimizer steps (0 = only at drain)"},
    {"slow-durable-ms-for-tests", CFG_INT, "0", 0, 600000, &C.slow_durable_ms,
     "tests only: a checkpoint's index and LATEST take this much longer to become durable"},
    {"addr-file", CFG_STR, "", 0, 0, C.addr_file,
     "write the bound RPC address to this file once listening"},
    {"nice", CFG_INT, "-5", -20, 19, &C.nice,
     "the coordinator's scheduling priority (its threads'); below 0 needs CAP_SYS_NICE or "
     "RLIMIT_NICE (root, systemd Nice=), else it stays at 0 and logs so"},
    {"log-level", CFG_STR, "info", 0, 0, C.log_level, "debug | info | warn | error"},
};
#define NCFG ((int)(sizeof(coord_cfg) / sizeof(coord_cfg[0])))

static void on_request(rpc_call *call, void *arg)
{
    coord_dispatch(arg, D, call);
}

static void on_tick(uv_timer_t *t)
{
    coord *c = t->data;
    double now = (double)rpc_now_ns() * 1e-9;
    sdn_tick(&S, c->ready, c->draining, "cluster ready", rpc_now_ns());
    if (now - c->recent_t0 >= 1.0) {
        c->tokens_per_s = c->recent_tokens / (now - c->recent_t0);
        c->recent_tokens = 0;
        c->recent_t0 = now;
    }
    coord_check_workers(c);
    coord_job_pump(c);
    coord_metrics_render(c);
    coord_history_tick(c);
    if (c->draining && c->drain_timeout_ms > 0 &&
        rpc_now_ns() - c->drain_started_ns > (uint64_t)c->drain_timeout_ms * 1000000ull) {
        /* the bound on a drain: answer what is left and stop */
        LOG_W("drain took longer than %lld ms: failing %d queued jobs and stopping",
              c->drain_timeout_ms, c->qlen);
        coord_job_fail_all(c, MOE_EUNAVAIL, "coordinator stopped: drain timeout");
        uv_stop(c->loop);
        return;
    }
    if (c->draining && !c->current && !c->qhead) {
        /* checkpoint every model that changed since its last checkpoint */
        if (c->ckpt_dir[0] && c->ready && !c->drain_saved) {
            c->drain_saved = 1;
            for (int i = 0; i < c->nmodels; i++)
                coord_autosave(c, c->models[i], 0);
            coord_job_pump(c);
            if (c->current)
                return;
        }
        uv_stop(c->loop);
    }
}

static void on_signal(uv_signal_t *h, int sig)
{
    coord *c = h->data;
    if (c->draining) {
        LOG_W("second signal %d: stopping now", sig);
        coord_job_fail_all(c, MOE_EUNAVAIL, "coordinator stopped");
        uv_stop(c->loop);
        return;
    }
    coord_start_drain(c, sig == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* check_exposure refuses listeners other hosts can reach when no auth token
 * guards them, unless --insecure (0: fine) */
static int check_exposure(const coord *c)
{
    const char *urls[2] = {c->listen_url, c->metrics_url};
    if (c->auth_token[0] || c->insecure)
        return 0;
    for (int i = 0; i < 2; i++) {
        if (urls[i][0] && !url_is_loopback(urls[i])) {
            fprintf(stderr,
                    "moe-coordinator: refusing to listen on %s without --auth-token: anyone who "
                    "can reach it could use and stop the service (set --auth-token, or pass "
                    "--insecure on a trusted network)\n",
                    urls[i]);
            return -1;
        }
    }
    return 0;
}

/* check_tls: a tls+tcp:// listen address needs a certificate and key, and
 * the TLS engine must be there (0: fine) */
static int check_tls(const coord *c)
{
    char why[256];
    if (!moe_tls_url(c->listen_url))
        return 0;
    if (!moe_tls_available(why, sizeof(why))) {
        fprintf(stderr, "moe-coordinator: cannot listen on %s: %s\n", c->listen_url, why);
        return -1;
    }
    if (!c->tls_cert[0] || !c->tls_key[0]) {
        fprintf(stderr, "moe-coordinator: %s is a TLS address: give --tls-cert and --tls-key\n",
                c->listen_url);
        return -1;
    }
    return 0;
}

/* setup_secret: --cluster-secret, else the secret file's, else a new one
 * written to the file (secret.h). 0 on success. */
static int setup_secret(coord *c)
{
    char path[CFG_STR_MAX], err[512];
    if (c->cluster_secret[0])
        return 0;
    if (!c->cluster_secret_file[0]) {
        fprintf(stderr, "moe-coordinator: no --cluster-secret and no --cluster-secret-file: "
                        "workers could not prove themselves\n");
        return -1;
    }
    if (secret_expand_path(c->cluster_secret_file, path, sizeof(path), err, sizeof(err)) !=
        MOE_OK) {
        fprintf(stderr, "moe-coordinator: cluster-secret-file %s\n", err);
        return -1;
    }
    moe_err e =
        secret_read_file(path, c->cluster_secret, sizeof(c->cluster_secret), err, sizeof(err));
    if (e == MOE_OK)
        return 0;
    if (e == MOE_ENOTFOUND &&
        secret_generate(c->cluster_secret, sizeof(c->cluster_secret)) == MOE_OK &&
        secret_write_file(path, c->cluster_secret, err, sizeof(err)) == MOE_OK) {
        fprintf(stderr, "moe-coordinator: wrote a new cluster secret to %s\n", path);
        return 0;
    }
    fprintf(stderr, "moe-coordinator: cluster secret: %s\n", err);
    return -1;
}

int main(int argc, char **argv)
{
    char err[256];
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: moe-coordinator [flags]\n");
            cfg_usage(coord_cfg, NCFG, stdout);
            return 0;
        }
    }
    if (cfg_load(coord_cfg, NCFG, argc, argv, "MOE_COORD_", err, sizeof(err)) != MOE_OK) {
        fprintf(stderr, "moe-coordinator: %s\n", err);
        return 2;
    }
    if (strcmp(C.xchg_cfg, "auto") && strcmp(C.xchg_cfg, "nng") && strcmp(C.xchg_cfg, "nccl") &&
        strcmp(C.xchg_cfg, "shm")) {
        fprintf(stderr, "moe-coordinator: xchg must be auto, nng, nccl or shm\n");
        return 2;
    }
    if (C.min_workers > C.expected_workers) {
        fprintf(stderr, "moe-coordinator: min-workers (%lld) must be at most workers (%lld)\n",
                C.min_workers, C.expected_workers);
        return 2;
    }
    if (C.max_inflight_mb < C.max_msg_mb) {
        fprintf(stderr,
                "moe-coordinator: max-inflight-mb (%lld) must be at least max-msg-mb "
                "(%lld): a request of the largest size must fit\n",
                C.max_inflight_mb, C.max_msg_mb);
        return 2;
    }
    if (check_exposure(&C) != 0 || setup_secret(&C) != 0 || check_tls(&C) != 0)
        return 2;
    int lvl = log_level_parse(C.log_level);
    log_init("coord", lvl < 0 ? LOG_INFO : (log_level)lvl);
    signal(SIGPIPE, SIG_IGN);
    /* before any thread exists: nng's, libuv's and ours start with it */
    if (C.nice != 0 && prio_set_self((int)C.nice, err, sizeof(err)) != 0)
        LOG_I("scheduling priority unchanged (%s): threads of co-located workers may delay this "
              "loop",
              err);
    C.loop = uv_default_loop();
    C.started_ns = rpc_now_ns();
    {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        C.epoch = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) >> 1;
    }
    C.recent_t0 = (double)C.started_ns * 1e-9;
    pthread_mutex_init(&C.done_mu, NULL);
    pthread_mutex_init(&C.metrics_mu, NULL);
    /* the calls jobs.c makes upward (coord.h: coord_hooks), set once */
    C.hooks = (coord_hooks){.worker_lost = coord_worker_lost, .after_done = coord_maybe_form};
    uv_async_init(C.loop, &C.done_async, coord_on_done);
    C.done_async.data = &C;

    if (!(D = dedupe_new(DEDUPE_MAX_ENTRIES, DEDUPE_MAX_BYTES, DEDUPE_MAX_REPLY))) {
        fprintf(stderr, "moe-coordinator: out of memory\n");
        return 1;
    }
    uv_async_init(C.loop, &C.pipes_async, coord_on_pipes);
    C.pipes_async.data = &C;
    const moe_tls_files tls = {C.tls_cert, C.tls_key, C.tls_ca};
    rpcsrv_opts o = {
        C.listen_url,      (int)C.nctx,      (size_t)C.max_msg_mb << 20, on_request, &C,
        coord_pipe_closed, (int)C.max_conns, (int)C.idle_timeout_ms,     &tls};
    if (rpcsrv_open(C.loop, &o, &C.srv, C.bound_url, sizeof(C.bound_url)) != MOE_OK) {
        fprintf(stderr, "moe-coordinator: cannot listen on %s\n", C.listen_url);
        return 1;
    }
    if (coord_metrics_start(&C) != MOE_OK)
        return 1;
    fprintf(stderr, "moe-coordinator pid %d listening on %s\n", (int)getpid(), C.bound_url);
    cfg_print(coord_cfg, NCFG, stderr);
    if (C.addr_file[0]) {
        char tmp[CFG_STR_MAX + 8];
        snprintf(tmp, sizeof(tmp), "%s.tmp", C.addr_file);
        FILE *f = fopen(tmp, "w");
        if (!f || fprintf(f, "%s\n", C.bound_url) < 0 || fclose(f) != 0 ||
            rename(tmp, C.addr_file) != 0) {
            fprintf(stderr, "moe-coordinator: cannot write %s\n", C.addr_file);
            return 1;
        }
    }
    coord_ckpt_init(&C);
    coord_models_restore(&C); /* models of a previous run, with --checkpoint-dir */
    coord_metrics_render(&C);
    C.hist_last_ns = C.started_ns;
    coord_history_render(&C);
    sdn_init(&S);
    uv_timer_init(C.loop, &C.tick);
    C.tick.data = &C;
    uv_timer_start(&C.tick, on_tick, 100, 100);
    /* workers on this host: their deaths seen in /proc, before their sockets close */
    moe_host_id(C.host_id, sizeof(C.host_id));
    uv_timer_init(C.loop, &C.watch_timer);
    C.watch_timer.data = &C;
    uv_timer_start(&C.watch_timer, coord_watch_tick, 5, 5);
    uv_signal_init(C.loop, &C.sigterm);
    uv_signal_init(C.loop, &C.sigint);
    C.sigterm.data = C.sigint.data = &C;
    uv_signal_start(&C.sigterm, on_signal, SIGTERM);
    uv_signal_start(&C.sigint, on_signal, SIGINT);

    uv_run(C.loop, UV_RUN_DEFAULT);

    LOG_I("stopping");
    coord_job_fail_all(&C, MOE_EUNAVAIL, "coordinator stopped");
    /* a second signal stops with a job in flight: its workers' replies will
     * never be processed (the loop is done), so answer its clients now,
     * before rpcsrv_close, instead of leaving them to time out */
    if (C.current) {
        for (coord_job *b = C.current; b; b = b->batch_next)
            if (b->call)
                rpc_reply_err(b->call, MOE_EUNAVAIL, "coordinator stopped");
        C.current = NULL;
    }
    coord_metrics_stop(&C);
    rpcsrv_close(C.srv);
    dedupe_free(D); /* every original was answered above, or dropped by the close */
    for (int i = 0; i < COORD_MAX_WORKERS; i++)
        if (C.workers[i].cli) {
            moe_client_close(C.workers[i].cli);
            C.workers[i].cli = NULL;
        }
    uv_close((uv_handle_t *)&C.tick, NULL);
    uv_close((uv_handle_t *)&C.watch_timer, NULL);
    /* calls to workers closed above may still complete on nng threads */
    pthread_mutex_lock(&C.done_mu);
    C.done_closed = 1;
    pthread_mutex_unlock(&C.done_mu);
    uv_close((uv_handle_t *)&C.done_async, NULL);
    uv_close((uv_handle_t *)&C.pipes_async, NULL);
    uv_close((uv_handle_t *)&C.sigterm, NULL);
    uv_close((uv_handle_t *)&C.sigint, NULL);
    uv_run(C.loop, UV_RUN_DEFAULT);
    for (int i = 0; i < C.nmodels; i++)
        coord_model_free(C.models[i]);
    free(C.metrics_text);
    free(C.history_json);
    return 0;
}
