/*
 * main.c - moe-worker: registers with the coordinator, heartbeats, and runs
 * the coordinator's requests on its compute thread.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/blas_pick.h"
#include "worker/bulk.h"
#include "common/confine.h"
#include "common/ep_env.h"
#include "worker/gpu.h"
#include "common/hostid.h"
#include "common/procstat.h"
#include "common/log.h"
#include "common/prio.h"
#include "common/params.h"
#include "worker/pool.h"
#include "common/sdnotify.h"
#include "common/secret.h"
#include "common/tls.h"
#include "worker/worker.h"
#include "client/client_dp.h" /* moe__set_cluster */

void openblas_set_num_threads(int);

static wkr W;
static sdn S;                /* systemd notifications (Type=notify); loop thread */
static uv_timer_t sdn_timer; /* the watchdog, when systemd asks for one */

static const cfg_entry worker_cfg[] = {
    {"coordinator", CFG_STR, "tcp://127.0.0.1:7000", 0, 0, W.coord_url,
     "coordinator address to register with"},
    {"listen", CFG_STR, "tcp://127.0.0.1:0", 0, 0, W.listen_url,
     "RPC address the coordinator calls (port 0 = any)"},
    {"data", CFG_STR, "tcp://127.0.0.1:0", 0, 0, W.data_url_cfg,
     "exchange address other workers dial (port 0 = any)"},
    {"client-listen", CFG_STR, "tcp://127.0.0.1:0", 0, 0, W.client_url_cfg,
     "data plane: address clients send token rows to (port 0 = any; \"off\" = none)"},
    {"bulk-listen", CFG_STR, "tcp://127.0.0.1:0", 0, 0, W.bulk_url_cfg,
     "data plane: plain TCP address for large rows from clients on other hosts (port 0 = any; "
     "\"off\" = none)"},
    {"bulk-timeout-ms", CFG_INT, "10000", 100, 3600000, &W.bulk_timeout_ms,
     "data plane: a bulk transfer whose bytes stop for this long is dropped"},
    {"data-wait-ms", CFG_INT, "10000", 1, 3600000, &W.data_wait_ms,
     "data plane: how long a job waits for a client's rows to arrive"},
    {"data-staged-mb", CFG_INT, "4096", 1, 1 << 20, &W.data_staged_mb,
     "data plane: rows received inline and not yet asked for, MiB (beyond: busy)"},
    {"ring-spin-us", CFG_INT, "0", 0, 100000, &W.ring_spin_us,
     "data plane: after answering through a shared-memory ring, its thread and the compute "
     "thread watch for the next request this long before they sleep (0 = sleep at once)"},
    {"shm-max-mb", CFG_INT, "65536", 0, 1 << 24, &W.shm_max_mb,
     "data plane: clients' shared-memory regions mapped here, MiB (0 = no shared memory)"},
    {"backend", CFG_STR, "auto", 0, 0, W.backend_cfg, "auto | cpu | cuda"},
    {"device", CFG_INT, "0", 0, 1024, &W.device_index, "CUDA device this worker uses"},
    {"gpu-max-tokens", CFG_INT, "16384", 1, 1 << 24, &W.gpu_max_tokens,
     "GPU backend: most tokens of one layer call (sizes the device workspace)"},
    {"gpu-chunk-tokens", CFG_INT, "4096", 0, 1 << 24, &W.gpu_chunk_tokens,
     "GPU backend, one-worker cluster: an inference forward of page-locked host rows with at "
     "least twice this many tokens runs in chunks of this many, the host-device copies "
     "overlapped with the compute (0 = off)"},
    {"gpu-train-states", CFG_INT, "2", 1, 16, &W.gpu_train_states,
     "GPU backend, one-worker cluster: train forwards per layer kept on the device for their "
     "backward (a pipeline's forwards of several micro-batches do not recompute); each costs "
     "one workspace of device memory"},
    {"gpu-ep-train-states", CFG_INT, "1", 1, 15, &W.gpu_ep_train_states,
     "GPU backend, expert parallelism (several GPU workers): train forwards per layer kept on the "
     "device for their backward; above 1, one more state holds the other forwards (each state: "
     "a token side and an owner side of device memory, about 3.7 GiB for a Qwen3-30B-A3B layer "
     "at 16384 tokens on 2 GPUs)"},
    {"gpu-grad-bf16", CFG_INT, "0", 0, 1, &W.gpu_grad_bf16,
     "GPU backend, one-worker cluster: expert gradients stored in bf16 (half the memory)"},
    {"ep-chunks", CFG_INT, "0", 0, 8, &W.ep_chunks,
     "GPU workers over NCCL: overlap degree of dispatch/experts/combine (0 = by shape)"},
    {"ep", CFG_STR, "auto", 0, 0, W.ep_cfg,
     "auto | off: several GPU workers over NCCL run the layer device-resident (kcu_ep)"},
    {"heartbeat-ms", CFG_INT, "500", 50, 60000, &W.heartbeat_ms, "heartbeat period"},
    {"stuck-exit-ms", CFG_INT, "30000", 0, 86400000, &W.stuck_exit_ms,
     "after the coordinator gave up this worker's generation, exit with status 3 (for the "
     "supervisor to restart it) if the compute thread has not come back from its job within "
     "this bound - a device that cannot be recovered (0 = never)"},
    {"abort-exit-ms", CFG_INT, "3000", 0, 86400000, &W.abort_exit_ms,
     "GPU workers: exit with status 3 (for the supervisor to restart it) when an ncclCommAbort "
     "has not returned within this bound - a stream left waiting on a peer that is gone, which "
     "no abort releases (0 = never)"},
    {"test-hang-forward-ms", CFG_INT, "0", 0, 3600000, &W.test_hang_forward_ms,
     "tests only: every forward first hangs this long, deaf to aborts"},
    {"xchg-timeout-ms", CFG_INT, "10000", 100, 3600000, &W.xchg_timeout_ms,
     "bound on one collective between workers"},
    {"pool-mb", CFG_INT, "2048", 0, 1 << 24, &W.pool_mb,
     "host buffers of a layer call kept for the next one, MiB (0 = none)"},
    {"threads", CFG_INT, "0", 0, 1024, &W.threads, "BLAS threads (0 = library default)"},
    {"max-msg-mb", CFG_INT, "1024", 1, 4096, &W.max_msg_mb, "largest request accepted, MiB"},
    {"max-handles", CFG_INT, "64", 1, 1000000, &W.max_handles,
     "train forwards kept for backward; the oldest is dropped beyond this"},
    {"handle-ttl-ms", CFG_INT, "600000", 1, 86400000, &W.handle_ttl_ms,
     "a train forward not backwarded within this expires"},
    {"auth-token", CFG_STR, "", 0, 0, W.auth_token,
     "token sent to the coordinator, and required from clients on the data plane"},
    {"cluster-secret", CFG_STR, "", 0, 0, W.cluster_secret_cfg,
     "the coordinator's cluster secret (empty = read cluster-secret-file)"},
    {"cluster-secret-file", CFG_STR, "~/.moe/cluster-secret", 0, 0, W.cluster_secret_file,
     "without cluster-secret: read the secret here before each registration"},
    {"insecure", CFG_BOOL, "0", 0, 1, &W.insecure,
     "allow listening on non-loopback addresses without auth-token"},
    {"tls-cert", CFG_STR, "", 0, 0, W.tls_cert,
     "PEM certificate chain its tls+tcp:// listen and client-listen addresses present"},
    {"tls-key", CFG_STR, "", 0, 0, W.tls_key, "PEM private key of tls-cert"},
    {"tls-ca", CFG_STR, "", 0, 0, W.tls_ca,
     "PEM CA certificates that the coordinator's tls+tcp:// certificate must chain to"},
    {"mem-report-mb", CFG_INT, "0", 0, 1LL << 40, &W.mem_report_mb,
     "host memory offered for models, MiB, reported to the coordinator, which refuses a "
     "model.create that does not fit (0 = MemAvailable of /proc/meminfo)"},
    {"fail-create-for-tests", CFG_STR, "", 0, 0, W.fail_create_for_tests,
     "testing: the first worker.model_create of the model of this name fails "
     "(resource_exhausted)"},
    {"slow-step-ms-for-tests", CFG_INT, "0", 0, 600000, &W.slow_step_ms,
     "testing: worker.step sleeps this long before it runs (a step still at work when a peer "
     "dies)"},
    {"slow-create-ms-for-tests", CFG_INT, "0", 0, 600000, &W.slow_create_ms,
     "testing: worker.model_create of a model this worker does not hold sleeps this long "
     "first (a re-formation whose models come back slowly)"},
    {"slow-load-ms-for-tests", CFG_INT, "0", 0, 600000, &W.slow_load_ms,
     "testing: worker.checkpoint_load's prepare sleeps this long first (a restore still on "
     "its way after a re-formation)"},
    {"slow-ckpt-ms-for-tests", CFG_INT, "0", 0, 600000, &W.slow_ckpt_ms,
     "testing: worker.checkpoint_save sleeps this long before it writes (a save still at work "
     "when a peer dies)"},
    {"fail-shm-attach-for-tests", CFG_INT, "0", 0, 1000000, &W.fail_shm_attach,
     "testing: the first N data.shm_attach calls are answered unavailable (a worker a client "
     "cannot attach a buffer to, as one just killed)"},
    {"fail-create-below-world", CFG_INT, "0", 0, 256, &W.fail_create_below_world,
     "testing: every worker.model_create fails (resource_exhausted) while the generation has "
     "fewer workers than this, as if the larger share did not fit"},
    {"nice", CFG_INT, "-5", -20, 19, &W.nice,
     "the priority of the worker's loop (RPC, heartbeats, worker.abort) and I/O threads; the "
     "compute thread and its kernels' threads run at 0. Below 0 needs CAP_SYS_NICE or "
     "RLIMIT_NICE (root, systemd Nice=), else everything stays at 0 and it logs so"},
    {"log-level", CFG_STR, "info", 0, 0, W.log_level, "debug | info | warn | error"},
};
#define NCFG ((int)(sizeof(worker_cfg) / sizeof(worker_cfg[0])))

