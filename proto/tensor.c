/*
 * tensor.c - tensors on the wire: {"dtype": str, "shape": [int...], "data": bin}.
 * Keys in any order; each exactly once; nothing else. The data view points
 * into the message (no copy, not aligned).
 */
#include <inttypes.h>
#include <string.h>

#include "proto/proto.h"

/* shape_bytes computes numel and numel * elsize, overflow-checked. */
static moe_err shape_bytes(int ndim, const int64_t *shape, size_t elsize, int64_t *numel,
                           uint64_t *nbytes, mp_errbuf *eb)
{
    if (ndim < 1 || ndim > MOE_MAX_DIMS)
        return mp_errf(eb, MOE_EINVAL, "tensor shape has %d dims, expected 1..%d", ndim,
                       MOE_MAX_DIMS);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return mp_errf(eb, MOE_EINVAL, "tensor shape[%d] = %" PRId64 " is negative", i,
                           shape[i]);
        if (__builtin_mul_overflow(n, shape[i], &n))
            return mp_errf(eb, MOE_EINVAL, "tensor shape product overflows int64 at dim %d", i);
    }
    uint64_t b;
    if (__builtin_mul_overflow((uint64_t)n, (uint64_t)elsize, &b) || b > UINT32_MAX)
        return mp_errf(eb, MOE_EINVAL,
                       "tensor of %" PRId64 " elements x %zu bytes exceeds the 4 GiB bin limit", n,
                       elsize);
    *numel = n;
    *nbytes = b;
    return MOE_OK;
}

int64_t moe_tensor_numel(const moe_tensor *t)
{
    if (t->ndim < 1 || t->ndim > MOE_MAX_DIMS)
        return -1;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0 || __builtin_mul_overflow(n, t->shape[i], &n))
            return -1;
    }
    return n;
}

enum { KEY_DTYPE = 1, KEY_SHAPE = 2, KEY_DATA = 4 };

moe_err moe_tensor_read(mp_reader *r, moe_tensor *t, mp_errbuf *eb)
{
    uint32_t npairs;
    moe_err e = mp_read_map(r, &npairs, eb);
    if (e) {
        mp_err_prefix(eb, "tensor: ");
        return e;
    }
    memset(t, 0, sizeof(*t));
    unsigned seen = 0;
    const void *data = NULL;
    uint32_t data_len = 0;
    for (uint32_t i = 0; i < npairs; i++) {
        const char *k;
        uint32_t klen;
        e = mp_read_str(r, &k, &klen, eb);
        if (e) {
            mp_err_prefix(eb, "tensor key: ");
            return e;
        }
        unsigned bit = mp_str_eq(k, klen, "dtype")   ? KEY_DTYPE
                       : mp_str_eq(k, klen, "shape") ? KEY_SHAPE
                       : mp_str_eq(k, klen, "data")  ? KEY_DATA
                                                     : 0;
        if (!bit)
            return mp_errf(eb, MOE_EINVAL,
                           "tensor: unknown key \"%.*s\" (expected dtype, shape, data)",
                           (int)(klen > 64 ? 64 : klen), k);
        if (seen & bit)
            return mp_errf(eb, MOE_EINVAL, "tensor: duplicate key \"%.*s\"", (int)klen, k);
        seen |= bit;
        if (bit == KEY_DTYPE) {
            const char *s;
            uint32_t slen;
            e = mp_read_str(r, &s, &slen, eb);
            if (e) {
                mp_err_prefix(eb, "tensor dtype: ");
                return e;
            }
            if (moe_dtype_parse(s, slen, &t->dtype) != MOE_OK)
                return mp_errf(eb, MOE_EINVAL,
                               "tensor: unknown dtype \"%.*s\" (expected f32, bf16, f16)",
                               (int)(slen > 64 ? 64 : slen), s);
        } else if (bit == KEY_SHAPE) {
            uint32_t nd;
            e = mp_read_array(r, &nd, eb);
            if (e) {
                mp_err_prefix(eb, "tensor shape: ");
                return e;
            }
            if (nd < 1 || nd > MOE_MAX_DIMS)
                return mp_errf(eb, MOE_EINVAL, "tensor shape has %" PRIu32 " dims, expected 1..%d",
                               nd, MOE_MAX_DIMS);
            t->ndim = (int)nd;
            for (uint32_t d = 0; d < nd; d++) {
                e = mp_read_i64(r, &t->shape[d], eb);
                if (e) {
                    mp_err_prefix(eb, "tensor shape[%" PRIu32 "]: ", d);
                    return e;
                }
            }
        } else {
            e = mp_read_bin(r, &data, &data_len, eb);
            if (e) {
                mp_err_prefix(eb, "tensor data: ");
                return e;
            }
        }
    }
    if (seen != (KEY_DTYPE | KEY_SHAPE | KEY_DATA))
        return mp_errf(eb, MOE_EINVAL, "tensor: missing key%s%s%s",
                       seen & KEY_DTYPE ? "" : " dtype", seen & KEY_SHAPE ? "" : " shape",
                       seen & KEY_DATA ? "" : " data");
    int64_t numel;
    uint64_t nbytes;
    e = shape_bytes(t->ndim, t->shape, moe_dtype_size(t->dtype), &numel, &nbytes, eb);
    if (e)
        return e;
    if (nbytes != data_len)
        return mp_errf(eb, MOE_EINVAL,
                       "tensor: data has %" PRIu32 " bytes, shape and dtype %s need %" PRIu64,
                       data_len, moe_dtype_name(t->dtype), nbytes);
    t->data = data;
    t->nbytes = (size_t)nbytes;
    return MOE_OK;
}

