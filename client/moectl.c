/*
 * moectl - the command-line client.
 *
 *   moectl [--url URL] [--token TOKEN] [--timeout-ms N] [--tls-ca PEM] COMMAND [options]
 *
 * Commands: ping, status, info, create, delete, forward, stats, bench, drain.
 * Replies of status/info/stats print as JSON; forward prints the load table.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/bench_stats.h"
#include "base/moe.h"
#include "proto/proto.h"
#include "common/rng.h"

typedef struct opts {
    const char *url, *token, *name, *model, *activation, *input, *output, *dtype, *path;
    const char *from_hf;   /* create --from-hf DIR */
    const char *data_path; /* --data-path: auto | socket | shm | bulk | nccl | coordinator */
    const char *tls_ca, *tls_cert, *tls_key; /* --tls-ca/--tls-cert/--tls-key: PEM paths */
    int timeout_ms, layers, d_model, d_ff, experts, top_k, renorm, layer, requests, conc;
    long long tokens, seed;
    double cf, aux, z;
    int ping_only, train, quiet;
} opts;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: moectl [--url tcp://127.0.0.1:7000] [--token T] [--timeout-ms N]\n"
            "              [--data-path auto|socket|shm|bulk|nccl|coordinator]\n"
            "              [--tls-ca PEM [--tls-cert PEM --tls-key PEM]] COMMAND\n"
            "  (a tls+tcp:// url needs --tls-ca: the CA of the server's certificate)\n"
            "  ping                                  round trip to the coordinator\n"
            "  status                                cluster.status (workers, generation)\n"
            "  info --model NAME                     model.info\n"
            "  create --name NAME --layers L --d-model H --d-ff F --experts E --top-k K\n"
            "         [--activation swiglu|gelu] [--renormalize] [--capacity-factor C]\n"
            "         [--dtype f32|bf16] [--seed S] [--aux-loss-coef A] [--z-loss-coef Z]\n"
            "  delete --model NAME                   model.delete\n"
            "  create --name NAME --from-hf DIR [--dtype f32|bf16]\n"
            "                                        a Hugging Face model directory (on the\n"
            "                                        coordinator, under its checkpoint root)\n"
            "  forward --model NAME [--layer L] [--tokens T | --input FILE] [--dtype f32|bf16]\n"
            "          [--output FILE] [--seed S]    FILE: raw row-major (T, d_model)\n"
            "  stats                                 cumulative stats\n"
            "  bench --model NAME [--layer L] --tokens T [--requests N] [--concurrency C]\n"
            "        [--dtype f32|bf16] | bench --ping [--requests N] [--concurrency C]\n"
            "  bench --train --model NAME [--layer L] --tokens T [--requests STEPS]\n"
            "                                        forward(train)+backward+optimizer.step\n"
            "        bench counts each request's outcome per error code (ok 98, failed 2\n"
            "        (deadline_exceeded 2)); tokens/s, req/s and the nearest-rank p50/p99\n"
            "        (with their sample count n; below 100 samples p99 is the max) count the ok\n"
            "        requests only; a warm-up request first is not counted. --timeout-ms\n"
            "        bounds each request. Exit status 1 if any request failed.\n"
            "  save --model NAME --path DIR          checkpoint.save (DIR/LATEST, safetensors)\n"
            "  load --model NAME --path DIR          checkpoint.load (the newest under DIR)\n"
            "  drain                                 stop the coordinator gracefully\n");
}

