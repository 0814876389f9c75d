/*
 * fanout.c - the lane of a cluster of several workers (fan-out;
 * docs/PROTOCOL.md "Data plane", 6). A client sends the same T rows of an
 * inference forward to every member; each one routes all T tokens (every
 * rank holds the router, and all compute the same routing), runs its own
 * experts on the slots routed to them, and answers the client with those
 * slots' expert rows. The client sums them in the layer's fixed order
 * (common/combine.c), as the last step of the ordered road does. No
 * exchange between workers, so no cluster job order is needed: the
 * coordinator is not asked, and a decode step costs one round trip to the
 * workers, side by side.
 *
 * Bits: the same as the ordered road's for the same request. The router
 * sees the client's rows as the lane does (one request: T_total = T); an
 * expert runs on the same rows in the same order (expert by expert, slots
 * ascending), with the same BLAS call; bf16 expert rows travel as bf16, as
 * the exchange carries them; the shared expert's gated rows of each
 * rank's ordered-road shard of the tokens are computed by that rank (the
 * same GEMM heights) and added by the client after the sum, as
 * kern_shared_forward_cpu adds them.
 *
 * GPU workers (worker/gpu.h): the expert-parallel backend routes all T
 * tokens on its device and runs its experts there (gops->fanout,
 * kcu_ep_forward_local): the rows travel as bf16, as the GEMMs store them,
 * and the client's sum is the device combine's (sum_j bf16(w ye) in slot
 * order, one rounding), so y agrees with the ordered road's to bf16
 * rounding (the decode kernels may round an expert row differently from
 * the owner's GEMMs). The experts backend (a capacity factor, --ep off)
 * routes on the host as a CPU worker and runs its experts on the device
 * (gops->experts_forward), as its ordered road does.
 *
 * Thread: the compute thread (called from wkr_op_forward for a lane run
 * with fanout).
 */
#include <string.h>

#include "common/log.h"
#include "common/placement.h"
#include "worker/fwd.h"
#include "worker/gpu.h"
#include "worker/lane_trace.h"
#include "worker/pool.h"
#include "worker/rows.h"

/* write_rows_bin writes n floats as a bin of dtype dt (f32 or bf16). */
static void write_rows_bin(mp_writer *w, const float *x, size_t n, moe_dtype dt)
{
    size_t es = moe_dtype_size(dt), nb = n * es;
    uint8_t *tmp = wpool_alloc(nb ? nb : 1);
    if (!tmp) {
        w->failed = 1;
        return;
    }
    rows_f32_to_dtype(x, dt, tmp, n);
    mp_write_bin(w, tmp, (uint32_t)nb);
    wpool_free(tmp);
}

/* fanout_out: what a rank answers, however it computed it */
typedef struct fanout_out {
    int32_t *counts;   /* (E) slots routed per expert */
    int32_t *dropped;  /* (E) slots dropped by the capacity (this rank's experts) */
    double *probs_sum; /* (E) */
    double z_sum;
    const float *topk_w;  /* (T*K) */
    const int32_t *slots; /* (n) this rank's experts' slots */
    size_t n;
    const void *rows; /* (n,H) of dtype rdt, or f32 rows (rows_f32) to convert */
    int rows_f32;
    moe_dtype rdt;       /* how the rows travel */
    const float *shared; /* (shn,H) the shared expert's gated rows, or NULL */
    long long sh0, shn;
} fanout_out;

/* fanout_answer writes the client's answer {fanout: {...}, stats} on the
 * ticket, and c's reply with the counts lane.c records */
