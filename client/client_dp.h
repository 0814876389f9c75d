/*
 * client_dp.h - libmoe's side of the data plane (internal): forward and
 * backward send their rows straight to the workers (data.rows), the
 * control call to the coordinator carries only a ticket. The worker map
 * comes from the coordinator's dataplane.info and is refreshed when the
 * cluster re-forms. docs/PROTOCOL.md ("Data plane") has the bytes.
 */
#ifndef MOE_CLIENT_DP_H
#define MOE_CLIENT_DP_H

#include <stddef.h>
#include <stdint.h>

#include <nng/nng.h>

#include "base/moe.h"
#include "proto/proto.h"

/* MOE_PATH_NCCL: rows in GPU memory over a NCCL communicator with each
 * worker (client_nccl.h; CUDA builds, CUDA workers) */
enum {
    MOE_PATH_AUTO = 0,
    MOE_PATH_COORD,
    MOE_PATH_SOCKET,
    MOE_PATH_SHM,
    MOE_PATH_BULK,
    MOE_PATH_NCCL
};

struct moe_dp;

/* moe_dp_parse_path: NULL or "" = auto. MOE_EINVAL for another name. */
moe_err moe_dp_parse_path(const char *s, int *out);
struct moe_dp *moe_dp_new(void);
/* moe_dp_free closes the worker connections and unmaps shared buffers. */
void moe_dp_free(struct moe_dp *dp);

/* moe_dp_call runs one forward or backward over the data plane.
 * method "forward" or "backward"; ctl_head: the control params map's pairs
 * already encoded (nctl of them) without x/dy; in (T,H) of dtype dt is sent,
 * out (T,H) receives y / dx. On success the coordinator's reply is in *ctl
 * (free with moe_reply_free). Returns MOE_ENOMETHOD when the cluster offers
 * no data plane (the caller then uses the coordinator path). */
moe_err moe_dp_call(moe_client *c, const char *method, const void *ctl_pairs, size_t ctl_len,
                    uint32_t nctl, moe_dtype dt, const void *in, int64_t T, int64_t H, void *out,
                    moe_reply *ctl);

/* moe_buffer_alloc / moe_buffer_free (moe.h) */
void *moe_dp_buffer_alloc(moe_client *c, size_t n);
void moe_dp_buffer_free(moe_client *c, void *p);
moe_err moe_dp_cuda_register(moe_client *c, void *dptr, size_t n, const void *ipc_handle);
/* moe_dp_nccl_floor: moe_nccl_floor (moe.h) */
moe_err moe_dp_nccl_floor(moe_client *c, int rank, void *dev, size_t n, int iters, double *seconds);
/* moe_dp_on_device: p lies in a registered GPU buffer (n > 0) */
int moe_dp_on_device(moe_client *c, const void *p, size_t n);

/* internal accessors of moe_client (client.c) */
uint32_t moe__next_msgid(moe_client *c);
const char *moe__auth(const moe_client *c);
/* moe__set_cluster: every later call of c carries "cluster": secret (the
 * daemons' calls to each other; NULL or "" = none). Copied. Call it before
 * the first call, not concurrently with calls. */
moe_err moe__set_cluster(moe_client *c, const char *secret);
int moe__timeout_ms(const moe_client *c);
size_t moe__max_msg(const moe_client *c);
int moe__data_path(const moe_client *c);
struct moe_dp *moe__dp(moe_client *c);
/* moe__dial starts a non-blocking dial of url on s with c's TLS files
 * (tls+tcp:// urls; tls.h). MOE_EINVAL for a bad url or missing TLS
 * settings, MOE_EUNAVAIL otherwise; the reason in moe_last_error. */
moe_err moe__dial(moe_client *c, nng_socket s, const char *url, const char *what);
/* moe__from_nng maps an nng error to moe_err (client.c) */
moe_err moe__from_nng(int rv);
void moe__set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
