/*
 * registry.c - workers dial in and register, then heartbeat. A worker that
 * misses heartbeats for heartbeat_timeout_ms is marked down: its client is
 * closed (in-flight calls to it fail at once) and the cluster is no longer
 * ready. When `expected_workers` workers are up, the cluster (re)forms: a
 * new generation, ranks by registration order, a join broadcast carrying
 * every member's data address, then every model is created again.
 *
 * Entries of dead workers do not pile up (a worker restarted on port 0 has a
 * new address each time): a new generation forgets every down entry (the
 * workers that took their ranks replace them); a down entry that is not a
 * member of the current generation is forgotten when the registry needs room
 * for a new worker, and at the latest COORD_FORGET_DOWN_S after its last
 * heartbeat. Only up workers and down members of the current generation
 * hold entries for good; with --max-workers of those, a new worker is
 * refused "registry full" (logged at warn).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/client_dp.h" /* moe__set_cluster */
#include "server/coord.h"
#include "common/log.h"
#include "common/procstat.h"
#include "common/params.h"

#define COORD_FORGET_DOWN_S 60 /* a down non-member is forgotten after this */

static void on_abort_reply(moe_err err, moe_reply *r, void *arg)
{
    (void)err, (void)arg;
    moe_reply_free(r);
    free(r);
}

/* abort_survivors: a member of the current generation is gone; the others
 * stop waiting for it in their collectives now (worker.abort), so that the
 * job in flight is answered unavailable at once, not at its timeout. */
static void abort_survivors(coord *c, const coord_worker *gone)
{
    mp_writer p;
    mp_writer_init(&p);
    mp_write_map(&p, 1);
    mp_write_cstr(&p, "generation");
    mp_write_u64(&p, c->generation);
    for (int r = 0; r < c->world; r++) {
        coord_worker *w = &c->workers[c->rank_to_worker[r]];
        if (w == gone || w->state != WS_UP || !w->cli)
            continue;
        moe_call_async(w->cli, "worker.abort", p.buf, p.len, on_abort_reply, NULL);
    }
    mp_writer_fini(&p);
}

static void worker_release(coord *c, coord_worker *w)
{
    if (w->cli) {
        moe_client_close(w->cli);
        w->cli = NULL;
    }
    if (w->rank >= 0 && w->rank < c->world && c->generation) {
        if (c->ready || c->current)
            abort_survivors(c, w);
        c->ready = 0;
        c->need_form = 1;
        c->short_since_ns = rpc_now_ns(); /* --shrink-after-ms counts from the last loss */
        /* what waits behind the current job cannot run in this generation:
         * answered now, not when the current job comes back */
        coord_job_refuse_unready(c);
    }
}

/* worker_forget frees the entry of a down worker (its /metrics series go with it). */
static void worker_forget(coord_worker *w, const char *why)
{
    LOG_I("worker %d (%s) forgotten: %s", w->id, w->rpc_url, why);
    memset(w, 0, sizeof(*w));
    w->state = WS_FREE;
    w->rank = -1;
}

/* reclaim_one forgets the down non-member with the oldest heartbeat, to
 * make room for a new worker; returns its slot or NULL when there is none. */
static coord_worker *reclaim_one(coord *c)
{
    coord_worker *old = NULL;
    for (int i = 0; i < c->max_workers; i++) {
        coord_worker *w = &c->workers[i];
        if (w->state == WS_DOWN && w->rank < 0 && (!old || w->last_hb_ns < old->last_hb_ns))
            old = w;
    }
    if (old)
        worker_forget(old, "down, and the registry needs room");
    return old;
}

void coord_pipe_closed(uint32_t pipe, void *arg)
{
    coord *c = arg;
    pthread_mutex_lock(&c->done_mu);
    if (!c->done_closed) {
        if (c->nclosed_pipes < (int)(sizeof(c->closed_pipes) / sizeof(c->closed_pipes[0])))
            c->closed_pipes[c->nclosed_pipes++] = pipe;
        else
            c->closed_overflow = 1;
        uv_async_send(&c->pipes_async);
    }
    pthread_mutex_unlock(&c->done_mu);
}