/* ---- msgpack to JSON, for printing replies ---- */
static int print_json(mp_reader *r, int indent)
{
    mp_type t = mp_peek(r);
    uint32_t n;
    switch (t) {
    case MP_NIL:
        mp_read_nil(r, NULL);
        printf("null");
        return 0;
    case MP_BOOL: {
        bool b;
        mp_read_bool(r, &b, NULL);
        printf(b ? "true" : "false");
        return 0;
    }
    case MP_INT:
    case MP_UINT: {
        int64_t v;
        if (mp_read_i64(r, &v, NULL) != MOE_OK) {
            uint64_t u;
            if (mp_read_u64(r, &u, NULL) != MOE_OK)
                return -1;
            printf("%llu", (unsigned long long)u);
        } else {
            printf("%lld", (long long)v);
        }
        return 0;
    }
    case MP_FLOAT: {
        double d;
        mp_read_f64(r, &d, NULL);
        printf("%.6g", d);
        return 0;
    }
    case MP_STR: {
        const char *s;
        uint32_t len;
        mp_read_str(r, &s, &len, NULL);
        printf("\"%.*s\"", (int)len, s);
        return 0;
    }
    case MP_BIN: {
        const void *d;
        uint32_t len;
        mp_read_bin(r, &d, &len, NULL);
        printf("\"<%u bytes>\"", len);
        return 0;
    }
    case MP_ARRAY: {
        if (mp_read_array(r, &n, NULL) != MOE_OK)
            return -1;
        printf("[");
        for (uint32_t i = 0; i < n; i++) {
            if (i)
                printf(", ");
            if (print_json(r, indent + 2))
                return -1;
        }
        printf("]");
        return 0;
    }
    case MP_MAP: {
        if (mp_read_map(r, &n, NULL) != MOE_OK)
            return -1;
        printf("{");
        for (uint32_t i = 0; i < n; i++) {
            printf("%s\n%*s", i ? "," : "", indent + 2, "");
            if (print_json(r, indent + 2))
                return -1;
            printf(": ");
            if (print_json(r, indent + 2))
                return -1;
        }
        printf("\n%*s}", indent, "");
        return 0;
    }
    default: return mp_skip(r, NULL) == MOE_OK ? (printf("\"?\""), 0) : -1;
    }
}

static int call_and_print(moe_client *c, const char *method, const void *params, size_t len)
{
    moe_reply r;
    moe_err e = moe_call(c, method, params, len, &r);
    if (e != MOE_OK) {
        fprintf(stderr, "moectl: %s: %s: %s\n", method, moe_err_code(e), r.message);
        moe_reply_free(&r);
        return 1;
    }
    mp_reader rd;
    mp_reader_init(&rd, r.buf + r.result_off, r.len - r.result_off);
    print_json(&rd, 0);
    printf("\n");
    moe_reply_free(&r);
    return 0;
}

static void print_load_table(const moe_fwd_info *info)
{
    int E = info->n_experts;
    int64_t mx = 1;
    for (int e = 0; e < E; e++)
        mx = info->tokens_per_expert[e] > mx ? info->tokens_per_expert[e] : mx;
    printf("  expert  tokens  dropped\n");
    for (int e = 0; e < E; e++) {
        int bar = (int)(40 * info->tokens_per_expert[e] / mx);
        printf("  %6d  %6lld  %7lld  ", e, (long long)info->tokens_per_expert[e],
               (long long)(info->dropped ? info->dropped[e] : 0));
        for (int i = 0; i < bar; i++)
            putchar('#');
        putchar('\n');
    }
    printf("  imbalance (max/mean) %.3f   aux_loss %.4f   z_loss %.4f\n", info->imbalance,
           info->aux_loss, info->z_loss);
    printf("  phases: gate %.3f ms  dispatch %.3f ms  experts %.3f ms  combine %.3f ms  "
           "total %.3f ms\n",
           info->gate_s * 1e3, info->dispatch_s * 1e3, info->experts_s * 1e3, info->combine_s * 1e3,
           info->total_s * 1e3);
}

static moe_dtype parse_dtype(const char *s)
{
    moe_dtype d = MOE_F32;
    if (s && moe_dtype_parse(s, strlen(s), &d) != MOE_OK) {
        fprintf(stderr, "moectl: unknown dtype %s\n", s);
        exit(2);
    }
    return d;
}

