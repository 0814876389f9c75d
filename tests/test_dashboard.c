/*
 * test_dashboard.c - GET /dashboard on the coordinator's metrics server: a
 * self-contained HTML page (no external resources) that polls /metrics; and
 * after a forward, /metrics holds the per-expert lines the page draws.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "cluster.h"
#include "kern.h"

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
    /* the sections */
    static const char *titles[] = {"<h2>Cluster</h2>",         "<h2>Throughput</h2>",
                                   "<h2>Forward latency</h2>", "<h2>Phases</h2>",
                                   "<h2>Workers</h2>",         "<h2>Load balance per layer</h2>"};
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
    kern_fill_uniform(3, 4, -1, 1, x, (size_t)T * H);
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
    cr_assert(strstr(body, "\nmoe_expert_tokens_total{model=\"m\",layer=\"0\",expert=\"0\"} "), "%s", body);
    cr_assert(strstr(body, "\nmoe_expert_tokens_total{model=\"m\",layer=\"1\",expert=\"3\"} "), "%s", body);
    cr_assert(strstr(body, "\nmoe_layer_imbalance{model=\"m\",layer=\"0\"} "), "%s", body);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}
