/*
 * kcu_ep.cu - one MoE layer with expert parallelism over NCCL, every row on
 * the device (see kcu_ep.h for the contract).
 *
 * Token side (every rank, T tokens, S = T*K slots):
 *   router GEMM, softmax/top-k, layout sorted by expert (kcu_route on a
 *   "router view" kcu_layer that carries only the router buffers);
 *   send buffer xsend (S,H): chunk-major, then expert (= owner-major, the
 *   experts being contiguous per owner), then the expert's rows in slot
 *   order; sendpos (S) slot -> send row.
 * Owner side (rows received, N in all):
 *   chunk c's rows arrive source-major then expert (recv layout, region
 *   [rbase[c], rbase[c+1])); the GEMMs walk them expert-major through
 *   gidx (expert-major row -> recv row): the up-projection gathers through
 *   it and the down-projection scatters its output back into the recv
 *   layout (ysend), which is sent back as it is: the token side receives
 *   its own send layout (yrecv) and combines through sendpos. Where d_ff is
 *   large (kcu_sorted_mode) the rows are first copied into expert order
 *   (kcu_gather_rows, into the chunk's ysend region, or kept in xg when
 *   training; dy rows into its dxsend region) so the up-projection and dh
 *   stream dense tiles; with one chunk the activation order is the global
 *   expert order and the weight gradients read dense rows too (dW2 then runs
 *   right after dh, while the sorted dy rows are in dxsend).
 * Routing families (kcu_ep.h): the router view carries the family
 * (kcu_route_config without its shared experts, the bias, the gate row E
 * of wr) and kcu_route runs k_route_family on it, K routed slots a token.
 * Shared expert: a kcu_experts (sh) of one expert of d_ff m*F on this
 * rank's T tokens (rows = xb, no exchange), run on the compute stream while
 * the dispatch flies; its output ys (T,H) joins the combine after the
 * routed slots, times sigmoid(logits[t, E]) with a gate.
 * Deduplicated dispatch (c.dedup or KCU_EP_DEDUP: 1 inference forwards, 2
 *   training ones too; kcu_ep.h): each (token, destination) row sent once
 *   with its K int32 of metadata, chunks cut by token; the owner's gidx /
 *   sidx (and wgx, wgh, wgy when training) come from the metadata
 *   (kcu_ep_dedup.cu); the return, the combine and the backward's transfers
 *   follow the return layout (see "deduplicated dispatch" below for the
 *   layouts).
 * Training keeps xrecv, ab, h (owner) and xs, yrecv, routing (token side);
 * backward sends bf16(w*dy) along the forward's paths (xsend -> ysend),
 * runs dh and dx per chunk, returns dx rows (dxsend -> yrecv), and runs the
 * weight gradients over all chunks at once (wgx, wgh: global expert-major
 * row -> recv row / activation row).
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <type_traits>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cuda.h>
#include <nccl.h>

#include "kernels/cuda/kcu_abort.h"
#include "kernels/cuda/kcu_ep.h"
#include "kernels/cuda/kcu_ep_dedup.cuh"
#include "kernels/cuda/kcu_ffn.cuh"
#include "common/ep_env.h"
#include "common/placement.h"
#include "common/step_trace.h"
#include "base/bf16.h"

/* the worker's "give up on this generation" check (kcu_ep.h) */
extern "C" int (*kcu_ep_abort_hook)(void) = nullptr;

/* EP_CHUNK_ROWS / EP_CHUNK_ROWS_TRAIN: routed rows per rank from which
 * kcu_ep_auto_chunks overlaps (4 chunks) on more than 2 GPUs, in an
 * inference forward and in a training forward (whose backward runs the same
 * chunks). Measured on 4x H200, Qwen3 shape (bench/NOTES.md "The overlap
 * threshold on 4 GPUs"), 4 chunks against 1 at 32768 / 49152 / 65536 /
 * 98304 / 131072 rows per rank: forward +4 / -2 / -8 / -11 / -25%, fwd+bwd
 * +9 / +5 / +1 / -1 / -11%: the forward gains from 49152 on, training from
 * 98304 on. */
enum { EP_MAX_CHUNKS = 8, EP_MAX_WORLD = 64, EP_CHUNK_ROWS = 49152, EP_CHUNK_ROWS_TRAIN = 98304 };

/* NCCL entry points of the copy-engine exchange, looked up at run time
 * (dlsym) so that the library runs where NCCL lacks them: ncclAlltoAll
 * (2.28), ncclCommWindowRegister / Deregister (2.27), ncclMemAlloc /
 * ncclMemFree (2.19) */
struct ep_ce_fns {
    ncclResult_t (*mem_alloc)(void **, size_t);
    ncclResult_t (*mem_free)(void *);
    ncclResult_t (*win_reg)(ncclComm_t, void *, size_t, ncclWindow_t *, int);
    ncclResult_t (*win_dereg)(ncclComm_t, ncclWindow_t);
    ncclResult_t (*a2a)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
};

/* the padded slots of a CE forward (ce_slots; the same on every rank):
 * chunk c's dispatch slot S[c] rows per (source, destination) pair, its
 * return slot R[c] rows per (owner, source) pair; the dispatch region of
 * chunk c starts at row D[c] = W sum_{c'<c} S[c'] of xsend / xrecv (peer
 * q's slot at D[c] + q S[c]), the return region at B[c] = W sum R[c'] of
 * ysend / yrecv (peer q's slot at B[c] + q R[c]) */
struct ep_ce_slots {
    int64_t S[EP_MAX_CHUNKS], R[EP_MAX_CHUNKS], D[EP_MAX_CHUNKS + 1], B[EP_MAX_CHUNKS + 1];
    int64_t real, padded; /* rows over all ranks: sent for real, moved with padding */
};

/* the state of one borrowed communicator shared by every kcu_ep on it (the
 * layers of one worker; world > 1): the exchange communicator (kcu_ep.h
 * "The exchange communicator") and its watchdog, and the copy-engine state
 * (kcu_ep.h "Copy-engine exchange"): one CE communicator, one pair of
 * windows, grown to what the largest layer needs. Found by parent in ce_list under ce_mu and
 * refcounted by the kcu_ep holding it (kcu_ep_create / kcu_ep_destroy);
 * the rest is used by one thread at a time (a worker's layers run one at a
 * time on its compute thread), but the GPU work of consecutive layers
 * overlaps: ev_free orders the windows' reuse (ce_plan, ce_windows_done). */
struct ep_watch;
struct ce_flags;

struct ep_ce_shared {
    ep_ce_shared *next; /* ce_list, while linked */
    ncclComm_t parent;  /* the borrowed communicator (the key; not owned) */
    int refs;           /* kcu_ep holding it (under ce_mu) */
    int linked;         /* in ce_list (under ce_mu): unlinked once failed */
    int state;          /* 0 not set up yet, 1 ready, -1 unavailable: every layer
                         * takes the send/recv path */
    ep_ce_fns fn;       /* NCCL symbols newer than 2.27, by dlsym */
    ncclComm_t comm;    /* the CE communicator over parent's ranks, CTAPolicy ZERO,
                         * blocking (owned; ce_create), or NULL (not set up, or
                         * aborted) */
    /* the exchange communicator (KCU_EP_BLOCKING, on unless 0; kcu_ep.h
     * "The exchange communicator"): a blocking twin of parent over its
     * ranks that every NCCL call of the layers on parent takes once set up
     * (fast_setup, at the first forward of any of them) */
    int fast_state;      /* 0 not set up, 1 up, -1 unavailable (the layers use
                          * parent), -2 failed (every call fails: the
                          * generation is over) */
    ncclComm_t fast;     /* blocking, default CTA policy (owned), or NULL */
    ep_watch *watch;     /* the watchdog of blocking calls (a reference), or NULL */
    void *buf[2];        /* ncclMemAlloc: [0] token side, [1] owner side */
    ncclWindow_t win[2]; /* their symmetric windows on comm */
    size_t bytes;        /* bytes of each */
    int64_t capx, capy;  /* padded dispatch / return rows they hold */
    unsigned gen;        /* bumped by each growth (the buffers move) */
    cudaEvent_t ev_free; /* recorded after the last CE forward's last use of the
                          * windows (any layer's); ev_used once recorded */
    int ev_used;
    const kcu_ep *acct; /* the layer whose kcu_ep_bytes counts the windows (once):
                         * the one that set up, else the next to take the CE path */
    /* the copy-engine transport (kcu_ep.h "Copy-engine exchange"): 1 = this
     * library's (ce_ipc_*: the windows are cudaMalloc buffers every rank maps
     * (CUDA IPC), the copies cudaMemcpyAsync, the handshake stream memory
     * operations on a page of host flags every rank maps, which a host store
     * releases), 0 = NCCL's CE collectives over symmetric windows */
    int ipc;
    int world, rank, device;
    void **peer[2];              /* ipc: rank q's buf[i] mapped here ([rank] = buf[i]);
                                  * W pointers each (owned arrays) */
    int peer_open[EP_MAX_WORLD]; /* ipc: bit i when peer[i][q] came from
                                  * cudaIpcOpenMemHandle (to be closed) */
    ce_flags *flags;             /* ipc: the flag page (a reference), or NULL */
    uint64_t seq;                /* ipc: the last handshake's number (the same on every
                                  * rank: the calls run in lockstep) */
};

enum { EP_LOC_GRAPHS = 16 }; /* the fan-out's decode chains kept as graphs: T = 1..16 */

/* one train state (kcu_ep.h "Train states"): a forward's token-side
 * workspace, its owner-side buffers and its plan (the host fields of
 * EP_PLAN_FIELDS, saved as bytes); the selected state's are the struct's
 * own fields, saved here when another is selected */
enum { EP_PLAN_BYTES = 20480 };
struct ep_state {
    void *tws; /* this state's part of the token side (owned) */
    void *ows; /* owner side (owned), grown on demand by ep_grow */
    size_t ows_bytes, cap_rows, cap_tbl;
    int32_t *tbl_h; /* pinned (owned) */
    unsigned char plan[EP_PLAN_BYTES];
};

struct kcu_ep {
    kcu_ep_config c;
    ncclComm_t comm; /* borrowed */
    cudaStream_t cs; /* communication stream (owned) */
    int nsm, first, ne, N1;
    kcu_layer R; /* router view: only the router / routing fields are set */
    void *tws;   /* token-side allocation */
    size_t tws_bytes;
    kcu_experts *ex;  /* local experts: weights, gradients, AdamW state */
    kcu_experts *sh;  /* shared expert (one expert of d_ff m*F, replicated), or NULL */
    int gate;         /* the shared output is gated: sigmoid(logits[t, E]), wr row E = wsg */
    bf16 *sy;         /* (T_max,H) shared expert output ys (kept for the gate's gradient),
                       * then its dx rows in the backward; NULL without shared experts */
    bf16 *xsend;      /* (S_max,H) dispatch rows, then bf16(w dy) rows */
    bf16 *yrecv;      /* (S_max,H) expert outputs back, then dx rows back */
    bf16 *dyb;        /* (T_max,H) staged dy (train) */
    int32_t *sendpos; /* (S_max) slot -> send row */
    int32_t *tab;     /* (C*E) send row of (chunk, expert)'s first row */
    int32_t *cnt_all; /* (W*E) every rank's counts (allgather) */
    int32_t *cnt_h;   /* (W*E) pinned mirror */
    void *ows;        /* owner-side allocation, grown on demand */
    size_t ows_bytes, cap_rows, cap_tbl;
    bf16 *xrecv, *ysend, *h, *ab, *dxsend; /* (N,H) (N,H) (N,F) (N,N1) (N,H) */
    bf16 *xg; /* (N,H) received rows in activation order, kept for dW13 (sorted, train) */
    int32_t *gidx, *wgx, *wgh; /* (N) each */
    int32_t *tbl_d, *tbl_h;    /* per-call tables (device, pinned host) */
    int chunks_auto; /* overlap degree chosen per forward from the global rows (chunks 0) */
    int sorted;      /* owner GEMMs on sorted copies of the received rows (kcu_sorted_mode > 0) */
    int dw2_done;    /* this backward's dW2 already ran inside the pipeline */
    cudaEvent_t ev_a, ev_cnt, ev_done, ev_disp[EP_MAX_CHUNKS], ev_comp[EP_MAX_CHUNKS];
    /* the last call */
    int T, T_fwd, C; /* C: chunks of the last forward */
    int stat_rows;   /* rows of R.statpart the last routing wrote (kcu_ep_stats) */
    int rgrads_clean;
    int T_global;
    int64_t N;
    int32_t counts_local[256], counts_global[256];
    int64_t send_rows[EP_MAX_CHUNKS][EP_MAX_WORLD], recv_rows[EP_MAX_CHUNKS][EP_MAX_WORLD];
    int64_t sbase[EP_MAX_CHUNKS + 1], rbase[EP_MAX_CHUNKS + 1];
    int tiles[EP_MAX_CHUNKS], tbase[EP_MAX_CHUNKS];
    /* offsets (int32 elements) of the parts of the table */
    int t_offs, t_goffs, t_ntiles, t_rbase, t_te, t_tr, t_len;
    /* deduplicated dispatch (kcu_ep.h "Deduplicated dispatch"; the layouts
     * in kcu_ep_dedup.cuh). Buffers made at create when c.dedup or
     * KCU_EP_DEDUP is 1 or 2 (and world > 1); NULL otherwise. */
    int dedup;             /* 1: inference forwards dedup their dispatch, 2: train ones too */
    int dd;                /* the last forward did */
    int P;                 /* slices of the last dedup forward's counts blocks */
    int32_t *dcnt;         /* (EP_MAX_CHUNKS*(E+W)) this rank's counts block */
    uint64_t *umask;       /* (T_max) destination ranks of each token */
    int32_t *urank;        /* (T_max,W) rank of the token among those on q */
    int32_t *ubcnt;        /* (ceil(T_max/256),W) per-block tokens on q, then prefix */
    int32_t *msend;        /* (T_max*min(W,K),K) metadata of the unique send rows */
    int32_t *mrecv, *sidx; /* owner: (N,K) received metadata, (N) GEMM row -> return row */
    int32_t *wgy;          /* owner, train: (N) global expert-major row -> return row */
    /* unique rows per (chunk, peer) sent and received, their bases; the
     * largest count received from one source per chunk */
    int64_t usend[EP_MAX_CHUNKS][EP_MAX_WORLD], urecv[EP_MAX_CHUNKS][EP_MAX_WORLD];
    int64_t usbase[EP_MAX_CHUNKS + 1], urbase[EP_MAX_CHUNKS + 1];
    int max_urn[EP_MAX_CHUNKS];
    /* the dedup tables after t_tr's (kcu_ep_dedup.cuh): token side ctab,
     * cpre (C,E), utab, upre (C,W); owner ur0, urn (C,W), goff, roff (C,W,ne) */
    int t_ctab, t_cpre, t_utab, t_upre, t_ur0, t_urn, t_goff, t_roff;
    int t_wbase; /* (C,W,ne) global expert-major row of (chunk, source, expert) (train) */
    /* the exchange buffers a forward binds (ep_bind): the send/recv path's
     * (xsend, yrecv, msend in tws; xrecv, ysend, mrecv in ows, set by
     * ep_grow) or the copy-engine windows' */
    bf16 *xsend_t, *yrecv_t, *xrecv_o, *ysend_o;
    int32_t *msend_t, *mrecv_o;
    /* copy-engine exchange (KCU_EP_CE, on unless 0; kcu_ep.h "Copy-engine exchange") */
    int ce_want;                /* KCU_EP_CE not 0 at create, world > 1, dedup on */
    int ce_fwd;                 /* the last forward took the CE path */
    int64_t ce_n[2];            /* inference dedup forwards on the CE path, fallen back */
    ep_ce_shared *ce;           /* the CE state of comm, shared by its layers (a reference),
                                 * or NULL without ce_want */
    unsigned ce_gen;            /* ce->gen when the last CE forward bound the windows */
    int32_t *agree_d, *agree_h; /* one int32 for ep_agree (device, pinned) */
    /* the fan-out forward (kcu_ep_forward_local): pinned mirror of counts,
     * topk_w, perm and the shared gate's logits, grown on demand */
    void *loc_h, *loc_d; /* loc_d: its device-visible address (mapped) */
    size_t loc_bytes;
    bf16 *loc_hd; /* (S,F) the decode chain's h (kcu_decode_local), grown on demand */
    size_t loc_hd_bytes;
    /* the decode chain as a CUDA graph per T <= EP_LOC_GRAPHS (KCU_LOCAL_GRAPH):
     * captured on loc_st at a T's second call, valid while loc_gen (bumped
     * when the mirror or loc_hd move) is the one it was captured under */
    cudaStream_t loc_st;
    unsigned loc_gen;
    struct {
        cudaGraphExec_t exec;
        unsigned gen;
        int calls, bad;
    } loc_g[EP_LOC_GRAPHS + 1];
    ep_ce_slots cs_; /* the last CE forward's padded slots */
    /* train states (kcu_ep.h "Train states"): nstates of them, cur selected;
     * tws above is the part the states share (weights, gradients, scratch) */
    int nstates, cur;
    size_t tws_state_bytes;
    ep_state st[KCU_EP_MAX_STATES];
};

namespace
{

size_t al(size_t b)
{
    return (b + 255) & ~(size_t)255;
}

int64_t now_ms()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* rows of an expert with n rows that fall in chunk c of C */
__host__ __device__ __forceinline__ int64_t chunk_lo(int64_t n, int c, int C)
{
    return n * c / C;
}
__host__ __device__ __forceinline__ int64_t chunk_size(int64_t n, int c, int C)
{
    return n * (c + 1) / C - n * c / C;
}

/* ---- kernels ---- */

/* one thread: tab[c*E+e] = send row where (chunk c, expert e) starts */
__global__ void k_ep_tab(const int32_t *__restrict__ counts, int E, int C,
                         int32_t *__restrict__ tab)
{
    if (threadIdx.x != 0)
        return;
    int64_t pos = 0;
    for (int c = 0; c < C; c++)
        for (int e = 0; e < E; e++) {
            tab[c * E + e] = (int32_t)pos;
            pos += chunk_size(counts[e], c, C);
        }
}

/* the fan-out forward's rows: dst[r] = x[tok[r]] for r < gridDim.x, one
 * CTA per row, 16 bytes per thread (H a multiple of 8) */
__global__ void k_ep_local_rows(const bf16 *__restrict__ x, const int32_t *__restrict__ tok, int H,
                                bf16 *__restrict__ dst)
{
    const int r = blockIdx.x;
    const uint4 *src = reinterpret_cast<const uint4 *>(x + (size_t)tok[r] * H);
    uint4 *d = reinterpret_cast<uint4 *>(dst + (size_t)r * H);
    for (int i = threadIdx.x; i < H / 8; i += blockDim.x)
        d[i] = src[i];
}

/* the fan-out forward's copies into the host's mapped mirror in one
 * launch: up to five arrays of 32-bit words */
struct ep_copies {
    const uint32_t *src[5];
    uint32_t *dst[5];
    int n[5];
};

__global__ void k_ep_copies(const __grid_constant__ ep_copies c)
{
    const int i0 = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    for (int k = 0; k < 5; k++)
        for (int i = i0; i < c.n[k]; i += step)
            c.dst[k][i] = c.src[k][i];
}

/* one warp per sorted row r: xsend[dest] = x[tok[r]], sendpos[slot] = dest */
__global__ void k_ep_gather(const bf16 *__restrict__ x, const int32_t *__restrict__ perm,
                            const int32_t *__restrict__ tok, const int32_t *__restrict__ idx,
                            const int32_t *__restrict__ offs, const int32_t *__restrict__ counts,
                            const int32_t *__restrict__ tab, int S, int E, int H, int C,
                            bf16 *__restrict__ xsend, int32_t *__restrict__ sendpos)
{
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= S)
        return;
    const int s = perm[r], e = idx[s];
    const int64_t j = r - offs[e], n = counts[e];
    int c = 0;
    while (c + 1 < C && chunk_lo(n, c + 1, C) <= j)
        c++;
    const int64_t dest = tab[c * E + e] + (j - chunk_lo(n, c, C));
    const uint4 *src = reinterpret_cast<const uint4 *>(x + (size_t)tok[r] * H);
    uint4 *dst = reinterpret_cast<uint4 *>(xsend + (size_t)dest * H);
    for (int i = lane; i < H / 8; i += 32)
        dst[i] = src[i];
    if (lane == 0)
        sendpos[s] = (int32_t)dest;
}

/* grid (ne, W, C): the rows of (local expert i, source q, chunk c).
 * tbl: offs (C, ne+1) per chunk expert-major offsets; goffs (ne+1); rbase
 * (C+1). gidx[rb + dst] = rb + src; train: wgx/wgh[global row] = recv row /
 * activation row. */
__global__ void k_ep_index(const int32_t *__restrict__ cnt_all, const int32_t *__restrict__ tbl,
                           int t_offs, int t_goffs, int t_rbase, int E, int W, int first, int ne,
                           int C, int32_t *__restrict__ gidx, int32_t *__restrict__ wgx,
                           int32_t *__restrict__ wgh)
{
    const int i = blockIdx.x, q = blockIdx.y, c = blockIdx.z, e = first + i;
    const int32_t *offs = tbl + t_offs + c * (ne + 1);
    const int32_t rb = tbl[t_rbase + c];
    const int64_t sz = chunk_size(cnt_all[q * E + e], c, C);
    if (sz == 0)
        return;
    __shared__ int64_t src0, dst0, g0;
    if (threadIdx.x == 0) {
        int64_t s = 0, d = offs[i], g = tbl[t_goffs + i];
        for (int qq = 0; qq < q; qq++) {
            for (int ii = 0; ii < ne; ii++)
                s += chunk_size(cnt_all[qq * E + first + ii], c, C);
            d += chunk_size(cnt_all[qq * E + e], c, C);
            g += chunk_size(cnt_all[qq * E + e], c, C);
        }
        for (int ii = 0; ii < i; ii++)
            s += chunk_size(cnt_all[q * E + first + ii], c, C);
        for (int cc = 0; cc < c; cc++) {
            const int32_t *o = tbl + t_offs + cc * (ne + 1);
            g += o[i + 1] - o[i];
        }
        src0 = s;
        dst0 = d;
        g0 = g;
    }
    __syncthreads();
    for (int64_t k = threadIdx.x; k < sz; k += blockDim.x) {
        const int32_t src = (int32_t)(rb + src0 + k), act = (int32_t)(rb + dst0 + k);
        gidx[act] = src;
        if (wgx) {
            wgx[g0 + k] = src;
            wgh[g0 + k] = act;
        }
    }
}

/* one warp per slot s: dw[s] = <dy[t], ye_s> (fp32, fixed order), then the
 * send row becomes bf16(w_s * dy[t]) */
__global__ void k_ep_dy(const bf16 *__restrict__ dy, const bf16 *__restrict__ yrecv,
                        const int32_t *__restrict__ pos, const float *__restrict__ w, int S, int K,
                        int H, float *__restrict__ dw, bf16 *__restrict__ send)
{
    const int lane = threadIdx.x & 31;
    const int s = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (s >= S)
        return;
    const int t = s / K;
    const size_t d = (size_t)pos[s];
    const float ws = w[s];
    float dot = 0.f;
    for (int i = lane * 2; i < H; i += 64) {
        const float2 a =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(dy + (size_t)t * H + i));
        const float2 b =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(yrecv + d * H + i));
        dot += a.x * b.x + a.y * b.y;
        *reinterpret_cast<__nv_bfloat162 *>(send + d * H + i) =
            __floats2bfloat162_rn(ws * a.x, ws * a.y);
    }
    for (int o = 16; o; o >>= 1)
        dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0)
        dw[s] = dot;
}

/* ---- host helpers ---- */

void ce_fail(kcu_ep *ep, const char *why);
void ep_fail(kcu_ep *ep, const char *why);

/* a wait on cv (mu held) of at most ms milliseconds */
void cond_wait_ms(pthread_cond_t *cv, pthread_mutex_t *mu, int ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long)ms * 1000000;
    ts.tv_sec += ts.tv_nsec / 1000000000;
    ts.tv_nsec %= 1000000000;
    pthread_cond_timedwait(cv, mu, &ts);
}

/* fn(arg) on a detached thread: 1, or 0 when none starts */
int start_detached(void *(*fn)(void *), void *arg)
{
    pthread_attr_t at;
    pthread_t th;
    const int started = pthread_attr_init(&at) == 0 &&
                        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED) == 0 &&
                        pthread_create(&th, &at, fn, arg) == 0;
    pthread_attr_destroy(&at);
    return started;
}

/* ---- the watchdog of blocking NCCL calls ----
 * A call on a blocking communicator (the exchange communicator's group
 * end or collective, the CE communicator's all-to-all and window
 * registrations) can wait on a peer
 * inside the call: the first call to a peer connects to it, and a dead peer
 * never answers. One thread per shared state (ep_ce_shared) watches the call
 * in progress: watch_arm before it, watch_disarm after. When the abort hook
 * trips or the layer's timeout passes while a call is armed, the thread
 * aborts that call's communicator (ncclCommAbort from another thread: the
 * blocked call then returns an error) and the caller, told by
 * watch_disarm, never touches it again; the reaper frees what it used (the
 * CE windows' buffers) once the abort is over (watch_idle). Arming costs a mutex and two
 * stores, no system call: the thread polls every 20 ms, armed or not (the
 * timeouts are seconds). The thread is detached and holds a reference: the
 * last of it and the owner (watch_put) frees the struct, so the owner never
 * waits for an abort in progress (one can take seconds with a dead peer). */
} // namespace

