/*
 * coord.h - the coordinator (moe-coordinator): RPC front end, worker
 * registry, placement, the cluster job queue, stats and metrics.
 *
 * All state here belongs to the libuv loop thread. nng threads only push
 * completions onto `done` (mutex-protected) and ring `done_async`.
 *
 * Cluster jobs (a broadcast to all W workers: join, model create, forward)
 * run one at a time, in queue order: every worker sees the same sequence of
 * collectives, which the exchange layer requires.
 *
 * Call order. The core files call each other only downward, lowest first:
 *
 *   call order: state < jobs < ckpt < models < forward < train < registry
 *
 * state.c holds lookups and counters over struct coord; jobs.c the job queue
 * (it reaches the files above only through c->hooks and coord_job_ops);
 * ckpt.c checkpoints, model persistence and the restore guard; models.c
 * model.create/info; forward.c the forward and its handles; train.c backward
 * and step; registry.c workers and the cluster's formation. The other server
 * files may call any of these, and no cycle may run through them. tools/calls.py
 * (make lint) reads this line and checks it on the built objects (nm).
 */
#ifndef MOE_COORD_H
#define MOE_COORD_H

#include <pthread.h>
#include <stdint.h>
#include <uv.h>

#include "common/config.h"
#include "rpc/dedupe.h"
#include "rpc/methods.h"
#include "common/model_cfg.h"
#include "rpc/rpcsrv.h"

#define COORD_MAX_WORKERS 256
#define COORD_MAX_MODELS  64
#define COORD_LAT_BUCKETS 16
#define COORD_HIST_POINTS 180 /* the dashboard's history: 15 min at the default 5 s */

typedef enum worker_state { WS_FREE = 0, WS_UP, WS_DOWN } worker_state;

typedef struct coord_worker {
    int id; /* registration id, unique for the coordinator's lifetime */
    worker_state state;
    int rank; /* in the current generation, -1 if not a member */
    char rpc_url[CFG_STR_MAX], data_url[CFG_STR_MAX];
    char client_url[CFG_STR_MAX]; /* data plane: clients send rows here ("" = none) */
    char bulk_url[CFG_STR_MAX];   /* data plane: bulk rows over plain TCP ("" = none) */
    char host[128];               /* host identity (boot id): same host = shared memory */
    char backend[32], device[128];
    int ep_dedup;  /* its KCU_EP_DEDUP (0..2; -1 not reported): all must agree */
    int ep_ce;     /* its KCU_EP_CE (0 or 1; -1 not reported): all must agree */
    uint32_t pipe; /* the connection its registration and heartbeats come on */
    /* its data plane, from its last heartbeat: rows waiting for their job,
     * clients' regions mapped, rows and bytes received, rows expired */
    int64_t dp_tickets, dp_regions;
    uint64_t dp_rows_total, dp_bytes_total, dp_expired_total;
    int64_t dp_bulk_conns;     /* bulk connections open at the worker */
    uint64_t dp_bulk_in_total; /* rows transfers received over bulk connections */
    int pid;
    unsigned long long start_ticks; /* its process's start (procstat): with pid, that process */
    int watched; /* on this host, its process visible: its death seen in /proc (registry.c) */
    uint64_t registered_ns, last_hb_ns;
    moe_client *cli;    /* owned: calls into the worker */
    double busy_s;      /* compute time reported by forwards */
    uint64_t a2a_bytes; /* bytes it sent to the other workers in forwards */
    uint64_t ops_total;
    /* memory it reported with its registration and heartbeats (bytes; -1 =
     * not reported): host memory available, free GPU memory */
    int64_t mem_host, mem_gpu;
} coord_worker;

/* One history point of a model (history.c); NaN: nothing in the interval. */
typedef struct coord_hist_model {
    double tokens_per_s, forwards_per_s;
    double lat_mean_s; /* its forwards answered in the interval */
    double imbalance;  /* the worst layer's max / mean of the interval's routed slots */
} coord_hist_model;

