/*
 * test_fanout.c - the fan-out lane (docs/PROTOCOL.md, "Data plane", 6): a
 * small inference forward on a cluster of several CPU workers goes to every
 * worker at once, each answering its own experts' rows, and libmoe sums
 * them. On real clusters of 2 and 3 CPU workers:
 *  - y and the stats equal the ordered road's (the coordinator path) bit
 *    for bit, for the plain family with drops (capacity factor) in f32 and
 *    bf16, and for a DeepSeek-style family (sigmoid scoring, bias, groups,
 *    a gated shared expert, a routed scale);
 *  - every worker got all the rows (the fan-out ran), up to
 *    $MOE_FANOUT_ROWS; larger batches and MOE_FANOUT_ROWS=0 take the
 *    ordered road;
 *  - the coordinator counts each forward once (rank 0's heartbeat), tokens
 *    once;
 *  - a run.fanout on a stale generation or a one-worker cluster is refused
 *    clearly; a NaN row is refused to its sender; the workers serve on.
 * And, without a cluster, libmoe's assembly refuses parts that do not fit.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/fanout.h"
#include "common/combine.h"
#include "common/rng.h"
#include "proto/proto.h"
#include "tests/cluster.h"

static moe_client *open_path(cluster *cl, const char *path)
{
    moe_client *c;
    moe_client_opts o = {.timeout_ms = 30000, .data_path = path};
    cr_assert_eq(moe_client_open(cl->url, &o, &c), MOE_OK, "open (%s): %s", path, moe_last_error());
    return c;
}

/* fcase: one model.create */
typedef struct fcase {
    const char *name;
    int H, F, E, K;
    moe_dtype dt;
    double capacity; /* 0: dropless */
    int family;      /* 1: sigmoid + bias + groups + gated shared expert + routed scale */
} fcase;

static void create(cluster *cl, const fcase *f)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 10 + (f->family ? 7 : 0));
    mp_write_cstr(&w, "name"), mp_write_cstr(&w, f->name);
    mp_write_cstr(&w, "layers"), mp_write_i64(&w, 1);
    mp_write_cstr(&w, "d_model"), mp_write_i64(&w, f->H);
    mp_write_cstr(&w, "d_ff"), mp_write_i64(&w, f->F);
    mp_write_cstr(&w, "n_experts"), mp_write_i64(&w, f->E);
    mp_write_cstr(&w, "top_k"), mp_write_i64(&w, f->K);
    mp_write_cstr(&w, "renormalize"), mp_write_bool(&w, true);
    mp_write_cstr(&w, "seed"), mp_write_i64(&w, 11);
    mp_write_cstr(&w, "dtype"), mp_write_cstr(&w, moe_dtype_name(f->dt));
    mp_write_cstr(&w, "capacity_factor"), mp_write_f64(&w, f->capacity);
    if (f->family) {
        mp_write_cstr(&w, "scoring"), mp_write_cstr(&w, "sigmoid");
        mp_write_cstr(&w, "score_bias"), mp_write_bool(&w, true);
        mp_write_cstr(&w, "n_group"), mp_write_i64(&w, 4);
        mp_write_cstr(&w, "topk_group"), mp_write_i64(&w, 2);
        mp_write_cstr(&w, "shared_d_ff"), mp_write_i64(&w, 24);
        mp_write_cstr(&w, "shared_gate"), mp_write_bool(&w, true);
        mp_write_cstr(&w, "routed_scaling_factor"), mp_write_f64(&w, 2.5);
    }
    moe_reply rep;
    moe_err e = moe_call(cl->cli, "model.create", w.buf, w.len, &rep);
    mp_writer_fini(&w);
    cr_assert_eq(e, MOE_OK, "model.create %s: %s", f->name, rep.message);
    moe_reply_free(&rep);
}

/* dataplane.info's key (a bool) */
static int info_flag(cluster *cl, const char *key)
{
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "dataplane.info", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    mp_reader r = mp_reply_reader(&rep);
    bool b = false;
    cr_assert(mp_map_find(&r, key) == 0 && mp_read_bool(&r, &b, NULL) == MOE_OK,
              "dataplane.info has no %s", key);
    moe_reply_free(&rep);
    return b;
}

/* raw_call: method {pairs in p (n of them)} on a data endpoint: the error;
 * with key, *out gets that integer of the result */
static moe_err raw_call(const char *url, const char *method, const mp_writer *p, uint32_t n,
                        char *msg, size_t msglen, const char *key, int64_t *out)
{
    nng_socket s;
    cr_assert_eq(nng_req0_open(&s), 0);
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, 30000);
    cr_assert_eq(nng_dial(s, url, NULL, 0), 0);
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_request_head(&w, 1, method);
    mp_write_map(&w, n);
    if (p)
        mp_write_raw(&w, p->buf, p->len);
    cr_assert_eq(nng_send(s, w.buf, w.len, 0), 0);
    mp_writer_fini(&w);
    uint8_t *buf;
    size_t len;
    cr_assert_eq(nng_recv(s, &buf, &len, NNG_FLAG_ALLOC), 0);
    moe_rpc_response resp;
    mp_errbuf eb;
    cr_assert_eq(moe_rpc_parse_response(buf, len, &resp, &eb), MOE_OK);
    snprintf(msg, msglen, "%.*s", (int)resp.errmsg_len, resp.errmsg ? resp.errmsg : "");
    if (key) {
        mp_reader rd = resp.result;
        cr_assert(mp_map_find(&rd, key) == 0 && mp_read_i64(&rd, out, NULL) == MOE_OK, "no %s",
                  key);
    }
    moe_err e = resp.err;
    nng_free(buf, len);
    nng_close(s);
    return e;
}