struct ep_watch {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;         /* the thread and the owner */
    int stop;         /* the owner is gone: the thread ends */
    ncclComm_t comm;  /* the armed call's communicator (not owned), or NULL */
    int64_t deadline; /* now_ms() past which the armed call is given up */
    int fired;        /* it aborted the armed call's communicator: 1 on the abort
                       * hook, 2 on the timeout (cleared by watch_disarm) */
    int aborting;     /* its ncclCommAbort is running (watch_disarm waits it out) */
};

namespace
{

void watch_unref(ep_watch *w)
{
    pthread_mutex_lock(&w->mu);
    const int last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (last) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
    }
}

void *watch_main(void *arg)
{
    ep_watch *w = (ep_watch *)arg;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        int why = 0;
        if (w->comm)
            why = kcu_ep_abort_hook && kcu_ep_abort_hook() ? 1 : now_ms() > w->deadline ? 2 : 0;
        if (why) {
            ncclComm_t c = w->comm;
            w->comm = nullptr;
            w->fired = why;
            w->aborting = 1;
            pthread_mutex_unlock(&w->mu);
            kcu_comm_abort(c);
            pthread_mutex_lock(&w->mu);
            w->aborting = 0;
            pthread_cond_broadcast(&w->cv);
            continue;
        }
        cond_wait_ms(&w->cv, &w->mu, 20);
    }
    pthread_mutex_unlock(&w->mu);
    watch_unref(w);
    return nullptr;
}

/* s's watchdog, started the first time: 0, or -1 when no thread starts */
int watch_ensure(ep_ce_shared *s)
{
    if (s->watch)
        return 0;
    ep_watch *w = (ep_watch *)calloc(1, sizeof(*w));
    if (!w)
        return -1;
    pthread_mutex_init(&w->mu, nullptr);
    pthread_cond_init(&w->cv, nullptr);
    w->refs = 2;
    if (!start_detached(watch_main, w)) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return -1;
    }
    s->watch = w;
    return 0;
}

/* the owner lets go (the shared state's end): the thread ends at its next
 * wake-up */
void watch_put(ep_ce_shared *s)
{
    ep_watch *w = s->watch;
    s->watch = nullptr;
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    w->comm = nullptr;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    watch_unref(w);
}

void watch_arm(ep_watch *w, ncclComm_t comm, int timeout_ms)
{
    pthread_mutex_lock(&w->mu);
    w->comm = comm;
    w->deadline = now_ms() + timeout_ms;
    pthread_mutex_unlock(&w->mu);
}

/* 0, or 1 / 2 when the watchdog aborted the armed call's communicator (the
 * abort hook / the timeout; the abort may still be running: what the
 * communicator used is freed after watch_idle, by the reaper) */
int watch_disarm(ep_watch *w)
{
    pthread_mutex_lock(&w->mu);
    w->comm = nullptr;
    const int fired = w->fired;
    w->fired = 0;
    pthread_mutex_unlock(&w->mu);
    return fired;
}

/* a reference to w for a thread that waits for its abort (watch_idle),
 * then lets go (watch_unref) */
ep_watch *watch_ref(ep_watch *w)
{
    if (w) {
        pthread_mutex_lock(&w->mu);
        w->refs++;
        pthread_mutex_unlock(&w->mu);
    }
    return w;
}

