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

#include "server/coord.h"
#include "common/log.h"
#include "common/params.h"
#include "common/placement.h"

void coord_model_create(coord *c, rpc_call *call)
{
    model_cfg cfg;
    char err[256];
    if (coord_hf_wants(call)) { /* a Hugging Face directory: hf.c */
        coord_hf_create(c, call);
        return;
    }
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
    if (!m && (e = coord_model_mem_check(c, &cfg, err, sizeof(err))) != MOE_OK) {
        rpc_reply_err(call, e, "%s", err); /* before any worker allocates */
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
    coord_job *j = coord_job_new(&coord_job_model_create, call, m);
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
    int hf = m->cfg.hf_dir[0] != 0;
    mp_write_map(&w, 4 + hf);
    if (hf) { /* the Hugging Face directory it came from (hf.c) */
        mp_write_cstr(&w, "hf");
        coord_hf_info(&w, m);
    }
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

static void model_create_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    (void)c, (void)rank;
    model_cfg_write(w, &j->model->cfg);
}

/* at most this many re-formations in a row for a model whose re-creation
 * fails on every worker; then its calls are refused until the next one */
#define RECREATE_REFORMS 3

static void model_create_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    coord_model *m = j->model;
    if (first == MOE_OK) {
        m->created_gen = (int)j->generation;
        m->recreate_failures = 0;
        m->recreate_err[0] = 0;
    }
    if (first != MOE_OK && !j->call && j->generation == c->generation) {
        /* a re-creation after a re-formation failed: the workers of this
         * generation do not hold the model, and its forwards would reach
         * workers that answer not_found. They are refused unavailable with
         * this (coord_job_pump), and the cluster forms again */
        snprintf(m->recreate_err, sizeof(m->recreate_err), "rank %d: %s", bad_rank,
                 j->replies[bad_rank] ? j->replies[bad_rank]->message : moe_err_code(first));
        if (c->world < c->expected_workers) {
            /* a generation of survivors (--min-workers) that cannot hold
             * the model: give it up and wait for every worker */
            LOG_W("model %s does not fit on the %d workers of generation %llu (%s): waiting "
                  "for all %lld workers",
                  m->cfg.name, c->world, (unsigned long long)c->generation, m->recreate_err,
                  c->expected_workers);
            c->ready = 0;
            c->shrink_blocked = 1;
            c->need_form = 1;
        } else if (++m->recreate_failures <= RECREATE_REFORMS) {
            /* the whole cluster: again, a bounded number of times (for a
             * failure that is not transient) */
            LOG_W("model %s: its re-creation on generation %llu failed (%s): re-forming the "
                  "cluster (%d of %d)",
                  m->cfg.name, (unsigned long long)c->generation, m->recreate_err,
                  m->recreate_failures, RECREATE_REFORMS);
            c->ready = 0;
            c->need_form = 1;
        } else {
            LOG_E("model %s: its re-creation failed %d times in a row (%s): its calls are "
                  "refused until the cluster re-forms",
                  m->cfg.name, m->recreate_failures, m->recreate_err);
        }
    }
    if (!j->call)
        return;
    if (first == MOE_OK) {
        mp_writer w;
        mp_writer_init(&w);
        moe_rpc_write_response_ok_head(&w, j->call->req.msgid);
        mp_write_map(&w, 2);
        mp_write_cstr(&w, "name");
        mp_write_cstr(&w, j->model->cfg.name);
        mp_write_cstr(&w, "params");
        mp_write_i64(&w, model_cfg_params(&j->model->cfg));
        rpc_reply(j->call, &w);
    } else {
        rpc_reply_err(j->call, first, "model.create failed on worker rank %d: %s", bad_rank,
                      j->replies[bad_rank] ? j->replies[bad_rank]->message : "");
        if (!j->model->created_gen) /* a new model: no ghost of it stays */
            coord_model_create_rollback(c, j);
    }
}

/* model_create_stale: a re-creation after a re-formation that an earlier
 * one of the same generation already did */
static int model_create_stale(coord *c, coord_job *j)
{
    return !j->call && j->model->created_gen == (int)c->generation;
}

const coord_job_ops coord_job_model_create = {
    JOB_MODEL_CREATE,    "worker.model_create", 0,
    model_create_encode, model_create_finish,   model_create_stale};
