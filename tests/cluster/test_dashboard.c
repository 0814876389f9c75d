/*
 * test_dashboard.c - GET /dashboard on the coordinator's metrics server: a
 * self-contained HTML page (no external resources) that polls /metrics and
 * /dashboard/history; after a forward, /metrics holds the per-expert lines
 * the page draws; the history JSON has the points its charts draw (per
 * model); and, when chromium is installed, the page loaded headless draws
 * its charts with data (skipped otherwise: the JSON test stands alone).
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "common/json.h"
#include "kernels/kern.h"
#include "common/rng.h"

/* header_value: the value of header name in head (case-insensitive name), or NULL */
static const char *header_value(const char *head, const char *name, char *out, size_t cap)
{
    size_t n = strlen(name);
    for (const char *p = strstr(head, "\r\n"); p; p = strstr(p + 2, "\r\n")) {
        if (strncasecmp(p + 2, name, n) == 0 && p[2 + n] == ':') {
            const char *v = p + 3 + n;
            while (*v == ' ')
                v++;
            size_t l = strcspn(v, "\r\n");
            snprintf(out, cap, "%.*s", (int)l, v);
            return out;
        }
    }
    return NULL;
}

Test(dashboard, page_served_and_metrics_it_parses, .timeout = 30, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1, .metrics = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    static char head[8192], body[1 << 20];

    cr_assert_eq(
        cluster_http_get(cl->metrics_port, "/dashboard", head, sizeof(head), body, sizeof(body)),
        200, "%s", head);
    char ctype[128];
    cr_assert(header_value(head, "Content-Type", ctype, sizeof(ctype)), "%s", head);
    cr_assert(strncmp(ctype, "text/html", 9) == 0, "Content-Type: %s", ctype);
    cr_assert(strstr(body, "<!doctype html>") && strstr(body, "</html>"));
    /* polls /metrics */
    cr_assert(strstr(body, "fetch('/metrics'"), "no fetch of /metrics in the page");
    cr_assert(strstr(body, "setTimeout(tick, POLL_MS)") && strstr(body, "POLL_MS = 2000"));
    /* and the history, drawn as inline SVG, per model chosen in a selector */
    cr_assert(strstr(body, "fetch('/dashboard/history'"), "no fetch of the history");
    cr_assert(strstr(body, "<svg") && strstr(body, "<select id='model'>"));
    cr_assert(strstr(body, "id='ch-tput'") && strstr(body, "id='ch-lat'") &&
              strstr(body, "id='ch-imb'"));
    /* the sections */
    static const char *titles[] = {"<h2>Cluster</h2>",         "<h2>Throughput</h2>",
                                   "<h2>Forward latency</h2>", "<h2>Phases</h2>",
                                   "<h2>Workers</h2>",         "<h2>Load balance per layer</h2>",
                                   "<h2>History</h2>"};
    for (size_t i = 0; i < sizeof(titles) / sizeof(titles[0]); i++)
        cr_assert(strstr(body, titles[i]), "missing section %s", titles[i]);
    /* the metric names the page reads */
    static const char *names[] = {"moe_cluster_ready",
                                  "moe_workers_up",
                                  "moe_workers_expected",
                                  "moe_queue_jobs",
                                  "moe_requests_total",
                                  "moe_request_errors_total",
                                  "moe_tokens_per_second",
                                  "moe_forward_latency_seconds_bucket",
                                  "moe_worker_busy_seconds_total",
                                  "moe_expert_tokens_total",
                                  "moe_expert_dropped_total",
                                  "moe_layer_imbalance"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        cr_assert(strstr(body, names[i]), "page does not read %s", names[i]);
    /* self-contained: nothing loaded from elsewhere */
    cr_assert_null(strstr(body, "http://"));
    cr_assert_null(strstr(body, "https://"));
    cr_assert_null(strstr(body, "<script src"));
    cr_assert_null(strstr(body, "<link"));

    /* after a forward, the text the page parses has the per-expert lines */
    moe_model_config mc = {0};
    mc.name = "m";
    mc.layers = 2;
    mc.d_model = 16;
    mc.d_ff = 32;
    mc.n_experts = 4;
    mc.top_k = 2;
    mc.seed = 5;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "model.create: %s", moe_last_error());
    const int T = 8, H = 16;
    float x[8 * 16], y[8 * 16];
    rng_fill_uniform(3, 4, -1, 1, x, (size_t)T * H);
    cr_assert_eq(moe_forward(cl->cli, "m", 0, MOE_F32, x, T, H, y, NULL), MOE_OK, "%s",
                 moe_last_error());
    int64_t t0 = cluster_now_ms();
    do { /* rendered by the loop every 100 ms */
        cr_assert_eq(
            cluster_http_get(cl->metrics_port, "/metrics", head, sizeof(head), body, sizeof(body)),
            200);
        if (strstr(body, "\nmoe_forward_total 1\n"))
            break;
        usleep(50000);
    } while (cluster_now_ms() - t0 < 5000);
    cr_assert(strstr(body, "\nmoe_forward_total 1\n"), "%s", body);
    cr_assert(strstr(body, "\nmoe_expert_tokens_total{model=\"m\",layer=\"0\",expert=\"0\"} "),
              "%s", body);
    cr_assert(strstr(body, "\nmoe_expert_tokens_total{model=\"m\",layer=\"1\",expert=\"3\"} "),
              "%s", body);
    cr_assert(strstr(body, "\nmoe_layer_imbalance{model=\"m\",layer=\"0\"} "), "%s", body);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* ---- the history ---- */

static char hbody[1 << 20];

static void create(cluster *cl, const char *name, int layers, int E)
{
    moe_model_config mc = {0};
    mc.name = name;
    mc.layers = layers;
    mc.d_model = 16;
    mc.d_ff = 32;
    mc.n_experts = E;
    mc.top_k = 2;
    mc.seed = 9;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "model.create: %s", moe_last_error());
}

