/*
 * methods.c - the coordinator's RPC methods as one table (name, flags,
 * handler) and the dispatch around it: auth, exactly-once, drain.
 * Adding a method is a row here and a handler; docs/PROTOCOL.md's method
 * tables are checked against this one (tests/test_methods.c).
 */
#include <string.h>

#include "coord.h"
#include "log.h"
#include "params.h"

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
    mp_write_cstr(&w, "0.1.0");
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
};

const coord_method coord_methods[] = {
    {{"ping", 0}, coord_ping},
    {{"cluster.status", 0}, coord_cluster_status},
    {{"dataplane.info", 0}, coord_dataplane_info},
    {{"stats", 0}, coord_stats},
    {{"model.info", 0}, coord_model_info},
    {{"model.create", MUT | NO_DRAIN}, coord_model_create},
    {{"forward", MUT_TRAIN | NO_DRAIN}, coord_forward},
    {{"backward", MUT | NO_DRAIN}, coord_backward},
    {{"optimizer.step", MUT | NO_DRAIN}, coord_step},
    {{"checkpoint.save", MUT}, coord_ckpt_save},
    {{"checkpoint.load", MUT | NO_DRAIN}, coord_ckpt_load},
    {{"drain", 0}, coord_drain},
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
