/*
 * test_proto_mp.c - the msgpack reader and writer: round trips at every
 * width boundary (bytes compared with msgpack-c's packer), every rejection
 * path of the bounded reader, nesting caps, and a differential test against
 * msgpack-c's unpacker on random valid messages.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "proto/proto.h"

/* ---- helpers ---- */

typedef struct sbuf {
    uint8_t *p;
    size_t len;
} sbuf;

static int sbuf_write(void *data, const char *buf, size_t len)
{
    msgpack_sbuffer *sb = data;
    return msgpack_sbuffer_write(sb, buf, len);
}

/* expect_same asserts that w's bytes equal msgpack-c's packer bytes. */
static void expect_same(mp_writer *w, msgpack_sbuffer *sb, const char *what)
{
    cr_assert(!w->failed);
    cr_assert_eq(w->len, sb->size, "%s: length %zu vs msgpack-c %zu", what, w->len, sb->size);
    cr_assert(memcmp(w->buf, sb->data, sb->size) == 0, "%s: bytes differ from msgpack-c", what);
}

#define ASSERT_ERR(call, code, eb)                                                                 \
    do {                                                                                           \
        (eb).msg[0] = '\0';                                                                        \
        moe_err e_ = (call);                                                                       \
        cr_assert_eq(e_, (code), "%s: got %d (%s), want %d", #call, e_, (eb).msg, (code));         \
        cr_assert((eb).msg[0] != '\0', "%s: empty error message", #call);                          \
    } while (0)

/* ---- integers ---- */

static const uint64_t uvals[] = {0,          1,          127,       128,
                                 255,        256,        65535,     65536,
                                 UINT32_MAX, 1ull << 32, INT64_MAX, (uint64_t)INT64_MAX + 1,
                                 UINT64_MAX};
static const uint8_t umark[] = {0x00, 0x01, 0x7f, 0xcc, 0xcc, 0xcd, 0xcd,
                                0xce, 0xce, 0xcf, 0xcf, 0xcf, 0xcf};
static const int64_t ivals[] = {
    -1, -32, -33, -128, -129, -32768, -32769, INT32_MIN, (int64_t)INT32_MIN - 1, INT64_MIN};
static const uint8_t imark[] = {0xff, 0xe0, 0xd0, 0xd0, 0xd1, 0xd1, 0xd2, 0xd2, 0xd3, 0xd3};

Test(proto_mp_int, uint_round_trip_every_width)
{
    for (size_t i = 0; i < sizeof(uvals) / sizeof(uvals[0]); i++) {
        mp_writer w;
        mp_writer_init(&w);
        mp_write_u64(&w, uvals[i]);
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, sbuf_write);
        msgpack_pack_uint64(&pk, uvals[i]);
        expect_same(&w, &sb, "u64");
        cr_assert_eq(w.buf[0], umark[i], "value %llu marker 0x%02x", (unsigned long long)uvals[i],
                     w.buf[0]);
        mp_reader r;
        mp_reader_init(&r, w.buf, w.len);
        cr_assert_eq(mp_peek(&r), MP_UINT);
        uint64_t u = 0;
        cr_assert_eq(mp_read_u64(&r, &u, NULL), MOE_OK);
        cr_assert_eq(u, uvals[i]);
        cr_assert_eq(mp_left(&r), 0);
        mp_reader_init(&r, w.buf, w.len);
        int64_t v = 0;
        mp_errbuf eb;
        if (uvals[i] > INT64_MAX) {
            ASSERT_ERR(mp_read_i64(&r, &v, &eb), MOE_EINVAL, eb);
        } else {
            cr_assert_eq(mp_read_i64(&r, &v, NULL), MOE_OK);
            cr_assert_eq((uint64_t)v, uvals[i]);
        }
        /* the signed writer picks the same (unsigned) encoding */
        if (uvals[i] <= INT64_MAX) {
            mp_writer w2;
            mp_writer_init(&w2);
            mp_write_i64(&w2, (int64_t)uvals[i]);
            cr_assert_eq(w2.len, w.len);
            cr_assert(memcmp(w2.buf, w.buf, w.len) == 0);
            mp_writer_fini(&w2);
        }
        msgpack_sbuffer_destroy(&sb);
        mp_writer_fini(&w);
    }
}

Test(proto_mp_int, negative_round_trip_every_width)
{
    for (size_t i = 0; i < sizeof(ivals) / sizeof(ivals[0]); i++) {
        mp_writer w;
        mp_writer_init(&w);
        mp_write_i64(&w, ivals[i]);
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, sbuf_write);
        msgpack_pack_int64(&pk, ivals[i]);
        expect_same(&w, &sb, "i64");
        cr_assert_eq(w.buf[0], imark[i]);
        mp_reader r;
        mp_reader_init(&r, w.buf, w.len);
        cr_assert_eq(mp_peek(&r), MP_INT);
        int64_t v = 0;
        cr_assert_eq(mp_read_i64(&r, &v, NULL), MOE_OK);
        cr_assert_eq(v, ivals[i]);
        mp_reader_init(&r, w.buf, w.len);
        uint64_t u;
        mp_errbuf eb;
        ASSERT_ERR(mp_read_u64(&r, &u, &eb), MOE_EINVAL, eb);
        mp_reader_init(&r, w.buf, w.len);
        double d;
        cr_assert_eq(mp_read_f64(&r, &d, NULL), MOE_OK);
        cr_assert_eq(d, (double)ivals[i]);
        msgpack_sbuffer_destroy(&sb);
        mp_writer_fini(&w);
    }
}

