/* test_kern_par.c - the CPU phases over threads (kernels/par.c: activation
 * forward and backward, combine forward and backward, row gather/scatter;
 * and the worker's row moves in worker/forward.c) against their one-thread forms on
 * fresh random inputs: bit-identical (memcmp), for several thread counts
 * and sizes that split into parts. Thread counts are fixed with
 * kern_par_set_threads, so the split happens on any machine. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "worker/fwd.h"
#include "kernels/kern.h"
#include "common/placement.h"
#include "worker/pool.h"
#include "common/rng.h"
#include "worker/rows.h"

static const int thread_counts[] = {1, 2, 3, 7};
#define NTC ((int)(sizeof(thread_counts) / sizeof(thread_counts[0])))

static float *rnd(uint64_t seed, uint64_t stream, size_t n, float scale)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    cr_assert(p);
    rng_fill_uniform(seed, stream, -scale, scale, p, n);
    return p;
}

/* perm_rand: a random permutation of [0, n) (Fisher-Yates on rng_fill_uniform draws). */
static int32_t *perm_rand(uint64_t seed, size_t n)
{
    int32_t *p = malloc((n ? n : 1) * sizeof(int32_t));
    float *u = rnd(seed, 99, n, 1.0f);
    cr_assert(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (int32_t)i;
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)((u[i - 1] * 0.5f + 0.5f) * (float)i);
        j = j < i ? j : i - 1;
        int32_t t = p[i - 1];
        p[i - 1] = p[j];
        p[j] = t;
    }
    free(u);
    return p;
}

static void expect_same(const char *what, const void *got, const void *want, size_t bytes, int th)
{
    cr_expect(memcmp(got, want, bytes) == 0, "%s with %d threads differs from one thread", what,
              th);
}

Test(kern_par, act_forward_bit_identical)
{
    /* sizes: below one grain (one part), a few grains (uneven parts) */
    const size_t sizes[] = {1, 1000, 3 * KERN_PAR_GRAIN_ACT + 17};
    for (int s = 0; s < 3; s++)
        for (int act = 0; act < 2; act++)
            for (int bf16 = 0; bf16 < 2; bf16++) {
                size_t n = sizes[s];
                float *a = rnd(11 + s, 0, n, 6.0f), *b = rnd(11 + s, 1, n, 2.0f);
                float *want = rnd(11 + s, 2, n, 1.0f), *got = rnd(11 + s, 3, n, 1.0f);
                kern_par_set_threads(1);
                kern_act_forward_n((kern_act)act, a, act ? NULL : b, n, bf16, want);
                for (int t = 0; t < NTC; t++) {
                    kern_par_set_threads(thread_counts[t]);
                    memset(got, 0xff, n * sizeof(float));
                    kern_act_forward_par((kern_act)act, a, act ? NULL : b, n, bf16, got);
                    expect_same("act forward", got, want, n * sizeof(float), thread_counts[t]);
                }
                free(a), free(b), free(want), free(got);
            }
    kern_par_set_threads(0);
}

Test(kern_par, act_backward_bit_identical)
{
    size_t n = 2 * KERN_PAR_GRAIN_ACT + 5;
    for (int act = 0; act < 2; act++) {
        int swiglu = act == KERN_ACT_SWIGLU;
        float *a = rnd(21, 0, n, 6.0f), *b = rnd(21, 1, n, 2.0f), *dh = rnd(21, 2, n, 1.0f);
        float *da0 = rnd(21, 3, n, 1.0f), *db0 = rnd(21, 4, n, 1.0f);
        float *da1 = rnd(21, 5, n, 1.0f), *db1 = rnd(21, 6, n, 1.0f);
        kern_act_backward_n((kern_act)act, a, swiglu ? b : NULL, dh, n, da0, swiglu ? db0 : NULL);
        for (int t = 0; t < NTC; t++) {
            kern_par_set_threads(thread_counts[t]);
            /* dh aliasing da, as kern_expert_ffn_backward_blas calls it */
            memcpy(da1, dh, n * sizeof(float));
            kern_act_backward_par((kern_act)act, a, swiglu ? b : NULL, da1, n, da1,
                                  swiglu ? db1 : NULL);
            expect_same("act backward da", da1, da0, n * sizeof(float), thread_counts[t]);
            if (swiglu)
                expect_same("act backward db", db1, db0, n * sizeof(float), thread_counts[t]);
        }
        free(a), free(b), free(dh), free(da0), free(db0), free(da1), free(db1);
    }
    kern_par_set_threads(0);
}

