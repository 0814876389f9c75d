/*
 * rows.h - moving token rows between float buffers and exchange messages.
 * Rows travel in the model dtype: f32, or bf16 bits for bf16 models (the
 * values are already bf16-rounded, so nothing is lost). Message buffers may
 * be unaligned: every access goes through memcpy.
 */
#ifndef MOE_WKR_ROWS_H
#define MOE_WKR_ROWS_H

#include <stddef.h>
#include <string.h>

#include "kernels/kern.h"
#include "proto/proto.h"

static inline void rows_put(void *dst, const float *src, size_t n, int bf16)
{
    if (!bf16) {
        memcpy(dst, src, n * 4);
        return;
    }
    unsigned char *d = dst;
    for (size_t i = 0; i < n; i++) {
        uint16_t h = kern_f32_to_bf16_inl(src[i]);
        memcpy(d + 2 * i, &h, 2);
    }
}

static inline void rows_get(float *dst, const void *src, size_t n, int bf16)
{
    if (!bf16) {
        memcpy(dst, src, n * 4);
        return;
    }
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        dst[i] = kern_bf16_to_f32_inl(h);
    }
}

/* rows_first_nonfinite: the first of the n rows of x (n,H) that holds a NaN
 * or an Inf, or n when all are finite; the rows split over the kernels'
 * threads (kern_par_for), each row's exponents checked without a branch
 * per value. */
int64_t rows_first_nonfinite(const float *x, int64_t n, int64_t H);
/* rows_first_nonfinite_bf16: the same over bf16 rows (unaligned ok) */
int64_t rows_first_nonfinite_bf16(const void *x, int64_t n, int64_t H);
/* rows_tensor_to_f32 converts a wire tensor of any dtype into floats. */
void rows_tensor_to_f32(const moe_tensor *t, float *out, size_t n);
/* rows_f32_to_dtype writes n floats as dtype dt into dst (unaligned ok). */
void rows_f32_to_dtype(const float *x, moe_dtype dt, void *dst, size_t n);
/* rows_write_tensor writes {dtype, shape [T, H], data} from floats. */
void rows_write_tensor(mp_writer *w, moe_dtype dt, const float *x, int T, int H);

#endif
