/*
 * forward.c - the forward at the coordinator: admission (the rows inside the
 * request, or on the data plane only their ticket: coord_parse_direct), the
 * rank's pieces of a data-plane job, and the gather of the workers' answers
 * into each request's reply and the load-balance statistics.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/coord.h"
#include "common/log.h"
#include "common/params.h"
#include "common/step_trace.h"
#include "common/routing_stats.h"
#include "common/placement.h"

moe_err coord_parse_direct(coord *c, mp_reader *r, coord_job *j, int64_t *T, char *err,
                           size_t errlen)
{
    char dtname[8];
    mp_reader rt;
    int64_t t = -1, h = -1;
    uint64_t gen = 0;
    int64_t gen_i = 0;
    uint32_t n;
    pspec sp[] = {
        {"ticket", P_RAW, &rt, true, 0, 0, 0, false},
        {"generation", P_INT, &gen_i, true, 0, 9e18, 0, false},
        {"dtype", P_STR, dtname, true, 0, 0, sizeof(dtname), false},
        {"T", P_INT, &t, false, 0, 1ll << 31, 0, false},
        {"H", P_INT, &h, false, 1, 1ll << 31, 0, false},
    };
    if (mp_read_map(r, &n, NULL) != MOE_OK) {
        snprintf(err, errlen, "direct must be a map {ticket, generation, dtype, T, H}");
        return MOE_EINVAL;
    }
    moe_err e = params_parse(r, n, sp, 5, err, errlen);
    if (e != MOE_OK)
        return e;
    if (sp[4].seen && j->model && h != j->model->cfg.d_model) {
        snprintf(err, errlen, "%s must have shape (T, d_model=%d); got (%lld, %lld)",
                 j->kind == JOB_BACKWARD ? "dy" : "x", j->model->cfg.d_model, (long long)t,
                 (long long)h);
        return MOE_EINVAL;
    }
    uint32_t k;
    if (mp_read_array(&rt, &k, NULL) != MOE_OK || k != 2 ||
        mp_read_u64(&rt, &j->tk_cid, NULL) != MOE_OK ||
        mp_read_u64(&rt, &j->tk_seq, NULL) != MOE_OK) {
        snprintf(err, errlen, "direct.ticket must be [client_id, seq]");
        return MOE_EINVAL;
    }
    if (moe_dtype_parse(dtname, strlen(dtname), &j->x.dtype) != MOE_OK) {
        snprintf(err, errlen, "direct.dtype must be f32, bf16 or f16");
        return MOE_EINVAL;
    }
    gen = (uint64_t)gen_i;
    if (!c->ready || gen != c->generation) {
        snprintf(err, errlen,
                 "the client's worker map is of generation %llu; the cluster is at %llu%s: ask "
                 "dataplane.info again",
                 (unsigned long long)gen, (unsigned long long)c->generation,
                 c->ready ? "" : " (not ready)");
        return MOE_EUNAVAIL;
    }
    j->direct = 1;
    j->dgen = gen;
    *T = t;
    return MOE_OK;
}

/* first_nonfinite_row: the first row of x (T,H; f32, bf16 or f16 bits,
 * unaligned) holding a NaN or an Inf, or -1. */
static int64_t first_nonfinite_row(const moe_tensor *x)
{
    const uint8_t *p = x->data;
    const size_t n = (size_t)x->shape[0] * (size_t)x->shape[1];
    const int64_t H = x->shape[1];
    for (size_t i = 0; i < n; i++) {
        int bad;
        if (x->dtype == MOE_F32) {
            uint32_t u;
            memcpy(&u, p + 4 * i, 4);
            bad = (u & 0x7f800000u) == 0x7f800000u;
        } else {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            bad = x->dtype == MOE_BF16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
        }
        if (bad)
            return (int64_t)(i / (size_t)H);
    }
    return -1;
}

