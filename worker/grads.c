/*
 * grads.c - worker.grads {model, layer, expert?}: the gradients this worker
 * holds for one layer, accumulated by the backwards since the last
 * optimizer step - its shares of the replicated tensors (the router, then
 * the shared expert's matrices and gate, model_cfg_shared_tensors of them;
 * the coordinator sums the ranks'), then its own experts' matrices (or
 * only expert `expert`'s). Reply: {tensors: {name: f32 tensor (rows,
 * cols)}}, names as the checkpoint's. Nothing changes.
 */
#include <stdio.h>
#include <string.h>

#include "worker/gpu.h"
#include "worker/worker.h"

/* write_grad: name, then p's gradient as an f32 (rows, cols) tensor */
static void write_grad(mp_writer *wr, const wkr_param *p)
{
    mp_write_cstr(wr, p->name);
    moe_tensor t = {0};
    t.dtype = MOE_F32;
    t.ndim = 2;
    t.shape[0] = p->rows;
    t.shape[1] = p->cols;
    t.data = p->grad;
    t.nbytes = p->n * sizeof(float);
    moe_tensor_write(wr, &t);
}

void wkr_op_grads(wkr *w, rpc_call *c)
{
    char name[MODEL_NAME_MAX];
    int64_t layer = 0, expert = -1;
    pspec sp[] = {
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"layer", P_INT, &layer, true, 0, 1023, 0, false},
        {"expert", P_INT, &expert, false, 0, 4095, 0, false},
    };
    if (!wkr_parse_or_reply(c, sp, 3))
        return;
    wkr_model *m = wkr_model_or_reply(w, c, name);
    if (!m)
        return;
    if (layer >= m->cfg.layers) {
        rpc_reply_err(c, MOE_ENOTFOUND, "model '%s' has %d layers", name, m->cfg.layers);
        return;
    }
    if (!m->train_ready) {
        rpc_reply_err(c, MOE_EPRECOND, "model '%s' has no gradients: no train forward yet", name);
        return;
    }
    /* GPU backend: the device gradients join the host ones (as at a step) */
    if (m->gpu_ops && wkr_gpu_pull_grads(m) != MOE_OK) {
        rpc_reply_err(c, MOE_EINTERNAL, "cannot read the gradients from the GPU");
        return;
    }
    int nmat = act_gated(m->cfg.act) ? 3 : 2;
    wkr_param *p = wkr_layer_params(m, (int)layer);
    /* the shared expert's tensors follow the (frozen) correction bias */
    int nsh = model_cfg_shared_tensors(&m->cfg);
    wkr_param *sh = wkr_layer_extra(m, (int)layer) + (m->cfg.score_bias ? 1 : 0);
    int n = 1 + m->ne * nmat;
    uint32_t count = (uint32_t)nsh;
    for (int i = 0; i < n; i++) {
        int x = i == 0 ? -1 : m->e0 + (i - 1) / nmat;
        if (i == 0 || expert < 0 || x == expert)
            count++;
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 1);
    mp_write_cstr(&wr, "tensors");
    mp_write_map(&wr, count);
    for (int i = 0; i < n; i++) {
        int x = i == 0 ? -1 : m->e0 + (i - 1) / nmat;
        if (i != 0 && expert >= 0 && x != expert)
            continue;
        write_grad(&wr, &p[i]);
        for (int k = 0; i == 0 && k < nsh; k++) /* after the router: the shared ones */
            write_grad(&wr, &sh[k]);
    }
    rpc_reply(c, &wr);
}
