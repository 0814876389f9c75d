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
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "model_cfg.h"
#include "rpcsrv.h"
#include "xchg.h"

#define WKR_MAX_MODELS 64

/* One layer's parameters on this worker (host memory, float; bf16 models keep
 * bf16-rounded values). Experts [e0, e0 + ne) of the layer live here. */
typedef struct wkr_layer {
    float *wr; /* (E,H) router replica */
    float *w1; /* (ne,F,H) */
    float *w3; /* (ne,F,H), NULL for GELU */
    float *w2; /* (ne,H,F) */
} wkr_layer;

typedef struct wkr_model {
    model_cfg cfg;
    int e0, ne;        /* owned experts */
    wkr_layer *layers; /* (cfg.layers) */
} wkr_model;

typedef struct wkr_queue_item {
    rpc_call *call;
    struct wkr_queue_item *next;
} wkr_queue_item;

typedef struct wkr {
    /* config (read-only after start) */
    char coord_url[CFG_STR_MAX];
    char listen_url[CFG_STR_MAX];
    char data_url_cfg[CFG_STR_MAX];
    char backend_cfg[CFG_STR_MAX];
    char log_level[CFG_STR_MAX];
    char auth_token[CFG_STR_MAX];
    long long heartbeat_ms, xchg_timeout_ms, threads, max_msg_mb;

    /* loop thread */
    uv_loop_t *loop;
    rpcsrv *srv;
    char rpc_url[CFG_STR_MAX];  /* bound */
    char data_url[CFG_STR_MAX]; /* bound */
    const char *backend;        /* "cpu" or "cuda" */
    char device[128];
    moe_client *coord; /* owned */
    int worker_id;     /* from the coordinator; -1 until registered */
    int registering;
    uv_timer_t hb_timer;
    uv_signal_t sigterm, sigint;
    int stopping;

    /* compute queue (mutex-protected, fed by the loop thread) */
    pthread_t compute_thread;
    pthread_mutex_t qmu;
    pthread_cond_t qcv;
    wkr_queue_item *qhead, *qtail;
    int qstop;

    /* compute state (compute thread only) */
    xchg_nng_listener *lis; /* the data listener, until a communicator takes it */
    xchg *xc;
    int rank, world;
    uint64_t generation;
    wkr_model *models[WKR_MAX_MODELS];
    int nmodels;
} wkr;

/* wkr_compute_main is the compute thread's body. */
void *wkr_compute_main(void *arg);
/* wkr_enqueue hands a call to the compute thread (loop thread). */
void wkr_enqueue(wkr *w, rpc_call *c);

/* compute-thread operations; each replies to c */
void wkr_op_join(wkr *w, rpc_call *c);
void wkr_op_model_create(wkr *w, rpc_call *c);
void wkr_op_forward(wkr *w, rpc_call *c);
wkr_model *wkr_find_model(wkr *w, const char *name);
void wkr_model_free(wkr_model *m);

#endif