/* write_meta writes the map up to the "data" key; *nbytes the data's size.
 * 0 on a bad dtype or shape (the writer is marked failed). */
static int write_meta(mp_writer *w, moe_dtype dtype, int ndim, const int64_t *shape,
                      uint64_t *nbytes)
{
    int64_t numel;
    size_t elsize = moe_dtype_size(dtype);
    if (elsize == 0 || shape_bytes(ndim, shape, elsize, &numel, nbytes, NULL) != MOE_OK) {
        w->failed = true;
        return 0;
    }
    mp_write_map(w, 3);
    mp_write_cstr(w, "dtype");
    mp_write_cstr(w, moe_dtype_name(dtype));
    mp_write_cstr(w, "shape");
    mp_write_array(w, (uint32_t)ndim);
    for (int i = 0; i < ndim; i++)
        mp_write_i64(w, shape[i]);
    mp_write_cstr(w, "data");
    return 1;
}

/* write_head writes the map up to and including the data bin header. */
static void *write_head(mp_writer *w, moe_dtype dtype, int ndim, const int64_t *shape,
                        const uint64_t *nbytes_check)
{
    uint64_t nbytes;
    if (!write_meta(w, dtype, ndim, shape, &nbytes))
        return NULL;
    if (nbytes_check && *nbytes_check != nbytes) {
        w->failed = true;
        return NULL;
    }
    return mp_writer_reserve_bin(w, (uint32_t)nbytes);
}

size_t moe_tensor_write_head(mp_writer *w, moe_dtype dtype, int ndim, const int64_t *shape)
{
    uint64_t nbytes;
    if (!write_meta(w, dtype, ndim, shape, &nbytes))
        return 0;
    mp_write_bin_head(w, (uint32_t)nbytes);
    return (size_t)nbytes;
}

void *moe_tensor_write_reserve(mp_writer *w, moe_dtype dtype, int ndim, const int64_t *shape)
{
    return write_head(w, dtype, ndim, shape, NULL);
}

void moe_tensor_write(mp_writer *w, const moe_tensor *t)
{
    uint64_t nbytes = t->nbytes;
    void *p = write_head(w, t->dtype, t->ndim, t->shape, &nbytes);
    if (p && nbytes)
        memcpy(p, t->data, nbytes);
}
