/*
 * kcu_ep_dedup.cu - the layout kernels of kcu_ep's deduplicated dispatch
 * (kcu_ep_dedup.cuh for the layouts, kcu_ep.cu for the call sequence).
 * Every position is computed from counts and stable orders (no atomics but
 * on integer counts), so the same routing gives the same layout.
 */
#include "kernels/cuda/kcu_ep_dedup.cuh"

namespace
{

const unsigned FULL = 0xffffffffu;
enum { EPD_NT = 256, EPD_MAX_W = 64 };

/* common/placement.h on the device: rank q's first expert, the owner of e */
__device__ __forceinline__ int epd_first(int E, int W, int q)
{
    return (int)(((long long)E * q) / W);
}
__device__ __forceinline__ int epd_owner(int E, int W, int e)
{
    int r = (int)(((long long)e * W) / E);
    while (r + 1 < W && epd_first(E, W, r + 1) <= e)
        r++;
    while (r > 0 && epd_first(E, W, r) > e)
        r--;
    return r;
}

/* the part (slice or chunk) of token t when T tokens are cut into n parts
 * [floor(pT/n), floor((p+1)T/n)): the largest p with floor(pT/n) <= t */
__device__ __forceinline__ int epd_part(int t, int T, int n)
{
    return (int)(((long long)(t + 1) * n - 1) / T);
}

/* one thread per token: the counts block (slots per (slice, expert), unique
 * rows per (slice, destination)), the token's destination mask and the
 * block's tokens per destination */
__global__ void k_epd_count(const int32_t *__restrict__ idx, int T, int K, int E, int W, int P,
                            int32_t *__restrict__ cnt, uint64_t *__restrict__ mask,
                            int32_t *__restrict__ bcnt)
{
    __shared__ int32_t bc[EPD_MAX_W];
    for (int q = threadIdx.x; q < W; q += blockDim.x)
        bc[q] = 0;
    __syncthreads();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) {
        const int s = epd_part(t, T, P);
        uint64_t m = 0;
        for (int k = 0; k < K; k++) {
            const int e = idx[(size_t)t * K + k];
            atomicAdd(&cnt[s * E + e], 1);
            m |= 1ull << epd_owner(E, W, e);
        }
        mask[t] = m;
        for (uint64_t b = m; b; b &= b - 1) {
            const int q = __ffsll((long long)b) - 1;
            atomicAdd(&cnt[P * E + s * W + q], 1);
            atomicAdd(&bc[q], 1);
        }
    }
    __syncthreads();
    for (int q = threadIdx.x; q < W; q += blockDim.x)
        bcnt[blockIdx.x * W + q] = bc[q];
}

/* one thread per destination q: bcnt (nblk,W) -> exclusive prefix over the
 * blocks */
__global__ void k_epd_scan(int nblk, int W, int32_t *__restrict__ bcnt)
{
    const int q = threadIdx.x;
    if (q >= W)
        return;
    int32_t run = 0;
    for (int b = 0; b < nblk; b++) {
        const int32_t v = bcnt[b * W + q];
        bcnt[b * W + q] = run;
        run += v;
    }
}

/* one thread per token, blocks of EPD_NT tokens: urank[t, q] = tokens on q
 * before t (the block's prefix from bcnt, then the block-local rank) */
__global__ void k_epd_rank(const uint64_t *__restrict__ mask, int T, int W,
                           const int32_t *__restrict__ bcnt, int32_t *__restrict__ urank)
{
    __shared__ int32_t wsum[EPD_NT / 32];
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint64_t m = t < T ? mask[t] : 0;
    for (int q = 0; q < W; q++) {
        const int f = (int)((m >> q) & 1);
        const unsigned bal = __ballot_sync(FULL, f);
        if (lane == 0)
            wsum[warp] = __popc(bal);
        __syncthreads();
        if (f) {
            int32_t pre = bcnt[blockIdx.x * W + q] + __popc(bal & ((1u << lane) - 1u));
            for (int w = 0; w < warp; w++)
                pre += wsum[w];
            urank[(size_t)t * W + q] = pre;
        }
        __syncthreads();
    }
}

/* one thread per sorted row r (slot s = perm[r] of token t, expert e, chunk
 * c): the slot's return row. The layout is stable, so expert e's rows of
 * chunk c are the contiguous sorted rows offs[e] + cpre[c,e] + j */
__global__ void k_epd_sendpos(const int32_t *__restrict__ perm, const int32_t *__restrict__ offs,
                              const int32_t *__restrict__ idx, int S, int T, int K, int E, int C,
                              const int32_t *__restrict__ ctab, const int32_t *__restrict__ cpre,
                              int32_t *__restrict__ sendpos)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= S)
        return;
    const int s = perm[r], e = idx[s], c = epd_part(s / K, T, C);
    const int j = r - offs[e] - cpre[c * E + e];
    sendpos[s] = ctab[c * E + e] + j;
}

/* one warp per token t of chunk c: for each destination q of t, its unique
 * row u (x[t] and the K metadata entries) */
