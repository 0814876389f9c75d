/*
 * test_dedupe.c - exactly-once for mutating requests (server/dedupe.c):
 * the SAME raw request bytes (same "rid") sent twice, as nng's req0 does
 * when a connection drops before the reply, against a real cluster.
 *   - optimizer.step: the step count advances once, both replies identical;
 *   - forward train=true and backward: the same handle, the same dx;
 *   - a duplicate that arrives while the original is in flight (two
 *     contexts, queued behind a slow forward) waits and gets the same bytes;
 *   - a reply over the cache's per-reply bound is not kept: a late duplicate
 *     gets failed_precondition instead of running again;
 *   - requests without rid behave as before; rid on ping is accepted (and
 *     not deduplicated); malformed or reused rids are refused.
 */
#include <criterion/criterion.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

#define H 64

/* ---- raw req0 requests ---- */

typedef struct raw_reply {
    uint8_t *buf; /* owned (nng_free) */
    size_t len;
    moe_rpc_response resp;
    int rv; /* nng error of send/recv, 0 if a reply came */
} raw_reply;

static nng_socket raw_open(const char *url)
{
    nng_socket s;
    cr_assert_eq(nng_req0_open(&s), 0);
    nng_socket_set_ms(s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, 30000);
    nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, 5000);
    nng_socket_set_size(s, NNG_OPT_RECVMAXSZ, (size_t)64 << 20);
    int rv = nng_dial(s, url, NULL, 0);
    cr_assert_eq(rv, 0, "dial %s: %s", url, nng_strerror(rv));
    return s;
}

static void parse(raw_reply *r)
{
    mp_errbuf eb = {{0}};
    moe_err e = moe_rpc_parse_response(r->buf, r->len, &r->resp, &eb);
    cr_assert_eq(e, MOE_OK, "the server's reply does not parse: %s", eb.msg);
}

/* raw_call sends the bytes of w and waits for one reply. */
static void raw_call(nng_socket s, const mp_writer *w, raw_reply *r)
{
    memset(r, 0, sizeof(*r));
    r->rv = nng_send(s, w->buf, w->len, 0);
    if (r->rv == 0)
        r->rv = nng_recv(s, &r->buf, &r->len, NNG_FLAG_ALLOC);
    cr_assert_eq(r->rv, 0, "no reply: %s", nng_strerror(r->rv));
    parse(r);
}

static void raw_free(raw_reply *r)
{
    if (r->buf)
        nng_free(r->buf, r->len);
    r->buf = NULL;
}

static void expect_ok(const raw_reply *r, const char *what)
{
    cr_assert_eq(r->resp.err, MOE_OK, "%s: %s: %.*s", what, moe_err_code(r->resp.err),
                 (int)r->resp.errmsg_len, r->resp.errmsg ? r->resp.errmsg : "");
}

static void expect_err(const raw_reply *r, moe_err want, const char *sub, const char *what)
{
    cr_assert_eq(r->resp.err, want, "%s: got %s (%.*s), want %s", what, moe_err_code(r->resp.err),
                 (int)r->resp.errmsg_len, r->resp.errmsg ? r->resp.errmsg : "", moe_err_code(want));
    if (sub) {
        char msg[600];
        snprintf(msg, sizeof(msg), "%.*s", (int)r->resp.errmsg_len, r->resp.errmsg);
        cr_assert(strstr(msg, sub), "%s: message '%s' lacks '%s'", what, msg, sub);
    }
    cr_log_info("%s -> %s: %.*s", what, moe_err_code(want), (int)r->resp.errmsg_len,
                r->resp.errmsg);
}

static void expect_same(const raw_reply *a, const raw_reply *b, const char *what)
{
    cr_assert_eq(a->len, b->len, "%s: replies of %zu and %zu bytes", what, a->len, b->len);
    cr_assert(memcmp(a->buf, b->buf, a->len) == 0, "%s: the replies differ", what);
}

