/*
 * client_nccl.h - libmoe's side of the NCCL path (internal): a rank's rows
 * go from the caller's GPU memory to its worker's GPU over a 2-rank NCCL
 * communicator of their own (the client rank 0, the worker rank 1); the
 * control (data.rows with nccl: comm) stays on nng (client_dp.c).
 * docs/PROTOCOL.md ("Data plane", "9. NCCL") has the bytes.
 *
 * A link is one communicator with one worker, owned by the worker map
 * (client_dp.c): opened on first use, aborted when a transfer fails, the
 * worker's answer is an error (x refused, or a receive of y posted ahead of
 * the answer can never end), or the map goes. Every wait
 * is polled with a bound, NCCL's async error and the worker's nng
 * connection (gone: the worker died), never blocking in NCCL.
 *
 * Built against CUDA and NCCL only with MOE_HAVE_CUDA; without, every call
 * answers MOE_EUNAVAIL ("built without CUDA").
 */
#ifndef MOE_CLIENT_NCCL_H
#define MOE_CLIENT_NCCL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"
#include "client/nccl_trace.h"

#define MOE_NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */

typedef struct moe_nccl_link {
    pthread_mutex_t mu; /* held by the call that uses it, start to end */
    int open;           /* the communicator is up (comm_id names it at the worker) */
    uint64_t comm_id;
    int pieces_max;   /* data.nccl_open's answer: rows may go in up to this many pieces */
    int device;       /* the client's GPU it lives on */
    void *comm;       /* ncclComm_t, NULL when closed */
    void *stream;     /* cudaStream_t of its transfers */
    nccl_trace trace; /* phase times (MOE_NCCL_TRACE=1), printed when it closes */
} moe_nccl_link;

void moe_nccl_link_init(moe_nccl_link *l);
/* moe_nccl_link_fini aborts the communicator if open (its worker notices
 * when the connection of the map closes). */
void moe_nccl_link_fini(moe_nccl_link *l);
/* moe_nccl_built: 1 when libmoe was built with CUDA and NCCL. */
int moe_nccl_built(void);

/* moe_nccl_version: the version code of the NCCL this process runs
 * (ncclGetVersion: 22803 for 2.28.3), loading it if not yet loaded; 0 when
 * there is none. Both ends of a communicator need the same one. */
int moe_nccl_version(void);
/* moe_nccl_device_of: the GPU whose device memory p is, or -1 (host
 * memory, managed memory, no CUDA). Loads the CUDA runtime and NCCL on
 * first use (client/cuda_dl.h): call it on the NCCL path only. */
int moe_nccl_device_of(const void *p);
/* moe_nccl_begin makes a unique id (out: MOE_NCCL_ID_BYTES bytes) and starts
 * rank 0's non-blocking initialisation on device. The caller sends the id
 * to the worker (data.nccl_open) and then waits with moe_nccl_wait. */
moe_err moe_nccl_begin(moe_nccl_link *l, int device, uint8_t *id, char *msg, size_t msglen);
/* moe_nccl_post enqueues a send (send = 1) or a receive of n bytes at p on
 * the link's stream (peer: the worker, rank 1). The communicator is
 * non-blocking: the post may still be ncclInProgress when this returns,
 * and NCCL refuses any further call on it ("Attempt to use communicator
 * before the previous operation returned ncclSuccess") until
 * moe_nccl_wait (stream 0 is enough) has seen it through: every post is
 * followed by a wait before the next post. */
moe_err moe_nccl_post(moe_nccl_link *l, int send, void *p, size_t n, char *msg, size_t msglen);
/* moe_nccl_wait polls until what was started or posted is done (with
 * stream: the stream is idle too), timeout_ms passed, NCCL reports an error,
 * *up (the worker's live nng connections) drops to 0, or give_up(arg)
 * returns non-zero. MOE_OK, else MOE_ETIMEDOUT / MOE_EUNAVAIL / MOE_ECLOSED
 * (give_up) with the reason in msg; then the caller aborts the link. */
moe_err moe_nccl_wait(moe_nccl_link *l, int stream, int timeout_ms, const int *up,
                      int (*give_up)(void *), void *arg, char *msg, size_t msglen);
/* host rows on the NCCL path are staged through device memory of GPU
 * $MOE_NCCL_DEVICE (default 0): moe_nccl_stage_device, moe_nccl_dev_alloc
 * (NULL on failure), moe_nccl_copy (either direction; MOE_EINTERNAL on
 * failure) and moe_nccl_dev_free. */
int moe_nccl_stage_device(void);
void *moe_nccl_dev_alloc(int device, size_t n);
moe_err moe_nccl_copy(void *dst, const void *src, size_t n);
void moe_nccl_dev_free(void *p);
/* moe_nccl_abort: the communicator is dropped (ncclCommAbort); open = 0. */
void moe_nccl_abort(moe_nccl_link *l);

#endif
