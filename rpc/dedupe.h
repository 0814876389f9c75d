/*
 * dedupe.h - exactly-once for the coordinator's mutating requests.
 *
 * nng's req0 socket sends a request again when the connection it went out
 * on drops before the reply arrived (NNG_OPT_REQ_RESENDTIME only turns off
 * the timer), so a request can arrive twice. libmoe therefore puts a request
 * id in every request, params "rid": [client_id, seq] (docs/PROTOCOL.md);
 * a resend carries the same bytes, hence the same rid.
 *
 * For a mutating request with a rid (backward, optimizer.step, forward with
 * train: true, checkpoint.save, checkpoint.load, model.create) the reply is
 * remembered under its rid:
 *   - a duplicate that arrives while the original is still in flight waits,
 *     and is answered with the original's reply bytes when it is answered;
 *   - a duplicate that arrives later is answered from the cache, or, when
 *     the reply was not kept (larger than max_reply, or dropped for the byte
 *     bound), with failed_precondition: it never runs a second time.
 * Duplicates must repeat the method and the msgid of the original (a resend
 * does); another request under a used rid gets invalid_argument.
 *
 * Bounds: max_entries rids (answered ones are forgotten oldest first; when
 * every entry is in flight a new request runs without protection, with a
 * warning), max_bytes of kept replies (the oldest replies are dropped first,
 * their rids are still remembered), and replies over max_reply are not kept.
 *
 * Threads: a dedupe belongs to the loop thread. dedupe_begin runs in the
 * request dispatch; the reply hook it installs on the call (rpc_call's
 * on_reply) runs where the call is answered, which in the coordinator is
 * always the loop thread (handlers and finish_job run there).
 */
#ifndef MOE_DEDUPE_H
#define MOE_DEDUPE_H

#include <stddef.h>

#include "rpc/methods.h"
#include "rpc/rpcsrv.h"

#define DEDUPE_MAX_ENTRIES 1024
#define DEDUPE_MAX_BYTES   ((size_t)64 << 20)
#define DEDUPE_MAX_REPLY   ((size_t)16 << 20)
#define DEDUPE_MAX_WAITERS 16 /* duplicates waiting on one original; more get busy */

typedef struct dedupe dedupe;

/* dedupe_new returns an empty cache (NULL when out of memory); the caller
 * owns it (dedupe_free). */
dedupe *dedupe_new(size_t max_entries, size_t max_bytes, size_t max_reply);
/* dedupe_free frees the cache and its replies. It answers nobody: call it
 * after rpcsrv_close, when every original has been answered (and with it its
 * waiting duplicates) or the server has dropped the calls. */
void dedupe_free(dedupe *d);

/* dedupe_begin runs before a request is dispatched (after the auth check),
 * with the method's table row m (which says whether it is mutating).
 * Returns 1 when it answered the call itself (a duplicate, or a malformed
 * "rid"): the caller must not touch it again. Returns 0 when the request is
 * to run as usual; for a mutating request with a new rid it has installed
 * the reply hook on the call, which records the reply and answers the
 * duplicates that wait for it. */
int dedupe_begin(dedupe *d, rpc_call *call, const rpc_method *m);

#endif
