/*
 * ep_bench.cu - expert parallelism over W GPUs of one host (kcu_ep.h): one
 * thread and one NCCL rank per GPU, a fixed number of tokens per GPU.
 * Prints, per overlap degree (chunks), the layer's forward and
 * forward+backward time, tokens/s, the time of the layer's all-to-all
 * alone (the same transfers without the GEMMs), its bandwidth against
 * NCCL's own ncclAlltoAll moving the same bytes in the same run, and how
 * much of the all-to-all time the overlap hides. With --check the outputs,
 * dx and every gradient are compared with the single-GPU layer (kcu_layer,
 * all W*T tokens on GPU 0). With --check-infer the inference forward's y
 * at every --chunks value is compared with the single-GPU layer's inference
 * forward (bit-identical expected). The deduplicated dispatch of inference
 * forwards (kcu_ep.h) is on, as in the library (--no-dedup: off, the
 * baseline); the table's "disp MB" column shows the inference forward's
 * off-GPU dispatch bytes. KCU_EP_DEDUP is not read here. Unless KCU_EP_CE=0
 * (the copy-engine exchange, kcu_ep.h; on by default) the "ce" column shows how many of
 * the timed inference forwards took the CE path, and a line after the
 * table the bytes its padded slots put on the wire; --check-infer names
 * the path of each forward it checks. Not a test.
 *
 *   bin/ep_bench --gpus 4 --shape mixtral|qwen3|deepseek|small|moe64 [--tokens 16384]
 *                [--chunks 1,2,4] [--comm-sms 16] [--iters 10] [--skew] [--check]
 *                [--t-max N]   (the layer sized for N tokens, as a worker's --gpu-max-tokens)
 *                [--host-rows]   (the timed inference forward's x and y bf16 in page-locked
 *                             host memory, as a GPU worker's raw path)
 *                [--check-chunks N]   (the check's overlap degree, default 2; 0: auto)
 *                [--dedup]   (deduplicated dispatch in inference forwards: c.dedup 1,
 *                             the default)
 *                [--dedup-train]   (in training forwards too: c.dedup 2)
 *                [--no-dedup]   (off: c.dedup -1)
 *                [--ce]   (after the table: NCCL's copy-engine all-to-all against the
 *                             default one, alone and concurrent with the expert GEMMs;
 *                             see "--ce" below)
 *                [--check-infer]   (y of the inference forward at each --chunks value
 *                             against kcu_layer's inference forward of all W*T tokens)
 *                [--layers L]   (with --check-infer: L layers on the one communicator,
 *                             their forwards back to back on their own streams, every
 *                             y bit-identical to the first's: the copy-engine windows
 *                             they share)
 *                [--infer]   (no optimizer state, forward only: DeepSeek-V3's 256
 *                             experts hold 18 bytes a parameter in training, 203 GB)
 *                [--family dsv3|qwen2]   (a routing family and a shared expert, on
 *                             both the expert-parallel layer and the --check's kcu_layer:
 *                             dsv3: sigmoid scores, a random choice bias, 8 groups of
 *                             which 4 are kept (a group's score the sum of its 2 best),
 *                             renormalised, routed scale 2.5, one shared expert of
 *                             d_ff F, ungated; qwen2: softmax, no renorm, a shared
 *                             expert of d_ff 4F gated by sigmoid(x . wsg). The check
 *                             then compares the shared expert's and the gate's
 *                             gradients too; it needs E % 8 == 0 and K <= E/2 (dsv3)
 *                             and E + 1 (dsv3) or E + 4 (qwen2) <= 256)
 *
 * --ce (issue 24: can the exchange leave the GEMMs all their SMs?): on a
 * second communicator split from the first with ctaPolicy
 * NCCL_CTA_POLICY_ZERO, over two ncclMemAlloc buffers of T*K*H bf16 each
 * registered as symmetric windows (ncclCommWindowRegister,
 * NCCL_WIN_COLL_SYMMETRIC), NCCL >= 2.28 moves ncclAlltoAll on the copy
 * engines, with no CTA, when every rank is reachable over NVLink (NCCL's
 * enqueue: symmetric support, one node, both buffers in symmetric windows,
 * CTAPolicy ZERO, a collective with a CE implementation: AllGather,
 * AlltoAll, Gather, Scatter, CUDA driver >= 12.5). Times, max over ranks,
 * median over --iters: (a) a round trip (two ncclAlltoAll, as "nccl ms")
 * on the CE communicator and on the default one (kernels); (b) this rank's
 * expert GEMMs alone: kcu_experts_forward of the local experts (same
 * weights) on the rows each received in the last forward (all SMs, random
 * bf16 rows); (c) the GEMMs while round trips run back to back on another
 * stream, CE and default, with the slowdown of the GEMMs and each round
 * trip's time under them. Then checks which path NCCL took: one CE
 * ncclAlltoAll captured into a CUDA graph must have no kernel node. Needs
 * ncclGetVersion >= 2.28.0 and the symbols (dlsym): otherwise one line
 * says what is missing and the rest of the run is as without --ce.
 *
 * Keep NCCL_NVLS_ENABLE=0 on the shared machines.
 */
#include <algorithm>
#include <dlfcn.h>
#include <functional>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <thread>
#include <time.h>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

#include "base/bf16.h"
#include "kernels/cuda/kcu_ep.h"
#include "kernels/cuda/kern_cuda.h"
#include "kernels/cuda/kcu_tool.h"
#include "common/placement.h"

#define CKN(call)                                                                                  \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, ncclGetErrorString(r_)); \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

struct shape {
    const char *name;
    int H, F, E, K;
};
static const shape SHAPES[] = {
    {"mixtral", 4096, 14336, 8, 2},   {"qwen3", 2048, 768, 128, 8}, {"small", 512, 256, 16, 2},
    {"deepseek", 7168, 2048, 256, 8}, /* DeepSeek-V3's routed experts (its router's
                                         groups and shared expert aside) */
    {"moe64", 1024, 512, 64, 6},      /* small, 8 experts a group: --family dsv3 checks */
};

/* --family: the routing family and shared expert of both layers */
enum { FAM_PLAIN = 0, FAM_DSV3 = 1, FAM_QWEN2 = 2 };
static const char *const FAM_NAMES[] = {"plain softmax top-k", "dsv3", "qwen2"};

static kcu_route_config family_route(int fam)
{
    kcu_route_config r;
    memset(&r, 0, sizeof(r));
    if (fam == FAM_DSV3) {
        r.scoring = KERN_SCORE_SIGMOID;
        r.n_group = 8;
        r.topk_group = 4;
        r.group_topn = 2;
        r.route_scale = 2.5f;
        r.shared_experts = 1;
    } else if (fam == FAM_QWEN2) {
        r.shared_experts = 4;
        r.shared_gate = 1;
    }
    return r;
}
static int family_renorm(int fam)
{
    return fam == FAM_QWEN2 ? 0 : 1;
}

static double now_s()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* value i of stream `seed`, uniform in [-a, a) */
static inline float hval(uint64_t seed, uint64_t i, float a)
{
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return a * (2.0f * (float)(z >> 40) * (1.0f / 16777216.0f) - 1.0f);
}
static void gen(std::vector<float> &v, size_t n, uint64_t seed, float a, float shift)
{
    v.resize(n);
    const int nt = 16;
    std::vector<std::thread> th;
    for (int t = 0; t < nt; t++)
        th.emplace_back([&, t] {
            for (size_t i = n * t / nt; i < n * (t + 1) / nt; i++)
                v[i] = hval(seed, i, a) + shift;
        });
    for (auto &x : th)
        x.join();
}