Test(kern_par, combine_bit_identical)
{
    enum { H = 96, K = 3 };
    const int Ts[] = {1, 7, (int)(3 * (KERN_PAR_GRAIN / (K * H) + 1)) + 11};
    for (int s = 0; s < 3; s++)
        for (int bf16 = 0; bf16 < 2; bf16++)
            for (int use_keep = 0; use_keep < 2; use_keep++) {
                int T = Ts[s];
                size_t S = (size_t)T * K;
                float *ye = rnd(31 + s, 0, S * H, 2.0f), *w = rnd(31 + s, 1, S, 1.0f);
                float *u = rnd(31 + s, 2, S, 1.0f);
                float *want = rnd(31 + s, 3, (size_t)T * H, 1.0f);
                float *got = rnd(31 + s, 4, (size_t)T * H, 1.0f);
                uint8_t *keep = malloc(S);
                cr_assert(keep);
                for (size_t i = 0; i < S; i++)
                    keep[i] = u[i] > -0.5f;
                kern_combine_cpu(ye, w, use_keep ? keep : NULL, T, K, H, bf16, want);
                for (int t = 0; t < NTC; t++) {
                    kern_par_set_threads(thread_counts[t]);
                    memset(got, 0xff, (size_t)T * H * sizeof(float));
                    kern_combine_par(ye, w, use_keep ? keep : NULL, T, K, H, bf16, got);
                    expect_same("combine", got, want, (size_t)T * H * sizeof(float),
                                thread_counts[t]);
                }
                free(ye), free(w), free(u), free(want), free(got), free(keep);
            }
    kern_par_set_threads(0);
}

Test(kern_par, combine_backward_bit_identical)
{
    enum { H = 80, K = 2 };
    const int T = (int)(3 * (KERN_PAR_GRAIN / (K * H) + 1)) + 3;
    const size_t S = (size_t)T * K;
    float *dy = rnd(35, 0, (size_t)T * H, 1.0f), *ye = rnd(35, 1, S * H, 2.0f);
    float *w = rnd(35, 2, S, 1.0f), *u = rnd(35, 3, S, 1.0f);
    float *dye0 = rnd(35, 4, S * H, 1.0f), *dye1 = rnd(35, 5, S * H, 1.0f);
    float *dw0 = rnd(35, 6, S, 1.0f), *dw1 = rnd(35, 7, S, 1.0f);
    uint8_t *keep = malloc(S);
    cr_assert(keep);
    for (size_t i = 0; i < S; i++)
        keep[i] = u[i] > -0.3f;
    for (int use_keep = 0; use_keep < 2; use_keep++) {
        kern_combine_backward_cpu(dy, ye, w, use_keep ? keep : NULL, T, K, H, dye0, dw0);
        for (int t = 0; t < NTC; t++) {
            kern_par_set_threads(thread_counts[t]);
            memset(dye1, 0xff, S * H * sizeof(float));
            memset(dw1, 0xff, S * sizeof(float));
            kern_combine_backward_par(dy, ye, w, use_keep ? keep : NULL, T, K, H, dye1, dw1);
            expect_same("combine backward dye", dye1, dye0, S * H * sizeof(float),
                        thread_counts[t]);
            expect_same("combine backward dw", dw1, dw0, S * sizeof(float), thread_counts[t]);
        }
    }
    free(dy), free(ye), free(w), free(u), free(dye0), free(dye1), free(dw0), free(dw1), free(keep);
    kern_par_set_threads(0);
}

Test(kern_par, rows_gather_scatter_bit_identical)
{
    enum { H = 64, K = 2 };
    const size_t n = 3 * (KERN_PAR_GRAIN / H + 1) + 9; /* slots */
    float *x = rnd(41, 0, n / K * H + H, 1.0f), *src = rnd(41, 1, n * H, 1.0f);
    float *want = rnd(41, 2, n * H, 1.0f), *got = rnd(41, 3, n * H, 1.0f);
    int32_t *perm = perm_rand(41, n);
    /* gather: slot rows from token rows (perm[r] / K < n / K + 1) */
    for (size_t r = 0; r < n; r++)
        memcpy(want + r * H, x + (size_t)(perm[r] / K) * H, H * sizeof(float));
    for (int t = 0; t < NTC; t++) {
        kern_par_set_threads(thread_counts[t]);
        memset(got, 0xff, n * H * sizeof(float));
        kern_rows_gather_par(got, x, perm, K, n, H);
        expect_same("gather", got, want, n * H * sizeof(float), thread_counts[t]);
    }
    for (size_t r = 0; r < n; r++)
        memcpy(want + (size_t)perm[r] * H, src + r * H, H * sizeof(float));
    for (int t = 0; t < NTC; t++) {
        kern_par_set_threads(thread_counts[t]);
        memset(got, 0xff, n * H * sizeof(float));
        kern_rows_scatter_par(got, src, perm, n, H);
        expect_same("scatter", got, want, n * H * sizeof(float), thread_counts[t]);
    }
    free(x), free(src), free(want), free(got), free(perm);
    kern_par_set_threads(0);
}