void coord_on_pipes(uv_async_t *h)
{
    coord *c = h->data;
    uint32_t pipes[64];
    pthread_mutex_lock(&c->done_mu);
    int n = c->nclosed_pipes;
    memcpy(pipes, c->closed_pipes, (size_t)n * sizeof(pipes[0]));
    c->nclosed_pipes = 0;
    c->closed_overflow = 0; /* the heartbeat timeout still finds the others */
    int closing = c->done_closed;
    pthread_mutex_unlock(&c->done_mu);
    if (closing) /* shutting down: the workers' clients are closed already */
        return;
    for (int k = 0; k < n; k++)
        for (int i = 0; i < COORD_MAX_WORKERS; i++)
            if (c->workers[i].state == WS_UP && c->workers[i].pipe == pipes[k])
                coord_worker_lost(c, i, "its connection to the coordinator closed");
    if (n)
        coord_maybe_form(c);
}

/* watchable: w runs on this host and /proc shows this very process (the
 * pid and its start time as the worker reported them: in another PID
 * namespace the pid names another process, or none) */
static int watchable(const coord *c, const coord_worker *w)
{
    procstat ps;
    return w->pid > 0 && w->start_ticks > 0 && w->host[0] && strcmp(w->host, c->host_id) == 0 &&
           procstat_read(w->pid, &ps) == 0 && ps.start_ticks == w->start_ticks &&
           !procstat_dying(&ps);
}

/* coord_watch_tick (every 5 ms): a watched worker whose process is exiting
 * (SIGKILL: its threads are marked exiting at once), gone, or replaced is
 * lost now - its connections close only once the kernel has torn its
 * memory down, tens to hundreds of ms later */
void coord_watch_tick(uv_timer_t *t)
{
    coord *c = t->data;
    int n = 0;
    for (int i = 0; i < COORD_MAX_WORKERS; i++) {
        coord_worker *w = &c->workers[i];
        if (w->state != WS_UP || !w->watched)
            continue;
        procstat ps;
        const char *why = NULL;
        if (procstat_read(w->pid, &ps) != 0)
            why = "its process is gone (/proc)";
        else if (ps.start_ticks != w->start_ticks)
            why = "its process is gone (its pid names another process)";
        else if (procstat_dying(&ps))
            why = "its process is exiting (/proc)";
        if (why) {
            coord_worker_lost(c, i, why);
            n++;
        }
    }
    if (n)
        coord_maybe_form(c);
}

/* ep_env_refused: 1 (and the call answered failed_precondition) when
 * the registering worker's value of the expert-parallel setting `name`
 * (mode, -1 not reported; KCU_EP_DEDUP when ce is 0, KCU_EP_CE when 1)
 * differs from one reported by a worker that is up (another address: a
 * restarted worker replaces its own entry; a down one runs nothing, so a
 * change of the value over every worker in turn is refused only while an
 * old one still runs - the refused worker registers again at its next
 * heartbeat tick). Expert-parallel layers size their counts exchange by
 * KCU_EP_DEDUP and make KCU_EP_CE's collective setup calls (the CE
 * communicator, window registrations) only where it is 1, so ranks that disagree
 * would fail every forward (or wait on each other until the exchange's
 * timeout). */
static int ep_env_refused(coord *c, rpc_call *call, const char *rpc_url, const char *name, int mode,
                          int ce)
{
    if (mode < 0)
        return 0;
    for (int i = 0; i < COORD_MAX_WORKERS; i++) {
        const coord_worker *w = &c->workers[i];
        const int theirs = ce ? w->ep_ce : w->ep_dedup;
        if (w->state != WS_UP || theirs < 0 || theirs == mode || strcmp(w->rpc_url, rpc_url) == 0)
            continue;
        LOG_W("worker at %s refused: %s=%d there, %d on worker %d (%s)", rpc_url, name, mode,
              theirs, w->id, w->rpc_url);
        rpc_reply_err(call, MOE_EPRECOND,
                      "%s=%d on this worker, %d on worker %d (%s): every worker must run with "
                      "the same value",
                      name, mode, theirs, w->id, w->rpc_url);
        return 1;
    }
    return 0;
}

