/*
 * dataplane.h - the worker's end of the data plane: clients send token rows
 * straight to the workers (method data.rows on the worker's client
 * endpoint), never through the coordinator. The coordinator's job names the
 * rows by ticket ([client id, sequence]); the compute thread takes them
 * from this table, runs the layer and answers the client's data.rows call
 * with its output rows. docs/PROTOCOL.md ("Data plane") has the bytes.
 *
 * Rows arrive inline (a tensor in the message) or by reference into a
 * shared-memory region the client attached once on the same connection
 * (data.shm_attach): the worker reads x from the region and writes y into
 * it. Regions and waiting tickets belong to the connection they came on:
 * when it closes they are dropped (nothing leaks when a client dies).
 *
 * Threads: requests arrive on the loop thread (dp_on_request), the compute
 * thread takes tickets (dp_take, may block, bounded) and answers them; a
 * mutex guards the table. Connection-close events come from nng threads and
 * are handled on the loop thread.
 */
#ifndef MOE_WKR_DATAPLANE_H
#define MOE_WKR_DATAPLANE_H

#include <pthread.h>
#include <stdint.h>
#include <uv.h>

#include "rpc/methods.h"
#include "proto/proto.h"
#include "rpc/rpcsrv.h"

typedef struct dp_region dp_region;
typedef struct dp_ring dp_ring; /* worker/ring.c */
struct wnc;                     /* worker/nccl_client.c */

#define DP_MAX_RINGS 16 /* rings watched by one worker (a thread each) */

/* dp_bulk: rows that came on a bulk connection (worker/bulk.c, docs/
 * PROTOCOL.md "Bulk rows"), named by a ticket. Parked in the table until a
 * data.rows with bulk: true claims them; the ticket's x is then a view into
 * buf, and its answer (y into the same buf, or the error) is handed back to
 * the connection's thread, which writes it to the client. Shared by the
 * connection's thread and the ticket: refs and state under the table's mu. */
enum { DP_BULK_PARKED = 1, DP_BULK_CLAIMED, DP_BULK_DONE };
typedef struct dp_bulk {
    uint64_t cid, seq; /* the ticket */
    moe_dtype dtype;
    int64_t rows, cols;
    uint8_t *buf;        /* owned (wpool): x (rows, cols) as received, then y in place */
    size_t nbytes;       /* rows x cols x element size */
    size_t reserved;     /* counted in the table's staged_bytes while parked */
    int state;           /* DP_BULK_* */
    int dead;            /* its connection is gone: nobody waits for the answer */
    int refs;            /* the connection's thread, and the ticket that claimed it */
    int wake_fd;         /* the connection's eventfd, written when state becomes DONE */
    pthread_mutex_t *mu; /* the table's */
    moe_err err;         /* with DONE: MOE_OK = y (nbytes in buf), else the error */
    char msg[256];
    uint64_t park_deadline_ns; /* parked rows not claimed by then are dropped */
    struct dp_bulk *next;      /* in the table's parked list */
} dp_bulk;

/* dp_ticket: one client's rows for one job, waiting or taken. */
typedef struct dp_ticket {
    uint64_t cid, seq;  /* the ticket */
    rpc_call *call;     /* the client's data.rows call; answered exactly once */
    moe_tensor x;       /* the rows (R,H): a view into call's message or region */
    dp_region *region;  /* non-NULL: x lies in this region */
    dp_bulk *bulk;      /* non-NULL: x came on a bulk connection (x, then y, in its buf) */
    dp_region *yregion; /* with region: y goes into this one (region by default) */
    uint64_t y_off;     /* byte offset of y (R,H) in yregion */
    uint32_t pipe;      /* connection the call came on */
    uint64_t deadline_ns;
    struct wnc *nccl; /* non-NULL: x came over this NCCL communicator (in its
                       * buffer region), y goes back on it (a reference) */
    /* the NCCL path in pieces (common/nccl_pieces.h): x and y travel as
     * nccl_pieces transfers of rows each (1: whole). x's piece i is in once
     * the communicator has received nccl_mark + i + 1 pieces
     * (wnc_x_piece_wait); nccl_ysent: y's pieces queued for sending so far
     * (dp_nccl_y_piece, in order; the answer queues the rest) */
    int nccl_pieces;
    int nccl_ysent;
    uint64_t nccl_mark;
    int taken; /* the compute thread owns it */
    /* owned: key/value pairs added to the answer's map (a lane forward's
     * stats, dp_ticket_set_extra) */
    uint8_t *extra;
    size_t extra_len;
    uint32_t extra_pairs;
    struct dp_ticket *next;
} dp_ticket;