/* ---- the worker's row moves (worker/forward.c) ---- */

/* a routing of T tokens, K slots each, over E experts: counts, offsets and
 * the sorted permutation from kern_layout_cpu on random choices */
typedef struct route {
    int T, K, E;
    int32_t *ti, *counts, *offsets, *perm;
} route;

static route route_rand(uint64_t seed, int T, int K, int E)
{
    route r = {T, K, E, NULL, NULL, NULL, NULL};
    size_t S = (size_t)T * K;
    float *u = rnd(seed, 7, S, 1.0f);
    r.ti = malloc(S * sizeof(int32_t));
    r.counts = malloc((size_t)E * sizeof(int32_t));
    r.offsets = malloc(((size_t)E + 1) * sizeof(int32_t));
    r.perm = malloc(S * sizeof(int32_t));
    cr_assert(r.ti && r.counts && r.offsets && r.perm);
    for (size_t s = 0; s < S; s++) {
        /* skewed: expert 1 gets nothing, so empty segments are covered */
        int e = (int)((u[s] * 0.5f + 0.5f) * (float)E) % E;
        r.ti[s] = e == 1 ? 0 : e;
    }
    kern_layout_cpu(r.ti, T, K, E, r.counts, r.offsets, r.perm, NULL);
    free(u);
    return r;
}

static void route_free(route *r)
{
    free(r->ti), free(r->counts), free(r->offsets), free(r->perm);
}

/* pack_plain: fwd_pack_by_owner's bytes, one thread (the format of fwd.h) */
static size_t pack_plain(const route *r, int W, int H, const float *rows, int by_token,
                         int with_counts, int bf16, uint8_t *out)
{
    size_t es = bf16 ? 2 : 4;
    uint8_t *p = out;
    for (int q = 0; q < W; q++) {
        int a = placement_first(r->E, W, q), b = a + placement_count(r->E, W, q);
        if (with_counts) {
            memcpy(p, r->counts + a, 4 * (size_t)(b - a));
            p += 4 * (size_t)(b - a);
        }
        for (int i = r->offsets[a]; i < r->offsets[b]; i++) {
            int32_t src = by_token ? r->perm[i] / r->K : r->perm[i];
            rows_put(p, rows + (size_t)src * H, (size_t)H, bf16);
            p += (size_t)H * es;
        }
    }
    return (size_t)(p - out);
}

Test(kern_par, worker_pack_unpack_bit_identical)
{
    enum { H = 48, K = 2, E = 7 };
    const int T = (int)(2 * (KERN_PAR_GRAIN / H + 1)) + 5; /* S = 2T slots: several parts */
    const size_t S = (size_t)T * K;
    route r = route_rand(51, T, K, E);
    float *x = rnd(51, 0, (size_t)T * H, 3.0f), *slots = rnd(51, 1, S * H, 3.0f);
    uint8_t *want = malloc(S * H * 4 + 4 * E);
    float *back0 = rnd(51, 2, S * H, 1.0f), *back1 = rnd(51, 3, S * H, 1.0f);
    cr_assert(want);
    wkr_model m;
    memset(&m, 0, sizeof(m));
    m.cfg.top_k = K;
    m.cfg.n_experts = E;
    wkr_fwd_state st;
    memset(&st, 0, sizeof(st));
    st.model = &m;
    st.T = T;
    st.counts = r.counts;
    st.offsets = r.offsets;
    st.perm = r.perm;
    for (int W = 1; W <= 3; W += 2)
        for (int bf16 = 0; bf16 < 2; bf16++)
            for (int mode = 0; mode < 2; mode++) { /* forward dispatch, backward dispatch */
                const float *rows = mode ? slots : x;
                size_t nb = pack_plain(&r, W, H, rows, !mode, !mode, bf16, want);
                for (int t = 0; t < NTC; t++) {
                    kern_par_set_threads(thread_counts[t]);
                    uint8_t *got = NULL;
                    size_t sb[3];
                    size_t n =
                        fwd_pack_by_owner(&st, W, E, H, K, rows, !mode, !mode, bf16, &got, sb);
                    cr_assert(n == nb, "pack: %zu bytes, want %zu", n, nb);
                    cr_expect(sb[0] + (W > 1 ? sb[1] + sb[2] : 0) == nb);
                    expect_same("pack", got, want, nb, thread_counts[t]);
                    wpool_free(got);
                }
            }
    /* unpack: sorted rows back to slot order */
    for (int bf16 = 0; bf16 < 2; bf16++) {
        size_t es = bf16 ? 2 : 4;
        uint8_t *buf = malloc(S * H * es);
        cr_assert(buf);
        for (size_t i = 0; i < S; i++)
            rows_put(buf + i * H * es, slots + i * H, H, bf16);
        kern_par_set_threads(1);
        for (size_t i = 0; i < S; i++)
            rows_get(back0 + (size_t)r.perm[i] * H, buf + i * H * es, H, bf16);
        for (int t = 0; t < NTC; t++) {
            kern_par_set_threads(thread_counts[t]);
            memset(back1, 0xff, S * H * sizeof(float));
            fwd_unpack_sorted(&st, buf, H, bf16, back1);
            expect_same("unpack", back1, back0, S * H * sizeof(float), thread_counts[t]);
        }
        free(buf);
    }
    free(x), free(slots), free(want), free(back0), free(back1);
    route_free(&r);
    kern_par_set_threads(0);
}