void coord_forward(coord *c, rpc_call *call)
{
    char name[MODEL_NAME_MAX], err[256];
    int64_t layer = 0, deadline_ms = 0;
    bool train = false;
    moe_tensor x;
    mp_reader rdirect;
    memset(&x, 0, sizeof(x));
    pspec sp[] = {
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"layer", P_INT, &layer, true, 0, 1e9, 0, false},
        {"x", P_TENSOR, &x, false, 0, 0, 0, false},
        {"train", P_BOOL, &train, false, 0, 0, 0, false},
        {"deadline_ms", P_INT, &deadline_ms, false, 1, 1e9, 0, false},
        {"direct", P_RAW, &rdirect, false, 0, 0, 0, false},
    };
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 6, err, sizeof(err));
    if (e == MOE_OK && sp[2].seen == sp[5].seen) {
        e = MOE_EINVAL;
        snprintf(err, sizeof(err),
                 "forward needs x (rows in the request) or direct (rows sent "
                 "to the workers), not %s",
                 sp[2].seen ? "both" : "neither");
    }
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    coord_model *m = coord_find_model(c, name);
    if (!m) {
        rpc_reply_err(call, MOE_ENOTFOUND, "no model named '%s'", name);
        return;
    }
    if (layer >= m->cfg.layers) {
        rpc_reply_err(call, MOE_ENOTFOUND, "model '%s' has %d layers; layer %lld does not exist",
                      name, m->cfg.layers, (long long)layer);
        return;
    }
    if (train && coord_train_refused(c, m, call))
        return;
    coord_job dj;
    memset(&dj, 0, sizeof(dj));
    dj.model = m;
    dj.kind = JOB_FORWARD;
    dj.ops = &coord_job_forward;
    if (sp[5].seen) {
        int64_t T = -1;
        e = coord_parse_direct(c, &rdirect, &dj, &T, err, sizeof(err));
        if (e == MOE_OK && T < 0) {
            e = MOE_EINVAL;
            snprintf(err, sizeof(err), "direct.T (rows) is required for forward");
        }
        if (e != MOE_OK) {
            rpc_reply_err(call, e, "%s", err);
            return;
        }
        x.dtype = dj.x.dtype;
        x.ndim = 2;
        x.shape[0] = T;
        x.shape[1] = m->cfg.d_model;
        x.data = NULL;
        x.nbytes = (size_t)T * (size_t)m->cfg.d_model * moe_dtype_size(x.dtype);
    }
    if (x.ndim != 2 || x.shape[1] != m->cfg.d_model) {
        char shape[96] = "";
        int k = 0;
        for (int i = 0; i < x.ndim && k < 80; i++)
            k += snprintf(shape + k, sizeof(shape) - (size_t)k, "%s%lld", i ? ", " : "",
                          (long long)x.shape[i]);
        rpc_reply_err(call, MOE_EINVAL, "x must have shape (T, d_model=%d); got (%s)",
                      m->cfg.d_model, shape);
        return;
    }
    int64_t bad = x.data ? first_nonfinite_row(&x) : -1;
    if (bad >= 0) { /* that client's error alone, before it can join a batch */
        rpc_reply_err(call, MOE_EINVAL,
                      "x row %lld is not finite (NaN or Inf): the request is refused",
                      (long long)bad);
        return;
    }
    coord_job *j = coord_job_new(&coord_job_forward, call, m);
    if (!j)
        return;
    j->layer = (int)layer;
    j->x = x;
    j->xrows = x.shape[0];
    j->train = train;
    j->direct = dj.direct;
    j->tk_cid = dj.tk_cid;
    j->tk_seq = dj.tk_seq;
    j->dgen = dj.dgen;
    int64_t dl = deadline_ms ? deadline_ms : c->deadline_ms;
    j->deadline_ns = dl > 0 ? rpc_now_ns() + (uint64_t)dl * 1000000ull : 0;
    if (coord_job_enqueue(c, j) != MOE_OK)
        return;
    if (train)
        j->handle = coord_handle_new(c, m, (int)layer, x.shape[0]);
    coord_job_pump(c);
}

coord_handle *coord_handle_new(coord *c, coord_model *m, int layer, int64_t T)
{
    uint64_t id = ++c->next_handle;
    coord_handle *h = &c->handles[id % COORD_HANDLE_RING];
    h->id = id;
    h->model = m;
    h->layer = layer;
    h->T = T;
    h->generation = c->generation;
    h->created_ns = rpc_now_ns();
    h->state = H_LIVE;
    return h;
}

