/*
 * hf.c - model.create {name, from_hf: DIR}: a Hugging Face model directory
 * as published (config.json + model.safetensors, or shards with
 * model.safetensors.index.json) becomes a model of one moe layer per MoE
 * layer of the checkpoint. The coordinator reads config.json and every
 * shard's header (never the tensor data) and checks each router and expert
 * tensor: present, dtype, shape. Only then is the model added and the
 * workers asked to create it; each worker maps the shards and reads only
 * its own experts (worker/hf.c). A failure on any worker removes the model
 * again: no half-created model remains.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/confine.h"
#include "server/coord.h"
#include "common/hfcfg.h"
#include "common/log.h"
#include "common/params.h"
#include "common/safetensors.h"

int coord_hf_wants(const rpc_call *call)
{
    const mp_reader *r = &call->req.params;
    const char *s;
    uint32_t len;
    return params_find_str(r, call->req.nparams, "from_hf", &s, &len) ||
           params_find_str(r, call->req.nparams, "hf_dir", &s, &len) ||
           params_find_str(r, call->req.nparams, "hf_family", &s, &len);
}

/* check_tensors checks every router and expert tensor of every MoE layer,
 * and the bias and shared expert tensors the family has */
static moe_err check_tensors(const coord *c, const char *dir, const hf_cfg *hc, moe_dtype *src,
                             char *err, size_t errlen)
{
    const char *roots[2];
    hf_reader *rd;
    moe_err e = hf_reader_open(dir, hc, roots, coord_ckpt_roots(c, roots), &rd, err, errlen);
    if (e != MOE_OK)
        return e;
    *src = MOE_F32;
    for (int l = 0; e == MOE_OK && l < hc->n_moe; l++) {
        const st_tensor *t;
        e = hf_reader_get(rd, hc->moe[l], 0, HF_ROUTER, &t, err, errlen);
        if (e == MOE_OK && l == 0 && t->dtype == ST_BF16)
            *src = MOE_BF16;
        for (int x = 0; e == MOE_OK && x < hc->E; x++)
            for (int mat = HF_GATE; e == MOE_OK && mat <= HF_DOWN; mat++)
                e = hf_reader_get(rd, hc->moe[l], x, (hf_mat)mat, &t, err, errlen);
        for (int mat = HF_BIAS; e == MOE_OK && mat <= HF_SH_GATEW; mat++)
            if (hf_cfg_has(hc, (hf_mat)mat))
                e = hf_reader_get(rd, hc->moe[l], 0, (hf_mat)mat, &t, err, errlen);
    }
    hf_reader_close(rd);
    return e;
}

/* hf_cfg_to_model builds (and validates, through model_cfg_parse) the
 * model's config from the checkpoint's and the request's overrides. */
static moe_err hf_cfg_to_model(const hf_cfg *hc, const char *name, const char *dir, moe_dtype dtype,
                               const double *cf, const double *aux, const double *z, model_cfg *out,
                               char *err, size_t errlen)
{
    model_cfg m;
    memset(&m, 0, sizeof(m));
    snprintf(m.name, sizeof(m.name), "%s", name);
    m.layers = hc->n_moe;
    m.d_model = hc->H;
    m.d_ff = hc->F;
    m.n_experts = hc->E;
    m.top_k = hc->K;
    m.act = ACT_SWIGLU;
    m.renormalize = hc->renormalize;
    /* the routing family: softmax top-k (model_cfg.h's defaults) unless
     * the checkpoint's family has more (hfcfg.h) */
    m.scoring = hc->scoring;
    m.score_bias = hc->score_bias;
    m.n_group = hc->n_group;
    m.topk_group = hc->topk_group;
    m.group_topn = 2;
    m.routed_scale = hc->routed_scale;
    m.shared_d_ff = hc->Fs;
    m.shared_gate = hc->shared_gate;
    m.capacity_factor = cf ? *cf : 0;
    m.dtype = dtype;
    /* moe's aux loss is transformers' load_balancing_loss_func / K: K times
     * router_aux_loss_coef gives transformers' gradient (docs/OPERATIONS.md) */
    m.aux_loss_coef = aux ? *aux : hc->router_aux_loss_coef * hc->K;
    m.z_loss_coef = z ? *z : 0;
    snprintf(m.hf_dir, sizeof(m.hf_dir), "%s", dir);
    snprintf(m.hf_family, sizeof(m.hf_family), "%s", hf_family_name(hc->family));
    mp_writer w;
    mp_writer_init(&w);
    model_cfg_write(&w, &m);
    mp_reader r;
    uint32_t n;
    mp_reader_init(&r, w.buf, w.len);
    mp_read_map(&r, &n, NULL);
    memset(out, 0, sizeof(*out));
    char perr[512];
    moe_err e = model_cfg_parse(&r, n, out, perr, sizeof(perr));
    mp_writer_fini(&w);
    if (e != MOE_OK) /* the checkpoint's keys do not make a model moe accepts */
        snprintf(err, errlen, "%s/config.json (family %s): %s", dir, hf_family_name(hc->family),
                 perr);
    return e;
}