/* dp_run: a data.rows request that also asks the worker to run the
 * inference forward at once ("run", docs/PROTOCOL.md "The lane") */
typedef struct dp_run {
    uint64_t cid, seq; /* its ticket */
    char model[64];
    int64_t layer;
    uint64_t generation; /* of the client's map */
    int64_t rows;        /* the ticket's rows (R) */
    moe_dtype dtype;     /* and dtype */
    uint64_t recv_ns;    /* when the data.rows arrived */
    int fanout;          /* one of several workers: answer this rank's experts' rows */
} dp_run;

typedef struct dp_table {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a ticket arrived, or the worker is stopping */
    int stopping;      /* dp_stop was called: dp_take waits no more */
    dp_ticket *head;   /* waiting and taken tickets */
    int ntickets, max_tickets;
    size_t staged_bytes, max_staged_bytes; /* inline rows waiting */
    dp_region *regions;
    size_t mapped_bytes, max_mapped_bytes;
    uint64_t next_region;
    dp_bulk *parked; /* bulk rows waiting for their data.rows */
    int bulk_conns, bulk_parked;
    uint64_t bulk_in_total; /* transfers received on bulk connections */
    const char *auth_token; /* "" or NULL = none (borrowed, read-only) */
    int gpu_register;       /* register regions with CUDA (pinned copies) */
    int gpu_device;         /* >= 0: the worker's GPU (CUDA IPC regions open there) */
    /* connections closed, from nng threads, handled on the loop thread */
    uint32_t closed[256];
    int nclosed, closed_overflow;
    uv_async_t closed_async;
    uv_timer_t expire_timer;
    /* the lane: runs a data.rows with "run" (loop thread; the ticket is
     * registered; MOE_OK once the job is queued, else the ticket is answered
     * with the error and dropped). NULL = no lane. */
    moe_err (*run)(void *arg, const dp_run *r, char *err, size_t errlen);
    void *run_arg;
    /* rings (worker/ring.c): data.rows through shared memory (under mu) */
    dp_ring *rings;
    int nrings; /* read without mu by dp_rings_active */
    uint64_t next_ring;
    int ring_spin_us; /* a ring's thread spins this long after an answer (read-only) */
    int fail_attach;  /* tests: data.shm_attach calls still to answer unavailable (under mu) */
    /* clients' NCCL communicators (worker/nccl_client.c, under mu) */
    struct wnc *wncs;
    uint64_t next_wnc;
    int wnc_threads; /* their threads still running */
    /* counters (under mu) */
    uint64_t rows_in_total, bytes_in_total, tickets_expired_total, regions_attached_total;
} dp_table;

/* dp_open initialises t on loop (timer and async handles). */
moe_err dp_open(dp_table *t, uv_loop_t *loop, size_t max_staged_bytes, size_t max_mapped_bytes,
                const char *auth_token);
/* dp_stop (any thread): the worker is stopping; a dp_take waiting for rows
 * that may never come returns at once (NULL), as at its deadline. */
void dp_stop(dp_table *t);
/* dp_close answers every waiting ticket (unavailable), unmaps every region
 * and closes the handles (run the loop once more to release them). */