static int64_t rows_in(const char *url)
{
    char msg[256];
    int64_t v = -1;
    cr_assert_eq(raw_call(url, "ping", NULL, 0, msg, sizeof(msg), "rows_in_total", &v), MOE_OK,
                 "%s", msg);
    return v;
}

/* run_rows sends a raw data.rows of 2 rows (H = 16) of x with run {model
 * "m", layer 0, generation, fanout} to url: the answer's error (text in msg) */
static moe_err run_rows(const char *url, uint64_t seq, const float *x, uint64_t generation,
                        bool fanout, char *msg, size_t msglen)
{
    const int64_t shape[2] = {2, 16};
    mp_writer p;
    mp_writer_init(&p);
    mp_write_cstr(&p, "ticket");
    mp_write_array(&p, 2);
    mp_write_u64(&p, 91);
    mp_write_u64(&p, seq);
    mp_write_cstr(&p, "x");
    moe_tensor_write_head(&p, MOE_F32, 2, shape);
    mp_write_raw(&p, x, sizeof(float) * 32);
    mp_write_cstr(&p, "run");
    mp_write_map(&p, 4);
    mp_write_cstr(&p, "model");
    mp_write_cstr(&p, "m");
    mp_write_cstr(&p, "layer");
    mp_write_i64(&p, 0);
    mp_write_cstr(&p, "generation");
    mp_write_u64(&p, generation);
    mp_write_cstr(&p, "fanout");
    mp_write_bool(&p, fanout);
    moe_err e = raw_call(url, "data.rows", &p, 3, msg, msglen, NULL, NULL);
    mp_writer_fini(&p);
    return e;
}

/* rings: the rings a worker watches (its data endpoint's ping) */
static int64_t rings(const char *url)
{
    char msg[256];
    int64_t v = -1;
    cr_assert_eq(raw_call(url, "ping", NULL, 0, msg, sizeof(msg), "rings", &v), MOE_OK, "%s", msg);
    return v;
}

static int64_t coord_stat(cluster *cl, const char *key)
{
    int64_t v = -1;
    cr_assert_eq(cluster_coord_stat(cl, key, &v), 0, "%s", cluster_error());
    return v;
}

/* fanned: one forward of T rows over path (dtype dt of x and y) against the
 * coordinator path's: y and stats equal; returns whether every worker got
 * all T rows (the forward fanned out) */
static int fanned(cluster *cl, moe_client *cc, moe_client *cs, const fcase *f, int T, moe_dtype dt,
                  uint64_t seed)
{
    const size_t n = (size_t)T * f->H, es = moe_dtype_size(dt);
    float *xf = malloc(n * 4);
    uint8_t *x = malloc(n * es), *y0 = malloc(n * es), *y1 = malloc(n * es);
    rng_fill_uniform(seed, (uint64_t)T, -2, 2, xf, n);
    if (dt == MOE_BF16)
        moe_bf16_from_f32(xf, (uint16_t *)x, n);
    else
        memcpy(x, xf, n * 4);
    char last[256];
    cr_assert_eq(cluster_worker_key(cl, cl->nworkers - 1, "url", last, sizeof(last)), 0, "%s",
                 cluster_error());
    int64_t before = rows_in(last);
    moe_fwd_info i0, i1;
    memset(&i0, 0, sizeof(i0));
    memset(&i1, 0, sizeof(i1));
    memset(y1, 0xff, n * es);
    cr_assert_eq(moe_forward(cc, f->name, 0, dt, x, T, f->H, y0, &i0), MOE_OK, "%s",
                 moe_last_error());
    int64_t mid = rows_in(last);
    cr_assert_eq(moe_forward(cs, f->name, 0, dt, x, T, f->H, y1, &i1), MOE_OK, "%s T=%d: %s",
                 f->name, T, moe_last_error());
    int64_t after = rows_in(last);
    cr_assert(mid - before < T || cl->nworkers == 1, "the coordinator path fanned out");
    cr_assert(memcmp(y0, y1, n * es) == 0, "%s T=%d (%s): y differs from the ordered road", f->name,
              T, moe_dtype_name(dt));
    cr_assert_eq(i1.n_experts, f->E);
    for (int e = 0; e < f->E; e++) {
        cr_assert_eq(i1.tokens_per_expert[e], i0.tokens_per_expert[e], "%s: expert %d routed",
                     f->name, e);
        cr_assert_eq(i1.dropped[e], i0.dropped[e], "%s: expert %d dropped", f->name, e);
    }
    cr_assert_float_eq(i1.aux_loss, i0.aux_loss, 1e-9);
    cr_assert_float_eq(i1.imbalance, i0.imbalance, 1e-12);
    int64_t dropped = 0;
    for (int e = 0; e < f->E; e++)
        dropped += i1.dropped[e];
    if (f->capacity > 0 && T >= 8)
        cr_assert_gt(dropped, 0, "%s T=%d: the capacity factor dropped nothing", f->name, T);
    moe_fwd_info_free(&i0);
    moe_fwd_info_free(&i1);
    free(xf), free(x), free(y0), free(y1);
    return after - mid == T;
}

