/* fanout.c - libmoe's half of a fan-out forward; see fanout.h. */
#include "client/fanout.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/bf16.h"

static int read_bin_key(mp_reader *r, const uint8_t **p, size_t *len)
{
    const void *d;
    uint32_t n;
    if (mp_read_bin(r, &d, &n, NULL) != MOE_OK)
        return 0;
    *p = d;
    *len = n;
    return 1;
}

static moe_err read_part(mp_reader *r, moe_fanout_part *p, char *msg, size_t msglen)
{
    uint32_t n;
    int have = 0; /* bits: rank, top_k, dtype, slots, rows, topk_w */
    if (mp_read_map(r, &n, NULL) != MOE_OK) {
        snprintf(msg, msglen, "fan-out answer: 'fanout' is not a map");
        return MOE_EPROTO;
    }
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        int64_t v;
        int ok = mp_read_str(r, &k, &kl, NULL) == MOE_OK;
        if (!ok) {
        } else if (mp_str_eq(k, kl, "rank")) {
            ok = mp_read_i64(r, &v, NULL) == MOE_OK && v >= 0 && v < 4096;
            p->rank = (int)v;
            have |= 1;
        } else if (mp_str_eq(k, kl, "top_k")) {
            ok = mp_read_i64(r, &v, NULL) == MOE_OK && v >= 1 && v <= 1024;
            p->top_k = (int)v;
            have |= 2;
        } else if (mp_str_eq(k, kl, "dtype")) {
            const char *s;
            uint32_t sl;
            ok = mp_read_str(r, &s, &sl, NULL) == MOE_OK &&
                 moe_dtype_parse(s, sl, &p->dtype) == MOE_OK &&
                 (p->dtype == MOE_F32 || p->dtype == MOE_BF16);
            have |= 4;
        } else if (mp_str_eq(k, kl, "slots")) {
            size_t len = 0;
            ok = read_bin_key(r, &p->slots, &len) && len % 4 == 0;
            p->nslots = len / 4;
            have |= 8;
        } else if (mp_str_eq(k, kl, "rows")) {
            ok = read_bin_key(r, &p->rows, &p->rows_len);
            have |= 16;
        } else if (mp_str_eq(k, kl, "topk_w")) {
            size_t len = 0;
            ok = read_bin_key(r, &p->topk_w, &len) && len % 4 == 0;
            p->ntopk = len / 4;
            have |= 32;
        } else if (mp_str_eq(k, kl, "shared")) {
            ok = read_bin_key(r, &p->shared, &p->shared_len);
        } else if (mp_str_eq(k, kl, "shared_row0")) {
            ok = mp_read_i64(r, &p->shared_row0, NULL) == MOE_OK && p->shared_row0 >= 0;
        } else {
            ok = mp_skip(r, NULL) == MOE_OK;
        }
        if (!ok) {
            snprintf(msg, msglen, "fan-out answer: a malformed field");
            return MOE_EPROTO;
        }
    }
    if (have != 63) {
        snprintf(msg, msglen,
                 "fan-out answer: a field is missing (rank, top_k, dtype, slots, "
                 "rows, topk_w)");
        return MOE_EPROTO;
    }
    return MOE_OK;
}

moe_err moe_fanout_read(mp_reader *r, moe_fanout_part *p, char *msg, size_t msglen)
{
    uint32_t n;
    int got = 0;
    memset(p, 0, sizeof(*p));
    if (mp_read_map(r, &n, NULL) != MOE_OK || n < 1 || n > 2) {
        snprintf(msg, msglen, "fan-out answer: want {fanout, stats}");
        return MOE_EPROTO;
    }
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(r, &k, &kl, NULL) != MOE_OK) {
            snprintf(msg, msglen, "fan-out answer: a key is not a string");
            return MOE_EPROTO;
        }
        if (mp_str_eq(k, kl, "fanout") && !got) {
            moe_err e = read_part(r, p, msg, msglen);
            if (e != MOE_OK)
                return e;
            got = 1;
        } else if (mp_str_eq(k, kl, "stats") && !p->stats) {
            const uint8_t *a = r->p;
            if (mp_skip(r, NULL) != MOE_OK) {
                snprintf(msg, msglen, "fan-out answer: malformed stats");
                return MOE_EPROTO;
            }
            p->stats = a;
            p->stats_len = (size_t)(r->p - a);
        } else {
            snprintf(msg, msglen, "fan-out answer: unexpected key '%.*s'", (int)kl, k);
            return MOE_EPROTO;
        }
    }
    if (!got) {
        snprintf(msg, msglen, "fan-out answer: no 'fanout'");
        return MOE_EPROTO;
    }
    return MOE_OK;
}

