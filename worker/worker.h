/*
 * worker.h - one expert worker: owns its slice of every layer's experts and a
 * replica of every layer's router, runs the kernels, and exchanges token rows
 * with the other workers through xchg.
 *
 * Threads: the libuv loop thread owns the transport (rpcsrv), registration
 * and heartbeats. The compute thread owns everything below "compute state":
 * models, weights and the exchange communicator; it runs the coordinator's
 * requests one at a time, in arrival order, and replies itself.
 */
#ifndef MOE_WORKER_H
#define MOE_WORKER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "common/config.h"
#include "worker/dataplane.h"
#include "rpc/methods.h"
#include "common/model_cfg.h"
#include "common/params.h"
#include "rpc/rpcsrv.h"
#include "worker/xchg.h"

#define WKR_MAX_MODELS 64

/* One layer's parameters on this worker (host memory, float; bf16 models keep
 * bf16-rounded values). Experts [e0, e0 + ne) of the layer live here. */
typedef struct wkr_layer {
    float *wr; /* (E,H) router replica */
    float *w1; /* (ne,F,H) */
    float *w3; /* (ne,F,H), NULL for GELU */
    float *w2; /* (ne,H,F) */
    /* routing families (model_cfg): replicated on every rank */
    float *bias; /* (E) choice bias, score_bias only; no gradient */
    float *ws1;  /* (Fs,H) shared expert, shared_d_ff > 0 only */
    float *ws3;  /* (Fs,H), NULL for GELU */
    float *ws2;  /* (H,Fs) */
    float *wsg;  /* (H) shared expert gate, shared_gate only */
} wkr_layer;

/* One trainable tensor of a model on this worker. Training state (grad, m,
 * v, and for bf16 models the fp32 master copy) is allocated on the first
 * train forward. `w` is what the kernels read: for bf16 models it holds the
 * master rounded to bf16. */
typedef struct wkr_param {
    char name[112]; /* checkpoint name (Hugging Face Mixtral naming), e.g.
                     * model.layers.0.block_sparse_moe.experts.3.w1.weight */
    float *w;       /* the tensor in wkr_layer (not owned here) */
    size_t n;
    int rows, cols;
    int replicated;               /* router: the same on every rank, gradient all-reduced */
    int frozen;                   /* no gradient, never stepped (the choice bias) */
    float *grad, *m, *v, *master; /* owned; NULL until training starts */
} wkr_param;

typedef struct wkr_model {
    model_cfg cfg;
    int e0, ne;        /* owned experts */
    wkr_layer *layers; /* (cfg.layers) */
    wkr_param *params; /* (nparams): per layer router, then w1, w3, w2 per local expert */
    int nparams;
    int64_t step;    /* optimizer steps applied */
    int has_grads;   /* a backward ran since the last step */
    int settled;     /* its state is the cluster's: it has run a forward the coordinator
                      * ordered, or committed (or aborted) a checkpoint load, since it was
                      * built. Until then the lane and the fan-out, which run outside the
                      * coordinator's job order, refuse it (after a re-formation the
                      * model is rebuilt from its seed, and its checkpoint may still be on
                      * its way: they would answer with weights that are not its own) */
    int train_ready; /* grad/m/v allocated */
    /* a checkpoint read and validated, waiting for commit (phase 2 of load):
     * per param 3 arrays (weights, m, v), (nparams * 3) */
    float **staged;
    int64_t staged_step;
    /* GPU backend (gpu.h): its ops (layer, ep or experts; NULL: the CPU
     * backend) and per layer its device object (a kcu_layer, kcu_ep or
     * kcu_experts); gpu_train: the device objects keep training state */
    const struct wkr_gpu_ops *gpu_ops;
    void **gpu;
    int gpu_train;
    uint64_t *gpu_handle; /* (layers) the train forward whose state the device holds */
} wkr_model;

