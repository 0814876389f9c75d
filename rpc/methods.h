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
 * checked against these tables by a test (tests/test_methods.c).
 */
#ifndef MOE_RPC_METHODS_H
#define MOE_RPC_METHODS_H

#include <stddef.h>
#include <stdint.h>

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

#endif
