/*
 * moe.h - the one public header of moe: error codes, dtypes and the client
 * library (libmoe). Internal modules include it for moe_err and moe_dtype.
 *
 * Conventions: functions return moe_err (0 = MOE_OK); outputs go through
 * pointers; the comment on each declaration states who owns what.
 */
#ifndef MOE_H
#define MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Everything declared here is libmoe's public interface: the library is
 * built with hidden visibility and exports exactly these functions. */
#pragma GCC visibility push(default)

/* the library's version: MOE_VERSION_* of the header it was built with */
#define MOE_VERSION_MAJOR  0
#define MOE_VERSION_MINOR  2
#define MOE_VERSION_PATCH  0
#define MOE_VERSION_STRING "0.2.0"
/* moe_version returns the library's MOE_VERSION_STRING (static). */
const char *moe_version(void);

/* MOE_UNSET: a double field of moe_model_config or moe_adamw left unset
 * (not sent: the service's default applies, docs/PROTOCOL.md). */
#define MOE_UNSET (__builtin_nan(""))

/* moe_err: the one error enum. Each value has a stable wire code string
 * (moe_err_code) used in RPC error responses. Never renumber. */
typedef enum moe_err {
    MOE_OK = 0,
    MOE_EINVAL = 1,     /* "invalid_argument" */
    MOE_EUNAUTH = 2,    /* "unauthenticated" */
    MOE_EBUSY = 3,      /* "busy": queue full, try later */
    MOE_ETIMEDOUT = 4,  /* "deadline_exceeded" */
    MOE_EUNAVAIL = 5,   /* "unavailable": workers missing or unhealthy */
    MOE_ENOTFOUND = 6,  /* "not_found": unknown model, layer, handle */
    MOE_ENOMEM = 7,     /* "resource_exhausted" */
    MOE_ETOOBIG = 8,    /* "too_large": message over the size cap */
    MOE_EPROTO = 9,     /* "malformed": not msgpack, or not a request */
    MOE_ENOMETHOD = 10, /* "unknown_method" */
    MOE_EEXPIRED = 11,  /* "expired": a training handle that timed out */
    MOE_EPRECOND = 12,  /* "failed_precondition": e.g. step with no grads */
    MOE_EIO = 13,       /* "io_error": file system */
    MOE_EINTERNAL = 14, /* "internal" */
    MOE_ECLOSED = 15,   /* "closed": object or connection closed */
    MOE_ERR_COUNT
} moe_err;

/* moe_strerror returns a static human-readable description of err. */
const char *moe_strerror(moe_err err);
/* moe_err_code returns the static stable wire code of err ("busy", ...). */
const char *moe_err_code(moe_err err);
/* moe_err_from_code maps a wire code (len bytes, not NUL terminated) back;
 * unknown codes map to MOE_EINTERNAL. */
moe_err moe_err_from_code(const char *code, size_t len);

/* moe_dtype: element types of tensors on the wire and in models. */
typedef enum moe_dtype {
    MOE_F32 = 0,
    MOE_BF16 = 1,
    MOE_F16 = 2,
} moe_dtype;

/* moe_dtype_size returns the element size in bytes (4, 2, 2), 0 if unknown. */
size_t moe_dtype_size(moe_dtype dt);
/* moe_dtype_name returns "f32", "bf16" or "f16"; NULL if unknown. */
const char *moe_dtype_name(moe_dtype dt);
/* moe_dtype_parse parses a name (len bytes); MOE_EINVAL if unknown. */
moe_err moe_dtype_parse(const char *name, size_t len, moe_dtype *out);

/* ---------------------------------------------------------------------------
 * libmoe: the client. Thread safe: one moe_client may be used by many threads.
 * Failed calls leave a message in moe_last_error() (thread-local).
 * ------------------------------------------------------------------------- */

typedef struct moe_client moe_client;

