/*
 * test_dataplane.c - the data plane: rows straight between a client and the
 * workers (docs/PROTOCOL.md, "Data plane"), on real clusters of CPU workers.
 *  - every path (coordinator, socket, shared memory) gives bit-identical
 *    outputs, input gradients and weight updates, on 1 and 3 workers, f32
 *    and bf16, merged batches included;
 *  - bad input on a worker's client endpoint gets a clear error and the
 *    worker keeps serving: unknown region, offsets outside a region, a bad
 *    segment name, a ticket sent twice, rows of the wrong shape, rows whose
 *    job never comes (deadline), cancel, an unknown method;
 *  - nothing leaks: no /dev/shm segment after clients close or are killed,
 *    no region or ticket left on the workers when a connection closes.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/client_ring.h"
#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

static const char *paths[3] = {"coordinator", "socket", "shm"};

/* count_segments: /dev/shm entries that libmoe made in process pid
 * (moe-<pid>-...; other tests running beside this one have other pids). */
static int count_segments(long pid)
{
    DIR *d = opendir("/dev/shm");
    struct dirent *de;
    char prefix[32];
    int n = 0;
    if (!d)
        return 0;
    snprintf(prefix, sizeof(prefix), "moe-%ld-", pid);
    while ((de = readdir(d)))
        n += strncmp(de->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

static moe_client *open_path(cluster *cl, const char *path)
{
    moe_client *c;
    moe_client_opts o = {.timeout_ms = 30000, .data_path = path};
    cr_assert_eq(moe_client_open(cl->url, &o, &c), MOE_OK, "open (%s): %s", path, moe_last_error());
    return c;
}

static void create(cluster *cl, const char *name, int H, int F, int E, int K, moe_dtype dt)
{
    moe_model_config mc = {0};
    mc.name = name;
    mc.layers = 1;
    mc.d_model = H;
    mc.d_ff = F;
    mc.n_experts = E;
    mc.top_k = K;
    mc.dtype = dt;
    mc.seed = 7;
    mc.aux_loss_coef = 0.01;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "create: %s", moe_last_error());
}

/* the same forward, train forward + backward over every path: identical
 * bytes (the rows take other roads; the math is the same) */
static void paths_identical(int W, moe_dtype dt)
{
    cluster_opts o = {.workers = W};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 48, F = 64, E = 6, K = 2;
    create(cl, "m", H, F, E, K, dt);
    const size_t es = dt == MOE_BF16 ? 2 : 4;
    const int Ts[3] = {1, 37, 200};
    for (int ti = 0; ti < 3; ti++) {
        const int T = Ts[ti];
        size_t n = (size_t)T * H;
        float *xf = malloc(n * 4), *dyf = malloc(n * 4);
        uint8_t *x = malloc(n * es), *dy = malloc(n * es);
        uint8_t *y[3], *dx[3];
        rng_fill_uniform(11, (uint64_t)T, -1, 1, xf, n);
        rng_fill_uniform(12, (uint64_t)T, -1, 1, dyf, n);
        for (size_t i = 0; i < n; i++) {
            if (dt == MOE_BF16) {
                uint16_t a = kern_f32_to_bf16(xf[i]), b = kern_f32_to_bf16(dyf[i]);
                memcpy(x + 2 * i, &a, 2);
                memcpy(dy + 2 * i, &b, 2);
            } else {
                memcpy(x + 4 * i, &xf[i], 4);
                memcpy(dy + 4 * i, &dyf[i], 4);
            }
        }
        for (int p = 0; p < 3; p++) {
            moe_client *c = open_path(cl, paths[p]);
            y[p] = malloc(n * es);
            dx[p] = malloc(n * es);
            memset(y[p], 0xff, n * es); /* poison */
            memset(dx[p], 0xff, n * es);
            moe_fwd_info info;
            memset(&info, 0, sizeof(info));
            cr_assert_eq(moe_forward(c, "m", 0, dt, x, T, H, y[p], &info), MOE_OK,
                         "forward over %s (W=%d, T=%d): %s", paths[p], W, T, moe_last_error());
            int64_t routed = 0;
            for (int e = 0; e < E; e++)
                routed += info.tokens_per_expert[e];
            cr_assert_eq(routed, (int64_t)T * K, "%s: stats of %lld slots", paths[p],
                         (long long)routed);
            moe_fwd_info_free(&info);
            /* train forward + backward: dx over this path */
            uint8_t *y2 = malloc(n * es);
            cr_assert_eq(moe_forward_train(c, "m", 0, dt, x, T, H, y2, &info), MOE_OK,
                         "train forward over %s: %s", paths[p], moe_last_error());
            cr_assert(memcmp(y2, y[p], n * es) == 0, "%s: train forward y differs from inference",
                      paths[p]);
            cr_assert_eq(moe_backward(c, info.handle, dt, dy, T, H, dx[p]), MOE_OK,
                         "backward over %s: %s", paths[p], moe_last_error());
            moe_fwd_info_free(&info);
            free(y2);
            moe_client_close(c);
            if (p > 0) {
                cr_assert(memcmp(y[p], y[0], n * es) == 0,
                          "y over %s differs from the coordinator path (W=%d, T=%d)", paths[p], W,
                          T);
                cr_assert(memcmp(dx[p], dx[0], n * es) == 0,
                          "dx over %s differs from the coordinator path (W=%d, T=%d)", paths[p], W,
                          T);
            }
        }
        for (int p = 0; p < 3; p++) {
            free(y[p]);
            free(dx[p]);
        }
        free(xf);
        free(dyf);
        free(x);
        free(dy);
    }
    /* the gradients of 9 backwards (3 per path) applied once: a step works */
    moe_adamw opt = {1e-3, 0.9, 0.999, 1e-8, 0, 0, 0, 0};
    int64_t step = 0;
    cr_assert_eq(moe_optimizer_step(cl->cli, "m", &opt, &step, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(step, 1);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

Test(dataplane, paths_identical_w1_f32, .timeout = 120, .fini = cluster_fini_all)
{
    paths_identical(1, MOE_F32);
}

Test(dataplane, paths_identical_w3_f32, .timeout = 120, .fini = cluster_fini_all)
{
    paths_identical(3, MOE_F32);
}

Test(dataplane, paths_identical_w2_bf16, .timeout = 120, .fini = cluster_fini_all)
{
    paths_identical(2, MOE_BF16);
}

/* ---- raw calls on a worker's client endpoint ---- */

typedef struct raw_reply {
    uint8_t *buf;
    size_t len;
    moe_rpc_response resp;
    int rv;
} raw_reply;

static nng_socket raw_open(const char *url)
{
    nng_socket s;
    cr_assert_eq(nng_req0_open(&s), 0);
    nng_socket_set_ms(s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, 30000);
    nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, 5000);
    int rv = nng_dial(s, url, NULL, 0);
    cr_assert_eq(rv, 0, "dial %s: %s", url, nng_strerror(rv));
    return s;
}

/* raw_call: method {params pairs in p (n of them)} and one reply */
static void raw_call(nng_socket s, const char *method, const mp_writer *p, uint32_t n, raw_reply *r)
{
    static uint32_t next = 1;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, next++, method);
    mp_write_map(&w, n);
    if (p)
        mp_write_raw(&w, p->buf, p->len);
    memset(r, 0, sizeof(*r));
    r->rv = nng_send(s, w.buf, w.len, 0);
    mp_writer_fini(&w);
    if (r->rv == 0)
        r->rv = nng_recv(s, &r->buf, &r->len, NNG_FLAG_ALLOC);
    if (r->rv != 0)
        return;
    mp_errbuf eb = {{0}};
    cr_assert_eq(moe_rpc_parse_response(r->buf, r->len, &r->resp, &eb), MOE_OK, "%s", eb.msg);
}

static void raw_free(raw_reply *r)
{
    if (r->buf)
        nng_free(r->buf, r->len);
    r->buf = NULL;
}

static void expect_err(raw_reply *r, moe_err want, const char *what)
{
    cr_assert_eq(r->rv, 0, "%s: no reply: %s", what, nng_strerror(r->rv));
    cr_assert_eq(r->resp.err, want, "%s: got %s (%.*s), want %s", what, moe_err_code(r->resp.err),
                 (int)r->resp.errmsg_len, r->resp.errmsg ? r->resp.errmsg : "", moe_err_code(want));
    cr_assert(r->resp.errmsg_len > 0, "%s: empty message", what);
    cr_log_info("%s -> %s: %.*s", what, moe_err_code(want), (int)r->resp.errmsg_len,
                r->resp.errmsg);
    raw_free(r);
}

/* data_stat reads one counter of the data endpoint's ping. */
static int64_t data_stat(const char *url, const char *key)
{
    nng_socket s = raw_open(url);
    raw_reply r;
    raw_call(s, "ping", NULL, 0, &r);
    cr_assert_eq(r.rv, 0);
    cr_assert_eq(r.resp.err, MOE_OK);
    mp_reader rd = r.resp.result;
    int64_t v = -1;
    cr_assert(mp_map_find(&rd, key) == 0 && mp_read_i64(&rd, &v, NULL) == MOE_OK, "ping: no %s",
              key);
    raw_free(&r);
    nng_close(s);
    return v;
}

/* wait_stat: the counter reaches want (connection close is handled on the
 * worker's loop soon after; bounded generously for a loaded machine) */
static void wait_stat(const char *url, const char *key, int64_t want)
{
    int64_t v = -1;
    for (int i = 0; i < 3000; i++) {
        if ((v = data_stat(url, key)) == want)
            return;
        usleep(10000);
    }
    cr_assert_fail("%s stayed %lld, want %lld", key, (long long)v, (long long)want);
}

static void write_ticket(mp_writer *p, uint64_t a, uint64_t b)
{
    mp_write_cstr(p, "ticket");
    mp_write_array(p, 2);
    mp_write_u64(p, a);
    mp_write_u64(p, b);
}

/* write_run_m0: data.rows' "run" key: a lane forward of model m, layer 0,
 * in generation gen (one key) */
static void write_run_m0(mp_writer *p, uint64_t gen)
{
    mp_write_cstr(p, "run");
    mp_write_map(p, 3);
    mp_write_cstr(p, "model");
    mp_write_cstr(p, "m");
    mp_write_cstr(p, "layer");
    mp_write_i64(p, 0);
    mp_write_cstr(p, "generation");
    mp_write_u64(p, gen);
}

/* write_rows_f32: data.rows' "dtype" f32 and "shape" [rows, H] (two keys) */
static void write_rows_f32(mp_writer *p, int64_t rows, int64_t H)
{
    mp_write_cstr(p, "dtype");
    mp_write_cstr(p, "f32");
    mp_write_cstr(p, "shape");
    mp_write_array(p, 2);
    mp_write_i64(p, rows);
    mp_write_i64(p, H);
}

Test(dataplane, bad_input_worker_keeps_serving, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32;
    create(cl, "m", H, 32, 4, 2, MOE_F32);
    char url[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    nng_socket s = raw_open(url);
    raw_reply r;
    mp_writer p;

    /* a region nobody attached */
    mp_writer_init(&p);
    write_ticket(&p, 1, 1);
    write_rows_f32(&p, 2, H);
    mp_write_cstr(&p, "region");
    mp_write_u64(&p, 7);
    mp_write_cstr(&p, "x_offset");
    mp_write_u64(&p, 0);
    mp_write_cstr(&p, "y_offset");
    mp_write_u64(&p, 0);
    raw_call(s, "data.rows", &p, 6, &r);
    mp_writer_fini(&p);
    expect_err(&r, MOE_ENOTFOUND, "data.rows in a region never attached");

    /* segment names: only the client's own (/moe-...), and they must exist */
    static const char *bad_names[] = {"/etc-passwd", "/moe-../x", "/moe-", "/moe-does-not-exist"};
    for (int i = 0; i < 4; i++) {
        mp_writer_init(&p);
        mp_write_cstr(&p, "name");
        mp_write_cstr(&p, bad_names[i]);
        mp_write_cstr(&p, "size");
        mp_write_u64(&p, 4096);
        raw_call(s, "data.shm_attach", &p, 2, &r);
        mp_writer_fini(&p);
        expect_err(&r, MOE_EINVAL, bad_names[i]);
    }

    /* a real segment, then offsets and lengths outside it */
    char name[64];
    snprintf(name, sizeof(name), "/moe-%ld-test-bad", (long)getpid());
    int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
    cr_assert(fd >= 0);
    cr_assert_eq(ftruncate(fd, 8192), 0);
    close(fd);
    mp_writer_init(&p);
    mp_write_cstr(&p, "name");
    mp_write_cstr(&p, name);
    mp_write_cstr(&p, "size");
    mp_write_u64(&p, 1 << 20); /* larger than the segment */
    raw_call(s, "data.shm_attach", &p, 2, &r);
    mp_writer_fini(&p);
    expect_err(&r, MOE_EINVAL, "a size beyond the segment");
    mp_writer_init(&p);
    mp_write_cstr(&p, "name");
    mp_write_cstr(&p, name);
    mp_write_cstr(&p, "size");
    mp_write_u64(&p, 8192);
    raw_call(s, "data.shm_attach", &p, 2, &r);
    mp_writer_fini(&p);
    shm_unlink(name);
    cr_assert_eq(r.rv, 0);
    cr_assert_eq(r.resp.err, MOE_OK, "attach: %.*s", (int)r.resp.errmsg_len, r.resp.errmsg);
    uint64_t region = 0;
    mp_reader rd = r.resp.result;
    cr_assert(mp_map_find(&rd, "region") == 0 && mp_read_u64(&rd, &region, NULL) == MOE_OK);
    raw_free(&r);
    cr_assert_eq(data_stat(url, "regions"), 1);
    /* rows (32, 32) f32 = 4096 bytes: x at 4096 fits, y at 4097 does not */
    static const uint64_t offs[3][2] = {{0, 4097}, {8192, 0}, {~0ull - 8, 0}};
    for (int i = 0; i < 3; i++) {
        mp_writer_init(&p);
        write_ticket(&p, 2, (uint64_t)i);
        write_rows_f32(&p, 32, H);
        mp_write_cstr(&p, "region");
        mp_write_u64(&p, region);
        mp_write_cstr(&p, "x_offset");
        mp_write_u64(&p, offs[i][0]);
        mp_write_cstr(&p, "y_offset");
        mp_write_u64(&p, offs[i][1]);
        raw_call(s, "data.rows", &p, 6, &r);
        mp_writer_fini(&p);
        expect_err(&r, MOE_EINVAL, "offsets outside the region");
    }
    /* another connection cannot name this connection's region */
    nng_socket s2 = raw_open(url);
    mp_writer_init(&p);
    write_ticket(&p, 3, 1);
    write_rows_f32(&p, 1, H);
    mp_write_cstr(&p, "region");
    mp_write_u64(&p, region);
    mp_write_cstr(&p, "x_offset");
    mp_write_u64(&p, 0);
    mp_write_cstr(&p, "y_offset");
    mp_write_u64(&p, 128);
    raw_call(s2, "data.rows", &p, 6, &r);
    mp_writer_fini(&p);
    expect_err(&r, MOE_ENOTFOUND, "a region of another connection");

    /* both x and a region, neither, an unknown method */
    float rows[4 * 32];
    memset(rows, 0, sizeof(rows));
    moe_tensor t = {MOE_F32, 2, {4, H, 0, 0}, rows, sizeof(rows)};
    mp_writer_init(&p);
    write_ticket(&p, 4, 1);
    raw_call(s2, "data.rows", &p, 1, &r);
    mp_writer_fini(&p);
    expect_err(&r, MOE_EINVAL, "data.rows without rows");
    raw_call(s2, "data.nothing", NULL, 0, &r);
    expect_err(&r, MOE_ENOMETHOD, "unknown method");

    /* a ticket sent twice: the second is refused; the first waits for a job
     * that never comes and is answered at its deadline */
    nng_socket s3 = raw_open(url);
    mp_writer_init(&p);
    write_ticket(&p, 5, 1);
    mp_write_cstr(&p, "deadline_ms");
    mp_write_i64(&p, 300);
    mp_write_cstr(&p, "x");
    moe_tensor_write(&p, &t);
    uint32_t msgid = 9001;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, msgid, "data.rows");
    mp_write_map(&w, 3);
    mp_write_raw(&w, p.buf, p.len);
    cr_assert_eq(nng_send(s3, w.buf, w.len, 0), 0);
    mp_writer_fini(&w);
    wait_stat(url, "tickets", 1);
    raw_call(s2, "data.rows", &p, 3, &r);
    expect_err(&r, MOE_EPRECOND, "a ticket sent twice");
    mp_writer_fini(&p);
    raw_reply r3;
    memset(&r3, 0, sizeof(r3));
    r3.rv = nng_recv(s3, &r3.buf, &r3.len, NNG_FLAG_ALLOC);
    cr_assert_eq(r3.rv, 0);
    mp_errbuf eb = {{0}};
    cr_assert_eq(moe_rpc_parse_response(r3.buf, r3.len, &r3.resp, &eb), MOE_OK);
    expect_err(&r3, MOE_ETIMEDOUT, "rows whose job never came");

    /* cancel: a waiting ticket is answered closed, and cancel says so */
    mp_writer_init(&p);
    write_ticket(&p, 6, 1);
    mp_write_cstr(&p, "x");
    moe_tensor_write(&p, &t);
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, 9002, "data.rows");
    mp_write_map(&w, 2);
    mp_write_raw(&w, p.buf, p.len);
    cr_assert_eq(nng_send(s3, w.buf, w.len, 0), 0);
    mp_writer_fini(&w);
    mp_writer_fini(&p);
    wait_stat(url, "tickets", 1);
    mp_writer_init(&p);
    write_ticket(&p, 6, 1);
    raw_call(s2, "data.cancel", &p, 1, &r);
    mp_writer_fini(&p);
    cr_assert_eq(r.rv, 0);
    cr_assert_eq(r.resp.err, MOE_OK);
    bool cancelled = false;
    rd = r.resp.result;
    cr_assert(mp_map_find(&rd, "cancelled") == 0 && mp_read_bool(&rd, &cancelled, NULL) == MOE_OK &&
              cancelled);
    raw_free(&r);
    memset(&r3, 0, sizeof(r3));
    cr_assert_eq(nng_recv(s3, &r3.buf, &r3.len, NNG_FLAG_ALLOC), 0);
    cr_assert_eq(moe_rpc_parse_response(r3.buf, r3.len, &r3.resp, &eb), MOE_OK);
    expect_err(&r3, MOE_ECLOSED, "a cancelled ticket");

    /* a forward whose rows have the wrong shape for the job: the worker
     * answers the rows, the coordinator the request, nothing hangs */
    float x[3 * 32], y[3 * 32];
    rng_fill_uniform(3, 3, -1, 1, x, 3 * 32);
    moe_client *cs = open_path(cl, "socket");
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 3, H + 1, y, NULL), MOE_EINVAL);
    moe_client_close(cs);

    /* closing the connection drops its region; the worker still serves */
    nng_close(s);
    nng_close(s2);
    nng_close(s3);
    wait_stat(url, "regions", 0);
    wait_stat(url, "tickets", 0);
    moe_client *c = open_path(cl, "shm");
    cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, x, 3, H, y, NULL), MOE_OK, "%s", moe_last_error());
    moe_client_close(c);
    wait_stat(url, "regions", 0);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* nothing left in /dev/shm or on the workers: after clients that close,
 * and after a client SIGKILLed in the middle of its forwards */
