/*
 * cuda_ipc_check.c - rows already on a GPU, through the service (a second
 * process: run it against a cluster of GPU workers on this host, e.g.
 * deploy/gpu-cluster.sh -w 1 -- bin/cuda_ipc_check). Not a test of the
 * suite (no GPU there); prints PASS/FAIL lines and exits non-zero on any
 * failure:
 *   - x and y in cudaMalloc'ed buffers registered with moe_cuda_register
 *     give the same bytes as the same forward from host memory (T = 1, 64,
 *     1000, a small bf16 layer);
 *   - bad input gets a clear error and the worker keeps serving: a handle
 *     that is not an IPC handle, an output buffer too small for the answer;
 *   - then times a Qwen3-30B-A3B layer (2048, 768, 128 experts, top-8) at
 *     T = 1, 64, 4096, 16384 from device buffers (median of --iters).
 *
 *   cuda_ipc_check [--url URL] [--iters N] [--no-timing] [--timing-min T]
 *   (--timing-min: time only the T of at least that many tokens)
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kern.h"
#include "base/moe.h"
#include "common/rng.h"

static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL ");                                                                       \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* dev_buffer: cudaMalloc n bytes and register them with the client */
static void *dev_buffer(moe_client *c, size_t n)
{
    void *d = NULL;
    cudaIpcMemHandle_t h;
    if (cudaMalloc(&d, n) != cudaSuccess || cudaIpcGetMemHandle(&h, d) != cudaSuccess) {
        printf("FAIL cudaMalloc/cudaIpcGetMemHandle of %zu bytes\n", n);
        exit(1);
    }
    moe_err e = moe_cuda_register(c, d, n, &h);
    CHECK(e == MOE_OK, "moe_cuda_register: %s", moe_last_error());
    return d;
}

static void create(moe_client *c, const char *name, int H, int F, int E, int K)
{
    moe_model_config cfg = {name, 1, H, F, E, K, "swiglu", 1, 0, MOE_BF16, 3, 0.01, 0};
    moe_err e = moe_model_create(c, &cfg);
    if (e != MOE_OK) {
        printf("FAIL model.create %s: %s\n", name, moe_last_error());
        exit(1);
    }
}

