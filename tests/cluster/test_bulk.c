/*
 * test_bulk.c - the data plane's bulk path (docs/PROTOCOL.md, "Data plane",
 * "7. Bulk rows"): rows over a worker's plain TCP bulk endpoint, control
 * over nng, on real clusters of CPU workers.
 *  - forward, train forward and backward over the bulk path give the bytes
 *    of the coordinator path, on 1, 2 and 3 workers (f32 and bf16); the
 *    auto path takes it for large rows to a worker on "another host";
 *  - bad headers, a length over the cap, a wrong token, a transfer cut off,
 *    a client killed mid-stream or after its ack, rows never named, a
 *    ticket twice, the staged-bytes cap: the worker answers or drops the
 *    connection, gives back what it held and keeps serving;
 *  - small requests over nng and bulk ones interleave;
 *  - a worker with --bulk-listen off: "bulk" fails clearly, auto falls back.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <netdb.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proto/bulk_wire.h"
#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

static moe_client *open_path(cluster *cl, const char *path)
{
    moe_client *c;
    moe_client_opts o = {.timeout_ms = 30000, .auth_token = cl->opts.auth_token, .data_path = path};
    cr_assert_eq(moe_client_open(cl->url, &o, &c), MOE_OK, "open (%s): %s", path, moe_last_error());
    return c;
}

static void create(cluster *cl, int H, int F, int E, int K, moe_dtype dt)
{
    moe_model_config mc = {0};
    mc.name = "m";
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

/* ---- raw nng calls on a worker's client endpoint ---- */

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

/* raw_call: method {pairs in p (n of them)}; the reply's error code (the
 * result, when ok, is not needed here) */
static moe_err raw_call(nng_socket s, const char *method, const mp_writer *p, uint32_t n, char *msg,
                        size_t msglen)
{
    static uint32_t next = 1;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, next++, method);
    mp_write_map(&w, n);
    if (p)
        mp_write_raw(&w, p->buf, p->len);
    int rv = nng_send(s, w.buf, w.len, 0);
    mp_writer_fini(&w);
    uint8_t *buf = NULL;
    size_t len = 0;
    if (rv == 0)
        rv = nng_recv(s, &buf, &len, NNG_FLAG_ALLOC);
    cr_assert_eq(rv, 0, "%s: no reply: %s", method, nng_strerror(rv));
    moe_rpc_response resp;
    mp_errbuf eb = {{0}};
    cr_assert_eq(moe_rpc_parse_response(buf, len, &resp, &eb), MOE_OK, "%s", eb.msg);
    snprintf(msg, msglen, "%.*s", (int)resp.errmsg_len, resp.errmsg ? resp.errmsg : "");
    moe_err e = resp.err;
    nng_free(buf, len);
    return e;
}

/* the workers' --auth-token in this test, NULL = none */
static const char *g_auth;

/* data_stat: one counter of the data endpoint's ping */
static int64_t data_stat(const char *url, const char *key)
{
    nng_socket s = raw_open(url);
    static uint32_t next = 1;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, next++, "ping");
    mp_write_map(&w, g_auth ? 1 : 0);
    if (g_auth) {
        mp_write_cstr(&w, "auth");
        mp_write_cstr(&w, g_auth);
    }
    cr_assert_eq(nng_send(s, w.buf, w.len, 0), 0);
    mp_writer_fini(&w);
    uint8_t *buf;
    size_t len;
    cr_assert_eq(nng_recv(s, &buf, &len, NNG_FLAG_ALLOC), 0);
    moe_rpc_response resp;
    mp_errbuf eb;
    cr_assert_eq(moe_rpc_parse_response(buf, len, &resp, &eb), MOE_OK);
    mp_reader rd = resp.result;
    int64_t v = -1;
    cr_assert(mp_map_find(&rd, key) == 0 && mp_read_i64(&rd, &v, NULL) == MOE_OK, "ping: no %s",
              key);
    nng_free(buf, len);
    nng_close(s);
    return v;
}

/* wait_stat: the counter reaches want (bounded generously for a loaded
 * machine; polling, never a sleep standing for an event) */
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

/* nothing held: no ticket, no staged byte, no parked rows, no connection */
static void wait_clean(const char *url)
{
    wait_stat(url, "bulk_conns", 0);
    wait_stat(url, "bulk_parked", 0);
    wait_stat(url, "tickets", 0);
    wait_stat(url, "staged_bytes", 0);
}

/* ---- raw bulk connections ---- */

