/*
 * history.c - the dashboard's short history: every --history-ms (default
 * 5 s) the loop thread takes one point of throughput, latency and
 * imbalance over the interval since the last point, for the coordinator
 * and for each model, into rings of COORD_HIST_POINTS (15 minutes at the
 * default), and renders them as the JSON that GET /dashboard/history serves
 * (the HTTP thread only copies it, as /metrics). Format in
 * docs/OPERATIONS.md ("Dashboard").
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/coord.h"
#include "server/httpd.h"
#include "common/json.h"
#include "common/log.h"

double coord_hist_quantile(const uint64_t *counts, double q)
{
    uint64_t total = 0;
    for (int i = 0; i <= COORD_LAT_BUCKETS; i++)
        total += counts[i];
    if (!total)
        return NAN;
    double rank = q * (double)total, cum = 0, lo = 0;
    for (int i = 0; i < COORD_LAT_BUCKETS; i++) {
        double n = (double)counts[i];
        if (n > 0 && cum + n >= rank)
            return lo + (coord_lat_bounds[i] - lo) * ((rank - cum) / n);
        cum += n;
        lo = coord_lat_bounds[i];
    }
    return coord_lat_bounds[COORD_LAT_BUCKETS - 1]; /* in the +Inf bucket: its lower bound */
}

/* model_point fills m's point for the interval of dt seconds that ends now */
static void model_point(coord_model *m, coord_hist_model *h, double dt)
{
    int L = m->cfg.layers, E = m->cfg.n_experts;
    uint64_t ok = m->ok_forwards - m->hist_ok;
    h->tokens_per_s = (double)(m->rows_total - m->hist_rows) / dt;
    h->forwards_per_s = (double)ok / dt;
    h->lat_mean_s = ok ? (m->lat_sum - m->hist_lat_sum) / (double)ok : NAN;
    h->imbalance = NAN;
    for (int l = 0; l < L; l++) {
        int64_t mx = 0, tot = 0;
        for (int e = 0; e < E; e++) {
            size_t i = (size_t)l * (size_t)E + (size_t)e;
            int64_t d = m->tokens[i] - m->hist_tokens[i];
            mx = d > mx ? d : mx;
            tot += d;
            m->hist_tokens[i] = m->tokens[i];
        }
        if (tot > 0) {
            double imb = (double)mx / ((double)tot / E);
            if (isnan(h->imbalance) || imb > h->imbalance)
                h->imbalance = imb;
        }
    }
    m->hist_rows = m->rows_total;
    m->hist_ok = m->ok_forwards;
    m->hist_lat_sum = m->lat_sum;
}

void coord_history_tick(coord *c)
{
    uint64_t now = rpc_now_ns();
    if (now - c->hist_last_ns < (uint64_t)c->history_ms * 1000000ull)
        return;
    double dt = (double)(now - c->hist_last_ns) * 1e-9;
    c->hist_last_ns = now;
    coord_hist_point *p = &c->hist[c->hist_n % COORD_HIST_POINTS];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    p->t = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    p->tokens_per_s = (double)(c->tokens_total - c->hist_tokens) / dt;
    p->requests_per_s = (double)(c->requests_total - c->hist_requests) / dt;
    p->errors_per_s = (double)(c->errors_total - c->hist_errors) / dt;
    uint64_t d[COORD_LAT_BUCKETS + 1], n = 0;
    for (int i = 0; i <= COORD_LAT_BUCKETS; i++) {
        d[i] = c->lat_hist[i] - c->hist_lat[i];
        n += d[i];
        c->hist_lat[i] = c->lat_hist[i];
    }
    p->lat_mean_s = n ? (c->lat_sum - c->hist_lat_sum) / (double)n : NAN;
    p->lat_p50_s = coord_hist_quantile(d, 0.5);
    p->lat_p99_s = coord_hist_quantile(d, 0.99);
    c->hist_tokens = c->tokens_total;
    c->hist_requests = c->requests_total;
    c->hist_errors = c->errors_total;
    c->hist_lat_sum = c->lat_sum;
    for (int i = 0; i < c->nmodels; i++) {
        coord_model *m = c->models[i];
        model_point(m, &m->hist[c->hist_n % COORD_HIST_POINTS], dt);
    }
    c->hist_n++;
    coord_history_render(c);
}