struct opts {
    int W = 2, T = 16384, iters = 10, skew = 0, check = 0, comm_sms = 0;
    int infer = 0;        /* --infer: inference only (no optimizer state on the GPU, no fwd+bwd) */
    int check_chunks = 2; /* 0: chosen per forward (kcu_ep_auto_chunks) */
    int dedup = 1;        /* c.dedup: 1 inference forwards (the default, --dedup), 2 training too
                           * (--dedup-train), 0 off (--no-dedup: c.dedup -1) */
    int check_infer = 0;  /* --check-infer: inference y against kcu_layer's */
    int ce = 0;           /* --ce: the copy-engine all-to-all measurement */
    int layers = 1;       /* --layers L (with --check-infer): L layers on one communicator,
                           * forwards back to back on their own streams (the worker's
                           * layers share the copy-engine windows) */
    int t_max = 0;        /* --t-max N: the layer sized for N tokens (a worker's
                           * --gpu-max-tokens), not T */
    int host_rows = 0;    /* --host-rows: the timed inference forward's x and y bf16 in
                           * page-locked host memory (a GPU worker's raw path), not on the
                           * device */
    int family = FAM_PLAIN;
    shape s = SHAPES[2];
    std::vector<int> chunks{1, 2, 4};
};

struct world {
    opts o;
    ncclUniqueId id;
    pthread_barrier_t bar;
    std::vector<float> wr, w1, w3, w2;     /* the whole layer, host fp32 */
    std::vector<float> bias;               /* (E) choice bias (dsv3), empty: none */
    std::vector<float> ws1, ws3, ws2, wsg; /* shared expert (Fs,H) (Fs,H) (H,Fs), gate (H);
                                            * empty: none / ungated */
    std::vector<std::vector<float>> x, dy, y, dx;
    std::vector<std::vector<float>> yi;              /* per rank: y of an inference forward */
    std::vector<std::vector<std::vector<float>>> yc; /* --check-infer: per chunks value, per
                                                      * rank: y of an inference forward */
    std::vector<std::vector<float>> g1, g3, g2, gr;  /* per rank: local expert grads, router grad */
    std::vector<std::vector<float>> gs1, gs3, gs2, gsg; /* per rank: shared expert, gate grads */
    /* results per chunks value (rank 0 writes the max over ranks) */
    std::vector<double> t_fwd, t_fb, t_a2a, t_nccl;
    std::vector<int> used;       /* chunks each setting used (0: chosen per forward): */
    std::vector<int> used_train; /* by the inference forward and by the training one */
    std::vector<double> rank_ms; /* scratch: one slot per rank */
    std::vector<int> rank_ok;    /* scratch: one flag per rank (--ce) */
    /* per chunks value: the inference forward's off-GPU bytes, max over ranks:
     * dispatch (kcu_ep_last_send_bytes), dispatch and return */
    std::vector<int64_t> disp_b, a2a_b;
    /* per chunks value (rank 0's; every rank takes the same path): timed
     * inference forwards on the CE path, of how many; the last one's wire
     * bytes with padding (max over ranks); --check-infer: its forward's path */
    std::vector<int> ce_n, ce_of, yc_ce;
    /* --layers: per chunks value, per rank: a layer's y differed from layer
     * 0's (bit for bit) in the back-to-back run, or that run failed */
    std::vector<std::vector<int>> layers_bad;
    std::vector<int64_t> ce_wire;
    int64_t ce_total[2] = {0, 0}; /* rank 0's forwards on the CE path, fallen back */
    int64_t send_bytes = 0, rows_max = 0, rows_min = 0;
    size_t mem_max = 0;
};

typedef ncclResult_t (*alltoall_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                                    cudaStream_t);

/* max over ranks of each rank's duration, after a barrier start */
static double timed(world *w, int r, const std::function<void()> &fn)
{
    pthread_barrier_wait(&w->bar);
    const double t0 = now_s();
    fn();
    w->rank_ms[r] = (now_s() - t0) * 1e3;
    pthread_barrier_wait(&w->bar);
    double m = 0;
    for (double v : w->rank_ms)
        m = std::max(m, v);
    pthread_barrier_wait(&w->bar);
    return m;
}

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

/* ---- --ce: the copy-engine all-to-all (see the top of the file) ---- */

typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
typedef ncclResult_t (*memalloc_fn)(void **, size_t);
typedef ncclResult_t (*memfree_fn)(void *);
typedef ncclResult_t (*winreg_fn)(ncclComm_t, void *, size_t, ncclWindow_t *, int);
typedef ncclResult_t (*windereg_fn)(ncclComm_t, ncclWindow_t);

/* max over ranks of v (every rank calls) */
static double max_ranks(world *w, int r, double v)
{
    w->rank_ms[r] = v;
    pthread_barrier_wait(&w->bar);
    double m = 0;
    for (double x : w->rank_ms)
        m = std::max(m, x);
    pthread_barrier_wait(&w->bar);
    return m;
}

/* 1 when every rank passes ok != 0 (every rank calls): a collective NCCL
 * call follows only when all ranks reach it */
static int all_ok(world *w, int r, int ok)
{
    w->rank_ok[r] = ok;
    pthread_barrier_wait(&w->bar);
    int all = 1;
    for (int x : w->rank_ok)
        all &= x != 0;
    pthread_barrier_wait(&w->bar);
    return all;
}

/* n bf16 values in [-1, 1) from (seed, i) */
__global__ void k_fill_bf16(uint16_t *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z ^= z >> 27;
        const float v = 2.0f * (float)(z >> 40) * (1.0f / 16777216.0f) - 1.0f;
        p[i] = (uint16_t)(__float_as_uint(v) >> 16);
    }
}

static const char *nccl_err(ncclResult_t e)
{
    return ncclGetErrorString(e);
}

/* the --ce measurement on rank r after the table's runs: the GEMMs' rows
 * are those this rank's experts received in the last forward of `ep` */
