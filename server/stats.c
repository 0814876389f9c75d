/*
 * stats.c - the stats RPC, and the Prometheus text served at /metrics with
 * /livez and /readyz by nng's HTTP server. The loop thread renders the text
 * (coord_metrics_render, on every tick); the HTTP thread only copies it.
 * Every family is written through promtext.h (one group each, HELP and
 * TYPE); per-model series carry a model label, per-worker ones a worker
 * label (registry entries only), errors a code label.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/coord.h"
#include "server/httpd.h"
#include "common/log.h"
#include "server/promtext.h"

static const char *phase_name[4] = {"gate", "dispatch", "experts", "combine"};

/* per_worker writes one sample per registry entry (up or down) of the
 * current family; v(wk) its value */
static void per_worker(promtext *p, const coord *c, double (*v)(const coord_worker *))
{
    for (int i = 0; i < COORD_MAX_WORKERS; i++) {
        const coord_worker *wk = &c->workers[i];
        if (wk->state == WS_FREE)
            continue;
        char id[16];
        snprintf(id, sizeof(id), "%d", wk->id);
        pt_label l = {"worker", id};
        pt_sample_f64(p, &l, 1, v(wk));
    }
}

static double wk_up(const coord_worker *w)
{
    return w->state == WS_UP;
}
static double wk_busy(const coord_worker *w)
{
    return w->busy_s;
}
static double wk_a2a(const coord_worker *w)
{
    return (double)w->a2a_bytes;
}
static double wk_tickets(const coord_worker *w)
{
    return (double)w->dp_tickets;
}
static double wk_regions(const coord_worker *w)
{
    return (double)w->dp_regions;
}
static double wk_rows(const coord_worker *w)
{
    return (double)w->dp_rows_total;
}
static double wk_bytes(const coord_worker *w)
{
    return (double)w->dp_bytes_total;
}
static double wk_expired(const coord_worker *w)
{
    return (double)w->dp_expired_total;
}
static double wk_bulk_conns(const coord_worker *w)
{
    return (double)w->dp_bulk_conns;
}
static double wk_bulk_in(const coord_worker *w)
{
    return (double)w->dp_bulk_in_total;
}

/* per_expert writes counts (layers x E) of every model, labels model, layer, expert */
static void per_expert(promtext *p, const coord *c, int dropped)
{
    for (int i = 0; i < c->nmodels; i++) {
        const coord_model *m = c->models[i];
        const int64_t *v = dropped ? m->dropped : m->tokens;
        for (int l = 0; l < m->cfg.layers; l++)
            for (int e = 0; e < m->cfg.n_experts; e++) {
                char ls[16], es[16];
                snprintf(ls, sizeof(ls), "%d", l);
                snprintf(es, sizeof(es), "%d", e);
                pt_label lab[3] = {{"model", m->cfg.name}, {"layer", ls}, {"expert", es}};
                pt_sample_u64(p, lab, 3, (uint64_t)v[(size_t)l * m->cfg.n_experts + e]);
            }
    }
}

/* layer_imbalance: max / mean of the layer's routed slots since start (0 before any) */
static double layer_imbalance(const coord_model *m, int l)
{
    int E = m->cfg.n_experts;
    int64_t mx = 0, tot = 0;
    for (int e = 0; e < E; e++) {
        int64_t t = m->tokens[(size_t)l * E + e];
        mx = t > mx ? t : mx;
        tot += t;
    }
    return tot ? (double)mx / ((double)tot / E) : 0.0;
}