/* Per model: config and load-balance counters. */
typedef struct coord_model {
    model_cfg cfg;
    int64_t *tokens;  /* (layers, E) routed slots, cumulative */
    int64_t *dropped; /* (layers, E) dropped slots, cumulative */
    uint64_t forwards;
    int created_gen; /* generation the workers hold it in; 0 = not yet */
    /* a re-creation after a re-formation that failed (models.c): the
     * re-formations it caused in a row, and why the last one failed (its
     * forwards are refused `unavailable` with this, coord_job_pump) */
    int recreate_failures;
    char recreate_err[200];
    int64_t step;          /* optimizer steps completed */
    int64_t saved_step;    /* step of the last checkpoint written or loaded */
    int64_t pending_grads; /* backwards since the last step */
    /* restoring: the workers do not hold the model's durable state yet, so
     * training calls are refused (coord_train_refused): 1 while its newest
     * checkpoint is being restored (a re-formation, or a step whose outcome
     * is unknown rolled it back), 2 when that restore failed (until a
     * checkpoint.load succeeds) */
    int restoring;
    /* step_unsettled: a step ran on the workers and its checkpoint is being
     * written; until it is durable (or failed) a step's expect_step and
     * gradients are checked when its turn comes, not when it arrives */
    int step_unsettled;
    double last_aux, last_z; /* losses of the last forward */
    uint64_t rows_total;     /* rows of x of its forwards */
    uint64_t ok_forwards;    /* forwards answered successfully, and their latency sum */
    double lat_sum;
    /* history.c: its points since it was created (ring, owned), and its
     * counters at the last point */
    coord_hist_model *hist;
    uint64_t hist_first;  /* the coordinator's point number of its first point */
    int64_t *hist_tokens; /* (layers, E) */
    uint64_t hist_rows, hist_ok;
    double hist_lat_sum;
} coord_model;

/* One history point of the coordinator (history.c); NaN: nothing in the interval. */
typedef struct coord_hist_point {
    double t; /* wall clock, Unix seconds */
    double tokens_per_s, requests_per_s, errors_per_s;
    double lat_mean_s, lat_p50_s, lat_p99_s; /* of the forwards answered in the interval */
} coord_hist_point;

typedef enum job_kind {
    JOB_XCHG_ID, /* rank 0 only: make an NCCL unique id for the next JOIN */
    JOB_JOIN,
    JOB_MODEL_CREATE,
    JOB_FORWARD,
    JOB_BACKWARD,
    JOB_STEP,
    JOB_CKPT_SAVE,
    JOB_CKPT_LOAD,   /* phase 1: every worker reads and validates into staging */
    JOB_CKPT_COMMIT, /* phase 2: swap staging in (or drop it: ckpt_abort) */
    JOB_MODEL_DELETE,
    JOB_GRADS, /* model.grads: every worker's share of a layer's gradients */
} job_kind;

/* A train forward's handle, until its backward (or expiry). */
typedef enum handle_state { H_LIVE = 0, H_USED, H_EXPIRED } handle_state;
typedef struct coord_handle {
    uint64_t id;
    struct coord_model *model;
    int layer;
    int64_t T;
    uint64_t generation, created_ns;
    handle_state state;
} coord_handle;
#define COORD_HANDLE_RING 32768 /* > queue-depth + max-handles (both capped at 16384) */

typedef struct coord coord;
typedef struct coord_job coord_job;

/* coord_job_ops: one kind of cluster job - the worker method it calls,
 * what it sends each rank, and what it does with the W replies. Each kind
 * is defined by the file that owns it (registry.c: xchg_id, join;
 * models.c: model.create; forward.c; train.c: backward, step; ckpt.c);
 * jobs.c runs jobs through these and calls nothing above it. */
typedef struct coord_job_ops {
    job_kind kind;
    const char *method; /* the worker method */
    unsigned flags;     /* JOB_F_* */
    /* encode writes the params map of rank's call */
    void (*encode)(coord *c, coord_job *j, int rank, mp_writer *w);
    /* finish consumes the replies: first is the first rank's error
     * (MOE_OK when all succeeded), bad_rank that rank (-1 if none) */
    void (*finish)(coord *c, coord_job *j, moe_err first, int bad_rank);
    /* stale (optional): the job has nothing left to do when its turn
     * comes; it is dropped unsent */
    int (*stale)(coord *c, coord_job *j);
} coord_job_ops;
#define JOB_F_FORMING 1u /* runs while the cluster forms (before ready) */
#define JOB_F_RANK0   2u /* sent to rank 0 only */
#define JOB_F_EARLY                                                                                \
    4u /* a member gone (no response at all): finish with the error at once,                       \
        * not when the survivors answer (they stay the current job) */