/* a row of n values of dtype dt as f32 (memcpy: the rows of a msgpack bin
 * need not be aligned) */
static inline float row_at(const uint8_t *row, int bf, size_t i)
{
    if (bf) {
        uint16_t h;
        memcpy(&h, row + 2 * i, 2);
        return bf16_to_f32_inl(h);
    }
    float f;
    memcpy(&f, row + 4 * i, 4);
    return f;
}

/* sum_cols writes columns [c0, c1) of y (dtype of out: bf16 when out_bf,
 * else f32) = sum_j w[j] row[j] in order j (moe_combine_rows' arithmetic:
 * each term rounded to bf16 when bf, then the sum), plus the shared row
 * srow (or NULL) rounded as moe_rows_add does: the reference arithmetic,
 * one column at a time */
static void sum_cols(uint8_t *out, int out_bf, const uint8_t *const *row, const float *w, int K,
                     const uint8_t *srow, int bf, size_t c0, size_t c1)
{
    for (size_t i = c0; i < c1; i++) {
        float acc = 0.0f;
        for (int j = 0; j < K; j++) {
            const float t = w[j] * row_at(row[j], bf, i);
            acc += bf ? bf16_round_inl(t) : t;
        }
        if (bf)
            acc = bf16_round_inl(acc);
        if (srow) {
            const float s = acc + row_at(srow, bf, i);
            acc = bf ? bf16_round_inl(s) : s;
        }
        if (out_bf) {
            const uint16_t h = bf16_from_f32_inl(acc);
            memcpy(out + 2 * i, &h, 2);
        } else {
            memcpy(out + 4 * i, &acc, 4);
        }
    }
}

/* The bf16 sum in vectors (GCC's and clang's vector extensions: plain C
 * operators on whole vectors, compiled for the unit the clone targets). A
 * vector of 8 words holds 16 bf16 columns: its words shifted left by 16 are
 * the even columns as f32, masked to the high half the odd ones, so a load
 * and two integer operations widen 16 values.
 *
 * The rounding is bf16_round_inl without its NaN branch: (u + 0x7fff +
 * lsb) & 0xffff0000. Both agree on every finite value and infinity, and on
 * every NaN whose low 16 bits are zero and whose quiet bit is set, as here:
 * the rows are bf16 (their low halves zero), arithmetic returns quiet NaNs
 * carrying an operand's payload or the default NaN, and the weights are
 * checked finite first (sum_token takes the reference path otherwise). */
#if defined(__GNUC__)
/* vectors passed between these static helpers (inlined; no ABI crosses a
 * library boundary): GCC's and clang's note on the ABI of such arguments
 * does not apply */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float sum_vf __attribute__((vector_size(32)));
typedef uint32_t sum_vu __attribute__((vector_size(32)));
#define SUM_BF_COLS 16 /* bf16 columns in one vector of words */