static void identical(int W)
{
    cluster_opts o = {.workers = W};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const fcase cases[3] = {
        {"plain", 32, 24, 6, 2, MOE_F32, 1.0, 0},
        {"half", 32, 24, 6, 3, MOE_BF16, 1.0, 0},
        {"dsv3", 32, 16, 8, 3, MOE_F32, 0, 1},
    };
    for (int i = 0; i < 3; i++)
        create(cl, &cases[i]);
    cr_assert(info_flag(cl, "fanout"), "%d CPU workers: fan-out open", W);
    cr_assert(!info_flag(cl, "lane"), "%d workers: no one-worker lane", W);
    moe_client *cc = open_path(cl, "coordinator"), *cs = open_path(cl, "socket");
    const int Ts[4] = {1, 5, 16, 17};
    for (int i = 0; i < 3; i++)
        for (int t = 0; t < 4; t++) {
            int f = fanned(cl, cc, cs, &cases[i], Ts[t], MOE_F32, 100 + (uint64_t)i);
            cr_assert_eq(f, Ts[t] <= 16, "%s T=%d: fanned out %d", cases[i].name, Ts[t], f);
        }
    /* bf16 rows in and out */
    cr_assert(fanned(cl, cc, cs, &cases[1], 7, MOE_BF16, 200));
    /* on this host through shared-memory rings (after a model's first
     * answer told libmoe how large its answers can be) */
    moe_client *cm = open_path(cl, "shm");
    for (int i = 0; i < 3; i++)
        for (int t = 0; t < 3; t++)
            cr_assert(fanned(cl, cc, cm, &cases[i], Ts[t], MOE_F32, 400 + (uint64_t)i));
    for (int q = 0; q < W; q++) {
        char url[256];
        cr_assert_eq(cluster_worker_key(cl, q, "url", url, sizeof(url)), 0, "%s", cluster_error());
        cr_assert_geq(rings(url), 1, "rank %d: no ring (the fan-out did not take them)", q);
    }
    moe_client_close(cm);
    /* MOE_FANOUT_ROWS=0: the ordered road for every size */
    setenv("MOE_FANOUT_ROWS", "0", 1);
    moe_client *c0 = open_path(cl, "socket");
    cr_assert(!fanned(cl, cc, c0, &cases[0], 3, MOE_F32, 300), "MOE_FANOUT_ROWS=0 fanned out");
    unsetenv("MOE_FANOUT_ROWS");
    moe_client_close(c0);
    moe_client_close(cc);
    moe_client_close(cs);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* a fan-out whose largest answer needs more than a 2 MiB ring's answer
 * area (16 rows x top-8 x d_model 4096: 1 MiB of expert rows in bf16, 2 in
 * f32, and the shared rows) goes through a ring made for its size: such
 * answers once took the socket (on 2 GPU workers a 32-row Qwen3 fan-out
 * 1.09 ms against 0.40 for 17 rows through a ring) */
Test(fanout, large_answers_through_a_ring_of_their_size, .timeout = 180, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const fcase big = {"big", 4096, 16, 16, 8, MOE_F32, 1.0, 0};
    create(cl, &big);
    moe_client *cc = open_path(cl, "coordinator"), *cm = open_path(cl, "shm");
    for (int q = 0; q < 2; q++) {
        char url[256];
        cr_assert_eq(cluster_worker_key(cl, q, "url", url, sizeof(url)), 0, "%s", cluster_error());
        cr_assert_eq(rings(url), 0, "rank %d: a ring before any fan-out", q);
    }
    /* the first answer tells libmoe how large the model's answers can be;
     * the next ones take a ring of that size */
    for (int i = 0; i < 3; i++)
        cr_assert(fanned(cl, cc, cm, &big, 16, MOE_F32, 500 + (uint64_t)i), "T=16 fanned out");
    for (int q = 0; q < 2; q++) {
        char url[256];
        cr_assert_eq(cluster_worker_key(cl, q, "url", url, sizeof(url)), 0, "%s", cluster_error());
        cr_assert_geq(rings(url), 1, "rank %d: no ring for answers of more than 1 MiB", q);
    }
    moe_client_close(cm);
    moe_client_close(cc);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

Test(fanout, identical_to_the_ordered_road_w2, .timeout = 180, .fini = cluster_fini_all)
{
    identical(2);
}

Test(fanout, identical_to_the_ordered_road_w3, .timeout = 180, .fini = cluster_fini_all)
{
    identical(3);
}

/* fan-out forwards reach every worker and are counted once by the
 * coordinator, from rank 0's heartbeat; stale or misplaced fan-outs are
 * refused clearly */
Test(fanout, counted_once_and_refused_clearly, .timeout = 180, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2, .metrics = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const fcase f = {"m", 16, 16, 4, 2, MOE_F32, 0, 0};
    create(cl, &f);
    moe_client *cs = open_path(cl, "socket");
    float x[9 * 16], y[9 * 16];
    rng_fill_uniform(5, 1, -1, 1, x, 9 * 16);
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 1, 16, y, NULL), MOE_OK, "%s",
                 moe_last_error()); /* the map loaded: the counts below are the forwards' */
    char url[256], msg[256];
    cr_assert_eq(cluster_worker_key(cl, 1, "url", url, sizeof(url)), 0, "%s", cluster_error());
    int64_t r0 = rows_in(url);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 9, 16, y, NULL), MOE_OK, "%s",
                     moe_last_error());
    cr_assert_eq(rows_in(url) - r0, 45, "rank 1 got %lld rows: not fanned out",
                 (long long)(rows_in(url) - r0));
    /* a fresh cluster: the warm-up forward of one row and these 5 of 9 */
    const int64_t want_f = 6, want_t = 1 + 45;
    int64_t fw = 0, tk = 0;
    for (int i = 0; i < 3000 && (fw < want_f || tk < want_t); i++) {
        fw = coord_stat(cl, "forward_total");
        tk = coord_stat(cl, "tokens_total");
        if (fw < want_f || tk < want_t)
            usleep(10000);
    }
    usleep(1200 * 1000); /* two more heartbeats (500 ms): nothing counted twice */
    fw = coord_stat(cl, "forward_total");
    tk = coord_stat(cl, "tokens_total");
    cr_assert_eq(fw, want_f, "forward_total %lld, want %lld", (long long)fw, (long long)want_f);
    cr_assert_eq(tk, want_t, "tokens_total %lld, want %lld", (long long)tk, (long long)want_t);
    /* and /metrics: each forward in the latency and phase histograms once
     * (the text is rendered every 100 ms) */
    static char body[1 << 20];
    static const char *hist[3] = {"moe_forward_latency_seconds_count",
                                  "moe_gate_latency_seconds_count",
                                  "moe_experts_latency_seconds_count"};
    for (int64_t t0 = cluster_now_ms(); cluster_now_ms() - t0 < 5000; usleep(50000)) {
        cr_assert_eq(cluster_http_get(cl->metrics_port, "/metrics", NULL, 0, body, sizeof(body)),
                     200);
        if (cluster_metric_value(body, "moe_forward_total") == (double)want_f)
            break;
    }
    for (int i = 0; i < 3; i++)
        cr_assert_eq(cluster_metric_value(body, hist[i]), (double)want_f, "%s = %g", hist[i],
                     cluster_metric_value(body, hist[i]));

    /* a NaN row: refused to its sender, the workers serve on */
    x[20] = NAN;
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 9, 16, y, NULL), MOE_EINVAL);
    x[20] = 0.25f;
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 9, 16, y, NULL), MOE_OK, "%s",
                 moe_last_error());

    /* a stale generation: unavailable, ask dataplane.info again; and the
     * one-worker lane (no fanout), closed with two */
    for (int k = 0; k < 2; k++) {
        moe_err e = run_rows(url, (uint64_t)k + 1, x, k ? 1 : 999, !k, msg, sizeof(msg));
        cr_assert_eq(e, MOE_EUNAVAIL, "run %d: %s (%s)", k, moe_err_code(e), msg);
        cr_assert(strstr(msg, "dataplane.info"), "run %d: %s", k, msg);
    }
    moe_client_close(cs);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());

    /* one worker: no fan-out (its lane serves), and a run.fanout is refused */
    cluster_opts o1 = {.workers = 1};
    cl = cluster_start(&o1);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    create(cl, &f);
    cr_assert(!info_flag(cl, "fanout"), "one worker: fan-out closed");
    cr_assert_eq(cluster_worker_key(cl, 0, "url", url, sizeof(url)), 0, "%s", cluster_error());
    moe_err e = run_rows(url, 3, x, 1, true, msg, sizeof(msg));
    cr_assert_eq(e, MOE_EUNAVAIL, "fan-out on one worker: %s (%s)", moe_err_code(e), msg);
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, 2, 16, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ---- libmoe's assembly, without a cluster ---- */