void coord_write_sharded(mp_writer *w, const moe_tensor *x, int W, int rank)
{
    int64_t T = x->shape[0], H = x->shape[1];
    int64_t a = shard_first(T, W, rank), b = shard_first(T, W, rank + 1);
    size_t es = moe_dtype_size(x->dtype);
    moe_tensor shard = *x;
    shard.shape[0] = b - a;
    shard.data = (const uint8_t *)x->data + (size_t)a * (size_t)H * es;
    shard.nbytes = (size_t)(b - a) * (size_t)H * es;
    moe_tensor_write(w, &shard);
}

/* coord_write_pieces writes rank's pieces of a direct job: for each request of
 * the (merged) batch [client_id, seq, rows], rows = its shard for rank. */
void coord_write_pieces(mp_writer *w, const coord_job *j, int W, int rank)
{
    uint32_t n = 0;
    for (const coord_job *b = j; b; b = b->batch_next)
        n++;
    mp_write_cstr(w, "pieces");
    mp_write_array(w, n);
    for (const coord_job *b = j; b; b = b->batch_next) {
        int64_t Tb = b->xrows;
        mp_write_array(w, 3);
        mp_write_u64(w, b->tk_cid);
        mp_write_u64(w, b->tk_seq);
        mp_write_i64(w, shard_first(Tb, W, rank + 1) - shard_first(Tb, W, rank));
    }
}

/* worker forward reply, parsed */
typedef struct fwd_part {
    moe_tensor y;
    /* views into the reply's bin payloads: not aligned, read with memcpy */
    const uint8_t *counts, *dropped, *probs_sum; /* int32[E], int32[E], f64[E] */
    double z_sum, phase[4];
    double aux_loss; /* a whole-layer GPU worker reports the loss itself */
    int has_aux;
    int64_t a2a_bytes; /* sent to the other workers (dispatch + combine) */
    mp_reader missing; /* direct: indices of the pieces whose rows did not arrive */
    int has_missing;
    mp_reader refused; /* direct: [[piece, row]] of pieces refused (non-finite rows) */
    int has_refused;
} fwd_part;

static moe_err parse_part(const moe_reply *rep, int E, int direct, fwd_part *p, char *err,
                          size_t errlen)
{
    mp_reader r;
    uint32_t n, lc = 0, ld = 0, lp = 0;
    const void *bc = NULL, *bd = NULL, *bp = NULL;
    mp_reader_init(&r, rep->buf + rep->result_off, rep->len - rep->result_off);
    if (mp_read_map(&r, &n, NULL) != MOE_OK) {
        snprintf(err, errlen, "worker reply is not a map");
        return MOE_EINTERNAL;
    }
    mp_reader rc, rd, rp, rz, ra;
    pspec sp[] = {
        {"y", P_TENSOR, &p->y, !direct, 0, 0, 0, false},
        {"counts", P_RAW, &rc, true, 0, 0, 0, false},
        {"dropped", P_RAW, &rd, true, 0, 0, 0, false},
        {"probs_sum", P_RAW, &rp, true, 0, 0, 0, false},
        {"z_sum", P_RAW, &rz, true, 0, 0, 0, false},
        {"gate_s", P_F64, &p->phase[0], true, 0, 0, 0, false},
        {"dispatch_s", P_F64, &p->phase[1], true, 0, 0, 0, false},
        {"experts_s", P_F64, &p->phase[2], true, 0, 0, 0, false},
        {"combine_s", P_F64, &p->phase[3], true, 0, 0, 0, false},
        {"aux_loss", P_RAW, &ra, false, 0, 0, 0, false},
        {"a2a_bytes", P_INT, &p->a2a_bytes, false, 0, 9e18, 0, false},
        {"missing", P_RAW, &p->missing, false, 0, 0, 0, false},
        {"refused", P_RAW, &p->refused, false, 0, 0, 0, false},
    };
    moe_err e = params_parse(&r, n, sp, 13, err, errlen);
    p->has_aux = sp[9].seen;
    p->has_missing = sp[11].seen;
    p->has_refused = sp[12].seen;
    if (e != MOE_OK)
        return MOE_EINTERNAL;
    /* the losses may be NaN or Inf: a GPU worker's bf16 inference path
     * computes unchecked rows through (docs/PROTOCOL.md, "Non-finite rows");
     * that is no reason to fail the batch */
    if (mp_read_f64(&rz, &p->z_sum, NULL) != MOE_OK ||
        (p->has_aux && mp_read_f64(&ra, &p->aux_loss, NULL) != MOE_OK)) {
        snprintf(err, errlen, "z_sum and aux_loss must be numbers");
        return MOE_EINTERNAL;
    }
    if (mp_read_bin(&rc, &bc, &lc, NULL) != MOE_OK || lc != 4u * (uint32_t)E ||
        mp_read_bin(&rd, &bd, &ld, NULL) != MOE_OK || ld != 4u * (uint32_t)E ||
        mp_read_bin(&rp, &bp, &lp, NULL) != MOE_OK || lp != 8u * (uint32_t)E) {
        snprintf(err, errlen, "worker reply arrays have the wrong length");
        return MOE_EINTERNAL;
    }
    p->counts = bc;
    p->dropped = bd;
    p->probs_sum = bp;
    return MOE_OK;
}

