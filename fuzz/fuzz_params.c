/*
 * fuzz_params.c - libFuzzer harness for the params layer: every input is
 * read as a params map by params_parse with a spec of every type, and by
 * model_cfg_parse (model.create's params). Besides sanitizer reports it
 * aborts on broken invariants: an error without a message, or of a code
 * other than malformed / invalid_argument; a string out of its buffer or
 * holding a NUL; a number outside its range; a model config that does not
 * survive write -> parse (params_write is params_parse's inverse).
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/model_cfg.h"
#include "common/params.h"

static void check(int ok)
{
    if (!ok)
        abort();
}

static void every_type(const uint8_t *data, size_t len)
{
    mp_reader r;
    uint32_t n;
    mp_reader_init(&r, data, len);
    if (mp_read_map(&r, &n, NULL) != MOE_OK)
        return;
    char s[8];
    int64_t i = 0;
    double f = 0;
    bool b = false;
    moe_tensor t;
    mp_reader raw;
    pspec sp[] = {
        {"s", P_STR, s, true, 0, 0, sizeof(s), false}, {"i", P_INT, &i, false, -5, 5, 0, false},
        {"f", P_F64, &f, false, 0, 1, 0, false},       {"b", P_BOOL, &b, false, 0, 0, 0, false},
        {"t", P_TENSOR, &t, false, 0, 0, 0, false},    {"r", P_RAW, &raw, false, 0, 0, 0, false},
    };
    char err[256] = "";
    moe_err e = params_parse(&r, n, sp, 6, err, sizeof(err));
    if (e != MOE_OK) {
        check(err[0] != 0 && (e == MOE_EPROTO || e == MOE_EINVAL));
        return;
    }
    check(sp[0].seen && memchr(s, 0, sizeof(s)) != NULL);
    check(strlen(s) < sizeof(s));
    check(!sp[1].seen || (i >= -5 && i <= 5));
    check(!sp[2].seen || (f >= 0 && f <= 1));
    check(!sp[4].seen || (t.ndim >= 1 && t.ndim <= MOE_MAX_DIMS));
}

static void model_config(const uint8_t *data, size_t len)
{
    mp_reader r;
    uint32_t n;
    mp_reader_init(&r, data, len);
    if (mp_read_map(&r, &n, NULL) != MOE_OK)
        return;
    model_cfg a, b;
    char err[256] = "";
    memset(&a, 0, sizeof(a));
    moe_err e = model_cfg_parse(&r, n, &a, err, sizeof(err));
    if (e != MOE_OK) {
        check(err[0] != 0 && (e == MOE_EPROTO || e == MOE_EINVAL));
        return;
    }
    check(model_name_valid(a.name, strlen(a.name)));
    check(a.top_k >= 1 && a.top_k <= a.n_experts);
    mp_writer w;
    mp_writer_init(&w);
    model_cfg_write(&w, &a);
    check(!w.failed);
    mp_reader_init(&r, w.buf, w.len);
    check(mp_read_map(&r, &n, NULL) == MOE_OK);
    memset(&b, 0, sizeof(b));
    check(model_cfg_parse(&r, n, &b, err, sizeof(err)) == MOE_OK);
    check(model_cfg_same(&a, &b));
    mp_writer_fini(&w);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    if (len > (1u << 16))
        return 0;
    every_type(data, len);
    model_config(data, len);
    return 0;
}