extern const coord_job_ops coord_job_xchg_id, coord_job_join, coord_job_model_create,
    coord_job_forward, coord_job_backward, coord_job_step, coord_job_ckpt_save, coord_job_ckpt_load,
    coord_job_ckpt_commit, coord_job_model_delete;

struct coord_job {
    struct coord_job *next;
    const coord_job_ops *ops;
    job_kind kind;  /* ops->kind */
    rpc_call *call; /* the client request being served; NULL for internal jobs */
    coord_model *model;
    int layer;
    moe_tensor x;            /* forward input / backward dy: a view into call's message;
                              * on the direct path only dtype and shape (data NULL) */
    int direct;              /* the rows travel client <-> workers (data plane) */
    uint64_t tk_cid, tk_seq; /* direct: the rows' ticket */
    uint64_t dgen;           /* direct: the generation the client's map is of */
    int train;
    coord_handle *handle;         /* train forward / backward */
    struct coord_job *batch_next; /* inference forwards merged into this job */
    int64_t xrows;                /* this request's own rows of x */
    uint8_t *xbuf;                /* owned: the concatenated x of a merged batch */
    char path[1024];              /* checkpoint directory (JOB_CKPT_*) */
    int commit;                   /* JOB_CKPT_COMMIT: 1 swap in, 0 abort */
    double hp[6];                 /* JOB_STEP: lr, beta1, beta2, eps, weight_decay, max_grad_norm */
    char **files;                 /* JOB_CKPT_LOAD: shard file names (owned) */
    int nfiles;
    int64_t ckpt_step;      /* JOB_CKPT_*: the checkpoint's step */
    char root[CFG_STR_MAX]; /* JOB_CKPT_SAVE: the directory that holds LATEST */
    uint8_t *deferred;      /* JOB_CKPT_SAVE: an optimizer.step reply sent only once this
                             * checkpoint is durable (owned) */
    size_t deferred_len;
    int64_t expect_step; /* JOB_STEP: the client's expect_step (-1: none) */
    uint64_t admit_gen;  /* JOB_CKPT_SAVE with deferred: the generation of its step */
    uint64_t enqueued_ns, deadline_ns, started_ns;
    uint64_t first_reply_ns, last_reply_ns; /* on the loop: the first and last member's reply */
    uint64_t generation;                    /* cluster generation the job was sent in */
    int nsent, pending;
    int answered;   /* finish ran early (a member is gone, JOB_F_EARLY): not again */
    int gone_plus1; /* 1 + the rank whose loss answered it early (0: none): its error
                     * answer names it ("gone"), so a client stops waiting for that rank */
    moe_reply *replies[COORD_MAX_WORKERS]; /* by rank; owned */
    moe_err errs[COORD_MAX_WORKERS];
    /* JOB_CKPT_SAVE: its durable writes run off the loop (ckpt.c); the
     * job stays current until they are done (coord_job_io_done), so no
     * job or generation starts under it while the loop keeps serving */
    int io_pending;
};

/* a completed worker call, from an nng thread */
typedef struct coord_done {
    struct coord_done *next;
    coord_job *job;
    int rank;
    moe_err err;
    moe_reply *reply;
} coord_done;

/* coord_hooks: the calls jobs.c makes to files above it, by pointer (it
 * names none of them). Set once by main.c before the loop runs; a NULL hook
 * is skipped. */
typedef struct coord_hooks {
    /* worker_lost: worker slot i gave no answer at all to a job's call
     * (registry.c: coord_worker_lost) */
    void (*worker_lost)(coord *c, int i, const char *why);
    /* after_done: a batch of worker replies was handled, before the queue
     * is pumped (registry.c: coord_maybe_form) */
    void (*after_done)(coord *c);
} coord_hooks;

