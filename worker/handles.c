/* handles.c - train forwards awaiting their backward, bounded in count and age. */
#include <stdlib.h>

#include "worker/pool.h"
#include "worker/worker.h"

void wkr_fwd_state_free(wkr_fwd_state *st)
{
    if (!st)
        return;
    wpool_free(st->x);
    wpool_free(st->logits);
    wpool_free(st->probs);
    wpool_free(st->topk_w);
    wpool_free(st->topk_idx);
    wpool_free(st->counts);
    wpool_free(st->offsets);
    wpool_free(st->perm);
    wpool_free(st->counts_global);
    wpool_free(st->ye_slot);
    wpool_free(st->src_cnt);
    wpool_free(st->kept);
    wpool_free(st->xe);
    wpool_free(st->ae);
    wpool_free(st->be);
    wpool_free(st);
}

void wkr_handle_put(wkr *w, wkr_fwd_state *st)
{
    int slot = -1, oldest = -1;
    for (int i = 0; i < w->max_handles; i++) {
        if (!w->handles[i]) {
            slot = i;
            break;
        }
        if (oldest < 0 || w->handles[i]->created_ns < w->handles[oldest]->created_ns)
            oldest = i;
    }
    if (slot < 0) {
        wkr_fwd_state_free(w->handles[oldest]);
        slot = oldest;
    }
    w->handles[slot] = st;
}

wkr_fwd_state *wkr_handle_take(wkr *w, uint64_t handle)
{
    for (int i = 0; i < w->max_handles; i++)
        if (w->handles[i] && w->handles[i]->handle == handle) {
            wkr_fwd_state *st = w->handles[i];
            w->handles[i] = NULL;
            return st;
        }
    return NULL;
}

void wkr_handle_expire(wkr *w)
{
    uint64_t now = rpc_now_ns(), ttl = (uint64_t)w->handle_ttl_ms * 1000000ull;
    for (int i = 0; i < w->max_handles; i++)
        if (w->handles[i] && now - w->handles[i]->created_ns > ttl) {
            wkr_fwd_state_free(w->handles[i]);
            w->handles[i] = NULL;
        }
}

void wkr_handle_drop_model(wkr *w, wkr_model *m)
{
    for (int i = 0; i < w->max_handles; i++)
        if (w->handles[i] && (!m || w->handles[i]->model == m)) {
            wkr_fwd_state_free(w->handles[i]);
            w->handles[i] = NULL;
        }
}
