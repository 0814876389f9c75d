/* rows.c - wire tensors <-> float rows; see rows.h. */
#include "worker/rows.h"

#include <math.h>

static float f16_to_f32(uint16_t h)
{
    uint32_t ex = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (ex == 0)
        v = ldexpf((float)man, -24);
    else if (ex == 31)
        v = man ? NAN : INFINITY;
    else
        v = ldexpf((float)(man | 0x400), (int)ex - 25);
    return (h & 0x8000) ? -v : v;
}

void rows_tensor_to_f32(const moe_tensor *t, float *out, size_t n)
{
    const unsigned char *s = t->data;
    if (t->dtype == MOE_F32) {
        memcpy(out, s, n * 4);
        return;
    }
    if (t->dtype == MOE_BF16) {
        rows_get(out, s, n, 1);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        out[i] = f16_to_f32(h);
    }
}

void rows_write_tensor(mp_writer *w, moe_dtype dt, const float *x, int T, int H)
{
    size_t n = (size_t)T * (size_t)H;
    mp_write_map(w, 3);
    mp_write_cstr(w, "dtype");
    mp_write_cstr(w, moe_dtype_name(dt));
    mp_write_cstr(w, "shape");
    mp_write_array(w, 2);
    mp_write_i64(w, T);
    mp_write_i64(w, H);
    mp_write_cstr(w, "data");
    unsigned char *dst = mp_writer_reserve_bin(w, (uint32_t)(n * moe_dtype_size(dt)));
    if (dst)
        rows_f32_to_dtype(x, dt, dst, n);
}

void rows_f32_to_dtype(const float *x, moe_dtype dt, void *out, size_t n)
{
    unsigned char *dst = out;
    if (dt == MOE_F32) {
        memcpy(dst, x, n * 4);
    } else if (dt == MOE_BF16) {
        rows_put(dst, x, n, 1);
    } else {
        for (size_t i = 0; i < n; i++) {
            _Float16 h = (_Float16)x[i];
            memcpy(dst + 2 * i, &h, 2);
        }
    }
}
