/*
 * hf.c - this worker's part of a model from a Hugging Face directory: its
 * parameters get the checkpoint's own tensor names, and its weights (the
 * routers, correction biases and shared experts, replicated, and its own
 * experts) are read from the directory's
 * safetensors files. The files are mapped and only the tensors read here
 * are touched: a worker never reads the other workers' experts.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/confine.h"
#include "common/hfcfg.h"
#include "kernels/kern.h"
#include "common/safetensors.h"
#include "worker/worker.h"

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
        /* the extra tensors in wkr_layer_nextra's order */
        p = wkr_layer_extra(m, l);
        for (int mat = HF_BIAS; mat <= HF_SH_GATEW; mat++)
            if (hf_cfg_has(hc, (hf_mat)mat))
                hf_tensor_name(f, hc->moe[l], 0, (hf_mat)mat, (p++)->name, sizeof(p->name));
    }
}

/* conv_part: elements [i0, i1) of one tensor to floats (kern_par_for) */
typedef struct conv_job {
    const st_tensor *t;
    float *dst;
    int bf16;
    int failed; /* a part could not convert (written by parts, read after) */
} conv_job;

static void conv_part(void *arg, size_t i0, size_t i1)
{
    conv_job *j = arg;
    if (st_to_f32_range(j->t, j->dst, i0, i1) != MOE_OK) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    if (j->bf16)
        kern_bf16_round_n(j->dst + i0, i1 - i0);
}

/* load_one converts tensor (layer, expert, mat) into dst (n floats), split
 * over the worker's threads (the load is bound by this conversion on a
 * warm cache: bench/history/service.md "Loading a Hugging Face checkpoint") */
static moe_err load_one(hf_reader *rd, int layer, int expert, hf_mat mat, float *dst, size_t n,
                        int bf16, char *err, size_t errlen)
{
    const st_tensor *t;
    moe_err e = hf_reader_get(rd, layer, expert, mat, &t, err, errlen);
    if (e != MOE_OK)
        return e;
    conv_job j = {t, dst, bf16, 0};
    if (t->esize == 0 || t->nbytes / t->esize != n)
        j.failed = 1;
    else
        kern_par_for(n, KERN_PAR_GRAIN, conv_part, &j);
    if (j.failed) {
        snprintf(err, errlen, "tensor %s: cannot convert %s", t->name, t->dtype_name);
        return MOE_EINVAL;
    }
    return MOE_OK;
}

moe_err wkr_hf_load(wkr_model *m, const hf_cfg *hc, char *err, size_t errlen)
{
    const model_cfg *c = &m->cfg;
    if (hc->n_moe != c->layers || hc->H != c->d_model || hc->F != c->d_ff ||
        hc->E != c->n_experts || hc->K != c->top_k || hc->Fs != c->shared_d_ff ||
        hc->score_bias != c->score_bias || hc->shared_gate != c->shared_gate) {
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
    /* every tensor read below, asked for at once: the disk reads ahead (a
     * cold cache otherwise faults the pages in one by one as they convert) */
    for (int l = 0; l < c->layers; l++) {
        const st_tensor *t;
        char perr[8];
        for (int i = -1; i < m->ne; i++)
            for (int k = 0; k < (i < 0 ? 1 : 3); k++) {
                hf_mat mat = i < 0 ? HF_ROUTER : k == 0 ? HF_GATE : k == 1 ? HF_UP : HF_DOWN;
                if (hf_reader_get(rd, hc->moe[l], i < 0 ? 0 : m->e0 + i, mat, &t, perr,
                                  sizeof(perr)) == MOE_OK)
                    st_prefetch(t);
            }
    }
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
        /* replicated: the bias (kept in f32, never rounded), the shared expert, its gate */
        size_t sfh = (size_t)c->shared_d_ff * c->d_model;
        if (e == MOE_OK && c->score_bias)
            e = load_one(rd, hl, 0, HF_BIAS, L->bias, (size_t)c->n_experts, 0, err, errlen);
        if (e == MOE_OK && c->shared_d_ff > 0)
            e = load_one(rd, hl, 0, HF_SH_GATE, L->ws1, sfh, bf, err, errlen);
        if (e == MOE_OK && c->shared_d_ff > 0)
            e = load_one(rd, hl, 0, HF_SH_UP, L->ws3, sfh, bf, err, errlen);
        if (e == MOE_OK && c->shared_d_ff > 0)
            e = load_one(rd, hl, 0, HF_SH_DOWN, L->ws2, sfh, bf, err, errlen);
        if (e == MOE_OK && c->shared_gate)
            e = load_one(rd, hl, 0, HF_SH_GATEW, L->wsg, (size_t)c->d_model, bf, err, errlen);
    }
    hf_reader_close(rd);
    return e;
}