void coord_worker_register(coord *c, rpc_call *call)
{
    char rpc_url[CFG_STR_MAX], data_url[CFG_STR_MAX], backend[32] = "cpu", device[128] = "";
    char client_url[CFG_STR_MAX] = "", host[128] = "", bulk_url[CFG_STR_MAX] = "";
    int64_t pid = 0, start_ticks = 0, ep_dedup = -1, ep_ce = -1;
    mp_reader rmem;
    char err[256];
    pspec sp[] = {
        {"rpc_url", P_STR, rpc_url, true, 0, 0, sizeof(rpc_url), false},
        {"data_url", P_STR, data_url, true, 0, 0, sizeof(data_url), false},
        {"backend", P_STR, backend, false, 0, 0, sizeof(backend), false},
        {"device", P_STR, device, false, 0, 0, sizeof(device), false},
        {"pid", P_INT, &pid, false, 0, 1e9, 0, false},
        {"client_url", P_STR, client_url, false, 0, 0, sizeof(client_url), false},
        {"host", P_STR, host, false, 0, 0, sizeof(host), false},
        {"bulk_url", P_STR, bulk_url, false, 0, 0, sizeof(bulk_url), false},
        {"mem", P_RAW, &rmem, false, 0, 0, 0, false},
        {"start_ticks", P_INT, &start_ticks, false, 0, 9.2e18, 0, false},
        {"ep_dedup", P_INT, &ep_dedup, false, 0, 2, 0, false},
        {"ep_ce", P_INT, &ep_ce, false, 0, 1, 0, false},
    };
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 12, err, sizeof(err));
    int64_t mem_host = -1, mem_gpu = -1;
    if (e == MOE_OK && sp[8].seen)
        e = coord_parse_mem(&rmem, &mem_host, &mem_gpu, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    /* a worker that reports ep_dedup but not ep_ce is of a build before the
     * copy-engine exchange (session 24): it has none, so its value is 0 (a
     * new worker, on by default, is refused beside it, not left to fail its
     * forwards); one that reports neither is not compared */
    if (ep_ce < 0 && ep_dedup >= 0)
        ep_ce = 0;
    if (ep_env_refused(c, call, rpc_url, "KCU_EP_DEDUP", (int)ep_dedup, 0) ||
        ep_env_refused(c, call, rpc_url, "KCU_EP_CE", (int)ep_ce, 1))
        return;
    /* a restarted worker on the same address replaces its old entry */
    coord_worker *slot = NULL;
    for (int i = 0; i < COORD_MAX_WORKERS; i++) {
        coord_worker *w = &c->workers[i];
        if (w->state != WS_FREE && strcmp(w->rpc_url, rpc_url) == 0) {
            LOG_I("worker %d at %s registered again: replacing", w->id, rpc_url);
            worker_release(c, w);
            w->state = WS_FREE;
        }
    }
    for (int i = 0; i < c->max_workers && !slot; i++)
        if (c->workers[i].state == WS_FREE)
            slot = &c->workers[i];
    if (!slot)
        slot = reclaim_one(c);
    if (!slot) {
        LOG_W("worker at %s refused: registry full (%lld entries, each up or a down member of "
              "generation %llu; see --max-workers)",
              rpc_url, c->max_workers, (unsigned long long)c->generation);
        rpc_reply_err(call, MOE_ENOMEM,
                      "registry full: %lld workers are up or hold a rank of the current "
                      "generation (--max-workers)",
                      c->max_workers);
        return;
    }
    memset(slot, 0, sizeof(*slot));
    moe_client_opts o = {
        (int)c->worker_timeout_ms, 0, NULL, "coordinator", c->tls_ca, c->tls_cert, c->tls_key};
    if (moe_client_open(rpc_url, &o, &slot->cli) != MOE_OK) {
        rpc_reply_err(call, MOE_EINVAL, "cannot dial worker rpc_url %s: %s", rpc_url,
                      moe_last_error());
        return;
    }
    if (moe__set_cluster(slot->cli, c->cluster_secret) != MOE_OK) { /* workers require it */
        moe_client_close(slot->cli);
        slot->cli = NULL;
        rpc_reply_err(call, MOE_ENOMEM, "out of memory");
        return;
    }
    slot->id = c->next_worker_id++;
    slot->state = WS_UP;
    slot->rank = -1;
    snprintf(slot->rpc_url, sizeof(slot->rpc_url), "%s", rpc_url);
    snprintf(slot->data_url, sizeof(slot->data_url), "%s", data_url);
    snprintf(slot->client_url, sizeof(slot->client_url), "%s", client_url);
    snprintf(slot->bulk_url, sizeof(slot->bulk_url), "%s", bulk_url);
    slot->pipe = rpc_call_pipe(call);
    snprintf(slot->host, sizeof(slot->host), "%s", host);
    snprintf(slot->backend, sizeof(slot->backend), "%s", backend);
    snprintf(slot->device, sizeof(slot->device), "%s", device);
    slot->pid = (int)pid;
    slot->ep_dedup = (int)ep_dedup;
    slot->ep_ce = (int)ep_ce;
    slot->start_ticks = (unsigned long long)start_ticks;
    slot->watched = watchable(c, slot);
    slot->mem_host = mem_host;
    slot->mem_gpu = mem_gpu;
    slot->registered_ns = slot->last_hb_ns = rpc_now_ns();
    LOG_I("worker %d registered: rpc %s data %s backend %s pid %d%s (%d of %lld up)", slot->id,
          rpc_url, data_url, backend, slot->pid,
          slot->watched ? ", this host: its process watched" : "", coord_up_workers(c),
          c->expected_workers);
    if (!c->ready)
        c->need_form = 1;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    const char *roots[2];
    int nroots = coord_ckpt_roots(c, roots);
    mp_write_map(&w, 3);
    mp_write_cstr(&w, "worker_id");
    mp_write_i64(&w, slot->id);
    mp_write_cstr(&w, "epoch");
    mp_write_i64(&w, (int64_t)c->epoch);
    mp_write_cstr(&w, "checkpoint_roots"); /* where checkpoint calls may point the worker */
    mp_write_array(&w, (uint32_t)nroots);
    for (int k = 0; k < nroots; k++)
        mp_write_cstr(&w, roots[k]);
    rpc_reply(call, &w);
    coord_maybe_form(c);
}

