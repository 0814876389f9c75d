/*
 * test_cluster_badinput.c - bad input against the real coordinator: each
 * case gets the right stable error code and a non-empty message, and the
 * next valid request on the same connection still succeeds. Raw bytes go
 * through an nng req0 socket; replies are parsed with moe_rpc_parse_response.
 * Also: size caps (1.5x the cap -> too_large; over the 2x transport cap the
 * connection is dropped and others are still served), auth, a full queue
 * (busy, and every async call answered exactly once), and a worker killed
 * with SIGKILL (down within the heartbeat timeout, forward unavailable) then
 * restarted (ready again, forward correct).
 */
#include <criterion/criterion.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

#define H 64

/* ---- a raw req0 socket ---- */

typedef struct raw_reply {
    uint8_t *buf; /* owned (nng_free) */
    size_t len;
    moe_rpc_response resp;
    int rv; /* nng error of send/recv, 0 if a reply came */
} raw_reply;

static nng_socket raw_open(const char *url, int recv_timeout_ms)
{
    nng_socket s;
    cr_assert_eq(nng_req0_open(&s), 0);
    nng_socket_set_ms(s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, recv_timeout_ms);
    nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, 5000);
    nng_socket_set_ms(s, NNG_OPT_RECONNMINT, 20);
    nng_socket_set_ms(s, NNG_OPT_RECONNMAXT, 200);
    int rv = nng_dial(s, url, NULL, 0);
    cr_assert_eq(rv, 0, "dial %s: %s", url, nng_strerror(rv));
    return s;
}

/* raw_call sends len bytes and waits for one reply (parsed into r->resp). */
static void raw_call(nng_socket s, const void *bytes, size_t len, raw_reply *r)
{
    memset(r, 0, sizeof(*r));
    r->rv = nng_send(s, (void *)bytes, len, 0);
    if (r->rv == 0)
        r->rv = nng_recv(s, &r->buf, &r->len, NNG_FLAG_ALLOC);
    if (r->rv != 0)
        return;
    mp_errbuf eb = {{0}};
    moe_err e = moe_rpc_parse_response(r->buf, r->len, &r->resp, &eb);
    cr_assert_eq(e, MOE_OK, "the server's reply does not parse: %s", eb.msg);
}

static void raw_free(raw_reply *r)
{
    if (r->buf)
        nng_free(r->buf, r->len);
    r->buf = NULL;
}

/* expect_raw_err: a reply came, with code `want` and a non-empty message. */
static void expect_raw_err(const raw_reply *r, moe_err want, const char *what)
{
    cr_assert_eq(r->rv, 0, "%s: no reply: %s", what, nng_strerror(r->rv));
    cr_assert_eq(r->resp.err, want, "%s: got %s (%.*s), want %s", what, moe_err_code(r->resp.err),
                 (int)r->resp.errmsg_len, r->resp.errmsg ? r->resp.errmsg : "", moe_err_code(want));
    cr_assert(r->resp.errmsg_len > 0, "%s: empty error message", what);
    cr_log_info("%s -> %s: %.*s", what, moe_err_code(want), (int)r->resp.errmsg_len,
                r->resp.errmsg);
}

/* [0, msgid, "ping", [{}]] */
static size_t ping_bytes(uint8_t *out, uint8_t msgid)
{
    static const uint8_t p[] = {0x94, 0x00, 0x00, 0xa4, 'p', 'i', 'n', 'g', 0x91, 0x80};
    memcpy(out, p, sizeof(p));
    out[2] = msgid & 0x7f;
    return sizeof(p);
}

/* raw_ping_ok: the same connection still serves a valid request. */
static void raw_ping_ok(nng_socket s)
{
    uint8_t b[16];
    raw_reply r;
    raw_call(s, b, ping_bytes(b, 77), &r);
    cr_assert_eq(r.rv, 0, "ping after bad input: no reply: %s", nng_strerror(r.rv));
    cr_assert_eq(r.resp.err, MOE_OK, "ping after bad input: %s", moe_err_code(r.resp.err));
    cr_assert_eq(r.resp.msgid, 77u);
    raw_free(&r);
}

/* ---- libmoe calls with hand-made params ---- */