/* two parts of T=2 tokens, K=2, H=3: rank 0 slots {0, 3}, rank 1 {1, 2} */
static float g_rows0[2 * 3] = {1, 2, 3, 4, 5, 6}, g_rows1[2 * 3] = {-1, 0.5f, 2, 8, -3, 1};
static float g_w[4] = {0.75f, 0.25f, 0.5f, 0.5f};
static int32_t g_s0[2] = {0, 3}, g_s1[2] = {1, 2};

static void parts_init(moe_fanout_part *p)
{
    memset(p, 0, 2 * sizeof(*p));
    for (int q = 0; q < 2; q++) {
        p[q].rank = q;
        p[q].top_k = 2;
        p[q].dtype = MOE_F32;
        p[q].slots = (const uint8_t *)(q ? g_s1 : g_s0);
        p[q].nslots = 2;
        p[q].rows = (const uint8_t *)(q ? g_rows1 : g_rows0);
        p[q].rows_len = sizeof(g_rows0);
        p[q].topk_w = (const uint8_t *)g_w;
        p[q].ntopk = 4;
    }
}

Test(fanout_unit, assembly_sums_in_order_and_refuses_misfits)
{
    moe_fanout_part p[2];
    float y[6], want[6], ye[4 * 3];
    char msg[256];
    parts_init(p);
    /* ye by slot: 0 <- rows0[0], 1 <- rows1[0], 2 <- rows1[1], 3 <- rows0[1] */
    memcpy(ye + 0, g_rows0, 12), memcpy(ye + 3, g_rows1, 12);
    memcpy(ye + 6, g_rows1 + 3, 12), memcpy(ye + 9, g_rows0 + 3, 12);
    moe_combine_rows(ye, g_w, NULL, 2, 2, 3, 0, want);
    cr_assert_eq(moe_fanout_combine(p, 2, 2, 3, MOE_F32, y, msg, sizeof(msg)), MOE_OK, "%s", msg);
    cr_assert(memcmp(y, want, sizeof(y)) == 0, "y is not the ordered sum");

    int32_t twice[2] = {0, 0}, out_of_range[2] = {1, 4};
    const int32_t *bad_slots[2] = {twice, out_of_range};
    for (int k = 0; k < 2; k++) {
        parts_init(p);
        p[1].slots = (const uint8_t *)bad_slots[k];
        cr_assert_eq(moe_fanout_combine(p, 2, 2, 3, MOE_F32, y, msg, sizeof(msg)), MOE_EPROTO);
        cr_log_info("bad slots: %s", msg);
    }
    parts_init(p);
    p[1].nslots = 1, p[1].rows_len = 12; /* slot 2 missing */
    cr_assert_eq(moe_fanout_combine(p, 2, 2, 3, MOE_F32, y, msg, sizeof(msg)), MOE_EPROTO);
    cr_assert(strstr(msg, "3 of 4"), "%s", msg);
    float other_w[4] = {0.75f, 0.25f, 0.5f, 0.4f};
    parts_init(p);
    p[1].topk_w = (const uint8_t *)other_w;
    cr_assert_eq(moe_fanout_combine(p, 2, 2, 3, MOE_F32, y, msg, sizeof(msg)), MOE_EPROTO);
    cr_assert(strstr(msg, "routed"), "%s", msg);
    parts_init(p);
    p[0].rows_len = 11;
    cr_assert_eq(moe_fanout_combine(p, 2, 2, 3, MOE_F32, y, msg, sizeof(msg)), MOE_EPROTO);
    parts_init(p);
    p[1].top_k = 3;
    cr_assert_eq(moe_fanout_combine(p, 2, 2, 3, MOE_F32, y, msg, sizeof(msg)), MOE_EPROTO);
}

