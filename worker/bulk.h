/*
 * bulk.h - the worker's bulk listener: large rows from clients on plain
 * TCP connections, beside the nng client endpoint that keeps the control
 * (docs/PROTOCOL.md, "Data plane", "7. Bulk rows"; the headers are
 * proto/bulk.h).
 *
 * One thread accepts; each connection has its own thread (at most
 * max_conns of them), which serves one transfer at a time: header, rows
 * read straight into a pool buffer, ack; then the rows wait in the data
 * plane's table (dp_bulk_park) for the data.rows that names them, and the
 * thread waits for their answer (y written back from the same buffer, or
 * an error header). A read or write that stalls for timeout_ms, a bad
 * header, or the client going away ends the connection; whatever it held
 * is given back (staged bytes, the buffer).
 */
#ifndef MOE_WKR_BULK_H
#define MOE_WKR_BULK_H

#include <stddef.h>

#include "worker/dataplane.h"

typedef struct wkr_bulk wkr_bulk;

typedef struct wkr_bulk_opts {
    const char *url;        /* "tcp://host:port" to listen on (port 0 = any) */
    dp_table *dp;           /* the data plane the rows go to (borrowed) */
    size_t max_bytes;       /* largest transfer (--max-msg-mb) */
    int timeout_ms;         /* a read or write that makes no progress this long fails */
    int park_ms;            /* rows not named by a data.rows within this are dropped */
    int idle_ms;            /* a connection with no transfer for this long is closed */
    int max_conns;          /* open connections; more are closed at once */
    const char *auth_token; /* "" or NULL = none; else every header must carry it (borrowed) */
} wkr_bulk_opts;

/* wkr_bulk_open listens and starts the accept thread; the bound address
 * ("tcp://host:port") goes to bound. MOE_EINVAL for a bad url, MOE_EIO
 * when it cannot listen. */
moe_err wkr_bulk_open(const wkr_bulk_opts *o, wkr_bulk **out, char *bound, size_t boundlen);
/* wkr_bulk_close stops accepting, ends every connection and waits for
 * their threads (bounded); NULL is a no-op. */
void wkr_bulk_close(wkr_bulk *b);

#endif
