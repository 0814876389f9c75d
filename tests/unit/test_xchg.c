/*
 * test_xchg.c - the nng exchange backend: W ranks as threads (or forked
 * processes) on 127.0.0.1 with port 0. Checks alltoallv (random sizes, zero
 * parts, several-MB parts, chunking under a small receive cap), allreduce
 * (bit-identical to a rank-order reference sum), allgather, long mixed
 * sequences, garbage on the data socket, and failures: a peer that never
 * shows up, one that closes, hangs or dies mid-run -> MOE_EUNAVAIL in time.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nng/nng.h>
#include <nng/protocol/pipeline0/push.h>

#include "common/log.h"
#include "worker/xchg.h"

#define MAXW 8

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ------------------------------------------------------------ rank threads */

typedef struct tr_rank tr_rank;
typedef void (*tr_fn)(tr_rank *t);
struct tr_rank {
    int rank, world, timeout_ms;
    uint64_t gen;
    char url[128];
    const char **urls;
    xchg_nng_listener *lis;
    xchg *x;
    moe_err open_err;
    tr_fn fn;
    const void *arg;
    char fail[512];
    pthread_t th;
};

/* T_CHECK records the first failed check of a rank (asserted in the main
 * thread: Criterion asserts must not run on other threads). */
#define T_CHECK(t, cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond) && !(t)->fail[0])                                                              \
            snprintf((t)->fail, sizeof((t)->fail), __VA_ARGS__);                                   \
    } while (0)

/* shm_token: set by the shared-memory backend's tests (xchg_shm): the rank
 * threads open that backend instead of nng */
static char shm_token[32];

static void *tr_main(void *arg)
{
    tr_rank *t = arg;
    if (shm_token[0])
        t->open_err = xchg_shm_open(t->rank, t->world, shm_token, t->gen, t->timeout_ms, &t->x);
    else
        t->open_err =
            xchg_nng_open(t->lis, t->rank, t->world, t->urls, t->gen, t->timeout_ms, &t->x);
    t->fn(t);
    xchg_close(t->x);
    xchg_nng_listener_close(t->lis); /* the listener outlives the communicator */
    t->lis = NULL;
    return NULL;
}

/* dead_port returns a TCP socket bound to 127.0.0.1 but not listening
 * (connects are refused; the port stays taken so no other test gets it),
 * and its URL in url. */
static int dead_port(char *url, size_t len)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof(a);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &al), 0);
    snprintf(url, len, "tcp://127.0.0.1:%u", (unsigned)ntohs(a.sin_port));
    return fd;
}

/* tr_run runs fn on W rank threads; ranks in `absent` (bit mask) never
 * open: their URL points at a port where nobody listens. */
static void tr_run(int W, tr_fn fn, const void *arg, int timeout_ms, size_t recv_max,
                   unsigned absent)
{
    tr_rank t[MAXW];
    const char *urls[MAXW];
    memset(t, 0, sizeof(t));
    for (int r = 0; r < W; r++) {
        t[r].rank = r;
        t[r].world = W;
        t[r].timeout_ms = timeout_ms;
        t[r].gen = 7;
        t[r].fn = fn;
        t[r].arg = arg;
        t[r].urls = urls;
        cr_assert_eq(xchg_nng_listen_max("tcp://127.0.0.1:0", recv_max, &t[r].lis, t[r].url,
                                         sizeof(t[r].url)),
                     MOE_OK);
        urls[r] = t[r].url;
    }
    int dead[MAXW];
    for (int r = 0; r < W; r++) {
        dead[r] = -1;
        if (absent & (1u << r)) {
            xchg_nng_listener_close(t[r].lis);
            t[r].lis = NULL;
            dead[r] = dead_port(t[r].url, sizeof(t[r].url));
        }
    }
    for (int r = 0; r < W; r++)
        if (!(absent & (1u << r)))
            cr_assert_eq(pthread_create(&t[r].th, NULL, tr_main, &t[r]), 0);
    for (int r = 0; r < W; r++)
        if (!(absent & (1u << r)))
            pthread_join(t[r].th, NULL);
    for (int r = 0; r < W; r++) {
        if (dead[r] >= 0)
            close(dead[r]);
        cr_expect(t[r].fail[0] == '\0', "W=%d rank %d: %s", W, r, t[r].fail);
    }
}

