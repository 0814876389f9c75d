/*
 * kcu_experts.cu - the experts-only object (kern_cuda.h): ne local experts'
 * SwiGLU/GELU FFNs over rows already grouped by expert (the distributed
 * path, after the dispatch all-to-all), their backward, and the AdamW step
 * on fp32 master weights. Same grouped GEMMs as the layer (kcu_ffn.cu),
 * without gathers or gate weights; the tile list is built on the device
 * from the host counts.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kcu_ffn.cuh"

namespace
{

using carve = kcu_carve;

void carve_params(kcu_experts *x, carve *cv)
{
    const size_t H = x->H, F = x->F, ne = x->ne, N1 = x->N1;
    cv->take(&x->w13, ne * N1 * H * 2); /* a multiple of 256 bytes: w2 follows directly */
    cv->take(&x->w2, ne * H * F * 2);
    if (x->train) {
        cv->take(&x->master, x->nparam * 4);
        cv->take(&x->g, x->nparam * 4);
        cv->take(&x->m, x->nparam * 4);
        cv->take(&x->v, x->nparam * 4);
    }
}

void carve_ws(kcu_experts *x, carve *cv)
{
    const size_t N = x->N_max, H = x->H, F = x->F, ne = x->ne;
    const size_t mt = N / KCU_BM + ne + 1;
    cv->take(&x->xs, N * H * 2);
    cv->take(&x->io, N * H * 2);
    cv->take(&x->stage, N * H * 4);
    cv->take(&x->h, N * F * 2);
    if (x->train)
        cv->take(&x->ab, N * x->N1 * 2);
    cv->take(&x->cnt, ne * 4);
    cv->take(&x->counts, ne * 4);
    cv->take(&x->offs, (ne + 1) * 4);
    cv->take(&x->tile_e, mt * 4);
    cv->take(&x->tile_r0, mt * 4);
    cv->take(&x->ntiles, 4);
    cv->take(&x->sumsq, (KCU_SUMSQ_BLOCKS + 1) * 8);
    x->max_tiles = (int)mt;
}

/* src (n) of dtype dt, host or device -> bf16 device dst */
moe_err stage_in(kcu_experts *x, const void *src, moe_dtype dt, bf16 *dst, size_t n,
                 cudaStream_t st)
{
    if (dt == MOE_F32 && kcu_is_host_ptr(src)) {
        KCU_CHECK(cudaMemcpyAsync(x->stage, src, n * 4, cudaMemcpyHostToDevice, st));
        src = x->stage;
    }
    return kcu_to_bf16(src, dt, dst, n, st);
}

/* the experts' FFN over the tile list of the last layout (tiles m-tiles at
 * most) */
kcu_ffn experts_ffn(const kcu_experts *x, int tiles)
{
    kcu_ffn f;
    memset(&f, 0, sizeof(f));
    f.H = x->H;
    f.F = x->F;
    f.N1 = x->N1;
    f.act = x->act;
    f.nsm = x->nsm;
    f.w13 = x->w13;
    f.w2 = x->w2;
    f.h = x->h;
    f.ab = x->ab;
    f.t.offs = x->offs;
    f.t.tile_e = x->tile_e;
    f.t.tile_r0 = x->tile_r0;
    f.t.ntiles = x->ntiles;
    f.t.max_tiles = tiles;
    f.E = x->ne;
    f.goffs = x->offs;
    if (x->g) { /* w13's gradients, then w2's */
        f.g_w13 = x->g;
        f.g_w2 = x->g + (size_t)x->ne * x->N1 * x->H;
    }
    f.beta0 = x->grads_clean;
    return f;
}

/* rows (N,H) out of the down (dx 0) or dx (dx 1) GEMM of f: into out
 * (device) or the staging buffer then out (host, or a device pointer the
 * epilogues' 8-byte bf16 / 16-byte f32 stores cannot address), f32 or bf16 */
