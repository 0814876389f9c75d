/*
 * stats.c - the stats RPC, and the Prometheus text served at /metrics with
 * /livez and /readyz by nng's HTTP server. The loop thread renders the text
 * (coord_metrics_render, on every tick); the HTTP thread only copies it.
 * Label keys are only layer, expert and worker; counts of several models
 * are summed per (layer, expert).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "httpd.h"
#include "log.h"

typedef struct sbuf {
    char *p;
    size_t len, cap;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0)
            return;
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = (b->cap ? b->cap * 2 : 8192) + (size_t)n;
        char *np = realloc(b->p, nc);
        if (!np)
            return;
        b->p = np;
        b->cap = nc;
    }
}

static int max_layers(const coord *c)
{
    int L = 0;
    for (int i = 0; i < c->nmodels; i++)
        L = c->models[i]->cfg.layers > L ? c->models[i]->cfg.layers : L;
    return L;
}

/* write_histogram writes a Prometheus histogram over coord_lat_bounds. */
static void write_histogram(sbuf *b, const char *name, const uint64_t *hist, double sum)
{
    uint64_t cum = 0;
    sb_printf(b, "# TYPE %s histogram\n", name);
    for (int i = 0; i < COORD_LAT_BUCKETS; i++) {
        cum += hist[i];
        sb_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, coord_lat_bounds[i],
                  (unsigned long long)cum);
    }
    cum += hist[COORD_LAT_BUCKETS];
    sb_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", name,
              (unsigned long long)cum, name, sum, name, (unsigned long long)cum);
}

