/*
 * methods.c - the coordinator's RPC methods as one table (name, flags,
 * handler) and the dispatch around it: auth, exactly-once, drain.
 * Adding a method is a row here and a handler; docs/PROTOCOL.md's method
 * tables are checked against this one (tests/unit/test_methods.c).
 */
#include <string.h>

#include "server/coord.h"
#include "common/log.h"
#include "common/params.h"

static void coord_ping(coord *c, rpc_call *call)
{
    (void)c;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    mp_write_map(&w, 3);
    mp_write_cstr(&w, "role");
    mp_write_cstr(&w, "coordinator");
    mp_write_cstr(&w, "version");
    mp_write_cstr(&w, MOE_VERSION_STRING);
    mp_write_cstr(&w, "time_ns");
    mp_write_u64(&w, rpc_now_ns());
    rpc_reply(call, &w);
}

void coord_start_drain(coord *c, const char *why)
{
    if (c->draining)
        return;
    LOG_I("%s: draining (%d queued jobs)", why, c->qlen);
    c->draining = 1;
    c->drain_started_ns = rpc_now_ns();
}

static void coord_drain(coord *c, rpc_call *call)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    mp_write_map(&w, 0);
    rpc_reply(call, &w);
    coord_start_drain(c, "drain requested");
}

enum {
    MUT = RPC_MUTATING,
    MUT_TRAIN = RPC_MUTATING_IF_TRAIN,
    NO_DRAIN = RPC_REFUSED_DRAINING,
    INTERNAL = RPC_INTERNAL,
    NONE = RPC_NO_PARAMS,
};

const coord_method coord_methods[] = {
    {{"ping", NONE}, coord_ping},
    {{"cluster.status", NONE}, coord_cluster_status},
    {{"dataplane.info", NONE}, coord_dataplane_info},
    {{"stats", NONE}, coord_stats},
    {{"model.info", 0}, coord_model_info},
    {{"model.create", MUT | NO_DRAIN}, coord_model_create},
    {{"model.delete", MUT | NO_DRAIN}, coord_model_delete},
    {{"model.grads", 0}, coord_grads},
    {{"forward", MUT_TRAIN | NO_DRAIN}, coord_forward},
    {{"backward", MUT | NO_DRAIN}, coord_backward},
    {{"optimizer.step", MUT | NO_DRAIN}, coord_step},
    {{"checkpoint.save", MUT}, coord_ckpt_save},
    {{"checkpoint.load", MUT | NO_DRAIN}, coord_ckpt_load},
    {{"drain", NONE}, coord_drain},
    {{"worker.register", INTERNAL}, coord_worker_register},
    {{"worker.heartbeat", INTERNAL}, coord_worker_heartbeat},
};
const int coord_nmethods = (int)(sizeof(coord_methods) / sizeof(coord_methods[0]));

void coord_dispatch(coord *c, dedupe *d, rpc_call *call)
{
    const moe_rpc_request *q = &call->req;
    c->requests_total++;
    if (c->auth_token[0]) {
        const char *tok;
        uint32_t len;
        if (!params_find_str(&q->params, q->nparams, "auth", &tok, &len) ||
            !mp_str_eq(tok, len, c->auth_token)) {
            coord_count_error(c, MOE_EUNAUTH);
            rpc_reply_err(call, MOE_EUNAUTH, "missing or wrong auth token");
            return;
        }
    }
    const coord_method *m =
        rpc_method_find(coord_methods, coord_nmethods, sizeof(*m), q->method, q->method_len);
    if (!m) {
        coord_count_error(c, MOE_ENOMETHOD);
        rpc_reply_err(call, MOE_ENOMETHOD, "unknown method '%.*s'",
                      (int)(q->method_len > 64 ? 64 : q->method_len), q->method);
        return;
    }
    /* internal methods: only the cluster's own daemons know the secret */
    if ((m->m.flags & RPC_INTERNAL) && !rpc_cluster_ok(q, c->cluster_secret)) {
        coord_count_error(c, MOE_EUNAUTH);
        rpc_reply_err(call, MOE_EUNAUTH,
                      "'%s' is internal: missing or wrong cluster secret (params key \"cluster\")",
                      m->m.name);
        return;
    }
    if (m->m.flags & RPC_INTERNAL) /* a worker's: its heartbeats may be rarer than the bound */
        rpcsrv_pipe_keep(c->srv, rpc_call_pipe(call));
    char err[256];
    moe_err e = rpc_method_check_params(&m->m, q, err, sizeof(err));
    if (e != MOE_OK) {
        coord_count_error(c, e);
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    /* the byte budget: the request messages held by the calls in progress
     * (this one included) stay within --max-inflight-mb; the cluster's own
     * small calls are never refused by it */
    uint64_t held = rpcsrv_held_bytes(c->srv);
    if (!(m->m.flags & RPC_INTERNAL) && held > ((uint64_t)c->max_inflight_mb << 20)) {
        coord_count_error(c, MOE_EBUSY);
        c->busy_total++;
        c->busy_bytes_total++;
        rpc_reply_err(call, MOE_EBUSY,
                      "busy: requests in progress hold %llu MiB (--max-inflight-mb %lld)",
                      (unsigned long long)(held >> 20), c->max_inflight_mb);
        return;
    }
    /* exactly-once: a duplicate (same "rid") of a mutating request gets the
     * original's reply and does not run again (dedupe.h) */
    if (dedupe_begin(d, call, &m->m))
        return;
    if (c->draining && (m->m.flags & RPC_REFUSED_DRAINING)) {
        coord_count_error(c, MOE_EUNAVAIL);
        rpc_reply_err(call, MOE_EUNAVAIL, "coordinator is draining");
        return;
    }
    m->fn(c, call);
}