struct coord {
    /* config (read-only after start) */
    char listen_url[CFG_STR_MAX], metrics_url[CFG_STR_MAX], auth_token[CFG_STR_MAX];
    char log_level[CFG_STR_MAX], addr_file[CFG_STR_MAX];
    long long expected_workers, max_msg_mb, queue_depth, deadline_ms, heartbeat_timeout_ms;
    long long worker_timeout_ms, nctx, batch_max_tokens;
    long long lane; /* 1: dataplane.info opens the lane when the generation has one worker */
    char ckpt_dir[CFG_STR_MAX];  /* automatic checkpoints (empty = off) */
    char ckpt_root[CFG_STR_MAX]; /* explicit checkpoint paths must lie under it
                                  * (empty: under ckpt_dir; neither: refused) */
    long long max_workers;       /* registry capacity (<= COORD_MAX_WORKERS) */
    long long min_workers;       /* > 0: after shrink_after_ms short of expected_workers,
                                  * form with the workers up when at least this many */
    long long shrink_after_ms;
    long long history_ms;       /* the dashboard history's interval */
    char xchg_cfg[CFG_STR_MAX]; /* auto | nng | nccl | shm */
    long long ckpt_every;       /* save every N optimizer steps (0 = only at drain) */
    long long slow_durable_ms;  /* tests: a checkpoint's durable writes take this much longer */
    long long nice;             /* --nice: the priority of every coordinator thread */
    char host_id[128];          /* this host (common/hostid.h): workers with it are watched */
    uv_timer_t watch_timer;     /* every 5 ms: the watched workers' processes (registry.c) */
    /* the cluster secret: internal methods (worker.*) require it, and the
     * calls to workers carry it (secret.h; never empty after start) */
    char cluster_secret[CFG_STR_MAX], cluster_secret_file[CFG_STR_MAX];
    long long insecure; /* non-loopback listeners without --auth-token allowed */
    /* byte and connection bounds (OPERATIONS.md) */
    long long max_inflight_mb, max_conns, idle_timeout_ms;
    /* TLS (tls.h): the listener's certificate and key, the CA of workers'
     * certificates (PEM paths; empty = none) */
    char tls_cert[CFG_STR_MAX], tls_key[CFG_STR_MAX], tls_ca[CFG_STR_MAX];

    coord_hooks hooks; /* set once at start (main.c) */
    uv_loop_t *loop;
    rpcsrv *srv;
    char bound_url[CFG_STR_MAX];
    uv_timer_t tick;
    uv_signal_t sigterm, sigint;
    uv_async_t done_async;
    pthread_mutex_t done_mu;
    coord_done *done_head, *done_tail;
    int done_closed; /* done_async is closed (shutdown): nng threads must not ring it */
    /* connections that closed (nng threads -> loop, under done_mu): a
     * worker's means the process is gone (coord_on_pipes) */
    uint32_t closed_pipes[64];
    int nclosed_pipes, closed_overflow;
    uv_async_t pipes_async;
    int draining;
    int drain_saved; /* the drain's checkpoints were queued */
    uint64_t drain_started_ns;
    long long drain_timeout_ms;

    /* registry */
    coord_worker workers[COORD_MAX_WORKERS];
    int next_worker_id;
    uint64_t epoch; /* this coordinator's start time: heartbeats of another are unknown */
    int rank_to_worker[COORD_MAX_WORKERS];
    int world;            /* members of the current generation */
    uint64_t generation;  /* 0 = never formed */
    int ready;            /* the current generation is joined and whole */
    int use_nccl;         /* every member has a GPU: exchange over NCCL */
    int use_shm;          /* every member on one host: exchange through shared memory */
    int shm_failed;       /* a join through shared memory failed: nng from then on */
    uint8_t nccl_id[128]; /* relayed from rank 0 to every member in the JOIN */
    int nccl_id_ok;
    int need_form;           /* a (re)formation is wanted */
    uint64_t short_since_ns; /* a member was lost at this time and the cluster has not been
                              * whole since (0 = whole); --shrink-after-ms counts from it */
    int shrink_blocked;      /* a generation of survivors could not hold a model: no more
                              * shrinking until the cluster is whole again */

    /* training */
    long long max_handles, handle_ttl_ms;
    uint64_t next_handle;
    coord_handle handles[COORD_HANDLE_RING]; /* ring by id */

    /* models */
    coord_model *models[COORD_MAX_MODELS];
    int nmodels;

    /* jobs */
    coord_job *qhead, *qtail;
    int qlen;
    coord_job *current;