Test(kern_par, worker_owner_gather_scatter_bit_identical)
{
    enum { H = 40, W = 3, NE = 4 };
    /* rows per (source rank, local expert): uneven, some empty */
    const int32_t cnt[W * NE] = {3000, 0, 1500, 2, 0, 0, 4100, 777, 1, 2600, 0, 3333};
    size_t n = 0;
    for (int i = 0; i < W * NE; i++)
        n += (size_t)cnt[i];
    wkr_model m;
    memset(&m, 0, sizeof(m));
    m.ne = NE;
    wkr_fwd_state st;
    memset(&st, 0, sizeof(st));
    st.model = &m;
    st.src_cnt = (int32_t *)cnt;
    for (int bf16 = 0; bf16 < 2; bf16++) {
        size_t es = bf16 ? 2 : 4, hdr = 16, row0[W], pos[W], off = 0;
        /* the message: per rank a 16-byte header, then its rows expert by expert */
        uint8_t *buf = malloc(W * hdr + n * H * es);
        float *src = rnd(61 + bf16, 0, n * H, 2.0f);
        float *want = rnd(61, 1, n * H, 1.0f), *got = rnd(61, 2, n * H, 1.0f);
        cr_assert(buf);
        rng_fill_uniform(61, 3, -1.0f, 1.0f, (float *)buf, (W * hdr + n * H * es) / 4);
        for (int q = 0; q < W; q++) {
            size_t k = 0;
            for (int i = 0; i < NE; i++)
                k += (size_t)cnt[q * NE + i];
            row0[q] = off + hdr;
            off += hdr + k * H * es;
        }
        /* the plain expert-major walk over (expert, rank) */
        size_t r = 0;
        for (int q = 0; q < W; q++)
            pos[q] = row0[q];
        for (int i = 0; i < NE; i++)
            for (int q = 0; q < W; q++) {
                size_t k = (size_t)cnt[q * NE + i];
                rows_get(want + r * H, buf + pos[q], k * H, bf16);
                pos[q] += k * H * es;
                r += k;
            }
        for (int t = 0; t < NTC; t++) {
            kern_par_set_threads(thread_counts[t]);
            memset(got, 0xff, n * H * sizeof(float));
            fwd_owner_gather(&st, W, buf, row0, H, bf16, got);
            expect_same("owner gather", got, want, n * H * sizeof(float), thread_counts[t]);
        }
        /* scatter: rows back into per-rank segments in rank order */
        uint8_t *sw = malloc(n * H * es + 1);
        cr_assert(sw);
        size_t bb = 0;
        for (int q = 0; q < W; q++) {
            pos[q] = bb;
            for (int i = 0; i < NE; i++)
                bb += (size_t)cnt[q * NE + i] * H * es;
        }
        r = 0;
        for (int i = 0; i < NE; i++)
            for (int q = 0; q < W; q++) {
                size_t k = (size_t)cnt[q * NE + i];
                rows_put(sw + pos[q], src + r * H, k * H, bf16);
                pos[q] += k * H * es;
                r += k;
            }
        for (int t = 0; t < NTC; t++) {
            kern_par_set_threads(thread_counts[t]);
            uint8_t *out = NULL;
            size_t back[W];
            size_t tot = fwd_owner_scatter(&st, W, H, src, bf16, &out, back);
            cr_assert(tot == bb, "scatter: %zu bytes, want %zu", tot, bb);
            expect_same("owner scatter", out, sw, bb, thread_counts[t]);
            wpool_free(out);
        }
        free(buf), free(src), free(want), free(got), free(sw);
    }
    kern_par_set_threads(0);
}
