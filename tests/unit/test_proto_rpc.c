/*
 * test_proto_rpc.c - msgpack-rpc framing: request/response round trips,
 * both params forms, and every rejection path of the request parser.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/proto.h"

#define ASSERT_ERR(call, code, eb)                                                                 \
    do {                                                                                           \
        (eb).msg[0] = '\0';                                                                        \
        moe_err e_ = (call);                                                                       \
        cr_assert_eq(e_, (code), "%s: got %d (%s), want %d", #call, e_, (eb).msg, (code));         \
        cr_assert((eb).msg[0] != '\0', "%s: empty error message", #call);                          \
    } while (0)

#define MAXLEN (1u << 20)

Test(proto_rpc, request_round_trip)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, 4000000000u, "forward");
    mp_write_map(&w, 2);
    mp_write_cstr(&w, "layer");
    mp_write_u64(&w, 3);
    mp_write_cstr(&w, "x");
    moe_tensor t = {
        .dtype = MOE_F32, .ndim = 1, .shape = {2}, .data = "\0\0\x80?\0\0\0@", .nbytes = 8};
    moe_tensor_write(&w, &t);
    cr_assert(!w.failed);
    moe_rpc_request req;
    uint32_t id = 0;
    mp_errbuf eb;
    cr_assert_eq(moe_rpc_parse_request(w.buf, w.len, MAXLEN, &req, &id, &eb), MOE_OK, "%s", eb.msg);
    cr_assert_eq(id, 4000000000u);
    cr_assert_eq(req.msgid, 4000000000u);
    cr_assert(mp_str_eq(req.method, req.method_len, "forward"));
    cr_assert_eq(req.nparams, 2);
    const char *k;
    uint32_t kl;
    uint64_t layer;
    cr_assert_eq(mp_read_str(&req.params, &k, &kl, NULL), MOE_OK);
    cr_assert(mp_str_eq(k, kl, "layer"));
    cr_assert_eq(mp_read_u64(&req.params, &layer, NULL), MOE_OK);
    cr_assert_eq(layer, 3);
    cr_assert_eq(mp_read_str(&req.params, &k, &kl, NULL), MOE_OK);
    moe_tensor got;
    cr_assert_eq(moe_tensor_read(&req.params, &got, NULL), MOE_OK);
    cr_assert_eq(got.nbytes, 8);
    cr_assert_eq(mp_left(&req.params), 0);
    cr_assert(id == req.msgid);
    /* a ETOOBIG cap of exactly len is fine, len - 1 is not */
    cr_assert_eq(moe_rpc_parse_request(w.buf, w.len, w.len, &req, &id, NULL), MOE_OK);
    ASSERT_ERR(moe_rpc_parse_request(w.buf, w.len, w.len - 1, &req, &id, &eb), MOE_ETOOBIG, eb);
    cr_assert_eq(id, 0, "msgid unknown when refused by size");
    mp_writer_fini(&w);
}

Test(proto_rpc, bare_map_params_and_ping_bytes)
{
    /* [0, 7, "ping", {}] and [0, 7, "ping", [{}]] */
    static const uint8_t bare[] = {0x94, 0x00, 0x07, 0xa4, 'p', 'i', 'n', 'g', 0x80};
    static const uint8_t wrapped[] = {0x94, 0x00, 0x07, 0xa4, 'p', 'i', 'n', 'g', 0x91, 0x80};
    moe_rpc_request req;
    uint32_t id;
    cr_assert_eq(moe_rpc_parse_request(bare, sizeof(bare), MAXLEN, &req, &id, NULL), MOE_OK);
    cr_assert_eq(req.nparams, 0);
    cr_assert_eq(id, 7);
    cr_assert_eq(moe_rpc_parse_request(wrapped, sizeof(wrapped), MAXLEN, &req, &id, NULL), MOE_OK);
    cr_assert(mp_str_eq(req.method, req.method_len, "ping"));
    /* [0, 7, "ping", []]: no arguments, as generic msgpack-rpc clients send it */
    static const uint8_t none[] = {0x94, 0x00, 0x07, 0xa4, 'p', 'i', 'n', 'g', 0x90};
    cr_assert_eq(moe_rpc_parse_request(none, sizeof(none), MAXLEN, &req, &id, NULL), MOE_OK);
    cr_assert_eq(req.nparams, 0);
    /* the writer produces exactly the wrapped form */
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, 7, "ping");
    mp_write_map(&w, 0);
    cr_assert_eq(w.len, sizeof(wrapped));
    cr_assert(memcmp(w.buf, wrapped, sizeof(wrapped)) == 0);
    mp_writer_fini(&w);
    /* msgid NULL is allowed */
    cr_assert_eq(moe_rpc_parse_request(bare, sizeof(bare), MAXLEN, &req, NULL, NULL), MOE_OK);
}