void coord_worker_heartbeat(coord *c, rpc_call *call)
{
    int64_t id = -1, epoch = 0;
    char err[256];
    mp_reader rdata, rlane, rmem;
    pspec sp[] = {{"worker_id", P_INT, &id, true, 0, 1e9, 0, false},
                  {"epoch", P_INT, &epoch, false, 0, 9.2e18, 0, false},
                  {"data", P_RAW, &rdata, false, 0, 0, 0, false},
                  {"lane", P_RAW, &rlane, false, 0, 0, 0, false},
                  {"mem", P_RAW, &rmem, false, 0, 0, 0, false}};
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 5, err, sizeof(err));
    int64_t mem_host = -1, mem_gpu = -1;
    if (e == MOE_OK && sp[4].seen)
        e = coord_parse_mem(&rmem, &mem_host, &mem_gpu, err, sizeof(err));
    int64_t dv[7] = {0, 0, 0, 0, 0, 0, 0};
    if (e == MOE_OK && sp[2].seen) {
        uint32_t n;
        pspec dp[] = {{"tickets", P_INT, &dv[0], false, 0, 9e18, 0, false},
                      {"regions", P_INT, &dv[1], false, 0, 9e18, 0, false},
                      {"rows_in_total", P_INT, &dv[2], false, 0, 9e18, 0, false},
                      {"bytes_in_total", P_INT, &dv[3], false, 0, 9e18, 0, false},
                      {"expired_total", P_INT, &dv[4], false, 0, 9e18, 0, false},
                      {"bulk_conns", P_INT, &dv[5], false, 0, 9e18, 0, false},
                      {"bulk_in_total", P_INT, &dv[6], false, 0, 9e18, 0, false}};
        if (mp_read_map(&rdata, &n, NULL) != MOE_OK) {
            e = MOE_EINVAL;
            snprintf(err, sizeof(err), "data must be a map");
        } else {
            e = params_parse(&rdata, n, dp, 7, err, sizeof(err));
        }
    }
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    bool known = false;
    /* ids restart with the coordinator: one of another epoch is a stranger */
    for (int i = 0; i < COORD_MAX_WORKERS && (!sp[1].seen || epoch == (int64_t)c->epoch); i++) {
        coord_worker *w = &c->workers[i];
        if (w->state == WS_UP && w->id == id) {
            w->last_hb_ns = rpc_now_ns();
            w->pipe = rpc_call_pipe(call); /* a reconnect brings a new one */
            if (sp[2].seen) {
                w->dp_tickets = dv[0];
                w->dp_regions = dv[1];
                w->dp_rows_total = (uint64_t)dv[2];
                w->dp_bytes_total = (uint64_t)dv[3];
                w->dp_expired_total = (uint64_t)dv[4];
                w->dp_bulk_conns = dv[5];
                w->dp_bulk_in_total = (uint64_t)dv[6];
            }
            if (sp[4].seen) {
                w->mem_host = mem_host;
                w->mem_gpu = mem_gpu;
            }
            if (sp[3].seen && coord_fold_lane(c, w, &rlane, err, sizeof(err)) != MOE_OK)
                LOG_W("worker %d: bad lane report in its heartbeat: %s", w->id, err);
            known = true;
        }
    }
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "known");
    mp_write_bool(&w, known);
    rpc_reply(call, &w);
}

