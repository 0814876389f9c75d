/*
 * test_proto_tensor.c - tensor maps: round trips of every dtype, key order,
 * and every validation path (dtype, keys, ndim, dims, overflow, data length).
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

Test(proto_tensor, round_trip_each_dtype)
{
    static const moe_dtype dts[] = {MOE_F32, MOE_BF16, MOE_F16};
    uint8_t data[2 * 3 * 4 * 4];
    for (size_t i = 0; i < sizeof(data); i++)
        data[i] = (uint8_t)i;
    for (size_t k = 0; k < 3; k++) {
        moe_tensor t = {.dtype = dts[k], .ndim = 3, .shape = {2, 3, 4}, .data = data};
        t.nbytes = 24 * moe_dtype_size(dts[k]);
        cr_assert_eq(moe_tensor_numel(&t), 24);
        mp_writer w;
        mp_writer_init(&w);
        moe_tensor_write(&w, &t);
        cr_assert(!w.failed);
        mp_reader r;
        mp_reader_init(&r, w.buf, w.len);
        moe_tensor got;
        mp_errbuf eb;
        cr_assert_eq(moe_tensor_read(&r, &got, &eb), MOE_OK, "%s", eb.msg);
        cr_assert_eq(mp_left(&r), 0);
        cr_assert_eq(got.dtype, dts[k]);
        cr_assert_eq(got.ndim, 3);
        cr_assert_eq(got.shape[0], 2);
        cr_assert_eq(got.shape[1], 3);
        cr_assert_eq(got.shape[2], 4);
        cr_assert_eq(got.nbytes, t.nbytes);
        cr_assert(memcmp(got.data, data, t.nbytes) == 0);
        cr_assert(got.data >= (const void *)w.buf &&
                  (const uint8_t *)got.data + got.nbytes <= w.buf + w.len);
        /* the reserve path writes identical bytes */
        mp_writer w2;
        mp_writer_init(&w2);
        void *p = moe_tensor_write_reserve(&w2, dts[k], 3, t.shape);
        cr_assert_not_null(p);
        memcpy(p, data, t.nbytes);
        cr_assert_eq(w2.len, w.len);
        cr_assert(memcmp(w2.buf, w.buf, w.len) == 0);
        mp_writer_fini(&w2);
        mp_writer_fini(&w);
    }
}

Test(proto_tensor, empty_and_four_dims)
{
    moe_tensor t = {.dtype = MOE_F32, .ndim = 4, .shape = {1, 0, 7, 2}, .data = NULL};
    mp_writer w;
    mp_writer_init(&w);
    moe_tensor_write(&w, &t);
    cr_assert(!w.failed);
    mp_reader r;
    mp_reader_init(&r, w.buf, w.len);
    moe_tensor got;
    cr_assert_eq(moe_tensor_read(&r, &got, NULL), MOE_OK);
    cr_assert_eq(got.ndim, 4);
    cr_assert_eq(got.nbytes, 0);
    cr_assert_eq(moe_tensor_numel(&got), 0);
    mp_writer_fini(&w);
}

/* build writes a tensor map from parts; NULL parts are left out. */
typedef struct part {
    const char *key;
    const char *raw; /* already encoded value */
    size_t rawlen;
} part;

static moe_err read_parts(const part *parts, int n, mp_errbuf *eb, moe_tensor *t)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        mp_write_cstr(&w, parts[i].key);
        mp_write_raw(&w, parts[i].raw, parts[i].rawlen);
    }
    mp_reader r;
    mp_reader_init(&r, w.buf, w.len);
    moe_err e = moe_tensor_read(&r, t, eb);
    mp_writer_fini(&w);
    return e;
}

#define RAW(s) s, sizeof(s) - 1
#define F32                                                                                        \
    {                                                                                              \
        "dtype", RAW("\xa3"                                                                        \
                     "f32")                                                                        \
    }
#define SHAPE_2x2                                                                                  \
    {                                                                                              \
        "shape", RAW("\x92\x02\x02")                                                               \
    }
