/*
 * ckpt.c - checkpoints on this worker. Save writes one safetensors file
 * (weights - fp32 masters for bf16 models -, AdamW moments, step, config)
 * with the experts this rank owns; rank 0 also writes the routers (they are
 * replicated). Load is two-phase so the cluster never ends half-loaded:
 * "prepare" reads and validates every tensor this rank needs into staging
 * buffers (nothing changes), "commit" swaps them in, "abort" drops them.
 * Tensors are found by name in any shard file, so a checkpoint saved by W
 * workers loads into a cluster of another size.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/confine.h"
#include "kernels/kern.h"
#include "common/log.h"
#include "worker/gpu.h"
#include "common/params.h"
#include "common/safetensors.h"
#include "worker/worker.h"

#define CKPT_MAX_FILES 1024

/* the coordinator's checkpoint roots (from registration); under roots_mu */
static pthread_mutex_t roots_mu = PTHREAD_MUTEX_INITIALIZER;
static char roots[CONFINE_MAX_ROOTS][CFG_STR_MAX];
static int nroots;

void wkr_ckpt_set_roots(const char *const *r, int n)
{
    pthread_mutex_lock(&roots_mu);
    nroots = 0;
    for (int i = 0; i < n && i < CONFINE_MAX_ROOTS; i++)
        snprintf(roots[nroots++], CFG_STR_MAX, "%s", r[i]);
    pthread_mutex_unlock(&roots_mu);
}

moe_err wkr_ckpt_set_roots_from(mp_reader *rr, char *err, size_t errlen)
{
    char buf[CONFINE_MAX_ROOTS][CFG_STR_MAX];
    const char *r[CONFINE_MAX_ROOTS];
    uint32_t n = 0;
    if (rr && (mp_read_array(rr, &n, NULL) != MOE_OK || n > CONFINE_MAX_ROOTS))
        goto bad;
    for (uint32_t i = 0; i < n; i++) {
        const char *s;
        uint32_t len;
        if (mp_read_str(rr, &s, &len, NULL) != MOE_OK || len >= CFG_STR_MAX || memchr(s, 0, len))
            goto bad;
        memcpy(buf[i], s, len);
        buf[i][len] = 0;
        r[i] = buf[i];
    }
    wkr_ckpt_set_roots(r, (int)n);
    return MOE_OK;
bad:
    if (err)
        snprintf(err, errlen, "checkpoint_roots must be an array of at most %d paths",
                 CONFINE_MAX_ROOTS);
    return MOE_EINVAL;
}

int wkr_ckpt_get_roots(char out[][CFG_STR_MAX], int max)
{
    pthread_mutex_lock(&roots_mu);
    int n = nroots < max ? nroots : max;
    for (int i = 0; i < n; i++)
        memcpy(out[i], roots[i], CFG_STR_MAX);
    pthread_mutex_unlock(&roots_mu);
    return n;
}

/* confine resolves path into out; it must lie under one of the roots. */
static moe_err confine(const char *path, char *out, size_t outlen, char *err, size_t errlen)
{
    char copy[CONFINE_MAX_ROOTS][CFG_STR_MAX];
    const char *rp[CONFINE_MAX_ROOTS];
    pthread_mutex_lock(&roots_mu);
    int n = nroots;
    for (int i = 0; i < n; i++) {
        memcpy(copy[i], roots[i], CFG_STR_MAX);
        rp[i] = copy[i];
    }
    pthread_mutex_unlock(&roots_mu);
    return path_confine(path, rp, n, out, outlen, err, errlen);
}

void wkr_ckpt_meta(st_writer *sw, const wkr_model *m, int rank, int world)
{
    char v[64];
    const model_cfg *c = &m->cfg;
#define META_I(key, val)                                                                           \
    do {                                                                                           \
        snprintf(v, sizeof(v), "%lld", (long long)(val));                                          \
        st_writer_meta(sw, key, v);                                                                \
    } while (0)
    st_writer_meta(sw, "format", "pt");
    st_writer_meta(sw, "moe.name", c->name);
    META_I("moe.step", m->step);
    META_I("moe.rank", rank);
    META_I("moe.world", world);
    META_I("moe.layers", c->layers);
    META_I("moe.d_model", c->d_model);
    META_I("moe.d_ff", c->d_ff);
    META_I("moe.n_experts", c->n_experts);
    META_I("moe.top_k", c->top_k);
    st_writer_meta(sw, "moe.activation", act_name(c->act));
    st_writer_meta(sw, "moe.dtype", moe_dtype_name(c->dtype));
#undef META_I
}