static void send_register(wkr *w);

static void on_register_reply(moe_err err, moe_reply *r, void *arg);

/* replies from the coordinator arrive on an nng thread; bounce to the loop */
typedef struct reg_event {
    uv_async_t async;
    int worker_id;
    moe_err err;
} reg_event;

static uv_async_t reg_async;
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static int reg_pending_id = -2; /* -2 none, -1 failed, >= 0 registered id */
static int hb_unknown;          /* set when the coordinator forgot us */
static int64_t reg_epoch;       /* the coordinator's epoch from the last registration */
static int reg_closed;          /* reg_async is closed: nng threads must not ring it */

static void on_reg_async(uv_async_t *h)
{
    wkr *w = h->data;
    pthread_mutex_lock(&reg_mu);
    int id = reg_pending_id;
    int unknown = hb_unknown;
    reg_pending_id = -2;
    hb_unknown = 0;
    pthread_mutex_unlock(&reg_mu);
    if (id >= 0) {
        w->worker_id = id;
        w->registering = 0;
        LOG_I("registered with %s as worker %d", w->coord_url, id);
        sdn_tick(&S, 1, 0, "registered", rpc_now_ns());
    } else if (id == -1) {
        w->registering = 0;
    }
    if (unknown && !w->registering) {
        LOG_W("coordinator does not know worker %d: registering again", w->worker_id);
        w->worker_id = -1;
    }
}