__global__ void k_epd_pack(const bf16 *__restrict__ x, const int32_t *__restrict__ idx,
                           const uint64_t *__restrict__ mask, const int32_t *__restrict__ urank,
                           const int32_t *__restrict__ sendpos, int T, int K, int E, int W, int H,
                           int C, const int32_t *__restrict__ ctab,
                           const int32_t *__restrict__ utab, const int32_t *__restrict__ upre,
                           bf16 *__restrict__ xsend, int32_t *__restrict__ msend)
{
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T)
        return;
    const int c = epd_part(t, T, C);
    const uint4 *src = reinterpret_cast<const uint4 *>(x + (size_t)t * H);
    for (uint64_t b = mask[t]; b; b &= b - 1) {
        const int q = __ffsll((long long)b) - 1;
        const int64_t u = (int64_t)utab[c * W + q] + urank[(size_t)t * W + q] - upre[c * W + q];
        uint4 *dst = reinterpret_cast<uint4 *>(xsend + (size_t)u * H);
        for (int i = lane; i < H / 8; i += 32)
            dst[i] = src[i];
        if (lane < K) {
            const int s = t * K + lane, e = idx[s];
            int32_t v = -1;
            if (epd_owner(E, W, e) == q) {
                const int32_t j = sendpos[s] - ctab[c * E + e];
                v = ((e - epd_first(E, W, q)) << 24) | j;
            }
            msend[u * K + lane] = v;
        }
    }
}

/* grid (rows, W): one thread per metadata entry of the unique rows received
 * from source q in this chunk: the GEMM row of each slot on this rank gets
 * its input row (gidx) and its return row (sidx); training (wgx non-NULL):
 * its global expert-major row G (wbase) gets the same input row (wgx), its
 * activation row (wgh) and its return row (wgy) */
__global__ void k_epd_index(const int32_t *__restrict__ mrecv, int K, int ne, int rb,
                            const int32_t *__restrict__ ur0, const int32_t *__restrict__ urn,
                            const int32_t *__restrict__ goff, const int32_t *__restrict__ roff,
                            const int32_t *__restrict__ wbase, int32_t *__restrict__ gidx,
                            int32_t *__restrict__ sidx, int32_t *__restrict__ wgx,
                            int32_t *__restrict__ wgh, int32_t *__restrict__ wgy)
{
    const int q = blockIdx.y;
    const int64_t n = (int64_t)urn[q] * K, k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n)
        return;
    const int32_t v = mrecv[(int64_t)ur0[q] * K + k];
    if (v < 0)
        return;
    const int i = v >> 24, j = v & 0xffffff;
    const int g = goff[q * ne + i] + j;
    const int32_t x = (int32_t)(ur0[q] + k / K), y = rb + roff[q * ne + i] + j;
    gidx[rb + g] = x;
    sidx[rb + g] = y;
    if (wgx) {
        const int G = wbase[q * ne + i] + j;
        wgx[G] = x;
        wgh[G] = rb + g;
        wgy[G] = y;
    }
}

} // namespace

moe_err kcu_epd_count(const int32_t *topk_idx, int T, int K, int E, int W, int P, int32_t *cnt,
                      uint64_t *mask, int32_t *bcnt, cudaStream_t st)
{
    if (W > EPD_MAX_W)
        return MOE_EINVAL;
    KCU_CHECK(cudaMemsetAsync(cnt, 0, (size_t)P * (E + W) * 4, st));
    if (T == 0)
        return MOE_OK;
    k_epd_count<<<KCU_CEIL_DIV(T, EPD_NT), EPD_NT, 0, st>>>(topk_idx, T, K, E, W, P, cnt, mask,
                                                            bcnt);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_epd_rank(const uint64_t *mask, int T, int W, int32_t *bcnt, int32_t *urank,
                     cudaStream_t st)
{
    if (T == 0)
        return MOE_OK;
    const int nblk = KCU_CEIL_DIV(T, EPD_NT);
    k_epd_scan<<<1, EPD_MAX_W, 0, st>>>(nblk, W, bcnt);
    KCU_CHECK_LAUNCH();
    k_epd_rank<<<nblk, EPD_NT, 0, st>>>(mask, T, W, bcnt, urank);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_epd_pack(const bf16 *x, const int32_t *perm, const int32_t *offs,
                     const int32_t *topk_idx, const uint64_t *mask, const int32_t *urank, int T,
                     int K, int E, int W, int H, int C, const int32_t *ctab, const int32_t *cpre,
                     const int32_t *utab, const int32_t *upre, int32_t *sendpos, bf16 *xsend,
                     int32_t *msend, cudaStream_t st)
{
    const int S = T * K;
    if (S == 0)
        return MOE_OK;
    k_epd_sendpos<<<KCU_CEIL_DIV(S, EPD_NT), EPD_NT, 0, st>>>(perm, offs, topk_idx, S, T, K, E, C,
                                                              ctab, cpre, sendpos);
    KCU_CHECK_LAUNCH();
    k_epd_pack<<<KCU_CEIL_DIV(T, EPD_NT / 32), EPD_NT, 0, st>>>(
        x, topk_idx, mask, urank, sendpos, T, K, E, W, H, C, ctab, utab, upre, xsend, msend);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

moe_err kcu_epd_index(const int32_t *mrecv, int K, int W, int ne, int rb, const int32_t *ur0,
                      const int32_t *urn, int max_urn, const int32_t *goff, const int32_t *roff,
                      const int32_t *wbase, int32_t *gidx, int32_t *sidx, int32_t *wgx,
                      int32_t *wgh, int32_t *wgy, cudaStream_t st)
{
    if (max_urn == 0)
        return MOE_OK;
    const dim3 grid((unsigned)KCU_CEIL_DIV((int64_t)max_urn * K, (int64_t)EPD_NT), (unsigned)W);
    k_epd_index<<<grid, EPD_NT, 0, st>>>(mrecv, K, ne, rb, ur0, urn, goff, roff, wbase, gidx, sidx,
                                         wgx, wgh, wgy);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}
