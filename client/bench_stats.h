/*
 * bench_stats.h - what `moectl bench` reports, header-only so that
 * tests/cluster/test_moectl_bench.c checks it without a cluster:
 *   - every request's outcome, counted per error code (ok, deadline_exceeded, ...);
 *   - throughput (tokens/s, req/s) of the successful requests only, over the
 *     wall time of all of them;
 *   - latency percentiles of the successful requests only, by the nearest-rank
 *     method, printed with the number of samples they rest on.
 */
#ifndef MOE_BENCH_STATS_H
#define MOE_BENCH_STATS_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/moe.h"

/* pctl_rank: the 1-based rank of the p-th percentile (0 < p <= 100) of n
 * samples by the nearest-rank method, ceil(p/100 * n), clamped to [1, n];
 * 0 when n == 0. p50 of 2 samples is rank 1 (the smaller), p99 of 2 (of any
 * n <= 100) is rank n (the largest), p99 of 1000 is rank 990. */
static inline size_t pctl_rank(double p, size_t n)
{
    if (n == 0)
        return 0;
    /* p * n / 100 is exact for integer p and n; the 1e-9 keeps a p such as
     * 99.9, which is not exact in binary, from rounding up one rank */
    double r = ceil(p * (double)n / 100.0 - 1e-9);
    if (r < 1)
        return 1;
    if (r > (double)n)
        return n;
    return (size_t)r;
}

/* pctl_sorted: the p-th percentile (nearest rank) of the n values of v,
 * sorted ascending; NAN when n == 0. */
static inline double pctl_sorted(const double *v, size_t n, double p)
{
    return n ? v[pctl_rank(p, n) - 1] : NAN;
}

static inline int pctl_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* pctl_sort sorts the n values of v ascending, in place. */
static inline void pctl_sort(double *v, size_t n)
{
    if (n > 1)
        qsort(v, n, sizeof(double), pctl_cmp);
}

/* bench_tally: the outcome of every request of a bench, by error code:
 * n[MOE_OK] succeeded, n[e] failed with e. */
typedef struct bench_tally {
    long long n[MOE_ERR_COUNT];
} bench_tally;

static inline void bench_tally_add(bench_tally *t, moe_err e)
{
    t->n[(unsigned)e < (unsigned)MOE_ERR_COUNT ? e : MOE_EINTERNAL]++;
}

static inline void bench_tally_merge(bench_tally *dst, const bench_tally *src)
{
    for (int e = 0; e < MOE_ERR_COUNT; e++)
        dst->n[e] += src->n[e];
}

static inline long long bench_tally_failed(const bench_tally *t)
{
    long long f = 0;
    for (int e = 1; e < MOE_ERR_COUNT; e++)
        f += t->n[e];
    return f;
}

/* bench_append: snprintf at buf + *len, never past cap (buf stays NUL terminated). */
static inline void bench_append(char *buf, size_t cap, size_t *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline void bench_append(char *buf, size_t cap, size_t *len, const char *fmt, ...)
{
    if (*len >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + *len, cap - *len, fmt, ap);
    va_end(ap);
    if (k > 0)
        *len = *len + (size_t)k < cap ? *len + (size_t)k : cap - 1;
}

/* bench_report writes into buf (cap bytes, NUL terminated) the part of a
 * bench line after its header, e.g.
 *   ok 18, failed 2 (deadline_exceeded 2); over the 18 ok: 360 tokens/s,
 *   18.00 req/s, p50 1.234 ms, p99 2.345 ms (n=18 < 100: p99 is the max)
 * or, when nothing succeeded,
 *   ok 0, failed 20 (unavailable 20); no request succeeded: no throughput, no latency
 * lat: the latencies (seconds) of the t->n[MOE_OK] successful requests, sorted
 * here in place; wall_s: the wall time of all the requests, failed ones too;
 * tokens: tokens per request (0: no tokens/s); unit: "req", "steps".
 * Returns 0 when every request succeeded, 1 when any failed or none ran. */
static inline int bench_report(char *buf, size_t cap, const bench_tally *t, double *lat,
                               double wall_s, long long tokens, const char *unit)
{
    size_t len = 0;
    long long ok = t->n[MOE_OK], failed = bench_tally_failed(t);
    if (cap)
        buf[0] = 0;
    bench_append(buf, cap, &len, "ok %lld, failed %lld", ok, failed);
    if (failed) {
        const char *sep = " (";
        for (int e = 1; e < MOE_ERR_COUNT; e++)
            if (t->n[e]) {
                bench_append(buf, cap, &len, "%s%s %lld", sep, moe_err_code((moe_err)e), t->n[e]);
                sep = ", ";
            }
        bench_append(buf, cap, &len, ")");
    }
    if (ok == 0) {
        bench_append(buf, cap, &len, "; no request succeeded: no throughput, no latency");
        return 1;
    }
    double w = wall_s > 0 ? wall_s : 1e-9;
    bench_append(buf, cap, &len, "; over the %lld ok: ", ok);
    if (tokens > 0)
        bench_append(buf, cap, &len, "%.0f tokens/s, ", (double)ok * (double)tokens / w);
    pctl_sort(lat, (size_t)ok);
    bench_append(buf, cap, &len, "%.2f %s/s, p50 %.3f ms, p99 %.3f ms (n=%lld%s)", (double)ok / w,
                 unit, pctl_sorted(lat, (size_t)ok, 50) * 1e3,
                 pctl_sorted(lat, (size_t)ok, 99) * 1e3, ok,
                 ok < 100 ? " < 100: p99 is the max" : "");
    return failed ? 1 : 0;
}

#endif