static void on_register_reply(moe_err err, moe_reply *r, void *arg)
{
    int id = -1;
    int64_t epoch = 0;
    if (err == MOE_OK && r) {
        mp_reader rd;
        uint32_t n;
        mp_reader_init(&rd, r->buf + r->result_off, r->len - r->result_off);
        int64_t v = -1;
        mp_reader roots_r;
        pspec sp[] = {{"worker_id", P_INT, &v, true, 0, 1e9, 0, false},
                      {"epoch", P_INT, &epoch, false, 0, 9.2e18, 0, false},
                      {"checkpoint_roots", P_RAW, &roots_r, false, 0, 0, 0, false}};
        char e2[128];
        if (mp_read_map(&rd, &n, NULL) == MOE_OK &&
            params_parse(&rd, n, sp, 3, e2, sizeof(e2)) == MOE_OK &&
            wkr_ckpt_set_roots_from(sp[2].seen ? &roots_r : NULL, NULL, 0) == MOE_OK) {
            id = (int)v;
        }
    } else if (r && r->transport) {
        LOG_D("register: %s", r->message);
    } else if (r) {
        /* the coordinator refused us (e.g. its registry is full): say why */
        LOG_W("register with the coordinator: %s: %s", moe_err_code(err), r->message);
    }
    moe_reply_free(r);
    free(r);
    pthread_mutex_lock(&reg_mu);
    reg_pending_id = id;
    if (id >= 0)
        reg_epoch = epoch;
    if (!reg_closed)
        uv_async_send(&reg_async);
    pthread_mutex_unlock(&reg_mu);
}

