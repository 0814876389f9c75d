/*
 * forward.c - one MoE layer forward on this worker's token shard (CPU
 * backend): gate, dispatch (all-to-all-v of token rows to the experts'
 * owners), experts, combine (all-to-all-v back, weighted sum in fixed order).
 *
 * Dispatch message to rank q: int32 counts[ne_q] (rows per owned expert of
 * q), then the rows in expert order, each expert's rows in slot order; rows
 * are in the model dtype (f32, or bf16 bits). The reply from q holds the
 * expert output rows (unweighted) in the same order and dtype.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"
#include "log.h"
#include "params.h"
#include "placement.h"
#include "worker.h"

static double now_s(void)
{
    return (double)rpc_now_ns() * 1e-9;
}

/* rows are carried in the model's dtype: f32 or bf16 */
static void put_row(void *dst, const float *src, int H, int bf16)
{
    if (!bf16) {
        memcpy(dst, src, (size_t)H * 4);
        return;
    }
    uint8_t *d = dst;
    for (int i = 0; i < H; i++) {
        uint16_t h = kern_f32_to_bf16(src[i]);
        memcpy(d + 2 * i, &h, 2);
    }
}

static void get_row(float *dst, const void *src, int H, int bf16)
{
    if (!bf16) {
        memcpy(dst, src, (size_t)H * 4);
        return;
    }
    const uint8_t *s = src;
    for (int i = 0; i < H; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        dst[i] = kern_bf16_to_f32(h);
    }
}

/* tensor_to_f32 converts x (T,H) of any wire dtype into floats. */
static void tensor_to_f32(const moe_tensor *t, float *out, size_t n)
{
    if (t->dtype == MOE_F32) {
        memcpy(out, t->data, n * 4);
    } else if (t->dtype == MOE_BF16) {
        const uint8_t *s = t->data; /* unaligned in the message: copy each element */
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            out[i] = kern_bf16_to_f32(h);
        }
    } else {
        const uint8_t *s = t->data;
        for (size_t i = 0; i < n; i++) {
            /* f16 -> f32 */
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            uint32_t sign = (uint32_t)(h & 0x8000) << 16, ex = (h >> 10) & 0x1f, man = h & 0x3ff;
            float v;
            if (ex == 0)
                v = ldexpf((float)man, -24);
            else if (ex == 31)
                v = man ? NAN : INFINITY;
            else
                v = ldexpf((float)(man | 0x400), (int)ex - 25);
            uint32_t bits;
            memcpy(&bits, &v, 4);
            bits |= sign;
            memcpy(&out[i], &bits, 4);
        }
    }
}

typedef struct fwd_scratch {
    float *x, *logits, *probs, *topk_w, *ye_slot, *y;
    int32_t *topk_idx, *counts, *offsets, *perm;
    uint8_t *sendbuf, *backbuf;
    void *recvbuf, *retbuf;
    float *xe, *ae, *be, *ye;
} fwd_scratch;

static void scratch_free(wkr *w, fwd_scratch *s)
{
    free(s->x);
    free(s->logits);
    free(s->probs);
    free(s->topk_w);
    free(s->ye_slot);
    free(s->y);
    free(s->topk_idx);
    free(s->counts);
    free(s->offsets);
    free(s->perm);
    free(s->sendbuf);
    free(s->backbuf);
    free(s->xe);
    free(s->ae);
    free(s->be);
    free(s->ye);
    if (s->recvbuf)
        xchg_free(w->xc, s->recvbuf);
    if (s->retbuf)
        xchg_free(w->xc, s->retbuf);
}