/* returns once no abort of w's is running */
void watch_idle(ep_watch *w)
{
    pthread_mutex_lock(&w->mu);
    while (w->aborting)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

/* the stderr line of a call a watchdog gave up on: fired 1 (the abort
 * hook) or 2 (the timeout) */
void fired_say(const kcu_ep *ep, const char *what, int fired)
{
    if (fired == 1)
        fprintf(stderr, "kcu_ep: rank %d: %s: given up (a member is gone)\n", ep->c.rank, what);
    else
        fprintf(stderr, "kcu_ep: rank %d: %s: not done after %d ms\n", ep->c.rank, what,
                ep->c.timeout_ms);
}

/* ---- NCCL calls ---- */

/* the communicator an exchange call takes: the shared blocking twin once
 * up, the borrowed one before it or without it; NULL once the twin failed
 * (the generation is over: every call fails) */
ncclComm_t ep_xc(const kcu_ep *ep)
{
    const ep_ce_shared *s = ep->ce;
    if (!s || s->fast_state == 0 || s->fast_state == -1)
        return ep->comm;
    return s->fast_state == 1 ? s->fast : nullptr;
}

/* r of an NCCL call on communicator comm: while a non-blocking
 * communicator reports ncclInProgress, polled under the timeout and the
 * abort hook (1000 polls, then 20 us sleeps) */
moe_err ep_nccl_on(kcu_ep *ep, ncclComm_t comm, ncclResult_t r, const char *what)
{
    const int64_t deadline = now_ms() + ep->c.timeout_ms;
    int spins = 0;
    while (r == ncclInProgress) {
        if (now_ms() > deadline) {
            fprintf(stderr, "kcu_ep: rank %d: %s still in progress after %d ms\n", ep->c.rank, what,
                    ep->c.timeout_ms);
            ep_fail(ep, what);
            return MOE_EUNAVAIL;
        }
        /* a member is gone (the worker aborted the exchange): a collective
         * call in progress on the borrowed communicator never ends */
        if (kcu_ep_abort_hook && kcu_ep_abort_hook()) {
            fprintf(stderr, "kcu_ep: rank %d: %s: given up (a member is gone)\n", ep->c.rank, what);
            ep_fail(ep, what);
            return MOE_EUNAVAIL;
        }
        if (spins++ > 1000) {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
        ncclResult_t st = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(comm, &st);
        r = q != ncclSuccess ? q : st;
    }
    if (r != ncclSuccess) {
        fprintf(stderr, "kcu_ep: rank %d: %s: %s (%s)\n", ep->c.rank, what, ncclGetErrorString(r),
                ncclGetLastError(comm));
        ep_fail(ep, what);
        return MOE_EUNAVAIL;
    }
    return MOE_OK;
}

/* before an NCCL call on comm (EP_NCCL_ON): the watchdog armed where comm
 * is one of the shared blocking communicators; 0 when comm is NULL (the
 * exchange communicator failed: the call is not made) */
int ep_arm(kcu_ep *ep, ncclComm_t comm)
{
    if (!comm)
        return 0;
    if (comm != ep->comm && ep->ce && ep->ce->watch)
        watch_arm(ep->ce->watch, comm, ep->c.timeout_ms);
    return 1;
}

/* after it: disarmed, then its result r checked (ep_nccl_on). Where the
 * watchdog aborted comm, comm is forgotten (the shared state no longer
 * holds it) and the exchange fails. */
moe_err ep_nccl_done(kcu_ep *ep, ncclComm_t comm, ncclResult_t r, const char *what)
{
    ep_ce_shared *s = ep->ce;
    const int fired = comm != ep->comm && s && s->watch ? watch_disarm(s->watch) : 0;
    if (!fired)
        return ep_nccl_on(ep, comm, r, what);
    if (comm == s->fast) {
        s->fast = nullptr;
        s->fast_state = -2;
    }
    if (comm == s->comm) {
        s->comm = nullptr;
        s->win[0] = s->win[1] = nullptr;
    }
    fired_say(ep, what, fired);
    ep_fail(ep, what);
    return MOE_EUNAVAIL;
}

moe_err ep_gone(kcu_ep *ep, const char *what)
{
    fprintf(stderr, "kcu_ep: rank %d: %s: the exchange communicator failed earlier\n", ep->c.rank,
            what);
    return MOE_EUNAVAIL;
}

/* EP_NCCL_ON(ep, comm, call, what): one NCCL call whose communicator
 * argument is comm, under the watchdog when comm is blocking (armed before
 * the call is evaluated: it is the call that can block), its result
 * checked. EP_NCCL: the same on the exchange communicator, ep_xc(ep) (the
 * call names ep_xc(ep) as its communicator). */
#define EP_NCCL_ON(ep, comm, call, what)                                                           \
    (ep_arm((ep), (comm)) ? ep_nccl_done((ep), (comm), (call), (what)) : ep_gone((ep), (what)))
#define EP_NCCL(ep, call, what) EP_NCCL_ON(ep, ep_xc(ep), call, what)

/* the asynchronous error state of comm: nonzero on an error (in progress
 * is not one) */
int ep_comm_failed(ncclComm_t comm)
{
    ncclResult_t as = ncclSuccess;
    return ncclCommGetAsyncError(comm, &as) != ncclSuccess ||
           (as != ncclSuccess && as != ncclInProgress);
}

/* wait for an event (or a stream when ev is NULL) under the timeout while
 * watching NCCL's asynchronous errors */
moe_err ep_wait(kcu_ep *ep, cudaEvent_t ev, cudaStream_t st, const char *what)
{
    const int64_t deadline = now_ms() + ep->c.timeout_ms;
    int spins = 0;
    for (;;) {
        const cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(st);
        if (e == cudaSuccess)
            return MOE_OK;
        if (e != cudaErrorNotReady) {
            fprintf(stderr, "kcu_ep: rank %d: %s: %s\n", ep->c.rank, what, cudaGetErrorString(e));
            return MOE_EINTERNAL;
        }
        /* the exchange and CE communicators' too: their calls wait on
         * peers as well */
        const ep_ce_shared *s = ep->ce;
        const int bad = ep_comm_failed(ep->comm)                  ? 1
                        : s && s->fast && ep_comm_failed(s->fast) ? 2
                        : s && s->comm && ep_comm_failed(s->comm) ? 3
                                                                  : 0;
        if (bad) {
            static const char *const name[] = {"", "communicator", "exchange communicator",
                                               "CE communicator"};
            fprintf(stderr, "kcu_ep: rank %d: %s: NCCL error (%s)\n", ep->c.rank, what, name[bad]);
            ep_fail(ep, what);
            return MOE_EUNAVAIL;
        }
        if (kcu_ep_abort_hook && kcu_ep_abort_hook()) {
            fprintf(stderr, "kcu_ep: rank %d: %s: given up (a member is gone)\n", ep->c.rank, what);
            ep_fail(ep, what);
            return MOE_EUNAVAIL;
        }
        if (now_ms() > deadline) {
            fprintf(stderr, "kcu_ep: rank %d: %s: not done after %d ms\n", ep->c.rank, what,
                    ep->c.timeout_ms);
            ep_fail(ep, what);
            return MOE_EUNAVAIL;
        }
        if (spins++ < 2000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
}

/* before a synchronous device call (cudaMemcpy, cudaDeviceSynchronize):
 * wait for the legacy stream and the exchange stream under the timeout and
 * the abort hook, so that a collective stuck on a dead peer makes the call
 * fail at once instead of blocking the worker's compute thread */
static moe_err ep_quiesce(kcu_ep *ep, const char *what)
{
    KCU_TRY(ep_wait(ep, nullptr, ep->cs, what));
    return ep_wait(ep, nullptr, (cudaStream_t)0, what);
}

int64_t ep_owner_rows(const kcu_ep *ep, const int32_t *cnt, int q, int c)
{
    /* rows of one rank's counts cnt (E) for owner q's experts in chunk c */
    const int E = ep->c.E, W = ep->c.world, C = ep->C;
    const int a = placement_first(E, W, q), b = a + placement_count(E, W, q);
    int64_t n = 0;
    for (int e = a; e < b; e++)
        n += chunk_size(cnt[e], c, C);
    return n;
}

void ows_layout(kcu_ep *ep);

/* owner-side buffers for N rows and a table of tl int32 (the selected
 * state's) */
moe_err ep_grow(kcu_ep *ep, int64_t N, int tl)
{
    if ((size_t)N <= ep->cap_rows && (size_t)tl <= ep->cap_tbl && ep->ows)
        return MOE_OK;
    size_t rows = (size_t)N > ep->cap_rows ? (size_t)N + (size_t)N / 4 + 256 : ep->cap_rows;
    size_t tbl = (size_t)tl > ep->cap_tbl ? (size_t)tl * 2 + 1024 : ep->cap_tbl;
    const size_t H = ep->c.H, F = ep->c.F, N1 = ep->N1;
    const int tr = ep->c.train;
    size_t b = al(rows * H * 2) * 2 + al(rows * F * 2) + al(rows * 4) + al(tbl * 4);
    if (tr)
        b += al(rows * N1 * 2) + al(rows * H * 2) + 2 * al(rows * 4) +
             (ep->sorted ? al(rows * H * 2) : 0);
    if (ep->dedup) /* mrecv, sidx (wgy): the unique rows received are at most the rows */
        b += al(rows * ep->c.K * 4) + al(rows * 4) + (tr ? al(rows * 4) : 0);
    KCU_CHECK(cudaDeviceSynchronize()); /* nothing in flight uses the old buffers */
    if (ep->ows)
        cudaFree(ep->ows);
    if (ep->tbl_h)
        cudaFreeHost(ep->tbl_h);
    ep->ows = nullptr;
    ep->tbl_h = nullptr;
    ep->cap_rows = ep->cap_tbl = 0;
    if (cudaMalloc(&ep->ows, b) != cudaSuccess ||
        cudaMallocHost(&ep->tbl_h, tbl * 4) != cudaSuccess) {
        (void)cudaGetLastError();
        fprintf(stderr, "kcu_ep: rank %d: allocation of %zu bytes for %zu rows failed\n",
                ep->c.rank, b, rows);
        if (ep->ows)
            cudaFree(ep->ows);
        ep->ows = nullptr;
        return MOE_ENOMEM;
    }
    ep->ows_bytes = b;
    ep->cap_rows = rows;
    ep->cap_tbl = tbl;
    ows_layout(ep);
    return MOE_OK;
}

/* ---- copy-engine exchange (kcu_ep.h "Copy-engine exchange") ---- */

/* the exchange buffers of this forward: the copy-engine windows (ce) or
 * the send/recv path's */
void ep_bind(kcu_ep *ep, int ce)
{
    if (ce) {
        const size_t H = ep->c.H, K = ep->c.K, X = ep->ce->capx;
        /* each window: [X rows of H bf16 | X rows of K int32 | Y rows of H
         * bf16]: xsend | msend | yrecv on the token side, xrecv | mrecv |
         * ysend on the owner side (the same offsets on every rank) */
        char *t = (char *)ep->ce->buf[0], *o = (char *)ep->ce->buf[1];
        const size_t m0 = al(X * H * 2), y0 = m0 + al(X * K * 4);
        ep->xsend = (bf16 *)t;
        ep->msend = (int32_t *)(t + m0);
        ep->yrecv = (bf16 *)(t + y0);
        ep->xrecv = (bf16 *)o;
        ep->mrecv = (int32_t *)(o + m0);
        ep->ysend = (bf16 *)(o + y0);
    } else {
        ep->xsend = ep->xsend_t;
        ep->msend = ep->msend_t;
        ep->yrecv = ep->yrecv_t;
        ep->xrecv = ep->xrecv_o;
        ep->mrecv = ep->mrecv_o;
        ep->ysend = ep->ysend_o;
    }
}

/* one stderr line per process for the CE path's notes */
void ce_note(const kcu_ep *ep, const char *msg)
{
    static std::atomic<int> said{0};
    if (!said.exchange(1))
        fprintf(stderr,
                "kcu_ep: rank %d: the copy-engine exchange (KCU_EP_CE): %s; forwards take the "
                "send/recv path\n",
                ep->c.rank, msg);
}

/* ---- the shared CE state: one per borrowed communicator ---- */

pthread_mutex_t ce_mu = PTHREAD_MUTEX_INITIALIZER;
ep_ce_shared *ce_list = nullptr; /* the linked states (under ce_mu) */

/* a reference to parent's shared CE state, made the first time (state 0:
 * nothing set up, no collective call); NULL when out of memory */
ep_ce_shared *ce_get(ncclComm_t parent)
{
    pthread_mutex_lock(&ce_mu);
    ep_ce_shared *s = ce_list;
    while (s && s->parent != parent)
        s = s->next;
    if (!s) {
        s = (ep_ce_shared *)calloc(1, sizeof(*s));
        if (s && cudaEventCreateWithFlags(&s->ev_free, cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            free(s);
            s = nullptr;
        }
        if (s) {
            s->parent = parent;
            s->linked = 1;
            s->next = ce_list;
            ce_list = s;
        }
    }
    if (s)
        s->refs++;
    pthread_mutex_unlock(&ce_mu);
    return s;
}

/* takes s out of ce_list (ce_mu held): a kcu_ep created later on the same
 * parent (or on a new communicator at the same address) starts afresh */
void ce_unlink_locked(ep_ce_shared *s)
{
    if (!s->linked)
        return;
    for (ep_ce_shared **p = &ce_list; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            break;
        }
    s->linked = 0;
    s->next = nullptr;
}

void ce_free_bufs(ep_ce_shared *s);

/* ---- the IPC transport's flag page ----
 * A POSIX shared-memory page that every rank of a borrowed communicator
 * maps and registers with CUDA (mapped, portable): the handshake of each
 * all-to-all (ce_ipc_a2a) is stream memory operations on it, and a host
 * store releases a wait that a dead peer will never satisfy (ce_ipc_release)
 * - which NCCL's CE collectives cannot do: their waits are on flags in
 * NCCL's own memory, and ncclCommAbort does not release them (a survivor's
 * stream waited for good after 7 of 69 inference kills on 2x H200,
 * bench/history/service.md "Session 32"). Flag (kind, w, r) is written by
 * rank w and waited on by rank r: kind CE_READY "w's receive slots are free
 * for this call", CE_DONE "w's copies into r are done". Ranks that are
 * threads of one process (bin/ep_bench) share one mapping: a process-wide
 * list by name, refcounted (under ce_mu). */
enum { CE_READY, CE_DONE };
} // namespace

struct ce_flags {
    ce_flags *next;
    char name[64];
    int refs;
    volatile uint64_t *h; /* the page (mmap, registered) */
    uint64_t *d;          /* its device address */
    size_t bytes;
};

namespace
{

ce_flags *ce_flags_list = nullptr; /* under ce_mu */

size_t ce_flag_index(int W, int kind, int w, int r)
{
    return (size_t)kind * W * W + (size_t)w * W + r;
}

/* the page named name of W x W x 2 flags, made (create: O_EXCL, zeroed) or
 * opened, mapped and registered; NULL with why on failure */
ce_flags *ce_flags_get(const char *name, int W, int create, char *why, size_t nwhy)
{
    pthread_mutex_lock(&ce_mu);
    ce_flags *f = ce_flags_list;
    while (f && strcmp(f->name, name) != 0)
        f = f->next;
    if (f) {
        f->refs++;
        pthread_mutex_unlock(&ce_mu);
        return f;
    }
    const size_t bytes = ((size_t)2 * W * W * 8 + 4095) / 4096 * 4096;
    void *h = MAP_FAILED;
    int fd = shm_open(name, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
    if (fd < 0 && create && errno == EEXIST) { /* left by a crashed process of the same pid */
        shm_unlink(name);
        fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    }
    if (fd < 0 || (create && ftruncate(fd, (off_t)bytes) != 0))
        snprintf(why, nwhy, "shm_open/ftruncate %s: %s", name, strerror(errno));
    else if ((h = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
        snprintf(why, nwhy, "mmap %s: %s", name, strerror(errno));
    if (fd >= 0)
        close(fd);
    void *d = nullptr;
    if (h != MAP_FAILED) {
        cudaError_t e =
            cudaHostRegister(h, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
        if (e == cudaSuccess && (e = cudaHostGetDevicePointer(&d, h, 0)) != cudaSuccess)
            cudaHostUnregister(h);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            snprintf(why, nwhy, "cudaHostRegister of the flag page: %s", cudaGetErrorString(e));
            munmap(h, bytes);
            h = MAP_FAILED;
        }
    }
    if (h != MAP_FAILED && !(f = (ce_flags *)calloc(1, sizeof(*f)))) {
        snprintf(why, nwhy, "no memory");
        cudaHostUnregister(h);
        munmap(h, bytes);
    } else if (f) {
        snprintf(f->name, sizeof(f->name), "%s", name);
        f->refs = 1;
        f->h = (volatile uint64_t *)h;
        f->d = (uint64_t *)d;
        f->bytes = bytes;
        f->next = ce_flags_list;
        ce_flags_list = f;
    }
    pthread_mutex_unlock(&ce_mu);
    return f;
}

/* drops a reference; the last unregisters and unmaps the page (nothing
 * may wait on it any more: the device was synchronised) */
void ce_flags_put(ce_flags *f)
{
    if (!f)
        return;
    pthread_mutex_lock(&ce_mu);
    const int last = --f->refs == 0;
    if (last)
        for (ce_flags **p = &ce_flags_list; *p; p = &(*p)->next)
            if (*p == f) {
                *p = f->next;
                break;
            }
    pthread_mutex_unlock(&ce_mu);
    if (!last)
        return;
    cudaHostUnregister((void *)f->h);
    munmap((void *)f->h, f->bytes);
    free(f);
}

/* every wait of this rank's handshakes, past and to come, passes: the
 * flags it waits on (kind, q, rank) are stored far past the last call's
 * number (the waits compare cyclically: value - wanted >= 0 as int64).
 * Its stream then drains: its copies into the peers run (their memory
 * stays mapped: a dead exporter's allocation lives while mapped here,
 * checked on 2x H200) and the kernels after them read what arrived. */
void ce_ipc_release(ep_ce_shared *s)
{
    ce_flags *f = s->flags;
    if (!f)
        return;
    const uint64_t v = s->seq + ((uint64_t)1 << 40);
    for (int q = 0; q < s->world; q++)
        if (q != s->rank) {
            f->h[ce_flag_index(s->world, CE_READY, q, s->rank)] = v;
            f->h[ce_flag_index(s->world, CE_DONE, q, s->rank)] = v;
        }
    __sync_synchronize();
}

/* closes the peers' mappings (cudaIpcCloseMemHandle; a peer of this process
 * was never opened) */
void ce_ipc_unmap(void **peer[2], int *peer_open, int W, int me)
{
    for (int q = 0; q < W; q++) {
        for (int i = 0; i < 2; i++) {
            if (peer[i] && (peer_open[q] >> i & 1) && peer[i][q])
                cudaIpcCloseMemHandle(peer[i][q]);
            if (peer[i] && q != me)
                peer[i][q] = nullptr;
        }
        peer_open[q] = 0;
    }
}

/* ---- the CE communicator's abort, off the caller's thread ----
 * ncclCommAbort of the CE communicator with a peer dead can take long or
 * not return (its symmetric windows map the peer's memory; a worker's
 * compute thread stuck in it for 30 s after a SIGKILLed peer, 4x H100,
 * 2026-11-27), and the caller (the compute thread failing a forward, or
 * destroying the layers for a re-formation) must go on to the borrowed
 * communicator's abort. So a detached thread takes the communicator and
 * the windows' buffers, aborts, then frees them; the caller only forgets
 * them. Where the thread cannot start, the abort runs here. */
struct ce_reap {
    ncclComm_t comm; /* aborted (owned) */
    void *buf[2];    /* ncclMemFree'd after the abort (owned; ipc: cudaFree'd) */
    ep_ce_fns fn;    /* mem_free */
    ep_watch *w;     /* a reference: its abort of comm, if running, ends first */
    int rank;
    const char *name; /* which communicator, for the log line */
    char why[96];
    /* the IPC transport's (its waits already released: ce_ipc_release):
     * after the device drains, the peers' mappings closed, the buffers
     * freed, the flag page let go */
    int ipc, device, world;
    void **peer[2]; /* owned arrays */
    int peer_open[EP_MAX_WORLD];
    ce_flags *flags; /* a reference */
};

/* the abort and the frees of r's (ce_reap_main, or the caller where no
 * memory was left for r) */
void reap_do(ce_reap *r)
{
    const int64_t t0 = now_ms();
    if (r->w) { /* the watchdog aborted the communicator: its abort is over first */
        watch_idle(r->w);
        watch_unref(r->w);
    }
    if (r->comm)
        kcu_comm_abort(r->comm);
    if (r->ipc) {
        (void)cudaSetDevice(r->device);
        (void)cudaDeviceSynchronize(); /* the released handshakes drain */
        ce_ipc_unmap(r->peer, r->peer_open, r->world, r->rank);
        for (int i = 0; i < 2; i++) {
            if (r->buf[i])
                cudaFree(r->buf[i]);
            free(r->peer[i]);
        }
        ce_flags_put(r->flags);
        (void)cudaGetLastError();
    } else {
        for (int i = 0; i < 2; i++)
            if (r->buf[i] && r->fn.mem_free)
                r->fn.mem_free(r->buf[i]);
    }
    fprintf(stderr, "kcu_ep: rank %d: %s: %s %s (%lld ms)\n", r->rank, r->why, r->name,
            r->ipc ? "released" : "aborted", (long long)(now_ms() - t0));
}

void *ce_reap_main(void *arg)
{
    ce_reap *r = (ce_reap *)arg;
    reap_do(r);
    free(r);
    return nullptr;
}

/* runs r on a detached thread, or here where none starts */
void reap_run(ce_reap *r)
{
    if (!start_detached(ce_reap_main, r))
        ce_reap_main(r);
}

/* the exchange communicator's abort, off the caller's thread as the CE
 * communicator's (a dead peer's connections can make it slow) */
void fast_reap(ep_ce_shared *s, int rank, const char *why)
{
    ncclComm_t c = s->fast;
    s->fast = nullptr;
    if (!c)
        return;
    ce_reap *r = (ce_reap *)calloc(1, sizeof(*r));
    if (!r) {
        kcu_comm_abort(c);
        return;
    }
    r->comm = c;
    r->rank = rank;
    r->name = "exchange communicator";
    snprintf(r->why, sizeof(r->why), "%s", why);
    reap_run(r);
}

/* hands s's communicator and buffers to a reaper thread (see above) and
 * forgets them: s has no windows afterwards */
void ce_reap_start(ep_ce_shared *s, int rank, const char *why)
{
    if (!s->comm && !s->buf[0] && !s->buf[1] && !s->flags && !s->peer[0] && !s->peer[1])
        return;
    ce_reap here;
    ce_reap *r = (ce_reap *)calloc(1, sizeof(*r));
    if (!r) { /* no memory for the hand-over: the abort and the frees here */
        memset(&here, 0, sizeof(here));
        r = &here;
    }
    r->comm = s->comm;
    r->buf[0] = s->buf[0];
    r->buf[1] = s->buf[1];
    r->fn = s->fn;
    r->w = watch_ref(s->watch);
    r->rank = rank;
    r->name = s->ipc ? "CE windows" : "CE communicator";
    snprintf(r->why, sizeof(r->why), "%s", why);
    r->ipc = s->ipc;
    r->device = s->device;
    r->world = s->world;
    for (int i = 0; i < 2; i++) {
        r->peer[i] = s->peer[i];
        s->peer[i] = nullptr;
    }
    memcpy(r->peer_open, s->peer_open, sizeof(r->peer_open));
    memset(s->peer_open, 0, sizeof(s->peer_open));
    r->flags = s->flags;
    s->flags = nullptr;
    s->comm = nullptr;
    s->win[0] = s->win[1] = nullptr;
    s->buf[0] = s->buf[1] = nullptr;
    s->bytes = 0;
    s->capx = s->capy = 0;
    if (r == &here)
        reap_do(r);
    else
        reap_run(r);
}

/* the CE path failed (a wait or an NCCL call failed: a peer is gone, the
 * timeout passed, the abort hook; or a window's registration failed): the
 * CE communicator is ours, so it is aborted (its copies stuck on a dead
 * peer stop; the caller aborts the borrowed one) by a reaper thread
 * (ce_reap_start), and never used again; its windows and their buffers go
 * with it. Every layer on it falls back to send/recv; the state leaves
 * ce_list. */
void ce_fail(kcu_ep *ep, const char *why)
{
    ep_ce_shared *s = ep->ce;
    ep->ce_fwd = 0;
    if (!s)
        return;
    pthread_mutex_lock(&ce_mu);
    ce_unlink_locked(s);
    pthread_mutex_unlock(&ce_mu);
    s->state = -1;
    ce_ipc_release(s); /* this rank's waits pass: its stream drains */
    ce_reap_start(s, ep->c.rank, why);
}

/* the exchange failed (an NCCL call or a wait: a peer is gone, the
 * timeout, the abort hook): the CE path fails (ce_fail) and so does the
 * exchange communicator, aborted by a reaper thread (its kernels stuck on a
 * dead peer stop); every later call of the layers on it fails (the worker
 * aborts the borrowed communicator and the cluster re-forms) */
void ep_fail(kcu_ep *ep, const char *why)
{
    ce_fail(ep, why);
    ep_ce_shared *s = ep->ce;
    if (!s)
        return;
    fast_reap(s, ep->c.rank, why);
    if (s->fast_state == 1)
        s->fast_state = -2;
}

/* frees the windows' buffers (after their deregistration or the CE
 * communicator's abort, nothing in flight on them) */
void ce_free_bufs(ep_ce_shared *s)
{
    for (int i = 0; i < 2; i++) {
        if (s->buf[i] && s->ipc)
            cudaFree(s->buf[i]);
        else if (s->buf[i] && s->fn.mem_free)
            s->fn.mem_free(s->buf[i]);
        s->buf[i] = nullptr;
    }
    s->bytes = 0;
    s->capx = s->capy = 0;
}

/* kcu_ep_destroy's first part: drops ep's reference. The last one takes
 * the state out of ce_list and aborts the CE communicator, never
 * deregisters and destroys it: both are collective, and a layer is
 * destroyed when its model is deleted or re-created after a re-formation,
 * where a peer may be dead or the borrowed communicator already aborted (a
 * deregistration waiting on it would hold the worker up to the timeout, or
 * for good). The abort is local (a reaper thread: ce_reap_start) and
 * stops copies stuck on a dead peer while the device is synchronised.
 * Returns the state for ce_free (after
 * that synchronisation) when this was the last reference, else NULL. */
ep_ce_shared *ce_put(kcu_ep *ep)
{
    ep_ce_shared *s = ep->ce;
    ep->ce = nullptr;
    if (!s)
        return nullptr;
    pthread_mutex_lock(&ce_mu);
    const int last = --s->refs == 0;
    if (last)
        ce_unlink_locked(s);
    else if (s->acct == ep)
        s->acct = nullptr; /* the next layer taking the CE path counts the windows */
    pthread_mutex_unlock(&ce_mu);
    if (!last)
        return nullptr;
    watch_put(s);      /* nothing armed: no call in progress */
    ce_ipc_release(s); /* nothing may wait on a peer that is gone */
    ce_reap_start(s, ep->c.rank, "the last layer's destroy");
    fast_reap(s, ep->c.rank, "the last layer's destroy");
    return s;
}

/* kcu_ep_destroy's second part, after the device synchronisation: the
 * buffers, the event, the state */
void ce_free(ep_ce_shared *s)
{
    ce_free_bufs(s);
    for (int i = 0; i < 2; i++)
        free(s->peer[i]);
    ce_flags_put(s->flags);
    cudaEventDestroy(s->ev_free);
    free(s);
}

enum { CE_REG, CE_DEREG };

/* one blocking collective call on the CE communicator, under the watchdog:
 * CE_REG registers window i over buf[i] (bytes, NCCL_WIN_COLL_SYMMETRIC),
 * CE_DEREG deregisters window i. ncclSuccess, or the failure, after which
 * the CE path is failed (ce_fail; where the watchdog fired the
 * communicator is already aborted and forgotten). A non-blocking answer
 * (ncclInProgress: NCCL_COMM_BLOCKING=0 in the environment overrides the
 * config) counts as a failure: this path polls nothing. */
ncclResult_t ce_guarded(kcu_ep *ep, int op, int i, size_t bytes, const char *what)
{
    ep_ce_shared *s = ep->ce;
    if (!s->comm)
        return ncclInvalidUsage;
    if (!s->watch) {
        fprintf(stderr, "kcu_ep: rank %d: %s: no watchdog thread\n", ep->c.rank, what);
        ce_fail(ep, what);
        return ncclSystemError;
    }
    watch_arm(s->watch, s->comm, ep->c.timeout_ms);
    ncclResult_t r =
        op == CE_REG ? s->fn.win_reg(s->comm, s->buf[i], bytes, &s->win[i], NCCL_WIN_COLL_SYMMETRIC)
                     : s->fn.win_dereg(s->comm, s->win[i]);
    const int fired = watch_disarm(s->watch);
    if (op == CE_DEREG)
        s->win[i] = nullptr;
    if (fired) {
        s->comm = nullptr; /* aborted by the watchdog: never touched again */
        s->win[0] = s->win[1] = nullptr;
        fired_say(ep, what, fired);
        if (r == ncclSuccess || r == ncclInProgress)
            r = ncclRemoteError;
    }
    if (r != ncclSuccess) {
        if (!fired)
            fprintf(stderr, "kcu_ep: rank %d: %s: %s (%s)\n", ep->c.rank, what,
                    ncclGetErrorString(r), ncclGetLastError(s->comm));
        ce_fail(ep, what);
    }
    return r;
}

/* 1 when every rank passes ok != 0: a min all-reduce of one int32 on the
 * borrowed communicator (every rank calls, in the same order), waited for
 * under the timeout. *all is set only on success. */
moe_err ep_agree(kcu_ep *ep, int ok, int *all, const char *what)
{
    ep->agree_h[0] = ok ? 1 : 0;
    KCU_CHECK(cudaMemcpyAsync(ep->agree_d, ep->agree_h, 4, cudaMemcpyHostToDevice, ep->cs));
    KCU_TRY(EP_NCCL(
        ep, ncclAllReduce(ep->agree_d, ep->agree_d, 1, ncclInt32, ncclMin, ep_xc(ep), ep->cs),
        what));
    KCU_CHECK(cudaMemcpyAsync(ep->agree_h, ep->agree_d, 4, cudaMemcpyDeviceToHost, ep->cs));
    KCU_CHECK(cudaEventRecord(ep->ev_cnt, ep->cs));
    KCU_TRY(ep_wait(ep, ep->ev_cnt, nullptr, what));
    *all = ep->agree_h[0] == 1;
    return MOE_OK;
}

/* n bytes of host memory through the exchange communicator, waited for
 * under the timeout: op EP_BCAST broadcasts buf (n bytes) from rank 0,
 * EP_GATHER all-gathers buf (W x n bytes, this rank's part at rank x n, in
 * place). ok is this rank's own precondition: every rank agrees first on
 * it and on its staging memory (ep_agree); *all is 0 when some rank lacked
 * either (nothing moved). Errors where the exchange fails. */
enum { EP_BCAST, EP_GATHER };
moe_err ep_host_coll(kcu_ep *ep, int op, void *buf, size_t n, int ok, int *all, const char *what)
{
    const size_t total = op == EP_GATHER ? n * (size_t)ep->c.world : n;
    unsigned char *h = nullptr; /* pinned: the bytes' way to and from the device */
    void *d = nullptr;
    const int ready = ok && cudaMallocHost((void **)&h, total) == cudaSuccess &&
                      cudaMalloc(&d, total) == cudaSuccess;
    if (!ready)
        (void)cudaGetLastError();
    moe_err e = ep_agree(ep, ready, all, what);
    if (e == MOE_OK && *all) {
        memcpy(h, buf, total);
        if (cudaMemcpyAsync(d, h, total, cudaMemcpyHostToDevice, ep->cs) != cudaSuccess)
            e = MOE_EINTERNAL;
        if (e == MOE_OK && op == EP_GATHER)
            e = EP_NCCL(ep,
                        ncclAllGather((char *)d + n * (size_t)ep->c.rank, d, n, ncclUint8,
                                      ep_xc(ep), ep->cs),
                        what);
        else if (e == MOE_OK)
            e = EP_NCCL(ep, ncclBroadcast(d, d, n, ncclUint8, 0, ep_xc(ep), ep->cs), what);
        if (e == MOE_OK &&
            (cudaMemcpyAsync(h, d, total, cudaMemcpyDeviceToHost, ep->cs) != cudaSuccess ||
             cudaEventRecord(ep->ev_cnt, ep->cs) != cudaSuccess))
            e = MOE_EINTERNAL;
        if (e == MOE_OK)
            e = ep_wait(ep, ep->ev_cnt, nullptr, what);
        if (e == MOE_OK)
            memcpy(buf, h, total);
    }
    if (d)
        cudaFree(d);
    if (h)
        cudaFreeHost(h);
    return e;
}

/* deregisters both windows (collective on the CE communicator: every rank,
 * in lockstep), each under the watchdog; MOE_EUNAVAIL (the CE path failed)
 * when one fails */
moe_err ce_dereg(kcu_ep *ep)
{
    ep_ce_shared *s = ep->ce;
    for (int i = 0; i < 2; i++)
        if (s->comm && s->win[i] &&
            ce_guarded(ep, CE_DEREG, i, 0, "ncclCommWindowDeregister") != ncclSuccess)
            return MOE_EUNAVAIL;
    return MOE_OK;
}

/* r of NCCL call or state, or the one it reports asynchronously */
ncclResult_t ce_async(ncclComm_t comm)
{
    ncclResult_t st = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &st);
    return q != ncclSuccess ? q : st;
}

/* a blocking communicator over the borrowed one's ranks into *out (CTAPolicy
 * ZERO when zero_cta: the CE communicator; else NCCL's default: the exchange
 * communicator); *ok whether it was made here, else why says why. Errors
 * only where the exchange fails (the unique id's broadcast).
 * Why blocking: NCCL 2.28 refuses the window registration on a non-blocking
 * CE communicator: ncclCommWindowRegister fails at once on every rank with
 * ncclInvalidArgument, NCCL_DEBUG=WARN showing per rank "init.cc:362 NCCL
 * WARN Attempt to use communicator before the previous operation returned
 * ncclSuccess" and "group.cc:86 NCCL WARN ncclAsyncJobComplete: job ...
 * failed, job error 3" (4x H100, 2026-11-27); a blocking one registers and
 * runs (bench/NOTES.md "Copy-engine exchange"). Its blocking collective
 * calls run under the watchdog (ce_guarded).
 * Why not ncclCommSplit of the borrowed communicator: the split runs in the
 * parent's mode, and on the worker's non-blocking communicator its job
 * fails the same way (the same two WARN lines, each worker of 4 on 4x H100,
 * 2026-11-27), which also leaves the parent unusable. So rank 0 makes a
 * fresh unique id, the borrowed communicator broadcasts it (a collective
 * like the agreements, under the timeout and the abort hook), and every
 * rank joins with ncclCommInitRankConfig. That join blocks until every rank
 * is in; the broadcast just before it has seen them all alive, and the join
 * runs on a thread of its own (twin_init) that the caller waits for under
 * the timeout and the abort hook: a peer dying inside it fails the
 * exchange, and the thread, when NCCL lets it go, aborts what it made. */
struct twin_init {
    pthread_mutex_t mu;
    ncclUniqueId id;
    int world, rank, device, zero_cta;
    ncclComm_t comm; /* made (handed to the caller unless abandoned) */
    ncclResult_t r;
    int done, abandoned; /* the join returned; the caller gave up waiting */
};

void *twin_init_main(void *arg)
{
    twin_init *j = (twin_init *)arg;
    ncclComm_t c = nullptr;
    ncclResult_t r = ncclUnhandledCudaError;
    if (cudaSetDevice(j->device) == cudaSuccess) {
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        if (j->zero_cta)
            cfg.CTAPolicy = NCCL_CTA_POLICY_ZERO;
        cfg.blocking = 1;
        r = ncclCommInitRankConfig(&c, j->world, j->id, j->rank, &cfg);
        /* NCCL_COMM_BLOCKING=0 in the environment overrides the config */
        while (r == ncclInProgress && c) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
            r = ce_async(c);
        }
        if (r == ncclSuccess && c)
            r = ce_async(c);
    }
    pthread_mutex_lock(&j->mu);
    j->done = 1;
    const int gone = j->abandoned;
    j->comm = c;
    j->r = r;
    pthread_mutex_unlock(&j->mu);
    if (gone) { /* the caller left: this thread owns the job */
        if (c)
            kcu_comm_abort(c);
        pthread_mutex_destroy(&j->mu);
        free(j);
    }
    return nullptr;
}

moe_err twin_create(kcu_ep *ep, int zero_cta, ncclComm_t *out, int *ok, char *why, size_t nwhy)
{
    *ok = 0;
    *out = nullptr;
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    ncclResult_t r = ep->c.rank == 0 ? ncclGetUniqueId(&id) : ncclSuccess;
    const char *what = zero_cta ? "CE setup (unique id)" : "exchange communicator (unique id)";
    int all = 0;
    moe_err e = ep_host_coll(ep, EP_BCAST, &id, sizeof(id), r == ncclSuccess, &all, what);
    if (e == MOE_OK && !all)
        snprintf(why, nwhy, "the unique id (rank %d: %s)", ep->c.rank,
                 r != ncclSuccess ? ncclGetErrorString(r) : "no memory for it");
    if (e != MOE_OK || !all)
        return e;
    twin_init *j = (twin_init *)calloc(1, sizeof(*j));
    int dev = 0;
    if (!j || cudaGetDevice(&dev) != cudaSuccess) {
        free(j);
        snprintf(why, nwhy, "rank %d: no memory or device for the join", ep->c.rank);
        return MOE_OK;
    }
    pthread_mutex_init(&j->mu, nullptr);
    j->id = id;
    j->world = ep->c.world;
    j->rank = ep->c.rank;
    j->device = dev;
    j->zero_cta = zero_cta;
    if (!start_detached(twin_init_main, j)) /* no thread: the join here, unguarded */
        twin_init_main(j);
    const int64_t deadline = now_ms() + ep->c.timeout_ms;
    for (;;) {
        pthread_mutex_lock(&j->mu);
        if (j->done)
            break;
        const int why_gone = kcu_ep_abort_hook && kcu_ep_abort_hook() ? 1
                             : now_ms() > deadline                    ? 2
                                                                      : 0;
        if (why_gone) {
            j->abandoned = 1; /* the thread frees the job and aborts what it makes */
            pthread_mutex_unlock(&j->mu);
            fprintf(stderr, "kcu_ep: rank %d: %s: %s\n", ep->c.rank,
                    zero_cta ? "CE setup (communicator)" : "exchange communicator (join)",
                    why_gone == 1 ? "given up (a member is gone)" : "not done within the timeout");
            ep_fail(ep, what);
            return MOE_EUNAVAIL;
        }
        pthread_mutex_unlock(&j->mu);
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    ncclComm_t c = j->comm;
    r = j->r;
    pthread_mutex_unlock(&j->mu);
    pthread_mutex_destroy(&j->mu);
    free(j);
    *ok = r == ncclSuccess && c;
    if (*ok) {
        *out = c;
        return MOE_OK;
    }
    snprintf(why, nwhy, "ncclCommInitRankConfig%s on rank %d: %s",
             zero_cta ? " with CTAPolicy ZERO" : "", ep->c.rank, ncclGetErrorString(r));
    if (c)
        kcu_comm_abort(c);
    return MOE_OK;
}

/* the CE communicator into s->comm (twin_create); *ok whether it was made */
moe_err ce_create(kcu_ep *ep, int *ok, char *why, size_t nwhy)
{
    return twin_create(ep, 1, &ep->ce->comm, ok, why, nwhy);
}

/* the exchange communicator (KCU_EP_BLOCKING, on unless 0; kcu_ep.h "The
 * exchange communicator"), at the first forward of any layer on this
 * borrowed communicator (every rank reaches it in lockstep: the layers run
 * in the same order on every rank). Why: a non-blocking communicator's
 * group end hands the launch to a thread NCCL creates for each call and
 * answers ncclInProgress until it is done; a forward makes several, and
 * on 2 H200s a T=1 forward's exchange took 0.67 ms of host time on the
 * worker's non-blocking communicator against 0.25 on a blocking one (the
 * same binaries, NCCL_COMM_BLOCKING=1; polling with yields instead of
 * sleeps gained 0.07). Every rank agrees on wanting it, then on having
 * made it; otherwise the layers stay on the borrowed one (one stderr
 * line). Its calls run under the watchdog (watch_ensure). */
moe_err fast_setup(kcu_ep *ep)
{
    ep_ce_shared *s = ep->ce;
    const char *v = getenv("KCU_EP_BLOCKING");
    const int want = !(v && v[0] == '0' && !v[1]);
    int all = 0;
    KCU_TRY(ep_agree(ep, want && watch_ensure(s) == 0, &all, "exchange communicator (wanted)"));
    if (!all) {
        s->fast_state = -1;
        if (want && ep->c.rank == 0)
            fprintf(stderr, "kcu_ep: rank 0: the exchange communicator (KCU_EP_BLOCKING): not "
                            "wanted or no watchdog on some rank; the worker's communicator "
                            "carries the exchange\n");
        return MOE_OK;
    }
    char why[160] = "";
    int ok = 0;
    ncclComm_t c = nullptr;
    KCU_TRY(twin_create(ep, 0, &c, &ok, why, sizeof(why)));
    const moe_err e = ep_agree(ep, ok, &all, "exchange communicator");
    if (e != MOE_OK || !all) {
        if (c)
            kcu_comm_abort(c);
        s->fast_state = -1;
        if (e == MOE_OK)
            fprintf(stderr,
                    "kcu_ep: rank %d: the exchange communicator (KCU_EP_BLOCKING): %s; the "
                    "worker's communicator carries the exchange\n",
                    ep->c.rank, why[0] ? why : "not made on another rank");
        return e;
    }
    s->fast = c;
    s->fast_state = 1;
    return MOE_OK;
}

/* the driver's stream memory operations (64-bit), by entry point: NULL
 * where the driver lacks them */
typedef CUresult (*ce_memop_fn)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
ce_memop_fn ce_wait64, ce_write64;

int ce_memops_load(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, [] {
        void *w = nullptr, *x = nullptr;
        cudaDriverEntryPointQueryResult q1, q2;
        if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &w, 12000, cudaEnableDefault,
                                             &q1) == cudaSuccess &&
            cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &x, 12000, cudaEnableDefault,
                                             &q2) == cudaSuccess &&
            q1 == cudaDriverEntryPointSuccess && q2 == cudaDriverEntryPointSuccess) {
            ce_wait64 = (ce_memop_fn)w;
            ce_write64 = (ce_memop_fn)x;
        }
        (void)cudaGetLastError();
    });
    return ce_wait64 && ce_write64;
}

/* one rank's card for the IPC transport's windows (all-gathered) */
struct ce_ipc_card {
    cudaIpcMemHandle_t h[2];
    uint64_t ptr[2]; /* the buffers' addresses (a rank of this process maps none) */
    int32_t pid, dev;
};

/* the end of a CE setup whose last agreement returned e and all: the state
 * up (this layer counts the windows), or one note (why, else other) and
 * the CE path failed on every rank */
moe_err ce_setup_done(kcu_ep *ep, moe_err e, int all, const char *why, const char *other,
                      const char *what)
{
    if (e != MOE_OK || !all) {
        if (e == MOE_OK)
            ce_note(ep, why[0] ? why : other);
        ce_fail(ep, what);
        return e;
    }
    ep->ce->state = 1;
    ep->ce->acct = ep;
    return MOE_OK;
}

/* the IPC transport at the first CE forward (every rank in lockstep): the
 * driver's stream memory operations, then the flag page (rank 0 makes it,
 * its name broadcast, every rank maps it; unlinked once all have), agreed
 * by all ranks; a failure leaves every rank on the send/recv path */
moe_err ce_ipc_setup(kcu_ep *ep)
{
    ep_ce_shared *s = ep->ce;
    static std::atomic<unsigned> made{0};
    char why[160] = "", name[64] = "";
    const int W = ep->c.world, me = ep->c.rank;
    s->ipc = 1; /* from here a failure's reaper lets go of what is made */
    s->world = W;
    s->rank = me;
    (void)cudaGetDevice(&s->device);
    int ok = ce_memops_load();
    if (!ok)
        snprintf(why, sizeof(why), "the driver lacks cuStreamWaitValue64 / cuStreamWriteValue64");
    for (int i = 0; i < 2 && ok; i++)
        ok = (s->peer[i] = (void **)calloc((size_t)W, sizeof(void *))) != nullptr;
    ce_flags *f = nullptr;
    if (me == 0) {
        snprintf(name, sizeof(name), "/moe-kcu-ce-%d-%u", (int)getpid(), made++);
        if (ok && !(f = ce_flags_get(name, W, 1, why, sizeof(why))))
            ok = 0;
    }
    s->flags = f; /* from here the state's: a failure's reaper lets it go */
    int all = 0;
    moe_err e =
        ep_host_coll(ep, EP_BCAST, name, sizeof(name), me != 0 || f, &all, "CE setup (flag page)");
    if (e == MOE_OK && all && me != 0 && ok &&
        !(s->flags = ce_flags_get(name, W, 0, why, sizeof(why))))
        ok = 0;
    if (e == MOE_OK && all)
        e = ep_agree(ep, ok && s->flags, &all, "CE setup (flag page, mapped)");
    if (me == 0 && f)
        shm_unlink(name); /* every rank has it mapped, or the path is off */
    return ce_setup_done(ep, e, all, why, "the flag page could not be mapped on another rank",
                         "CE setup (flag page)");
}

/* the windows of the IPC transport, after they were (re)allocated: every
 * rank's handles and addresses gathered, the peers' opened here (a rank of
 * this process: its address as it is); *ok whether all ranks have them */
moe_err ce_ipc_map(kcu_ep *ep, int *all)
{
    ep_ce_shared *s = ep->ce;
    const int W = ep->c.world, me = ep->c.rank;
    ce_ipc_card *cards = (ce_ipc_card *)calloc((size_t)W, sizeof(ce_ipc_card));
    int ok = cards != nullptr;
    if (ok) {
        ce_ipc_card &c = cards[me];
        for (int i = 0; i < 2 && ok; i++) {
            ok = cudaIpcGetMemHandle(&c.h[i], s->buf[i]) == cudaSuccess;
            c.ptr[i] = (uint64_t)(uintptr_t)s->buf[i];
        }
        c.pid = (int32_t)getpid();
        c.dev = s->device;
    }
    (void)cudaGetLastError();
    const moe_err e =
        ep_host_coll(ep, EP_GATHER, cards, sizeof(ce_ipc_card), ok, all, "CE windows (handles)");
    if (e != MOE_OK) {
        free(cards);
        return e;
    }
    for (int i = 0; i < 2; i++)
        s->peer[i][me] = s->buf[i];
    for (int q = 0; q < W && *all && ok; q++) {
        if (q == me)
            continue;
        for (int i = 0; i < 2 && ok; i++) {
            if (cards[q].pid == (int32_t)getpid()) { /* a thread's rank: peer access */
                s->peer[i][q] = (void *)(uintptr_t)cards[q].ptr[i];
                if (cards[q].dev != s->device)
                    (void)cudaDeviceEnablePeerAccess(cards[q].dev, 0);
                (void)cudaGetLastError(); /* already enabled, or copies staged */
            } else if (cudaIpcOpenMemHandle(&s->peer[i][q], cards[q].h[i],
                                            cudaIpcMemLazyEnablePeerAccess) == cudaSuccess) {
                s->peer_open[q] |= 1 << i;
            } else {
                (void)cudaGetLastError();
                s->peer[i][q] = nullptr;
                ok = 0;
            }
        }
    }
    free(cards);
    if (*all)
        KCU_TRY(ep_agree(ep, ok, all, "CE windows (handles opened)"));
    return MOE_OK;
}

/* NCCL's transport (KCU_EP_CE_IMPL=nccl), at the first forward of any layer
 * on this borrowed communicator that would take the CE path (every rank
 * reaches it in lockstep: the decision comes from the gathered counts, and
 * the layers run in the same order on every rank). The library's version
 * and symbols, then the CE communicator (ce_create), each agreed on by all
 * ranks (ep_agree); a failure anywhere leaves every rank on the send/recv
 * path (state -1, one note). Errors only where the borrowed communicator
 * fails. */
moe_err ce_nccl_setup(kcu_ep *ep)
{
    ep_ce_shared *s = ep->ce;
    char why[160] = "";
    int ver = 0;
    ncclGetVersion(&ver);
    ep_ce_fns &f = s->fn;
    f.mem_alloc = (decltype(f.mem_alloc))dlsym(RTLD_DEFAULT, "ncclMemAlloc");
    f.mem_free = (decltype(f.mem_free))dlsym(RTLD_DEFAULT, "ncclMemFree");
    f.win_reg = (decltype(f.win_reg))dlsym(RTLD_DEFAULT, "ncclCommWindowRegister");
    f.win_dereg = (decltype(f.win_dereg))dlsym(RTLD_DEFAULT, "ncclCommWindowDeregister");
    f.a2a = (decltype(f.a2a))dlsym(RTLD_DEFAULT, "ncclAlltoAll");
    if (ver < 22800) /* NCCL_VERSION(2,28,0): CTAPolicy ZERO's copy-engine collectives */
        snprintf(why, sizeof(why), "NCCL %d.%d.%d at run time (copy-engine collectives need 2.28)",
                 ver / 10000, ver / 100 % 100, ver % 100);
    else if (!f.mem_alloc || !f.mem_free || !f.win_reg || !f.win_dereg || !f.a2a)
        snprintf(why, sizeof(why),
                 "NCCL at run time lacks a symbol of "
                 "ncclMemAlloc, ncclMemFree, ncclCommWindow(De)Register, "
                 "ncclAlltoAll");
    int all = 0;
    KCU_TRY(ep_agree(ep, !why[0], &all, "CE setup (versions)"));
    if (!all) {
        s->state = -1;
        ce_note(ep, why[0] ? why : "another rank's NCCL lacks the copy-engine collectives");
        return MOE_OK;
    }
    int ok = 0;
    (void)watch_ensure(
        s); /* its calls under the watchdog (without one ce_guarded registers no window) */
    KCU_TRY(ce_create(ep, &ok, why, sizeof(why)));
    const moe_err e = ep_agree(ep, ok, &all, "CE setup (communicator)");
    return ce_setup_done(ep, e, all, why, "the CE communicator could not be made on another rank",
                         "CE setup (communicator)");
}

/* *shared: whether two ranks of the exchange communicator are threads of
 * one process (bin/ep_bench), from the ranks' process ids all-gathered, so
 * every rank answers the same; -1 where some rank had no memory for them.
 * Errors where the exchange fails. */
moe_err ce_ranks_share_process(kcu_ep *ep, int *shared)
{
    const int W = ep->c.world;
    int32_t *pid = (int32_t *)calloc((size_t)W, sizeof(int32_t));
    int all = 0;
    if (pid)
        pid[ep->c.rank] = (int32_t)getpid();
    const moe_err e = ep_host_coll(ep, EP_GATHER, pid, sizeof(int32_t), pid != nullptr, &all,
                                   "CE setup (process ids)");
    *shared = all ? 0 : -1;
    for (int a = 0; a < W && *shared == 0; a++)
        for (int b = a + 1; b < W && *shared == 0; b++)
            *shared = pid[a] == pid[b];
    free(pid);
    return e;
}

/* the CE path's transport (KCU_EP_CE_IMPL: "nccl" = NCCL's CE collectives,
 * "own" = this library's IPC transport, unset = this library's unless two
 * ranks are threads of one process, then NCCL's), agreed by every rank:
 * ranks that differ leave every rank on the send/recv path. Threads of one
 * process take NCCL's by default: there this library's transport hung on 4
 * GPUs (bin/ep_bench, session 33). The stacks: two ranks' threads in the
 * first launch of a kernel (the driver loads it lazily, under a lock of the
 * whole process, with peer access on between the ranks' devices), the
 * other two waiting for that lock in cudaMemcpyAsync - while their devices
 * wait on handshakes only those threads can enqueue. NCCL's maps its
 * buffers one by one, without peer access. A worker is one process per GPU
 * and keeps this library's. */
moe_err ce_setup(kcu_ep *ep)
{
    const char *v = getenv("KCU_EP_CE_IMPL");
    int want_nccl = v && strcmp(v, "nccl") == 0;
    int shared = 0; /* gathered on every rank whatever its setting: in lockstep */
    KCU_TRY(ce_ranks_share_process(ep, &shared));
    if (shared < 0) {
        ce_note(ep, "the ranks' process ids could not be gathered");
        ep->ce->state = -1;
        return MOE_OK;
    }
    if (!v || !v[0]) {
        want_nccl = shared;
        if (shared && ep->c.rank == 0)
            fprintf(stderr, "kcu_ep: rank 0: ranks share a process: the copy-engine exchange "
                            "takes NCCL's transport (KCU_EP_CE_IMPL=own: this library's)\n");
    }
    int all_ipc = 0, all_nccl = 0;
    KCU_TRY(ep_agree(ep, !want_nccl, &all_ipc, "CE setup (transport)"));
    if (all_ipc)
        return ce_ipc_setup(ep);
    KCU_TRY(ep_agree(ep, want_nccl, &all_nccl, "CE setup (transport)"));
    if (all_nccl)
        return ce_nccl_setup(ep);
    ce_note(ep, "the ranks' KCU_EP_CE_IMPL differ");
    ep->ce->state = -1;
    return MOE_OK;
}

/* the windows for x padded dispatch rows and y return rows (every rank
 * the same sizes, from the gathered counts: grown in lockstep; shared by
 * the layers, so grown to the largest need of any). Everything in flight
 * on them is waited for first, bounded: this layer's streams and ev_free
 * (the last CE forward of any layer: its combine reads yrecv, its
 * transfers use both). A failure on any rank (agreed) fails the CE path:
 * every rank then stays on the send/recv path. */
moe_err ce_grow(kcu_ep *ep, int64_t x, int64_t y, cudaStream_t st)
{
    ep_ce_shared *s = ep->ce;
    const size_t H = ep->c.H, K = ep->c.K;
    /* 1.25x what this forward needs, so that a slightly larger batch does
     * not register again (collective, slow); bytes rounded to 2 MiB */
    const int64_t nx = std::max(s->capx, x + x / 4 + 256);
    const int64_t ny = std::max(s->capy, y + y / 4 + 256);
    const size_t mib2 = (size_t)2 << 20;
    const size_t bytes =
        ((al(nx * H * 2) + al(nx * K * 4) + al(ny * H * 2)) + mib2 - 1) / mib2 * mib2;
    KCU_TRY(ep_wait(ep, nullptr, st, "CE windows (previous forward)"));
    KCU_TRY(ep_quiesce(ep, "CE windows (previous forward)"));
    if (s->ev_used)
        KCU_TRY(ep_wait(ep, s->ev_free, nullptr, "CE windows (previous forward of a layer)"));
    int all = 0;
    char why[160];
    moe_err e = MOE_OK;
    if (s->ipc) {
        /* every rank's copies into this rank's windows are done (its last
         * CE forward waited for their flags), and a peer's mapping keeps
         * the old buffers alive until that peer closes it */
        ce_ipc_unmap(s->peer, s->peer_open, s->world, s->rank);
        ce_free_bufs(s);
        cudaError_t ce = cudaMalloc(&s->buf[0], bytes);
        if (ce == cudaSuccess)
            ce = cudaMalloc(&s->buf[1], bytes);
        (void)cudaGetLastError();
        snprintf(why, sizeof(why), "cudaMalloc of 2 x %.1f MiB failed on some rank (rank %d: %s)",
                 bytes / 1048576.0, ep->c.rank, cudaGetErrorString(ce));
        e = ep_agree(ep, ce == cudaSuccess, &all, "CE windows (allocation)");
        if (e == MOE_OK && all) {
            e = ce_ipc_map(ep, &all);
            snprintf(why, sizeof(why), "the windows' CUDA IPC handles failed on some rank");
        }
    } else {
        KCU_TRY(ce_dereg(ep));
        ce_free_bufs(s);
        ncclResult_t r = s->fn.mem_alloc(&s->buf[0], bytes);
        if (r == ncclSuccess)
            r = s->fn.mem_alloc(&s->buf[1], bytes);
        snprintf(why, sizeof(why), "ncclMemAlloc of 2 x %.1f MiB failed on some rank (rank %d: %s)",
                 bytes / 1048576.0, ep->c.rank, ncclGetErrorString(r));
        e = ep_agree(ep, r == ncclSuccess, &all, "CE windows (allocation)");
    }
    if (e == MOE_OK && all && !s->ipc) {
        /* collective on the CE communicator: every rank registers the same
         * sizes in the same order; a failure fails the CE path here */
        ncclResult_t r = ce_guarded(ep, CE_REG, 0, bytes, "ncclCommWindowRegister");
        if (r == ncclSuccess)
            r = ce_guarded(ep, CE_REG, 1, bytes, "ncclCommWindowRegister");
        snprintf(why, sizeof(why), "ncclCommWindowRegister failed on some rank (rank %d: %s)",
                 ep->c.rank, ncclGetErrorString(r));
        e = ep_agree(ep, r == ncclSuccess && s->comm, &all, "CE windows (registration)");
    }
    if (e != MOE_OK || !all) {
        if (e == MOE_OK)
            ce_note(ep, why);
        ce_fail(ep, "CE windows");
        ce_free_bufs(s); /* nothing in flight on them: waited for above */
        return e;
    }
    s->bytes = bytes;
    s->capx = nx;
    s->capy = ny;
    s->gen++;
    /* one line per setup and growth (rare): the operator's sign that the
     * copy-engine path is in use, and what it holds */
    if (ep->c.rank == 0)
        fprintf(stderr,
                "kcu_ep: rank 0: copy-engine exchange: windows 2 x %.1f MiB (%lld dispatch, %lld "
                "return rows), growth %u\n",
                bytes / 1048576.0, (long long)nx, (long long)ny, s->gen);
    return MOE_OK;
}

/* after a CE forward (or the bench's exchange) on stream st, finished or
 * failed half-way: the exchange stream joined into st, then ev_free
 * recorded on st. The next CE forward of any layer waits for it on its
 * stream before writing into the windows (ce_plan), a growth on the host
 * (ce_grow). A CUDA error here fails the CE path. */
moe_err ce_windows_done(kcu_ep *ep, cudaStream_t st)
{
    ep_ce_shared *s = ep->ce;
    if (!s || s->state <= 0)
        return MOE_OK;
    cudaError_t e = cudaEventRecord(ep->ev_done, ep->cs);
    if (e == cudaSuccess)
        e = cudaStreamWaitEvent(st, ep->ev_done, 0);
    if (e == cudaSuccess)
        e = cudaEventRecord(s->ev_free, st);
    if (e != cudaSuccess) {
        fprintf(stderr, "kcu_ep: rank %d: CE windows' release: %s\n", ep->c.rank,
                cudaGetErrorString(e));
        ce_fail(ep, "CE windows' release");
        return MOE_EINTERNAL;
    }
    s->ev_used = 1;
    return MOE_OK;
}

/* one move of an IPC all-to-all: bytes for each peer q from send + q bytes
 * into q's window win at recv's offset + rank bytes (recv is in this
 * rank's window win: the windows have the same layout on every rank) */
struct ce_move {
    const void *send;
    void *recv;
    size_t bytes;
    int win;
};

/* the IPC transport's all-to-all of n moves on ep->cs (kcu_ep.h
 * "Copy-engine exchange"): call number q = ++seq; this rank's READY flag to
 * every peer (its slots are free: everything before on ep->cs, which
 * follows the windows' previous use, is done), a wait for every peer's
 * READY, the copies into the peers' windows (cudaMemcpyAsync: the copy
 * engines, no SM), DONE to every peer (the write is fenced after the
 * copies), a wait for every peer's DONE. Only enqueues: ep_wait watches it
 * under the timeout and the abort hook, and a failure releases the waits
 * (ce_fail). A CUDA error enqueueing fails the exchange. */
/* one flag kind of a handshake on st: this rank's flag to every peer set
 * to q (fenced after what st ran before), then a wait for every peer's to
 * reach q; each rank starts at its next peer */
CUresult ce_signal(const ep_ce_shared *s, CUstream st, int kind, uint64_t q)
{
    const int W = s->world, me = s->rank;
    const CUdeviceptr fd = (CUdeviceptr)s->flags->d;
    CUresult r = CUDA_SUCCESS;
    for (int j = 1; j < W && r == CUDA_SUCCESS; j++)
        r = ce_write64(st, fd + 8 * ce_flag_index(W, kind, me, (me + j) % W), q,
                       CU_STREAM_WRITE_VALUE_DEFAULT);
    for (int j = 1; j < W && r == CUDA_SUCCESS; j++)
        r = ce_wait64(st, fd + 8 * ce_flag_index(W, kind, (me + j) % W, me), q,
                      CU_STREAM_WAIT_VALUE_GEQ);
    return r;
}

moe_err ce_ipc_a2a(kcu_ep *ep, const ce_move *mv, int n, const char *what)
{
    ep_ce_shared *s = ep->ce;
    const int W = ep->c.world, me = ep->c.rank;
    CUstream st = (CUstream)ep->cs;
    const uint64_t q = ++s->seq;
    cudaError_t ce = cudaSuccess;
    CUresult r = ce_signal(s, st, CE_READY, q);
    for (int k = 0; k < n && r == CUDA_SUCCESS && ce == cudaSuccess; k++) {
        const ce_move &m = mv[k];
        const size_t off = (size_t)((const char *)m.recv - (const char *)s->buf[m.win]);
        for (int j = 0; j < W && ce == cudaSuccess; j++) { /* each rank starts at its next peer */
            const int p = (me + 1 + j) % W;
            ce = cudaMemcpyAsync((char *)s->peer[m.win][p] + off + (size_t)me * m.bytes,
                                 (const char *)m.send + (size_t)p * m.bytes, m.bytes,
                                 cudaMemcpyDeviceToDevice, ep->cs);
        }
    }
    if (r == CUDA_SUCCESS && ce == cudaSuccess)
        r = ce_signal(s, st, CE_DONE, q);
    if (r == CUDA_SUCCESS && ce == cudaSuccess)
        return MOE_OK;
    fprintf(stderr, "kcu_ep: rank %d: %s: %s (driver %d)\n", ep->c.rank, what,
            cudaGetErrorString(ce), (int)r);
    (void)cudaGetLastError();
    ep_fail(ep, what);
    return MOE_EUNAVAIL;
}

/* the CE path's all-to-alls of chunk c on stream cs: the unique rows and
 * their metadata out (S[c] rows per peer: one IPC all-to-all of two moves,
 * or two ncclAlltoAll), or the slot rows back (R[c] rows per peer). The
 * slots are padded: rows past a pair's real count carry stale bytes nothing
 * reads. Both transports return once enqueued (on the blocking CE
 * communicator too); ep_wait watches the progress under the timeout. */
moe_err ce_dispatch(kcu_ep *ep, int c)
{
    const ep_ce_slots &p = ep->cs_;
    const ep_ce_shared *s = ep->ce;
    const size_t H = ep->c.H, K = ep->c.K;
    if (p.S[c] == 0)
        return MOE_OK;
    if (s->ipc) {
        const ce_move mv[2] = {{ep->xsend + (size_t)p.D[c] * H, ep->xrecv + (size_t)p.D[c] * H,
                                (size_t)p.S[c] * H * 2, 1},
                               {ep->msend + (size_t)p.D[c] * K, ep->mrecv + (size_t)p.D[c] * K,
                                (size_t)p.S[c] * K * 4, 1}};
        return ce_ipc_a2a(ep, mv, 2, "CE dispatch");
    }
    KCU_TRY(EP_NCCL_ON(ep, s->comm,
                       s->fn.a2a(ep->xsend + (size_t)p.D[c] * H, ep->xrecv + (size_t)p.D[c] * H,
                                 (size_t)p.S[c] * H, ncclBfloat16, s->comm, ep->cs),
                       "ncclAlltoAll (CE dispatch)"));
    return EP_NCCL_ON(ep, s->comm,
                      s->fn.a2a(ep->msend + (size_t)p.D[c] * K, ep->mrecv + (size_t)p.D[c] * K,
                                (size_t)p.S[c] * K, ncclInt32, s->comm, ep->cs),
                      "ncclAlltoAll (CE metadata)");
}

moe_err ce_return(kcu_ep *ep, int c)
{
    const ep_ce_slots &p = ep->cs_;
    const ep_ce_shared *s = ep->ce;
    const size_t H = ep->c.H;
    if (p.R[c] == 0)
        return MOE_OK;
    if (s->ipc) {
        const ce_move mv[1] = {{ep->ysend + (size_t)p.B[c] * H, ep->yrecv + (size_t)p.B[c] * H,
                                (size_t)p.R[c] * H * 2, 0}};
        return ce_ipc_a2a(ep, mv, 1, "CE return");
    }
    return EP_NCCL_ON(ep, s->comm,
                      s->fn.a2a(ep->ysend + (size_t)p.B[c] * H, ep->yrecv + (size_t)p.B[c] * H,
                                (size_t)p.R[c] * H, ncclBfloat16, s->comm, ep->cs),
                      "ncclAlltoAll (CE return)");
}

/* the host tables of one call from the gathered counts: transfer sizes,
 * per-chunk expert offsets and tile lists, global offsets */
moe_err ep_plan(kcu_ep *ep)
{
    const int E = ep->c.E, W = ep->c.world, C = ep->C, me = ep->c.rank, ne = ep->ne, K = ep->c.K;
    const int32_t *cnt = ep->cnt_h;
    ep->T_global = 0;
    for (int e = 0; e < E; e++)
        ep->counts_global[e] = 0;
    for (int q = 0; q < W; q++) {
        int64_t tq = 0;
        for (int e = 0; e < E; e++) {
            if (cnt[q * E + e] < 0)
                return MOE_EINTERNAL;
            ep->counts_global[e] += cnt[q * E + e];
            tq += cnt[q * E + e];
        }
        ep->T_global += (int)(tq / K);
    }
    for (int e = 0; e < E; e++)
        ep->counts_local[e] = cnt[me * E + e];
    ep->sbase[0] = ep->rbase[0] = 0;
    for (int c = 0; c < C; c++) {
        int64_t s = 0, r = 0;
        for (int q = 0; q < W; q++) {
            ep->send_rows[c][q] = ep_owner_rows(ep, cnt + me * E, q, c);
            ep->recv_rows[c][q] = ep_owner_rows(ep, cnt + q * E, me, c);
            s += ep->send_rows[c][q];
            r += ep->recv_rows[c][q];
        }
        ep->sbase[c + 1] = ep->sbase[c] + s;
        ep->rbase[c + 1] = ep->rbase[c] + r;
    }
    ep->N = ep->rbase[C];
    if (ep->N > INT32_MAX / 2)
        return MOE_EINVAL;
    /* table layout */
    int tt = 0;
    for (int c = 0; c < C; c++) {
        int n = 0;
        for (int i = 0; i < ne; i++) {
            int64_t k = 0;
            for (int q = 0; q < W; q++)
                k += chunk_size(cnt[q * E + ep->first + i], c, C);
            n += (int)KCU_CEIL_DIV(k, (int64_t)KCU_BM);
        }
        ep->tiles[c] = n;
        ep->tbase[c] = tt;
        tt += n;
    }
    ep->t_offs = 0;
    ep->t_goffs = C * (ne + 1);
    ep->t_ntiles = ep->t_goffs + ne + 1;
    ep->t_rbase = ep->t_ntiles + C;
    ep->t_te = ep->t_rbase + C + 1;
    ep->t_tr = ep->t_te + tt + 1;
    ep->t_len = ep->t_tr + tt + 1;
    KCU_TRY(ep_grow(ep, ep->N, ep->t_len));
    int32_t *t = ep->tbl_h;
    for (int i = 0; i <= ne; i++)
        t[ep->t_goffs + i] = 0;
    for (int c = 0; c < C; c++) {
        int32_t *offs = t + ep->t_offs + c * (ne + 1);
        int32_t *te = t + ep->t_te + ep->tbase[c], *tr = t + ep->t_tr + ep->tbase[c];
        int o = 0, k = 0;
        for (int i = 0; i < ne; i++) {
            int64_t n = 0;
            for (int q = 0; q < W; q++)
                n += chunk_size(cnt[q * E + ep->first + i], c, C);
            offs[i] = o;
            for (int64_t r0 = 0; r0 < n; r0 += KCU_BM) {
                te[k] = i;
                tr[k] = o + (int)r0;
                k++;
            }
            o += (int)n;
            t[ep->t_goffs + i + 1] += (int32_t)n;
        }
        offs[ne] = o;
        t[ep->t_ntiles + c] = k;
        t[ep->t_rbase + c] = (int32_t)ep->rbase[c];
    }
    t[ep->t_rbase + C] = (int32_t)ep->rbase[C];
    for (int i = 0; i < ne; i++)
        t[ep->t_goffs + i + 1] += t[ep->t_goffs + i];
    return MOE_OK;
}

/* one grouped exchange of chunk c: forward direction (token side -> owner)
 * or back (owner -> token side) */
moe_err ep_exchange(kcu_ep *ep, int c, const bf16 *tok_buf, bf16 *own_buf, int back)
{
    const int W = ep->c.world, me = ep->c.rank;
    const size_t H = ep->c.H;
    int64_t so = ep->sbase[c], ro = ep->rbase[c];
    KCU_TRY(EP_NCCL(ep, ncclGroupStart(), "ncclGroupStart"));
    moe_err err = MOE_OK;
    for (int q = 0; q < W && err == MOE_OK; q++) {
        const int64_t ns = ep->send_rows[c][q], nr = ep->recv_rows[c][q];
        bf16 *tp = (bf16 *)tok_buf + (size_t)so * H, *op = own_buf + (size_t)ro * H;
        if (q == me && W == 1) {
            /* ns == nr: our own rows (with peers, NCCL copies them inside
             * the group, concurrently with the other transfers) */
            if (ns && cudaMemcpyAsync(back ? tp : op, back ? op : tp, (size_t)ns * H * 2,
                                      cudaMemcpyDeviceToDevice, ep->cs) != cudaSuccess)
                err = MOE_EINTERNAL;
        } else if (!back) {
            if (ns)
                err = EP_NCCL(ep, ncclSend(tp, (size_t)ns * H, ncclBfloat16, q, ep_xc(ep), ep->cs),
                              "ncclSend");
            if (err == MOE_OK && nr)
                err = EP_NCCL(ep, ncclRecv(op, (size_t)nr * H, ncclBfloat16, q, ep_xc(ep), ep->cs),
                              "ncclRecv");
        } else {
            if (nr)
                err = EP_NCCL(ep, ncclSend(op, (size_t)nr * H, ncclBfloat16, q, ep_xc(ep), ep->cs),
                              "ncclSend");
            if (err == MOE_OK && ns)
                err = EP_NCCL(ep, ncclRecv(tp, (size_t)ns * H, ncclBfloat16, q, ep_xc(ep), ep->cs),
                              "ncclRecv");
        }
        so += ns;
        ro += nr;
    }
    moe_err e2 = EP_NCCL(ep, ncclGroupEnd(), "ncclGroupEnd");
    return err != MOE_OK ? err : e2;
}

/* SMs for a persistent GEMM that runs while NCCL transfers are in flight:
 * a grid of every SM would leave NCCL's blocks (or the GEMM's last CTAs)
 * waiting for a free SM */
int ep_overlap_sms(const kcu_ep *ep)
{
    const int free_sms = ep->c.comm_sms > 0 ? ep->c.comm_sms : 32;
    return ep->nsm - free_sms > 16 ? ep->nsm - free_sms : 16;
}

int ep_gemm_sms(const kcu_ep *ep)
{
    /* the CE path moves the rows on the copy engines: no SM to leave */
    if (ep->C <= 1 || ep->c.world == 1 || ep->ce_fwd)
        return ep->nsm;
    return ep_overlap_sms(ep);
}

/* one chunk of sorted rows: activation order is the global expert-major
 * order (wgh is the identity), so the weight gradients read dense rows */
int ep_dense_wgrad(const kcu_ep *ep)
{
    return ep->C == 1 && ep->xg != nullptr;
}

/* the owner's expert FFNs (ex's weights and gradients) over every chunk's
 * rows, for the weight gradients: groups the global expert-major ranges
 * (t_goffs), h and ab rows read through wgh (in activation order when
 * ep_dense_wgrad) */
kcu_ffn ep_ffn(const kcu_ep *ep, int nsm)
{
    const kcu_experts *x = ep->ex;
    kcu_ffn f;
    memset(&f, 0, sizeof(f));
    f.H = ep->c.H;
    f.F = ep->c.F;
    f.N1 = ep->N1;
    f.act = ep->c.act;
    f.nsm = nsm;
    f.w13 = x->w13;
    f.w2 = x->w2;
    f.h = ep->h;
    f.ab = ep->ab;
    f.E = ep->ne;
    f.goffs = ep->tbl_d + ep->t_goffs;
    f.ws_gather = ep_dense_wgrad(ep) ? nullptr : ep->wgh;
    if (x->g) { /* w13's gradients, then w2's */
        f.g_w13 = x->g;
        f.g_w2 = x->g + (size_t)ep->ne * ep->N1 * ep->c.H;
    }
    f.beta0 = x->grads_clean;
    return f;
}

/* chunk c's view of ep_ffn for the rows-mode GEMMs: its tile list, and h
 * and ab from its first row */
kcu_ffn ep_chunk_ffn(const kcu_ep *ep, int c, int nsm)
{
    kcu_ffn f = ep_ffn(ep, nsm);
    const int64_t rb = ep->rbase[c];
    f.t.offs = ep->tbl_d + ep->t_offs + c * (ep->ne + 1);
    f.t.tile_e = ep->tbl_d + ep->t_te + ep->tbase[c];
    f.t.tile_r0 = ep->tbl_d + ep->t_tr + ep->tbase[c];
    f.t.ntiles = ep->tbl_d + ep->t_ntiles + c;
    f.t.max_tiles = ep->tiles[c];
    f.h = ep->h + (size_t)rb * ep->c.F;
    f.ab = ep->ab ? ep->ab + (size_t)rb * ep->N1 : nullptr; /* train */
    return f;
}

/* dW2_e (+)= dy_e^T (w h)_e over the owner's rows: dy (N,H) through a_gather
 * (recv layout, wgx) or dense in activation order (a_gather NULL) */
moe_err ep_dw2(kcu_ep *ep, const bf16 *dy, const int32_t *a_gather, int nsm, cudaStream_t st)
{
    const kcu_ffn f = ep_ffn(ep, nsm);
    return kcu_ffn_dw2(&f, dy, a_gather, st);
}

/* the owner's forward GEMMs of chunk c: xrecv -> ysend (recv layout) */
moe_err ep_experts_fwd(kcu_ep *ep, int c, int train, cudaStream_t st)
{
    if (ep->tiles[c] == 0)
        return MOE_OK;
    const int H = ep->c.H;
    const int64_t rb = ep->rbase[c];
    const kcu_ffn f = ep_chunk_ffn(ep, c, ep_gemm_sms(ep));
    const bf16 *xrows = ep->xrecv;
    const int32_t *xgather = ep->gidx + rb;
    if (ep->sorted) { /* chunk c's rows in expert (activation) order: kept in xg
                       * for dW13 when training, else in the chunk's ysend region
                       * (the down-projection overwrites it afterwards) */
        bf16 *dst = (train && ep->xg ? ep->xg : ep->ysend) + (size_t)rb * H;
        KCU_TRY(kcu_gather_rows(ep->xrecv, MOE_BF16, ep->gidx + rb, f.t.offs + ep->ne,
                                (int)(ep->rbase[c + 1] - rb), H, dst, 0, st));
        xrows = dst;
        xgather = nullptr;
    }
    return kcu_ffn_forward(&f, xrows, xgather, train, ep->ysend, MOE_BF16, ep->gidx + rb, st);
}

/* the owner's dh and dx GEMMs of chunk c: dy rows (in ysend) -> dxsend.
 * After a dedup forward the dy and dx rows are in the return layout: read
 * and written through sidx (GEMM row -> return row) instead of gidx */
moe_err ep_experts_bwd(kcu_ep *ep, int c, cudaStream_t st)
{
    if (ep->tiles[c] == 0)
        return MOE_OK;
    const int H = ep->c.H, nsm = ep_gemm_sms(ep);
    const int64_t rb = ep->rbase[c];
    const kcu_ffn f = ep_chunk_ffn(ep, c, nsm);
    const int32_t *rows = (ep->dd ? ep->sidx : ep->gidx) + rb;
    const bf16 *dy = ep->ysend;
    const int32_t *dygather = rows;
    if (ep->sorted) { /* the dy rows in expert order, in chunk c's dxsend region
                       * (the dx GEMM overwrites it after dh) */
        KCU_TRY(kcu_gather_rows(ep->ysend, MOE_BF16, rows, f.t.offs + ep->ne,
                                (int)(ep->rbase[c + 1] - rb), H, ep->dxsend + (size_t)rb * H, 0,
                                st));
        dy = ep->dxsend + (size_t)rb * H;
        dygather = nullptr;
    }
    /* no gate weights: k_ep_dy applied them to the dy rows */
    KCU_TRY(kcu_ffn_dh(&f, dy, dygather, nullptr, nullptr, nullptr, st));
    if (ep_dense_wgrad(ep)) { /* dW2 now, while the sorted dy rows are in dxsend */
        KCU_TRY(ep_dw2(ep, ep->dxsend, nullptr, nsm, st));
        ep->dw2_done = 1;
    }
    return kcu_ffn_dx(&f, ep->dxsend, MOE_BF16, rows, st);
}

/* the pipeline of one direction: chunk c computes while later chunks are
 * dispatched and earlier ones return. fwd: xsend -> xrecv -> (GEMMs)
 * -> ysend -> yrecv. bwd: xsend (w dy) -> ysend -> (GEMMs) -> dxsend ->
 * yrecv. */
moe_err ep_pipeline(kcu_ep *ep, int bwd, int train, cudaStream_t st)
{
    const int C = ep->C;
    bf16 *in_own = bwd ? ep->ysend : ep->xrecv, *out_own = bwd ? ep->dxsend : ep->ysend;
    KCU_CHECK(cudaStreamWaitEvent(ep->cs, ep->ev_a, 0));
    /* every dispatch first (they depend on nothing but the token side, so
     * the link never idles while a chunk computes), then each return as
     * soon as its chunk is computed */
    for (int c = 0; c < C; c++) {
        KCU_TRY(ep_exchange(ep, c, ep->xsend, in_own, 0));
        KCU_CHECK(cudaEventRecord(ep->ev_disp[c], ep->cs));
    }
    for (int c = 0; c < C; c++) {
        KCU_CHECK(cudaStreamWaitEvent(st, ep->ev_disp[c], 0));
        KCU_TRY(bwd ? ep_experts_bwd(ep, c, st) : ep_experts_fwd(ep, c, train, st));
        KCU_CHECK(cudaEventRecord(ep->ev_comp[c], st));
    }
    for (int c = 0; c < C; c++) {
        KCU_CHECK(cudaStreamWaitEvent(ep->cs, ep->ev_comp[c], 0));
        KCU_TRY(ep_exchange(ep, c, ep->yrecv, out_own, 1));
    }
    KCU_CHECK(cudaEventRecord(ep->ev_done, ep->cs));
    return MOE_OK;
}

/* routing state of the router view for T tokens from xb (T,H): for few
 * slots of an inference forward the decode router alone (kcu_route_small),
 * else the router GEMM, kcu_route and kcu_stats */
moe_err ep_route(kcu_ep *ep, int T, const bf16 *xb, int train, cudaStream_t st)
{
    kcu_layer *R = &ep->R;
    const int H = ep->c.H, E = ep->c.E;
    ep->stat_rows = KCU_CEIL_DIV(T, 256); /* kcu_stats' blocks */
    if (T > 0 && kcu_route_small_use(R, T, train)) {
        KCU_TRY(kcu_route_small(R, T, xb, INT_MAX, &ep->stat_rows, st));
    } else if (T > 0) {
        kcu_gemm_args a;
        memset(&a, 0, sizeof(a));
        a.A = xb;
        a.lda = H;
        a.B = R->wr;
        a.ldb = H;
        a.M = T;
        a.N = R->Ep;
        a.K = H;
        a.Cf = R->logits;
        a.ldc = R->Ep;
        KCU_TRY(kcu_gemm(KCU_A_K, KCU_B_K, KCU_EPI_F32, &a, ep->nsm, st));
        KCU_TRY(kcu_route(R, T, INT_MAX, 0, st));
        KCU_TRY(kcu_stats(R, T, st));
    } else {
        KCU_CHECK(cudaMemsetAsync(R->counts, 0, E * 4, st));
    }
    return MOE_OK;
}

/* the send rows of T tokens (xsend, sendpos) cut into ep->C chunks */
moe_err ep_pack(kcu_ep *ep, int T, const bf16 *xb, cudaStream_t st)
{
    kcu_layer *R = &ep->R;
    const int H = ep->c.H, E = ep->c.E, S = T * ep->c.K;
    k_ep_tab<<<1, 32, 0, st>>>(R->counts, E, ep->C, ep->tab);
    KCU_CHECK_LAUNCH();
    if (S > 0) {
        k_ep_gather<<<KCU_CEIL_DIV(S, 8), 256, 0, st>>>(xb, R->perm, R->tok, R->topk_idx, R->offs,
                                                        R->counts, ep->tab, S, E, H, ep->C,
                                                        ep->xsend, ep->sendpos);
        KCU_CHECK_LAUNCH();
    }
    return MOE_OK;
}

/* counts of every rank to the host; the overlap degree of this call (with
 * chunks 0: from the rows routed over all ranks, the same on every rank),
 * then the plan and its tables */
moe_err ep_exchange_counts(kcu_ep *ep, int train, cudaStream_t st)
{
    const int E = ep->c.E, W = ep->c.world;
    KCU_CHECK(cudaEventRecord(ep->ev_a, st));
    KCU_CHECK(cudaStreamWaitEvent(ep->cs, ep->ev_a, 0));
    KCU_TRY(EP_NCCL(ep, ncclAllGather(ep->R.counts, ep->cnt_all, E, ncclInt32, ep_xc(ep), ep->cs),
                    "ncclAllGather(counts)"));
    KCU_CHECK(
        cudaMemcpyAsync(ep->cnt_h, ep->cnt_all, (size_t)W * E * 4, cudaMemcpyDeviceToHost, ep->cs));
    KCU_CHECK(cudaEventRecord(ep->ev_cnt, ep->cs));
    KCU_TRY(ep_wait(ep, ep->ev_cnt, nullptr, "counts exchange"));
    if (ep->chunks_auto) {
        long long rows = 0;
        for (int i = 0; i < W * E; i++)
            rows += ep->cnt_h[i];
        ep->C = kcu_ep_auto_chunks(W, ep->c.F, rows / W, train);
    }
    KCU_TRY(ep_plan(ep));
    KCU_CHECK(
        cudaMemcpyAsync(ep->tbl_d, ep->tbl_h, (size_t)ep->t_len * 4, cudaMemcpyHostToDevice, st));
    return MOE_OK;
}

moe_err stage(kcu_ep *ep, const void *src, moe_dtype dt, bf16 *dst, size_t n, cudaStream_t st)
{
    if (dt == MOE_F32 && kcu_is_host_ptr(src)) {
        KCU_CHECK(cudaMemcpyAsync(ep->R.stage, src, n * 4, cudaMemcpyHostToDevice, st));
        src = ep->R.stage;
    }
    return kcu_to_bf16(src, dt, dst, n, st);
}

/* out (T,H) of dtype dt = the combine of the returned rows (yrecv, through
 * sendpos) weighted by w (or not), plus extra (T,H) f32, plus the shared
 * rows srows (T,H) (gated by the logits column glog, ld Ep, or not) */
moe_err finish_out(kcu_ep *ep, const float *w, const float *extra, const bf16 *srows,
                   const float *glog, int T, void *out, moe_dtype dt, cudaStream_t st)
{
    const int H = ep->c.H, host = kcu_is_host_ptr(out);
    KCU_CHECK(cudaStreamWaitEvent(st, ep->ev_done, 0));
    if (T == 0)
        return MOE_OK;
    void *dst = host ? (void *)ep->R.stage : out;
    KCU_TRY(kcu_shared_combine(ep->yrecv, ep->sendpos, nullptr, w, extra, srows, glog, ep->R.Ep, T,
                               ep->c.K, H, dst, dt, st));
    if (host) {
        /* a copy to pageable memory blocks the host until the stream gets
         * there: wait first, bounded, so a dead peer cannot hang us here */
        KCU_TRY(ep_wait(ep, nullptr, st, "layer"));
        KCU_CHECK(cudaMemcpyAsync(out, ep->R.stage, (size_t)T * H * (dt == MOE_F32 ? 4 : 2),
                                  cudaMemcpyDeviceToHost, st));
    }
    return MOE_OK;
}

/* ---- deduplicated dispatch (kcu_ep.h "Deduplicated dispatch") ----
 * Token side: a token with slots on rank q is sent to q once; the unique
 * send rows xsend are chunk-major (chunk c = tokens [floor(cT/C),
 * floor((c+1)T/C))), then destination, then token order, each with K int32
 * of metadata (msend, kcu_ep_dedup.cuh). The return keeps one row per
 * (token, slot): yrecv is chunk-major, then expert (= owner-major), then
 * token order (sendpos: slot -> return row), and the combine is
 * finish_out's as without dedup. Owner: chunk c's unique rows arrive
 * source-major in [urbase[c], urbase[c+1]) of xrecv with their metadata
 * (mrecv); kcu_epd_index turns them into gidx (GEMM row -> received row;
 * the up-projection gathers through it) and sidx (GEMM row -> return row;
 * the down-projection scatters through it) over the chunk's GEMM rows, which
 * are expert-major, then source, then token order (the tile lists of
 * ep_plan's kind). The return rows of chunk c, [rbase[c], rbase[c+1]) of
 * ysend, are source-major, then expert, then token order: ep_exchange sends
 * them back as it does without dedup. */

/* the counts block of rank q (kcu_ep_dedup.cuh) in the gathered counts */
const int32_t *epd_block(const kcu_ep *ep, int q)
{
    return ep->cnt_h + (size_t)q * ep->P * (ep->c.E + ep->c.world);
}

/* slots of rank q's chunk c routed to expert e: the sum of the chunk's slices */
int64_t epd_rows(const kcu_ep *ep, int q, int c, int e)
{
    const int32_t *b = epd_block(ep, q);
    const int m = ep->P / ep->C;
    int64_t n = 0;
    for (int s = c * m; s < (c + 1) * m; s++)
        n += b[(size_t)s * ep->c.E + e];
    return n;
}

/* unique rows of rank q's chunk c for destination d */
int64_t epd_uniq(const kcu_ep *ep, int q, int c, int d)
{
    const int32_t *b = epd_block(ep, q) + (size_t)ep->P * ep->c.E;
    const int m = ep->P / ep->C;
    int64_t n = 0;
    for (int s = c * m; s < (c + 1) * m; s++)
        n += b[(size_t)s * ep->c.world + d];
    return n;
}

/* rows of rank q's chunk c for owner o's experts */
int64_t epd_owner_rows(const kcu_ep *ep, int q, int c, int o)
{
    const int E = ep->c.E, W = ep->c.world;
    const int a = placement_first(E, W, o), b = a + placement_count(E, W, o);
    int64_t n = 0;
    for (int e = a; e < b; e++)
        n += epd_rows(ep, q, c, e);
    return n;
}

/* ep_ce_slots of this forward from the gathered counts (the same on every
 * rank): S[c] the most unique rows of chunk c from one source to one
 * destination (itself included: NCCL copies a rank's own slot too), R[c]
 * the most slot rows of chunk c from one source for one owner; the regions'
 * bases; the rows sent for real and with padding over all ranks */
void ce_slots(const kcu_ep *ep, ep_ce_slots *p)
{
    const int W = ep->c.world, C = ep->C;
    p->D[0] = p->B[0] = 0;
    p->real = 0;
    for (int c = 0; c < C; c++) {
        int64_t s = 0, r = 0;
        for (int q = 0; q < W; q++)
            for (int d = 0; d < W; d++) {
                const int64_t u = epd_uniq(ep, q, c, d), n = epd_owner_rows(ep, q, c, d);
                s = std::max(s, u);
                r = std::max(r, n);
                p->real += u + n;
            }
        p->S[c] = s;
        p->R[c] = r;
        p->D[c + 1] = p->D[c] + W * s;
        p->B[c + 1] = p->B[c] + W * r;
    }
    p->padded = (int64_t)W * (p->D[C] + p->B[C]);
}

/* whether this forward takes the CE path (ep->ce_fwd), decided from the
 * gathered counts only, so every rank decides the same and makes the same
 * collective calls (setup, growth) in the same order: an inference forward
 * with KCU_EP_CE not 0, the CE communicator up (set up here the first time),
 * padding at most 1.25x the real rows (rows over all ranks, both
 * directions; the copy engines move every slot whole), some rows to move,
 * and the windows big enough (grown here). Otherwise the send/recv path. */
moe_err ce_plan(kcu_ep *ep, int train, cudaStream_t st)
{
    ep->ce_fwd = 0;
    if (!ep->ce_want || train)
        return MOE_OK;
    ep_ce_slots &p = ep->cs_;
    ce_slots(ep, &p);
    const int C = ep->C;
    ep_ce_shared *s = ep->ce;
    int take = s->state >= 0 && p.real > 0 && p.padded * 4 <= p.real * 5 &&
               p.D[C] < INT32_MAX / 2 && p.B[C] < INT32_MAX / 2;
    if (take && s->state == 0)
        KCU_TRY(ce_setup(ep));
    take = take && s->state > 0;
    if (take && (p.D[C] > s->capx || p.B[C] > s->capy))
        KCU_TRY(ce_grow(ep, p.D[C], p.B[C], st));
    take = take && s->state > 0;
    if (take) {
        /* the windows are shared: the last CE forward (this layer's or
         * another's, maybe still running on the GPU) is done with them
         * before this one writes into them (the pack on st, next; the
         * transfers and GEMMs follow st) */
        if (s->ev_used)
            KCU_CHECK(cudaStreamWaitEvent(st, s->ev_free, 0));
        if (!s->acct)
            s->acct = ep;
        ep->ce_gen = s->gen;
    }
    ep->ce_fwd = take;
    ep->ce_n[take ? 0 : 1]++;
    return MOE_OK;
}

/* ep_plan for a dedup forward: statistics, transfer sizes (unique rows out,
 * slot rows back), tile lists, and the dedup tables */
moe_err epd_plan(kcu_ep *ep, int train, cudaStream_t st)
{
    const int E = ep->c.E, W = ep->c.world, C = ep->C, me = ep->c.rank, ne = ep->ne, K = ep->c.K;
    const int first = ep->first;
    ep->T_global = 0;
    for (int e = 0; e < E; e++)
        ep->counts_global[e] = 0;
    for (int q = 0; q < W; q++) {
        const int32_t *b = epd_block(ep, q);
        for (int i = 0; i < ep->P * (E + W); i++)
            if (b[i] < 0)
                return MOE_EINTERNAL;
        int64_t tq = 0;
        for (int e = 0; e < E; e++) {
            int64_t n = 0;
            for (int c = 0; c < C; c++)
                n += epd_rows(ep, q, c, e);
            ep->counts_global[e] += (int32_t)n;
            if (q == me)
                ep->counts_local[e] = (int32_t)n;
            tq += n;
        }
        ep->T_global += (int)(tq / K);
    }
    ep->sbase[0] = ep->rbase[0] = ep->usbase[0] = ep->urbase[0] = 0;
    for (int c = 0; c < C; c++) {
        int64_t s = 0, r = 0, us = 0, ur = 0;
        ep->max_urn[c] = 0;
        for (int q = 0; q < W; q++) {
            ep->send_rows[c][q] = epd_owner_rows(ep, me, c, q); /* back from q */
            ep->recv_rows[c][q] = epd_owner_rows(ep, q, c, me); /* back to q */
            ep->usend[c][q] = epd_uniq(ep, me, c, q);
            ep->urecv[c][q] = epd_uniq(ep, q, c, me);
            s += ep->send_rows[c][q];
            r += ep->recv_rows[c][q];
            us += ep->usend[c][q];
            ur += ep->urecv[c][q];
            ep->max_urn[c] = std::max(ep->max_urn[c], (int)ep->urecv[c][q]);
        }
        ep->sbase[c + 1] = ep->sbase[c] + s;
        ep->rbase[c + 1] = ep->rbase[c] + r;
        ep->usbase[c + 1] = ep->usbase[c] + us;
        ep->urbase[c + 1] = ep->urbase[c] + ur;
    }
    ep->N = ep->rbase[C];
    if (ep->N > INT32_MAX / 2 || ep->urbase[C] > ep->N)
        return MOE_EINVAL;
    /* table layout: ep_plan's parts, then the dedup tables */
    int tt = 0;
    for (int c = 0; c < C; c++) {
        int n = 0;
        for (int i = 0; i < ne; i++) {
            int64_t k = 0;
            for (int q = 0; q < W; q++)
                k += epd_rows(ep, q, c, first + i);
            n += (int)KCU_CEIL_DIV(k, (int64_t)KCU_BM);
        }
        ep->tiles[c] = n;
        ep->tbase[c] = tt;
        tt += n;
    }
    ep->t_offs = 0;
    ep->t_goffs = C * (ne + 1);
    ep->t_ntiles = ep->t_goffs + ne + 1;
    ep->t_rbase = ep->t_ntiles + C;
    ep->t_te = ep->t_rbase + C + 1;
    ep->t_tr = ep->t_te + tt + 1;
    ep->t_ctab = ep->t_tr + tt + 1;
    ep->t_cpre = ep->t_ctab + C * E;
    ep->t_utab = ep->t_cpre + C * E;
    ep->t_upre = ep->t_utab + C * W;
    ep->t_ur0 = ep->t_upre + C * W;
    ep->t_urn = ep->t_ur0 + C * W;
    ep->t_goff = ep->t_urn + C * W;
    ep->t_roff = ep->t_goff + C * W * ne;
    ep->t_wbase = ep->t_roff + C * W * ne;
    ep->t_len = ep->t_wbase + C * W * ne;
    KCU_TRY(ep_grow(ep, ep->N, ep->t_len));
    /* the CE path (its windows) or the send/recv path (ep_grow's buffers) */
    KCU_TRY(ce_plan(ep, train, st));
    ep_bind(ep, ep->ce_fwd);
    const ep_ce_slots &cp = ep->cs_;
    const int ce = ep->ce_fwd;
    int32_t *t = ep->tbl_h;
    for (int i = 0; i <= ne; i++)
        t[ep->t_goffs + i] = 0;
    for (int c = 0; c < C; c++) {
        /* the owner's GEMM rows of chunk c: expert-major offsets and tiles */
        int32_t *offs = t + ep->t_offs + c * (ne + 1);
        int32_t *te = t + ep->t_te + ep->tbase[c], *tr = t + ep->t_tr + ep->tbase[c];
        int o = 0, k = 0;
        for (int i = 0; i < ne; i++) {
            int64_t n = 0;
            for (int q = 0; q < W; q++)
                n += epd_rows(ep, q, c, first + i);
            offs[i] = o;
            for (int64_t r0 = 0; r0 < n; r0 += KCU_BM) {
                te[k] = i;
                tr[k] = o + (int)r0;
                k++;
            }
            o += (int)n;
            t[ep->t_goffs + i + 1] += (int32_t)n;
        }
        offs[ne] = o;
        t[ep->t_ntiles + c] = k;
        t[ep->t_rbase + c] = (int32_t)ep->rbase[c];
        /* token side: return rows of (c, e), expert e's slots in chunks
         * before c; unique send rows of (c, q), tokens on q before c. CE
         * path: owner o's rows of chunk c come back into the slot B[c] + o
         * R[c] of yrecv, and the unique rows for q go out from D[c] + q S[c]
         * of xsend */
        int64_t pos = ep->sbase[c];
        for (int e = 0; e < E; e++) {
            int64_t before = 0;
            for (int cc = 0; cc < c; cc++)
                before += epd_rows(ep, me, cc, e);
            if (ce) {
                const int o = placement_owner(E, W, e);
                if (e == placement_first(E, W, o))
                    pos = cp.B[c] + o * cp.R[c];
            }
            t[ep->t_ctab + c * E + e] = (int32_t)pos;
            t[ep->t_cpre + c * E + e] = (int32_t)before;
            pos += epd_rows(ep, me, c, e);
        }
        int64_t upos = ep->usbase[c], rpos = ep->urbase[c], ret = 0;
        for (int q = 0; q < W; q++) {
            int64_t before = 0;
            for (int cc = 0; cc < c; cc++)
                before += ep->usend[cc][q];
            if (ce) /* the same row on both sides: the slot of the pair */
                upos = rpos = cp.D[c] + q * cp.S[c];
            t[ep->t_utab + c * W + q] = (int32_t)upos;
            t[ep->t_upre + c * W + q] = (int32_t)before;
            upos += ep->usend[c][q];
            /* owner side: source q's unique rows, its slots' GEMM rows and
             * return rows per local expert (relative to rbase[c]; CE path:
             * in source q's slot B[c] + q R[c] of ysend) */
            t[ep->t_ur0 + c * W + q] = (int32_t)rpos;
            t[ep->t_urn + c * W + q] = (int32_t)ep->urecv[c][q];
            rpos += ep->urecv[c][q];
            int64_t r_in = ce ? cp.B[c] - ep->rbase[c] + q * cp.R[c] : ret;
            for (int i = 0; i < ne; i++) {
                int64_t g = offs[i];
                for (int qq = 0; qq < q; qq++)
                    g += epd_rows(ep, qq, c, first + i);
                t[ep->t_goff + (c * W + q) * ne + i] = (int32_t)g;
                t[ep->t_roff + (c * W + q) * ne + i] = (int32_t)r_in;
                r_in += epd_rows(ep, q, c, first + i);
            }
            ret += ep->recv_rows[c][q];
        }
    }
    t[ep->t_rbase + C] = (int32_t)ep->rbase[C];
    for (int i = 0; i < ne; i++)
        t[ep->t_goffs + i + 1] += t[ep->t_goffs + i];
    /* global expert-major rows (the weight gradients' groups): expert i's
     * rows of every chunk, chunk-major, each chunk's in GEMM row order */
    for (int i = 0; i < ne; i++) {
        int64_t g0 = t[ep->t_goffs + i];
        for (int c = 0; c < C; c++) {
            const int32_t *offs = t + ep->t_offs + c * (ne + 1);
            for (int q = 0; q < W; q++) {
                const int k = (c * W + q) * ne + i;
                t[ep->t_wbase + k] = (int32_t)(g0 + t[ep->t_goff + k] - offs[i]);
            }
            g0 += offs[i + 1] - offs[i];
        }
    }
    return MOE_OK;
}

/* the token side of a dedup forward up to the pipeline: the counts blocks
 * (one all-gather: the call's host synchronisation), this call's chunks,
 * the plan, and the send rows */
moe_err epd_prepare(kcu_ep *ep, int T, const bf16 *xb, int train, cudaStream_t st)
{
    kcu_layer *R = &ep->R;
    const int E = ep->c.E, W = ep->c.world, K = ep->c.K;
    /* chunks 0: slices for every degree kcu_ep_auto_chunks picks (1 or 4,
     * both dividing EP_MAX_CHUNKS), chosen after the exchange */
    ep->P = ep->chunks_auto ? EP_MAX_CHUNKS : ep->C;
    const int BW = ep->P * (E + W);
    KCU_TRY(kcu_epd_count(R->topk_idx, T, K, E, W, ep->P, ep->dcnt, ep->umask, ep->ubcnt, st));
    KCU_TRY(kcu_epd_rank(ep->umask, T, W, ep->ubcnt, ep->urank, st));
    KCU_CHECK(cudaEventRecord(ep->ev_a, st));
    KCU_CHECK(cudaStreamWaitEvent(ep->cs, ep->ev_a, 0));
    KCU_TRY(EP_NCCL(ep, ncclAllGather(ep->dcnt, ep->cnt_all, BW, ncclInt32, ep_xc(ep), ep->cs),
                    "ncclAllGather(dedup counts)"));
    KCU_CHECK(cudaMemcpyAsync(ep->cnt_h, ep->cnt_all, (size_t)W * BW * 4, cudaMemcpyDeviceToHost,
                              ep->cs));
    KCU_CHECK(cudaEventRecord(ep->ev_cnt, ep->cs));
    KCU_TRY(ep_wait(ep, ep->ev_cnt, nullptr, "counts exchange"));
    if (ep->chunks_auto) {
        long long rows = 0;
        for (int q = 0; q < W; q++)
            for (int i = 0; i < ep->P * E; i++)
                rows += epd_block(ep, q)[i];
        ep->C = kcu_ep_auto_chunks(W, ep->c.F, rows / W, train);
    }
    if (ep->P % ep->C)
        return MOE_EINTERNAL;
    KCU_TRY(epd_plan(ep, train, st));
    KCU_CHECK(
        cudaMemcpyAsync(ep->tbl_d, ep->tbl_h, (size_t)ep->t_len * 4, cudaMemcpyHostToDevice, st));
    const int32_t *tb = ep->tbl_d;
    return kcu_epd_pack(xb, R->perm, R->offs, R->topk_idx, ep->umask, ep->urank, T, K, E, W,
                        ep->c.H, ep->C, tb + ep->t_ctab, tb + ep->t_cpre, tb + ep->t_utab,
                        tb + ep->t_upre, ep->sendpos, ep->xsend, ep->msend, st);
}

/* chunk c's dispatch of unique rows: every peer's rows (bf16) and their
 * metadata (int32) in one group */
moe_err epd_dispatch(kcu_ep *ep, int c)
{
    const int W = ep->c.world, K = ep->c.K;
    const size_t H = ep->c.H;
    int64_t so = ep->usbase[c], ro = ep->urbase[c];
    KCU_TRY(EP_NCCL(ep, ncclGroupStart(), "ncclGroupStart"));
    moe_err err = MOE_OK;
    for (int q = 0; q < W && err == MOE_OK; q++) {
        const int64_t ns = ep->usend[c][q], nr = ep->urecv[c][q];
        if (ns) {
            err = EP_NCCL(ep,
                          ncclSend(ep->xsend + (size_t)so * H, (size_t)ns * H, ncclBfloat16, q,
                                   ep_xc(ep), ep->cs),
                          "ncclSend");
            if (err == MOE_OK)
                err = EP_NCCL(ep,
                              ncclSend(ep->msend + (size_t)so * K, (size_t)ns * K, ncclInt32, q,
                                       ep_xc(ep), ep->cs),
                              "ncclSend(meta)");
        }
        if (err == MOE_OK && nr) {
            err = EP_NCCL(ep,
                          ncclRecv(ep->xrecv + (size_t)ro * H, (size_t)nr * H, ncclBfloat16, q,
                                   ep_xc(ep), ep->cs),
                          "ncclRecv");
            if (err == MOE_OK)
                err = EP_NCCL(ep,
                              ncclRecv(ep->mrecv + (size_t)ro * K, (size_t)nr * K, ncclInt32, q,
                                       ep_xc(ep), ep->cs),
                              "ncclRecv(meta)");
        }
        so += ns;
        ro += nr;
    }
    moe_err e2 = EP_NCCL(ep, ncclGroupEnd(), "ncclGroupEnd");
    return err != MOE_OK ? err : e2;
}

/* the owner's forward GEMMs of chunk c: its index from the received
 * metadata, then xrecv (through gidx) -> ysend (through sidx); training
 * keeps ab (and the sorted rows in xg) and the weight gradients' indices */
moe_err epd_experts_fwd(kcu_ep *ep, int c, int train, cudaStream_t st)
{
    if (ep->tiles[c] == 0)
        return MOE_OK;
    const int H = ep->c.H, W = ep->c.world, ne = ep->ne;
    const int64_t rb = ep->rbase[c];
    const int32_t *tb = ep->tbl_d;
    KCU_TRY(kcu_epd_index(ep->mrecv, ep->c.K, W, ne, (int)rb, tb + ep->t_ur0 + c * W,
                          tb + ep->t_urn + c * W, ep->max_urn[c], tb + ep->t_goff + c * W * ne,
                          tb + ep->t_roff + c * W * ne, tb + ep->t_wbase + c * W * ne, ep->gidx,
                          ep->sidx, train ? ep->wgx : nullptr, train ? ep->wgh : nullptr,
                          train ? ep->wgy : nullptr, st));
    const kcu_ffn f = ep_chunk_ffn(ep, c, ep_gemm_sms(ep));
    const bf16 *xrows = ep->xrecv;
    const int32_t *xgather = ep->gidx + rb;
    if (ep->sorted) { /* the chunk's rows in expert order: kept in xg for dW13 when
                       * training, else in its ysend region (the down-projection
                       * overwrites it afterwards; CE path: the chunk's padded
                       * return region, which holds at least its rows) */
        const int64_t yb = ep->ce_fwd ? ep->cs_.B[c] : rb;
        bf16 *dst = train && ep->xg ? ep->xg + (size_t)rb * H : ep->ysend + (size_t)yb * H;
        KCU_TRY(kcu_gather_rows(ep->xrecv, MOE_BF16, ep->gidx + rb, f.t.offs + ne,
                                (int)(ep->rbase[c + 1] - rb), H, dst, 0, st));
        xrows = dst;
        xgather = nullptr;
    }
    return kcu_ffn_forward(&f, xrows, xgather, train, ep->ysend, MOE_BF16, ep->sidx + rb, st);
}

/* ep_pipeline's forward for a dedup forward: every chunk's unique rows out
 * first, each chunk's GEMMs as soon as its rows arrived, each return as
 * soon as its GEMMs finished (the backward is ep_pipeline's: its dy rows
 * go out and its dx rows come back along the return's paths) */
moe_err epd_pipeline(kcu_ep *ep, int train, cudaStream_t st)
{
    const int C = ep->C;
    KCU_CHECK(cudaStreamWaitEvent(ep->cs, ep->ev_a, 0));
    for (int c = 0; c < C; c++) {
        KCU_TRY(ep->ce_fwd ? ce_dispatch(ep, c) : epd_dispatch(ep, c));
        KCU_CHECK(cudaEventRecord(ep->ev_disp[c], ep->cs));
    }
    for (int c = 0; c < C; c++) {
        KCU_CHECK(cudaStreamWaitEvent(st, ep->ev_disp[c], 0));
        KCU_TRY(epd_experts_fwd(ep, c, train, st));
        KCU_CHECK(cudaEventRecord(ep->ev_comp[c], st));
    }
    for (int c = 0; c < C; c++) {
        KCU_CHECK(cudaStreamWaitEvent(ep->cs, ep->ev_comp[c], 0));
        KCU_TRY(ep->ce_fwd ? ce_return(ep, c) : ep_exchange(ep, c, ep->yrecv, ep->ysend, 1));
    }
    KCU_CHECK(cudaEventRecord(ep->ev_done, ep->cs));
    return MOE_OK;
}

/* ---- train states (kcu_ep.h "Train states") ---- */

/* the host fields of one forward's plan, which its backward reads: saved
 * and loaded as bytes when another state is selected */
// clang-format off
#define EP_PLAN_FIELDS(X)                                                                          \
    X(T) X(T_fwd) X(C) X(stat_rows) X(T_global) X(N) X(counts_local) X(counts_global)              \
    X(send_rows) X(recv_rows) X(sbase) X(rbase) X(tiles) X(tbase) X(t_offs) X(t_goffs)             \
    X(t_ntiles) X(t_rbase) X(t_te) X(t_tr) X(t_len) X(dd) X(P) X(usend) X(urecv) X(usbase)         \
    X(urbase) X(max_urn) X(t_ctab) X(t_cpre) X(t_utab) X(t_upre) X(t_ur0) X(t_urn) X(t_goff)       \
    X(t_roff) X(t_wbase) X(dw2_done) X(ce_fwd)
// clang-format on

#define EP_PLAN_SIZE(f) +sizeof(kcu_ep::f)
static_assert(0 EP_PLAN_FIELDS(EP_PLAN_SIZE) <= EP_PLAN_BYTES, "EP_PLAN_BYTES too small");
#undef EP_PLAN_SIZE

void plan_save(const kcu_ep *ep, unsigned char *b)
{
    size_t o = 0;
#define EP_PLAN_SAVE(f)                                                                            \
    memcpy(b + o, &ep->f, sizeof(ep->f));                                                          \
    o += sizeof(ep->f);
    EP_PLAN_FIELDS(EP_PLAN_SAVE)
#undef EP_PLAN_SAVE
}

void plan_load(kcu_ep *ep, const unsigned char *b)
{
    size_t o = 0;
#define EP_PLAN_LOAD(f)                                                                            \
    memcpy(&ep->f, b + o, sizeof(ep->f));                                                          \
    o += sizeof(ep->f);
    EP_PLAN_FIELDS(EP_PLAN_LOAD)
#undef EP_PLAN_LOAD
}

/* ep_tws_layout: the token side's pointers, the states' shared part from
 * shared and the selected state's from state; with NULL bases only the
 * sizes (*shared_b, *state_b; the pointers left NULL). Shared: the router's
 * weights, bias, gradient and grid-barrier words, and the scratch no
 * forward hands to its backward (each call writes it before it reads it,
 * on one stream): the f32 staging, the backward's dlogits, dw, dxr and
 * staged dy, ep_agree's word. Per state: the rest (the routing, its layout
 * and tables, the dispatch and return rows, the counts). */
void ep_tws_layout(kcu_ep *ep, char *shared, char *state, size_t *shared_b, size_t *state_b)
{
    const kcu_ep_config &c = ep->c;
    kcu_layer *R = &ep->R;
    const size_t T = c.T_max, S = T * c.K, H = c.H, E = c.E, Ep = R->Ep;
    const size_t nch = KCU_CEIL_DIV(S, (size_t)256), mt = S / KCU_BM + E + 1;
    /* int32 per rank in the counts exchange: E counts, or a dedup counts
     * block of up to EP_MAX_CHUNKS slices (kcu_ep_dedup.cuh) */
    const size_t ncnt = ep->dedup ? (size_t)EP_MAX_CHUNKS * (E + c.world) : E;
    size_t off[2] = {0, 0};
    char *base[2] = {shared, state};
    auto take = [&](int part, auto **ptr, size_t bytes) {
        *ptr =
            base[part]
                ? reinterpret_cast<std::remove_reference_t<decltype(*ptr)>>(base[part] + off[part])
                : nullptr;
        off[part] += al(bytes);
    };
    enum { SH = 0, ST = 1 };
    take(SH, &R->wr, Ep * H * 2);
    take(ST, &R->xs, T * H * 2);
    take(SH, &R->stage, T * H * 4);
    take(ST, &R->logits, T * Ep * 4);
    take(ST, &R->probs, T * E * 4);
    take(ST, &R->lse, T * 4);
    take(ST, &R->topk_idx, S * 4);
    take(ST, &R->topk_w, S * 4);
    take(ST, &R->counts, E * 4);
    take(ST, &R->offs, (E + 1) * 4);
    take(ST, &R->chunk, nch * E * 4);
    take(ST, &R->perm, S * 4);
    take(ST, &R->tok, S * 4);
    take(ST, &R->tile_e, mt * 4);
    take(ST, &R->tile_r0, mt * 4);
    take(ST, &R->ntiles, 4);
    take(ST, &R->cglob, E * 4);
    take(ST, &R->stats, 2 * 4);
    take(ST, &R->statpart,
         std::max(KCU_CEIL_DIV(T, (size_t)256), (size_t)KCU_RT_CTAS) * (E + 1) * 4);
    take(SH, &R->dsync, KCU_DSYNC_WORDS * 4);
    take(ST, &R->spos, S * 4);
    take(ST, &R->dropped, E * 4);
    take(SH, &R->bias, E * 4);
    if (ep->sh)
        take(ST, &ep->sy, T * H * 2);
    take(ST, &ep->xsend, S * H * 2);
    take(ST, &ep->yrecv, S * H * 2);
    take(ST, &ep->sendpos, S * 4);
    take(ST, &ep->tab, (size_t)EP_MAX_CHUNKS * E * 4);
    take(ST, &ep->cnt_all, (size_t)c.world * ncnt * 4);
    if (c.world > 1)
        take(SH, &ep->agree_d, 4);
    if (ep->dedup) {
        take(ST, &ep->dcnt, ncnt * 4);
        take(ST, &ep->umask, T * 8);
        take(ST, &ep->urank, T * c.world * 4);
        take(ST, &ep->ubcnt, KCU_CEIL_DIV(T, (size_t)256) * c.world * 4);
        take(ST, &ep->msend, T * std::min(c.world, c.K) * c.K * 4);
    }
    if (c.train) {
        take(SH, &R->g_wr, Ep * H * 4);
        take(SH, &R->dw, S * 4);
        take(SH, &R->dlogits, T * Ep * 2);
        take(SH, &R->dxr, T * H * 4);
        take(SH, &ep->dyb, T * H * 2);
    }
    ep->xsend_t = ep->xsend;
    ep->yrecv_t = ep->yrecv;
    ep->msend_t = ep->msend;
    if (shared_b)
        *shared_b = off[SH];
    if (state_b)
        *state_b = off[ST];
}

/* ows_layout: the owner side's pointers into ep->ows for cap_rows rows and a
 * table of cap_tbl int32 (the sizes ep_grow allocated); all NULL without
 * ows (a state before its first forward) */
void ows_layout(kcu_ep *ep)
{
    const size_t rows = ep->cap_rows, tbl = ep->cap_tbl;
    const size_t H = ep->c.H, F = ep->c.F, N1 = ep->N1;
    const int tr = ep->c.train;
    char *p = (char *)ep->ows;
    auto take = [&](size_t bytes) {
        char *q = p;
        if (p)
            p += al(bytes);
        return q;
    };
    ep->xrecv = (bf16 *)take(rows * H * 2);
    ep->ysend = (bf16 *)take(rows * H * 2);
    ep->h = (bf16 *)take(rows * F * 2);
    ep->gidx = (int32_t *)take(rows * 4);
    ep->tbl_d = (int32_t *)take(tbl * 4);
    ep->ab = ep->dxsend = ep->xg = nullptr;
    ep->wgx = ep->wgh = nullptr;
    if (tr) {
        ep->ab = (bf16 *)take(rows * N1 * 2);
        ep->dxsend = (bf16 *)take(rows * H * 2);
        if (ep->sorted)
            ep->xg = (bf16 *)take(rows * H * 2);
        ep->wgx = (int32_t *)take(rows * 4);
        ep->wgh = (int32_t *)take(rows * 4);
    }
    ep->mrecv = ep->sidx = ep->wgy = nullptr;
    if (ep->dedup) {
        ep->mrecv = (int32_t *)take(rows * ep->c.K * 4);
        ep->sidx = (int32_t *)take(rows * 4);
        if (tr)
            ep->wgy = (int32_t *)take(rows * 4);
    }
    ep->xrecv_o = ep->xrecv;
    ep->ysend_o = ep->ysend;
    ep->mrecv_o = ep->mrecv;
}

/* state_stash: the selected state's owner side and plan into ep->st[cur] */
void state_stash(kcu_ep *ep)
{
    ep_state *a = &ep->st[ep->cur];
    plan_save(ep, a->plan);
    a->ows = ep->ows;
    a->ows_bytes = ep->ows_bytes;
    a->cap_rows = ep->cap_rows;
    a->cap_tbl = ep->cap_tbl;
    a->tbl_h = ep->tbl_h;
}

} // namespace

extern "C" moe_err kcu_ep_create(const kcu_ep_config *cfg, void *comm, kcu_ep **out)
{
    *out = NULL;
    kcu_ep_config c = *cfg;
    if (c.chunks == 0) /* chosen per forward; this is the most it takes */
        c.chunks = kcu_ep_auto_chunks(c.world, c.F, LLONG_MAX, 0);
    if (c.timeout_ms <= 0)
        c.timeout_ms = 60000;
    if (!comm || c.H <= 0 || c.F <= 0 || c.H % 128 || c.F % 128 || c.E < 1 || c.E > 256 ||
        c.K < 1 || c.K > 8 || c.K > c.E || c.T_max < 1 || c.world < 1 || c.world > EP_MAX_WORLD ||
        c.world > c.E || c.rank < 0 || c.rank >= c.world || c.chunks < 1 ||
        c.chunks > EP_MAX_CHUNKS || (c.act != KERN_ACT_SWIGLU && c.act != KERN_ACT_GELU) ||
        (long long)c.T_max * c.K > INT32_MAX / 4) {
        fprintf(stderr, "kcu_ep_create: unsupported H=%d F=%d E=%d K=%d T_max=%d world=%d\n", c.H,
                c.F, c.E, c.K, c.T_max, c.world);
        return MOE_EINVAL;
    }
    /* routing family and shared expert: kcu_layer_create_ex's limits, but
     * the shared expert is one kcu_experts of d_ff m*F (no E + m <= 256) */
    const kcu_route_config *rt = &c.route;
    const int ng = rt->n_group > 1 ? rt->n_group : 1;
    const int tg = rt->topk_group > 0 ? rt->topk_group : ng;
    if ((rt->scoring != KERN_SCORE_SOFTMAX && rt->scoring != KERN_SCORE_SIGMOID) ||
        rt->n_group < 0 || rt->n_group > KCU_MAX_GROUPS || c.E % ng != 0 || rt->topk_group < 0 ||
        tg > ng || c.K > tg * (c.E / ng) || rt->group_topn < 0 || rt->group_topn > 2 ||
        !(rt->route_scale >= 0.0f) || isinf(rt->route_scale) || rt->shared_experts < 0 ||
        (long long)rt->shared_experts * c.F > 65536 ||
        (rt->shared_gate && rt->shared_experts == 0)) {
        fprintf(stderr,
                "kcu_ep_create: unsupported routing scoring=%d n_group=%d topk_group=%d "
                "group_topn=%d route_scale=%g shared_experts=%d shared_gate=%d (E=%d K=%d F=%d)\n",
                rt->scoring, rt->n_group, rt->topk_group, rt->group_topn, (double)rt->route_scale,
                rt->shared_experts, rt->shared_gate, c.E, c.K, c.F);
        return MOE_EINVAL;
    }
    const int m_sh = rt->shared_experts;
    kcu_ep *ep = (kcu_ep *)calloc(1, sizeof(*ep));
    if (!ep)
        return MOE_ENOMEM;
    ep->c = c;
    ep->C = c.chunks;
    ep->chunks_auto = cfg->chunks == 0;
    ep->comm = (ncclComm_t)comm;
    ep->first = placement_first(c.E, c.world, c.rank);
    ep->ne = placement_count(c.E, c.world, c.rank);
    ep->N1 = c.act == KERN_ACT_SWIGLU ? 2 * c.F : c.F;
    {
        kcu_config kc;
        memset(&kc, 0, sizeof(kc));
        kc.H = c.H;
        kc.F = c.F;
        ep->sorted = kcu_sorted_mode(&kc) > 0;
    }
    ep->rgrads_clean = 1;
    {
        /* deduplicated dispatch: c.dedup (-1 off, 1 or 2), else
         * KCU_EP_DEDUP (0, 1 or 2), else 1 (inference forwards); with peers
         * (alone there is nothing to save) and T_max < 2^24 (the metadata's
         * slot ranks, kcu_ep_dedup.cuh) */
        int want = c.dedup != 0 ? c.dedup : ep_dedup_env();
        want = want < 0 ? 0 : want > 2 ? 2 : want;
        ep->dedup = c.world > 1 && c.T_max < (1 << 24) ? want : 0;
        if (want && !ep->dedup && c.world > 1)
            fprintf(stderr, "kcu_ep_create: dedup off: T_max %d >= 2^24\n", c.T_max);
        /* the copy-engine exchange (kcu_ep.h): KCU_EP_CE not 0, inference
         * forwards of the dedup path; set up at the first forward that
         * takes it */
        ep->ce_want = ep->dedup && ep_ce_env();
    }
    int dev = 0;
    moe_err rc = MOE_OK;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&ep->nsm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaStreamCreateWithFlags(&ep->cs, cudaStreamNonBlocking) != cudaSuccess) {
        kcu_ep_destroy(ep);
        return MOE_EUNAVAIL;
    }
    /* the state shared with the other layers on comm: the exchange
     * communicator and the CE path (no collective call: each is set up at
     * the first forward that needs it) */
    if (c.world > 1 && !(ep->ce = ce_get(ep->comm))) {
        kcu_ep_destroy(ep);
        return MOE_ENOMEM;
    }
    cudaEvent_t *evs[] = {&ep->ev_a, &ep->ev_cnt, &ep->ev_done};
    for (auto e : evs)
        if (cudaEventCreateWithFlags(e, cudaEventDisableTiming) != cudaSuccess)
            rc = MOE_EINTERNAL;
    for (int i = 0; i < EP_MAX_CHUNKS; i++)
        if (cudaEventCreateWithFlags(&ep->ev_disp[i], cudaEventDisableTiming) != cudaSuccess ||
            cudaEventCreateWithFlags(&ep->ev_comp[i], cudaEventDisableTiming) != cudaSuccess)
            rc = MOE_EINTERNAL;
    if (rc == MOE_OK)
        rc = kcu_experts_create(c.H, c.F, ep->ne, c.act, 128, c.train, &ep->ex);
    /* the shared expert: one expert of d_ff m*F over this rank's T_max rows */
    if (rc == MOE_OK && m_sh > 0)
        rc = kcu_experts_create(c.H, m_sh * c.F, 1, c.act, c.T_max, c.train, &ep->sh);
    ep->gate = m_sh > 0 && rt->shared_gate;
    if (rc != MOE_OK) {
        kcu_ep_destroy(ep);
        return rc;
    }
    /* the router view and the token side */
    kcu_layer *R = &ep->R;
    R->c.H = c.H;
    R->c.F = c.F;
    R->c.E = c.E;
    R->c.K = c.K;
    R->c.act = c.act;
    R->c.renorm = c.renorm;
    R->c.T_max = c.T_max;
    R->c.train = c.train;
    /* the family without its shared experts (the layout holds the K routed
     * slots only; the shared expert is ep->sh), but the family router taken
     * exactly where kcu_layer_create_ex takes it, shared experts included,
     * so that both route with the same kernel; a shared gate's wsg is
     * router row E, as in kcu_layer */
    R->r = c.route;
    R->r.shared_experts = 0;
    R->r.shared_gate = 0;
    R->family = rt->scoring != KERN_SCORE_SOFTMAX || ng > 1 ||
                (rt->route_scale != 0.0f && rt->route_scale != 1.0f) || m_sh > 0;
    R->Ep = KCU_CEIL_DIV(c.E + ep->gate, KCU_BN) * KCU_BN;
    R->nsm = ep->nsm;
    const size_t T = c.T_max, S = T * c.K, H = c.H, E = c.E, Ep = R->Ep;
    const size_t mt = S / KCU_BM + E + 1;
    const size_t ncnt = ep->dedup ? (size_t)EP_MAX_CHUNKS * (E + c.world) : E;
    /* the token side: the part the states share, and one part per state
     * (kcu_ep.h "Train states"; a layer with a shared expert keeps one:
     * its kcu_experts holds its own kept forward) */
    size_t shared_b = 0, state_b = 0;
    ep_tws_layout(ep, nullptr, nullptr, &shared_b, &state_b);
    ep->nstates = c.train && c.states > 1 && !ep->sh
                      ? (c.states < KCU_EP_MAX_STATES ? c.states : KCU_EP_MAX_STATES)
                      : 1;
    ep->tws_bytes = shared_b;
    ep->tws_state_bytes = state_b;
    /* state 0's token side now; the others' at their first use */
    bool ok = cudaMalloc(&ep->tws, shared_b) == cudaSuccess &&
              cudaMalloc(&ep->st[0].tws, state_b) == cudaSuccess;
    ok = ok && cudaMallocHost((void **)&ep->cnt_h, (size_t)c.world * ncnt * 4) == cudaSuccess &&
         (c.world == 1 || cudaMallocHost((void **)&ep->agree_h, 4) == cudaSuccess);
    if (!ok) {
        (void)cudaGetLastError();
        fprintf(stderr, "kcu_ep_create: allocation of %zu + %zu bytes failed\n", shared_b, state_b);
        kcu_ep_destroy(ep);
        return MOE_ENOMEM;
    }
    ep_tws_layout(ep, (char *)ep->tws, (char *)ep->st[0].tws, nullptr, nullptr);
    R->max_tiles = (int)(mt - 1);
    if (cudaMemset(R->wr, 0, Ep * H * 2) != cudaSuccess ||
        cudaMemset(R->bias, 0, E * 4) != cudaSuccess ||
        cudaMemset(R->dsync, 0, KCU_DSYNC_WORDS * 4) != cudaSuccess) {
        kcu_ep_destroy(ep);
        return MOE_EINTERNAL;
    }
    for (int i = 1; i < ep->nstates; i++) /* every state starts as state 0 */
        plan_save(ep, ep->st[i].plan);
    *out = ep;
    return MOE_OK;
}

extern "C" void kcu_ep_destroy(kcu_ep *ep)
{
    if (!ep)
        return;
    /* before the device sync: the last layer's abort of the shared CE
     * communicator stops its copies */
    ep_ce_shared *ce_last = ce_put(ep);
    cudaDeviceSynchronize();
    if (ce_last)
        ce_free(ce_last);
    if (ep->ex)
        kcu_experts_destroy(ep->ex);
    if (ep->sh)
        kcu_experts_destroy(ep->sh);
    if (ep->tws)
        cudaFree(ep->tws);
    state_stash(ep); /* every state's buffers are in st[] */
    for (int i = 0; i < KCU_EP_MAX_STATES; i++) {
        if (ep->st[i].tws)
            cudaFree(ep->st[i].tws);
        if (ep->st[i].ows)
            cudaFree(ep->st[i].ows);
        if (ep->st[i].tbl_h)
            cudaFreeHost(ep->st[i].tbl_h);
    }
    if (ep->cnt_h)
        cudaFreeHost(ep->cnt_h);
    if (ep->agree_h)
        cudaFreeHost(ep->agree_h);
    if (ep->loc_h)
        cudaFreeHost(ep->loc_h);
    if (ep->loc_hd)
        cudaFree(ep->loc_hd);
    for (int t = 0; t <= EP_LOC_GRAPHS; t++)
        if (ep->loc_g[t].exec)
            cudaGraphExecDestroy(ep->loc_g[t].exec);
    if (ep->loc_st)
        cudaStreamDestroy(ep->loc_st);
    cudaEvent_t evs[] = {ep->ev_a, ep->ev_cnt, ep->ev_done};
    for (auto e : evs)
        if (e)
            cudaEventDestroy(e);
    for (int i = 0; i < EP_MAX_CHUNKS; i++) {
        if (ep->ev_disp[i])
            cudaEventDestroy(ep->ev_disp[i]);
        if (ep->ev_comp[i])
            cudaEventDestroy(ep->ev_comp[i]);
    }
    if (ep->cs)
        cudaStreamDestroy(ep->cs);
    free(ep);
}

/* a row threshold: the environment's value if set (negative: 0), else dflt */
static long long env_rows(const char *name, long long dflt)
{
    const char *s = getenv(name);
    const long long v = s && *s ? atoll(s) : dflt;
    return v < 0 ? 0 : v;
}

extern "C" int kcu_ep_auto_chunks(int world, int F, long long rows_per_rank, int train)
{
    /* 2 GPUs: one chunk at every batch measured (bench/NOTES.md, Qwen3 on
     * 2x H200, 16..16384 tokens per GPU: chunks 4 is 4-90% slower); more
     * GPUs: 4 chunks for small F from KCU_EP_CHUNK_ROWS (inference) or
     * KCU_EP_CHUNK_ROWS_TRAIN (training) routed rows per rank on (measured
     * on 4x H200: EP_CHUNK_ROWS) */
    static long long min_rows[2] = {-1, -1};
    if (min_rows[0] < 0) {
        min_rows[1] = env_rows("KCU_EP_CHUNK_ROWS_TRAIN", EP_CHUNK_ROWS_TRAIN);
        min_rows[0] = env_rows("KCU_EP_CHUNK_ROWS", EP_CHUNK_ROWS);
    }
    return world > 2 && F < 5333 && rows_per_rank >= min_rows[train != 0] ? 4 : 1;
}

/* each_state: f(ep) with each state in use selected in turn (a state never
 * used keeps nothing), up to the first nonzero answer, which it returns;
 * the selected state is selected again after */
template <class F> static int each_state(kcu_ep *ep, F f)
{
    const int keep = ep->cur;
    int r = 0;
    for (int i = 0; i < ep->nstates && !r; i++) {
        if (!ep->st[i].tws)
            continue;
        (void)kcu_ep_use_state(ep, i);
        r = f(ep);
    }
    (void)kcu_ep_use_state(ep, keep);
    return r;
}

extern "C" moe_err kcu_ep_set_chunks(kcu_ep *ep, int chunks, int comm_sms)
{
    const int autoc = chunks == 0;
    if (autoc)
        chunks = kcu_ep_auto_chunks(ep->c.world, ep->c.F, LLONG_MAX, 0);
    if (chunks < 1 || chunks > EP_MAX_CHUNKS || comm_sms < 0)
        return MOE_EINVAL;
    /* the states in use (a state's first use takes c.chunks); none may keep
     * a train forward */
    if (each_state(ep, [](kcu_ep *e) { return e->T_fwd > 0 ? 1 : 0; }))
        return MOE_EPRECOND;
    each_state(ep, [chunks](kcu_ep *e) {
        e->C = chunks;
        return 0;
    });
    ep->c.chunks = chunks;
    ep->chunks_auto = autoc;
    ep->c.comm_sms = comm_sms;
    return MOE_OK;
}

extern "C" int kcu_ep_states(const kcu_ep *ep)
{
    return ep->nstates;
}

extern "C" moe_err kcu_ep_use_state(kcu_ep *ep, int s)
{
    if (s < 0 || s >= ep->nstates)
        return MOE_EINVAL;
    if (s == ep->cur)
        return MOE_OK;
    ep_state *b = &ep->st[s];
    const int fresh = !b->tws; /* its first use: its token side now */
    if (fresh && cudaMalloc(&b->tws, ep->tws_state_bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        b->tws = nullptr;
        fprintf(stderr, "kcu_ep: rank %d: train state %d: allocation of %zu bytes failed\n",
                ep->c.rank, s, ep->tws_state_bytes);
        return MOE_ENOMEM;
    }
    state_stash(ep);
    plan_load(ep, b->plan);
    if (fresh) { /* the plan as at create, with today's overlap degree */
        ep->C = ep->c.chunks;
        ep->T_fwd = 0;
    }
    ep->ows = b->ows;
    ep->ows_bytes = b->ows_bytes;
    ep->cap_rows = b->cap_rows;
    ep->cap_tbl = b->cap_tbl;
    ep->tbl_h = b->tbl_h;
    ep_tws_layout(ep, (char *)ep->tws, (char *)b->tws, nullptr, nullptr);
    ows_layout(ep); /* NULL before the state's first forward (ep_grow makes them) */
    ep_bind(ep, 0);
    ep->cur = s;
    return MOE_OK;
}

/* forget_train_forwards: no state keeps a train forward (new weights) */
static void forget_train_forwards(kcu_ep *ep)
{
    each_state(ep, [](kcu_ep *e) {
        e->T_fwd = 0;
        return 0;
    });
}

extern "C" moe_err kcu_ep_upload(kcu_ep *ep, const float *wr, const float *w1, const float *w3,
                                 const float *w2)
{
    KCU_TRY(ep_quiesce(ep, "weights upload"));
    KCU_TRY(kcu_ep_upload_router(ep, wr));
    KCU_TRY(kcu_experts_upload(ep->ex, w1, w3, w2));
    ep->rgrads_clean = 1;
    forget_train_forwards(ep);
    return MOE_OK;
}

extern "C" moe_err kcu_ep_upload_router(kcu_ep *ep, const float *wr)
{
    if (!wr)
        return MOE_EINVAL;
    const size_t n = (size_t)ep->c.E * ep->c.H;
    uint16_t *b = (uint16_t *)malloc(n * 2);
    if (!b)
        return MOE_ENOMEM;
    for (size_t i = 0; i < n; i++)
        b[i] = kcu_host_bf16(wr[i]);
    const cudaError_t e = cudaMemcpy(ep->R.wr, b, n * 2, cudaMemcpyHostToDevice);
    free(b);
    KCU_CHECK(e);
    return MOE_OK;
}

/* kcu_ep_forward's work (kcu_ep_forward orders the CE windows' next use
 * after it, whatever its outcome) */
static moe_err ep_forward(kcu_ep *ep, int T, const void *x, moe_dtype x_dtype, void *y,
                          moe_dtype y_dtype, int train, cudaStream_t st)
{
    if (T < 0 || T > ep->c.T_max || (train && !ep->c.train) || (T > 0 && (!x || !y)) ||
        (x_dtype != MOE_F32 && x_dtype != MOE_BF16) || (y_dtype != MOE_F32 && y_dtype != MOE_BF16))
        return MOE_EINVAL;
    if (ep->ce && ep->ce->fast_state == 0)
        KCU_TRY(fast_setup(ep));
    ep->T_fwd = 0;
    ep->T = T;
    ep->ce_fwd = 0; /* epd_plan may take the CE path; until then send/recv's buffers */
    if (ep->ows)
        ep_bind(ep, 0);
    const bf16 *xb = ep->R.xs;
    if (T > 0) {
        if (x_dtype == MOE_BF16 && !train && !kcu_is_host_ptr(x))
            xb = (const bf16 *)x;
        else
            KCU_TRY(stage(ep, x, x_dtype, ep->R.xs, (size_t)T * ep->c.H, st));
    }
    KCU_TRY(ep_route(ep, T, xb, train, st));
    /* dedup 1: inference forwards; 2: train forwards too (their backward
     * follows them: ep_experts_bwd, wgy) */
    ep->dd = ep->dedup == 2 || (ep->dedup == 1 && !train);
    if (ep->dd) {
        KCU_TRY(epd_prepare(ep, T, xb, train, st)); /* sets this call's chunks */
    } else {
        KCU_TRY(ep_exchange_counts(ep, train, st)); /* sets this call's chunks */
        KCU_TRY(ep_pack(ep, T, xb, st));
    }
    if (ep->N > 0 && !ep->dd) {
        const int W = ep->c.world, ne = ep->ne;
        k_ep_index<<<dim3(ne, W, ep->C), 128, 0, st>>>(
            ep->cnt_all, ep->tbl_d, ep->t_offs, ep->t_goffs, ep->t_rbase, ep->c.E, W, ep->first, ne,
            ep->C, ep->gidx, train ? ep->wgx : nullptr, train ? ep->wgh : nullptr);
        KCU_CHECK_LAUNCH();
    }
    KCU_CHECK(cudaEventRecord(ep->ev_a, st));
    if (ep->sh && T > 0) {
        /* the shared expert on this rank's T tokens: ys (T,H) = expert(xb),
         * while the dispatch flies (so it leaves NCCL its SMs when there
         * are peers); kept for the gate's gradient */
        const int32_t rows = T;
        ep->sh->nsm = ep->c.world > 1 && !ep->ce_fwd ? ep_overlap_sms(ep) : ep->nsm;
        KCU_TRY(kcu_experts_forward(ep->sh, T, xb, MOE_BF16, &rows, ep->sy, MOE_BF16, train, st));
    }
    KCU_TRY(ep->dd ? epd_pipeline(ep, train, st) : ep_pipeline(ep, 0, train, st));
    KCU_TRY(finish_out(ep, ep->R.topk_w, nullptr, ep->sy,
                       ep->gate ? ep->R.logits + ep->c.E : nullptr, T, y, y_dtype, st));
    ep->T_fwd = train ? (T > 0 ? T : -1) : 0; /* -1: a train forward of no tokens */
    return MOE_OK;
}

extern "C" moe_err kcu_ep_forward(kcu_ep *ep, int T, const void *x, moe_dtype x_dtype, void *y,
                                  moe_dtype y_dtype, int train, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    ep->ce_fwd = 0;
    moe_err e = ep_forward(ep, T, x, x_dtype, y, y_dtype, train, st);
    if (ep->ce_fwd) { /* the shared windows' next user waits for this forward */
        const moe_err e2 = ce_windows_done(ep, st);
        e = e != MOE_OK ? e : e2;
    }
    return e;
}

extern "C" moe_err kcu_ep_backward(kcu_ep *ep, const void *dy, moe_dtype dy_dtype, void *dx,
                                   moe_dtype dx_dtype, float aux_coef, float z_coef, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    if (!ep->c.train || ep->T_fwd == 0)
        return MOE_EPRECOND;
    if ((dy_dtype != MOE_F32 && dy_dtype != MOE_BF16) ||
        (dx_dtype != MOE_F32 && dx_dtype != MOE_BF16))
        return MOE_EINVAL;
    const int T = ep->T_fwd > 0 ? ep->T_fwd : 0, H = ep->c.H, K = ep->c.K, E = ep->c.E;
    const int S = T * K;
    kcu_layer *R = &ep->R;
    kcu_experts *x = ep->ex;
    if (T > 0) {
        KCU_TRY(stage(ep, dy, dy_dtype, ep->dyb, (size_t)T * H, st));
        k_ep_dy<<<KCU_CEIL_DIV(S, 8), 256, 0, st>>>(ep->dyb, ep->yrecv, ep->sendpos, R->topk_w, S,
                                                    K, H, R->dw, ep->xsend);
        KCU_CHECK_LAUNCH();
        KCU_CHECK(cudaMemcpyAsync(R->cglob, ep->counts_global, E * 4, cudaMemcpyHostToDevice, st));
        KCU_TRY(kcu_router_bwd(R, T, ep->T_global, aux_coef, z_coef, st));
        if (ep->gate) { /* dlogits[:, E] (k_router_bwd left it zero); dyb *= g */
            KCU_TRY(kcu_shared_gate_bwd(ep->dyb, MOE_BF16, ep->sy, R->logits + E, R->Ep, T, H,
                                        ep->dyb, R->dlogits + E, st));
        }
        kcu_gemm_args a;
        memset(&a, 0, sizeof(a)); /* dxr (T,H) = dlogits (T,Ep) wr (Ep,H) */
        a.A = R->dlogits;
        a.lda = R->Ep;
        a.B = R->wr;
        a.ldb = H;
        a.M = T;
        a.N = H;
        a.K = R->Ep;
        a.Cf = R->dxr;
        a.ldc = H;
        KCU_TRY(kcu_gemm(KCU_A_K, KCU_B_N, KCU_EPI_F32, &a, ep->nsm, st));
        memset(&a, 0, sizeof(a)); /* g_wr (Ep,H) += dlogits^T xs */
        a.A = R->dlogits;
        a.lda = R->Ep;
        a.B = R->xs;
        a.ldb = H;
        a.M = R->Ep;
        a.N = H;
        a.K = T;
        a.ngroups = 1;
        a.Cf = R->g_wr;
        a.beta0 = ep->rgrads_clean;
        a.ldc = H;
        KCU_TRY(kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, ep->nsm, st));
        ep->rgrads_clean = 0;
    }
    KCU_CHECK(cudaEventRecord(ep->ev_a, st));
    if (ep->sh && T > 0) {
        /* the shared expert's backward while the w*dy rows are dispatched:
         * dy rows dyb ((g dy) with a gate), its dx rows into sy (ys is no
         * longer needed), its weight gradients accumulated */
        ep->sh->nsm = ep->c.world > 1 ? ep_overlap_sms(ep) : ep->nsm;
        KCU_TRY(kcu_experts_backward(ep->sh, ep->dyb, MOE_BF16, ep->sy, MOE_BF16, st));
    }
    ep->dw2_done = 0;
    KCU_TRY(ep_pipeline(ep, 1, 1, st));
    if (ep->N > 0) {
        /* weight gradients over every chunk's rows, while the last returns
         * fly (so they leave NCCL its SMs whenever there are peers) */
        const int wsm = ep->c.world > 1 ? ep_overlap_sms(ep) : ep->nsm;
        const kcu_ffn f = ep_ffn(ep, wsm);
        if (ep_dense_wgrad(ep)) /* dW13 += dab^T x: ab and the kept x rows in expert order */
            KCU_TRY(kcu_ffn_dw13(&f, ep->xg, nullptr, st));
        else /* ab through wgh, the received x rows through wgx */
            KCU_TRY(kcu_ffn_dw13(&f, ep->xrecv, ep->wgx, st));
        if (!ep->dw2_done) /* dW2 += dye^T h (dedup: the dy rows through wgy) */
            KCU_TRY(ep_dw2(ep, ep->ysend, ep->dd ? ep->wgy : ep->wgx, wsm, st));
        x->grads_clean = 0;
    }
    KCU_TRY(
        finish_out(ep, nullptr, T > 0 ? R->dxr : nullptr, ep->sy, nullptr, T, dx, dx_dtype, st));
    ep->T_fwd = 0;
    return MOE_OK;
}

extern "C" moe_err kcu_ep_wait(kcu_ep *ep, void *stream)
{
    return ep_wait(ep, nullptr, (cudaStream_t)stream, "layer");
}

extern "C" void kcu_ep_last_counts(const kcu_ep *ep, int32_t *counts_local, int32_t *counts_global,
                                   int *T_global, int64_t *rows_in)
{
    if (counts_local)
        memcpy(counts_local, ep->counts_local, (size_t)ep->c.E * 4);
    if (counts_global)
        memcpy(counts_global, ep->counts_global, (size_t)ep->c.E * 4);
    if (T_global)
        *T_global = ep->T_global;
    if (rows_in)
        *rows_in = ep->N;
}

extern "C" moe_err kcu_ep_stats(kcu_ep *ep, double *probs_sum, double *z_sum, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    const int E = ep->c.E, T = ep->T, nblk = ep->stat_rows;
    if (probs_sum)
        for (int e = 0; e < E; e++)
            probs_sum[e] = 0;
    if (z_sum)
        *z_sum = 0;
    if (T <= 0)
        return MOE_OK;
    /* statpart (nblk, E+1): per 256-token block (kcu_stats) or per router
     * CTA (kcu_route_small), column sums of probs and the sum of lse^2;
     * summed here in row order */
    float *part = (float *)malloc((size_t)nblk * (E + 1) * 4);
    if (!part)
        return MOE_ENOMEM;
    cudaError_t ce = cudaMemcpyAsync(part, ep->R.statpart, (size_t)nblk * (E + 1) * 4,
                                     cudaMemcpyDeviceToHost, st);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(st);
    if (ce != cudaSuccess) {
        free(part);
        KCU_CHECK(ce);
    }
    for (int b = 0; b < nblk; b++) {
        const float *p = part + (size_t)b * (E + 1);
        for (int e = 0; probs_sum && e < E; e++)
            probs_sum[e] += p[e];
        if (z_sum)
            *z_sum += p[E];
    }
    free(part);
    return MOE_OK;
}

extern "C" int kcu_ep_last_chunks(const kcu_ep *ep)
{
    return ep->C;
}

extern "C" int64_t kcu_ep_last_a2a_bytes(const kcu_ep *ep)
{
    if (ep->dd) { /* unique rows with their metadata out, slot rows back */
        int64_t back = 0;
        for (int c = 0; c < ep->C; c++)
            for (int q = 0; q < ep->c.world; q++)
                if (q != ep->c.rank)
                    back += ep->recv_rows[c][q];
        return kcu_ep_last_send_bytes(ep) + back * ep->c.H * 2;
    }
    int64_t rows = 0;
    for (int c = 0; c < ep->C; c++)
        for (int q = 0; q < ep->c.world; q++)
            if (q != ep->c.rank)
                rows += ep->send_rows[c][q] + ep->recv_rows[c][q];
    return rows * ep->c.H * 2;
}

extern "C" moe_err kcu_ep_download_router_grad(kcu_ep *ep, float *dwr)
{
    if (!ep->c.train)
        return MOE_EPRECOND;
    const size_t n = (size_t)ep->c.E * ep->c.H;
    KCU_TRY(ep_quiesce(ep, "router gradient download"));
    KCU_CHECK(cudaDeviceSynchronize());
    if (ep->rgrads_clean) {
        memset(dwr, 0, n * 4);
        return MOE_OK;
    }
    KCU_CHECK(cudaMemcpy(dwr, ep->R.g_wr, n * 4, cudaMemcpyDeviceToHost));
    return MOE_OK;
}

extern "C" moe_err kcu_ep_zero_grads(kcu_ep *ep)
{
    if (!ep->c.train)
        return MOE_EPRECOND;
    ep->rgrads_clean = 1;
    if (ep->sh)
        KCU_TRY(kcu_experts_zero_grads(ep->sh, nullptr));
    return kcu_experts_zero_grads(ep->ex, nullptr);
}

extern "C" struct kcu_experts *kcu_ep_experts(kcu_ep *ep)
{
    return ep->ex;
}

extern "C" struct kcu_experts *kcu_ep_shared_experts(kcu_ep *ep)
{
    return ep->sh;
}

extern "C" moe_err kcu_ep_upload_bias(kcu_ep *ep, const float *bias)
{
    const size_t E = ep->c.E;
    KCU_TRY(ep_quiesce(ep, "bias upload"));
    if (!bias) {
        KCU_CHECK(cudaMemset(ep->R.bias, 0, E * 4));
        ep->R.has_bias = 0;
        return MOE_OK;
    }
    KCU_CHECK(cudaMemcpy(ep->R.bias, bias, E * 4, cudaMemcpyHostToDevice));
    ep->R.has_bias = 1;
    return MOE_OK;
}

extern "C" moe_err kcu_ep_upload_shared(kcu_ep *ep, const float *ws1, const float *ws3,
                                        const float *ws2, const float *wsg)
{
    const int swiglu = ep->c.act == KERN_ACT_SWIGLU;
    if (!ep->sh || !ws1 || !ws2 || (swiglu && !ws3) || (ep->gate && !wsg))
        return MOE_EINVAL;
    /* one expert of d_ff Fs: ws1, ws3 (1,Fs,H) and ws2 (1,H,Fs) are
     * kcu_experts_upload's shapes as they are */
    KCU_TRY(kcu_experts_upload(ep->sh, ws1, swiglu ? ws3 : nullptr, ws2));
    if (ep->gate) { /* wsg (H) -> router row E, bf16 */
        const size_t H = ep->c.H;
        uint16_t *b = (uint16_t *)malloc(H * 2);
        if (!b)
            return MOE_ENOMEM;
        for (size_t i = 0; i < H; i++)
            b[i] = kcu_host_bf16(wsg[i]);
        const cudaError_t e =
            cudaMemcpy(ep->R.wr + (size_t)ep->c.E * H, b, H * 2, cudaMemcpyHostToDevice);
        free(b);
        KCU_CHECK(e);
    }
    forget_train_forwards(ep); /* the shared expert's kept forward is gone (as kcu_ep_upload) */
    return MOE_OK;
}

extern "C" moe_err kcu_ep_download_shared_grads(kcu_ep *ep, float *dws1, float *dws3, float *dws2,
                                                float *dwsg)
{
    if (!ep->c.train)
        return MOE_EPRECOND;
    if (!ep->sh)
        return MOE_EINVAL;
    KCU_TRY(ep_quiesce(ep, "shared expert gradients download"));
    KCU_TRY(kcu_experts_download_grads(ep->sh, dws1, dws3, dws2)); /* synchronises the device */
    if (dwsg && ep->gate) {
        const size_t H = ep->c.H;
        if (ep->rgrads_clean)
            memset(dwsg, 0, H * 4);
        else
            KCU_CHECK(
                cudaMemcpy(dwsg, ep->R.g_wr + (size_t)ep->c.E * H, H * 4, cudaMemcpyDeviceToHost));
    }
    return MOE_OK;
}

extern "C" size_t kcu_ep_bytes(const kcu_ep *ep)
{
    size_t p = 0, w = 0, sp = 0, sw = 0;
    kcu_experts_bytes(ep->ex, &p, &w);
    if (ep->sh)
        kcu_experts_bytes(ep->sh, &sp, &sw);
    /* the shared CE windows once per worker: in the layer that accounts
     * for them (ep_ce_shared.acct), 0 in the others */
    const size_t ce = ep->ce && ep->ce->acct == ep ? 2 * ep->ce->bytes : 0;
    size_t own = ep->tws_bytes;
    for (int i = 0; i < ep->nstates; i++)
        own += (ep->st[i].tws ? ep->tws_state_bytes : 0) +
               (i == ep->cur ? ep->ows_bytes : ep->st[i].ows_bytes);
    return p + w + sp + sw + own + ce;
}

/* the local experts' rows of the fan-out forward (expert-major, counts cnt
 * of the ne experts, n in all) through ex in pieces of at most N_max rows:
 * xe (n,H) device bf16 in, ye (n,H) device bf16 out */
static moe_err local_experts(kcu_ep *ep, const int32_t *cnt, int64_t n, const bf16 *xe, bf16 *ye,
                             cudaStream_t st)
{
    kcu_experts *x = ep->ex;
    const int H = ep->c.H, ne = ep->ne;
    int32_t piece[256];
    int64_t done = 0;    /* rows handed out so far */
    int e = 0, used = 0; /* expert e's rows already taken by earlier pieces */
    while (done < n) {
        int64_t rows = 0;
        memset(piece, 0, sizeof(piece));
        while (e < ne && rows < x->N_max) {
            const int64_t left = cnt[e] - used, take = std::min<int64_t>(left, x->N_max - rows);
            piece[e] = (int32_t)take;
            rows += take;
            used += (int)take;
            if (used == cnt[e]) {
                e++;
                used = 0;
            }
        }
        KCU_TRY(kcu_experts_forward(x, (int)rows, xe + (size_t)done * H, MOE_BF16, piece,
                                    ye + (size_t)done * H, MOE_BF16, 0, st));
        done += rows;
    }
    return MOE_OK;
}

/* the pinned host mirror of the fan-out forward (ep->loc_h), grown to need,
 * mapped into the device's address space (loc_d: every 64-bit CUDA system
 * maps page-locked memory; MOE_EINTERNAL where it is not) */
static moe_err loc_reserve(kcu_ep *ep, size_t need)
{
    if (need <= ep->loc_bytes)
        return MOE_OK;
    if (ep->loc_h)
        cudaFreeHost(ep->loc_h);
    ep->loc_h = ep->loc_d = nullptr;
    ep->loc_bytes = 0;
    KCU_CHECK(cudaMallocHost(&ep->loc_h, need));
    ep->loc_bytes = need;
    ep->loc_gen++; /* the graphs name the old mirror */
    KCU_CHECK(cudaHostGetDevicePointer(&ep->loc_d, ep->loc_h, 0));
    return MOE_OK;
}

/* the mirror's parts for a forward of T tokens (byte offsets): x in (bf16);
 * counts; the slot of each sorted row; the weights; the statistics (the
 * statpart rows, at most one per router CTA or 256-token block, or probs
 * then lse); the shared gate's logits; the expert rows out (at their
 * sorted rows on the chain, from 0 on the two-step path); the shared rows */
struct loc_parts {
    size_t x, cnt, perm, w, stat, glog, ye, ys, need;
};

static loc_parts loc_layout(const kcu_ep *ep, int T, size_t shn)
{
    const size_t H = ep->c.H, E = ep->c.E, S = (size_t)T * ep->c.K;
    const size_t nstat = std::max((size_t)KCU_RT_CTAS, (size_t)KCU_CEIL_DIV(T, 256));
    loc_parts o;
    o.x = 0;
    o.cnt = al((size_t)T * H * 2);
    o.perm = o.cnt + al(E * 4);
    o.w = o.perm + al(S * 4);
    o.stat = o.w + al(S * 4);
    o.glog = o.stat + al(nstat * (E + 1) * 4);
    o.ye = o.glog + al(shn * 4);
    o.ys = o.ye + al(S * H * 2);
    o.need = o.ys + al(shn * H * 2);
    return o;
}

/* the routing of a fan-out forward into the mapped mirror: counts (E),
 * perm and topk_w (S), then a (na words) and b (nb words) one after the
 * other from the statistics part */
static moe_err loc_copies(kcu_ep *ep, const loc_parts &o, size_t S, const void *a, size_t na,
                          const void *b, size_t nb, cudaStream_t st)
{
    char *db = (char *)ep->loc_d;
    ep_copies c;
    memset(&c, 0, sizeof(c));
    const void *src[5] = {ep->R.counts, ep->R.perm, ep->R.topk_w, a, b};
    char *dst[5] = {db + o.cnt, db + o.perm, db + o.w, db + o.stat, db + o.stat + na * 4};
    const size_t n[5] = {(size_t)ep->c.E, S, S, na, nb};
    size_t most = 0;
    for (int k = 0; k < 5; k++) {
        c.src[k] = (const uint32_t *)src[k];
        c.dst[k] = (uint32_t *)dst[k];
        c.n[k] = src[k] ? (int)n[k] : 0;
        most = std::max(most, n[k]);
    }
    const int grid = std::max(1, (int)std::min<size_t>(KCU_CEIL_DIV(most, (size_t)256), 32));
    k_ep_copies<<<grid, 256, 0, st>>>(c);
    KCU_CHECK_LAUNCH();
    return MOE_OK;
}

/* KCU_LOCAL_TRACE=N: where a fan-out forward's host time goes
 * (common/step_trace.h); the chain leaves steps 2 and 4-6 at 0 */
static step_trace loc_tr = {
    "KCU_LOCAL_TRACE",
    "kcu_ep_forward_local",
    8,
    {"x in", "route", "copies out", "sync 1", "experts", "host", "sync 2", "rows out"},
    -1,
    0,
    {0}};

/* the decode chain's work on st: x from the mapped mirror to the device
 * (read in place over PCIe the up kernel would read it once per weight
 * tile: 105 us a T=1 chain on an H200, against 67 for the two steps), the
 * chain, the copies of the routing into the mirror */
static moe_err chain_enqueue(kcu_ep *ep, int T, const loc_parts &o, cudaStream_t st)
{
    const int H = ep->c.H, E = ep->c.E;
    char *db = (char *)ep->loc_d;
    ep_copies c;
    memset(&c, 0, sizeof(c));
    c.src[0] = (const uint32_t *)(db + o.x);
    c.dst[0] = (uint32_t *)ep->R.xs;
    c.n[0] = (int)((size_t)T * H / 2);
    const int grid = (int)std::min<size_t>(KCU_CEIL_DIV((size_t)c.n[0], (size_t)256), 32);
    k_ep_copies<<<grid, 256, 0, st>>>(c);
    KCU_CHECK_LAUNCH();
    KCU_TRY(kcu_decode_local(&ep->R, ep->ex, ep->first, T, ep->R.xs, ep->loc_hd, db + o.ye, st));
    return loc_copies(ep, o, (size_t)T * ep->c.K, ep->R.probs, (size_t)T * E, ep->R.lse, (size_t)T,
                      st);
}

/* KCU_LOCAL_GRAPH=0: the chain launched kernel by kernel every call */
static int loc_graph_on()
{
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("KCU_LOCAL_GRAPH");
        on = v && *v ? atoi(v) != 0 : 1;
    }
    return on;
}

