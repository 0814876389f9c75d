/*
 * train.c - training at the coordinator: handles of train forwards,
 * backward (dy sharded like x, dx gathered like y) and optimizer.step.
 * Handles live in a ring indexed by id; one is used once, and expires after
 * handle_ttl_ms or when more than max_handles newer ones exist (the workers
 * apply the same bounds to what they keep).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/coord.h"
#include "common/log.h"
#include "common/params.h"
#include "common/placement.h"

/* lookup_handle: the live handle, or an error with a message. */
static coord_handle *lookup_handle(coord *c, uint64_t id, moe_err *e, char *err, size_t len)
{
    coord_handle *h = &c->handles[id % COORD_HANDLE_RING];
    if (id == 0 || id > c->next_handle || h->id != id) {
        *e = id > 0 && id <= c->next_handle ? MOE_EEXPIRED : MOE_ENOTFOUND;
        snprintf(err, len,
                 *e == MOE_EEXPIRED ? "handle %llu expired (too old)" : "unknown handle %llu",
                 (unsigned long long)id);
        return NULL;
    }
    /* a re-formation first: a backward of an older generation's handle,
     * used there or not (libmoe retries a call the lost generation answered
     * unavailable), can only be expired - its forward's state is gone */
    if (h->generation != c->generation) {
        h->state = H_EXPIRED;
        *e = MOE_EEXPIRED;
        snprintf(err, len, "handle %llu expired: the cluster re-formed since its forward",
                 (unsigned long long)id);
        return NULL;
    }
    if (h->state == H_USED) {
        *e = MOE_EPRECOND;
        snprintf(err, len, "handle %llu was already used by a backward", (unsigned long long)id);
        return NULL;
    }
    uint64_t age = rpc_now_ns() - h->created_ns;
    if (h->state == H_EXPIRED || age > (uint64_t)c->handle_ttl_ms * 1000000ull ||
        c->next_handle - id >= (uint64_t)c->max_handles) {
        h->state = H_EXPIRED;
        *e = MOE_EEXPIRED;
        snprintf(err, len,
                 "handle %llu expired (after %lld ms or %lld newer train forwards without "
                 "backward)",
                 (unsigned long long)id, c->handle_ttl_ms, c->max_handles);
        return NULL;
    }
    return h;
}

/* coord_gather_rows writes the tensor `key` of every worker's reply, in rank
 * order, as one (T, H) tensor of the input's dtype. */
moe_err coord_gather_rows(coord *c, coord_job *j, const char *key, mp_writer *w, char *err,
                          size_t errlen)
{
    const int W = j->nsent;
    const int64_t T = j->x.shape[0], H = j->x.shape[1];
    moe_tensor *parts = calloc((size_t)W, sizeof(moe_tensor));
    if (!parts)
        return MOE_ENOMEM;
    for (int r = 0; r < W; r++) {
        const moe_reply *rep = j->replies[r];
        mp_reader rd;
        uint32_t n;
        int found = 0;
        mp_reader_init(&rd, rep->buf + rep->result_off, rep->len - rep->result_off);
        if (mp_read_map(&rd, &n, NULL) == MOE_OK)
            for (uint32_t i = 0; i < n; i++) {
                const char *k;
                uint32_t kl;
                if (mp_read_str(&rd, &k, &kl, NULL) != MOE_OK)
                    break;
                if (mp_str_eq(k, kl, key)) {
                    found = moe_tensor_read(&rd, &parts[r], NULL) == MOE_OK;
                    break;
                }
                if (mp_skip(&rd, NULL) != MOE_OK)
                    break;
            }
        int64_t rows = shard_first(T, W, r + 1) - shard_first(T, W, r);
        if (!found || parts[r].ndim != 2 || parts[r].shape[0] != rows || parts[r].shape[1] != H ||
            parts[r].dtype != j->x.dtype) {
            snprintf(err, errlen, "worker rank %d returned no valid '%s' shard", r, key);
            free(parts);
            return MOE_EINTERNAL;
        }
    }
    mp_write_map(w, 3);
    mp_write_cstr(w, "dtype");
    mp_write_cstr(w, moe_dtype_name(j->x.dtype));
    mp_write_cstr(w, "shape");
    mp_write_array(w, 2);
    mp_write_i64(w, T);
    mp_write_i64(w, H);
    mp_write_cstr(w, "data");
    uint8_t *dst = mp_writer_reserve_bin(w, (uint32_t)j->x.nbytes);
    for (int r = 0; dst && r < W; r++) {
        memcpy(dst, parts[r].data, parts[r].nbytes);
        dst += parts[r].nbytes;
    }
    free(parts);
    (void)c;
    return MOE_OK;
}

