/*
 * test_metrics.c - /metrics as Prometheus reads it (docs/OPERATIONS.md,
 * "Health and metrics"):
 *   - the writer (server/promtext.h) writes the format and refuses the
 *     mistakes it exists to prevent; its checker finds them in a text;
 *   - a live coordinator (2 CPU workers, 2 models, forwards, errors):
 *     every family one group with HELP and TYPE, a model label on the
 *     per-model series, an idle model that does not change another's
 *     imbalance, errors by wire code summing to the stats RPC's
 *     errors_total, and no series of a worker that was killed and replaced;
 *   - the same text through `promtool check metrics` when promtool is
 *     installed (Debian package prometheus; skipped otherwise).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "server/promtext.h"
#include "common/rng.h"

#define WORKER_IDS 256 /* worker ids of a test cluster stay below */

/* ---- the writer and the checker, without a cluster ---- */

Test(promtext, writes_the_text_format)
{
    promtext p;
    pt_init(&p);
    pt_family(&p, "moe_x_total", PT_COUNTER, "A count.\nSecond \\ line.");
    pt_label l[2] = {{"model", "a\"b\\c\nd"}, {"layer", "0"}};
    pt_sample_u64(&p, l, 2, 18446744073709551615ull);
    pt_sample_u64(&p, NULL, 0, 3);
    pt_family(&p, "moe_g", PT_GAUGE, "A gauge.");
    pt_sample_f64(&p, NULL, 0, 0.1);
    pt_sample_f64(&p, l + 1, 1, NAN);
    pt_sample_f64(&p, l + 1, 1, -INFINITY);
    pt_family(&p, "moe_h_seconds", PT_HISTOGRAM, "A histogram.");
    const double b[2] = {0.5, 1};
    const uint64_t n[3] = {1, 2, 3};
    pt_histogram(&p, l + 1, 1, b, 2, n, 7.25);
    cr_assert_null(pt_error(&p), "%s", pt_error(&p));
    char *t = pt_finish(&p);
    cr_assert(t);
    const char *want = "# HELP moe_x_total A count.\\nSecond \\\\ line.\n"
                       "# TYPE moe_x_total counter\n"
                       "moe_x_total{model=\"a\\\"b\\\\c\\nd\",layer=\"0\"} 18446744073709551615\n"
                       "moe_x_total 3\n"
                       "# HELP moe_g A gauge.\n"
                       "# TYPE moe_g gauge\n"
                       "moe_g 0.1\n"
                       "moe_g{layer=\"0\"} NaN\n"
                       "moe_g{layer=\"0\"} -Inf\n"
                       "# HELP moe_h_seconds A histogram.\n"
                       "# TYPE moe_h_seconds histogram\n"
                       "moe_h_seconds_bucket{layer=\"0\",le=\"0.5\"} 1\n"
                       "moe_h_seconds_bucket{layer=\"0\",le=\"1\"} 3\n"
                       "moe_h_seconds_bucket{layer=\"0\",le=\"+Inf\"} 6\n"
                       "moe_h_seconds_sum{layer=\"0\"} 7.25\n"
                       "moe_h_seconds_count{layer=\"0\"} 6\n";
    cr_assert_str_eq(t, want);
    /* the checker reads it back (the two moe_g{layer="0"} are one series twice) */
    char err[256];
    pt_family_info f[8];
    cr_assert_eq(promtext_check(t, f, 8, err, sizeof(err)), -1);
    cr_assert(strstr(err, "twice"), "%s", err);
    free(t);
}

