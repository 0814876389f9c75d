/*
 * xchg.h - the exchange layer: collectives between the W workers of a
 * cluster. One interface, two backends: nng (CPU workers, host buffers) and
 * NCCL (GPU workers, device buffers). The rest of the worker does not know
 * which one runs.
 *
 * Every rank must call the collectives in the same order (they are matched
 * by a per-communicator sequence number). Calls block the calling thread
 * (the worker's compute thread), bounded by the timeout given at open; a
 * timeout or peer failure returns MOE_EUNAVAIL and leaves the communicator
 * failed (every later call fails fast until it is closed and reopened).
 */
#ifndef MOE_XCHG_H
#define MOE_XCHG_H

#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"

typedef struct xchg xchg;

typedef struct xchg_ops {
    /* see the xchg_* wrappers below */
    moe_err (*alltoallv)(xchg *x, const void *sendbuf, const size_t *send_bytes, void **recvbuf,
                         size_t *recv_bytes);
    moe_err (*allreduce_f32)(xchg *x, float *buf, size_t n);
    moe_err (*allgather)(xchg *x, const void *sendbuf, size_t nbytes, void *recvbuf);
    void (*free_buf)(xchg *x, void *buf);
    void (*close)(xchg *x);
} xchg_ops;

struct xchg {
    const xchg_ops *ops; /* private */
    int rank;            /* read-only */
    int world;           /* read-only */
    int failed;          /* read-only: 1 once a collective failed; every later call
                          * returns MOE_EUNAVAIL at once. Close and reopen. */
};

/* xchg_nng_open joins a communicator of `world` ranks over nng. Rank r
 * listens on listen_url (its data address) and dials peer_urls[q] for every
 * q != r (peer_urls has world entries; entry `rank` is ignored). Blocks until
 * every peer is connected or timeout_ms passes (MOE_EUNAVAIL). The
 * communicator is owned by the caller: close it with xchg_close. The
 * listener may be opened earlier with xchg_nng_listen so that the actual
 * address (port 0 = any) is known before the peers are. */
typedef struct xchg_nng_listener xchg_nng_listener;
moe_err xchg_nng_listen(const char *url, xchg_nng_listener **out, char *bound_url,
                        size_t bound_len);
/* XCHG_NNG_RECV_MAX_DEFAULT: the cap on one message received (NNG_OPT_RECVMAXSZ)
 * used by xchg_nng_listen. Payloads of any size still pass: senders cut
 * each part into chunks that fit the receiver's cap, which every rank
 * announces in the open handshake. */
#define XCHG_NNG_RECV_MAX_DEFAULT ((size_t)64 << 20)
/* xchg_nng_listen_max is xchg_nng_listen with an explicit cap on one
 * received message in bytes: 0 = unlimited (chunks of XCHG_NNG_CHUNK_MAX),
 * otherwise at least 4096. A bigger cap means fewer, larger chunks.
 * bound_url (bound_len bytes, may be NULL) receives the address actually
 * bound: for tcp "tcp://IP:PORT" with the real port; a wildcard address
 * (0.0.0.0) is reported as 127.0.0.1, so a multi-host caller substitutes
 * its reachable host name. On success *out is owned by the caller (pass it
 * to xchg_nng_open or xchg_nng_listener_close). Errors: MOE_EINVAL (bad url
 * or cap), MOE_EUNAVAIL (bind failed, e.g. port in use). */
#define XCHG_NNG_CHUNK_MAX ((size_t)16 << 20)
moe_err xchg_nng_listen_max(const char *url, size_t recv_max, xchg_nng_listener **out,
                            char *bound_url, size_t bound_len);
/* xchg_nng_open borrows lis: the listener stays the caller's and must
 * outlive the communicator; one listener serves one communicator at a time,
 * and the next generation's communicator reuses it (messages that arrive
 * early from peers already in a newer generation are kept for it). Errors:
 * MOE_EINVAL (bad arguments), MOE_ENOMEM, MOE_EUNAVAIL (some peer not
 * reached within timeout_ms; the log line names the missing ranks).
 * timeout_ms also bounds every later collective (the whole call). Messages
 * carry `generation`: messages of another generation are dropped, so a
 * rebuilt communicator (generation + 1) ignores leftovers of the old one.
 *
 * xchg_close on an nng communicator that has not failed is graceful: it
 * tells the peers it leaves and waits (at most timeout_ms) until each peer
 * also left, so that no peer loses data still in flight; a peer that is
 * still running a collective sees the departure and fails it at once with
 * MOE_EUNAVAIL. Close of a failed communicator does not wait. The listener
 * stays open (close it with xchg_nng_listener_close when done). */