/* req_head: [0, msgid, method, [{rid?, + npairs more}]]; rid NULL = none. */
static void req_head(mp_writer *w, uint32_t msgid, const char *method, uint32_t npairs,
                     const uint64_t *rid)
{
    mp_writer_init(w);
    moe_rpc_write_request_head(w, msgid, method);
    mp_write_map(w, npairs + (rid ? 1 : 0));
    if (rid) {
        mp_write_cstr(w, "rid");
        mp_write_array(w, 2);
        mp_write_u64(w, rid[0]);
        mp_write_u64(w, rid[1]);
    }
}

static void step_req(mp_writer *w, uint32_t msgid, const char *model, const uint64_t *rid)
{
    req_head(w, msgid, "optimizer.step", 1, rid);
    mp_write_cstr(w, "model");
    mp_write_cstr(w, model);
}

/* fwd_req: forward of T rows of width h (values from seed), train or not. */
static void fwd_req(mp_writer *w, uint32_t msgid, const char *model, int64_t T, int h, int train,
                    uint64_t seed, const uint64_t *rid)
{
    req_head(w, msgid, "forward", train ? 4 : 3, rid);
    mp_write_cstr(w, "model");
    mp_write_cstr(w, model);
    mp_write_cstr(w, "layer");
    mp_write_i64(w, 0);
    if (train) {
        mp_write_cstr(w, "train");
        mp_write_bool(w, true);
    }
    mp_write_cstr(w, "x");
    int64_t shape[2] = {T, h};
    float *x = moe_tensor_write_reserve(w, MOE_F32, 2, shape);
    cr_assert(x);
    float *tmp = malloc((size_t)T * h * sizeof(float));
    rng_fill_uniform(seed, 1, -1, 1, tmp, (size_t)T * h);
    memcpy(x, tmp, (size_t)T * h * sizeof(float)); /* x is unaligned */
    free(tmp);
}

/* result_int: the int `key` of the result map. */
static int64_t result_int(const raw_reply *r, const char *key)
{
    mp_reader rd = r->resp.result;
    int64_t v = -1;
    cr_assert_eq(mp_map_find(&rd, key), 0, "no '%s' in the result", key);
    cr_assert_eq(mp_read_i64(&rd, &v, NULL), MOE_OK);
    return v;
}

/* ---- cluster helpers ---- */

static cluster *start(int workers)
{
    cluster_opts o = {0};
    o.workers = workers;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    return cl;
}

static void stop(cluster *cl)
{
    cr_assert_eq(cluster_stop(cl), 0, "cluster_stop: %s", cluster_error());
}

static void model_create(cluster *cl, const char *name, int h, int f, int E, int K)
{
    moe_model_config mc = {0};
    mc.name = name;
    mc.layers = 1;
    mc.d_model = h;
    mc.d_ff = f;
    mc.n_experts = E;
    mc.top_k = K;
    mc.seed = 11;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "model.create: %s", moe_last_error());
}

/* fwd_bwd: a train forward and its backward through libmoe (gradients for a step). */
static void fwd_bwd(cluster *cl, const char *model, int T, uint64_t seed)
{
    size_t n = (size_t)T * H;
    float *x = malloc(n * 4), *y = malloc(n * 4), *dx = malloc(n * 4);
    moe_fwd_info info = {0};
    rng_fill_uniform(seed, 2, -1, 1, x, n);
    cr_assert_eq(moe_forward_train(cl->cli, model, 0, MOE_F32, x, T, H, y, &info), MOE_OK,
                 "forward train: %s", moe_last_error());
    cr_assert_eq(moe_backward(cl->cli, info.handle, MOE_F32, y, T, H, dx), MOE_OK, "backward: %s",
                 moe_last_error());
    moe_fwd_info_free(&info);
    free(x);
    free(y);
    free(dx);
}

static int64_t libmoe_step(cluster *cl, const char *model)
{
    moe_adamw opt = {1e-3, 0.9, 0.999, 1e-8, 0, 0, 0, 0};
    int64_t step = -1;
    cr_assert_eq(moe_optimizer_step(cl->cli, model, &opt, &step, NULL), MOE_OK, "step: %s",
                 moe_last_error());
    return step;
}

/* ---- tests ---- */

