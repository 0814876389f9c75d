/*
 * tma_stream.cu - the ceiling of a bytes-bound expert GEMM's loads, and a
 * model of what its consumers cost it. One CTA per SM runs v10's stage ring
 * without math: thread 0 (the producer) streams every expert's weights by
 * TMA as v10's producer does (items of 256 output columns, boxes of 64 k x
 * 128 columns with the 128-byte swizzle, w = CTA, + grid), each stage also
 * taking 0, 128 or 192 of the expert's rows from L2 (v10's row boxes of 64);
 * thread 32 (the consumer) waits for each stage, spends c ns on it (its
 * "math"), releases the previous stage (as wg_wait<1> does) and pauses e ns
 * at each item's end (its "epilogue"). Table 1: c = e = 0, weights alone
 * and with rows, 3 / 4 / 6 stages - the ceiling. Table 2: 128 rows a stage,
 * 3 and 4 stages, c and e swept - which hold times and epilogue lengths
 * give a GEMM's measured time. Printed beside the device-to-device copy
 * bandwidth of the same run (read + write). bench/NOTES.md "v10 paired".
 * The barriers and loads are gemm/tma.cuh's, as in the GEMMs.
 *
 * Usage: bin/tma_stream [E N K ...]   (default: qwen235's up and down,
 *        128 3072 4096 and 128 4096 1536)
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/gemm/tma.cuh"
#include "kernels/cuda/kcu_tool.h"

namespace
{

constexpr int W_BOX = 128 * 64 * 2; /* a weight box: 128 columns x 64 k, bf16 */
constexpr int R_BOX = 64 * 64 * 2;  /* a row box: 64 rows x 64 k */
constexpr int COLS = 256;           /* output columns an item (v10's wide items) */
constexpr int SMEM = 227 * 1024;

__device__ __forceinline__ uint64_t global_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void spin_ns(int ns)
{
    const uint64_t t0 = global_ns();
    while (ns > 0 && global_ns() - t0 < (uint64_t)ns) {
    }
}

/* the producer (thread 0): item w = (expert w / (N / COLS), columns (w %
 * (N / COLS)) x COLS), K / 64 stages each of two weight boxes and nrb row
 * boxes (rows e x 128 + 64 b of the rows map), into a ring of `stages`;
 * the consumer (thread 32): c_ns a stage, the previous stage released after
 * it, e_ns at each item's end after the item's last release */
__global__ void __launch_bounds__(64)
    k_stream(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap rmap,
             int E, int N, int K, int stages, int nrb, int c_ns, int e_ns)
{
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023) & ~1023u;
    const int stage_bytes = 2 * W_BOX + nrb * R_BOX;
    const uint32_t full0 = base + stages * stage_bytes, empty0 = full0 + 8 * stages;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 1);
        }
        ws_bars_fence();
    }
    __syncthreads();
    const int per_e = N / COLS, total = E * per_e, ktiles = K / 64;
    uint32_t it = 0;
    if (threadIdx.x == 0) {
        for (int w = blockIdx.x; w < total; w += gridDim.x) {
            const int e = w / per_e, n0 = (w % per_e) * COLS;
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % stages;
                const uint32_t fb = full0 + 8 * s, dst = base + s * stage_bytes;
                mbar_wait(empty0 + 8 * s, ((it / stages) & 1) ^ 1);
                mbar_arrive_tx(fb, stage_bytes);
                for (int b = 0; b < 2; b++)
                    tma_3d(dst + b * W_BOX, &wmap, kt * 64, n0 + 128 * b, e, fb);
                for (int b = 0; b < nrb; b++)
                    tma_2d(dst + 2 * W_BOX + b * R_BOX, &rmap, kt * 64, e * 128 + 64 * b, fb);
            }
        }
    } else if (threadIdx.x == 32) {
        for (int w = blockIdx.x; w < total; w += gridDim.x) {
            for (int kt = 0; kt < ktiles; kt++, it++) {
                mbar_wait(full0 + 8 * (it % stages), (it / stages) & 1);
                spin_ns(c_ns);
                if (kt > 0)
                    mbar_arrive(empty0 + 8 * ((it + stages - 1) % stages));
            }
            mbar_arrive(empty0 + 8 * ((it + stages - 1) % stages));
            spin_ns(e_ns);
        }
    }
}

typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                              const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                              const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* a bf16 map of `rank` dims with the 128-byte swizzle and 256-byte L2
 * promotion (as dispatch.cu's maps) */
void encode(encode_fn f, CUtensorMap *m, void *p, int rank, const cuuint64_t *dim,
            const cuuint64_t *stride, const cuuint32_t *box)
{
    const cuuint32_t es[3] = {1, 1, 1};
    if (f(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, p, dim, stride, box, es,
          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        fprintf(stderr, "tma_stream: cuTensorMapEncodeTiled failed\n");
        exit(2);
    }
}

/* the best of `reps` timed runs of fn, in ms */
template <class F> float best_ms(int reps, F &&fn)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    float best = 1e30f;
    for (int r = 0; r < reps; r++) {
        CK(cudaEventRecord(a));
        fn();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        best = ms < best ? ms : best;
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return best;
}

} // namespace

int main(int argc, char **argv)
{
    int shapes[8][3] = {{128, 3072, 4096}, {128, 4096, 1536}}, nshape = 2;
    if (argc > 1) {
        nshape = 0;
        for (int i = 1; i + 2 < argc && nshape < 8; i += 3, nshape++)
            for (int j = 0; j < 3; j++)
                shapes[nshape][j] = atoi(argv[i + j]);
    }
    size_t wmax = 0;
    for (int i = 0; i < nshape; i++) {
        const int E = shapes[i][0], N = shapes[i][1], K = shapes[i][2];
        if (E < 1 || N < COLS || N % COLS || K < 64 || K % 64) {
            fprintf(stderr, "tma_stream: E N K need N a multiple of %d and K of 64\n", COLS);
            return 1;
        }
        const size_t w = (size_t)E * N * K * 2;
        wmax = w > wmax ? w : wmax;
    }
    encode_fn enc = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void **)&enc, 12000,
                                        cudaEnableDefault, &q));
    if (!enc) {
        fprintf(stderr, "tma_stream: no cuTensorMapEncodeTiled\n");
        return 2;
    }
    int dev = 0, nsm = 0;
    cudaDeviceProp prop;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    if (prop.major < 9) {
        fprintf(stderr, "tma_stream: needs sm_90 (TMA), found %s\n", prop.name);
        return 2;
    }
    void *w = nullptr, *w2 = nullptr, *rows = nullptr;
    CK(cudaMalloc(&w, wmax));
    CK(cudaMalloc(&w2, wmax));
    CK(cudaMemset(w, 1, wmax));
    /* the rows: 128 of them per expert, as at qwen235 T=2048 (top 8 of 128) */
    int emax = 0, kmax = 0;
    for (int i = 0; i < nshape; i++) {
        emax = shapes[i][0] > emax ? shapes[i][0] : emax;
        kmax = shapes[i][2] > kmax ? shapes[i][2] : kmax;
    }
    const size_t rbytes = (size_t)emax * 128 * kmax * 2;
    CK(cudaMalloc(&rows, rbytes));
    CK(cudaMemset(rows, 1, rbytes));
    CK(cudaFuncSetAttribute(k_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));

    /* warm up to sustained clocks (about a second of copies), then the copy */
    for (int i = 0; i < 200; i++)
        CK(cudaMemcpyAsync(w2, w, wmax, cudaMemcpyDeviceToDevice));
    CK(cudaDeviceSynchronize());
    const float cms =
        best_ms(5, [&] { CK(cudaMemcpyAsync(w2, w, wmax, cudaMemcpyDeviceToDevice)); });
    const double copy = 2.0 * wmax / cms / 1e6;
    printf("device %s, %d SMs: D2D copy %.0f GB/s (read + write, %.0f MB)\n", prop.name, nsm, copy,
           wmax / 1e6);

    /* table 1: the ceiling (stages, row boxes); table 2: the consumer model
     * (stages, c ns, e ns) at 2 row boxes */
    const int ceil_cfg[][2] = {{3, 0}, {4, 0}, {6, 0}, {3, 2}, {4, 2}, {3, 3}, {4, 3}};
    const int model_cfg[][3] = {{3, 650, 0},    {3, 650, 2000}, {3, 650, 4000}, {3, 650, 8000},
                                {3, 900, 0},    {3, 900, 2000}, {3, 900, 4000}, {4, 650, 0},
                                {4, 650, 2000}, {4, 650, 4000}, {4, 650, 8000}};
    const int n_ceil = (int)(sizeof(ceil_cfg) / sizeof(ceil_cfg[0]));
    const int n_model = (int)(sizeof(model_cfg) / sizeof(model_cfg[0]));
    for (int i = 0; i < nshape; i++) {
        const int E = shapes[i][0], N = shapes[i][1], K = shapes[i][2];
        const size_t bytes = (size_t)E * N * K * 2;
        CUtensorMap wm, rm;
        const cuuint64_t wdim[3] = {(cuuint64_t)K, (cuuint64_t)N, (cuuint64_t)E},
                         wstr[2] = {(cuuint64_t)K * 2, (cuuint64_t)N * K * 2};
        const cuuint32_t wbox[3] = {64, 128, 1};
        encode(enc, &wm, w, 3, wdim, wstr, wbox);
        const cuuint64_t rdim[2] = {(cuuint64_t)K, (cuuint64_t)E * 128},
                         rstr[1] = {(cuuint64_t)K * 2};
        const cuuint32_t rbox[2] = {64, 64};
        encode(enc, &rm, rows, 2, rdim, rstr, rbox);
        for (int c = 0; c < n_ceil + n_model; c++) {
            const bool model = c >= n_ceil;
            const int stages = model ? model_cfg[c - n_ceil][0] : ceil_cfg[c][0];
            const int nrb = model ? 2 : ceil_cfg[c][1];
            const int c_ns = model ? model_cfg[c - n_ceil][1] : 0;
            const int e_ns = model ? model_cfg[c - n_ceil][2] : 0;
            if (stages * (2 * W_BOX + nrb * R_BOX) + 1024 + 16 * stages > SMEM)
                continue;
            const float ms = best_ms(5, [&] {
                k_stream<<<nsm, 64, SMEM>>>(wm, rm, E, N, K, stages, nrb, c_ns, e_ns);
                CK(cudaGetLastError());
            });
            const double gbs = bytes / ms / 1e6;
            if (model)
                printf("E=%d N=%d K=%d: %d stages, 128 rows, consumer %4d ns a stage, %4d ns an "
                       "item's end: %.3f ms, %.0f%% of copy\n",
                       E, N, K, stages, c_ns, e_ns, ms, 100.0 * gbs / copy);
            else
                printf("E=%d N=%d K=%d: %d stages, weights + %3d rows a stage: %.3f ms, weights "
                       "at %.0f GB/s = %.0f%% of copy\n",
                       E, N, K, stages, 64 * nrb, ms, gbs, 100.0 * gbs / copy);
        }
    }
    CK(cudaFree(w));
    CK(cudaFree(w2));
    CK(cudaFree(rows));
    return 0;
}