static int nbatch_of(const coord_job *j)
{
    int n = 0;
    for (; j; j = j->batch_next)
        n++;
    return n;
}

/* MOE_COORD_TRACE=N: where an ordered forward's time goes in the
 * coordinator (common/step_trace.h; a decode loop's one call at a time):
 * from the request's arrival to its job's queueing on the loop, to the job
 * sent to the workers, to the first member's reply seen on the loop, to
 * the last's, to the answer sent */
static step_trace co_tr = {"MOE_COORD_TRACE",
                           "coordinator forward",
                           5,
                           {"to loop", "to send", "first reply", "last reply", "answer"},
                           -1,
                           0,
                           {0}};

static void coord_trace(const coord_job *j)
{
    double now_us = 0;
    if (!step_trace_begin(&co_tr, &now_us) || !j->call || !j->started_ns || !j->first_reply_ns)
        return;
    const double us[5] = {
        ((double)j->enqueued_ns - (double)j->call->recv_ns) * 1e-3,
        ((double)j->started_ns - (double)j->enqueued_ns) * 1e-3,
        ((double)j->first_reply_ns - (double)j->started_ns) * 1e-3,
        ((double)j->last_reply_ns - (double)j->first_reply_ns) * 1e-3,
        ((double)rpc_now_ns() - (double)j->last_reply_ns) * 1e-3,
    };
    for (int i = 0; i < 5; i++)
        co_tr.t[i] += us[i];
    step_trace_end(&co_tr);
}