Test(proto_mp_int, accepts_any_encoding_that_fits)
{
    static const struct {
        uint8_t b[9];
        size_t n;
        int64_t v;
    } cases[] = {
        {{0xcc, 0x05}, 2, 5},
        {{0xcd, 0x00, 0x05}, 3, 5},
        {{0xce, 0, 0, 0, 5}, 5, 5},
        {{0xcf, 0, 0, 0, 0, 0, 0, 0, 5}, 9, 5},
        {{0xd0, 0x05}, 2, 5},
        {{0xd1, 0x00, 0x05}, 3, 5},
        {{0xd2, 0, 0, 0, 5}, 5, 5},
        {{0xd3, 0, 0, 0, 0, 0, 0, 0, 5}, 9, 5},
        {{0xd0, 0xff}, 2, -1},
        {{0xd1, 0xff, 0xff}, 3, -1},
        {{0xd2, 0xff, 0xff, 0xff, 0xff}, 5, -1},
        {{0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, 9, -1},
        {{0xd3, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, 9, INT64_MAX},
        {{0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0}, 9, INT64_MIN},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mp_reader r;
        mp_reader_init(&r, cases[i].b, cases[i].n);
        cr_assert_eq(mp_peek(&r), cases[i].v >= 0 ? MP_UINT : MP_INT, "case %zu", i);
        int64_t v;
        cr_assert_eq(mp_read_i64(&r, &v, NULL), MOE_OK, "case %zu", i);
        cr_assert_eq(v, cases[i].v, "case %zu", i);
        cr_assert_eq(mp_left(&r), 0);
        if (cases[i].v >= 0) {
            uint64_t u;
            mp_reader_init(&r, cases[i].b, cases[i].n);
            cr_assert_eq(mp_read_u64(&r, &u, NULL), MOE_OK, "case %zu", i);
            cr_assert_eq(u, (uint64_t)cases[i].v);
        }
    }
}

/* ---- nil, bool, floats ---- */

Test(proto_mp_scalar, nil_bool_round_trip)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_nil(&w);
    mp_write_bool(&w, true);
    mp_write_bool(&w, false);
    cr_assert_eq(w.len, 3);
    cr_assert(memcmp(w.buf, "\xc0\xc3\xc2", 3) == 0);
    mp_reader r;
    mp_reader_init(&r, w.buf, w.len);
    cr_assert_eq(mp_peek(&r), MP_NIL);
    cr_assert_eq(mp_read_nil(&r, NULL), MOE_OK);
    bool b = false;
    cr_assert_eq(mp_peek(&r), MP_BOOL);
    cr_assert_eq(mp_read_bool(&r, &b, NULL), MOE_OK);
    cr_assert(b);
    cr_assert_eq(mp_read_bool(&r, &b, NULL), MOE_OK);
    cr_assert(!b);
    cr_assert_eq(mp_peek(&r), MP_INVALID);
    mp_writer_fini(&w);
}

Test(proto_mp_scalar, float_round_trip)
{
    static const double dv[] = {0.0, -0.0, 1.5, -3.25e300, 5e-324, INFINITY, -INFINITY, NAN};
    for (size_t i = 0; i < sizeof(dv) / sizeof(dv[0]); i++) {
        mp_writer w;
        mp_writer_init(&w);
        mp_write_f64(&w, dv[i]);
        mp_write_f32(&w, (float)dv[i]);
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, sbuf_write);
        msgpack_pack_double(&pk, dv[i]);
        msgpack_pack_float(&pk, (float)dv[i]);
        expect_same(&w, &sb, "float");
        cr_assert_eq(w.len, 9 + 5);
        mp_reader r;
        mp_reader_init(&r, w.buf, w.len);
        cr_assert_eq(mp_peek(&r), MP_FLOAT);
        double a, b;
        cr_assert_eq(mp_read_f64(&r, &a, NULL), MOE_OK);
        cr_assert_eq(mp_read_f64(&r, &b, NULL), MOE_OK);
        double want_b = (float)dv[i];
        cr_assert(memcmp(&a, &dv[i], sizeof(a)) == 0 || (isnan(a) && isnan(dv[i])));
        cr_assert(memcmp(&b, &want_b, sizeof(b)) == 0 || (isnan(b) && isnan(want_b)));
        msgpack_sbuffer_destroy(&sb);
        mp_writer_fini(&w);
    }
}

/* ---- str, bin ---- */

static const uint32_t lens[] = {0, 1, 31, 32, 255, 256, 65535, 65536, 70000};

Test(proto_mp_bytes, str_round_trip_every_width)
{
    static const uint8_t mark[] = {0xa0, 0xa1, 0xbf, 0xd9, 0xd9, 0xda, 0xda, 0xdb, 0xdb};
    char *s = malloc(70000);
    for (uint32_t i = 0; i < 70000; i++)
        s[i] = (char)('a' + i % 26);
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        mp_writer w;
        mp_writer_init(&w);
        mp_write_str(&w, s, lens[i]);
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, sbuf_write);
        msgpack_pack_str_with_body(&pk, s, lens[i]);
        expect_same(&w, &sb, "str");
        cr_assert_eq(w.buf[0], mark[i], "len %u", lens[i]);
        mp_reader r;
        mp_reader_init(&r, w.buf, w.len);
        cr_assert_eq(mp_peek(&r), MP_STR);
        const char *got;
        uint32_t n;
        cr_assert_eq(mp_read_str(&r, &got, &n, NULL), MOE_OK);
        cr_assert_eq(n, lens[i]);
        cr_assert(memcmp(got, s, n) == 0);
        cr_assert_eq(mp_left(&r), 0);
        /* zero copy: the string points into the buffer */
        cr_assert(got >= (const char *)w.buf && got + n <= (const char *)w.buf + w.len);
        /* one byte short of the payload: truncated */
        mp_errbuf eb;
        mp_reader_init(&r, w.buf, w.len - 1);
        if (lens[i] > 0)
            ASSERT_ERR(mp_read_str(&r, &got, &n, &eb), MOE_EPROTO, eb);
        msgpack_sbuffer_destroy(&sb);
        mp_writer_fini(&w);
    }
    free(s);
}