#define DATA16                                                                                     \
    {                                                                                              \
        "data", RAW("\xc4\x10"                                                                     \
                    "0123456789abcdef")                                                            \
    }

Test(proto_tensor, keys_in_any_order)
{
    moe_tensor t;
    part a[] = {DATA16, SHAPE_2x2, F32};
    cr_assert_eq(read_parts(a, 3, NULL, &t), MOE_OK);
    part b[] = {SHAPE_2x2, DATA16, F32};
    cr_assert_eq(read_parts(b, 3, NULL, &t), MOE_OK);
    cr_assert_eq(t.nbytes, 16);
    part c[] = {{"dtype", RAW("\xa4"
                              "bf16")},
                {"shape", RAW("\x91\x08")},
                DATA16};
    cr_assert_eq(read_parts(c, 3, NULL, &t), MOE_OK);
    cr_assert_eq(t.dtype, MOE_BF16);
    part d[] = {{"dtype", RAW("\xa3"
                              "f16")},
                {"shape", RAW("\x92\xd3\0\0\0\0\0\0\0\x04\xcc\x02")},
                DATA16};
    cr_assert_eq(read_parts(d, 3, NULL, &t), MOE_OK, "non-minimal int dims accepted");
    cr_assert_eq(t.dtype, MOE_F16);
}

