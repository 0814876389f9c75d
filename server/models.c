/*
 * models.c - model.create and model.info at the coordinator, and the
 * encoding of every cluster job into its worker request (the sharding of a
 * batch by token ranges: rank r gets rows [T*r/W, T*(r+1)/W)). The forward's
 * admission and gather are in forward.c.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "log.h"
#include "params.h"
#include "placement.h"

const double coord_lat_bounds[COORD_LAT_BUCKETS] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};

coord_model *coord_model_add(coord *c, const model_cfg *cfg, char *err, size_t errlen)
{
    if (c->nmodels == COORD_MAX_MODELS) {
        snprintf(err, errlen, "too many models (max %d)", COORD_MAX_MODELS);
        return NULL;
    }
    coord_model *m = calloc(1, sizeof(*m));
    size_t n = (size_t)cfg->layers * (size_t)cfg->n_experts;
    if (!m || !(m->tokens = calloc(n, sizeof(int64_t))) ||
        !(m->dropped = calloc(n, sizeof(int64_t))) ||
        !(m->hist_tokens = calloc(n, sizeof(int64_t))) ||
        !(m->hist = calloc(COORD_HIST_POINTS, sizeof(*m->hist)))) {
        coord_model_free(m);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    m->hist_first = c->hist_n; /* its history starts at the next point */
    m->cfg = *cfg;
    c->models[c->nmodels++] = m;
    LOG_I("model %s: %d layers, d_model %d, d_ff %d, %d experts, top-%d, %s, %s", cfg->name,
          cfg->layers, cfg->d_model, cfg->d_ff, cfg->n_experts, cfg->top_k,
          cfg->act ? "gelu" : "swiglu", moe_dtype_name(cfg->dtype));
    return m;
}

void coord_model_free(coord_model *m)
{
    if (!m)
        return;
    free(m->tokens);
    free(m->dropped);
    free(m->hist_tokens);
    free(m->hist);
    free(m);
}

coord_model *coord_find_model(coord *c, const char *name)
{
    for (int i = 0; i < c->nmodels; i++)
        if (strcmp(c->models[i]->cfg.name, name) == 0)
            return c->models[i];
    return NULL;
}