    /* stats */
    uint64_t started_ns;
    uint64_t requests_total, errors_total, forwards_total, tokens_total, busy_total;
    uint64_t errors_by_code[MOE_ERR_COUNT]; /* their sum is errors_total */
    uint64_t busy_bytes_total;              /* requests answered busy: over --max-inflight-mb */
    double phase_s[4]; /* gate, dispatch, experts, combine: sums of slowest worker */
    uint64_t lat_hist[COORD_LAT_BUCKETS + 1];      /* forward latency histogram */
    uint64_t phase_hist[4][COORD_LAT_BUCKETS + 1]; /* per-phase latency histograms */
    double lat_sum;
    double recent_tokens, recent_t0; /* tokens/s over a sliding window */
    double tokens_per_s;

    /* history.c: the dashboard's history (ring of COORD_HIST_POINTS), and
     * the counters at the last point */
    coord_hist_point hist[COORD_HIST_POINTS];
    uint64_t hist_n; /* points taken */
    uint64_t hist_last_ns;
    uint64_t hist_requests, hist_errors, hist_tokens, hist_lat[COORD_LAT_BUCKETS + 1];
    double hist_lat_sum;

    /* metrics text and history JSON rendered by the loop, copied out by the
     * HTTP thread (both owned, under metrics_mu) */
    pthread_mutex_t metrics_mu;
    char *metrics_text;
    char *history_json;
    struct httpd *http; /* owned: serves /metrics (httpd.h) */
};

extern const double coord_lat_bounds[COORD_LAT_BUCKETS];

/* state.c (the bottom of the call order) */
int coord_up_workers(const coord *c);
coord_model *coord_find_model(coord *c, const char *name);
/* coord_model_add registers a model (config validated by the caller): c
 * owns it from here. */
coord_model *coord_model_add(coord *c, const model_cfg *cfg, char *err, size_t errlen);
/* coord_model_free frees m and what it owns */
void coord_model_free(coord_model *m);
/* coord_count_error counts an error answer with code e (every place that
 * answers an error the coordinator counts: docs/OPERATIONS.md) */
void coord_count_error(coord *c, moe_err e);

/* methods.c: the method table and the dispatch (auth, exactly-once by rid
 * through d, refusals while draining) */
typedef struct coord_method {
    rpc_method m;
    void (*fn)(coord *c, rpc_call *call);
} coord_method;
extern const coord_method coord_methods[];
extern const int coord_nmethods;
void coord_dispatch(coord *c, dedupe *d, rpc_call *call);
/* coord_start_drain: stop taking jobs (the methods flagged
 * RPC_REFUSED_DRAINING), finish the queue, then stop the loop. */
void coord_start_drain(coord *c, const char *why);

/* registry.c */
void coord_worker_register(coord *c, rpc_call *call);
void coord_worker_heartbeat(coord *c, rpc_call *call);
void coord_check_workers(coord *c);
/* coord_watch_tick: the timer callback that loses a watched worker (one on
 * this host) as soon as /proc shows its process exiting (registry.c) */
void coord_watch_tick(uv_timer_t *t);
/* coord_worker_lost marks worker slot i down now (a call to it got no answer). */
void coord_worker_lost(coord *c, int i, const char *why);
void coord_maybe_form(coord *c);
void coord_cluster_status(coord *c, rpc_call *call);
/* coord_pipe_closed: rpcsrv's connection-close hook (nng thread);
 * coord_on_pipes handles them on the loop: a member whose connection
 * closed is lost at once (not after the heartbeat timeout). */
void coord_pipe_closed(uint32_t pipe, void *arg);
void coord_on_pipes(uv_async_t *h);
/* coord_dataplane_info answers where clients send rows (docs/PROTOCOL.md). */
/* coord_lane_open: clients may send inference forwards straight to the one
 * worker of the generation (the lane). */
int coord_lane_open(const coord *c);
/* coord_fanout_open: clients may send small inference forwards to every
 * worker of the generation at once (fan-out: several workers of one backend). */
int coord_fanout_open(const coord *c);
void coord_dataplane_info(coord *c, rpc_call *call);

/* jobs.c */
moe_err coord_job_submit(coord *c, coord_job *j, int front);
/* coord_job_new allocates a job of a kind for a client call (call NULL: an
 * internal job); on failure it answers the call (out of memory) and
 * returns NULL. */