static void on_heartbeat_reply(moe_err err, moe_reply *r, void *arg)
{
    int unknown = 0;
    if (err == MOE_OK && r) {
        mp_reader rd;
        uint32_t n;
        bool known = true;
        mp_reader_init(&rd, r->buf + r->result_off, r->len - r->result_off);
        pspec sp[] = {{"known", P_BOOL, &known, true, 0, 0, 0, false}};
        char e2[128];
        if (mp_read_map(&rd, &n, NULL) == MOE_OK &&
            params_parse(&rd, n, sp, 1, e2, sizeof(e2)) == MOE_OK && !known)
            unknown = 1;
    }
    moe_reply_free(r);
    free(r);
    if (unknown) {
        pthread_mutex_lock(&reg_mu);
        hb_unknown = 1;
        if (!reg_closed)
            uv_async_send(&reg_async);
        pthread_mutex_unlock(&reg_mu);
    }
}

/* load_secret makes w->cluster_secret current: --cluster-secret, else the
 * secret file as it is now (the coordinator may have written it after we
 * started, or a new one after a restart). 0 when a secret is known. */
static int load_secret(wkr *w)
{
    static char last_err[512];
    char path[CFG_STR_MAX], err[512] = "", secret[CFG_STR_MAX];
    if (w->cluster_secret_cfg[0]) {
        snprintf(secret, sizeof(secret), "%s", w->cluster_secret_cfg);
    } else if (secret_expand_path(w->cluster_secret_file, path, sizeof(path), err, sizeof(err)) !=
                   MOE_OK ||
               secret_read_file(path, secret, sizeof(secret), err, sizeof(err)) != MOE_OK) {
        if (strcmp(err, last_err) != 0) /* say it once, not every heartbeat */
            LOG_W("cluster secret: %s (set --cluster-secret or --cluster-secret-file); "
                  "not registering until it is readable",
                  err);
        snprintf(last_err, sizeof(last_err), "%s", err);
        return -1;
    }
    last_err[0] = 0;
    if (strcmp(secret, w->cluster_secret) != 0) {
        if (moe__set_cluster(w->coord, secret) != MOE_OK)
            return -1;
        snprintf(w->cluster_secret, sizeof(w->cluster_secret), "%s", secret);
    }
    return 0;
}

static void send_register(wkr *w)
{
    mp_writer pw;
    if (load_secret(w) != 0)
        return;
    mp_writer_init(&pw);
    mp_write_map(&pw, 11 + (w->bulk_url[0] ? 1 : 0));
    if (w->bulk_url[0]) {
        mp_write_cstr(&pw, "bulk_url");
        mp_write_cstr(&pw, w->bulk_url);
    }
    wkr_write_mem(w, &pw);
    mp_write_cstr(&pw, "client_url");
    mp_write_cstr(&pw, w->client_url);
    mp_write_cstr(&pw, "host");
    mp_write_cstr(&pw, w->host_id);
    mp_write_cstr(&pw, "rpc_url");
    mp_write_cstr(&pw, w->rpc_url);
    mp_write_cstr(&pw, "data_url");
    mp_write_cstr(&pw, w->data_url);
    mp_write_cstr(&pw, "backend");
    mp_write_cstr(&pw, w->backend);
    mp_write_cstr(&pw, "device");
    mp_write_cstr(&pw, w->device);
    mp_write_cstr(&pw, "pid");
    mp_write_i64(&pw, getpid());
    mp_write_cstr(&pw, "ep_dedup");
    mp_write_i64(&pw, ep_dedup_env()); /* its layers' rules (common/ep_env.h) */
    mp_write_cstr(&pw, "ep_ce");
    mp_write_i64(&pw, ep_ce_env());
    procstat me; /* with the pid, names this process: a coordinator on this
                  * host watches it die (common/procstat.h) */
    mp_write_cstr(&pw, "start_ticks");
    mp_write_i64(&pw, procstat_read(0, &me) == 0 ? (int64_t)me.start_ticks : 0);
    w->registering = 1;
    if (moe_call_async(w->coord, "worker.register", pw.buf, pw.len, on_register_reply, w) != MOE_OK)
        w->registering = 0;
    mp_writer_fini(&pw);
}

/* stuck_stacks: $MOE_STUCK_STACKS, when set, is a command run with this
 * process's id appended (e.g. "eu-stack -p" or "gdb -batch -ex 'thread
 * apply all bt' -p") before a stuck worker exits: every thread's stack in
 * the log, for diagnosis */