Test(dedupe, step_twice_applies_once, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start(2);
    model_create(cl, "m", H, 2 * H, 8, 2);
    fwd_bwd(cl, "m", 16, 1);
    nng_socket s = raw_open(cl->url);
    const uint64_t rid[2] = {0x1234567890abcdefull, 7};
    mp_writer w;
    step_req(&w, 7, "m", rid);
    raw_reply a, b, c;
    raw_call(s, &w, &a);
    expect_ok(&a, "step");
    cr_assert_eq(result_int(&a, "step"), 1);
    raw_call(s, &w, &b); /* nng's resend: the same bytes */
    expect_ok(&b, "duplicate step");
    expect_same(&a, &b, "step and its duplicate");
    raw_call(s, &w, &c); /* again: still from the cache */
    expect_same(&a, &c, "step and a second duplicate");
    /* the model is at step 1: the next step is 2 */
    fwd_bwd(cl, "m", 16, 2);
    cr_assert_eq(libmoe_step(cl, "m"), 2, "the duplicate step was applied");
    raw_free(&a);
    raw_free(&b);
    raw_free(&c);
    mp_writer_fini(&w);
    nng_close(s);
    stop(cl);
}

Test(dedupe, train_forward_and_backward_twice, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start(2);
    model_create(cl, "m", H, 2 * H, 8, 2);
    nng_socket s = raw_open(cl->url);
    const int T = 24;
    const uint64_t rid_f[2] = {42, 1}, rid_b[2] = {42, 2};
    mp_writer wf, wb;
    raw_reply f1, f2, b1, b2;
    fwd_req(&wf, 1, "m", T, H, 1, 3, rid_f);
    raw_call(s, &wf, &f1);
    expect_ok(&f1, "train forward");
    raw_call(s, &wf, &f2);
    expect_same(&f1, &f2, "train forward and its duplicate"); /* one handle */
    int64_t handle = result_int(&f1, "handle");
    cr_assert_gt(handle, 0);

    req_head(&wb, 2, "backward", 2, rid_b);
    mp_write_cstr(&wb, "handle");
    mp_write_i64(&wb, handle);
    mp_write_cstr(&wb, "dy");
    int64_t shape[2] = {T, H};
    float dy[24 * H];
    rng_fill_uniform(4, 1, -1, 1, dy, (size_t)T * H);
    memcpy(moe_tensor_write_reserve(&wb, MOE_F32, 2, shape), dy, sizeof(dy));
    raw_call(s, &wb, &b1);
    expect_ok(&b1, "backward");
    raw_call(s, &wb, &b2);
    expect_ok(&b2, "duplicate backward"); /* not "already used": the trainer keeps dx */
    expect_same(&b1, &b2, "backward and its duplicate");
    mp_reader rd = b2.resp.result;
    moe_tensor dx;
    cr_assert_eq(mp_map_find(&rd, "dx"), 0);
    cr_assert_eq(moe_tensor_read(&rd, &dx, NULL), MOE_OK);
    cr_assert_eq(dx.shape[0], T);
    cr_assert_eq(dx.shape[1], H);

    /* a new request for the same handle (another rid) is refused as before */
    raw_reply b3;
    const uint64_t rid_b3[2] = {42, 3};
    mp_writer wb3;
    req_head(&wb3, 3, "backward", 2, rid_b3);
    mp_write_cstr(&wb3, "handle");
    mp_write_i64(&wb3, handle);
    mp_write_cstr(&wb3, "dy");
    memcpy(moe_tensor_write_reserve(&wb3, MOE_F32, 2, shape), dy, sizeof(dy));
    raw_call(s, &wb3, &b3);
    expect_err(&b3, MOE_EPRECOND, "already used", "a second backward of the handle");
    /* the gradients were accumulated once: one step, step 1 */
    cr_assert_eq(libmoe_step(cl, "m"), 1);
    raw_free(&f1);
    raw_free(&f2);
    raw_free(&b1);
    raw_free(&b2);
    raw_free(&b3);
    mp_writer_fini(&wf);
    mp_writer_fini(&wb);
    mp_writer_fini(&wb3);
    nng_close(s);
    stop(cl);
}