static int bulk_dial(const char *url)
{
    char host[256], port[16];
    cr_assert_eq(moe_bulk_url_split(url, host, sizeof(host), port, sizeof(port)), MOE_OK, "%s",
                 url);
    struct addrinfo hints = {0}, *ai;
    hints.ai_socktype = SOCK_STREAM;
    cr_assert_eq(getaddrinfo(host, port, &hints, &ai), 0);
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    cr_assert_eq(connect(fd, ai->ai_addr, ai->ai_addrlen), 0, "connect %s: %s", url,
                 strerror(errno));
    freeaddrinfo(ai);
    struct timeval tv = {60, 0}; /* a bound on a test that would hang */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

static int io_all(int fd, void *buf, size_t n, int wr)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t k = wr ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* send_hdr: a request header (fields as given, even inconsistent) */
static void send_hdr(int fd, uint64_t cid, uint64_t seq, moe_dtype dt, int64_t rows, int64_t cols,
                     uint64_t nbytes, const char *auth)
{
    uint8_t b[MOE_BULK_REQ_LEN];
    size_t al = auth ? strlen(auth) : 0;
    moe_bulk_req h = {MOE_BULK_MAGIC,
                      MOE_BULK_VERSION,
                      (uint16_t)al,
                      cid,
                      seq,
                      (uint32_t)dt,
                      rows,
                      cols,
                      nbytes,
                      0,
                      0};
    moe_bulk_req_encode(&h, b);
    cr_assert_eq(io_all(fd, b, sizeof(b), 1), 0);
    if (al)
        cr_assert_eq(io_all(fd, (void *)auth, al, 1), 0);
}

/* send_part_hdr: the header of part `part` of `parts` of a transfer of
 * rows x cols f32 (nbytes: the whole transfer's) */
static void send_part_hdr(int fd, uint64_t cid, uint64_t seq, int64_t rows, int64_t cols, int part,
                          int parts)
{
    uint8_t b[MOE_BULK_REQ_LEN];
    moe_bulk_req h = {MOE_BULK_MAGIC,
                      MOE_BULK_VERSION,
                      0,
                      cid,
                      seq,
                      MOE_F32,
                      rows,
                      cols,
                      (uint64_t)(rows * cols * 4),
                      (uint16_t)part,
                      (uint16_t)parts};
    moe_bulk_req_encode(&h, b);
    cr_assert_eq(io_all(fd, b, sizeof(b), 1), 0);
}

/* read_rep: the worker's next reply header: its kind, or 0 when the
 * connection closed instead; an error's code and text in *e / msg */
static int read_rep(int fd, moe_err *e, char *msg, size_t msglen)
{
    uint8_t b[MOE_BULK_REP_LEN];
    moe_bulk_rep h;
    *e = MOE_OK;
    msg[0] = 0;
    if (io_all(fd, b, sizeof(b), 0) != 0)
        return 0;
    cr_assert_eq(moe_bulk_rep_decode(b, &h), MOE_OK, "a malformed reply header");
    if (h.kind == MOE_BULK_ERR) {
        char text[MOE_BULK_MSG_MAX + 1];
        cr_assert_eq(io_all(fd, text, h.msg_len, 0), 0);
        text[h.msg_len] = 0;
        snprintf(msg, msglen, "%s", text);
        *e = (moe_err)h.status;
    }
    return h.kind;
}

/* expect_err_then: the next reply is the error want; then the connection
 * is closed (closes = 1) or still serves (0) */
static void expect_err(int fd, moe_err want, const char *what)
{
    moe_err e;
    char msg[MOE_BULK_MSG_MAX + 1];
    int k = read_rep(fd, &e, msg, sizeof(msg));
    cr_assert_eq(k, MOE_BULK_ERR, "%s: reply kind %d, want an error", what, k);
    cr_assert_eq(e, want, "%s: got %s (%s), want %s", what, moe_err_code(e), msg,
                 moe_err_code(want));
    cr_assert(msg[0], "%s: empty message", what);
    cr_log_info("%s -> %s: %s", what, moe_err_code(want), msg);
}

static void expect_closed(int fd, const char *what)
{
    char c;
    cr_assert_eq(recv(fd, &c, 1, 0), 0, "%s: the connection stays open", what);
    close(fd);
}

/* bulk_metric_max: the largest moe_worker_bulk_transfers_total sample of
 * the coordinator's /metrics, waiting (bounded) for it to reach want: the
 * workers report their counters with their heartbeats */
static double bulk_metric_max(cluster *cl, double want)
{
    static char body[1 << 20];
    const char *fam = "moe_worker_bulk_transfers_total{";
    double mx = -1;
    int64_t t0 = cluster_now_ms();
    do {
        cr_assert_eq(cluster_http_get(cl->metrics_port, "/metrics", NULL, 0, body, sizeof(body)),
                     200);
        mx = -1;
        for (const char *p = strstr(body, fam); p; p = strstr(p + 1, fam)) {
            const char *sp = strchr(p, ' ');
            double v = sp ? atof(sp + 1) : -1;
            mx = v > mx ? v : mx;
        }
        if (mx >= want)
            break;
        usleep(50 * 1000);
    } while (cluster_now_ms() - t0 < 30000);
    return mx;
}

/* ---- every path gives the same bytes ---- */

static void bulk_identical(int W, moe_dtype dt)
{
    cluster_opts o = {.workers = W, .metrics = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 48, F = 64, E = 6, K = 2;
    create(cl, H, F, E, K, dt);
    const size_t es = moe_dtype_size(dt);
    const int Ts[3] = {1, 37, 300};
    moe_client *cc = open_path(cl, "coordinator"), *cb = open_path(cl, "bulk");
    for (int ti = 0; ti < 3; ti++) {
        const int T = Ts[ti];
        size_t n = (size_t)T * H;
        float *xf = malloc(n * 4), *dyf = malloc(n * 4);
        uint8_t *x = malloc(n * es), *dy = malloc(n * es), *y[2], *dx[2];
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
        for (int p = 0; p < 2; p++) {
            moe_client *c = p ? cb : cc;
            y[p] = malloc(n * es);
            dx[p] = malloc(n * es);
            memset(y[p], 0xff, n * es); /* poison */
            memset(dx[p], 0xff, n * es);
            moe_fwd_info info;
            cr_assert_eq(moe_forward(c, "m", 0, dt, x, T, H, y[p], NULL), MOE_OK,
                         "forward (path %d, W=%d, T=%d): %s", p, W, T, moe_last_error());
            uint8_t *y2 = malloc(n * es);
            memset(&info, 0, sizeof(info));
            cr_assert_eq(moe_forward_train(c, "m", 0, dt, x, T, H, y2, &info), MOE_OK,
                         "train forward (path %d): %s", p, moe_last_error());
            cr_assert(memcmp(y2, y[p], n * es) == 0, "train forward y differs from inference");
            cr_assert_eq(moe_backward(c, info.handle, dt, dy, T, H, dx[p]), MOE_OK,
                         "backward (path %d): %s", p, moe_last_error());
            moe_fwd_info_free(&info);
            free(y2);
        }
        cr_assert(memcmp(y[1], y[0], n * es) == 0,
                  "y over bulk differs from the coordinator path (W=%d, T=%d)", W, T);
        cr_assert(memcmp(dx[1], dx[0], n * es) == 0,
                  "dx over bulk differs from the coordinator path (W=%d, T=%d)", W, T);
        for (int p = 0; p < 2; p++) {
            free(y[p]);
            free(dx[p]);
        }
        free(xf), free(dyf), free(x), free(dy);
    }
    moe_client_close(cb);
    moe_client_close(cc);
    /* the rows went in bulk (the last rank has rows of every call) */
    char url[256];
    cr_assert_eq(cluster_worker_key(cl, W - 1, "url", url, sizeof(url)), 0, "%s", cluster_error());
    int64_t in = data_stat(url, "bulk_in_total");
    cr_assert_eq(in, 9, "the last worker took %lld transfers in bulk, want 9", (long long)in);
    /* and the coordinator's /metrics says so */
    cr_assert_eq(bulk_metric_max(cl, 9), 9, "moe_worker_bulk_transfers_total");
    wait_clean(url);
    moe_adamw opt = {1e-3, 0.9, 0.999, 1e-8, 0, 0, 0, 0};
    int64_t step = 0;
    cr_assert_eq(moe_optimizer_step(cl->cli, "m", &opt, &step, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

Test(bulk, identical_w1_f32, .timeout = 120, .fini = cluster_fini_all)
{
    bulk_identical(1, MOE_F32);
}

Test(bulk, identical_w2_bf16, .timeout = 120, .fini = cluster_fini_all)
{
    bulk_identical(2, MOE_BF16);
}

Test(bulk, identical_w3_f32, .timeout = 120, .fini = cluster_fini_all)
{
    bulk_identical(3, MOE_F32);
}

/* auto: rows of 1 MiB or more per worker on another host go in bulk,
 * smaller ones over nng; the bytes are the coordinator path's */
Test(bulk, auto_takes_bulk_for_large_rows_to_other_hosts, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 64, T = 2 * (1 << 20) / (64 * 4) + 5; /* just over 1 MiB per worker */
    create(cl, H, 16, 4, 1, MOE_F32);
    size_t n = (size_t)T * H;
    float *x = malloc(n * 4), *y0 = malloc(n * 4), *y1 = malloc(n * 4);
    rng_fill_uniform(3, 3, -1, 1, x, n);
    moe_client *cc = open_path(cl, "coordinator");
    cr_assert_eq(moe_forward(cc, "m", 0, MOE_F32, x, T, H, y0, NULL), MOE_OK);
    moe_client_close(cc);
    char url0[256], url1[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url0, sizeof(url0)), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_key(cl, 1, "url", url1, sizeof(url1)), 0, "%s", cluster_error());
    /* this client counts as on another host (libmoe reads the id at its
     * first data-plane call) */
    setenv("MOE_HOST_ID", "another-host", 1);
    moe_client *ca = open_path(cl, "auto");
    cr_assert_eq(moe_forward(ca, "m", 0, MOE_F32, x, 16, H, y1, NULL), MOE_OK);
    cr_assert_eq(data_stat(url0, "bulk_in_total") + data_stat(url1, "bulk_in_total"), 0,
                 "small rows went in bulk");
    memset(y1, 0xff, n * 4);
    cr_assert_eq(moe_forward(ca, "m", 0, MOE_F32, x, T, H, y1, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert(memcmp(y0, y1, n * 4) == 0, "auto (bulk) differs from the coordinator path");
    cr_assert_eq(data_stat(url0, "bulk_in_total"), 1);
    cr_assert_eq(data_stat(url1, "bulk_in_total"), 1);
    cr_assert_eq(data_stat(url0, "regions"), 0, "shared memory used with an 'other' host");
    moe_client_close(ca);
    unsetenv("MOE_HOST_ID");
    free(x), free(y0), free(y1);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ---- bounds and errors ---- */

Test(bulk, bad_transfers_worker_keeps_serving, .timeout = 120, .fini = cluster_fini_all)
{
    /* 2 MiB per transfer, 3 MiB staged at most */
    cluster_opts o = {.workers = 1,
                      .worker_args = {"--max-msg-mb", "2", "--data-staged-mb", "3",
                                      "--data-wait-ms", "600000", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32;
    create(cl, H, 32, 4, 2, MOE_F32);
    char url[256], burl[256], msg[400];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_key(cl, 0, "bulk_url", burl, sizeof(burl)), 0, "%s",
                 cluster_error());
    cr_assert(strncmp(burl, "tcp://127.0.0.1:", 16) == 0, "bulk_url %s", burl);
    size_t small = 4 * H * 4;
    uint8_t *rows = calloc(1, (size_t)3 << 20);

    /* a bad magic: an error, the connection closed */
    int fd = bulk_dial(burl);
    uint8_t junk[MOE_BULK_REQ_LEN];
    memset(junk, 'G', sizeof(junk));
    cr_assert_eq(io_all(fd, junk, sizeof(junk), 1), 0);
    expect_err(fd, MOE_EPROTO, "bad magic");
    expect_closed(fd, "bad magic");
    /* another version */
    fd = bulk_dial(burl);
    moe_bulk_req h = {MOE_BULK_MAGIC, MOE_BULK_VERSION, 0, 1, 1, MOE_F32, 4, H, small, 0, 0};
    moe_bulk_req_encode(&h, junk);
    junk[4] = 9;
    cr_assert_eq(io_all(fd, junk, sizeof(junk), 1), 0);
    expect_err(fd, MOE_EPROTO, "version 9");
    expect_closed(fd, "version 9");
    /* a length that does not match the shape */
    fd = bulk_dial(burl);
    send_hdr(fd, 1, 2, MOE_F32, 4, H, small + 1, NULL);
    expect_err(fd, MOE_EINVAL, "length not rows x cols x 4");
    expect_closed(fd, "bad length");
    /* over --max-msg-mb */
    fd = bulk_dial(burl);
    send_hdr(fd, 1, 3, MOE_F32, (3 << 20) / (H * 4), H, (size_t)3 << 20, NULL);
    expect_err(fd, MOE_ETOOBIG, "3 MiB over a 2 MiB cap");
    expect_closed(fd, "too large");

    /* the staged-bytes cap: a second 2 MiB transfer while one is held (a
     * data.rows names it, its job has not come) is busy; its bytes are read
     * and dropped, its connection serves on */
    int64_t R2 = (2 << 20) / (H * 4);
    int fa = bulk_dial(burl), fb = bulk_dial(burl);
    moe_err e;
    send_hdr(fa, 7, 1, MOE_F32, R2, H, (size_t)2 << 20, NULL);
    cr_assert_eq(io_all(fa, rows, (size_t)2 << 20, 1), 0);
    cr_assert_eq(read_rep(fa, &e, msg, sizeof(msg)), MOE_BULK_ACK, "first transfer: %s", msg);
    nng_socket s1 = raw_open(url), s = raw_open(url);
    mp_writer p;
    mp_writer_init(&p);
    moe_rpc_write_request_head(&p, 4242, "data.rows");
    mp_write_map(&p, 2);
    mp_write_cstr(&p, "ticket");
    mp_write_array(&p, 2);
    mp_write_u64(&p, 7);
    mp_write_u64(&p, 1);
    mp_write_cstr(&p, "bulk");
    mp_write_bool(&p, true);
    cr_assert_eq(nng_send(s1, p.buf, p.len, 0), 0); /* answered below */
    mp_writer_fini(&p);
    wait_stat(url, "tickets", 1);
    cr_assert_eq(data_stat(url, "bulk_parked"), 0, "the rows named are still parked");
    send_hdr(fb, 7, 2, MOE_F32, R2, H, (size_t)2 << 20, NULL);
    cr_assert_eq(io_all(fb, rows, (size_t)2 << 20, 1), 0);
    expect_err(fb, MOE_EBUSY, "over --data-staged-mb");
    /* cancel: data.rows is answered closed, the bulk connection an error */
    mp_writer_init(&p);
    mp_write_cstr(&p, "ticket");
    mp_write_array(&p, 2);
    mp_write_u64(&p, 7);
    mp_write_u64(&p, 1);
    cr_assert_eq(raw_call(s, "data.cancel", &p, 1, msg, sizeof(msg)), MOE_OK, "%s", msg);
    mp_writer_fini(&p);
    uint8_t *rb;
    size_t rl;
    cr_assert_eq(nng_recv(s1, &rb, &rl, NNG_FLAG_ALLOC), 0);
    moe_rpc_response resp;
    mp_errbuf eb;
    cr_assert_eq(moe_rpc_parse_response(rb, rl, &resp, &eb), MOE_OK);
    cr_assert_eq(resp.err, MOE_ECLOSED, "cancelled rows answered %s", moe_err_code(resp.err));
    nng_free(rb, rl);
    nng_close(s1);
    cr_assert_eq(read_rep(fa, &e, msg, sizeof(msg)), MOE_BULK_ERR, "cancelled: no error header");
    cr_assert_eq(e, MOE_ECLOSED, "cancelled: %s", moe_err_code(e));
    wait_stat(url, "tickets", 0);
    wait_stat(url, "staged_bytes", 0);
    /* the busy connection takes a transfer now; a ticket twice is refused */
    send_hdr(fb, 7, 3, MOE_F32, 4, H, small, NULL);
    cr_assert_eq(io_all(fb, rows, small, 1), 0);
    cr_assert_eq(read_rep(fb, &e, msg, sizeof(msg)), MOE_BULK_ACK, "after busy: %s", msg);
    send_hdr(fa, 7, 3, MOE_F32, 4, H, small, NULL);
    cr_assert_eq(io_all(fa, rows, small, 1), 0);
    expect_err(fa, MOE_EPRECOND, "the same ticket twice");
    /* data.rows naming rows that are not here; then naming the parked
     * ones, whose job never comes */
    mp_writer_init(&p);
    mp_write_cstr(&p, "ticket");
    mp_write_array(&p, 2);
    mp_write_u64(&p, 7);
    mp_write_u64(&p, 9);
    mp_write_cstr(&p, "bulk");
    mp_write_bool(&p, true);
    cr_assert_eq(raw_call(s, "data.rows", &p, 2, msg, sizeof(msg)), MOE_ENOTFOUND,
                 "data.rows bulk with no rows here: %s", msg);
    mp_writer_fini(&p);
    mp_writer_init(&p);
    mp_write_cstr(&p, "ticket");
    mp_write_array(&p, 2);
    mp_write_u64(&p, 7);
    mp_write_u64(&p, 3);
    mp_write_cstr(&p, "bulk");
    mp_write_bool(&p, true);
    mp_write_cstr(&p, "deadline_ms");
    mp_write_i64(&p, 200);
    /* never run (no job names it): deadline_exceeded on nng, an error
     * header on the bulk connection */
    cr_assert_eq(raw_call(s, "data.rows", &p, 3, msg, sizeof(msg)), MOE_ETIMEDOUT, "%s", msg);
    mp_writer_fini(&p);
    cr_assert_eq(read_rep(fb, &e, msg, sizeof(msg)), MOE_BULK_ERR);
    wait_stat(url, "tickets", 0);
    wait_stat(url, "staged_bytes", 0);
    close(fa);
    close(fb);

    /* a wrong token is refused where the worker has one: see
     * auth_required; a transfer cut off mid-stream is dropped */
    fd = bulk_dial(burl);
    send_hdr(fd, 8, 1, MOE_F32, R2, H, (size_t)2 << 20, NULL);
    cr_assert_eq(io_all(fd, rows, (size_t)1 << 20, 1), 0);
    close(fd);
    wait_clean(url);

    /* and the worker serves on: forwards over bulk and over nng */
    float x[16 * 32], y0[16 * 32], y1[16 * 32];
    rng_fill_uniform(9, 9, -1, 1, x, 16 * 32);
    moe_client *cb = open_path(cl, "bulk"), *cs = open_path(cl, "socket");
    cr_assert_eq(moe_forward(cb, "m", 0, MOE_F32, x, 16, H, y0, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 16, H, y1, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert(memcmp(y0, y1, sizeof(y0)) == 0);
    moe_client_close(cb);
    moe_client_close(cs);
    nng_close(s);
    wait_clean(url);
    free(rows);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

Test(bulk, auth_required, .timeout = 90, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1, .auth_token = "s3cret"};
    g_auth = "s3cret";
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32;
    create(cl, H, 32, 4, 2, MOE_F32);
    char url[256], burl[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_key(cl, 0, "bulk_url", burl, sizeof(burl)), 0, "%s",
                 cluster_error());
    uint8_t rows[4 * 32 * 4] = {0};
    int fd = bulk_dial(burl);
    send_hdr(fd, 1, 1, MOE_F32, 4, H, sizeof(rows), NULL);
    expect_err(fd, MOE_EUNAUTH, "no token");
    expect_closed(fd, "no token");
    fd = bulk_dial(burl);
    send_hdr(fd, 1, 1, MOE_F32, 4, H, sizeof(rows), "wrong!");
    expect_err(fd, MOE_EUNAUTH, "a wrong token");
    expect_closed(fd, "a wrong token");
    fd = bulk_dial(burl);
    send_hdr(fd, 1, 1, MOE_F32, 4, H, sizeof(rows), "s3cret");
    cr_assert_eq(io_all(fd, rows, sizeof(rows), 1), 0);
    moe_err e;
    char msg[300];
    cr_assert_eq(read_rep(fd, &e, msg, sizeof(msg)), MOE_BULK_ACK, "%s", msg);
    close(fd);
    wait_clean(url);
    /* libmoe sends the client's token */
    float x[8 * 32], y[8 * 32];
    rng_fill_uniform(2, 2, -1, 1, x, 8 * 32);
    moe_client *cb = open_path(cl, "bulk");
    cr_assert_eq(moe_forward(cb, "m", 0, MOE_F32, x, 8, H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_client_close(cb);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* rows that no data.rows names are dropped at --data-wait-ms: an error
 * header, the bytes given back, the connection serves on */
Test(bulk, unclaimed_rows_dropped, .timeout = 90, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1, .worker_args = {"--data-wait-ms", "200", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    char url[256], burl[256], msg[300];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_key(cl, 0, "bulk_url", burl, sizeof(burl)), 0, "%s",
                 cluster_error());
    uint8_t rows[4 * 32 * 4] = {0};
    moe_err e;
    int fd = bulk_dial(burl);
    for (int i = 0; i < 2; i++) {
        send_hdr(fd, 5, (uint64_t)i, MOE_F32, 4, 32, sizeof(rows), NULL);
        cr_assert_eq(io_all(fd, rows, sizeof(rows), 1), 0);
        cr_assert_eq(read_rep(fd, &e, msg, sizeof(msg)), MOE_BULK_ACK, "%s", msg);
        expect_err(fd, MOE_ETIMEDOUT, "rows never named");
        wait_stat(url, "bulk_parked", 0);
        wait_stat(url, "staged_bytes", 0);
    }
    close(fd);
    wait_clean(url);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* child_send: in a forked child (no nng here): start a transfer of 8 MiB,
 * send `part` bytes of it (all of it: wait for the ack too), tell the
 * parent on pipe wr, then wait to be killed */
static void child_send(const char *burl, size_t part, int wr)
{
    char host[256], port[16];
    struct addrinfo hints = {0}, *ai;
    if (moe_bulk_url_split(burl, host, sizeof(host), port, sizeof(port)) != MOE_OK)
        _exit(2);
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &ai) != 0)
        _exit(2);
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, ai->ai_addr, ai->ai_addrlen) != 0)
        _exit(3);
    size_t nb = (size_t)8 << 20;
    uint8_t hb[MOE_BULK_REQ_LEN], *rows = calloc(1, nb);
    moe_bulk_req h = {
        MOE_BULK_MAGIC, MOE_BULK_VERSION, 0, 99, 1, MOE_F32, (int64_t)(nb / 128), 32, nb, 0, 0};
    moe_bulk_req_encode(&h, hb);
    if (!rows || io_all(fd, hb, sizeof(hb), 1) != 0 || io_all(fd, rows, part, 1) != 0)
        _exit(4);
    if (part == nb && io_all(fd, hb, MOE_BULK_REP_LEN, 0) != 0) /* the ack */
        _exit(5);
    char c = 1;
    if (write(wr, &c, 1) != 1)
        _exit(6);
    for (;;)
        pause();
}

/* a client killed mid-stream, or after its ack with its rows parked: the
 * worker frees what it held and serves on */
Test(bulk, client_killed_mid_stream, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1, .worker_args = {"--data-wait-ms", "600000", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32;
    create(cl, H, 32, 4, 2, MOE_F32);
    char url[256], burl[256];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_key(cl, 0, "bulk_url", burl, sizeof(burl)), 0, "%s",
                 cluster_error());
    const size_t parts[2] = {(size_t)3 << 20, (size_t)8 << 20};
    for (int i = 0; i < 2; i++) {
        int pp[2];
        cr_assert_eq(pipe(pp), 0);
        pid_t pid = fork();
        cr_assert(pid >= 0);
        if (pid == 0) {
            close(pp[0]);
            child_send(burl, parts[i], pp[1]);
        }
        close(pp[1]);
        char c;
        cr_assert_eq(read(pp[0], &c, 1), 1, "the child did not start its transfer");
        close(pp[0]);
        if (i == 1)
            cr_assert_eq(data_stat(url, "bulk_parked"), 1, "the acked rows are not parked");
        wait_stat(url, "staged_bytes", (int64_t)8 << 20); /* counted from the header on */
        kill(pid, SIGKILL);
        int st;
        waitpid(pid, &st, 0);
        wait_clean(url);
    }
    float x[8 * 32], y[8 * 32];
    rng_fill_uniform(2, 2, -1, 1, x, 8 * 32);
    moe_client *cb = open_path(cl, "bulk");
    cr_assert_eq(moe_forward(cb, "m", 0, MOE_F32, x, 8, H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_client_close(cb);
    wait_clean(url);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ---- interleaved small and bulk requests ---- */

typedef struct mix_arg {
    moe_client *c;
    int id, H, maxT;
    const float *x, *ref; /* ref: (4, maxT, H) y of each size alone */
    const int *Ts;
    int bad;
    char msg[256];
} mix_arg;

static void *mix_main(void *arg)
{
    mix_arg *a = arg;
    float *y = malloc((size_t)a->maxT * a->H * 4);
    for (int k = 0; k < 8 && !a->bad; k++) {
        int j = (k + a->id) % 4, T = a->Ts[j];
        if (moe_forward(a->c, "m", 0, MOE_F32, a->x, T, a->H, y, NULL) != MOE_OK) {
            snprintf(a->msg, sizeof(a->msg), "thread %d call %d: %s", a->id, k, moe_last_error());
            a->bad = 1;
        } else {
            double rel = kern_rel_err(y, a->ref + (size_t)j * a->maxT * a->H, (size_t)T * a->H);
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

Test(bulk, interleaved_small_and_bulk, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 64, maxT = 9000;
    static const int Ts[4] = {1, 33, 9000, 4500}; /* 9000 x 64 x 4 = 2.2 MiB */
    create(cl, H, 32, 6, 2, MOE_F32);
    float *x = malloc((size_t)maxT * H * 4), *ref = malloc((size_t)4 * maxT * H * 4);
    rng_fill_uniform(31, 1, -1, 1, x, (size_t)maxT * H);
    moe_client *cc = open_path(cl, "coordinator");
    for (int k = 0; k < 4; k++)
        cr_assert_eq(
            moe_forward(cc, "m", 0, MOE_F32, x, Ts[k], H, ref + (size_t)k * maxT * H, NULL),
            MOE_OK);
    moe_client_close(cc);
    /* 3 threads on a bulk client, 3 on a socket client, 2 on an auto client
     * that counts as on another host (bulk for the large, nng for the small) */
    setenv("MOE_HOST_ID", "another-host", 1); /* for the auto client; the others do not care */
    moe_client *cb = open_path(cl, "bulk"), *cs = open_path(cl, "socket");
    moe_client *ca = open_path(cl, "auto");
    pthread_t th[8];
    mix_arg args[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (mix_arg){i < 3 ? cb : i < 6 ? cs : ca, i, H, maxT, x, ref, Ts, 0, ""};
        pthread_create(&th[i], NULL, mix_main, &args[i]);
    }
    for (int i = 0; i < 8; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 8; i++)
        cr_assert(!args[i].bad, "%s", args[i].msg);
    moe_client_close(cb);
    moe_client_close(cs);
    moe_client_close(ca);
    unsetenv("MOE_HOST_ID");
    char url[256]; /* the last rank has rows of every call */
    cr_assert_eq(cluster_worker_key(cl, 1, "url", url, sizeof(url)), 0, "%s", cluster_error());
    cr_assert(data_stat(url, "bulk_in_total") >= 24, "the bulk client's rows did not go in bulk");
    wait_clean(url);
    free(x);
    free(ref);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ---- no bulk endpoint ---- */

Test(bulk, off_fails_by_name_auto_falls_back, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2, .worker_args = {"--bulk-listen", "off", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 64, T = 9000;
    create(cl, H, 16, 4, 2, MOE_F32);
    char burl[256];
    cr_assert_eq(cluster_worker_key(cl, 1, "bulk_url", burl, sizeof(burl)), 0, "%s",
                 cluster_error());
    cr_assert_str_empty(burl, "a worker with --bulk-listen off offers %s", burl);
    size_t n = (size_t)T * H;
    float *x = malloc(n * 4), *y0 = malloc(n * 4), *y1 = malloc(n * 4);
    rng_fill_uniform(5, 5, -1, 1, x, n);
    moe_client *cb = open_path(cl, "bulk"), *cc = open_path(cl, "coordinator");
    moe_err e = moe_forward(cb, "m", 0, MOE_F32, x, T, H, y1, NULL);
    cr_assert_eq(e, MOE_EUNAVAIL, "bulk with no endpoint: %s", moe_err_code(e));
    cr_assert(strstr(moe_last_error(), "no bulk endpoint"), "%s", moe_last_error());
    cr_assert_eq(moe_forward(cc, "m", 0, MOE_F32, x, T, H, y0, NULL), MOE_OK);
    setenv("MOE_HOST_ID", "another-host", 1);
    moe_client *ca = open_path(cl, "auto");
    cr_assert_eq(moe_forward(ca, "m", 0, MOE_F32, x, T, H, y1, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert(memcmp(y0, y1, n * 4) == 0, "auto without bulk differs");
    moe_client_close(ca);
    unsetenv("MOE_HOST_ID");
    moe_client_close(cb);
    moe_client_close(cc);
    free(x), free(y0), free(y1);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ---- a transfer split over several connections ---- */

/* large rows split over 1, 2, 3 and 4 connections per worker (uneven row
 * counts) give the bytes of one connection, forward and backward,
 * on 2 workers; each split transfer counts once */
Test(bulk, split_over_connections_identical, .timeout = 300, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 1024, T = 16387; /* 32 MiB each rank: 4 parts of 8 MiB at most */
    create(cl, H, 4, 4, 2, MOE_F32);
    size_t n = (size_t)T * H;
    float *x = malloc(n * 4), *dy = malloc(n * 4), *y[4], *dx[4];
    rng_fill_uniform(21, 1, -1, 1, x, n);
    rng_fill_uniform(21, 2, -1, 1, dy, n);
    moe_client *cb = open_path(cl, "bulk");
    const char *streams[4] = {"1", "2", "3", "16"};
    for (int i = 0; i < 4; i++) {
        setenv("MOE_BULK_STREAMS", streams[i], 1);
        y[i] = malloc(n * 4);
        dx[i] = malloc(n * 4);
        memset(y[i], 0xff, n * 4);
        memset(dx[i], 0xff, n * 4);
        moe_fwd_info info;
        memset(&info, 0, sizeof(info));
        cr_assert_eq(moe_forward_train(cb, "m", 0, MOE_F32, x, T, H, y[i], &info), MOE_OK,
                     "forward (%s streams): %s", streams[i], moe_last_error());
        cr_assert_eq(moe_backward(cb, info.handle, MOE_F32, dy, T, H, dx[i]), MOE_OK,
                     "backward (%s streams): %s", streams[i], moe_last_error());
        moe_fwd_info_free(&info);
        if (i) {
            cr_assert(memcmp(y[i], y[0], n * 4) == 0, "y over %s streams differs", streams[i]);
            cr_assert(memcmp(dx[i], dx[0], n * 4) == 0, "dx over %s streams differs", streams[i]);
        }
    }
    unsetenv("MOE_BULK_STREAMS");
    char url[256];
    cr_assert_eq(cluster_worker_key(cl, 1, "url", url, sizeof(url)), 0, "%s", cluster_error());
    int64_t in = data_stat(url, "bulk_in_total");
    cr_assert_eq(in, 8, "rank 1 took %lld transfers, want 8 (one per split transfer)",
                 (long long)in);
    /* the last calls went over 4 connections at once (kept by the client) */
    cr_assert_eq(data_stat(url, "bulk_conns"), 4, "bulk connections open to rank 1");
    moe_client_close(cb);
    wait_clean(url);
    for (int i = 0; i < 4; i++)
        free(y[i]), free(dx[i]);
    free(x), free(dy);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* bad parts: each answered with its error, what they held given back, and
 * the worker keeps serving */
Test(bulk, split_bad_parts, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1,
                      .worker_args = {"--bulk-timeout-ms", "600", "--data-wait-ms", "300", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const int H = 32, R = 8;
    create(cl, H, 32, 4, 2, MOE_F32);
    char url[256], burl[256], msg[300];
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_key(cl, 0, "bulk_url", burl, sizeof(burl)), 0, "%s",
                 cluster_error());
    float half[4 * 32] = {0}; /* the rows of one part of 2 (R = 8: 4 each) */
    moe_err e;

    /* parts over the cap, a part beyond its count, more parts than rows:
     * malformed headers, the connection closed */
    const int bad[3][2] = {{0, MOE_BULK_MAX_PARTS + 1}, {2, 2}, {0, R + 1}};
    for (int i = 0; i < 3; i++) {
        int fd = bulk_dial(burl);
        send_part_hdr(fd, 30, (uint64_t)i, R, H, bad[i][0], bad[i][1]);
        expect_err(fd, MOE_EINVAL, "bad part numbers");
        expect_closed(fd, "bad part numbers");
    }

    /* a part that disagrees with the first, and a part twice: errors, their
     * rows dropped, the connections serve on; the missing part never comes:
     * the first part is answered deadline_exceeded at --bulk-timeout-ms */
    int a = bulk_dial(burl), b = bulk_dial(burl), c = bulk_dial(burl);
    send_part_hdr(a, 31, 1, R, H, 0, 2);
    cr_assert_eq(io_all(a, half, sizeof(half), 1), 0);
    cr_assert_eq(read_rep(a, &e, msg, sizeof(msg)), MOE_BULK_ACK, "%s", msg);
    send_part_hdr(b, 31, 1, R, H, 0, 2); /* part 0 again */
    cr_assert_eq(io_all(b, half, sizeof(half), 1), 0);
    expect_err(b, MOE_EPRECOND, "a part twice");
    send_part_hdr(c, 31, 1, R, H, 1, 3); /* another count of parts */
    int64_t r0, rn;
    moe_bulk_part_rows(R, 3, 1, &r0, &rn);
    cr_assert_eq(io_all(c, half, (size_t)rn * H * 4, 1), 0);
    expect_err(c, MOE_EINVAL, "a part that disagrees");
    expect_err(a, MOE_ETIMEDOUT, "a part that never came");
    wait_stat(url, "staged_bytes", 0);

    /* a part's connection closed mid-rows: the other part is answered
     * unavailable, everything given back */
    send_part_hdr(a, 32, 1, R, H, 0, 2);
    cr_assert_eq(io_all(a, half, sizeof(half), 1), 0);
    cr_assert_eq(read_rep(a, &e, msg, sizeof(msg)), MOE_BULK_ACK, "%s", msg);
    send_part_hdr(b, 32, 1, R, H, 1, 2);
    cr_assert_eq(io_all(b, half, sizeof(half) / 2, 1), 0);
    close(b);
    expect_err(a, MOE_EUNAVAIL, "another part cut off");
    wait_stat(url, "staged_bytes", 0);

    /* both parts in, never named by a data.rows: both answered
     * deadline_exceeded at --data-wait-ms, both connections serve on */
    b = bulk_dial(burl);
    send_part_hdr(a, 33, 1, R, H, 0, 2);
    cr_assert_eq(io_all(a, half, sizeof(half), 1), 0);
    send_part_hdr(b, 33, 1, R, H, 1, 2);
    cr_assert_eq(io_all(b, half, sizeof(half), 1), 0);
    cr_assert_eq(read_rep(a, &e, msg, sizeof(msg)), MOE_BULK_ACK, "%s", msg);
    cr_assert_eq(read_rep(b, &e, msg, sizeof(msg)), MOE_BULK_ACK, "%s", msg);
    expect_err(a, MOE_ETIMEDOUT, "split rows never named (part 0)");
    expect_err(b, MOE_ETIMEDOUT, "split rows never named (part 1)");
    wait_stat(url, "bulk_parked", 0);
    wait_stat(url, "staged_bytes", 0);
    close(a), close(b), close(c);
    wait_clean(url);

    /* and a split forward still works */
    float x[R * H], y[R * H];
    rng_fill_uniform(2, 3, -1, 1, x, R * H);
    moe_client *cb = open_path(cl, "bulk");
    cr_assert_eq(moe_forward(cb, "m", 0, MOE_F32, x, R, H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_client_close(cb);
    wait_clean(url);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}