static int tr_opened(tr_rank *t)
{
    T_CHECK(t, t->open_err == MOE_OK, "open: %s", moe_strerror(t->open_err));
    return t->open_err == MOE_OK;
}

/* --------------------------------------------------------------- alltoallv */

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

/* do_a2a: one alltoallv of round `round`, sizes below maxsz, checked. */
static void do_a2a(tr_rank *t, int round, size_t maxsz)
{
    int r = t->rank, W = t->world;
    size_t sb[MAXW] = {0}, rb[MAXW] = {0}, total = 0;
    for (int q = 0; q < W; q++)
        total += sb[q] = a2a_size(round, r, q, maxsz);
    uint8_t *send = calloc(1, total ? total : 1);
    size_t off = 0;
    for (int q = 0; q < W; q++)
        for (size_t i = 0; i < sb[q]; i++)
            send[off++] = a2a_byte(round, r, q, i);
    void *recv = NULL;
    moe_err err = xchg_alltoallv(t->x, send, sb, &recv, rb);
    free(send);
    T_CHECK(t, err == MOE_OK, "alltoallv round %d: %s", round, moe_strerror(err));
    if (err != MOE_OK)
        return;
    off = 0;
    for (int q = 0; q < W; q++) {
        size_t want = a2a_size(round, q, r, maxsz);
        T_CHECK(t, rb[q] == want, "round %d: %zu bytes from rank %d, want %zu", round, rb[q], q,
                want);
        if (rb[q] != want)
            break;
        const uint8_t *p = (const uint8_t *)recv + off;
        for (size_t i = 0; i < want; i++) {
            if (p[i] != a2a_byte(round, q, r, i)) {
                T_CHECK(t, 0, "round %d: byte %zu from rank %d differs", round, i, q);
                break;
            }
        }
        off += want;
    }
    xchg_free(t->x, recv);
}

static void fn_a2a(tr_rank *t)
{
    if (!tr_opened(t))
        return;
    for (int round = 0; round < 8; round++)
        do_a2a(t, round, 70000);
    do_a2a(t, 100, 0);               /* all parts empty: recvbuf may be NULL */
    do_a2a(t, 101, (size_t)6 << 20); /* several MB per part */
}