static void ce_measure(world *w, int r, ncclComm_t comm, kcu_ep *ep, cudaStream_t st,
                       alltoall_fn a2a, void *nb_s, void *nb_r)
{
    const opts &o = w->o;
    const int W = o.W, T = o.T;
    const shape s = o.s;
    const size_t H = s.H, F = s.F;
    const size_t per_peer = (size_t)T * s.K * H / W, bytes = per_peer * W * 2;
    char why[256] = "";
    int ver = 0;
    ncclGetVersion(&ver);
    split_fn split = (split_fn)dlsym(RTLD_DEFAULT, "ncclCommSplit");
    memalloc_fn mem_alloc = (memalloc_fn)dlsym(RTLD_DEFAULT, "ncclMemAlloc");
    memfree_fn mem_free = (memfree_fn)dlsym(RTLD_DEFAULT, "ncclMemFree");
    winreg_fn win_reg = (winreg_fn)dlsym(RTLD_DEFAULT, "ncclCommWindowRegister");
    windereg_fn win_dereg = (windereg_fn)dlsym(RTLD_DEFAULT, "ncclCommWindowDeregister");
    if (W < 2)
        snprintf(why, sizeof(why), "needs --gpus >= 2");
    else if (ver < 22800) /* NCCL_VERSION(2,28,0): CTAPolicy ZERO's CE collectives */
        snprintf(why, sizeof(why),
                 "NCCL at runtime is %d.%d.%d: copy-engine collectives need 2.28 or later",
                 ver / 10000, ver / 100 % 100, ver % 100);
    else if (!split || !mem_alloc || !mem_free || !win_reg || !win_dereg || !a2a || !nb_s)
        snprintf(why, sizeof(why),
                 "NCCL at runtime lacks%s%s%s%s%s%s (or the default buffers are missing)",
                 split ? "" : " ncclCommSplit", mem_alloc ? "" : " ncclMemAlloc",
                 mem_free ? "" : " ncclMemFree", win_reg ? "" : " ncclCommWindowRegister",
                 win_dereg ? "" : " ncclCommWindowDeregister", a2a ? "" : " ncclAlltoAll");
    if (why[0]) { /* the same on every rank: one line, no collective call */
        if (r == 0)
            printf("ce: unavailable: %s; --ce skipped\n", why);
        return;
    }
    /* the CE communicator: a split of comm (every rank, the same color) */
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    ncclComm_t ce = nullptr;
    ncclResult_t e = split(comm, 0, r, &ce, &cfg);
    if (!all_ok(w, r, e == ncclSuccess && ce)) {
        if (e != ncclSuccess)
            printf("ce: rank %d: ncclCommSplit with CTAPolicy ZERO: %s (%s)\n", r, nccl_err(e),
                   ncclGetLastError(comm));
        if (r == 0)
            printf("ce: unavailable: no CE communicator; --ce skipped\n");
        if (ce)
            ncclCommDestroy(ce);
        return;
    }
    void *cs = nullptr, *cr = nullptr;
    ncclWindow_t ws = nullptr, wr = nullptr;
    e = mem_alloc(&cs, bytes);
    if (e == ncclSuccess)
        e = mem_alloc(&cr, bytes);
    int ok = all_ok(w, r, e == ncclSuccess);
    if (!ok && r == 0)
        printf("ce: unavailable: ncclMemAlloc of 2 x %.1f MiB failed on some rank (%s)\n",
               bytes / 1048576.0, nccl_err(e));
    if (ok) { /* collective: every rank registers the same sizes, in the same order */
        e = win_reg(ce, cs, bytes, &ws, NCCL_WIN_COLL_SYMMETRIC);
        if (e == ncclSuccess)
            e = win_reg(ce, cr, bytes, &wr, NCCL_WIN_COLL_SYMMETRIC);
        ok = all_ok(w, r, e == ncclSuccess);
        if (!ok)
            printf("ce: rank %d: ncclCommWindowRegister: %s (%s)\n", r, nccl_err(e),
                   ncclGetLastError(ce));
    }
    /* the GEMMs: a kcu_experts of this rank's experts with the same weights,
     * on the rows its experts received in the last forward */
    int first = 0;
    const int ne = kcu_ep_local_experts(ep, &first);
    std::vector<int32_t> cg(s.E), cnt(ne);
    int64_t N = 0;
    kcu_ep_last_counts(ep, nullptr, cg.data(), nullptr, nullptr);
    for (int i = 0; i < ne; i++)
        N += cnt[i] = cg[first + i];
    kcu_experts *ex = nullptr;
    void *gx = nullptr, *gy = nullptr;
    cudaStream_t st2;
    cudaEvent_t ev[4];
    CK(cudaStreamCreateWithFlags(&st2, cudaStreamNonBlocking));
    for (cudaEvent_t &x : ev)
        CK(cudaEventCreate(&x));
    if (ok) {
        moe_err me =
            kcu_experts_create(s.H, s.F, ne, KERN_ACT_SWIGLU, (int)std::max<int64_t>(N, 1), 0, &ex);
        if (me == MOE_OK)
            me = kcu_experts_upload(ex, w->w1.data() + (size_t)first * F * H,
                                    w->w3.data() + (size_t)first * F * H,
                                    w->w2.data() + (size_t)first * H * F);
        if (me == MOE_OK &&
            (cudaMalloc(&gx, (size_t)std::max<int64_t>(N, 1) * H * 2) != cudaSuccess ||
             cudaMalloc(&gy, (size_t)std::max<int64_t>(N, 1) * H * 2) != cudaSuccess))
            me = MOE_ENOMEM;
        ok = all_ok(w, r, me == MOE_OK);
        if (!ok && r == 0)
            printf("ce: the GEMMs' kcu_experts (%lld rows) could not be made; --ce skipped\n",
                   (long long)N);
    }
    if (ok) {
        k_fill_bf16<<<1024, 256, 0, st>>>((uint16_t *)gx, (size_t)N * H, 300 + r);
        k_fill_bf16<<<1024, 256, 0, st>>>((uint16_t *)cs, bytes / 2, 400 + r);
        CK(cudaGetLastError());
        CK(cudaStreamSynchronize(st));
    }
    auto gemm = [&](cudaStream_t sg) {
        CKM(kcu_experts_forward(ex, (int)N, gx, MOE_BF16, cnt.data(), gy, MOE_BF16, 0, sg));
    };
    /* one round trip: there and back, as the table's "nccl ms" */
    auto trip = [&](int use_ce, cudaStream_t sa) {
        ncclComm_t c = use_ce ? ce : comm;
        void *s0 = use_ce ? cs : nb_s, *r0 = use_ce ? cr : nb_r;
        CKN(a2a(s0, r0, per_peer, ncclBfloat16, c, sa));
        CKN(a2a(r0, s0, per_peer, ncclBfloat16, c, sa));
    };
    auto ms = [&](cudaEvent_t a, cudaEvent_t b) {
        float f = 0;
        CK(cudaEventElapsedTime(&f, a, b));
        return (double)f;
    };
    std::vector<double> g0, tce, tdef, gce, gdef, uce, udef;
    int nce = 1, ndef = 1; /* round trips issued under the GEMMs: enough to cover them */
    for (int it = 0; ok && it < o.iters + 2; it++) {
        /* (b) the GEMMs alone */
        pthread_barrier_wait(&w->bar);
        CK(cudaEventRecord(ev[0], st));
        gemm(st);
        CK(cudaEventRecord(ev[1], st));
        CK(cudaStreamSynchronize(st));
        const double g = max_ranks(w, r, ms(ev[0], ev[1]));
        /* (a) a round trip alone, CE then default */
        double t[2];
        for (int k = 0; k < 2; k++) {
            pthread_barrier_wait(&w->bar);
            CK(cudaEventRecord(ev[0], st2));
            trip(k == 0, st2);
            CK(cudaEventRecord(ev[1], st2));
            CK(cudaStreamSynchronize(st2));
            t[k] = max_ranks(w, r, ms(ev[0], ev[1]));
        }
        /* (c) the GEMMs while round trips run on st2 */
        double gu[2], tu[2];
        for (int k = 0; k < 2; k++) {
            const int n = k == 0 ? nce : ndef;
            pthread_barrier_wait(&w->bar);
            CK(cudaEventRecord(ev[2], st2));
            for (int i = 0; i < n; i++)
                trip(k == 0, st2);
            CK(cudaEventRecord(ev[3], st2));
            CK(cudaEventRecord(ev[0], st));
            gemm(st);
            CK(cudaEventRecord(ev[1], st));
            CK(cudaStreamSynchronize(st));
            CK(cudaStreamSynchronize(st2));
            gu[k] = max_ranks(w, r, ms(ev[0], ev[1]));
            tu[k] = max_ranks(w, r, ms(ev[2], ev[3]) / n);
        }
        if (it == 1) { /* from the warm-up's times (the same on every rank) */
            nce = std::min(64, (int)ceil(g / std::max(t[0], 1e-3)) + 1);
            ndef = std::min(64, (int)ceil(g / std::max(t[1], 1e-3)) + 1);
        }
        if (it >= 2) {
            g0.push_back(g);
            tce.push_back(t[0]);
            tdef.push_back(t[1]);
            gce.push_back(gu[0]);
            gdef.push_back(gu[1]);
            uce.push_back(tu[0]);
            udef.push_back(tu[1]);
        }
    }
    if (ok && r == 0) {
        const double G = median(g0), A = median(tce), D = median(tdef);
        const double GC = median(gce), GD = median(gdef), UC = median(uce), UD = median(udef);
        const double rt = 2.0 * bytes; /* both directions, as the table's GB/s */
        int maj = ver / 10000, mnr = ver / 100 % 100, pat = ver % 100;
        printf("ce: NCCL %d.%d.%d; CE communicator: ncclCommSplit, CTAPolicy "
               "NCCL_CTA_POLICY_ZERO; 2 windows of %.1f MiB (ncclMemAlloc, "
               "NCCL_WIN_COLL_SYMMETRIC); a round trip = 2 ncclAlltoAll of %zu bf16 per peer\n",
               maj, mnr, pat, bytes / 1048576.0, per_peer);
        printf("ce: (a) round trip alone: CE %.3f ms (%.1f GB/s), default %.3f ms (%.1f GB/s), "
               "CE/default time %.2f\n",
               A, rt / (A * 1e6), D, rt / (D * 1e6), A / D);
        printf("ce: (b) expert GEMMs alone (kcu_experts_forward, %d local experts, %lld rows on "
               "rank 0, all SMs): %.3f ms\n",
               ne, (long long)N, G);
        printf("ce: (c) GEMMs under CE round trips (%d back to back): %.3f ms (slowdown x%.3f), "
               "a round trip under them %.3f ms\n",
               nce, GC, GC / G, UC);
        printf("ce: (c) GEMMs under default round trips (%d back to back): %.3f ms (slowdown "
               "x%.3f), a round trip under them %.3f ms\n",
               ndef, GD, GD / G, UD);
        printf("ce: the model of issue 24 holds if (c) CE stays near x1.0 while the default's "
               "is well above it; comm_sms 32 of 132 costs x1.32 by the SM count\n");
        fflush(stdout);
    }
    /* which path NCCL took: a CE ncclAlltoAll captured into a graph has no
     * kernel node (the kernel path launches NCCL's device kernel) */
    if (ok) {
        cudaStream_t sc;
        CK(cudaStreamCreateWithFlags(&sc, cudaStreamNonBlocking));
        pthread_barrier_wait(&w->bar);
        cudaGraph_t gr = nullptr;
        int kern = -1, copies = 0;
        size_t nn = 0;
        if (cudaStreamBeginCapture(sc, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
            e = a2a(cs, cr, per_peer, ncclBfloat16, ce, sc);
            if (cudaStreamEndCapture(sc, &gr) == cudaSuccess && e == ncclSuccess &&
                cudaGraphGetNodes(gr, nullptr, &nn) == cudaSuccess) {
                std::vector<cudaGraphNode_t> nodes(nn);
                cudaGraphGetNodes(gr, nodes.data(), &nn);
                kern = 0;
                for (cudaGraphNode_t nd : nodes) {
                    cudaGraphNodeType ty;
                    cudaGraphNodeGetType(nd, &ty);
                    kern += ty == cudaGraphNodeTypeKernel;
                    copies += ty == cudaGraphNodeTypeMemcpy;
                }
            }
        }
        (void)cudaGetLastError();
        if (gr)
            cudaGraphDestroy(gr);
        cudaStreamDestroy(sc);
        const double kmax = max_ranks(w, r, kern < 0 ? 1e9 : kern);
        if (r == 0)
            printf("ce: path: a CE ncclAlltoAll captured into a graph: %s (rank 0: %zu nodes, %d "
                   "kernel, %d memcpy)\n",
                   kmax >= 1e9 ? "capture failed, path unknown"
                   : kmax > 0  ? "kernel nodes on some rank: NOT the copy-engine path"
                               : "no kernel node on any rank: copy engines",
                   nn, kern, copies);
        fflush(stdout);
    }
    CK(cudaDeviceSynchronize());
    if (ex)
        kcu_experts_destroy(ex);
    if (gx)
        cudaFree(gx);
    if (gy)
        cudaFree(gy);
    for (cudaEvent_t &x : ev)
        cudaEventDestroy(x);
    cudaStreamDestroy(st2);
    if (wr)
        win_dereg(ce, wr);
    if (ws)
        win_dereg(ce, ws);
    if (cr)
        mem_free(cr);
    if (cs)
        mem_free(cs);
    ncclCommDestroy(ce);
}

/* ep_upload_weights: this rank's share of the layer into ep (its experts
 * from first on, the router, the choice bias; the shared expert replicated
 * on every rank) */
static void ep_upload_weights(world *w, kcu_ep *ep, int first)
{
    const size_t H = w->o.s.H, F = w->o.s.F;
    CKM(kcu_ep_upload(ep, w->wr.data(), w->w1.data() + (size_t)first * F * H,
                      w->w3.data() + (size_t)first * F * H, w->w2.data() + (size_t)first * H * F));
    if (!w->bias.empty())
        CKM(kcu_ep_upload_bias(ep, w->bias.data()));
    if (!w->ws1.empty())
        CKM(kcu_ep_upload_shared(ep, w->ws1.data(), w->ws3.data(), w->ws2.data(),
                                 w->wsg.empty() ? nullptr : w->wsg.data()));
}

/* --layers: every layer's inference forward of this rank's x (device f32
 * xd), back to back, each on its own stream into its own device y, no host
 * wait between them (a layer's combine may still read the shared CE
 * windows when the next layer's dispatch fills them); 1 when any layer's y
 * differs bit for bit from w->yc[ci][r] (layer 0's, checked against the
 * one-GPU layer) or a call failed */
static int layers_back_to_back(world *w, int r, kcu_ep *ep, const std::vector<kcu_ep *> &more,
                               const std::vector<cudaStream_t> &lst, const void *xd, size_t ci)
{
    const int T = w->o.T;
    const size_t n = (size_t)T * w->o.s.H;
    const size_t L = more.size() + 1;
    std::vector<float *> yl(L, nullptr);
    int bad = 0;
    for (size_t l = 0; l < L && !bad; l++)
        bad = cudaMalloc(&yl[l], n * 4) != cudaSuccess;
    for (size_t l = 0; l < L && !bad; l++) {
        kcu_ep *e = l ? more[l - 1] : ep;
        bad = kcu_ep_set_chunks(e, w->o.chunks[ci], w->o.comm_sms) != MOE_OK ||
              kcu_ep_forward(e, T, xd, MOE_F32, yl[l], MOE_F32, 0, lst[l]) != MOE_OK;
    }
    for (size_t l = 0; l < L && !bad; l++)
        bad = kcu_ep_wait(l ? more[l - 1] : ep, lst[l]) != MOE_OK;
    std::vector<float> h(n);
    for (size_t l = 0; l < L && !bad; l++) {
        bad = cudaMemcpy(h.data(), yl[l], n * 4, cudaMemcpyDeviceToHost) != cudaSuccess ||
              memcmp(h.data(), w->yc[ci][r].data(), n * 4) != 0;
        if (bad)
            printf("check-infer --layers: rank %d, chunks %d: layer %zu's y differs from layer "
                   "0's alone (or a call failed)\n",
                   r, w->o.chunks[ci], l);
    }
    for (float *p : yl)
        if (p)
            cudaFree(p);
    return bad;
}

static void *rank_main(void *arg)
{
    auto *pr = (std::pair<world *, int> *)arg;
    world *w = pr->first;
    const int r = pr->second, W = w->o.W, T = w->o.T;
    const shape s = w->o.s;
    const size_t H = s.H, F = s.F;
    CK(cudaSetDevice(r));
    ncclComm_t comm;
    CKN(ncclCommInitRank(&comm, W, w->id, r));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    kcu_ep_config c;
    memset(&c, 0, sizeof(c));
    c.H = s.H;
    c.F = s.F;
    c.E = s.E;
    c.K = s.K;
    c.act = KERN_ACT_SWIGLU;
    c.renorm = family_renorm(w->o.family);
    c.route = family_route(w->o.family);
    c.rank = r;
    c.world = W;
    c.T_max = w->o.t_max > T ? w->o.t_max : T;
    c.train = !w->o.infer;
    c.chunks = 1;
    c.dedup = w->o.dedup ? w->o.dedup : -1;
    kcu_ep *ep;
    CKM(kcu_ep_create(&c, comm, &ep));
    int first = 0;
    const int ne = kcu_ep_local_experts(ep, &first);
    ep_upload_weights(w, ep, first);

    /* --layers: layers 1..L-1, the same weights on the same communicator */
    std::vector<kcu_ep *> more(w->o.check_infer ? w->o.layers - 1 : 0, nullptr);
    std::vector<cudaStream_t> lst(more.size() + 1);
    for (size_t l = 0; l < more.size(); l++) {
        CKM(kcu_ep_create(&c, comm, &more[l]));
        ep_upload_weights(w, more[l], first);
    }
    for (cudaStream_t &x : lst)
        CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));

    /* device inputs for the timing runs */
    void *xd, *yd, *dyd, *dxd;
    CK(cudaMalloc(&xd, (size_t)T * H * 4));
    CK(cudaMalloc(&yd, (size_t)T * H * 2));
    CK(cudaMalloc(&dyd, (size_t)T * H * 4));
    CK(cudaMalloc(&dxd, (size_t)T * H * 2));
    CK(cudaMemcpy(xd, w->x[r].data(), (size_t)T * H * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dyd, w->dy[r].data(), (size_t)T * H * 4, cudaMemcpyHostToDevice));
    /* --host-rows: the timed inference forward's x and y (bf16) page-locked on the host */
    void *xh = nullptr, *yh = nullptr;
    if (w->o.host_rows) {
        CK(cudaMallocHost(&xh, (size_t)T * H * 2 + 2));
        CK(cudaMallocHost(&yh, (size_t)T * H * 2 + 2));
        std::vector<uint16_t> xb((size_t)T * H);
        for (size_t i = 0; i < xb.size(); i++)
            xb[i] = bf16_from_f32_inl(w->x[r][i]);
        memcpy(xh, xb.data(), xb.size() * 2);
    }

    if (w->o.check) { /* chunks 2 for the check (the pipelined path) unless --check-chunks */
        CKM(kcu_ep_set_chunks(ep, w->o.check_chunks, 0));
        w->y[r].assign((size_t)T * H, 0.f);
        w->dx[r].assign((size_t)T * H, 0.f);
        CKM(kcu_ep_zero_grads(ep));
        CKM(kcu_ep_forward(ep, T, w->x[r].data(), MOE_F32, w->y[r].data(), MOE_F32, 1, st));
        CKM(kcu_ep_wait(ep, st));
        CKM(kcu_ep_backward(ep, w->dy[r].data(), MOE_F32, w->dx[r].data(), MOE_F32, 0.01f, 0.001f,
                            st));
        CKM(kcu_ep_wait(ep, st));
        /* an inference forward: its own routing path for few slots */
        w->yi[r].assign((size_t)T * H, 0.f);
        CKM(kcu_ep_forward(ep, T, w->x[r].data(), MOE_F32, w->yi[r].data(), MOE_F32, 0, st));
        CKM(kcu_ep_wait(ep, st));
        w->g1[r].resize((size_t)ne * F * H);
        w->g3[r].resize((size_t)ne * F * H);
        w->g2[r].resize((size_t)ne * H * F);
        w->gr[r].resize((size_t)s.E * H);
        CKM(kcu_experts_download_grads(kcu_ep_experts(ep), w->g1[r].data(), w->g3[r].data(),
                                       w->g2[r].data()));
        CKM(kcu_ep_download_router_grad(ep, w->gr[r].data()));
        if (!w->ws1.empty()) { /* this rank's tokens' share of the shared gradients */
            w->gs1[r].resize(w->ws1.size());
            w->gs3[r].resize(w->ws3.size());
            w->gs2[r].resize(w->ws2.size());
            w->gsg[r].resize(H);
            CKM(kcu_ep_download_shared_grads(ep, w->gs1[r].data(), w->gs3[r].data(),
                                             w->gs2[r].data(), w->gsg[r].data()));
        }
    }

    if (w->o.check_infer) /* the inference forward at every chunks value */
        for (size_t ci = 0; ci < w->o.chunks.size(); ci++) {
            CKM(kcu_ep_set_chunks(ep, w->o.chunks[ci], w->o.comm_sms));
            w->yc[ci][r].assign((size_t)T * H, 0.f);
            CKM(kcu_ep_forward(ep, T, w->x[r].data(), MOE_F32, w->yc[ci][r].data(), MOE_F32, 0,
                               st));
            CKM(kcu_ep_wait(ep, st));
            if (r == 0)
                w->yc_ce[ci] = kcu_ep_last_ce(ep, nullptr, nullptr, nullptr);
            if (!more.empty())
                w->layers_bad[ci][r] = layers_back_to_back(w, r, ep, more, lst, xd, ci);
        }

    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    alltoall_fn a2a = (alltoall_fn)dlsym(RTLD_DEFAULT, "ncclAlltoAll");
    void *nb_s = nullptr, *nb_r = nullptr;
    for (size_t ci = 0; ci < w->o.chunks.size(); ci++) {
        CKM(kcu_ep_set_chunks(ep, w->o.chunks[ci], w->o.comm_sms));
        std::vector<double> tf, tb, ta, tn;
        int used_inf = 0, ce_n = 0, ce_of = 0;
        int64_t disp_b = 0, a2a_b = 0, ce_wire = 0;
        for (int it = 0; it < w->o.iters + 2; it++) {
            const double f = timed(w, r, [&] {
                if (xh)
                    CKM(kcu_ep_forward(ep, T, xh, MOE_BF16, yh, MOE_BF16, 0, st));
                else
                    CKM(kcu_ep_forward(ep, T, xd, MOE_F32, yd, MOE_BF16, 0, st));
                CKM(kcu_ep_wait(ep, st));
            });
            used_inf = kcu_ep_last_chunks(ep);
            disp_b = kcu_ep_last_send_bytes(ep);
            a2a_b = kcu_ep_last_a2a_bytes(ep);
            if (it >= 2) { /* the path of each timed inference forward */
                ce_n += kcu_ep_last_ce(ep, &ce_wire, nullptr, nullptr);
                ce_of++;
            }
            /* the all-to-all alone repeats the last forward's transfers:
             * with --dedup the inference forward's (dedup) ones, so before
             * the training forward (which has no dedup with --dedup) */
            const double a0 =
                w->o.dedup ? timed(w, r, [&] { CKM(kcu_ep_bench_exchange(ep, st)); }) : 0;
            const double fb = w->o.infer ? 0 : timed(w, r, [&] {
                CKM(kcu_ep_forward(ep, T, xd, MOE_F32, yd, MOE_BF16, 1, st));
                CKM(kcu_ep_backward(ep, dyd, MOE_F32, dxd, MOE_BF16, 0.f, 0.f, st));
                CKM(kcu_ep_wait(ep, st));
            });
            const double a =
                w->o.dedup ? a0 : timed(w, r, [&] { CKM(kcu_ep_bench_exchange(ep, st)); });
            if (it >= 2) {
                tf.push_back(f);
                tb.push_back(fb);
                ta.push_back(a);
            }
        }
        /* NCCL's own all-to-all with the same bytes: the dispatch's S*H
         * bf16 per rank, evenly split, then back again (two calls) */
        const size_t per_peer = (size_t)T * s.K * H / W;
        if (a2a && W > 1) {
            if (!nb_s) {
                CK(cudaMalloc(&nb_s, per_peer * W * 2));
                CK(cudaMalloc(&nb_r, per_peer * W * 2));
            }
            for (int it = 0; it < w->o.iters + 2; it++) {
                const double n = timed(w, r, [&] {
                    CKN(a2a(nb_s, nb_r, per_peer, ncclBfloat16, comm, st));
                    CKN(a2a(nb_r, nb_s, per_peer, ncclBfloat16, comm, st));
                    CK(cudaStreamSynchronize(st));
                });
                if (it >= 2)
                    tn.push_back(n);
            }
        }
        if (r == 0) {
            w->t_fwd[ci] = median(tf);
            w->t_fb[ci] = median(tb);
            w->t_a2a[ci] = median(ta);
            w->t_nccl[ci] = tn.empty() ? 0 : median(tn);
            w->used[ci] = used_inf; /* chunks 0: chosen per forward */
            w->used_train[ci] = kcu_ep_last_chunks(ep);
            w->ce_n[ci] = ce_n;
            w->ce_of[ci] = ce_of;
        }
        pthread_mutex_lock(&mu);
        w->ce_wire[ci] = std::max(w->ce_wire[ci], ce_wire);
        w->disp_b[ci] = std::max(w->disp_b[ci], disp_b);
        w->a2a_b[ci] = std::max(w->a2a_b[ci], a2a_b);
        pthread_mutex_unlock(&mu);
        pthread_barrier_wait(&w->bar);
    }
    if (r == 0)
        kcu_ep_last_ce(ep, nullptr, &w->ce_total[0], &w->ce_total[1]);
    if (w->o.ce)
        ce_measure(w, r, comm, ep, st, a2a, nb_s, nb_r);
    int64_t rows = 0;
    kcu_ep_last_counts(ep, nullptr, nullptr, nullptr, &rows);
    const int64_t sb = kcu_ep_last_send_bytes(ep);
    const size_t mem = kcu_ep_bytes(ep);
    pthread_mutex_lock(&mu);
    w->send_bytes = std::max(w->send_bytes, sb);
    w->rows_max = std::max(w->rows_max, rows);
    w->rows_min = w->rows_min == 0 ? rows : std::min(w->rows_min, rows);
    w->mem_max = std::max(w->mem_max, mem);
    pthread_mutex_unlock(&mu);
    if (nb_s) {
        cudaFree(nb_s);
        cudaFree(nb_r);
    }
    cudaFree(xd);
    cudaFree(yd);
    if (xh)
        cudaFreeHost(xh);
    if (yh)
        cudaFreeHost(yh);
    cudaFree(dyd);
    cudaFree(dxd);
    for (kcu_ep *m : more)
        kcu_ep_destroy(m);
    for (cudaStream_t &x : lst)
        cudaStreamDestroy(x);
    kcu_ep_destroy(ep);
    ncclCommDestroy(comm);
    cudaStreamDestroy(st);
    return nullptr;
}