int coord_reply_has_missing(const moe_reply *rep)
{
    mp_reader rd;
    uint32_t n, nm;
    mp_reader_init(&rd, rep->buf + rep->result_off, rep->len - rep->result_off);
    if (mp_read_map(&rd, &n, NULL) != MOE_OK)
        return 1;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(&rd, &k, &kl, NULL) != MOE_OK)
            return 1;
        if (mp_str_eq(k, kl, "missing"))
            return mp_read_array(&rd, &nm, NULL) != MOE_OK || nm > 0;
        if (mp_skip(&rd, NULL) != MOE_OK)
            return 1;
    }
    return 0;
}

void coord_backward(coord *c, rpc_call *call)
{
    uint64_t hid = 0;
    moe_tensor dy;
    char err[256];
    mp_reader rdirect;
    memset(&dy, 0, sizeof(dy));
    pspec sp[] = {
        {"handle", P_U64, &hid, true, 0, 0, 0, false}, /* any uint: unknown is not_found */
        {"dy", P_TENSOR, &dy, false, 0, 0, 0, false},
        {"direct", P_RAW, &rdirect, false, 0, 0, 0, false},
    };
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 3, err, sizeof(err));
    if (e == MOE_OK && sp[1].seen == sp[2].seen) {
        e = MOE_EINVAL;
        snprintf(err, sizeof(err),
                 "backward needs dy (rows in the request) or direct (rows sent "
                 "to the workers), not %s",
                 sp[1].seen ? "both" : "neither");
    }
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    coord_handle *h = lookup_handle(c, hid, &e, err, sizeof(err));
    if (!h) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    if (coord_train_refused(c, h->model, call))
        return;
    coord_job dj;
    memset(&dj, 0, sizeof(dj));
    dj.model = h->model;
    dj.kind = JOB_BACKWARD;
    dj.ops = &coord_job_backward;
    if (sp[2].seen) {
        int64_t T = -1;
        e = coord_parse_direct(c, &rdirect, &dj, &T, err, sizeof(err));
        if (e == MOE_OK && T >= 0 && T != h->T) {
            e = MOE_EINVAL;
            snprintf(err, sizeof(err), "dy must have shape (T=%lld, d_model=%d) like the forward",
                     (long long)h->T, h->model->cfg.d_model);
        }
        if (e != MOE_OK) {
            rpc_reply_err(call, e, "%s", err);
            return;
        }
        dy.dtype = dj.x.dtype;
        dy.ndim = 2;
        dy.shape[0] = h->T;
        dy.shape[1] = h->model->cfg.d_model;
        dy.nbytes = (size_t)h->T * (size_t)h->model->cfg.d_model * moe_dtype_size(dy.dtype);
    }
    if (dy.ndim != 2 || dy.shape[0] != h->T || dy.shape[1] != h->model->cfg.d_model) {
        rpc_reply_err(call, MOE_EINVAL, "dy must have shape (T=%lld, d_model=%d) like the forward",
                      (long long)h->T, h->model->cfg.d_model);
        return;
    }
    coord_job *j = coord_job_new(&coord_job_backward, call, h->model);
    if (!j)
        return;
    j->layer = h->layer;
    j->x = dy;
    j->xrows = dy.shape[0];
    j->handle = h;
    j->direct = dj.direct;
    j->tk_cid = dj.tk_cid;
    j->tk_seq = dj.tk_seq;
    j->dgen = dj.dgen;
    if (coord_job_enqueue(c, j) != MOE_OK)
        return;
    h->state = H_USED;
    coord_job_pump(c);
}