static inline sum_vf sum_as_f(sum_vu u)
{
    sum_vf f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline sum_vu sum_as_u(sum_vf f)
{
    sum_vu u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline sum_vf sum_round(sum_vf f)
{
    const sum_vu u = sum_as_u(f);
    return sum_as_f((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

/* sum_token writes y (H) of one token: vectors for f32 rows, and for bf16
 * rows whose weights are finite; sum_cols elsewhere (the last columns, a
 * non-finite weight); the same bits either way. Cloned for the wider
 * vector units (picked at load time): the same operations in the same
 * order (no contraction under -std=c11). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void
sum_token(uint8_t *out, int out_bf, const uint8_t *const *row, const float *w, int K,
          const uint8_t *srow, int bf, size_t H)
{
    if (!bf) { /* f32 rows: the reference's products and sums, 32 columns at a time */
        const size_t Hf = H - H % 32;
        for (size_t c = 0; c < Hf; c += 32) {
            sum_vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, x0, x1, x2, x3;
            for (int j = 0; j < K; j++) {
                const uint8_t *r = row[j] + 4 * c;
                memcpy(&x0, r, sizeof(x0));
                memcpy(&x1, r + 32, sizeof(x1));
                memcpy(&x2, r + 64, sizeof(x2));
                memcpy(&x3, r + 96, sizeof(x3));
                a0 += w[j] * x0;
                a1 += w[j] * x1;
                a2 += w[j] * x2;
                a3 += w[j] * x3;
            }
            if (srow) {
                const uint8_t *r = srow + 4 * c;
                memcpy(&x0, r, sizeof(x0));
                memcpy(&x1, r + 32, sizeof(x1));
                memcpy(&x2, r + 64, sizeof(x2));
                memcpy(&x3, r + 96, sizeof(x3));
                a0 = a0 + x0;
                a1 = a1 + x1;
                a2 = a2 + x2;
                a3 = a3 + x3;
            }
            float y[32];
            memcpy(y, &a0, 32);
            memcpy(y + 8, &a1, 32);
            memcpy(y + 16, &a2, 32);
            memcpy(y + 24, &a3, 32);
            if (out_bf)
                for (int i = 0; i < 32; i++) {
                    const uint16_t h = bf16_from_f32_inl(y[i]);
                    memcpy(out + 2 * (c + (size_t)i), &h, 2);
                }
            else
                memcpy(out + 4 * c, y, sizeof(y));
        }
        sum_cols(out, out_bf, row, w, K, srow, bf, Hf, H);
        return;
    }
    int finite = 1; /* the weights: the vectors' rounding needs them finite */
    for (int j = 0; j < K; j++) {
        uint32_t wb;
        memcpy(&wb, &w[j], 4);
        finite &= (wb & 0x7f800000u) != 0x7f800000u;
    }
    const size_t step = 2 * SUM_BF_COLS, Hv = finite ? H - H % step : 0;
    const sum_vu hi = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                       0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};
    for (size_t c = 0; c < Hv; c += step) {
        sum_vf e0 = {0}, o0 = {0}, e1 = {0}, o1 = {0}; /* even and odd columns */
        for (int j = 0; j < K; j++) {
            sum_vu u0, u1;
            memcpy(&u0, row[j] + 2 * c, sizeof(u0));
            memcpy(&u1, row[j] + 2 * c + sizeof(u0), sizeof(u1));
            const float wj = w[j];
            e0 += sum_round(wj * sum_as_f(u0 << 16));
            o0 += sum_round(wj * sum_as_f(u0 & hi));
            e1 += sum_round(wj * sum_as_f(u1 << 16));
            o1 += sum_round(wj * sum_as_f(u1 & hi));
        }
        e0 = sum_round(e0);
        o0 = sum_round(o0);
        e1 = sum_round(e1);
        o1 = sum_round(o1);
        if (srow) {
            sum_vu s0, s1;
            memcpy(&s0, srow + 2 * c, sizeof(s0));
            memcpy(&s1, srow + 2 * c + sizeof(s0), sizeof(s1));
            e0 = sum_round(e0 + sum_as_f(s0 << 16));
            o0 = sum_round(o0 + sum_as_f(s0 & hi));
            e1 = sum_round(e1 + sum_as_f(s1 << 16));
            o1 = sum_round(o1 + sum_as_f(s1 & hi));
        }
        if (out_bf) { /* already bf16 values: the high halves, packed back */
            const sum_vu p0 = (sum_as_u(o0) & hi) | (sum_as_u(e0) >> 16);
            const sum_vu p1 = (sum_as_u(o1) & hi) | (sum_as_u(e1) >> 16);
            memcpy(out + 2 * c, &p0, sizeof(p0));
            memcpy(out + 2 * c + sizeof(p0), &p1, sizeof(p1));
        } else {
            float ev[2][8], od[2][8];
            memcpy(ev[0], &e0, sizeof(e0));
            memcpy(od[0], &o0, sizeof(o0));
            memcpy(ev[1], &e1, sizeof(e1));
            memcpy(od[1], &o1, sizeof(o1));
            float y[2 * SUM_BF_COLS];
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 8; i++) {
                    y[h * SUM_BF_COLS + 2 * i] = ev[h][i];
                    y[h * SUM_BF_COLS + 2 * i + 1] = od[h][i];
                }
            memcpy(out + 4 * c, y, sizeof(y));
        }
    }
    sum_cols(out, out_bf, row, w, K, srow, bf, Hv, H);
}

moe_err moe_fanout_combine(const moe_fanout_part *parts, int W, int64_t T, int64_t H, moe_dtype dt,
                           void *out, char *msg, size_t msglen)
{
    if (W < 1 || T < 0 || H < 1 || (dt != MOE_F32 && dt != MOE_BF16)) {
        snprintf(msg, msglen, "fan-out: bad arguments");
        return MOE_EINVAL;
    }
    const int K = parts[0].top_k;
    const moe_dtype rdt = parts[0].dtype;
    const size_t S = (size_t)T * (size_t)K, es = moe_dtype_size(rdt), rb = (size_t)H * es;
    const int bf = rdt == MOE_BF16;
    size_t shared_rows = 0; /* the shared expert's rows, from the parts that sent them */
    int has_shared = 0;
    for (int q = 0; q < W; q++) {
        const moe_fanout_part *p = &parts[q];
        if (p->top_k != K || p->dtype != rdt || p->ntopk != S ||
            memcmp(p->topk_w, parts[0].topk_w, S * sizeof(float)) != 0) {
            snprintf(msg, msglen,
                     "fan-out: worker rank %d routed the tokens differently from rank %d", p->rank,
                     parts[0].rank);
            return MOE_EPROTO;
        }
        if (p->rows_len != p->nslots * rb) {
            snprintf(msg, msglen, "fan-out: worker rank %d sent %zu bytes of rows for %zu slots",
                     p->rank, p->rows_len, p->nslots);
            return MOE_EPROTO;
        }
        if (p->shared) {
            size_t rows = p->shared_len / rb;
            if (p->shared_len % rb || rows == 0 || p->shared_row0 < 0 ||
                (size_t)p->shared_row0 + rows > (size_t)T) {
                snprintf(msg, msglen, "fan-out: shared rows of worker rank %d outside the batch",
                         p->rank);
                return MOE_EPROTO;
            }
            shared_rows += rows;
            has_shared = 1;
        }
    }
    /* where each slot's row is (and each token's shared row), checked once */
    const uint8_t **row = calloc(S ? S : 1, sizeof(*row));           /* (S) */
    const uint8_t **srow = calloc(T ? (size_t)T : 1, sizeof(*srow)); /* (T) */
    float *wt = malloc((size_t)K * sizeof(float));                   /* (K) */
    moe_err e = MOE_OK;
    if (!row || !srow || !wt) {
        snprintf(msg, msglen, "out of memory");
        e = MOE_ENOMEM;
        goto out;
    }
    size_t filled = 0;
    for (int q = 0; q < W && e == MOE_OK; q++) {
        const moe_fanout_part *p = &parts[q];
        for (size_t j = 0; j < p->nslots; j++) {
            int32_t s;
            memcpy(&s, p->slots + 4 * j, 4);
            if (s < 0 || (size_t)s >= S || row[s]) {
                snprintf(msg, msglen, "fan-out: worker rank %d names slot %d %s", p->rank, (int)s,
                         s < 0 || (size_t)s >= S ? "out of range" : "twice");
                e = MOE_EPROTO;
                break;
            }
            row[s] = p->rows + j * rb;
            filled++;
        }
    }
    if (e == MOE_OK && filled != S) {
        snprintf(msg, msglen, "fan-out: the workers answered %zu of %zu slots", filled, S);
        e = MOE_EPROTO;
    }
    /* the shared rows: every token's once, when any worker sent some */
    for (int q = 0; q < W && e == MOE_OK && has_shared; q++) {
        const moe_fanout_part *p = &parts[q];
        size_t rows = p->shared ? p->shared_len / rb : 0;
        for (size_t r = 0; r < rows && e == MOE_OK; r++) {
            size_t t = (size_t)p->shared_row0 + r;
            if (srow[t]) {
                snprintf(msg, msglen, "fan-out: shared rows of token %zu twice", t);
                e = MOE_EPROTO;
            }
            srow[t] = p->shared + r * rb;
        }
    }
    if (e == MOE_OK && has_shared && shared_rows != (size_t)T) {
        snprintf(msg, msglen, "fan-out: shared rows of %zu of %lld tokens", shared_rows,
                 (long long)T);
        e = MOE_EPROTO;
    }
    if (e != MOE_OK)
        goto out;
    /* y[t] = sum_j w[t,j] rows[t*K+j] in order j (moe_combine_rows), then
     * the shared row (moe_rows_add), in the output's dtype */
    for (int64_t t = 0; t < T; t++) {
        for (int j = 0; j < K; j++)
            memcpy(&wt[j], parts[0].topk_w + 4 * ((size_t)t * K + j), 4);
        sum_token((uint8_t *)out + (size_t)t * H * moe_dtype_size(dt), dt == MOE_BF16,
                  row + (size_t)t * K, wt, K, has_shared ? srow[t] : NULL, bf, (size_t)H);
    }
out:
    free(row);
    free(srow);
    free(wt);
    return e;
}

/* skip_value steps over one value: an array of small counts (the stats'
 * per-expert arrays) in one step */
static int skip_value(mp_reader *r)
{
    uint32_t m;
    const uint8_t *small;
    return mp_read_small_uints(r, &m, &small, NULL) == MOE_OK || mp_skip(r, NULL) == MOE_OK;
}

/* dropped_at points r at the value of the "dropped" key of an encoded
 * stats map; 0, or -1 when malformed or missing */
static int dropped_at(const uint8_t *stats, size_t len, mp_reader *r)
{
    uint32_t n;
    mp_reader_init(r, stats, len);
    if (mp_read_map(r, &n, NULL) != MOE_OK)
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(r, &k, &kl, NULL) != MOE_OK)
            return -1;
        if (mp_str_eq(k, kl, "dropped"))
            return 0;
        if (!skip_value(r))
            return -1;
    }
    return -1;
}