coord_job *coord_job_new(const coord_job_ops *ops, rpc_call *call, coord_model *m);
/* coord_job_refuse_unready answers now, unavailable, the queued client jobs
 * that the pump would refuse at their turn because the cluster is not
 * ready (a member was lost while another job is still current); jobs with a
 * stale rule and internal ones keep their place. */
void coord_job_refuse_unready(coord *c);
/* coord_job_enqueue queues j at the back; when the queue is full it answers
 * busy, frees j and returns MOE_EBUSY. The caller pumps. */
moe_err coord_job_enqueue(coord *c, coord_job *j);
void coord_job_pump(coord *c);
/* coord_job_io_done: the off-loop part of current job j's finish is done
 * (j->io_pending was set by its finish): j stops being current and is freed,
 * and the queue moves on */
void coord_job_io_done(coord *c, coord_job *j);
/* coord_job_gone: the rank of j's members known dead, -1 if none: the one
 * whose loss answered j early, else rank r when its call got no response
 * (its connection dropped) */
int coord_job_gone(const coord_job *j, int r);
void coord_on_done(uv_async_t *h);
void coord_job_fail_all(coord *c, moe_err e, const char *why);
/* coord_job_discard frees a job that is in no queue (its call, if any, must
 * have been answered). */
void coord_job_discard(coord_job *j);

/* models.c */
void coord_model_create(coord *c, rpc_call *call);
void coord_model_info(coord *c, rpc_call *call);
void coord_forward(coord *c, rpc_call *call);
/* forward.c: a train forward's handle (in c's ring), and rank's shard of x */
coord_handle *coord_handle_new(coord *c, coord_model *m, int layer, int64_t T);
void coord_write_sharded(mp_writer *w, const moe_tensor *x, int W, int rank);
/* coord_fold_lane counts the lane's forwards that worker wk reports with
 * its heartbeat (the "lane" array, docs/PROTOCOL.md); MOE_EINVAL with err
 * when a report is malformed (the ones before it are counted). */
moe_err coord_fold_lane(coord *c, coord_worker *wk, mp_reader *r, char *err, size_t errlen);

/* train.c */
void coord_backward(coord *c, rpc_call *call);
void coord_step(coord *c, rpc_call *call);
/* coord_parse_direct reads a request's "direct" map {ticket, generation,
 * dtype, T?} into j (direct, tk_*, dgen, x.dtype); *T = -1 when absent.
 * MOE_EUNAVAIL when the client's map is not of the current generation. */
moe_err coord_parse_direct(coord *c, mp_reader *r, coord_job *j, int64_t *T, char *err,
                           size_t errlen);
/* coord_write_pieces writes "pieces" of a data-plane job for rank: per
 * request of the (merged) batch [client_id, seq, that request's rows for
 * the rank]. */
void coord_write_pieces(mp_writer *w, const coord_job *j, int W, int rank);
/* coord_reply_has_missing: a worker's direct reply names pieces whose rows
 * did not arrive (or cannot be read). */
int coord_reply_has_missing(const moe_reply *rep);
moe_err coord_gather_rows(coord *c, coord_job *j, const char *key, mp_writer *w, char *err,
                          size_t errlen);

/* hf.c: model.create from a Hugging Face directory (from_hf) */
/* coord_hf_wants: the request names from_hf (or hf_dir / hf_family, which
 * only the coordinator sets): coord_hf_create answers it. */
int coord_hf_wants(const rpc_call *call);
void coord_hf_create(coord *c, rpc_call *call);
/* coord_hf_info writes model.info's "hf" value of a model from a directory. */
void coord_hf_info(mp_writer *w, const coord_model *m);
extern const coord_job_ops coord_job_hf_create;
/* grads.c: model.grads {model, layer, expert?} */
void coord_grads(coord *c, rpc_call *call);
extern const coord_job_ops coord_job_grads;

/* ckpt.c */
/* coord_train_refused answers call `unavailable` ("restoring") and returns 1
 * when training calls on m must wait: the cluster is not ready, m is not
 * created in this generation, or its restore is pending or failed. */
int coord_train_refused(coord *c, const coord_model *m, rpc_call *call);
/* coord_step_rollback: the outcome of a step of m on the workers is unknown
 * (a worker failed during it, or its checkpoint did not become durable).
 * With automatic checkpoints m returns to its newest checkpoint: training
 * calls are refused until the cluster re-forms and restores it. */
