/*
 * nccl_trace.h - where a call's time goes on the client's NCCL path, for
 * measuring it against its floor (bench/nccl_client_check.sh): with
 * MOE_NCCL_TRACE=1 each link keeps the phase times of its last
 * NCCL_TRACE_KEEP calls and prints their medians to stderr when it closes.
 * Off (the default), a mark is one branch on a flag.
 *
 * Phases of one call on one link, each the time from the mark before:
 *   NT_START      the call took the link
 *   NT_ROWS_SENT  data.rows handed to nng and sent
 *   NT_X_POSTED   ncclSend of x enqueued
 *   NT_X_DONE     x seen sent (the stream idle)
 *   NT_Y_POSTED   ncclRecv of y enqueued
 *   NT_ANSWERED   the worker's answer read
 *   NT_Y_DONE     y seen received: the end
 * A mark not reached (an error) leaves the call out.
 */
#ifndef MOE_NCCL_TRACE_H
#define MOE_NCCL_TRACE_H

#include <stdint.h>

enum { NT_START, NT_ROWS_SENT, NT_X_POSTED, NT_X_DONE, NT_Y_POSTED, NT_ANSWERED, NT_Y_DONE, NT_N };
#define NCCL_TRACE_KEEP 256

typedef struct nccl_trace {
    int on;                            /* MOE_NCCL_TRACE=1 when the link was made */
    uint64_t mark_ns[NT_N];            /* this call's marks (0: not reached) */
    int32_t us[NCCL_TRACE_KEEP][NT_N]; /* per kept call: [0] total, [i] mark i - mark i-1 */
    int32_t pieces[NCCL_TRACE_KEEP];   /* per kept call: the pieces x and y travelled in */
    int cur_pieces;                    /* this call's (nccl_trace_pieces) */
    uint32_t calls;                    /* calls recorded (the last KEEP kept) */
} nccl_trace;

/* nccl_trace_init reads MOE_NCCL_TRACE; nccl_trace_mark notes phase p now
 * (NT_START clears the others); nccl_trace_pieces notes the pieces this
 * call's rows travel in (docs/PROTOCOL.md "Pieces": x posted is then the
 * last piece's send posted, x done every piece sent, y posted every
 * receive posted, y done every piece received); nccl_trace_end keeps the
 * call if every mark was reached; nccl_trace_print writes the medians
 * (device names the GPU) and forgets them. */
void nccl_trace_init(nccl_trace *t);
void nccl_trace_mark(nccl_trace *t, int p);
void nccl_trace_pieces(nccl_trace *t, int pieces);
void nccl_trace_end(nccl_trace *t);
void nccl_trace_print(nccl_trace *t, int device);

#endif
