/*
 * test_moectl_bench.c - `moectl bench` tells the truth:
 *   - moectl_pctl: the nearest-rank percentile (client/bench_stats.h): p99 of
 *     {1, 2} is 2, p50 of {1, 2} is 1, p50 / p99 of 1..100 are 50 / 99, one
 *     sample is every percentile;
 *   - moectl_report: the bench line counts outcomes per error code and its
 *     tokens/s, req/s and percentiles count the successful requests only;
 *   - moectl_bench: bin/moectl against a real cluster (every request ok, in
 *     forward, --ping and --train modes: exit 0) and against requests that
 *     all fail, deterministically (a layer the model does not have:
 *     not_found; a coordinator address where nothing listens:
 *     deadline_exceeded after --timeout-ms): "ok 0", no tokens/s, exit 1.
 * Nothing here depends on how fast the machine is.
 */
#include <criterion/criterion.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/bench_stats.h"
#include "tests/cluster.h"

/* ---- the percentile ---- */

Test(moectl_pctl, two_samples)
{
    double v[] = {2, 1};
    pctl_sort(v, 2);
    cr_assert_eq(v[0], 1);
    cr_assert_eq(pctl_sorted(v, 2, 99), 2, "p99 of 2 samples is the larger");
    cr_assert_eq(pctl_sorted(v, 2, 50), 1, "p50 of 2 samples is the smaller (rank ceil(1) = 1)");
    cr_assert_eq(pctl_sorted(v, 2, 100), 2);
    cr_assert_eq(pctl_sorted(v, 2, 1), 1);
    cr_assert_eq(pctl_sorted(v, 2, 51), 2);
}

Test(moectl_pctl, one_to_hundred)
{
    double v[100];
    for (int i = 0; i < 100; i++) /* a permutation of 1..100 */
        v[i] = (double)((i * 37) % 100 + 1);
    pctl_sort(v, 100);
    for (int i = 0; i < 100; i++)
        cr_assert_eq(v[i], i + 1);
    cr_assert_eq(pctl_sorted(v, 100, 50), 50);
    cr_assert_eq(pctl_sorted(v, 100, 99), 99);
    cr_assert_eq(pctl_sorted(v, 100, 100), 100);
    cr_assert_eq(pctl_sorted(v, 100, 1), 1);
    cr_assert_eq(pctl_sorted(v, 100, 90), 90);
    cr_assert_eq(pctl_sorted(v, 99, 99), 99, "p99 of 1..99: rank ceil(98.01) = 99");
    cr_assert_eq(pctl_sorted(v, 3, 50), 2);
}

Test(moectl_pctl, ranks)
{
    cr_assert_eq(pctl_rank(99, 1000), 990);
    cr_assert_eq(pctl_rank(99.9, 1000), 999, "a p not exact in binary keeps its rank");
    cr_assert_eq(pctl_rank(50, 1001), 501);
    cr_assert_eq(pctl_rank(99, 101), 100);
    cr_assert_eq(pctl_rank(99, 50), 50);
    cr_assert_eq(pctl_rank(50, 0), 0);
}

Test(moectl_pctl, single_and_no_sample)
{
    double v[] = {7.5};
    pctl_sort(v, 1);
    cr_assert_eq(pctl_sorted(v, 1, 50), 7.5);
    cr_assert_eq(pctl_sorted(v, 1, 99), 7.5);
    cr_assert_eq(pctl_sorted(v, 1, 1), 7.5);
    cr_assert(isnan(pctl_sorted(v, 0, 50)));
}

/* ---- the bench line ---- */

Test(moectl_report, failures_counted_apart)
{
    bench_tally t = {{0}};
    moe_err outcomes[] = {MOE_OK, MOE_ETIMEDOUT, MOE_OK, MOE_OK};
    for (int i = 0; i < 4; i++)
        bench_tally_add(&t, outcomes[i]);
    double lat[] = {0.003, 0.001, 0.002}; /* the 3 ok ones */
    char buf[1024];
    int rc = bench_report(buf, sizeof(buf), &t, lat, 1.0, 10, "req");
    cr_log_info("%s", buf);
    cr_assert_eq(rc, 1, "a failed request makes the exit status 1");
    cr_assert(strstr(buf, "ok 3, failed 1 (deadline_exceeded 1)"), "%s", buf);
    cr_assert(strstr(buf, "over the 3 ok: 30 tokens/s, 3.00 req/s,"),
              "4 requests ran in 1 s, 3 ok with 10 tokens each: %s", buf);
    cr_assert(strstr(buf, "p50 2.000 ms, p99 3.000 ms (n=3 < 100: p99 is the max)"), "%s", buf);
}