static void write_hf_reply(mp_writer *w, const coord_model *m, int pending)
{
    hf_cfg hc;
    char err[256];
    int ok = hf_cfg_read(m->cfg.hf_dir, &hc, err, sizeof(err)) == MOE_OK;
    mp_write_map(w, 5 + pending);
    mp_write_cstr(w, "name");
    mp_write_cstr(w, m->cfg.name);
    mp_write_cstr(w, "params");
    mp_write_i64(w, model_cfg_params(&m->cfg));
    mp_write_cstr(w, "family");
    mp_write_cstr(w, m->cfg.hf_family);
    mp_write_cstr(w, "layers"); /* the checkpoint's index of each moe layer */
    mp_write_array(w, ok ? (uint32_t)hc.n_moe : 0);
    for (int l = 0; ok && l < hc.n_moe; l++)
        mp_write_i64(w, hc.moe[l]);
    mp_write_cstr(w, "dense_layers"); /* skipped: not MoE */
    mp_write_array(w, ok ? (uint32_t)(hc.n_layers - hc.n_moe) : 0);
    for (int l = 0, k = 0; ok && l < hc.n_layers; l++) {
        if (k < hc.n_moe && hc.moe[k] == l)
            k++;
        else
            mp_write_i64(w, l);
    }
    if (pending) {
        mp_write_cstr(w, "pending");
        mp_write_bool(w, true);
    }
}

static void model_remove(coord *c, coord_model *m)
{
    for (int i = 0; i < c->nmodels; i++)
        if (c->models[i] == m) {
            memmove(&c->models[i], &c->models[i + 1],
                    (size_t)(c->nmodels - i - 1) * sizeof(c->models[0]));
            c->nmodels--;
            coord_model_free(m);
            return;
        }
}

static void hf_create_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    (void)c, (void)rank;
    model_cfg_write(w, &j->model->cfg);
}

/* j->commit: 1 when this request added the model (removed again on failure) */
static void hf_create_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    if (first != MOE_OK) {
        char msg[600];
        snprintf(msg, sizeof(msg), "model.create from %s failed on worker rank %d: %s",
                 j->model->cfg.hf_dir, bad_rank,
                 bad_rank >= 0 && j->replies[bad_rank] ? j->replies[bad_rank]->message : "");
        LOG_W("%s", msg);
        if (j->commit)
            model_remove(c, j->model);
        if (j->call)
            rpc_reply_err(j->call, first, "%s", msg);
        return;
    }
    j->model->created_gen = (int)j->generation;
    coord_model_persist(c, j->model);
    if (!j->call)
        return;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, j->call->req.msgid);
    write_hf_reply(&w, j->model, 0);
    rpc_reply(j->call, &w);
}

const coord_job_ops coord_job_hf_create = {JOB_MODEL_CREATE, "worker.model_create", 0,
                                           hf_create_encode, hf_create_finish,      NULL};