/* render writes every family (docs/OPERATIONS.md, "Health and metrics") */
static void render(promtext *p, coord *c)
{
    pt_family(p, "moe_uptime_seconds", PT_GAUGE, "Seconds since the coordinator started.");
    pt_sample_f64(p, NULL, 0, (double)(rpc_now_ns() - c->started_ns) * 1e-9);
    pt_family(p, "moe_cluster_ready", PT_GAUGE,
              "1 when the current cluster generation is formed and whole, else 0.");
    pt_sample_u64(p, NULL, 0, (uint64_t)(c->ready != 0));
    pt_family(p, "moe_workers_expected", PT_GAUGE, "Workers that form the cluster (--workers).");
    pt_sample_u64(p, NULL, 0, (uint64_t)c->expected_workers);
    pt_family(p, "moe_workers_up", PT_GAUGE, "Workers registered and heartbeating.");
    pt_sample_u64(p, NULL, 0, (uint64_t)coord_up_workers(c));
    pt_family(p, "moe_cluster_world", PT_GAUGE,
              "Members of the current generation (below moe_workers_expected when formed "
              "with --min-workers).");
    pt_sample_u64(p, NULL, 0, (uint64_t)(c->generation ? c->world : 0));
    pt_family(p, "moe_queue_jobs", PT_GAUGE,
              "Jobs waiting in the queue, not counting the running one.");
    pt_sample_u64(p, NULL, 0, (uint64_t)c->qlen);
    pt_family(p, "moe_queue_capacity", PT_GAUGE,
              "Queued jobs before requests are answered busy (--queue-depth).");
    pt_sample_u64(p, NULL, 0, (uint64_t)c->queue_depth);
    if (c->srv) { /* the byte and connection bounds (docs/OPERATIONS.md, "Bounds") */
        rpcsrv_counters rc;
        rpcsrv_counters_get(c->srv, &rc);
        pt_family(p, "moe_inflight_bytes", PT_GAUGE,
                  "Request bytes held by requests in progress (--max-inflight-mb).");
        pt_sample_u64(p, NULL, 0, (uint64_t)rc.held_bytes);
        pt_family(p, "moe_busy_bytes_total", PT_COUNTER,
                  "Requests answered busy because the byte budget was full.");
        pt_sample_u64(p, NULL, 0, (uint64_t)c->busy_bytes_total);
        pt_family(p, "moe_connections", PT_GAUGE, "Client and worker connections open now.");
        pt_sample_u64(p, NULL, 0, (uint64_t)rc.conns);
        pt_family(p, "moe_connections_refused_total", PT_COUNTER,
                  "Connections closed at once because --max-conns were open.");
        pt_sample_u64(p, NULL, 0, (uint64_t)rc.conns_refused_total);
        pt_family(p, "moe_connections_idle_closed_total", PT_COUNTER,
                  "Connections closed after --idle-timeout-ms without a request in progress.");
        pt_sample_u64(p, NULL, 0, (uint64_t)rc.idle_closed_total);
    }
    pt_family(p, "moe_requests_total", PT_COUNTER,
              "Requests handled, every method, worker heartbeats included.");
    pt_sample_u64(p, NULL, 0, c->requests_total);
    pt_family(p, "moe_request_errors_total", PT_COUNTER,
              "Error answers the coordinator counts, by wire error code.");
    for (int e = 1; e < MOE_ERR_COUNT; e++) {
        pt_label l = {"code", moe_err_code((moe_err)e)};
        pt_sample_u64(p, &l, 1, c->errors_by_code[e]);
    }
    pt_family(p, "moe_forward_total", PT_COUNTER, "Forward requests answered successfully.");
    pt_sample_u64(p, NULL, 0, c->forwards_total);
    pt_family(p, "moe_tokens_total", PT_COUNTER, "Tokens (rows of x) of forwards.");
    pt_sample_u64(p, NULL, 0, c->tokens_total);
    pt_family(p, "moe_tokens_per_second", PT_GAUGE,
              "Tokens of forwards in the last completed 1 s window.");
    pt_sample_f64(p, NULL, 0, c->tokens_per_s);
    for (int k = 0; k < 4; k++) {
        char name[64], help[128];
        snprintf(name, sizeof(name), "moe_%s_seconds_total", phase_name[k]);
        snprintf(help, sizeof(help), "Per forward, the slowest worker's %s time, summed.",
                 phase_name[k]);
        pt_family(p, name, PT_COUNTER, help);
        pt_sample_f64(p, NULL, 0, c->phase_s[k]);
    }
    pt_family(p, "moe_forward_latency_seconds", PT_HISTOGRAM,
              "Time from receipt to reply of a forward, at the coordinator.");
    pt_histogram(p, NULL, 0, coord_lat_bounds, COORD_LAT_BUCKETS, c->lat_hist, c->lat_sum);
    for (int k = 0; k < 4; k++) {
        char name[64], help[128];
        snprintf(name, sizeof(name), "moe_%s_latency_seconds", phase_name[k]);
        snprintf(help, sizeof(help), "Per forward, the slowest worker's %s time.", phase_name[k]);
        pt_family(p, name, PT_HISTOGRAM, help);
        pt_histogram(p, NULL, 0, coord_lat_bounds, COORD_LAT_BUCKETS, c->phase_hist[k],
                     c->phase_s[k]);
    }
    /* per worker: the registry's entries (a dead worker's entry, and so
     * its series, goes when the next generation forms: registry.c) */
    static const struct {
        const char *name;
        pt_type type;
        const char *help;
        double (*v)(const coord_worker *);
    } wm[] = {
        {"moe_worker_up", PT_GAUGE, "1 when the registered worker is up, 0 when down.", wk_up},
        {"moe_worker_busy_seconds_total", PT_COUNTER,
         "Compute time the worker reported in forwards (its four phases).", wk_busy},
        {"moe_alltoall_bytes_total", PT_COUNTER,
         "Bytes a worker sent to the others in dispatch and combine.", wk_a2a},
        {"moe_worker_data_tickets", PT_GAUGE, "Clients' rows waiting at the worker for their job.",
         wk_tickets},
        {"moe_worker_data_regions", PT_GAUGE,
         "Clients' shared or GPU buffers the worker has mapped.", wk_regions},
        {"moe_worker_data_rows_total", PT_COUNTER, "Rows clients sent the worker directly.",
         wk_rows},
        {"moe_worker_data_bytes_total", PT_COUNTER,
         "Bytes of rows clients sent the worker directly.", wk_bytes},
        {"moe_worker_data_expired_total", PT_COUNTER,
         "Clients' rows whose job never came before their deadline.", wk_expired},
        {"moe_worker_bulk_connections", PT_GAUGE,
         "Bulk (plain TCP) connections from clients open at the worker.", wk_bulk_conns},
        {"moe_worker_bulk_transfers_total", PT_COUNTER,
         "Rows transfers the worker received over bulk connections.", wk_bulk_in},
    };
    for (size_t k = 0; k < sizeof(wm) / sizeof(wm[0]); k++) {
        pt_family(p, wm[k].name, wm[k].type, wm[k].help);
        per_worker(p, c, wm[k].v);
    }
    /* per model */
    pt_family(p, "moe_model_forward_total", PT_COUNTER,
              "Forward requests of the model answered successfully.");
    for (int i = 0; i < c->nmodels; i++) {
        pt_label l = {"model", c->models[i]->cfg.name};
        pt_sample_u64(p, &l, 1, c->models[i]->ok_forwards);
    }
    pt_family(p, "moe_model_tokens_total", PT_COUNTER,
              "Tokens (rows of x) of the model's forwards.");
    for (int i = 0; i < c->nmodels; i++) {
        pt_label l = {"model", c->models[i]->cfg.name};
        pt_sample_u64(p, &l, 1, c->models[i]->rows_total);
    }
    pt_family(p, "moe_expert_tokens_total", PT_COUNTER,
              "Routed slots (token x top-k choice) per expert, before capacity.");
    per_expert(p, c, 0);
    pt_family(p, "moe_expert_dropped_total", PT_COUNTER,
              "Routed slots dropped by the capacity factor, per expert.");
    per_expert(p, c, 1);
    pt_family(p, "moe_layer_imbalance", PT_GAUGE,
              "Max over mean of the layer's routed slots per expert since start (1 = balanced).");
    for (int i = 0; i < c->nmodels; i++) {
        const coord_model *m = c->models[i];
        for (int l = 0; l < m->cfg.layers; l++) {
            char ls[16];
            snprintf(ls, sizeof(ls), "%d", l);
            pt_label lab[2] = {{"model", m->cfg.name}, {"layer", ls}};
            pt_sample_f64(p, lab, 2, layer_imbalance(m, l));
        }
    }
}

void coord_metrics_render(coord *c)
{
    promtext p;
    pt_init(&p);
    render(&p, c);
    char *text = pt_finish(&p);
    if (!text) { /* a bug in render: keep the last good text, say why once */
        static int said;
        if (!said++)
            LOG_E("metrics: %s", pt_error(&p));
        return;
    }
    pthread_mutex_lock(&c->metrics_mu);
    free(c->metrics_text);
    c->metrics_text = text;
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
                                     {"/dashboard", coord_http_dashboard},
                                     {"/dashboard/history", coord_http_history}};

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
