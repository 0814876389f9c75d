/*
 * cluster.h - test harness: a real cluster (bin/moe-coordinator and N
 * bin/moe-worker processes) on 127.0.0.1 for one Criterion test.
 *
 * Isolation: the coordinator listens on port 0 and writes its address to an
 * --addr-file in a fresh mkdtemp directory; workers use port 0 too, so tests
 * that run in parallel never collide. The daemons' stdout/stderr go to log
 * files in that directory (coord.log, worker-<i>.log).
 *
 * No process is left behind:
 *   - cluster_stop: SIGTERM to every daemon, waitpid with a bound, SIGKILL
 *     stragglers, remove the directory. Logs are printed when a daemon had to
 *     be killed or the coordinator did not exit 0.
 *   - cluster_fini_all (use it as the test's .fini): a failed cr_assert jumps
 *     to .fini; every cluster the test did not stop itself is stopped there
 *     and its logs are printed (the test failed, the logs explain why).
 *   - a watchdog (SIGALRM, armed 2 s before the test's .timeout) prints the
 *     logs and kills the daemons before Criterion kills the test.
 *   - each daemon has PR_SET_PDEATHSIG = SIGKILL: if the test process dies
 *     (crash, Criterion's timeout), the kernel kills its daemons.
 *
 * Binaries come from $MOE_BIN_DIR, else <dir of the test binary>/../bin,
 * else ./bin. MOE_COORD_* / MOE_WORKER_* variables of the caller's
 * environment are not passed to the daemons.
 */
#ifndef MOE_TEST_CLUSTER_H
#define MOE_TEST_CLUSTER_H

#include <stdint.h>
#include <sys/types.h>

#include "base/moe.h"
#include "proto/proto.h"

#define CLUSTER_MAX_WORKERS 8
#define CLUSTER_MAX_ARGS    16

typedef struct cluster_opts {
    int workers;            /* worker processes to start (0 = none) */
    int expected_workers;   /* the coordinator's --workers; 0 = max(workers, 1) */
    const char *auth_token; /* --auth-token for every daemon and the client; NULL = none */
    int metrics;            /* serve /metrics on a free port (cluster.metrics_port) */
    int no_wait;            /* do not wait for cluster.status ready */
    int ready_timeout_ms;   /* bound on the wait for ready; 0 = 15000 */
    int client_timeout_ms;  /* the client's per-call timeout; 0 = 30000 */
    const char *data_path;  /* the client's data path (moe_client_opts); NULL = default */
    const char *coord_args[CLUSTER_MAX_ARGS];  /* extra coordinator flags, NULL-terminated */
    const char *worker_args[CLUSTER_MAX_ARGS]; /* extra worker flags, NULL-terminated */
    int no_client;               /* open no client and do not wait for ready: for a forked child
                                  * process, where nng cannot be used ("not fork-reentrant safe") */
    const char *checkpoint_root; /* the coordinator's --checkpoint-root: NULL = /tmp (where
                                  * tests make their checkpoint directories), "" = none */
    const char *tls_ca;          /* the client's CA file (moe_client_opts.tls_ca); NULL = none */
} cluster_opts;

typedef struct cluster {
    /* read-only for tests */
    char dir[256];                         /* temp dir: addr file and logs */
    char url[256];                         /* coordinator RPC address */
    int metrics_port;                      /* 0 = metrics off */
    pid_t coord_pid;                       /* 0 once reaped */
    pid_t worker_pid[CLUSTER_MAX_WORKERS]; /* 0 = not running */
    int nworkers;
    moe_client *cli;  /* connected client (with the auth token, if any) */
    int coord_status; /* coordinator wait status after cluster_stop; -1 unknown */
    char err[512];    /* why the last harness call failed */
    char secret[256]; /* the cluster secret (the coordinator writes it to <dir>/secret, which
                       * every daemon is given as --cluster-secret-file) */
    /* private */
    cluster_opts opts;
    int live;
    char paths_addr[320], paths_coord_log[320], paths_secret[320],
        paths_worker_log[CLUSTER_MAX_WORKERS][320];
} cluster;

