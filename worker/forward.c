/*
 * forward.c - one MoE layer forward on this worker's token shard (CPU
 * backend): gate, dispatch (all-to-all-v of token rows to the experts'
 * owners), experts, combine (all-to-all-v back, weighted sum in fixed order).
 *
 * Dispatch message to rank q: int32 counts[ne_q] (rows per expert owned by
 * q), then the rows in expert order, each expert's rows in slot order. The
 * reply from q holds the expert output rows (unweighted) in the same order.
 * Rows are in the model dtype (rows.h). Experts are owned in contiguous
 * blocks (placement.h), so rows sorted by expert are also sorted by owner.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/pool.h"
#include "worker/fwd.h"
#include "worker/lane_trace.h"
#include "worker/gpu.h"
#include "common/log.h"
#include "common/nccl_pieces.h"
#include "common/params.h"
#include "common/placement.h"
#include "common/step_trace.h"
#include "worker/nccl_client.h"
#include "worker/rows.h"

double fwd_now_s(void)
{
    return (double)rpc_now_ns() * 1e-9;
}

/* ---- row moves between float rows and message buffers, over threads ----
 * Every move is a set of whole rows with disjoint destinations, split by
 * kern_par_for: the bytes are the one-thread loop's. */

/* idx_job: sorted row i <-> float row perm[i] / div, at buffer byte
 * i * rowb + the headers before i's owner (hdr_end, row_end: per owner q,
 * header bytes up to and including q and the end of q's sorted rows; NULL
 * when the buffer has no headers). */
typedef struct idx_job {
    const int32_t *perm;
    int div, H, bf16, to_buf, W;
    const size_t *hdr_end;
    const int32_t *row_end;
    float *rows;
    uint8_t *buf;
} idx_job;

static void idx_part(void *p, size_t i0, size_t i1)
{
    const idx_job *j = p;
    size_t rowb = (size_t)j->H * (j->bf16 ? 2 : 4), hdr = 0;
    int q = 0;
    for (size_t i = i0; i < i1; i++) {
        if (j->hdr_end) {
            while (q < j->W - 1 && (int64_t)i >= j->row_end[q])
                q++;
            hdr = j->hdr_end[q];
        }
        float *f = j->rows + (size_t)(j->perm[i] / j->div) * j->H;
        uint8_t *m = j->buf + hdr + i * rowb;
        if (j->to_buf)
            rows_put(m, f, (size_t)j->H, j->bf16);
        else
            rows_get(f, m, (size_t)j->H, j->bf16);
    }
}

static void idx_run(idx_job *j, size_t n)
{
    kern_par_for(n, KERN_PAR_GRAIN / (size_t)(j->H > 0 ? j->H : 1) + 1, idx_part, j);
}

/* seg_job: expert-major float rows [0, n) <-> per-source segments of the
 * buffer: segment g holds rows [row0[g], row0[g+1]) at byte off[g]. */
typedef struct seg_job {
    const size_t *row0, *off;
    size_t nseg;
    int H, bf16, to_buf;
    float *rows;
    uint8_t *buf;
} seg_job;

static void seg_part(void *p, size_t r0, size_t r1)
{
    const seg_job *j = p;
    size_t rowb = (size_t)j->H * (j->bf16 ? 2 : 4), g = 0;
    for (size_t r = r0; r < r1;) {
        while (j->row0[g + 1] <= r) /* to r's segment; row0[nseg] = n > r */
            g++;
        size_t end = j->row0[g + 1] < r1 ? j->row0[g + 1] : r1;
        float *f = j->rows + r * j->H;
        uint8_t *m = j->buf + j->off[g] + (r - j->row0[g]) * rowb;
        if (j->to_buf)
            rows_put(m, f, (end - r) * j->H, j->bf16);
        else
            rows_get(f, m, (end - r) * j->H, j->bf16);
        r = end;
    }
}

/* seg_run: the segments in expert-major order (expert i, then rank q) at
 * byte pos[q] onward in the buffer; pos advances. Returns 0, or -1 when
 * the table cannot be allocated (then nothing is moved). */
static int seg_run(const wkr_fwd_state *st, int W, size_t *pos, int H, int bf16, int to_buf,
                   float *rows, uint8_t *buf)
{
    const int ne = st->model->ne;
    size_t nseg = (size_t)ne * W, es = bf16 ? 2 : 4, n = 0;
    size_t *row0 = malloc((nseg + 1) * sizeof(size_t)), *off = malloc((nseg + 1) * sizeof(size_t));
    if (!row0 || !off) {
        free(row0), free(off);
        return -1;
    }
    for (int i = 0; i < ne; i++)
        for (int q = 0; q < W; q++) {
            size_t g = (size_t)i * W + q, k = (size_t)st->src_cnt[(size_t)q * ne + i];
            row0[g] = n;
            off[g] = pos[q];
            pos[q] += k * H * es;
            n += k;
        }
    row0[nseg] = n;
    off[nseg] = 0;
    seg_job j = {row0, off, nseg, H, bf16, to_buf, rows, buf};
    if (nseg)
        kern_par_for(n, KERN_PAR_GRAIN / (size_t)(H > 0 ? H : 1) + 1, seg_part, &j);
    free(row0), free(off);
    return 0;
}