Test(dataplane, no_leaked_segments_or_regions, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 64;
    create(cl, "m", H, 64, 8, 2, MOE_F32);
    char url0[256], url1[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url0, sizeof(url0)), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_key(cl, 1, "url", url1, sizeof(url1)), 0, "%s", cluster_error());
    int before = count_segments(getpid());
    /* sizes that need new, larger buffers */
    moe_client *c = open_path(cl, "shm");
    static float x[4096 * 64], y[4096 * 64];
    rng_fill_uniform(5, 5, -1, 1, x, 4096 * 64);
    for (int T = 1; T <= 4096; T *= 4)
        cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, x, T, H, y, NULL), MOE_OK, "%s",
                     moe_last_error());
    cr_assert_eq(count_segments(getpid()), before, "segments left while the client lives");
    cr_assert(data_stat(url0, "regions") > 0, "the worker mapped no region");
    moe_client_close(c);
    wait_stat(url0, "regions", 0);
    wait_stat(url1, "regions", 0);
    cr_assert_eq(count_segments(getpid()), before, "segments left after close");

    /* a client killed mid-run: moectl bench over shared memory */
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        char moectl[512];
        snprintf(moectl, sizeof(moectl), "%s/moectl", cluster_bin_dir());
        execl(moectl, "moectl", "--url", cl->url, "--data-path", "shm", "bench", "--model", "m",
              "--tokens", "512", "--requests", "1000000", (char *)NULL);
        _exit(127);
    }
    /* until it has mapped a region on both workers, then SIGKILL */
    for (int i = 0;
         i < 3000 && (data_stat(url0, "regions") == 0 || data_stat(url1, "regions") == 0); i++)
        usleep(10000);
    usleep(100000);
    kill(pid, SIGKILL);
    int st;
    waitpid(pid, &st, 0);
    wait_stat(url0, "regions", 0);
    wait_stat(url1, "regions", 0);
    wait_stat(url0, "tickets", 0);
    wait_stat(url1, "tickets", 0);
    /* a segment the killed client made but had not unlinked yet is swept by
     * the next client on this host */
    c = open_path(cl, "shm");
    cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, x, 16, H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_client_close(c);
    cr_assert_eq(count_segments(pid), 0, "segments left after a killed client");
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* rows in moe_buffer_alloc buffers travel with no copy and give the same
 * bytes; freeing a buffer unmaps it on the workers; on the socket path the
 * same calls work with plain memory */
