/* hfread.c - reading a Hugging Face directory's MoE tensors; see hfcfg.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/confine.h"
#include "common/hfcfg.h"
#include "common/safetensors.h"

struct hf_reader {
    char dir[4096];
    const hf_cfg *cfg; /* the caller's, outlives the reader */
    hf_files *files;   /* owned */
    st_file **open;    /* (nfiles) owned, NULL until first use */
    const char *roots[CONFINE_MAX_ROOTS];
    int nroots;
};

moe_err hf_reader_open(const char *dir, const hf_cfg *cfg, const char *const *roots, int nroots,
                       hf_reader **out, char *err, size_t errlen)
{
    hf_reader *r = calloc(1, sizeof(*r));
    if (!r)
        return MOE_ENOMEM;
    snprintf(r->dir, sizeof(r->dir), "%s", dir);
    r->cfg = cfg;
    for (int i = 0; i < nroots && i < CONFINE_MAX_ROOTS; i++)
        r->roots[r->nroots++] = roots[i];
    moe_err e = hf_files_open(dir, &r->files, err, errlen);
    if (e == MOE_OK && !(r->open = calloc((size_t)hf_files_count(r->files), sizeof(st_file *))))
        e = MOE_ENOMEM;
    if (e != MOE_OK) {
        hf_reader_close(r);
        return e;
    }
    *out = r;
    return MOE_OK;
}

void hf_reader_close(hf_reader *r)
{
    if (!r)
        return;
    for (int i = 0; r->open && i < hf_files_count(r->files); i++)
        st_close(r->open[i]);
    free(r->open);
    hf_files_close(r->files);
    free(r);
}

moe_err hf_reader_file_open(hf_reader *r, int i, st_file **f, char *err, size_t errlen)
{
    if (!r->open[i]) {
        char path[4400], real[4400];
        snprintf(path, sizeof(path), "%s/%s", r->dir, hf_files_name(r->files, i));
        /* the file may be a symlink: what is read stays under a root */
        moe_err e = path_confine(path, r->roots, r->nroots, real, sizeof(real), err, errlen);
        if (e == MOE_OK)
            e = st_open_flags(real, ST_OPEN_ANY_DTYPE | ST_OPEN_NO_CHECKSUM, &r->open[i], err,
                              errlen);
        if (e != MOE_OK)
            return e;
    }
    *f = r->open[i];
    return MOE_OK;
}

const hf_files *hf_reader_files(const hf_reader *r)
{
    return r->files;
}

const char *hf_reader_file(const hf_reader *r, const char *tensor)
{
    int i = hf_files_find(r->files, tensor);
    return i < 0 ? "" : hf_files_name(r->files, i);
}

static const char *torch_name(st_dtype d)
{
    return d == ST_F32 ? "float32" : d == ST_BF16 ? "bfloat16" : "float16";
}

moe_err hf_reader_get(hf_reader *r, int layer, int expert, hf_mat mat, const st_tensor **t,
                      char *err, size_t errlen)
{
    char name[200];
    hf_tensor_name(r->cfg->family, layer, expert, mat, name, sizeof(name));
    int fi = hf_files_find(r->files, name);
    if (fi < 0) {
        snprintf(err, errlen,
                 "%s/model.safetensors.index.json names no file for tensor %s (family %s)", r->dir,
                 name, r->cfg->model_type);
        return MOE_EINVAL;
    }
    st_file *f;
    char ferr[600];
    moe_err e = hf_reader_file_open(r, fi, &f, ferr, sizeof(ferr));
    if (e != MOE_OK) {
        snprintf(err, errlen, "%s (reading tensor %s)", ferr, name);
        return e;
    }
    const char *file = hf_files_name(r->files, fi);
    const st_tensor *s = st_find(f, name);
    if (!s) {
        snprintf(err, errlen, "%s/%s has no tensor %s (family %s)", r->dir, file, name,
                 r->cfg->model_type);
        return MOE_EINVAL;
    }
    if (s->dtype == ST_OTHER) {
        snprintf(err, errlen, "%s/%s: tensor %s is %s: only BF16, F16 and F32 are read", r->dir,
                 file, name, s->dtype_name);
        return MOE_EINVAL;
    }
    if (r->cfg->dtype_known && mat != HF_BIAS && strcmp(torch_name(s->dtype), r->cfg->dtype) != 0) {
        snprintf(err, errlen, "%s/%s: tensor %s is %s but config.json says dtype %s", r->dir, file,
                 name, s->dtype_name, r->cfg->dtype);
        return MOE_EINVAL;
    }
    int64_t want[2];
    int nd = hf_tensor_shape(r->cfg, mat, want);
    if (nd == 1 && (s->ndim != 1 || s->shape[0] != want[0])) {
        snprintf(err, errlen,
                 "%s/%s: tensor %s has %d dimensions (first %lld), config.json implies (%lld) "
                 "(experts %d)",
                 r->dir, file, name, s->ndim, (long long)(s->ndim > 0 ? s->shape[0] : 0),
                 (long long)want[0], r->cfg->E);
        return MOE_EINVAL;
    }
    if (nd == 2 && (s->ndim != 2 || s->shape[0] != want[0] || s->shape[1] != want[1])) {
        int sh = mat >= HF_SH_GATE && mat <= HF_SH_DOWN;
        const char *fk =
            sh ? (r->cfg->family == HF_QWEN2_MOE ? "shared_expert_intermediate_size"
                                                 : "n_shared_experts x moe_intermediate_size")
            : r->cfg->family == HF_MIXTRAL || r->cfg->family == HF_OLMOE ? "intermediate_size"
                                                                         : "moe_intermediate_size";
        snprintf(err, errlen,
                 "%s/%s: tensor %s has shape (%lld, %lld%s), config.json implies (%lld, %lld) "
                 "(hidden_size %d, %s %d, experts %d)",
                 r->dir, file, name, (long long)(s->ndim > 0 ? s->shape[0] : 0),
                 (long long)(s->ndim > 1 ? s->shape[1] : 0), s->ndim > 2 ? ", ..." : "",
                 (long long)want[0], (long long)want[1], r->cfg->H, fk, sh ? r->cfg->Fs : r->cfg->F,
                 r->cfg->E);
        return MOE_EINVAL;
    }
    *t = s;
    return MOE_OK;
}