/* expect_call_err: method(params) fails with `want` and a message. */
static void expect_call_err(moe_client *c, const char *method, const mp_writer *params,
                            moe_err want, const char *what)
{
    moe_reply rep;
    moe_err e = moe_call(c, method, params ? params->buf : NULL, params ? params->len : 0, &rep);
    cr_assert_eq(e, want, "%s: got %s (%s), want %s", what, moe_err_code(e), rep.message,
                 moe_err_code(want));
    cr_assert(rep.message[0] != 0, "%s: empty error message", what);
    cr_log_info("%s -> %s: %s", what, moe_err_code(e), rep.message);
    moe_reply_free(&rep);
}

static void model_create(cluster *cl, const char *name, int layers)
{
    moe_model_config mc = {0};
    mc.name = name;
    mc.layers = layers;
    mc.d_model = H;
    mc.d_ff = 2 * H;
    mc.n_experts = 8;
    mc.top_k = 2;
    mc.seed = 5;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "model.create: %s", moe_last_error());
}

/* forward_ok: a valid forward of T tokens succeeds; y (T, H) out if not NULL. */
static void forward_ok(cluster *cl, const char *model, int T, float *y_out)
{
    float *x = malloc((size_t)T * H * sizeof(float)), *y = malloc((size_t)T * H * sizeof(float));
    rng_fill_uniform(9, 1, -1, 1, x, (size_t)T * H);
    moe_err e = moe_forward(cl->cli, model, 0, MOE_F32, x, T, H, y, NULL);
    cr_assert_eq(e, MOE_OK, "valid forward after bad input: %s", moe_last_error());
    if (y_out)
        memcpy(y_out, y, (size_t)T * H * sizeof(float));
    free(x);
    free(y);
}

/* forward params {model, layer, x: {dtype, shape, data}} with free-form x */
static void write_forward(mp_writer *w, const char *model, int layer, const char *dtype,
                          const int64_t *shape, int ndim, size_t data_len)
{
    mp_write_map(w, 3);
    mp_write_cstr(w, "model");
    mp_write_cstr(w, model);
    mp_write_cstr(w, "layer");
    mp_write_i64(w, layer);
    mp_write_cstr(w, "x");
    mp_write_map(w, 3);
    mp_write_cstr(w, "dtype");
    mp_write_cstr(w, dtype);
    mp_write_cstr(w, "shape");
    mp_write_array(w, (uint32_t)ndim);
    for (int i = 0; i < ndim; i++)
        mp_write_i64(w, shape[i]);
    mp_write_cstr(w, "data");
    void *d = mp_writer_reserve_bin(w, (uint32_t)data_len);
    if (d)
        memset(d, 0, data_len);
}

static cluster *start(cluster_opts o)
{
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    return cl;
}

static void stop(cluster *cl)
{
    cr_assert_eq(cluster_stop(cl), 0, "cluster_stop: %s", cluster_error());
}

/* a coordinator alone: enough for envelope-level input */
static const cluster_opts coord_only = {.workers = 0, .expected_workers = 1};

/* ---- envelope ---- */

/* write_create: model.create parameters for a 1-layer SwiGLU model of 4
 * experts, d_model = d_ff = d, with layers written as a float (2.0) when
 * layers_f64 (a type error) */
static void write_create(mp_writer *w, const char *name, int layers_f64, int64_t d, int64_t top_k)
{
    mp_write_map(w, 6);
    mp_write_cstr(w, "name");
    mp_write_cstr(w, name);
    mp_write_cstr(w, "layers");
    if (layers_f64)
        mp_write_f64(w, 2.0);
    else
        mp_write_i64(w, 1);
    mp_write_cstr(w, "d_model");
    mp_write_i64(w, d);
    mp_write_cstr(w, "d_ff");
    mp_write_i64(w, d);
    mp_write_cstr(w, "n_experts");
    mp_write_i64(w, 4);
    mp_write_cstr(w, "top_k");
    mp_write_i64(w, top_k);
}

/* a raw message the coordinator must answer with a protocol error */
struct bad_msg {
    const char *bytes;
    size_t len;
    const char *what;
};

/* each message on s gets MOE_EPROTO, and the connection still answers a ping */
static void expect_proto_errs(nng_socket s, const struct bad_msg *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        raw_reply r;
        raw_call(s, cases[i].bytes, cases[i].len, &r);
        expect_raw_err(&r, MOE_EPROTO, cases[i].what);
        raw_free(&r);
        raw_ping_ok(s);
    }
}