void coord_metrics_render(coord *c)
{
    sbuf b = {0};
    double up_s = (double)(rpc_now_ns() - c->started_ns) * 1e-9;
    sb_printf(&b,
              "# HELP moe_uptime_seconds Seconds since the coordinator started.\n"
              "# TYPE moe_uptime_seconds gauge\nmoe_uptime_seconds %.3f\n",
              up_s);
    sb_printf(&b, "# TYPE moe_cluster_ready gauge\nmoe_cluster_ready %d\n", c->ready);
    sb_printf(&b, "# TYPE moe_workers_expected gauge\nmoe_workers_expected %lld\n",
              c->expected_workers);
    sb_printf(&b, "# TYPE moe_workers_up gauge\nmoe_workers_up %d\n", coord_up_workers(c));
    sb_printf(&b, "# TYPE moe_queue_jobs gauge\nmoe_queue_jobs %d\n", c->qlen);
    if (c->srv) {
        rpcsrv_counters rc;
        rpcsrv_counters_get(c->srv, &rc);
        sb_printf(&b,
                  "# HELP moe_inflight_bytes Request bytes held by requests in progress "
                  "(--max-inflight-mb).\n# TYPE moe_inflight_bytes gauge\nmoe_inflight_bytes "
                  "%llu\n",
                  (unsigned long long)rc.held_bytes);
        sb_printf(&b, "# TYPE moe_busy_bytes_total counter\nmoe_busy_bytes_total %llu\n",
                  (unsigned long long)c->busy_bytes_total);
        sb_printf(&b, "# TYPE moe_connections gauge\nmoe_connections %llu\n",
                  (unsigned long long)rc.conns);
        sb_printf(&b,
                  "# TYPE moe_connections_refused_total counter\nmoe_connections_refused_total "
                  "%llu\n",
                  (unsigned long long)rc.conns_refused_total);
        sb_printf(&b,
                  "# TYPE moe_connections_idle_closed_total counter\n"
                  "moe_connections_idle_closed_total %llu\n",
                  (unsigned long long)rc.idle_closed_total);
    }
    sb_printf(&b, "# TYPE moe_requests_total counter\nmoe_requests_total %llu\n",
              (unsigned long long)c->requests_total);
    sb_printf(&b, "# TYPE moe_request_errors_total counter\nmoe_request_errors_total %llu\n",
              (unsigned long long)c->errors_total);
    sb_printf(&b, "# TYPE moe_forward_total counter\nmoe_forward_total %llu\n",
              (unsigned long long)c->forwards_total);
    sb_printf(&b, "# TYPE moe_tokens_total counter\nmoe_tokens_total %llu\n",
              (unsigned long long)c->tokens_total);
    sb_printf(&b, "# TYPE moe_tokens_per_second gauge\nmoe_tokens_per_second %.1f\n",
              c->tokens_per_s);
    static const char *phase[4] = {"gate", "dispatch", "experts", "combine"};
    for (int k = 0; k < 4; k++)
        sb_printf(&b, "# TYPE moe_%s_seconds_total counter\nmoe_%s_seconds_total %.6f\n", phase[k],
                  phase[k], c->phase_s[k]);
    sb_printf(&b, "# HELP moe_forward_latency_seconds Forward time at the coordinator.\n");
    write_histogram(&b, "moe_forward_latency_seconds", c->lat_hist, c->lat_sum);
    for (int k = 0; k < 4; k++) {
        char name[64];
        snprintf(name, sizeof(name), "moe_%s_latency_seconds", phase[k]);
        sb_printf(&b, "# HELP %s Per forward, the slowest worker's %s time.\n", name, phase[k]);
        write_histogram(&b, name, c->phase_hist[k], c->phase_s[k]);
    }
    sb_printf(&b, "# TYPE moe_worker_up gauge\n");
    for (int i = 0; i < COORD_MAX_WORKERS; i++)
        if (c->workers[i].state != WS_FREE)
            sb_printf(&b, "moe_worker_up{worker=\"%d\"} %d\n", c->workers[i].id,
                      c->workers[i].state == WS_UP);
    sb_printf(&b, "# HELP moe_alltoall_bytes_total Bytes a worker sent to the others in "
                  "dispatch and combine.\n# TYPE moe_alltoall_bytes_total counter\n");
    for (int i = 0; i < COORD_MAX_WORKERS; i++)
        if (c->workers[i].state != WS_FREE)
            sb_printf(&b, "moe_alltoall_bytes_total{worker=\"%d\"} %llu\n", c->workers[i].id,
                      (unsigned long long)c->workers[i].a2a_bytes);
    /* the data plane, per worker, as of its last heartbeat */
    static const struct {
        const char *name, *type, *help;
    } dpm[5] = {
        {"moe_worker_data_tickets", "gauge", "Clients' rows waiting at the worker for their job."},
        {"moe_worker_data_regions", "gauge",
         "Clients' shared or GPU buffers the worker has mapped."},
        {"moe_worker_data_rows_total", "counter", "Rows clients sent the worker directly."},
        {"moe_worker_data_bytes_total", "counter",
         "Bytes of rows clients sent the worker directly."},
        {"moe_worker_data_expired_total", "counter",
         "Clients' rows whose job never came before their deadline."},
    };
    for (int k = 0; k < 5; k++) {
        sb_printf(&b, "# HELP %s %s\n# TYPE %s %s\n", dpm[k].name, dpm[k].help, dpm[k].name,
                  dpm[k].type);
        for (int i = 0; i < COORD_MAX_WORKERS; i++) {
            const coord_worker *wk = &c->workers[i];
            if (wk->state == WS_FREE)
                continue;
            unsigned long long v = k == 0   ? (unsigned long long)wk->dp_tickets
                                   : k == 1 ? (unsigned long long)wk->dp_regions
                                   : k == 2 ? (unsigned long long)wk->dp_rows_total
                                   : k == 3 ? (unsigned long long)wk->dp_bytes_total
                                            : (unsigned long long)wk->dp_expired_total;
            sb_printf(&b, "%s{worker=\"%d\"} %llu\n", dpm[k].name, wk->id, v);
        }
    }
    sb_printf(&b, "# TYPE moe_worker_busy_seconds_total counter\n");
    for (int i = 0; i < COORD_MAX_WORKERS; i++)
        if (c->workers[i].state != WS_FREE)
            sb_printf(&b, "moe_worker_busy_seconds_total{worker=\"%d\"} %.6f\n", c->workers[i].id,
                      c->workers[i].busy_s);
    int L = max_layers(c);
    sb_printf(&b, "# TYPE moe_expert_tokens_total counter\n");
    sb_printf(&b, "# TYPE moe_expert_dropped_total counter\n");
    sb_printf(&b, "# TYPE moe_layer_imbalance gauge\n");
    for (int l = 0; l < L; l++) {
        int E = 0;
        for (int i = 0; i < c->nmodels; i++)
            if (l < c->models[i]->cfg.layers && c->models[i]->cfg.n_experts > E)
                E = c->models[i]->cfg.n_experts;
        int64_t mx = 0, tot = 0;
        for (int e = 0; e < E; e++) {
            int64_t t = 0, d = 0;
            for (int i = 0; i < c->nmodels; i++) {
                coord_model *m = c->models[i];
                if (l < m->cfg.layers && e < m->cfg.n_experts) {
                    t += m->tokens[(size_t)l * m->cfg.n_experts + e];
                    d += m->dropped[(size_t)l * m->cfg.n_experts + e];
                }
            }
            sb_printf(&b, "moe_expert_tokens_total{layer=\"%d\",expert=\"%d\"} %lld\n", l, e,
                      (long long)t);
            sb_printf(&b, "moe_expert_dropped_total{layer=\"%d\",expert=\"%d\"} %lld\n", l, e,
                      (long long)d);
            mx = t > mx ? t : mx;
            tot += t;
        }
        sb_printf(&b, "moe_layer_imbalance{layer=\"%d\"} %.4f\n", l,
                  tot ? (double)mx / ((double)tot / E) : 0.0);
    }
    pthread_mutex_lock(&c->metrics_mu);
    free(c->metrics_text);
    c->metrics_text = b.p;
    pthread_mutex_unlock(&c->metrics_mu);
}