static void write_num(FILE *f, double v)
{
    if (isfinite(v))
        fprintf(f, "%.6g", v);
    else
        fputs("null", f);
}

/* write_series writes "key":[...] of the points k0..hist_n-1: the double at
 * byte offset off of each element of ring (elements of size sz); null for
 * points before first */
static void write_series(FILE *f, const char *key, const void *ring, size_t sz, size_t off,
                         uint64_t k0, uint64_t n, uint64_t first)
{
    fprintf(f, "\"%s\":[", key);
    for (uint64_t k = k0; k < n; k++) {
        if (k > k0)
            fputc(',', f);
        if (k < first)
            fputs("null", f);
        else {
            double v;
            memcpy(&v, (const char *)ring + (k % COORD_HIST_POINTS) * sz + off, sizeof(v));
            write_num(f, v);
        }
    }
    fputc(']', f);
}

void coord_history_render(coord *c)
{
    static const struct {
        const char *key;
        size_t off;
    } cs[] =
        {
            {"tokens_per_s", offsetof(coord_hist_point, tokens_per_s)},
            {"requests_per_s", offsetof(coord_hist_point, requests_per_s)},
            {"errors_per_s", offsetof(coord_hist_point, errors_per_s)},
            {"latency_mean_s", offsetof(coord_hist_point, lat_mean_s)},
            {"latency_p50_s", offsetof(coord_hist_point, lat_p50_s)},
            {"latency_p99_s", offsetof(coord_hist_point, lat_p99_s)},
        },
      ms[] = {
          {"tokens_per_s", offsetof(coord_hist_model, tokens_per_s)},
          {"forwards_per_s", offsetof(coord_hist_model, forwards_per_s)},
          {"latency_mean_s", offsetof(coord_hist_model, lat_mean_s)},
          {"imbalance", offsetof(coord_hist_model, imbalance)},
      };
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) {
        LOG_E("history: out of memory");
        return;
    }
    uint64_t n = c->hist_n, k0 = n > COORD_HIST_POINTS ? n - COORD_HIST_POINTS : 0;
    fprintf(f, "{\"interval_s\":%.3f,\"capacity\":%d,\"points\":%llu,",
            (double)c->history_ms * 1e-3, COORD_HIST_POINTS, (unsigned long long)(n - k0));
    fputs("\"t\":[", f);
    for (uint64_t k = k0; k < n; k++)
        fprintf(f, "%s%.3f", k > k0 ? "," : "", c->hist[k % COORD_HIST_POINTS].t);
    fputc(']', f);
    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
        fputc(',', f);
        write_series(f, cs[i].key, c->hist, sizeof(c->hist[0]), cs[i].off, k0, n, 0);
    }
    fputs(",\"models\":{", f);
    for (int i = 0; i < c->nmodels; i++) {
        const coord_model *m = c->models[i];
        if (i)
            fputc(',', f);
        json_write_str(f, m->cfg.name);
        fputs(":{", f);
        for (size_t s = 0; s < sizeof(ms) / sizeof(ms[0]); s++) {
            if (s)
                fputc(',', f);
            write_series(f, ms[s].key, m->hist, sizeof(m->hist[0]), ms[s].off, k0, n,
                         m->hist_first);
        }
        fputc('}', f);
    }
    fputs("}}\n", f);
    if (fclose(f) != 0 || !text) {
        free(text);
        LOG_E("history: out of memory");
        return;
    }
    pthread_mutex_lock(&c->metrics_mu);
    free(c->history_json);
    c->history_json = text;
    pthread_mutex_unlock(&c->metrics_mu);
}

void coord_http_history(void *arg, httpd_resp *out)
{
    coord *c = arg;
    pthread_mutex_lock(&c->metrics_mu);
    out->body = strdup(c->history_json ? c->history_json : "{}\n"); /* owned by out */
    pthread_mutex_unlock(&c->metrics_mu);
    out->status = 200;
    out->ctype = "application/json";
    out->extra = "Cache-Control: no-cache\r\n";
    out->len = out->body ? strlen(out->body) : 1; /* NULL body, len 1: httpd answers 500 */
    out->owned = 1;
}