/* series: the array key of the object o, with n elements */
static const json_node *series(const json_node *o, const char *key, size_t n)
{
    const json_node *a = json_get(o, key);
    cr_assert(a && a->type == J_ARR, "no array %s", key);
    cr_assert_eq(a->len, n, "%s: %zu values, %zu points", key, a->len, n);
    for (size_t i = 0; i < n; i++)
        cr_assert(a->kids[i].type == J_NUM || a->kids[i].type == J_NULL, "%s[%zu]", key, i);
    return a;
}

/* max_num: the largest number of array a, or -1 when it has none */
static double max_num(const json_node *a)
{
    double mx = -1;
    for (size_t i = 0; i < a->len; i++)
        if (a->kids[i].type == J_NUM && a->kids[i].num > mx)
            mx = a->kids[i].num;
    return mx;
}

/* history_cluster: one worker, the history every 200 ms; models m (used:
 * forwards until the history has a point of them) and idle; returns the
 * cluster with the JSON in hbody */
static cluster *history_cluster(void)
{
    cluster_opts o = {.workers = 1, .metrics = 1};
    o.coord_args[0] = "--history-ms";
    o.coord_args[1] = "200";
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    create(cl, "m", 2, 4);
    create(cl, "idle", 1, 16);
    const int T = 8, H = 16;
    float x[8 * 16], y[8 * 16];
    int64_t t0 = cluster_now_ms();
    for (int i = 0;; i++) {
        /* a forward, then the history, until a point holds forwards of m */
        rng_fill_uniform(5, (uint64_t)i, -1, 1, x, (size_t)T * H);
        cr_assert_eq(moe_forward(cl->cli, "m", i % 2, MOE_F32, x, T, H, y, NULL), MOE_OK, "%s",
                     moe_last_error());
        cr_assert_eq(
            cluster_http_get(cl->metrics_port, "/dashboard/history", NULL, 0, hbody, sizeof(hbody)),
            200);
        const char *m = strstr(hbody, "\"m\":{\"tokens_per_s\":[");
        const char *imb = m ? strstr(m, "\"imbalance\":[") : NULL;
        /* a number in m's imbalance series: a point with routed tokens */
        if (imb && strcspn(imb + 13, "0123456789") < strcspn(imb + 13, "]"))
            return cl;
        cr_assert(cluster_now_ms() - t0 < 30000, "no point with m's forwards:\n%.2000s", hbody);
        usleep(50000);
    }
}