moe_err xchg_nng_open(xchg_nng_listener *lis, int rank, int world, const char *const *peer_urls,
                      uint64_t generation, int timeout_ms, xchg **out);
void xchg_nng_listener_close(xchg_nng_listener *lis);

/* xchg_shm_open joins a communicator of `world` ranks on one host through
 * shared memory (worker/xchg_shm.c): rank r makes segment
 * /moe-x<token>-g<generation>-r<r> and maps every peer's. token ([A-Za-z0-9],
 * 1-40 characters) is the same on every rank (the coordinator's). Blocks
 * until every peer mapped ours or min(timeout_ms, 10 s) passes
 * (MOE_EUNAVAIL: e.g. ranks that share a boot id but not /dev/shm). timeout_ms also bounds
 * every later collective. Segments are unlinked once mapped; close says
 * goodbye (a peer in a collective fails it at once) and unmaps. */
moe_err xchg_shm_open(int rank, int world, const char *token, uint64_t generation, int timeout_ms,
                      xchg **out);
/* xchg_shm_sweep unlinks /dev/shm/moe-x* segments whose maker is gone
 * (killed before its peers mapped them). */
void xchg_shm_sweep(void);
/* Errors of the collectives: MOE_EUNAVAIL (timeout, peer gone, socket
 * error; the communicator is failed from then on), MOE_ENOMEM (nng: when
 * only alltoallv's result buffer could not be allocated, the communicator
 * stays usable; otherwise it is failed), MOE_EPROTO
 * (ranks called different collectives or sizes disagree: a bug in the
 * caller; the communicator is failed too), MOE_EINVAL (bad arguments; the
 * communicator stays usable only if every rank got the same error).
 *
 * xchg_alltoallv: rank r sends send_bytes[q] bytes to each rank q, taken
 * contiguously from sendbuf in rank order (q = 0 first; the part for itself
 * is copied locally). On success *recvbuf holds the bytes received, in rank
 * order, recv_bytes[q] from rank q; *recvbuf is owned by the caller and
 * freed with xchg_free (it may be NULL when nothing was received). The host
 * backends take it from the worker's buffer pool (worker/pool.h), so that
 * a large exchange does not fault in fresh pages on every call. */
static inline moe_err xchg_alltoallv(xchg *x, const void *sendbuf, const size_t *send_bytes,
                                     void **recvbuf, size_t *recv_bytes)
{
    return x->ops->alltoallv(x, sendbuf, send_bytes, recvbuf, recv_bytes);
}
/* xchg_allreduce_f32: in-place sum over ranks; deterministic: every rank
 * gets identical bits, and the same inputs give the same bits again. nng
 * sums in rank order 0..W-1; NCCL uses its own (fixed) order, so the two
 * backends can differ in the last bits. */
static inline moe_err xchg_allreduce_f32(xchg *x, float *buf, size_t n)
{
    return x->ops->allreduce_f32(x, buf, n);
}
/* xchg_allgather: recvbuf (world * nbytes) receives each rank's nbytes in
 * rank order. Every rank must pass the same nbytes (else MOE_EPROTO). */
static inline moe_err xchg_allgather(xchg *x, const void *sendbuf, size_t nbytes, void *recvbuf)
{
    return x->ops->allgather(x, sendbuf, nbytes, recvbuf);
}
static inline void xchg_free(xchg *x, void *buf)
{
    x->ops->free_buf(x, buf);
}
static inline void xchg_close(xchg *x)
{
    if (x)
        x->ops->close(x);
}
/* xchg_abort closes without the graceful goodbye (as a failed communicator
 * closes): for a communicator being replaced because the cluster re-formed,
 * where a peer may be gone. */
static inline void xchg_abort(xchg *x)
{
    if (x) {
        x->failed = 1;
        x->ops->close(x);
    }
}

