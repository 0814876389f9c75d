/*
 * mp_read.c - the strict bounded msgpack reader.
 *
 * Every value starts with read_hdr, which consumes the marker byte and the
 * fixed-size part after it, and checks any length or count it announces
 * against the bytes left BEFORE anyone uses it: a str/bin/ext of n bytes
 * needs n bytes, an array of n elements n bytes (one per element at least),
 * a map of n pairs 2n bytes. Nothing here allocates; str and bin results
 * point into the caller's buffer.
 */
#include <inttypes.h>
#include <string.h>

#include "proto/proto.h"

/* hdr: one decoded header. For str/bin/ext, n is the payload length (not yet
 * consumed; for ext the type byte is consumed); for array/map, the count. */
typedef struct hdr {
    mp_type type;
    uint8_t marker;
    bool b;
    uint64_t u; /* MP_UINT value, or MP_INT value as two's complement */
    double f;
    uint32_t n;
} hdr;

static uint16_t be16(const uint8_t *p)
{
    return (uint16_t)((uint16_t)p[0] << 8 | p[1]);
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t be64(const uint8_t *p)
{
    return (uint64_t)be32(p) << 32 | be32(p + 4);
}

void mp_reader_init(mp_reader *r, const void *buf, size_t len)
{
    r->p = buf;
    r->end = r->p ? r->p + len : r->p;
}

size_t mp_left(const mp_reader *r)
{
    return (size_t)(r->end - r->p);
}

/* fmt_name names the msgpack format of a marker byte, for error messages. */
static const char *fmt_name(uint8_t m)
{
    if (m <= 0x7f)
        return "positive fixint";
    if (m <= 0x8f)
        return "fixmap";
    if (m <= 0x9f)
        return "fixarray";
    if (m <= 0xbf)
        return "fixstr";
    if (m >= 0xe0)
        return "negative fixint";
    static const char *const names[0x20] = {
        "nil",     "reserved 0xc1", "false",   "true",     "bin8",    "bin16", "bin32",
        "ext8",    "ext16",         "ext32",   "float32",  "float64", "uint8", "uint16",
        "uint32",  "uint64",        "int8",    "int16",    "int32",   "int64", "fixext1",
        "fixext2", "fixext4",       "fixext8", "fixext16", "str8",    "str16", "str32",
        "array16", "array32",       "map16",   "map32",
    };
    return names[m - 0xc0];
}

static mp_type marker_type(uint8_t m)
{
    if (m <= 0x7f)
        return MP_UINT;
    if (m <= 0x8f)
        return MP_MAP;
    if (m <= 0x9f)
        return MP_ARRAY;
    if (m <= 0xbf)
        return MP_STR;
    if (m >= 0xe0)
        return MP_INT;
    switch (m) {
    case 0xc0: return MP_NIL;
    case 0xc2:
    case 0xc3: return MP_BOOL;
    case 0xc4:
    case 0xc5:
    case 0xc6: return MP_BIN;
    case 0xc7:
    case 0xc8:
    case 0xc9: return MP_EXT;
    case 0xca:
    case 0xcb: return MP_FLOAT;
    case 0xcc:
    case 0xcd:
    case 0xce:
    case 0xcf: return MP_UINT;
    case 0xd0:
    case 0xd1:
    case 0xd2:
    case 0xd3: return MP_INT; /* refined by value in mp_peek / read_hdr */
    case 0xd4:
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8: return MP_EXT;
    case 0xd9:
    case 0xda:
    case 0xdb: return MP_STR;
    case 0xdc:
    case 0xdd: return MP_ARRAY;
    case 0xde:
    case 0xdf: return MP_MAP;
    }
    return MP_INVALID; /* 0xc1 */
}

const char *mp_type_name(mp_type t)
{
    switch (t) {
    case MP_NIL: return "nil";
    case MP_BOOL: return "bool";
    case MP_INT: return "negative int";
    case MP_UINT: return "int";
    case MP_FLOAT: return "float";
    case MP_STR: return "str";
    case MP_BIN: return "bin";
    case MP_ARRAY: return "array";
    case MP_MAP: return "map";
    case MP_EXT: return "ext";
    case MP_INVALID: return "invalid";
    }
    return "invalid";
}

/* fixed_len: bytes after the marker that form the header proper. */
static size_t fixed_len(uint8_t m)
{
    if (m <= 0xbf || m >= 0xe0)
        return 0;
    switch (m) {
    case 0xc4: return 1;
    case 0xc5: return 2;
    case 0xc6: return 4;
    case 0xc7: return 2; /* len8 + type */
    case 0xc8: return 3;
    case 0xc9: return 5;
    case 0xca: return 4;
    case 0xcb: return 8;
    case 0xcc: return 1;
    case 0xcd: return 2;
    case 0xce: return 4;
    case 0xcf: return 8;
    case 0xd0: return 1;
    case 0xd1: return 2;
    case 0xd2: return 4;
    case 0xd3: return 8;
    case 0xd4:
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8: return 1; /* type */
    case 0xd9: return 1;
    case 0xda: return 2;
    case 0xdb: return 4;
    case 0xdc: return 2;
    case 0xdd: return 4;
    case 0xde: return 2;
    case 0xdf: return 4;
    }
    return 0;
}

mp_type mp_peek(const mp_reader *r)
{
    if (r->p >= r->end)
        return MP_INVALID;
    uint8_t m = r->p[0];
    mp_type t = marker_type(m);
    if (m >= 0xd0 && m <= 0xd3 && mp_left(r) > fixed_len(m)) {
        /* signed encodings holding a non-negative value read as MP_UINT */
        if ((r->p[1] & 0x80) == 0)
            t = MP_UINT;
    }
    return t;
}

static moe_err read_hdr(mp_reader *r, hdr *h, mp_errbuf *eb)
{
    if (r->p >= r->end)
        return mp_errf(eb, MOE_EPROTO, "truncated: expected a value but 0 bytes remain");
    uint8_t m = *r->p;
    h->marker = m;
    h->type = marker_type(m);
    if (h->type == MP_INVALID)
        return mp_errf(eb, MOE_EPROTO, "reserved byte 0xc1 is not msgpack");
    size_t fl = fixed_len(m);
    size_t left = mp_left(r) - 1;
    if (fl > left)
        return mp_errf(eb, MOE_EPROTO, "truncated %s header: needs %zu more bytes but %zu remain",
                       fmt_name(m), fl, left);
    const uint8_t *q = r->p + 1;
    r->p += 1 + fl;
    left -= fl;
    uint64_t n = 0; /* announced length or count, checked below */
    if (m <= 0x7f) {
        h->u = m;
        return MOE_OK;
    }
    if (m >= 0xe0) {
        h->u = (uint64_t)(int64_t)(int8_t)m;
        return MOE_OK;
    }
    if (m <= 0xbf) { /* fixmap, fixarray, fixstr */
        n = m & (m <= 0x9f ? 0x0f : 0x1f);
    } else {
        switch (m) {
        case 0xc0: return MOE_OK;
        case 0xc2:
        case 0xc3: h->b = m == 0xc3; return MOE_OK;
        case 0xca: {
            uint32_t bits = be32(q);
            float f;
            memcpy(&f, &bits, sizeof(f));
            h->f = f;
            return MOE_OK;
        }
        case 0xcb: {
            uint64_t bits = be64(q);
            memcpy(&h->f, &bits, sizeof(h->f));
            return MOE_OK;
        }
        case 0xcc: h->u = q[0]; return MOE_OK;
        case 0xcd: h->u = be16(q); return MOE_OK;
        case 0xce: h->u = be32(q); return MOE_OK;
        case 0xcf: h->u = be64(q); return MOE_OK;
        case 0xd0: h->u = (uint64_t)(int64_t)(int8_t)q[0]; break;
        case 0xd1: h->u = (uint64_t)(int64_t)(int16_t)be16(q); break;
        case 0xd2: h->u = (uint64_t)(int64_t)(int32_t)be32(q); break;
        case 0xd3: h->u = be64(q); break;
        case 0xc4:
        case 0xd9: n = q[0]; break;
        case 0xc5:
        case 0xda:
        case 0xdc:
        case 0xde: n = be16(q); break;
        case 0xc6:
        case 0xdb:
        case 0xdd:
        case 0xdf: n = be32(q); break;
        case 0xc7: n = q[0]; break;
        case 0xc8: n = be16(q); break;
        case 0xc9: n = be32(q); break;
        case 0xd4: n = 1; break;
        case 0xd5: n = 2; break;
        case 0xd6: n = 4; break;
        case 0xd7: n = 8; break;
        case 0xd8: n = 16; break;
        }
        if (m >= 0xd0 && m <= 0xd3) {
            if ((int64_t)h->u >= 0)
                h->type = MP_UINT;
            return MOE_OK;
        }
    }
    h->n = (uint32_t)n;
    switch (h->type) {
    case MP_ARRAY:
        if (n > left)
            return mp_errf(eb, MOE_EPROTO,
                           "%s header claims %" PRIu64 " elements but %zu bytes remain",
                           fmt_name(m), n, left);
        break;
    case MP_MAP:
        if (n > left / 2)
            return mp_errf(eb, MOE_EPROTO,
                           "%s header claims %" PRIu64 " pairs (%" PRIu64
                           " values) but %zu bytes remain",
                           fmt_name(m), n, 2 * n, left);
        break;
    default: /* str, bin, ext: n payload bytes */
        if (n > left)
            return mp_errf(eb, MOE_EPROTO,
                           "truncated %s: header claims %" PRIu64 " bytes but %zu remain",
                           fmt_name(m), n, left);
        break;
    }
    return MOE_OK;
}

/* expect reads a header and checks its type. */
static moe_err expect(mp_reader *r, hdr *h, mp_type want, mp_errbuf *eb)
{
    const uint8_t *at = r->p;
    moe_err e = read_hdr(r, h, eb);
    if (e)
        return e;
    mp_type got = h->type == MP_INT ? MP_UINT : h->type;
    if (got != want)
        return mp_errf(eb, MOE_EPROTO, "expected %s, got %s (byte 0x%02x)", mp_type_name(want),
                       fmt_name(*at), *at);
    return MOE_OK;
}

moe_err mp_read_nil(mp_reader *r, mp_errbuf *eb)
{
    hdr h;
    return expect(r, &h, MP_NIL, eb);
}

moe_err mp_read_bool(mp_reader *r, bool *out, mp_errbuf *eb)
{
    hdr h;
    moe_err e = expect(r, &h, MP_BOOL, eb);
    if (e)
        return e;
    *out = h.b;
    return MOE_OK;
}

/* small_uint: the common unsigned integers (fixint, uint8/16/32) read
 * without the general header's work - decode-sized answers carry hundreds
 * of them (per-expert counts); 0 where the value is anything else. */
static inline int small_uint(mp_reader *r, uint64_t *v)
{
    const uint8_t *p = r->p;
    if (p >= r->end)
        return 0;
    const size_t left = (size_t)(r->end - p);
    switch (*p) {
    case 0xcc:
        if (left < 2)
            return 0;
        *v = p[1];
        r->p = p + 2;
        return 1;
    case 0xcd:
        if (left < 3)
            return 0;
        *v = (uint64_t)p[1] << 8 | p[2];
        r->p = p + 3;
        return 1;
    case 0xce:
        if (left < 5)
            return 0;
        *v = be32(p + 1);
        r->p = p + 5;
        return 1;
    default:
        if (*p > 0x7f)
            return 0;
        *v = *p;
        r->p = p + 1;
        return 1;
    }
}

moe_err mp_read_i64(mp_reader *r, int64_t *out, mp_errbuf *eb)
{
    uint64_t v;
    if (small_uint(r, &v)) {
        *out = (int64_t)v;
        return MOE_OK;
    }
    hdr h;
    moe_err e = expect(r, &h, MP_UINT, eb);
    if (e)
        return e;
    if (h.type == MP_UINT && h.u > (uint64_t)INT64_MAX)
        return mp_errf(eb, MOE_EINVAL, "integer %" PRIu64 " out of range for int64", h.u);
    *out = (int64_t)h.u;
    return MOE_OK;
}

moe_err mp_read_u64(mp_reader *r, uint64_t *out, mp_errbuf *eb)
{
    if (small_uint(r, out))
        return MOE_OK;
    hdr h;
    moe_err e = expect(r, &h, MP_UINT, eb);
    if (e)
        return e;
    if (h.type == MP_INT)
        return mp_errf(eb, MOE_EINVAL, "integer %" PRId64 " is negative, expected >= 0",
                       (int64_t)h.u);
    *out = h.u;
    return MOE_OK;
}

moe_err mp_read_f64(mp_reader *r, double *out, mp_errbuf *eb)
{
    const uint8_t *at = r->p;
    hdr h;
    moe_err e = read_hdr(r, &h, eb);
    if (e)
        return e;
    switch (h.type) {
    case MP_FLOAT: *out = h.f; return MOE_OK;
    case MP_UINT: *out = (double)h.u; return MOE_OK;
    case MP_INT: *out = (double)(int64_t)h.u; return MOE_OK;
    default:
        return mp_errf(eb, MOE_EPROTO, "expected float, got %s (byte 0x%02x)", fmt_name(*at), *at);
    }
}

moe_err mp_read_str(mp_reader *r, const char **s, uint32_t *len, mp_errbuf *eb)
{
    hdr h;
    moe_err e = expect(r, &h, MP_STR, eb);
    if (e)
        return e;
    *s = (const char *)r->p;
    *len = h.n;
    r->p += h.n;
    return MOE_OK;
}

moe_err mp_read_bin(mp_reader *r, const void **data, uint32_t *len, mp_errbuf *eb)
{
    hdr h;
    moe_err e = expect(r, &h, MP_BIN, eb);
    if (e)
        return e;
    *data = r->p;
    *len = h.n;
    r->p += h.n;
    return MOE_OK;
}

moe_err mp_read_array(mp_reader *r, uint32_t *count, mp_errbuf *eb)
{
    hdr h;
    moe_err e = expect(r, &h, MP_ARRAY, eb);
    if (e)
        return e;
    *count = h.n;
    return MOE_OK;
}

moe_err mp_read_small_uints(mp_reader *r, uint32_t *count, const uint8_t **vals, mp_errbuf *eb)
{
    const uint8_t *at = r->p;
    hdr h;
    moe_err e = expect(r, &h, MP_ARRAY, eb);
    if (e == MOE_OK && (size_t)(r->end - r->p) >= h.n) {
        uint8_t high = 0; /* any byte >= 0x80 is not a positive fixint */
        for (uint32_t i = 0; i < h.n; i++)
            high |= r->p[i];
        if (!(high & 0x80)) {
            *count = h.n;
            *vals = r->p;
            r->p += h.n;
            return MOE_OK;
        }
    }
    r->p = at;
    return mp_errf(eb, MOE_EPROTO, "not an array of small non-negative integers");
}

moe_err mp_read_map(mp_reader *r, uint32_t *count, mp_errbuf *eb)
{
    hdr h;
    moe_err e = expect(r, &h, MP_MAP, eb);
    if (e)
        return e;
    *count = h.n;
    return MOE_OK;
}

/* skip_scalar: steps over a value of fixed size (nil, bool, integers,
 * floats) with one look at its marker; 0 (nothing read) for anything else
 * or one cut short, which mp_skip_depth then reads the long way (and
 * reports) */
static inline int skip_scalar(mp_reader *r)
{
    const uint8_t *p = r->p;
    if (p >= r->end)
        return 0;
    const uint8_t m = *p;
    size_t n;
    if (m <= 0x7f || m >= 0xe0 || m == 0xc0 || m == 0xc2 || m == 0xc3)
        n = 1;
    else if (m == 0xcc || m == 0xd0)
        n = 2;
    else if (m == 0xcd || m == 0xd1)
        n = 3;
    else if (m == 0xca || m == 0xce || m == 0xd2)
        n = 5;
    else if (m == 0xcb || m == 0xcf || m == 0xd3)
        n = 9;
    else
        return 0;
    if ((size_t)(r->end - p) < n)
        return 0;
    r->p = p + n;
    return 1;
}

/* mp_skip_depth: mp_skip for a value found `depth` containers deep. */
moe_err mp_skip_depth(mp_reader *r, int depth, mp_errbuf *eb)
{
    if (skip_scalar(r))
        return MOE_OK;
    hdr h;
    moe_err e = read_hdr(r, &h, eb);
    if (e)
        return e;
    switch (h.type) {
    case MP_STR:
    case MP_BIN:
    case MP_EXT: r->p += h.n; return MOE_OK;
    case MP_ARRAY:
    case MP_MAP: {
        if (depth >= MP_MAX_DEPTH)
            return mp_errf(eb, MOE_EPROTO, "nesting deeper than %d containers", MP_MAX_DEPTH);
        uint64_t values = h.type == MP_MAP ? 2 * (uint64_t)h.n : h.n;
        for (uint64_t i = 0; i < values; i++) {
            if (skip_scalar(r)) /* arrays of numbers: no call per element */
                continue;
            e = mp_skip_depth(r, depth + 1, eb);
            if (e)
                return e;
        }
        return MOE_OK;
    }
    default: return MOE_OK;
    }
}

moe_err mp_skip(mp_reader *r, mp_errbuf *eb)
{
    return mp_skip_depth(r, 0, eb);
}

bool mp_str_eq(const char *s, uint32_t len, const char *cstr)
{
    /* byte by byte: a parameter table compares each key with every name,
     * and most differ at the first byte (no strlen of each name) */
    for (uint32_t i = 0; i < len; i++)
        if (cstr[i] == '\0' || cstr[i] != s[i])
            return false;
    return cstr[len] == '\0';
}