Test(proto_mp_bytes, bin_round_trip_every_width)
{
    static const uint8_t mark[] = {0xc4, 0xc4, 0xc4, 0xc4, 0xc4, 0xc5, 0xc5, 0xc6, 0xc6};
    uint8_t *d = malloc(70000);
    for (uint32_t i = 0; i < 70000; i++)
        d[i] = (uint8_t)(i * 7);
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        mp_writer w;
        mp_writer_init(&w);
        mp_write_bin(&w, d, lens[i]);
        /* the reserve path writes the same bytes */
        mp_writer w2;
        mp_writer_init(&w2);
        void *p = mp_writer_reserve_bin(&w2, lens[i]);
        cr_assert_not_null(p);
        memcpy(p, d, lens[i]);
        cr_assert_eq(w2.len, w.len);
        cr_assert(memcmp(w2.buf, w.buf, w.len) == 0);
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, sbuf_write);
        msgpack_pack_bin_with_body(&pk, d, lens[i]);
        expect_same(&w, &sb, "bin");
        cr_assert_eq(w.buf[0], mark[i]);
        mp_reader r;
        mp_reader_init(&r, w.buf, w.len);
        cr_assert_eq(mp_peek(&r), MP_BIN);
        const void *got;
        uint32_t n;
        cr_assert_eq(mp_read_bin(&r, &got, &n, NULL), MOE_OK);
        cr_assert_eq(n, lens[i]);
        cr_assert(memcmp(got, d, n) == 0);
        cr_assert_eq(mp_left(&r), 0);
        msgpack_sbuffer_destroy(&sb);
        mp_writer_fini(&w);
        mp_writer_fini(&w2);
    }
    free(d);
}

Test(proto_mp_bytes, str_eq_and_cstr)
{
    cr_assert(mp_str_eq("ping", 4, "ping"));
    cr_assert(!mp_str_eq("ping", 3, "ping"));
    cr_assert(!mp_str_eq("pinG", 4, "ping"));
    cr_assert(mp_str_eq("", 0, ""));
    cr_assert(!mp_str_eq("pin", 3, "ping")); /* a prefix of the name */
    cr_assert(!mp_str_eq("ping!", 5, "ping"));
    cr_assert(!mp_str_eq("pi\0g", 4, "pi")); /* a NUL inside the read string */
    cr_assert(!mp_str_eq("", 0, "ping"));
    mp_writer w;
    mp_writer_init(&w);
    mp_write_cstr(&w, "forward");
    cr_assert_eq(w.len, 8);
    cr_assert(memcmp(w.buf,
                     "\xa7"
                     "forward",
                     8) == 0);
    mp_writer_fini(&w);
}

/* ---- array, map ---- */

static const uint32_t counts[] = {0, 1, 15, 16, 65535, 65536};

Test(proto_mp_container, array_and_map_round_trip_every_width)
{
    static const uint8_t amark[] = {0x90, 0x91, 0x9f, 0xdc, 0xdc, 0xdd};
    static const uint8_t mmark[] = {0x80, 0x81, 0x8f, 0xde, 0xde, 0xdf};
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
        for (int is_map = 0; is_map < 2; is_map++) {
            mp_writer w;
            mp_writer_init(&w);
            msgpack_sbuffer sb;
            msgpack_sbuffer_init(&sb);
            msgpack_packer pk;
            msgpack_packer_init(&pk, &sb, sbuf_write);
            uint32_t n = counts[i];
            if (is_map) {
                mp_write_map(&w, n);
                msgpack_pack_map(&pk, n);
            } else {
                mp_write_array(&w, n);
                msgpack_pack_array(&pk, n);
            }
            for (uint32_t j = 0; j < n * (is_map ? 2u : 1u); j++) {
                mp_write_u64(&w, j % 100);
                msgpack_pack_uint32(&pk, j % 100);
            }
            expect_same(&w, &sb, is_map ? "map" : "array");
            cr_assert_eq(w.buf[0], is_map ? mmark[i] : amark[i]);
            mp_reader r;
            mp_reader_init(&r, w.buf, w.len);
            cr_assert_eq(mp_peek(&r), is_map ? MP_MAP : MP_ARRAY);
            uint32_t got;
            cr_assert_eq(is_map ? mp_read_map(&r, &got, NULL) : mp_read_array(&r, &got, NULL),
                         MOE_OK);
            cr_assert_eq(got, n);
            for (uint32_t j = 0; j < n * (is_map ? 2u : 1u); j++) {
                uint64_t u;
                cr_assert_eq(mp_read_u64(&r, &u, NULL), MOE_OK);
                cr_assert_eq(u, j % 100);
            }
            cr_assert_eq(mp_left(&r), 0);
            mp_reader_init(&r, w.buf, w.len);
            cr_assert_eq(mp_skip(&r, NULL), MOE_OK);
            cr_assert_eq(mp_left(&r), 0);
            msgpack_sbuffer_destroy(&sb);
            mp_writer_fini(&w);
        }
    }
}