Test(moectl_report, codes_in_order)
{
    bench_tally t = {{0}}, u = {{0}};
    bench_tally_add(&t, MOE_EUNAVAIL);
    bench_tally_add(&t, MOE_OK);
    bench_tally_add(&u, MOE_EUNAVAIL);
    bench_tally_add(&u, MOE_EBUSY);
    bench_tally_add(&u, (moe_err)99); /* out of range: counted as internal */
    bench_tally_merge(&t, &u);
    cr_assert_eq(bench_tally_failed(&t), 4);
    double lat[] = {0.5};
    char buf[1024];
    cr_assert_eq(bench_report(buf, sizeof(buf), &t, lat, 2.0, 0, "req"), 1);
    cr_assert(strstr(buf, "ok 1, failed 4 (busy 1, unavailable 2, internal 1); "), "%s", buf);
    cr_assert(!strstr(buf, "tokens/s"), "no tokens/s for pings: %s", buf);
    cr_assert(strstr(buf, "0.50 req/s, p50 500.000 ms, p99 500.000 ms (n=1 < 100"), "%s", buf);
}

Test(moectl_report, all_ok)
{
    bench_tally t = {{0}};
    double lat[200];
    for (int i = 0; i < 200; i++) {
        bench_tally_add(&t, MOE_OK);
        lat[i] = (200 - i) * 1e-3; /* 200 ms down to 1 ms */
    }
    char buf[1024];
    cr_assert_eq(bench_report(buf, sizeof(buf), &t, lat, 4.0, 3, "steps"), 0);
    cr_assert(strstr(buf, "ok 200, failed 0; over the 200 ok: 150 tokens/s, 50.00 steps/s, "
                          "p50 100.000 ms, p99 198.000 ms (n=200)"),
              "%s", buf);
}

Test(moectl_report, none_ok)
{
    bench_tally t = {{0}};
    for (int i = 0; i < 5; i++)
        bench_tally_add(&t, MOE_ETIMEDOUT);
    char buf[1024];
    cr_assert_eq(bench_report(buf, sizeof(buf), &t, NULL, 1.0, 64, "req"), 1);
    cr_assert_str_eq(buf, "ok 0, failed 5 (deadline_exceeded 5); no request succeeded: no "
                          "throughput, no latency");
    /* a short buffer stays terminated */
    char small[12];
    bench_report(small, sizeof(small), &t, NULL, 1.0, 64, "req");
    cr_assert_str_eq(small, "ok 0, faile");
}

/* ---- bin/moectl bench ---- */

/* moectl_path: bin/moectl as the cluster harness finds the daemons. */
static const char *moectl_path(void)
{
    static char path[PATH_MAX + 32];
    const char *env = getenv("MOE_BIN_DIR");
    if (env && *env) {
        snprintf(path, sizeof(path), "%s/moectl", env);
        return path;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            snprintf(path, sizeof(path), "%s/../bin/moectl", exe);
            if (access(path, X_OK) == 0)
                return path;
        }
    }
    return "bin/moectl";
}

/* run_moectl runs `moectl --url URL ARGS` and returns its exit status, its
 * stdout and stderr together in out. */
static int run_moectl(const char *url, const char *args, char *out, size_t cap)
{
    char cmd[2048];
    /* bounded (well inside the test's own timeout), so that a moectl that
     * never finishes fails here naming the command and what it printed,
     * instead of the whole test timing out without either */
    snprintf(cmd, sizeof(cmd), "timeout -k 5 60 '%s' --url '%s' %s 2>&1", moectl_path(), url, args);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_log_info("$ moectl %s\n%s", args, out);
    const int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    cr_assert(rc != 124 && rc != 137, "moectl %s: not finished after 60 s; it printed: %s", args,
              out);
    return rc;
}

