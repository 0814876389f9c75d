/* model.c - the worker's models: cluster membership (join) and weights. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/hfcfg.h"
#include "kernels/kern.h"
#include "common/log.h"
#include "common/params.h"
#include "worker/gpu.h"
#include "common/placement.h"
#include "worker/worker.h"

#define MAX_WORLD 256

void wkr_model_free(wkr_model *m)
{
    if (!m)
        return;
    if (m->gpu_ops)
        wkr_gpu_detach(m);
    for (int i = 0; m->params && i < m->nparams; i++) {
        free(m->params[i].grad);
        free(m->params[i].m);
        free(m->params[i].v);
        free(m->params[i].master);
    }
    free(m->params);
    for (int i = 0; m->staged && i < 3 * m->nparams; i++)
        free(m->staged[i]);
    free(m->staged);
    for (int l = 0; m->layers && l < m->cfg.layers; l++) {
        free(m->layers[l].wr);
        free(m->layers[l].w1);
        free(m->layers[l].w3);
        free(m->layers[l].w2);
        free(m->layers[l].bias);
        free(m->layers[l].ws1);
        free(m->layers[l].ws3);
        free(m->layers[l].ws2);
        free(m->layers[l].wsg);
    }
    free(m->layers);
    free(m);
}

wkr_model *wkr_find_model(wkr *w, const char *name)
{
    for (int i = 0; i < w->nmodels; i++)
        if (strcmp(w->models[i]->cfg.name, name) == 0)
            return w->models[i];
    return NULL;
}

bool wkr_parse_or_reply(rpc_call *c, pspec *sp, int n)
{
    char err[512] = "";
    mp_reader r = c->req.params;
    const moe_err e = params_parse(&r, c->req.nparams, sp, n, err, sizeof(err));
    if (e != MOE_OK)
        rpc_reply_err(c, e, "%s", err);
    return e == MOE_OK;
}

wkr_model *wkr_model_or_reply(wkr *w, rpc_call *c, const char *name)
{
    wkr_model *m = wkr_find_model(w, name);
    if (!m)
        rpc_reply_err(c, MOE_ENOTFOUND, "model '%s' not on this worker", name);
    return m;
}

bool wkr_xc_or_reply(wkr *w, rpc_call *c)
{
    if (!w->xc) {
        rpc_reply_err(c, MOE_EUNAVAIL, "worker has no cluster communicator");
        return false;
    }
    /* a failed communicator (an NCCL one is aborted after the failed call's
     * answer, and the device-resident layers still point at it) is never
     * used again: the cluster re-forms with a new one */
    if (w->xc->failed) {
        rpc_reply_err(c, MOE_EUNAVAIL,
                      "the exchange of generation %llu failed on this worker; the cluster "
                      "re-forms",
                      (unsigned long long)xchg_generation());
        return false;
    }
    return true;
}

static void drop_models(wkr *w)
{
    wkr_handle_drop_model(w, NULL);
    for (int i = 0; i < w->nmodels; i++)
        wkr_model_free(w->models[i]);
    w->nmodels = 0;
}

/* worker.join {generation, rank, world, peers: [data_url...]}: (re)build the
 * communicator. Models are dropped: the coordinator re-creates them, since
 * the placement depends on the world size. */