void coord_worker_lost(coord *c, int i, const char *why)
{
    coord_worker *w = &c->workers[i];
    if (w->state != WS_UP)
        return;
    LOG_W("worker %d (%s, rank %d) lost: marked down (%s)", w->id, w->rpc_url, w->rank, why);
    w->state = WS_DOWN;
    worker_release(c, w);
}

void coord_check_workers(coord *c)
{
    uint64_t now = rpc_now_ns(), limit = (uint64_t)c->heartbeat_timeout_ms * 1000000ull;
    for (int i = 0; i < COORD_MAX_WORKERS; i++) {
        coord_worker *w = &c->workers[i];
        if (w->state == WS_UP && now - w->last_hb_ns > limit) {
            LOG_W("worker %d (%s, rank %d) missed heartbeats for %.1f s: marked down", w->id,
                  w->rpc_url, w->rank, (double)(now - w->last_hb_ns) * 1e-9);
            w->state = WS_DOWN;
            worker_release(c, w);
        }
        if (w->state == WS_DOWN && w->rank < 0 &&
            now - w->last_hb_ns > (uint64_t)COORD_FORGET_DOWN_S * 1000000000ull)
            worker_forget(w, "down and not a member of the cluster");
    }
    coord_maybe_form(c);
}

/* form_size: the members of the next generation: --workers when that
 * many are up; with --min-workers, once the cluster has been short of
 * members for --shrink-after-ms, the workers up (at least --min-workers);
 * 0: not now */
static int form_size(coord *c)
{
    const int up = coord_up_workers(c);
    if (up >= c->expected_workers)
        return (int)c->expected_workers;
    if (c->min_workers <= 0 || up < c->min_workers || up < 1 || !c->short_since_ns ||
        c->shrink_blocked)
        return 0;
    if (rpc_now_ns() - c->short_since_ns < (uint64_t)c->shrink_after_ms * 1000000ull)
        return 0;
    return up;
}

/* can_grow: the ready cluster runs short of --workers (formed with
 * --min-workers) and enough workers are up again to form it whole, without
 * losing a step that no checkpoint holds */
static int can_grow(coord *c)
{
    if (!c->ready || c->world >= c->expected_workers || coord_up_workers(c) < c->expected_workers)
        return 0;
    /* a voluntary re-formation restores every model from its newest
     * checkpoint: not while one holds steps no checkpoint has */
    for (int m = 0; m < c->nmodels; m++) {
        const coord_model *md = c->models[m];
        if (md->step > 0 && (!c->ckpt_dir[0] || md->saved_step != md->step))
            return 0;
    }
    return 1;
}

/* coord_maybe_form starts a new generation when enough workers are up (or
 * the cluster can grow back) and no job is running. */