Test(cluster_badinput, not_msgpack, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start(coord_only);
    nng_socket s = raw_open(cl->url, 5000);
    static const struct bad_msg cases[] = {
        {"\xc1\xc1\xc1\xc1", 4, "reserved byte 0xc1"},
        {"GET / HTTP/1.0\r\n\r\n", 18, "an HTTP request"},
        {"\x94\x00\x01\xa4pi", 6, "a request cut short"},
        {"", 0, "an empty message"},
    };
    expect_proto_errs(s, cases, sizeof(cases) / sizeof(cases[0]));
    nng_close(s);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    stop(cl);
}

Test(cluster_badinput, msgpack_but_not_a_request, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start(coord_only);
    nng_socket s = raw_open(cl->url, 5000);
    static const struct bad_msg cases[] = {
        {"\x81\xa1\x61\x01", 4, "the map {a: 1}"},
        {"\xa5hello", 6, "the string \"hello\""},
        {"\x94\x01\x05\xc0\xc0", 5, "a response [1, 5, nil, nil]"},
        {"\x93\x02\xa4ping\x90", 8, "a notification [2, \"ping\", []]"},
        {"\x94\x00\x05\x07\x91\x80", 6, "a method that is an int"},
        {"\x94\x00\x05\xa4ping\xc0", 9, "params nil"},
        {"\x94\x00\x05\xa4ping\x91\x80\x00", 11, "trailing bytes"},
    };
    expect_proto_errs(s, cases, sizeof(cases) / sizeof(cases[0]));
    nng_close(s);
    stop(cl);
}

Test(cluster_badinput, unknown_method, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start(coord_only);
    nng_socket s = raw_open(cl->url, 5000);
    static const uint8_t req[] = {
        0x94, 0x00, 0x2a, 0xa7, 'n',  'o', '.',
        's',  'u',  'c',  'h',  0x91, 0x80}; /* [0, 42, "no.such", [{}]] */
    raw_reply r;
    raw_call(s, req, sizeof(req), &r);
    expect_raw_err(&r, MOE_ENOMETHOD, "method no.such");
    cr_assert_eq(r.resp.msgid, 42u, "msgid not echoed");
    cr_assert(memmem(r.resp.errmsg, r.resp.errmsg_len, "no.such", 7), "message names the method");
    raw_free(&r);
    raw_ping_ok(s);
    nng_close(s);
    /* the same through libmoe */
    expect_call_err(cl->cli, "model.destroy_all", NULL, MOE_ENOMETHOD, "libmoe unknown method");
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    stop(cl);
}

/* 0xdd 0x00 0xff 0xff 0xff: an array32 header claiming 16 million elements */
Test(cluster_badinput, huge_array_header, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start(coord_only);
    nng_socket s = raw_open(cl->url, 5000);
    static const uint8_t bomb[] = {0xdd, 0x00, 0xff, 0xff, 0xff};
    raw_reply r;
    raw_call(s, bomb, sizeof(bomb), &r);
    expect_raw_err(&r, MOE_EPROTO, "array32 header of 16777215 elements");
    cr_assert_eq(r.resp.msgid, 0u);
    cr_assert(memmem(r.resp.errmsg, r.resp.errmsg_len, "16777215", 8),
              "message should name the claimed count: %.*s", (int)r.resp.errmsg_len, r.resp.errmsg);
    raw_free(&r);
    /* the same claim inside a params map, after a readable msgid */
    static const uint8_t inner[] = {0x94, 0x00, 0x09, 0xa4, 'p',  'i',  'n',  'g', 0x91,
                                    0x81, 0xa1, 'a',  0xdd, 0x00, 0xff, 0xff, 0xff};
    raw_call(s, inner, sizeof(inner), &r);
    expect_raw_err(&r, MOE_EPROTO, "array32 bomb inside params");
    cr_assert_eq(r.resp.msgid, 9u, "msgid should be echoed when readable");
    raw_free(&r);
    raw_ping_ok(s);
    nng_close(s);
    stop(cl);
}

/* ---- params ---- */

