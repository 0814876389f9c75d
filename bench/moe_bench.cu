/*
 * moe_bench.cu - times one MoE layer (kern_cuda.h) on the GPU: forward and
 * forward+backward per case (CUDA events, warm-up, median), TFLOP/s and the
 * fraction of a dense 8192^3 bf16 cuBLAS GEMM measured in the same run,
 * device memory, and for decode the GB/s over the touched expert weights
 * against the measured device copy bandwidth, with the GEMM path (decode
 * path off, kcu_decode.cu) timed in the same run for comparison, and the
 * time of a call among calls enqueued back to back (b2b_ms). Not a test.
 *
 *   bench/moe_bench [--quick | --only LIST]   (--quick: the Mixtral and Qwen3 rows;
 *                                  --only qwen3-dec:1,mixtral-dec: cases by prefix;
 *                                  --only pipelined: host x, y chunked with the copies
 *                                  overlapped (kcu_forward_pipelined);
 *                                  MOE_BENCH_NO_AB=1: without the sorted-mode A/B;
 *                                  MOE_BENCH_CUBLAS=0: without cuBLAS's batched GEMMs
 *                                  beside the bytes-bound layers)
 */
#include <algorithm>
#include <cublas_v2.h>
#include <functional>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "kernels/cuda/kcu_internal.cuh"
#include "kernels/cuda/kcu_tool.h"

/* uniform in [lo, hi) from a hash of (seed, i), stored as bf16 */
__global__ void k_fill(bf16 *p, size_t n, uint64_t seed, float lo, float hi)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        p[i] = __float2bfloat16_rn(lo + (hi - lo) * u);
    }
}
static void fill(bf16 *p, size_t n, uint64_t seed, float a, float b)
{
    k_fill<<<4096, 256>>>(p, n, seed, a, b);
    CK(cudaGetLastError());
}

/* one timed call between the events a and b, ms */
template <typename F> static float time_once(cudaEvent_t a, cudaEvent_t b, F &fn)
{
    CK(cudaEventRecord(a));
    fn();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

/* median_ms: median of reps timed calls after warm untimed ones; warm < 0:
 * warm up for -warm milliseconds (at least 3 calls), so that the GPU is at
 * the clock it holds under sustained load (H100: 700 W power cap) */
template <typename F> static float median_ms(int warm, int reps, F fn)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    if (warm < 0) {
        const float ms = time_once(a, b, fn);
        const float n = (float)-warm / (ms > 1e-3f ? ms : 1e-3f);
        warm = n > 20000.f ? 20000 : n < 3.f ? 3 : (int)n;
    }
    for (int i = 0; i < warm; i++)
        fn();
    std::vector<float> t;
    for (int i = 0; i < reps; i++)
        t.push_back(time_once(a, b, fn));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

/* a cuBLAS handle (the caller destroys it); exits when none can be made */
static cublasHandle_t cublas_new()
{
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasCreate failed\n");
        exit(2);
    }
    return h;
}

/* dense_tflops: cuBLAS bf16 8192^3; sustained_ms > 0: first run it back to
 * back for that long (the GPU reaches its power limit and lowers its clock,
 * as it does under the layer's own repeated calls), then time it */
static double dense_tflops(float sustained_ms)
{
    const int n = 8192;
    bf16 *A, *B, *C;
    CK(cudaMalloc(&A, (size_t)n * n * 2));
    CK(cudaMalloc(&B, (size_t)n * n * 2));
    CK(cudaMalloc(&C, (size_t)n * n * 2));
    fill(A, (size_t)n * n, 1, -1, 1);
    fill(B, (size_t)n * n, 2, -1, 1);
    cublasHandle_t h = cublas_new();
    const float one = 1.f, zero = 0.f;
    const int warm = sustained_ms > 0 ? (int)(sustained_ms / 1.3f) : 3;
    const float ms = median_ms(warm, 15, [&] {
        if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, A, CUDA_R_16BF, n, B,
                         CUDA_R_16BF, n, &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cublasGemmEx failed\n");
            exit(2);
        }
    });
    cublasDestroy(h);
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(C));
    return 2.0 * n * n * (double)n / (ms * 1e-3) / 1e12;
}

/* copy_gbs: device-to-device copy of 1 GiB, read + write GB/s; sustained_ms
 * > 0: first copied back to back for that long (as dense_tflops) */
static double copy_gbs(float sustained_ms)
{
    const size_t n = (size_t)1 << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 1, n));
    const int warm = sustained_ms > 0 ? (int)(sustained_ms / 0.5f) : 2;
    const float ms =
        median_ms(warm, 10, [&] { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); });
    CK(cudaFree(a));
    CK(cudaFree(b));
    return 2.0 * n / (ms * 1e-3) / 1e9;
}

