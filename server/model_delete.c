/*
 * model_delete.c - the life of a model beyond model.create: the memory
 * check before a create (against what each worker reports in its
 * heartbeats), the roll back of a create that failed on a worker, and
 * model.delete. Both remove the model from the coordinator at once (its
 * name may be created again) and queue a worker.model_delete job that frees
 * it on every worker.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "server/coord.h"
#include "common/log.h"
#include "common/params.h"
#include "common/placement.h"

moe_err coord_parse_mem(mp_reader *r, int64_t *host, int64_t *gpu, char *err, size_t errlen)
{
    uint32_t n;
    pspec sp[] = {{"host_available", P_INT, host, false, -1, 9e18, 0, false},
                  {"gpu_free", P_INT, gpu, false, -1, 9e18, 0, false}};
    if (mp_read_map(r, &n, NULL) != MOE_OK) {
        snprintf(err, errlen, "mem must be a map");
        return MOE_EINVAL;
    }
    return params_parse(r, n, sp, 2, err, errlen);
}

double coord_model_bytes(const model_cfg *cfg, int world, int rank)
{
    double E = cfg->n_experts, H = cfg->d_model, F = cfg->d_ff;
    double nmat = act_gated(cfg->act) ? 3 : 2; /* gated: w1, w3, w2; else w1, w2 */
    double ne = world > 0 ? placement_count(cfg->n_experts, world, rank) : E;
    /* weights are kept in f32 on every worker (bf16 models are rounded) */
    return (double)cfg->layers * (E * H + ne * nmat * F * H) * 4.0;
}

static double gib(double b)
{
    return b / (double)(1ull << 30);
}

moe_err coord_model_mem_check(coord *c, const model_cfg *cfg, char *err, size_t errlen)
{
    int world = c->ready && c->world > 0 ? c->world : (int)c->expected_workers;
    const coord_worker *worst = NULL;
    double worst_need = 0, worst_margin = 0;
    for (int i = 0; i < COORD_MAX_WORKERS; i++) {
        const coord_worker *w = &c->workers[i];
        if (w->state != WS_UP || w->mem_host < 0)
            continue;                                      /* down, or it did not say */
        int rank = c->ready && w->rank >= 0 ? w->rank : 0; /* rank 0 holds the most experts */
        double need = coord_model_bytes(cfg, world, rank);
        double margin = (double)w->mem_host - need;
        if (!worst || margin < worst_margin) {
            worst = w;
            worst_need = need;
            worst_margin = margin;
        }
    }
    if (!worst || worst_margin >= 0)
        return MOE_OK;
    snprintf(err, errlen,
             "model '%s' needs %.3f GiB of memory on each worker (%lld bytes for its share of "
             "%d layers x %d experts over %d workers) but worker %d (rank %d) reports %.3f GiB "
             "(%lld bytes) available",
             cfg->name, gib(worst_need), (long long)worst_need, cfg->layers, cfg->n_experts, world,
             worst->id, worst->rank, gib((double)worst->mem_host), (long long)worst->mem_host);
    return MOE_ENOMEM;
}

/* job_uses_model: j (or a request merged into it) is for m */
static int job_uses_model(const coord_job *j, const coord_model *m)
{
    for (const coord_job *b = j; b; b = b->batch_next)
        if (b->model == m)
            return 1;
    return 0;
}

int coord_model_jobs(const coord *c, const coord_model *m)
{
    int n = c->current && job_uses_model(c->current, m);
    for (const coord_job *j = c->qhead; j; j = j->next)
        n += job_uses_model(j, m);
    return n;
}

/* drop_queued_jobs answers and frees every queued job for m (not_found) */
static void drop_queued_jobs(coord *c, coord_model *m, const char *why)
{
    coord_job **pp = &c->qhead, *last = NULL;
    while (*pp) {
        coord_job *j = *pp;
        if (!job_uses_model(j, m)) {
            last = j;
            pp = &j->next;
            continue;
        }
        *pp = j->next;
        c->qlen--;
        if (j->call) {
            rpc_reply_err(j->call, MOE_ENOTFOUND, "model '%s' %s", m->cfg.name, why);
            coord_count_error(c, MOE_ENOTFOUND);
        }
        j->next = NULL;
        j->call = NULL;
        coord_job_discard(j);
    }
    c->qtail = last;
}