/* make_input fills (T, H) random values in [-1, 1) in dtype dt. */
static void *make_input(long long T, int H, moe_dtype dt, long long seed)
{
    size_t n = (size_t)T * (size_t)H;
    float *f = malloc((n ? n : 1) * sizeof(float));
    if (!f)
        return NULL;
    rng_fill_uniform((uint64_t)seed, 7, -1.0f, 1.0f, f, n);
    if (dt == MOE_F32)
        return f;
    uint16_t *h = malloc((n ? n : 1) * 2);
    if (h)
        moe_bf16_from_f32(f, h, n);
    free(f);
    return h;
}

static int query_d_model(moe_client *c, const char *model, int *H)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, model);
    moe_reply r;
    moe_err e = moe_call(c, "model.info", w.buf, w.len, &r);
    mp_writer_fini(&w);
    if (e != MOE_OK) {
        fprintf(stderr, "moectl: model.info: %s: %s\n", moe_err_code(e), r.message);
        moe_reply_free(&r);
        return -1;
    }
    /* find config.d_model */
    mp_reader rd;
    uint32_t n, m;
    mp_reader_init(&rd, r.buf + r.result_off, r.len - r.result_off);
    *H = 0;
    if (mp_read_map(&rd, &n, NULL) == MOE_OK)
        for (uint32_t i = 0; i < n; i++) {
            const char *k;
            uint32_t kl;
            if (mp_read_str(&rd, &k, &kl, NULL) != MOE_OK)
                break;
            if (mp_str_eq(k, kl, "config") && mp_read_map(&rd, &m, NULL) == MOE_OK) {
                for (uint32_t j = 0; j < m; j++) {
                    int64_t v;
                    if (mp_read_str(&rd, &k, &kl, NULL) != MOE_OK)
                        break;
                    if (mp_str_eq(k, kl, "d_model") && mp_read_i64(&rd, &v, NULL) == MOE_OK)
                        *H = (int)v;
                    else
                        mp_skip(&rd, NULL);
                }
                break;
            }
            mp_skip(&rd, NULL);
        }
    moe_reply_free(&r);
    return *H > 0 ? 0 : -1;
}

static int cmd_forward(moe_client *c, const opts *o)
{
    int H;
    if (!o->model || query_d_model(c, o->model, &H) != 0)
        return 1;
    moe_dtype dt = parse_dtype(o->dtype);
    size_t es = moe_dtype_size(dt);
    long long T = o->tokens;
    void *x;
    if (o->input) {
        FILE *f = fopen(o->input, "rb");
        if (!f) {
            perror(o->input);
            return 1;
        }
        fseek(f, 0, SEEK_END);
        long sz = ftell(f);
        fseek(f, 0, SEEK_SET);
        if (sz < 0 || (size_t)sz % ((size_t)H * es) != 0) {
            fprintf(stderr, "moectl: %s has %ld bytes, not a multiple of d_model*%zu\n", o->input,
                    sz, es);
            fclose(f);
            return 1;
        }
        T = sz / (long)((size_t)H * es);
        x = malloc((size_t)sz + 1);
        if (!x || fread(x, 1, (size_t)sz, f) != (size_t)sz) {
            fclose(f);
            return 1;
        }
        fclose(f);
    } else {
        x = make_input(T, H, dt, o->seed);
    }
    void *y = malloc((size_t)T * H * es + 1);
    moe_fwd_info info;
    double t0 = now_s();
    moe_err e = moe_forward(c, o->model, o->layer, dt, x, T, H, y, &info);
    double dt_s = now_s() - t0;
    if (e != MOE_OK) {
        fprintf(stderr, "moectl: forward: %s: %s\n", moe_err_code(e), moe_last_error());
        free(x);
        free(y);
        return 1;
    }
    double sum = 0, sq = 0;
    for (long long i = 0; i < T * H; i++) {
        float v;
        if (dt == MOE_F32)
            v = ((float *)y)[i];
        else
            moe_f32_from_bf16((const uint16_t *)y + i, &v, 1);
        sum += v;
        sq += (double)v * v;
    }
    printf("forward %s layer %d: T=%lld d_model=%d %s in %.3f ms (%.0f tokens/s)\n", o->model,
           o->layer, T, H, moe_dtype_name(dt), dt_s * 1e3, T / dt_s);
    printf("  y: sum %.6g  rms %.6g\n", sum, T ? sqrt(sq / (double)(T * H)) : 0.0);
    print_load_table(&info);
    if (o->output) {
        FILE *f = fopen(o->output, "wb");
        if (!f || fwrite(y, 1, (size_t)T * H * es, f) != (size_t)T * H * es) {
            perror(o->output);
            return 1;
        }
        fclose(f);
    }
    moe_fwd_info_free(&info);
    free(x);
    free(y);
    return 0;
}