void coord_model_create(coord *c, rpc_call *call)
{
    model_cfg cfg;
    char err[256];
    memset(&cfg, 0, sizeof(cfg));
    mp_reader r = call->req.params;
    moe_err e = model_cfg_parse(&r, call->req.nparams, &cfg, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    coord_model *m = coord_find_model(c, cfg.name);
    if (m && !model_cfg_same(&m->cfg, &cfg)) {
        rpc_reply_err(call, MOE_EINVAL, "model '%s' already exists with another configuration",
                      cfg.name);
        return;
    }
    if (!m) {
        if (!(m = coord_model_add(c, &cfg, err, sizeof(err)))) {
            rpc_reply_err(call, MOE_ENOMEM, "%s", err);
            return;
        }
        coord_model_persist(c, m);
    }
    if (!c->ready) {
        /* created on the workers when the cluster forms */
        mp_writer w;
        mp_writer_init(&w);
        moe_rpc_write_response_ok_head(&w, call->req.msgid);
        mp_write_map(&w, 3);
        mp_write_cstr(&w, "name");
        mp_write_cstr(&w, cfg.name);
        mp_write_cstr(&w, "params");
        mp_write_i64(&w, model_cfg_params(&cfg));
        mp_write_cstr(&w, "pending");
        mp_write_bool(&w, true);
        rpc_reply(call, &w);
        return;
    }
    coord_job *j = coord_job_new(JOB_MODEL_CREATE, call, m);
    if (!j || coord_job_enqueue(c, j) != MOE_OK)
        return;
    coord_job_pump(c);
}

void coord_model_info(coord *c, rpc_call *call)
{
    char name[MODEL_NAME_MAX], err[256];
    pspec sp[] = {{"model", P_STR, name, true, 0, 0, sizeof(name), false}};
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 1, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    coord_model *m = coord_find_model(c, name);
    if (!m) {
        rpc_reply_err(call, MOE_ENOTFOUND, "no model named '%s'", name);
        return;
    }
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    mp_write_map(&w, 4);
    mp_write_cstr(&w, "config");
    model_cfg_write(&w, &m->cfg);
    mp_write_cstr(&w, "params");
    mp_write_i64(&w, model_cfg_params(&m->cfg));
    mp_write_cstr(&w, "ready");
    mp_write_bool(&w, c->ready && m->created_gen == (int)c->generation);
    mp_write_cstr(&w, "placement"); /* expert -> rank in the current generation */
    int E = m->cfg.n_experts, W = c->world > 0 ? c->world : 1;
    mp_write_array(&w, (uint32_t)E);
    for (int e2 = 0; e2 < E; e2++)
        mp_write_i64(&w, c->world > 0 ? placement_owner(E, W, e2) : -1);
    rpc_reply(call, &w);
}

void coord_job_encode(coord *c, coord_job *j, int rank, mp_writer *w, const char **method)
{
    switch (j->kind) {
    case JOB_XCHG_ID:
        *method = "worker.xchg_id";
        mp_write_map(w, 0);
        return;
    case JOB_JOIN:
        *method = "worker.join";
        mp_write_map(w, c->use_nccl ? 5 : 4);
        if (c->use_nccl) {
            mp_write_cstr(w, "nccl_id");
            mp_write_bin(w, c->nccl_id, sizeof(c->nccl_id));
        }
        mp_write_cstr(w, "generation");
        mp_write_u64(w, c->generation);
        mp_write_cstr(w, "rank");
        mp_write_i64(w, rank);
        mp_write_cstr(w, "world");
        mp_write_i64(w, c->world);
        mp_write_cstr(w, "peers");
        mp_write_array(w, (uint32_t)c->world);
        for (int r = 0; r < c->world; r++)
            mp_write_cstr(w, c->workers[c->rank_to_worker[r]].data_url);
        return;
    case JOB_MODEL_CREATE:
        *method = "worker.model_create";
        model_cfg_write(w, &j->model->cfg);
        return;
    case JOB_FORWARD: {
        *method = "worker.forward";
        int64_t T = j->x.shape[0];
        mp_write_map(w, j->direct ? 8 : 7);
        mp_write_cstr(w, "handle");
        mp_write_u64(w, j->handle ? j->handle->id : 0);
        mp_write_cstr(w, "model");
        mp_write_cstr(w, j->model->cfg.name);
        mp_write_cstr(w, "layer");
        mp_write_i64(w, j->layer);
        mp_write_cstr(w, "T_total");
        mp_write_i64(w, T);
        mp_write_cstr(w, "row0");
        mp_write_i64(w, shard_first(T, c->world, rank));
        mp_write_cstr(w, "train");
        mp_write_bool(w, j->train != 0);
        if (j->direct) {
            mp_write_cstr(w, "dtype");
            mp_write_cstr(w, moe_dtype_name(j->x.dtype));
            coord_write_pieces(w, j, c->world, rank);
            return;
        }
        mp_write_cstr(w, "x");
        coord_write_sharded(w, &j->x, c->world, rank);
        return;
    }
    case JOB_BACKWARD:
        *method = "worker.backward";
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
        return;
    case JOB_STEP: {
        static const char *names[6] = {"lr",  "beta1",        "beta2",
                                       "eps", "weight_decay", "max_grad_norm"};
        *method = "worker.step";
        mp_write_map(w, 7);
        mp_write_cstr(w, "model");
        mp_write_cstr(w, j->model->cfg.name);
        for (int k = 0; k < 6; k++) {
            mp_write_cstr(w, names[k]);
            mp_write_f64(w, j->hp[k]);
        }
        return;
    }
    case JOB_CKPT_SAVE:
    case JOB_CKPT_LOAD:
    case JOB_CKPT_COMMIT: coord_ckpt_encode(c, j, rank, w, method); return;
    }
}
