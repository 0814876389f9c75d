/*
 * rpcsrv.h - an async msgpack-rpc endpoint on an nng rep0 socket, feeding a
 * libuv loop. Used by the coordinator (clients and workers call it) and by
 * each worker (the coordinator calls it).
 *
 * nctx nng contexts each wait for one request. nng callbacks never block:
 * a received message is pushed onto a mutex-protected queue and the loop is
 * woken with uv_async_send; the loop drains the whole queue, parses each
 * request and hands it to the handler. Malformed requests are answered here
 * with the error code and the echoed msgid; the handler never sees them.
 */
#ifndef MOE_RPCSRV_H
#define MOE_RPCSRV_H

#include <stdint.h>
#include <uv.h>

#include "proto/proto.h"
#include "common/tls.h"

typedef struct rpcsrv rpcsrv;

typedef struct rpc_call rpc_call;

/* rpc_reply_hook: runs once, with the complete encoded response, when the
 * call is answered (rpc_reply, rpc_reply_err or rpc_reply_bytes), on the
 * thread that answers it, before the bytes are sent and before the call is
 * released (req is still valid). buf is borrowed for the duration of the
 * hook: copy what must outlive it. The hook may answer other calls, not this
 * one. */
typedef void (*rpc_reply_hook)(rpc_call *call, const void *buf, size_t len, void *arg);

/* rpc_call: one in-flight request. Owned by the rpcsrv until the handler
 * answers it with rpc_reply / rpc_reply_err (exactly once, from any thread);
 * after that it must not be touched. */
struct rpc_call {
    moe_rpc_request req; /* read-only: method and params point into the message */
    uint64_t recv_ns;    /* read-only: monotonic time the request arrived */
    void *data;          /* public: for the handler */
    /* public: set by the handler; NULL when the request arrives, and cleared
     * before it runs */
    rpc_reply_hook on_reply;
    void *on_reply_arg;
    /* private */
    struct rpc_slot *slot;
    void *msg;           /* nng_msg *, owns the bytes req points into */
    uint32_t local_pipe; /* a local call's connection (rpc_call_set_pipe) */
};

/* rpc_handler runs on the loop thread for every well-formed request. */
typedef void (*rpc_handler)(rpc_call *call, void *arg);

typedef struct rpcsrv_opts {
    const char *url; /* listen address, e.g. tcp://127.0.0.1:7000 (port 0 = any) */
    int nctx;        /* concurrent requests */
    size_t max_msg;  /* protocol cap: larger messages get "too_large" */
    rpc_handler handler;
    void *handler_arg;
    /* optional: runs on an nng thread when a connection (pipe) closes, with
     * the id rpc_call_pipe reports for its calls; must not block */
    void (*on_pipe_closed)(uint32_t pipe, void *arg);
    /* optional bounds on connections (0 = none). max_conns: connections
     * beyond it are closed as they arrive. idle_timeout_ms (needs
     * max_conns): a connection with no request in progress that completed
     * no message (in either direction) for this long is closed - an idle
     * client, or one that sent part of a message and stalled. A client's
     * next call dials again (libmoe and nng do it by themselves). */
    int max_conns;
    int idle_timeout_ms;
    /* optional: the certificate and key of a tls+tcp:// url (tls.h;
     * borrowed for the call to rpcsrv_open); NULL for other urls */
    const moe_tls_files *tls;
} rpcsrv_opts;

/* rpcsrv_counters: a snapshot of an endpoint's bounds (rpcsrv_counters_get) */
typedef struct rpcsrv_counters {
    uint64_t held_bytes;          /* bytes of requests handed to the handler, not yet answered */
    uint64_t conns;               /* connections open (0 without max_conns) */
    uint64_t conns_refused_total; /* closed at once: max_conns reached */
    uint64_t idle_closed_total;   /* closed by idle_timeout_ms */
} rpcsrv_counters;

/* rpcsrv_open starts listening. bound_url (may be NULL) receives the actual
 * address (useful with port 0). The server is owned by the caller: close it
 * with rpcsrv_close on the loop thread. */
moe_err rpcsrv_open(uv_loop_t *loop, const rpcsrv_opts *o, rpcsrv **out, char *bound_url,
                    size_t bound_len);
/* rpcsrv_close answers requests received but not yet handed to the loop
 * ("unavailable: server is shutting down"), waits up to 5 s for replies still
 * being sent, then stops receiving, aborts pending requests and frees the
 * server (its uv handle is closed; run the loop once more to release it). */
void rpcsrv_close(rpcsrv *s);

/* rpc_reply sends the response in w (a complete msgpack-rpc response built
 * with moe_rpc_write_response_ok_head + result) and releases the call.
 * The writer is left empty. Thread safe. */
void rpc_reply(rpc_call *c, mp_writer *w);
/* rpc_reply_err answers with an error object {code, message}. Thread safe. */
void rpc_reply_err(rpc_call *c, moe_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* rpc_reply_err_gone: the same, the error object carrying "gone" (ngone
 * ranks of workers known dead; proto.h). Thread safe. */
void rpc_reply_err_gone(rpc_call *c, moe_err err, const int *gone, int ngone, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* rpc_reply_bytes answers with a complete, already encoded response (len
 * bytes, copied) and releases the call. Thread safe. */
void rpc_reply_bytes(rpc_call *c, const void *buf, size_t len);

/* rpc_call_pipe returns the id of the connection the call arrived on
 * (nonzero; stable while the connection lives). */
uint32_t rpc_call_pipe(const rpc_call *c);

/* rpc_reply_msg answers with a complete encoded response already in an
 * nng_msg (nng_msg *, ownership passes to the server in every case): the
 * reply is sent without another copy. Thread safe. */
void rpc_reply_msg(rpc_call *c, void *nng_msg);

/* rpc_call_local makes a call that did not come over the network: method
 * with params (an encoded msgpack map of len bytes, copied). A handler
 * answers it like any call (rpc_reply, rpc_reply_err, ...); the encoded
 * answer goes to hook (which must not answer it) and the call is freed.
 * rpc_call_pipe of a local call is 0 (or rpc_call_set_pipe's). NULL when out of memory or params is
 * not a map. For a daemon's internal work that reuses a method's handler. */
rpc_call *rpc_call_local(const char *method, const void *params, size_t len, rpc_reply_hook hook,
                         void *arg);
/* rpc_call_set_pipe: the connection a local call speaks for (what
 * rpc_call_pipe reports), e.g. a request that came through shared memory
 * set up on that connection. */
void rpc_call_set_pipe(rpc_call *c, uint32_t pipe);
/* rpcsrv_held_bytes: the size of the request messages handed to the
 * handler and not yet answered (the handler's call included while it runs).
 * Thread safe. */
uint64_t rpcsrv_held_bytes(const rpcsrv *s);
/* rpcsrv_pipe_keep exempts the connection pipe (rpc_call_pipe) from
 * idle_timeout_ms, e.g. once it proved to be a daemon of the cluster (whose
 * heartbeats may be rarer than the bound). Thread safe. */
void rpcsrv_pipe_keep(rpcsrv *s, uint32_t pipe);
/* rpcsrv_counters_get fills *out. Thread safe. */
void rpcsrv_counters_get(rpcsrv *s, rpcsrv_counters *out);

/* rpc_now_ns returns CLOCK_MONOTONIC in nanoseconds. */
uint64_t rpc_now_ns(void);

#endif