Test(xchg_nng, alltoallv_w2, .timeout = 20)
{
    tr_run(2, fn_a2a, NULL, 5000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}
Test(xchg_nng, alltoallv_w3, .timeout = 20)
{
    tr_run(3, fn_a2a, NULL, 5000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}
Test(xchg_nng, alltoallv_w4, .timeout = 20)
{
    tr_run(4, fn_a2a, NULL, 5000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}

/* ------------------------------------------------------ allreduce/allgather */

static float ar_val(int round, int rank, size_t i)
{
    uint64_t h = mix(((uint64_t)round << 48) ^ ((uint64_t)rank << 40) ^ i);
    float m = (float)((int64_t)(h % 2000001u) - 1000000) / 1000.0f;
    return m * (float)(1u << ((h >> 32) % 16)); /* mixed magnitudes: order matters */
}

static void do_allreduce(tr_rank *t, int round, size_t n)
{
    int W = t->world;
    float *buf = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        buf[i] = ar_val(round, t->rank, i);
    moe_err err = xchg_allreduce_f32(t->x, buf, n);
    T_CHECK(t, err == MOE_OK, "allreduce n=%zu: %s", n, moe_strerror(err));
    for (size_t i = 0; err == MOE_OK && i < n; i++) {
        float ref = ar_val(round, 0, i); /* the reference: sum in rank order */
        for (int q = 1; q < W; q++)
            ref += ar_val(round, q, i);
        if (memcmp(&ref, &buf[i], sizeof(float)) != 0) {
            T_CHECK(t, 0, "allreduce n=%zu: element %zu is %a, reference %a", n, i, buf[i], ref);
            break;
        }
    }
    free(buf);
}

static void do_allgather(tr_rank *t, int round, size_t nb)
{
    int W = t->world;
    uint8_t *send = malloc(nb ? nb : 1), *recv = malloc(nb * (size_t)W + 1);
    for (size_t i = 0; i < nb; i++)
        send[i] = a2a_byte(round, t->rank, 0, i);
    moe_err err = xchg_allgather(t->x, send, nb, recv);
    T_CHECK(t, err == MOE_OK, "allgather nb=%zu: %s", nb, moe_strerror(err));
    for (int q = 0; err == MOE_OK && q < W; q++)
        for (size_t i = 0; i < nb; i++)
            if (recv[(size_t)q * nb + i] != a2a_byte(round, q, 0, i)) {
                T_CHECK(t, 0, "allgather nb=%zu: byte %zu of rank %d differs", nb, i, q);
                break;
            }
    free(send);
    free(recv);
}

static void fn_reduce_gather(tr_rank *t)
{
    static const size_t ns[] = {0, 1, 2, 3, 5, 1000, 100003, 1u << 20};
    if (!tr_opened(t))
        return;
    for (size_t k = 0; k < sizeof(ns) / sizeof(ns[0]); k++)
        do_allreduce(t, (int)k, ns[k]);
    static const size_t nbs[] = {0, 1, 777, 1u << 20};
    for (size_t k = 0; k < sizeof(nbs) / sizeof(nbs[0]); k++)
        do_allgather(t, (int)k, nbs[k]);
}

Test(xchg_nng, allreduce_allgather_w2, .timeout = 20)
{
    tr_run(2, fn_reduce_gather, NULL, 5000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}
Test(xchg_nng, allreduce_allgather_w3, .timeout = 20)
{
    tr_run(3, fn_reduce_gather, NULL, 5000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}
Test(xchg_nng, allreduce_allgather_w4, .timeout = 20)
{
    tr_run(4, fn_reduce_gather, NULL, 5000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}

/* Parts far above a 16 KiB receive cap travel as chunks; the float sums
 * work across chunk boundaries. */
static void fn_small_cap(tr_rank *t)
{
    if (!tr_opened(t))
        return;
    do_a2a(t, 1, (size_t)2 << 20);
    do_allreduce(t, 2, 100003);
    do_allgather(t, 3, 300000);
}

Test(xchg_nng, chunking_small_recv_cap, .timeout = 20)
{
    tr_run(3, fn_small_cap, NULL, 5000, 16384, 0);
}

/* A long run of mixed collectives, chosen alike on every rank: ranks drift
 * up to one round apart, so early messages must be kept. */
static void fn_mixed(tr_rank *t)
{
    if (!tr_opened(t))
        return;
    for (int it = 0; it < 60; it++) {
        switch (mix((uint64_t)it) % 3) {
        case 0: do_a2a(t, it, 5000); break;
        case 1: do_allreduce(t, it, 1 + mix((uint64_t)it + 99) % 3000); break;
        default: do_allgather(t, it, mix((uint64_t)it + 7) % 600); break;
        }
    }
}

Test(xchg_nng, mixed_sequence_w4, .timeout = 20)
{
    tr_run(4, fn_mixed, NULL, 5000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}

static void fn_w1(tr_rank *t)
{
    if (!tr_opened(t))
        return;
    do_a2a(t, 1, 1000);
    do_allreduce(t, 2, 10);
    do_allgather(t, 3, 10);
}

Test(xchg_nng, world_of_one, .timeout = 10)
{
    tr_run(1, fn_w1, NULL, 1000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}

/* ------------------------------------------------------------------ failures */

/* A peer that never shows up: open fails with MOE_EUNAVAIL near the timeout. */
static void fn_open_fails(tr_rank *t)
{
    T_CHECK(t, t->open_err == MOE_EUNAVAIL, "open: %s, want unavailable",
            moe_strerror(t->open_err));
    T_CHECK(t, t->x == NULL, "open failed but returned a communicator");
}

Test(xchg_nng, peer_never_shows_up, .timeout = 10)
{
    int64_t t0 = now_ms();
    tr_run(3, fn_open_fails, NULL, 500, XCHG_NNG_RECV_MAX_DEFAULT, 1u << 2);
    int64_t dt = now_ms() - t0;
    cr_expect(dt >= 450 && dt < 2500, "open took %lld ms, timeout 500", (long long)dt);
}

/* Rank W-1 closes its communicator after the first collective; the others
 * fail the second one at once (not at the 5 s timeout), and then fail fast. */
static void fn_peer_closes(tr_rank *t)
{
    if (!tr_opened(t))
        return;
    do_a2a(t, 1, 1000);
    if (t->rank == t->world - 1)
        return; /* tr_main closes */
    float v[100] = {0};
    int64_t t0 = now_ms();
    moe_err err = xchg_allreduce_f32(t->x, v, 100);
    int64_t dt = now_ms() - t0;
    T_CHECK(t, err == MOE_EUNAVAIL, "allreduce after a peer left: %s", moe_strerror(err));
    T_CHECK(t, dt < 2000, "failure took %lld ms (timeout 5000)", (long long)dt);
    T_CHECK(t, t->x->failed == 1, "failed flag not set");
    t0 = now_ms();
    err = xchg_allgather(t->x, v, 4, v);
    T_CHECK(t, err == MOE_EUNAVAIL && now_ms() - t0 < 50, "later call: %s after %lld ms",
            moe_strerror(err), (long long)(now_ms() - t0));
}

Test(xchg_nng, peer_closes_mid_run, .timeout = 20)
{
    tr_run(3, fn_peer_closes, NULL, 5000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}

/* Rank 1 stays connected but never calls the collective: rank 0 times out. */
static void fn_peer_hangs(tr_rank *t)
{
    if (!tr_opened(t))
        return;
    if (t->rank == 1) {
        usleep(1200 * 1000);
        return;
    }
    uint8_t b[64] = {0}, out[128];
    int64_t t0 = now_ms();
    moe_err err = xchg_allgather(t->x, b, sizeof(b), out);
    int64_t dt = now_ms() - t0;
    T_CHECK(t, err == MOE_EUNAVAIL, "allgather with a hung peer: %s", moe_strerror(err));
    T_CHECK(t, dt >= 450 && dt < 1100, "timeout after %lld ms, want ~500", (long long)dt);
}

Test(xchg_nng, peer_hangs_timeout, .timeout = 20)
{
    tr_run(2, fn_peer_hangs, NULL, 500, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}

/* Strangers' messages on the data socket (short, bad magic, old generation)
 * are dropped; the collectives still work. */
typedef struct fake_hdr {
    uint32_t magic;
    uint8_t version, kind;
    uint16_t reserved;
    uint32_t src, reserved2;
    uint64_t gen, seq, total, off;
} fake_hdr;

static void fn_garbage(tr_rank *t)
{
    if (!tr_opened(t))
        return;
    if (t->rank == 0) {
        nng_socket s;
        nng_push0_open(&s);
        nng_dial(s, t->urls[1], NULL, 0);
        fake_hdr h = {.magic = 0x4843584du,
                      .version = 1,
                      .kind = 2,
                      .src = 0,
                      .gen = 6,
                      .seq = 1,
                      .total = 3,
                      .off = 0};
        uint8_t msg[sizeof(h) + 3] = {0};
        nng_send(s, "xy", 2, 0); /* too short */
        memcpy(msg, &h, sizeof(h));
        nng_send(s, msg, sizeof(msg), 0); /* older generation */
        h.magic = 1;
        h.gen = 7;
        memcpy(msg, &h, sizeof(h));
        nng_send(s, msg, sizeof(msg), 0); /* bad magic */
        usleep(50 * 1000);
        nng_close(s);
    }
    do_a2a(t, 1, 1000);
    do_allreduce(t, 2, 77);
}

Test(xchg_nng, garbage_dropped, .timeout = 10)
{
    tr_run(2, fn_garbage, NULL, 3000, XCHG_NNG_RECV_MAX_DEFAULT, 0);
}

/* ---------------------------------------------------------- forked process */

/* Rank 1 is a child process that _exits (no close) after the first
 * collective; rank 0's second collective fails at once. Criterion's worker
 * process already runs nng (its own IPC), and nng refuses to run in a
 * forked child, so the child re-executes this binary: the constructor below
 * runs rank 1 before Criterion's main when XCHG_TEST_CHILD is set. */
static void *exit_soon(void *arg)
{
    (void)arg;
    usleep(200 * 1000);
    _exit(0);
    return NULL;
}

/* child_rank: rank 1. Mode 0: one collective, then _exit when rank 0 says;
 * mode 1: _exit 200 ms into an alltoallv that rank 0 has not joined, with
 * 40 MB for rank 0 (partly sent); mode 2: the same with 0 bytes for rank 0
 * (its part is complete: rank 0 notices only that its send cannot go). */
static void child_rank(const char *spec)
{
    int rfd, wfd, mode;
    char urls[2][128];
    const char *u[2] = {urls[0], urls[1]};
    xchg_nng_listener *lis;
    xchg *x = NULL;
    if (sscanf(spec, "%d,%d,%d", &rfd, &wfd, &mode) != 3)
        _exit(2);
    alarm(15); /* never outlive the test, whatever happens to rank 0 */
    if (xchg_nng_listen("tcp://127.0.0.1:0", &lis, urls[1], sizeof(urls[1])) != MOE_OK)
        _exit(2);
    if (write(wfd, urls[1], sizeof(urls[1])) != (ssize_t)sizeof(urls[1]) ||
        read(rfd, urls[0], sizeof(urls[0])) != (ssize_t)sizeof(urls[0]))
        _exit(2);
    size_t sb[2] = {100, 100}, rb[2];
    uint8_t buf[200] = {0};
    void *rv = NULL;
    if (xchg_nng_open(lis, 1, 2, u, 1, 5000, &x) != MOE_OK)
        _exit(3);
    if (mode == 1 || mode == 2) {
        pthread_t th;
        size_t big[2] = {mode == 1 ? (size_t)40 << 20 : 0, 0};
        uint8_t *b = calloc(1, big[0] + 1);
        pthread_create(&th, NULL, exit_soon, NULL);
        xchg_alltoallv(x, b, big, &rv, rb);
        _exit(6); /* not reached: rank 0 joins only after we are gone */
    }
    if (xchg_alltoallv(x, buf, sb, &rv, rb) != MOE_OK)
        _exit(3);
    char c;
    if (read(rfd, &c, 1) != 1) /* rank 0 has our data */
        _exit(4);
    _exit(0);
}

__attribute__((constructor)) static void child_hook(void)
{
    const char *spec = getenv("XCHG_TEST_CHILD");
    if (spec)
        child_rank(spec);
}

static pid_t spawn_child(int mode, int *rfd, int *wfd)
{
    int c2p[2], p2c[2];
    cr_assert_eq(pipe(c2p), 0);
    cr_assert_eq(pipe(p2c), 0);
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    cr_assert(n > 0);
    exe[n] = '\0';
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        char spec[64];
        close(p2c[1]); /* so that a dead parent means EOF here */
        close(c2p[0]);
        snprintf(spec, sizeof(spec), "%d,%d,%d", p2c[0], c2p[1], mode);
        setenv("XCHG_TEST_CHILD", spec, 1);
        execl(exe, exe, (char *)NULL);
        _exit(5);
    }
    close(p2c[0]);
    close(c2p[1]);
    *rfd = c2p[0];
    *wfd = p2c[1];
    return pid;
}

/* parent_open: rank 0 of 2 with the child as rank 1. The communicator
 * borrows *lis: close it after xchg_close. */
static xchg *parent_open(int rfd, int wfd, xchg_nng_listener **lis_out)
{
    char urls[2][128];
    const char *u[2] = {urls[0], urls[1]};
    xchg_nng_listener *lis;
    xchg *x = NULL;
    cr_assert_eq(xchg_nng_listen("tcp://127.0.0.1:0", &lis, urls[0], sizeof(urls[0])), MOE_OK);
    *lis_out = lis;
    cr_assert_eq(read(rfd, urls[1], sizeof(urls[1])), (ssize_t)sizeof(urls[1]));
    cr_assert_eq(write(wfd, urls[0], sizeof(urls[0])), (ssize_t)sizeof(urls[0]));
    cr_assert_eq(xchg_nng_open(lis, 0, 2, u, 1, 5000, &x), MOE_OK);
    return x;
}

static void child_exit_ok(pid_t pid)
{
    int st;
    waitpid(pid, &st, 0);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
}

Test(xchg_nng, forked_peer_dies, .timeout = 20)
{
    int rfd, wfd;
    pid_t pid = spawn_child(0, &rfd, &wfd);
    xchg_nng_listener *lis;
    xchg *x = parent_open(rfd, wfd, &lis);
    size_t sb[2] = {100, 100}, rb[2];
    uint8_t buf[200] = {0};
    void *rv = NULL;
    cr_assert_eq(xchg_alltoallv(x, buf, sb, &rv, rb), MOE_OK);
    cr_expect_eq(rb[1], 100);
    xchg_free(x, rv);
    cr_assert_eq(write(wfd, "g", 1), 1);
    int64_t t0 = now_ms();
    moe_err err = xchg_alltoallv(x, buf, sb, &rv, rb);
    int64_t dt = now_ms() - t0;
    cr_expect_eq(err, MOE_EUNAVAIL, "alltoallv after the peer died: %s", moe_strerror(err));
    cr_expect(dt < 2000, "failure took %lld ms (timeout 5000)", (long long)dt);
    child_exit_ok(pid);
    xchg_close(x);
    xchg_nng_listener_close(lis);
}

/* The child dies inside an alltoallv; rank 0 joins late and fails at once
 * instead of waiting for the 5 s timeout. */
static void mid_collective(int mode)
{
    int rfd, wfd;
    pid_t pid = spawn_child(mode, &rfd, &wfd);
    xchg_nng_listener *lis;
    xchg *x = parent_open(rfd, wfd, &lis);
    usleep(400 * 1000);
    size_t sb[2] = {0, (size_t)1 << 20}, rb[2];
    uint8_t *buf = calloc(1, sb[1]);
    void *rv = NULL;
    int64_t t0 = now_ms();
    moe_err err = xchg_alltoallv(x, buf, sb, &rv, rb);
    int64_t dt = now_ms() - t0;
    cr_expect_eq(err, MOE_EUNAVAIL, "alltoallv with a dead peer: %s", moe_strerror(err));
    cr_expect(dt < 2000, "failure took %lld ms (timeout 5000)", (long long)dt);
    child_exit_ok(pid);
    xchg_close(x);
    xchg_nng_listener_close(lis);
    free(buf);
}

Test(xchg_nng, forked_peer_dies_mid_collective, .timeout = 20)
{
    mid_collective(1);
}

Test(xchg_nng, forked_peer_dies_mid_collective_send_side, .timeout = 20)
{
    mid_collective(2);
}

/* ------------------------------------------------------------------- misuse */

Test(xchg_nng, bad_arguments, .timeout = 10)
{
    xchg_nng_listener *lis;
    xchg *x = (xchg *)1;
    char url[128];
    cr_expect_eq(xchg_nng_listen_max("tcp://127.0.0.1:0", 100, &lis, url, sizeof(url)), MOE_EINVAL);
    cr_expect_eq(xchg_nng_listen("bogus://x", &lis, url, sizeof(url)), MOE_EINVAL);
    cr_expect_eq(xchg_nng_listen("tcp://127.0.0.1:0", &lis, url, 8), MOE_EINVAL);
    cr_assert_eq(xchg_nng_listen("tcp://127.0.0.1:0", &lis, url, sizeof(url)), MOE_OK);
    cr_expect(strncmp(url, "tcp://127.0.0.1:", 16) == 0 && atoi(url + 16) > 0, "bound %s", url);
    const char *urls[2] = {url, url};
    cr_expect_eq(xchg_nng_open(lis, 2, 2, urls, 0, 1000, &x), MOE_EINVAL);
    cr_expect_null(x);
    xchg_nng_listener_close(lis); /* the listener stays the caller's */
    cr_assert_eq(xchg_nng_listen("tcp://0.0.0.0:0", &lis, url, sizeof(url)), MOE_OK);
    cr_expect(strncmp(url, "tcp://127.0.0.1:", 16) == 0, "wildcard bound as %s", url);
    xchg_nng_listener_close(lis);
}

/* ------------------------------------------------ the shared-memory backend */

/* the same checks on xchg_shm (rank threads of one process; a forked rank
 * for a death); shm_count: segments of this test's token in /dev/shm */
static void shm_use(const char *what)
{
    snprintf(shm_token, sizeof(shm_token), "t%ld%s", (long)getpid(), what);
}

static int shm_count(void)
{
    char cmd[128], out[32] = "";
    snprintf(cmd, sizeof(cmd), "ls /dev/shm | grep -c '^moe-x%s-' 2>/dev/null", shm_token);
    FILE *f = popen(cmd, "r");
    if (f && fgets(out, sizeof(out), f) == NULL)
        out[0] = 0;
    if (f)
        pclose(f);
    return atoi(out);
}

static void shm_run(int W, tr_fn fn, int timeout_ms, unsigned absent)
{
    tr_rank t[MAXW];
    memset(t, 0, sizeof(t));
    for (int r = 0; r < W; r++) {
        t[r].rank = r;
        t[r].world = W;
        t[r].timeout_ms = timeout_ms;
        t[r].gen = 7;
        t[r].fn = fn;
    }
    for (int r = 0; r < W; r++)
        if (!(absent & (1u << r)))
            cr_assert_eq(pthread_create(&t[r].th, NULL, tr_main, &t[r]), 0);
    for (int r = 0; r < W; r++)
        if (!(absent & (1u << r)))
            pthread_join(t[r].th, NULL);
    for (int r = 0; r < W; r++)
        cr_expect(t[r].fail[0] == '\0', "W=%d rank %d: %s", W, r, t[r].fail);
    cr_expect_eq(shm_count(), 0, "segments left in /dev/shm");
}

Test(xchg_shm, alltoallv_w2_w3_w4, .timeout = 60)
{
    shm_use("a");
    for (int W = 2; W <= 4; W++)
        shm_run(W, fn_a2a, 20000, 0);
}

Test(xchg_shm, allreduce_allgather_same_bits_as_rank_order, .timeout = 60)
{
    shm_use("r");
    shm_run(2, fn_reduce_gather, 20000, 0);
    shm_run(4, fn_reduce_gather, 20000, 0);
}

Test(xchg_shm, mixed_sequence_w4_and_world_of_one, .timeout = 60)
{
    shm_use("m");
    shm_run(4, fn_mixed, 20000, 0);
    shm_run(1, fn_w1, 2000, 0);
}

Test(xchg_shm, peer_never_shows_up, .timeout = 20)
{
    shm_use("n");
    shm_run(3, fn_open_fails, 500, 1u << 2);
}

Test(xchg_shm, peer_closes_mid_run, .timeout = 30)
{
    shm_use("c");
    shm_run(3, fn_peer_closes, 5000, 0);
}

Test(xchg_shm, peer_hangs_timeout, .timeout = 30)
{
    shm_use("h");
    shm_run(2, fn_peer_hangs, 500, 0);
}

/* a forked rank killed while the other waits in a collective: the survivor
 * sees its pid go (also as an unreaped zombie) and fails at once, not at
 * the 20 s timeout */
typedef struct killer {
    pid_t pid;
    int reap;
} killer;

static void *killer_main(void *arg)
{
    killer *k = arg;
    usleep(300 * 1000);
    kill(k->pid, SIGKILL);
    if (k->reap)
        waitpid(k->pid, NULL, 0);
    return NULL;
}

static void killed_peer(int reap)
{
    int go[2];
    cr_assert_eq(pipe(go), 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        xchg *x = NULL;
        if (xchg_shm_open(1, 2, shm_token, 7, 20000, &x) != MOE_OK)
            _exit(3);
        char c;
        (void)read(go[0], &c, 1); /* killed while it waits here */
        _exit(4);
    }
    xchg *x = NULL;
    cr_assert_eq(xchg_shm_open(0, 2, shm_token, 7, 20000, &x), MOE_OK);
    killer k = {pid, reap};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, killer_main, &k), 0);
    size_t sb[2] = {0, (size_t)8 << 20}, rb[2];
    uint8_t *buf = calloc(1, sb[1]);
    void *rv = NULL;
    int64_t t0 = now_ms();
    moe_err err = xchg_alltoallv(x, buf, sb, &rv, rb);
    int64_t dt = now_ms() - t0;
    pthread_join(th, NULL);
    cr_expect_eq(err, MOE_EUNAVAIL, "alltoallv with a dead peer: %s", moe_strerror(err));
    cr_expect(dt < 15000, "failure took %lld ms (timeout 20000)", (long long)dt);
    cr_expect_eq(xchg_alltoallv(x, buf, sb, &rv, rb), MOE_EUNAVAIL, "later calls fail fast");
    if (!reap)
        waitpid(pid, NULL, 0);
    xchg_close(x);
    free(buf);
    close(go[0]);
    close(go[1]);
    cr_expect_eq(shm_count(), 0, "segments left in /dev/shm");
}

Test(xchg_shm, forked_peer_killed_mid_collective, .timeout = 60)
{
    shm_use("k");
    killed_peer(1);
    shm_use("z");
    killed_peer(0);
}

Test(xchg_shm, bad_arguments, .timeout = 10)
{
    xchg *x = (xchg *)1;
    cr_expect_eq(xchg_shm_open(2, 2, "tok", 1, 1000, &x), MOE_EINVAL);
    cr_expect_null(x);
    cr_expect_eq(xchg_shm_open(0, 2, "bad/token", 1, 1000, &x), MOE_EINVAL);
    cr_expect_eq(xchg_shm_open(0, 2, "", 1, 1000, &x), MOE_EINVAL);
    cr_expect_eq(xchg_shm_open(0, 0, "tok", 1, 1000, &x), MOE_EINVAL);
}