static void stuck_stacks(void)
{
    const char *cmd = getenv("MOE_STUCK_STACKS");
    if (!cmd || !*cmd)
        return;
    char line[512];
    snprintf(line, sizeof(line), "%s %d 1>&2", cmd, (int)getpid());
    if (system(line) != 0)
        LOG_W("MOE_STUCK_STACKS: \"%s\" failed", line);
}

/* check_stuck: the coordinator gave up our generation (a member is gone)
 * but the compute thread is still inside the job it began before: a
 * collective or kernel that cannot be interrupted. Past --stuck-exit-ms the
 * worker exits (status 3) so that its supervisor restarts it with a fresh
 * device, instead of leaving the cluster unable to re-form around it. */
static void check_stuck(wkr *w)
{
    uint64_t since = atomic_load(&w->busy_since_ns), ab = xchg_abort_requested_ns();
    uint64_t now = rpc_now_ns(), bound = (uint64_t)w->stuck_exit_ms * 1000000ull;
    /* a job that began after the abort fails at its first collective: it
     * too is stuck when it has not come back within the bound */
    uint64_t from = since > ab ? since : ab;
    if (w->stuck_exit_ms <= 0 || !since || !ab || now - from <= bound)
        return;
    const char *at = atomic_load(&w->busy_at);
    LOG_E("the compute thread has not come back %.1f s after generation %llu was given up (its "
          "job began %.1f s ago; inside: %s): the device or exchange cannot be recovered; "
          "exiting with status 3 for the supervisor to restart this worker",
          (double)(now - ab) * 1e-9, (unsigned long long)xchg_generation(),
          (double)(now - since) * 1e-9, at ? at : "?");
    stuck_stacks();
    _exit(3);
}

/* check_abort: an ncclCommAbort that has run past --abort-exit-ms (a
 * stream waits on a peer that is gone; every later free on the device waits
 * behind it): the device cannot be recovered in this process. Aborts with
 * a dead peer took 0.27-1.03 s on H100 and H200 (366 aborts, 69 kills,
 * 2x H200, 2026-11-28). */
static void check_abort(wkr *w)
{
    const int64_t ms = wkr_gpu_abort_stuck_ms();
    if (w->abort_exit_ms <= 0 || ms <= w->abort_exit_ms)
        return;
    const char *at = atomic_load(&w->busy_at);
    LOG_E("an ncclCommAbort has not returned after %.1f s (the compute thread is %s%s): a stream "
          "waits on a peer that is gone and the device cannot be recovered; exiting with status 3 "
          "for the supervisor to restart this worker",
          (double)ms * 1e-3, atomic_load(&w->busy_since_ns) ? "inside: " : "idle",
          atomic_load(&w->busy_since_ns) && at ? at : "");
    stuck_stacks();
    _exit(3);
}

static void on_stuck_timer(uv_timer_t *t)
{
    check_abort(t->data);
    check_stuck(t->data);
}

static void on_hb_timer(uv_timer_t *t)
{
    wkr *w = t->data;
    if (w->stopping)
        return;
    if (w->worker_id < 0) {
        if (!w->registering)
            send_register(w);
        return;
    }
    mp_writer pw;
    mp_writer_init(&pw);
    pthread_mutex_lock(&reg_mu);
    int64_t epoch = reg_epoch;
    pthread_mutex_unlock(&reg_mu);
    dp_counters dc;
    dp_get_counters(&w->dp, &dc);
    /* the lane's counts go last; the map's size is known once they are in */
    mp_writer lw;
    mp_writer_init(&lw);
    int lane = wkr_lane_write_report(w, &lw);
    mp_write_map(&pw, 4 + lane);
    wkr_write_mem(w, &pw);
    mp_write_cstr(&pw, "worker_id");
    mp_write_i64(&pw, w->worker_id);
    mp_write_cstr(&pw, "epoch");
    mp_write_i64(&pw, epoch);
    mp_write_cstr(&pw, "data"); /* the data plane's counters, for /metrics */
    mp_write_map(&pw, 7);
    mp_write_cstr(&pw, "bulk_conns");
    mp_write_i64(&pw, dc.bulk_conns);
    mp_write_cstr(&pw, "bulk_in_total");
    mp_write_u64(&pw, dc.bulk_in_total);
    mp_write_cstr(&pw, "tickets");
    mp_write_i64(&pw, dc.tickets);
    mp_write_cstr(&pw, "regions");
    mp_write_i64(&pw, dc.regions);
    mp_write_cstr(&pw, "rows_in_total");
    mp_write_u64(&pw, dc.rows_in_total);
    mp_write_cstr(&pw, "bytes_in_total");
    mp_write_u64(&pw, dc.bytes_in_total);
    mp_write_cstr(&pw, "expired_total");
    mp_write_u64(&pw, dc.tickets_expired_total);
    if (lane)
        mp_write_raw(&pw, lw.buf, lw.len);
    mp_writer_fini(&lw);
    moe_call_async(w->coord, "worker.heartbeat", pw.buf, pw.len, on_heartbeat_reply, w);
    mp_writer_fini(&pw);
}

