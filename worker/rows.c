/* rows.c - wire tensors <-> float rows; see rows.h. */
#include "worker/rows.h"

#include <math.h>

#include "common/parcopy.h"

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

/* conv_job: n values between float rows and a wire dtype, split over the
 * worker's threads (kern_par_for): a 64 MiB batch converted on one thread
 * is several milliseconds of a call */
typedef struct conv_job {
    const void *src;
    void *dst;
    moe_dtype dt; /* the wire side's */
    int to_f32;   /* src is the wire side */
} conv_job;

static void conv_part(void *p, size_t a, size_t b)
{
    const conv_job *j = p;
    const size_t es = moe_dtype_size(j->dt), n = b - a;
    if (j->to_f32) {
        const unsigned char *s = (const unsigned char *)j->src + a * es;
        float *out = (float *)j->dst + a;
        if (j->dt == MOE_BF16) {
            rows_get(out, s, n, 1);
            return;
        }
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            out[i] = f16_to_f32(h);
        }
        return;
    }
    const float *x = (const float *)j->src + a;
    unsigned char *dst = (unsigned char *)j->dst + a * es;
    if (j->dt == MOE_BF16) {
        rows_put(dst, x, n, 1);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        _Float16 h = (_Float16)x[i];
        memcpy(dst + 2 * i, &h, 2);
    }
}

void rows_tensor_to_f32(const moe_tensor *t, float *out, size_t n)
{
    if (t->dtype == MOE_F32) {
        par_memcpy(out, t->data, n * 4);
        return;
    }
    conv_job j = {t->data, out, t->dtype, 1};
    kern_par_for(n, KERN_PAR_GRAIN, conv_part, &j);
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
    if (dt == MOE_F32) {
        par_memcpy(out, x, n * 4);
        return;
    }
    conv_job j = {x, out, dt, 0};
    kern_par_for(n, KERN_PAR_GRAIN, conv_part, &j);
}

typedef struct nonfinite_job {
    const void *x; /* (n,H) f32, or bf16 when bf */
    int bf;
    int64_t H;
    int64_t first; /* min-ed atomically by the parts */
} nonfinite_job;

static void nonfinite_part(void *arg, size_t r0, size_t r1)
{
    nonfinite_job *j = arg;
    for (size_t r = r0; r < r1; r++) {
        if ((int64_t)r >= __atomic_load_n(&j->first, __ATOMIC_RELAXED))
            return; /* an earlier row is bad already */
        uint32_t bad = 0;
        if (j->bf) {
            const uint8_t *row = (const uint8_t *)j->x + r * (size_t)j->H * 2;
            for (int64_t h = 0; h < j->H; h++) { /* exponent all ones: Inf or NaN */
                uint16_t u;
                memcpy(&u, row + 2 * h, 2);
                bad |= (u & 0x7f80u) == 0x7f80u;
            }
        } else {
            const float *row = (const float *)j->x + r * (size_t)j->H;
            for (int64_t h = 0; h < j->H; h++) {
                uint32_t u;
                memcpy(&u, row + h, 4);
                bad |= (u & 0x7f800000u) == 0x7f800000u;
            }
        }
        if (bad) {
            int64_t cur = __atomic_load_n(&j->first, __ATOMIC_RELAXED);
            while ((int64_t)r < cur &&
                   !__atomic_compare_exchange_n(&j->first, &cur, (int64_t)r, 0, __ATOMIC_RELAXED,
                                                __ATOMIC_RELAXED))
                ;
            return;
        }
    }
}

static int64_t first_nonfinite(const void *x, int bf, int64_t n, int64_t H)
{
    if (n <= 0 || H <= 0)
        return n > 0 ? n : 0;
    nonfinite_job j = {x, bf, H, n};
    kern_par_for((size_t)n, KERN_PAR_GRAIN / (size_t)H + 1, nonfinite_part, &j);
    return j.first;
}

int64_t rows_first_nonfinite(const float *x, int64_t n, int64_t H)
{
    return first_nonfinite(x, 0, n, H);
}

int64_t rows_first_nonfinite_bf16(const void *x, int64_t n, int64_t H)
{
    return first_nonfinite(x, 1, n, H);
}