moe_err ffn_out(kcu_experts *x, const kcu_ffn *f, int dx, int N, void *out, moe_dtype dt,
                cudaStream_t st)
{
    const int host = kcu_is_host_ptr(out) || ((uintptr_t)out & (dt == MOE_F32 ? 15 : 7)) != 0;
    void *dst = host ? (void *)x->stage : out;
    if (dx)
        KCU_TRY(kcu_ffn_dx(f, dst, dt, nullptr, st));
    else
        KCU_TRY(kcu_ffn_down(f, dst, dt, nullptr, st));
    if (host)
        KCU_CHECK(cudaMemcpyAsync(out, x->stage, (size_t)N * x->H * (dt == MOE_F32 ? 4 : 2),
                                  cudaMemcpyDefault, st));
    return MOE_OK;
}

/* fp32 device-layout block of one expert (N1 rows of w13, or w2) <-> host
 * nn.Linear arrays */
void w13_to_dev(const kcu_experts *x, int e, const float *w1, const float *w3, float *dst)
{
    const size_t H = x->H, F = x->F;
    const int swiglu = x->act == KERN_ACT_SWIGLU;
    for (int r = 0; r < x->N1; r++) {
        int from3;
        const int sr = kcu_w13_src(r, swiglu, &from3);
        memcpy(dst + (size_t)r * H, (from3 ? w3 : w1) + ((size_t)e * F + sr) * H, H * 4);
    }
}
void w13_from_dev(const kcu_experts *x, int e, const float *src, float *w1, float *w3)
{
    const size_t H = x->H, F = x->F;
    const int swiglu = x->act == KERN_ACT_SWIGLU;
    for (int r = 0; r < x->N1; r++) {
        int from3;
        const int sr = kcu_w13_src(r, swiglu, &from3);
        float *d = from3 ? w3 : w1;
        if (d)
            memcpy(d + ((size_t)e * F + sr) * H, src + (size_t)r * H, H * 4);
    }
}

} // namespace

extern "C" moe_err kcu_experts_create(int H, int F, int ne, kern_act act, int N_max, int train,
                                      kcu_experts **out)
{
    *out = NULL;
    if (H <= 0 || F <= 0 || H % 128 || F % 128 || ne < 1 || ne > 256 || N_max < 1 ||
        (act != KERN_ACT_SWIGLU && act != KERN_ACT_GELU)) {
        fprintf(stderr, "kcu_experts_create: unsupported shape H=%d F=%d ne=%d N_max=%d\n", H, F,
                ne, N_max);
        return MOE_EINVAL;
    }
    kcu_experts *x = (kcu_experts *)calloc(1, sizeof(*x));
    if (!x)
        return MOE_ENOMEM;
    x->H = H;
    x->F = F;
    x->ne = ne;
    x->act = act;
    x->N1 = act == KERN_ACT_SWIGLU ? 2 * F : F;
    x->N_max = N_max;
    x->train = !!train;
    x->nparam = (size_t)ne * ((size_t)x->N1 * H + (size_t)H * F);
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&x->nsm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        fprintf(stderr, "kcu_experts_create: no CUDA device\n");
        free(x);
        return MOE_EUNAVAIL;
    }
    carve cv = {nullptr, 0};
    carve_params(x, &cv);
    x->params_bytes = cv.off;
    cv = {nullptr, 0};
    carve_ws(x, &cv);
    x->ws_bytes = cv.off;
    if (cudaMalloc(&x->params, x->params_bytes) != cudaSuccess ||
        cudaMalloc(&x->ws, x->ws_bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        fprintf(stderr, "kcu_experts_create: cudaMalloc of %zu + %zu bytes failed\n",
                x->params_bytes, x->ws_bytes);
        kcu_experts_destroy(x);
        return MOE_ENOMEM;
    }
    cv = {(char *)x->params, 0};
    carve_params(x, &cv);
    cv = {(char *)x->ws, 0};
    carve_ws(x, &cv);
    if (x->w2 != x->w13 + (size_t)ne * x->N1 * H) { /* the optimizer walks w13|w2 as one */
        kcu_experts_destroy(x);
        return MOE_EINTERNAL;
    }
    x->grads_clean = 1;
    *out = x;
    return MOE_OK;
}