size_t fwd_pack_by_owner(const wkr_fwd_state *st, int W, int E, int H, int K, const float *rows,
                         int by_token, int with_counts, int bf16, uint8_t **out, size_t *send_bytes)
{
    size_t es = bf16 ? 2 : 4, total = 0, hdr = 0;
    size_t hdr_end[256]; /* W <= 256 (worker.join) */
    int32_t row_end[256];
    for (int q = 0; q < W; q++) {
        int a = placement_first(E, W, q), b = a + placement_count(E, W, q);
        send_bytes[q] = (with_counts ? 4 * (size_t)(b - a) : 0) +
                        (size_t)(st->offsets[b] - st->offsets[a]) * (size_t)H * es;
        total += send_bytes[q];
        hdr += with_counts ? 4 * (size_t)(b - a) : 0;
        hdr_end[q] = hdr;
        row_end[q] = st->offsets[b];
    }
    uint8_t *buf = wpool_alloc(total ? total : 1);
    if (!buf)
        return (size_t)-1;
    for (int q = 0; q < W && with_counts; q++) { /* each owner's counts before its rows */
        int a = placement_first(E, W, q), b = a + placement_count(E, W, q);
        size_t at = hdr_end[q] - 4 * (size_t)(b - a) + (size_t)st->offsets[a] * H * es;
        memcpy(buf + at, st->counts + a, 4 * (size_t)(b - a));
    }
    /* rows: owners' blocks are contiguous in sorted order (placement.h) */
    idx_job j = {st->perm, by_token ? K : 1, H,  bf16, 1, W, with_counts ? hdr_end : NULL,
                 row_end,  (float *)rows,    buf};
    idx_run(&j, (size_t)st->offsets[E]);
    *out = buf;
    return total;
}

void fwd_unpack_sorted(const wkr_fwd_state *st, const uint8_t *buf, int H, int bf16,
                       float *slot_rows)
{
    size_t S = (size_t)st->T * (size_t)st->model->cfg.top_k;
    idx_job j = {st->perm, 1, H, bf16, 0, 1, NULL, NULL, slot_rows, (uint8_t *)buf};
    idx_run(&j, S);
}

void fwd_owner_gather(const wkr_fwd_state *st, int W, const uint8_t *buf, const size_t *row0, int H,
                      int bf16, float *rows)
{
    size_t pos[256]; /* W <= 256 (worker.join) */
    for (int q = 0; q < W; q++)
        pos[q] = row0[q];
    if (seg_run(st, W, pos, H, bf16, 0, rows, (uint8_t *)buf) == 0)
        return;
    /* no memory for the table: the same moves on this thread */
    const int ne = st->model->ne;
    size_t es = bf16 ? 2 : 4, n = 0;
    for (int q = 0; q < W; q++)
        pos[q] = row0[q];
    for (int i = 0; i < ne; i++)
        for (int q = 0; q < W; q++) {
            int32_t k = st->src_cnt[(size_t)q * ne + i];
            rows_get(rows + n * H, buf + pos[q], (size_t)k * H, bf16);
            pos[q] += (size_t)k * H * es;
            n += (size_t)k;
        }
}

size_t fwd_owner_scatter(const wkr_fwd_state *st, int W, int H, const float *rows, int bf16,
                         uint8_t **out, size_t *back_bytes)
{
    const int ne = st->model->ne;
    size_t es = bf16 ? 2 : 4, total = 0;
    size_t pos[256]; /* W <= 256 (worker.join) */
    for (int q = 0; q < W; q++) {
        size_t nrows = 0;
        for (int i = 0; i < ne; i++)
            nrows += (size_t)st->src_cnt[(size_t)q * ne + i];
        back_bytes[q] = nrows * H * es;
        pos[q] = total;
        total += back_bytes[q];
    }
    uint8_t *buf = wpool_alloc(total ? total : 1);
    if (!buf)
        return (size_t)-1;
    if (seg_run(st, W, pos, H, bf16, 1, (float *)rows, buf) != 0) {
        wpool_free(buf);
        return (size_t)-1;
    }
    *out = buf;
    return total;
}