/* refuses: each case fails the writer, which then writes nothing more */
Test(promtext, refuses_the_mistakes)
{
    static const struct {
        const char *what, *name;
        pt_type type;
        const char *help;
    } fam[] = {
        {"declared twice", "moe_a_total", PT_COUNTER, "again"},
        {"counter without _total", "moe_b", PT_COUNTER, "x"},
        {"gauge with _total", "moe_c_total", PT_GAUGE, "x"},
        {"no HELP", "moe_d", PT_GAUGE, ""},
        {"invalid name", "moe-e", PT_GAUGE, "x"},
        {"histogram suffix", "moe_f_count", PT_GAUGE, "x"},
    };
    for (size_t i = 0; i < sizeof(fam) / sizeof(fam[0]); i++) {
        promtext p;
        pt_init(&p);
        cr_assert_eq(pt_family(&p, "moe_a_total", PT_COUNTER, "first"), 0);
        cr_assert_eq(pt_family(&p, fam[i].name, fam[i].type, fam[i].help), -1, "%s", fam[i].what);
        cr_assert(pt_error(&p), "%s", fam[i].what);
        pt_sample_u64(&p, NULL, 0, 1); /* ignored */
        cr_assert_null(pt_finish(&p), "%s: finished anyway", fam[i].what);
        cr_log_info("%s: %s", fam[i].what, pt_error(&p));
    }
    promtext p;
    /* a sample before any family */
    pt_init(&p);
    pt_sample_u64(&p, NULL, 0, 1);
    cr_assert_null(pt_finish(&p));
    /* bad label names, le, a label twice */
    static const pt_label bad[][2] = {{{"1x", "v"}, {"a", "b"}},
                                      {{"__x", "v"}, {"a", "b"}},
                                      {{"le", "v"}, {"a", "b"}},
                                      {{"a", "v"}, {"a", "b"}}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        pt_init(&p);
        pt_family(&p, "moe_g", PT_GAUGE, "x");
        pt_sample_f64(&p, bad[i], 2, 1);
        cr_assert_null(pt_finish(&p), "label set %zu accepted", i);
    }
    /* a plain sample of a histogram, a histogram of a gauge */
    pt_init(&p);
    pt_family(&p, "moe_h", PT_HISTOGRAM, "x");
    pt_sample_f64(&p, NULL, 0, 1);
    cr_assert_null(pt_finish(&p));
    pt_init(&p);
    pt_family(&p, "moe_g", PT_GAUGE, "x");
    const double b[1] = {1};
    const uint64_t n[2] = {0, 0};
    pt_histogram(&p, NULL, 0, b, 1, n, 0);
    cr_assert_null(pt_finish(&p));
}

Test(promtext, check_finds_what_promtool_rejects)
{
    static const struct {
        const char *what, *text, *says;
    } bad[] = {
        {"interleaved",
         "# HELP a x\n# TYPE a gauge\n# HELP b x\n# TYPE b gauge\na 1\nb 1\na{l=\"1\"} 2\n",
         "not one group"},
        {"no HELP", "# TYPE a gauge\na 1\n", "HELP"},
        {"no TYPE", "# HELP a x\na 1\n", "TYPE"},
        {"undeclared", "# HELP a x\n# TYPE a gauge\na 1\nb 2\n", "without"},
        {"bad escape", "# HELP a x\n# TYPE a gauge\na{l=\"\\t\"} 1\n", "escape"},
        {"bad value", "# HELP a x\n# TYPE a gauge\na 1x\n", "value"},
        {"bucket without le", "# HELP h x\n# TYPE h histogram\nh_bucket 1\n", "le"},
        {"no newline at the end", "# HELP a x\n# TYPE a gauge\na 1", "newline"},
        {"series twice", "# HELP a x\n# TYPE a gauge\na{l=\"1\"} 1\na{l=\"1\"} 2\n", "twice"},
    };
    char err[256];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(promtext_check(bad[i].text, NULL, 0, err, sizeof(err)), -1, "%s passed",
                     bad[i].what);
        cr_assert(strstr(err, bad[i].says), "%s: %s", bad[i].what, err);
    }
    const char *good = "# HELP a x\n# TYPE a gauge\na 1\na{l=\"\\\"\"} 2 1700000000000\n"
                       "# comment\n# HELP h x\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\n"
                       "h_sum 1\nh_count 1\n";
    pt_family_info f[4];
    cr_assert_eq(promtext_check(good, f, 4, err, sizeof(err)), 2, "%s", err);
    cr_assert_str_eq(f[1].name, "h");
    cr_assert_eq(f[1].type, PT_HISTOGRAM);
    cr_assert_eq(f[0].samples, 2);
}