void dp_close(dp_table *t);

/* dp_counters: what the data plane holds now and has taken in so far. */
typedef struct dp_counters {
    int64_t tickets, regions;
    uint64_t staged_bytes, mapped_bytes, rows_in_total, bytes_in_total, tickets_expired_total;
    int64_t bulk_conns, bulk_parked; /* open bulk connections, rows waiting for data.rows */
    uint64_t bulk_in_total;          /* transfers received on bulk connections */
    int64_t rings;                   /* rings watched (data.ring_attach) */
} dp_counters;
void dp_get_counters(dp_table *t, dp_counters *out);

/* ---- rings (worker/ring.c) and the table's parts they use ---- */
/* dp_on_ring_attach: the data.ring_attach handler (loop thread). */
void dp_on_ring_attach(dp_table *t, rpc_call *c);
/* dp_rows_call: the data.rows handler, for a socket's call or a ring's
 * local call (any thread; takes mu). */
void dp_rows_call(dp_table *t, rpc_call *c);
/* dp_rings_stop_region (mu held): the rings in region g stop; each thread
 * answers what it runs, then gives its reference on g back. */
void dp_rings_stop_region(dp_table *t, dp_region *g);
/* dp_rings_wait: waits (at most timeout_ms) until no ring thread runs. */
void dp_rings_wait(dp_table *t, int timeout_ms);
/* dp_rings_active: a ring is watched now (a hint: no lock). */
int dp_rings_active(dp_table *t);
/* region references for the rings (mu held): find a region of connection
 * pipe (its mapping, size and kind out), hold and release a reference (the
 * last release of a dropped region unmaps it). */
dp_region *dp_region_find_locked(dp_table *t, uint32_t pipe, uint64_t id, uint8_t **base,
                                 size_t *size, int *cuda);
void dp_region_hold_locked(dp_region *g);
void dp_region_release_locked(dp_table *t, dp_region *g);

/* ---- the NCCL path's side (worker/nccl_client.c) ---- */
/* dp_ncclbuf_region: a region of n bytes of device memory dev on GPU device
 * (a communicator's buffer; not in the table's list): refs 1, the
 * caller's. Freed (cudaFree) with its last reference once abandoned. NULL
 * when out of memory. */
dp_region *dp_ncclbuf_region(int device, void *dev, size_t n);
/* dp_region_abandon_locked: the owner drops g; freed with its last ref. */
void dp_region_abandon_locked(dp_table *t, dp_region *g);
uint8_t *dp_region_base(const dp_region *g);
/* dp_rows_file files a ticket whose x is in place (tk->x, region set),
 * as data.rows does, and starts the lane's run when run is not NULL; on a
 * refusal tk is answered and freed (any thread; takes mu). */
void dp_rows_file(dp_table *t, dp_ticket *tk, const dp_run *run);
/* dp_nccl_y_piece queues piece `piece` of tk's y (rows of its NCCL
 * buffer, common/nccl_pieces.h) for sending to the client; pieces go in
 * order (piece == tk->nccl_ysent, which it advances). Called by the lane's
 * piece loop as each piece's forward is done, and by the answer for the
 * pieces not queued yet. MOE_EUNAVAIL: the communicator failed (nothing
 * queued); MOE_EINVAL: a piece out of order. */
moe_err dp_nccl_y_piece(dp_ticket *tk, int piece);
/* dp_ticket_discard answers a ticket never filed with an error and frees it
 * (releasing what it holds; takes mu). */
void dp_ticket_discard(dp_table *t, dp_ticket *tk, moe_err e, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- the bulk path's side (worker/bulk.c; the table's mu inside) ---- */
/* dp_bulk_reserve counts n bytes of rows on their way in staged_bytes:
 * MOE_EBUSY (reason in err) beyond --data-staged-mb. */