/* ctx_send queues the bytes of w on ctx (waits only for the send). */
static void ctx_send(nng_ctx ctx, nng_aio *aio, const mp_writer *w)
{
    nng_msg *m;
    cr_assert_eq(nng_msg_alloc(&m, w->len), 0);
    memcpy(nng_msg_body(m), w->buf, w->len);
    nng_aio_set_msg(aio, m);
    nng_ctx_send(ctx, aio);
    nng_aio_wait(aio);
    cr_assert_eq(nng_aio_result(aio), 0, "send: %s", nng_strerror(nng_aio_result(aio)));
}

static void ctx_recv_wait(nng_aio *aio, raw_reply *r)
{
    memset(r, 0, sizeof(*r));
    nng_aio_wait(aio);
    r->rv = nng_aio_result(aio);
    cr_assert_eq(r->rv, 0, "recv: %s", nng_strerror(r->rv));
    nng_msg *m = nng_aio_get_msg(aio);
    r->len = nng_msg_len(m);
    r->buf = nng_alloc(r->len);
    memcpy(r->buf, nng_msg_body(m), r->len);
    nng_msg_free(m);
    parse(r);
}

static int log_has(const cluster *cl, const char *needle)
{
    char path[400];
    snprintf(path, sizeof(path), "%s/coord.log", cl->dir);
    FILE *f = fopen(path, "r");
    char line[1024];
    int found = 0;
    while (f && !found && fgets(line, sizeof(line), f))
        found = strstr(line, needle) != NULL;
    if (f)
        fclose(f);
    return found;
}

Test(dedupe, duplicate_in_flight, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start(2);
    model_create(cl, "m", H, 2 * H, 8, 2);
    fwd_bwd(cl, "m", 16, 1);
    nng_socket s = raw_open(cl->url);
    nng_ctx ctx[3];
    nng_aio *aio[3];
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(nng_ctx_open(&ctx[i], s), 0);
        cr_assert_eq(nng_aio_alloc(&aio[i], NULL, NULL), 0);
        nng_aio_set_timeout(aio[i], 30000);
    }
    /* a slow inference forward first: jobs run in queue order, so the step
     * is still in flight when its duplicate arrives */
    mp_writer wslow, wstep;
    fwd_req(&wslow, 1, "m", 16384, H, 0, 5, NULL);
    const uint64_t rid[2] = {0xfeedull, 9};
    step_req(&wstep, 9, "m", rid);
    ctx_send(ctx[0], aio[0], &wslow);
    ctx_send(ctx[1], aio[1], &wstep);
    ctx_send(ctx[2], aio[2], &wstep);
    for (int i = 0; i < 3; i++)
        nng_ctx_recv(ctx[i], aio[i]);
    raw_reply slow, a, b;
    ctx_recv_wait(aio[0], &slow);
    ctx_recv_wait(aio[1], &a);
    ctx_recv_wait(aio[2], &b);
    expect_ok(&slow, "slow forward");
    expect_ok(&a, "step");
    expect_ok(&b, "step sent twice at once");
    expect_same(&a, &b, "step and its concurrent duplicate");
    cr_assert_eq(result_int(&a, "step"), 1);
    cr_assert(log_has(cl, "waits for the original in flight"),
              "the duplicate did not take the in-flight path");
    /* the job ran once */
    fwd_bwd(cl, "m", 16, 2);
    cr_assert_eq(libmoe_step(cl, "m"), 2, "the duplicate step was applied");
    raw_free(&slow);
    raw_free(&a);
    raw_free(&b);
    mp_writer_fini(&wslow);
    mp_writer_fini(&wstep);
    for (int i = 0; i < 3; i++) {
        nng_aio_free(aio[i]);
        nng_ctx_close(ctx[i]);
    }
    nng_close(s);
    stop(cl);
}