static void fanout_answer(wkr *w, rpc_call *c, const model_cfg *cfg, int T, dp_batch *batch,
                          const fanout_out *o, const double ph[4])
{
    const int H = cfg->d_model, E = cfg->n_experts, K = cfg->top_k;
    dp_ticket *tk = batch->tk[0];
    mp_writer pw; /* the answer, written once (the rows straight from where they are) */
    mp_writer_init(&pw);
    if (dp_answer_begin(tk, &pw, 2)) { /* not refused (a NaN or Inf row answers with its error) */
        mp_write_cstr(&pw, "fanout");
        mp_write_map(&pw, o->shared ? 8 : 6);
        mp_write_cstr(&pw, "rank");
        mp_write_i64(&pw, w->rank);
        mp_write_cstr(&pw, "top_k");
        mp_write_i64(&pw, K);
        mp_write_cstr(&pw, "dtype");
        mp_write_cstr(&pw, moe_dtype_name(o->rdt));
        mp_write_cstr(&pw, "slots");
        mp_write_bin(&pw, o->slots, (uint32_t)(o->n * sizeof(int32_t)));
        mp_write_cstr(&pw, "rows");
        if (o->rows_f32)
            write_rows_bin(&pw, o->rows, o->n * H, o->rdt);
        else
            mp_write_bin(&pw, o->rows, (uint32_t)(o->n * H * moe_dtype_size(o->rdt)));
        mp_write_cstr(&pw, "topk_w");
        mp_write_bin(&pw, o->topk_w, (uint32_t)((size_t)T * K * sizeof(float)));
        if (o->shared) {
            mp_write_cstr(&pw, "shared_row0");
            mp_write_i64(&pw, o->sh0);
            mp_write_cstr(&pw, "shared");
            write_rows_bin(&pw, o->shared, (size_t)o->shn * H, o->rdt);
        }
        wkr_lane_stats_write(&pw, cfg, T, o->counts, o->dropped, o->probs_sum, o->z_sum, NULL, ph);
        dp_answer_end(tk, &pw);
    }
    mp_writer_fini(&pw);

    /* the local call's reply: what lane.c counts (counts on rank 0 only) */
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 6);
    mp_write_cstr(&wr, "counts");
    mp_write_bin(&wr, o->counts, (uint32_t)(4 * E));
    mp_write_cstr(&wr, "dropped");
    mp_write_bin(&wr, o->dropped, (uint32_t)(4 * E));
    mp_write_cstr(&wr, "gate_s");
    mp_write_f64(&wr, ph[0]);
    mp_write_cstr(&wr, "dispatch_s");
    mp_write_f64(&wr, ph[1]);
    mp_write_cstr(&wr, "experts_s");
    mp_write_f64(&wr, ph[2]);
    mp_write_cstr(&wr, "combine_s");
    mp_write_f64(&wr, ph[3]);
    rpc_reply(c, &wr);
}

/* fanout_device: the expert-parallel GPU backend's fan-out (gops->fanout):
 * routing and this rank's experts on the device; x (T,H) host, f32 or bf16
 * (xdt). The rows stay where the backend left them (o->rows: valid until
 * the layer's next call); o's other arrays are pool memory the caller frees. */
static moe_err fanout_device(wkr *w, wkr_model *m, int layer, int T, const void *x, moe_dtype xdt,
                             fanout_out *o, double ph[4], char *err, size_t errlen)
{
    const model_cfg *cfg = &m->cfg;
    const int H = cfg->d_model, K = cfg->top_k;
    const size_t S = (size_t)T * K;
    wkr_gpu_fanout g;
    memset(&g, 0, sizeof(g));
    g.counts = o->counts;
    g.probs_sum = o->probs_sum;
    g.topk_w = wpool_alloc(S * sizeof(float));
    g.slots = wpool_alloc(S * sizeof(int32_t));
    /* the shared expert's rows of this rank's ordered-road shard */
    g.sh0 = (int)shard_first(T, w->world, w->rank);
    g.shn = cfg->shared_d_ff > 0 ? (int)shard_first(T, w->world, w->rank + 1) - g.sh0 : 0;
    g.ys = g.shn > 0 ? wpool_alloc((size_t)g.shn * H * sizeof(float)) : NULL;
    o->topk_w = g.topk_w;
    o->slots = g.slots;
    o->shared = g.shn > 0 ? g.ys : NULL;
    if (!g.topk_w || !g.slots || (g.shn > 0 && !g.ys))
        return MOE_ENOMEM;
    double t0 = fwd_now_s();
    moe_err e = m->gpu_ops->fanout(w, m, layer, T, x, xdt, &g, err, errlen);
    ph[2] = fwd_now_s() - t0; /* routing and experts: one device call */
    o->z_sum = g.z_sum;
    o->n = (size_t)g.n;
    o->rows = g.ye_at;
    o->rows_f32 = 0;
    o->rdt = MOE_BF16; /* the device's expert rows are bf16 */
    o->sh0 = g.sh0;
    o->shn = g.shn;
    return e;
}

