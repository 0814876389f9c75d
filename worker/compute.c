/* compute.c - the worker's compute thread: a FIFO of coordinator requests. */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "worker.h"

void wkr_enqueue(wkr *w, rpc_call *c)
{
    wkr_queue_item *it = malloc(sizeof(*it));
    if (!it) {
        rpc_reply_err(c, MOE_ENOMEM, "worker out of memory");
        return;
    }
    it->call = c;
    it->next = NULL;
    pthread_mutex_lock(&w->qmu);
    if (w->qtail)
        w->qtail->next = it;
    else
        w->qhead = it;
    w->qtail = it;
    pthread_cond_signal(&w->qcv);
    pthread_mutex_unlock(&w->qmu);
}

static void run_one(wkr *w, rpc_call *c)
{
    const moe_rpc_request *q = &c->req;
    if (mp_str_eq(q->method, q->method_len, "worker.forward"))
        wkr_op_forward(w, c);
    else if (mp_str_eq(q->method, q->method_len, "worker.backward"))
        wkr_op_backward(w, c);
    else if (mp_str_eq(q->method, q->method_len, "worker.step"))
        wkr_op_step(w, c);
    else if (mp_str_eq(q->method, q->method_len, "worker.checkpoint_save"))
        wkr_op_ckpt_save(w, c);
    else if (mp_str_eq(q->method, q->method_len, "worker.checkpoint_load"))
        wkr_op_ckpt_load(w, c);
    else if (mp_str_eq(q->method, q->method_len, "worker.xchg_id"))
        wkr_op_xchg_id(w, c);
    else if (mp_str_eq(q->method, q->method_len, "worker.join"))
        wkr_op_join(w, c);
    else if (mp_str_eq(q->method, q->method_len, "worker.model_create"))
        wkr_op_model_create(w, c);
    else
        rpc_reply_err(c, MOE_ENOMETHOD, "unknown worker method '%.*s'", (int)q->method_len,
                      q->method);
}

void *wkr_compute_main(void *arg)
{
    wkr *w = arg;
    for (;;) {
        pthread_mutex_lock(&w->qmu);
        while (!w->qhead && !w->qstop)
            pthread_cond_wait(&w->qcv, &w->qmu);
        wkr_queue_item *it = w->qhead;
        if (!it) {
            pthread_mutex_unlock(&w->qmu);
            break;
        }
        w->qhead = it->next;
        if (!w->qhead)
            w->qtail = NULL;
        pthread_mutex_unlock(&w->qmu);
        run_one(w, it->call);
        free(it);
    }
    xchg_close(w->xc);
    w->xc = NULL;
    if (w->lis)
        xchg_nng_listener_close(w->lis);
    w->lis = NULL;
    wkr_handle_drop_model(w, NULL);
    for (int i = 0; i < w->nmodels; i++)
        wkr_model_free(w->models[i]);
    w->nmodels = 0;
    return NULL;
}
