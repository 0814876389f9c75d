/*
 * grads.c - model.grads {model, layer, expert?}: a layer's weight
 * gradients, as accumulated by the backwards since the last
 * optimizer.step, so that a user can check them against autograd. Every
 * worker sends its share (worker.grads): the router gradient is the sum of
 * the ranks' shares (summed here in rank order, as float), each expert's
 * matrices come from the rank that owns it. Reply: {layer, step, backwards,
 * tensors: {name: f32 tensor}} with the checkpoint's tensor names.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/coord.h"
#include "common/params.h"

static void grads_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    (void)c, (void)rank;
    int ex = j->ckpt_step >= 0; /* j->ckpt_step: the expert asked for, -1 = all */
    mp_write_map(w, 2 + ex);
    mp_write_cstr(w, "model");
    mp_write_cstr(w, j->model->cfg.name);
    mp_write_cstr(w, "layer");
    mp_write_i64(w, j->layer);
    if (ex) {
        mp_write_cstr(w, "expert");
        mp_write_i64(w, j->ckpt_step);
    }
}

/* tensors_of positions r at rank's "tensors" map; returns its size or -1 */
static int64_t tensors_of(const moe_reply *rep, mp_reader *r)
{
    uint32_t n, kl;
    const char *k;
    mp_reader_init(r, rep->buf + rep->result_off, rep->len - rep->result_off);
    if (mp_read_map(r, &n, NULL) != MOE_OK || n != 1 || mp_read_str(r, &k, &kl, NULL) != MOE_OK ||
        !mp_str_eq(k, kl, "tensors") || mp_read_map(r, &n, NULL) != MOE_OK || n < 1)
        return -1;
    return n;
}

static void grads_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    (void)c;
    if (!j->call)
        return;
    if (first != MOE_OK) {
        rpc_reply_err(j->call, first, "model.grads: worker rank %d: %s", bad_rank,
                      j->replies[bad_rank] ? j->replies[bad_rank]->message : "");
        return;
    }
    int H = j->model->cfg.d_model, E = j->model->cfg.n_experts;
    size_t rn = (size_t)E * H;
    float *router = calloc(rn, sizeof(float));
    uint32_t total = 1;
    const char *rname = NULL;
    uint32_t rlen = 0;
    moe_err e = router ? MOE_OK : MOE_ENOMEM;
    for (int r = 0; e == MOE_OK && r < j->nsent; r++) {
        mp_reader rd;
        int64_t n = tensors_of(j->replies[r], &rd);
        moe_tensor t;
        if (n < 1 || mp_read_str(&rd, &rname, &rlen, NULL) != MOE_OK ||
            moe_tensor_read(&rd, &t, NULL) != MOE_OK || t.dtype != MOE_F32 ||
            t.nbytes != rn * sizeof(float)) {
            e = MOE_EPROTO;
            break;
        }
        for (size_t k = 0; k < rn; k++) { /* unaligned view: copy out */
            float v;
            memcpy(&v, (const char *)t.data + k * sizeof(float), sizeof(float));
            router[k] += v;
        }
        total += (uint32_t)(n - 1);
    }
    if (e != MOE_OK) {
        free(router);
        rpc_reply_err(j->call, e, "model.grads: a worker's reply is malformed");
        return;
    }
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, j->call->req.msgid);
    mp_write_map(&w, 4);
    mp_write_cstr(&w, "layer");
    mp_write_i64(&w, j->layer);
    mp_write_cstr(&w, "step");
    mp_write_i64(&w, j->model->step);
    mp_write_cstr(&w, "backwards"); /* backwards accumulated since the last step */
    mp_write_i64(&w, j->model->pending_grads);
    mp_write_cstr(&w, "tensors");
    mp_write_map(&w, total);
    mp_write_str(&w, rname, rlen);
    moe_tensor rt = {MOE_F32, 2, {E, H}, router, rn * sizeof(float)};
    moe_tensor_write(&w, &rt);
    free(router);
    for (int r = 0; r < j->nsent; r++) { /* the experts, as the ranks sent them */
        mp_reader rd;
        int64_t n = tensors_of(j->replies[r], &rd);
        mp_skip(&rd, NULL), mp_skip(&rd, NULL); /* the router share */
        const moe_reply *rep = j->replies[r];
        size_t from = rep->len - mp_left(&rd);
        for (int64_t i = 1; i < n; i++)
            mp_skip(&rd, NULL), mp_skip(&rd, NULL);
        mp_write_raw(&w, rep->buf + from, rep->len - mp_left(&rd) - from);
    }
    rpc_reply(j->call, &w);
}

const coord_job_ops coord_job_grads = {JOB_GRADS,    "worker.grads", 0,
                                       grads_encode, grads_finish,   NULL};

void coord_grads(coord *c, rpc_call *call)
{
    char name[MODEL_NAME_MAX], err[256];
    int64_t layer = 0, expert = -1;
    pspec sp[] = {
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"layer", P_INT, &layer, true, 0, 1023, 0, false},
        {"expert", P_INT, &expert, false, 0, 4095, 0, false},
    };
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 3, err, sizeof(err));
    coord_model *m = NULL;
    if (e == MOE_OK && !(m = coord_find_model(c, name))) {
        snprintf(err, sizeof(err), "no model named '%s'", name);
        e = MOE_ENOTFOUND;
    }
    if (e == MOE_OK && layer >= m->cfg.layers) {
        snprintf(err, sizeof(err), "model '%s' has %d layers", name, m->cfg.layers);
        e = MOE_ENOTFOUND;
    }
    if (e == MOE_OK && expert >= m->cfg.n_experts) {
        snprintf(err, sizeof(err), "model '%s' has %d experts", name, m->cfg.n_experts);
        e = MOE_ENOTFOUND;
    }
    if (e == MOE_OK && (!c->ready || m->created_gen != (int)c->generation)) {
        snprintf(err, sizeof(err), "model '%s' is not ready on the workers", name);
        e = MOE_EUNAVAIL;
    }
    if (e != MOE_OK) {
        coord_count_error(c, e);
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    coord_job *j = coord_job_new(&coord_job_grads, call, m);
    if (!j)
        return;
    j->layer = (int)layer;
    j->ckpt_step = expert;
    if (coord_job_enqueue(c, j) != MOE_OK)
        return;
    coord_job_pump(c);
}