moe_err dp_bulk_reserve(dp_table *t, size_t n, char *err, size_t errlen);
/* dp_bulk_unreserve gives back what dp_bulk_reserve counted. */
void dp_bulk_unreserve(dp_table *t, size_t n);
/* dp_bulk_park files received rows (b->reserved bytes counted) until a
 * data.rows claims them or park_deadline_ns; refs becomes 1 (the caller's).
 * MOE_EPRECOND when the ticket is already here. */
moe_err dp_bulk_park(dp_table *t, dp_bulk *b, char *err, size_t errlen);
/* dp_bulk_unpark drops b from the parked list if it is still there
 * (unreserving its bytes): 1 if it was parked. With dead, b is marked
 * gone (its answer goes nowhere; the wake fd is no longer written). */
int dp_bulk_unpark(dp_table *t, dp_bulk *b, int dead);
/* dp_bulk_put drops the caller's reference; the last one frees b and buf. */
void dp_bulk_put(dp_table *t, dp_bulk *b);
/* dp_bulk_conn_count adds d to the open bulk connections (ping). */
void dp_bulk_conn_count(dp_table *t, int d);

/* dp_method: a row of the data-plane endpoint's method table (dp_methods:
 * data.rows, data.cancel, data.shm_attach/detach, data.cuda_attach/detach,
 * ping) */
typedef struct dp_method {
    rpc_method m;
    void (*fn)(dp_table *t, rpc_call *c);
} dp_method;
extern const dp_method dp_methods[];
extern const int dp_nmethods;

/* dp_on_request checks the auth token and runs the call's row of
 * dp_methods (loop thread); it answers errors itself. */
void dp_on_request(dp_table *t, rpc_call *c);
/* dp_on_pipe_closed: rpcsrv's connection-close hook (nng thread). */
void dp_on_pipe_closed(uint32_t pipe, void *arg);

/* dp_take waits until the ticket (cid, seq) has arrived, or until
 * deadline_ns; returns it (taken: the caller answers it with dp_answer_* and
 * then dp_release), or NULL on timeout (compute thread). */
dp_ticket *dp_take(dp_table *t, uint64_t cid, uint64_t seq, uint64_t deadline_ns);
/* dp_answer_f32 answers the ticket with y (R,H) given as floats, converted
 * to the ticket's dtype (inline, or written into its region). */
void dp_answer_f32(dp_ticket *tk, const float *y, int64_t rows, int64_t H);
/* dp_answer_raw answers with y (R,H) already in the ticket's dtype. */
void dp_answer_raw(dp_ticket *tk, const void *y, int64_t rows, int64_t H);
/* dp_answer_begin starts tk's answer in w (initialised by the caller):
 * the response head and a map of npairs pairs, which the caller writes
 * next, with no y (a fan-out forward's rows, worker/fanout.c: written once,
 * straight into the answer); 0 when tk is answered already (refused).
 * dp_answer_end sends it (an error answer when w failed); w stays the
 * caller's to free. */