/* What one train forward keeps for its backward (this worker's part). */
typedef struct wkr_fwd_state {
    uint64_t handle;
    uint64_t created_ns;
    wkr_model *model;
    int layer, T, T_total;
    /* origin side: this worker's T tokens */
    float *x;               /* (T,H) */
    float *logits;          /* (T,E) */
    float *probs;           /* (T,E) */
    float *topk_w;          /* (T,K) */
    int32_t *topk_idx;      /* (T,K) */
    int32_t *counts;        /* (E) local slots per expert */
    int32_t *offsets;       /* (E+1) */
    int32_t *perm;          /* (S) sorted position -> slot */
    int32_t *counts_global; /* (E) over the whole batch */
    float *ye_slot;         /* (S,H) unweighted expert output per slot */
    /* owner side: rows received for this worker's experts */
    int32_t *src_cnt; /* (W,ne) rows per source rank and local expert */
    int32_t *kept;    /* (ne) rows kept under the capacity */
    size_t n_in;      /* rows received */
    float *xe;        /* (n_in,H) expert-major, sources in rank order */
    float *ae, *be;   /* (n_in,F) pre-activations, kept rows only valid */
} wkr_fwd_state;

typedef struct wkr wkr;

/* what the lane ran for one model and layer since the last heartbeat */
#define WKR_LANE_REPORTS 16
#define WKR_LANE_LAT     4096 /* latencies kept per report; more are counted only */
typedef struct wkr_lane_report {
    char model[64];
    int layer, E;
    uint64_t forwards, tokens;
    int64_t *counts, *dropped; /* (E) owned */
    double phase_s[4];
    float lat_s[WKR_LANE_LAT];
    float phase_v[WKR_LANE_LAT][4]; /* each forward's phases, beside its latency */
    int nlat;
} wkr_lane_report;

/* wkr_method: a row of the worker's method table (worker/methods.c) */
typedef struct wkr_method {
    rpc_method m;
    void (*fn)(wkr *w, rpc_call *c);
} wkr_method;
extern const wkr_method wkr_methods[];
extern const int wkr_nmethods;

typedef struct wkr_queue_item {
    rpc_call *call;
    const wkr_method *method; /* its row (RPC_COMPUTE) */
    int is_run;               /* a lane forward (lane.c) in place of a call */
    dp_run run;
    struct wkr_queue_item *next;
} wkr_queue_item;

struct wkr {
    /* config (read-only after start) */
    char coord_url[CFG_STR_MAX];
    char listen_url[CFG_STR_MAX];
    char data_url_cfg[CFG_STR_MAX];
    char client_url_cfg[CFG_STR_MAX]; /* data plane: where clients send rows */
    char backend_cfg[CFG_STR_MAX];
    char log_level[CFG_STR_MAX];
    long long nice; /* --nice: the loop's and I/O threads' priority; compute runs at 0 */
    char auth_token[CFG_STR_MAX];
    /* TLS (tls.h): the listeners' certificate and key, the CA of the peers'
     * certificates (PEM paths; empty = none) */
    char tls_cert[CFG_STR_MAX], tls_key[CFG_STR_MAX], tls_ca[CFG_STR_MAX];
    long long mem_report_mb;           /* > 0: report this as host memory available */
    long long fail_create_below_world; /* tests: refuse model creates in smaller worlds */
    long long slow_step_ms;            /* tests: worker.step sleeps this long first */
    long long slow_create_ms;  /* tests: worker.model_create of a new model sleeps this long */
    long long slow_load_ms;    /* tests: worker.checkpoint_load's prepare sleeps this long */
    long long slow_ckpt_ms;    /* tests: worker.checkpoint_save sleeps this long first */
    long long fail_shm_attach; /* tests: answer the first N data.shm_attach unavailable */
    char fail_create_for_tests[CFG_STR_MAX]; /* the first worker.model_create of this name
                                              * fails (tests) */
    int fail_create_done;                    /* it did (compute thread) */
    char cluster_secret_cfg[CFG_STR_MAX], cluster_secret_file[CFG_STR_MAX];
    long long insecure; /* non-loopback listeners without --auth-token allowed */
    long long heartbeat_ms, xchg_timeout_ms, threads, max_msg_mb, device_index, gpu_max_tokens;
    long long gpu_chunk_tokens;     /* inference forwards of page-locked host rows of at
                                     * least twice this many tokens run chunked, the copies
                                     * overlapped with the compute (kcu_forward_pipelined);
                                     * 0 = off */
    long long stuck_exit_ms;        /* exit 3 when the compute thread does not come back from a
                                     * job this long after its generation was given up */
    long long abort_exit_ms;        /* exit 3 when an ncclCommAbort has run this long */
    long long test_hang_forward_ms; /* tests only: a forward first sleeps this long (ignoring
                                     * aborts), as a kernel that never ends would */
    _Atomic uint64_t busy_since_ns; /* the compute thread's current job began (0 = idle) */
    _Atomic(const char *) busy_at;  /* where in that job it is (a static string): named
                                     * when a stuck device makes the worker exit */
    long long ep_chunks;            /* kcu_ep overlap degree, 0 = by shape */
    long long gpu_grad_bf16;        /* kcu_config.grad_bf16 of whole-layer GPU models */
    long long gpu_train_states;     /* train forwards per layer kept on the device (layer mode) */
    long long gpu_ep_train_states;  /* the same on the expert-parallel path (ep mode) */
    char ep_cfg[CFG_STR_MAX];       /* "auto" | "off" */
    int use_gpu;                    /* the CUDA backend was chosen at start */

