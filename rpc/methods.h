/*
 * methods.h - a daemon's RPC methods as data: one table row per method
 * (Redis's command table). Each daemon's table type starts with an
 * rpc_method (name and flags) followed by its typed handler, e.g.
 *
 *     typedef struct coord_method {
 *         rpc_method m;
 *         void (*fn)(coord *c, rpc_call *call);
 *     } coord_method;
 *
 * The dispatch finds the row by name (rpc_method_find), and the flags say
 * what the daemon does around the handler: exactly-once by rid, refusal
 * while draining, the compute thread. docs/PROTOCOL.md's method tables are
 * checked against these tables by a test (tests/unit/test_methods.c).
 */
#ifndef MOE_RPC_METHODS_H
#define MOE_RPC_METHODS_H

#include <stddef.h>
#include <stdint.h>

#include "proto/proto.h"

typedef enum rpc_method_flag {
    /* a repetition would change the outcome: exactly-once by "rid"
     * (rpc/dedupe.h) */
    RPC_MUTATING = 1u << 0,
    /* mutating when its params say "train": true (forward) */
    RPC_MUTATING_IF_TRAIN = 1u << 1,
    /* answered unavailable while the daemon drains */
    RPC_REFUSED_DRAINING = 1u << 2,
    /* called by the cluster's own daemons, not by clients */
    RPC_INTERNAL = 1u << 3,
    /* worker: runs on the compute thread, in arrival order (the cluster's
     * job order); without it, on the loop thread at once */
    RPC_COMPUTE = 1u << 4,
    /* takes no params: a key other than the envelope's ("auth", "rid",
     * "cluster") is invalid_argument, checked by the dispatch */
    RPC_NO_PARAMS = 1u << 5,
} rpc_method_flag;

typedef struct rpc_method {
    const char *name; /* e.g. "optimizer.step" */
    unsigned flags;   /* rpc_method_flag bits */
} rpc_method;

/* rpc_method_find returns the row of table (n rows of stride bytes, each
 * starting with an rpc_method) named name[0..len), or NULL. */
const void *rpc_method_find(const void *table, int n, size_t stride, const char *name,
                            uint32_t len);

/* rpc_method_mutating: whether a call of row m with the given "train" value
 * is exactly-once (RPC_MUTATING, or RPC_MUTATING_IF_TRAIN and train). */
int rpc_method_mutating(const rpc_method *m, int train);

/* rpc_method_check_params: for a row flagged RPC_NO_PARAMS, whether the
 * request's params hold nothing but envelope keys; MOE_OK, or the error
 * (invalid_argument: "unknown parameter 'x'") with its message in err. */
moe_err rpc_method_check_params(const rpc_method *m, const moe_rpc_request *q, char *err,
                                size_t errlen);

/* rpc_cluster_ok: the request carries "cluster": secret (compared in
 * constant time); never true for an empty secret. */
int rpc_cluster_ok(const moe_rpc_request *q, const char *secret);

#endif
