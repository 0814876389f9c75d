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

/* to_f32: n values of dtype dt (f32 or bf16) at src, unaligned, into dst */
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

/* yt (H) += w row, each term rounded to bf16 when bf (moe_combine_rows'
 * arithmetic, in one pass over the row as it came: no f32 copy of it).
 * Cloned for the wider vector units (picked at load time): the same
 * operations in the same order, so the same bits (no contraction under
 * -std=c11), 2x faster with AVX2 than with SSE2 (T=1 at d_model 2048, top-8:
 * a decode step's sum) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void
add_term(float *yt, const uint8_t *row, int bf, float w, size_t H)
{
    if (bf)
        for (size_t i = 0; i < H; i++)
            yt[i] += bf16_round_inl(w * row_at(row, 1, i));
    else
        for (size_t i = 0; i < H; i++)
            yt[i] += w * row_at(row, 0, i);
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
    float *yt = malloc((size_t)H * sizeof(float));                   /* (H) */
    moe_err e = MOE_OK;
    if (!row || !srow || !yt) {
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
        for (int64_t i = 0; i < H; i++)
            yt[i] = 0.0f;
        for (int j = 0; j < K; j++) {
            const size_t s = (size_t)t * K + j;
            float w;
            memcpy(&w, parts[0].topk_w + 4 * s, 4);
            add_term(yt, row[s], bf, w, (size_t)H);
        }
        if (bf)
            for (int64_t i = 0; i < H; i++)
                yt[i] = bf16_round_inl(yt[i]);
        if (has_shared)
            for (int64_t i = 0; i < H; i++) {
                const float sum = yt[i] + row_at(srow[t], bf, (size_t)i);
                yt[i] = bf ? bf16_round_inl(sum) : sum;
            }
        if (dt == MOE_F32) {
            memcpy((float *)out + (size_t)t * H, yt, (size_t)H * sizeof(float));
        } else {
            uint8_t *o = (uint8_t *)out + (size_t)t * H * 2;
            for (int64_t i = 0; i < H; i++) {
                const uint16_t h = bf16_from_f32_inl(yt[i]);
                memcpy(o + 2 * i, &h, 2);
            }
        }
    }
out:
    free(row);
    free(srow);
    free(yt);
    return e;
}

/* dropped_of adds the "dropped" array of an encoded stats map into sum
 * (growing *E on first sight; sum NULL: only its length into *E); 0, or -1
 * when malformed */
static int dropped_of(const uint8_t *stats, size_t len, int64_t *sum, uint32_t cap, uint32_t *E)
{
    mp_reader r;
    uint32_t n;
    mp_reader_init(&r, stats, len);
    if (mp_read_map(&r, &n, NULL) != MOE_OK)
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl, m;
        if (mp_read_str(&r, &k, &kl, NULL) != MOE_OK)
            return -1;
        if (!mp_str_eq(k, kl, "dropped")) {
            if (mp_skip(&r, NULL) != MOE_OK)
                return -1;
            continue;
        }
        if (mp_read_array(&r, &m, NULL) != MOE_OK || m > cap || (*E && m != *E))
            return -1;
        *E = m;
        for (uint32_t e = 0; e < m; e++) {
            int64_t v;
            if (mp_read_i64(&r, &v, NULL) != MOE_OK)
                return -1;
            if (sum)
                sum[e] += v;
        }
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
    uint32_t E = 0;
    if (dropped_of(p0->stats, p0->stats_len, NULL, 1u << 16, &E) != 0)
        return -1;
    int64_t *sum = calloc(E ? E : 1, sizeof(int64_t));
    const uint32_t cap = E;
    E = 0;
    int ok = sum != NULL;
    for (int q = 0; ok && q < W; q++)
        ok = !parts[q].stats || dropped_of(parts[q].stats, parts[q].stats_len, sum, cap, &E) == 0;
    mp_reader r;
    uint32_t n;
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
        if (mp_read_str(&r, &k, &kl, NULL) != MOE_OK || mp_skip(&r, NULL) != MOE_OK) {
            free(sum);
            return -1;
        }
        if (mp_str_eq(k, kl, "dropped")) {
            mp_write_cstr(w, "dropped");
            mp_write_array(w, E);
            for (uint32_t e = 0; e < E; e++)
                mp_write_i64(w, sum[e]);
        } else {
            mp_write_raw(w, a, (size_t)(r.p - a));
        }
    }
    free(sum);
    return 0;
}
