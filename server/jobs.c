/*
 * jobs.c - the cluster job queue: one broadcast job at a time; each sends one
 * call to every member worker and finishes when all W replies are in.
 *
 * The bottom of the coordinator's call order (coord.h) above state.c: it
 * calls the job kinds through their coord_job_ops and the files above it
 * only through c->hooks (a lost worker, the replies handled), never by name.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/coord.h"
#include "common/log.h"

moe_err coord_job_submit(coord *c, coord_job *j, int front)
{
    if (j->call && c->qlen >= c->queue_depth)
        return MOE_EBUSY;
    j->enqueued_ns = rpc_now_ns();
    if (front) {
        j->next = c->qhead;
        c->qhead = j;
        if (!c->qtail)
            c->qtail = j;
    } else {
        j->next = NULL;
        if (c->qtail)
            c->qtail->next = j;
        else
            c->qhead = j;
        c->qtail = j;
    }
    c->qlen++;
    return MOE_OK;
}

static void job_free(coord_job *j);

coord_job *coord_job_new(const coord_job_ops *ops, rpc_call *call, coord_model *m)
{
    coord_job *j = calloc(1, sizeof(*j));
    if (!j) {
        if (call)
            rpc_reply_err(call, MOE_ENOMEM, "out of memory");
        return NULL;
    }
    j->ops = ops;
    j->kind = ops->kind;
    j->call = call;
    j->model = m;
    return j;
}

moe_err coord_job_enqueue(coord *c, coord_job *j)
{
    if (coord_job_submit(c, j, 0) != MOE_OK) {
        rpc_reply_err(j->call, MOE_EBUSY, "queue full (%lld jobs): retry later", c->queue_depth);
        coord_count_error(c, MOE_EBUSY);
        free(j);
        return MOE_EBUSY;
    }
    return MOE_OK;
}

static void job_free(coord_job *j)
{
    while (j->batch_next) {
        coord_job *b = j->batch_next;
        j->batch_next = b->batch_next;
        b->batch_next = NULL;
        job_free(b);
    }
    free(j->xbuf);
    free(j->deferred);
    for (int i = 0; i < j->nfiles; i++)
        free(j->files[i]);
    free(j->files);
    for (int r = 0; r < COORD_MAX_WORKERS; r++) {
        if (j->replies[r]) {
            moe_reply_free(j->replies[r]);
            free(j->replies[r]);
        }
    }
    free(j);
}

void coord_job_discard(coord_job *j)
{
    job_free(j);
}

/* on_worker_reply runs on an nng thread. */
static void on_worker_reply(moe_err err, moe_reply *reply, void *arg)
{
    coord_done *d = arg;
    coord *c = (coord *)d->next; /* smuggled: see send_job */
    d->next = NULL;
    /* a call to a worker that was marked down (its client closed) or whose
     * connection broke: the worker is unavailable */
    if (err == MOE_ECLOSED)
        err = MOE_EUNAVAIL;
    d->err = err;
    d->reply = reply;
    pthread_mutex_lock(&c->done_mu);
    if (c->done_tail)
        c->done_tail->next = d;
    else
        c->done_head = d;
    c->done_tail = d;
    if (!c->done_closed)
        uv_async_send(&c->done_async);
    pthread_mutex_unlock(&c->done_mu);
}

/* answer_early: a member's call got no response at all (its connection
 * dropped: the process is gone), so the job cannot succeed; its client is
 * answered now rather than when the survivors come back from work that is
 * lost anyway (an optimizer step on the host, an exchange they abort). The
 * ranks still out read as unavailable for finish; their real replies are
 * kept when they come, and the job stays current until then (no new
 * generation forms under it). */