Test(cluster_badinput, wrong_param_types, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 1});
    model_create(cl, "m", 1);
    mp_writer w;
    /* layer as a string */
    mp_writer_init(&w);
    mp_write_map(&w, 3);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    mp_write_cstr(&w, "layer");
    mp_write_cstr(&w, "0");
    mp_write_cstr(&w, "x");
    mp_write_cstr(&w, "not a tensor");
    expect_call_err(cl->cli, "forward", &w, MOE_EPROTO, "forward layer=\"0\"");
    mp_writer_fini(&w);
    /* x as a string */
    mp_writer_init(&w);
    mp_write_map(&w, 3);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    mp_write_cstr(&w, "layer");
    mp_write_i64(&w, 0);
    mp_write_cstr(&w, "x");
    mp_write_cstr(&w, "not a tensor");
    expect_call_err(cl->cli, "forward", &w, MOE_EPROTO, "forward x=\"not a tensor\"");
    mp_writer_fini(&w);
    /* model as an int */
    mp_writer_init(&w);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "model");
    mp_write_i64(&w, 3);
    expect_call_err(cl->cli, "model.info", &w, MOE_EPROTO, "model.info model=3");
    mp_writer_fini(&w);
    /* model.create: layers as a float, renormalize as an int */
    mp_writer_init(&w);
    write_create(&w, "m2", 1, H, 1);
    expect_call_err(cl->cli, "model.create", &w, MOE_EPROTO, "model.create layers=2.0");
    mp_writer_fini(&w);
    /* right types, bad values: invalid_argument */
    mp_writer_init(&w);
    write_create(&w, "m3", 0, H, 5);
    expect_call_err(cl->cli, "model.create", &w, MOE_EINVAL, "model.create top_k > n_experts");
    mp_writer_fini(&w);
    mp_writer_init(&w);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "modle");
    mp_write_cstr(&w, "m");
    expect_call_err(cl->cli, "model.info", &w, MOE_EINVAL, "model.info unknown key");
    mp_writer_fini(&w);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    forward_ok(cl, "m", 4, NULL);
    stop(cl);
}

Test(cluster_badinput, shape_does_not_match_d_model, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 1});
    model_create(cl, "m", 1);
    static const struct {
        int64_t shape[3];
        int ndim;
    } cases[] = {{{4, H + 1}, 2}, {{4, H / 2}, 2}, {{4 * H}, 1}, {{2, 2, H}, 3}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mp_writer w;
        mp_writer_init(&w);
        size_t n = 1;
        for (int d = 0; d < cases[i].ndim; d++)
            n *= (size_t)cases[i].shape[d];
        write_forward(&w, "m", 0, "f32", cases[i].shape, cases[i].ndim, n * 4);
        expect_call_err(cl->cli, "forward", &w, MOE_EINVAL, "forward x of the wrong shape");
        mp_writer_fini(&w);
    }
    /* libmoe's own call, with H that does not match */
    float x[4 * (H + 1)], y[4 * (H + 1)];
    memset(x, 0, sizeof(x));
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 4, H + 1, y, NULL), MOE_EINVAL);
    cr_assert(strstr(moe_last_error(), "d_model"), "message: %s", moe_last_error());
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    forward_ok(cl, "m", 4, NULL);
    stop(cl);
}

Test(cluster_badinput, data_length_does_not_match_shape, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 1});
    model_create(cl, "m", 1);
    static const struct {
        const char *dtype;
        size_t len;
    } cases[] = {{"f32", 4 * H * 4 - 1},
                 {"f32", 4 * H * 4 + 4},
                 {"f32", 4 * H * 2},
                 {"bf16", 4 * H * 4},
                 {"f32", 0}};
    int64_t shape[2] = {4, H};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mp_writer w;
        mp_writer_init(&w);
        write_forward(&w, "m", 0, cases[i].dtype, shape, 2, cases[i].len);
        expect_call_err(cl->cli, "forward", &w, MOE_EINVAL, "forward data length != shape");
        mp_writer_fini(&w);
    }
    /* an unknown dtype is a bad value too */
    mp_writer w;
    mp_writer_init(&w);
    write_forward(&w, "m", 0, "f64", shape, 2, 4 * H * 8);
    expect_call_err(cl->cli, "forward", &w, MOE_EINVAL, "forward dtype f64");
    mp_writer_fini(&w);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    forward_ok(cl, "m", 4, NULL);
    stop(cl);
}