static void forward_finish(coord *c, coord_job *j)
{
    coord_model *m = j->model;
    const int E = m->cfg.n_experts, K = m->cfg.top_k, W = j->nsent > 0 ? j->nsent : 1;
    const int64_t T = j->x.shape[0], H = j->x.shape[1];
    char err[256];
    for (int r = 0; r < W; r++) {
        if (j->errs[r] != MOE_OK) {
            moe_reply *rep = j->replies[r];
            const int gone = coord_job_gone(j, r);
            for (coord_job *b = j; b; b = b->batch_next) {
                rpc_reply_err_gone(b->call, j->errs[r], &gone, gone >= 0, "worker rank %d: %s", r,
                                   rep ? rep->message : moe_strerror(j->errs[r]));
                coord_count_error(c, j->errs[r]);
            }
            return;
        }
    }
    fwd_part *parts = calloc((size_t)W, sizeof(fwd_part));
    if (!parts) {
        for (coord_job *b = j; b; b = b->batch_next)
            rpc_reply_err(b->call, MOE_ENOMEM, "out of memory");
        return;
    }
    for (int r = 0; r < W; r++) {
        moe_err e = parse_part(j->replies[r], E, j->direct, &parts[r], err, sizeof(err));
        int64_t rows = shard_first(T, W, r + 1) - shard_first(T, W, r);
        if (e == MOE_OK && !j->direct &&
            (parts[r].y.ndim != 2 || parts[r].y.shape[0] != rows || parts[r].y.shape[1] != H ||
             parts[r].y.dtype != j->x.dtype)) {
            snprintf(err, sizeof(err), "output shard has the wrong shape");
            e = MOE_EINTERNAL;
        }
        if (e != MOE_OK) {
            LOG_E("forward: bad reply from rank %d: %s", r, err);
            for (coord_job *b = j; b; b = b->batch_next) {
                rpc_reply_err(b->call, MOE_EINTERNAL, "bad reply from worker rank %d: %s", r, err);
                coord_count_error(c, MOE_EINTERNAL);
            }
            free(parts);
            return;
        }
    }
    /* aggregate load balance */
    int64_t *cnt = calloc((size_t)E, sizeof(int64_t)), *drop = calloc((size_t)E, sizeof(int64_t));
    double *psum = calloc((size_t)E, sizeof(double));
    double z = 0, phase[4] = {0, 0, 0, 0};
    for (int r = 0; r < W && cnt && drop && psum; r++) {
        for (int e = 0; e < E; e++) {
            int32_t cv, dv;
            double pv;
            memcpy(&cv, parts[r].counts + 4 * (size_t)e, sizeof(cv));
            memcpy(&dv, parts[r].dropped + 4 * (size_t)e, sizeof(dv));
            memcpy(&pv, parts[r].probs_sum + 8 * (size_t)e, sizeof(pv));
            cnt[e] += cv;
            drop[e] += dv;
            psum[e] += pv;
        }
        z += parts[r].z_sum;
        double busy = 0;
        for (int k = 0; k < 4; k++) {
            phase[k] = parts[r].phase[k] > phase[k] ? parts[r].phase[k] : phase[k];
            busy += parts[r].phase[k];
        }
        coord_worker *wk = &c->workers[c->rank_to_worker[r]];
        wk->busy_s += busy;
        wk->a2a_bytes += (uint64_t)parts[r].a2a_bytes;
        wk->ops_total++;
    }
    uint8_t *yall = j->direct ? NULL : malloc(j->x.nbytes ? j->x.nbytes : 1);
    uint8_t *lost = calloc((size_t)nbatch_of(j), 1); /* direct: pieces that did not arrive */
    int64_t *bad_row = malloc((size_t)nbatch_of(j) * sizeof(int64_t)); /* direct: refused */
    if (!cnt || !drop || !psum || (!j->direct && !yall) || !lost || !bad_row) {
        free(lost);
        free(bad_row);
        free(cnt);
        free(drop);
        free(psum);
        free(parts);
        free(yall);
        for (coord_job *b = j; b; b = b->batch_next)
            rpc_reply_err(b->call, MOE_ENOMEM, "out of memory");
        return;
    }
    size_t yoff = 0;
    for (int r = 0; !j->direct && r < W; r++) {
        memcpy(yall + yoff, parts[r].y.data, parts[r].y.nbytes);
        yoff += parts[r].y.nbytes;
    }
    for (int i = 0; i < nbatch_of(j); i++)
        bad_row[i] = -1;
    for (int r = 0; j->direct && r < W; r++) { /* refused pieces: their row in the request */
        uint32_t nr, two;
        int64_t idx, row;
        mp_reader rr = parts[r].refused;
        if (!parts[r].has_refused || mp_read_array(&rr, &nr, NULL) != MOE_OK)
            continue;
        for (uint32_t i = 0; i < nr; i++) {
            if (mp_read_array(&rr, &two, NULL) != MOE_OK || two != 2 ||
                mp_read_i64(&rr, &idx, NULL) != MOE_OK || mp_read_i64(&rr, &row, NULL) != MOE_OK)
                break;
            if (idx < 0 || idx >= nbatch_of(j))
                continue;
            const coord_job *b = j;
            for (int64_t k = 0; k < idx; k++)
                b = b->batch_next;
            int64_t g = shard_first(b->xrows, W, r) + row;
            if (bad_row[idx] < 0 || g < bad_row[idx])
                bad_row[idx] = g;
        }
    }
    for (int r = 0; j->direct && r < W; r++) {
        uint32_t nm;
        int64_t idx;
        mp_reader mr = parts[r].missing;
        if (!parts[r].has_missing || mp_read_array(&mr, &nm, NULL) != MOE_OK)
            continue;
        for (uint32_t i = 0; i < nm; i++)
            if (mp_read_i64(&mr, &idx, NULL) == MOE_OK && idx >= 0 && idx < nbatch_of(j))
                lost[idx] = 1;
    }
    for (int e = 0; e < E; e++) {
        m->tokens[(size_t)j->layer * E + e] += cnt[e];
        m->dropped[(size_t)j->layer * E + e] += drop[e];
    }
    double aux, imbalance;
    routing_stats(cnt, psum, E, K, T, &aux, &imbalance);
    if (W == 1 && parts[0].has_aux)
        aux = parts[0].aux_loss;
    /* one response per request of the batch: its rows of y, the batch's stats */
    int nbatch = 0;
    for (coord_job *b = j; b; b = b->batch_next)
        nbatch++;
    size_t es = moe_dtype_size(j->x.dtype), row = 0;
    uint64_t now = rpc_now_ns();
    int bi = -1;
    for (coord_job *b = j; b; b = b->batch_next) {
        int64_t Tb = b->xrows;
        double total_s = (double)(now - b->call->recv_ns) * 1e-9;
        bi++;
        if (j->direct && bad_row[bi] >= 0) {
            rpc_reply_err(b->call, MOE_EINVAL,
                          "x row %lld is not finite (NaN or Inf): the request is refused (the "
                          "other requests of its batch are not affected)",
                          (long long)bad_row[bi]);
            coord_count_error(c, MOE_EINVAL);
            continue;
        }
        if (j->direct && lost[bi]) {
            rpc_reply_err(b->call, MOE_EUNAVAIL,
                          "the rows of this request did not reach every worker in time (send "
                          "data.rows before, or with, the forward)");
            coord_count_error(c, MOE_EUNAVAIL);
            continue;
        }
        mp_writer w;
        mp_writer_init(&w);
        moe_rpc_write_response_ok_head(&w, b->call->req.msgid);
        mp_write_map(&w, b->handle ? 3 : 2);
        if (b->handle) {
            mp_write_cstr(&w, "handle");
            mp_write_u64(&w, b->handle->id);
        }
        if (j->direct) {
            mp_write_cstr(&w, "direct");
            mp_write_bool(&w, true);
        } else {
            mp_write_cstr(&w, "y");
            mp_write_map(&w, 3);
            mp_write_cstr(&w, "dtype");
            mp_write_cstr(&w, moe_dtype_name(j->x.dtype));
            mp_write_cstr(&w, "shape");
            mp_write_array(&w, 2);
            mp_write_i64(&w, Tb);
            mp_write_i64(&w, H);
            mp_write_cstr(&w, "data");
            mp_write_bin(&w, yall + row * (size_t)H * es, (uint32_t)((size_t)Tb * (size_t)H * es));
            row += (size_t)Tb;
        }
        mp_write_cstr(&w, "stats");
        mp_write_map(&w, 11);
        mp_write_cstr(&w, "tokens_per_expert");
        mp_write_array(&w, (uint32_t)E);
        for (int e = 0; e < E; e++)
            mp_write_i64(&w, cnt[e]);
        mp_write_cstr(&w, "dropped");
        mp_write_array(&w, (uint32_t)E);
        for (int e = 0; e < E; e++)
            mp_write_i64(&w, drop[e]);
        mp_write_cstr(&w, "imbalance");
        mp_write_f64(&w, imbalance);
        mp_write_cstr(&w, "aux_loss");
        mp_write_f64(&w, aux);
        mp_write_cstr(&w, "z_loss");
        mp_write_f64(&w, T > 0 ? z / (double)T : 0);
        static const char *pn[4] = {"gate_s", "dispatch_s", "experts_s", "combine_s"};
        for (int k = 0; k < 4; k++) {
            mp_write_cstr(&w, pn[k]);
            mp_write_f64(&w, phase[k]);
        }
        mp_write_cstr(&w, "total_s");
        mp_write_f64(&w, total_s);
        mp_write_cstr(&w, "batch_requests");
        mp_write_i64(&w, nbatch);
        rpc_reply(b->call, &w);
        int bk = 0;
        while (bk < COORD_LAT_BUCKETS && total_s > coord_lat_bounds[bk])
            bk++;
        c->lat_hist[bk]++;
        c->lat_sum += total_s;
        c->forwards_total++;
        m->lat_sum += total_s;
        m->ok_forwards++;
    }
    free(yall);
    free(lost);
    free(bad_row);

    /* stats */
    m->forwards += (uint64_t)nbatch;
    if (isfinite(aux) && isfinite(z)) { /* the model's last losses stay the last finite ones */
        m->last_aux = aux;
        m->last_z = T > 0 ? z / (double)T : 0;
    }
    c->tokens_total += (uint64_t)T;
    m->rows_total += (uint64_t)T;
    for (int k = 0; k < 4; k++) {
        c->phase_s[k] += phase[k];
        int pb = 0;
        while (pb < COORD_LAT_BUCKETS && phase[k] > coord_lat_bounds[pb])
            pb++;
        c->phase_hist[k][pb]++;
    }
    c->recent_tokens += (double)T;
    coord_trace(j);
    free(cnt);
    free(drop);
    free(psum);
    free(parts);
}