static void answer_early(coord *c, coord_job *j, int gone)
{
    int synth[COORD_MAX_WORKERS] = {0};
    for (int r = 0; r < j->nsent; r++) {
        if (j->replies[r] || j->errs[r] != MOE_OK)
            continue;
        moe_reply *rep = calloc(1, sizeof(*rep));
        if (!rep)
            return; /* answered when all are in, as without this */
        snprintf(rep->message, sizeof(rep->message),
                 "the job cannot complete: worker rank %d is gone (%s)", gone,
                 j->replies[gone]->message);
        rep->err = MOE_EUNAVAIL;
        j->replies[r] = rep;
        j->errs[r] = MOE_EUNAVAIL;
        synth[r] = 1;
    }
    LOG_W("%s: worker rank %d is gone: answering unavailable now, %d survivors still at work",
          j->ops->method, gone, j->pending);
    j->gone_plus1 = gone + 1;
    j->ops->finish(c, j, j->errs[gone], gone);
    j->answered = 1;
    for (int r = 0; r < j->nsent; r++)
        if (synth[r]) {
            moe_reply_free(j->replies[r]);
            free(j->replies[r]);
            j->replies[r] = NULL;
            j->errs[r] = MOE_OK;
        }
}

static void finish_job(coord *c, coord_job *j)
{
    moe_err first = MOE_OK;
    int bad_rank = -1;
    for (int r = 0; r < j->nsent; r++)
        if (j->errs[r] != MOE_OK && first == MOE_OK) {
            first = j->errs[r];
            bad_rank = r;
        }
    if (!j->answered)
        j->ops->finish(c, j, first, bad_rank);
    /* a worker that did not answer at all (connection lost, timed out) is
     * down now: waiting for its heartbeats to stop would only make the next
     * generation wait for it; if it is alive it registers again */
    for (int r = 0; r < j->nsent; r++)
        if (j->replies[r] && j->replies[r]->transport)
            if (c->hooks.worker_lost)
                c->hooks.worker_lost(c, c->rank_to_worker[r], j->replies[r]->message);
    if (first == MOE_EUNAVAIL || first == MOE_ECLOSED || first == MOE_ETIMEDOUT) {
        /* a worker or the exchange between workers failed: rebuild */
        if (c->ready)
            LOG_W("job failed with %s on rank %d: re-forming the cluster", moe_err_code(first),
                  bad_rank);
        c->ready = 0;
        c->need_form = 1;
    }
}

void coord_on_done(uv_async_t *h)
{
    coord *c = h->data;
    pthread_mutex_lock(&c->done_mu);
    coord_done *d = c->done_head;
    c->done_head = c->done_tail = NULL;
    pthread_mutex_unlock(&c->done_mu);
    while (d) {
        coord_done *next = d->next;
        coord_job *j = d->job;
        j->replies[d->rank] = d->reply;
        j->errs[d->rank] = d->err;
        j->last_reply_ns = rpc_now_ns();
        if (!j->first_reply_ns)
            j->first_reply_ns = j->last_reply_ns;
        if (--j->pending > 0 && !j->answered && (j->ops->flags & JOB_F_EARLY) && d->reply &&
            d->reply->transport && d->err != MOE_OK)
            answer_early(c, j, d->rank);
        if (j->pending == 0) {
            finish_job(c, j);
            if (!j->io_pending) { /* else coord_job_io_done, when its writes are done */
                if (c->current == j)
                    c->current = NULL;
                job_free(j);
            }
        }
        free(d);
        d = next;
    }
    if (c->hooks.after_done)
        c->hooks.after_done(c);
    coord_job_pump(c);
}

int coord_job_gone(const coord_job *j, int r)
{
    if (j->gone_plus1 > 0)
        return j->gone_plus1 - 1;
    const moe_reply *rep = r >= 0 && r < j->nsent ? j->replies[r] : NULL;
    return rep && rep->transport ? r : -1;
}

void coord_job_io_done(coord *c, coord_job *j)
{
    j->io_pending = 0;
    if (c->current == j)
        c->current = NULL;
    job_free(j);
    if (c->hooks.after_done)
        c->hooks.after_done(c);
    coord_job_pump(c);
}