Test(proto_rpc, request_rejections)
{
    static const struct {
        const char *b;
        size_t n;
        uint32_t msgid; /* expected *msgid_out */
        const char *what;
    } cases[] = {
#define C(s, id, what) {s, sizeof(s) - 1, id, what}
        C("", 0, "empty"),
        C("\xc1", 0, "reserved byte"),
        C("\xa4ping", 0, "not an array"),
        C("\x80", 0, "a map"),
        C("\x93\x00\x01\xa1p", 0, "array of 3"),
        C("\x95\x00\x01\xa1p\x80\xc0", 0, "array of 5"),
        C("\xdd\x00\xff\xff\xff", 0, "array header claiming 16M"),
        C("\x94\x01\x01\xa1p\x80", 0, "type 1 (response)"),
        C("\x94\x02\x01\xa1p\x80", 0, "type 2"),
        C("\x94\xff\x01\xa1p\x80", 0, "type -1"),
        C("\x94\xa1"
          "0\x01\xa1p\x80",
          0, "type a str"),
        C("\x94\x00\xff\xa1p\x80", 0, "msgid -1"),
        C("\x94\x00\xcf\x00\x00\x00\x01\x00\x00\x00\x00\xa1p\x80", 0, "msgid 2^32"),
        C("\x94\x00\xa1"
          "1\xa1p\x80",
          0, "msgid a str"),
        C("\x94\x00\xcb\0\0\0\0\0\0\0\0\xa1p\x80", 0, "msgid a float"),
        C("\x94\x00\x05\x01\x80", 5, "method an int"),
        C("\x94\x00\x05\xc4\x01p\x80", 5, "method a bin"),
        C("\x94\x00\x05\xa1p\xc0", 5, "params nil"),
        C("\x94\x00\x05\xa1p\x01", 5, "params an int"),
        C("\x94\x00\x05\xa1p\x92\x80\x80", 5, "params [{}, {}]"),
        C("\x94\x00\x05\xa1p\x91\x01", 5, "params [1]"),
        C("\x94\x00\x05\xa1p\x91\x90", 5, "params [[]]"),
        C("\x94\x00\x05\xa1p\x80\xc0", 5, "trailing byte"),
        C("\x94\x00\x05\xa1p\x91\x80\x00\x00", 5, "trailing bytes after [{}]"),
        C("\x94\x00\x05\xa1p\x81\xa1k", 5, "params map truncated"),
        C("\x94\x00\x05\xa1p\x81\xa1k\xc1", 5, "reserved byte in params"),
        C("\x94\x00\x05\xa1p\x81\xa1k\xdd\x00\xff\xff\xff", 5, "16M array in params"),
        C("\x94\x00\x05\xa3pi", 5, "method truncated"),
#undef C
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        moe_rpc_request req;
        uint32_t id = 12345;
        mp_errbuf eb;
        eb.msg[0] = '\0';
        moe_err e = moe_rpc_parse_request(cases[i].b, cases[i].n, MAXLEN, &req, &id, &eb);
        cr_assert_eq(e, MOE_EPROTO, "%s: got %d (%s)", cases[i].what, e, eb.msg);
        if (getenv("PROTO_SHOW"))
            fprintf(stderr, "%-28s %s\n", cases[i].what, eb.msg);
        cr_assert(eb.msg[0] != '\0', "%s: empty message", cases[i].what);
        cr_assert_eq(id, cases[i].msgid, "%s: msgid_out %u", cases[i].what, id);
    }
}