/* fwd_gate: router replica on the local tokens (fwd.h) */
moe_err fwd_gate(const wkr_layer *L, wkr_fwd_state *st, int shards, double *probs_sum,
                 double *z_sum)
{
    const model_cfg *cfg = &st->model->cfg;
    const int T = st->T, H = cfg->d_model, E = cfg->n_experts, K = cfg->top_k;
    size_t Tn = T ? (size_t)T : 1, S = (size_t)T * K;
    st->logits = wpool_alloc(Tn * E * sizeof(float));
    st->probs = wpool_alloc(Tn * E * sizeof(float));
    st->topk_w = wpool_alloc((S ? S : 1) * sizeof(float));
    st->topk_idx = wpool_alloc((S ? S : 1) * sizeof(int32_t));
    st->counts = wpool_calloc((size_t)E, sizeof(int32_t));
    st->offsets = wpool_calloc((size_t)E + 1, sizeof(int32_t));
    st->perm = wpool_alloc((S ? S : 1) * sizeof(int32_t));
    if (!st->logits || !st->probs || !st->topk_w || !st->topk_idx || !st->counts || !st->offsets ||
        !st->perm)
        return MOE_ENOMEM;
    for (int q = 0; q < shards; q++) {
        long long a = shard_first(T, shards, q), b = shard_first(T, shards, q + 1);
        kern_router_logits_blas(st->x + (size_t)a * H, L->wr, (int)(b - a), H, E,
                                st->logits + (size_t)a * E);
    }
    kern_route_cfg rc = fwd_route_cfg(cfg, L);
    kern_route_cpu(st->logits, T, E, K, &rc, st->probs, st->topk_idx, st->topk_w);
    kern_layout_cpu(st->topk_idx, T, K, E, st->counts, st->offsets, st->perm, NULL);
    *z_sum = 0;
    for (int e = 0; e < E; e++)
        probs_sum[e] = 0;
    for (int t = 0; t < T; t++) {
        const float *lg = st->logits + (size_t)t * E;
        float mx = lg[0];
        for (int e = 1; e < E; e++)
            mx = lg[e] > mx ? lg[e] : mx;
        double sum = 0;
        for (int e = 0; e < E; e++) {
            sum += exp((double)lg[e] - mx);
            probs_sum[e] += st->probs[(size_t)t * E + e];
        }
        /* sum >= 1: the largest logit contributes exp(0) */
        double lse = mx + log(sum); // cppcheck-suppress invalidFunctionArg
        *z_sum += lse * lse;
    }
    return MOE_OK;
}

/* fwd_owner_parse reads the per-source counts headers of a dispatch. */
static moe_err fwd_owner_parse(wkr_fwd_state *st, int W, int H, int bf16, const uint8_t *buf,
                               const size_t *recv_bytes, size_t *row0, char *err, size_t errlen)
{
    const int ne = st->model->ne;
    size_t es = bf16 ? 2 : 4, off = 0;
    st->src_cnt = wpool_alloc((size_t)W * (ne ? ne : 1) * sizeof(int32_t));
    st->kept = wpool_calloc((size_t)(ne ? ne : 1), sizeof(int32_t));
    if (!st->src_cnt || !st->kept)
        return MOE_ENOMEM;
    st->n_in = 0;
    for (int q = 0; q < W; q++) {
        size_t need = 4 * (size_t)ne, nrows = 0;
        if (recv_bytes[q] < need) {
            snprintf(err, errlen, "short dispatch message from rank %d", q);
            return MOE_EINTERNAL;
        }
        memcpy(st->src_cnt + (size_t)q * ne, buf + off, need);
        for (int i = 0; i < ne; i++) {
            int32_t k = st->src_cnt[(size_t)q * ne + i];
            if (k < 0) {
                snprintf(err, errlen, "negative row count from rank %d", q);
                return MOE_EINTERNAL;
            }
            nrows += (size_t)k;
        }
        if (recv_bytes[q] != need + nrows * H * es) {
            snprintf(err, errlen, "dispatch message from rank %d has %zu bytes, want %zu", q,
                     recv_bytes[q], need + nrows * H * es);
            return MOE_EINTERNAL;
        }
        row0[q] = off + need;
        off += recv_bytes[q];
        st->n_in += nrows;
    }
    return MOE_OK;
}

/* fwd_experts runs every owned expert on its kept rows: ye (n_in,H) out,
 * dropped rows zero. Fills st->kept and dropped (E) for owned experts. */
static moe_err fwd_experts(wkr_fwd_state *st, const wkr_layer *L, int W, int32_t *dropped,
                           float *ye, int train)
{
    const model_cfg *cfg = &st->model->cfg;
    const int ne = st->model->ne, H = cfg->d_model, F = cfg->d_ff, K = cfg->top_k;
    int32_t cap = kern_capacity((float)cfg->capacity_factor, st->T_total, K, cfg->n_experts);
    const wkr_gpu_ops *g = st->model->gpu_ops;
    int32_t *n = wpool_alloc((size_t)(ne ? ne : 1) * sizeof(int32_t)); /* (ne) rows in */
    size_t rows = 0;
    if (!n)
        return MOE_ENOMEM;
    for (int i = 0; i < ne; i++) {
        n[i] = 0;
        for (int q = 0; q < W; q++)
            n[i] += st->src_cnt[(size_t)q * ne + i];
        st->kept[i] = n[i] < cap ? n[i] : cap;
        dropped[st->model->e0 + i] = n[i] - st->kept[i];
        rows += (size_t)n[i];
    }
    moe_err e = MOE_OK;
    if (g && g->experts_forward) {
        e = g->experts_forward(st->model, st->layer, st->handle, st->xe, n, st->kept, ye, train);
    } else {
        /* the owned experts at once, column blocks of their GEMMs on the
         * threads (kern_experts_ffn_blas); between blocks the generation
         * given up (a member is gone) stops the work: the combine cannot
         * complete, so the rest of it is lost - answer now, not after tens
         * of ms of GEMMs (the exchange would only fail then) */
        float *h = wpool_alloc((rows ? rows : 1) * (size_t)(F > 0 ? F : 1) * sizeof(float));
        int rc = h ? kern_experts_ffn_blas(st->xe, n, st->kept, ne, H, F, L->w1, L->w3, L->w2,
                                           (kern_act)cfg->act, cfg->dtype == MOE_BF16, st->ae,
                                           st->be, h, ye, xchg_aborted)
                   : -1;
        wpool_free(h);
        e = rc < 0 ? MOE_ENOMEM : rc > 0 ? MOE_EUNAVAIL : MOE_OK;
    }
    wpool_free(n);
    return e;
}

