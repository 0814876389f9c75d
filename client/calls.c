/* calls.c - libmoe typed calls: ping, model.create, forward. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/client_dp.h"
#include "common/model_cfg.h"
#include "base/moe.h"
#include "common/params.h"
#include "proto/proto.h"

static moe_err fail(moe_reply *r, moe_err e)
{
    moe_reply_free(r);
    return e;
}

moe_err moe_ping(moe_client *c)
{
    moe_reply r;
    moe_err e = moe_call(c, "ping", NULL, 0, &r);
    moe_reply_free(&r);
    return e;
}

moe_err moe_model_create(moe_client *c, const moe_model_config *cfg)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_err e = model_cfg_write_request(
        &w, cfg->name ? cfg->name : "", cfg->layers, cfg->d_model, cfg->d_ff, cfg->n_experts,
        cfg->top_k, cfg->activation, cfg->renormalize, cfg->capacity_factor,
        moe_dtype_name(cfg->dtype) ? moe_dtype_name(cfg->dtype) : "?", cfg->seed,
        cfg->aux_loss_coef, cfg->z_loss_coef);
    if (e != MOE_OK) {
        mp_writer_fini(&w);
        moe__set_error("model.create: a name, activation or dtype is too long");
        return e;
    }
    moe_reply r;
    e = w.failed ? MOE_ENOMEM : moe_call(c, "model.create", w.buf, w.len, &r);
    mp_writer_fini(&w);
    if (!w.failed)
        moe_reply_free(&r);
    return e;
}

moe_err moe_model_delete(moe_client *c, const char *model)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, model ? model : "");
    moe_reply r;
    moe_err e = w.failed ? MOE_ENOMEM : moe_call(c, "model.delete", w.buf, w.len, &r);
    mp_writer_fini(&w);
    if (!w.failed)
        moe_reply_free(&r);
    return e;
}

moe_err moe_model_create_from_hf(moe_client *c, const char *name, const char *dir,
                                 const char *dtype)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, dtype ? 3 : 2);
    mp_write_cstr(&w, "name");
    mp_write_cstr(&w, name ? name : "");
    mp_write_cstr(&w, "from_hf");
    mp_write_cstr(&w, dir ? dir : "");
    if (dtype) {
        mp_write_cstr(&w, "dtype");
        mp_write_cstr(&w, dtype);
    }
    moe_reply r;
    moe_err e = w.failed ? MOE_ENOMEM : moe_call(c, "model.create", w.buf, w.len, &r);
    mp_writer_fini(&w);
    if (!w.failed)
        moe_reply_free(&r);
    return e;
}

void moe_fwd_info_free(moe_fwd_info *info)
{
    if (!info)
        return;
    free(info->tokens_per_expert);
    free(info->dropped);
    info->tokens_per_expert = info->dropped = NULL;
}

static moe_err read_i64_array(mp_reader *r, int64_t **out, int *n_out)
{
    uint32_t n;
    if (mp_read_array(r, &n, NULL) != MOE_OK)
        return MOE_EPROTO;
    int64_t *a = calloc(n ? n : 1, sizeof(int64_t));
    if (!a)
        return MOE_ENOMEM;
    for (uint32_t i = 0; i < n; i++)
        if (mp_read_i64(r, &a[i], NULL) != MOE_OK) {
            free(a);
            return MOE_EPROTO;
        }
    *out = a;
    *n_out = (int)n;
    return MOE_OK;
}

static moe_err parse_stats(mp_reader *r, moe_fwd_info *info)
{
    uint32_t n;
    int ndropped = 0;
    if (mp_read_map(r, &n, NULL) != MOE_OK)
        return MOE_EPROTO;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        moe_err e = MOE_OK;
        if (mp_read_str(r, &k, &kl, NULL) != MOE_OK)
            return MOE_EPROTO;
        /* a repeated key would leak the first array */
        if (mp_str_eq(k, kl, "tokens_per_expert") && !info->tokens_per_expert)
            e = read_i64_array(r, &info->tokens_per_expert, &info->n_experts);
        else if (mp_str_eq(k, kl, "dropped") && !info->dropped)
            e = read_i64_array(r, &info->dropped, &ndropped);
        else if (mp_str_eq(k, kl, "imbalance"))
            e = mp_read_f64(r, &info->imbalance, NULL);
        else if (mp_str_eq(k, kl, "gate_s"))
            e = mp_read_f64(r, &info->gate_s, NULL);
        else if (mp_str_eq(k, kl, "dispatch_s"))
            e = mp_read_f64(r, &info->dispatch_s, NULL);
        else if (mp_str_eq(k, kl, "experts_s"))
            e = mp_read_f64(r, &info->experts_s, NULL);
        else if (mp_str_eq(k, kl, "combine_s"))
            e = mp_read_f64(r, &info->combine_s, NULL);
        else if (mp_str_eq(k, kl, "total_s"))
            e = mp_read_f64(r, &info->total_s, NULL);
        else if (mp_str_eq(k, kl, "aux_loss"))
            e = mp_read_f64(r, &info->aux_loss, NULL);
        else if (mp_str_eq(k, kl, "z_loss"))
            e = mp_read_f64(r, &info->z_loss, NULL);
        else
            e = mp_skip(r, NULL);
        if (e != MOE_OK)
            return e;
    }
    /* callers index both arrays by expert: they must have n_experts entries */
    if (info->dropped && (!info->tokens_per_expert || ndropped != info->n_experts))
        return MOE_EPROTO;
    return MOE_OK;
}