/* send_job sends the job's call to every member. */
static void send_job(coord *c, coord_job *j)
{
    j->generation = c->generation;
    j->started_ns = rpc_now_ns();
    int targets = (j->ops->flags & JOB_F_RANK0) ? 1 : c->world;
    j->nsent = targets;
    j->pending = targets;
    c->current = j;
    for (int r = 0; r < targets; r++) {
        coord_worker *wk = &c->workers[c->rank_to_worker[r]];
        mp_writer w;
        mp_writer_init(&w);
        j->ops->encode(c, j, r, &w);
        coord_done *d = calloc(1, sizeof(*d));
        moe_err e = MOE_ENOMEM;
        if (d) {
            d->job = j;
            d->rank = r;
            d->next = (coord_done *)c; /* carried to the callback */
            if (wk->state != WS_UP || !wk->cli)
                e = MOE_EUNAVAIL;
            else if (w.failed)
                e = MOE_ENOMEM;
            else
                e = moe_call_async(wk->cli, j->ops->method, w.buf, w.len, on_worker_reply, d);
        }
        mp_writer_fini(&w);
        if (e != MOE_OK) {
            /* report as a completion so the job finishes through one path */
            moe_reply *rep = calloc(1, sizeof(*rep));
            if (rep) {
                rep->err = e;
                snprintf(rep->message, sizeof(rep->message), "worker %d (rank %d) is %s", wk->id, r,
                         wk->state == WS_UP ? "unreachable" : "down");
            }
            if (!d)
                d = calloc(1, sizeof(*d));
            if (!d) {
                free(rep);
                j->pending--;
                j->errs[r] = e;
                continue;
            }
            d->job = j;
            d->rank = r;
            d->next = (coord_done *)c;
            on_worker_reply(e, rep, d);
        }
    }
}

/* merge_forwards folds the inference forwards queued right behind j (same
 * model, layer and dtype; up to batch_max_tokens rows) into j, so that one
 * cluster job serves them all. Only a contiguous run from the head of the
 * queue is merged: the order of requests is kept. */
static void merge_forwards(coord *c, coord_job *j)
{
    int64_t rows = j->x.shape[0];
    int n = 0;
    coord_job *q = c->qhead, *tail = j;
    uint64_t now = rpc_now_ns();
    if (j->model->cfg.capacity_factor > 0)
        return; /* the capacity is per batch: merging would change what drops */
    while (q && q->kind == JOB_FORWARD && !q->train && q->model == j->model &&
           q->layer == j->layer && q->x.dtype == j->x.dtype && q->direct == j->direct &&
           q->dgen == j->dgen && rows + q->x.shape[0] <= c->batch_max_tokens &&
           !(q->deadline_ns && now > q->deadline_ns)) {
        rows += q->x.shape[0];
        tail->batch_next = q;
        tail = q;
        q = q->next;
        n++;
    }
    if (!n)
        return;
    if (j->direct) { /* the rows are at the workers: only the count grows */
        c->qhead = q;
        if (!q)
            c->qtail = NULL;
        c->qlen -= n;
        j->x.shape[0] = rows;
        j->x.nbytes = (size_t)rows * (size_t)j->x.shape[1] * moe_dtype_size(j->x.dtype);
        return;
    }
    size_t es = moe_dtype_size(j->x.dtype), H = (size_t)j->x.shape[1];
    uint8_t *buf = malloc((size_t)rows * H * es);
    if (!buf) {
        /* run alone; the others stay queued, unlinked (a stale batch_next
         * would answer them twice) */
        for (coord_job *b = j, *nb; b; b = nb) {
            nb = b == tail ? NULL : b->batch_next;
            b->batch_next = NULL;
        }
        return;
    }
    c->qhead = q;
    if (!q)
        c->qtail = NULL;
    c->qlen -= n;
    size_t off = 0;
    for (coord_job *b = j; b; b = b->batch_next) {
        memcpy(buf + off, b->x.data, b->x.nbytes);
        off += b->x.nbytes;
    }
    j->xbuf = buf;
    j->x.data = buf;
    j->x.shape[0] = rows;
    j->x.nbytes = off;
}

/* refuse_unready answers j's client (if any) that the cluster is not
 * ready, and frees j */
