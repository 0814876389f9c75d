/*
 * nccl_client.h - rows between a client's GPU and this worker's GPU over a
 * 2-rank NCCL communicator of their own (docs/PROTOCOL.md, "Data plane",
 * "9. NCCL"). Separate from the workers' own communicator (xchg_nccl.c):
 * clients join and leave without touching it.
 *
 * One wnc per data.nccl_open: the client is rank 0, the worker rank 1. Each
 * has a thread of its own that initialises the communicator (non-blocking,
 * polled with a bound), then runs its transfers in order: receive a
 * request's x into a device buffer (then files the ticket, as data.rows
 * does for a CUDA IPC region: the layer reads x and writes y on the
 * device), and once y is written, send y back (queued before the ticket's
 * answer goes: the answer follows y rather than gating it). A lane
 * forward's rows may come in pieces (common/nccl_pieces.h, docs/PROTOCOL.md
 * "Pieces"): every piece's receive is posted at once, the ticket filed when
 * piece 0 is in, and the compute thread waits for each further piece
 * (wnc_x_piece_wait) and queues each piece's y as it is written
 * (wnc_send_y, via dp_nccl_y_piece). Every wait is
 * polled against a deadline, NCCL's async error and the "dead" flag (the
 * client's connection closed, data.nccl_close, worker stopping); on any of
 * them the communicator is aborted (ncclCommAbort) and later requests
 * naming it are refused.
 *
 * Threads: data.nccl_open / data.nccl_close / data.rows arrive on the loop
 * thread (or a ring's); wnc_send_y runs on the compute thread; the table's
 * mu guards the list, refs and the queue. Without CUDA (or on a CPU worker)
 * data.nccl_open is refused (failed_precondition).
 */
#ifndef MOE_WKR_NCCL_CLIENT_H
#define MOE_WKR_NCCL_CLIENT_H

#include <stdint.h>

#include "worker/dataplane.h"

struct wnc;

/* wnc_on_open: data.nccl_open {id: bin (128 bytes, ncclUniqueId), device?:
 * int, timeout_ms?: int, nccl_version?: int} -> {comm: uint, pieces_max:
 * int} (loop thread; pieces_max: data.rows may ask for up to this many
 * pieces, common/nccl_pieces.h). */
void wnc_on_open(dp_table *t, rpc_call *c);
/* wnc_on_echo: data.nccl_echo {comm, bytes, rounds?, deadline_ms?} -> {}:
 * receives bytes and sends them back, rounds times, on the communicator
 * (the path's floor: no compute, no nng; service_bench). */
void wnc_on_echo(dp_table *t, rpc_call *c);
/* wnc_on_close: data.nccl_close {comm} -> {} (loop thread). */
void wnc_on_close(dp_table *t, rpc_call *c);
/* wnc_submit: a data.rows naming comm: tk (not filed yet; owns the call)
 * gets its x (R, H of dt) over NCCL in `pieces` receives (checked by the
 * caller: nccl_pieces_check), then is filed with run (NULL = not a lane
 * forward) once its first piece is in. On a refusal tk is answered and
 * freed here. */
void wnc_submit(dp_table *t, dp_ticket *tk, uint64_t comm, moe_dtype dt, int64_t R, int64_t H,
                const dp_run *run, int pieces);
/* wnc_x_piece_wait: the compute thread waits until x's piece `piece` of
 * filed ticket tk is in its buffer (at once for a ticket of one piece:
 * filed whole). Polled against tk's deadline and the communicator's
 * failure: MOE_OK, or MOE_EUNAVAIL / MOE_ETIMEDOUT with the reason in err
 * (the caller answers the ticket with it). */
moe_err wnc_x_piece_wait(const dp_ticket *tk, int piece, char *err, size_t errlen);
/* wnc_send_y: y's piece `piece` of `pieces` (n bytes at dev, in the comm's
 * buffer) goes to the client next (any thread), in order; queued before
 * the answer is sent, so that y does not wait for the answer (the client
 * posted its receives already). MOE_EUNAVAIL: the communicator failed,
 * nothing queued: the caller answers with an error instead. */
moe_err wnc_send_y(struct wnc *x, const void *dev, size_t n, uint64_t deadline_ns, int piece,
                   int pieces);
/* wnc_put drops a ticket's reference on x (mu held). */
void wnc_put_locked(struct wnc *x);
/* wnc_pipe_closed_locked: the communicators of connection pipe (all: every
 * one) are aborted by their threads (mu held). */
void wnc_pipe_closed_locked(dp_table *t, uint32_t pipe, int all);
/* wnc_wait_all waits (at most timeout_ms) until no communicator thread runs. */
void wnc_wait_all(dp_table *t, int timeout_ms);
/* wnc_region_free frees a communicator buffer region's device memory. */
void wnc_buf_free(int device, void *dev);

#endif