/* ---- rejections ---- */

Test(proto_mp_reject, array32_header_claiming_16_million_elements)
{
    static const uint8_t msg[] = {0xdd, 0x00, 0xff, 0xff, 0xff};
    mp_reader r;
    mp_errbuf eb;
    uint32_t n = 123;
    mp_reader_init(&r, msg, sizeof(msg));
    ASSERT_ERR(mp_read_array(&r, &n, &eb), MOE_EPROTO, eb);
    cr_assert_eq(n, 123, "count must not be handed out");
    cr_assert(strstr(eb.msg, "16777215") != NULL, "reason: %s", eb.msg);
    mp_reader_init(&r, msg, sizeof(msg));
    ASSERT_ERR(mp_skip(&r, &eb), MOE_EPROTO, eb);
    /* with 3 bytes after it, still refused */
    static const uint8_t msg2[] = {0xdd, 0x01, 0x00, 0x00, 0x00, 0xc0, 0xc0, 0xc0};
    mp_reader_init(&r, msg2, sizeof(msg2));
    ASSERT_ERR(mp_read_array(&r, &n, &eb), MOE_EPROTO, eb);
    cr_assert(strstr(eb.msg, "16777216 elements but 3 bytes remain") != NULL, "reason: %s", eb.msg);
}

Test(proto_mp_reject, counts_larger_than_bytes_left)
{
    static const struct {
        uint8_t b[8];
        size_t n;
    } cases[] = {
        {{0x91}, 1},                         /* fixarray 1, nothing */
        {{0x92, 0xc0}, 2},                   /* fixarray 2, 1 byte */
        {{0x81, 0xc0}, 2},                   /* fixmap 1 needs 2 bytes */
        {{0xdc, 0x00, 0x02, 0xc0}, 4},       /* array16 */
        {{0xde, 0x00, 0x02, 0xc0, 0xc0}, 5}, /* map16: 2 pairs need 4 bytes */
        {{0xdf, 0xff, 0xff, 0xff, 0xff}, 5}, /* map32 max */
        {{0xa3, 'a', 'b'}, 3},               /* fixstr */
        {{0xd9, 0x05, 'a'}, 3},              /* str8 */
        {{0xda, 0x01, 0x00}, 3},             /* str16 */
        {{0xdb, 0xff, 0xff, 0xff, 0xff}, 5}, /* str32 */
        {{0xc4, 0x02, 0x00}, 3},             /* bin8 */
        {{0xc5, 0x01, 0x00}, 3},             /* bin16 */
        {{0xc6, 0x7f, 0xff, 0xff, 0xff}, 5}, /* bin32 */
        {{0xc7, 0x03, 0x01, 0x00}, 4},       /* ext8 */
        {{0xc9, 0xff, 0xff, 0xff, 0xff, 1}, 6},
        {{0xd8, 0x01, 0x00}, 3}, /* fixext16 */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mp_reader r;
        mp_errbuf eb;
        mp_reader_init(&r, cases[i].b, cases[i].n);
        ASSERT_ERR(mp_skip(&r, &eb), MOE_EPROTO, eb);
    }
}

Test(proto_mp_reject, truncated_headers)
{
    static const uint8_t markers[] = {0xc4, 0xc5, 0xc6, 0xc7, 0xc8, 0xc9, 0xca, 0xcb, 0xcc, 0xcd,
                                      0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3, 0xd4, 0xd5, 0xd6, 0xd7,
                                      0xd8, 0xd9, 0xda, 0xdb, 0xdc, 0xdd, 0xde, 0xdf};
    for (size_t i = 0; i < sizeof(markers); i++) {
        mp_reader r;
        mp_errbuf eb;
        mp_reader_init(&r, &markers[i], 1);
        ASSERT_ERR(mp_skip(&r, &eb), MOE_EPROTO, eb);
        cr_assert(strstr(eb.msg, "truncated") != NULL, "0x%02x: %s", markers[i], eb.msg);
    }
    mp_reader r;
    mp_errbuf eb;
    mp_reader_init(&r, NULL, 0);
    cr_assert_eq(mp_peek(&r), MP_INVALID);
    ASSERT_ERR(mp_skip(&r, &eb), MOE_EPROTO, eb);
    int64_t v;
    ASSERT_ERR(mp_read_i64(&r, &v, &eb), MOE_EPROTO, eb);
}

/* skip_whole_not_prefixes: mp_skip takes buf's len bytes as one value and
 * refuses every shorter prefix as truncated */
static void skip_whole_not_prefixes(const uint8_t *buf, size_t len)
{
    for (size_t n = 0; n < len; n++) {
        mp_reader r;
        mp_errbuf eb;
        mp_reader_init(&r, buf, n);
        ASSERT_ERR(mp_skip(&r, &eb), MOE_EPROTO, eb);
    }
    mp_reader r;
    mp_reader_init(&r, buf, len);
    cr_assert_eq(mp_skip(&r, NULL), MOE_OK);
    cr_assert_eq(mp_left(&r), 0);
}

Test(proto_mp_reject, every_prefix_of_a_message_is_truncated)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 3);
    mp_write_cstr(&w, "a");
    mp_write_array(&w, 3);
    mp_write_i64(&w, -70000);
    mp_write_f64(&w, 2.5);
    mp_write_str(&w, "0123456789012345678901234567890123456789", 40);
    mp_write_cstr(&w, "b");
    mp_write_bin(&w, "xyz", 3);
    mp_write_cstr(&w, "c");
    mp_write_raw(&w, "\xd6\x01\x00\x00\x00\x00", 6); /* fixext4 */
    skip_whole_not_prefixes(w.buf, w.len);
    mp_writer_fini(&w);
}