void coord_hf_create(coord *c, rpc_call *call)
{
    char name[MODEL_NAME_MAX], path[CFG_STR_MAX], dtype_s[16] = "", err[768] = "";
    double cf = 0, aux = 0, z = 0;
    pspec sp[] = {
        {"name", P_STR, name, true, 0, 0, sizeof(name), false},
        {"from_hf", P_STR, path, true, 0, 0, sizeof(path), false},
        {"dtype", P_STR, dtype_s, false, 0, 0, sizeof(dtype_s), false},
        {"capacity_factor", P_F64, &cf, false, 0, 1000, 0, false},
        {"aux_loss_coef", P_F64, &aux, false, 0, 1000, 0, false},
        {"z_loss_coef", P_F64, &z, false, 0, 1000, 0, false},
    };
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 6, err, sizeof(err));
    if (e != MOE_OK && strstr(err, "hf_"))
        snprintf(err, sizeof(err),
                 "hf_dir and hf_family are set by the coordinator: pass "
                 "from_hf (a Hugging Face model directory)");
    if (e != MOE_OK && !sp[1].seen)
        snprintf(err, sizeof(err), "model.create from a Hugging Face directory needs from_hf");
    const char *roots[2];
    char real[CFG_STR_MAX + 64];
    hf_cfg *hc = calloc(1, sizeof(*hc));
    if (e == MOE_OK && !hc) {
        snprintf(err, sizeof(err), "out of memory");
        e = MOE_ENOMEM;
    }
    if (e == MOE_OK)
        e = path_confine(path, roots, coord_ckpt_roots(c, roots), real, sizeof(real), err,
                         sizeof(err));
    if (e == MOE_OK && strlen(real) >= MODEL_HF_DIR_MAX) {
        snprintf(err, sizeof(err), "from_hf resolves to a path over %d characters",
                 MODEL_HF_DIR_MAX - 1);
        e = MOE_EINVAL;
    }
    if (e == MOE_OK)
        e = hf_cfg_read(real, hc, err, sizeof(err));
    moe_dtype src = MOE_F32, dt = MOE_F32;
    if (e == MOE_OK)
        e = check_tensors(c, real, hc, &src, err, sizeof(err));
    if (e == MOE_OK) {
        dt = hc->dtype_known ? (strcmp(hc->dtype, "bfloat16") == 0 ? MOE_BF16 : MOE_F32) : src;
        if (sp[2].seen &&
            (moe_dtype_parse(dtype_s, strlen(dtype_s), &dt) != MOE_OK || dt == MOE_F16)) {
            snprintf(err, sizeof(err), "dtype must be \"f32\" or \"bf16\", not \"%s\"", dtype_s);
            e = MOE_EINVAL;
        }
    }
    model_cfg cfg;
    if (e == MOE_OK)
        e = hf_cfg_to_model(hc, name, real, dt, sp[3].seen ? &cf : NULL, sp[4].seen ? &aux : NULL,
                            sp[5].seen ? &z : NULL, &cfg, err, sizeof(err));
    free(hc);
    coord_model *m = e == MOE_OK ? coord_find_model(c, name) : NULL;
    if (m && !model_cfg_same(&m->cfg, &cfg)) {
        snprintf(err, sizeof(err), "model '%s' already exists with another configuration", name);
        e = MOE_EINVAL;
    }
    int added = 0;
    if (e == MOE_OK && !m) /* the same memory check as model.create's, before any worker reads */
        e = coord_model_mem_check(c, &cfg, err, sizeof(err));
    if (e == MOE_OK && !m) {
        if (!(m = coord_model_add(c, &cfg, err, sizeof(err))))
            e = MOE_ENOMEM;
        added = m != NULL;
    }
    if (e != MOE_OK) {
        coord_count_error(c, e);
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    LOG_I("model %s from %s (%s)", name, real, cfg.hf_family);
    if (!c->ready) { /* created on the workers when the cluster forms */
        coord_model_persist(c, m);
        mp_writer w;
        mp_writer_init(&w);
        moe_rpc_write_response_ok_head(&w, call->req.msgid);
        write_hf_reply(&w, m, 1);
        rpc_reply(call, &w);
        return;
    }
    coord_job *j = coord_job_new(&coord_job_hf_create, call, m);
    if (!j) {
        if (added)
            model_remove(c, m);
        return;
    }
    j->commit = added;
    if (coord_job_enqueue(c, j) != MOE_OK) {
        if (added)
            model_remove(c, m);
        return;
    }
    coord_job_pump(c);
}