Test(dedupe, large_reply_not_kept, .timeout = 90, .fini = cluster_fini_all)
{
    /* y of a (4200, 1024) f32 train forward is 17.2 MB: over the 16 MiB a
     * reply may take in the cache */
    cluster *cl = start(2);
    model_create(cl, "big", 1024, 32, 4, 1);
    nng_socket s = raw_open(cl->url);
    const uint64_t rid[2] = {77, 1};
    mp_writer w;
    raw_reply a, b;
    fwd_req(&w, 1, "big", 4200, 1024, 1, 6, rid);
    raw_call(s, &w, &a);
    expect_ok(&a, "large train forward");
    cr_assert_gt(a.len, (size_t)16 << 20);
    raw_call(s, &w, &b);
    expect_err(&b, MOE_EPRECOND, "duplicate of a request already answered",
               "late duplicate of a large reply");
    raw_free(&a);
    raw_free(&b);
    mp_writer_fini(&w);
    nng_close(s);
    stop(cl);
}

Test(dedupe, without_rid_as_before, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start(2);
    model_create(cl, "m", H, 2 * H, 8, 2);
    fwd_bwd(cl, "m", 16, 1);
    nng_socket s = raw_open(cl->url);
    mp_writer w;
    raw_reply a, b, p;
    step_req(&w, 3, "m", NULL);
    raw_call(s, &w, &a);
    expect_ok(&a, "step without rid");
    cr_assert_eq(result_int(&a, "step"), 1);
    raw_call(s, &w, &b); /* runs again: no gradients left */
    expect_err(&b, MOE_EPRECOND, "no gradients", "the same step again, without rid");
    mp_writer_fini(&w);
    req_head(&w, 4, "ping", 0, NULL);
    raw_call(s, &w, &p);
    expect_ok(&p, "ping without rid");
    raw_free(&a);
    raw_free(&b);
    raw_free(&p);
    mp_writer_fini(&w);
    nng_close(s);
    stop(cl);
}

Test(dedupe, rid_checks, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start(1);
    model_create(cl, "m", H, 2 * H, 8, 2);
    nng_socket s = raw_open(cl->url);
    mp_writer w;
    raw_reply a, b;
    const uint64_t rid[2] = {5, 5};

    /* ping with a rid: accepted, not deduplicated (a fresh time each time) */
    req_head(&w, 5, "ping", 0, rid);
    raw_call(s, &w, &a);
    expect_ok(&a, "ping with rid");
    raw_call(s, &w, &b);
    expect_ok(&b, "ping with the same rid");
    cr_assert_gt(result_int(&b, "time_ns"), result_int(&a, "time_ns"), "ping was cached");
    raw_free(&a);
    raw_free(&b);
    mp_writer_fini(&w);

    /* a method with strictly checked params accepts it too */
    req_head(&w, 6, "model.info", 1, rid);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    raw_call(s, &w, &a);
    expect_ok(&a, "model.info with rid");
    raw_free(&a);
    mp_writer_fini(&w);

    /* malformed rids */
    static const struct {
        const char *what;
        int kind;
        moe_err want;
    } bad[] = {
        {"rid: a string", 0, MOE_EPROTO},   {"rid: [1]", 1, MOE_EINVAL},
        {"rid: [-1, 2]", 2, MOE_EINVAL},    {"rid: [1, \"a\"]", 3, MOE_EPROTO},
        {"rid given twice", 4, MOE_EINVAL},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        mp_writer_init(&w);
        moe_rpc_write_request_head(&w, 7, "ping");
        mp_write_map(&w, bad[i].kind == 4 ? 2 : 1);
        if (bad[i].kind == 4) {
            mp_write_cstr(&w, "rid");
            mp_write_array(&w, 2);
            mp_write_u64(&w, rid[0]);
            mp_write_u64(&w, rid[1]);
        }
        mp_write_cstr(&w, "rid");
        switch (bad[i].kind) {
        case 0: mp_write_cstr(&w, "x"); break;
        case 1:
            mp_write_array(&w, 1);
            mp_write_u64(&w, 1);
            break;
        case 2:
            mp_write_array(&w, 2);
            mp_write_i64(&w, -1);
            mp_write_u64(&w, 2);
            break;
        case 3:
            mp_write_array(&w, 2);
            mp_write_u64(&w, 1);
            mp_write_cstr(&w, "a");
            break;
        default: /* the same valid rid a second time */
            mp_write_array(&w, 2);
            mp_write_u64(&w, rid[0]);
            mp_write_u64(&w, rid[1]);
            break;
        }
        raw_call(s, &w, &a);
        expect_err(&a, bad[i].want, "rid", bad[i].what);
        raw_free(&a);
        mp_writer_fini(&w);
    }

    /* a used rid under another msgid or method: refused, never run */
    fwd_bwd(cl, "m", 8, 1);
    const uint64_t rs[2] = {6, 1};
    step_req(&w, 1, "m", rs);
    raw_call(s, &w, &a);
    expect_ok(&a, "step");
    raw_free(&a);
    mp_writer_fini(&w);
    step_req(&w, 2, "m", rs);
    raw_call(s, &w, &a);
    expect_err(&a, MOE_EINVAL, "already used by another request", "the rid under another msgid");
    raw_free(&a);
    mp_writer_fini(&w);
    req_head(&w, 1, "checkpoint.save", 2, rs);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    mp_write_cstr(&w, "path");
    mp_write_cstr(&w, cl->dir);
    raw_call(s, &w, &a);
    expect_err(&a, MOE_EINVAL, "already used by another request", "the rid on another method");
    raw_free(&a);
    mp_writer_fini(&w);
    nng_close(s);
    stop(cl);
}