/* phase timing through kcu_phase_hook: events recorded between phases */
static std::vector<std::pair<const char *, cudaEvent_t>> g_ph;
static void phase_hook(const char *name, cudaStream_t st)
{
    cudaEvent_t e;
    CK(cudaEventCreate(&e));
    CK(cudaEventRecord(e, st));
    g_ph.emplace_back(name, e);
}
/* one forward+backward with the hook on: "name ms" per phase */
static void phase_times(std::function<void()> fn, char *out, size_t n)
{
    kcu_phase_hook = phase_hook;
    fn();
    kcu_phase_hook = nullptr;
    CK(cudaDeviceSynchronize());
    size_t o = 0;
    for (size_t i = 0; i + 1 < g_ph.size() && o < n; i++) {
        float ms;
        CK(cudaEventElapsedTime(&ms, g_ph[i].second, g_ph[i + 1].second));
        if (!strcmp(g_ph[i].first, "f.end"))
            continue;
        o += snprintf(out + o, n - o, " %s %.2f", g_ph[i].first, ms);
    }
    for (auto &pe : g_ph)
        CK(cudaEventDestroy(pe.second));
    g_ph.clear();
}

/* matches: list is comma-separated prefixes of "name:T" tags */
static bool matches(const char *list, const char *tag)
{
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ',');
        const size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n && !strncmp(p, tag, n))
            return true;
        p += n + (e ? 1 : 0);
    }
    return false;
}

/* every timing warms up this long first: the clock under sustained load */
static const int WARM_MS = 1000;

/* b2b_ms: one call's time when calls are enqueued back to back, as an
 * engine enqueues its layers (no host wait between them: the launch latency
 * hides behind the previous call): CALLS calls between two events, median
 * of reps, divided by CALLS. The calls rotate over copies of layer l (same
 * config and parameters, pb bytes) so that the weights they touch (bytes
 * each) add up to four 50 MB L2 caches at least: no call finds its weights
 * in L2 from the one before, as no layer of a model does. */
template <typename F>
static float b2b_ms(kcu_layer *l, const kcu_config &cfg, size_t pb, double bytes, int reps, F fn)
{
    const int CALLS = 24;
    int ncopy = (int)(200e6 / bytes) + 1;
    ncopy = ncopy < 2 ? 2 : ncopy > 8 ? 8 : ncopy;
    std::vector<kcu_layer *> ls(1, l);
    for (int i = 1; i < ncopy; i++) {
        kcu_layer *li;
        CKM(kcu_layer_create(&cfg, &li));
        CK(cudaMemcpy(li->params, l->params, pb, cudaMemcpyDeviceToDevice));
        ls.push_back(li);
    }
    const float ms = median_ms(-WARM_MS, reps, [&] {
        for (int i = 0; i < CALLS; i++)
            fn(ls[i % ncopy]);
    });
    for (int i = 1; i < ncopy; i++)
        kcu_layer_destroy(ls[i]);
    return ms / CALLS;
}

static bool getenv_is(const char *name, const char *v)
{
    const char *e = getenv(name);
    return e && !strcmp(e, v);
}

/* cublas_batched: the vendor's GEMMs at a bytes-bound layer's shapes, for
 * scale: every expert given the same R rows (cuBLAS's strided batch takes
 * no ragged groups), the up-projection x (R, H) w13_e^T -> (R, N1) (no
 * activation: its output is twice h) and the down-projection (R, F) w2_e^T
 * -> (R, H) over the layer's own weights, each timed as the layer is
 * (warm-up, median). Writes "up U ms (u%), down D ms (d%), both B ms (b%)",
 * % of copy over the weights each reads; false when R would be fractional */