void coord_hf_info(mp_writer *w, const coord_model *m)
{
    hf_cfg *hc = calloc(1, sizeof(*hc));
    char err[512], nm[200];
    if (!hc || hf_cfg_read(m->cfg.hf_dir, hc, err, sizeof(err)) != MOE_OK) {
        mp_write_map(w, 3);
        mp_write_cstr(w, "dir");
        mp_write_cstr(w, m->cfg.hf_dir);
        mp_write_cstr(w, "family");
        mp_write_cstr(w, m->cfg.hf_family);
        mp_write_cstr(w, "error");
        mp_write_cstr(w, hc ? err : "out of memory");
        free(hc);
        return;
    }
    hf_family f = hf_family_parse(m->cfg.hf_family);
    mp_write_map(w, 4);
    mp_write_cstr(w, "dir");
    mp_write_cstr(w, m->cfg.hf_dir);
    mp_write_cstr(w, "family");
    mp_write_cstr(w, m->cfg.hf_family);
    mp_write_cstr(w, "dense_layers");
    mp_write_array(w, (uint32_t)(hc->n_layers - hc->n_moe));
    for (int l = 0, k = 0; l < hc->n_layers; l++) {
        if (k < hc->n_moe && hc->moe[k] == l)
            k++;
        else
            mp_write_i64(w, l);
    }
    /* per moe layer: the checkpoint's layer, its router, its expert tensors
     * ("{e}" stands for the expert's index) */
    mp_write_cstr(w, "layers");
    mp_write_array(w, (uint32_t)hc->n_moe);
    int nextra = 0;
    for (int mat = HF_BIAS; mat <= HF_SH_GATEW; mat++)
        nextra += hf_cfg_has(hc, (hf_mat)mat);
    for (int l = 0; l < hc->n_moe; l++) {
        mp_write_map(w, nextra ? 4 : 3);
        mp_write_cstr(w, "layer");
        mp_write_i64(w, hc->moe[l]);
        mp_write_cstr(w, "router");
        hf_tensor_name(f, hc->moe[l], 0, HF_ROUTER, nm, sizeof(nm));
        mp_write_cstr(w, nm);
        mp_write_cstr(w, "experts");
        mp_write_array(w, 3);
        for (int mat = HF_GATE; mat <= HF_DOWN; mat++) {
            char pat[220];
            hf_tensor_name(f, hc->moe[l], 999999, (hf_mat)mat, nm, sizeof(nm));
            char *at = strstr(nm, ".999999.");
            if (at) {
                *at = 0;
                snprintf(pat, sizeof(pat), "%s.{e}.%s", nm, at + 8);
            } else {
                snprintf(pat, sizeof(pat), "%s", nm);
            }
            mp_write_cstr(w, pat);
        }
        if (nextra) { /* the bias, the shared expert, its gate (replicated) */
            mp_write_cstr(w, "shared");
            mp_write_array(w, (uint32_t)nextra);
            for (int mat = HF_BIAS; mat <= HF_SH_GATEW; mat++)
                if (hf_cfg_has(hc, (hf_mat)mat)) {
                    hf_tensor_name(f, hc->moe[l], 0, (hf_mat)mat, nm, sizeof(nm));
                    mp_write_cstr(w, nm);
                }
        }
    }
    free(hc);
}
