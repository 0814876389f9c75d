/*
 * service_bench.c - checks and times a running cluster through libmoe.
 *
 *   service_bench --url URL [--d-model H --d-ff F --experts E --top-k K]
 *                 [--dtype bf16|f32] [--tokens T,T,...] [--iters N] [--train]
 *                 [--paths coordinator,socket,shm,shm-zc,bulk,bulk1,nccl] [--no-ref]
 *                 [--client-device N]
 *
 * Creates a model "sb" (seed 1), then for each T: forward (and with --train
 * backward) through the service, compared with the single-process CPU
 * reference (kern_moe_forward_ref / kern_moe_backward_ref) on the same
 * seeded weights: relative error ||out - ref|| / ||ref||, bound 1e-2 for bf16
 * and 1e-4 for f32. Then the time per call (median of --iters) and tokens/s,
 * for each data path (docs/PROTOCOL.md, "Data plane"; "bulk": every
 * worker's rows over its bulk TCP endpoint; "shm-zc": shared memory with x
 * and y in moe_buffer_alloc buffers), beside the limits measured in the
 * same run:
 *   - compute: the workers' own time for the call (the sum of the phases
 *     they report: gate, dispatch, experts, combine; SERVICE_BENCH_PHASES=1
 *     prints the last call's phases too);
 *   - nng: a raw nng req/rep round trip of the same bytes (x out, y back) on
 *     the coordinator's transport, to an echo server in this process;
 *   - tcp: the same bytes out and back over one plain loopback TCP
 *     connection with large writes, to an echo thread in this process (the
 *     most the bulk path on one connection, "bulk1", can do here), and over
 *     $MOE_BULK_STREAMS (default 4) connections at once, each with its share
 *     (the floor of "bulk", which splits large rows that way);
 *   - pinned (CUDA builds): the same bytes host->device->host from pinned
 *     memory on GPU 0.
 * "nccl" (CUDA builds, CUDA workers): x and y in cudaMalloc'ed memory of GPU
 * --client-device (default 0), each worker's rows over a NCCL communicator
 * with it; its line adds the floor measured in the same run, over the same
 * communicator: raw ncclSend + ncclRecv of the same bytes to rank 0's worker
 * and back (moe_nccl_floor; all T rows: with one worker, exactly what the
 * call moves), and "floor/path" (>= 80% is the bar).
 * Each path's line also gives "path": the call's time less the workers'
 * compute (what moving the rows costs on that path, copies included), and
 * raw nng's time over it ("nng/path": how many times faster than one raw
 * nng round trip of the same bytes the path moves them).
 * Prints one line per case and exits non-zero if any check fails. Not a
 * test: it runs against whatever cluster you point it at (GPU workers too).
 */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/kern.h"
#include "base/moe.h"
#include "common/rng.h"
#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double rel_err(const float *a, const float *b, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] != a[i])
            return INFINITY;
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r += (double)b[i] * b[i];
    }
    return sqrt(d / (r > 0 ? r : 1e-30));
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void to_wire(const float *x, size_t n, moe_dtype dt, void *out)
{
    if (dt == MOE_F32) {
        memcpy(out, x, n * 4);
        return;
    }
    uint16_t *h = out;
    for (size_t i = 0; i < n; i++)
        h[i] = kern_f32_to_bf16(x[i]);
}

static void from_wire(const void *in, size_t n, moe_dtype dt, float *x)
{
    if (dt == MOE_F32) {
        memcpy(x, in, n * 4);
        return;
    }
    const uint16_t *h = in;
    for (size_t i = 0; i < n; i++)
        x[i] = kern_bf16_to_f32(h[i]);
}

/* ---- the raw nng floor: an echo of n bytes out and n bytes back ---- */

typedef struct echo_srv {
    nng_socket sock;
    char url[256];
    volatile int stop;
} echo_srv;

static void *echo_main(void *arg)
{
    echo_srv *e = arg;
    while (!e->stop) {
        nng_msg *m;
        if (nng_recvmsg(e->sock, &m, 0) != 0)
            return NULL;
        if (nng_sendmsg(e->sock, m, 0) != 0) /* the same bytes back: x out, y back */
            nng_msg_free(m);
    }
    return NULL;
}

/* echo_open listens on the transport of url (tcp -> 127.0.0.1, ipc -> a
 * path beside it) and starts the echo thread. */
