/*
 * methods.c - the worker's RPC methods (the endpoint the coordinator calls)
 * as one table: name, flags, handler. Rows flagged RPC_COMPUTE run on the
 * compute thread in arrival order (the cluster's job order); the others on
 * the loop thread at once. docs/PROTOCOL.md's table is checked against
 * this one (tests/unit/test_methods.c).
 */
#include "common/log.h"
#include "common/params.h"
#include "worker/worker.h"
#include "worker/xchg.h"

static void wkr_ping(wkr *w, rpc_call *c)
{
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 2);
    mp_write_cstr(&wr, "role");
    mp_write_cstr(&wr, "worker");
    mp_write_cstr(&wr, "backend");
    mp_write_cstr(&wr, w->backend);
    rpc_reply(c, &wr);
}

/* worker.abort {generation}: the coordinator says a member of that
 * generation is gone; the collectives of it stop waiting now (answered on
 * the loop thread: the compute thread may be inside one) */
static void wkr_abort(wkr *w, rpc_call *c)
{
    int64_t gen = 0;
    char err[256];
    pspec sp[] = {{"generation", P_INT, &gen, true, 1, 9e18, 0, false}};
    mp_reader r = c->req.params;
    (void)w;
    moe_err e = params_parse(&r, c->req.nparams, sp, 1, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    int current = (uint64_t)gen == xchg_generation();
    if (current) {
        LOG_W("generation %lld given up by the coordinator (a member is gone)", (long long)gen);
        xchg_request_abort((uint64_t)gen);
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 1);
    mp_write_cstr(&wr, "aborted");
    mp_write_bool(&wr, current != 0);
    rpc_reply(c, &wr);
}

enum { COMPUTE = RPC_COMPUTE | RPC_INTERNAL, LOOP = RPC_INTERNAL, NONE = RPC_NO_PARAMS };

const wkr_method wkr_methods[] = {
    {{"ping", NONE}, wkr_ping},
    {{"worker.abort", LOOP}, wkr_abort},
    {{"worker.xchg_id", COMPUTE | NONE}, wkr_op_xchg_id},
    {{"worker.join", COMPUTE}, wkr_op_join},
    {{"worker.model_create", COMPUTE}, wkr_op_model_create},
    {{"worker.model_delete", COMPUTE}, wkr_op_model_delete},
    {{"worker.forward", COMPUTE}, wkr_op_forward},
    {{"worker.backward", COMPUTE}, wkr_op_backward},
    {{"worker.step", COMPUTE}, wkr_op_step},
    {{"worker.checkpoint_save", COMPUTE}, wkr_op_ckpt_save},
    {{"worker.checkpoint_load", COMPUTE}, wkr_op_ckpt_load},
    {{"worker.grads", COMPUTE}, wkr_op_grads},
};
const int wkr_nmethods = (int)(sizeof(wkr_methods) / sizeof(wkr_methods[0]));

void wkr_dispatch(wkr *w, rpc_call *c)
{
    const moe_rpc_request *q = &c->req;
    const wkr_method *m =
        rpc_method_find(wkr_methods, wkr_nmethods, sizeof(*m), q->method, q->method_len);
    char err[256];
    moe_err e;
    if (!m)
        rpc_reply_err(c, MOE_ENOMETHOD, "unknown worker method '%.*s'",
                      (int)(q->method_len > 64 ? 64 : q->method_len), q->method);
    else if ((m->m.flags & RPC_INTERNAL) && !rpc_cluster_ok(q, w->cluster_secret))
        rpc_reply_err(c, MOE_EUNAUTH,
                      "'%s' is internal: missing or wrong cluster secret (params key \"cluster\")",
                      m->m.name);
    else if ((e = rpc_method_check_params(&m->m, q, err, sizeof(err))) != MOE_OK)
        rpc_reply_err(c, e, "%s", err);
    else if (m->m.flags & RPC_COMPUTE)
        wkr_enqueue(w, c, m);
    else
        m->fn(w, c);
}