Test(moectl_bench, ok_and_failed_requests, .timeout = 120, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    moe_model_config mc = {0};
    mc.name = "m";
    mc.layers = 2;
    mc.d_model = 16;
    mc.d_ff = 32;
    mc.n_experts = 4;
    mc.top_k = 2;
    mc.seed = 3;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "model.create: %s", moe_last_error());
    static char out[1 << 16];

    /* every request ok: counted, exit 0 */
    int rc =
        run_moectl(cl->url, "bench --model m --layer 1 --tokens 8 --requests 7 --concurrency 2",
                   out, sizeof(out));
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "bench forward m layer 1: T=8 d_model=16 f32, 7 requests, concurrency 2: "
                          "ok 7, failed 0; over the 7 ok: "),
              "%s", out);
    cr_assert(strstr(out, " tokens/s, ") && strstr(out, " req/s, p50 "), "%s", out);
    cr_assert(strstr(out, "(n=7 < 100: p99 is the max)"), "%s", out);

    rc = run_moectl(cl->url, "bench --ping --requests 5 --concurrency 3", out, sizeof(out));
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "bench ping: 5 requests, concurrency 3: ok 5, failed 0; over the 5 ok: "),
              "%s", out);
    cr_assert(!strstr(out, "tokens/s"), "%s", out);

    rc = run_moectl(cl->url, "bench --train --model m --tokens 8 --requests 2", out, sizeof(out));
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "bench train m layer 0: T=8 d_model=16 f32, 2 steps: ok 2, failed 0; "
                          "over the 2 ok: "),
              "%s", out);
    cr_assert(strstr(out, " steps/s, p50 ") && strstr(out, "(n=2 < 100: p99 is the max)"), "%s",
              out);
    cr_assert(strstr(out, "; per ok step forward "), "%s", out);

    /* every request fails (the model has no layer 5): counted per code, no
     * throughput, no latency, exit 1 */
    rc = run_moectl(cl->url, "bench --model m --layer 5 --tokens 8 --requests 6 --concurrency 2",
                    out, sizeof(out));
    cr_assert_eq(rc, 1, "%s", out);
    cr_assert(strstr(out, "6 requests, concurrency 2: ok 0, failed 6 (not_found 6); no request "
                          "succeeded: no throughput, no latency"),
              "%s", out);
    cr_assert(!strstr(out, "tokens/s") && !strstr(out, "p99"), "%s", out);
    cr_assert(strstr(out, "moectl: bench: not_found: "), "the first failure is shown: %s", out);

    rc = run_moectl(cl->url, "bench --train --model m --layer 5 --tokens 8 --requests 3", out,
                    sizeof(out));
    cr_assert_eq(rc, 1, "%s", out);
    cr_assert(strstr(out, "3 steps: ok 0, failed 3 (not_found 3); no request succeeded"), "%s",
              out);
    cr_assert(!strstr(out, "steps/s") && !strstr(out, "per ok step"), "%s", out);

    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}

/* Nothing listens: every ping times out after --timeout-ms (the client's
 * per-request deadline) with deadline_exceeded. */
Test(moectl_bench, unreachable_coordinator, .timeout = 60)
{
    char dir[] = "/tmp/moectl-bench-XXXXXX";
    cr_assert(mkdtemp(dir), "mkdtemp");
    char url[128];
    snprintf(url, sizeof(url), "ipc://%s/nobody.sock", dir);
    static char out[1 << 14];
    int rc = run_moectl(url, "--timeout-ms 200 bench --ping --requests 3 --concurrency 2", out,
                        sizeof(out));
    rmdir(dir);
    cr_assert_eq(rc, 1, "%s", out);
    cr_assert(strstr(out, "bench ping: 3 requests, concurrency 2: ok 0, failed 3 "
                          "(deadline_exceeded 3); no request succeeded"),
              "%s", out);
    cr_assert(!strstr(out, "req/s"), "%s", out);
}