Test(cluster_badinput, unknown_model, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 1});
    model_create(cl, "m", 1);
    float x[2 * H], y[2 * H];
    memset(x, 0, sizeof(x));
    cr_assert_eq(moe_forward(cl->cli, "nope", 0, MOE_F32, x, 2, H, y, NULL), MOE_ENOTFOUND);
    cr_assert(strstr(moe_last_error(), "nope"), "message: %s", moe_last_error());
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "nope");
    expect_call_err(cl->cli, "model.info", &w, MOE_ENOTFOUND, "model.info of an unknown model");
    mp_writer_fini(&w);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    forward_ok(cl, "m", 2, NULL);
    stop(cl);
}

Test(cluster_badinput, unknown_layer, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 1});
    model_create(cl, "m", 2);
    float x[2 * H], y[2 * H];
    memset(x, 0, sizeof(x));
    cr_assert_eq(moe_forward(cl->cli, "m", 2, MOE_F32, x, 2, H, y, NULL), MOE_ENOTFOUND);
    cr_assert(strstr(moe_last_error(), "layer"), "message: %s", moe_last_error());
    cr_assert_eq(moe_forward(cl->cli, "m", 1000000, MOE_F32, x, 2, H, y, NULL), MOE_ENOTFOUND);
    /* a negative layer is out of the parameter's range */
    cr_assert_eq(moe_forward(cl->cli, "m", -1, MOE_F32, x, 2, H, y, NULL), MOE_EINVAL);
    cr_assert(moe_last_error()[0]);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    forward_ok(cl, "m", 2, NULL);
    stop(cl);
}

Test(cluster_badinput, forward_before_any_worker, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start(coord_only);
    /* accepted while no worker is up: created when the cluster forms */
    model_create(cl, "m", 1);
    float x[3 * H], y[3 * H];
    memset(x, 0, sizeof(x));
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 3, H, y, NULL), MOE_EUNAVAIL);
    cr_assert(strstr(moe_last_error(), "not ready"), "message: %s", moe_last_error());
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    /* a worker arrives: the pending model is built and forward works */
    cr_assert_eq(cluster_worker_start(cl, 0), 0, "%s", cluster_error());
    cr_assert_eq(cluster_wait_ready(cl, 15000), 0, "%s", cluster_error());
    forward_ok(cl, "m", 3, NULL);
    stop(cl);
}

/* ---- size caps: --max-msg-mb 1 ---- */

/* a ping request padded with a bin parameter to `total` bytes */
static uint8_t *padded_ping(size_t total, size_t *len)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, 5, "ping");
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "pad");
    size_t pad = total - w.len - 8;
    void *d = mp_writer_reserve_bin(&w, (uint32_t)pad);
    cr_assert(d);
    memset(d, 0x5a, pad);
    return mp_writer_take(&w, len);
}

Test(cluster_badinput, message_over_the_cap, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start(
        (cluster_opts){.workers = 0, .expected_workers = 1, .coord_args = {"--max-msg-mb", "1"}});
    nng_socket s = raw_open(cl->url, 5000);
    size_t len;
    uint8_t *big = padded_ping(3u << 19, &len); /* 1.5 MiB */
    raw_reply r;
    raw_call(s, big, len, &r);
    expect_raw_err(&r, MOE_ETOOBIG, "a 1.5 MiB request, cap 1 MiB");
    cr_assert_eq(r.resp.msgid, 0u);
    raw_free(&r);
    free(big);
    raw_ping_ok(s);
    /* just under the cap is read and reaches the method: ping takes no
     * params, so it names the unknown key (not too_large) */
    big = padded_ping((1u << 20) - 64, &len);
    raw_call(s, big, len, &r);
    cr_assert_eq(r.rv, 0);
    cr_assert_eq(r.resp.err, MOE_EINVAL, "a request under the cap: %s", moe_err_code(r.resp.err));
    cr_assert(r.resp.errmsg_len > 0 && memmem(r.resp.errmsg, r.resp.errmsg_len, "pad", 3), "%.*s",
              (int)r.resp.errmsg_len, r.resp.errmsg);
    raw_free(&r);
    free(big);
    nng_close(s);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    stop(cl);
}

/* Over the transport cap (2 x cap + 4 KiB) nng drops the connection without
 * a reply; the server goes on serving other connections, and the dropped
 * client's socket reconnects and is served again. */