static int echo_open(const char *url, echo_srv *e, pthread_t *th)
{
    memset(e, 0, sizeof(*e));
    if (strncmp(url, "ipc://", 6) == 0)
        snprintf(e->url, sizeof(e->url), "ipc:///tmp/moe-sb-echo-%d", (int)getpid());
    else
        snprintf(e->url, sizeof(e->url), "tcp://127.0.0.1:%d", 20000 + (int)(getpid() % 20000));
    if (nng_rep0_open(&e->sock) != 0)
        return -1;
    nng_socket_set_size(e->sock, NNG_OPT_RECVMAXSZ, (size_t)2 << 30);
    if (nng_listen(e->sock, e->url, NULL, 0) != 0)
        return -1;
    return pthread_create(th, NULL, echo_main, e);
}

/* raw_rtt: median seconds of a req/rep of n bytes each way */
static double raw_rtt(const char *url, size_t n, int iters)
{
    nng_socket s;
    double *t = malloc((size_t)iters * sizeof(double)), med;
    if (!t || nng_req0_open(&s) != 0)
        return -1;
    nng_socket_set_size(s, NNG_OPT_RECVMAXSZ, (size_t)2 << 30);
    if (nng_dial(s, url, NULL, 0) != 0)
        return -1;
    for (int it = -2; it < iters; it++) { /* two warm-up rounds */
        nng_msg *m;
        double t0 = now_s();
        if (nng_msg_alloc(&m, n) != 0)
            return -1;
        memset(nng_msg_body(m), it & 0xff, n);
        if (nng_sendmsg(s, m, 0) != 0 || nng_recvmsg(s, &m, 0) != 0)
            return -1;
        nng_msg_free(m);
        if (it >= 0)
            t[it] = now_s() - t0;
    }
    nng_close(s);
    qsort(t, (size_t)iters, sizeof(double), cmp_d);
    med = t[iters / 2];
    free(t);
    return med;
}

/* tcp_rtt: median seconds of n bytes out and n bytes back over `streams`
 * loopback TCP connections at once, each carrying its share of the rows
 * (an echo thread per connection reads its share, then writes it back);
 * -1 on failure */
typedef struct tcp_echo {
    int lfd;
    int iters;
} tcp_echo;

static int tcp_io(int fd, uint8_t *p, size_t n, int wr)
{
    while (n) {
        ssize_t k = wr ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, MSG_WAITALL);
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static void *tcp_echo_main(void *arg)
{
    tcp_echo *e = arg;
    int fd = accept(e->lfd, NULL, NULL);
    uint64_t n = 0; /* the connection's share, sent first */
    if (fd >= 0 && tcp_io(fd, (uint8_t *)&n, sizeof(n), 0) != 0)
        n = 0;
    uint8_t *b = n ? malloc(n) : NULL;
    for (int i = 0; fd >= 0 && b && i < e->iters + 2; i++)
        if (tcp_io(fd, b, n, 0) != 0 || tcp_io(fd, b, n, 1) != 0)
            break;
    free(b);
    if (fd >= 0)
        close(fd);
    return NULL;
}

typedef struct tcp_leg {
    int fd;
    uint8_t *b;
    size_t n;
    int rc;
} tcp_leg;

static void *tcp_leg_main(void *arg)
{
    tcp_leg *l = arg;
    l->rc = tcp_io(l->fd, l->b, l->n, 1) != 0 || tcp_io(l->fd, l->b, l->n, 0) != 0 ? -1 : 0;
    return NULL;
}

static double tcp_rtt(size_t n, int iters, int streams)
{
    enum { MAXS = 16 };
    if (streams < 1 || streams > MAXS)
        return -1;
    struct sockaddr_in sa = {0};
    socklen_t sl = sizeof(sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(lfd, MAXS) != 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl) != 0)
        return -1;
    tcp_echo e[MAXS];
    tcp_leg l[MAXS];
    pthread_t th[MAXS], lt[MAXS];
    int ok = 1;
    for (int s = 0; s < streams; s++) {
        uint64_t share = n * (size_t)(s + 1) / streams - n * (size_t)s / streams;
        e[s] = (tcp_echo){lfd, iters};
        pthread_create(&th[s], NULL, tcp_echo_main, &e[s]);
        l[s] = (tcp_leg){socket(AF_INET, SOCK_STREAM, 0), malloc(share ? share : 1), share, 0};
        ok &= l[s].fd >= 0 && l[s].b && connect(l[s].fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
              tcp_io(l[s].fd, (uint8_t *)&share, sizeof(share), 1) == 0;
        if (l[s].b)
            memset(l[s].b, 1, share);
    }
    double *t = malloc((size_t)iters * sizeof(double)), med = -1;
    int it = -2;
    for (; ok && t && it < iters; it++) {
        double t0 = now_s();
        for (int s = 0; s < streams; s++)
            pthread_create(&lt[s], NULL, tcp_leg_main, &l[s]);
        for (int s = 0; s < streams; s++) {
            pthread_join(lt[s], NULL);
            ok &= l[s].rc == 0;
        }
        if (it >= 0)
            t[it] = now_s() - t0;
    }
    if (ok && it == iters) {
        qsort(t, (size_t)iters, sizeof(double), cmp_d);
        med = t[iters / 2];
    }
    for (int s = 0; s < streams; s++) {
        if (l[s].fd >= 0)
            close(l[s].fd);
        free(l[s].b);
    }
    shutdown(lfd, SHUT_RDWR);
    for (int s = 0; s < streams; s++)
        pthread_join(th[s], NULL);
    close(lfd);
    free(t);
    return med;
}

/* pinned_rtt: median seconds to copy n bytes host->device and n bytes back
 * from pinned memory on GPU 0; -1 without CUDA or a GPU */
static double pinned_rtt(size_t n, int iters)
{
#ifdef MOE_HAVE_CUDA
    void *h = NULL, *d = NULL;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0 ||
        cudaMallocHost(&h, n ? n : 1) != cudaSuccess || cudaMalloc(&d, n ? n : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    double *t = malloc((size_t)iters * sizeof(double)), med;
    for (int it = -2; it < iters; it++) {
        double t0 = now_s();
        cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);
        cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost);
        if (it >= 0)
            t[it] = now_s() - t0;
    }
    qsort(t, (size_t)iters, sizeof(double), cmp_d);
    med = t[iters / 2];
    free(t);
    cudaFreeHost(h);
    cudaFree(d);
    return med;
#else
    (void)n, (void)iters;
    return -1;
#endif
}