/* ---- a live coordinator ---- */

static char body[1 << 21];

static void get_metrics(cluster *cl)
{
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/metrics", NULL, 0, body, sizeof(body)), 200);
}

/* value of the series (name with labels, exact) in body; NAN if absent */
static double value(const char *series)
{
    size_t n = strlen(series);
    for (const char *p = body; (p = strstr(p, series)) != NULL; p += n)
        if ((p == body || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return NAN;
}

/* wait_value polls /metrics (rendered every 100 ms) until series == want */
static void wait_value(cluster *cl, const char *series, double want)
{
    int64_t t0 = cluster_now_ms();
    for (;;) {
        get_metrics(cl);
        if (value(series) == want)
            return;
        cr_assert(cluster_now_ms() - t0 < 30000, "%s is %g, want %g", series, value(series), want);
        usleep(20000);
    }
}

/* worker_ids: the worker label values of every sample of body, as a bit set */
static void worker_ids(uint8_t ids[WORKER_IDS])
{
    memset(ids, 0, WORKER_IDS);
    for (const char *p = body; (p = strstr(p, "worker=\"")) != NULL; p++) {
        int id = atoi(p + 8);
        cr_assert(id >= 0 && id < WORKER_IDS);
        ids[id] = 1;
    }
}

/* populate: two models (a used, b idle with 16 experts), three forwards of
 * a, two unknown methods and one wrong auth token */
static cluster *populate(void)
{
    cluster_opts o = {.workers = 2, .metrics = 1, .auth_token = "secret"};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    moe_model_config mc = {0};
    mc.name = "a";
    mc.layers = 2;
    mc.d_model = 16;
    mc.d_ff = 32;
    mc.n_experts = 4;
    mc.top_k = 2;
    mc.seed = 3;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "%s", moe_last_error());
    mc.name = "b";
    mc.layers = 1;
    mc.n_experts = 16;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "%s", moe_last_error());
    const int T = 24, H = 16;
    float x[24 * 16], y[24 * 16];
    for (int i = 0; i < 3; i++) {
        rng_fill_uniform(7, (uint64_t)i, -1, 1, x, (size_t)T * H);
        cr_assert_eq(moe_forward(cl->cli, "a", i % 2, MOE_F32, x, T, H, y, NULL), MOE_OK, "%s",
                     moe_last_error());
    }
    moe_reply rep;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(moe_call(cl->cli, "no.such", NULL, 0, &rep), MOE_ENOMETHOD);
        moe_reply_free(&rep);
    }
    moe_client *bad;
    moe_client_opts co = {.timeout_ms = 10000, .auth_token = "wrong"};
    cr_assert_eq(moe_client_open(cl->url, &co, &bad), MOE_OK);
    cr_assert_eq(moe_ping(bad), MOE_EUNAUTH);
    moe_client_close(bad);
    wait_value(cl, "moe_model_forward_total{model=\"a\"}", 3);
    wait_value(cl, "moe_request_errors_total{code=\"unauthenticated\"}", 1);
    wait_value(cl, "moe_request_errors_total{code=\"unknown_method\"}", 2);
    return cl;
}

/* stats_errors_and_imbalance: from the stats RPC, errors_total and model
 * a's imbalance of layer l */
static void stats_errors_and_imbalance(cluster *cl, uint64_t *errors, double imb[2])
{
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "stats", NULL, 0, &rep), MOE_OK, "%s", rep.message);
    mp_reader r = mp_reply_reader(&rep);
    cr_assert_eq(mp_map_find(&r, "errors_total"), 0);
    cr_assert_eq(mp_read_u64(&r, errors, NULL), MOE_OK);
    r = mp_reply_reader(&rep);
    cr_assert_eq(mp_map_find(&r, "models"), 0);
    cr_assert_eq(mp_map_find(&r, "a"), 0);
    cr_assert_eq(mp_map_find(&r, "layers"), 0);
    uint32_t n;
    cr_assert_eq(mp_read_array(&r, &n, NULL), MOE_OK);
    cr_assert_eq(n, 2u);
    for (uint32_t l = 0; l < n; l++) {
        mp_reader one = r;
        cr_assert_eq(mp_map_find(&one, "imbalance"), 0);
        cr_assert_eq(mp_read_f64(&one, &imb[l], NULL), MOE_OK);
        cr_assert_eq(mp_skip(&r, NULL), MOE_OK);
    }
    moe_reply_free(&rep);
}