/* mp_skip's and mp_read_i64/u64's fast paths for scalars (an array of
 * per-expert counts is hundreds of them): every width, each prefix cut
 * short refused, the whole message skipped to its end and read back */
Test(proto_mp_reject, scalar_arrays_every_width_and_prefix)
{
    static const int64_t iv[] = {0,
                                 127,
                                 128,
                                 255,
                                 256,
                                 65535,
                                 65536,
                                 -1,
                                 -32,
                                 -33,
                                 -128,
                                 -129,
                                 -32768,
                                 -32769,
                                 (int64_t)1 << 40,
                                 -70000,
                                 -((int64_t)1 << 40)};
    const int ni = (int)(sizeof(iv) / sizeof(iv[0]));
    mp_writer w;
    mp_writer_init(&w);
    mp_write_array(&w, (uint32_t)ni + 5);
    for (int i = 0; i < ni; i++)
        mp_write_i64(&w, iv[i]);
    mp_write_f32(&w, 1.5f);
    mp_write_f64(&w, 2.5);
    mp_write_nil(&w);
    mp_write_bool(&w, true);
    mp_write_u64(&w, UINT64_MAX);
    cr_assert(!w.failed);
    skip_whole_not_prefixes(w.buf, w.len);
    mp_reader r;
    /* read back: the integers as written, each one cut short refused */
    mp_reader_init(&r, w.buf, w.len);
    uint32_t n;
    cr_assert_eq(mp_read_array(&r, &n, NULL), MOE_OK);
    for (int i = 0; i < ni; i++) {
        const uint8_t *at = r.p;
        int64_t v = 0;
        cr_assert_eq(mp_read_i64(&r, &v, NULL), MOE_OK, "value %d", i);
        cr_assert_eq(v, iv[i], "value %d: %lld", i, (long long)v);
        for (const uint8_t *end = at; end < r.p; end++) {
            mp_reader t;
            mp_reader_init(&t, at, (size_t)(end - at));
            cr_assert_eq(mp_read_i64(&t, &v, NULL), MOE_EPROTO, "value %d cut to %td bytes", i,
                         end - at);
            if (iv[i] >= 0) {
                uint64_t u;
                mp_reader_init(&t, at, (size_t)(end - at));
                cr_assert_eq(mp_read_u64(&t, &u, NULL), MOE_EPROTO);
            }
        }
    }
    mp_writer_fini(&w);
}