/* The coordinator's own calls to a worker carry a rid too (libmoe adds it):
 * a worker.step resent by the transport is answered again from the
 * worker's reply cache, not run twice. */
Test(dedupe, worker_resent_step_runs_once, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start(1);
    model_create(cl, "m", H, 2 * H, 8, 2);
    fwd_bwd(cl, "m", 16, 1);
    cr_assert_eq(libmoe_step(cl, "m"), 1);
    /* the worker's rpc_url from cluster.status */
    moe_reply st;
    cr_assert_eq(moe_call(cl->cli, "cluster.status", NULL, 0, &st), MOE_OK);
    mp_reader r = mp_reply_reader(&st);
    uint32_t n;
    const char *u;
    uint32_t ul;
    char url[256];
    cr_assert(mp_map_find(&r, "workers") == 0 && mp_read_array(&r, &n, NULL) == MOE_OK && n == 1);
    cr_assert(mp_map_find(&r, "rpc_url") == 0 && mp_read_str(&r, &u, &ul, NULL) == MOE_OK);
    snprintf(url, sizeof(url), "%.*s", (int)ul, u);
    moe_reply_free(&st);
    nng_socket s = raw_open(url);
    const uint64_t rid[2] = {0xfeedfacecafebeefull, 42};
    mp_writer w;
    req_head(&w, 42, "worker.step", 2, rid);
    mp_write_cstr(&w, "cluster"); /* the worker's endpoint requires the secret */
    mp_write_cstr(&w, cl->secret);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    raw_reply a, b;
    raw_call(s, &w, &a);
    expect_ok(&a, "worker.step");
    cr_assert_eq(result_int(&a, "step"), 2);
    raw_call(s, &w, &b); /* the transport's resend: the same bytes */
    expect_ok(&b, "resent worker.step");
    expect_same(&a, &b, "worker.step and its resend");
    /* the worker is at step 2 (not 3): the next step through the service
     * makes the worker's count 3 while the coordinator thinks 2 - so ask the
     * worker directly with a new rid */
    const uint64_t rid2[2] = {0xfeedfacecafebeefull, 43};
    mp_writer w2;
    req_head(&w2, 43, "worker.step", 2, rid2);
    mp_write_cstr(&w2, "cluster");
    mp_write_cstr(&w2, cl->secret);
    mp_write_cstr(&w2, "model");
    mp_write_cstr(&w2, "m");
    raw_reply c;
    raw_call(s, &w2, &c);
    expect_ok(&c, "a new worker.step");
    cr_assert_eq(result_int(&c, "step"), 3, "the resent step ran twice");
    raw_free(&a);
    raw_free(&b);
    raw_free(&c);
    mp_writer_fini(&w);
    mp_writer_fini(&w2);
    nng_close(s);
    stop(cl);
}