void coord_maybe_form(coord *c)
{
    if (can_grow(c))
        c->need_form = 1;
    if (!c->need_form || c->current || c->draining)
        return;
    const int want = form_size(c);
    if (!want)
        return;
    if (want < c->expected_workers)
        LOG_W("forming with %d of %lld workers: the lost workers did not come back within %lld ms "
              "(--min-workers %lld); their experts go to the others",
              want, c->expected_workers, c->shrink_after_ms, c->min_workers);
    else if (c->ready)
        LOG_I("growing back to %lld workers", c->expected_workers);
    int n = 0;
    for (int i = 0; i < COORD_MAX_WORKERS; i++) {
        c->workers[i].rank = -1;
        /* the ranks of dead workers go to the workers up now: their entries go */
        if (c->workers[i].state == WS_DOWN)
            worker_forget(&c->workers[i], "replaced in a new generation");
    }
    /* ranks in registration order */
    for (int id = 0; id < c->next_worker_id && n < want; id++)
        for (int i = 0; i < COORD_MAX_WORKERS; i++)
            if (c->workers[i].state == WS_UP && c->workers[i].id == id) {
                c->workers[i].rank = n;
                c->rank_to_worker[n++] = i;
            }
    c->world = n;
    c->generation++;
    c->ready = 0;
    c->need_form = 0;
    for (int m = 0; m < c->nmodels; m++)
        c->models[m]->created_gen = 0;
    LOG_I("forming cluster generation %llu with %d workers", (unsigned long long)c->generation, n);
    /* JOIN first, then re-create every model (and restore its newest
     * automatic checkpoint), ahead of queued client jobs */
    for (int m = c->nmodels - 1; m >= 0; m--) {
        coord_model *md = c->models[m];
        /* the join drops the workers' models: they come back from the seed,
         * then from the newest checkpoint; training waits for that */
        int r = coord_autorestore(c, md);
        md->restoring = r > 0 ? 1 : r < 0 ? 2 : 0;
        md->pending_grads = 0;
        md->step_unsettled = 0;
        if (r == 0) /* nothing to restore: the model starts again at step 0 */
            md->step = md->saved_step = 0;
        coord_job *j = coord_job_new(&coord_job_model_create, NULL, md);
        if (!j)
            continue;
        coord_job_submit(c, j, 1);
    }
    /* NCCL between GPU workers (unless configured otherwise): rank 0 makes
     * the unique id first, the JOIN relays it */
    int all_gpu = 1;
    for (int r = 0; r < n; r++)
        all_gpu &= strcmp(c->workers[c->rank_to_worker[r]].backend, "cuda") == 0;
    c->use_nccl = strcmp(c->xchg_cfg, "nccl") == 0 || (strcmp(c->xchg_cfg, "auto") == 0 && all_gpu);
    c->nccl_id_ok = 0;
    /* otherwise, every member on one host (same boot id): shared memory,
     * unless a join through it failed before (e.g. one boot id, but
     * containers that do not share /dev/shm) */
    int one_host = n > 1 && c->workers[c->rank_to_worker[0]].host[0];
    for (int r = 1; r < n && one_host; r++)
        one_host =
            !strcmp(c->workers[c->rank_to_worker[r]].host, c->workers[c->rank_to_worker[0]].host);
    c->use_shm = !c->use_nccl && one_host && !c->shm_failed &&
                 (!strcmp(c->xchg_cfg, "auto") || !strcmp(c->xchg_cfg, "shm"));
    coord_job *j = coord_job_new(&coord_job_join, NULL, NULL);
    if (j)
        coord_job_submit(c, j, 1);
    if (c->use_nccl && (j = coord_job_new(&coord_job_xchg_id, NULL, NULL)))
        coord_job_submit(c, j, 1);
    LOG_I("generation %llu exchanges over %s", (unsigned long long)c->generation,
          c->use_nccl  ? "NCCL"
          : c->use_shm ? "shared memory"
                       : "nng");
    coord_job_pump(c);
}