/* ---- bench: N requests at concurrency C ----
 * Each request's outcome is counted per error code (bench_stats.h); the
 * throughput and the latency percentiles are those of the successful
 * requests only. One warm-up request (step) first, not counted. The exit
 * status is 1 when any counted request failed. */

/* bench_note_error prints the first failure of each error code (of any thread). */
static void bench_note_error(const char *what, moe_err e)
{
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static int seen[MOE_ERR_COUNT];
    pthread_mutex_lock(&mu);
    if ((unsigned)e < (unsigned)MOE_ERR_COUNT && !seen[e]++)
        fprintf(stderr, "moectl: %s: %s: %s\n", what, moe_err_code(e), moe_last_error());
    pthread_mutex_unlock(&mu);
}

typedef struct bench_thr {
    moe_client *c;
    const opts *o;
    int H, n, n_ok;
    moe_dtype dt;
    double *lat; /* the latencies of its successful requests, n_ok of them */
    bench_tally tally;
    void *x, *y;
} bench_thr;

static void *bench_main(void *arg)
{
    bench_thr *b = arg;
    for (int i = 0; i < b->n; i++) {
        double t0 = now_s();
        moe_err e = b->o->ping_only ? moe_ping(b->c)
                                    : moe_forward(b->c, b->o->model, b->o->layer, b->dt, b->x,
                                                  b->o->tokens, b->H, b->y, NULL);
        double t = now_s() - t0;
        bench_tally_add(&b->tally, e);
        if (e == MOE_OK)
            b->lat[b->n_ok++] = t;
        else
            bench_note_error("bench", e);
    }
    return NULL;
}

/* bench --train: N steps of forward(train) + backward + optimizer.step; a
 * step fails with the error of its first failed call. */
static int cmd_bench_train(moe_client *c, const opts *o)
{
    int H = 0, N = o->requests > 0 ? o->requests : 100;
    if (!o->model || query_d_model(c, o->model, &H) != 0)
        return 1;
    size_t n = (size_t)o->tokens * H;
    float *x = malloc(n * 4 + 4), *y = malloc(n * 4 + 4), *dy = malloc(n * 4 + 4),
          *dx = malloc(n * 4 + 4);
    double *lat = calloc((size_t)N, sizeof(double));
    if (!x || !y || !dy || !dx || !lat) {
        fprintf(stderr, "moectl: bench --train: out of memory\n");
        free(x), free(y), free(dy), free(dx), free(lat);
        return 1;
    }
    moe_adamw opt = {1e-4, 0.9, 0.999, 1e-8, 0.0, 1.0, 0, 0};
    double t_fwd = 0, t_bwd = 0, t_step = 0, t0 = now_s();
    bench_tally tally = {{0}};
    int n_ok = 0;
    for (int i = 0; i <= N; i++) { /* i = 0 is a warm-up */
        rng_fill_uniform((uint64_t)o->seed + (uint64_t)i, 1, -1, 1, x, n);
        rng_fill_uniform((uint64_t)o->seed + (uint64_t)i, 2, -1e-2f, 1e-2f, dy, n);
        moe_fwd_info info = {0}; /* left as is by a failed forward */
        double a = now_s();
        moe_err e = moe_forward_train(c, o->model, o->layer, MOE_F32, x, o->tokens, H, y, &info);
        double b = now_s();
        if (e == MOE_OK)
            e = moe_backward(c, info.handle, MOE_F32, dy, o->tokens, H, dx);
        double d = now_s();
        if (e == MOE_OK)
            e = moe_optimizer_step(c, o->model, &opt, NULL, NULL);
        double f = now_s();
        moe_fwd_info_free(&info);
        if (e != MOE_OK && i == 0)
            fprintf(stderr, "moectl: bench --train: warm-up (not counted): %s: %s\n",
                    moe_err_code(e), moe_last_error());
        if (i == 0) {
            t0 = now_s();
            continue;
        }
        bench_tally_add(&tally, e);
        if (e != MOE_OK) {
            bench_note_error("bench --train", e);
            continue;
        }
        t_fwd += b - a;
        t_bwd += d - b;
        t_step += f - d;
        lat[n_ok++] = f - a;
    }
    double wall = now_s() - t0;
    char rep[1024];
    int rc = bench_report(rep, sizeof(rep), &tally, lat, wall, o->tokens, "steps");
    printf("bench train %s layer %d: T=%lld d_model=%d f32, %d steps: %s", o->model, o->layer,
           o->tokens, H, N, rep);
    if (n_ok)
        printf("; per ok step forward %.2f ms, backward %.2f ms, optimizer %.2f ms",
               t_fwd / n_ok * 1e3, t_bwd / n_ok * 1e3, t_step / n_ok * 1e3);
    printf("\n");
    free(x), free(y), free(dy), free(dx), free(lat);
    return rc;
}