/* the chain of T rows as one graph launch on ep->loc_st (four kernel
 * launches cost ~20 us of host time before the device starts; a graph
 * launch one). A T's first call runs uncaptured (the kernels' one-time
 * set-up, e.g. shared memory limits, stays out of the capture), its second
 * is captured; a capture that fails leaves that T uncaptured for good. */
static moe_err chain_graph(kcu_ep *ep, int T, const loc_parts &o)
{
    if (!ep->loc_st)
        KCU_CHECK(cudaStreamCreateWithFlags(&ep->loc_st, cudaStreamNonBlocking));
    if (T < 1 || T > EP_LOC_GRAPHS) /* one graph slot per T up to EP_LOC_GRAPHS */
        return chain_enqueue(ep, T, o, ep->loc_st);
    auto &g = ep->loc_g[T];
    if (g.exec && g.gen == ep->loc_gen) {
        KCU_CHECK(cudaGraphLaunch(g.exec, ep->loc_st));
        return MOE_OK;
    }
    if (g.exec) {
        cudaGraphExecDestroy(g.exec);
        g.exec = nullptr;
    }
    if (g.bad || g.calls++ < 1)
        return chain_enqueue(ep, T, o, ep->loc_st);
    cudaGraph_t graph = nullptr;
    cudaError_t ce = cudaStreamBeginCapture(ep->loc_st, cudaStreamCaptureModeThreadLocal);
    moe_err e = ce == cudaSuccess ? chain_enqueue(ep, T, o, ep->loc_st) : MOE_EINTERNAL;
    if (ce == cudaSuccess)
        ce = cudaStreamEndCapture(ep->loc_st, &graph);
    if (e == MOE_OK && ce == cudaSuccess && graph)
        ce = cudaGraphInstantiate(&g.exec, graph, 0);
    if (graph)
        cudaGraphDestroy(graph);
    if (e != MOE_OK || ce != cudaSuccess || !g.exec) {
        (void)cudaGetLastError();
        fprintf(stderr,
                "kcu_ep_forward_local: the chain of %d rows cannot be a graph (%s, %d); "
                "it runs kernel by kernel\n",
                T, cudaGetErrorString(ce), (int)e);
        g.bad = 1;
        g.exec = nullptr;
        return chain_enqueue(ep, T, o, ep->loc_st);
    }
    g.gen = ep->loc_gen;
    KCU_CHECK(cudaGraphLaunch(g.exec, ep->loc_st));
    return MOE_OK;
}