    /* loop thread */
    uv_loop_t *loop;
    rpcsrv *srv;
    char rpc_url[CFG_STR_MAX];  /* bound */
    char data_url[CFG_STR_MAX]; /* bound */
    const char *backend;        /* "cpu" or "cuda" */
    char device[128];
    moe_client *coord; /* owned */
    int worker_id;     /* from the coordinator; -1 until registered */
    /* the cluster secret: the coordinator's calls (worker.*) must carry it,
     * ours to it carry it; --cluster-secret, else read from the secret file
     * before each registration ("" until known) */
    char cluster_secret[CFG_STR_MAX];
    int registering;
    uv_timer_t hb_timer;
    uv_timer_t stuck_timer; /* check_stuck (main.c) */
    uv_signal_t sigterm, sigint;
    int stopping;

    /* compute queue (mutex-protected, fed by the loop thread) */
    pthread_t compute_thread;
    pthread_mutex_t qmu;
    pthread_cond_t qcv;
    wkr_queue_item *qhead, *qtail;
    int qstop;
    atomic_uint qposted; /* lane jobs queued so far (a spinning compute thread watches it) */

    /* compute state (compute thread only) */
    xchg_nng_listener *lis; /* the data listener, until a communicator takes it */
    xchg *xc;
    int rank, world;
    uint64_t generation;
    wkr_model *models[WKR_MAX_MODELS];
    int nmodels;
    wkr_fwd_state **handles; /* (max_handles) train forwards awaiting backward */
    /* replies to the last few coordinator requests, by request id: nng's req
     * socket resends a request whose connection dropped, and a resent
     * forward, backward or step must not run twice (compute thread only) */
    struct wkr_reply_cache {
        uint64_t rid[2];
        uint8_t *buf; /* owned */
        size_t len;
    } replies[4];
    int replies_next;
    uint64_t cur_rid[2]; /* the request being run */
    long long max_handles, handle_ttl_ms;

    /* data plane: rows straight from clients (dataplane.h) */
    rpcsrv *dsrv;                   /* loop thread */
    char client_url[CFG_STR_MAX];   /* bound */
    char bulk_url_cfg[CFG_STR_MAX]; /* --bulk-listen */
    char bulk_url[CFG_STR_MAX];     /* bound ("" = none) */
    long long bulk_timeout_ms;
    struct wkr_bulk *bulk; /* the bulk listener (bulk.h), or NULL */
    char host_id[128];     /* this host's boot id */
    long long data_wait_ms, data_staged_mb, shm_max_mb, pool_mb, ring_spin_us;
    dp_table dp;
    void *pin; /* pinned host buffer of the GPU paths (compute thread; wkr_pinned) */
    size_t pin_bytes;