static void refuse_unready(coord *c, coord_job *j)
{
    if (j->call) {
        /* the generation's members that are down: a direct request's client
         * stops waiting for the rows it sent them */
        int gone[MOE_RPC_MAX_GONE], ngone = 0;
        if (j->direct && j->dgen == c->generation) /* ranks of the client's map only */
            for (int r = 0; r < c->world && ngone < MOE_RPC_MAX_GONE; r++)
                if (c->workers[c->rank_to_worker[r]].state != WS_UP)
                    gone[ngone++] = r;
        rpc_reply_err_gone(j->call, MOE_EUNAVAIL, gone, ngone,
                           "cluster not ready: %d of %lld workers up (generation %llu)",
                           coord_up_workers(c), c->expected_workers,
                           (unsigned long long)c->generation);
        coord_count_error(c, MOE_EUNAVAIL);
    }
    job_free(j);
}

void coord_job_pump(coord *c)
{
    while (!c->current && c->qhead) {
        coord_job *j = c->qhead;
        c->qhead = j->next;
        if (!c->qhead)
            c->qtail = NULL;
        c->qlen--;
        uint64_t now = rpc_now_ns();
        if (j->call && j->deadline_ns && now > j->deadline_ns) {
            rpc_reply_err(j->call, MOE_ETIMEDOUT, "deadline passed after %.3f s in the queue",
                          (double)(now - j->enqueued_ns) * 1e-9);
            coord_count_error(c, MOE_ETIMEDOUT);
            job_free(j);
            continue;
        }
        /* stale first: a job that answers for itself when it has nothing
         * left to do (e.g. the checkpoint of a step) also does when the
         * cluster is not ready */
        if (j->ops->stale && j->ops->stale(c, j)) {
            job_free(j);
            continue;
        }
        if (!(j->ops->flags & JOB_F_FORMING) && !c->ready) {
            refuse_unready(c, j);
            continue;
        }
        if (j->call && j->direct && j->dgen != c->generation) {
            rpc_reply_err(j->call, MOE_EUNAVAIL,
                          "the cluster re-formed (generation %llu) after this request was "
                          "admitted: its rows went to the old workers; ask dataplane.info again",
                          (unsigned long long)c->generation);
            coord_count_error(c, MOE_EUNAVAIL);
            job_free(j);
            continue;
        }
        if (j->kind == JOB_FORWARD && j->model && j->model->created_gen != (int)c->generation) {
            /* the model's re-creation for this generation failed (it runs
             * ahead of every client job): its workers do not hold it */
            if (j->call) {
                rpc_reply_err(j->call, MOE_EUNAVAIL,
                              "model '%s' is not on the workers of generation %llu: its "
                              "re-creation failed (%s); the cluster forms again",
                              j->model->cfg.name, (unsigned long long)c->generation,
                              j->model->recreate_err[0] ? j->model->recreate_err : "unknown");
                coord_count_error(c, MOE_EUNAVAIL);
            }
            job_free(j);
            continue;
        }
        if (j->kind == JOB_FORWARD && !j->train)
            merge_forwards(c, j);
        send_job(c, j);
    }
}

void coord_job_refuse_unready(coord *c)
{
    if (c->ready)
        return;
    coord_job **pp = &c->qhead, *last = NULL;
    while (*pp) {
        coord_job *j = *pp;
        /* what the pump would refuse when the job's turn comes: a client's
         * job that needs a ready cluster and has no stale rule of its own */
        if (j->call && !(j->ops->flags & JOB_F_FORMING) && !j->ops->stale) {
            *pp = j->next;
            c->qlen--;
            refuse_unready(c, j);
            continue;
        }
        last = j;
        pp = &j->next;
    }
    c->qtail = last;
}

void coord_job_fail_all(coord *c, moe_err e, const char *why)
{
    while (c->qhead) {
        coord_job *j = c->qhead;
        c->qhead = j->next;
        if (j->call)
            rpc_reply_err(j->call, e, "%s", why);
        job_free(j);
    }
    c->qtail = NULL;
    c->qlen = 0;
}