Test(cluster_badinput, message_over_twice_the_cap_drops_connection, .timeout = 30,
     .fini = cluster_fini_all)
{
    cluster *cl = start(
        (cluster_opts){.workers = 0, .expected_workers = 1, .coord_args = {"--max-msg-mb", "1"}});
    nng_socket s = raw_open(cl->url, 1500);
    size_t len;
    uint8_t *big = padded_ping(5u << 19, &len); /* 2.5 MiB */
    raw_reply r;
    raw_call(s, big, len, &r);
    cr_assert_neq(r.rv, 0, "a 2.5 MiB request got a reply; the transport cap should drop it");
    cr_log_info("2.5 MiB request, cap 1 MiB: no reply (%s)", nng_strerror(r.rv));
    free(big);
    /* others are served */
    cr_assert_eq(moe_ping(cl->cli), MOE_OK, "%s", moe_last_error());
    nng_socket s2 = raw_open(cl->url, 5000);
    raw_ping_ok(s2);
    nng_close(s2);
    /* and the dropped client again, after its socket redials */
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, 5000);
    raw_ping_ok(s);
    nng_close(s);
    stop(cl);
}

/* ---- auth ---- */

Test(cluster_badinput, auth_token, .timeout = 30, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 1, .auth_token = "s3cret-token"});
    model_create(cl, "m", 1); /* cl->cli carries the right token */
    static const char *bad_tokens[] = {NULL, "wrong", "s3cret-toke", ""};
    for (size_t i = 0; i < sizeof(bad_tokens) / sizeof(bad_tokens[0]); i++) {
        moe_client_opts o = {.timeout_ms = 5000, .auth_token = bad_tokens[i]};
        moe_client *c;
        cr_assert_eq(moe_client_open(cl->url, &o, &c), MOE_OK);
        cr_assert_eq(moe_ping(c), MOE_EUNAUTH, "token %s: ping should be refused",
                     bad_tokens[i] ? bad_tokens[i] : "(none)");
        cr_assert(strstr(moe_last_error(), "token"), "message: %s", moe_last_error());
        float x[2 * H], y[2 * H];
        memset(x, 0, sizeof(x));
        cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, x, 2, H, y, NULL), MOE_EUNAUTH);
        moe_client_close(c);
        cr_assert_eq(moe_ping(cl->cli), MOE_OK, "right token after a refused one");
    }
    /* a token of the wrong type is refused too */
    nng_socket s = raw_open(cl->url, 5000);
    static const uint8_t req[] = {0x94, 0x00, 0x03, 0xa4, 'p', 'i', 'n', 'g',
                                  0x91, 0x81, 0xa4, 'a',  'u', 't', 'h', 0x07};
    raw_reply r;
    raw_call(s, req, sizeof(req), &r);
    expect_raw_err(&r, MOE_EUNAUTH, "auth=7");
    raw_free(&r);
    nng_close(s);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    forward_ok(cl, "m", 2, NULL);
    stop(cl);
}

/* ---- a full queue: busy at once, and no call lost ---- */

#define NCALLS 10
typedef struct busy_state {
    pthread_mutex_t mu;
    int answers[NCALLS];
    moe_err err[NCALLS];
    char msg[NCALLS][128];
    int done;
} busy_state;

typedef struct busy_arg {
    busy_state *st;
    int i;
} busy_arg;

static void on_answer(moe_err err, moe_reply *rep, void *arg)
{
    busy_arg *a = arg;
    pthread_mutex_lock(&a->st->mu);
    a->st->answers[a->i]++;
    a->st->err[a->i] = err;
    snprintf(a->st->msg[a->i], sizeof(a->st->msg[0]), "%.127s", rep ? rep->message : "");
    a->st->done++;
    pthread_mutex_unlock(&a->st->mu);
    if (rep) {
        moe_reply_free(rep);
        free(rep);
    }
}