static int cmd_bench(moe_client *c, const opts *o)
{
    int H = 0, C = o->conc > 0 ? o->conc : 1, N = o->requests > 0 ? o->requests : 100;
    moe_dtype dt = parse_dtype(o->dtype);
    if (!o->ping_only && (!o->model || query_d_model(c, o->model, &H) != 0))
        return 1;
    bench_thr *th = calloc((size_t)C, sizeof(bench_thr));
    pthread_t *tid = calloc((size_t)C, sizeof(pthread_t));
    double *lat = calloc((size_t)N, sizeof(double));
    if (!th || !tid || !lat) {
        fprintf(stderr, "moectl: bench: out of memory\n");
        free(th), free(tid), free(lat);
        return 1;
    }
    int off = 0;
    /* one warm-up request, not counted */
    moe_err we;
    if (!o->ping_only) {
        void *x = make_input(o->tokens, H, dt, o->seed);
        void *y = malloc((size_t)o->tokens * H * moe_dtype_size(dt) + 1);
        we = moe_forward(c, o->model, o->layer, dt, x, o->tokens, H, y, NULL);
        free(x);
        free(y);
    } else {
        we = moe_ping(c);
    }
    if (we != MOE_OK)
        fprintf(stderr, "moectl: bench: warm-up (not counted): %s: %s\n", moe_err_code(we),
                moe_last_error());
    double t0 = now_s();
    for (int i = 0; i < C; i++) {
        th[i].c = c;
        th[i].o = o;
        th[i].H = H;
        th[i].dt = dt;
        th[i].n = N / C + (i < N % C);
        th[i].lat = lat + off;
        off += th[i].n;
        if (!o->ping_only) {
            th[i].x = make_input(o->tokens, H, dt, o->seed + i);
            th[i].y = malloc((size_t)o->tokens * H * moe_dtype_size(dt) + 1);
        }
        pthread_create(&tid[i], NULL, bench_main, &th[i]);
    }
    bench_tally tally = {{0}};
    int n_ok = 0;
    for (int i = 0; i < C; i++) {
        pthread_join(tid[i], NULL);
        bench_tally_merge(&tally, &th[i].tally);
        /* the ok latencies of every thread, packed at the front of lat */
        memmove(lat + n_ok, th[i].lat, (size_t)th[i].n_ok * sizeof(double));
        n_ok += th[i].n_ok;
        free(th[i].x);
        free(th[i].y);
    }
    double wall = now_s() - t0;
    char rep[1024];
    int rc = bench_report(rep, sizeof(rep), &tally, lat, wall, o->ping_only ? 0 : o->tokens, "req");
    if (o->ping_only)
        printf("bench ping: %d requests, concurrency %d: %s\n", N, C, rep);
    else
        printf("bench forward %s layer %d: T=%lld d_model=%d %s, %d requests, concurrency %d: %s\n",
               o->model, o->layer, o->tokens, H, moe_dtype_name(dt), N, C, rep);
    free(th);
    free(tid);
    free(lat);
    return rc;
}