/* the sum's vector paths against the reference arithmetic
 * (moe_combine_rows, moe_rows_add), bit for bit: T=3 tokens, top-8, 2 parts
 * taking alternate slots, H past a whole number of vectors (the last
 * columns take the scalar path), shared rows from both parts, rows with
 * infinities, NaNs, subnormals and values whose weighted terms overflow;
 * bf16 rows and f32 rows, bf16 and f32 output; then a NaN weight (the
 * reference path throughout for bf16 rows). NaNs compare as NaNs (their
 * payloads are the compiler's to choose). */
static int same_value(float a, float b)
{
    return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof(a)) == 0;
}

enum { SUM_T = 3, SUM_K = 8, SUM_S = SUM_T * SUM_K, SUM_H = 2048 + 17 };

/* sum_case: parts of rows (S,H) of dtype rdt (rows by slot, ye f32 the
 * same values), shared rows sh (T,H) of rdt (shf f32), weights w: y in
 * both output dtypes against the reference; returns the NaN outputs */
static int sum_case(moe_dtype rdt, const void *rows, const float *ye, const void *sh,
                    const float *shf, const float *w, int pass)
{
    enum { T = SUM_T, K = SUM_K, S = SUM_S, H = SUM_H };
    const size_t es = moe_dtype_size(rdt), n = (size_t)T * H;
    const int bf = rdt == MOE_BF16;
    uint8_t *part[2];
    int32_t slots[2][S / 2];
    float *want = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    uint16_t *yb = malloc(n * 2);
    char msg[256];
    cr_assert(want && y && yb);
    for (int q = 0; q < 2; q++) {
        part[q] = malloc((size_t)(S / 2) * H * es);
        cr_assert(part[q]);
    }
    for (int s = 0; s < S; s++) { /* rank q takes slots q, q+2, ... */
        slots[s % 2][s / 2] = s;
        memcpy(part[s % 2] + (size_t)(s / 2) * H * es, (const uint8_t *)rows + (size_t)s * H * es,
               (size_t)H * es);
    }
    moe_combine_rows(ye, w, NULL, T, K, H, bf, want);
    moe_rows_add(want, shf, n, bf);
    moe_fanout_part p[2];
    memset(p, 0, sizeof(p));
    for (int q = 0; q < 2; q++) {
        p[q].rank = q;
        p[q].top_k = K;
        p[q].dtype = rdt;
        p[q].slots = (const uint8_t *)slots[q];
        p[q].nslots = S / 2;
        p[q].rows = part[q];
        p[q].rows_len = (size_t)(S / 2) * H * es;
        p[q].topk_w = (const uint8_t *)w;
        p[q].ntopk = S;
    }
    p[0].shared = sh; /* token 0 from rank 0, 1-2 from rank 1 */
    p[0].shared_len = (size_t)H * es;
    p[1].shared = (const uint8_t *)sh + (size_t)H * es;
    p[1].shared_len = (size_t)2 * H * es;
    p[1].shared_row0 = 1;
    cr_assert_eq(moe_fanout_combine(p, 2, T, H, MOE_F32, y, msg, sizeof(msg)), MOE_OK, "%s", msg);
    cr_assert_eq(moe_fanout_combine(p, 2, T, H, MOE_BF16, yb, msg, sizeof(msg)), MOE_OK, "%s", msg);
    int nan = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t wb;
        float wf;
        moe_bf16_from_f32(&want[i], &wb, 1);
        moe_f32_from_bf16(&yb[i], &wf, 1);
        nan += isnan(want[i]);
        cr_assert(same_value(y[i], want[i]), "%s rows, pass %d: f32 y[%zu] %a, reference %a",
                  moe_dtype_name(rdt), pass, i, y[i], want[i]);
        cr_assert(isnan(wf) ? isnan(want[i]) : yb[i] == wb,
                  "%s rows, pass %d: bf16 y[%zu] %04x, reference %04x", moe_dtype_name(rdt), pass,
                  i, yb[i], wb);
    }
    for (int q = 0; q < 2; q++)
        free(part[q]);
    free(want), free(y), free(yb);
    return nan;
}

