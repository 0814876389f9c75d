/*
 * grads.c - worker.grads {model, layer, expert?}: the gradients this worker
 * holds for one layer, accumulated by the backwards since the last
 * optimizer step - its router replica's share (the coordinator sums the
 * ranks') and its own experts' matrices (or only expert `expert`'s).
 * Reply: {tensors: {name: f32 tensor (rows, cols)}}, names as the
 * checkpoint's. Nothing changes.
 */
#include <stdio.h>
#include <string.h>

#include "worker/gpu.h"
#include "worker/worker.h"

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
    if (m->gpu && wkr_gpu_pull_grads(m) != MOE_OK) {
        rpc_reply_err(c, MOE_EINTERNAL, "cannot read the gradients from the GPU");
        return;
    }
    int nmat = m->cfg.act == 0 ? 3 : 2;
    wkr_param *p = wkr_layer_params(m, (int)layer);
    int n = 1 + m->ne * nmat;
    uint32_t count = 0;
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
        int64_t shape[2] = {p[i].rows, p[i].cols};
        mp_write_cstr(&wr, p[i].name);
        moe_tensor t = {0};
        t.dtype = MOE_F32;
        t.ndim = 2;
        t.shape[0] = shape[0];
        t.shape[1] = shape[1];
        t.data = p[i].grad;
        t.nbytes = p[i].n * sizeof(float);
        moe_tensor_write(&wr, &t);
    }
    rpc_reply(c, &wr);
}