void wkr_forward_fanout(wkr *w, rpc_call *c, wkr_model *m, int layer, dp_batch *batch)
{
    const model_cfg *cfg = &m->cfg;
    const int H = cfg->d_model, F = cfg->d_ff, E = cfg->n_experts, K = cfg->top_k;
    const int bf = cfg->dtype == MOE_BF16;
    const wkr_layer *L = &m->layers[layer];
    const wkr_gpu_ops *gops = m->gpu_ops;
    const int T = (int)batch->x.shape[0];
    const size_t Tn = T ? (size_t)T : 1;
    moe_err e = MOE_OK;
    char err[256] = "";
    wkr_fwd_state *st = wpool_calloc(1, sizeof(*st));
    double *probs_sum = wpool_calloc((size_t)E, sizeof(double)), z_sum = 0;
    int32_t *dropped = wpool_calloc((size_t)E, sizeof(int32_t));
    int32_t *slots = NULL; /* (mine) the slots of this rank's experts, in order */
    float *ye = NULL, *shared = NULL;
    fanout_out o;
    memset(&o, 0, sizeof(o));
    if (!st || !probs_sum || !dropped) {
        e = MOE_ENOMEM;
        goto fail;
    }
    if (batch->n != 1 || !batch->tk[0] || batch->x_device) {
        e = MOE_EINVAL;
        snprintf(err, sizeof(err), "a fan-out forward takes one request's rows on the host");
        goto fail_msg;
    }
    st->model = m;
    st->layer = layer;
    st->T = T;
    st->T_total = T;
    double t0 = fwd_now_s();
    lane_trace(LT_FWD0);

    /* a bf16 model's finite bf16 rows go to the device as they came;
     * otherwise the client's rows as f32 (a decode batch: a few rows), bf16
     * models' rounded, and a NaN or Inf row refuses its request */
    const int raw = gops && gops->fanout && bf && batch->x.dtype == MOE_BF16 &&
                    rows_first_nonfinite_bf16(batch->x.data, T, H) == T;
    if (!raw) {
        st->x = wpool_alloc(Tn * H * sizeof(float));
        if (!st->x) {
            e = MOE_ENOMEM;
            goto fail;
        }
        rows_tensor_to_f32(&batch->x, st->x, (size_t)T * H);
        if (bf)
            kern_bf16_round_n(st->x, (size_t)T * H);
        dp_batch_refuse_nonfinite(batch, st->x, H);
    }

    if (gops && gops->fanout && T > w->gpu_max_tokens) {
        /* more rows than the device layer holds ($MOE_FANOUT_ROWS raised
         * past --gpu-max-tokens): the client takes the ordered road for
         * this call (it retries a lane or fan-out forward answered
         * not_found there), where the rows are split over the workers */
        e = MOE_ENOTFOUND;
        snprintf(err, sizeof(err),
                 "a fan-out of %d rows exceeds this GPU worker's --gpu-max-tokens=%lld: the "
                 "ordered road takes it",
                 T, w->gpu_max_tokens);
        goto fail_msg;
    }
    if (gops && gops->fanout) { /* routing and experts on the device */
        double ph[4] = {0, 0, 0, 0};
        o.counts = wpool_calloc((size_t)E, sizeof(int32_t));
        o.dropped = dropped;
        o.probs_sum = probs_sum;
        if (!o.counts) {
            e = MOE_ENOMEM;
            goto fail;
        }
        e = raw ? fanout_device(w, m, layer, T, batch->x.data, MOE_BF16, &o, ph, err, sizeof(err))
                : fanout_device(w, m, layer, T, st->x, MOE_F32, &o, ph, err, sizeof(err));
        lane_trace(LT_FWD1);
        if (e == MOE_OK) {
            ph[0] = 0;
            ph[3] = fwd_now_s() - t0 - ph[2];
            fanout_answer(w, c, cfg, T, batch, &o, ph);
        }
        wpool_free(o.counts);
        wpool_free((void *)o.topk_w);
        wpool_free((void *)o.slots);
        wpool_free((void *)o.shared); /* o.rows: the backend's */
        if (e == MOE_OK)
            goto out;
        if (err[0])
            goto fail_msg;
        goto fail;
    }

    /* ---- gate: every token, as every other rank does ---- */
    if ((e = fwd_gate(L, st, w->world, probs_sum, &z_sum)) != MOE_OK)
        goto fail;
    double t_gate = fwd_now_s();

    /* ---- this rank's experts on their slots ---- */
    const int e0 = m->e0, ne = m->ne;
    const size_t first = (size_t)st->offsets[e0];
    const size_t mine = (size_t)st->offsets[e0 + ne] - first;
    const size_t nm = mine ? mine : 1;
    int32_t cap = kern_capacity((float)cfg->capacity_factor, T, K, E);
    slots = wpool_alloc(nm * sizeof(int32_t));
    st->xe = wpool_alloc(nm * H * sizeof(float));
    ye = wpool_alloc(nm * H * sizeof(float));
    if (!slots || !st->xe || !ye) {
        e = MOE_ENOMEM;
        goto fail;
    }
    for (size_t j = 0; j < mine; j++) {
        int32_t s = st->perm[first + j];
        slots[j] = s;
        memcpy(st->xe + j * H, st->x + (size_t)(s / K) * H, (size_t)H * sizeof(float));
    }
    st->kept = wpool_alloc((size_t)(ne ? ne : 1) * sizeof(int32_t));
    if (!st->kept) {
        e = MOE_ENOMEM;
        goto fail;
    }
    for (int i = 0; i < ne; i++) {
        int32_t n = st->counts[e0 + i];
        st->kept[i] = n < cap ? n : cap;
        dropped[e0 + i] = n - st->kept[i];
    }
    if (gops && gops->experts_forward) { /* the experts backend: rows on the device */
        e = gops->experts_forward(m, layer, 0, st->xe, st->counts + e0, st->kept, ye, 0);
        if (e != MOE_OK)
            goto fail;
    } else { /* the same call as the ordered road's owner (worker/forward.c) */
        st->ae = wpool_alloc(nm * F * sizeof(float));
        st->be = act_gated(cfg->act) ? wpool_alloc(nm * F * sizeof(float)) : NULL;
        float *h = wpool_alloc(nm * (size_t)(F > 0 ? F : 1) * sizeof(float));
        if (!st->ae || (act_gated(cfg->act) && !st->be) || !h) {
            wpool_free(h);
            e = MOE_ENOMEM;
            goto fail;
        }
        int rc = kern_experts_ffn_blas(st->xe, st->counts + e0, st->kept, ne, H, F, L->w1, L->w3,
                                       L->w2, (kern_act)cfg->act, bf, st->ae, st->be, h, ye, NULL);
        wpool_free(h);
        if (rc != 0) {
            e = MOE_ENOMEM;
            goto fail;
        }
    }
    double t_exp = fwd_now_s();
    /* the shared expert's gated rows of this rank's shard of the tokens
     * (the ordered road's: its own tokens there) */
    const long long sh0 = shard_first(T, w->world, w->rank);
    const long long shn = shard_first(T, w->world, w->rank + 1) - sh0;
    if (cfg->shared_d_ff > 0 && shn > 0) {
        shared = wpool_alloc((size_t)shn * H * sizeof(float));
        if (!shared) {
            e = MOE_ENOMEM;
            goto fail;
        }
        kern_shared_rows_cpu(st->x + (size_t)sh0 * H, (int)shn, H, cfg->shared_d_ff, L->ws1, L->ws3,
                             L->ws2, L->wsg, (kern_act)cfg->act, bf, 1, shared);
    }
    double t_comb = fwd_now_s();
    lane_trace(LT_FWD1);

    double ph[4] = {t_gate - t0, 0, t_exp - t_gate, t_comb - t_exp};
    o.counts = st->counts;
    o.dropped = dropped;
    o.probs_sum = probs_sum;
    o.z_sum = z_sum;
    o.topk_w = st->topk_w;
    o.slots = slots;
    o.n = mine;
    o.rows = ye;
    o.rows_f32 = 1;
    o.rdt = bf ? MOE_BF16 : MOE_F32; /* as the exchange carries them */
    o.shared = shared;
    o.sh0 = sh0;
    o.shn = shn;
    fanout_answer(w, c, cfg, T, batch, &o, ph);
    goto out;

fail_msg:
    LOG_W("fan-out forward: %s", err);
    dp_batch_fail(batch, e, err);
    rpc_reply_err(c, e, "%s", err);
    goto out;
fail:
    dp_batch_fail(batch, e, moe_strerror(e));
    rpc_reply_err(c, e, "worker rank %d: %s", w->rank, moe_strerror(e));
out:
    wkr_fwd_state_free(st);
    wpool_free(probs_sum);
    wpool_free(dropped);
    wpool_free(slots);
    wpool_free(ye);
    wpool_free(shared);
}