#ifdef MOE_HAVE_CUDA
/* NCCL backend (GPU workers). One rank per worker process, one GPU each.
 *
 * Buffers: device pointers of the communicator's device; the collectives
 * run on the backend's own stream (xchg_nccl_stream, non-blocking with
 * respect to the legacy default stream), so the caller makes the inputs
 * ready first: produce them on that stream, or synchronize. Every call
 * returns after its work finished (the stream is watched with the timeout;
 * that is how a hung peer is noticed), so outputs are ready on return.
 * Host pointers are accepted too and staged through device scratch (slow;
 * meant for small control data: counts, losses): a host sendbuf gives a
 * host *recvbuf in alltoallv. xchg_free frees either kind (device memory
 * with cudaFreeAsync on the backend's stream).
 *
 * Failures: NCCL errors, CUDA errors and timeouts return MOE_EUNAVAIL
 * (MOE_ENOMEM when a CUDA allocation failed) and leave the communicator
 * failed (its ncclCommAbort owed to xchg_nccl_settle or the close); close
 * and reopen with a new unique id.
 *
 * Link: -lnccl -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lpthread. */
#define XCHG_NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */
/* xchg_nccl_get_unique_id writes a new ncclUniqueId (XCHG_NCCL_ID_BYTES
 * bytes) to out. Rank 0 calls it and the coordinator relays the bytes to
 * the other ranks; the calling process hosts NCCL's bootstrap root, so it
 * must live until every rank has opened. MOE_EUNAVAIL on NCCL errors. */
moe_err xchg_nccl_get_unique_id(void *out);
/* xchg_nccl_open joins rank `rank` of `world` on CUDA device `device`
 * (made current on the calling thread) with a non-blocking NCCL
 * communicator. Blocks until every rank joined or timeout_ms passed
 * (MOE_EUNAVAIL; the communicator is aborted). timeout_ms also bounds each
 * later collective. On success *out is owned by the caller (xchg_close:
 * finalize and destroy, or abort when failed). */
moe_err xchg_nccl_open(int rank, int world, const void *unique_id, int device, int timeout_ms,
                       xchg **out);
/* xchg_nccl_stream returns the cudaStream_t the collectives run on. */
void *xchg_nccl_stream(xchg *x);
/* xchg_nccl_abort_comm marks the communicator failed, as a failed
 * collective does: for work enqueued on the communicator outside xchg
 * (kcu_ep) that failed or timed out. The ncclCommAbort (kernels stuck on a
 * dead peer stop; it takes hundreds of milliseconds) is owed until
 * xchg_nccl_settle or the close, so that the failed call is answered
 * first: between the two, nothing that waits on the device may run. */
void xchg_nccl_abort_comm(xchg *x, const char *why);
/* xchg_nccl_settle runs an owed ncclCommAbort; nothing when none is owed.
 * The compute thread calls it after each request it ran. */
void xchg_nccl_settle(xchg *x);
/* xchg_nccl_comm returns the ncclComm_t (NULL once failed); for benchmarks
 * and tools. The communicator stays owned by x. */
void *xchg_nccl_comm(xchg *x);
#endif /* MOE_HAVE_CUDA */

/* ---- giving up on a generation (any thread) ----
 * The coordinator tells the survivors when a member of their generation is
 * gone (worker.abort): every collective of that generation, waiting or to
 * come, then fails at once with MOE_EUNAVAIL instead of waiting for its
 * timeout (the nng and NCCL exchanges and the device-resident layer check
 * it in their wait loops). */
/* xchg_set_generation: the generation this worker joined (worker.join). */
void xchg_set_generation(uint64_t gen);
uint64_t xchg_generation(void);
/* xchg_request_abort: give up on generation gen. */
void xchg_request_abort(uint64_t gen);
/* xchg_abort_requested_ns: when the current generation was given up
 * (rpc_now_ns), 0 when it was not. */
uint64_t xchg_abort_requested_ns(void);
/* xchg_abort_requested: 1 when gen (nonzero) was given up. */
int xchg_abort_requested(uint64_t gen);
/* xchg_aborted: the current generation was given up. */
int xchg_aborted(void);

#endif /* MOE_XCHG_H */
