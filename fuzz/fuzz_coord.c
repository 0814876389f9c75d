/*
 * fuzz_coord.c - libFuzzer harness for the coordinator's request handling:
 * each input is one request - its first byte picks a method of the
 * coordinator's table (coord_methods), the rest is its params map - run
 * through coord_dispatch on a coordinator with no workers (so every job is
 * answered at once: not ready), as a local call (rpc_call_local). Besides
 * sanitizer reports it aborts on broken invariants: a request not answered
 * exactly once, or an answer that is not a well-formed response (an error
 * with an empty message or an unknown code included). State persists across
 * inputs (models created, handles, drain), as in a daemon's life.
 */
#include <stdlib.h>
#include <string.h>

#include "server/coord.h"

static coord *C;
static dedupe *D;
static int answered;

static void check(int ok)
{
    if (!ok)
        abort();
}

static void on_answer(rpc_call *call, const void *buf, size_t len, void *arg)
{
    moe_rpc_response resp;
    mp_errbuf eb;
    (void)call, (void)arg;
    answered++;
    check(moe_rpc_parse_response(buf, len, &resp, &eb) == MOE_OK);
    if (resp.err != MOE_OK) {
        check(resp.errmsg_len > 0);
        check(strcmp(moe_err_code(resp.err), "internal") != 0 || resp.err == MOE_EINTERNAL);
    }
}

/* has_rid: the params map has a "rid" key */
static int has_rid(const rpc_call *call)
{
    mp_reader r = call->req.params;
    for (uint32_t i = 0; i < call->req.nparams; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(&r, &k, &kl, NULL) != MOE_OK)
            return 1; /* cannot tell: do not count */
        if (mp_str_eq(k, kl, "rid"))
            return 1;
        if (mp_skip(&r, NULL) != MOE_OK)
            return 1;
    }
    return 0;
}

static void setup(void)
{
    static coord c; /* large (the handle ring): not on the stack */
    C = &c;
    C->expected_workers = 2;
    C->max_inflight_mb = 1024;
    C->max_conns = 1024;
    C->max_msg_mb = 256;
    C->queue_depth = 256;
    C->deadline_ms = 60000;
    C->heartbeat_timeout_ms = 3000;
    C->worker_timeout_ms = 120000;
    C->max_handles = 64;
    C->handle_ttl_ms = 600000;
    C->lane = 1;
    C->batch_max_tokens = 8192;
    C->max_workers = 16;
    C->history_ms = 5000;
    C->drain_timeout_ms = 120000;
    C->hooks = (coord_hooks){.worker_lost = coord_worker_lost, .after_done = coord_maybe_form};
    strcpy(C->xchg_cfg, "auto");
    strcpy(C->cluster_secret, "fuzz-cluster-secret");
    C->started_ns = rpc_now_ns();
    pthread_mutex_init(&C->done_mu, NULL);
    pthread_mutex_init(&C->metrics_mu, NULL);
    for (int i = 0; i < COORD_MAX_WORKERS; i++)
        C->workers[i].rank = -1;
    D = dedupe_new(DEDUPE_MAX_ENTRIES, DEDUPE_MAX_BYTES, DEDUPE_MAX_REPLY);
    check(D != NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    if (!C)
        setup();
    if (len < 1 || len > (1u << 16))
        return 0;
    const coord_method *m = &coord_methods[data[0] % coord_nmethods];
    /* drain and the worker's own methods would end or fill the daemon's
     * life after one input: they are fuzzed with the params layer only */
    if (!strcmp(m->m.name, "drain") || (m->m.flags & RPC_INTERNAL))
        return 0;
    rpc_call *call = rpc_call_local(m->m.name, data + 1, len - 1, on_answer, NULL);
    if (!call)
        return 0; /* params not a map: refused by the decoder, fuzzed there */
    /* with a "rid" a mutating request's answer goes to the exactly-once
     * cache's hook instead (rpc/dedupe.h): not counted here */
    int counted = !has_rid(call), before = answered;
    coord_dispatch(C, D, call);
    check(!counted || answered == before + 1);
    return 0;
}
