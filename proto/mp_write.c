/*
 * mp_write.c - the msgpack writer: hand-written smallest encodings into a
 * growable buffer. An allocation failure sets w->failed; every later write is
 * dropped and mp_writer_take returns NULL, so callers check once at the end.
 */
#include <stdlib.h>
#include <string.h>

#include "proto/proto.h"

#define MP_WRITER_MIN_CAP 256

void mp_writer_init(mp_writer *w)
{
    w->buf = NULL;
    w->len = 0;
    w->cap = 0;
    w->failed = false;
}

void mp_writer_fini(mp_writer *w)
{
    free(w->buf);
    mp_writer_init(w);
}

uint8_t *mp_writer_take(mp_writer *w, size_t *len)
{
    uint8_t *buf = w->buf;
    bool failed = w->failed;
    *len = failed ? 0 : w->len;
    if (failed) {
        free(buf);
        buf = NULL;
    } else if (!buf) {
        buf = malloc(1); /* nothing written: still a valid, freeable buffer */
    }
    mp_writer_init(w);
    return buf;
}

/* grow returns where n more bytes go, advancing len; NULL once failed. */
static uint8_t *grow(mp_writer *w, size_t n)
{
    if (w->failed)
        return NULL;
    if (n > SIZE_MAX - w->len) {
        w->failed = true;
        return NULL;
    }
    size_t need = w->len + n;
    if (need > w->cap || !w->buf) {
        size_t cap = w->cap ? w->cap : MP_WRITER_MIN_CAP;
        while (cap < need)
            cap = cap > SIZE_MAX / 2 ? need : cap * 2;
        uint8_t *nb = realloc(w->buf, cap);
        if (!nb) {
            w->failed = true;
            return NULL;
        }
        w->buf = nb;
        w->cap = cap;
    }
    uint8_t *p = w->buf + w->len;
    w->len = need;
    return p;
}

static void put_be(uint8_t *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

/* put_marker writes a marker followed by an n-byte big-endian value. */
static void put_marker(mp_writer *w, uint8_t m, uint64_t v, int n)
{
    uint8_t *p = grow(w, 1 + (size_t)n);
    if (!p)
        return;
    p[0] = m;
    put_be(p + 1, v, n);
}

void mp_write_raw(mp_writer *w, const void *data, size_t len)
{
    uint8_t *p = grow(w, len);
    if (p && len)
        memcpy(p, data, len);
}

void mp_write_nil(mp_writer *w)
{
    put_marker(w, 0xc0, 0, 0);
}

void mp_write_bool(mp_writer *w, bool v)
{
    put_marker(w, v ? 0xc3 : 0xc2, 0, 0);
}

void mp_write_u64(mp_writer *w, uint64_t v)
{
    if (v <= 0x7f && w->len < w->cap && !w->failed) { /* the common case, no call */
        w->buf[w->len++] = (uint8_t)v;
        return;
    }
    if (v <= 0x7f)
        put_marker(w, (uint8_t)v, 0, 0);
    else if (v <= UINT8_MAX)
        put_marker(w, 0xcc, v, 1);
    else if (v <= UINT16_MAX)
        put_marker(w, 0xcd, v, 2);
    else if (v <= UINT32_MAX)
        put_marker(w, 0xce, v, 4);
    else
        put_marker(w, 0xcf, v, 8);
}

void mp_write_i64(mp_writer *w, int64_t v)
{
    if (v >= 0)
        mp_write_u64(w, (uint64_t)v);
    else if (v >= -32)
        put_marker(w, (uint8_t)(int8_t)v, 0, 0);
    else if (v >= INT8_MIN)
        put_marker(w, 0xd0, (uint64_t)v, 1);
    else if (v >= INT16_MIN)
        put_marker(w, 0xd1, (uint64_t)v, 2);
    else if (v >= INT32_MIN)
        put_marker(w, 0xd2, (uint64_t)v, 4);
    else
        put_marker(w, 0xd3, (uint64_t)v, 8);
}

void mp_write_f64(mp_writer *w, double v)
{
    uint64_t bits;
    memcpy(&bits, &v, sizeof(bits));
    put_marker(w, 0xcb, bits, 8);
}

void mp_write_f32(mp_writer *w, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof(bits));
    put_marker(w, 0xca, bits, 4);
}

/* write_str_hdr / write_bin_hdr: smallest length header. */
static void write_str_hdr(mp_writer *w, uint32_t len)
{
    if (len <= 31)
        put_marker(w, (uint8_t)(0xa0 | len), 0, 0);
    else if (len <= UINT8_MAX)
        put_marker(w, 0xd9, len, 1);
    else if (len <= UINT16_MAX)
        put_marker(w, 0xda, len, 2);
    else
        put_marker(w, 0xdb, len, 4);
}

static void write_bin_hdr(mp_writer *w, uint32_t len)
{
    if (len <= UINT8_MAX)
        put_marker(w, 0xc4, len, 1);
    else if (len <= UINT16_MAX)
        put_marker(w, 0xc5, len, 2);
    else
        put_marker(w, 0xc6, len, 4);
}

void mp_write_str(mp_writer *w, const char *s, uint32_t len)
{
    write_str_hdr(w, len);
    mp_write_raw(w, s, len);
}

void mp_write_cstr(mp_writer *w, const char *s)
{
    size_t len = strlen(s);
    if (len > UINT32_MAX) {
        w->failed = true;
        return;
    }
    mp_write_str(w, s, (uint32_t)len);
}

void mp_write_bin(mp_writer *w, const void *data, uint32_t len)
{
    write_bin_hdr(w, len);
    mp_write_raw(w, data, len);
}

void *mp_writer_reserve_bin(mp_writer *w, uint32_t n)
{
    write_bin_hdr(w, n);
    uint8_t *p = grow(w, n);
    if (!p)
        return NULL;
    return p;
}

void mp_write_bin_head(mp_writer *w, uint32_t n)
{
    write_bin_hdr(w, n);
}

void mp_write_array(mp_writer *w, uint32_t count)
{
    if (count <= 15)
        put_marker(w, (uint8_t)(0x90 | count), 0, 0);
    else if (count <= UINT16_MAX)
        put_marker(w, 0xdc, count, 2);
    else
        put_marker(w, 0xdd, count, 4);
}

void mp_write_map(mp_writer *w, uint32_t count)
{
    if (count <= 15)
        put_marker(w, (uint8_t)(0x80 | count), 0, 0);
    else if (count <= UINT16_MAX)
        put_marker(w, 0xde, count, 2);
    else
        put_marker(w, 0xdf, count, 4);
}
