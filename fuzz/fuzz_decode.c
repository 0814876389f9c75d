/*
 * fuzz_decode.c - libFuzzer harness for the wire decoder: every input is
 * parsed as a request (then each param value is skipped and tried as a
 * tensor) and as a response (then the result is skipped and tried as a
 * tensor). Crashes, sanitizer reports and broken invariants abort.
 * Build and run: see fuzz/README.md.
 */
#include <stdlib.h>
#include <string.h>

#include "proto/proto.h"

#define FUZZ_MAX_LEN (1u << 20)

static void check(int ok)
{
    if (!ok)
        abort();
}

/* try_tensor decodes a tensor at r (a copy) and checks the view. */
static void try_tensor(mp_reader r, const uint8_t *buf, size_t len)
{
    moe_tensor t;
    mp_errbuf eb;
    eb.msg[0] = '\0';
    moe_err e = moe_tensor_read(&r, &t, &eb);
    if (e != MOE_OK) {
        check(eb.msg[0] != '\0' && (e == MOE_EPROTO || e == MOE_EINVAL));
        return;
    }
    check(t.ndim >= 1 && t.ndim <= MOE_MAX_DIMS);
    int64_t n = moe_tensor_numel(&t);
    check(n >= 0 && (uint64_t)n * moe_dtype_size(t.dtype) == t.nbytes);
    check(t.nbytes == 0 ||
          ((const uint8_t *)t.data >= buf && (const uint8_t *)t.data + t.nbytes <= buf + len));
    /* it re-encodes to something that decodes to the same tensor */
    mp_writer w;
    mp_writer_init(&w);
    moe_tensor_write(&w, &t);
    check(!w.failed);
    mp_reader r2;
    mp_reader_init(&r2, w.buf, w.len);
    moe_tensor t2;
    check(moe_tensor_read(&r2, &t2, NULL) == MOE_OK && mp_left(&r2) == 0);
    check(t2.dtype == t.dtype && t2.ndim == t.ndim && t2.nbytes == t.nbytes);
    check(memcmp(t2.shape, t.shape, sizeof(t.shape)) == 0);
    check(t.nbytes == 0 || memcmp(t2.data, t.data, t.nbytes) == 0);
    mp_writer_fini(&w);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* request */
    moe_rpc_request req;
    uint32_t msgid = 0xdeadbeef;
    mp_errbuf eb;
    eb.msg[0] = '\0';
    moe_err e = moe_rpc_parse_request(data, size, FUZZ_MAX_LEN, &req, &msgid, &eb);
    /* msgid_out may be NULL and changes nothing */
    moe_rpc_request req2;
    check(moe_rpc_parse_request(data, size, FUZZ_MAX_LEN, &req2, NULL, NULL) == e);
    if (e != MOE_OK) {
        check(eb.msg[0] != '\0');
        check(e == MOE_EPROTO || (e == MOE_ETOOBIG && size > FUZZ_MAX_LEN));
        /* an echoed msgid is the one in the message: [0, msgid, ... */
        if (msgid != 0) {
            mp_reader h;
            uint32_t n;
            uint64_t type, id;
            mp_reader_init(&h, data, size);
            check(mp_read_array(&h, &n, NULL) == MOE_OK && n == 4);
            check(mp_read_u64(&h, &type, NULL) == MOE_OK && type == 0);
            check(mp_read_u64(&h, &id, NULL) == MOE_OK && id == msgid);
        }
    } else {
        check(msgid == req.msgid);
        check(req.method >= (const char *)data &&
              req.method + req.method_len <= (const char *)data + size);
        mp_reader p = req.params;
        for (uint32_t i = 0; i < req.nparams; i++) {
            /* a parsed request is complete: walking it cannot fail on
             * truncation, only on a wrong type (a non-str key) */
            const char *k;
            uint32_t kl;
            mp_reader key = p;
            if (mp_read_str(&key, &k, &kl, NULL) != MOE_OK)
                check(mp_skip(&p, NULL) == MOE_OK);
            else
                p = key;
            try_tensor(p, data, size);
            check(mp_skip(&p, NULL) == MOE_OK);
        }
        check(mp_left(&p) == 0);
    }

    /* response */
    moe_rpc_response resp;
    eb.msg[0] = '\0';
    e = moe_rpc_parse_response(data, size, &resp, &eb);
    if (e != MOE_OK) {
        check(e == MOE_EPROTO && eb.msg[0] != '\0');
    } else {
        check(resp.err == MOE_OK || resp.errmsg != NULL);
        check(resp.err != MOE_OK || resp.errmsg == NULL);
        try_tensor(resp.result, data, size);
        mp_reader r = resp.result;
        check(mp_skip(&r, NULL) == MOE_OK && mp_left(&r) == 0);
    }

    /* the raw bytes as one tensor, and the reader on its own */
    mp_reader r;
    mp_reader_init(&r, data, size);
    try_tensor(r, data, size);
    while (mp_left(&r) > 0 && mp_skip(&r, NULL) == MOE_OK)
        ;
    return 0;
}