/* write_y writes the output rows into the coordinator's reply, or, on the
 * data plane, answers each client's rows and writes which pieces were
 * missing. */
static void write_y(mp_writer *wr, dp_batch *b, int direct, moe_dtype dt, const float *y,
                    const void *y_raw, int T, int H)
{
    if (!direct) {
        mp_write_cstr(wr, "y");
        if (!y_raw) {
            rows_write_tensor(wr, dt, y, T, H);
            return;
        }
        moe_tensor t = {dt, 2, {T, H, 0, 0}, y_raw, (size_t)T * (size_t)H * moe_dtype_size(dt)};
        moe_tensor_write(wr, &t);
        return;
    }
    if (y_raw)
        dp_batch_answer_raw(b, y_raw, H);
    else
        dp_batch_answer_f32(b, y, H);
    mp_write_cstr(wr, "missing");
    dp_batch_write_missing(wr, b);
    mp_write_cstr(wr, "refused");
    dp_batch_write_refused(wr, b);
}

/* lane_attach_stats: a lane forward's client gets the stats the
 * coordinator would have sent, in its rows' answer (the one piece). */
static void lane_attach_stats(dp_batch *b, const model_cfg *cfg, int64_t T, const int32_t *counts,
                              const int32_t *dropped, const double *probs_sum, double z_sum,
                              const double *aux_device, const double phase[4])
{
    if (b->n != 1 || !b->tk[0])
        return;
    mp_writer sw;
    mp_writer_init(&sw);
    wkr_lane_stats_write(&sw, cfg, T, counts, dropped, probs_sum, z_sum, aux_device, phase);
    if (sw.failed || dp_ticket_set_extra(b->tk[0], sw.buf, sw.len, 1) != MOE_OK)
        LOG_W("lane forward: no room for its stats; answered without them");
    mp_writer_fini(&sw);
}

/* pieces_add adds one piece's forward statistics gi (E experts) into go's
 * sums; its aux loss, weighted by its rows n, into *aux_rows */
static void pieces_add(wkr_gpu_out *go, const wkr_gpu_out *gi, int E, int64_t n, double *aux_rows)
{
    for (int k = 0; k < E; k++) {
        go->counts[k] += gi->counts[k];
        go->dropped[k] += gi->dropped[k];
        if (go->probs_sum)
            go->probs_sum[k] += gi->probs_sum[k];
    }
    go->z_sum += gi->z_sum;
    go->a2a_bytes += gi->a2a_bytes;
    go->aux_whole = gi->aux_whole;
    *aux_rows += gi->aux * (double)n;
}

/* fwd_nccl_pieces: the lane's inference forward of one ticket whose x
 * arrives over NCCL in pieces (common/nccl_pieces.h; batch x_pieces): piece
 * i's rows run once they are in (wnc_x_piece_wait; the communicator's
 * thread receives the next pieces meanwhile), and piece i's y is queued for
 * the client as soon as its forward returns (the backend synchronises: y is
 * written), so that it travels while piece i+1 computes. Rows are
 * independent per token: each row's y is what one forward of all T rows
 * gives (within bf16 rounding). Statistics are the pieces' sums (counts,
 * dropped, probs_sum, z_sum); the aux loss, computed per forward, is the
 * row-weighted mean of the pieces'. x, y: (T,H) bf16 device rows of tk's
 * communicator buffer; go: the caller's zeroed arrays. On an error (in err)
 * the pieces of y already queued are on their way; the caller answers the
 * ticket with the error (the client aborts its communicator). */
static moe_err fwd_nccl_pieces(wkr *w, wkr_model *m, const wkr_gpu_ops *gops, int layer,
                               uint64_t handle, dp_ticket *tk, int T, int H, const void *x, void *y,
                               wkr_gpu_out *go, char *err, size_t errlen)
{
    const int E = m->cfg.n_experts, P = tk->nccl_pieces;
    const size_t row = (size_t)H * 2;                            /* bf16 */
    int32_t *cnt = wpool_calloc((size_t)2 * E, sizeof(int32_t)); /* counts, dropped */
    double *probs = wpool_calloc((size_t)E, sizeof(double)), aux_rows = 0;
    moe_err e = cnt && probs ? MOE_OK : MOE_ENOMEM;
    if (e != MOE_OK)
        snprintf(err, errlen, "worker out of memory");
    for (int i = 0; i < P && e == MOE_OK; i++) {
        const int64_t a = nccl_piece_first(T, P, i), n = nccl_piece_first(T, P, i + 1) - a;
        wkr_gpu_out gi;
        memset(&gi, 0, sizeof(gi));
        memset(cnt, 0, (size_t)2 * E * sizeof(int32_t));
        memset(probs, 0, (size_t)E * sizeof(double));
        gi.counts = cnt;
        gi.dropped = cnt + E;
        gi.probs_sum = probs;
        e = wnc_x_piece_wait(tk, i, err, errlen);
        if (e == MOE_OK)
            e = gops->forward(w, m, layer, handle, (int)n, (const uint8_t *)x + (size_t)a * row,
                              MOE_BF16, (uint8_t *)y + (size_t)a * row, MOE_BF16, 0, &gi, err,
                              errlen);
        if (e == MOE_OK && (e = dp_nccl_y_piece(tk, i)) != MOE_OK)
            snprintf(err, errlen,
                     "the NCCL communicator failed before y's piece %d of %d could "
                     "be sent",
                     i + 1, P);
        if (e == MOE_OK)
            pieces_add(go, &gi, E, n, &aux_rows);
    }
    go->aux = T > 0 ? aux_rows / (double)T : 0;
    wpool_free(cnt);
    wpool_free(probs);
    return e;
}