/* cluster_start starts the coordinator and opts->workers workers, opens
 * cl->cli and (unless opts->no_wait) waits until cluster.status says ready.
 * Returns the cluster, in harness-owned storage (it must survive a failed
 * cr_assert, which unwinds the test's stack before .fini runs), valid until
 * cluster_stop. Returns NULL with the reason in cluster_error(); the daemons
 * started so far keep running until cluster_fini_all stops them. */
cluster *cluster_start(const cluster_opts *opts);
/* cluster_error: why the last harness call failed (also in cl->err). */
const char *cluster_error(void);
/* cluster_wait_ready polls cluster.status until ready (0) or timeout (-1). */
int cluster_wait_ready(cluster *cl, int timeout_ms);
/* cluster_worker_start (re)starts worker i (0 <= i < CLUSTER_MAX_WORKERS). */
int cluster_worker_start(cluster *cl, int i);
/* cluster_worker_kill sends sig to worker i and reaps it. */
int cluster_worker_kill(cluster *cl, int i, int sig);
/* cluster_coord_signal sends sig to the coordinator (never to pid <= 0). */
int cluster_coord_signal(cluster *cl, int sig);
/* cluster_coord_wait waits up to timeout_ms for the coordinator to exit (after
 * a signal or a drain) and reaps it. Returns its wait status, or -1 if it is
 * still running (or was not). */
int cluster_coord_wait(cluster *cl, int timeout_ms);
/* cluster_worker_wait waits up to timeout_ms for worker i to exit on its
 * own and reaps it: its wait status, or -1 if it still runs (or was not). */
int cluster_worker_wait(cluster *cl, int i, int timeout_ms);
/* cluster_stop stops every daemon (SIGTERM, bounded wait, SIGKILL) and
 * removes the directory. Returns the number of daemons that needed SIGKILL
 * or did not exit 0 (0 = clean). Idempotent. */
int cluster_stop(cluster *cl);
/* cluster_fini_all: for .fini. Stops every cluster still live and prints its
 * logs first (a live cluster at .fini means the test did not finish). */
void cluster_fini_all(void);
/* cluster_log_has: 1 when the file at path (a daemon's log) has a line
 * containing needle, else 0 (also when it cannot be read). */
int cluster_log_has(const char *path, const char *needle);
/* cluster_dump_logs prints the last part of every daemon log to stderr. */
void cluster_dump_logs(const cluster *cl, const char *why);

/* cluster.status, parsed. */
typedef struct cluster_state {
    int ready, draining, expected, up, down, listed;
    int waiting_for_all; /* survivors could not hold a model */
    int world;           /* members of the current generation */
    uint64_t generation;
} cluster_state;
moe_err cluster_get_state(cluster *cl, cluster_state *st);

/* ---- small msgpack helpers for tests ---- */
/* cluster_bin_dir: where bin/moe-worker, bin/moectl ... are. */
const char *cluster_bin_dir(void);
/* mp_map_find: r is at a map; on success r is at the value of key. */
int mp_map_find(mp_reader *r, const char *key);
/* mp_reply_reader: a reader at the result of a successful reply. */
mp_reader mp_reply_reader(const moe_reply *rep);
/* cluster_http_get fetches path from 127.0.0.1:port: the status code, the
 * headers in head (may be NULL) and the body in body, NUL terminated and
 * truncated to their caps; -1 on failure. */
int cluster_http_get(int port, const char *path, char *head, size_t hcap, char *body, size_t bcap);
/* cluster_worker_key copies a string field of rank's entry in
 * dataplane.info ("url", "bulk_url", "host", "backend") into out: 0, or -1
 * (cluster_error says why). */
int cluster_worker_key(cluster *cl, int rank, const char *key, char *out, size_t len);
/* cluster_coord_stat: *out = the integer `key` of the coordinator's
 * `stats`; 0, or -1 (cluster_error says why). */
int cluster_coord_stat(cluster *cl, const char *key, int64_t *out);
/* cluster_metric_value: the value of the sample `name` (a whole series
 * name, labels included) in a /metrics text, or -1 when absent. */
double cluster_metric_value(const char *text, const char *name);
/* cluster_now_ms: CLOCK_MONOTONIC in ms. */
int64_t cluster_now_ms(void);

#endif