Test(dashboard, history_json_per_model, .timeout = 60, .fini = cluster_fini_all)
{
    cluster *cl = history_cluster();
    static char head[4096];
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/dashboard/history", head, sizeof(head), hbody,
                                  sizeof(hbody)),
                 200);
    char ctype[128];
    cr_assert(header_value(head, "Content-Type", ctype, sizeof(ctype)), "%s", head);
    cr_assert_str_eq(ctype, "application/json");
    json_doc *doc;
    json_node *root;
    char err[256];
    cr_assert_eq(json_parse(hbody, strlen(hbody), &doc, &root, err, sizeof(err)), MOE_OK, "%s: %s",
                 err, hbody);
    const json_node *v = json_get(root, "interval_s");
    cr_assert(v && v->num == 0.2, "interval_s");
    v = json_get(root, "capacity");
    cr_assert(v && v->num == 180, "capacity");
    v = json_get(root, "points");
    cr_assert(v && v->num >= 1 && v->num <= 180, "points");
    size_t n = (size_t)v->num;
    const json_node *t = series(root, "t", n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(t->kids[i].type, J_NUM);
        cr_assert(i == 0 || t->kids[i].num > t->kids[i - 1].num, "t not ascending");
    }
    static const char *keys[] = {"tokens_per_s",   "requests_per_s", "errors_per_s",
                                 "latency_mean_s", "latency_p50_s",  "latency_p99_s"};
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++)
        series(root, keys[k], n);
    cr_assert_gt(max_num(json_get(root, "requests_per_s")), 0);
    const json_node *models = json_get(root, "models");
    cr_assert(models && models->type == J_OBJ && models->len == 2, "models");
    const json_node *m = json_get(models, "m"), *idle = json_get(models, "idle");
    cr_assert(m && idle, "models m and idle");
    static const char *mkeys[] = {"tokens_per_s", "forwards_per_s", "latency_mean_s", "imbalance"};
    for (size_t k = 0; k < sizeof(mkeys) / sizeof(mkeys[0]); k++) {
        series(m, mkeys[k], n);
        series(idle, mkeys[k], n);
    }
    /* m's point with forwards: tokens, forwards, latency and imbalance */
    const json_node *imb = json_get(m, "imbalance");
    size_t i = n;
    while (i-- > 0 && imb->kids[i].type != J_NUM)
        ;
    cr_assert(i < n, "no imbalance of m");
    cr_assert_geq(imb->kids[i].num, 1.0);
    cr_assert_gt(json_get(m, "tokens_per_s")->kids[i].num, 0);
    cr_assert_gt(json_get(m, "forwards_per_s")->kids[i].num, 0);
    cr_assert_eq(json_get(m, "latency_mean_s")->kids[i].type, J_NUM);
    cr_assert_gt(json_get(m, "latency_mean_s")->kids[i].num, 0);
    cr_assert_gt(json_get(root, "tokens_per_s")->kids[i].num, 0);
    /* idle: no forwards, so no imbalance and no latency at any point */
    for (size_t k = 0; k < n; k++) {
        cr_assert_eq(json_get(idle, "imbalance")->kids[k].type, J_NULL);
        cr_assert_eq(json_get(idle, "latency_mean_s")->kids[k].type, J_NULL);
        const json_node *tk = &json_get(idle, "tokens_per_s")->kids[k];
        cr_assert(tk->type == J_NULL || tk->num == 0);
    }
    json_free(doc);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

static const char *chromium_path(void)
{
    static const char *names[] = {"chromium", "chromium-browser", "google-chrome"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char cmd[128];
        snprintf(cmd, sizeof(cmd), "command -v %s >/dev/null 2>&1", names[i]);
        if (system(cmd) == 0)
            return names[i];
    }
    return NULL;
}

/* chart_points: data-n of the svg in the element with id, or -1 */
static int chart_points(const char *dom, const char *id)
{
    char key[64];
    snprintf(key, sizeof(key), "id=\"%s\"", id);
    const char *p = strstr(dom, key);
    const char *svg = p ? strstr(p, "<svg") : NULL;
    const char *n = svg ? strstr(svg, "data-n=\"") : NULL;
    return n ? atoi(n + 8) : -1;
}

static char dom[1 << 20];

Test(dashboard, chromium_draws_the_history_charts, .timeout = 180, .fini = cluster_fini_all)
{
    const char *chrome = chromium_path();
    if (!chrome)
        cr_skip_test("chromium is not installed (Debian package chromium): the page is not "
                     "rendered; dashboard::history_json_per_model checks the data it draws");
    cluster *cl = history_cluster();
    char cmd[1024];
    /* a profile of its own in the cluster's directory; --no-sandbox: CI runs as root */
    snprintf(cmd, sizeof(cmd),
             "timeout 120 %s --headless --no-sandbox --disable-gpu --disable-dev-shm-usage "
             "--no-first-run --user-data-dir=%s/chrome --virtual-time-budget=5000 --dump-dom "
             "'http://127.0.0.1:%d/dashboard#model=m' 2>%s/chrome.log",
             chrome, cl->dir, cl->metrics_port, cl->dir);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(dom, 1, sizeof(dom) - 1, p);
    dom[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: exit %d", chrome,
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    /* the page ran: data from /metrics, the models in the selector */
    cr_assert(strstr(dom, ">READY<"), "the page shows no READY:\n%.3000s", dom);
    cr_assert(strstr(dom, "<option selected=\"\">m</option>"), "m not selected:\n%.3000s", dom);
    cr_assert(strstr(dom, "<option>idle</option>"), "no idle in the selector");
    /* the three charts have points: throughput, latency, m's imbalance */
    static const char *charts[] = {"ch-tput", "ch-lat", "ch-imb"};
    for (size_t i = 0; i < 3; i++) {
        int pts = chart_points(dom, charts[i]);
        cr_assert_gt(pts, 0, "chart %s: %d points:\n%.3000s", charts[i], pts, dom);
    }
    cr_assert(strstr(dom, "<polyline") || strstr(dom, "<circle"), "nothing drawn");
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}