static void forward_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    int64_t T = j->x.shape[0];
    mp_write_map(w, j->direct ? 8 : 7);
    mp_write_cstr(w, "handle");
    mp_write_u64(w, j->handle ? j->handle->id : 0);
    mp_write_cstr(w, "model");
    mp_write_cstr(w, j->model->cfg.name);
    mp_write_cstr(w, "layer");
    mp_write_i64(w, j->layer);
    mp_write_cstr(w, "T_total");
    mp_write_i64(w, T);
    mp_write_cstr(w, "row0");
    mp_write_i64(w, shard_first(T, c->world, rank));
    mp_write_cstr(w, "train");
    mp_write_bool(w, j->train != 0);
    if (j->direct) {
        mp_write_cstr(w, "dtype");
        mp_write_cstr(w, moe_dtype_name(j->x.dtype));
        coord_write_pieces(w, j, c->world, rank);
        return;
    }
    mp_write_cstr(w, "x");
    coord_write_sharded(w, &j->x, c->world, rank);
}

static void forward_job_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    (void)bad_rank;
    if (first != MOE_OK && j->handle)
        j->handle->state = H_EXPIRED;
    forward_finish(c, j);
}

const coord_job_ops coord_job_forward = {JOB_FORWARD,    "worker.forward",   JOB_F_EARLY,
                                         forward_encode, forward_job_finish, NULL};