static moe_err forward_impl(moe_client *c, const char *model, int layer, moe_dtype dt,
                            const void *x, int64_t T, int64_t H, void *y, moe_fwd_info *info,
                            int train);

moe_err moe_forward(moe_client *c, const char *model, int layer, moe_dtype dt, const void *x,
                    int64_t T, int64_t H, void *y, moe_fwd_info *info)
{
    return forward_impl(c, model, layer, dt, x, T, H, y, info, 0);
}

moe_err moe_forward_train(moe_client *c, const char *model, int layer, moe_dtype dt, const void *x,
                          int64_t T, int64_t H, void *y, moe_fwd_info *info)
{
    if (!info)
        return MOE_EINVAL;
    return forward_impl(c, model, layer, dt, x, T, H, y, info, 1);
}

/* read_tensor_result finds key in the result map and copies its data into
 * out (nbytes, dtype dt). */
/* result_find positions rd at the value of key in the reply's result map. */
static moe_err result_find(const moe_reply *r, const char *key, mp_reader *rd)
{
    uint32_t n;
    mp_reader_init(rd, r->buf + r->result_off, r->len - r->result_off);
    if (mp_read_map(rd, &n, NULL) != MOE_OK)
        return MOE_EPROTO;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(rd, &k, &kl, NULL) != MOE_OK)
            return MOE_EPROTO;
        if (mp_str_eq(k, kl, key))
            return MOE_OK;
        if (mp_skip(rd, NULL) != MOE_OK)
            return MOE_EPROTO;
    }
    return MOE_EPROTO;
}

/* read_tensor_result copies the tensor `key` (nbytes, dtype dt) into out. */
static moe_err read_tensor_result(moe_reply *r, const char *key, moe_dtype dt, void *out,
                                  size_t nbytes)
{
    mp_reader rd;
    moe_tensor t;
    if (result_find(r, key, &rd) != MOE_OK || moe_tensor_read(&rd, &t, NULL) != MOE_OK ||
        t.nbytes != nbytes || t.dtype != dt)
        return MOE_EPROTO;
    memcpy(out, t.data, nbytes);
    return MOE_OK;
}

moe_err moe_backward(moe_client *c, uint64_t handle, moe_dtype dt, const void *dy, int64_t T,
                     int64_t H, void *dx)
{
    size_t es = moe_dtype_size(dt);
    if (!es || T < 0 || H <= 0 || (uint64_t)T * (uint64_t)H * es > 0xffffffffull)
        return MOE_EINVAL;
    mp_writer w;
    mp_writer_init(&w);
    if (moe__data_path(c) != MOE_PATH_COORD) {
        moe_reply r;
        mp_write_cstr(&w, "handle");
        mp_write_u64(&w, handle);
        moe_err e = w.failed ? MOE_ENOMEM
                             : moe_dp_call(c, "backward", w.buf, w.len, 1, dt, dy, T, H, dx, &r);
        mp_writer_fini(&w);
        moe_reply_free(&r);
        if (e != MOE_ENOMETHOD)
            return e;
        size_t nb = (size_t)T * (size_t)H * es;
        if (moe_dp_on_device(c, dy, nb) || moe_dp_on_device(c, dx, nb)) {
            moe__set_error("backward: rows on a GPU need the data plane");
            return MOE_EINVAL;
        }
        mp_writer_init(&w); /* no data plane here: the coordinator path */
    }
    mp_write_map(&w, 2);
    mp_write_cstr(&w, "handle");
    mp_write_u64(&w, handle);
    mp_write_cstr(&w, "dy");
    moe_tensor t = {dt, 2, {T, H, 0, 0}, dy, (size_t)T * (size_t)H * es};
    moe_tensor_write(&w, &t);
    if (w.failed) {
        mp_writer_fini(&w);
        return MOE_ENOMEM;
    }
    moe_reply r;
    moe_err e = moe_call(c, "backward", w.buf, w.len, &r);
    mp_writer_fini(&w);
    if (e == MOE_OK)
        e = read_tensor_result(&r, "dx", dt, dx, t.nbytes);
    moe_reply_free(&r);
    return e;
}