    /* the lane's counts for the coordinator, sent with the next heartbeat
     * (lane.c; under lane_mu) */
    pthread_mutex_t lane_mu;
    wkr_lane_report lane[WKR_LANE_REPORTS];
    int nlane;
};

/* wkr_layer_params: layer l's parameters in m->params - the router, then
 * w1, (w3,) w2 of each local expert. After every layer's block come the
 * layers' extra replicated tensors (wkr_layer_extra). */
static inline wkr_param *wkr_layer_params(wkr_model *m, int l)
{
    int nmat = act_gated(m->cfg.act) ? 3 : 2;
    return &m->params[(size_t)l * (1 + (size_t)m->ne * nmat)];
}

/* wkr_layer_nextra: replicated tensors per layer beyond the router: bias,
 * then ws1, (ws3,) ws2, then wsg, each when the config has it. */
static inline int wkr_layer_nextra(const model_cfg *c)
{
    int nmat = act_gated(c->act) ? 3 : 2;
    return (c->score_bias ? 1 : 0) + (c->shared_d_ff > 0 ? nmat : 0) + (c->shared_gate ? 1 : 0);
}
/* wkr_layer_extra: layer l's extra tensors (wkr_layer_nextra of them). */
static inline wkr_param *wkr_layer_extra(wkr_model *m, int l)
{
    int nmat = act_gated(m->cfg.act) ? 3 : 2;
    return &m->params[(size_t)m->cfg.layers * (1 + (size_t)m->ne * nmat) +
                      (size_t)l * wkr_layer_nextra(&m->cfg)];
}

/* wkr_pinned returns the compute thread's pinned host buffer, grown to at
 * least n bytes (plain memory without CUDA); NULL when out of memory. */
void *wkr_pinned(wkr *w, size_t n);
/* wkr_compute_main is the compute thread's body. */
void *wkr_compute_main(void *arg);
/* wkr_dispatch runs a coordinator call (loop thread): by its row of the
 * method table, at once or on the compute thread (RPC_COMPUTE). */
void wkr_dispatch(wkr *w, rpc_call *c);
/* lane.c: wkr_lane_enqueue is the data plane's run hook (loop thread);
 * wkr_lane_run runs one lane forward (compute thread);
 * wkr_lane_stats_write writes a forward's "stats" pair as the coordinator
 * would (aux_device: the loss computed on the device, or NULL);
 * wkr_lane_write_report writes the "lane" pair of a heartbeat and empties
 * the reports (returns 0 and writes nothing when there are none). */
moe_err wkr_lane_enqueue(void *arg, const dp_run *r, char *err, size_t errlen);
void wkr_lane_run(wkr *w, const dp_run *r);
void wkr_lane_stats_write(mp_writer *wr, const model_cfg *cfg, int64_t T, const int32_t *counts,
                          const int32_t *dropped, const double *probs_sum, double z_sum,
                          const double *aux_device, const double phase[4]);
int wkr_lane_write_report(wkr *w, mp_writer *pw);
/* wkr_enqueue hands a call to the compute thread (loop thread). */
void wkr_enqueue(wkr *w, rpc_call *c, const wkr_method *m);

/* compute-thread operations; each replies to c */
void wkr_op_join(wkr *w, rpc_call *c);
void wkr_op_xchg_id(wkr *w, rpc_call *c);
void wkr_op_model_create(wkr *w, rpc_call *c);
/* model_delete.c: worker.model_delete, and the "mem" report (a key and its
 * map, written into pw) of worker.register and worker.heartbeat */
void wkr_op_model_delete(wkr *w, rpc_call *c);
void wkr_write_mem(const wkr *w, mp_writer *pw);
void wkr_op_forward(wkr *w, rpc_call *c);
void wkr_op_backward(wkr *w, rpc_call *c);
void wkr_op_step(wkr *w, rpc_call *c);
void wkr_op_ckpt_save(wkr *w, rpc_call *c);
void wkr_op_ckpt_load(wkr *w, rpc_call *c);
/* wkr_ckpt_set_roots: the directories the coordinator lets checkpoints be
 * written in and read from (its worker.register reply); checkpoint calls
 * naming a directory or file outside them are refused. Copied; any thread. */