/* is_moe_tensor: name is a router, bias, expert or shared expert tensor of
 * a MoE layer (the model's own parameters); every other tensor passes
 * through a save */
static int is_moe_tensor(const hf_cfg *hc, const char *name)
{
    int layer, at = 0;
    if (sscanf(name, "model.layers.%d.%n", &layer, &at) != 1 || at == 0)
        return 0;
    const char *block = hc->family == HF_MIXTRAL ? "block_sparse_moe." : "mlp.";
    const char *rest = name + at;
    if (strncmp(rest, block, strlen(block)) != 0)
        return 0;
    rest += strlen(block);
    if (strcmp(rest, "gate.weight") != 0 && strncmp(rest, "experts.", 8) != 0 &&
        !(hc->score_bias && strcmp(rest, "gate.e_score_correction_bias") == 0) &&
        !(hc->Fs > 0 && strncmp(rest, "shared_expert", 13) == 0))
        return 0;
    for (int l = 0; l < hc->n_moe; l++)
        if (hc->moe[l] == layer)
            return 1;
    return 0;
}

/* copy_file copies src to dst durably (config.json) */
static moe_err copy_file(const char *src, const char *dst, char *err, size_t errlen)
{
    FILE *f = fopen(src, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot read %s: %s", src, strerror(errno));
        return MOE_EIO;
    }
    char *buf = malloc(1 << 20);
    size_t n = buf ? fread(buf, 1, 1 << 20, f) : 0;
    fclose(f);
    if (!buf)
        return MOE_ENOMEM;
    moe_err e = st_write_durable(dst, buf, n, err, errlen);
    free(buf);
    return e;
}

typedef struct save_ctx {
    st_writer *sw, *ow; /* model file, optimizer file */
    mp_writer names, onames;
    uint32_t nnames, nonames;
    size_t bytes;
    uint16_t **bufs; /* bf16 copies, owned */
    int nbufs;
} save_ctx;

static moe_err add_weight(save_ctx *s, const wkr_param *p, int bf16)
{
    /* the correction bias (frozen) is (E) in the family's files */
    int nd = p->frozen && p->rows == 1 ? 1 : 2;
    int64_t shape[2] = {nd == 1 ? p->cols : p->rows, p->cols};
    moe_err e;
    if (bf16) {
        uint16_t *b = malloc(p->n * sizeof(uint16_t));
        if (!b)
            return MOE_ENOMEM;
        s->bufs[s->nbufs++] = b;
        for (size_t k = 0; k < p->n; k++)
            b[k] = kern_f32_to_bf16(p->w[k]);
        e = st_writer_add_typed(s->sw, p->name, "BF16", 2, nd, shape, b);
        s->bytes += p->n * 2;
    } else {
        e = st_writer_add(s->sw, p->name, nd, shape, p->w);
        s->bytes += p->n * 4;
    }
    mp_write_cstr(&s->names, p->name);
    s->nnames++;
    return e;
}

static moe_err add_opt(save_ctx *s, const wkr_param *p, const char *what, const float *v)
{
    char tname[200];
    int64_t shape[2] = {p->rows, p->cols};
    snprintf(tname, sizeof(tname), "optimizer.%s.%s", what, p->name);
    mp_write_cstr(&s->onames, tname);
    s->nonames++;
    s->bytes += p->n * 4;
    return st_writer_add(s->ow, tname, 2, shape, v);
}

/* add_passthrough adds every other tensor of the source directory to the
 * model file, as it is (rank 0); rd stays open until the file is written */
static moe_err add_passthrough(save_ctx *s, hf_reader *rd, const hf_cfg *hc, char *err,
                               size_t errlen)
{
    const hf_files *hf = hf_reader_files(rd);
    for (int i = 0; i < hf_files_count(hf); i++) {
        st_file *f;
        moe_err e = hf_reader_file_open(rd, i, &f, err, errlen);
        if (e != MOE_OK)
            return e;
        for (int k = 0; k < st_count(f); k++) {
            const st_tensor *t = st_at(f, k);
            if (is_moe_tensor(hc, t->name))
                continue;
            e = st_writer_add_typed(s->sw, t->name, t->dtype_name, t->esize, t->ndim, t->shape,
                                    t->data);
            if (e != MOE_OK)
                return e;
            mp_write_cstr(&s->names, t->name);
            s->nnames++;
            s->bytes += t->nbytes;
        }
    }
    return MOE_OK;
}