/* the fan-out forward through the decode chain (kcu_decode_local): the
 * expert rows land at their sorted rows of the mirror's ye part, the
 * routing (counts, perm, weights, probs, lse) in its other parts; one
 * synchronisation */
static moe_err local_chain(kcu_ep *ep, int T, const loc_parts &o, kcu_ep_local *out,
                           cudaStream_t st, double t_last)
{
    const int H = ep->c.H, F = ep->c.F, E = ep->c.E, K = ep->c.K;
    const size_t S = (size_t)T * K;
    if (S * F * 2 > ep->loc_hd_bytes) {
        if (ep->loc_hd)
            cudaFree(ep->loc_hd);
        ep->loc_hd = nullptr;
        ep->loc_hd_bytes = 0;
        KCU_CHECK(cudaMalloc((void **)&ep->loc_hd, S * F * 2));
        ep->loc_hd_bytes = S * F * 2;
        ep->loc_gen++;
    }
    ep->stat_rows = 0; /* kcu_ep_stats: the sums are this call's (out) */
    /* a graph per T of at most EP_LOC_GRAPHS rows on loc_st; larger batches
     * (MOE_FANOUT_ROWS raised past 16) kernel by kernel on st - which may
     * be the legacy stream, NULL: the choice is its own flag */
    const int graph = T <= EP_LOC_GRAPHS && loc_graph_on();
    cudaStream_t run = st;
    if (graph) {
        KCU_TRY(chain_graph(ep, T, o));
        run = ep->loc_st;
    } else {
        KCU_TRY(chain_enqueue(ep, T, o, run));
    }
    step_trace_stamp(&loc_tr, 1, &t_last);
    KCU_CHECK(cudaStreamSynchronize(run));
    step_trace_stamp(&loc_tr, 3, &t_last);
    const char *hb = (const char *)ep->loc_h;
    const int32_t *cnt_h = (const int32_t *)(hb + o.cnt), *perm_h = (const int32_t *)(hb + o.perm);
    const float *w_h = (const float *)(hb + o.w), *probs_h = (const float *)(hb + o.stat);
    const float *lse_h = probs_h + (size_t)T * E;
    int64_t off0 = 0, n = 0;
    for (int e = 0; e < ep->first; e++)
        off0 += cnt_h[e];
    for (int e = ep->first; e < ep->first + ep->ne; e++)
        n += cnt_h[e];
    memcpy(out->counts, cnt_h, (size_t)E * 4);
    memcpy(out->topk_w, w_h, S * 4);
    memcpy(out->slots, perm_h + off0, (size_t)n * 4);
    out->ye_at = hb + o.ye + (size_t)off0 * H * 2;
    out->n = n;
    if (out->probs_sum)
        for (int e = 0; e < E; e++) {
            double sum = 0;
            for (int t = 0; t < T; t++)
                sum += probs_h[(size_t)t * E + e];
            out->probs_sum[e] = sum;
        }
    out->z_sum = 0;
    for (int t = 0; t < T; t++)
        out->z_sum += (double)lse_h[t] * lse_h[t];
    step_trace_stamp(&loc_tr, 7, &t_last);
    step_trace_end(&loc_tr);
    return MOE_OK;
}

