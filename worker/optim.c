/*
 * optim.c - optimizer.step on this worker: router gradients all-reduced
 * (every replica stays identical), the global gradient norm over all
 * workers (for clipping), AdamW on every parameter this worker owns, then
 * gradients zeroed and the step counted.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/kern.h"
#include "common/log.h"
#include "worker/gpu.h"
#include "common/params.h"
#include "worker/worker.h"

moe_err wkr_model_train_alloc(wkr_model *m)
{
    int bf = m->cfg.dtype == MOE_BF16;
    for (int i = 0; i < m->nparams; i++) {
        wkr_param *p = &m->params[i];
        size_t n = p->n ? p->n : 1;
        if (!p->grad)
            p->grad = calloc(n, sizeof(float));
        if (!p->m)
            p->m = calloc(n, sizeof(float));
        if (!p->v)
            p->v = calloc(n, sizeof(float));
        if (bf && !p->master && (p->master = malloc(n * sizeof(float))))
            memcpy(p->master, p->w, p->n * sizeof(float));
        if (!p->grad || !p->m || !p->v || (bf && !p->master))
            return MOE_ENOMEM;
    }
    m->train_ready = 1;
    return MOE_OK;
}

void wkr_op_step(wkr *w, rpc_call *c)
{
    char name[MODEL_NAME_MAX];
    double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0, max_norm = 0;
    pspec sp[] = {
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"lr", P_F64, &lr, false, 0, 1e3, 0, false},
        {"beta1", P_F64, &b1, false, 0, 1, 0, false},
        {"beta2", P_F64, &b2, false, 0, 1, 0, false},
        {"eps", P_F64, &eps, false, 0, 1, 0, false},
        {"weight_decay", P_F64, &wd, false, 0, 1e3, 0, false},
        {"max_grad_norm", P_F64, &max_norm, false, 0, 1e30, 0, false},
    };
    if (!wkr_parse_or_reply(c, sp, 7))
        return;
    wkr_model *m = wkr_model_or_reply(w, c, name);
    if (!m || !wkr_xc_or_reply(w, c))
        return;
    moe_err e = MOE_OK;
    if (w->slow_step_ms > 0)
        usleep((useconds_t)(w->slow_step_ms * 1000));
    if (!m->train_ready && wkr_model_train_alloc(m) != MOE_OK) {
        rpc_reply_err(c, MOE_ENOMEM, "cannot allocate training state");
        return;
    }
    /* GPU backend: the device gradients join the host ones */
    wkr_busy_at(w, "optimizer.step: gradients from the GPU");
    if (m->gpu_ops && wkr_gpu_pull_grads(m) != MOE_OK) {
        rpc_reply_err(c, MOE_EINTERNAL, "cannot read the gradients from the GPU");
        return;
    }
    /* router gradients: one all-reduce over every layer's router */
    size_t rn = 0;
    for (int i = 0; i < m->nparams; i++)
        if (m->params[i].replicated)
            rn += m->params[i].n;
    float *rbuf = malloc((rn ? rn : 1) * sizeof(float));
    if (!rbuf) {
        rpc_reply_err(c, MOE_ENOMEM, "out of memory");
        return;
    }
    size_t off = 0;
    for (int i = 0; i < m->nparams; i++)
        if (m->params[i].replicated) {
            memcpy(rbuf + off, m->params[i].grad, m->params[i].n * sizeof(float));
            off += m->params[i].n;
        }
    wkr_busy_at(w, "optimizer.step: router gradients all-reduce");
    e = xchg_allreduce_f32(w->xc, rbuf, rn);
    /* global norm: experts are disjoint across ranks, the router counts once */
    double local = 0, router = 0;
    double *all = malloc((size_t)w->world * sizeof(double));
    if (e == MOE_OK && all) {
        off = 0;
        for (int i = 0; i < m->nparams; i++) {
            wkr_param *p = &m->params[i];
            if (p->replicated) {
                memcpy(p->grad, rbuf + off, p->n * sizeof(float));
                off += p->n;
                router += kern_sumsq_cpu(p->grad, p->n);
            } else {
                local += kern_sumsq_cpu(p->grad, p->n);
            }
        }
        wkr_busy_at(w, "optimizer.step: norm all-gather");
        e = xchg_allgather(w->xc, &local, sizeof(double), all);
    }
    free(rbuf);
    if (e != MOE_OK || !all) {
        free(all);
        rpc_reply_err(c, e == MOE_OK ? MOE_ENOMEM : MOE_EUNAVAIL,
                      "optimizer step: exchange between workers failed: %s", moe_strerror(e));
        return;
    }
    double sumsq = router;
    for (int q = 0; q < w->world; q++)
        sumsq += all[q];
    free(all);
    double norm = sqrt(sumsq);
    float scale = 1.0f;
    if (max_norm > 0 && norm > max_norm)
        scale = (float)(max_norm / (norm + 1e-6));
    m->step++;
    int bf = m->cfg.dtype == MOE_BF16;
    for (int i = 0; i < m->nparams; i++) {
        wkr_param *p = &m->params[i];
        if (p->frozen) /* the choice bias: set by the checkpoint, never trained */
            continue;
        float *target = bf ? p->master : p->w;
        kern_adamw_cpu(target, p->grad, p->m, p->v, p->n, (float)lr, (float)b1, (float)b2,
                       (float)eps, (float)wd, m->step, scale);
        if (bf)
            for (size_t k = 0; k < p->n; k++)
                p->w[k] = kern_bf16_round_inl(p->master[k]);
        memset(p->grad, 0, p->n * sizeof(float));
    }
    m->has_grads = 0;
    wkr_busy_at(w, "optimizer.step: weights to the GPU");
    if (m->gpu_ops && wkr_gpu_push_weights(m) != MOE_OK) {
        rpc_reply_err(c, MOE_EINTERNAL, "cannot write the new weights to the GPU");
        return;
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 3);
    mp_write_cstr(&wr, "step");
    mp_write_i64(&wr, m->step);
    mp_write_cstr(&wr, "grad_norm");
    mp_write_f64(&wr, norm);
    mp_write_cstr(&wr, "clip_scale");
    mp_write_f64(&wr, scale);
    rpc_reply(c, &wr);
}