Test(proto_rpc, params_nesting_counts_from_root)
{
    /* params {"k": [[[...nil]]]}: the cap counts the 3 outer levels */
    mp_writer w;
    for (int extra = 0; extra <= 1; extra++) {
        mp_writer_init(&w);
        moe_rpc_write_request_head(&w, 1, "m");
        mp_write_map(&w, 1);
        mp_write_cstr(&w, "k");
        int levels = MP_MAX_DEPTH - 3 + extra; /* outer array, [ ], { } */
        for (int i = 0; i < levels; i++)
            mp_write_array(&w, 1);
        mp_write_nil(&w);
        moe_rpc_request req;
        mp_errbuf eb;
        moe_err e = moe_rpc_parse_request(w.buf, w.len, MAXLEN, &req, NULL, &eb);
        cr_assert_eq(e, extra ? MOE_EPROTO : MOE_OK, "extra %d: %s", extra, eb.msg);
        mp_writer_fini(&w);
    }
}

Test(proto_rpc, every_prefix_of_a_request_is_refused)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, 300, "optimizer.step");
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "lr");
    mp_write_f64(&w, 1e-3);
    for (size_t n = 0; n < w.len; n++) {
        moe_rpc_request req;
        mp_errbuf eb;
        ASSERT_ERR(moe_rpc_parse_request(w.buf, n, MAXLEN, &req, NULL, &eb), MOE_EPROTO, eb);
    }
    mp_writer_fini(&w);
}

Test(proto_rpc, response_ok_round_trip)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, 99);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "pong");
    mp_write_bool(&w, true);
    moe_rpc_response resp;
    mp_errbuf eb;
    cr_assert_eq(moe_rpc_parse_response(w.buf, w.len, &resp, &eb), MOE_OK, "%s", eb.msg);
    cr_assert_eq(resp.msgid, 99);
    cr_assert_eq(resp.err, MOE_OK);
    uint32_t n;
    cr_assert_eq(mp_read_map(&resp.result, &n, NULL), MOE_OK);
    cr_assert_eq(n, 1);
    mp_writer_fini(&w);
}

Test(proto_rpc, response_error_round_trip_every_code)
{
    for (int c = 1; c < MOE_ERR_COUNT; c++) {
        mp_writer w;
        mp_writer_init(&w);
        moe_rpc_write_response_err(&w, (uint32_t)c, (moe_err)c, c == 3 ? NULL : "boom");
        moe_rpc_response resp;
        mp_errbuf eb;
        cr_assert_eq(moe_rpc_parse_response(w.buf, w.len, &resp, &eb), MOE_OK, "%s", eb.msg);
        cr_assert_eq(resp.msgid, (uint32_t)c);
        cr_assert_eq(resp.err, (moe_err)c);
        if (c == 3)
            cr_assert(mp_str_eq(resp.errmsg, resp.errmsg_len, moe_strerror(MOE_EBUSY)));
        else
            cr_assert(mp_str_eq(resp.errmsg, resp.errmsg_len, "boom"));
        cr_assert_eq(mp_read_nil(&resp.result, NULL), MOE_OK);
        mp_writer_fini(&w);
    }
    /* MOE_OK is not an error code on the wire */
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_err(&w, 1, MOE_OK, "x");
    moe_rpc_response resp;
    cr_assert_eq(moe_rpc_parse_response(w.buf, w.len, &resp, NULL), MOE_OK);
    cr_assert_eq(resp.err, MOE_EINTERNAL);
    mp_writer_fini(&w);
}

/* "gone": the ranks an unavailable answer names dead, kept up to
 * MOE_RPC_MAX_GONE (the rest read past); none written without them; a
 * malformed gone refuses the response */