static void on_metrics(void *arg, httpd_resp *out)
{
    coord *c = arg;
    pthread_mutex_lock(&c->metrics_mu);
    out->body = strdup(c->metrics_text ? c->metrics_text : ""); /* owned by out */
    pthread_mutex_unlock(&c->metrics_mu);
    out->status = 200;
    out->ctype = "text/plain; version=0.0.4";
    out->extra = NULL;
    out->len = out->body ? strlen(out->body) : 1; /* NULL body, len 1: httpd answers 500 */
    out->owned = 1;
}

static void on_livez(void *arg, httpd_resp *out)
{
    (void)arg;
    *out = (httpd_resp){200, "text/plain", NULL, "ok\n", 3, 0};
}

static void on_readyz(void *arg, httpd_resp *out)
{
    coord *c = arg;
    /* ready and not draining; read without the loop: a racy int read is fine here */
    int ok = __atomic_load_n(&c->ready, __ATOMIC_RELAXED) &&
             !__atomic_load_n(&c->draining, __ATOMIC_RELAXED);
    if (ok)
        *out = (httpd_resp){200, "text/plain", NULL, "ready\n", 6, 0};
    else
        *out = (httpd_resp){503, "text/plain", NULL, "not ready\n", 10, 0};
}

static const httpd_route routes[] = {{"/metrics", on_metrics},
                                     {"/livez", on_livez},
                                     {"/readyz", on_readyz},
                                     {"/dashboard", coord_http_dashboard}};

moe_err coord_metrics_start(coord *c)
{
    char err[512];
    if (!c->metrics_url[0])
        return MOE_OK;
    httpd *h = httpd_start(c->metrics_url, routes, (int)(sizeof(routes) / sizeof(routes[0])), c,
                           err, sizeof(err));
    if (!h) {
        LOG_E("cannot serve metrics: %s", err);
        return MOE_EINVAL;
    }
    c->http = h;
    LOG_I("metrics on %s/metrics", c->metrics_url);
    return MOE_OK;
}

