/*
 * xchg_nccl_check.c - the NCCL exchange backend on real GPUs: one forked
 * process per rank (rank r on device r), like the workers.
 *
 *   1. correctness against host computations: alltoallv (random sizes, zero
 *      parts, device and host buffers), allreduce_f32 (sum within rounding
 *      of a double reference; bit-identical on every rank and on a rerun),
 *      allgather (device and host buffers);
 *   2. timing: xchg_alltoallv (counts exchange + grouped send/recv + sync)
 *      against ncclAlltoAll moving the same bytes, both synchronized per
 *      call, on the same communicator; GB/s = bytes each rank sends to the
 *      other ranks per second;
 *   3. failure: a fresh communicator with a 3 s timeout, the last rank
 *      exits, the others' allreduce must return MOE_EUNAVAIL in time.
 *
 * Build: make bin/xchg_nccl_check (a CUDA build: this file, worker/xchg_nccl.c,
 * xchg_abort.c, the RPC and core libraries, linked with NCCL and cudart).
 * Run: bin/xchg_nccl_check [-n ranks] [-i iters] [-s max MiB per peer]
 *      [-t timeout ms] [-F: skip the failure test]. Exit status 0 = all ok.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "common/log.h"
#include "worker/xchg.h"

#define MAXR 64

typedef struct opts {
    int world, iters, timeout_ms, fail_test;
    size_t max_bytes; /* per peer, timing */
} opts;

/* report: what each rank tells the parent after the checks */
typedef struct report {
    int errors;
    uint64_t ar_hash; /* FNV-1a of the allreduce results */
} report;

static int rank_errors;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            rank_errors++;                                                                         \
            LOG_E(__VA_ARGS__);                                                                    \
        }                                                                                          \
    } while (0)

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            LOG_E("%s: %s", #call, cudaGetErrorString(e_));                                        \
            _exit(10);                                                                             \
        }                                                                                          \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static size_t a2a_size(int round, int s, int d, size_t maxsz)
{
    uint64_t h = mix((uint64_t)round * 1000003u + (uint64_t)s * 1009u + (uint64_t)d);
    if (h % 4 == 0 || maxsz == 0)
        return 0;
    return (size_t)((h >> 8) % maxsz);
}

static uint8_t a2a_byte(int round, int s, int d, size_t i)
{
    uint64_t h =
        mix(((uint64_t)round << 40) ^ ((uint64_t)s << 32) ^ ((uint64_t)d << 24) ^ (i >> 3));
    return (uint8_t)(h >> ((i & 7) * 8));
}

static float ar_val(int round, int rank, size_t i)
{
    uint64_t h = mix(((uint64_t)round << 48) ^ ((uint64_t)rank << 40) ^ i);
    return (float)((int64_t)(h % 2000001u) - 1000000) / 1000.0f;
}