Test(dataplane, zero_copy_buffers, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 40, T = 77;
    const size_t n = (size_t)T * H;
    create(cl, "m", H, 56, 5, 2, MOE_F32);
    char url0[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url0, sizeof(url0)), 0, "%s", cluster_error());
    float *x = malloc(n * 4), *dy = malloc(n * 4), *yref = malloc(n * 4), *dxref = malloc(n * 4);
    rng_fill_uniform(21, 1, -1, 1, x, n);
    rng_fill_uniform(22, 1, -1, 1, dy, n);
    moe_client *cc = open_path(cl, "coordinator");
    moe_fwd_info info;
    cr_assert_eq(moe_forward(cc, "m", 0, MOE_F32, x, T, H, yref, NULL), MOE_OK);
    cr_assert_eq(moe_forward_train(cc, "m", 0, MOE_F32, x, T, H, yref, &info), MOE_OK);
    cr_assert_eq(moe_backward(cc, info.handle, MOE_F32, dy, T, H, dxref), MOE_OK);
    moe_fwd_info_free(&info);
    moe_client_close(cc);
    const char *ps[2] = {"shm", "socket"};
    for (int p = 0; p < 2; p++) {
        moe_client *c = open_path(cl, ps[p]);
        /* x and y in one buffer, dy and dx in two others */
        float *xy = moe_buffer_alloc(c, 2 * n * 4);
        float *bdy = moe_buffer_alloc(c, n * 4), *bdx = moe_buffer_alloc(c, n * 4);
        cr_assert(xy && bdy && bdx, "%s: moe_buffer_alloc: %s", ps[p], moe_last_error());
        memcpy(xy, x, n * 4);
        memcpy(bdy, dy, n * 4);
        memset(xy + n, 0xff, n * 4);
        memset(bdx, 0xff, n * 4);
        int64_t regions0 = data_stat(url0, "regions");
        cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, xy, T, H, xy + n, NULL), MOE_OK, "%s: %s",
                     ps[p], moe_last_error());
        cr_assert(memcmp(xy + n, yref, n * 4) == 0, "%s: y from the buffers differs", ps[p]);
        cr_assert_eq(moe_forward_train(c, "m", 0, MOE_F32, xy, T, H, xy + n, &info), MOE_OK);
        cr_assert_eq(moe_backward(c, info.handle, MOE_F32, bdy, T, H, bdx), MOE_OK, "%s: %s", ps[p],
                     moe_last_error());
        moe_fwd_info_free(&info);
        cr_assert(memcmp(bdx, dxref, n * 4) == 0, "%s: dx from the buffers differs", ps[p]);
        int64_t regions1 = data_stat(url0, "regions");
        if (p == 0) /* the three buffers were mapped, and no copy buffer was needed */
            cr_assert_eq(regions1 - regions0, 3, "%lld regions mapped for 3 buffers",
                         (long long)(regions1 - regions0));
        else
            cr_assert_eq(regions1, regions0, "the socket path mapped a region");
        moe_buffer_free(c, bdy);
        if (p == 0)
            wait_stat(url0, "regions", regions1 - 1);
        moe_buffer_free(c, bdx);
        moe_buffer_free(c, xy);
        moe_client_close(c);
    }
    wait_stat(url0, "regions", 0);
    free(x);
    free(dy);
    free(yref);
    free(dxref);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* rows registered as GPU memory (moe_cuda_register) are never touched by
 * libmoe: on CPU workers the worker refuses the buffer with a clear error,
 * on the coordinator path the call fails before sending anything. The
 * "device" memory here is a PROT_NONE mapping: any read or write of it by
 * the library would crash the test. With two workers, T rows small enough
 * to fan out: the fan-out reads rows on the host, so it must not take them. */