void wkr_hf_ckpt_save(wkr *w, rpc_call *c, wkr_model *m, const char *dir)
{
    char err[768] = "", file[64], ofile[64], path[4200];
    save_ctx s;
    memset(&s, 0, sizeof(s));
    mp_writer_init(&s.names);
    mp_writer_init(&s.onames);
    hf_cfg *hc = malloc(sizeof(*hc));
    hf_reader *rd = NULL;
    int bf = m->cfg.dtype == MOE_BF16, trained = m->train_ready;
    moe_err e = hc ? MOE_OK : MOE_ENOMEM;
    if (e == MOE_OK && (st_writer_new(&s.sw) != MOE_OK || st_writer_new(&s.ow) != MOE_OK ||
                        !(s.bufs = calloc((size_t)m->nparams, sizeof(uint16_t *)))))
        e = MOE_ENOMEM;
    if (e == MOE_OK) {
        wkr_ckpt_meta(s.sw, m, w->rank, w->world);
        wkr_ckpt_meta(s.ow, m, w->rank, w->world);
    }
    for (int i = 0; e == MOE_OK && i < m->nparams; i++) {
        const wkr_param *p = &m->params[i];
        if (p->replicated && w->rank != 0)
            continue;
        e = add_weight(&s, p, bf && !p->frozen); /* the bias stays F32, as published */
        if (e == MOE_OK && trained && bf)
            e = add_opt(&s, p, "master", p->master);
        if (e == MOE_OK && trained)
            e = add_opt(&s, p, "exp_avg", p->m);
        if (e == MOE_OK && trained)
            e = add_opt(&s, p, "exp_avg_sq", p->v);
    }
    if (e == MOE_OK && w->rank == 0) { /* the rest of the model, and its config */
        char rootbuf[CONFINE_MAX_ROOTS][CFG_STR_MAX];
        const char *roots[CONFINE_MAX_ROOTS];
        int nr = wkr_ckpt_get_roots(rootbuf, CONFINE_MAX_ROOTS);
        for (int i = 0; i < nr; i++)
            roots[i] = rootbuf[i];
        char src[4200];
        e = hf_cfg_read(m->cfg.hf_dir, hc, err, sizeof(err));
        if (e == MOE_OK)
            e = hf_reader_open(m->cfg.hf_dir, hc, roots, nr, &rd, err, sizeof(err));
        if (e == MOE_OK)
            e = add_passthrough(&s, rd, hc, err, sizeof(err));
        snprintf(src, sizeof(src), "%s/config.json", m->cfg.hf_dir);
        snprintf(path, sizeof(path), "%s/config.json", dir);
        if (e == MOE_OK)
            e = copy_file(src, path, err, sizeof(err));
    }
    snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", w->rank + 1, w->world);
    snprintf(ofile, sizeof(ofile), "optimizer-%05d-of-%05d.safetensors", w->rank + 1, w->world);
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    if (e == MOE_OK)
        e = st_writer_save(s.sw, path, err, sizeof(err));
    snprintf(path, sizeof(path), "%s/%s", dir, ofile);
    if (e == MOE_OK && s.nonames)
        e = st_writer_save(s.ow, path, err, sizeof(err));
    hf_reader_close(rd);
    free(hc);
    st_writer_free(s.sw);
    st_writer_free(s.ow);
    for (int i = 0; i < s.nbufs; i++)
        free(s.bufs[i]);
    free(s.bufs);
    if (e != MOE_OK) {
        mp_writer_fini(&s.names);
        mp_writer_fini(&s.onames);
        rpc_reply_err(c, e, "%s", err[0] ? err : moe_strerror(e));
        return;
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, s.nonames ? 5 : 3);
    mp_write_cstr(&wr, "file");
    mp_write_cstr(&wr, file);
    mp_write_cstr(&wr, "bytes");
    mp_write_u64(&wr, s.bytes);
    mp_write_cstr(&wr, "names");
    mp_write_array(&wr, s.nnames);
    mp_write_raw(&wr, s.names.buf, s.names.len);
    if (s.nonames) {
        mp_write_cstr(&wr, "opt_file");
        mp_write_cstr(&wr, ofile);
        mp_write_cstr(&wr, "opt_names");
        mp_write_array(&wr, s.nonames);
        mp_write_raw(&wr, s.onames.buf, s.onames.len);
    }
    mp_writer_fini(&s.names);
    mp_writer_fini(&s.onames);
    rpc_reply(c, &wr);
}