/* the families /metrics must have (docs/OPERATIONS.md's table) */
static const char *const families[] = {
    "moe_uptime_seconds",
    "moe_cluster_ready",
    "moe_workers_expected",
    "moe_workers_up",
    "moe_cluster_world",
    "moe_queue_jobs",
    "moe_queue_capacity",
    "moe_inflight_bytes",
    "moe_busy_bytes_total",
    "moe_connections",
    "moe_connections_refused_total",
    "moe_connections_idle_closed_total",
    "moe_requests_total",
    "moe_request_errors_total",
    "moe_forward_total",
    "moe_tokens_total",
    "moe_tokens_per_second",
    "moe_gate_seconds_total",
    "moe_dispatch_seconds_total",
    "moe_experts_seconds_total",
    "moe_combine_seconds_total",
    "moe_forward_latency_seconds",
    "moe_gate_latency_seconds",
    "moe_dispatch_latency_seconds",
    "moe_experts_latency_seconds",
    "moe_combine_latency_seconds",
    "moe_worker_up",
    "moe_worker_busy_seconds_total",
    "moe_alltoall_bytes_total",
    "moe_worker_data_tickets",
    "moe_worker_data_regions",
    "moe_worker_data_rows_total",
    "moe_worker_data_bytes_total",
    "moe_worker_data_expired_total",
    "moe_worker_bulk_connections",
    "moe_worker_bulk_transfers_total",
    "moe_model_forward_total",
    "moe_model_tokens_total",
    "moe_expert_tokens_total",
    "moe_expert_dropped_total",
    "moe_layer_imbalance",
};
#define NFAMILIES ((int)(sizeof(families) / sizeof(families[0])))