extern "C" void kcu_experts_destroy(kcu_experts *x)
{
    if (!x)
        return;
    if (x->params)
        cudaFree(x->params);
    if (x->ws)
        cudaFree(x->ws);
    free(x);
}

extern "C" void kcu_experts_bytes(const kcu_experts *x, size_t *params_bytes, size_t *ws_bytes)
{
    if (params_bytes)
        *params_bytes = x->params_bytes;
    if (ws_bytes)
        *ws_bytes = x->ws_bytes;
}

extern "C" moe_err kcu_experts_upload(kcu_experts *x, const float *w1, const float *w3,
                                      const float *w2)
{
    if (!w1 || !w2 || (x->act == KERN_ACT_SWIGLU && !w3))
        return MOE_EINVAL;
    const size_t H = x->H, F = x->F, p13 = (size_t)x->N1 * H, p2 = H * F;
    const size_t per = p13 > p2 ? p13 : p2;
    float *buf = (float *)malloc(per * 4);
    uint16_t *hb = (uint16_t *)malloc(per * 2);
    moe_err rc = MOE_OK;
    if (!buf || !hb)
        rc = MOE_ENOMEM;
    for (int e = 0; e < x->ne && rc == MOE_OK; e++) {
        for (int part = 0; part < 2 && rc == MOE_OK; part++) {
            const size_t n = part ? p2 : p13;
            const float *src = buf;
            if (part)
                src = w2 + (size_t)e * p2;
            else
                w13_to_dev(x, e, w1, w3, buf);
            for (size_t i = 0; i < n; i++)
                hb[i] = kcu_host_bf16(src[i]);
            const size_t off = part ? (size_t)x->ne * p13 + e * p2 : e * p13;
            if (cudaMemcpy(x->w13 + off, hb, n * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
                (x->train &&
                 cudaMemcpy(x->master + off, src, n * 4, cudaMemcpyHostToDevice) != cudaSuccess))
                rc = MOE_EINTERNAL;
        }
    }
    free(buf);
    free(hb);
    if (rc == MOE_EINTERNAL)
        fprintf(stderr, "kcu_experts_upload: %s\n", cudaGetErrorString(cudaGetLastError()));
    if (rc != MOE_OK)
        return rc;
    if (x->train) {
        KCU_CHECK(cudaMemset(x->m, 0, x->nparam * 4));
        KCU_CHECK(cudaMemset(x->v, 0, x->nparam * 4));
        x->grads_clean = 1;
    }
    x->N_fwd = 0;
    KCU_CHECK(cudaDeviceSynchronize());
    return MOE_OK;
}

extern "C" moe_err kcu_experts_forward(kcu_experts *x, int N, const void *xin, moe_dtype x_dtype,
                                       const int32_t *counts, void *y, moe_dtype y_dtype,
                                       int keep_for_backward, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    if (N < 0 || N > x->N_max || !counts || (keep_for_backward && !x->train) ||
        (x_dtype != MOE_F32 && x_dtype != MOE_BF16) || (y_dtype != MOE_F32 && y_dtype != MOE_BF16))
        return MOE_EINVAL;
    long long sum = 0;
    int tiles = 0;
    for (int e = 0; e < x->ne; e++) {
        if (counts[e] < 0)
            return MOE_EINVAL;
        sum += counts[e];
        tiles += KCU_CEIL_DIV(counts[e], KCU_BM);
    }
    if (sum != N)
        return MOE_EINVAL;
    x->N_fwd = 0;
    if (N == 0)
        return MOE_OK;
    const int H = x->H;
    if (kcu_decode_use_experts(x, N, counts, keep_for_backward)) { /* kcu_decode.cu */
        const bf16 *xb = x->xs;
        if (x_dtype == MOE_BF16 && !kcu_is_host_ptr(xin))
            xb = (const bf16 *)xin;
        else
            KCU_TRY(stage_in(x, xin, x_dtype, x->xs, (size_t)N * H, st));
        const int yhost = kcu_is_host_ptr(y);
        KCU_TRY(kcu_decode_experts_forward(x, N, xb, counts, yhost ? (void *)x->stage : y, y_dtype,
                                           st));
        if (yhost)
            KCU_CHECK(cudaMemcpyAsync(y, x->stage, (size_t)N * H * (y_dtype == MOE_F32 ? 4 : 2),
                                      cudaMemcpyDeviceToHost, st));
        return MOE_OK;
    }
    KCU_CHECK(cudaMemcpyAsync(x->cnt, counts, x->ne * 4, cudaMemcpyHostToDevice, st));
    KCU_TRY(kcu_tiles_from_counts(x->cnt, x->ne, x->counts, x->offs, x->tile_e, x->tile_r0,
                                  x->ntiles, st));
    x->tiles_fwd = tiles;

    const bf16 *xb = x->xs;
    if (x_dtype == MOE_BF16 && !keep_for_backward && !kcu_is_host_ptr(xin))
        xb = (const bf16 *)xin;
    else
        KCU_TRY(stage_in(x, xin, x_dtype, x->xs, (size_t)N * H, st));

    const kcu_ffn f = experts_ffn(x, tiles);
    KCU_TRY(kcu_ffn_up(&f, xb, nullptr, keep_for_backward, st));
    KCU_TRY(ffn_out(x, &f, 0, N, y, y_dtype, st));
    x->N_fwd = keep_for_backward ? N : 0;
    return MOE_OK;
}

extern "C" moe_err kcu_experts_backward(kcu_experts *x, const void *dy, moe_dtype dy_dtype,
                                        void *dx, moe_dtype dx_dtype, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    const int N = x->N_fwd;
    if (!x->train || N <= 0)
        return MOE_EPRECOND;
    if ((dy_dtype != MOE_F32 && dy_dtype != MOE_BF16) ||
        (dx_dtype != MOE_F32 && dx_dtype != MOE_BF16))
        return MOE_EINVAL;
    const int H = x->H, tiles = x->tiles_fwd;
    KCU_TRY(stage_in(x, dy, dy_dtype, x->io, (size_t)N * H, st));

    /* dh = dy w2_e -> (da, db) in place of (a, b), h in place of h */
    const kcu_ffn f = experts_ffn(x, tiles);
    KCU_TRY(kcu_ffn_dh(&f, x->io, nullptr, nullptr, nullptr, nullptr, st));

    /* dx = dab w13_e */
    KCU_TRY(ffn_out(x, &f, 1, N, dx, dx_dtype, st));

    /* dW13 += dab^T x, dW2 += dy^T h, grouped over each expert's rows */
    KCU_TRY(kcu_ffn_dw13(&f, x->xs, nullptr, st));
    KCU_TRY(kcu_ffn_dw2(&f, x->io, nullptr, st));
    x->grads_clean = 0;
    x->N_fwd = 0; /* the kept state was consumed in place */
    return MOE_OK;
}

extern "C" moe_err kcu_experts_zero_grads(kcu_experts *x, void *stream)
{
    (void)stream;
    if (!x->train)
        return MOE_EPRECOND;
    x->grads_clean = 1;
    return MOE_OK;
}

extern "C" moe_err kcu_experts_grad_sumsq(kcu_experts *x, double *sumsq, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    if (!x->train)
        return MOE_EPRECOND;
    if (x->grads_clean) {
        *sumsq = 0.0;
        return MOE_OK;
    }
    KCU_TRY(kcu_sumsq(x->g, x->nparam, x->sumsq, st));
    KCU_CHECK(cudaMemcpyAsync(sumsq, x->sumsq + KCU_SUMSQ_BLOCKS, 8, cudaMemcpyDeviceToHost, st));
    KCU_CHECK(cudaStreamSynchronize(st));
    return MOE_OK;
}

extern "C" moe_err kcu_experts_adamw(kcu_experts *x, float lr, float beta1, float beta2, float eps,
                                     float wd, int64_t step, float grad_scale, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    if (!x->train)
        return MOE_EPRECOND;
    if (step < 1)
        step = 1;
    const float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
    const float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
    if (x->grads_clean) { /* logically zero: make them so before the step reads them */
        KCU_CHECK(cudaMemsetAsync(x->g, 0, x->nparam * 4, st));
        x->grads_clean = 0;
    }
    return kcu_adamw(x->master, x->g, x->m, x->v, x->w13, x->nparam, lr, beta1, beta2, eps, wd, bc1,
                     bc2, grad_scale, st);
}

extern "C" moe_err kcu_experts_download_grads(kcu_experts *x, float *dw1, float *dw3, float *dw2)
{
    if (!x->train)
        return MOE_EPRECOND;
    const size_t H = x->H, F = x->F, p13 = (size_t)x->N1 * H, p2 = H * F;
    const int swiglu = x->act == KERN_ACT_SWIGLU;
    KCU_CHECK(cudaDeviceSynchronize());
    if (x->grads_clean) {
        if (dw1)
            memset(dw1, 0, (size_t)x->ne * F * H * 4);
        if (dw3 && swiglu)
            memset(dw3, 0, (size_t)x->ne * F * H * 4);
        if (dw2)
            memset(dw2, 0, (size_t)x->ne * p2 * 4);
        return MOE_OK;
    }
    if (dw2)
        KCU_CHECK(cudaMemcpy(dw2, x->g + (size_t)x->ne * p13, (size_t)x->ne * p2 * 4,
                             cudaMemcpyDeviceToHost));
    if (!dw1 && !dw3)
        return MOE_OK;
    float *buf = (float *)malloc(p13 * 4);
    if (!buf)
        return MOE_ENOMEM;
    for (int e = 0; e < x->ne; e++) {
        if (cudaMemcpy(buf, x->g + e * p13, p13 * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
            free(buf);
            KCU_CHECK(cudaGetLastError());
            return MOE_EINTERNAL;
        }
        w13_from_dev(x, e, buf, dw1, swiglu ? dw3 : NULL);
    }
    free(buf);
    return MOE_OK;
}

extern "C" moe_err kcu_experts_download_weights(kcu_experts *x, float *w1, float *w3, float *w2)
{
    const size_t H = x->H, F = x->F, p13 = (size_t)x->N1 * H, p2 = H * F;
    const size_t per = p13 > p2 ? p13 : p2;
    const int swiglu = x->act == KERN_ACT_SWIGLU;
    KCU_CHECK(cudaDeviceSynchronize());
    float *buf = (float *)malloc(per * 4);
    uint16_t *hb = (uint16_t *)malloc(per * 2);
    moe_err rc = buf && hb ? MOE_OK : MOE_ENOMEM;
    for (int e = 0; e < x->ne && rc == MOE_OK; e++) {
        for (int part = 0; part < 2 && rc == MOE_OK; part++) {
            float *dst = part ? w2 : (w1 || w3 ? buf : NULL);
            if (!dst)
                continue;
            const size_t n = part ? p2 : p13;
            const size_t off = part ? (size_t)x->ne * p13 + e * p2 : e * p13;
            if (part)
                dst += e * p2;
            if (x->train) {
                if (cudaMemcpy(dst, x->master + off, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess)
                    rc = MOE_EINTERNAL;
            } else {
                if (cudaMemcpy(hb, x->w13 + off, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
                    rc = MOE_EINTERNAL;
                for (size_t i = 0; i < n && rc == MOE_OK; i++) {
                    const uint32_t u = (uint32_t)hb[i] << 16;
                    memcpy(&dst[i], &u, 4);
                }
            }
            if (!part && rc == MOE_OK)
                w13_from_dev(x, e, buf, w1, swiglu ? w3 : NULL);
        }
    }
    free(buf);
    free(hb);
    if (rc == MOE_EINTERNAL)
        fprintf(stderr, "kcu_experts_download_weights: %s\n",
                cudaGetErrorString(cudaGetLastError()));
    return rc;
}
