/*
 * backward.c - one MoE layer backward for a train forward's handle: combine
 * backward at the origin, expert gradients rows sent to the owners (same
 * order as dispatch), expert backward on the owners (weight gradients
 * accumulated), input-gradient rows sent back, summed per token in slot
 * order, plus the router gradient (aux and z losses included).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/pool.h"
#include "worker/fwd.h"
#include "worker/gpu.h"
#include "common/log.h"
#include "common/params.h"
#include "worker/rows.h"

/* slot_sum_job: dx (T,H) += the token's K slot rows of dx_slot (S,H), in
 * slot order; split over tokens (kern_par_for), so the sums keep their
 * one-thread order and bits. */
typedef struct slot_sum_job {
    const float *dx_slot;
    int K, H;
    float *dx;
} slot_sum_job;

static void slot_sum_part(void *p, size_t t0, size_t t1)
{
    const slot_sum_job *j = p;
    for (size_t t = t0; t < t1; t++)
        for (int k = 0; k < j->K; k++) {
            const float *src = j->dx_slot + (t * j->K + k) * j->H;
            float *d = j->dx + t * j->H;
            for (int h = 0; h < j->H; h++)
                d[h] += src[h];
        }
}

void wkr_op_backward(wkr *w, rpc_call *c)
{
    int64_t handle = 0;
    moe_tensor dyt;
    char err[256] = "", dtname[8] = "";
    mp_reader rpieces;
    dp_batch batch;
    memset(&dyt, 0, sizeof(dyt));
    memset(&batch, 0, sizeof(batch));
    pspec sp[] = {
        {"handle", P_INT, &handle, true, 0, 9e18, 0, false},
        {"dy", P_TENSOR, &dyt, false, 0, 0, 0, false},
        {"pieces", P_RAW, &rpieces, false, 0, 0, 0, false},
        {"dtype", P_STR, dtname, false, 0, 0, sizeof(dtname), false},
    };
    if (!wkr_parse_or_reply(c, sp, 4) || !wkr_xc_or_reply(w, c))
        return;
    moe_err e = MOE_OK;
    wkr_handle_expire(w);
    wkr_fwd_state *st = wkr_handle_take(w, (uint64_t)handle);
    const int direct = sp[2].seen;
    int rows_ok = 1;
    if (direct) { /* dy from the clients (data plane) */
        moe_dtype dt = MOE_F32;
        e = moe_dtype_parse(dtname, strlen(dtname), &dt);
        if (e == MOE_OK)
            e = dp_batch_gather(&w->dp, &rpieces, dt, st ? st->model->cfg.d_model : 0,
                                rpc_now_ns() + (uint64_t)w->data_wait_ms * 1000000ull, 0, &batch,
                                err, sizeof(err));
        rows_ok = e == MOE_OK && batch.missing == 0;
        dyt = batch.x;
    }
    /* every rank must hold the handle and its rows, or none goes on (no
     * collective may be left waiting): 1 ok, 0 no handle, 2 rows missing */
    const int W = w->world;
    int32_t have = st == NULL ? 0
                   : rows_ok  ? 1
                              : 2,
            *all_have = wpool_alloc((size_t)W * sizeof(int32_t));
    if (!all_have) {
        wkr_fwd_state_free(st);
        dp_batch_fail(&batch, MOE_ENOMEM, "out of memory");
        dp_batch_free(&w->dp, &batch);
        rpc_reply_err(c, MOE_ENOMEM, "out of memory");
        return;
    }
    e = xchg_allgather(w->xc, &have, sizeof(have), all_have);
    int expired = 0, missing = 0;
    for (int q = 0; q < W && e == MOE_OK; q++) {
        expired |= all_have[q] == 0;
        missing |= all_have[q] == 2;
    }
    wpool_free(all_have);
    if (e != MOE_OK || expired || missing) {
        wkr_fwd_state_free(st);
        if (e != MOE_OK) {
            dp_batch_fail(&batch, MOE_EUNAVAIL, "exchange between workers failed");
            rpc_reply_err(c, MOE_EUNAVAIL, "exchange between workers failed: %s", moe_strerror(e));
        } else if (expired) {
            dp_batch_fail(&batch, MOE_EEXPIRED, "handle expired");
            rpc_reply_err(c, MOE_EEXPIRED,
                          "handle %lld expired on a worker (too old, or too many "
                          "forwards without backward)",
                          (long long)handle);
        } else {
            dp_batch_fail(&batch, MOE_EUNAVAIL, "dy rows did not reach every worker");
            rpc_reply_err(c, MOE_EUNAVAIL, "the dy rows of handle %lld did not reach every worker",
                          (long long)handle);
        }
        dp_batch_free(&w->dp, &batch);
        return;
    }
    wkr_model *m = st->model;
    const model_cfg *cfg = &m->cfg;
    const int H = cfg->d_model, F = cfg->d_ff, E = cfg->n_experts, K = cfg->top_k, T = st->T;
    const int bf = cfg->dtype == MOE_BF16, ne = m->ne;
    const size_t S = (size_t)T * K, Tn = T ? (size_t)T : 1, es = bf ? 2 : 4;
    if (dyt.ndim != 2 || dyt.shape[0] != T || dyt.shape[1] != H) {
        wkr_fwd_state_free(st);
        dp_batch_fail(&batch, MOE_EINVAL, "dy has the wrong shape");
        dp_batch_free(&w->dp, &batch);
        rpc_reply_err(c, MOE_EINVAL, "dy must have shape (%d, %d)", T, H);
        return;
    }
    float *dy = wpool_alloc(Tn * H * sizeof(float)),
          *dye = wpool_alloc((S ? S : 1) * H * sizeof(float));
    float *dw = wpool_alloc((S ? S : 1) * sizeof(float)), *dx = wpool_calloc(Tn * H, sizeof(float));
    size_t nin = st->n_in ? st->n_in : 1;
    float *dye_e = wpool_alloc(nin * H * sizeof(float)),
          *dx_e = wpool_calloc(nin * H, sizeof(float));
    float *dx_slot = wpool_alloc((S ? S : 1) * H * sizeof(float));
    uint8_t *sendbuf = NULL, *backbuf = NULL;
    void *recvbuf = NULL, *retbuf = NULL;
    size_t send_bytes[256], recv_bytes[256], back_bytes[256], ret_bytes[256], row0[256];
    if (!dy || !dye || !dw || !dx || !dye_e || !dx_e || !dx_slot) {
        e = MOE_ENOMEM;
        goto fail;
    }
    rows_tensor_to_f32(&dyt, dy, (size_t)T * H);
    const wkr_gpu_ops *gops = m->gpu_ops;
    if (gops && gops->whole_layer) {
        /* the whole layer on the device (over NCCL: every rank runs its part) */
        e = gops->backward(w, m, st->layer, st->handle, T, st->x, dy, dx, err, sizeof(err));
        if (e == MOE_EUNAVAIL && gops->collective)
            goto fail_xchg;
        if (e != MOE_OK)
            goto fail_msg;
        m->has_grads = 1;
        goto reply;
    }
    kern_combine_backward_par(dy, st->ye_slot, st->topk_w, NULL, T, K, H, dye, dw);

    /* expert output gradients to the owners, in dispatch order */
    if (fwd_pack_by_owner(st, W, E, H, K, dye, 0, 0, bf, &sendbuf, send_bytes) == (size_t)-1) {
        e = MOE_ENOMEM;
        goto fail;
    }
    e = xchg_alltoallv(w->xc, sendbuf, send_bytes, &recvbuf, recv_bytes);
    if (e != MOE_OK)
        goto fail_xchg;
    size_t off = 0;
    for (int q = 0; q < W; q++) {
        size_t rows = 0;
        for (int i = 0; i < ne; i++)
            rows += (size_t)st->src_cnt[(size_t)q * ne + i];
        if (recv_bytes[q] != rows * H * es) {
            e = MOE_EINTERNAL;
            snprintf(err, sizeof(err), "backward rows from rank %d: %zu bytes, want %zu", q,
                     recv_bytes[q], rows * H * es);
            goto fail_msg;
        }
        row0[q] = off;
        off += recv_bytes[q];
    }
    fwd_owner_gather(st, W, recvbuf, row0, H, bf, dye_e);

    /* expert backward on kept rows; dropped rows pass no gradient */
    wkr_param *lp = wkr_layer_params(m, st->layer);
    int nmat = act_gated(cfg->act) ? 3 : 2;
    const wkr_layer *L = &m->layers[st->layer];
    const size_t fh = (size_t)F * H;
    size_t n0 = 0;
    const int dev_experts = gops && gops->experts_backward;
    if (dev_experts) {
        int32_t *n = wpool_alloc((size_t)(ne ? ne : 1) * sizeof(int32_t));
        e = n ? MOE_OK : MOE_ENOMEM;
        for (int i = 0; e == MOE_OK && i < ne; i++) {
            n[i] = 0;
            for (int q = 0; q < W; q++)
                n[i] += st->src_cnt[(size_t)q * ne + i];
        }
        /* recomputes the forward when another one ran since this one */
        if (e == MOE_OK)
            e = gops->experts_backward(m, st->layer, st->handle, st->xe, dye_e, n, st->kept, dx_e);
        wpool_free(n);
        if (e != MOE_OK) {
            snprintf(err, sizeof(err), "GPU expert backward failed: %s", moe_strerror(e));
            goto fail_msg;
        }
    }
    for (int i = 0; i < ne && !dev_experts; i++) {
        if (xchg_aborted()) { /* given up (a member is gone): the return cannot complete */
            e = MOE_EUNAVAIL;
            goto fail_xchg;
        }
        size_t n = 0;
        for (int q = 0; q < W; q++)
            n += (size_t)st->src_cnt[(size_t)q * ne + i];
        int kept = st->kept[i];
        wkr_param *pw1 = &lp[1 + i * nmat], *pw3 = nmat == 3 ? &lp[2 + i * nmat] : NULL;
        wkr_param *pw2 = &lp[nmat + i * nmat];
        if (kept)
            kern_expert_ffn_backward_blas(
                st->xe + n0 * H, st->ae + n0 * F, st->be ? st->be + n0 * F : NULL, dye_e + n0 * H,
                kept, H, F, L->w1 + i * fh, L->w3 ? L->w3 + i * fh : NULL, L->w2 + i * fh,
                (kern_act)cfg->act, dx_e + n0 * H, pw1->grad, pw3 ? pw3->grad : NULL, pw2->grad);
        n0 += n;
    }

    /* input gradients back to the origins */
    if (fwd_owner_scatter(st, W, H, dx_e, bf, &backbuf, back_bytes) == (size_t)-1) {
        e = MOE_ENOMEM;
        goto fail;
    }
    e = xchg_alltoallv(w->xc, backbuf, back_bytes, &retbuf, ret_bytes);
    if (e != MOE_OK)
        goto fail_xchg;
    size_t ret_total = 0;
    for (int q = 0; q < W; q++)
        ret_total += ret_bytes[q];
    if (ret_total != S * H * es) {
        e = MOE_EINTERNAL;
        snprintf(err, sizeof(err), "backward returned %zu bytes, want %zu", ret_total, S * H * es);
        goto fail_msg;
    }
    fwd_unpack_sorted(st, retbuf, H, bf, dx_slot);
    slot_sum_job sj = {dx_slot, K, H, dx};
    kern_par_for((size_t)T, KERN_PAR_GRAIN / ((size_t)K * H) + 1, slot_sum_part, &sj);
    kern_route_cfg rc = fwd_route_cfg(cfg, L);
    kern_route_backward_cpu(st->x, L->wr, st->logits, st->probs, st->topk_idx, dw, T, H, E, K, &rc,
                            st->counts_global, st->T_total, (float)cfg->aux_loss_coef,
                            (float)cfg->z_loss_coef, lp[0].grad, dx);
    if (cfg->shared_d_ff > 0) {
        /* the shared expert on this rank's tokens; its gradients are
         * all-reduced at the step like the router's */
        float *dws1, *dws3, *dws2, *dwsg;
        fwd_shared_grads(m, st->layer, &dws1, &dws3, &dws2, &dwsg);
        e = kern_shared_backward_cpu(st->x, dy, T, H, cfg->shared_d_ff, L->ws1, L->ws3, L->ws2,
                                     L->wsg, (kern_act)cfg->act, bf, 1, dx, dws1, dws3, dws2, dwsg);
        if (e != MOE_OK)
            goto fail;
    }
    m->has_grads = 1;

reply:;
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 1);
    if (direct) {
        dp_batch_answer_f32(&batch, dx, H);
        mp_write_cstr(&wr, "missing");
        dp_batch_write_missing(&wr, &batch);
    } else {
        mp_write_cstr(&wr, "dx");
        rows_write_tensor(&wr, dyt.dtype, dx, T, H);
    }
    rpc_reply(c, &wr);
    goto out;

fail_xchg:
    LOG_W("backward: exchange failed: %s", moe_strerror(e));
    dp_batch_fail(&batch, MOE_EUNAVAIL, "exchange between workers failed");
    rpc_reply_err(c, MOE_EUNAVAIL, "exchange between workers failed (rank %d): %s", w->rank,
                  moe_strerror(e));
    goto out;
fail_msg:
    LOG_E("backward: %s", err);
    dp_batch_fail(&batch, e, err);
    rpc_reply_err(c, e, "%s", err);
    goto out;
fail:
    dp_batch_fail(&batch, e, moe_strerror(e));
    rpc_reply_err(c, e, "worker rank %d: %s", w->rank, moe_strerror(e));
out:
    dp_batch_free(&w->dp, &batch);
    wkr_fwd_state_free(st);
    wpool_free(dy);
    wpool_free(dye);
    wpool_free(dw);
    wpool_free(dx);
    wpool_free(dye_e);
    wpool_free(dx_e);
    wpool_free(dx_slot);
    wpool_free(sendbuf);
    wpool_free(backbuf);
    if (recvbuf)
        xchg_free(w->xc, recvbuf);
    if (retbuf)
        xchg_free(w->xc, retbuf);
}