Test(proto_mp_reject, reserved_c1)
{
    static const uint8_t b[] = {0xc1};
    static const uint8_t nested[] = {0x92, 0x01, 0xc1};
    mp_reader r;
    mp_errbuf eb;
    mp_reader_init(&r, b, 1);
    cr_assert_eq(mp_peek(&r), MP_INVALID);
    ASSERT_ERR(mp_skip(&r, &eb), MOE_EPROTO, eb);
    cr_assert(strstr(eb.msg, "0xc1") != NULL);
    mp_reader_init(&r, b, 1);
    ASSERT_ERR(mp_read_nil(&r, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, nested, sizeof(nested));
    ASSERT_ERR(mp_skip(&r, &eb), MOE_EPROTO, eb);
}

Test(proto_mp_reject, wrong_types)
{
    static const uint8_t str[] = {0xa1, 'x'};
    static const uint8_t one[] = {0x01};
    static const uint8_t arr[] = {0x90};
    static const uint8_t f[] = {0xca, 0, 0, 0, 0};
    mp_reader r;
    mp_errbuf eb;
    const char *s;
    const void *d;
    uint32_t n;
    int64_t i;
    uint64_t u;
    double x;
    bool b;
    mp_reader_init(&r, str, sizeof(str));
    ASSERT_ERR(mp_read_i64(&r, &i, &eb), MOE_EPROTO, eb);
    cr_assert(strstr(eb.msg, "expected int") != NULL, "%s", eb.msg);
    mp_reader_init(&r, str, sizeof(str));
    ASSERT_ERR(mp_read_bin(&r, &d, &n, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, str, sizeof(str));
    ASSERT_ERR(mp_read_f64(&r, &x, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, one, sizeof(one));
    ASSERT_ERR(mp_read_str(&r, &s, &n, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, one, sizeof(one));
    ASSERT_ERR(mp_read_bool(&r, &b, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, one, sizeof(one));
    ASSERT_ERR(mp_read_nil(&r, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, one, sizeof(one));
    ASSERT_ERR(mp_read_array(&r, &n, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, arr, sizeof(arr));
    ASSERT_ERR(mp_read_map(&r, &n, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, f, sizeof(f));
    ASSERT_ERR(mp_read_u64(&r, &u, &eb), MOE_EPROTO, eb);
    mp_reader_init(&r, f, sizeof(f));
    ASSERT_ERR(mp_read_i64(&r, &i, &eb), MOE_EPROTO, eb);
}

/* ---- nesting ---- */

static moe_err skip_nested(uint8_t marker, size_t depth, mp_errbuf *eb)
{
    /* depth nested containers of one element each, innermost holds nil */
    size_t per = marker == 0x81 ? 2 : 1;
    size_t n = depth * per + 1;
    uint8_t *b = malloc(n);
    for (size_t i = 0; i < depth; i++) {
        b[i * per] = marker;
        if (per == 2)
            b[i * per + 1] = 0xc0; /* key nil, value is the next container */
    }
    b[n - 1] = 0xc0;
    mp_reader r;
    mp_reader_init(&r, b, n);
    moe_err e = mp_skip(&r, eb);
    if (e == MOE_OK)
        cr_assert_eq(mp_left(&r), 0);
    free(b);
    return e;
}

Test(proto_mp_nesting, depth_capped)
{
    mp_errbuf eb;
    cr_assert_eq(skip_nested(0x91, MP_MAX_DEPTH, &eb), MOE_OK);
    ASSERT_ERR(skip_nested(0x91, MP_MAX_DEPTH + 1, &eb), MOE_EPROTO, eb);
    cr_assert(strstr(eb.msg, "nesting") != NULL, "%s", eb.msg);
    cr_assert_eq(skip_nested(0x81, MP_MAX_DEPTH, &eb), MOE_OK);
    ASSERT_ERR(skip_nested(0x81, MP_MAX_DEPTH + 1, &eb), MOE_EPROTO, eb);
    /* a million nested arrays: rejected quickly, no stack overflow */
    ASSERT_ERR(skip_nested(0x91, 1000000, &eb), MOE_EPROTO, eb);
    /* depth counted from the root when asked */
    static const uint8_t one[] = {0x91, 0xc0};
    mp_reader r;
    mp_reader_init(&r, one, sizeof(one));
    ASSERT_ERR(mp_skip_depth(&r, MP_MAX_DEPTH, &eb), MOE_EPROTO, eb);
}

/* ---- writer ---- */

Test(proto_mp_writer, take_and_empty)
{
    mp_writer w;
    mp_writer_init(&w);
    size_t len = 99;
    uint8_t *b = mp_writer_take(&w, &len);
    cr_assert_not_null(b);
    cr_assert_eq(len, 0);
    free(b);
    mp_write_u64(&w, 300);
    b = mp_writer_take(&w, &len);
    cr_assert_eq(len, 3);
    cr_assert(memcmp(b, "\xcd\x01\x2c", 3) == 0);
    cr_assert_eq(w.len, 0);
    cr_assert_null(w.buf);
    free(b);
    w.failed = true;
    mp_write_nil(&w);
    cr_assert_eq(w.len, 0);
    cr_assert_null(mp_writer_take(&w, &len));
    mp_writer_fini(&w);
}

Test(proto_mp_writer, errbuf_helpers)
{
    mp_errbuf eb;
    cr_assert_eq(mp_errf(&eb, MOE_EINVAL, "bad %d", 7), MOE_EINVAL);
    cr_assert_str_eq(eb.msg, "bad 7");
    mp_err_prefix(&eb, "param \"%s\": ", "x");
    cr_assert_str_eq(eb.msg, "param \"x\": bad 7");
    cr_assert_eq(mp_errf(NULL, MOE_EPROTO, "x"), MOE_EPROTO);
    mp_err_prefix(NULL, "y");
    cr_assert_str_eq(mp_type_name(MP_MAP), "map");
}

/* ---- differential against msgpack-c ---- */

static uint64_t rng_state;

static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void put(mp_writer *w, uint8_t m, uint64_t v, int n)
{
    uint8_t b[9];
    b[0] = m;
    for (int i = n; i >= 1; i--) {
        b[i] = (uint8_t)v;
        v >>= 8;
    }
    mp_write_raw(w, b, 1 + (size_t)n);
}

/* gen_len writes a str/bin/array/map header of a random width that fits. */
static void gen_hdr(mp_writer *w, uint8_t fix, uint8_t fixmax, uint8_t m8, uint8_t m16, uint8_t m32,
                    uint32_t n)
{
    for (;;) {
        switch (rnd() % 4) {
        case 0:
            if (fix && n <= fixmax) {
                put(w, (uint8_t)(fix | n), 0, 0);
                return;
            }
            break;
        case 1:
            if (m8 && n <= 255) {
                put(w, m8, n, 1);
                return;
            }
            break;
        case 2:
            if (n <= 65535) {
                put(w, m16, n, 2);
                return;
            }
            break;
        default: put(w, m32, n, 4); return;
        }
    }
}

/* gen writes one random valid value, with random (often non-minimal) widths. */
static void gen(mp_writer *w, int depth)
{
    int kind = (int)(rnd() % (depth < 6 ? 12 : 9));
    switch (kind) {
    case 0: put(w, 0xc0, 0, 0); break;
    case 1: put(w, rnd() & 1 ? 0xc3 : 0xc2, 0, 0); break;
    case 2: { /* non-negative int, any width that fits */
        int bits = (int)(rnd() % 65);
        uint64_t v = bits == 64 ? rnd() : rnd() & ((1ull << bits) - 1);
        for (;;) {
            int c = (int)(rnd() % 9);
            if (c == 0 && v <= 0x7f)
                return put(w, (uint8_t)v, 0, 0);
            if (c >= 1 && c <= 4 && (c == 4 || v < (1ull << (8 << (c - 1)))))
                return put(w, (uint8_t)(0xcc + c - 1), v, 1 << (c - 1));
            if (c >= 5 && (c == 8 || v < (1ull << ((8 << (c - 5)) - 1))))
                return put(w, (uint8_t)(0xd0 + c - 5), v, 1 << (c - 5));
        }
    }
    case 3: { /* negative int */
        int bits = (int)(rnd() % 64);
        int64_t v = -1 - (int64_t)(bits == 0 ? 0 : rnd() & ((1ull << bits) - 1));
        for (;;) {
            int c = (int)(rnd() % 5);
            if (c == 0 && v >= -32)
                return put(w, (uint8_t)(int8_t)v, 0, 0);
            static const int64_t lo[] = {-32, INT8_MIN, INT16_MIN, INT32_MIN, INT64_MIN};
            if (c >= 1 && v >= lo[c])
                return put(w, (uint8_t)(0xd0 + c - 1), (uint64_t)v, 1 << (c - 1));
        }
    }
    case 4: {
        float f;
        uint32_t bits = (uint32_t)rnd();
        memcpy(&f, &bits, 4);
        if (isnan(f))
            f = 1.0f;
        mp_write_f32(w, f);
        break;
    }
    case 5: {
        double d;
        uint64_t bits = rnd();
        memcpy(&d, &bits, 8);
        if (isnan(d))
            d = -2.0;
        mp_write_f64(w, d);
        break;
    }
    case 6:
    case 7: {
        uint32_t n = (uint32_t)(rnd() % 4 == 0 ? rnd() % 300 : rnd() % 20);
        if (kind == 6)
            gen_hdr(w, 0xa0, 31, 0xd9, 0xda, 0xdb, n);
        else
            gen_hdr(w, 0, 0, 0xc4, 0xc5, 0xc6, n);
        for (uint32_t i = 0; i < n; i++) {
            uint8_t c = (uint8_t)rnd();
            mp_write_raw(w, &c, 1);
        }
        break;
    }
    case 8: { /* ext, fixed or sized */
        static const uint8_t fixm[] = {0xd4, 0xd5, 0xd6, 0xd7, 0xd8};
        static const uint32_t fixn[] = {1, 2, 4, 8, 16};
        uint32_t n;
        if (rnd() & 1) {
            int i = (int)(rnd() % 5);
            put(w, fixm[i], 0, 0);
            n = fixn[i];
        } else {
            n = (uint32_t)(rnd() % 40);
            gen_hdr(w, 0, 0, 0xc7, 0xc8, 0xc9, n);
        }
        uint8_t type = (uint8_t)(rnd() % 100); /* not -1 (timestamp) */
        mp_write_raw(w, &type, 1);
        for (uint32_t i = 0; i < n; i++) {
            uint8_t c = (uint8_t)rnd();
            mp_write_raw(w, &c, 1);
        }
        break;
    }
    case 9:
    case 10: {
        uint32_t n = (uint32_t)(rnd() % 6);
        gen_hdr(w, 0x90, 15, 0, 0xdc, 0xdd, n);
        for (uint32_t i = 0; i < n; i++)
            gen(w, depth + 1);
        break;
    }
    default: {
        uint32_t n = (uint32_t)(rnd() % 5);
        gen_hdr(w, 0x80, 15, 0, 0xde, 0xdf, n);
        for (uint32_t i = 0; i < 2 * n; i++)
            gen(w, depth + 1);
        break;
    }
    }
}

/* agree walks our reader and msgpack-c's object tree together. */
static void agree(mp_reader *r, const msgpack_object *o)
{
    mp_type t = mp_peek(r);
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        cr_assert_eq(t, MP_NIL);
        cr_assert_eq(mp_read_nil(r, NULL), MOE_OK);
        break;
    case MSGPACK_OBJECT_BOOLEAN: {
        bool b;
        cr_assert_eq(t, MP_BOOL);
        cr_assert_eq(mp_read_bool(r, &b, NULL), MOE_OK);
        cr_assert_eq(b, o->via.boolean);
        break;
    }
    case MSGPACK_OBJECT_POSITIVE_INTEGER: {
        uint64_t u;
        cr_assert_eq(t, MP_UINT);
        cr_assert_eq(mp_read_u64(r, &u, NULL), MOE_OK);
        cr_assert_eq(u, o->via.u64);
        break;
    }
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: {
        int64_t v;
        cr_assert_eq(t, MP_INT);
        cr_assert_eq(mp_read_i64(r, &v, NULL), MOE_OK);
        cr_assert_eq(v, o->via.i64);
        break;
    }
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: {
        double d;
        cr_assert_eq(t, MP_FLOAT);
        cr_assert_eq(mp_read_f64(r, &d, NULL), MOE_OK);
        cr_assert(memcmp(&d, &o->via.f64, sizeof(d)) == 0);
        break;
    }
    case MSGPACK_OBJECT_STR: {
        const char *s;
        uint32_t n;
        cr_assert_eq(t, MP_STR);
        cr_assert_eq(mp_read_str(r, &s, &n, NULL), MOE_OK);
        cr_assert_eq(n, o->via.str.size);
        cr_assert(n == 0 || memcmp(s, o->via.str.ptr, n) == 0);
        break;
    }
    case MSGPACK_OBJECT_BIN: {
        const void *d;
        uint32_t n;
        cr_assert_eq(t, MP_BIN);
        cr_assert_eq(mp_read_bin(r, &d, &n, NULL), MOE_OK);
        cr_assert_eq(n, o->via.bin.size);
        cr_assert(n == 0 || memcmp(d, o->via.bin.ptr, n) == 0);
        break;
    }
    case MSGPACK_OBJECT_EXT: {
        cr_assert_eq(t, MP_EXT);
        size_t before = mp_left(r);
        cr_assert_eq(mp_skip(r, NULL), MOE_OK);
        /* the payload is the last size bytes of what was skipped */
        cr_assert(before - mp_left(r) >= o->via.ext.size + 2);
        cr_assert(o->via.ext.size == 0 ||
                  memcmp(r->p - o->via.ext.size, o->via.ext.ptr, o->via.ext.size) == 0);
        break;
    }
    case MSGPACK_OBJECT_ARRAY: {
        uint32_t n;
        cr_assert_eq(t, MP_ARRAY);
        cr_assert_eq(mp_read_array(r, &n, NULL), MOE_OK);
        cr_assert_eq(n, o->via.array.size);
        for (uint32_t i = 0; i < n; i++)
            agree(r, &o->via.array.ptr[i]);
        break;
    }
    case MSGPACK_OBJECT_MAP: {
        uint32_t n;
        cr_assert_eq(t, MP_MAP);
        cr_assert_eq(mp_read_map(r, &n, NULL), MOE_OK);
        cr_assert_eq(n, o->via.map.size);
        for (uint32_t i = 0; i < n; i++) {
            agree(r, &o->via.map.ptr[i].key);
            agree(r, &o->via.map.ptr[i].val);
        }
        break;
    }
    }
}

Test(proto_mp_differential, random_valid_messages_agree_with_msgpack_c)
{
    rng_state = 0x9e3779b97f4a7c15ull;
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    for (int iter = 0; iter < 20000; iter++) {
        mp_writer w;
        mp_writer_init(&w);
        gen(&w, 0);
        cr_assert(!w.failed);
        size_t off = 0;
        msgpack_unpack_return ret = msgpack_unpack_next(&up, (const char *)w.buf, w.len, &off);
        cr_assert_eq(ret, MSGPACK_UNPACK_SUCCESS, "iter %d: msgpack-c says %d", iter, ret);
        cr_assert_eq(off, w.len);
        mp_reader r;
        mp_reader_init(&r, w.buf, w.len);
        mp_reader s = r;
        cr_assert_eq(mp_skip(&s, NULL), MOE_OK, "iter %d", iter);
        cr_assert_eq(mp_left(&s), 0);
        agree(&r, &up.data);
        cr_assert_eq(mp_left(&r), 0);
        /* mutated copies: whenever we accept, msgpack-c must accept the
         * same bytes and decode the same values (we never hand an unchecked
         * count to msgpack-c, which would allocate it) */
        for (int m = 0; m < 4 && w.len > 0; m++) {
            uint8_t *c = malloc(w.len);
            memcpy(c, w.buf, w.len);
            c[rnd() % w.len] = (uint8_t)rnd();
            size_t clen = rnd() % 4 == 0 ? rnd() % w.len : w.len;
            mp_reader_init(&r, c, clen);
            s = r;
            if (mp_skip(&s, NULL) == MOE_OK) {
                size_t used = clen - mp_left(&s);
                off = 0;
                ret = msgpack_unpack_next(&up, (const char *)c, used, &off);
                cr_assert_eq(ret, MSGPACK_UNPACK_SUCCESS, "iter %d mutation %d", iter, m);
                cr_assert_eq(off, used);
                agree(&r, &up.data);
                cr_assert_eq(mp_left(&r), mp_left(&s));
            }
            free(c);
        }
        mp_writer_fini(&w);
    }
    msgpack_unpacked_destroy(&up);
}

/* ---- arrays of small counts in one step ---- */

/* mp_read_small_uints takes an array of positive fixints (fixarray and
 * array16 headers) as a view of its bytes, and refuses, with the reader
 * where it was, an array holding anything else, a value that is not an
 * array, or a count past the buffer */
Test(proto_mp_small_uints, view_or_refusal_with_the_reader_kept)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_array(&w, 3); /* fixarray of small counts */
    for (int i = 0; i < 3; i++)
        mp_write_i64(&w, 5 * i);
    mp_write_array(&w, 40); /* array16 of small counts */
    for (int i = 0; i < 40; i++)
        mp_write_i64(&w, i % 128);
    mp_write_array(&w, 2); /* a count of 128 takes two bytes: not small */
    mp_write_i64(&w, 1);
    mp_write_i64(&w, 128);
    mp_write_array(&w, 1); /* a negative fixint is not a count */
    mp_write_i64(&w, -1);
    mp_write_str(&w, "ab", 2); /* not an array */
    cr_assert(!w.failed);
    mp_reader r;
    mp_reader_init(&r, w.buf, w.len);
    uint32_t n = 0;
    const uint8_t *v = NULL;
    mp_errbuf eb;
    cr_assert_eq(mp_read_small_uints(&r, &n, &v, &eb), MOE_OK);
    cr_assert(n == 3 && v[0] == 0 && v[1] == 5 && v[2] == 10);
    cr_assert_eq(mp_read_small_uints(&r, &n, &v, &eb), MOE_OK);
    cr_assert(n == 40 && v[39] == 39);
    for (int k = 0; k < 3; k++) { /* refused, then read the long way */
        const size_t left = mp_left(&r);
        ASSERT_ERR(mp_read_small_uints(&r, &n, &v, &eb), MOE_EPROTO, eb);
        cr_assert_eq(mp_left(&r), left, "the reader moved on a refusal");
        cr_assert_eq(mp_skip(&r, NULL), MOE_OK);
    }
    cr_assert_eq(mp_left(&r), 0);
    /* a count past the end of the buffer: refused, nothing read out of bounds */
    const uint8_t cut[3] = {0x94, 0x01, 0x02}; /* fixarray of 4, 2 bytes present */
    mp_reader_init(&r, cut, sizeof(cut));
    ASSERT_ERR(mp_read_small_uints(&r, &n, &v, &eb), MOE_EPROTO, eb);
    cr_assert_eq(mp_left(&r), sizeof(cut));
    mp_writer_fini(&w);
}