/* full_write/full_read: pipes between the parent and the ranks */
static int full_write(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int full_read(int fd, void *p, size_t n)
{
    char *c = p;
    while (n) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

/* ------------------------------------------------------------------- checks */

static void check_a2a(xchg *x, int round, size_t maxsz, int host)
{
    int r = x->rank, W = x->world;
    size_t sb[MAXR], rb[MAXR], total = 0;
    for (int q = 0; q < W; q++)
        total += sb[q] = a2a_size(round, r, q, maxsz);
    uint8_t *hs = malloc(total + 1);
    size_t off = 0;
    for (int q = 0; q < W; q++)
        for (size_t i = 0; i < sb[q]; i++)
            hs[off++] = a2a_byte(round, r, q, i);
    void *send = hs, *recv = NULL;
    if (!host) {
        CUDA_OK(cudaMalloc(&send, total + 1));
        CUDA_OK(cudaMemcpy(send, hs, total, cudaMemcpyHostToDevice));
    }
    moe_err err = xchg_alltoallv(x, send, sb, &recv, rb);
    CHECK(err == MOE_OK, "alltoallv round %d (%s): %s", round, host ? "host" : "device",
          moe_strerror(err));
    size_t rtotal = 0;
    for (int q = 0; err == MOE_OK && q < W; q++) {
        size_t want = a2a_size(round, q, r, maxsz);
        CHECK(rb[q] == want, "alltoallv round %d: %zu bytes from rank %d, want %zu", round, rb[q],
              q, want);
        rtotal += rb[q];
    }
    if (err == MOE_OK && rtotal) {
        uint8_t *hr = recv;
        if (!host) {
            hr = malloc(rtotal);
            CUDA_OK(cudaMemcpy(hr, recv, rtotal, cudaMemcpyDeviceToHost));
        }
        off = 0;
        for (int q = 0; q < W; q++) {
            for (size_t i = 0; i < rb[q]; i++) {
                if (hr[off + i] != a2a_byte(round, q, r, i)) {
                    CHECK(0, "alltoallv round %d: byte %zu from rank %d differs", round, i, q);
                    break;
                }
            }
            off += rb[q];
        }
        if (!host)
            free(hr);
    }
    xchg_free(x, recv);
    if (!host)
        cudaFree(send);
    free(hs);
}

static uint64_t check_allreduce(xchg *x, int round, size_t n, int host)
{
    int r = x->rank, W = x->world;
    float *h = malloc(n * sizeof(float)), *h2 = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        h[i] = ar_val(round, r, i);
    float *buf = h;
    if (!host) {
        CUDA_OK(cudaMalloc((void **)&buf, n * sizeof(float)));
        CUDA_OK(cudaMemcpy(buf, h, n * sizeof(float), cudaMemcpyHostToDevice));
    }
    moe_err err = xchg_allreduce_f32(x, buf, n);
    CHECK(err == MOE_OK, "allreduce n=%zu: %s", n, moe_strerror(err));
    if (!host)
        CUDA_OK(cudaMemcpy(h, buf, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; err == MOE_OK && i < n; i++) {
        double ref = 0, mag = 0;
        for (int q = 0; q < W; q++) {
            ref += ar_val(round, q, i);
            mag += fabs(ar_val(round, q, i));
        }
        if (fabs(h[i] - ref) > 1e-6 * mag * W + 1e-6) {
            CHECK(0, "allreduce n=%zu: element %zu is %.9g, reference %.9g", n, i, h[i], ref);
            break;
        }
    }
    /* rerun with the same inputs: the same bits */
    for (size_t i = 0; i < n; i++)
        h2[i] = ar_val(round, r, i);
    if (!host)
        CUDA_OK(cudaMemcpy(buf, h2, n * sizeof(float), cudaMemcpyHostToDevice));
    else
        buf = h2;
    err = xchg_allreduce_f32(x, buf, n);
    CHECK(err == MOE_OK, "allreduce rerun: %s", moe_strerror(err));
    if (!host)
        CUDA_OK(cudaMemcpy(h2, buf, n * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(memcmp(h, h2, n * sizeof(float)) == 0, "allreduce n=%zu: rerun gave other bits", n);
    uint64_t hash = fnv(0xcbf29ce484222325ull, h, n * sizeof(float));
    if (!host)
        cudaFree(buf);
    free(h);
    free(h2);
    return hash;
}

static void check_allgather(xchg *x, size_t nb, int host)
{
    int r = x->rank, W = x->world;
    uint8_t *hs = malloc(nb), *hr = malloc(nb * (size_t)W);
    for (size_t i = 0; i < nb; i++)
        hs[i] = a2a_byte(77, r, 0, i);
    void *s = hs, *d = hr;
    if (!host) {
        CUDA_OK(cudaMalloc(&s, nb));
        CUDA_OK(cudaMalloc(&d, nb * (size_t)W));
        CUDA_OK(cudaMemcpy(s, hs, nb, cudaMemcpyHostToDevice));
    }
    moe_err err = xchg_allgather(x, s, nb, d);
    CHECK(err == MOE_OK, "allgather nb=%zu: %s", nb, moe_strerror(err));
    if (!host)
        CUDA_OK(cudaMemcpy(hr, d, nb * (size_t)W, cudaMemcpyDeviceToHost));
    for (int q = 0; err == MOE_OK && q < W; q++)
        for (size_t i = 0; i < nb; i++)
            if (hr[(size_t)q * nb + i] != a2a_byte(77, q, 0, i)) {
                CHECK(0, "allgather nb=%zu: byte %zu of rank %d differs", nb, i, q);
                break;
            }
    if (!host) {
        cudaFree(s);
        cudaFree(d);
    }
    free(hs);
    free(hr);
}

/* -------------------------------------------------------------------- timing */

static int nccl_wait(ncclComm_t comm, ncclResult_t r)
{
    while (r == ncclInProgress)
        if (ncclCommGetAsyncError(comm, &r) != ncclSuccess)
            return -1;
    return r == ncclSuccess ? 0 : -1;
}

static void barrier(xchg *x)
{
    float one = 1;
    if (xchg_allreduce_f32(x, &one, 1) != MOE_OK)
        CHECK(0, "barrier failed");
}

static void timing(xchg *x, const opts *o)
{
    int W = x->world;
    cudaStream_t st = xchg_nccl_stream(x);
    ncclComm_t comm = xchg_nccl_comm(x);
    if (x->rank == 0)
        printf("\nalltoallv timing, %d ranks, %d iterations, synchronized per call\n"
               "%12s %12s %12s %12s %12s %8s\n",
               W, o->iters, "bytes/peer", "xchg us", "xchg GB/s", "a2a us", "a2a GB/s", "ratio");
    for (size_t b = 64 << 10; b <= o->max_bytes; b *= 4) {
        size_t sb[MAXR], rb[MAXR];
        void *send, *recv, *out;
        for (int q = 0; q < W; q++)
            sb[q] = b;
        CUDA_OK(cudaMalloc(&send, b * (size_t)W));
        CUDA_OK(cudaMalloc(&recv, b * (size_t)W));
        CUDA_OK(cudaMemset(send, x->rank, b * (size_t)W));
        CUDA_OK(cudaDeviceSynchronize());
        double t_x = 0, t_n = 0;
        for (int pass = 0; pass < 2; pass++) { /* pass 0 warms up */
            int it = pass ? o->iters : 3;
            barrier(x);
            double t0 = now_s();
            for (int i = 0; i < it; i++) {
                if (xchg_alltoallv(x, send, sb, &out, rb) != MOE_OK) {
                    CHECK(0, "timing: alltoallv failed");
                    return;
                }
                xchg_free(x, out);
            }
            t_x = (now_s() - t0) / it;
            barrier(x);
            t0 = now_s();
            for (int i = 0; i < it; i++) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 3)
                int rc = nccl_wait(comm, ncclAlltoAll(send, recv, b, ncclUint8, comm, st));
#else /* same traffic as one grouped send/recv round */
                int rc = 0;
                ncclGroupStart();
                for (int q = 0; q < W; q++) {
                    ncclSend((char *)send + q * b, b, ncclUint8, q, comm, st);
                    ncclRecv((char *)recv + q * b, b, ncclUint8, q, comm, st);
                }
                rc = nccl_wait(comm, ncclGroupEnd());
#endif
                if (rc != 0 || cudaStreamSynchronize(st) != cudaSuccess) {
                    CHECK(0, "timing: ncclAlltoAll failed");
                    return;
                }
            }
            t_n = (now_s() - t0) / it;
        }
        double bytes = (double)b * (W - 1);
        if (x->rank == 0)
            printf("%12zu %12.1f %12.2f %12.1f %12.2f %8.3f\n", b, t_x * 1e6, bytes / t_x / 1e9,
                   t_n * 1e6, bytes / t_n / 1e9, t_n / t_x);
        cudaFree(send);
        cudaFree(recv);
    }
    fflush(stdout);
}

/* --------------------------------------------------------------------- ranks */

static xchg *open_rank(int r, int W, int rfd, int wfd, int timeout_ms)
{
    uint8_t id[XCHG_NCCL_ID_BYTES];
    xchg *x = NULL;
    if (r == 0) {
        if (xchg_nccl_get_unique_id(id) != MOE_OK)
            _exit(11);
        full_write(wfd, id, sizeof(id));
    } else if (full_read(rfd, id, sizeof(id)) != 0) {
        _exit(12);
    }
    moe_err err = xchg_nccl_open(r, W, id, r, timeout_ms, &x);
    if (err != MOE_OK) {
        LOG_E("rank %d: xchg_nccl_open: %s", r, moe_strerror(err));
        _exit(13);
    }
    return x;
}

static int rank_main(int r, int rfd, int wfd, const opts *o)
{
    char role[32];
    int W = o->world;
    snprintf(role, sizeof(role), "rank%d", r);
    log_init(role, LOG_INFO);
    CUDA_OK(cudaSetDevice(r));
    xchg *x = open_rank(r, W, rfd, wfd, o->timeout_ms);

    report rep = {0, 0xcbf29ce484222325ull};
    for (int round = 0; round < 6; round++)
        check_a2a(x, round, round < 3 ? 5000 : (size_t)8 << 20, 0);
    check_a2a(x, 50, 0, 0); /* nothing at all */
    check_a2a(x, 51, 100000, 1);
    static const size_t ns[] = {1, 3, 1000, (1u << 20) + 3};
    for (size_t k = 0; k < sizeof(ns) / sizeof(ns[0]); k++) {
        uint64_t h = check_allreduce(x, (int)k, ns[k], 0);
        rep.ar_hash = fnv(rep.ar_hash, &h, sizeof(h));
    }
    uint64_t hh = check_allreduce(x, 9, 1000, 1);
    rep.ar_hash = fnv(rep.ar_hash, &hh, sizeof(hh));
    check_allgather(x, 1, 0);
    check_allgather(x, 123457, 0);
    check_allgather(x, 8, 1);
    if (r == 0) {
        printf("correctness: %s\n", rank_errors ? "FAILED (see log)" : "ok on rank 0");
        fflush(stdout);
    }
    timing(x, o);
    xchg_close(x);
    rep.errors = rank_errors;
    full_write(wfd, &rep, sizeof(rep));

    char cmd;
    if (full_read(rfd, &cmd, 1) != 0 || cmd != 'F' || W < 2)
        return rank_errors ? 1 : 0;
    /* failure test: the last rank leaves without a word */
    x = open_rank(r, W, rfd, wfd, 3000);
    barrier(x);
    if (r == W - 1)
        _exit(0);
    float v[1024] = {0}, *d;
    CUDA_OK(cudaMalloc((void **)&d, sizeof(v)));
    CUDA_OK(cudaMemcpy(d, v, sizeof(v), cudaMemcpyHostToDevice));
    double t0 = now_s();
    moe_err err = xchg_allreduce_f32(x, d, 1024);
    double dt = now_s() - t0;
    CHECK(err == MOE_EUNAVAIL, "failure test: allreduce gave %s, want unavailable",
          moe_strerror(err));
    CHECK(dt < 6.0, "failure test: took %.1f s with a 3 s timeout", dt);
    t0 = now_s();
    err = xchg_allreduce_f32(x, d, 1024);
    CHECK(err == MOE_EUNAVAIL && now_s() - t0 < 0.1, "failure test: a later call gave %s",
          moe_strerror(err));
    xchg_close(x);
    if (r == 0)
        printf("failure test: peer exit detected in %.2f s (timeout 3 s): %s\n", dt,
               rank_errors ? "FAILED" : "ok");
    fflush(stdout);
    return rank_errors ? 1 : 0;
}

/* count_gpus asks a child: CUDA must not be initialized before fork. */
static int count_gpus(void)
{
    int p[2], n = 0;
    if (pipe(p) != 0)
        return 0;
    pid_t pid = fork();
    if (pid == 0) {
        int c = 0;
        if (cudaGetDeviceCount(&c) != cudaSuccess)
            c = 0;
        full_write(p[1], &c, sizeof(c));
        _exit(0);
    }
    close(p[1]);
    if (full_read(p[0], &n, sizeof(n)) != 0)
        n = 0;
    close(p[0]);
    waitpid(pid, NULL, 0);
    return n;
}

int main(int argc, char **argv)
{
    opts o = {.world = 0,
              .iters = 20,
              .timeout_ms = 20000,
              .fail_test = 1,
              .max_bytes = (size_t)64 << 20};
    int c;
    while ((c = getopt(argc, argv, "n:i:s:t:F")) != -1) {
        switch (c) {
        case 'n': o.world = atoi(optarg); break;
        case 'i': o.iters = atoi(optarg); break;
        case 's': o.max_bytes = (size_t)atol(optarg) << 20; break;
        case 't': o.timeout_ms = atoi(optarg); break;
        case 'F': o.fail_test = 0; break;
        default:
            fprintf(stderr, "usage: %s [-n ranks] [-i iters] [-s MiB] [-t ms] [-F]\n", argv[0]);
            return 2;
        }
    }
    /* NVLink multicast stays off on the shared GPU hosts (it can take
     * them out of service): force it off for our ranks too. */
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    log_init("check", LOG_INFO);
    if (o.world <= 0)
        o.world = count_gpus();
    if (o.world < 1 || o.world > MAXR || o.iters < 1) {
        fprintf(stderr, "need 1..%d ranks (GPUs visible: %d)\n", MAXR, count_gpus());
        return 2;
    }
    printf("xchg_nccl_check: %d ranks, NCCL headers %d\n", o.world, NCCL_VERSION_CODE);
    fflush(stdout);

    int to[MAXR][2], from[MAXR][2];
    pid_t pid[MAXR];
    for (int r = 0; r < o.world; r++) {
        if (pipe(to[r]) != 0 || pipe(from[r]) != 0)
            return 2;
        pid[r] = fork();
        if (pid[r] == 0) {
            for (int q = 0; q <= r; q++) { /* keep only our own ends */
                close(to[q][1]);
                close(from[q][0]);
                if (q != r) {
                    close(to[q][0]);
                    close(from[q][1]);
                }
            }
            _exit(rank_main(r, to[r][0], from[r][1], &o));
        }
        close(to[r][0]);
        close(from[r][1]);
    }
    /* relay_id: rank 0's unique id to the others */
    int bad = 0;
#define RELAY_ID()                                                                                 \
    do {                                                                                           \
        uint8_t id[XCHG_NCCL_ID_BYTES];                                                            \
        if (full_read(from[0][0], id, sizeof(id)) != 0) {                                          \
            bad = 1;                                                                               \
            break;                                                                                 \
        }                                                                                          \
        for (int r = 1; r < o.world; r++)                                                          \
            full_write(to[r][1], id, sizeof(id));                                                  \
    } while (0)
    RELAY_ID();
    report rep[MAXR] = {{0}};
    for (int r = 0; !bad && r < o.world; r++) {
        if (full_read(from[r][0], &rep[r], sizeof(rep[r])) != 0) {
            fprintf(stderr, "rank %d died before reporting\n", r);
            bad = 1;
        }
    }
    for (int r = 0; !bad && r < o.world; r++) {
        if (rep[r].errors)
            bad = 1;
        if (rep[r].ar_hash != rep[0].ar_hash) {
            fprintf(stderr, "allreduce: rank %d got other bits than rank 0\n", r);
            bad = 1;
        }
    }
    if (!bad)
        printf("allreduce results bit-identical on all %d ranks\n", o.world);
    char cmd = o.fail_test && !bad ? 'F' : 'q';
    for (int r = 0; r < o.world; r++)
        full_write(to[r][1], &cmd, 1);
    if (cmd == 'F' && o.world > 1)
        RELAY_ID();
    for (int r = 0; r < o.world; r++) {
        int st;
        waitpid(pid[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "rank %d: exit status %d\n", r, st);
            bad = 1;
        }
    }
    printf("xchg_nccl_check: %s\n", bad ? "FAILED" : "ok");
    return bad ? 1 : 0;
}