static void on_sdn_timer(uv_timer_t *t)
{
    sdn_tick(&S, W.worker_id >= 0, W.stopping, "registered", rpc_now_ns());
}

static void on_request(rpc_call *c, void *arg)
{
    wkr_dispatch(arg, c);
}

static void on_data_request(rpc_call *c, void *arg)
{
    dp_on_request(arg, c);
}

static void on_signal(uv_signal_t *h, int sig)
{
    wkr *w = h->data;
    LOG_I("signal %d: stopping", sig);
    sdn_tick(&S, 0, 1, NULL, rpc_now_ns());
    w->stopping = 1;
    uv_stop(w->loop);
}

/* print_version: what this binary can do, for people and scripts (a
 * stripped binary has no symbols to grep): the backends compiled in, the
 * CUDA/NCCL versions and kernel images, the GPU found now, the BLAS. */
static int print_version(void)
{
    char cuda[256], dev[160] = "", blas[256];
    wkr_gpu_build_info(cuda, sizeof(cuda));
    int gpu = wkr_gpu_probe(0, dev, sizeof(dev));
    printf("moe-worker %s\n", MOE_VERSION_STRING);
#ifdef MOE_HAVE_CUDA
    printf("backends: cpu cuda\n");
#else
    printf("backends: cpu\n");
#endif
    printf("%s\n", cuda);
    printf("gpu 0: %s\n", gpu ? dev : "none usable here");
    printf("blas: %s\n", blas_pick_describe(blas, sizeof(blas)));
    return 0;
}

/* check_tls: every tls+tcp:// address needs the TLS engine, a listener's a
 * certificate and key, the coordinator's a CA; the data address is never
 * TLS (0: fine) */
static int check_tls(const wkr *w)
{
    const char *listens[2] = {w->listen_url, w->client_url_cfg};
    char why[256];
    int any = moe_tls_url(w->coord_url);
    if (moe_tls_url(w->data_url_cfg)) {
        /* nng 1.5.2 (Debian 12) can hang for ever closing a TLS push socket
         * whose last message the peer has not read yet: a worker would not
         * stop, nor leave a generation */
        fprintf(stderr,
                "moe-worker: the exchange between workers (--data %s) does not run over "
                "TLS: use tcp:// on a private network, or ipc:// on one host\n",
                w->data_url_cfg);
        return -1;
    }
    for (int i = 0; i < 2; i++) {
        if (!moe_tls_url(listens[i]))
            continue;
        any = 1;
        if (!w->tls_cert[0] || !w->tls_key[0]) {
            fprintf(stderr, "moe-worker: %s is a TLS address: give --tls-cert and --tls-key\n",
                    listens[i]);
            return -1;
        }
    }
    if (any && !moe_tls_available(why, sizeof(why))) {
        fprintf(stderr, "moe-worker: TLS addresses given but %s\n", why);
        return -1;
    }
    if (moe_tls_url(w->coord_url) && !w->tls_ca[0]) {
        fprintf(stderr, "moe-worker: dialing the coordinator at %s needs --tls-ca\n", w->coord_url);
        return -1;
    }
    return 0;
}

static const char *pick_backend(wkr *w)
{
    if (strcmp(w->backend_cfg, "cpu") != 0 &&
        wkr_gpu_probe((int)w->device_index, w->device, sizeof(w->device))) {
        w->use_gpu = 1;
        return "cuda";
    }
    snprintf(w->device, sizeof(w->device), "cpu");
    return "cpu";
}

