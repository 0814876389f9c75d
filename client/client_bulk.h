/*
 * client_bulk.h - libmoe's side of the bulk path (internal): a rank's rows
 * go to its worker on a plain TCP connection (header, then the bytes
 * straight from the caller's memory), and its output rows come back on the
 * same connection straight into the caller's memory; the control
 * (data.rows with bulk: true) stays on nng (client_dp.c).
 * docs/PROTOCOL.md ("Data plane", "7. Bulk rows") has the bytes.
 *
 * A transfer runs on its own thread: send x, read the ack (the caller
 * waits for it before sending data.rows), then read y or the error. A
 * large transfer may be split by rows over several connections (parts),
 * one thread each, so that several cores move its bytes at once.
 * Connections are kept per worker (a small pool) and reused.
 */
#ifndef MOE_CLIENT_BULK_H
#define MOE_CLIENT_BULK_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"
#include "proto/bulk_wire.h"

#define MOE_BULK_POOL_MAX MOE_BULK_MAX_PARTS /* idle connections kept per worker */

/* moe_bulk_pool: idle connections to one worker's bulk endpoint. */
typedef struct moe_bulk_pool {
    char url[256]; /* "tcp://host:port" */
    pthread_mutex_t mu;
    int idle[MOE_BULK_POOL_MAX];
    int nidle;
} moe_bulk_pool;

/* moe_bulk_pool_init: no connection yet; url copied. */
void moe_bulk_pool_init(moe_bulk_pool *p, const char *url);
/* moe_bulk_pool_fini closes the idle connections. */
void moe_bulk_pool_fini(moe_bulk_pool *p);

struct moe_bulk_xfer;
/* moe_bulk_part: one connection's share of a transfer (private) */
typedef struct moe_bulk_part {
    struct moe_bulk_xfer *t;
    int idx;              /* part number */
    int64_t row0, rows;   /* its rows of x and of y */
    int fd, state, got_y; /* state: 0 sending, 1 acked, 2 ended (under t->mu) */
    int started;          /* its thread runs */
    moe_err e;            /* its error */
    char msg[300];
    pthread_t th;
} moe_bulk_part;

/* moe_bulk_xfer: one rank's rows out and back. The caller fills the
 * inputs, then moe_bulk_start, moe_bulk_wait_ack, moe_bulk_finish. */
typedef struct moe_bulk_xfer {
    /* in (borrowed until moe_bulk_finish) */
    moe_bulk_pool *pool;
    const char *auth; /* NULL = none */
    uint64_t cid, seq;
    moe_dtype dt;
    int64_t rows, cols;
    const void *x; /* (rows, cols) of dt */
    void *y;       /* (rows, cols) of dt: written by the transfer's threads */
    int timeout_ms;
    int parts; /* connections to split it over: 0 or 1 = one; at most
                * MOE_BULK_MAX_PARTS and rows */
    /* out: the transfer's error (the first part's that failed), its text */
    moe_err e;
    char msg[300];
    /* private */
    int started, aborted, nparts;
    moe_bulk_part part[MOE_BULK_MAX_PARTS];
    pthread_mutex_t mu; /* the parts' fd and state, aborted */
    pthread_cond_t cv;  /* a part's state changed */
} moe_bulk_xfer;

/* moe_bulk_start starts the transfer's thread. */
moe_err moe_bulk_start(moe_bulk_xfer *t);
/* moe_bulk_wait_ack waits until the worker has the rows (MOE_OK) or the
 * transfer failed (its error; the text in t->msg). */
moe_err moe_bulk_wait_ack(moe_bulk_xfer *t);
/* moe_bulk_finish ends the transfer: with abort, the connection is shut
 * (the worker drops whatever it holds of it); else y is awaited. The
 * connection goes back to the pool only after a clean y. Returns t->e
 * (MOE_OK: y holds the output rows). A transfer never started is a no-op. */
moe_err moe_bulk_finish(moe_bulk_xfer *t, int abort);

#endif