static double rel(const float *a, const float *b, size_t n, int *nan)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]))
            *nan = 1;
        const double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* single_layer: the one-GPU layer on GPU 0 (current device afterwards)
 * with the whole layer's weights, T_max every rank's tokens (W*T), the
 * run's routing family; train: its training state too. The checks'
 * reference; the caller destroys it. */
static kcu_layer *single_layer(world *w, int train)
{
    const opts &o = w->o;
    const shape s = o.s;
    CK(cudaSetDevice(0));
    kcu_config c;
    memset(&c, 0, sizeof(c));
    c.H = s.H;
    c.F = s.F;
    c.E = s.E;
    c.K = s.K;
    c.act = KERN_ACT_SWIGLU;
    c.renorm = family_renorm(o.family);
    c.T_max = o.W * o.T;
    c.train = train;
    const kcu_route_config rc = family_route(o.family);
    kcu_layer *l;
    CKM(kcu_layer_create_ex(&c, &rc, &l));
    CKM(kcu_layer_upload(l, w->wr.data(), w->w1.data(), w->w3.data(), w->w2.data()));
    if (!w->bias.empty())
        CKM(kcu_layer_upload_bias(l, w->bias.data()));
    if (!w->ws1.empty())
        CKM(kcu_layer_upload_shared(l, w->ws1.data(), w->ws3.data(), w->ws2.data(),
                                    w->wsg.empty() ? nullptr : w->wsg.data()));
    return l;
}