void coord_cluster_status(coord *c, rpc_call *call)
{
    uint64_t now = rpc_now_ns();
    int n = 0;
    for (int i = 0; i < COORD_MAX_WORKERS; i++)
        n += c->workers[i].state != WS_FREE;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    mp_write_map(&w, 8);
    mp_write_cstr(&w, "ready");
    mp_write_bool(&w, c->ready != 0);
    /* the survivors could not hold a model: no smaller generation forms
     * again until every worker is up */
    mp_write_cstr(&w, "waiting_for_all");
    mp_write_bool(&w, c->shrink_blocked != 0);
    mp_write_cstr(&w, "expected_workers");
    mp_write_i64(&w, c->expected_workers);
    mp_write_cstr(&w, "world"); /* members of the current generation (< expected: shrunk) */
    mp_write_i64(&w, c->generation ? c->world : 0);
    mp_write_cstr(&w, "up_workers");
    mp_write_i64(&w, coord_up_workers(c));
    mp_write_cstr(&w, "generation");
    mp_write_u64(&w, c->generation);
    mp_write_cstr(&w, "draining");
    mp_write_bool(&w, c->draining != 0);
    mp_write_cstr(&w, "workers");
    mp_write_array(&w, (uint32_t)n);
    for (int i = 0; i < COORD_MAX_WORKERS; i++) {
        coord_worker *wk = &c->workers[i];
        if (wk->state == WS_FREE)
            continue;
        mp_write_map(&w, 9);
        mp_write_cstr(&w, "id");
        mp_write_i64(&w, wk->id);
        mp_write_cstr(&w, "rank");
        mp_write_i64(&w, wk->rank);
        mp_write_cstr(&w, "state");
        mp_write_cstr(&w, wk->state == WS_UP ? "up" : "down");
        mp_write_cstr(&w, "rpc_url");
        mp_write_cstr(&w, wk->rpc_url);
        mp_write_cstr(&w, "data_url");
        mp_write_cstr(&w, wk->data_url);
        mp_write_cstr(&w, "backend");
        mp_write_cstr(&w, wk->backend);
        mp_write_cstr(&w, "device");
        mp_write_cstr(&w, wk->device);
        mp_write_cstr(&w, "last_heartbeat_s");
        mp_write_f64(&w, (double)(now - wk->last_hb_ns) * 1e-9);
        mp_write_cstr(&w, "busy_s");
        mp_write_f64(&w, wk->busy_s);
    }
    rpc_reply(call, &w);
}

int coord_lane_open(const coord *c)
{
    return c->lane && c->ready && c->world == 1 && !c->draining;
}

int coord_fanout_open(const coord *c)
{
    if (!c->lane || !c->ready || c->world < 2 || c->draining)
        return 0;
    /* every member of one backend: all CPU workers route alike, and so do
     * GPU workers (of one GPU type; the client checks that the ranks'
     * gate weights agree bit for bit) - a CPU worker and a GPU worker
     * need not */
    const char *b0 = c->workers[c->rank_to_worker[0]].backend;
    for (int r = 1; r < c->world; r++)
        if (strcmp(c->workers[c->rank_to_worker[r]].backend, b0) != 0)
            return 0;
    return 1;
}

void coord_dataplane_info(coord *c, rpc_call *call)
{
    int direct = c->ready;
    for (int r = 0; direct && r < c->world; r++)
        direct = c->workers[c->rank_to_worker[r]].client_url[0] != 0;
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, call->req.msgid);
    mp_write_map(&w, 6);
    mp_write_cstr(&w, "generation");
    mp_write_u64(&w, c->generation);
    mp_write_cstr(&w, "lane");
    mp_write_bool(&w, direct && coord_lane_open(c));
    mp_write_cstr(&w, "fanout");
    mp_write_bool(&w, direct && coord_fanout_open(c));
    mp_write_cstr(&w, "ready");
    mp_write_bool(&w, c->ready != 0);
    mp_write_cstr(&w, "direct");
    mp_write_bool(&w, direct != 0);
    mp_write_cstr(&w, "workers"); /* by rank */
    mp_write_array(&w, c->ready ? (uint32_t)c->world : 0);
    for (int r = 0; c->ready && r < c->world; r++) {
        coord_worker *wk = &c->workers[c->rank_to_worker[r]];
        mp_write_map(&w, 5);
        mp_write_cstr(&w, "url");
        mp_write_cstr(&w, wk->client_url);
        mp_write_cstr(&w, "bulk_url"); /* "" = no bulk path */
        mp_write_cstr(&w, wk->bulk_url);
        mp_write_cstr(&w, "host");
        mp_write_cstr(&w, wk->host);
        mp_write_cstr(&w, "backend");
        mp_write_cstr(&w, wk->backend);
        mp_write_cstr(&w, "nccl"); /* data.nccl_open works: a CUDA worker */
        mp_write_bool(&w, strcmp(wk->backend, "cuda") == 0);
    }
    rpc_reply(call, &w);
}

/* ---- the jobs that form a generation ---- */

static void xchg_id_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    (void)c, (void)j, (void)rank;
    mp_write_map(w, 0);
}