typedef struct moe_client_opts {
    int timeout_ms;         /* per call; 0 = 60000 */
    size_t max_msg;         /* largest response accepted; 0 = 1 GiB */
    const char *auth_token; /* sent as params "auth" on every call; NULL = none */
    /* how the rows of forward and backward travel (docs/PROTOCOL.md, "Data
     * plane"): "auto" (straight to the workers; through shared memory when
     * they are on this host; rows of 1 MiB or more per worker on another
     * host over its bulk TCP endpoint), "socket" (straight to the workers
     * over nng), "shm" (shared memory; fails where a worker is on another
     * host), "bulk" (every worker's rows over its bulk endpoint; fails where
     * a worker offers none), "nccl" (GPU to GPU over NCCL, below
     * moe_nccl_floor; CUDA workers only), "coordinator" (inside the request to the
     * coordinator, as before the data plane). NULL = $MOE_DATA_PATH, else
     * "auto". Only "auto" falls back to the coordinator path where the
     * cluster has no data plane; "socket", "shm" and "bulk" then fail with
     * MOE_EUNAVAIL and say why. */
    const char *data_path;
    /* TLS, for tls+tcp:// urls (the coordinator's and the workers' data
     * plane); ignored for others. PEM file paths, NULL = none. tls_ca: the
     * CA certificates the server's certificate must chain to (required for
     * a tls+tcp:// url; its host name is checked against the certificate).
     * tls_cert and tls_key: a client certificate and its key (optional,
     * both or neither). Added after data_path: callers that set only the
     * fields above keep working. */
    const char *tls_ca;
    const char *tls_cert;
    const char *tls_key;
} moe_client_opts;

/* moe_client_open dials url (tcp://host:port, ipc://path). opts may be NULL.
 * The client is owned by the caller: free with moe_client_close.
 * It draws a random 64-bit client id; every request carries the params key
 * "rid": [client id, msgid], so that the coordinator runs a mutating request
 * that nng delivered twice (a resend after a dropped connection) only once
 * (docs/PROTOCOL.md). Params passed to moe_call must therefore not contain
 * "rid" (nor "auth" when opts->auth_token is set). */
moe_err moe_client_open(const char *url, const moe_client_opts *opts, moe_client **out);
/* moe_client_close: the async calls still in flight end first (each
 * callback runs, with a transport error, before it returns); then the
 * connection closes and c is freed. Not from inside a callback. */
void moe_client_close(moe_client *c);
/* moe_client_id returns the client id sent in every "rid" (0 for NULL). */
uint64_t moe_client_id(const moe_client *c);
/* moe_last_error: the message of the last failed call on this thread. */
const char *moe_last_error(void);

/* moe_reply: one whole response. buf is owned by the reply (moe_reply_free).
 * On success the result value starts at buf + result_off (msgpack). */
typedef struct moe_reply {
    uint8_t *buf;
    size_t len;
    size_t result_off;
    moe_err err;       /* the server's error, MOE_OK if none */
    char message[512]; /* the server's (or transport's) error message */
    int transport;     /* 1: no response arrived (send/receive failed or timed out) */
} moe_reply;
void moe_reply_free(moe_reply *r);

/* moe_call sends method with params (an encoded msgpack map, or NULL for {})
 * and waits for the reply. Returns MOE_OK when a response arrived AND it
 * carries no error; otherwise the error (server's or transport's), with the
 * message in out->message and moe_last_error(). out is always filled; free it
 * with moe_reply_free in every case. */
moe_err moe_call(moe_client *c, const char *method, const void *params, size_t params_len,
                 moe_reply *out);
/* moe_call_cb: runs on a library thread; reply is owned by the callback
 * (free it with moe_reply_free) and err == reply->err or a transport error. */
typedef void (*moe_call_cb)(moe_err err, moe_reply *reply, void *arg);
/* moe_call_async: like moe_call but returns at once; cb runs exactly once
 * (also on failure to send). moe_client_close returns only after every
 * callback of the client has returned: a callback must not close its own
 * client. */
moe_err moe_call_async(moe_client *c, const char *method, const void *params, size_t params_len,
                       moe_call_cb cb, void *arg);

/* ---- typed calls ---- */

/* moe_ping: one round trip to the server. */
moe_err moe_ping(moe_client *c);