static void backward_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    (void)first, (void)bad_rank;
    char err[256];
    for (int r = 0; r < j->nsent; r++)
        if (j->errs[r] != MOE_OK) {
            const int gone = coord_job_gone(j, r);
            rpc_reply_err_gone(j->call, j->errs[r], &gone, gone >= 0,
                               "backward: worker rank %d: %s", r,
                               j->replies[r] ? j->replies[r]->message : moe_strerror(j->errs[r]));
            coord_count_error(c, j->errs[r]);
            return;
        }
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, j->call->req.msgid);
    mp_write_map(&w, 1);
    if (j->direct) { /* dx went from the workers to the client */
        for (int r = 0; r < j->nsent; r++)
            if (coord_reply_has_missing(j->replies[r])) {
                mp_writer_fini(&w);
                rpc_reply_err(j->call, MOE_EUNAVAIL,
                              "the dy rows did not reach worker rank %d in time; the gradients "
                              "of this backward were not accumulated there",
                              r);
                coord_count_error(c, MOE_EUNAVAIL);
                return;
            }
        mp_write_cstr(&w, "direct");
        mp_write_bool(&w, true);
        j->model->pending_grads++;
        rpc_reply(j->call, &w);
        return;
    }
    mp_write_cstr(&w, "dx");
    moe_err e = coord_gather_rows(c, j, "dx", &w, err, sizeof(err));
    if (e != MOE_OK) {
        mp_writer_fini(&w);
        rpc_reply_err(j->call, e, "%s", err);
        return;
    }
    j->model->pending_grads++;
    rpc_reply(j->call, &w);
}

/* step_refused answers call failed_precondition and returns 1 when the
 * model is not at expect (>= 0) or has no gradients to apply. */
static int step_refused(coord *c, const coord_model *m, int64_t expect, rpc_call *call)
{
    /* idempotency guard: a step resent after a lost reply must not apply twice */
    if (expect >= 0 && expect != m->step) {
        rpc_reply_err(call, MOE_EPRECOND,
                      "model '%s' is at step %lld, not %lld: this step was already applied or "
                      "another one ran",
                      m->cfg.name, (long long)m->step, (long long)expect);
        coord_count_error(c, MOE_EPRECOND);
        return 1;
    }
    if (m->pending_grads == 0) {
        rpc_reply_err(call, MOE_EPRECOND,
                      "no gradients to apply: run backward on model '%s' since the last step "
                      "(it is at step %lld; a restore of its checkpoint drops gradients)",
                      m->cfg.name, (long long)m->step);
        coord_count_error(c, MOE_EPRECOND);
        return 1;
    }
    return 0;
}

void coord_step(coord *c, rpc_call *call)
{
    char name[MODEL_NAME_MAX], err[256];
    double hp[6] = {1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0};
    int64_t expect = -1;
    pspec sp[] = {
        {"expect_step", P_INT, &expect, false, 0, 9e18, 0, false},
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"lr", P_F64, &hp[0], false, 0, 1e3, 0, false},
        {"beta1", P_F64, &hp[1], false, 0, 0.999999, 0, false},
        {"beta2", P_F64, &hp[2], false, 0, 0.999999999, 0, false},
        {"eps", P_F64, &hp[3], false, 1e-30, 1, 0, false},
        {"weight_decay", P_F64, &hp[4], false, 0, 1e3, 0, false},
        {"max_grad_norm", P_F64, &hp[5], false, 0, 1e30, 0, false},
    };
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 8, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    coord_model *m = coord_find_model(c, name);
    if (!m) {
        rpc_reply_err(call, MOE_ENOTFOUND, "no model named '%s'", name);
        return;
    }
    /* never answered against a state the workers do not hold (docs/PROTOCOL.md,
     * optimizer.step: the answers agree with the state after any crash) */
    if (coord_train_refused(c, m, call))
        return;
    /* while the last step's checkpoint is being written, step_stale checks
     * when this step's turn comes, once that step is settled */
    if (!m->step_unsettled && step_refused(c, m, sp[0].seen ? expect : -1, call))
        return;
    coord_job *j = coord_job_new(&coord_job_step, call, m);
    if (!j)
        return;
    memcpy(j->hp, hp, sizeof(hp));
    j->expect_step = sp[0].seen ? expect : -1;
    if (coord_job_enqueue(c, j) != MOE_OK)
        return;
    coord_job_pump(c);
}