/* dropped_add adds the "dropped" array at r into sum (E values; *E 0: its
 * length sets *E, at most cap); 0, or -1 when malformed. Small counts (one
 * byte each, as dropped slots mostly are: none) are read in one step. */
static int dropped_add(mp_reader *r, int64_t *sum, uint32_t cap, uint32_t *E)
{
    uint32_t m;
    const uint8_t *small;
    if (mp_read_small_uints(r, &m, &small, NULL) == MOE_OK) {
        if (m > cap || (*E && m != *E))
            return -1;
        *E = m;
        for (uint32_t e = 0; e < m; e++)
            sum[e] += small[e];
        return 0;
    }
    if (mp_read_array(r, &m, NULL) != MOE_OK || m > cap || (*E && m != *E))
        return -1;
    *E = m;
    for (uint32_t e = 0; e < m; e++) {
        int64_t v;
        if (mp_read_i64(r, &v, NULL) != MOE_OK)
            return -1;
        sum[e] += v;
    }
    return 0;
}

int moe_fanout_stats(const moe_fanout_part *parts, int W, mp_writer *w)
{
    const moe_fanout_part *p0 = NULL;
    for (int q = 0; q < W; q++)
        if (parts[q].rank == 0)
            p0 = &parts[q];
    if (!p0 || !p0->stats)
        return -1;
    /* sum (E): sized by rank 0's own "dropped" (a fresh 512 KB of zeroes
     * per call cost a decode step tens of microseconds) */
    mp_reader r;
    uint32_t E = 0, n;
    if (dropped_at(p0->stats, p0->stats_len, &r) != 0 || mp_peek(&r) != MP_ARRAY)
        return -1;
    {
        mp_reader c = r;
        if (mp_read_array(&c, &E, NULL) != MOE_OK || E > (1u << 16))
            return -1;
    }
    int64_t *sum = calloc(E ? E : 1, sizeof(int64_t));
    const uint32_t cap = E;
    E = 0;
    int ok = sum != NULL;
    for (int q = 0; ok && q < W; q++)
        ok = !parts[q].stats || (dropped_at(parts[q].stats, parts[q].stats_len, &r) == 0 &&
                                 dropped_add(&r, sum, cap, &E) == 0);
    mp_reader_init(&r, p0->stats, p0->stats_len);
    if (!ok || mp_read_map(&r, &n, NULL) != MOE_OK) {
        free(sum);
        return -1;
    }
    mp_write_map(w, n);
    for (uint32_t i = 0; i < n; i++) { /* rank 0's pairs, "dropped" summed */
        const uint8_t *a = r.p;
        const char *k;
        uint32_t kl;
        if (mp_read_str(&r, &k, &kl, NULL) != MOE_OK || !skip_value(&r)) {
            free(sum);
            return -1;
        }
        if (mp_str_eq(k, kl, "dropped")) {
            mp_write_cstr(w, "dropped");
            mp_write_array(w, E);
            uint8_t small[256]; /* runs of small sums (a fixint: the value's own
                                 * byte), written at once */
            uint32_t ns = 0;
            for (uint32_t e = 0; e < E; e++) {
                const int fits = sum[e] >= 0 && sum[e] < 128;
                if (fits)
                    small[ns++] = (uint8_t)sum[e];
                if (!fits || ns == sizeof(small)) {
                    mp_write_raw(w, small, ns);
                    ns = 0;
                }
                if (!fits)
                    mp_write_i64(w, sum[e]);
            }
            mp_write_raw(w, small, ns);
        } else {
            mp_write_raw(w, a, (size_t)(r.p - a));
        }
    }
    free(sum);
    return 0;
}