/* detach removes m from the coordinator's models (its name is free again):
 * queued jobs for it are answered not_found, its train handles expire, its
 * persisted config goes. m itself is freed by the caller. */
static void detach(coord *c, coord_model *m, const char *why)
{
    drop_queued_jobs(c, m, why);
    for (int i = 0; i < COORD_HANDLE_RING; i++) {
        if (c->handles[i].model == m) {
            c->handles[i].state = H_EXPIRED;
            c->handles[i].model = NULL;
        }
    }
    for (int i = 0; i < c->nmodels; i++) {
        if (c->models[i] == m) {
            memmove(&c->models[i], &c->models[i + 1],
                    (size_t)(c->nmodels - i - 1) * sizeof(c->models[0]));
            c->nmodels--;
            break;
        }
    }
    coord_model_unpersist(c, m);
}

/* the worker.model_delete job: the name travels in j->path (the model is
 * already freed at the coordinator) */
static void model_delete_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    (void)c, (void)rank;
    mp_write_map(w, 1);
    mp_write_cstr(w, "model");
    mp_write_cstr(w, j->path);
}

static void model_delete_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    (void)c;
    /* a worker that did not answer leaves the generation (jobs.c); the next
     * one's join drops every model there: the model is gone either way */
    if (first != MOE_OK)
        LOG_W("worker.model_delete %s failed on rank %d (%s): the model goes with the next "
              "re-formation",
              j->path, bad_rank, moe_err_code(first));
    if (!j->call)
        return;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, j->call->req.msgid);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "name");
    mp_write_cstr(&w, j->path);
    rpc_reply(j->call, &w);
}

const coord_job_ops coord_job_model_delete = {JOB_MODEL_DELETE,    "worker.model_delete", 0,
                                              model_delete_encode, model_delete_finish,   NULL};

/* queue_worker_delete queues worker.model_delete of name for call (NULL:
 * internal), at the front for a roll back. Without a ready cluster there
 * is nothing to free on the workers (a join drops every model): call is
 * answered now. */
static void queue_worker_delete(coord *c, const char *name, rpc_call *call, int front)
{
    coord_job *j = c->ready ? coord_job_new(&coord_job_model_delete, call, NULL) : NULL;
    if (j) {
        snprintf(j->path, sizeof(j->path), "%s", name);
        if (coord_job_submit(c, j, front) == MOE_OK) {
            coord_job_pump(c);
            return;
        }
        j->call = NULL;
        coord_job_discard(j);
        LOG_W("model %s: worker.model_delete not queued (queue full): the model stays on the "
              "workers until the next re-formation",
              name);
    }
    if (!call)
        return;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "name");
    mp_write_cstr(&w, name);
    rpc_reply(call, &w);
}

void coord_model_create_rollback(coord *c, coord_job *j)
{
    coord_model *m = j->model;
    char name[MODEL_NAME_MAX];
    snprintf(name, sizeof(name), "%s", m->cfg.name);
    LOG_W("model.create %s failed on a worker: rolling it back everywhere", name);
    detach(c, m, "was rolled back: its model.create failed");
    j->model = NULL;
    coord_model_free(m);
    queue_worker_delete(c, name, NULL, 1);
}

void coord_model_delete(coord *c, rpc_call *call)
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
    int busy = coord_model_jobs(c, m);
    if (busy) {
        rpc_reply_err(call, MOE_EPRECOND,
                      "model '%s' has %d requests queued or running: retry once they are "
                      "answered",
                      name, busy);
        return;
    }
    detach(c, m, "was deleted");
    coord_model_free(m);
    LOG_I("model %s deleted", name);
    queue_worker_delete(c, name, call, 0);
}