static int cmd_create(moe_client *c, const opts *o)
{
    if (o->from_hf) {
        moe_err e = moe_model_create_from_hf(c, o->name, o->from_hf, o->dtype);
        if (e != MOE_OK) {
            fprintf(stderr, "moectl: create: %s: %s\n", moe_err_code(e), moe_last_error());
            return 1;
        }
        printf("created model %s from %s\n", o->name, o->from_hf);
        return 0;
    }
    moe_model_config cfg = {0};
    cfg.name = o->name;
    cfg.layers = o->layers;
    cfg.d_model = o->d_model;
    cfg.d_ff = o->d_ff;
    cfg.n_experts = o->experts;
    cfg.top_k = o->top_k;
    cfg.activation = o->activation;
    cfg.renormalize = o->renorm;
    cfg.capacity_factor = o->cf;
    cfg.dtype = parse_dtype(o->dtype);
    cfg.seed = (uint64_t)o->seed;
    cfg.aux_loss_coef = o->aux;
    cfg.z_loss_coef = o->z;
    moe_err e = moe_model_create(c, &cfg);
    if (e != MOE_OK) {
        fprintf(stderr, "moectl: create: %s: %s\n", moe_err_code(e), moe_last_error());
        return 1;
    }
    printf("created model %s: %d layers, d_model %d, d_ff %d, %d experts, top-%d\n", o->name,
           o->layers, o->d_model, o->d_ff, o->experts, o->top_k);
    return 0;
}

int main(int argc, char **argv)
{
    opts o = {0};
    o.url = "tcp://127.0.0.1:7000";
    o.tokens = 64;
    o.seed = 1;
    o.aux = 0.01;
    o.layers = 1;
    o.requests = 100;
    o.conc = 1;
    const char *cmd = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(flag) (strcmp(a, flag) == 0 && v && (i++, 1))
        if (OPT("--url"))
            o.url = v;
        else if (OPT("--token"))
            o.token = v;
        else if (OPT("--data-path"))
            o.data_path = v;
        else if (OPT("--tls-ca"))
            o.tls_ca = v;
        else if (OPT("--tls-cert"))
            o.tls_cert = v;
        else if (OPT("--tls-key"))
            o.tls_key = v;
        else if (OPT("--timeout-ms"))
            o.timeout_ms = atoi(v);
        else if (OPT("--name"))
            o.name = v;
        else if (OPT("--from-hf"))
            o.from_hf = v;
        else if (OPT("--model"))
            o.model = v;
        else if (OPT("--layers"))
            o.layers = atoi(v);
        else if (OPT("--d-model"))
            o.d_model = atoi(v);
        else if (OPT("--d-ff"))
            o.d_ff = atoi(v);
        else if (OPT("--experts"))
            o.experts = atoi(v);
        else if (OPT("--top-k"))
            o.top_k = atoi(v);
        else if (OPT("--activation"))
            o.activation = v;
        else if (OPT("--capacity-factor"))
            o.cf = atof(v);
        else if (OPT("--aux-loss-coef"))
            o.aux = atof(v);
        else if (OPT("--z-loss-coef"))
            o.z = atof(v);
        else if (OPT("--dtype"))
            o.dtype = v;
        else if (OPT("--seed"))
            o.seed = atoll(v);
        else if (OPT("--layer"))
            o.layer = atoi(v);
        else if (OPT("--tokens"))
            o.tokens = atoll(v);
        else if (OPT("--input"))
            o.input = v;
        else if (OPT("--output"))
            o.output = v;
        else if (OPT("--path"))
            o.path = v;
        else if (OPT("--requests"))
            o.requests = atoi(v);
        else if (OPT("--concurrency"))
            o.conc = atoi(v);
        else if (strcmp(a, "--renormalize") == 0)
            o.renorm = 1;
        else if (strcmp(a, "--ping") == 0)
            o.ping_only = 1;
        else if (strcmp(a, "--train") == 0)
            o.train = 1;
        else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage();
            return 0;
        } else if (a[0] != '-' && !cmd)
            cmd = a;
        else {
            fprintf(stderr, "moectl: unknown or incomplete option %s\n", a);
            usage();
            return 2;
        }