static moe_err read_i64_key(moe_reply *r, const char *key, int64_t *out)
{
    mp_reader rd;
    if (result_find(r, key, &rd) != MOE_OK)
        return MOE_EPROTO;
    return mp_read_i64(&rd, out, NULL);
}

moe_err moe_optimizer_step(moe_client *c, const char *model, const moe_adamw *opt,
                           int64_t *step_out, double *grad_norm_out)
{
    /* the keys the caller set (MOE_UNSET doubles are left out: the
     * service's defaults apply; see MOE_ADAMW_DEFAULT) */
    int64_t expect = opt->expect_step;
    double hp[6] = {opt->lr,  opt->beta1,        opt->beta2,
                    opt->eps, opt->weight_decay, opt->max_grad_norm};
    pspec sp[8] = {
        {"model", P_STR, (void *)model, true, 0, 0, 0, false},
        {"lr", P_F64, &hp[0], false, 0, 0, 0, false},
        {"beta1", P_F64, &hp[1], false, 0, 0, 0, false},
        {"beta2", P_F64, &hp[2], false, 0, 0, 0, false},
        {"eps", P_F64, &hp[3], false, 0, 0, 0, false},
        {"weight_decay", P_F64, &hp[4], false, 0, 0, 0, false},
        {"max_grad_norm", P_F64, &hp[5], false, 0, 0, 0, false},
        {"expect_step", P_INT, &expect, false, 0, 0, 0, false},
    };
    mp_writer w;
    mp_writer_init(&w);
    params_write(&w, sp, opt->check_step ? 8 : 7);
    moe_reply r;
    moe_err e = moe_call(c, "optimizer.step", w.buf, w.len, &r);
    mp_writer_fini(&w);
    if (e == MOE_OK && step_out)
        e = read_i64_key(&r, "step", step_out);
    if (e == MOE_OK && grad_norm_out) {
        mp_reader rd;
        *grad_norm_out = 0;
        if (result_find(&r, "grad_norm", &rd) == MOE_OK)
            mp_read_f64(&rd, grad_norm_out, NULL);
    }
    moe_reply_free(&r);
    return e;
}

static moe_err ckpt_call(moe_client *c, const char *method, const char *model, const char *path,
                         int64_t *step_out)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 2);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, model);
    mp_write_cstr(&w, "path");
    mp_write_cstr(&w, path);
    moe_reply r;
    moe_err e = moe_call(c, method, w.buf, w.len, &r);
    mp_writer_fini(&w);
    if (e == MOE_OK && step_out)
        e = read_i64_key(&r, "step", step_out);
    moe_reply_free(&r);
    return e;
}

moe_err moe_checkpoint_save(moe_client *c, const char *model, const char *path)
{
    return ckpt_call(c, "checkpoint.save", model, path, NULL);
}

moe_err moe_checkpoint_load(moe_client *c, const char *model, const char *path, int64_t *step_out)
{
    return ckpt_call(c, "checkpoint.load", model, path, step_out);
}

