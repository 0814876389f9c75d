/* compute.c - the worker's compute thread: a FIFO of coordinator requests. */
#include <stdlib.h>
#include <string.h>

#include "worker/gpu.h"
#include "common/log.h"
#include "common/prio.h"
#include "worker/lane_trace.h"
#include "worker/worker.h"

void wkr_enqueue(wkr *w, rpc_call *c, const wkr_method *m)
{
    wkr_queue_item *it = calloc(1, sizeof(*it));
    if (!it) {
        rpc_reply_err(c, MOE_ENOMEM, "worker out of memory");
        return;
    }
    it->call = c;
    it->method = m;
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

/* find_rid reads params "rid": [client_id, seq] (libmoe adds it). */
static int find_rid(const moe_rpc_request *q, uint64_t rid[2])
{
    mp_reader r = q->params;
    for (uint32_t i = 0; i < q->nparams; i++) {
        const char *k;
        uint32_t kl, n;
        if (mp_read_str(&r, &k, &kl, NULL) != MOE_OK)
            return 0;
        if (mp_str_eq(k, kl, "rid"))
            return mp_read_array(&r, &n, NULL) == MOE_OK && n == 2 &&
                   mp_read_u64(&r, &rid[0], NULL) == MOE_OK &&
                   mp_read_u64(&r, &rid[1], NULL) == MOE_OK;
        if (mp_skip(&r, NULL) != MOE_OK)
            return 0;
    }
    return 0;
}

/* WKR_REPLY_KEEP: the largest reply kept whole for a resend. On the data
 * plane every reply to the coordinator is small (the rows go to the client);
 * a larger one (rows inside it: the coordinator path) is not copied a second
 * time - a resend of its request is answered failed_precondition. */
#define WKR_REPLY_KEEP ((size_t)1 << 20)

/* remember_reply keeps a copy of the reply to the request being run (runs on
 * the compute thread, which answers every request it runs). */
static void remember_reply(rpc_call *c, const void *buf, size_t len, void *arg)
{
    wkr *w = arg;
    struct wkr_reply_cache *e = &w->replies[w->replies_next];
    uint8_t *copy = len <= WKR_REPLY_KEEP ? malloc(len ? len : 1) : NULL;
    (void)c;
    free(e->buf);
    e->buf = copy;
    e->len = copy ? len : 0;
    if (copy)
        memcpy(copy, buf, len);
    e->rid[0] = w->cur_rid[0];
    e->rid[1] = w->cur_rid[1];
    w->replies_next = (w->replies_next + 1) % 4;
}

static void run_one(wkr *w, rpc_call *c, const wkr_method *m)
{
    const moe_rpc_request *q = &c->req;
    uint64_t rid[2];
    if (find_rid(q, rid)) {
        for (int i = 0; i < 4; i++) {
            struct wkr_reply_cache *e = &w->replies[i];
            if (e->rid[0] == rid[0] && e->rid[1] == rid[1] && (e->rid[0] || e->rid[1])) {
                LOG_W("request %llu resent by the transport: answering it again, not re-running",
                      (unsigned long long)rid[1]);
                if (e->buf)
                    rpc_reply_bytes(c, e->buf, e->len);
                else
                    rpc_reply_err(c, MOE_EPRECOND, "duplicate of a request already answered");
                return;
            }
        }
        w->cur_rid[0] = rid[0];
        w->cur_rid[1] = rid[1];
        c->on_reply = remember_reply;
        c->on_reply_arg = w;
    }
    m->fn(w, c);
}

void *wkr_pinned(wkr *w, size_t n)
{
    if (n <= w->pin_bytes && w->pin)
        return w->pin;
    wkr_gpu_pinned_free(w->pin);
    size_t size = (size_t)1 << 20;
    while (size < n)
        size *= 2;
    w->pin = wkr_gpu_pinned_alloc(size);
    w->pin_bytes = w->pin ? size : 0;
    return w->pin;
}

void *wkr_compute_main(void *arg)
{
    wkr *w = arg;
    char msg[128];
    /* compute yields to the loop threads (and a co-located coordinator's):
     * back to the default priority, inherited by the kernels' threads */
    if (w->nice < 0 && prio_set_self(0, msg, sizeof(msg)) != 0)
        LOG_W("compute thread: %s", msg);
    for (;;) {
        pthread_mutex_lock(&w->qmu);
        if (!w->qhead && !w->qstop && w->dp.ring_spin_us > 0 && dp_rings_active(&w->dp)) {
            /* a client on a shared-memory ring posts its next request within
             * microseconds (a decode loop): wait for it awake, not asleep */
            unsigned seen = atomic_load(&w->qposted);
            pthread_mutex_unlock(&w->qmu);
            uint64_t until = rpc_now_ns() + (uint64_t)w->dp.ring_spin_us * 1000ull;
            while (atomic_load(&w->qposted) == seen && rpc_now_ns() < until)
                ;
            pthread_mutex_lock(&w->qmu);
        }
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
        atomic_store(&w->busy_since_ns, rpc_now_ns());
        wkr_busy_at(w, it->is_run ? "a lane forward" : it->method->m.name);
        if (it->is_run) {
            lane_trace(LT_TAKEN);
            wkr_lane_run(w, &it->run);
        } else
            run_one(w, it->call, it->method);
#ifdef MOE_HAVE_CUDA
        /* a failed NCCL call was answered: now its communicator's abort
         * (the thread stays busy: a stuck abort is a stuck device) */
        wkr_busy_at(w, "ncclCommAbort of the failed communicator");
        xchg_nccl_settle(w->xc);
#endif
        atomic_store(&w->busy_since_ns, 0);
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
    for (int i = 0; i < 4; i++)
        free(w->replies[i].buf);
    wkr_gpu_pinned_free(w->pin);
    w->pin = NULL;
    return NULL;
}