void wkr_op_forward(wkr *w, rpc_call *c)
{
    char model_name[MODEL_NAME_MAX], err[256];
    int64_t layer = 0, T_total = 0, row0 = 0;
    bool train = false;
    moe_tensor xt;
    pspec sp[] = {
        {"model", P_STR, model_name, true, 0, 0, sizeof(model_name), false},
        {"layer", P_INT, &layer, true, 0, 1e6, 0, false},
        {"T_total", P_INT, &T_total, true, 0, 1e12, 0, false},
        {"row0", P_INT, &row0, true, 0, 1e12, 0, false},
        {"x", P_TENSOR, &xt, true, 0, 0, 0, false},
        {"train", P_BOOL, &train, false, 0, 0, 0, false},
    };
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 6, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    if (!w->xc) {
        rpc_reply_err(c, MOE_EUNAVAIL, "worker has no cluster communicator");
        return;
    }
    wkr_model *m = wkr_find_model(w, model_name);
    if (!m) {
        rpc_reply_err(c, MOE_ENOTFOUND, "model '%s' not on this worker", model_name);
        return;
    }
    const model_cfg *cfg = &m->cfg;
    const int H = cfg->d_model, F = cfg->d_ff, E = cfg->n_experts, K = cfg->top_k;
    const int W = w->world, bf = cfg->dtype == MOE_BF16;
    const size_t es = bf ? 2 : 4;
    if (layer >= cfg->layers || xt.ndim != 2 || xt.shape[1] != H) {
        rpc_reply_err(c, MOE_EINVAL, "bad layer or x shape for model '%s'", model_name);
        return;
    }
    const int T = (int)xt.shape[0];
    const wkr_layer *L = &m->layers[layer];
    fwd_scratch s;
    memset(&s, 0, sizeof(s));
    double t0 = now_s(), t_gate, t_disp, t_exp, t_comb;
    const size_t S = (size_t)T * K, Tn = T ? (size_t)T : 1;

    /* ---- gate ---- */
    s.x = malloc(Tn * H * sizeof(float));
    s.logits = malloc(Tn * E * sizeof(float));
    s.probs = malloc(Tn * E * sizeof(float));
    s.topk_w = malloc((S ? S : 1) * sizeof(float));
    s.topk_idx = malloc((S ? S : 1) * sizeof(int32_t));
    s.counts = calloc((size_t)E, sizeof(int32_t));
    s.offsets = calloc((size_t)E + 1, sizeof(int32_t));
    s.perm = malloc((S ? S : 1) * sizeof(int32_t));
    if (!s.x || !s.logits || !s.probs || !s.topk_w || !s.topk_idx || !s.counts || !s.offsets ||
        !s.perm) {
        e = MOE_ENOMEM;
        goto fail;
    }
    tensor_to_f32(&xt, s.x, (size_t)T * H);
    if (bf)
        kern_bf16_round_n(s.x, (size_t)T * H);
    kern_router_logits_cpu(s.x, L->wr, T, H, E, s.logits);
    kern_softmax_topk_cpu(s.logits, T, E, K, cfg->renormalize, s.probs, s.topk_idx, s.topk_w);
    kern_layout_cpu(s.topk_idx, T, K, E, s.counts, s.offsets, s.perm, NULL);
    double probs_sum[4096], z_sum = 0;
    for (int e2 = 0; e2 < E; e2++)
        probs_sum[e2] = 0;
    for (int t = 0; t < T; t++) {
        const float *lg = s.logits + (size_t)t * E;
        float mx = lg[0];
        for (int e2 = 1; e2 < E; e2++)
            mx = lg[e2] > mx ? lg[e2] : mx;
        double sum = 0;
        for (int e2 = 0; e2 < E; e2++) {
            sum += exp((double)lg[e2] - mx);
            probs_sum[e2] += s.probs[(size_t)t * E + e2];
        }
        double lse = mx + log(sum);
        z_sum += lse * lse;
    }
    t_gate = now_s();

    /* ---- dispatch ---- */
    size_t send_bytes[256], recv_bytes[256], total = 0;
    for (int q = 0; q < W; q++) {
        int a = placement_first(E, W, q), b = a + placement_count(E, W, q);
        send_bytes[q] = 4 * (size_t)(b - a) + (size_t)(s.offsets[b] - s.offsets[a]) * H * es;
        total += send_bytes[q];
    }
    s.sendbuf = malloc(total ? total : 1);
    if (!s.sendbuf) {
        e = MOE_ENOMEM;
        goto fail;
    }
    uint8_t *p = s.sendbuf;
    for (int q = 0; q < W; q++) {
        int a = placement_first(E, W, q), b = a + placement_count(E, W, q);
        memcpy(p, s.counts + a, 4 * (size_t)(b - a));
        p += 4 * (size_t)(b - a);
        for (int i = s.offsets[a]; i < s.offsets[b]; i++) {
            put_row(p, s.x + (size_t)(s.perm[i] / K) * H, H, bf);
            p += (size_t)H * es;
        }
    }
    e = xchg_alltoallv(w->xc, s.sendbuf, send_bytes, &s.recvbuf, recv_bytes);
    if (e != MOE_OK)
        goto fail_xchg;
    t_disp = now_s();

    /* ---- experts: gather each owned expert's rows over sources ---- */
    const int ne = m->ne;
    int32_t *src_cnt = malloc((size_t)W * (ne ? ne : 1) * sizeof(int32_t)); /* (W, ne) */
    size_t *src_row0 = malloc((size_t)W * sizeof(size_t)); /* byte offset of rows per source */
    int32_t dropped[4096];
    memset(dropped, 0, sizeof(int32_t) * (size_t)E);
    if (!src_cnt || !src_row0) {
        free(src_cnt);
        free(src_row0);
        e = MOE_ENOMEM;
        goto fail;
    }
    size_t off = 0, rows_in = 0;
    for (int q = 0; q < W; q++) {
        size_t need = 4 * (size_t)ne;
        if (recv_bytes[q] < need) {
            free(src_cnt);
            free(src_row0);
            e = MOE_EINTERNAL;
            snprintf(err, sizeof(err), "short dispatch message from rank %d", q);
            goto fail_msg;
        }
        memcpy(src_cnt + (size_t)q * ne, (uint8_t *)s.recvbuf + off, need);
        size_t nrows = 0;
        for (int i = 0; i < ne; i++)
            nrows += (size_t)src_cnt[(size_t)q * ne + i];
        if (recv_bytes[q] != need + nrows * H * es) {
            free(src_cnt);
            free(src_row0);
            e = MOE_EINTERNAL;
            snprintf(err, sizeof(err), "dispatch message from rank %d has %zu bytes, want %zu",
                     q, recv_bytes[q], need + nrows * H * es);
            goto fail_msg;
        }
        src_row0[q] = off + need;
        off += recv_bytes[q];
        rows_in += nrows;
    }
    s.backbuf = malloc(rows_in ? rows_in * H * es : 1);
    size_t back_bytes[256];
    for (int q = 0; q < W; q++) {
        size_t nrows = 0;
        for (int i = 0; i < ne; i++)
            nrows += (size_t)src_cnt[(size_t)q * ne + i];
        back_bytes[q] = nrows * H * es;
    }
    int32_t cap = kern_capacity((float)cfg->capacity_factor, (int)T_total, K, E);
    size_t maxN = 0;
    for (int i = 0; i < ne; i++) {
        size_t n = 0;
        for (int q = 0; q < W; q++)
            n += (size_t)src_cnt[(size_t)q * ne + i];
        maxN = n > maxN ? n : maxN;
    }
    size_t mN = maxN ? maxN : 1;
    s.xe = malloc(mN * H * sizeof(float));
    s.ye = malloc(mN * H * sizeof(float));
    s.ae = malloc(mN * F * sizeof(float));
    s.be = malloc(mN * F * sizeof(float));
    if (!s.backbuf || !s.xe || !s.ye || !s.ae || !s.be) {
        free(src_cnt);
        free(src_row0);
        e = MOE_ENOMEM;
        goto fail;
    }
    /* back offsets: per source, rows of expert i follow those of i-1 */
    size_t *back_pos = malloc((size_t)W * sizeof(size_t));
    size_t *src_pos = malloc((size_t)W * sizeof(size_t));
    size_t acc = 0;
    for (int q = 0; q < W; q++) {
        back_pos[q] = acc;
        acc += back_bytes[q];
        src_pos[q] = src_row0[q];
    }
    const size_t fh = (size_t)F * H;
    for (int i = 0; i < ne; i++) {
        size_t n = 0;
        for (int q = 0; q < W; q++) {
            int32_t k = src_cnt[(size_t)q * ne + i];
            for (int32_t j = 0; j < k; j++) {
                get_row(s.xe + (n + (size_t)j) * H, (uint8_t *)s.recvbuf + src_pos[q] +
                                                        (size_t)j * H * es,
                        H, bf);
            }
            n += (size_t)k;
        }
        size_t kept = n < (size_t)cap ? n : (size_t)cap;
        dropped[m->e0 + i] = (int32_t)(n - kept);
        if (kept)
            kern_expert_ffn_blas(s.xe, (int)kept, H, F, L->w1 + i * fh,
                                 L->w3 ? L->w3 + i * fh : NULL, L->w2 + i * fh,
                                 (kern_act)cfg->act, bf, s.ae, s.be, s.ye);
        if (n > kept)
            memset(s.ye + kept * H, 0, (n - kept) * H * sizeof(float));
        n = 0;
        for (int q = 0; q < W; q++) {
            int32_t k = src_cnt[(size_t)q * ne + i];
            for (int32_t j = 0; j < k; j++)
                put_row(s.backbuf + back_pos[q] + (size_t)j * H * es, s.ye + (n + (size_t)j) * H,
                        H, bf);
            back_pos[q] += (size_t)k * H * es;
            src_pos[q] += (size_t)k * H * es;
            n += (size_t)k;
        }
    }
    free(back_pos);
    free(src_pos);
    free(src_cnt);
    free(src_row0);
    t_exp = now_s();

    /* ---- combine ---- */
    size_t ret_bytes[256];
    e = xchg_alltoallv(w->xc, s.backbuf, back_bytes, &s.retbuf, ret_bytes);
    if (e != MOE_OK)
        goto fail_xchg;
    size_t ret_total = 0;
    for (int q = 0; q < W; q++)
        ret_total += ret_bytes[q];
    if (ret_total != S * H * es) {
        e = MOE_EINTERNAL;
        snprintf(err, sizeof(err), "combine returned %zu bytes, want %zu", ret_total,
                 S * H * es);
        goto fail_msg;
    }
    s.ye_slot = malloc((S ? S : 1) * H * sizeof(float));
    s.y = malloc(Tn * H * sizeof(float));
    if (!s.ye_slot || !s.y) {
        e = MOE_ENOMEM;
        goto fail;
    }
    /* the rows come back in the order they were sent: sorted position i */
    for (size_t i = 0; i < S; i++)
        get_row(s.ye_slot + (size_t)s.perm[i] * H, (uint8_t *)s.retbuf + i * H * es, H, bf);
    kern_combine_cpu(s.ye_slot, s.topk_w, NULL, T, K, H, bf, s.y);
    t_comb = now_s();

    /* ---- reply {y, counts, dropped, probs_sum, z_sum, phase times} ---- */
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 9);
    mp_write_cstr(&wr, "y");
    {
        mp_write_map(&wr, 3);
        mp_write_cstr(&wr, "dtype");
        mp_write_cstr(&wr, moe_dtype_name(xt.dtype));
        mp_write_cstr(&wr, "shape");
        mp_write_array(&wr, 2);
        mp_write_i64(&wr, T);
        mp_write_i64(&wr, H);
        mp_write_cstr(&wr, "data");
        size_t yb = (size_t)T * H * moe_dtype_size(xt.dtype);
        uint8_t *dst = mp_writer_reserve_bin(&wr, (uint32_t)yb);
        if (dst) {
            if (xt.dtype == MOE_F32) {
                memcpy(dst, s.y, yb);
            } else if (xt.dtype == MOE_BF16) {
                for (size_t i = 0; i < (size_t)T * H; i++) {
                    uint16_t h = kern_f32_to_bf16(s.y[i]);
                    memcpy(dst + 2 * i, &h, 2);
                }
            } else {
                for (size_t i = 0; i < (size_t)T * H; i++) {
                    _Float16 h = (_Float16)s.y[i];
                    memcpy(dst + 2 * i, &h, 2);
                }
            }
        }
    }
    mp_write_cstr(&wr, "counts");
    mp_write_bin(&wr, s.counts, (uint32_t)(4 * E));
    mp_write_cstr(&wr, "dropped");
    mp_write_bin(&wr, dropped, (uint32_t)(4 * E));
    mp_write_cstr(&wr, "probs_sum");
    mp_write_bin(&wr, probs_sum, (uint32_t)(8 * E));
    mp_write_cstr(&wr, "z_sum");
    mp_write_f64(&wr, z_sum);
    mp_write_cstr(&wr, "gate_s");
    mp_write_f64(&wr, t_gate - t0);
    mp_write_cstr(&wr, "dispatch_s");
    mp_write_f64(&wr, t_disp - t_gate);
    mp_write_cstr(&wr, "experts_s");
    mp_write_f64(&wr, t_exp - t_disp);
    mp_write_cstr(&wr, "combine_s");
    mp_write_f64(&wr, t_comb - t_exp);
    rpc_reply(c, &wr);
    scratch_free(w, &s);
    return;

fail_xchg:
    LOG_W("forward %s layer %lld: exchange failed: %s", model_name, (long long)layer,
          moe_strerror(e));
    rpc_reply_err(c, MOE_EUNAVAIL, "exchange between workers failed (rank %d): %s", w->rank,
                  moe_strerror(e));
    scratch_free(w, &s);
    return;
fail_msg:
    LOG_E("forward: %s", err);
    rpc_reply_err(c, e, "%s", err);
    scratch_free(w, &s);
    return;
fail:
    rpc_reply_err(c, e, "worker rank %d: %s", w->rank, moe_strerror(e));
    scratch_free(w, &s);
}