int dp_answer_begin(dp_ticket *tk, mp_writer *w, uint32_t npairs);
void dp_answer_end(dp_ticket *tk, mp_writer *w);
/* dp_answer_err answers the ticket with an error. */
void dp_answer_err(dp_ticket *tk, moe_err e, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* dp_ticket_set_extra attaches npairs encoded key/value pairs (copied) to
 * tk's answer map. MOE_ENOMEM when the copy fails. */
moe_err dp_ticket_set_extra(dp_ticket *tk, const void *pairs, size_t len, uint32_t npairs);
/* dp_release frees an answered ticket (and its reference to its region). */
void dp_release(dp_table *t, dp_ticket *tk);
/* dp_y_ptr: where y (R,H) should be written for the ticket: its place in
 * the shared region (device memory when dp_y_on_device), or NULL for
 * inline answers. */
void *dp_y_ptr(const dp_ticket *tk);
/* dp_x_on_device / dp_y_on_device: x / y lie in a client's GPU buffer
 * (data.cuda_attach): device pointers of the worker's GPU. */
int dp_x_on_device(const dp_ticket *tk);
int dp_y_on_device(const dp_ticket *tk);

/* ---- a job's pieces: the rows of several tickets, in order ---- */
typedef struct dp_batch {
    int n;                /* pieces */
    dp_ticket **tk;       /* (n) NULL where the rows did not arrive */
    int64_t *rows;        /* (n) rows the coordinator announced for each piece */
    moe_tensor x;         /* (T,H) the pieces' rows that arrived, concatenated */
    uint8_t *xbuf;        /* owned: the concatenation when n > 1, or host rows of a GPU buffer */
    int x_device;         /* x is device memory (one piece in a CUDA IPC region) */
    int x_pieces;         /* > 1: x (one ticket's, over NCCL) is still arriving in this many
                           * pieces: piece i is read only after wnc_x_piece_wait(tk[0], i)
                           * (DP_GATHER_PIECES); else every row is in */
    int64_t *refused_row; /* (n) first non-finite row of a piece refused, else -1 */
    int missing;          /* pieces whose rows did not arrive */
} dp_batch;

/* dp_batch_gather flags: DP_GATHER_DEVICE: x may stay in a client's GPU
 * buffer; DP_GATHER_PIECES (with DEVICE): the caller computes a single
 * ticket's rows piece by piece as they arrive over NCCL (b->x_pieces). */
#define DP_GATHER_DEVICE 1
#define DP_GATHER_PIECES 2
/* dp_batch_gather reads the job's pieces ([[cid, seq, rows], ...] at r),
 * takes their tickets (waiting until deadline_ns) and builds b->x of dtype
 * dt and width H. With DP_GATHER_DEVICE and a single piece in a client's
 * GPU buffer, b->x is that device memory (b->x_device set); otherwise rows
 * on a GPU are copied to the host. Rows arriving over NCCL in pieces are
 * waited for whole here, unless DP_GATHER_PIECES leaves that to the caller
 * (b->x_pieces); a ticket whose pieces never come is answered with the
 * error and counts as missing. A ticket whose rows are not (rows, H) of
 * dtype dt is answered invalid_argument and counts as missing. Errors:
 * MOE_EINVAL (malformed pieces), MOE_ENOMEM. */
moe_err dp_batch_gather(dp_table *t, mp_reader *r, moe_dtype dt, int64_t H, uint64_t deadline_ns,
                        int flags, dp_batch *b, char *err, size_t errlen);
/* dp_batch_refuse_nonfinite looks at the rows of x (T,H) floats (the
 * batch's rows, in order) piece by piece: a piece with a NaN or Inf is
 * answered invalid_argument (naming its first such row), its rows are set
 * to zero so the math of the others stays finite, and it is reported in
 * dp_batch_write_refused. Returns the number of pieces refused. */
int dp_batch_refuse_nonfinite(dp_batch *b, float *x, int64_t H);
/* dp_batch_write_refused writes [[piece, row], ...] of the refused pieces. */
void dp_batch_write_refused(mp_writer *w, const dp_batch *b);
/* dp_batch_answer_f32 sends each piece its rows of y (T,H) floats. */
void dp_batch_answer_f32(dp_batch *b, const float *y, int64_t H);
/* dp_batch_answer_raw: the same with y already in the batch's dtype. */
void dp_batch_answer_raw(dp_batch *b, const void *y, int64_t H);
/* dp_batch_fail answers every piece still held with the error. */
void dp_batch_fail(dp_batch *b, moe_err e, const char *msg);
/* dp_batch_write_missing writes the indices of the missing pieces (array). */
void dp_batch_write_missing(mp_writer *w, const dp_batch *b);
/* dp_batch_free answers what is left (internal error), releases tickets. */
void dp_batch_free(dp_table *t, dp_batch *b);

#endif