Test(fanout_unit, sum_matches_the_reference_bit_for_bit)
{
    enum { T = SUM_T, S = SUM_S, H = SUM_H };
    float *ref = malloc((size_t)S * H * sizeof(float)); /* (S,H) ye by slot */
    float *ref32 = malloc((size_t)S * H * sizeof(float));
    float *shf = malloc((size_t)T * H * sizeof(float)); /* (T,H) shared rows */
    float *shf32 = malloc((size_t)T * H * sizeof(float));
    uint16_t *allb = malloc((size_t)S * H * 2), *shb = malloc((size_t)T * H * 2); /* bf16 */
    float w[S];
    cr_assert(ref && ref32 && shf && shf32 && allb && shb);
    rng_fill_uniform(7, 1, -4.0f, 4.0f, ref32, (size_t)S * H);
    rng_fill_uniform(7, 2, -2.0f, 2.0f, shf32, (size_t)T * H);
    rng_fill_uniform(7, 3, 0.0f, 2.5f, w, S);
    w[3] = 0.0f;
    const float special[] = {INFINITY, -INFINITY, NAN, -NAN, 1e-39f, -3e-40f, 3.0e38f, -3.3e38f};
    for (int k = 0; k < 64; k++) /* special values at scattered places, vector and tail */
        ref32[(size_t)(k * 7919) % ((size_t)S * H)] = special[k % 8];
    ref32[(size_t)3 * H + 5] = INFINITY; /* times the zero weight: NaN */
    /* bf16 values: the f32 rows rounded */
    moe_bf16_from_f32(ref32, allb, (size_t)S * H);
    moe_f32_from_bf16(allb, ref, (size_t)S * H);
    moe_bf16_from_f32(shf32, shb, (size_t)T * H);
    moe_f32_from_bf16(shb, shf, (size_t)T * H);
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            w[5] = NAN;
        int nan = sum_case(MOE_BF16, allb, ref, shb, shf, w, pass);
        cr_assert(nan > 0 && nan < T * H / 2, "bf16 rows, pass %d: %d NaN outputs", pass, nan);
        nan = sum_case(MOE_F32, ref32, ref32, shf32, shf32, w, pass);
        cr_assert(nan > 0 && nan < T * H / 2, "f32 rows, pass %d: %d NaN outputs", pass, nan);
    }
    free(ref), free(ref32), free(shf), free(shf32), free(allb), free(shb);
}

/* the answer's stats: rank 0's map with "dropped" summed over the parts,
 * whether the counts are one byte each (the fast read: rank 1) or not
 * (rank 0: 200), and the sums written small (one byte) or not */
static void stats_map(mp_writer *w, const int64_t *dropped, int E)
{
    mp_write_map(w, 3);
    mp_write_cstr(w, "tokens_per_expert");
    mp_write_array(w, (uint32_t)E);
    for (int e = 0; e < E; e++)
        mp_write_i64(w, 3 * e);
    mp_write_cstr(w, "dropped");
    mp_write_array(w, (uint32_t)E);
    for (int e = 0; e < E; e++)
        mp_write_i64(w, dropped[e]);
    mp_write_cstr(w, "imbalance");
    mp_write_f64(w, 0.5);
}

Test(fanout_unit, stats_sum_dropped_small_or_not)
{
    enum { E = 4 };
    const int64_t d0[E] = {1, 200, 0, 127}, d1[E] = {0, 5, 100, 1}, want[E] = {1, 205, 100, 128};
    mp_writer a, b, out;
    mp_writer_init(&a);
    mp_writer_init(&b);
    mp_writer_init(&out);
    stats_map(&a, d0, E);
    stats_map(&b, d1, E);
    moe_fanout_part p[2];
    memset(p, 0, sizeof(p));
    p[0].rank = 1, p[0].stats = b.buf, p[0].stats_len = b.len; /* rank 0 second: found by rank */
    p[1].rank = 0, p[1].stats = a.buf, p[1].stats_len = a.len;
    cr_assert_eq(moe_fanout_stats(p, 2, &out), 0);
    mp_reader r;
    uint32_t n, m;
    mp_reader_init(&r, out.buf, out.len);
    cr_assert_eq(mp_read_map(&r, &n, NULL), MOE_OK);
    cr_assert_eq(n, 3);
    int seen = 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        cr_assert_eq(mp_read_str(&r, &k, &kl, NULL), MOE_OK);
        if (mp_str_eq(k, kl, "dropped")) {
            cr_assert_eq(mp_read_array(&r, &m, NULL), MOE_OK);
            cr_assert_eq(m, E);
            for (int e = 0; e < E; e++) {
                int64_t v;
                cr_assert_eq(mp_read_i64(&r, &v, NULL), MOE_OK);
                cr_assert_eq(v, want[e], "dropped[%d] = %lld, want %lld", e, (long long)v,
                             (long long)want[e]);
            }
            seen |= 1;
        } else if (mp_str_eq(k, kl, "tokens_per_expert")) { /* rank 0's, as it was */
            cr_assert_eq(mp_read_array(&r, &m, NULL), MOE_OK);
            for (uint32_t e = 0; e < m; e++) {
                int64_t v;
                cr_assert_eq(mp_read_i64(&r, &v, NULL), MOE_OK);
                cr_assert_eq(v, 3 * (int64_t)e);
            }
            seen |= 2;
        } else {
            double f;
            cr_assert_eq(mp_read_f64(&r, &f, NULL), MOE_OK);
            cr_assert_eq(f, 0.5);
            seen |= 4;
        }
    }
    cr_assert_eq(seen, 7);
    /* a part whose dropped counts differ in length: refused */
    mp_writer c;
    mp_writer_init(&c);
    stats_map(&c, d1, E - 1);
    p[0].stats = c.buf, p[0].stats_len = c.len;
    mp_writer o2;
    mp_writer_init(&o2);
    cr_assert_eq(moe_fanout_stats(p, 2, &o2), -1);
    mp_writer_fini(&o2);
    mp_writer_fini(&c);
    mp_writer_fini(&a);
    mp_writer_fini(&b);
    mp_writer_fini(&out);
}