#undef OPT
    }
    if (!cmd) {
        usage();
        return 2;
    }
    moe_client_opts co = {.timeout_ms = o.timeout_ms,
                          .auth_token = o.token,
                          .data_path = o.data_path,
                          .tls_ca = o.tls_ca,
                          .tls_cert = o.tls_cert,
                          .tls_key = o.tls_key};
    moe_client *c;
    if (moe_client_open(o.url, &co, &c) != MOE_OK) {
        fprintf(stderr, "moectl: %s\n", moe_last_error());
        return 1;
    }
    int rc;
    mp_writer w;
    mp_writer_init(&w);
    if (strcmp(cmd, "ping") == 0) {
        double t0 = now_s();
        moe_err e = moe_ping(c);
        if (e == MOE_OK)
            printf("pong from %s in %.3f ms\n", o.url, (now_s() - t0) * 1e3);
        else
            fprintf(stderr, "moectl: ping: %s\n", moe_last_error());
        rc = e != MOE_OK;
    } else if (strcmp(cmd, "status") == 0) {
        rc = call_and_print(c, "cluster.status", NULL, 0);
    } else if (strcmp(cmd, "stats") == 0) {
        rc = call_and_print(c, "stats", NULL, 0);
    } else if (strcmp(cmd, "drain") == 0) {
        rc = call_and_print(c, "drain", NULL, 0);
    } else if (strcmp(cmd, "info") == 0) {
        mp_write_map(&w, 1);
        mp_write_cstr(&w, "model");
        mp_write_cstr(&w, o.model ? o.model : "");
        rc = call_and_print(c, "model.info", w.buf, w.len);
    } else if (strcmp(cmd, "save") == 0 || strcmp(cmd, "load") == 0) {
        int save = cmd[0] == 's';
        int64_t step = 0;
        moe_err e = !o.model || !o.path ? MOE_EINVAL
                    : save              ? moe_checkpoint_save(c, o.model, o.path)
                                        : moe_checkpoint_load(c, o.model, o.path, &step);
        if (e == MOE_OK && save)
            printf("saved %s under %s\n", o.model, o.path);
        else if (e == MOE_OK)
            printf("loaded %s from %s: step %lld\n", o.model, o.path, (long long)step);
        else
            fprintf(stderr, "moectl: %s: %s\n", cmd,
                    !o.model || !o.path ? "needs --model and --path" : moe_last_error());
        rc = e != MOE_OK;
    } else if (strcmp(cmd, "create") == 0) {
        rc = cmd_create(c, &o);
    } else if (strcmp(cmd, "delete") == 0) {
        moe_err e = o.model ? moe_model_delete(c, o.model) : MOE_EINVAL;
        if (e == MOE_OK)
            printf("deleted model %s\n", o.model);
        else
            fprintf(stderr, "moectl: delete: %s\n", o.model ? moe_last_error() : "needs --model");
        rc = e != MOE_OK;
    } else if (strcmp(cmd, "forward") == 0) {
        rc = cmd_forward(c, &o);
    } else if (strcmp(cmd, "bench") == 0) {
        rc = o.train ? cmd_bench_train(c, &o) : cmd_bench(c, &o);
    } else {
        fprintf(stderr, "moectl: unknown command %s\n", cmd);
        usage();
        rc = 2;
    }
    mp_writer_fini(&w);
    moe_client_close(c);
    return rc;
}