extern "C" moe_err kcu_ep_forward_local(kcu_ep *ep, int T, const void *x, moe_dtype x_dtype,
                                        kcu_ep_local *out, void *stream)
{
    double t_last = 0;
    step_trace_begin(&loc_tr, &t_last);
    cudaStream_t st = (cudaStream_t)stream;
    const int H = ep->c.H, E = ep->c.E, K = ep->c.K;
    if (T < 1 || T > ep->c.T_max || !x || !out || !out->counts || !out->topk_w || !out->slots ||
        (x_dtype != MOE_F32 && x_dtype != MOE_BF16) || out->sh0 < 0 || out->shn < 0 ||
        out->sh0 + out->shn > T || (out->shn > 0 && (!ep->sh || !out->ys)))
        return MOE_EINVAL;
    const size_t S = (size_t)T * K, shn = (size_t)out->shn;
    const loc_parts o = loc_layout(ep, T, shn);
    KCU_TRY(loc_reserve(ep, o.need));
    char *hb = (char *)ep->loc_h, *db = (char *)ep->loc_d;
    int32_t *cnt_h = (int32_t *)(hb + o.cnt), *perm_h = (int32_t *)(hb + o.perm);
    float *w_h = (float *)(hb + o.w), *stat_h = (float *)(hb + o.stat);
    float *glog_h = (float *)(hb + o.glog);
    uint16_t *ye_h = (uint16_t *)(hb + o.ye), *ys_h = (uint16_t *)(hb + o.ys);

    /* the routing of every token, as ep_forward's token side (its train
     * state, if any, is gone: as after any inference forward). The rows go
     * into the mapped mirror as bf16; the decode router and the gather read
     * them there (no copy to wait for), the router GEMM of a routing family
     * from the device (one copy) */
    ep->T_fwd = 0;
    ep->T = T;
    static int chain_on = -1; /* KCU_LOCAL_CHAIN=0: the two-step path below */
    if (chain_on < 0) {
        const char *v = getenv("KCU_LOCAL_CHAIN");
        chain_on = v && *v ? atoi(v) != 0 : 1;
    }
    /* the decode chain: router, up and down of this rank's experts, then the
     * copies, one synchronisation (plain softmax top-k, a decode batch) */
    const int chain = chain_on && shn == 0 && kcu_decode_local_use(&ep->R, T);
    uint16_t *xh = (uint16_t *)(hb + o.x);
    const size_t nx = (size_t)T * H;
    if (x_dtype == MOE_F32)
        for (size_t i = 0; i < nx; i++)
            xh[i] = bf16_from_f32_inl(((const float *)x)[i]);
    else
        memcpy(xh, x, nx * 2);
    step_trace_stamp(&loc_tr, 0, &t_last);
    if (chain)
        return local_chain(ep, T, o, out, st, t_last);
    const bf16 *xb = (const bf16 *)(db + o.x);
    if (!kcu_route_small_use(&ep->R, T, 0)) {
        KCU_CHECK(cudaMemcpyAsync(ep->R.xs, xh, nx * 2, cudaMemcpyHostToDevice, st));
        xb = ep->R.xs;
    }
    KCU_TRY(ep_route(ep, T, xb, 0, st));
    step_trace_stamp(&loc_tr, 1, &t_last);
    /* counts, slots, weights, statistics and the shared gate's logits to
     * the host: one synchronisation */
    const size_t nrows = (size_t)ep->stat_rows, nst = nrows * (E + 1);
    KCU_TRY(loc_copies(ep, o, S, ep->R.statpart, nst, nullptr, 0, st));
    if (shn > 0 && ep->gate)
        KCU_CHECK(cudaMemcpy2DAsync(glog_h, 4, ep->R.logits + (size_t)out->sh0 * ep->R.Ep + E,
                                    (size_t)ep->R.Ep * 4, 4, shn, cudaMemcpyDeviceToHost, st));
    /* the shared expert's rows of [sh0, sh0 + shn) meanwhile: bf16 ys, as
     * ep_forward keeps them */
    if (shn > 0) {
        const int32_t rows = out->shn;
        ep->sh->nsm = ep->nsm;
        KCU_TRY(kcu_experts_forward(ep->sh, rows, xb + (size_t)out->sh0 * H, MOE_BF16, &rows,
                                    ep->sy, MOE_BF16, 0, st));
        KCU_CHECK(cudaMemcpyAsync(ys_h, ep->sy, shn * H * 2, cudaMemcpyDeviceToHost, st));
    }
    step_trace_stamp(&loc_tr, 2, &t_last);
    KCU_CHECK(cudaStreamSynchronize(st));
    step_trace_stamp(&loc_tr, 3, &t_last);
    int64_t off0 = 0, n = 0;
    for (int e = 0; e < ep->first; e++)
        off0 += cnt_h[e];
    for (int e = ep->first; e < ep->first + ep->ne; e++)
        n += cnt_h[e];
    /* this rank's rows on the device while the host writes the rest out;
     * the decode kernels write them straight into the mapped mirror */
    if (n > 0) {
        const int32_t *cnt = cnt_h + ep->first;
        k_ep_local_rows<<<(unsigned)n, 128, 0, st>>>(xb, ep->R.tok + off0, H, ep->xsend_t);
        KCU_CHECK_LAUNCH();
        if (n <= ep->ex->N_max && kcu_decode_use_experts(ep->ex, (int)n, cnt, 0)) {
            KCU_TRY(kcu_decode_experts_forward(ep->ex, (int)n, ep->xsend_t, cnt, db + o.ye,
                                               MOE_BF16, st));
        } else {
            KCU_TRY(local_experts(ep, cnt, n, ep->xsend_t, ep->yrecv_t, st));
            KCU_CHECK(
                cudaMemcpyAsync(ye_h, ep->yrecv_t, (size_t)n * H * 2, cudaMemcpyDeviceToHost, st));
        }
    }
    step_trace_stamp(&loc_tr, 4, &t_last);
    memcpy(out->counts, cnt_h, (size_t)E * 4);
    memcpy(out->topk_w, w_h, S * 4);
    memcpy(out->slots, perm_h + off0, (size_t)n * 4);
    out->n = n;
    /* the statistics, as kcu_ep_stats sums them (row order) */
    if (out->probs_sum)
        for (int e = 0; e < E; e++)
            out->probs_sum[e] = 0;
    out->z_sum = 0;
    for (size_t b = 0; b < nrows; b++) {
        const float *p = stat_h + b * (E + 1);
        for (int e = 0; out->probs_sum && e < E; e++)
            out->probs_sum[e] += p[e];
        out->z_sum += p[E];
    }
    for (size_t t = 0; t < shn; t++) { /* ys rows, gated as the combine gates them */
        const float g = ep->gate ? 1.f / (1.f + expf(-glog_h[t])) : 1.f;
        for (int i = 0; i < H; i++) {
            const float v = bf16_to_f32_inl(ys_h[t * H + i]);
            out->ys[t * H + i] = ep->gate ? g * v : v;
        }
    }
    step_trace_stamp(&loc_tr, 5, &t_last);
    KCU_CHECK(cudaStreamSynchronize(st));
    step_trace_stamp(&loc_tr, 6, &t_last);
    out->ye_at = ye_h;
    step_trace_stamp(&loc_tr, 7, &t_last);
    step_trace_end(&loc_tr);
    return MOE_OK;
}