void coord_metrics_stop(coord *c)
{
    if (c->http) {
        httpd_stop(c->http);
        c->http = NULL;
    }
}

void coord_stats(coord *c, rpc_call *call)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    rpcsrv_counters rc;
    rpcsrv_counters_get(c->srv, &rc);
    mp_write_map(&w, 15);
    mp_write_cstr(&w, "inflight_bytes"); /* this request's own included */
    mp_write_u64(&w, rc.held_bytes);
    mp_write_cstr(&w, "busy_bytes_total");
    mp_write_u64(&w, c->busy_bytes_total);
    mp_write_cstr(&w, "connections");
    mp_write_u64(&w, rc.conns);
    mp_write_cstr(&w, "connections_refused_total");
    mp_write_u64(&w, rc.conns_refused_total);
    mp_write_cstr(&w, "connections_idle_closed_total");
    mp_write_u64(&w, rc.idle_closed_total);
    mp_write_cstr(&w, "uptime_s");
    mp_write_f64(&w, (double)(rpc_now_ns() - c->started_ns) * 1e-9);
    mp_write_cstr(&w, "requests_total");
    mp_write_u64(&w, c->requests_total);
    mp_write_cstr(&w, "errors_total");
    mp_write_u64(&w, c->errors_total);
    mp_write_cstr(&w, "forward_total");
    mp_write_u64(&w, c->forwards_total);
    mp_write_cstr(&w, "tokens_total");
    mp_write_u64(&w, c->tokens_total);
    mp_write_cstr(&w, "tokens_per_s");
    mp_write_f64(&w, c->tokens_per_s);
    mp_write_cstr(&w, "queue_jobs");
    mp_write_i64(&w, c->qlen);
    mp_write_cstr(&w, "phase_s");
    mp_write_map(&w, 4);
    static const char *phase[4] = {"gate", "dispatch", "experts", "combine"};
    for (int k = 0; k < 4; k++) {
        mp_write_cstr(&w, phase[k]);
        mp_write_f64(&w, c->phase_s[k]);
    }
    mp_write_cstr(&w, "forward_latency_mean_s");
    mp_write_f64(&w, c->forwards_total ? c->lat_sum / (double)c->forwards_total : 0);
    mp_write_cstr(&w, "models");
    mp_write_map(&w, (uint32_t)c->nmodels);
    for (int i = 0; i < c->nmodels; i++) {
        coord_model *m = c->models[i];
        int E = m->cfg.n_experts;
        mp_write_cstr(&w, m->cfg.name);
        mp_write_map(&w, 2);
        mp_write_cstr(&w, "forward_total");
        mp_write_u64(&w, m->forwards);
        mp_write_cstr(&w, "layers");
        mp_write_array(&w, (uint32_t)m->cfg.layers);
        for (int l = 0; l < m->cfg.layers; l++) {
            int64_t mx = 0, tot = 0;
            mp_write_map(&w, 3);
            mp_write_cstr(&w, "tokens_per_expert");
            mp_write_array(&w, (uint32_t)E);
            for (int e = 0; e < E; e++) {
                int64_t t = m->tokens[(size_t)l * E + e];
                mp_write_i64(&w, t);
                mx = t > mx ? t : mx;
                tot += t;
            }
            mp_write_cstr(&w, "dropped");
            mp_write_array(&w, (uint32_t)E);
            for (int e = 0; e < E; e++)
                mp_write_i64(&w, m->dropped[(size_t)l * E + e]);
            mp_write_cstr(&w, "imbalance");
            mp_write_f64(&w, tot ? (double)mx / ((double)tot / E) : 0.0);
        }
    }
    rpc_reply(call, &w);
}
