/* bulk_wire.c - the bulk path's headers; see bulk_wire.h. */
#include "proto/bulk_wire.h"

#include <stdio.h>
#include <string.h>

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

void moe_bulk_req_encode(const moe_bulk_req *h, uint8_t *out)
{
    memset(out, 0, MOE_BULK_REQ_LEN);
    put32(out, MOE_BULK_MAGIC);
    put16(out + 4, MOE_BULK_VERSION);
    put16(out + 6, h->auth_len);
    put64(out + 8, h->cid);
    put64(out + 16, h->seq);
    put32(out + 24, h->dtype);
    put64(out + 32, (uint64_t)h->rows);
    put64(out + 40, (uint64_t)h->cols);
    put64(out + 48, h->nbytes);
    if (h->parts > 1) { /* one part: zeros, as a client without parts writes */
        put16(out + 56, h->part);
        put16(out + 58, h->parts);
    }
}

void moe_bulk_part_rows(int64_t rows, int parts, int part, int64_t *row0, int64_t *nrows)
{
    if (parts < 1)
        parts = 1;
    int64_t a = rows * part / parts, b = rows * (part + 1) / parts;
    *row0 = a;
    *nrows = b - a;
}

moe_err moe_bulk_req_decode(const uint8_t *in, uint64_t max_bytes, moe_bulk_req *h, char *err,
                            size_t errlen)
{
    memset(h, 0, sizeof(*h));
    h->magic = get32(in);
    h->version = get16(in + 4);
    h->auth_len = get16(in + 6);
    h->cid = get64(in + 8);
    h->seq = get64(in + 16);
    h->dtype = get32(in + 24);
    uint64_t rows = get64(in + 32), cols = get64(in + 40);
    h->nbytes = get64(in + 48);
    if (h->magic != MOE_BULK_MAGIC) {
        snprintf(err, errlen, "not a bulk header (magic %08x)", h->magic);
        return MOE_EPROTO;
    }
    if (h->version != MOE_BULK_VERSION) {
        snprintf(err, errlen, "bulk header version %u (this worker speaks %d)", h->version,
                 MOE_BULK_VERSION);
        return MOE_EPROTO;
    }
    size_t es = h->dtype <= MOE_F16 ? moe_dtype_size((moe_dtype)h->dtype) : 0;
    if (es == 0) {
        snprintf(err, errlen, "bulk header dtype %u unknown (0 f32, 1 bf16, 2 f16)", h->dtype);
        return MOE_EINVAL;
    }
    h->part = get16(in + 56);
    h->parts = get16(in + 58);
    if (get32(in + 28) != 0 || get32(in + 60) != 0) {
        snprintf(err, errlen, "bulk header reserved bytes must be zero");
        return MOE_EINVAL;
    }
    if (h->auth_len > MOE_BULK_AUTH_MAX) {
        snprintf(err, errlen, "bulk header auth_len %u over %d", h->auth_len, MOE_BULK_AUTH_MAX);
        return MOE_EINVAL;
    }
    if (rows < 1 || rows > (uint64_t)MOE_BULK_MAX_ROWS || cols < 1 ||
        cols > (uint64_t)MOE_BULK_MAX_COLS) {
        snprintf(err, errlen, "bulk rows (%llu, %llu) outside [1, 2^31] x [1, 2^20]",
                 (unsigned long long)rows, (unsigned long long)cols);
        return MOE_EINVAL;
    }
    h->rows = (int64_t)rows;
    h->cols = (int64_t)cols;
    if (h->nbytes != rows * cols * es) { /* no overflow: < 2^31 x 2^20 x 4 */
        snprintf(err, errlen, "bulk nbytes %llu for (%llu, %llu) of %s (want %llu)",
                 (unsigned long long)h->nbytes, (unsigned long long)rows, (unsigned long long)cols,
                 moe_dtype_name((moe_dtype)h->dtype), (unsigned long long)(rows * cols * es));
        return MOE_EINVAL;
    }
    if (h->parts == 0)
        h->parts = 1;
    if (h->parts > MOE_BULK_MAX_PARTS || h->part >= h->parts || h->parts > rows) {
        snprintf(err, errlen, "bulk part %u of %u: want part < parts <= min(%d, rows %llu)",
                 h->part, h->parts, MOE_BULK_MAX_PARTS, (unsigned long long)rows);
        return MOE_EINVAL;
    }
    if (h->nbytes > max_bytes) {
        snprintf(err, errlen, "bulk rows of %llu bytes over the cap of %llu (max-msg-mb)",
                 (unsigned long long)h->nbytes, (unsigned long long)max_bytes);
        return MOE_ETOOBIG;
    }
    return MOE_OK;
}

void moe_bulk_rep_encode(const moe_bulk_rep *h, uint8_t *out)
{
    memset(out, 0, MOE_BULK_REP_LEN);
    put32(out, MOE_BULK_MAGIC);
    put16(out + 4, MOE_BULK_VERSION);
    put16(out + 6, h->kind);
    put32(out + 8, h->status);
    put32(out + 12, h->msg_len);
    put64(out + 16, h->cid);
    put64(out + 24, h->seq);
    put64(out + 32, (uint64_t)h->rows);
    put64(out + 40, h->nbytes);
}

moe_err moe_bulk_rep_decode(const uint8_t *in, moe_bulk_rep *h)
{
    memset(h, 0, sizeof(*h));
    h->magic = get32(in);
    h->version = get16(in + 4);
    h->kind = get16(in + 6);
    h->status = get32(in + 8);
    h->msg_len = get32(in + 12);
    h->cid = get64(in + 16);
    h->seq = get64(in + 24);
    h->rows = (int64_t)get64(in + 32);
    h->nbytes = get64(in + 40);
    if (h->magic != MOE_BULK_MAGIC || h->version != MOE_BULK_VERSION || h->kind < MOE_BULK_ACK ||
        h->kind > MOE_BULK_ERR || h->msg_len > MOE_BULK_MSG_MAX)
        return MOE_EPROTO;
    return MOE_OK;
}

moe_err moe_bulk_url_split(const char *url, char *host, size_t hostlen, char *port, size_t portlen)
{
    if (strncmp(url, "tcp://", 6) != 0)
        return MOE_EINVAL;
    const char *h = url + 6, *he, *p;
    if (*h == '[') {
        he = strchr(h, ']');
        if (!he || he[1] != ':')
            return MOE_EINVAL;
        h++;
        p = he + 2;
    } else {
        he = strrchr(h, ':');
        if (!he)
            return MOE_EINVAL;
        p = he + 1;
    }
    size_t hn = (size_t)(he - h), pn = strlen(p);
    if (hn == 0 || hn >= hostlen || pn == 0 || pn >= portlen || strspn(p, "0123456789") != pn)
        return MOE_EINVAL;
    memcpy(host, h, hn);
    host[hn] = 0;
    memcpy(port, p, pn + 1);
    return MOE_OK;
}