int main(int argc, char **argv)
{
    char err[256], blas[256];
    /* before any BLAS call: the CPU's own kernels when the library fell back
     * to generic ones (re-executes once; blas_pick.h) */
    blas_pick_reexec(argc, argv);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--version") == 0)
            return print_version();
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: moe-worker [--version] [flags]\n");
            cfg_usage(worker_cfg, NCFG, stdout);
            return 0;
        }
    }
    if (cfg_load(worker_cfg, NCFG, argc, argv, "MOE_WORKER_", err, sizeof(err)) != MOE_OK) {
        fprintf(stderr, "moe-worker: %s\n", err);
        return 2;
    }
    int lvl = log_level_parse(W.log_level);
    log_init("worker", lvl < 0 ? LOG_INFO : (log_level)lvl);
    signal(SIGPIPE, SIG_IGN);
    /* before nng's and our threads exist (OpenBLAS's, from its load, stay
     * at 0 with the compute thread) */
    if (W.nice != 0 && prio_set_self((int)W.nice, err, sizeof(err)) != 0) {
        LOG_I("scheduling priority unchanged (%s): busy compute threads on this host may delay "
              "the loop",
              err);
        W.nice = 0;
    }
    if (strcmp(W.backend_cfg, "auto") && strcmp(W.backend_cfg, "cpu") &&
        strcmp(W.backend_cfg, "cuda")) {
        fprintf(stderr, "moe-worker: backend must be auto, cpu or cuda\n");
        return 2;
    }
    if (strcmp(W.ep_cfg, "auto") && strcmp(W.ep_cfg, "off")) {
        fprintf(stderr, "moe-worker: ep must be auto or off\n");
        return 2;
    }
    if (!W.auth_token[0] && !W.insecure) {
        const char *urls[4] = {W.listen_url, W.data_url_cfg, W.client_url_cfg, W.bulk_url_cfg};
        for (int i = 0; i < 4; i++) {
            if (strcmp(urls[i], "off") != 0 && !url_is_loopback(urls[i])) {
                fprintf(stderr,
                        "moe-worker: refusing to listen on %s without --auth-token (set "
                        "--auth-token, or pass --insecure on a trusted network)\n",
                        urls[i]);
                return 2;
            }
        }
    }
    if (W.threads > 0)
        openblas_set_num_threads((int)W.threads);
    wpool_set_limit((size_t)W.pool_mb << 20);
    W.backend = pick_backend(&W);
    if (strcmp(W.backend_cfg, "cuda") == 0 && strcmp(W.backend, "cuda") != 0) {
        fprintf(stderr, "moe-worker: backend cuda requested but unavailable\n");
        return 2;
    }
    W.worker_id = -1;
    W.handles = calloc((size_t)W.max_handles, sizeof(wkr_fwd_state *));
    if (!W.handles)
        return 1;
    W.loop = uv_default_loop();
    pthread_mutex_init(&W.qmu, NULL);
    pthread_cond_init(&W.qcv, NULL);

    const moe_tls_files tls = {W.tls_cert, W.tls_key, W.tls_ca};
    if (check_tls(&W) != 0)
        return 2;
    xchg_shm_sweep(); /* exchange segments of workers killed on this host before */
    if (xchg_nng_listen(W.data_url_cfg, &W.lis, W.data_url, sizeof(W.data_url)) != MOE_OK) {
        LOG_E("cannot listen on data address %s", W.data_url_cfg);
        return 1;
    }
    rpcsrv_opts o = {W.listen_url, 8, (size_t)W.max_msg_mb << 20, on_request, &W, NULL, 0, 0, &tls};
    if (rpcsrv_open(W.loop, &o, &W.srv, W.rpc_url, sizeof(W.rpc_url)) != MOE_OK)
        return 1;
    moe_host_id(W.host_id, sizeof(W.host_id));
    dp_open(&W.dp, W.loop, (size_t)W.data_staged_mb << 20, (size_t)W.shm_max_mb << 20,
            W.auth_token);
    pthread_mutex_init(&W.lane_mu, NULL);
    W.dp.run = wkr_lane_enqueue; /* the lane (lane.c) */
    W.dp.ring_spin_us = (int)W.ring_spin_us;
    W.dp.run_arg = &W;
    W.dp.gpu_register = W.use_gpu;
    W.dp.fail_attach = (int)W.fail_shm_attach;
    W.dp.gpu_device = W.use_gpu ? (int)W.device_index : -1;
    if (strcmp(W.client_url_cfg, "off") != 0) {
        /* many contexts: a client's rows wait here, each holding one, until
         * the coordinator's job for them runs */
        rpcsrv_opts d = {W.client_url_cfg,
                         256,
                         (size_t)W.max_msg_mb << 20,
                         on_data_request,
                         &W.dp,
                         dp_on_pipe_closed,
                         0,
                         0,
                         &tls};
        if (rpcsrv_open(W.loop, &d, &W.dsrv, W.client_url, sizeof(W.client_url)) != MOE_OK)
            return 1;
        /* the bulk path rides on the client endpoint (its control) */
        if (strcmp(W.bulk_url_cfg, "off") != 0) {
            wkr_bulk_opts bo = {W.bulk_url_cfg,
                                &W.dp,
                                (size_t)W.max_msg_mb << 20,
                                (int)W.bulk_timeout_ms,
                                (int)W.data_wait_ms,
                                60000,
                                64,
                                W.auth_token};
            if (wkr_bulk_open(&bo, &W.bulk, W.bulk_url, sizeof(W.bulk_url)) != MOE_OK)
                return 1;
        }
    }
    moe_client_opts co = {
        0,          0,        W.auth_token[0] ? W.auth_token : NULL, "coordinator", W.tls_ca,
        W.tls_cert, W.tls_key};
    co.timeout_ms = (int)(W.heartbeat_ms * 4);
    if (moe_client_open(W.coord_url, &co, &W.coord) != MOE_OK) {
        LOG_E("cannot dial coordinator %s: %s", W.coord_url, moe_last_error());
        return 1;
    }
    fprintf(stderr, "moe-worker pid %d backend %s (%s) rpc %s data %s clients %s bulk %s blas %s\n",
            (int)getpid(), W.backend, W.device, W.rpc_url, W.data_url,
            W.client_url[0] ? W.client_url : "off", W.bulk_url[0] ? W.bulk_url : "off",
            blas_pick_describe(blas, sizeof(blas)));
    cfg_print(worker_cfg, NCFG, stderr);

    pthread_create(&W.compute_thread, NULL, wkr_compute_main, &W);
    uv_async_init(W.loop, &reg_async, on_reg_async);
    reg_async.data = &W;
    uv_timer_init(W.loop, &W.hb_timer);
    W.hb_timer.data = &W;
    uv_timer_start(&W.hb_timer, on_hb_timer, 0, (uint64_t)W.heartbeat_ms);
    uv_timer_init(W.loop, &W.stuck_timer); /* check_stuck, 5 times a second */
    W.stuck_timer.data = &W;
    uv_timer_start(&W.stuck_timer, on_stuck_timer, 200, 200);
    sdn_init(&S);
    uv_timer_init(W.loop, &sdn_timer);
    if (sdn_period_ms(&S))
        uv_timer_start(&sdn_timer, on_sdn_timer, 0, sdn_period_ms(&S));
    uv_signal_init(W.loop, &W.sigterm);
    uv_signal_init(W.loop, &W.sigint);
    W.sigterm.data = W.sigint.data = &W;
    uv_signal_start(&W.sigterm, on_signal, SIGTERM);
    uv_signal_start(&W.sigint, on_signal, SIGINT);

    uv_run(W.loop, UV_RUN_DEFAULT);

    /* drain: stop the compute thread after its current request */
    pthread_mutex_lock(&W.qmu);
    W.qstop = 1;
    while (W.qhead) {
        wkr_queue_item *it = W.qhead;
        W.qhead = it->next;
        if (it->call) /* a lane item's rows are answered by dp_close */
            rpc_reply_err(it->call, MOE_EUNAVAIL, "worker is shutting down");
        free(it);
    }
    W.qtail = NULL;
    pthread_cond_signal(&W.qcv);
    pthread_mutex_unlock(&W.qmu);
    /* a job waiting for a client's rows that will not come now stops waiting */
    dp_stop(&W.dp);
    pthread_join(W.compute_thread, NULL);
    rpcsrv_close(W.srv);
    dp_close(&W.dp); /* answers the rows still waiting, before their server goes */
    wkr_bulk_close(W.bulk);
    if (W.dsrv)
        rpcsrv_close(W.dsrv);
    uv_close((uv_handle_t *)&W.hb_timer, NULL);
    uv_close((uv_handle_t *)&W.stuck_timer, NULL);
    uv_close((uv_handle_t *)&sdn_timer, NULL);
    /* register/heartbeat replies (or their failures when the client closes)
     * still arrive on nng threads: they must not ring a closed handle */
    pthread_mutex_lock(&reg_mu);
    reg_closed = 1;
    pthread_mutex_unlock(&reg_mu);
    uv_close((uv_handle_t *)&reg_async, NULL);
    uv_close((uv_handle_t *)&W.sigterm, NULL);
    uv_close((uv_handle_t *)&W.sigint, NULL);
    uv_run(W.loop, UV_RUN_DEFAULT);
    moe_client_close(W.coord);
    LOG_I("stopped");
    return 0;
}