static moe_err forward_impl(moe_client *c, const char *model, int layer, moe_dtype dt,
                            const void *x, int64_t T, int64_t H, void *y, moe_fwd_info *info,
                            int train)
{
    size_t es = moe_dtype_size(dt);
    if (!es || T < 0 || H <= 0 || (uint64_t)T * (uint64_t)H * es > 0xffffffffull)
        return MOE_EINVAL;
    mp_writer w;
    moe_reply r;
    moe_err e = MOE_ENOMETHOD;
    int got_y = 0;
    moe_tensor t = {dt, 2, {T, H, 0, 0}, x, (size_t)T * (size_t)H * es};
    mp_writer_init(&w);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, model);
    mp_write_cstr(&w, "layer");
    mp_write_i64(&w, layer);
    if (train) {
        mp_write_cstr(&w, "train");
        mp_write_bool(&w, true);
    }
    if (w.failed) {
        mp_writer_fini(&w);
        return MOE_ENOMEM;
    }
    if (moe__data_path(c) != MOE_PATH_COORD) {
        /* the rows straight to the workers; y comes back from them */
        e = moe_dp_call(c, "forward", w.buf, w.len, train ? 3 : 2, dt, x, T, H, y, &r);
        if (e == MOE_OK)
            got_y = 1;
        else if (e != MOE_ENOMETHOD) {
            mp_writer_fini(&w);
            return fail(&r, e);
        } else
            moe_reply_free(&r);
    }
    if (e == MOE_ENOMETHOD &&
        (moe_dp_on_device(c, x, t.nbytes) || moe_dp_on_device(c, y, t.nbytes))) {
        mp_writer_fini(&w);
        moe__set_error("forward: rows on a GPU need the data plane (this cluster or data path "
                       "has none)");
        return MOE_EINVAL;
    }
    if (e == MOE_ENOMETHOD) { /* the coordinator path: x inside the request */
        mp_writer p;
        mp_writer_init(&p);
        mp_write_map(&p, train ? 4 : 3);
        mp_write_raw(&p, w.buf, w.len);
        mp_write_cstr(&p, "x");
        moe_tensor_write(&p, &t);
        if (p.failed) {
            mp_writer_fini(&p);
            mp_writer_fini(&w);
            return MOE_ENOMEM;
        }
        e = moe_call(c, "forward", p.buf, p.len, &r);
        mp_writer_fini(&p);
        if (e != MOE_OK) {
            mp_writer_fini(&w);
            return fail(&r, e);
        }
    }
    mp_writer_fini(&w);
    mp_reader rd;
    uint32_t n;
    mp_reader_init(&rd, r.buf + r.result_off, r.len - r.result_off);
    if (mp_read_map(&rd, &n, NULL) != MOE_OK)
        return fail(&r, MOE_EPROTO);
    if (info)
        memset(info, 0, sizeof(*info));
    e = MOE_OK;
    for (uint32_t i = 0; e == MOE_OK && i < n; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(&rd, &k, &kl, NULL) != MOE_OK) {
            e = MOE_EPROTO;
        } else if (mp_str_eq(k, kl, "y")) {
            moe_tensor yt;
            if (moe_tensor_read(&rd, &yt, NULL) != MOE_OK || yt.nbytes != t.nbytes ||
                yt.dtype != dt) {
                e = MOE_EPROTO;
            } else {
                memcpy(y, yt.data, yt.nbytes);
                got_y = 1;
            }
        } else if (mp_str_eq(k, kl, "handle") && info) {
            if (mp_read_u64(&rd, &info->handle, NULL) != MOE_OK)
                e = MOE_EPROTO;
        } else if (mp_str_eq(k, kl, "stats") && info) {
            if (parse_stats(&rd, info) != MOE_OK)
                e = MOE_EPROTO;
        } else if (mp_skip(&rd, NULL) != MOE_OK) {
            e = MOE_EPROTO;
        }
    }
    if (e == MOE_OK && !got_y)
        e = MOE_EPROTO;
    /* on any error the arrays parsed so far are released: the caller gets
     * nothing to free */
    if (e != MOE_OK)
        moe_fwd_info_free(info);
    moe_reply_free(&r);
    return e;
}

void *moe_buffer_alloc(moe_client *c, size_t n)
{
    return moe_dp_buffer_alloc(c, n);
}

void moe_buffer_free(moe_client *c, void *p)
{
    moe_dp_buffer_free(c, p);
}

moe_err moe_cuda_register(moe_client *c, void *dptr, size_t n, const void *ipc_handle)
{
    return moe_dp_cuda_register(c, dptr, n, ipc_handle);
}

void moe_cuda_unregister(moe_client *c, void *dptr)
{
    moe_dp_buffer_free(c, dptr);
}

moe_err moe_nccl_floor(moe_client *c, int rank, void *dev, size_t n, int iters, double *seconds)
{
    return moe_dp_nccl_floor(c, rank, dev, n, iters, seconds);
}