Test(metrics, live_text_groups_models_errors_dead_workers, .timeout = 120, .fini = cluster_fini_all)
{
    cluster *cl = populate();
    get_metrics(cl);
    char err[256];
    pt_family_info f[PT_MAX_FAMILIES];
    int nf = promtext_check(body, f, PT_MAX_FAMILIES, err, sizeof(err));
    cr_assert_eq(nf, NFAMILIES, "%d families (%s):\n%s", nf, err, body);
    for (int i = 0; i < NFAMILIES; i++) {
        int found = 0;
        for (int k = 0; k < nf; k++)
            found |= strcmp(f[k].name, families[i]) == 0;
        cr_assert(found, "no family %s", families[i]);
    }
    /* per-model series: both models, with the model label */
    char s[160];
    for (int l = 0; l < 2; l++) {
        double mx = 0, tot = 0;
        for (int e = 0; e < 4; e++) {
            snprintf(s, sizeof(s),
                     "moe_expert_tokens_total{model=\"a\",layer=\"%d\",expert=\"%d\"}", l, e);
            double v = value(s);
            cr_assert(!isnan(v), "no %s", s);
            mx = v > mx ? v : mx;
            tot += v;
        }
        cr_assert_eq(tot, l == 0 ? 2 * 24 * 2 : 24 * 2, "layer %d: %g slots", l, tot);
        snprintf(s, sizeof(s), "moe_layer_imbalance{model=\"a\",layer=\"%d\"}", l);
        cr_assert(fabs(value(s) - mx / (tot / 4)) < 1e-9, "%s = %g, want %g", s, value(s),
                  mx / (tot / 4));
    }
    cr_assert_eq(value("moe_expert_tokens_total{model=\"b\",layer=\"0\",expert=\"15\"}"), 0);
    cr_assert_eq(value("moe_expert_dropped_total{model=\"b\",layer=\"0\",expert=\"15\"}"), 0);
    cr_assert_eq(value("moe_layer_imbalance{model=\"b\",layer=\"0\"}"), 0);
    cr_assert_eq(value("moe_model_tokens_total{model=\"a\"}"), 3 * 24);
    cr_assert_eq(value("moe_model_forward_total{model=\"b\"}"), 0);
    /* the idle model b changes nothing of a's: /metrics says what stats says */
    uint64_t stats_errors;
    double imb[2];
    stats_errors_and_imbalance(cl, &stats_errors, imb);
    for (int l = 0; l < 2; l++) {
        snprintf(s, sizeof(s), "moe_layer_imbalance{model=\"a\",layer=\"%d\"}", l);
        cr_assert(fabs(value(s) - imb[l]) < 1e-9, "%s = %g, stats says %g", s, value(s), imb[l]);
    }
    /* errors by code; their sum is the stats RPC's errors_total */
    double sum = 0;
    for (int e = 1; e < MOE_ERR_COUNT; e++) {
        snprintf(s, sizeof(s), "moe_request_errors_total{code=\"%s\"}", moe_err_code((moe_err)e));
        double v = value(s);
        cr_assert(!isnan(v), "no %s", s);
        sum += v;
    }
    cr_assert_eq(sum, (double)stats_errors, "sum by code %g, errors_total %llu", sum,
                 (unsigned long long)stats_errors);
    cr_assert_eq(sum, 3);

    /* a worker killed and replaced: none of its series remain */
    uint8_t before[WORKER_IDS], after[WORKER_IDS];
    worker_ids(before);
    cluster_state st;
    cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
    uint64_t gen = st.generation;
    cr_assert_eq(cluster_worker_kill(cl, 0, SIGKILL), 0, "%s", cluster_error());
    cr_assert_eq(cluster_worker_start(cl, 0), 0, "%s", cluster_error());
    int64_t t0 = cluster_now_ms();
    for (;;) {
        cr_assert_eq(cluster_get_state(cl, &st), MOE_OK);
        if (st.ready && st.generation > gen)
            break;
        cr_assert(cluster_now_ms() - t0 < 60000, "not ready again: up %d", st.up);
        usleep(20000);
    }
    /* the text of the new generation: 2 workers, both up, one of them new
     * (the text is rendered every 100 ms: it may lag cluster.status) */
    t0 = cluster_now_ms();
    int n_after, up, fresh;
    do {
        usleep(20000);
        get_metrics(cl);
        worker_ids(after);
        n_after = 0;
        up = 0;
        fresh = 0;
        for (int i = 0; i < WORKER_IDS; i++) {
            n_after += after[i];
            fresh += after[i] && !before[i];
            snprintf(s, sizeof(s), "moe_worker_up{worker=\"%d\"}", i);
            up += after[i] && value(s) == 1;
        }
        cr_assert(cluster_now_ms() - t0 < 30000, "%d worker ids, %d up:\n%s", n_after, up, body);
    } while (n_after != 2 || up != 2 || !fresh);
    int kept = 0, gone = 0, added = 0;
    for (int i = 0; i < WORKER_IDS; i++) {
        kept += before[i] && after[i];
        gone += before[i] && !after[i];
        added += !before[i] && after[i];
    }
    cr_assert(kept == 1 && gone == 1 && added == 1, "kept %d gone %d new %d:\n%s", kept, gone,
              added, body);
    cr_assert_eq(promtext_check(body, NULL, 0, err, sizeof(err)), NFAMILIES, "%s", err);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

static int have_promtool(void)
{
    return system("command -v promtool >/dev/null 2>&1") == 0;
}

Test(metrics, promtool_check_metrics_live, .timeout = 120, .fini = cluster_fini_all)
{
    if (!have_promtool())
        cr_skip_test("promtool is not installed (Debian package prometheus; .ci/run installs it)");
    cluster *cl = populate();
    get_metrics(cl);
    char path[400], cmd[600], out[8192];
    snprintf(path, sizeof(path), "%s/metrics.txt", cl->dir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs(body, f);
    cr_assert_eq(fclose(f), 0);
    snprintf(cmd, sizeof(cmd), "promtool check metrics < %s 2>&1", path);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "promtool check metrics: exit %d\n%s",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1, out);
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}