void wkr_op_join(wkr *w, rpc_call *c)
{
    int64_t gen = 0, rank = 0, world = 0;
    mp_reader peers_r, id_r, roots_r;
    char err[256], shm_token[48] = "";
    pspec sp[] = {
        {"generation", P_INT, &gen, true, 0, 9e18, 0, false},
        {"rank", P_INT, &rank, true, 0, MAX_WORLD - 1, 0, false},
        {"world", P_INT, &world, true, 1, MAX_WORLD, 0, false},
        {"peers", P_RAW, &peers_r, true, 0, 0, 0, false},
        {"nccl_id", P_RAW, &id_r, false, 0, 0, 0, false},
        {"checkpoint_roots", P_RAW, &roots_r, false, 0, 0, 0, false},
        {"shm", P_STR, shm_token, false, 0, 0, sizeof(shm_token), false},
    };
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 7, err, sizeof(err));
    if (e == MOE_OK && sp[5].seen)
        e = wkr_ckpt_set_roots_from(&roots_r, err, sizeof(err));
    const void *nccl_id = NULL;
    uint32_t id_len = 0;
    if (e == MOE_OK && sp[4].seen &&
        (mp_read_bin(&id_r, &nccl_id, &id_len, NULL) != MOE_OK || id_len != 128)) {
        snprintf(err, sizeof(err), "nccl_id must be 128 bytes");
        e = MOE_EINVAL;
    }
    if (e == MOE_OK && rank >= world) {
        snprintf(err, sizeof(err), "rank %lld >= world %lld", (long long)rank, (long long)world);
        e = MOE_EINVAL;
    }
    uint32_t n = 0;
    char urls[MAX_WORLD][CFG_STR_MAX];
    const char *url_ptrs[MAX_WORLD];
    if (e == MOE_OK && (mp_read_array(&peers_r, &n, NULL) != MOE_OK || n != (uint32_t)world)) {
        snprintf(err, sizeof(err), "peers must be an array of world=%lld urls", (long long)world);
        e = MOE_EINVAL;
    }
    for (uint32_t i = 0; e == MOE_OK && i < n; i++) {
        const char *s;
        uint32_t len;
        if (mp_read_str(&peers_r, &s, &len, NULL) != MOE_OK || len >= CFG_STR_MAX) {
            snprintf(err, sizeof(err), "peers[%u] is not a url", i);
            e = MOE_EINVAL;
            break;
        }
        memcpy(urls[i], s, len);
        urls[i][len] = 0;
        url_ptrs[i] = urls[i];
    }
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    /* a new generation: a peer of the old one may be gone. Abort the old
     * communicator first: NCCL kernels stuck on a dead peer stop, so that
     * dropping the models' device objects (which synchronise) cannot hang */
    xchg_abort(w->xc);
    w->xc = NULL;
    drop_models(w);
    xchg_set_generation((uint64_t)gen);
    if (nccl_id) {
#ifdef MOE_HAVE_CUDA
        e = xchg_nccl_open((int)rank, (int)world, nccl_id, (int)w->device_index,
                           (int)w->xchg_timeout_ms, &w->xc);
        if (e != MOE_OK) {
            w->xc = NULL;
            rpc_reply_err(c, MOE_EUNAVAIL, "NCCL communicator of %lld ranks failed to form: %s",
                          (long long)world, moe_strerror(e));
            return;
        }
        goto joined;
#else
        rpc_reply_err(c, MOE_EINVAL, "this worker was built without CUDA/NCCL");
        return;
#endif
    }
    if (shm_token[0]) { /* every member on this host: shared memory */
        e = xchg_shm_open((int)rank, (int)world, shm_token, (uint64_t)gen, (int)w->xchg_timeout_ms,
                          &w->xc);
        if (e != MOE_OK) {
            w->xc = NULL;
            rpc_reply_err(c, MOE_EUNAVAIL,
                          "exchange through shared memory with %lld peers failed to form: %s",
                          (long long)world, moe_strerror(e));
            return;
        }
        goto joined;
    }
    /* the data listener lives as long as the worker: every generation's
     * communicator borrows it */
    e = xchg_nng_open(w->lis, (int)rank, (int)world, url_ptrs, (uint64_t)gen,
                      (int)w->xchg_timeout_ms, &w->xc);
    if (e != MOE_OK) {
        w->xc = NULL;
        rpc_reply_err(c, MOE_EUNAVAIL, "exchange with %lld peers failed to form: %s",
                      (long long)world, moe_strerror(e));
        return;
    }
joined:
    w->rank = (int)rank;
    w->world = (int)world;
    w->generation = (uint64_t)gen;
    LOG_I("joined generation %llu as rank %d of %d (%s)", (unsigned long long)gen, w->rank,
          w->world,
          nccl_id        ? "NCCL"
          : shm_token[0] ? "shared memory"
                         : "nng");
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 0);
    rpc_reply(c, &wr);
}