extern "C" int kcu_ep_local_experts(const kcu_ep *ep, int *first)
{
    if (first)
        *first = ep->first;
    return ep->ne;
}

extern "C" moe_err kcu_ep_bench_exchange(kcu_ep *ep, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    if (ep->ce_fwd) {
        /* the shared windows: failed, or moved by another layer's growth,
         * since this layer's last forward bound them */
        const ep_ce_shared *s = ep->ce;
        if (s->state <= 0 || s->gen != ep->ce_gen)
            return MOE_EPRECOND;
        if (s->ev_used)
            KCU_CHECK(cudaStreamWaitEvent(st, s->ev_free, 0));
    }
    KCU_CHECK(cudaEventRecord(ep->ev_a, st));
    KCU_CHECK(cudaStreamWaitEvent(ep->cs, ep->ev_a, 0));
    for (int c = 0; c < ep->C; c++) /* dedup: the unique rows and their metadata */
        KCU_TRY(ep->ce_fwd ? ce_dispatch(ep, c)
                : ep->dd   ? epd_dispatch(ep, c)
                           : ep_exchange(ep, c, ep->xsend, ep->xrecv, 0));
    for (int c = 0; c < ep->C; c++)
        KCU_TRY(ep->ce_fwd ? ce_return(ep, c) : ep_exchange(ep, c, ep->yrecv, ep->ysend, 1));
    KCU_CHECK(cudaEventRecord(ep->ev_done, ep->cs));
    KCU_CHECK(cudaStreamWaitEvent(st, ep->ev_done, 0));
    if (ep->ce_fwd)
        KCU_TRY(ce_windows_done(ep, st));
    return ep_wait(ep, nullptr, st, "exchange");
}