static void gpu_buffers_refused(int workers, int T)
{
    cluster_opts o = {.workers = workers};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32;
    create(cl, "m", H, 32, 4, 2, MOE_BF16);
    size_t n = (size_t)T * H * 2;
    void *guard = mmap(NULL, 2 * n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert(guard != MAP_FAILED);
    uint8_t handle[64];
    memset(handle, 0x3c, sizeof(handle));
    const char *ps[3] = {"auto", "socket", "coordinator"};
    for (int p = 0; p < 3; p++) {
        moe_client *c = open_path(cl, ps[p]);
        cr_assert_eq(moe_cuda_register(c, guard, 2 * n, handle), MOE_OK, "%s", moe_last_error());
        moe_err e = moe_forward(c, "m", 0, MOE_BF16, guard, T, H, (uint8_t *)guard + n, NULL);
        cr_assert_eq(e, MOE_EINVAL, "%s: got %s", ps[p], moe_err_code(e));
        cr_log_info("%d workers, %s: %s", workers, ps[p], moe_last_error());
        if (p == 0)
            cr_assert(strstr(moe_last_error(), "no GPU"), "%s", moe_last_error());
        /* the workers and the client still serve */
        uint16_t x[8 * 32], y[8 * 32];
        memset(x, 0, sizeof(x));
        cr_assert_eq(moe_forward(c, "m", 0, MOE_BF16, x, T, H, y, NULL), MOE_OK, "%s",
                     moe_last_error());
        moe_cuda_unregister(c, guard);
        moe_client_close(c);
    }
    munmap(guard, 2 * n);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

Test(dataplane, gpu_buffers_refused_clearly_on_cpu, .timeout = 60, .fini = cluster_fini_all)
{
    gpu_buffers_refused(1, 8);
}

Test(dataplane, gpu_buffers_never_fanned_out, .timeout = 90, .fini = cluster_fini_all)
{
    gpu_buffers_refused(2, 1);
}

/* many requests in flight on one client, over each data path: 8 threads x
 * 6 forwards of different sizes, merged by the coordinator as they queue;
 * every y equal to the same forward alone over the coordinator path (to f32
 * rounding: a row's expert GEMM in a merged batch may round differently
 * from the one-row product of a call alone) */
typedef struct conc_arg {
    moe_client *c;
    int id, H;
    const float *x;   /* (maxT, H) */
    const float *ref; /* (6, maxT, H): y of each call's rows alone */
    int bad;
    char msg[256];
} conc_arg;

static const int conc_T[6] = {1, 5, 17, 64, 3, 33};

static void *conc_main(void *arg)
{
    conc_arg *a = arg;
    float *y = malloc((size_t)64 * a->H * 4);
    for (int k = 0; k < 6 && !a->bad; k++) {
        int T = conc_T[(k + a->id) % 6];
        if (moe_forward(a->c, "m", 0, MOE_F32, a->x, T, a->H, y, NULL) != MOE_OK) {
            snprintf(a->msg, sizeof(a->msg), "thread %d call %d: %s", a->id, k, moe_last_error());
            a->bad = 1;
        } else {
            double rel =
                kern_rel_err(y, a->ref + (size_t)((k + a->id) % 6) * 64 * a->H, (size_t)T * a->H);
            if (!(rel < 1e-5)) {
                snprintf(a->msg, sizeof(a->msg), "thread %d call %d (T=%d): rel err %.3g", a->id, k,
                         T, rel);
                a->bad = 1;
            }
        }
    }
    free(y);
    return NULL;
}

Test(dataplane, many_requests_in_flight, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 48;
    create(cl, "m", H, 64, 6, 2, MOE_F32);
    float *x = malloc((size_t)64 * H * 4), *ref = malloc((size_t)6 * 64 * H * 4);
    rng_fill_uniform(31, 1, -1, 1, x, (size_t)64 * H);
    moe_client *cc = open_path(cl, "coordinator");
    for (int k = 0; k < 6; k++)
        cr_assert_eq(
            moe_forward(cc, "m", 0, MOE_F32, x, conc_T[k], H, ref + (size_t)k * 64 * H, NULL),
            MOE_OK);
    moe_client_close(cc);
    for (int p = 1; p < 3; p++) {
        moe_client *c = open_path(cl, paths[p]);
        pthread_t th[8];
        conc_arg args[8];
        for (int i = 0; i < 8; i++) {
            args[i] = (conc_arg){c, i, H, x, ref, 0, ""};
            pthread_create(&th[i], NULL, conc_main, &args[i]);
        }
        for (int i = 0; i < 8; i++)
            pthread_join(th[i], NULL);
        for (int i = 0; i < 8; i++)
            cr_assert(!args[i].bad, "%s: %s", paths[p], args[i].msg);
        moe_client_close(c);
    }
    free(x);
    free(ref);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* rows over the size where copies go parallel (8 MiB), of an odd count:
 * byte-identical over every path */
Test(dataplane, large_rows_every_path, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 64, T = (int)((8u << 20) / (64 * 4)) + 3;
    const size_t n = (size_t)T * H;
    create(cl, "m", H, 8, 2, 1, MOE_F32);
    float *x = malloc(n * 4), *y[3];
    rng_fill_uniform(41, 1, -1, 1, x, n);
    for (int p = 0; p < 3; p++) {
        moe_client *c = open_path(cl, paths[p]);
        y[p] = malloc(n * 4);
        memset(y[p], 0xff, n * 4);
        cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, x, T, H, y[p], NULL), MOE_OK, "%s: %s",
                     paths[p], moe_last_error());
        moe_client_close(c);
        if (p)
            cr_assert(memcmp(y[p], y[0], n * 4) == 0, "%s: %zu-byte y differs", paths[p], n * 4);
    }
    for (int p = 0; p < 3; p++)
        free(y[p]);
    free(x);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* operators see the data plane: /metrics carries each worker's rows and
 * bytes received from clients and its mapped regions (from heartbeats) */
Test(dataplane, metrics_show_the_data_plane, .timeout = 90, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2, .metrics = 1, .worker_args = {"--heartbeat-ms", "100"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32, T = 50;
    create(cl, "m", H, 32, 4, 2, MOE_F32);
    moe_client *c = open_path(cl, "shm");
    float x[50 * 32], y[50 * 32];
    rng_fill_uniform(51, 1, -1, 1, x, (size_t)T * H);
    for (int k = 0; k < 3; k++)
        cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, x, T, H, y, NULL), MOE_OK, "%s",
                     moe_last_error());
    static char body[1 << 16];
    int found = 0;
    for (int i = 0; i < 1000 && !found; i++) { /* the next heartbeats bring them */
        int code = cluster_http_get(cl->metrics_port, "/metrics", NULL, 0, body, sizeof(body));
        long long rows = 0, sum = 0;
        const char *p = body;
        while (code == 200 && (p = strstr(p, "moe_worker_data_rows_total{")) != NULL) {
            p = strchr(p, '}');
            if (p && sscanf(p + 1, " %lld", &rows) == 1)
                sum += rows;
        }
        found = sum == 3LL * T && strstr(body, "moe_worker_data_regions{") != NULL;
        if (!found)
            usleep(20000);
    }
    cr_assert(found, "/metrics never showed %d rows received by the workers:\n%.2000s", 3 * T,
              strstr(body, "moe_worker_data") ? strstr(body, "moe_worker_data") : body);
    moe_client_close(c);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* one client's NaN is that client's error alone: its request is refused
 * (invalid_argument naming the row), the requests beside it - merged into
 * the same job or not - get their exact outputs */
typedef struct nan_arg {
    moe_client *c;
    const float *x;
    int T, H;
    float *y;
    moe_err e;
    char msg[512];
} nan_arg;

static void *nan_main(void *arg)
{
    nan_arg *a = arg;
    a->e = moe_forward(a->c, "m", 0, MOE_F32, a->x, a->T, a->H, a->y, NULL);
    snprintf(a->msg, sizeof(a->msg), "%s", a->e ? moe_last_error() : "");
    return NULL;
}

Test(dataplane, nan_rows_refused_alone, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32, TB = 20, TG = 30;
    create(cl, "m", H, 32, 4, 2, MOE_F32);
    float xb[20 * 32], xg[30 * 32], yb[20 * 32], yg[30 * 32], yref[30 * 32];
    rng_fill_uniform(61, 1, -1, 1, xb, (size_t)TB * H);
    rng_fill_uniform(62, 1, -1, 1, xg, (size_t)TG * H);
    xb[13 * H + 5] = NAN; /* row 13 (on rank 1 of 2: rows 10-19) */
    xb[17 * H + 1] = INFINITY;
    moe_client *cr = open_path(cl, "socket");
    cr_assert_eq(moe_forward(cr, "m", 0, MOE_F32, xg, TG, H, yref, NULL), MOE_OK);
    moe_err e = moe_forward(cr, "m", 0, MOE_F32, xb, TB, H, yb, NULL);
    cr_assert_eq(e, MOE_EINVAL, "alone: %s", moe_err_code(e));
    cr_assert(strstr(moe_last_error(), "row 13"), "alone: %s", moe_last_error());
    for (int round = 0; round < 5; round++) { /* side by side: merged when they queue */
        moe_client *ca = open_path(cl, "shm"), *cb = open_path(cl, "socket");
        nan_arg a = {ca, xb, TB, H, yb, MOE_OK, ""}, b = {cb, xg, TG, H, yg, MOE_OK, ""};
        pthread_t ta, tb;
        pthread_create(&ta, NULL, nan_main, &a);
        pthread_create(&tb, NULL, nan_main, &b);
        pthread_join(ta, NULL);
        pthread_join(tb, NULL);
        cr_assert_eq(a.e, MOE_EINVAL, "round %d: the NaN request: %s %s", round, moe_err_code(a.e),
                     a.msg);
        cr_assert(strstr(a.msg, "row 13"), "round %d: %s", round, a.msg);
        cr_assert_eq(b.e, MOE_OK, "round %d: the clean request failed: %s", round, b.msg);
        double rel = kern_rel_err(yg, yref, (size_t)TG * H);
        cr_assert(rel < 1e-5, "round %d: the clean request's y: rel err %.3g", round, rel);
        moe_client_close(ca);
        moe_client_close(cb);
    }
    moe_client_close(cr);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* the coordinator path refuses a NaN row at admission, for that client */
Test(dataplane, nan_rows_refused_on_the_coordinator_path, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32, T = 9;
    create(cl, "m", H, 32, 4, 2, MOE_BF16);
    uint16_t x[9 * 32], y[9 * 32];
    for (int i = 0; i < T * H; i++)
        x[i] = kern_f32_to_bf16(0.25f);
    x[4 * H + 3] = 0x7fc0; /* a bf16 NaN in row 4 */
    moe_client *c = open_path(cl, "coordinator");
    moe_err e = moe_forward(c, "m", 0, MOE_BF16, x, T, H, y, NULL);
    cr_assert_eq(e, MOE_EINVAL, "%s", moe_err_code(e));
    cr_assert(strstr(moe_last_error(), "row 4"), "%s", moe_last_error());
    x[4 * H + 3] = kern_f32_to_bf16(0.25f);
    cr_assert_eq(moe_forward(c, "m", 0, MOE_BF16, x, T, H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_client_close(c);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* workers without a client endpoint (--client-listen off): the default path
 * falls back to the coordinator path and gives the same bytes; a path asked
 * for by name fails with a clear error instead of another path in silence */
Test(dataplane, no_data_plane_fallback_and_named_paths, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2, .worker_args = {"--client-listen", "off"}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32, T = 11;
    create(cl, "m", H, 32, 4, 2, MOE_F32);
    float x[11 * 32], y0[11 * 32], y1[11 * 32];
    rng_fill_uniform(71, 1, -1, 1, x, (size_t)T * H);
    moe_client *cc = open_path(cl, "coordinator"), *ca = open_path(cl, "auto");
    cr_assert_eq(moe_forward(cc, "m", 0, MOE_F32, x, T, H, y0, NULL), MOE_OK);
    cr_assert_eq(moe_forward(ca, "m", 0, MOE_F32, x, T, H, y1, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert(memcmp(y0, y1, sizeof(y0)) == 0, "auto without a data plane differs");
    for (int p = 1; p < 3; p++) {
        moe_client *c = open_path(cl, paths[p]);
        moe_err e = moe_forward(c, "m", 0, MOE_F32, x, T, H, y1, NULL);
        cr_assert_eq(e, MOE_EUNAVAIL, "%s: %s", paths[p], moe_err_code(e));
        cr_assert(strstr(moe_last_error(), "no data plane"), "%s: %s", paths[p], moe_last_error());
        moe_client_close(c);
    }
    moe_client_close(cc);
    moe_client_close(ca);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ---- the lane: a one-worker cluster serves inference forwards itself ---- */

/* coord_stat reads one number of the coordinator's `stats` */
static int64_t coord_stat(cluster *cl, const char *key)
{
    int64_t v = -1;
    cr_assert_eq(cluster_coord_stat(cl, key, &v), 0, "%s", cluster_error());
    return v;
}

/* lane_open reads dataplane.info's "lane" */
static int lane_open(cluster *cl)
{
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "dataplane.info", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    mp_reader r = mp_reply_reader(&rep);
    bool lane = false;
    cr_assert(mp_map_find(&r, "lane") == 0 && mp_read_bool(&r, &lane, NULL) == MOE_OK,
              "dataplane.info has no lane");
    moe_reply_free(&rep);
    return lane;
}

/* One worker: the lane is open; forwards over it never reach the
 * coordinator (its request count stays), give the coordinator path's
 * bytes and stats, and are counted by the coordinator with the worker's
 * next heartbeat. */
Test(dataplane, lane_serves_one_worker_clusters, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 40, E = 5, K = 2;
    create(cl, "m", H, 48, E, K, MOE_F32);
    cr_assert(lane_open(cl), "a one-worker cluster should open the lane");
    moe_client *cc = open_path(cl, "coordinator"), *cs = open_path(cl, "socket"),
               *cm = open_path(cl, "shm");
    const int Ts[3] = {1, 9, 130};
    float *x = malloc(130 * 40 * 4), *y0 = malloc(130 * 40 * 4), *y1 = malloc(130 * 40 * 4);
    /* warm the map (dataplane.info) so that the count below is the forwards' */
    rng_fill_uniform(80, 1, -1, 1, x, (size_t)130 * H);
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 1, H, y1, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(moe_forward(cm, "m", 0, MOE_F32, x, 1, H, y1, NULL), MOE_OK, "%s",
                 moe_last_error());
    int64_t req0 = coord_stat(cl, "requests_total"), lane_tokens = 0;
    for (int ti = 0; ti < 3; ti++) {
        const int T = Ts[ti];
        rng_fill_uniform(81, (uint64_t)T, -1, 1, x, (size_t)T * H);
        moe_fwd_info i0, i1;
        memset(&i0, 0, sizeof(i0));
        memset(&i1, 0, sizeof(i1));
        cr_assert_eq(moe_forward(cc, "m", 0, MOE_F32, x, T, H, y0, &i0), MOE_OK, "%s",
                     moe_last_error());
        for (int p = 0; p < 2; p++) {
            memset(y1, 0xff, (size_t)T * H * 4);
            cr_assert_eq(moe_forward(p ? cm : cs, "m", 0, MOE_F32, x, T, H, y1, &i1), MOE_OK,
                         "lane forward T=%d: %s", T, moe_last_error());
            cr_assert(memcmp(y0, y1, (size_t)T * H * 4) == 0, "lane y differs (T=%d, %s)", T,
                      p ? "shm" : "socket");
            cr_assert_eq(i1.n_experts, E, "lane stats: %d experts", i1.n_experts);
            for (int e = 0; e < E; e++)
                cr_assert_eq(i1.tokens_per_expert[e], i0.tokens_per_expert[e],
                             "lane stats: expert %d", e);
            cr_assert_float_eq(i1.imbalance, i0.imbalance, 1e-12);
            cr_assert_float_eq(i1.aux_loss, i0.aux_loss, 1e-9);
            moe_fwd_info_free(&i1);
            lane_tokens += T;
        }
        moe_fwd_info_free(&i0);
    }
    /* the coordinator saw the 3 coordinator-path forwards and this stats
     * call (each stats call counts itself), none of the 6 lane forwards */
    int64_t req1 = coord_stat(cl, "requests_total");
    cr_assert_eq(req1 - req0, 3 + 1, "requests at the coordinator: %lld", (long long)(req1 - req0));
    /* ... and counts the lane's with the worker's next heartbeat */
    /* (a fresh cluster: the 2 warm-up forwards of one row, 3 over the
     * coordinator, 6 on the lane) */
    int64_t want_f = 2 + 3 + 6, want_t = 2 + 140 + lane_tokens, f = 0, t = 0;
    for (int i = 0; i < 3000 && (f < want_f || t < want_t); i++) {
        f = coord_stat(cl, "forward_total");
        t = coord_stat(cl, "tokens_total");
        if (f < want_f || t < want_t)
            usleep(10000);
    }
    cr_assert_eq(f, want_f, "forward_total %lld, want %lld", (long long)f, (long long)want_f);
    cr_assert_eq(t, want_t, "tokens_total %lld, want %lld", (long long)t, (long long)want_t);
    /* a NaN on the lane: refused to its sender, the worker goes on */
    x[3] = NAN;
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 9, H, y1, NULL), MOE_EINVAL);
    x[3] = 0.5f;
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 9, H, y1, NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_client_close(cc);
    moe_client_close(cs);
    moe_client_close(cm);
    free(x);
    free(y0);
    free(y1);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* The lane stays closed with two workers and with --lane 0; a data.rows
 * asking to run is refused clearly (unavailable: ask dataplane.info
 * again) when the generation is not one of one worker, or is not the
 * current one; bad "run" params are invalid; the worker keeps serving. */
Test(dataplane, lane_closed_and_bad_run_refused, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o2 = {.workers = 2};
    cluster *cl = cluster_start(&o2);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    create(cl, "m", 16, 16, 4, 1, MOE_F32);
    cr_assert(!lane_open(cl), "two workers: no lane");
    char url[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    nng_socket s = raw_open(url);
    float x[2 * 16] = {0};
    moe_tensor t = {MOE_F32, 2, {2, 16, 0, 0}, x, sizeof(x)};
    for (int k = 0; k < 4; k++) {
        mp_writer p;
        raw_reply r;
        mp_writer_init(&p);
        write_ticket(&p, 77, (uint64_t)k + 1);
        mp_write_cstr(&p, "x");
        moe_tensor_write(&p, &t);
        mp_write_cstr(&p, "run");
        if (k == 3) { /* not a map */
            mp_write_i64(&p, 1);
        } else {
            mp_write_map(&p, 3);
            mp_write_cstr(&p, "model");
            mp_write_cstr(&p, k == 2 ? "nope" : "m");
            mp_write_cstr(&p, "layer");
            mp_write_i64(&p, 0);
            mp_write_cstr(&p, "generation");
            mp_write_u64(&p, k == 1 ? 999 : 1);
        }
        raw_call(s, "data.rows", &p, 3, &r);
        mp_writer_fini(&p);
        expect_err(&r, k == 3 ? MOE_EPROTO : MOE_EUNAVAIL, "data.rows run on a closed lane");
    }
    nng_close(s);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());

    /* one worker: wrong generation, unknown model */
    cluster_opts o1 = {.workers = 1};
    cl = cluster_start(&o1);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    create(cl, "m", 16, 16, 4, 1, MOE_F32);
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    s = raw_open(url);
    for (int k = 0; k < 2; k++) {
        mp_writer p;
        raw_reply r;
        mp_writer_init(&p);
        write_ticket(&p, 78, (uint64_t)k + 1);
        mp_write_cstr(&p, "x");
        moe_tensor_write(&p, &t);
        mp_write_cstr(&p, "run");
        mp_write_map(&p, 3);
        mp_write_cstr(&p, "model");
        mp_write_cstr(&p, k ? "nope" : "m");
        mp_write_cstr(&p, "layer");
        mp_write_i64(&p, 0);
        mp_write_cstr(&p, "generation");
        mp_write_u64(&p, k ? 1 : 999);
        raw_call(s, "data.rows", &p, 3, &r);
        mp_writer_fini(&p);
        expect_err(&r, k ? MOE_ENOTFOUND : MOE_EUNAVAIL, "data.rows run: stale or unknown");
    }
    nng_close(s);
    float y[2 * 16];
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 2, 16, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());

    /* --lane 0 on the coordinator: closed, forwards still served */
    cluster_opts o3 = {.workers = 1, .coord_args = {"--lane", "0"}};
    cl = cluster_start(&o3);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    cr_assert(!lane_open(cl), "--lane 0: no lane");
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ring_answer: waits for the ring's answer to its last post and parses it */
static moe_rpc_response ring_answer(moe_ring *rg, uint8_t *copy, size_t cap)
{
    const uint8_t *a;
    size_t n;
    cr_assert_eq(moe_ring_wait(rg, 30000, NULL, &a, &n), MOE_OK, "no answer on the ring");
    cr_assert(n <= cap);
    memcpy(copy, a, n);
    moe_rpc_response resp;
    mp_errbuf eb = {{0}};
    cr_assert_eq(moe_rpc_parse_response(copy, n, &resp, &eb), MOE_OK, "%s", eb.msg);
    cr_assert_eq(resp.msgid, rg->seq, "the answer names request %u, not %u", resp.msgid, rg->seq);
    return resp;
}

static void ring_expect(moe_ring *rg, moe_err want, const char *what)
{
    uint8_t buf[4096];
    moe_rpc_response resp = ring_answer(rg, buf, sizeof(buf));
    cr_assert_eq(resp.err, want, "%s: got %s (%.*s), want %s", what, moe_err_code(resp.err),
                 (int)resp.errmsg_len, resp.errmsg ? resp.errmsg : "", moe_err_code(want));
    cr_assert(resp.errmsg_len > 0, "%s: empty message", what);
    cr_log_info("ring: %s -> %s: %.*s", what, moe_err_code(want), (int)resp.errmsg_len,
                resp.errmsg);
}

/* A shared-memory ring (docs/PROTOCOL.md, "Data plane", 8): libmoe's lane
 * forwards over shared memory go through one (the worker counts it) and
 * give the socket's bytes; bad attaches and bad requests get clear errors
 * in the ring or on the socket, the worker keeps serving, and closing the
 * connection stops the ring and unmaps its region. */
Test(dataplane, ring_requests_and_bad_input, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32;
    create(cl, "m", H, 32, 4, 2, MOE_F32);
    char url[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());

    /* libmoe: the same bytes through the ring as through the socket */
    moe_client *cs = open_path(cl, "socket"), *cm = open_path(cl, "shm");
    float *x = malloc(64 * 32 * 4), *y0 = malloc(64 * 32 * 4), *y1 = malloc(64 * 32 * 4);
    for (int T = 1; T <= 64; T *= 4) {
        rng_fill_uniform(90, (uint64_t)T, -1, 1, x, (size_t)T * H);
        cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, T, H, y0, NULL), MOE_OK, "%s",
                     moe_last_error());
        cr_assert_eq(moe_forward(cm, "m", 0, MOE_F32, x, T, H, y1, NULL), MOE_OK, "%s",
                     moe_last_error());
        cr_assert(memcmp(y0, y1, (size_t)T * H * 4) == 0, "ring y differs at T=%d", T);
    }
    cr_assert_eq(data_stat(url, "rings"), 1, "one client calling in turn: one ring");
    moe_client_close(cm);
    wait_stat(url, "rings", 0);
    wait_stat(url, "regions", 0);

    /* by hand: a ring segment and a data segment on one connection */
    nng_socket s = raw_open(url);
    raw_reply r;
    mp_writer p;
    char rname[64], dname[64];
    snprintf(rname, sizeof(rname), "/moe-%ld-ringtest", (long)getpid());
    snprintf(dname, sizeof(dname), "/moe-%ld-ringdata", (long)getpid());
    moe_ring rg;
    cr_assert_eq(moe_ring_map(&rg, rname, 8192), MOE_OK);
    int fd = shm_open(dname, O_CREAT | O_RDWR, 0600);
    cr_assert(fd >= 0);
    cr_assert_eq(ftruncate(fd, 65536), 0);
    float *data = mmap(NULL, 65536, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    cr_assert(data != MAP_FAILED);
    uint64_t region[2] = {0, 0};
    const char *names[2] = {rname, dname};
    const size_t sizes[2] = {8192, 65536};
    for (int i = 0; i < 2; i++) {
        mp_writer_init(&p);
        mp_write_cstr(&p, "name");
        mp_write_cstr(&p, names[i]);
        mp_write_cstr(&p, "size");
        mp_write_u64(&p, sizes[i]);
        raw_call(s, "data.shm_attach", &p, 2, &r);
        mp_writer_fini(&p);
        shm_unlink(names[i]);
        cr_assert_eq(r.rv, 0);
        cr_assert_eq(r.resp.err, MOE_OK, "attach: %.*s", (int)r.resp.errmsg_len, r.resp.errmsg);
        mp_reader rd = r.resp.result;
        cr_assert(mp_map_find(&rd, "region") == 0 && mp_read_u64(&rd, &region[i], NULL) == MOE_OK);
        raw_free(&r);
    }
    /* bad attaches: misaligned, too small, outside the region, no region */
    static const int64_t bad[4][3] = {{0, 32, 4096}, {0, 0, 1024}, {0, 4096, 8192}, {1, 0, 4096}};
    static const moe_err bad_err[4] = {MOE_EINVAL, MOE_EINVAL, MOE_EINVAL, MOE_ENOTFOUND};
    for (int i = 0; i < 4; i++) {
        mp_writer_init(&p);
        mp_write_cstr(&p, "region");
        mp_write_u64(&p, bad[i][0] ? 999 : region[0]);
        mp_write_cstr(&p, "offset");
        mp_write_u64(&p, (uint64_t)bad[i][1]);
        mp_write_cstr(&p, "size");
        mp_write_u64(&p, (uint64_t)bad[i][2]);
        raw_call(s, "data.ring_attach", &p, 3, &r);
        mp_writer_fini(&p);
        expect_err(&r, bad_err[i], "a bad data.ring_attach");
    }
    cr_assert_eq(data_stat(url, "rings"), 0);
    mp_writer_init(&p);
    mp_write_cstr(&p, "region");
    mp_write_u64(&p, region[0]);
    mp_write_cstr(&p, "offset");
    mp_write_u64(&p, 0);
    mp_write_cstr(&p, "size");
    mp_write_u64(&p, 8192);
    raw_call(s, "data.ring_attach", &p, 3, &r);
    mp_writer_fini(&p);
    cr_assert_eq(r.rv, 0);
    cr_assert_eq(r.resp.err, MOE_OK, "ring: %.*s", (int)r.resp.errmsg_len, r.resp.errmsg);
    raw_free(&r);
    cr_assert_eq(data_stat(url, "rings"), 1);

    /* bad requests in the ring: not a map, offsets outside the region, rows
     * whose job never comes (their deadline: answered from the worker's
     * loop), a request larger than the request area */
    static const uint8_t not_a_map[1] = {0x01};
    cr_assert_eq(moe_ring_post(&rg, not_a_map, 1), MOE_OK);
    ring_expect(&rg, MOE_EPROTO, "a ring request that is not a map");
    for (int k = 0; k < 2; k++) {
        mp_writer_init(&p);
        mp_write_map(&p, 7);
        write_ticket(&p, 5, (uint64_t)k);
        write_rows_f32(&p, 4, H);
        mp_write_cstr(&p, "region");
        mp_write_u64(&p, region[1]);
        mp_write_cstr(&p, "x_offset");
        mp_write_u64(&p, k == 0 ? 65536 - 64 : 0);
        mp_write_cstr(&p, "y_offset");
        mp_write_u64(&p, 4096);
        mp_write_cstr(&p, "deadline_ms");
        mp_write_i64(&p, 1);
        cr_assert_eq(moe_ring_post(&rg, p.buf, p.len), MOE_OK);
        mp_writer_fini(&p);
        ring_expect(&rg, k == 0 ? MOE_EINVAL : MOE_ETIMEDOUT,
                    k == 0 ? "rows outside the region" : "rows whose job never comes");
    }
    uint8_t *big = calloc(1, 8192);
    cr_assert_eq(moe_ring_post(&rg, big, 8192), MOE_ETOOBIG, "the client refuses it first");
    free(big);

    /* a lane forward through the ring: rows from the data segment, y into
     * it, the bytes of the socket path */
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "dataplane.info", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    mp_reader rd = mp_reply_reader(&rep);
    uint64_t gen = 0;
    cr_assert(mp_map_find(&rd, "generation") == 0 && mp_read_u64(&rd, &gen, NULL) == MOE_OK);
    moe_reply_free(&rep);
    const int T = 5;
    rng_fill_uniform(91, 1, -1, 1, data, (size_t)T * H);
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, data, T, H, y0, NULL), MOE_OK, "%s",
                 moe_last_error());
    mp_writer_init(&p);
    mp_write_map(&p, 7);
    write_ticket(&p, 6, 1);
    write_rows_f32(&p, T, H);
    mp_write_cstr(&p, "region");
    mp_write_u64(&p, region[1]);
    mp_write_cstr(&p, "x_offset");
    mp_write_u64(&p, 0);
    mp_write_cstr(&p, "y_offset");
    mp_write_u64(&p, 8192);
    write_run_m0(&p, gen);
    cr_assert_eq(moe_ring_post(&rg, p.buf, p.len), MOE_OK);
    mp_writer_fini(&p);
    uint8_t ans[4096];
    moe_rpc_response resp = ring_answer(&rg, ans, sizeof(ans));
    cr_assert_eq(resp.err, MOE_OK, "lane forward on the ring: %.*s", (int)resp.errmsg_len,
                 resp.errmsg);
    cr_assert(memcmp(data + 8192 / 4, y0, (size_t)T * H * 4) == 0, "ring y differs");

    /* the worker kept serving the socket, and closing the connection stops
     * the ring and unmaps both regions */
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 3, H, y1, NULL), MOE_OK, "%s",
                 moe_last_error());
    nng_close(s);
    wait_stat(url, "rings", 0);
    wait_stat(url, "regions", 0);
    moe_ring_unmap(&rg);
    munmap(data, 65536);
    moe_client_close(cs);
    free(x);
    free(y0);
    free(y1);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

typedef struct ring_loop {
    moe_client *c;
    int H;
    atomic_int done;
    moe_err err;
    char msg[300];
} ring_loop;

static void *ring_loop_main(void *arg)
{
    ring_loop *l = arg;
    float x[4 * 32], y[4 * 32];
    rng_fill_uniform(92, 1, -1, 1, x, sizeof(x) / 4);
    for (;;) {
        moe_err e = moe_forward(l->c, "m", 0, MOE_F32, x, 4, l->H, y, NULL);
        if (e != MOE_OK) {
            l->err = e;
            snprintf(l->msg, sizeof(l->msg), "%s", moe_last_error());
            return NULL;
        }
        atomic_fetch_add(&l->done, 1);
    }
}

/* The worker is SIGKILLed while a client waits on a ring: the client sees
 * the connection go and answers unavailable instead of waiting out its
 * deadline (30 s here; the test allows 20). */
Test(dataplane, ring_worker_killed_answers_unavailable, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32;
    create(cl, "m", H, 32, 4, 2, MOE_F32);
    char url[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    ring_loop l = {.c = open_path(cl, "shm"), .H = H};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, ring_loop_main, &l), 0);
    while (atomic_load(&l.done) < 50 && !l.err)
        usleep(1000);
    cr_assert_eq(l.err, MOE_OK, "before the kill: %s", l.msg);
    cr_assert_eq(data_stat(url, "rings"), 1, "the forwards do not go through a ring");
    int64_t t0 = cluster_now_ms();
    cr_assert_eq(cluster_worker_kill(cl, 0, SIGKILL), 0);
    pthread_join(th, NULL);
    int64_t waited = cluster_now_ms() - t0;
    cr_log_info("after the kill: %s (%lld ms): %s", moe_err_code(l.err), (long long)waited, l.msg);
    cr_assert_eq(l.err, MOE_EUNAVAIL, "got %s: %s", moe_err_code(l.err), l.msg);
    cr_assert(waited < 20000, "the client waited %lld ms", (long long)waited);
    moe_client_close(l.c);
}

/* the NCCL path (docs/PROTOCOL.md, "9. NCCL") on a CPU worker: not
 * advertised in dataplane.info, data.nccl_open refused with
 * failed_precondition and a reason, rows naming a communicator refused,
 * a client on data path nccl fails clearly (unavailable) - and the worker
 * keeps serving the other paths */
/* pieces_rows_call: data.rows (ticket 91/seq) of T rows (H wide, f32) over
 * communicator 1 in `pieces` pieces (NO_PIECES: no such key); lane: with
 * run (model m, layer 0, generation 1); inline: x in the message instead
 * of nccl */
#define NO_PIECES INT64_MIN
static void pieces_rows_call(nng_socket s, uint64_t seq, int64_t T, int64_t H, int64_t pieces,
                             int lane, int inline_x, raw_reply *r)
{
    static float x[8 * 32];
    mp_writer p;
    uint32_t n = 1;
    mp_writer_init(&p);
    write_ticket(&p, 91, seq);
    if (inline_x) {
        moe_tensor t = {MOE_F32, 2, {T, H, 0, 0}, x, (size_t)(T * H) * sizeof(float)};
        mp_write_cstr(&p, "x");
        moe_tensor_write(&p, &t);
        n += 1;
    } else {
        write_rows_f32(&p, T, H);
        mp_write_cstr(&p, "nccl");
        mp_write_u64(&p, 1);
        n += 3;
    }
    if (pieces != NO_PIECES) {
        mp_write_cstr(&p, "pieces");
        mp_write_i64(&p, pieces);
        n++;
    }
    if (lane) {
        write_run_m0(&p, 1);
        n++;
    }
    raw_call(s, "data.rows", &p, n, r);
    mp_writer_fini(&p);
}

Test(dataplane, nccl_refused_clearly_on_cpu, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32, T = 4;
    create(cl, "m", H, 32, 4, 2, MOE_F32);

    /* dataplane.info: workers[0].nccl is false */
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "dataplane.info", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    mp_reader rd = mp_reply_reader(&rep);
    uint32_t nw = 0;
    bool nccl = true;
    cr_assert(mp_map_find(&rd, "workers") == 0 && mp_read_array(&rd, &nw, NULL) == MOE_OK &&
              nw == 1);
    cr_assert(mp_map_find(&rd, "nccl") == 0 && mp_read_bool(&rd, &nccl, NULL) == MOE_OK,
              "dataplane.info: a worker without the nccl key");
    cr_assert(!nccl, "a CPU worker advertises nccl");
    moe_reply_free(&rep);

    char url[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    nng_socket s = raw_open(url);
    raw_reply r;
    mp_writer p;
    uint8_t id[128];
    memset(id, 0x5a, sizeof(id));

    mp_writer_init(&p);
    mp_write_cstr(&p, "id");
    mp_write_bin(&p, id, sizeof(id));
    mp_write_cstr(&p, "device");
    mp_write_i64(&p, 0);
    raw_call(s, "data.nccl_open", &p, 2, &r);
    mp_writer_fini(&p);
    cr_assert_eq(r.rv, 0);
    cr_assert(r.resp.errmsg && memmem(r.resp.errmsg, r.resp.errmsg_len, "no GPU", 6),
              "data.nccl_open: %.*s", (int)r.resp.errmsg_len, r.resp.errmsg ? r.resp.errmsg : "");
    expect_err(&r, MOE_EPRECOND, "data.nccl_open on a CPU worker");

    /* a client whose NCCL is not the worker's (a PyTorch process brings its
     * own): refused before anything starts, saying both versions; checked
     * ahead of the GPU, so this CPU worker of a CUDA build shows it */
    mp_writer_init(&p);
    mp_write_cstr(&p, "id");
    mp_write_bin(&p, id, sizeof(id));
    mp_write_cstr(&p, "nccl_version");
    mp_write_i64(&p, 20101); /* 2.1.1 */
    raw_call(s, "data.nccl_open", &p, 2, &r);
    mp_writer_fini(&p);
    cr_assert_eq(r.rv, 0);
#ifdef MOE_HAVE_CUDA
    cr_assert(r.resp.errmsg && memmem(r.resp.errmsg, r.resp.errmsg_len,
                                      "NCCL versions differ: the client runs NCCL 2.1.1", 48),
              "data.nccl_open from another NCCL: %.*s", (int)r.resp.errmsg_len,
              r.resp.errmsg ? r.resp.errmsg : "");
#endif
    expect_err(&r, MOE_EPRECOND, "data.nccl_open from another NCCL version");

    /* rows naming a communicator: none is open here */
    pieces_rows_call(s, 1, T, H, NO_PIECES, 0, 0, &r);
    cr_assert_eq(r.rv, 0);
    cr_assert(r.resp.err == MOE_EPRECOND || r.resp.err == MOE_ENOTFOUND, "data.rows nccl: %s",
              moe_err_code(r.resp.err));
    expect_err(&r, r.resp.err, "data.rows naming a communicator on a CPU worker");

    mp_writer_init(&p);
    mp_write_cstr(&p, "comm");
    mp_write_u64(&p, 1);
    raw_call(s, "data.nccl_close", &p, 1, &r);
    mp_writer_fini(&p);
    expect_err(&r, MOE_ENOTFOUND, "data.nccl_close of no communicator");
    nng_close(s);

    /* a client on the nccl path: refused before anything is sent */
    moe_client *c = open_path(cl, "nccl");
    float x[4 * 32], y[4 * 32], y2[4 * 32];
    rng_fill_uniform(3, 1, -1, 1, x, (size_t)T * H);
    moe_err e = moe_forward(c, "m", 0, MOE_F32, x, T, H, y, NULL);
    cr_assert_eq(e, MOE_EUNAVAIL, "nccl path on a CPU worker: got %s", moe_err_code(e));
    cr_log_info("nccl path: %s", moe_last_error());
    cr_assert(strstr(moe_last_error(), "nccl"), "%s", moe_last_error());
    moe_client_close(c);

    /* the worker still serves */
    c = open_path(cl, "socket");
    cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, x, T, H, y2, NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_client_close(c);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* expect_says: an error reply of code want whose message holds says */
static void expect_says(raw_reply *r, moe_err want, const char *says, const char *what)
{
    cr_assert_eq(r->rv, 0, "%s: no reply", what);
    cr_assert(r->resp.errmsg && memmem(r->resp.errmsg, r->resp.errmsg_len, says, strlen(says)),
              "%s: '%.*s' does not say '%s'", what, (int)r->resp.errmsg_len,
              r->resp.errmsg ? r->resp.errmsg : "", says);
    expect_err(r, want, what);
}

/* data.rows "pieces" (docs/PROTOCOL.md, "9. NCCL", "Pieces"): a value the
 * worker cannot honour - out of [1, 8], more pieces than rows, pieces
 * outside a lane forward, pieces of rows that do not come over NCCL - is
 * refused invalid_argument with the reason, before anything is received
 * (this CPU worker would otherwise say that no communicator is open: a
 * valid request gets that answer); nothing is left behind, and the worker
 * keeps serving. */
Test(dataplane, nccl_pieces_refused_clearly, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32, T = 4;
    create(cl, "m", H, 32, 4, 2, MOE_F32);
    cr_assert(lane_open(cl), "one worker: the lane is open");
    char url[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    nng_socket s = raw_open(url);
    raw_reply r;

    pieces_rows_call(s, 1, T, H, 9, 1, 0, &r);
    expect_says(&r, MOE_EINVAL, "1 to 8 pieces", "pieces 9");
    pieces_rows_call(s, 2, T, H, 0, 1, 0, &r);
    expect_says(&r, MOE_EINVAL, "1 to 8 pieces", "pieces 0");
    pieces_rows_call(s, 3, T, H, -1, 1, 0, &r);
    expect_says(&r, MOE_EINVAL, "1 to 8 pieces", "pieces -1");
    pieces_rows_call(s, 4, T, H, T + 1, 1, 0, &r);
    expect_says(&r, MOE_EINVAL, "every piece needs at least one row", "more pieces than rows");
    pieces_rows_call(s, 5, T, H, 2, 0, 0, &r);
    expect_says(&r, MOE_EINVAL, "only a lane forward", "pieces without run");
    pieces_rows_call(s, 6, T, H, 2, 1, 1, &r);
    expect_says(&r, MOE_EINVAL, "only rows over NCCL", "pieces of inline rows");
    /* valid pieces: past the check, refused for what this worker lacks */
    for (int P = 1; P <= T; P++) {
        pieces_rows_call(s, 10 + (uint64_t)P, T, H, P, 1, 0, &r);
        cr_assert_eq(r.rv, 0);
        cr_assert(r.resp.err == MOE_EPRECOND || r.resp.err == MOE_ENOTFOUND,
                  "pieces %d over NCCL on a CPU worker: %s", P, moe_err_code(r.resp.err));
        expect_err(&r, r.resp.err, "valid pieces, no communicator");
    }
    /* nothing left behind */
    wait_stat(url, "tickets", 0);
    cr_assert_eq(data_stat(url, "staged_bytes"), 0);
    nng_close(s);

    /* the worker still serves */
    float x[4 * 32], y[4 * 32];
    rng_fill_uniform(5, 1, -1, 1, x, (size_t)T * H);
    moe_client *c = open_path(cl, "socket");
    cr_assert_eq(moe_forward(c, "m", 0, MOE_F32, x, T, H, y, NULL), MOE_OK, "%s", moe_last_error());
    moe_client_close(c);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* MOE_LANE_TRACE=N (docs/OPERATIONS.md, "Logs"): every N ring requests the
 * worker logs the medians of each step's time; requests on the socket are
 * not counted, and a worker without the variable logs nothing of it. */
Test(dataplane, lane_trace_logs_step_medians, .timeout = 120, .fini = cluster_fini_all)
{
    setenv("MOE_LANE_TRACE", "3", 1);
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    unsetenv("MOE_LANE_TRACE");
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32;
    create(cl, "m", H, 32, 4, 2, MOE_F32);
    moe_client *cs = open_path(cl, "socket"), *cm = open_path(cl, "shm");
    float x[2 * 32], y[2 * 32];
    rng_fill_uniform(91, 1, -1, 1, x, sizeof(x) / 4);
    for (int i = 0; i < 4; i++) /* the socket: no stamps from a ring */
        cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 2, H, y, NULL), MOE_OK, "%s",
                     moe_last_error());
    cr_assert(!cluster_log_has(cl->paths_worker_log[0], "lane trace"),
              "socket requests were traced");
    for (int i = 0; i < 30; i++) /* 3 at least on the ring, however it is set up */
        cr_assert_eq(moe_forward(cm, "m", 0, MOE_F32, x, 2, H, y, NULL), MOE_OK, "%s",
                     moe_last_error());
    int found = 0;
    for (int i = 0; i < 1000 && !found; i++) { /* written after the third answer went */
        found = cluster_log_has(cl->paths_worker_log[0],
                                "lane trace, medians of 3 requests (us): seen->");
        if (!found)
            usleep(10000);
    }
    cr_assert(found, "no lane trace line after 30 requests through shared memory");
    moe_client_close(cs);
    moe_client_close(cm);
}