/* xchg_id_finish keeps rank 0's NCCL unique id for the JOIN */
static void xchg_id_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    const void *id = NULL;
    uint32_t len = 0;
    (void)bad_rank;
    if (first == MOE_OK) {
        mp_reader rd;
        uint32_t n;
        const moe_reply *rep = j->replies[0];
        mp_reader_init(&rd, rep->buf + rep->result_off, rep->len - rep->result_off);
        if (mp_read_map(&rd, &n, NULL) != MOE_OK || n != 1 || mp_skip(&rd, NULL) != MOE_OK ||
            mp_read_bin(&rd, &id, &len, NULL) != MOE_OK || len != sizeof(c->nccl_id))
            first = MOE_EINTERNAL;
    }
    if (first == MOE_OK) {
        memcpy(c->nccl_id, id, sizeof(c->nccl_id));
        c->nccl_id_ok = 1;
    } else {
        LOG_W("rank 0 could not make an NCCL id: %s",
              j->replies[0] ? j->replies[0]->message : moe_strerror(first));
        c->need_form = 1;
    }
}

const coord_job_ops coord_job_xchg_id = {
    JOB_XCHG_ID,    "worker.xchg_id", JOB_F_FORMING | JOB_F_RANK0,
    xchg_id_encode, xchg_id_finish,   NULL};

static void join_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    (void)j;
    /* the checkpoint roots again (as in the register reply): the join runs
     * on the worker's compute thread before this generation's model
     * create and restore, whereas the register reply is read on another
     * thread, possibly after them */
    const char *roots[2];
    int nroots = coord_ckpt_roots(c, roots);
    mp_write_map(w, c->use_nccl || c->use_shm ? 6 : 5);
    mp_write_cstr(w, "checkpoint_roots");
    mp_write_array(w, (uint32_t)nroots);
    for (int k = 0; k < nroots; k++)
        mp_write_cstr(w, roots[k]);
    if (c->use_nccl) {
        mp_write_cstr(w, "nccl_id");
        mp_write_bin(w, c->nccl_id, sizeof(c->nccl_id));
    } else if (c->use_shm) { /* the segments' token: this coordinator's */
        char token[24];
        snprintf(token, sizeof(token), "%016llx", (unsigned long long)c->epoch);
        mp_write_cstr(w, "shm");
        mp_write_cstr(w, token);
    }
    mp_write_cstr(w, "generation");
    mp_write_u64(w, c->generation);
    mp_write_cstr(w, "rank");
    mp_write_i64(w, rank);
    mp_write_cstr(w, "world");
    mp_write_i64(w, c->world);
    mp_write_cstr(w, "peers");
    mp_write_array(w, (uint32_t)c->world);
    for (int r = 0; r < c->world; r++)
        mp_write_cstr(w, c->workers[c->rank_to_worker[r]].data_url);
}

static void join_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    if (first == MOE_OK && j->generation == c->generation) {
        c->ready = 1;
        if (c->world >= c->expected_workers) {
            c->short_since_ns = 0;
            c->shrink_blocked = 0;
        }
        LOG_I("cluster generation %llu ready: %d workers", (unsigned long long)c->generation,
              c->world);
    } else {
        LOG_W("cluster generation %llu failed to form (rank %d: %s: %s)",
              (unsigned long long)j->generation, bad_rank, moe_err_code(first),
              bad_rank >= 0 && j->replies[bad_rank] ? j->replies[bad_rank]->message : "");
        if (c->use_shm && j->generation == c->generation && bad_rank >= 0 && j->replies[bad_rank] &&
            strstr(j->replies[bad_rank]->message, "shared memory")) {
            LOG_W("shared memory between the workers failed: the next generations exchange "
                  "over nng");
            c->shm_failed = 1;
        }
        c->need_form = 1;
    }
}

/* join_stale: the id job before it failed - form again later */
static int join_stale(coord *c, coord_job *j)
{
    (void)j;
    if (c->use_nccl && !c->nccl_id_ok) {
        c->need_form = 1;
        return 1;
    }
    return 0;
}

const coord_job_ops coord_job_join = {JOB_JOIN,    "worker.join", JOB_F_FORMING,
                                      join_encode, join_finish,   join_stale};