/* worker.checkpoint_save {model, dir} -> {file, bytes, names: [...]} */
void wkr_op_ckpt_save(wkr *w, rpc_call *c)
{
    char name[MODEL_NAME_MAX], dir[2048], err[512];
    pspec sp[] = {
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"dir", P_STR, dir, true, 0, 0, sizeof(dir), false},
    };
    if (!wkr_parse_or_reply(c, sp, 2))
        return;
    wkr_model *m = wkr_model_or_reply(w, c, name);
    if (!m)
        return;
    if (w->slow_ckpt_ms > 0)
        usleep((useconds_t)(w->slow_ckpt_ms * 1000));
    char real[2048];
    moe_err e = confine(dir, real, sizeof(real), err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    if (st_mkdir_p(real) != MOE_OK) {
        rpc_reply_err(c, MOE_EIO, "cannot create checkpoint directory %s: %s", real,
                      strerror(errno));
        return;
    }
    if (m->cfg.hf_dir[0]) { /* the family's names and dtype (hf.c) */
        wkr_hf_ckpt_save(w, c, m, real);
        return;
    }
    st_writer *sw;
    if (st_writer_new(&sw) != MOE_OK) {
        rpc_reply_err(c, MOE_ENOMEM, "out of memory");
        return;
    }
    char file[64], path[4096], tname[160];
    snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", w->rank + 1, w->world);
    snprintf(path, sizeof(path), "%s/%s", real, file);
    wkr_ckpt_meta(sw, m, w->rank, w->world);
    int bf = m->cfg.dtype == MOE_BF16;
    mp_writer names;
    mp_writer_init(&names);
    uint32_t nnames = 0;
    size_t bytes = 0;
    for (int pass = 0; pass < 3; pass++) {
        for (int i = 0; i < m->nparams; i++) {
            const wkr_param *p = &m->params[i];
            if (p->replicated && w->rank != 0)
                continue;
            const float *src = pass == 0   ? (bf && p->master ? p->master : p->w)
                               : pass == 1 ? p->m
                                           : p->v;
            if (!src)
                continue; /* never trained: no moments */
            if (pass == 0)
                snprintf(tname, sizeof(tname), "%s", p->name);
            else
                snprintf(tname, sizeof(tname), "optimizer.%s.%s",
                         pass == 1 ? "exp_avg" : "exp_avg_sq", p->name);
            int64_t shape[2] = {p->rows, p->cols};
            if (st_writer_add(sw, tname, 2, shape, src) != MOE_OK) {
                st_writer_free(sw);
                mp_writer_fini(&names);
                rpc_reply_err(c, MOE_ENOMEM, "out of memory");
                return;
            }
            mp_write_cstr(&names, tname);
            nnames++;
            bytes += p->n * sizeof(float);
        }
    }
    const char *delay = getenv("MOE_TEST_SAVE_DELAY_MS"); /* tests: widen the crash window */
    if (delay)
        usleep((useconds_t)atoi(delay) * 1000);
    e = st_writer_save(sw, path, err, sizeof(err));
    st_writer_free(sw);
    if (e != MOE_OK) {
        mp_writer_fini(&names);
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    LOG_I("checkpoint of %s step %lld: %s (%zu bytes)", name, (long long)m->step, path, bytes);
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 3);
    mp_write_cstr(&wr, "file");
    mp_write_cstr(&wr, file);
    mp_write_cstr(&wr, "bytes");
    mp_write_u64(&wr, bytes);
    mp_write_cstr(&wr, "names");
    mp_write_array(&wr, nnames);
    mp_write_raw(&wr, names.buf, names.len);
    mp_writer_fini(&names);
    rpc_reply(c, &wr);
}

static void drop_staged(wkr_model *m)
{
    for (int i = 0; m->staged && i < 3 * m->nparams; i++)
        free(m->staged[i]);
    free(m->staged);
    m->staged = NULL;
}