void wkr_ckpt_set_roots(const char *const *roots, int n);
/* wkr_ckpt_set_roots_from reads them from a "checkpoint_roots" array (the
 * register reply's, or worker.join's; NULL: none); MOE_EINVAL (err) when
 * it is not an array of paths. */
moe_err wkr_ckpt_set_roots_from(mp_reader *rr, char *err, size_t errlen);
/* wkr_ckpt_get_roots copies up to max of them into out; returns how many. */
int wkr_ckpt_get_roots(char out[][CFG_STR_MAX], int max);
/* hf.c: models from a Hugging Face directory (cfg.hf_dir). wkr_hf_names
 * names m's parameters as the checkpoint does (hc: its config.json);
 * wkr_hf_load reads the router and this worker's experts of every moe
 * layer from the directory's files, converted to the model's dtype. */
struct hf_cfg;
void wkr_hf_names(wkr_model *m, const struct hf_cfg *hc);
moe_err wkr_hf_load(wkr_model *m, const struct hf_cfg *hc, char *err, size_t errlen);
/* wkr_hf_ckpt_save answers worker.checkpoint_save of a model from a
 * Hugging Face directory into dir (resolved): model-<r>-of-<W>.safetensors
 * holds the weights in the model's dtype under the family's names (rank 0
 * also the routers, every other tensor of the source directory unchanged,
 * and config.json); optimizer-<r>-of-<W>.safetensors the fp32 masters and
 * AdamW moments, once trained. Reply {file, bytes, names, opt_file?,
 * opt_names?}. */
struct st_writer;
void wkr_hf_ckpt_save(wkr *w, rpc_call *c, wkr_model *m, const char *dir);
/* wkr_ckpt_meta writes the moe.* metadata of a checkpoint file */
void wkr_ckpt_meta(struct st_writer *sw, const wkr_model *m, int rank, int world);
/* grads.c: worker.grads {model, layer, expert?} */
void wkr_op_grads(wkr *w, rpc_call *c);
wkr_model *wkr_find_model(wkr *w, const char *name);
/* The handlers' common prologue steps; each answers the call with the
 * error and returns false / NULL when it fails. wkr_parse_or_reply parses
 * the call's parameters into sp (params_parse); wkr_model_or_reply finds the
 * model (not_found); wkr_xc_or_reply needs the cluster communicator
 * (unavailable). */
bool wkr_parse_or_reply(rpc_call *c, pspec *sp, int n);
wkr_model *wkr_model_or_reply(wkr *w, rpc_call *c, const char *name);
bool wkr_xc_or_reply(wkr *w, rpc_call *c);
void wkr_model_free(wkr_model *m);
/* wkr_model_train_alloc allocates grad/m/v (and masters for bf16). */
moe_err wkr_model_train_alloc(wkr_model *m);

/* handles.c: the table of train forwards awaiting backward. */
void wkr_fwd_state_free(wkr_fwd_state *st);
/* wkr_handle_put stores st (ownership passes to the table); the oldest entry
 * is evicted when full. */
void wkr_handle_put(wkr *w, wkr_fwd_state *st);
/* wkr_handle_take removes and returns the state of handle, or NULL. */
wkr_fwd_state *wkr_handle_take(wkr *w, uint64_t handle);
/* wkr_handle_expire frees states older than handle_ttl_ms. */
void wkr_handle_expire(wkr *w);
/* wkr_handle_drop_model frees every state of model m (NULL = all). */
void wkr_handle_drop_model(wkr *w, wkr_model *m);

/* wkr_busy_at names the step the compute thread is entering (a string
 * literal); a worker that exits on a stuck device logs it. */
static inline void wkr_busy_at(wkr *w, const char *what)
{
    atomic_store(&w->busy_at, what);
}

#endif