void coord_step_rollback(coord *c, coord_model *m);
void coord_ckpt_save(coord *c, rpc_call *call);
void coord_ckpt_load(coord *c, rpc_call *call);
/* coord_ckpt_roots lists the directories checkpoints may be written in and
 * read from (--checkpoint-root, --checkpoint-dir), for the workers; returns
 * how many (0..2). The strings belong to c. */
int coord_ckpt_roots(const coord *c, const char *roots[2]);
/* coord_ckpt_init creates --checkpoint-root when it is missing (at start). */
void coord_ckpt_init(coord *c);
/* coord_autosave queues a save of m under <checkpoint-dir>/<name> when
 * automatic checkpoints are on and m changed since its last checkpoint. */
void coord_autosave(coord *c, coord_model *m, int front);
/* coord_autosave_reply queues the automatic checkpoint of m at the front of
 * the queue and sends reply (an encoded optimizer.step response, owned by
 * the job from here) to call only once the checkpoint is durable; if the
 * save fails the call gets `unavailable`. Returns MOE_OK when queued; else
 * nothing was taken and the caller answers. */
moe_err coord_autosave_reply(coord *c, coord_model *m, rpc_call *call, uint8_t *reply, size_t len);
/* coord_autorestore queues a load of m's newest automatic checkpoint, if
 * any (at the queue's front); returns 1 when queued, 0 when there is none
 * (or automatic checkpoints are off), -1 when one exists but cannot be
 * loaded (logged). */
int coord_autorestore(coord *c, coord_model *m);
/* coord_model_persist writes m's config to <checkpoint-dir>/<name>/model.json
 * (durably) when automatic checkpoints are on; coord_models_restore reads
 * every such file at start, so a restarted coordinator knows its models
 * again (their weights come back from the newest checkpoint when the
 * cluster forms). */
void coord_model_persist(coord *c, const coord_model *m);
/* coord_model_unpersist removes m's model.json and renames its directory
 * <checkpoint-dir>/<name>~deleted-<ns> (kept, never restored) */
void coord_model_unpersist(coord *c, const coord_model *m);
void coord_models_restore(coord *c);

/* model_delete.c */
/* coord_parse_mem reads a worker's "mem" map {host_available, gpu_free}. */
moe_err coord_parse_mem(mp_reader *r, int64_t *host, int64_t *gpu, char *err, size_t errlen);
/* coord_model_bytes: the memory the rank's share of a model takes on a
 * worker of a world of `world` (weights, f32). */
double coord_model_bytes(const model_cfg *cfg, int world, int rank);
/* coord_model_mem_check: MOE_ENOMEM (with the need and the worst worker's
 * memory in err) when a worker reported less memory available than its
 * share of cfg needs. */
moe_err coord_model_mem_check(coord *c, const model_cfg *cfg, char *err, size_t errlen);
/* coord_model_jobs: how many queued or running jobs are for m. */
int coord_model_jobs(const coord *c, const coord_model *m);
/* coord_model_create_rollback: the client's first model.create of j->model
 * failed on a worker: the model goes from the coordinator (j->model is
 * freed and cleared) and a worker.model_delete job is queued first. */
void coord_model_create_rollback(coord *c, coord_job *j);
void coord_model_delete(coord *c, rpc_call *call);

/* stats.c */
void coord_stats(coord *c, rpc_call *call);
void coord_metrics_render(coord *c);
moe_err coord_metrics_start(coord *c);
void coord_metrics_stop(coord *c);
/* dashboard.c: GET /dashboard, the operator page (an httpd.h handler) */
struct httpd_resp;
void coord_http_dashboard(void *arg, struct httpd_resp *out);
/* history.c: every history_ms, a point of throughput, latency and
 * imbalance (the coordinator's and each model's) into the ring, and the
 * JSON that GET /dashboard/history serves re-rendered (loop thread;
 * coord_history_tick on every tick). coord_http_history is its handler. */
void coord_history_tick(coord *c);
void coord_history_render(coord *c);
void coord_http_history(void *arg, struct httpd_resp *out);
/* coord_hist_quantile: the q-quantile of a histogram over coord_lat_bounds
 * (counts per bucket, not cumulative; linear within a bucket, as
 * Prometheus' histogram_quantile); NaN when it is empty. */
double coord_hist_quantile(const uint64_t *counts, double q);

#endif