/* a worker killed under a stream of fan-out forwards (through rings and
 * over sockets): every call in flight or sent after is answered promptly
 * (ok, or unavailable - never held until the call's timeout); after the
 * restart the cluster re-forms and forwards fan out again */
typedef struct fo_stream {
    cluster *cl;
    const char *path;
    int stop, calls, ok, unavail, other;
    int64_t slowest_ms;
    int64_t call_since; /* cluster_now_ms of the call in progress, 0 between calls */
    char last_other[256];
    char last_err[256]; /* the last error answer of any kind */
} fo_stream;

static void *fo_stream_main(void *arg)
{
    fo_stream *s = arg;
    moe_client *c;
    moe_client_opts o = {.timeout_ms = 60000, .data_path = s->path};
    if (moe_client_open(s->cl->url, &o, &c) != MOE_OK)
        return NULL;
    float x[4 * 16], y[4 * 16];
    rng_fill_uniform(9, 9, -1, 1, x, 4 * 16);
    while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
        int64_t t0 = cluster_now_ms();
        __atomic_store_n(&s->call_since, t0, __ATOMIC_RELEASE);
        moe_err e = moe_forward(c, "m", 0, MOE_F32, x, 4, 16, y, NULL);
        int64_t ms = cluster_now_ms() - t0;
        __atomic_store_n(&s->call_since, 0, __ATOMIC_RELEASE);
        if (e != MOE_OK)
            snprintf(s->last_err, sizeof(s->last_err), "%s after %lld ms: %s", moe_err_code(e),
                     (long long)ms, moe_last_error());
        if (ms > s->slowest_ms)
            s->slowest_ms = ms;
        s->calls++;
        if (e == MOE_OK)
            s->ok++;
        else if (e == MOE_EUNAVAIL)
            s->unavail++;
        else {
            s->other++;
            snprintf(s->last_other, sizeof(s->last_other), "%s: %s", moe_err_code(e),
                     moe_last_error());
        }
        if (e != MOE_OK)
            usleep(2000);
    }
    moe_client_close(c);
    return NULL;
}

/* the streams' state, for a failed wait: each stream's counts, its last
 * error and how long its call in progress has waited */
static void fo_say(const fo_stream *st, char *buf, size_t len)
{
    size_t n = 0;
    for (int i = 0; i < 2 && n < len; i++) {
        const int64_t since = __atomic_load_n(&st[i].call_since, __ATOMIC_ACQUIRE);
        n += (size_t)snprintf(buf + n, len - n,
                              "%s%s: %d calls, %d ok, %d unavailable, a call in progress for "
                              "%lld ms, last error: %s",
                              i ? "; " : "", st[i].path, st[i].calls, st[i].ok, st[i].unavail,
                              since ? (long long)(cluster_now_ms() - since) : 0LL,
                              st[i].last_err[0] ? st[i].last_err : "none");
    }
}

/* waits until both streams have made `more` more calls (ok only: ok_only)
 * than base; 0, or -1 after limit_ms with what each stream is doing in
 * why */
static int fo_wait(fo_stream *st, const int base[2], int more, int ok_only, int64_t limit_ms,
                   char *why, size_t len)
{
    for (int64_t t0 = cluster_now_ms();; usleep(5000)) {
        int done = 1;
        for (int i = 0; i < 2; i++)
            done &= (ok_only ? st[i].ok : st[i].calls) >= base[i] + more;
        if (done)
            return 0;
        if (cluster_now_ms() - t0 > limit_ms) {
            fo_say(st, why, len);
            return -1;
        }
    }
}

/* stops the streams (a call in progress ends by its answer or its
 * timeout) */