/* MOE_JOB_TRACE=N: where an ordered-road forward's time goes in a worker
 * (common/step_trace.h; a decode loop's one call at a time): from the
 * coordinator's job arriving to the compute thread taking it, the rows
 * gathered, the forward, its answers (rows to the client, reply to the
 * coordinator) */
static step_trace job_tr = {"MOE_JOB_TRACE",
                            "worker ordered forward",
                            4,
                            {"to compute", "rows", "forward", "answer"},
                            -1,
                            0,
                            {0}};

void wkr_op_forward(wkr *w, rpc_call *c)
{
    double t_tr = 0;
    int tr = step_trace_begin(&job_tr, &t_tr);
    char model_name[MODEL_NAME_MAX], err[256] = "";
    int64_t layer = 0, T_total = 0, row0 = 0, handle = 0;
    bool train = false, lane = false, fanout = false;
    moe_tensor xt;
    mp_reader rpieces;
    char dtname[8] = "";
    dp_batch batch;
    memset(&xt, 0, sizeof(xt));
    memset(&batch, 0, sizeof(batch));
    pspec sp[] = {
        {"model", P_STR, model_name, true, 0, 0, sizeof(model_name), false},
        {"layer", P_INT, &layer, true, 0, 1e6, 0, false},
        {"T_total", P_INT, &T_total, true, 0, 2e9, 0, false},
        {"row0", P_INT, &row0, true, 0, 2e9, 0, false},
        {"x", P_TENSOR, &xt, false, 0, 0, 0, false},
        {"train", P_BOOL, &train, false, 0, 0, 0, false},
        {"handle", P_INT, &handle, false, 0, 9e18, 0, false},
        {"pieces", P_RAW, &rpieces, false, 0, 0, 0, false},
        {"dtype", P_STR, dtname, false, 0, 0, sizeof(dtname), false},
        {"lane", P_BOOL, &lane, false, 0, 0, 0, false},
        {"fanout", P_BOOL, &fanout, false, 0, 0, 0, false},
    };
    if (w->test_hang_forward_ms > 0) /* tests: a kernel that never ends, deaf to aborts */
        usleep((useconds_t)(w->test_hang_forward_ms * 1000));
    if (!wkr_parse_or_reply(c, sp, 11) || !wkr_xc_or_reply(w, c))
        return;
    wkr_model *m = wkr_model_or_reply(w, c, model_name);
    if (!m)
        return;
    if (lane && !m->settled) { /* the client retries through the coordinator (client_dp.c) */
        rpc_reply_err(c, MOE_ENOTFOUND,
                      "model '%s' is not settled on this worker yet (rebuilt in generation %llu; "
                      "its checkpoint may be on its way): its forwards go through the "
                      "coordinator until one has",
                      model_name, (unsigned long long)w->generation);
        return;
    }
    if (!lane)
        m->settled = 1; /* the coordinator ordered it behind the model's (re)creation and
                         * restore */
    moe_err e = MOE_OK;
    const model_cfg *cfg = &m->cfg;
    const int H = cfg->d_model, F = cfg->d_ff, E = cfg->n_experts, K = cfg->top_k;
    const int W = w->world, bf = cfg->dtype == MOE_BF16;
    const int direct = sp[7].seen;
    /* a whole-layer GPU backend runs router..combine itself (read again
     * after an attach for training, which may pick another backend) */
    const wkr_gpu_ops *gops = m->gpu_ops;
    int gpu_whole = gops && gops->whole_layer;
    if (direct) {
        /* the rows come from the clients (data plane); every rank goes on
         * with what arrived, so that no collective is left waiting */
        moe_dtype dt;
        if (layer >= cfg->layers) {
            rpc_reply_err(c, MOE_ENOTFOUND, "model '%s' has %d layers; layer %lld does not exist",
                          model_name, cfg->layers, (long long)layer);
            return;
        }
        if (moe_dtype_parse(dtname, strlen(dtname), &dt) != MOE_OK) {
            rpc_reply_err(c, MOE_EINVAL, "bad dtype '%s'", dtname);
            return;
        }
        /* rows on a client's GPU stay there when the device path takes them;
         * a lane forward on one device computes rows arriving over NCCL in
         * pieces as they come (fwd_nccl_pieces) */
        int device_ok = gpu_whole && bf && dt == MOE_BF16 && !train && !fanout;
        int piecewise = device_ok && lane && !fanout && !gops->collective;
        /* in a job of several workers the peers whose rows came are in the
         * exchange already: this rank gives up on missing rows well within
         * their collective's timeout, so that the exchange goes on (the
         * missing client answered unavailable) instead of timing out */
        long long wait_ms = w->data_wait_ms;
        if (W > 1 && wait_ms > w->xchg_timeout_ms / 2)
            wait_ms = w->xchg_timeout_ms / 2;
        tr = tr && !lane && !fanout; /* the ordered road's */
        if (tr)
            job_tr.t[0] += t_tr - (double)c->recv_ns * 1e-3;
        e = dp_batch_gather(&w->dp, &rpieces, dt, H, rpc_now_ns() + (uint64_t)wait_ms * 1000000ull,
                            (device_ok ? DP_GATHER_DEVICE : 0) | (piecewise ? DP_GATHER_PIECES : 0),
                            &batch, err, sizeof(err));
        if (e != MOE_OK) {
            dp_batch_fail(&batch, e, err);
            dp_batch_free(&w->dp, &batch);
            rpc_reply_err(c, e, "%s", err);
            return;
        }
        xt = batch.x;
        if (tr)
            step_trace_stamp(&job_tr, 1, &t_tr);
        if (fanout) { /* the lane of several workers: no exchange (fanout.c) */
            /* a GPU backend either routes on the device (fanout) or runs
             * the experts alone (experts_forward, routing on the host) */
            int backend_ok = !gops || gops->fanout || (!gops->whole_layer && gops->experts_forward);
            if (!lane || train || !backend_ok || xt.ndim != 2 || xt.shape[1] != H) {
                if (xt.ndim != 2 || xt.shape[1] != H)
                    snprintf(err, sizeof(err), "x must be (T, %d) for model '%s'", H, model_name);
                else
                    snprintf(err, sizeof(err),
                             "a fan-out forward is an inference lane forward of a cluster of "
                             "several workers");
                dp_batch_fail(&batch, MOE_EINVAL, err);
                rpc_reply_err(c, MOE_EINVAL, "%s", err);
            } else {
                wkr_forward_fanout(w, c, m, (int)layer, &batch);
            }
            dp_batch_free(&w->dp, &batch);
            return;
        }
    }
    if (layer >= cfg->layers || xt.ndim != 2 || xt.shape[1] != H) {
        rpc_reply_err(c, MOE_EINVAL, "bad layer or x shape for model '%s'", model_name);
        return;
    }
    if (train && !m->train_ready && wkr_model_train_alloc(m) != MOE_OK) {
        rpc_reply_err(c, MOE_ENOMEM, "cannot allocate training state for '%s'", model_name);
        return;
    }
    if (train && gops && !m->gpu_train && wkr_gpu_attach(w, m, 1) != MOE_OK) {
        rpc_reply_err(c, MOE_ENOMEM,
                      "cannot allocate GPU training state for '%s' (device memory: each layer "
                      "keeps --gpu-train-states=%lld workspaces sized by --gpu-max-tokens=%lld; "
                      "lower them)",
                      model_name, w->gpu_train_states, w->gpu_max_tokens);
        return;
    }
    gops = m->gpu_ops;
    gpu_whole = gops && gops->whole_layer;
    const wkr_layer *L = &m->layers[layer];
    wkr_fwd_state *st = wpool_calloc(1, sizeof(*st));
    uint8_t *sendbuf = NULL, *backbuf = NULL;
    void *recvbuf = NULL, *retbuf = NULL;
    float *ye = NULL, *y = NULL;
    double *probs_sum = wpool_calloc((size_t)E, sizeof(double)), z_sum = 0;
    int32_t *dropped = wpool_calloc((size_t)E, sizeof(int32_t));
    size_t send_bytes[256], recv_bytes[256], back_bytes[256], ret_bytes[256], row0s[256];
    if (!st || !probs_sum || !dropped) {
        e = MOE_ENOMEM;
        goto fail;
    }
    st->handle = (uint64_t)handle;
    st->created_ns = rpc_now_ns();
    st->model = m;
    st->layer = (int)layer;
    st->T = (int)xt.shape[0];
    st->T_total = (int)T_total;
    const int T = st->T;
    const size_t S = (size_t)T * K, Tn = T ? (size_t)T : 1;
    double t0 = fwd_now_s(), t_gate, t_disp, t_exp, t_comb;
    lane_trace(LT_FWD0);
    uint64_t a2a = 0; /* bytes this rank sent to the others (dispatch + combine) */
    double aux = 0;   /* aux_whole: the aux loss, computed by the device */
    int aux_whole = 0;

    /* A bf16 inference forward on the device stays bf16: the rows go from
     * the message (or the shared region) to the GPU and back, with no
     * conversion on the host; y lands in pinned memory, or straight in the
     * client's shared region. */
    const int raw = gpu_whole && bf && xt.dtype == MOE_BF16 && !train;
    void *y_raw = NULL;
    if (raw) {
        int only = direct && batch.n == 1 && batch.tk[0] && batch.tk[0]->region;
        y_raw = only ? dp_y_ptr(batch.tk[0]) : wkr_pinned(w, (size_t)T * H * 2);
        if (!y_raw) {
            e = MOE_ENOMEM;
            goto fail;
        }
    }

    /* ---- gate ---- */
    if (!raw) {
        st->x = wpool_alloc(Tn * H * sizeof(float));
        if (!st->x) {
            e = MOE_ENOMEM;
            goto fail;
        }
        rows_tensor_to_f32(&xt, st->x, (size_t)T * H);
        if (bf)
            kern_bf16_round_n(st->x, (size_t)T * H);
        /* a client's NaN or Inf is that client's error alone: its rows are
         * refused (and zeroed here), the others computed as usual */
        if (direct)
            dp_batch_refuse_nonfinite(&batch, st->x, H);
    }
    if (gpu_whole) {
        /* the whole layer on the device: one GPU worker, or several over
         * NCCL (rows go GPU to GPU) */
        st->counts = wpool_calloc((size_t)E, sizeof(int32_t));
        y = raw ? NULL : wpool_alloc(Tn * H * sizeof(float));
        if (!st->counts || (!raw && !y)) {
            e = MOE_ENOMEM;
            goto fail;
        }
        wkr_gpu_out go;
        memset(&go, 0, sizeof(go));
        go.counts = st->counts;
        go.dropped = dropped;
        go.probs_sum = probs_sum;
        if (raw && batch.x_pieces > 1 && batch.tk[0] && y_raw == dp_y_ptr(batch.tk[0]))
            e = fwd_nccl_pieces(w, m, gops, st->layer, st->handle, batch.tk[0], T, H, xt.data,
                                y_raw, &go, err, sizeof(err));
        else {
            if (batch.x_pieces > 1) /* not computed piece by piece: x whole first */
                e = wnc_x_piece_wait(batch.tk[0], batch.x_pieces - 1, err, sizeof(err));
            if (e == MOE_OK)
                e = raw ? gops->forward(w, m, st->layer, st->handle, T, xt.data, MOE_BF16, y_raw,
                                        MOE_BF16, train, &go, err, sizeof(err))
                        : gops->forward(w, m, st->layer, st->handle, T, st->x, MOE_F32, y, MOE_F32,
                                        train, &go, err, sizeof(err));
        }
        if (e == MOE_EUNAVAIL && gops->collective)
            goto fail_xchg;
        if (e != MOE_OK)
            goto fail_msg;
        z_sum = go.z_sum;
        aux_whole = go.aux_whole;
        aux = go.aux;
        a2a = go.a2a_bytes;
        t_gate = t_disp = t0;
        t_exp = t_comb = fwd_now_s();
        goto reply;
    }
    if ((e = fwd_gate(L, st, 1, probs_sum, &z_sum)) != MOE_OK)
        goto fail;
    if (train) {
        /* the aux loss gradient needs the batch's counts: gather them */
        st->counts_global = wpool_calloc((size_t)E, sizeof(int32_t));
        int32_t *all = wpool_alloc((size_t)W * E * sizeof(int32_t));
        if (!st->counts_global || !all) {
            wpool_free(all);
            e = MOE_ENOMEM;
            goto fail;
        }
        e = xchg_allgather(w->xc, st->counts, (size_t)E * sizeof(int32_t), all);
        for (int q = 0; e == MOE_OK && q < W; q++)
            for (int k = 0; k < E; k++)
                st->counts_global[k] += all[(size_t)q * E + k];
        wpool_free(all);
        if (e != MOE_OK)
            goto fail_xchg;
    }
    t_gate = fwd_now_s();

    /* ---- dispatch ---- */
    if (fwd_pack_by_owner(st, W, E, H, K, st->x, 1, 1, bf, &sendbuf, send_bytes) == (size_t)-1) {
        e = MOE_ENOMEM;
        goto fail;
    }
    e = xchg_alltoallv(w->xc, sendbuf, send_bytes, &recvbuf, recv_bytes);
    if (e != MOE_OK)
        goto fail_xchg;
    t_disp = fwd_now_s();

    /* ---- experts ---- */
    e = fwd_owner_parse(st, W, H, bf, recvbuf, recv_bytes, row0s, err, sizeof(err));
    if (e != MOE_OK)
        goto fail_msg;
    size_t nin = st->n_in ? st->n_in : 1;
    int host_experts = !(gops && gops->experts_forward); /* a device keeps its own activations */
    st->xe = wpool_alloc(nin * H * sizeof(float));
    if (host_experts)
        st->ae = wpool_alloc(nin * F * sizeof(float));
    if (host_experts && act_gated(cfg->act))
        st->be = wpool_alloc(nin * F * sizeof(float));
    ye = wpool_alloc(nin * H * sizeof(float));
    if (!st->xe || (host_experts && !st->ae) || (host_experts && act_gated(cfg->act) && !st->be) ||
        !ye) {
        e = MOE_ENOMEM;
        goto fail;
    }
    fwd_owner_gather(st, W, recvbuf, row0s, H, bf, st->xe);
    xchg_free(w->xc, recvbuf);
    recvbuf = NULL;
    if ((e = fwd_experts(st, L, W, dropped, ye, train)) != MOE_OK) {
        if (e == MOE_EUNAVAIL && xchg_aborted())
            goto fail_xchg; /* given up between two experts */
        snprintf(err, sizeof(err), "expert kernels failed on rank %d: %s", w->rank,
                 moe_strerror(e));
        goto fail_msg;
    }
    if (fwd_owner_scatter(st, W, H, ye, bf, &backbuf, back_bytes) == (size_t)-1) {
        e = MOE_ENOMEM;
        goto fail;
    }
    t_exp = fwd_now_s();

    /* ---- combine ---- */
    e = xchg_alltoallv(w->xc, backbuf, back_bytes, &retbuf, ret_bytes);
    if (e != MOE_OK)
        goto fail_xchg;
    size_t ret_total = 0;
    for (int q = 0; q < W; q++)
        ret_total += ret_bytes[q];
    if (ret_total != S * H * (bf ? 2 : 4)) {
        e = MOE_EINTERNAL;
        snprintf(err, sizeof(err), "combine returned %zu bytes, want %zu", ret_total,
                 S * H * (bf ? 2 : 4));
        goto fail_msg;
    }
    st->ye_slot = wpool_alloc((S ? S : 1) * H * sizeof(float));
    y = wpool_alloc(Tn * H * sizeof(float));
    if (!st->ye_slot || !y) {
        e = MOE_ENOMEM;
        goto fail;
    }
    fwd_unpack_sorted(st, retbuf, H, bf, st->ye_slot);
    kern_combine_par(st->ye_slot, st->topk_w, NULL, T, K, H, bf, y);
    /* the shared expert: replicated, on this rank's own tokens */
    if (cfg->shared_d_ff > 0 &&
        (e = kern_shared_forward_cpu(st->x, T, H, cfg->shared_d_ff, L->ws1, L->ws3, L->ws2, L->wsg,
                                     (kern_act)cfg->act, bf, 1, y)) != MOE_OK)
        goto fail;
    t_comb = fwd_now_s();

    for (int q = 0; q < W; q++)
        if (q != w->rank)
            a2a += send_bytes[q] + back_bytes[q];

reply:; /* {y, counts, dropped, probs_sum, z_sum, phase times, and a2a_bytes or
         * aux_loss} */
    lane_trace(LT_FWD1);
    if (tr && direct)
        step_trace_stamp(&job_tr, 2, &t_tr);
    if (lane) {
        double ph[4] = {t_gate - t0, t_disp - t_gate, t_exp - t_disp, t_comb - t_exp};
        lane_attach_stats(&batch, cfg, T, st->counts, dropped, probs_sum, z_sum,
                          aux_whole ? &aux : NULL, ph);
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 10 + direct);
    if (!aux_whole) {
        mp_write_cstr(&wr, "a2a_bytes");
        mp_write_u64(&wr, a2a);
    }
    write_y(&wr, &batch, direct, xt.dtype, y, y_raw, T, H);
    mp_write_cstr(&wr, "counts");
    mp_write_bin(&wr, st->counts, (uint32_t)(4 * E));
    mp_write_cstr(&wr, "dropped");
    mp_write_bin(&wr, dropped, (uint32_t)(4 * E));
    mp_write_cstr(&wr, "probs_sum"); /* aux_whole: not computed, the aux loss comes whole */
    mp_write_bin(&wr, probs_sum, (uint32_t)(8 * E));
    if (aux_whole) {
        mp_write_cstr(&wr, "aux_loss");
        mp_write_f64(&wr, aux);
    }
    mp_write_cstr(&wr, "z_sum");
    mp_write_f64(&wr, z_sum);
    mp_write_cstr(&wr, "gate_s");
    mp_write_f64(&wr, t_gate - t0);
    mp_write_cstr(&wr, "dispatch_s");
    mp_write_f64(&wr, t_disp - t_gate);
    mp_write_cstr(&wr, "experts_s");
    mp_write_f64(&wr, t_exp - t_disp);
    mp_write_cstr(&wr, "combine_s");
    mp_write_f64(&wr, t_comb - t_exp);
    rpc_reply(c, &wr);
    if (tr && direct) {
        step_trace_stamp(&job_tr, 3, &t_tr);
        step_trace_end(&job_tr);
    }
    if (train) {
        wkr_handle_put(w, st);
        st = NULL;
    }
    goto out;

fail_xchg:
    LOG_W("forward %s layer %lld: exchange failed: %s", model_name, (long long)layer,
          moe_strerror(e));
    dp_batch_fail(&batch, MOE_EUNAVAIL, "exchange between workers failed");
    rpc_reply_err(c, MOE_EUNAVAIL, "exchange between workers failed (rank %d): %s", w->rank,
                  moe_strerror(e));
    goto out;
fail_msg:
    LOG_E("forward: %s", err);
    dp_batch_fail(&batch, e, err);
    rpc_reply_err(c, e, "%s", err);
    goto out;
fail:
    dp_batch_fail(&batch, e, moe_strerror(e));
    rpc_reply_err(c, e, "worker rank %d: %s", w->rank, moe_strerror(e));
out:
    dp_batch_free(&w->dp, &batch);
    wkr_fwd_state_free(st);
    wpool_free(probs_sum);
    wpool_free(dropped);
    wpool_free(sendbuf);
    wpool_free(backbuf);
    wpool_free(ye);
    wpool_free(y);
    if (recvbuf)
        xchg_free(w->xc, recvbuf);
    if (retbuf)
        xchg_free(w->xc, retbuf);
}