/* read_i64s reads an array of exactly n ints into out (n may be 0). */
static int read_i64s(mp_reader *r, int64_t *out, uint32_t n)
{
    uint32_t got;
    if (mp_read_array(r, &got, NULL) != MOE_OK || got != n)
        return 0;
    for (uint32_t i = 0; i < n; i++)
        if (mp_read_i64(r, &out[i], NULL) != MOE_OK || out[i] < 0)
            return 0;
    return 1;
}

/* fold_one_lane: one report {model, layer, forwards, tokens, counts,
 * dropped, phase_s, latency_s} into the model's and the cluster's stats. */
static moe_err fold_one_lane(coord *c, coord_worker *wk, mp_reader *r, char *err, size_t errlen)
{
    char model[MODEL_NAME_MAX];
    int64_t layer = 0, fwds = 0, toks = 0;
    mp_reader rc, rd, rp, rl, rv;
    uint32_t n;
    if (mp_read_map(r, &n, NULL) != MOE_OK) {
        snprintf(err, errlen, "a lane report must be a map");
        return MOE_EINVAL;
    }
    pspec sp[] = {
        {"model", P_STR, model, true, 0, 0, sizeof(model), false},
        {"layer", P_INT, &layer, true, 0, 1e6, 0, false},
        {"forwards", P_INT, &fwds, true, 0, 9e18, 0, false},
        {"tokens", P_INT, &toks, true, 0, 9e18, 0, false},
        {"counts", P_RAW, &rc, true, 0, 0, 0, false},
        {"dropped", P_RAW, &rd, true, 0, 0, 0, false},
        {"phase_s", P_RAW, &rp, true, 0, 0, 0, false},
        {"latency_s", P_RAW, &rl, true, 0, 0, 0, false},
        {"phases_s", P_RAW, &rv, false, 0, 0, 0, false},
    };
    moe_err e = params_parse(r, n, sp, 9, err, errlen);
    if (e != MOE_OK)
        return e;
    coord_model *m = coord_find_model(c, model);
    if (!m || layer >= m->cfg.layers) {
        snprintf(err, errlen, "no model '%s' with a layer %lld", model, (long long)layer);
        return MOE_EINVAL;
    }
    const int E = m->cfg.n_experts;
    int64_t *cnt = calloc((size_t)E * 2, sizeof(int64_t));
    double phase[4];
    uint32_t np, nl;
    if (!cnt)
        return MOE_ENOMEM;
    if (!read_i64s(&rc, cnt, (uint32_t)E) || !read_i64s(&rd, cnt + E, (uint32_t)E) ||
        mp_read_array(&rp, &np, NULL) != MOE_OK || np != 4) {
        free(cnt);
        snprintf(err, errlen, "counts and dropped must hold %d ints, phase_s 4 numbers", E);
        return MOE_EINVAL;
    }
    for (int k = 0; k < 4; k++)
        if (mp_read_f64(&rp, &phase[k], NULL) != MOE_OK || !(phase[k] >= 0)) {
            free(cnt);
            snprintf(err, errlen, "phase_s must hold 4 numbers >= 0");
            return MOE_EINVAL;
        }
    for (int k = 0; k < E; k++) {
        m->tokens[(size_t)layer * E + k] += cnt[k];
        m->dropped[(size_t)layer * E + k] += cnt[E + k];
    }
    free(cnt);
    m->forwards += (uint64_t)fwds;
    m->ok_forwards += (uint64_t)fwds;
    m->rows_total += (uint64_t)toks;
    c->forwards_total += (uint64_t)fwds;
    c->tokens_total += (uint64_t)toks;
    c->recent_tokens += (double)toks;
    double busy = 0;
    for (int k = 0; k < 4; k++) {
        c->phase_s[k] += phase[k];
        busy += phase[k];
    }
    wk->busy_s += busy;
    wk->ops_total += (uint64_t)fwds;
    if (mp_read_array(&rl, &nl, NULL) == MOE_OK)
        for (uint32_t i = 0; i < nl; i++) {
            double s;
            if (mp_read_f64(&rl, &s, NULL) != MOE_OK || !(s >= 0))
                break;
            int bk = 0;
            while (bk < COORD_LAT_BUCKETS && s > coord_lat_bounds[bk])
                bk++;
            c->lat_hist[bk]++;
            c->lat_sum += s;
            m->lat_sum += s;
        }
    /* each forward's phases, into the phase histograms (their sums came
     * with phase_s above) */
    if (sp[8].seen && mp_read_array(&rv, &nl, NULL) == MOE_OK)
        for (uint32_t i = 0; i < nl; i++) {
            uint32_t four;
            double v[4];
            int ok = mp_read_array(&rv, &four, NULL) == MOE_OK && four == 4;
            for (int k = 0; ok && k < 4; k++)
                ok = mp_read_f64(&rv, &v[k], NULL) == MOE_OK && v[k] >= 0;
            if (!ok)
                break;
            for (int k = 0; k < 4; k++) {
                int pb = 0;
                while (pb < COORD_LAT_BUCKETS && v[k] > coord_lat_bounds[pb])
                    pb++;
                c->phase_hist[k][pb]++;
            }
        }
    return MOE_OK;
}

moe_err coord_fold_lane(coord *c, coord_worker *wk, mp_reader *r, char *err, size_t errlen)
{
    uint32_t n;
    if (mp_read_array(r, &n, NULL) != MOE_OK) {
        snprintf(err, errlen, "lane must be an array of reports");
        return MOE_EINVAL;
    }
    for (uint32_t i = 0; i < n; i++) {
        moe_err e = fold_one_lane(c, wk, r, err, errlen);
        if (e != MOE_OK)
            return e;
    }
    return MOE_OK;
}
