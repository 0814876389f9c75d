/*
 * hf.c - this worker's part of a model from a Hugging Face directory: its
 * parameters get the checkpoint's own tensor names, and its weights (the
 * routers, replicated, and its own experts) are read from the directory's
 * safetensors files. The files are mapped and only the tensors read here
 * are touched: a worker never reads the other workers' experts.
 */
#include <stdio.h>
#include <string.h>

#include "confine.h"
#include "hfcfg.h"
#include "kern.h"
#include "safetensors.h"
#include "worker.h"

void wkr_hf_names(wkr_model *m, const hf_cfg *hc)
{
    hf_family f = hf_family_parse(m->cfg.hf_family);
    for (int l = 0; l < m->cfg.layers; l++) {
        wkr_param *p = wkr_layer_params(m, l);
        hf_tensor_name(f, hc->moe[l], 0, HF_ROUTER, p->name, sizeof(p->name));
        p++;
        for (int i = 0; i < m->ne; i++) {
            hf_tensor_name(f, hc->moe[l], m->e0 + i, HF_GATE, (p++)->name, sizeof(p->name));
            hf_tensor_name(f, hc->moe[l], m->e0 + i, HF_UP, (p++)->name, sizeof(p->name));
            hf_tensor_name(f, hc->moe[l], m->e0 + i, HF_DOWN, (p++)->name, sizeof(p->name));
        }
    }
}

/* load_one converts tensor (layer, expert, mat) into dst (n floats) */
static moe_err load_one(hf_reader *rd, int layer, int expert, hf_mat mat, float *dst, size_t n,
                        int bf16, char *err, size_t errlen)
{
    const st_tensor *t;
    moe_err e = hf_reader_get(rd, layer, expert, mat, &t, err, errlen);
    if (e != MOE_OK)
        return e;
    if (st_to_f32(t, dst, n) != MOE_OK) {
        snprintf(err, errlen, "tensor %s: cannot convert %s", t->name, t->dtype_name);
        return MOE_EINVAL;
    }
    if (bf16)
        kern_bf16_round_n(dst, n);
    return MOE_OK;
}

moe_err wkr_hf_load(wkr_model *m, const hf_cfg *hc, char *err, size_t errlen)
{
    const model_cfg *c = &m->cfg;
    if (hc->n_moe != c->layers || hc->H != c->d_model || hc->F != c->d_ff ||
        hc->E != c->n_experts || hc->K != c->top_k) {
        snprintf(err, errlen, "%s/config.json changed since the coordinator read it", c->hf_dir);
        return MOE_EINVAL;
    }
    char rootbuf[CONFINE_MAX_ROOTS][CFG_STR_MAX];
    const char *roots[CONFINE_MAX_ROOTS];
    int nr = wkr_ckpt_get_roots(rootbuf, CONFINE_MAX_ROOTS);
    for (int i = 0; i < nr; i++)
        roots[i] = rootbuf[i];
    hf_reader *rd;
    moe_err e = hf_reader_open(c->hf_dir, hc, roots, nr, &rd, err, errlen);
    if (e != MOE_OK)
        return e;
    int bf = c->dtype == MOE_BF16;
    size_t fh = (size_t)c->d_ff * c->d_model;
    for (int l = 0; e == MOE_OK && l < c->layers; l++) {
        wkr_layer *L = &m->layers[l];
        int hl = hc->moe[l];
        e = load_one(rd, hl, 0, HF_ROUTER, L->wr, (size_t)c->n_experts * c->d_model, bf, err,
                     errlen);
        for (int i = 0; e == MOE_OK && i < m->ne; i++) {
            int x = m->e0 + i;
            e = load_one(rd, hl, x, HF_GATE, L->w1 + i * fh, fh, bf, err, errlen);
            if (e == MOE_OK)
                e = load_one(rd, hl, x, HF_UP, L->w3 + i * fh, fh, bf, err, errlen);
            if (e == MOE_OK)
                e = load_one(rd, hl, x, HF_DOWN, L->w2 + i * fh, fh, bf, err, errlen);
        }
    }
    hf_reader_close(rd);
    return e;
}