int main(int argc, char **argv)
{
    const char *url = getenv("MOE_URL") ? getenv("MOE_URL") : "tcp://127.0.0.1:7000";
    int iters = 20, timing = 1, tmin = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--url") && i + 1 < argc)
            url = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-timing"))
            timing = 0;
        else if (!strcmp(argv[i], "--timing-min") && i + 1 < argc)
            tmin = atoi(argv[++i]);
    }
    moe_client *c;
    moe_client_opts co = {.timeout_ms = 600000};
    if (moe_client_open(url, &co, &c) != MOE_OK) {
        printf("FAIL open %s: %s\n", url, moe_last_error());
        return 1;
    }
    /* 1. the same bytes from device buffers as from host memory */
    const int H = 1024;
    create(c, "ipc", H, 512, 16, 4);
    const int Ts[3] = {1, 64, 1000};
    size_t nmax = (size_t)1000 * H * 2;
    void *xd = dev_buffer(c, nmax), *yd = dev_buffer(c, nmax);
    uint16_t *x = malloc(nmax), *yh = malloc(nmax), *yg = malloc(nmax);
    float *xf = malloc((size_t)1000 * H * 4);
    for (int ti = 0; ti < 3; ti++) {
        int T = Ts[ti];
        size_t n = (size_t)T * H;
        rng_fill_uniform(5, (uint64_t)T, -1, 1, xf, n);
        for (size_t i = 0; i < n; i++)
            x[i] = kern_f32_to_bf16(xf[i]);
        moe_err e = moe_forward(c, "ipc", 0, MOE_BF16, x, T, H, yh, NULL);
        CHECK(e == MOE_OK, "host forward T=%d: %s", T, moe_last_error());
        cudaMemcpy(xd, x, n * 2, cudaMemcpyHostToDevice);
        cudaMemset(yd, 0xff, n * 2); /* poison */
        e = moe_forward(c, "ipc", 0, MOE_BF16, xd, T, H, yd, NULL);
        CHECK(e == MOE_OK, "device forward T=%d: %s", T, moe_last_error());
        cudaMemcpy(yg, yd, n * 2, cudaMemcpyDeviceToHost);
        int same = e == MOE_OK && memcmp(yg, yh, n * 2) == 0;
        CHECK(same, "T=%d: y from device buffers differs from the host forward", T);
        if (same)
            printf("PASS T=%d: y through CUDA IPC equals the host forward (%zu bytes)\n", T, n * 2);
    }
    /* 2. bad input: a handle that opens nothing; an output too small */
    {
        void *fake = (void *)(uintptr_t)0x7f0000000000ull;
        uint8_t junk[64];
        memset(junk, 0x5a, sizeof(junk));
        moe_err e = moe_cuda_register(c, fake, 1 << 20, junk);
        CHECK(e == MOE_OK, "register junk: %s", moe_last_error());
        e = moe_forward(c, "ipc", 0, MOE_BF16, fake, 4, H, fake, NULL);
        CHECK(e != MOE_OK, "a junk IPC handle was accepted");
        printf("%s junk handle -> %s: %s\n", e != MOE_OK ? "PASS" : "FAIL", moe_err_code(e),
               moe_last_error());
        moe_cuda_unregister(c, fake);
        void *small = dev_buffer(c, 4 * (size_t)H * 2); /* 4 rows */
        e = moe_forward(c, "ipc", 0, MOE_BF16, xd, 64, H, small, NULL);
        CHECK(e == MOE_EINVAL, "an output buffer of 4 rows for 64: %s", moe_err_code(e));
        printf("%s output too small -> %s: %s\n", e == MOE_EINVAL ? "PASS" : "FAIL",
               moe_err_code(e), moe_last_error());
        e = moe_forward(c, "ipc", 0, MOE_BF16, xd, 64, H, yd, NULL);
        CHECK(e == MOE_OK, "the worker serves after bad input: %s", moe_last_error());
        moe_cuda_unregister(c, small);
        cudaFree(small);
    }
    /* 3. timing: the Qwen3 layer from device buffers */
    if (timing) {
        const int QH = 2048, QT[4] = {1, 64, 4096, 16384};
        create(c, "ipcq", QH, 768, 128, 8);
        size_t qn = (size_t)16384 * QH * 2;
        void *qx = dev_buffer(c, qn), *qy = dev_buffer(c, qn);
        uint16_t *hx = malloc(qn);
        float *fx = malloc(qn * 2);
        rng_fill_uniform(9, 9, -1, 1, fx, qn / 2);
        for (size_t i = 0; i < qn / 2; i++)
            hx[i] = kern_f32_to_bf16(fx[i]);
        cudaMemcpy(qx, hx, qn, cudaMemcpyHostToDevice);
        double *lat = malloc((size_t)iters * sizeof(double));
        for (int ti = 0; ti < 4; ti++) {
            int T = QT[ti];
            if (T < tmin)
                continue;
            moe_err e = MOE_OK;
            for (int it = -2; it < iters && e == MOE_OK; it++) {
                moe_fwd_info fi;
                memset(&fi, 0, sizeof(fi));
                double t0 = now_s();
                e = moe_forward(c, "ipcq", 0, MOE_BF16, qx, T, QH, qy, &fi);
                if (it >= 0)
                    lat[it] = now_s() - t0;
                moe_fwd_info_free(&fi);
            }
            CHECK(e == MOE_OK, "qwen3 T=%d: %s", T, moe_last_error());
            if (e != MOE_OK)
                continue;
            qsort(lat, (size_t)iters, sizeof(double), cmp_d);
            printf("qwen3 T=%-6d CUDA IPC fwd %.3f ms (p50 of %d), %.0f tokens/s\n", T,
                   lat[iters / 2] * 1e3, iters, T / lat[iters / 2]);
        }
        free(lat);
        free(hx);
        free(fx);
    }
    moe_client_close(c);
    printf("%s: %d failures\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