static void fo_stop(fo_stream *st, pthread_t *th)
{
    for (int i = 0; i < 2; i++)
        __atomic_store_n(&st[i].stop, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
}

Test(fanout, worker_killed_mid_stream_answers_promptly, .timeout = 240, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const fcase f = {"m", 16, 16, 4, 2, MOE_F32, 0, 0};
    create(cl, &f);
    fo_stream st[2] = {{.cl = cl, .path = "shm"}, {.cl = cl, .path = "socket"}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, fo_stream_main, &st[i]), 0);
    /* calls are flowing, then the kill; a failed wait stops the streams
     * first (they use the cluster) and says what each was doing */
    char why[1024];
    const int zero[2] = {0, 0};
    int bad = fo_wait(st, zero, 20, 1, 60000, why, sizeof(why));
    if (bad)
        fo_stop(st, th);
    cr_assert(!bad, "the streams did not start: %s", why);
    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cluster_error());
    const int base[2] = {st[0].calls, st[1].calls};
    bad = fo_wait(st, base, 5, 0, 60000, why, sizeof(why));
    if (bad)
        fo_stop(st, th);
    cr_assert(!bad, "calls stopped after the kill: %s", why);
    cr_assert_eq(cluster_worker_start(cl, 1), 0, "%s", cluster_error());
    cr_assert_eq(cluster_wait_ready(cl, 60000), 0, "%s", cluster_error());
    const int oks[2] = {st[0].ok, st[1].ok};
    bad = fo_wait(st, oks, 20, 1, 60000, why, sizeof(why));
    fo_stop(st, th);
    cr_assert(!bad, "no forward served after the restart: %s", why);
    for (int i = 0; i < 2; i++) {
        cr_log_info("%s: %d calls, %d ok, %d unavailable, slowest %lld ms", st[i].path, st[i].calls,
                    st[i].ok, st[i].unavail, (long long)st[i].slowest_ms);
        cr_assert_eq(st[i].other, 0, "%s: an answer other than ok or unavailable: %s", st[i].path,
                     st[i].last_other);
        /* a call held until its timeout (60 s) would show here */
        cr_assert_lt(st[i].slowest_ms, 30000, "%s: a call waited %lld ms", st[i].path,
                     (long long)st[i].slowest_ms);
    }
    /* fanned out again: rank 1 gets all the rows */
    char url[256];
    cr_assert_eq(cluster_worker_key(cl, 1, "url", url, sizeof(url)), 0, "%s", cluster_error());
    moe_client *cs = open_path(cl, "socket");
    float x[4 * 16], y[4 * 16];
    rng_fill_uniform(9, 10, -1, 1, x, 4 * 16);
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 4, 16, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    int64_t r0 = rows_in(url);
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, 4, 16, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(rows_in(url) - r0, 4, "not fanned out after the restart");
    moe_client_close(cs);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* A worker that cannot attach the client's first shared-memory buffer (here
 * each worker answers its first data.shm_attach unavailable, as one just
 * killed does while the coordinator still lists it): the forward is
 * answered unavailable, the client asks for the map again, and the next
 * tries are served over shm. Before, the map turned shared memory off for
 * good and every later forward over the path asked for by name was refused
 * resource_exhausted (a stream through a worker's restart, under load,
 * got no forward in 60 s). */
Test(fanout, shm_buffer_a_worker_missed_is_unavailable_then_served, .timeout = 240,
     .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2, .worker_args = {"--fail-shm-attach-for-tests", "1", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const fcase f = {"m", 16, 16, 4, 2, MOE_F32, 0, 0};
    create(cl, &f);
    moe_client *c = open_path(cl, "shm");
    enum { T = 64 }; /* over DP_FANOUT_ROWS: the ordered road, through a shm buffer */
    static float x[T * 16], y[T * 16], y0[T * 16];
    rng_fill_uniform(9, 11, -1, 1, x, T * 16);
    moe_err e = MOE_EUNAVAIL;
    int tries = 0, unavail = 0;
    for (; tries < 10 && e != MOE_OK; tries++) {
        e = moe_forward(c, "m", 0, MOE_F32, x, T, 16, y, NULL);
        cr_assert(e == MOE_OK || e == MOE_EUNAVAIL, "try %d: %s: %s", tries + 1, moe_err_code(e),
                  moe_last_error());
        unavail += e == MOE_EUNAVAIL;
    }
    cr_assert_eq(e, MOE_OK, "no forward over shm in %d tries: %s", tries, moe_last_error());
    cr_assert_geq(unavail, 1, "the refused attach was not seen");
    /* the same y as the socket path gives */
    moe_client *cs = open_path(cl, "socket");
    cr_assert_eq(moe_forward(cs, "m", 0, MOE_F32, x, T, 16, y0, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert(memcmp(y, y0, sizeof(y)) == 0, "y over shm differs from y over the socket");
    moe_client_close(cs);
    moe_client_close(c);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* Right after a re-formation the cluster is ready before every worker holds
 * its models again (the coordinator re-creates them as jobs in order). A
 * fan-out forward runs outside that order: a worker that does not hold the
 * model yet answers not_found, and libmoe then takes the coordinator's road,
 * which queues the forward behind the re-creation. Each worker here takes
 * 1.5 s to create a model, so a forward of the second model sent as soon as
 * the cluster is ready reaches the workers before that model's re-creation. */
Test(fanout, forward_right_after_a_reformation_waits_for_the_model, .timeout = 240,
     .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2, .worker_args = {"--slow-create-ms-for-tests", "1500", NULL}};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    const fcase fa = {"fo_first", 64, 32, 4, 2, MOE_F32, 0, 0};
    const fcase fb = {"fo_second", 64, 32, 4, 2, MOE_F32, 0, 0};
    create(cl, &fa);
    create(cl, &fb);
    moe_client *cs = open_path(cl, "auto");
    enum { T = 4 };
    float x[T * 64], y0[T * 64], y1[T * 64];
    rng_fill_uniform(5, T, -2, 2, x, T * 64);
    cr_assert_eq(moe_forward(cs, fb.name, 0, MOE_F32, x, T, 64, y0, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(cluster_worker_kill(cl, 1, SIGKILL), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_start(cl, 1), 0, "%s", cluster_error());
    cr_assert_eq(cluster_wait_ready(cl, 60000), 0, "%s", cluster_error());
    /* the map of the old generation is stale: the first call may be answered
     * unavailable while it is asked again; never not_found */
    moe_err e = MOE_EUNAVAIL;
    for (int i = 0; i < 50 && e == MOE_EUNAVAIL; i++) {
        memset(y1, 0xff, sizeof(y1));
        e = moe_forward(cs, fb.name, 0, MOE_F32, x, T, 64, y1, NULL);
        if (e == MOE_EUNAVAIL)
            usleep(20000);
    }
    cr_assert_eq(e, MOE_OK, "a forward after the re-formation: %s: %s", moe_err_code(e),
                 moe_last_error());
    cr_assert(memcmp(y0, y1, sizeof(y0)) == 0, "y differs after the model's re-creation");
    moe_client_close(cs);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}