/* worker.xchg_id {}: rank 0 of a GPU cluster makes the NCCL unique id that
 * the coordinator relays to every member in worker.join. */
void wkr_op_xchg_id(wkr *w, rpc_call *c)
{
#ifdef MOE_HAVE_CUDA
    uint8_t id[XCHG_NCCL_ID_BYTES];
    moe_err e = xchg_nccl_get_unique_id(id);
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "ncclGetUniqueId failed");
        return;
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 1);
    mp_write_cstr(&wr, "nccl_id");
    mp_write_bin(&wr, id, sizeof(id));
    rpc_reply(c, &wr);
#else
    (void)w;
    rpc_reply_err(c, MOE_EINVAL, "this worker was built without CUDA/NCCL");
#endif
}

static float *alloc_init(uint64_t seed, int layer, int expert, kern_wkind which, int rows, int cols,
                         int bf16)
{
    size_t n = (size_t)rows * (size_t)cols;
    float *p = malloc(n * sizeof(float));
    if (!p)
        return NULL;
    kern_init_weight(seed, layer, expert, which, rows, cols, p);
    if (bf16)
        kern_bf16_round_n(p, n);
    return p;
}

/* build_model allocates and initialises this worker's share of every layer. */
static moe_err build_model(wkr *w, const model_cfg *cfg, wkr_model **out)
{
    wkr_model *m = calloc(1, sizeof(*m));
    if (!m)
        return MOE_ENOMEM;
    m->cfg = *cfg;
    int E = cfg->n_experts, H = cfg->d_model, F = cfg->d_ff, bf = cfg->dtype == MOE_BF16;
    m->e0 = placement_first(E, w->world, w->rank);
    m->ne = placement_count(E, w->world, w->rank);
    m->layers = calloc((size_t)cfg->layers, sizeof(wkr_layer));
    if (!m->layers)
        goto oom;
    int hf = cfg->hf_dir[0] != 0; /* weights come from the directory: no init */
    for (int l = 0; l < cfg->layers; l++) {
        wkr_layer *L = &m->layers[l];
        size_t fh = (size_t)F * H;
        L->wr = alloc_init(cfg->seed, l, 0, KERN_W_ROUTER, E, H, bf);
        L->w1 = malloc((size_t)(m->ne ? m->ne : 1) * fh * sizeof(float));
        L->w2 = malloc((size_t)(m->ne ? m->ne : 1) * fh * sizeof(float));
        if (act_gated(cfg->act))
            L->w3 = malloc((size_t)(m->ne ? m->ne : 1) * fh * sizeof(float));
        if (!L->wr || !L->w1 || !L->w2 || (act_gated(cfg->act) && !L->w3))
            goto oom;
        for (int i = 0; i < m->ne && !hf; i++) {
            int e = m->e0 + i;
            kern_init_weight(cfg->seed, l, e, KERN_W1, F, H, L->w1 + i * fh);
            kern_init_weight(cfg->seed, l, e, KERN_W2, H, F, L->w2 + i * fh);
            if (L->w3)
                kern_init_weight(cfg->seed, l, e, KERN_W3, F, H, L->w3 + i * fh);
        }
        /* routing families: the bias starts at 0; the shared expert is
         * initialised as expert E of the layer (the same on every rank) */
        int Fs = cfg->shared_d_ff;
        size_t sfh = (size_t)Fs * H;
        if (cfg->score_bias && !(L->bias = calloc((size_t)E, sizeof(float))))
            goto oom;
        if (Fs > 0) {
            L->ws1 = malloc(sfh * sizeof(float));
            L->ws2 = malloc(sfh * sizeof(float));
            if (act_gated(cfg->act))
                L->ws3 = malloc(sfh * sizeof(float));
            if (!L->ws1 || !L->ws2 || (act_gated(cfg->act) && !L->ws3))
                goto oom;
            kern_init_weight(cfg->seed, l, E, KERN_W1, Fs, H, L->ws1);
            kern_init_weight(cfg->seed, l, E, KERN_W2, H, Fs, L->ws2);
            if (L->ws3)
                kern_init_weight(cfg->seed, l, E, KERN_W3, Fs, H, L->ws3);
        }
        if (cfg->shared_gate) {
            if (!(L->wsg = malloc((size_t)H * sizeof(float))))
                goto oom;
            kern_init_weight(cfg->seed, l, E + 1, KERN_W1, 1, H, L->wsg);
        }
        if (bf && Fs > 0) {
            kern_bf16_round_n(L->ws1, sfh);
            kern_bf16_round_n(L->ws2, sfh);
            if (L->ws3)
                kern_bf16_round_n(L->ws3, sfh);
        }
        if (bf && L->wsg)
            kern_bf16_round_n(L->wsg, (size_t)H);
        /* a directory's experts are not initialised here: wkr_hf_load
         * writes (and rounds) them; rounding them here would read and touch
         * every page of the uninitialised buffers once more */
        if (bf && !hf) {
            kern_bf16_round_n(L->w1, (size_t)m->ne * fh);
            kern_bf16_round_n(L->w2, (size_t)m->ne * fh);
            if (L->w3)
                kern_bf16_round_n(L->w3, (size_t)m->ne * fh);
        }
    }
    /* the parameter list: per layer the router, then w1, (w3,) w2 of each local expert */
    int nmat = act_gated(cfg->act) ? 3 : 2;
    int nextra = wkr_layer_nextra(cfg);
    m->nparams = cfg->layers * (1 + m->ne * nmat + nextra);
    m->params = calloc((size_t)m->nparams, sizeof(wkr_param));
    if (!m->params)
        goto oom;
    wkr_param *p = m->params;
    for (int l = 0; l < cfg->layers; l++) {
        wkr_layer *L = &m->layers[l];
        size_t fh = (size_t)F * H;
        snprintf(p->name, sizeof(p->name), "model.layers.%d.block_sparse_moe.gate.weight", l);
        p->w = L->wr, p->n = (size_t)E * H, p->rows = E, p->cols = H, p->replicated = 1;
        p++;
        for (int i = 0; i < m->ne; i++) {
            int e = m->e0 + i;
            snprintf(p->name, sizeof(p->name),
                     "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l, e);
            p->w = L->w1 + i * fh, p->n = fh, p->rows = F, p->cols = H;
            p++;
            if (nmat == 3) {
                snprintf(p->name, sizeof(p->name),
                         "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l, e);
                p->w = L->w3 + i * fh, p->n = fh, p->rows = F, p->cols = H;
                p++;
            }
            snprintf(p->name, sizeof(p->name),
                     "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l, e);
            p->w = L->w2 + i * fh, p->n = fh, p->rows = H, p->cols = F;
            p++;
        }
    }
    /* the layers' extra replicated tensors (wkr_layer_extra), in the
     * Hugging Face names of DeepSeek-V3 / Qwen2-MoE (model.layers.L.mlp.*) */
    for (int l = 0; l < cfg->layers; l++) {
        wkr_layer *L = &m->layers[l];
        int Fs = cfg->shared_d_ff;
        size_t sfh = (size_t)Fs * H;
        const char *sh = cfg->shared_gate ? "shared_expert" : "shared_experts";
        if (cfg->score_bias) {
            snprintf(p->name, sizeof(p->name), "model.layers.%d.mlp.gate.e_score_correction_bias",
                     l);
            p->w = L->bias, p->n = (size_t)E, p->rows = 1, p->cols = E;
            p->replicated = 1, p->frozen = 1;
            p++;
        }
        if (Fs > 0) {
            snprintf(p->name, sizeof(p->name), "model.layers.%d.mlp.%s.gate_proj.weight", l, sh);
            p->w = L->ws1, p->n = sfh, p->rows = Fs, p->cols = H, p->replicated = 1;
            p++;
            if (nmat == 3) {
                snprintf(p->name, sizeof(p->name), "model.layers.%d.mlp.%s.up_proj.weight", l, sh);
                p->w = L->ws3, p->n = sfh, p->rows = Fs, p->cols = H, p->replicated = 1;
                p++;
            }
            snprintf(p->name, sizeof(p->name), "model.layers.%d.mlp.%s.down_proj.weight", l, sh);
            p->w = L->ws2, p->n = sfh, p->rows = H, p->cols = Fs, p->replicated = 1;
            p++;
        }
        if (cfg->shared_gate) {
            snprintf(p->name, sizeof(p->name), "model.layers.%d.mlp.shared_expert_gate.weight", l);
            p->w = L->wsg, p->n = (size_t)H, p->rows = 1, p->cols = H, p->replicated = 1;
            p++;
        }
    }
    *out = m;
    return MOE_OK;
oom:
    wkr_model_free(m);
    return MOE_ENOMEM;
}

/* worker.model_create {model.create params}: build (or confirm) the model. */
void wkr_op_model_create(wkr *w, rpc_call *c)
{
    model_cfg cfg;
    char err[256];
    mp_reader r = c->req.params;
    memset(&cfg, 0, sizeof(cfg));
    moe_err e = model_cfg_parse(&r, c->req.nparams, &cfg, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    if (!w->xc) {
        rpc_reply_err(c, MOE_EUNAVAIL, "worker has not joined a cluster");
        return;
    }
    if (w->world < w->fail_create_below_world) {
        rpc_reply_err(c, MOE_ENOMEM,
                      "cannot allocate model '%s' on %d workers (--fail-create-below-world %lld)",
                      cfg.name, w->world, w->fail_create_below_world);
        return;
    }
    if (w->fail_create_for_tests[0] && strcmp(w->fail_create_for_tests, cfg.name) == 0 &&
        !w->fail_create_done++) {
        rpc_reply_err(c, MOE_ENOMEM, "cannot allocate model '%s' (--fail-create-for-tests)",
                      cfg.name);
        return;
    }
    wkr_model *old = wkr_find_model(w, cfg.name);
    if (old && !model_cfg_same(&old->cfg, &cfg)) {
        rpc_reply_err(c, MOE_EINVAL, "model '%s' exists with another configuration", cfg.name);
        return;
    }
    if (!old) {
        if (w->nmodels == WKR_MAX_MODELS) {
            rpc_reply_err(c, MOE_ENOMEM, "too many models (max %d)", WKR_MAX_MODELS);
            return;
        }
        wkr_model *m;
        if (w->slow_create_ms > 0)
            usleep((useconds_t)(w->slow_create_ms * 1000));
        e = build_model(w, &cfg, &m);
        if (e != MOE_OK) {
            rpc_reply_err(c, e, "cannot allocate model '%s'", cfg.name);
            return;
        }
        if (cfg.hf_dir[0]) { /* a Hugging Face directory: its names and weights (hf.c) */
            char herr[768];
            hf_cfg *hc = malloc(sizeof(*hc));
            e = hc ? hf_cfg_read(cfg.hf_dir, hc, herr, sizeof(herr)) : MOE_ENOMEM;
            if (e == MOE_OK) {
                wkr_hf_names(m, hc);
                e = wkr_hf_load(m, hc, herr, sizeof(herr));
            }
            free(hc);
            if (e != MOE_OK) {
                wkr_model_free(m);
                rpc_reply_err(c, e, "%s", e == MOE_ENOMEM ? "out of memory" : herr);
                return;
            }
        }
        /* the GPU kernels store bf16: an f32 model stays on the exact CPU path */
        if (w->use_gpu && cfg.dtype != MOE_BF16)
            LOG_I("model %s is f32: computed on the CPU path (GPU kernels are bf16)", cfg.name);
        else if (w->use_gpu && wkr_gpu_attach(w, m, 0) != MOE_OK)
            LOG_W("model %s stays on the CPU path (GPU kernels need d_model and d_ff multiples "
                  "of 128, n_experts <= 256, top_k <= 8, and the memory)",
                  cfg.name);
        w->models[w->nmodels++] = m;
        LOG_I("model %s: %d layers, experts [%d, %d) of %d here", cfg.name, cfg.layers, m->e0,
              m->e0 + m->ne, cfg.n_experts);
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 0);
    rpc_reply(c, &wr);
}