Test(cluster_badinput, busy_when_queue_full, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = start((cluster_opts){.workers = 2, .coord_args = {"--queue-depth", "1"}});
    model_create(cl, "m", 1);
    const int T = 4096; /* long enough that all calls arrive while the first runs */
    float *x = malloc((size_t)T * H * sizeof(float));
    rng_fill_uniform(3, 3, -1, 1, x, (size_t)T * H);
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 3);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    mp_write_cstr(&w, "layer");
    mp_write_i64(&w, 0);
    mp_write_cstr(&w, "x");
    moe_tensor t = {MOE_F32, 2, {T, H, 0, 0}, x, (size_t)T * H * 4};
    moe_tensor_write(&w, &t);
    cr_assert(!w.failed);
    static busy_state st;
    static busy_arg args[NCALLS];
    memset(&st, 0, sizeof(st));
    pthread_mutex_init(&st.mu, NULL);
    for (int i = 0; i < NCALLS; i++) {
        args[i] = (busy_arg){&st, i};
        cr_assert_eq(moe_call_async(cl->cli, "forward", w.buf, w.len, on_answer, &args[i]), MOE_OK);
    }
    mp_writer_fini(&w);
    int64_t t0 = cluster_now_ms();
    for (;;) {
        pthread_mutex_lock(&st.mu);
        int done = st.done;
        pthread_mutex_unlock(&st.mu);
        if (done >= NCALLS || cluster_now_ms() - t0 > 30000)
            break;
        usleep(5000);
    }
    usleep(200000); /* a second answer to any call would show up here */
    int ok = 0, busy = 0;
    pthread_mutex_lock(&st.mu);
    for (int i = 0; i < NCALLS; i++) {
        cr_assert_eq(st.answers[i], 1, "call %d got %d answers", i, st.answers[i]);
        cr_assert(st.err[i] == MOE_OK || st.err[i] == MOE_EBUSY, "call %d: %s: %s", i,
                  moe_err_code(st.err[i]), st.msg[i]);
        ok += st.err[i] == MOE_OK;
        if (st.err[i] == MOE_EBUSY) {
            busy++;
            cr_assert(st.msg[i][0], "busy without a message");
        }
    }
    pthread_mutex_unlock(&st.mu);
    cr_log_info("%d calls, queue depth 1: %d served, %d busy", NCALLS, ok, busy);
    cr_assert_geq(ok, 1, "no call was served");
    cr_assert_geq(busy, 1, "no call got busy with --queue-depth 1");
    free(x);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);
    forward_ok(cl, "m", 8, NULL);
    stop(cl);
}

/* ---- a worker dies and comes back ---- */

Test(cluster_badinput, worker_killed_then_restarted, .timeout = 60, .fini = cluster_fini_all)
{
    const int hb_timeout_ms = 1000;
    cluster *cl = start((cluster_opts){.workers = 2,
                                       .coord_args = {"--heartbeat-timeout-ms", "1000"},
                                       .worker_args = {"--heartbeat-ms", "100"}});
    model_create(cl, "m", 1);
    const int T = 6;
    float y0[6 * H], y1[6 * H], x[6 * H], y[6 * H];
    forward_ok(cl, "m", T, y0);
    cluster_state st;
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
    uint64_t gen0 = st.generation;

    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cluster_error());
    int64_t t_kill = cluster_now_ms(), t_down = -1;
    while (cluster_now_ms() - t_kill < hb_timeout_ms + 2000) {
        cr_assert_eq(cluster_get_state(cl, &st), MOE_OK, "%s", moe_last_error());
        if (st.down == 1 && !st.ready) {
            t_down = cluster_now_ms();
            break;
        }
        usleep(20000);
    }
    cr_assert(t_down >= 0, "killed worker not marked down within %d ms (down %d, ready %d)",
              hb_timeout_ms + 2000, st.down, st.ready);
    cr_log_info("killed worker marked down after %lld ms (heartbeat timeout %d ms)",
                (long long)(t_down - t_kill), hb_timeout_ms);
    cr_assert_leq(t_down - t_kill, hb_timeout_ms + 1000);
    cr_assert_eq(st.up, 1);

    rng_fill_uniform(9, 1, -1, 1, x, (size_t)T * H);
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, T, H, y, NULL), MOE_EUNAVAIL,
                 "forward with a worker down: %s", moe_last_error());
    cr_assert(moe_last_error()[0]);
    cr_assert_eq(moe_ping(cl->cli), MOE_OK);

    cr_assert_eq(cluster_worker_start(cl, 1), 0, "%s", cluster_error());
    cr_assert_eq(cluster_wait_ready(cl, 15000), 0, "%s", cluster_error());
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
    cr_assert_gt(st.generation, gen0, "a new generation should have formed");
    forward_ok(cl, "m", T, y1);
    double rel = kern_rel_err(y1, y0, (size_t)T * H);
    cr_assert(rel < 1e-6, "forward after the restart differs: rel err %g", rel);
    stop(cl);
}