typedef struct moe_model_config {
    const char *name;       /* model name, [A-Za-z0-9_.-]{1,63} */
    int layers;             /* MoE layers */
    int d_model;            /* H */
    int d_ff;               /* F */
    int n_experts;          /* E */
    int top_k;              /* K, 1..E */
    const char *activation; /* "swiglu" (default) or "gelu" */
    int renormalize;        /* renormalise the K gate weights to sum 1 */
    double capacity_factor; /* 0 = dropless */
    moe_dtype dtype;        /* MOE_F32 or MOE_BF16 */
    uint64_t seed;          /* weight init seed */
    double aux_loss_coef;   /* training: load-balancing loss coefficient */
    double z_loss_coef;     /* training: router z-loss coefficient */
} moe_model_config;
/* MOE_MODEL_CONFIG_DEFAULT: start from it and set what you need; fields it
 * leaves unset (activation NULL, MOE_UNSET doubles) take the service's
 * defaults (swiglu, dropless, aux_loss_coef 0.01, z_loss_coef 0). A zeroed
 * struct sends its zeros. */
#define MOE_MODEL_CONFIG_DEFAULT                                                                   \
    {                                                                                              \
        NULL, 0, 0, 0, 0, 0, NULL, 0, MOE_UNSET, MOE_F32, 0, MOE_UNSET, MOE_UNSET                  \
    }

moe_err moe_model_create(moe_client *c, const moe_model_config *cfg);
/* moe_model_delete removes model from the coordinator and every worker
 * (model.delete); its name may be created again. MOE_ENOTFOUND when there
 * is no such model; MOE_EPRECOND while requests for it are queued. */
moe_err moe_model_delete(moe_client *c, const char *model);
/* moe_model_create_from_hf creates model `name` from a Hugging Face model
 * directory as published (config.json + model.safetensors, or shards with
 * model.safetensors.index.json; Mixtral, Qwen3-MoE, OLMoE): one moe layer
 * per MoE layer of the checkpoint, its weights and tensor names. dir is on
 * the coordinator's file system, under its --checkpoint-root. dtype "f32",
 * "bf16", or NULL for the checkpoint's own (docs/PROTOCOL.md). */
moe_err moe_model_create_from_hf(moe_client *c, const char *name, const char *dir,
                                 const char *dtype);

/* moe_fwd_info: what forward reports besides y. Arrays are malloc'ed by the
 * library (free with moe_fwd_info_free). */
typedef struct moe_fwd_info {
    int n_experts;
    int64_t *tokens_per_expert;                      /* (E) routed slots per expert */
    int64_t *dropped;                                /* (E) slots dropped by the capacity factor */
    double imbalance;                                /* max/mean of tokens_per_expert */
    double gate_s, dispatch_s, experts_s, combine_s; /* slowest worker per phase */
    double total_s;                                  /* coordinator time for the whole call */
    double aux_loss, z_loss;
    uint64_t handle; /* training handle (0 unless train=1) */
} moe_fwd_info;
void moe_fwd_info_free(moe_fwd_info *info);

/* moe_forward runs layer `layer` of `model` on x (T, H) of dtype dt and
 * writes y (T, H) of the same dtype into caller memory. info may be NULL. */
moe_err moe_forward(moe_client *c, const char *model, int layer, moe_dtype dt, const void *x,
                    int64_t T, int64_t H, void *y, moe_fwd_info *info);
/* moe_forward_train: as moe_forward with train=true; info (required) gets
 * the handle that moe_backward takes. */
moe_err moe_forward_train(moe_client *c, const char *model, int layer, moe_dtype dt, const void *x,
                          int64_t T, int64_t H, void *y, moe_fwd_info *info);
/* moe_backward: dx (T, H) from dy (T, H) for a train forward's handle (used
 * once). Gradients accumulate in the service until moe_optimizer_step. */
moe_err moe_backward(moe_client *c, uint64_t handle, moe_dtype dt, const void *dy, int64_t T,
                     int64_t H, void *dx);

/* moe_buffer_alloc: n bytes for the rows of forward and backward (x, y, dy,
 * dx) that travel with no copy at all: a shared-memory segment that the
 * workers on this host map once and read and write in place (for GPU
 * workers, pinned: copied by DMA). Rows in ordinary memory are copied into
 * such a buffer and back by the library; rows already in one are not. Where
 * shared memory cannot be used (workers on another host, data path socket
 * or coordinator) it is plain memory and everything still works. At most 64
 * per client. Owned by the caller: free with moe_buffer_free (or it goes
 * with moe_client_close). NULL when out of memory (moe_last_error). */