Test(proto_rpc, response_error_gone_ranks)
{
    int many[MOE_RPC_MAX_GONE + 3];
    for (int i = 0; i < MOE_RPC_MAX_GONE + 3; i++)
        many[i] = 3 * i + 1;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_err_gone(&w, 7, MOE_EUNAVAIL, "lost", many, MOE_RPC_MAX_GONE + 3);
    moe_rpc_response resp;
    mp_errbuf eb;
    cr_assert_eq(moe_rpc_parse_response(w.buf, w.len, &resp, &eb), MOE_OK, "%s", eb.msg);
    cr_assert_eq(resp.err, MOE_EUNAVAIL);
    cr_assert(mp_str_eq(resp.errmsg, resp.errmsg_len, "lost"));
    cr_assert_eq(resp.ngone, MOE_RPC_MAX_GONE);
    for (int i = 0; i < MOE_RPC_MAX_GONE; i++)
        cr_assert_eq(resp.gone[i], 3 * i + 1);
    cr_assert_eq(mp_read_nil(&resp.result, NULL), MOE_OK, "the result after every rank");
    mp_writer_fini(&w);

    mp_writer_init(&w);
    int one = 1;
    moe_rpc_write_response_err_gone(&w, 8, MOE_EUNAVAIL, "x", &one, 0);
    cr_assert_eq(moe_rpc_parse_response(w.buf, w.len, &resp, NULL), MOE_OK);
    cr_assert_eq(resp.ngone, 0);
    mp_writer_fini(&w);

    /* gone must be an array of ints */
    static const uint8_t bad[] = {0x94, 0x01, 0x02, 0x82, 0xa4, 'c', 'o', 'd', 'e',  0xa4, 'b',
                                  'u',  's',  'y',  0xa4, 'g',  'o', 'n', 'e', 0xa1, 'x',  0xc0};
    cr_assert_neq(moe_rpc_parse_response(bad, sizeof(bad), &resp, &eb), MOE_OK);
}

Test(proto_rpc, response_lenient_error_object)
{
    /* unknown code -> internal; missing message -> ""; extra keys skipped */
    static const uint8_t b[] = {0x94, 0x01, 0x02, 0x82, 0xa4, 'c', 'o', 'd',  'e',  0xa3, 'z',
                                'z',  'z',  0xa4, 'd',  'a',  't', 'a', 0x92, 0x01, 0x02, 0xc0};
    moe_rpc_response resp;
    mp_errbuf eb;
    cr_assert_eq(moe_rpc_parse_response(b, sizeof(b), &resp, &eb), MOE_OK, "%s", eb.msg);
    cr_assert_eq(resp.err, MOE_EINTERNAL);
    cr_assert_eq(resp.errmsg_len, 0);
    cr_assert_not_null(resp.errmsg);
}

Test(proto_rpc, response_rejections)
{
    static const struct {
        const char *b;
        size_t n;
        const char *what;
    } cases[] = {
#define C(s, what) {s, sizeof(s) - 1, what}
        C("", "empty"),
        C("\x94\x00\x01\xc0\xc0", "a request"),
        C("\x93\x01\x01\xc0", "array of 3"),
        C("\x94\x01\xff\xc0\xc0", "msgid -1"),
        C("\x94\x01\x01\x01\xc0", "error an int"),
        C("\x94\x01\x01\x80\xc0", "error without code"),
        C("\x94\x01\x01\x81\xa4"
          "code\x01\xc0",
          "code an int"),
        C("\x94\x01\x01\x81\xa4"
          "code\xa2ok\xc0",
          "code ok"),
        C("\x94\x01\x01\x81\x01\x01\xc0", "error key an int"),
        C("\x94\x01\x01\xc0", "no result"),
        C("\x94\x01\x01\xc0\xc0\xc0", "trailing"),
        C("\x94\x01\x01\xc0\x91", "result truncated"),
#undef C
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        moe_rpc_response resp;
        mp_errbuf eb;
        eb.msg[0] = '\0';
        moe_err e = moe_rpc_parse_response(cases[i].b, cases[i].n, &resp, &eb);
        cr_assert_eq(e, MOE_EPROTO, "%s: got %d (%s)", cases[i].what, e, eb.msg);
        if (getenv("PROTO_SHOW"))
            fprintf(stderr, "%-28s %s\n", cases[i].what, eb.msg);
        cr_assert(eb.msg[0] != '\0', "%s: empty message", cases[i].what);
    }
}