/* the single-GPU layer on GPU 0 over all W*T tokens; returns 0 if all pass */
static int check_single(world *w)
{
    const opts &o = w->o;
    const shape s = o.s;
    const int W = o.W, T = o.T, E = s.E;
    const size_t H = s.H, F = s.F, TT = (size_t)W * T;
    const int shared = !w->ws1.empty(), gate = !w->wsg.empty();
    kcu_layer *l = single_layer(w, 1);
    std::vector<float> x(TT * H), dy(TT * H), y(TT * H), dx(TT * H);
    for (int r = 0; r < W; r++) {
        memcpy(x.data() + (size_t)r * T * H, w->x[r].data(), (size_t)T * H * 4);
        memcpy(dy.data() + (size_t)r * T * H, w->dy[r].data(), (size_t)T * H * 4);
    }
    CKM(kcu_forward(l, (int)TT, x.data(), MOE_F32, y.data(), MOE_F32, 1, nullptr));
    CKM(kcu_backward(l, dy.data(), MOE_F32, dx.data(), MOE_F32, 0.01f, 0.001f, nullptr, 0,
                     nullptr));
    CK(cudaDeviceSynchronize());
    std::vector<float> g1((size_t)E * F * H), g3((size_t)E * F * H), g2((size_t)E * H * F),
        gr((size_t)E * H);
    CKM(kcu_layer_download_grads(l, gr.data(), g1.data(), g3.data(), g2.data()));
    std::vector<float> gs1(w->ws1.size()), gs3(w->ws3.size()), gs2(w->ws2.size()), gsg(H);
    if (shared)
        CKM(kcu_layer_download_shared_grads(l, gs1.data(), gs3.data(), gs2.data(), gsg.data()));
    kcu_layer_destroy(l);
    int nan = 0, fail = 0;
    double ey = 0, edx = 0, eg = 0, egr = 0;
    size_t ybits = 0;
    double eyi = 0;
    for (int r = 0; r < W; r++) {
        ey = std::max(ey, rel(w->y[r].data(), y.data() + (size_t)r * T * H, (size_t)T * H, &nan));
        eyi =
            std::max(eyi, rel(w->yi[r].data(), y.data() + (size_t)r * T * H, (size_t)T * H, &nan));
        ybits += memcmp(w->y[r].data(), y.data() + (size_t)r * T * H, (size_t)T * H * 4) != 0;
        edx =
            std::max(edx, rel(w->dx[r].data(), dx.data() + (size_t)r * T * H, (size_t)T * H, &nan));
        const int a = placement_first(E, W, r), ne = placement_count(E, W, r);
        eg = std::max(
            eg, rel(w->g1[r].data(), g1.data() + (size_t)a * F * H, (size_t)ne * F * H, &nan));
        eg = std::max(
            eg, rel(w->g3[r].data(), g3.data() + (size_t)a * F * H, (size_t)ne * F * H, &nan));
        eg = std::max(
            eg, rel(w->g2[r].data(), g2.data() + (size_t)a * H * F, (size_t)ne * H * F, &nan));
    }
    std::vector<float> grs((size_t)E * H, 0.f);
    for (int r = 0; r < W; r++)
        for (size_t i = 0; i < grs.size(); i++)
            grs[i] += w->gr[r][i];
    egr = rel(grs.data(), gr.data(), grs.size(), &nan);
    /* the shared expert's and the gate's gradients: each rank's share of
     * its own tokens, summed over the ranks (the worker's all-reduce) */
    double esh = 0, egate = 0;
    if (shared) {
        auto sum_rel = [&](const std::vector<std::vector<float>> &part,
                           const std::vector<float> &ref) {
            std::vector<float> sum(ref.size(), 0.f);
            for (int r = 0; r < W; r++)
                for (size_t i = 0; i < sum.size(); i++)
                    sum[i] += part[r][i];
            return rel(sum.data(), ref.data(), sum.size(), &nan);
        };
        esh = std::max(sum_rel(w->gs1, gs1), std::max(sum_rel(w->gs3, gs3), sum_rel(w->gs2, gs2)));
        if (gate)
            egate = sum_rel(w->gsg, gsg);
    }
    const double tol = 1e-2;
    fail = nan || ey > tol || eyi > tol || edx > tol || eg > tol || egr > tol || esh > tol ||
           egate > tol;
    char extra[128] = "";
    if (shared)
        snprintf(extra, sizeof(extra), ", shared expert grads %.2e, gate grad %s%.2e", esh,
                 gate ? "" : "(none) ", egate);
    printf("check vs single GPU (%zu tokens on GPU 0, %s routing, dedup %d): y %.2e (%s), y of an "
           "inference forward %.2e, dx %.2e, expert grads %.2e, router grad %.2e%s%s -> %s\n",
           TT, FAM_NAMES[o.family], o.dedup, ey, ybits ? "differs in bits" : "bit-identical", eyi,
           edx, eg, egr, extra, nan ? ", NaN" : "", fail ? "FAIL" : "pass");
    return fail;
}