void *moe_buffer_alloc(moe_client *c, size_t n);
void moe_buffer_free(moe_client *c, void *p);

/* moe_cuda_register: rows already on a GPU of this host. dptr is the base
 * of a device allocation of n bytes (cudaMalloc) and ipc_handle the 64 bytes
 * of its cudaIpcMemHandle_t (cudaIpcGetMemHandle(&h, dptr)): forward and
 * backward whose x and output both lie in such buffers (or in
 * moe_buffer_alloc ones) go GPU to GPU - each worker opens the allocation
 * once and reads x and writes y on the device, with no host copy (the
 * caller's stream work must be finished before the call). libmoe never
 * reads or writes that memory on the host; it copies it only with CUDA:
 * a decode batch (at most $MOE_FANOUT_ROWS rows: by default 64 on GPU
 * workers, 16 on CPU ones) on several
 * workers, when CUDA reports both buffers as device memory, is copied to
 * host memory and back with cudaMemcpy and fanned out (a few microseconds
 * instead of the ordered road). Without a data plane to workers on this
 * host such a call fails with MOE_EINVAL. At most 64 buffers of both
 * kinds per client. The memory stays the caller's; moe_cuda_unregister
 * tells the workers to close it. */
moe_err moe_cuda_register(moe_client *c, void *dptr, size_t n, const void *ipc_handle);
void moe_cuda_unregister(moe_client *c, void *dptr);

/* The "nccl" data path (opts.data_path, CUDA builds of libmoe, workers of
 * backend cuda): moe_forward / moe_forward_train / moe_backward whose x and
 * output are both device memory (cudaMalloc) of one GPU of this process
 * send each worker its rows GPU to GPU over a NCCL communicator of their
 * own (opened on the first call, on that GPU), the control still over nng
 * (docs/PROTOCOL.md, "Data plane", "9. NCCL"). The caller's work on x must
 * be finished before the call; y is written when it returns. Host x and
 * output (both) are staged through GPU $MOE_NCCL_DEVICE (default 0). On a
 * CPU worker or a build without CUDA such a call fails with MOE_EUNAVAIL
 * and says why.
 * moe_nccl_floor measures the path's floor: n bytes at dev (device memory)
 * to worker `rank` and back over that communicator, raw (no compute, no
 * nng), iters times; *seconds: the median round trip. */
moe_err moe_nccl_floor(moe_client *c, int rank, void *dev, size_t n, int iters, double *seconds);

typedef struct moe_adamw {
    double lr, beta1, beta2, eps, weight_decay;
    double max_grad_norm; /* 0 = no clipping */
    int check_step;       /* 1: apply only if the model is at expect_step (idempotent retry) */
    int64_t expect_step;
} moe_adamw;
/* MOE_ADAMW_DEFAULT: every hyperparameter unset (MOE_UNSET: not sent, the
 * service's defaults apply: lr 1e-3, beta1 0.9, beta2 0.999, eps 1e-8,
 * weight_decay 0, max_grad_norm 0); set the ones you change. */
#define MOE_ADAMW_DEFAULT                                                                          \
    {                                                                                              \
        MOE_UNSET, MOE_UNSET, MOE_UNSET, MOE_UNSET, MOE_UNSET, MOE_UNSET, 0, 0                     \
    }
/* moe_optimizer_step applies AdamW to every parameter of model and zeroes
 * the gradients. step_out and grad_norm_out may be NULL. */
moe_err moe_optimizer_step(moe_client *c, const char *model, const moe_adamw *opt,
                           int64_t *step_out, double *grad_norm_out);
/* moe_checkpoint_save writes a checkpoint of model under directory path
 * (see docs/OPERATIONS.md for the layout); moe_checkpoint_load loads the
 * newest complete one (or path itself if it holds an index). */
moe_err moe_checkpoint_save(moe_client *c, const char *model, const char *path);
moe_err moe_checkpoint_load(moe_client *c, const char *model, const char *path, int64_t *step_out);

/* bf16 <-> f32 (round to nearest even; NaN stays NaN), n elements: the
 * conversions a caller needs to hand the library bf16 rows. */
void moe_bf16_from_f32(const float *in, uint16_t *out, size_t n);
void moe_f32_from_bf16(const uint16_t *in, float *out, size_t n);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif /* MOE_H */
