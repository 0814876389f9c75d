/*
 * grads.c - model.grads {model, layer, expert?}: a layer's weight
 * gradients, as accumulated by the backwards since the last
 * optimizer.step, so that a user can check them against autograd. Every
 * worker sends its share (worker.grads): the router's and the shared
 * expert's gradients (replicated tensors) are the sums of the ranks' shares
 * (summed here in rank order, as float), each expert's matrices come from
 * the rank that owns it. Reply: {layer, step, backwards,
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

/* rep_sum: one replicated tensor summed over the ranks, as float in rank
 * order, with its name and shape from rank 0's reply */
typedef struct {
    const char *name;
    uint32_t len;
    int64_t rows, cols;
    float *sum; /* (rows, cols) */
} rep_sum;

/* sum_replicated reads the first nrep tensors of every rank's reply into
 * s[0..nrep); on return rd[r] is past them. MOE_EPROTO when a reply is
 * malformed or the ranks disagree on a name or shape. */
static moe_err sum_replicated(coord_job *j, int nrep, rep_sum *s, mp_reader *rd, int64_t *nt)
{
    for (int r = 0; r < j->nsent; r++) {
        nt[r] = tensors_of(j->replies[r], &rd[r]);
        if (nt[r] < nrep)
            return MOE_EPROTO;
        for (int i = 0; i < nrep; i++) {
            const char *k;
            uint32_t kl;
            moe_tensor t;
            if (mp_read_str(&rd[r], &k, &kl, NULL) != MOE_OK ||
                moe_tensor_read(&rd[r], &t, NULL) != MOE_OK || t.dtype != MOE_F32 || t.ndim != 2)
                return MOE_EPROTO;
            size_t n = (size_t)t.shape[0] * (size_t)t.shape[1];
            if (r == 0) {
                s[i] = (rep_sum){k, kl, t.shape[0], t.shape[1], calloc(n ? n : 1, sizeof(float))};
                if (!s[i].sum)
                    return MOE_ENOMEM;
            } else if (kl != s[i].len || memcmp(k, s[i].name, kl) != 0 || t.shape[0] != s[i].rows ||
                       t.shape[1] != s[i].cols) {
                return MOE_EPROTO;
            }
            if (t.nbytes != n * sizeof(float))
                return MOE_EPROTO;
            for (size_t q = 0; q < n; q++) { /* unaligned view: copy out */
                float v;
                memcpy(&v, (const char *)t.data + q * sizeof(float), sizeof(float));
                s[i].sum[q] += v;
            }
        }
    }
    return MOE_OK;
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
    /* replicated: the router, then the shared expert's tensors */
    int nrep = 1 + model_cfg_shared_tensors(&j->model->cfg);
    rep_sum *s = calloc((size_t)nrep, sizeof(rep_sum));
    mp_reader *rd = calloc((size_t)j->nsent + 1, sizeof(mp_reader));
    int64_t *nt = calloc((size_t)j->nsent + 1, sizeof(int64_t));
    moe_err e = s && rd && nt ? sum_replicated(j, nrep, s, rd, nt) : MOE_ENOMEM;
    if (e == MOE_OK) {
        uint32_t total = (uint32_t)nrep;
        for (int r = 0; r < j->nsent; r++)
            total += (uint32_t)(nt[r] - nrep);
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
        for (int i = 0; i < nrep; i++) {
            mp_write_str(&w, s[i].name, s[i].len);
            moe_tensor t = {MOE_F32,
                            2,
                            {s[i].rows, s[i].cols},
                            s[i].sum,
                            (size_t)s[i].rows * (size_t)s[i].cols * sizeof(float)};
            moe_tensor_write(&w, &t);
        }
        for (int r = 0; r < j->nsent; r++) { /* the experts, as the ranks sent them */
            const moe_reply *rep = j->replies[r];
            size_t from = rep->len - mp_left(&rd[r]);
            for (int64_t i = nrep; i < nt[r]; i++)
                mp_skip(&rd[r], NULL), mp_skip(&rd[r], NULL);
            mp_write_raw(&w, rep->buf + from, rep->len - mp_left(&rd[r]) - from);
        }
        rpc_reply(j->call, &w);
    }
    for (int i = 0; s && i < nrep; i++)
        free(s[i].sum);
    free(s), free(rd), free(nt);
    if (e != MOE_OK)
        rpc_reply_err(j->call, e, "model.grads: %s",
                      e == MOE_ENOMEM ? "out of memory" : "a worker's reply is malformed");
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