/* --check-infer: the single-GPU layer's inference forward on GPU 0 over all
 * W*T tokens against the expert-parallel inference forward at each chunks
 * value; returns 0 if all are within the tolerance (bit-identical expected:
 * "differs" in bits is reported, not failed) */
static int check_infer(world *w)
{
    const opts &o = w->o;
    const shape s = o.s;
    const int W = o.W, T = o.T;
    const size_t H = s.H, TT = (size_t)W * T;
    kcu_layer *l = single_layer(w, 0);
    std::vector<float> x(TT * H), y(TT * H);
    for (int r = 0; r < W; r++)
        memcpy(x.data() + (size_t)r * T * H, w->x[r].data(), (size_t)T * H * 4);
    CKM(kcu_forward(l, (int)TT, x.data(), MOE_F32, y.data(), MOE_F32, 0, nullptr));
    CK(cudaDeviceSynchronize());
    kcu_layer_destroy(l);
    int fail = 0;
    for (size_t ci = 0; ci < o.chunks.size(); ci++) {
        int nan = 0, bits = 0;
        double e = 0, maxabs = 0;
        for (int r = 0; r < W; r++) {
            const float *a = w->yc[ci][r].data(), *b = y.data() + (size_t)r * T * H;
            e = std::max(e, rel(a, b, (size_t)T * H, &nan));
            bits |= memcmp(a, b, (size_t)T * H * 4) != 0;
            for (size_t i = 0; i < (size_t)T * H; i++)
                maxabs = std::max(maxabs, (double)fabsf(a[i] - b[i]));
        }
        const int bad = nan || e > 1e-2;
        fail |= bad;
        printf("check-infer vs single GPU (%zu tokens on GPU 0, %s routing), chunks %d, dedup "
               "%s, exchange %s: y max abs diff %.3e, rel %.2e, %s%s -> %s\n",
               TT, FAM_NAMES[o.family], o.chunks[ci], o.dedup ? "on" : "off",
               w->yc_ce[ci] ? "CE (copy engines)" : "send/recv", maxabs, e,
               bits ? "differs" : "bit-identical", nan ? ", NaN" : "", bad ? "FAIL" : "pass");
        if (o.layers > 1) {
            int lb = 0;
            for (int r = 0; r < W; r++)
                lb |= w->layers_bad[ci][r];
            fail |= lb;
            printf("check-infer --layers %d, chunks %d: the layers' forwards back to back, each on "
                   "its own stream: every layer's y bit-identical to the one above -> %s\n",
                   o.layers, o.chunks[ci], lb ? "FAIL" : "pass");
        }
    }
    return fail;
}