static const st_tensor *find_any(st_file **files, int n, const char *name)
{
    for (int i = 0; i < n; i++) {
        const st_tensor *t = st_find(files[i], name);
        if (t)
            return t;
    }
    return NULL;
}

/* prepare: read and validate everything into m->staged. */
static moe_err ckpt_prepare(wkr_model *m, const char *dir, mp_reader *files_r, char *err,
                            size_t errlen)
{
    uint32_t nf;
    if (mp_read_array(files_r, &nf, NULL) != MOE_OK || nf == 0 || nf > CKPT_MAX_FILES) {
        snprintf(err, errlen, "files must be a non-empty array");
        return MOE_EINVAL;
    }
    st_file **files = calloc(nf, sizeof(st_file *));
    if (!files)
        return MOE_ENOMEM;
    moe_err e = MOE_OK;
    int64_t step = -1;
    for (uint32_t i = 0; i < nf && e == MOE_OK; i++) {
        const char *s;
        uint32_t len;
        char path[4096], real[4096];
        if (mp_read_str(files_r, &s, &len, NULL) != MOE_OK || len == 0 || len > 255 ||
            memchr(s, '/', len) || memchr(s, 0, len) ||
            (len <= 2 && s[0] == '.' && s[len - 1] == '.')) {
            snprintf(err, errlen, "bad shard file name");
            e = MOE_EINVAL;
            break;
        }
        snprintf(path, sizeof(path), "%s/%.*s", dir, (int)len, s);
        /* the file itself may be a symlink: what is read stays under a root */
        e = confine(path, real, sizeof(real), err, errlen);
        /* a model from a Hugging Face directory saves its weights in its
         * dtype (BF16) next to other tensors of any dtype (hf.c) */
        if (e == MOE_OK)
            e = st_open_flags(real, m->cfg.hf_dir[0] ? ST_OPEN_ANY_DTYPE : 0, &files[i], err,
                              errlen);
        if (e == MOE_OK) {
            const char *st = st_meta(files[i], "moe.step");
            int64_t v = st ? atoll(st) : -1;
            if (v < 0 || (step >= 0 && v != step)) {
                snprintf(err, errlen, "%s: missing or inconsistent moe.step", path);
                e = MOE_EINVAL;
            }
            step = v;
        }
    }
    drop_staged(m);
    if (e == MOE_OK && !(m->staged = calloc((size_t)3 * m->nparams, sizeof(float *))))
        e = MOE_ENOMEM;
    char tname[160];
    for (int i = 0; e == MOE_OK && i < m->nparams; i++) {
        const wkr_param *p = &m->params[i];
        for (int k = 0; k < 3 && e == MOE_OK; k++) {
            if (k == 0)
                snprintf(tname, sizeof(tname), "%s", p->name);
            else
                snprintf(tname, sizeof(tname), "optimizer.%s.%s", k == 1 ? "exp_avg" : "exp_avg_sq",
                         p->name);
            const st_tensor *t = NULL;
            if (k == 0 && m->cfg.hf_dir[0]) { /* the fp32 master, when one was saved */
                char mname[200];
                snprintf(mname, sizeof(mname), "optimizer.master.%s", p->name);
                t = find_any(files, (int)nf, mname);
            }
            if (!t)
                t = find_any(files, (int)nf, tname);
            if (!t && k > 0)
                continue; /* saved before any training: moments start at zero */
            if (!t) {
                snprintf(err, errlen, "checkpoint has no tensor %s", tname);
                e = MOE_EINVAL;
            } else if (!(t->ndim == 2 && t->shape[0] == p->rows && t->shape[1] == p->cols) &&
                       !(t->ndim == 1 && p->rows == 1 && t->shape[0] == p->cols)) {
                /* (a (1, n) tensor may be saved as (n): the correction bias) */
                snprintf(err, errlen, "tensor %s has shape (%lld, %lld), the model needs (%d, %d)",
                         tname, (long long)t->shape[0], (long long)(t->ndim > 1 ? t->shape[1] : 0),
                         p->rows, p->cols);
                e = MOE_EINVAL;
            } else if (!(m->staged[3 * i + k] = malloc(p->n * sizeof(float)))) {
                e = MOE_ENOMEM;
            } else if (st_to_f32(t, m->staged[3 * i + k], p->n) != MOE_OK) {
                snprintf(err, errlen, "tensor %s is %s: only F32, BF16 and F16 are read", tname,
                         t->dtype_name);
                e = MOE_EINVAL;
            }
        }
    }
    for (uint32_t i = 0; i < nf; i++)
        st_close(files[i]);
    free(files);
    if (e != MOE_OK)
        drop_staged(m);
    else
        m->staged_step = step;
    return e;
}