static void step_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    (void)first, (void)bad_rank;
    int64_t step = -1;
    double norm = 0, scale = 1;
    for (int r = 0; r < j->nsent; r++) {
        if (j->errs[r] != MOE_OK) {
            const char *why = j->replies[r] ? j->replies[r]->message : moe_strerror(j->errs[r]);
            if (c->ckpt_dir[0]) { /* some workers may have applied it: roll back */
                rpc_reply_err(j->call, MOE_EUNAVAIL,
                              "optimizer.step outcome unknown: worker rank %d: %s: %s; the "
                              "model returns to its newest checkpoint: retry with expect_step",
                              r, moe_err_code(j->errs[r]), why);
                coord_count_error(c, MOE_EUNAVAIL);
                coord_step_rollback(c, j->model);
                return;
            }
            rpc_reply_err(j->call, j->errs[r], "optimizer.step: worker rank %d: %s", r, why);
            coord_count_error(c, j->errs[r]);
            return;
        }
        const moe_reply *rep = j->replies[r];
        mp_reader rd;
        uint32_t n;
        int64_t s = -1;
        char err[128];
        mp_reader_init(&rd, rep->buf + rep->result_off, rep->len - rep->result_off);
        pspec sp[] = {
            {"step", P_INT, &s, true, 0, 9e18, 0, false},
            {"grad_norm", P_F64, &norm, true, 0, 0, 0, false},
            {"clip_scale", P_F64, &scale, true, 0, 0, 0, false},
        };
        if (mp_read_map(&rd, &n, NULL) != MOE_OK ||
            params_parse(&rd, n, sp, 3, err, sizeof(err)) != MOE_OK || (step >= 0 && s != step)) {
            rpc_reply_err(j->call, MOE_EINTERNAL, "workers disagree on the step count");
            coord_count_error(c, MOE_EINTERNAL);
            coord_step_rollback(c, j->model);
            return;
        }
        step = s;
    }
    j->model->step = step;
    j->model->pending_grads = 0;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, j->call->req.msgid);
    const int durable = c->ckpt_dir[0] && c->ckpt_every > 0 && step % c->ckpt_every == 0;
    mp_write_map(&w, 4);
    mp_write_cstr(&w, "step");
    mp_write_i64(&w, step);
    mp_write_cstr(&w, "grad_norm");
    mp_write_f64(&w, norm);
    mp_write_cstr(&w, "clip_scale");
    mp_write_f64(&w, scale);
    mp_write_cstr(&w, "durable");
    mp_write_bool(&w, durable);
    if (!durable) {
        rpc_reply(j->call, &w);
        return;
    }
    /* acknowledged only once its automatic checkpoint is durable: an
     * acknowledged step is never lost to a crash. If the save cannot even be
     * queued, the outcome is unknown as when it fails. */
    size_t len = 0;
    uint8_t *reply = mp_writer_take(&w, &len); /* NULL when w failed */
    mp_writer_fini(&w);
    if (reply && coord_autosave_reply(c, j->model, j->call, reply, len) == MOE_OK) {
        j->model->step_unsettled = 1;
        return;
    }
    free(reply);
    rpc_reply_err(j->call, MOE_EUNAVAIL,
                  "optimizer.step outcome unknown: step %lld of model '%s' ran on the workers but "
                  "its checkpoint could not be started; the model returns to its newest "
                  "checkpoint: retry with expect_step",
                  (long long)step, j->model->cfg.name);
    coord_count_error(c, MOE_EUNAVAIL);
    coord_step_rollback(c, j->model);
}

/* step_stale: a step admitted before the model changed under it (a restore,
 * a re-formation, another step) is answered as it would be now, unsent. */
static int step_stale(coord *c, coord_job *j)
{
    coord_model *m = j->model;
    if (!j->call)
        return 0;
    if (coord_train_refused(c, m, j->call))
        return 1;
    return step_refused(c, m, j->expect_step, j->call);
}

static void backward_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    mp_write_map(w, j->direct ? 3 : 2);
    mp_write_cstr(w, "handle");
    mp_write_u64(w, j->handle->id);
    if (j->direct) {
        mp_write_cstr(w, "dtype");
        mp_write_cstr(w, moe_dtype_name(j->x.dtype));
        coord_write_pieces(w, j, c->world, rank);
        return;
    }
    mp_write_cstr(w, "dy");
    coord_write_sharded(w, &j->x, c->world, rank);
}

const coord_job_ops coord_job_backward = {JOB_BACKWARD,    "worker.backward", JOB_F_EARLY,
                                          backward_encode, backward_finish,   NULL};

static void step_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    static const char *names[6] = {"lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm"};
    (void)c, (void)rank;
    mp_write_map(w, 7);
    mp_write_cstr(w, "model");
    mp_write_cstr(w, j->model->cfg.name);
    for (int k = 0; k < 6; k++) {
        mp_write_cstr(w, names[k]);
        mp_write_f64(w, j->hp[k]);
    }
}

const coord_job_ops coord_job_step = {JOB_STEP,    "worker.step", JOB_F_EARLY,
                                      step_encode, step_finish,   step_stale};
