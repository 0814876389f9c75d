/*
 * topk_bench.cu - the router's softmax/top-k for one token on one warp
 * (kcu_topk.cuh): the repeated arg-max (softmax_topk_nv) against the
 * butterfly merge (softmax_topk_bm).
 *
 * 1. Equality: both on 64k tokens of random logits per (E, K), a quarter of
 *    them quantised so that ties are common: probabilities, lse, indices and
 *    weights must match bit for bit (exit status 1 otherwise).
 * 2. Latency: one warp, one call per kernel launch (cold instruction cache,
 *    as in the decode kernels) and a second call in the same launch (warm),
 *    in SM clock cycles and ns (%globaltimer), median of 50 launches.
 *
 * Usage: bin/topk_bench
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/kcu_topk.cuh"
#include "kernels/cuda/kcu_tool.h"

template <int NV, int BM>
__device__ __forceinline__ void run(const float *lt, int E, int K, float (&v)[8], float &lse,
                                    int (&ik)[8], float (&wk)[8], float &ws)
{
    if (BM)
        kcu_topk::softmax_topk_bm<NV>(lt, E, K, v, lse, ik, wk, ws);
    else
        kcu_topk::softmax_topk_nv<NV>(lt, E, K, v, lse, ik, wk, ws);
}

/* one warp per token: both versions, any difference counted in *bad */
template <int NV> __global__ void k_equal(const float *lg, int T, int E, int K, unsigned *bad)
{
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T)
        return;
    float v0[8], v1[8], l0, l1, w0[8], w1[8], s0, s1;
    int i0[8], i1[8];
    run<NV, 0>(lg + (size_t)t * E, E, K, v0, l0, i0, w0, s0);
    run<NV, 1>(lg + (size_t)t * E, E, K, v1, l1, i1, w1, s1);
    bool same =
        __float_as_uint(l0) == __float_as_uint(l1) && __float_as_uint(s0) == __float_as_uint(s1);
    for (int j = 0; j < 8; j++)
        same = same && __float_as_uint(v0[j]) == __float_as_uint(v1[j]) && i0[j] == i1[j] &&
               __float_as_uint(w0[j]) == __float_as_uint(w1[j]);
    if (!same)
        atomicAdd(bad, 1u);
}

__device__ __forceinline__ unsigned long long gtime()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* one warp: a cold call and a warm call; cycles and ns of each in out[0..3] */
template <int NV, int BM>
__global__ void k_time(const float *lg, int E, int K, long long *out, int *sink)
{
    float v[8], lse, wk[8], ws;
    int ik[8];
    long long c0 = clock64();
    unsigned long long g0 = gtime();
    run<NV, BM>(lg, E, K, v, lse, ik, wk, ws);
    int acc = ik[K - 1];
    long long c1 = clock64();
    unsigned long long g1 = gtime();
    run<NV, BM>(lg + E + acc * 0, E, K, v, lse, ik, wk, ws);
    acc += ik[K - 1];
    long long c2 = clock64();
    unsigned long long g2 = gtime();
    if (threadIdx.x == 0) {
        out[0] = c1 - c0;
        out[1] = c2 - c1;
        out[2] = (long long)(g1 - g0);
        out[3] = (long long)(g2 - g1);
        *sink = acc;
    }
}

template <int NV>
void one(int E, int K, float *dlg, const std::vector<float> &lg, int T, int &fails)
{
    unsigned *dbad;
    long long *dout;
    int *dsink;
    CK(cudaMalloc(&dbad, 4));
    CK(cudaMalloc(&dout, 4 * 8));
    CK(cudaMalloc(&dsink, 4));
    CK(cudaMemcpy(dlg, lg.data(), lg.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dbad, 0, 4));
    k_equal<NV><<<(T + 7) / 8, 256>>>(dlg, T, E, K, dbad);
    CK(cudaGetLastError());
    unsigned bad = 0;
    CK(cudaMemcpy(&bad, dbad, 4, cudaMemcpyDeviceToHost));
    fails += bad != 0;
    long long med[2][4];
    for (int bm = 0; bm < 2; bm++) {
        std::vector<long long> r[4];
        for (int rep = 0; rep < 50; rep++) {
            if (bm)
                k_time<NV, 1><<<1, 32>>>(dlg, E, K, dout, dsink);
            else
                k_time<NV, 0><<<1, 32>>>(dlg, E, K, dout, dsink);
            CK(cudaGetLastError());
            long long h[4];
            CK(cudaMemcpy(h, dout, sizeof(h), cudaMemcpyDeviceToHost));
            for (int q = 0; q < 4; q++)
                r[q].push_back(h[q]);
        }
        for (int q = 0; q < 4; q++) {
            std::sort(r[q].begin(), r[q].end());
            med[bm][q] = r[q][r[q].size() / 2];
        }
    }
    printf("E %3d K %d | %s (%u of %d tokens differ) | arg-max cold %6lld cyc %6lld ns, warm %6lld "
           "cyc %6lld ns | merge cold %6lld cyc %6lld ns, warm %6lld cyc %6lld ns\n",
           E, K, bad ? "DIFFER" : "same", bad, T, med[0][0], med[0][2], med[0][1], med[0][3],
           med[1][0], med[1][2], med[1][1], med[1][3]);
    CK(cudaFree(dbad));
    CK(cudaFree(dout));
    CK(cudaFree(dsink));
}

int main()
{
    const int T = 65536, EMAX = 256;
    float *dlg;
    CK(cudaMalloc(&dlg, (size_t)T * EMAX * 4));
    srand(7);
    int fails = 0;
    const int cases[][2] = {{8, 1}, {8, 2}, {60, 4}, {64, 6}, {128, 8}, {128, 1}, {256, 8}};
    for (const auto &c : cases) {
        const int E = c[0], K = c[1];
        std::vector<float> lg((size_t)T * E);
        for (int t = 0; t < T; t++)
            for (int e = 0; e < E; e++) {
                float x = 8.f * ((float)rand() / RAND_MAX) - 4.f;
                if (t % 4 == 0) /* ties */
                    x = 0.25f * (float)(int)(x * 2.f);
                lg[(size_t)t * E + e] = x;
            }
        if (E <= 32)
            one<1>(E, K, dlg, lg, T, fails);
        else if (E <= 64)
            one<2>(E, K, dlg, lg, T, fails);
        else if (E <= 128)
            one<4>(E, K, dlg, lg, T, fails);
        else
            one<8>(E, K, dlg, lg, T, fails);
    }
    CK(cudaFree(dlg));
    printf("topk_bench: %s\n", fails ? "FAIL (the two top-k versions differ)" : "PASS");
    return fails ? 1 : 0;
}
