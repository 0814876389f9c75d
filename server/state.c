/*
 * state.c - the coordinator's shared state, at the bottom of its call order
 * (coord.h): lookups over struct coord (workers up, a model by name), the
 * model table (add, free), the error counters and the latency buckets.
 * Everything here only reads or writes struct coord and what it owns; it
 * calls no other server file, so every one of them may call it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/coord.h"
#include "common/log.h"

const double coord_lat_bounds[COORD_LAT_BUCKETS] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};

void coord_count_error(coord *c, moe_err e)
{
    if ((unsigned)e >= MOE_ERR_COUNT)
        e = MOE_EINTERNAL;
    c->errors_by_code[e]++;
    c->errors_total++;
}

int coord_up_workers(const coord *c)
{
    int n = 0;
    for (int i = 0; i < COORD_MAX_WORKERS; i++)
        n += c->workers[i].state == WS_UP;
    return n;
}

/* coord_model_add: the model belongs to c->models from here (freed by
 * coord_model_free when deleted or at exit). */
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
          cfg->layers, cfg->d_model, cfg->d_ff, cfg->n_experts, cfg->top_k, act_name(cfg->act),
          moe_dtype_name(cfg->dtype));
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