/* gpu_bufs: x, y, dy and dx in device memory of GPU dev (n bytes each; x
 * and dy copied from the host ones). 0 without CUDA or on a failure. */
static int gpu_bufs(int dev, size_t n, const void *xh, const void *dyh, void **x, void **y,
                    void **dy, void **dx)
{
#ifdef MOE_HAVE_CUDA
    *x = *y = *dy = *dx = NULL;
    if (cudaSetDevice(dev) != cudaSuccess || cudaMalloc(x, n + 4) != cudaSuccess ||
        cudaMalloc(y, n + 4) != cudaSuccess || cudaMalloc(dy, n + 4) != cudaSuccess ||
        cudaMalloc(dx, n + 4) != cudaSuccess ||
        cudaMemcpy(*x, xh, n, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(*dy, dyh, n, cudaMemcpyHostToDevice) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return 1;
#else
    (void)dev, (void)n, (void)xh, (void)dyh, (void)x, (void)y, (void)dy, (void)dx;
    return 0;
#endif
}

static int gpu_get(void *h, const void *d, size_t n)
{
#ifdef MOE_HAVE_CUDA
    return cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost) == cudaSuccess;
#else
    (void)h, (void)d, (void)n;
    return 0;
#endif
}

static void gpu_free4(void *a, void *b, void *c, void *d)
{
#ifdef MOE_HAVE_CUDA
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(d);
#else
    (void)a, (void)b, (void)c, (void)d;
#endif
}

int main(int argc, char **argv)
{
    const char *url = getenv("MOE_URL") ? getenv("MOE_URL") : "tcp://127.0.0.1:7000";
    const char *dts = "bf16", *tok = "1,64,1024";
    const char *paths = "coordinator,socket,shm"; /* data paths to time */
    int H = 1024, F = 2048, E = 8, K = 2, iters = 10, train = 0, ref = 1, cdev = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--url"))
            url = v, i++;
        else if (!strcmp(a, "--d-model"))
            H = atoi(v), i++;
        else if (!strcmp(a, "--d-ff"))
            F = atoi(v), i++;
        else if (!strcmp(a, "--experts"))
            E = atoi(v), i++;
        else if (!strcmp(a, "--top-k"))
            K = atoi(v), i++;
        else if (!strcmp(a, "--dtype"))
            dts = v, i++;
        else if (!strcmp(a, "--tokens"))
            tok = v, i++;
        else if (!strcmp(a, "--iters"))
            iters = atoi(v), i++;
        else if (!strcmp(a, "--train"))
            train = 1;
        else if (!strcmp(a, "--no-ref"))
            ref = 0;
        else if (!strcmp(a, "--paths"))
            paths = v, i++;
        else if (!strcmp(a, "--client-device"))
            cdev = atoi(v), i++;
        else {
            fprintf(stderr, "service_bench: unknown option %s\n", a);
            return 2;
        }
    }
    moe_dtype dt = strcmp(dts, "f32") == 0 ? MOE_F32 : MOE_BF16;
    double bound = dt == MOE_F32 ? 1e-4 : 1e-2;
    moe_client_opts co = {.timeout_ms = 600000};
    moe_client *c;
    if (moe_client_open(url, &co, &c) != MOE_OK) {
        fprintf(stderr, "service_bench: %s\n", moe_last_error());
        return 1;
    }
    moe_model_config cfg = {"sb", 1, H, F, E, K, "swiglu", 1, 0, dt, 1, 0.01, 0.001};
    if (moe_model_create(c, &cfg) != MOE_OK) {
        fprintf(stderr, "service_bench: model.create: %s\n", moe_last_error());
        return 1;
    }
    /* the reference weights, as the workers make them */
    size_t fh = (size_t)F * H;
    float *wr = malloc((size_t)E * H * 4), *w1 = malloc(E * fh * 4), *w3 = malloc(E * fh * 4),
          *w2 = malloc(E * fh * 4);
    if (!wr || !w1 || !w3 || !w2)
        return 1;
    kern_init_weight(1, 0, 0, KERN_W_ROUTER, E, H, wr);
    for (int e = 0; e < E; e++) {
        kern_init_weight(1, 0, e, KERN_W1, F, H, w1 + e * fh);
        kern_init_weight(1, 0, e, KERN_W3, F, H, w3 + e * fh);
        kern_init_weight(1, 0, e, KERN_W2, H, F, w2 + e * fh);
    }
    if (dt == MOE_BF16) {
        kern_bf16_round_n(wr, (size_t)E * H);
        kern_bf16_round_n(w1, E * fh);
        kern_bf16_round_n(w3, E * fh);
        kern_bf16_round_n(w2, E * fh);
    }
    kern_layer_weights lw = {.wr = wr, .w1 = w1, .w3 = w3, .w2 = w2};
    int failures = 0;
    echo_srv echo;
    pthread_t echo_th;
    if (echo_open(url, &echo, &echo_th) != 0) {
        fprintf(stderr, "service_bench: cannot start the nng echo server\n");
        return 1;
    }
    printf("# service_bench %s: d_model %d d_ff %d experts %d top-%d %s\n", url, H, F, E, K,
           moe_dtype_name(dt));
    for (const char *p = tok; *p;) {
        long T = strtol(p, (char **)&p, 10);
        if (*p == ',')
            p++;
        size_t n = (size_t)T * H, es = moe_dtype_size(dt);
        float *x = malloc(n * 4 + 4), *y = malloc(n * 4 + 4), *yr = malloc(n * 4 + 4);
        float *dy = malloc(n * 4 + 4), *dx = malloc(n * 4 + 4), *dxr = malloc(n * 4 + 4);
        void *xw = malloc(n * es + 4), *yw = malloc(n * es + 4), *dyw = malloc(n * es + 4),
             *dxw = malloc(n * es + 4);
        rng_fill_uniform(7, (uint64_t)T, -1, 1, x, n);
        rng_fill_uniform(8, (uint64_t)T, -1, 1, dy, n);
        if (dt == MOE_BF16) {
            kern_bf16_round_n(x, n);
            kern_bf16_round_n(dy, n);
        }
        to_wire(x, n, dt, xw);
        to_wire(dy, n, dt, dyw);
        moe_fwd_info info;
        moe_err e = train ? moe_forward_train(c, "sb", 0, dt, xw, T, H, yw, &info)
                          : moe_forward(c, "sb", 0, dt, xw, T, H, yw, &info);
        if (e == MOE_OK && train)
            e = moe_backward(c, info.handle, dt, dyw, T, H, dxw);
        if (e != MOE_OK) {
            printf("T=%-6ld FAIL %s\n", T, moe_last_error());
            failures++;
            continue;
        }
        moe_fwd_info_free(&info);
        double ey = 0, edx = 0;
        if (ref) {
            kern_moe_shape sh = {.T = (int)T,
                                 .H = H,
                                 .F = F,
                                 .E = E,
                                 .K = K,
                                 .act = KERN_ACT_SWIGLU,
                                 .renorm = 1,
                                 .capacity_factor = 0,
                                 .bf16 = dt == MOE_BF16};
            kern_moe_forward_ref(&sh, &lw, x, yr, NULL);
            from_wire(yw, n, dt, y);
            ey = rel_err(y, yr, n);
            if (train) {
                float *g1 = malloc(E * fh * 4), *g3 = malloc(E * fh * 4), *g2 = malloc(E * fh * 4),
                      *gr = malloc((size_t)E * H * 4);
                kern_moe_backward_ref(&sh, &lw, x, dy, 0.01f, 0.001f, dxr, gr, g1, g3, g2);
                from_wire(dxw, n, dt, dx);
                edx = rel_err(dx, dxr, n);
                free(g1), free(g3), free(g2), free(gr);
            }
        }
        /* timing: each data path, beside the floors of the same bytes */
        double floor_nng = raw_rtt(echo.url, n * es, iters);
        double floor_tcp = tcp_rtt(n * es, iters, 1);
        /* the split bulk path's floor: as many streams as it uses */
        const char *se = getenv("MOE_BULK_STREAMS");
        int streams = se && atoi(se) > 0 ? atoi(se) : 4;
        double floor_tcpn = streams > 1 ? tcp_rtt(n * es, iters, streams) : -1;
        double floor_pin = pinned_rtt(n * es, iters);
        int ok = !ref || (ey < bound && (!train || edx < bound));
        failures += !ok;
        printf("T=%-6ld %s  y err %.2e", T, ok ? "PASS" : "FAIL", ey);
        if (train)
            printf("  dx err %.2e", edx);
        printf("  | floors for %.2f MiB each way: raw nng %.3f ms, raw tcp %.3f ms (%.2fx nng)",
               (double)(n * es) / (1 << 20), floor_nng * 1e3, floor_tcp * 1e3,
               floor_tcp > 0 ? floor_nng / floor_tcp : 0.0);
        if (floor_tcpn > 0)
            printf(", raw tcp x%d %.3f ms (%.2fx nng)", streams, floor_tcpn * 1e3,
                   floor_nng / floor_tcpn);
        if (floor_pin >= 0)
            printf(", pinned h2d+d2h %.3f ms", floor_pin * 1e3);
        printf("\n");
        char *saved = se ? strdup(se) : NULL; /* $MOE_BULK_STREAMS as given */
        for (const char *q = paths; *q;) {
            char pname[32];
            size_t pl = strcspn(q, ",");
            snprintf(pname, sizeof(pname), "%.*s", (int)pl, q);
            q += pl + (q[pl] == ',');
            /* "shm-zc": shared memory with x and y in moe_buffer_alloc buffers;
             * "bulk1": the bulk path on one connection per worker */
            int zc = strcmp(pname, "shm-zc") == 0, one = strcmp(pname, "bulk1") == 0;
            if (one)
                setenv("MOE_BULK_STREAMS", "1", 1);
            else if (saved)
                setenv("MOE_BULK_STREAMS", saved, 1);
            else
                unsetenv("MOE_BULK_STREAMS");
            moe_client *pc;
            moe_client_opts po = {.timeout_ms = 600000,
                                  .data_path = zc    ? "shm"
                                               : one ? "bulk"
                                                     : pname};
            if (moe_client_open(url, &po, &pc) != MOE_OK) {
                printf("         %-11s FAIL %s\n", pname, moe_last_error());
                failures++;
                continue;
            }
            double *lat = malloc((size_t)iters * sizeof(double));
            double *cmp = malloc((size_t)iters * sizeof(double));
            void *xin = xw, *yout = yw, *dyin = dyw, *dxout = dxw;
            /* "nccl": the rows in GPU memory; the floor over the same communicator */
            int nc = strcmp(pname, "nccl") == 0;
            double floor_nccl = -1;
            void *ybuf = NULL;
            if (nc && !gpu_bufs(cdev, n * es, xw, dyw, &xin, &yout, &dyin, &dxout)) {
                printf("         %-11s FAIL no GPU %d buffers (a build without CUDA, or no such "
                       "GPU)\n",
                       pname, cdev);
                failures++;
                moe_client_close(pc);
                free(lat);
                free(cmp);
                continue;
            }
            if (zc) {
                xin = moe_buffer_alloc(pc, n * es + 4);
                yout = moe_buffer_alloc(pc, n * es + 4);
                dyin = moe_buffer_alloc(pc, n * es + 4);
                dxout = moe_buffer_alloc(pc, n * es + 4);
                if (!xin || !yout || !dyin || !dxout) {
                    printf("         %-11s FAIL %s\n", pname, moe_last_error());
                    failures++;
                    moe_client_close(pc);
                    continue;
                }
                memcpy(xin, xw, n * es);
                memcpy(dyin, dyw, n * es);
            }
            double last_ph[4] = {0};              /* the last call's phases (s) */
            for (int it = -1; it < iters; it++) { /* one warm-up call */
                moe_fwd_info fi;
                memset(&fi, 0, sizeof(fi));
                double t0 = now_s();
                e = train ? moe_forward_train(pc, "sb", 0, dt, xin, T, H, yout, &fi)
                          : moe_forward(pc, "sb", 0, dt, xin, T, H, yout, &fi);
                if (e == MOE_OK && train)
                    e = moe_backward(pc, fi.handle, dt, dyin, T, H, dxout);
                double dt_s = now_s() - t0;
                if (it >= 0) {
                    lat[it] = dt_s;
                    cmp[it] = fi.gate_s + fi.dispatch_s + fi.experts_s + fi.combine_s;
                    last_ph[0] = fi.gate_s, last_ph[1] = fi.dispatch_s;
                    last_ph[2] = fi.experts_s, last_ph[3] = fi.combine_s;
                }
                moe_fwd_info_free(&fi);
                if (e != MOE_OK) {
                    printf("         %-11s FAIL %s\n", pname, moe_last_error());
                    failures++;
                    break;
                }
            }
            if (nc && e == MOE_OK) { /* y back to the host to compare; the floor */
                ybuf = malloc(n * es + 4);
                if (!ybuf || !gpu_get(ybuf, yout, n * es)) {
                    printf("         %-11s FAIL reading y back from the GPU\n", pname);
                    e = MOE_EINTERNAL;
                    failures++;
                } else if (moe_nccl_floor(pc, 0, dxout, n * es, iters, &floor_nccl) != MOE_OK) {
                    printf("         %-11s FAIL floor: %s\n", pname, moe_last_error());
                    e = MOE_EINTERNAL;
                    failures++;
                }
            }
            if (e == MOE_OK) {
                qsort(lat, (size_t)iters, sizeof(double), cmp_d);
                qsort(cmp, (size_t)iters, sizeof(double), cmp_d);
                double med = lat[iters / 2], kc = cmp[iters / 2];
                printf("         %-11s %s %.3f ms  %.0f tokens/s  compute %.3f ms  "
                       "service/(compute+nng) %.2f",
                       pname, train ? "fwd+bwd(fwd compute)" : "fwd", med * 1e3, T / med, kc * 1e3,
                       med / (kc + floor_nng));
                if (floor_pin >= 0)
                    printf("  service/(compute+pinned) %.2f", med / (kc + floor_pin));
                if (nc)
                    printf("  nccl floor %.3f ms  floor/path %.0f%%", floor_nccl * 1e3,
                           med > kc ? 100 * floor_nccl / (med - kc) : 0.0);
                const void *ycmp = nc ? ybuf : yout;
                int differs = ycmp != yw && memcmp(ycmp, yw, n * es) != 0;
                printf("  nng/service %.0f%%  path %.3f ms  nng/path %.2fx  (p50 of %d)%s\n",
                       100 * floor_nng / med, (med - kc) * 1e3,
                       med > kc ? floor_nng / (med - kc) : 0.0, iters,
                       differs ? "  y DIFFERS from the first path" : "");
                failures += differs;
                if (getenv("SERVICE_BENCH_PHASES"))
                    printf("         %-11s phases of the last call: gate %.3f dispatch %.3f "
                           "experts %.3f combine %.3f ms\n",
                           pname, last_ph[0] * 1e3, last_ph[1] * 1e3, last_ph[2] * 1e3,
                           last_ph[3] * 1e3);
            }
            free(lat);
            free(cmp);
            free(ybuf);
            if (nc)
                gpu_free4(xin, yout, dyin, dxout);
            moe_client_close(pc);
        }
        if (saved)
            setenv("MOE_BULK_STREAMS", saved, 1);
        else
            unsetenv("MOE_BULK_STREAMS");
        free(saved);
        free(x), free(y), free(yr), free(dy), free(dx), free(dxr);
        free(xw), free(yw), free(dyw), free(dxw);
    }
    moe_client_close(c);
    printf("%d passed, %d failed\n", failures ? 0 : 1, failures ? 1 : 0);
    return failures ? 1 : 0;
}