/* commit: swap the staged tensors in; gradients zeroed, handles dropped. */
static moe_err ckpt_commit(wkr *w, wkr_model *m)
{
    if (!m->staged)
        return MOE_EPRECOND;
    int bf = m->cfg.dtype == MOE_BF16;
    if (!m->train_ready && wkr_model_train_alloc(m) != MOE_OK)
        return MOE_ENOMEM;
    for (int i = 0; i < m->nparams; i++) {
        wkr_param *p = &m->params[i];
        const float *wv = m->staged[3 * i], *mv = m->staged[3 * i + 1], *vv = m->staged[3 * i + 2];
        if (bf) {
            memcpy(p->master, wv, p->n * sizeof(float));
            for (size_t k = 0; k < p->n; k++)
                p->w[k] = kern_bf16_round_inl(wv[k]);
        } else {
            memcpy(p->w, wv, p->n * sizeof(float));
        }
        if (mv)
            memcpy(p->m, mv, p->n * sizeof(float));
        else
            memset(p->m, 0, p->n * sizeof(float));
        if (vv)
            memcpy(p->v, vv, p->n * sizeof(float));
        else
            memset(p->v, 0, p->n * sizeof(float));
        memset(p->grad, 0, p->n * sizeof(float));
    }
    m->step = m->staged_step;
    m->has_grads = 0;
    drop_staged(m);
    wkr_handle_drop_model(w, m);
    if (m->gpu_ops)
        return wkr_gpu_push_weights(m);
    return MOE_OK;
}

/* worker.checkpoint_load {model, phase: "prepare"|"commit"|"abort", dir, files} */
void wkr_op_ckpt_load(wkr *w, rpc_call *c)
{
    char name[MODEL_NAME_MAX], dir[2048] = "", phase[16], err[512] = "";
    mp_reader files_r;
    pspec sp[] = {
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"phase", P_STR, phase, true, 0, 0, sizeof(phase), false},
        {"dir", P_STR, dir, false, 0, 0, sizeof(dir), false},
        {"files", P_RAW, &files_r, false, 0, 0, 0, false},
    };
    if (!wkr_parse_or_reply(c, sp, 4))
        return;
    wkr_model *m = wkr_model_or_reply(w, c, name);
    if (!m)
        return;
    moe_err e = MOE_OK;
    if (strcmp(phase, "prepare") == 0) {
        if (w->slow_load_ms > 0)
            usleep((useconds_t)(w->slow_load_ms * 1000));
        if (!sp[2].seen || !sp[3].seen) {
            rpc_reply_err(c, MOE_EINVAL, "prepare needs dir and files");
            return;
        }
        e = ckpt_prepare(m, dir, &files_r, err, sizeof(err));
    } else if (strcmp(phase, "commit") == 0) {
        e = ckpt_commit(w, m);
        if (e == MOE_EPRECOND)
            snprintf(err, sizeof(err), "nothing prepared to commit");
        else if (e == MOE_OK)
            LOG_I("model %s loaded at step %lld", name, (long long)m->step);
        if (e == MOE_OK)
            m->settled = 1; /* its restore is done: the lane may serve it */
    } else if (strcmp(phase, "abort") == 0) {
        drop_staged(m);
        m->settled = 1; /* no restore comes: it serves what it holds, as the ordered road does */
    } else {
        snprintf(err, sizeof(err), "phase must be prepare, commit or abort");
        e = MOE_EINVAL;
    }
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err[0] ? err : moe_strerror(e));
        return;
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 1);
    mp_write_cstr(&wr, "step");
    mp_write_i64(&wr, m->step);
    rpc_reply(c, &wr);
}