extern "C" int kcu_ep_last_ce(const kcu_ep *ep, int64_t *wire_bytes, int64_t *n_ce,
                              int64_t *n_fallback)
{
    if (n_ce)
        *n_ce = ep->ce_n[0];
    if (n_fallback)
        *n_fallback = ep->ce_n[1];
    if (wire_bytes) { /* every slot of every other rank, padding included */
        int64_t b = 0;
        const int64_t H = ep->c.H, K = ep->c.K;
        for (int c = 0; ep->ce_fwd && c < ep->C; c++)
            b += ep->cs_.S[c] * (2 * H + 4 * K) + ep->cs_.R[c] * 2 * H;
        *wire_bytes = b * (ep->c.world - 1);
    }
    return ep->ce_fwd;
}

extern "C" int64_t kcu_ep_last_send_bytes(const kcu_ep *ep)
{
    if (ep->dd) { /* unique rows, each with K int32 of metadata */
        int64_t urows = 0;
        for (int c = 0; c < ep->C; c++)
            for (int q = 0; q < ep->c.world; q++)
                if (q != ep->c.rank)
                    urows += ep->usend[c][q];
        return urows * ((int64_t)ep->c.H * 2 + (int64_t)ep->c.K * 4);
    }
    int64_t rows = 0;
    for (int c = 0; c < ep->C; c++)
        for (int q = 0; q < ep->c.world; q++)
            if (q != ep->c.rank)
                rows += ep->send_rows[c][q];
    return rows * ep->c.H * 2;
}