int main(int argc, char **argv)
{
    world *w = new world;
    opts &o = w->o;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--gpus")) {
            o.W = atoi(v);
            i++;
        } else if (!strcmp(a, "--tokens")) {
            o.T = atoi(v);
            i++;
        } else if (!strcmp(a, "--iters")) {
            o.iters = atoi(v);
            i++;
        } else if (!strcmp(a, "--t-max")) {
            o.t_max = atoi(v);
            i++;
        } else if (!strcmp(a, "--host-rows")) {
            o.host_rows = 1;
        } else if (!strcmp(a, "--shape")) {
            int ok = 0;
            for (const shape &s : SHAPES)
                if (!strcmp(s.name, v)) {
                    o.s = s;
                    ok = 1;
                }
            if (!ok) {
                fprintf(stderr, "unknown shape %s\n", v);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--chunks")) {
            o.chunks.clear();
            for (const char *p = v; *p;) {
                o.chunks.push_back(atoi(p));
                while (*p && *p != ',')
                    p++;
                if (*p)
                    p++;
            }
            i++;
        } else if (!strcmp(a, "--comm-sms")) {
            o.comm_sms = atoi(v);
            i++;
        } else if (!strcmp(a, "--skew")) {
            o.skew = 1;
        } else if (!strcmp(a, "--check")) {
            o.check = 1;
        } else if (!strcmp(a, "--infer")) {
            o.infer = 1;
        } else if (!strcmp(a, "--dedup")) {
            o.dedup = 1;
        } else if (!strcmp(a, "--dedup-train")) {
            o.dedup = 2;
        } else if (!strcmp(a, "--no-dedup")) {
            o.dedup = 0;
        } else if (!strcmp(a, "--ce")) {
            o.ce = 1;
        } else if (!strcmp(a, "--check-infer")) {
            o.check_infer = 1;
        } else if (!strcmp(a, "--layers")) {
            o.layers = atoi(v);
            i++;
        } else if (!strcmp(a, "--check-chunks")) {
            o.check_chunks = atoi(v);
            i++;
        } else if (!strcmp(a, "--family")) {
            if (!strcmp(v, "dsv3"))
                o.family = FAM_DSV3;
            else if (!strcmp(v, "qwen2"))
                o.family = FAM_QWEN2;
            else {
                fprintf(stderr, "unknown family %s (dsv3|qwen2)\n", v);
                return 2;
            }
            i++;
        } else {
            fprintf(stderr,
                    "usage: %s --gpus W --shape mixtral|qwen3|deepseek|small|moe64 [--tokens T] "
                    "[--chunks 1,2,4] [--comm-sms N] [--iters N] [--skew] [--check] "
                    "[--check-chunks N] [--infer] [--family dsv3|qwen2] [--dedup] "
                    "[--dedup-train] [--no-dedup] [--check-infer] [--layers L] [--ce]\n",
                    argv[0]);
            return 2;
        }
    }
    int ndev = 0;
    CK(cudaGetDeviceCount(&ndev));
    if (o.layers < 1 || (o.layers > 1 && !o.check_infer)) {
        fprintf(stderr, "ep_bench: --layers L >= 1, and above 1 only with --check-infer\n");
        return 2;
    }
    if (o.W < 1 || o.W > ndev || o.T < 1 || o.iters < 1 || o.chunks.empty()) {
        fprintf(stderr, "ep_bench: need 1 <= --gpus <= %d devices, --tokens >= 1\n", ndev);
        return 2;
    }
    if (o.check && o.infer) {
        fprintf(stderr, "ep_bench: --check compares training outputs; not with --infer\n");
        return 2;
    }
    const shape s = o.s;
    const size_t H = s.H, F = s.F, E = s.E;
    const kcu_route_config fam = family_route(o.family);
    if (o.family != FAM_PLAIN) { /* the family's limits (kern_cuda.h), the check's kcu_layer's */
        const int ng = fam.n_group > 1 ? fam.n_group : 1;
        const int tg = fam.topk_group > 0 ? fam.topk_group : ng;
        /* E + shared experts > 256: the check's kcu_layer holds the shared
         * expert apart, as kcu_ep */
        if (s.E % ng || s.K > tg * (s.E / ng)) {
            fprintf(stderr,
                    "ep_bench: --family %s needs E %% %d == 0, K <= %d * E / %d (shape %s: E=%d "
                    "K=%d)\n",
                    FAM_NAMES[o.family], ng, tg, ng, s.name, s.E, s.K);
            return 2;
        }
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("ep_bench: %s x%d, shape %s (H=%d F=%d E=%d K=%d), %d tokens per GPU, SwiGLU bf16, "
           "%s routing, %s\n",
           prop.name, o.W, s.name, s.H, s.F, s.E, s.K, o.T, o.skew ? "skewed" : "random",
           FAM_NAMES[o.family]);
    const double t0 = now_s();
    gen(w->wr, E * H, 1, 1.0f / sqrtf((float)H), 0.f);
    if (o.skew) /* expert 0 wins for most tokens: its router row leans on the inputs' mean */
        for (size_t i = 0; i < H; i++)
            w->wr[i] += 4.0f / (float)H;
    gen(w->w1, E * F * H, 2, 1.0f / sqrtf((float)H), 0.f);
    gen(w->w3, E * F * H, 3, 1.0f / sqrtf((float)H), 0.f);
    gen(w->w2, E * H * F, 4, 1.0f / sqrtf((float)F), 0.f);
    if (o.family == FAM_DSV3) /* a choice bias of the scores' spread (sigmoid ~0.5 +- 0.1) */
        gen(w->bias, E, 5, 0.05f, 0.f);
    if (fam.shared_experts > 0) {
        const size_t Fs = (size_t)fam.shared_experts * F;
        gen(w->ws1, Fs * H, 6, 1.0f / sqrtf((float)H), 0.f);
        gen(w->ws3, Fs * H, 7, 1.0f / sqrtf((float)H), 0.f);
        gen(w->ws2, H * Fs, 8, 1.0f / sqrtf((float)Fs), 0.f);
        if (fam.shared_gate)
            gen(w->wsg, H, 9, 1.0f / sqrtf((float)H), 0.f);
    }
    w->x.resize(o.W);
    w->dy.resize(o.W);
    w->y.resize(o.W);
    w->yi.resize(o.W);
    w->dx.resize(o.W);
    w->g1.resize(o.W);
    w->g3.resize(o.W);
    w->g2.resize(o.W);
    w->gr.resize(o.W);
    w->gs1.resize(o.W);
    w->gs3.resize(o.W);
    w->gs2.resize(o.W);
    w->gsg.resize(o.W);
    for (int r = 0; r < o.W; r++) {
        gen(w->x[r], (size_t)o.T * H, 100 + r, 1.0f, o.skew ? 0.5f : 0.f);
        gen(w->dy[r], (size_t)o.T * H, 200 + r, 1.0f, 0.f);
    }
    printf("inputs generated in %.1f s\n", now_s() - t0);
    const size_t nc = o.chunks.size();
    w->t_fwd.assign(nc, 0);
    w->t_fb.assign(nc, 0);
    w->t_a2a.assign(nc, 0);
    w->t_nccl.assign(nc, 0);
    w->used.assign(nc, 0);
    w->used_train.assign(nc, 0);
    w->rank_ms.assign(o.W, 0);
    w->rank_ok.assign(o.W, 0);
    w->disp_b.assign(nc, 0);
    w->a2a_b.assign(nc, 0);
    w->yc.assign(o.check_infer ? nc : 0, std::vector<std::vector<float>>(o.W));
    w->layers_bad.assign(nc, std::vector<int>(o.W, 0));
    w->yc_ce.assign(nc, 0);
    w->ce_n.assign(nc, 0);
    w->ce_of.assign(nc, 0);
    w->ce_wire.assign(nc, 0);
    CKN(ncclGetUniqueId(&w->id));
    pthread_barrier_init(&w->bar, nullptr, o.W);
    std::vector<pthread_t> th(o.W);
    std::vector<std::pair<world *, int>> args(o.W);
    for (int r = 0; r < o.W; r++) {
        args[r] = {w, r};
        pthread_create(&th[r], nullptr, rank_main, &args[r]);
    }
    for (int r = 0; r < o.W; r++)
        pthread_join(th[r], nullptr);
    int fail = 0;
    if (o.check)
        fail = check_single(w);
    if (o.check_infer)
        fail |= check_infer(w);

    const double flops_fwd = 2.0 * o.T * s.K * 3.0 * H * F; /* per GPU */
    printf("rows received per GPU: %lld..%lld (of %lld routed per GPU); off-GPU dispatch bytes "
           "per GPU (max) %.1f MB; device memory per GPU (kcu_ep) %.2f GB\n",
           (long long)w->rows_min, (long long)w->rows_max, (long long)o.T * s.K,
           w->send_bytes / 1e6, w->mem_max / 1e9);
    printf("%-9s %9s %10s %12s %9s %10s %9s %9s %9s %8s %9s %9s %6s\n", "chunks", "fwd ms",
           "fwd+bwd", "tokens/s", "a2a ms", "a2a GB/s", "nccl ms", "nccl GB/s", "a2a/nccl",
           "hidden", "disp MB", "a2a MB", "ce");
    const double base = w->t_fwd[0];
    for (size_t i = 0; i < nc; i++) {
        /* a2a: dispatch + return of the forward; GB/s counts both directions'
         * off-GPU bytes of the busiest rank. ncclAlltoAll moves T*K*H*2 bytes
         * per rank each way (its own part included), the same amount. */
        const double bytes = 2.0 * (double)o.T * s.K * H * 2;
        const double a2a_gbs = w->t_a2a[i] > 0 ? bytes / (w->t_a2a[i] * 1e6) : 0;
        const double n_gbs = w->t_nccl[i] > 0 ? bytes / (w->t_nccl[i] * 1e6) : 0;
        const double hidden = (o.chunks[0] == 1 && w->t_a2a[i] > 0 && o.chunks[i] > 1)
                                  ? (base - w->t_fwd[i]) / w->t_a2a[i]
                                  : 0;
        char lab[24];
        if (o.chunks[i])
            snprintf(lab, sizeof(lab), "%d", o.chunks[i]);
        else /* auto: the inference forward's / the training forward's */
            snprintf(lab, sizeof(lab), "auto:%d/%d", w->used[i], w->used_train[i]);
        char cel[24];
        snprintf(cel, sizeof(cel), "%d/%d", w->ce_n[i], w->ce_of[i]);
        printf("%-9s %9.3f %10.3f %12.0f %9.3f %10.1f %9.3f %9.1f %9.2f %7.0f%% %9.1f %9.1f %6s\n",
               lab, w->t_fwd[i], w->t_fb[i], o.T * (double)o.W / (w->t_fwd[i] * 1e-3), w->t_a2a[i],
               a2a_gbs, w->t_nccl[i], n_gbs, w->t_nccl[i] > 0 ? w->t_a2a[i] / w->t_nccl[i] : 0,
               hidden * 100, w->disp_b[i] / 1e6, w->a2a_b[i] / 1e6, cel);
    }
    {
        const char *cev = getenv("KCU_EP_CE");
        printf("CE path (KCU_EP_CE=%s): ce = timed inference forwards on the copy-engine "
               "exchange / timed; rank 0's layer: %lld forwards on it, %lld fallen back to "
               "send/recv; wire MB with padding (busiest rank, last forward):",
               cev && *cev ? cev : "unset", (long long)w->ce_total[0], (long long)w->ce_total[1]);
        for (size_t i = 0; i < nc; i++)
            printf(" %.1f", w->ce_wire[i] / 1e6);
        printf("\n");
    }
    printf("disp MB / a2a MB: the inference forward's off-GPU bytes of the busiest rank, "
           "dispatch / dispatch and return (kcu_ep_last_send_bytes, kcu_ep_last_a2a_bytes)%s; "
           "a2a GB/s counts the bytes without dedup (2*T*K*H*2) as before\n",
           o.dedup ? ", dedup: unique rows and their metadata out" : "");
    printf("fwd TFLOP/s per GPU at chunks=%d: %.0f (expert GEMMs, 2*T*K*3*H*F per GPU)\n",
           o.chunks[0], flops_fwd / (w->t_fwd[0] * 1e-3) / 1e12);
    printf("hidden = (fwd at chunks 1 - fwd at chunks c) / a2a time at chunks c\n");
    return fail;
}