static bool cublas_batched(const kcu_layer *l, int T, int K, int reps, double bw, char *out,
                           size_t n)
{
    const int E = l->c.E, H = l->c.H, F = l->c.F, N1 = l->N1;
    if ((long long)T * K % E)
        return false;
    const int R = (int)((long long)T * K / E);
    bf16 *x, *u, *hh, *y;
    CK(cudaMalloc(&x, (size_t)E * R * H * 2));
    CK(cudaMalloc(&u, (size_t)E * R * N1 * 2));
    CK(cudaMalloc(&hh, (size_t)E * R * F * 2));
    CK(cudaMalloc(&y, (size_t)E * R * H * 2));
    fill(x, (size_t)E * R * H, 31, -1, 1);
    fill(hh, (size_t)E * R * F, 32, -1, 1);
    cublasHandle_t h = cublas_new();
    const float one = 1.f, zero = 0.f;
    /* column-major: C_e^T (m, R) = W_e (m, k as its rows) x act_e^T */
    auto gemm = [&](const bf16 *w, const bf16 *a, bf16 *c, int m, int k) {
        if (cublasGemmStridedBatchedEx(
                h, CUBLAS_OP_T, CUBLAS_OP_N, m, R, k, &one, w, CUDA_R_16BF, k, (long long)m * k, a,
                CUDA_R_16BF, k, (long long)R * k, &zero, c, CUDA_R_16BF, m, (long long)R * m, E,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cublasGemmStridedBatchedEx failed\n");
            exit(2);
        }
    };
    const float up = median_ms(-WARM_MS, reps, [&] { gemm(l->w13, x, u, N1, H); });
    const float down = median_ms(-WARM_MS, reps, [&] { gemm(l->w2, hh, y, H, F); });
    const float both = median_ms(-WARM_MS, reps, [&] {
        gemm(l->w13, x, u, N1, H);
        gemm(l->w2, hh, y, H, F);
    });
    cublasDestroy(h);
    CK(cudaFree(x));
    CK(cudaFree(u));
    CK(cudaFree(hh));
    CK(cudaFree(y));
    const double wu = (double)E * N1 * H * 2, wd = (double)E * H * F * 2;
    auto pct = [&](double bytes, float ms) { return 100.0 * bytes / (ms * 1e-3) / 1e9 / bw; };
    snprintf(out, n,
             "%d experts x %d rows: up %.3f ms (%.0f%%), down %.3f ms (%.0f%%), both %.3f ms "
             "(%.0f%%)",
             E, R, up, pct(wu, up), down, pct(wd, down), both, pct(wu + wd, both));
    return true;
}

struct bcase {
    const char *name;
    int T, H, F, E, K, train, skew;
};

int main(int argc, char **argv)
{
    const int quick = argc > 1 && !strcmp(argv[1], "--quick");
    /* --only LIST: the cases whose "name:T" starts with one of the
     * comma-separated prefixes (for profilers and A/B runs) */
    const char *only = argc > 2 && !strcmp(argv[1], "--only") ? argv[2] : nullptr;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const double peak = dense_tflops(0), bw = copy_gbs(0);
    const double peak_sus = dense_tflops(3000), bw_sus = copy_gbs(3000);
    printf("device: %s, %d SMs; dense bf16 GEMM 8192^3 (cuBLAS): %.0f TFLOP/s (after 3 s back to "
           "back: %.0f); D2D copy: %.0f GB/s (read+write; after 3 s back to back: %.0f)\n",
           prop.name, prop.multiProcessorCount, peak, peak_sus, bw, bw_sus);
    std::vector<bcase> cases = {{"mixtral", 8192, 4096, 14336, 8, 2, 1, 0},
                                {"qwen3", 16384, 2048, 768, 128, 8, 1, 0},
                                {"qwen3-skew", 16384, 2048, 768, 128, 8, 1, 1},
                                {"mixtral-dec", 1, 4096, 14336, 8, 2, 0, 0},
                                {"mixtral-dec", 16, 4096, 14336, 8, 2, 0, 0},
                                {"mixtral-dec", 64, 4096, 14336, 8, 2, 0, 0},
                                {"mixtral-dec", 256, 4096, 14336, 8, 2, 0, 0},
                                {"qwen3-dec", 1, 2048, 768, 128, 8, 0, 0},
                                {"qwen3-dec", 16, 2048, 768, 128, 8, 0, 0},
                                {"qwen3-dec", 64, 2048, 768, 128, 8, 0, 0},
                                {"qwen3-dec", 256, 2048, 768, 128, 8, 0, 0},
                                /* Qwen3-235B-A22B, inference at T = 2048: 128 rows per
                                 * expert, every expert touched, ~4.8 GB of weights (a
                                 * bytes-bound layer: the GB/s column applies) */
                                {"qwen235", 2048, 4096, 1536, 128, 8, 0, 0},
                                /* the same kind of layer (few rows per expert, every
                                 * expert touched): 64 and 256 rows per expert; Qwen3 and
                                 * Mixtral at 128 and 256 */
                                {"qwen235", 1024, 4096, 1536, 128, 8, 0, 0},
                                {"qwen235", 4096, 4096, 1536, 128, 8, 0, 0},
                                {"qwen3-mid", 2048, 2048, 768, 128, 8, 0, 0},
                                {"qwen3-mid", 4096, 2048, 768, 128, 8, 0, 0},
                                {"mixtral-mid", 512, 4096, 14336, 8, 2, 0, 0},
                                {"mixtral-mid", 1024, 4096, 14336, 8, 2, 0, 0}};
    if (quick)
        cases.resize(2);
    printf("%-12s %6s %5s %6s %4s %2s | %9s %8s %6s | %9s %8s %6s | %8s | %8s %8s | %s\n", "case",
           "T", "H", "F", "E", "K", "fwd ms", "TFLOP/s", "of GEMM", "f+b ms", "TFLOP/s", "of GEMM",
           "step ms", "ws MB", "grads MB", "decode: GB/s of touched weights (of copy)");
    for (const bcase &c : cases) {
        char tag[64];
        snprintf(tag, sizeof(tag), "%s:%d", c.name, c.T);
        if (only && !matches(only, tag))
            continue;
        kcu_config cfg = {c.H, c.F, c.E, c.K, KERN_ACT_SWIGLU, 1, c.T, c.train};
        size_t free0, free1, tot;
        CK(cudaMemGetInfo(&free0, &tot));
        kcu_layer *l;
        CKM(kcu_layer_create(&cfg, &l));
        CK(cudaMemGetInfo(&free1, &tot));
        const size_t H = c.H, F = c.F, E = c.E;
        fill(l->wr, (size_t)l->Ep * H, 11, -1.f / sqrtf(H), 1.f / sqrtf(H));
        fill(l->w13, E * l->N1 * H, 12, -1.f / sqrtf(H), 1.f / sqrtf(H));
        fill(l->w2, E * H * F, 13, -1.f / sqrtf(F), 1.f / sqrtf(F));
        if (c.skew) { /* experts 0 and 1 take most tokens */
            bf16 *tmp;
            CK(cudaMalloc(&tmp, 2 * H * 2));
            fill(tmp, H, 14, 16.f / H, 16.f / H + 1e-6f);
            fill(tmp + H, H, 15, 12.f / H, 12.f / H + 1e-6f);
            CK(cudaMemcpy(l->wr, tmp, 2 * H * 2, cudaMemcpyDeviceToDevice));
            CK(cudaFree(tmp));
        }
        bf16 *x, *y, *dy, *dx;
        const size_t n = (size_t)c.T * H;
        CK(cudaMalloc(&x, n * 2));
        CK(cudaMalloc(&y, n * 2));
        CK(cudaMalloc(&dy, n * 2));
        CK(cudaMalloc(&dx, n * 2));
        fill(x, n, 21, c.skew ? -0.5f : -1.f, c.skew ? 1.5f : 1.f);
        fill(dy, n, 22, -1.f, 1.f);
        CK(cudaDeviceSynchronize());
        if (c.train)
            CKM(kcu_layer_zero_grads(l, NULL));
        const double S = (double)c.T * c.K;
        const double fl_fwd = 2.0 * S * H * (l->N1 + F) + 2.0 * c.T * H * E;
        const double fl_bwd = 2.0 * fl_fwd + 2.0 * 2.0 * c.T * H * E; /* same GEMMs x2 */
        const int reps = c.T >= 4096 ? 20 : 50;
        const float fwd = median_ms(
            -WARM_MS, reps, [&] { CKM(kcu_forward(l, c.T, x, MOE_BF16, y, MOE_BF16, 0, NULL)); });
        float fb = 0, fbz = 0;
        char phases[512] = "";
        size_t pb, wb;
        kcu_layer_bytes(l, &pb, &wb);
        const size_t wbytes = ((size_t)l->Ep * H + E * l->N1 * H + E * H * F) * 2;
        if (c.train) {
            /* gradients accumulate (+=) over the repetitions */
            fb = median_ms(-WARM_MS, reps, [&] {
                CKM(kcu_forward(l, c.T, x, MOE_BF16, y, MOE_BF16, 1, NULL));
                CKM(kcu_backward(l, dy, MOE_BF16, dx, MOE_BF16, 0.01f, 0.001f, NULL, 0, NULL));
            });
            /* a training step's pattern: zero_grads, forward, backward (stores) */
            fbz = median_ms(-WARM_MS, reps, [&] {
                CKM(kcu_layer_zero_grads(l, NULL));
                CKM(kcu_forward(l, c.T, x, MOE_BF16, y, MOE_BF16, 1, NULL));
                CKM(kcu_backward(l, dy, MOE_BF16, dx, MOE_BF16, 0.01f, 0.001f, NULL, 0, NULL));
            });
            phase_times(
                [&] {
                    CKM(kcu_forward(l, c.T, x, MOE_BF16, y, MOE_BF16, 1, NULL));
                    CKM(kcu_backward(l, dy, MOE_BF16, dx, MOE_BF16, 0.01f, 0.001f, NULL, 0, NULL));
                },
                phases, sizeof(phases));
        }
        CK(cudaDeviceSynchronize());
        char dec[512] = "";
        if (!c.train) {
            std::vector<int32_t> counts(E);
            CKM(kcu_forward_stats(l, counts.data(), NULL, NULL, NULL, NULL));
            int touched = 0;
            for (int e = 0; e < c.E; e++)
                touched += counts[e] > 0;
            const double bytes = (double)touched * (l->N1 + F) * H * 2 + (double)c.E * H * 2;
            const double gbs = bytes / (fwd * 1e-3) / 1e9;
            /* A/B in the same run: the GEMM path (decode path off) */
            const int used = kcu_decode_use(l, c.T, 0);
            kcu_decode_override = 0;
            const float fwd_g = median_ms(-WARM_MS, reps, [&] {
                CKM(kcu_forward(l, c.T, x, MOE_BF16, y, MOE_BF16, 0, NULL));
            });
            phase_times([&] { CKM(kcu_forward(l, c.T, x, MOE_BF16, y, MOE_BF16, 0, NULL)); },
                        phases, sizeof(phases));
            /* and the decode path where it can run but the default is the GEMM path */
            char forced[96] = "";
            kcu_decode_override = 1;
            if (!used && kcu_decode_use(l, c.T, 0)) {
                const float fwd_d = median_ms(-WARM_MS, reps, [&] {
                    CKM(kcu_forward(l, c.T, x, MOE_BF16, y, MOE_BF16, 0, NULL));
                });
                snprintf(forced, sizeof(forced), "; decode path %.3f ms (%.0f%%)", fwd_d,
                         100.0 * bytes / (fwd_d * 1e-3) / 1e9 / bw);
            }
            kcu_decode_override = -1;
            const float fwd_b = b2b_ms(l, cfg, pb, bytes, reps, [&](kcu_layer *li) {
                CKM(kcu_forward(li, c.T, x, MOE_BF16, y, MOE_BF16, 0, NULL));
            });
            const double gbs_g = bytes / (fwd_g * 1e-3) / 1e9;
            snprintf(dec, sizeof(dec),
                     "%d experts, %.0f MB: %.0f GB/s (%.0f%%) [%s path]; GEMM path %.3f ms "
                     "(%.0f%%)%s; back to back %.3f ms (%.0f%%)",
                     touched, bytes / 1e6, gbs, 100.0 * gbs / bw, used ? "decode" : "GEMM", fwd_g,
                     100.0 * gbs_g / bw, forced, fwd_b, 100.0 * bytes / (fwd_b * 1e-3) / 1e9 / bw);
        }
        const double tf = fl_fwd / (fwd * 1e-3) / 1e12;
        const double tfb = c.train ? (fl_fwd + fl_bwd) / (fb * 1e-3) / 1e12 : 0;
        printf("%-12s %6d %5d %6d %4d %2d | %9.3f %8.0f %5.0f%% | %9.3f %8.0f %5.0f%% | %8.3f "
               "| %8.0f %8.0f | %s\n",
               c.name, c.T, c.H, c.F, c.E, c.K, fwd, tf, 100 * tf / peak, fb, tfb, 100 * tfb / peak,
               fbz, wb / 1e6, (pb - wbytes) / 1e6, dec);
        if (!c.train)
            printf("  GEMM path phases (ms, one call):%s\n", phases);
        /* bytes-bound layers (at most 256 rows an expert): the vendor's
         * batched GEMMs at the same shapes, % of copy over their weights */
        char cb[256];
        if (!c.train && (long long)c.T * c.K <= 256LL * c.E &&
            !getenv_is("MOE_BENCH_CUBLAS", "0") &&
            cublas_batched(l, c.T, c.K, reps, bw, cb, sizeof(cb)))
            printf("  cuBLAS strided-batched GEMMs, equal rows: %s\n", cb);
        if (c.train) {
            printf("  phases (ms):%s\n", phases);
            size_t pb_acc, wb_acc;
            kcu_layer_bytes(l, &pb_acc, &wb_acc);
            if (wb_acc > wb) /* ye borrowed from the zeroed gradient store (step) */
                printf("  workspace %.0f MB for a step (zero_grads first); accumulating without "
                       "zeroing: %.0f MB\n",
                       wb / 1e6, wb_acc / 1e6);
            /* A/B in the same run: the other sorted-rows modes (kcu_sorted_mode) */
            for (int m = 0; m < (getenv("MOE_BENCH_NO_AB") ? 0 : 3); m++) {
                if (m == l->sorted)
                    continue;
                kcu_sorted_override = m;
                kcu_layer *l2;
                CKM(kcu_layer_create(&cfg, &l2));
                kcu_sorted_override = -1;
                CK(cudaMemcpy(l2->params, l->params, pb, cudaMemcpyDeviceToDevice));
                CKM(kcu_layer_zero_grads(l2, NULL));
                const float f2 = median_ms(-WARM_MS, reps, [&] {
                    CKM(kcu_forward(l2, c.T, x, MOE_BF16, y, MOE_BF16, 0, NULL));
                });
                const float fb2 = median_ms(-WARM_MS, reps, [&] {
                    CKM(kcu_forward(l2, c.T, x, MOE_BF16, y, MOE_BF16, 1, NULL));
                    CKM(kcu_backward(l2, dy, MOE_BF16, dx, MOE_BF16, 0.01f, 0.001f, NULL, 0, NULL));
                });
                size_t pb2, wb2;
                kcu_layer_bytes(l2, &pb2, &wb2);
                printf("  sorted mode %d (default %d): fwd %.3f ms, f+b %.3f ms, ws %.0f MB\n", m,
                       l->sorted, f2, fb2, wb2 / 1e6);
                fflush(stdout);
                kcu_layer_destroy(l2);
            }
            /* bf16 gradient store (kcu_config.grad_bf16), default sorted mode */
            if (!getenv("MOE_BENCH_NO_AB")) {
                kcu_config c16 = cfg;
                c16.grad_bf16 = 1;
                kcu_layer *l2;
                CKM(kcu_layer_create(&c16, &l2));
                CK(cudaMemcpy(l2->wr, l->wr, (size_t)l->Ep * H * 2, cudaMemcpyDeviceToDevice));
                CK(cudaMemcpy(l2->w13, l->w13, E * l->N1 * H * 2, cudaMemcpyDeviceToDevice));
                CK(cudaMemcpy(l2->w2, l->w2, E * H * F * 2, cudaMemcpyDeviceToDevice));
                const float fb2 = median_ms(-WARM_MS, reps, [&] {
                    CKM(kcu_layer_zero_grads(l2, NULL));
                    CKM(kcu_forward(l2, c.T, x, MOE_BF16, y, MOE_BF16, 1, NULL));
                    CKM(kcu_backward(l2, dy, MOE_BF16, dx, MOE_BF16, 0.01f, 0.001f, NULL, 0, NULL));
                });
                size_t pb2, wb2;
                kcu_layer_bytes(l2, &pb2, &wb2);
                printf("  bf16 gradients: step %.3f ms, ws %.0f MB + grads %.0f MB = %.0f MB\n",
                       fb2, wb2 / 1e6, (pb2 - wbytes) / 1e6, (wb2 + pb2 - wbytes) / 1e6);
                fflush(stdout);
                kcu_layer_destroy(l2);
            }
        }
        fflush(stdout);
        (void)free0;
        (void)free1;
        CK(cudaFree(x));
        CK(cudaFree(y));
        CK(cudaFree(dy));
        CK(cudaFree(dx));
        kcu_layer_destroy(l);
    }

    /* routing families: the DeepSeek-V3 layer (256 routed experts, d_model
     * 7168, d_ff 2048, top-8, and one shared expert of d_ff 2048) with its
     * routing - sigmoid scores, a choice bias, 8 groups of which 4 kept
     * (top-2 sums), renormalised, x2.5 - against plain softmax top-8 of the
     * same routed experts (no shared expert), same weights, same run. The
     * shared expert is a 257th: kcu_layer holds it apart (one kcu_experts
     * on all T rows, added in the combine). Then the family without the
     * shared expert (the routed part alone; made after the softmax layer is
     * freed: three 22.5 GB layers would not fit an H100). */
    for (int T : {4096, 64, 1}) {
        char tag[64];
        snprintf(tag, sizeof(tag), "dsv3-route:%d", T);
        if (quick || (only && !matches(only, tag)))
            continue;
        const int H = 7168, F = 2048, E = 256, K = 8;
        kcu_config cfg = {H, F, E, K, KERN_ACT_SWIGLU, 1, T, 0};
        kcu_route_config rc;
        memset(&rc, 0, sizeof(rc));
        rc.scoring = KERN_SCORE_SIGMOID;
        rc.n_group = 8;
        rc.topk_group = 4;
        rc.group_topn = 2;
        rc.route_scale = 2.5f;
        rc.shared_experts = 1; /* d_ff 2048 = F, no gate (DeepSeek-V3) */
        kcu_layer *lf, *ls;
        CKM(kcu_layer_create_ex(&cfg, &rc, &lf));
        CKM(kcu_layer_create(&cfg, &ls));
        if (!lf->sh) {
            fprintf(stderr, "dsv3-route: the shared expert is not held apart\n");
            exit(1);
        }
        fill(lf->wr, (size_t)lf->Ep * H, 11, -1.f / sqrtf(H), 1.f / sqrtf(H));
        fill(lf->w13, (size_t)E * lf->N1 * H, 12, -1.f / sqrtf(H), 1.f / sqrtf(H));
        fill(lf->w2, (size_t)E * H * F, 13, -1.f / sqrtf(F), 1.f / sqrtf(F));
        /* the shared expert's bf16 weights: w13 (1,N1,H), w2 (1,H,Fs) */
        const size_t Fs = (size_t)lf->sh->F;
        fill(lf->sh->w13, (size_t)lf->sh->N1 * H, 14, -1.f / sqrtf(H), 1.f / sqrtf(H));
        fill(lf->sh->w2, (size_t)H * Fs, 15, -1.f / sqrtf((float)Fs), 1.f / sqrtf((float)Fs));
        size_t pb, wb;
        kcu_layer_bytes(ls, &pb, &wb);
        CK(cudaMemcpy(ls->wr, lf->wr, (size_t)ls->Ep * H * 2, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(ls->w13, lf->w13, (size_t)E * ls->N1 * H * 2, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(ls->w2, lf->w2, (size_t)E * H * F * 2, cudaMemcpyDeviceToDevice));
        std::vector<float> bias(E);
        for (int e = 0; e < E; e++)
            bias[e] = 0.01f * (float)((e * 37) % 17 - 8);
        CKM(kcu_layer_upload_bias(lf, bias.data()));
        bf16 *x, *y;
        CK(cudaMalloc(&x, (size_t)T * H * 2));
        CK(cudaMalloc(&y, (size_t)T * H * 2));
        fill(x, (size_t)T * H, 21, -1.f, 1.f);
        const int reps = T >= 4096 ? 20 : 50;
        /* the path the family layer takes (the decode path up to T = 64 here) */
        const long long dec0 = kcu_decode_calls;
        CKM(kcu_forward(lf, T, x, MOE_BF16, y, MOE_BF16, 0, NULL));
        const char *path = kcu_decode_calls > dec0 ? "decode" : "general";
        const float f_full = median_ms(
            -WARM_MS, reps, [&] { CKM(kcu_forward(lf, T, x, MOE_BF16, y, MOE_BF16, 0, NULL)); });
        const float f_soft = median_ms(
            -WARM_MS, reps, [&] { CKM(kcu_forward(ls, T, x, MOE_BF16, y, MOE_BF16, 0, NULL)); });
        kcu_layer_destroy(ls);
        /* the routed part alone: the family without the shared expert */
        kcu_route_config rr = rc;
        rr.shared_experts = 0;
        kcu_layer *lr;
        CKM(kcu_layer_create_ex(&cfg, &rr, &lr));
        CK(cudaMemcpy(lr->wr, lf->wr, (size_t)lr->Ep * H * 2, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(lr->w13, lf->w13, (size_t)E * lr->N1 * H * 2, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(lr->w2, lf->w2, (size_t)E * H * F * 2, cudaMemcpyDeviceToDevice));
        CKM(kcu_layer_upload_bias(lr, bias.data()));
        const float f_fam = median_ms(
            -WARM_MS, reps, [&] { CKM(kcu_forward(lr, T, x, MOE_BF16, y, MOE_BF16, 0, NULL)); });
        const double fl = 2.0 * T * K * H * (2.0 * F + F) + 2.0 * T * H * E;
        const double fl_sh = 2.0 * T * H * (2.0 * Fs + Fs);
        printf("dsv3-route T=%d: DeepSeek-V3 layer (256 routed + 1 shared of d_ff %zu, top-8; "
               "%s path) %.3f ms (%.0f TFLOP/s); softmax top-8 of the routed experts %.3f ms (%.0f "
               "TFLOP/s); the family without the shared expert %.3f ms (%.0f TFLOP/s): routing "
               "family %+.1f%%, shared expert %+.3f ms\n",
               T, Fs, path, f_full, (fl + fl_sh) / (f_full * 1e-3) / 1e12, f_soft,
               fl / (f_soft * 1e-3) / 1e12, f_fam, fl / (f_fam * 1e-3) / 1e12,
               100.0 * (f_fam - f_soft) / f_soft, f_full - f_fam);
        fflush(stdout);
        CK(cudaFree(x));
        CK(cudaFree(y));
        kcu_layer_destroy(lf);
        kcu_layer_destroy(lr);
    }

    /* pipelined: the Qwen3 layer's inference forward of T = 16384 tokens
     * whose x and y (bf16) are in pinned host memory: kcu_forward with host
     * pointers (the 64 MiB in and out serialised with the compute) against
     * kcu_forward_pipelined in chunks (the copies overlapped), and the
     * kernels alone (device x, y). Each timing is a synchronous call
     * between two events on the default stream. */
    for (int T : {16384}) {
        char tag[64];
        snprintf(tag, sizeof(tag), "pipelined:%d", T);
        if (quick || (only && !matches(only, tag)))
            continue;
        const int H = 2048, F = 768, E = 128, K = 8;
        kcu_config cfg = {H, F, E, K, KERN_ACT_SWIGLU, 1, T, 0};
        kcu_layer *l;
        CKM(kcu_layer_create(&cfg, &l));
        fill(l->wr, (size_t)l->Ep * H, 11, -1.f / sqrtf(H), 1.f / sqrtf(H));
        fill(l->w13, (size_t)E * l->N1 * H, 12, -1.f / sqrtf(H), 1.f / sqrtf(H));
        fill(l->w2, (size_t)E * H * F, 13, -1.f / sqrtf(F), 1.f / sqrtf(F));
        const size_t n = (size_t)T * H;
        bf16 *xd, *yd;
        void *xh, *yh, *yh2;
        CK(cudaMalloc(&xd, n * 2));
        CK(cudaMalloc(&yd, n * 2));
        CK(cudaMallocHost(&xh, n * 2));
        CK(cudaMallocHost(&yh, n * 2));
        CK(cudaMallocHost(&yh2, n * 2));
        fill(xd, n, 21, -1.f, 1.f);
        CK(cudaMemcpy(xh, xd, n * 2, cudaMemcpyDeviceToHost));
        const int reps = 20;
        const float f_dev = median_ms(
            -WARM_MS, reps, [&] { CKM(kcu_forward(l, T, xd, MOE_BF16, yd, MOE_BF16, 0, NULL)); });
        const float f_host = median_ms(-WARM_MS, reps, [&] {
            CKM(kcu_forward(l, T, xh, MOE_BF16, yh, MOE_BF16, 0, NULL));
            CK(cudaStreamSynchronize(NULL)); /* y in host memory, as the pipelined call */
        });
        /* the one-call result, for the bits of the pipelined ones */
        CK(cudaDeviceSynchronize());
        printf("pipelined T=%d (Qwen3 layer H=%d F=%d E=%d K=%d, bf16 x, y in pinned host "
               "memory): kernels alone (device x, y) %.3f ms; kcu_forward with host x, y %.3f ms "
               "(%.2fx)\n",
               T, H, F, E, K, f_dev, f_host, f_host / f_dev);
        for (int chunk : {2048, 4096, 8192}) {
            memset(yh2, 0xff, n * 2);
            const float f_pipe = median_ms(-WARM_MS, reps, [&] {
                CKM(kcu_forward_pipelined(l, T, xh, MOE_BF16, yh2, MOE_BF16, chunk, NULL));
            });
            const int same = memcmp(yh, yh2, n * 2) == 0;
            size_t pb, wb;
            kcu_layer_bytes(l, &pb, &wb);
            printf("  kcu_forward_pipelined chunk %5d: %.3f ms (%.2fx the kernels alone, %.2fx "
                   "the one call's time); y %s; ws %.0f MB\n",
                   chunk, f_pipe, f_pipe / f_dev, f_pipe / f_host,
                   same ? "same bits" : "DIFFERS from one call", wb / 1e6);
        }
        fflush(stdout);
        CK(cudaFree(xd));
        CK(cudaFree(yd));
        CK(cudaFreeHost(xh));
        CK(cudaFreeHost(yh));
        CK(cudaFreeHost(yh2));
        kcu_layer_destroy(l);
    }

    /* experts only (the distributed path): one worker's share of 8 */
    struct xcase {
        const char *name;
        int N, H, F, ne;
    };
    const std::vector<xcase> xcases = {{"x-mixtral/8", 2048, 4096, 14336, 1},
                                       {"x-qwen3/8", 16384, 2048, 768, 16}};
    printf("%-12s %6s %5s %6s %4s | %9s %8s | %9s %8s\n", "experts", "N", "H", "F", "ne", "fwd ms",
           "TFLOP/s", "f+b ms", "TFLOP/s");
    for (size_t i = 0; i < (quick || only ? 0 : xcases.size()); i++) {
        const xcase &c = xcases[i];
        kcu_experts *ex;
        CKM(kcu_experts_create(c.H, c.F, c.ne, KERN_ACT_SWIGLU, c.N, 1, &ex));
        const size_t H = c.H, F = c.F;
        fill(ex->w13, (size_t)c.ne * ex->N1 * H, 31, -1.f / sqrtf(H), 1.f / sqrtf(H));
        fill(ex->w2, (size_t)c.ne * H * F, 32, -1.f / sqrtf(F), 1.f / sqrtf(F));
        std::vector<int32_t> counts(c.ne, c.N / c.ne);
        bf16 *x, *y, *dy, *dx;
        const size_t n = (size_t)c.N * H;
        CK(cudaMalloc(&x, n * 2));
        CK(cudaMalloc(&y, n * 2));
        CK(cudaMalloc(&dy, n * 2));
        CK(cudaMalloc(&dx, n * 2));
        fill(x, n, 33, -1.f, 1.f);
        fill(dy, n, 34, -1.f, 1.f);
        CK(cudaDeviceSynchronize());
        const float fwd = median_ms(-WARM_MS, 20, [&] {
            CKM(kcu_experts_forward(ex, c.N, x, MOE_BF16, counts.data(), y, MOE_BF16, 0, NULL));
        });
        const float fb = median_ms(-WARM_MS, 20, [&] {
            CKM(kcu_experts_zero_grads(ex, NULL));
            CKM(kcu_experts_forward(ex, c.N, x, MOE_BF16, counts.data(), y, MOE_BF16, 1, NULL));
            CKM(kcu_experts_backward(ex, dy, MOE_BF16, dx, MOE_BF16, NULL));
        });
        const double fl = 2.0 * c.N * H * (ex->N1 + F);
        printf("%-12s %6d %5d %6d %4d | %9.3f %8.0f | %9.3f %8.0f\n", c.name, c.N, c.H, c.F, c.ne,
               fwd, fl / (fwd * 1e-3) / 1e12, fb, 3 * fl / (fb * 1e-3) / 1e12);
        fflush(stdout);
        CK(cudaFree(x));
        CK(cudaFree(y));
        CK(cudaFree(dy));
        CK(cudaFree(dx));
        kcu_experts_destroy(ex);
    }
    return 0;
}