Test(proto_tensor, rejections)
{
    moe_tensor t;
    mp_errbuf eb;
    struct {
        part p[4];
        int n;
        moe_err want;
        const char *what;
    } cases[] = {
        {{{"dtype", RAW("\xa3"
                        "f64")},
          SHAPE_2x2,
          DATA16},
         3,
         MOE_EINVAL,
         "bad dtype"},
        {{{"dtype", RAW("\xa0")}, SHAPE_2x2, DATA16}, 3, MOE_EINVAL, "empty dtype"},
        {{{"dtype", RAW("\x01")}, SHAPE_2x2, DATA16}, 3, MOE_EPROTO, "dtype not a str"},
        {{F32, {"shape", RAW("\x92\x02\x03")}, DATA16}, 3, MOE_EINVAL, "shape mismatch"},
        {{F32, {"shape", RAW("\x91\x05")}, DATA16}, 3, MOE_EINVAL, "shape too small"},
        {{F32, {"shape", RAW("\x90")}, DATA16}, 3, MOE_EINVAL, "ndim 0"},
        {{F32, {"shape", RAW("\x95\x01\x01\x01\x01\x04")}, DATA16}, 3, MOE_EINVAL, "ndim 5"},
        {{F32, {"shape", RAW("\x92\xff\xfc")}, DATA16}, 3, MOE_EINVAL, "negative dims"},
        {{F32, {"shape", RAW("\x92\x04\xff")}, DATA16}, 3, MOE_EINVAL, "dim -1"},
        {{F32, {"shape", RAW("\x92\xcf\xff\xff\xff\xff\xff\xff\xff\xff\x01")}, DATA16},
         3,
         MOE_EINVAL,
         "dim > int64"},
        {{F32, {"shape", RAW("\x93\xce\xff\xff\xff\xff\xce\xff\xff\xff\xff\x04")}, DATA16},
         3,
         MOE_EINVAL,
         "product overflows int64"},
        {{F32, {"shape", RAW("\x92\xce\x80\0\0\0\xce\x80\0\0\0")}, DATA16},
         3,
         MOE_EINVAL,
         "product x elsize overflows"},
        {{F32, {"shape", RAW("\x91\xce\x40\0\0\0")}, DATA16}, 3, MOE_EINVAL, "over 4 GiB"},
        {{F32, {"shape", RAW("\x91\xa1x")}, DATA16}, 3, MOE_EPROTO, "dim not an int"},
        {{F32, {"shape", RAW("\x01")}, DATA16}, 3, MOE_EPROTO, "shape not an array"},
        {{F32, SHAPE_2x2, {"data", RAW("\xa2hi")}}, 3, MOE_EPROTO, "data not a bin"},
        {{F32, SHAPE_2x2}, 2, MOE_EINVAL, "missing data"},
        {{SHAPE_2x2, DATA16}, 2, MOE_EINVAL, "missing dtype"},
        {{F32, DATA16}, 2, MOE_EINVAL, "missing shape"},
        {{F32, SHAPE_2x2, DATA16, F32}, 4, MOE_EINVAL, "duplicate dtype"},
        {{F32, SHAPE_2x2, DATA16, DATA16}, 4, MOE_EINVAL, "duplicate data"},
        {{F32, SHAPE_2x2, DATA16, {"strides", RAW("\x90")}}, 4, MOE_EINVAL, "unknown key"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        eb.msg[0] = '\0';
        moe_err e = read_parts(cases[i].p, cases[i].n, &eb, &t);
        cr_assert_eq(e, cases[i].want, "%s: got %d (%s)", cases[i].what, e, eb.msg);
        if (getenv("PROTO_SHOW"))
            fprintf(stderr, "%-28s %s\n", cases[i].what, eb.msg);
        cr_assert(eb.msg[0] != '\0', "%s: empty message", cases[i].what);
    }
}

Test(proto_tensor, not_a_map_and_truncated)
{
    static const uint8_t arr[] = {0x93, 0x01, 0x02, 0x03};
    static const uint8_t keyint[] = {0x81, 0x01, 0x02};
    mp_reader r;
    mp_errbuf eb;
    moe_tensor t;
    mp_reader_init(&r, arr, sizeof(arr));
    ASSERT_ERR(moe_tensor_read(&r, &t, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, keyint, sizeof(keyint));
    ASSERT_ERR(moe_tensor_read(&r, &t, &eb), MOE_EPROTO, eb);
    /* every prefix of a valid tensor fails with a reason */
    moe_tensor ok = {.dtype = MOE_F16, .ndim = 2, .shape = {3, 5}, .data = NULL};
    mp_writer w;
    mp_writer_init(&w);
    void *p = moe_tensor_write_reserve(&w, ok.dtype, ok.ndim, ok.shape);
    memset(p, 0x3c, 30);
    for (size_t n = 0; n < w.len; n++) {
        mp_reader_init(&r, w.buf, n);
        eb.msg[0] = '\0';
        moe_err e = moe_tensor_read(&r, &t, &eb);
        cr_assert(e == MOE_EPROTO || e == MOE_EINVAL, "prefix %zu: %d", n, e);
        cr_assert(eb.msg[0] != '\0');
    }
    mp_writer_fini(&w);
}

Test(proto_tensor, writer_refuses_invalid)
{
    int64_t bad0[] = {2, 2};
    mp_writer w;
    mp_writer_init(&w);
    cr_assert_null(moe_tensor_write_reserve(&w, MOE_F32, 0, bad0));
    cr_assert(w.failed);
    mp_writer_fini(&w);
    mp_writer_init(&w);
    cr_assert_null(moe_tensor_write_reserve(&w, (moe_dtype)9, 2, bad0));
    cr_assert(w.failed);
    mp_writer_fini(&w);
    int64_t neg[] = {2, -2};
    mp_writer_init(&w);
    cr_assert_null(moe_tensor_write_reserve(&w, MOE_F32, 2, neg));
    mp_writer_fini(&w);
    moe_tensor t = {.dtype = MOE_F32, .ndim = 2, .shape = {2, 2}, .nbytes = 15};
    mp_writer_init(&w);
    moe_tensor_write(&w, &t);
    cr_assert(w.failed, "nbytes mismatch must not be encoded");
    mp_writer_fini(&w);
    moe_tensor five = {.ndim = 5};
    cr_assert_eq(moe_tensor_numel(&five), -1);
    moe_tensor ovf = {.ndim = 2, .shape = {INT64_MAX, 2}};
    cr_assert_eq(moe_tensor_numel(&ovf), -1);
}
