/* dataplane.c - tickets and shared-memory regions of the worker's data
 * plane; see dataplane.h. */
#include "worker/dataplane.h"

#include <nng/nng.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "worker/gpu.h"
#include "kernels/kern.h"
#include "common/log.h"
#include "common/params.h"
#include "common/parcopy.h"
#include "common/nccl_pieces.h"
#include "worker/nccl_client.h"
#include "worker/pool.h"
#include "worker/rows.h"

#define DP_MAX_REGIONS_PER_PIPE 64

/* dp_region: a client's shared-memory segment mapped here. */
struct dp_region {
    uint64_t id;
    uint32_t pipe;
    uint8_t *base; /* owned mapping of size bytes */
    size_t size;
    int refs;       /* tickets that point into it (under mu) */
    int dead;       /* its connection closed or it was detached */
    int registered; /* pinned with the CUDA driver */
    int cuda;       /* a client's GPU allocation opened by CUDA IPC (base: device) */
    int device;     /* with cuda: the GPU it is open on */
    int ncclbuf;    /* with cuda: a client communicator's buffer (ours: cudaFree) */
    struct dp_region *next;
};

static void region_unmap(dp_region *g)
{
    if (g->ncclbuf) {
        wnc_buf_free(g->device, g->base);
        free(g);
        return;
    }
    if (g->cuda) {
        wkr_gpu_ipc_close(g->device, g->base);
        free(g);
        return;
    }
    if (g->registered)
        wkr_gpu_host_unregister(g->base);
    munmap(g->base, g->size);
    free(g);
}

/* region_drop unlinks g from the table (mu held); it is unmapped now if no
 * ticket points into it, else when the last one is released. */
static void region_drop(dp_table *t, dp_region *g)
{
    for (dp_region **pp = &t->regions; *pp; pp = &(*pp)->next)
        if (*pp == g) {
            *pp = g->next;
            break;
        }
    if (!g->cuda)
        t->mapped_bytes -= g->size;
    g->dead = 1;
    dp_rings_stop_region(t, g); /* each gives its reference back as it stops */
    if (!g->refs)
        region_unmap(g);
}

static dp_region *region_find(dp_table *t, uint32_t pipe, uint64_t id)
{
    for (dp_region *g = t->regions; g; g = g->next)
        if (g->id == id && g->pipe == pipe)
            return g;
    return NULL;
}

dp_region *dp_region_find_locked(dp_table *t, uint32_t pipe, uint64_t id, uint8_t **base,
                                 size_t *size, int *cuda)
{
    dp_region *g = region_find(t, pipe, id);
    if (g) {
        *base = g->base;
        *size = g->size;
        *cuda = g->cuda;
    }
    return g;
}

void dp_region_hold_locked(dp_region *g)
{
    g->refs++;
}

void dp_region_release_locked(dp_table *t, dp_region *g)
{
    (void)t;
    if (--g->refs == 0 && g->dead)
        region_unmap(g);
}

dp_region *dp_ncclbuf_region(int device, void *dev, size_t n)
{
    dp_region *g = calloc(1, sizeof(*g));
    if (!g)
        return NULL;
    g->base = dev;
    g->size = n;
    g->cuda = 1;
    g->ncclbuf = 1;
    g->device = device;
    g->refs = 1;
    return g;
}

void dp_region_abandon_locked(dp_table *t, dp_region *g)
{
    g->dead = 1;
    dp_region_release_locked(t, g);
}

uint8_t *dp_region_base(const dp_region *g)
{
    return g->base;
}

/* regions_on_pipe: how many regions connection pipe holds (mu held). */
static int regions_on_pipe(const dp_table *t, uint32_t pipe)
{
    int n = 0;
    for (const dp_region *g = t->regions; g; g = g->next)
        n += g->pipe == pipe;
    return n;
}

/* region_add files a mapped region under a fresh id (takes mu). */
static void region_add(dp_table *t, dp_region *g)
{
    pthread_mutex_lock(&t->mu);
    g->id = ++t->next_region;
    g->next = t->regions;
    t->regions = g;
    if (!g->cuda)
        t->mapped_bytes += g->size;
    t->regions_attached_total++;
    pthread_mutex_unlock(&t->mu);
}

/* unlink_ticket removes tk from the list (mu held). */
static void unlink_ticket(dp_table *t, dp_ticket *tk)
{
    for (dp_ticket **pp = &t->head; *pp; pp = &(*pp)->next)
        if (*pp == tk) {
            *pp = tk->next;
            break;
        }
    t->ntickets--;
    if (!tk->region)
        t->staged_bytes -= tk->x.nbytes;
}

/* ---- bulk rows (the connection's side is worker/bulk.c) ---- */

/* bulk_finish hands the ticket's answer to the bulk connection (mu held):
 * y already in b->buf (e == MOE_OK), or the error. Once only. */
static void bulk_finish(dp_bulk *b, moe_err e, const char *msg)
{
    if (b->state == DP_BULK_DONE)
        return;
    b->state = DP_BULK_DONE;
    b->err = e;
    snprintf(b->msg, sizeof(b->msg), "%s", msg);
    if (!b->dead) {
        uint64_t one = 1;
        ssize_t n = write(b->wake_fd, &one, sizeof(one));
        (void)n; /* an eventfd: cannot fill up here */
    }
}

/* bulk_unref drops one reference (mu held); the last frees b. */
static void bulk_unref(dp_bulk *b)
{
    if (--b->refs > 0)
        return;
    wpool_free(b->buf);
    free(b);
}

moe_err dp_bulk_reserve(dp_table *t, size_t n, char *err, size_t errlen)
{
    moe_err e = MOE_OK;
    pthread_mutex_lock(&t->mu);
    if (t->staged_bytes + n > t->max_staged_bytes) {
        e = MOE_EBUSY;
        snprintf(err, errlen, "%zu bytes of rows already wait here (cap %zu)", t->staged_bytes,
                 t->max_staged_bytes);
    } else {
        t->staged_bytes += n;
    }
    pthread_mutex_unlock(&t->mu);
    return e;
}

void dp_bulk_unreserve(dp_table *t, size_t n)
{
    pthread_mutex_lock(&t->mu);
    t->staged_bytes -= n;
    pthread_mutex_unlock(&t->mu);
}

moe_err dp_bulk_park(dp_table *t, dp_bulk *b, char *err, size_t errlen)
{
    moe_err e = MOE_OK;
    pthread_mutex_lock(&t->mu);
    for (dp_bulk *o = t->parked; o && e == MOE_OK; o = o->next)
        if (o->cid == b->cid && o->seq == b->seq)
            e = MOE_EPRECOND;
    for (dp_ticket *o = t->head; o && e == MOE_OK; o = o->next)
        if (o->cid == b->cid && o->seq == b->seq)
            e = MOE_EPRECOND;
    if (e != MOE_OK) {
        snprintf(err, errlen, "ticket [%llu, %llu] is already here", (unsigned long long)b->cid,
                 (unsigned long long)b->seq);
    } else {
        b->state = DP_BULK_PARKED;
        b->refs = 1;
        b->mu = &t->mu;
        b->next = t->parked;
        t->parked = b;
        t->bulk_parked++;
        t->bulk_in_total++;
    }
    pthread_mutex_unlock(&t->mu);
    return e;
}

/* bulk_unlink removes b from the parked list (mu held): 1 if it was there. */
static int bulk_unlink(dp_table *t, dp_bulk *b)
{
    for (dp_bulk **pp = &t->parked; *pp; pp = &(*pp)->next)
        if (*pp == b) {
            *pp = b->next;
            b->next = NULL;
            t->bulk_parked--;
            return 1;
        }
    return 0;
}

int dp_bulk_unpark(dp_table *t, dp_bulk *b, int dead)
{
    pthread_mutex_lock(&t->mu);
    int was = b->state == DP_BULK_PARKED && bulk_unlink(t, b);
    if (was) {
        t->staged_bytes -= b->reserved;
        b->reserved = 0;
        b->state = DP_BULK_DONE;
    }
    if (dead)
        b->dead = 1;
    pthread_mutex_unlock(&t->mu);
    return was;
}

void dp_bulk_put(dp_table *t, dp_bulk *b)
{
    pthread_mutex_lock(&t->mu);
    bulk_unref(b);
    pthread_mutex_unlock(&t->mu);
}

void dp_bulk_conn_count(dp_table *t, int d)
{
    pthread_mutex_lock(&t->mu);
    t->bulk_conns += d;
    pthread_mutex_unlock(&t->mu);
}

/* bulk_claim takes the parked rows of ticket (cid, seq) for tk (mu held):
 * tk's x is a view into their buffer; the bytes stay counted in
 * staged_bytes, now as the ticket's. NULL when none are parked. */
static dp_bulk *bulk_claim(dp_table *t, dp_ticket *tk)
{
    dp_bulk *b = t->parked;
    while (b && !(b->cid == tk->cid && b->seq == tk->seq))
        b = b->next;
    if (!b || b->dead)
        return NULL;
    bulk_unlink(t, b);
    b->state = DP_BULK_CLAIMED;
    b->reserved = 0;
    b->refs++;
    tk->bulk = b;
    tk->x.dtype = b->dtype;
    tk->x.ndim = 2;
    tk->x.shape[0] = b->rows;
    tk->x.shape[1] = b->cols;
    tk->x.data = b->buf;
    tk->x.nbytes = b->nbytes;
    return b;
}

/* ticket_free drops the region reference (mu held) and frees tk. */
static void ticket_free(dp_table *t, dp_ticket *tk)
{
    dp_region *g = tk->region, *gy = tk->yregion;
    if (tk->bulk) { /* an answer the bulk connection did not get yet: the error's */
        bulk_finish(tk->bulk, MOE_ECLOSED, "the rows were dropped; data.rows has the reason");
        bulk_unref(tk->bulk);
    }
    if (g && --g->refs == 0 && g->dead)
        region_unmap(g);
    if (gy && --gy->refs == 0 && gy->dead)
        region_unmap(gy);
    wnc_put_locked(tk->nccl);
    free(tk->extra);
    free(tk);
}

moe_err dp_ticket_set_extra(dp_ticket *tk, const void *pairs, size_t len, uint32_t npairs)
{
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy)
        return MOE_ENOMEM;
    memcpy(copy, pairs, len);
    free(tk->extra);
    tk->extra = copy;
    tk->extra_len = len;
    tk->extra_pairs = npairs;
    return MOE_OK;
}

/* answer_head writes the answer map's count and the ticket's extra pairs. */
static void answer_head(mp_writer *w, const dp_ticket *tk)
{
    mp_write_map(w, 1 + tk->extra_pairs);
    if (tk->extra_pairs)
        mp_write_raw(w, tk->extra, tk->extra_len);
}

void dp_release(dp_table *t, dp_ticket *tk)
{
    if (!tk)
        return;
    if (tk->call) /* never left unanswered */
        dp_answer_err(tk, MOE_EINTERNAL, "the worker dropped these rows unanswered");
    pthread_mutex_lock(&t->mu);
    unlink_ticket(t, tk);
    ticket_free(t, tk);
    pthread_mutex_unlock(&t->mu);
}

/* ---- answers ---- */

/* answer_inline sends {y: tensor (rows,H) of dt} with the data written into
 * the reply message itself: converted from floats, or copied (one pass). */
static void answer_inline(dp_ticket *tk, moe_dtype dt, int64_t rows, int64_t H, const void *src,
                          int src_f32)
{
    mp_writer w;
    size_t es = moe_dtype_size(dt), nbytes = (size_t)rows * (size_t)H * es;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, tk->call->req.msgid);
    answer_head(&w, tk);
    const int64_t shape[2] = {rows, H};
    mp_write_cstr(&w, "y");
    moe_tensor_write_head(&w, dt, 2, shape);
    nng_msg *m;
    if (w.failed || nng_msg_alloc(&m, w.len + nbytes) != 0) {
        mp_writer_fini(&w);
        rpc_reply_err(tk->call, MOE_ENOMEM, "out of memory for a %zu byte answer", nbytes);
        tk->call = NULL;
        return;
    }
    uint8_t *body = nng_msg_body(m);
    memcpy(body, w.buf, w.len);
    if (src_f32)
        rows_f32_to_dtype(src, dt, body + w.len, (size_t)rows * (size_t)H);
    else if (nbytes)
        par_memcpy(body + w.len, src, nbytes);
    mp_writer_fini(&w);
    rpc_reply_msg(tk->call, m);
    tk->call = NULL;
}

int dp_answer_begin(dp_ticket *tk, mp_writer *w, uint32_t npairs)
{
    if (!tk->call)
        return 0;
    moe_rpc_write_response_ok_head(w, tk->call->req.msgid);
    mp_write_map(w, npairs);
    return 1;
}

void dp_answer_end(dp_ticket *tk, mp_writer *w)
{
    if (!tk->call)
        return;
    if (w->failed)
        rpc_reply_err(tk->call, MOE_ENOMEM, "out of memory for an answer");
    else
        rpc_reply(tk->call, w);
    tk->call = NULL;
}

/* write_y_apart: the answer's y when its rows travel apart from it (the
 * bulk connection, the NCCL communicator): {key: true, dtype, shape} */
static void write_y_apart(mp_writer *w, const char *key, moe_dtype dt, int64_t rows, int64_t H)
{
    mp_write_map(w, 3);
    mp_write_cstr(w, key);
    mp_write_bool(w, true);
    mp_write_cstr(w, "dtype");
    mp_write_cstr(w, moe_dtype_name(dt));
    mp_write_cstr(w, "shape");
    mp_write_array(w, 2);
    mp_write_i64(w, rows);
    mp_write_i64(w, H);
}

moe_err dp_nccl_y_piece(dp_ticket *tk, int piece)
{
    const int P = tk->nccl_pieces > 1 ? tk->nccl_pieces : 1;
    if (!tk->nccl || piece != tk->nccl_ysent || piece >= P)
        return MOE_EINVAL;
    const int64_t R = tk->x.shape[0], a = nccl_piece_first(R, P, piece);
    const size_t row = (size_t)tk->x.shape[1] * moe_dtype_size(tk->x.dtype);
    const size_t n = (size_t)(nccl_piece_first(R, P, piece + 1) - a) * row;
    moe_err e = wnc_send_y(tk->nccl, (const uint8_t *)dp_y_ptr(tk) + (size_t)a * row, n,
                           tk->deadline_ns, piece, P);
    if (e == MOE_OK)
        tk->nccl_ysent++;
    return e;
}

/* answer_region: y already written at y_off; the answer names where. */
static void answer_region(dp_ticket *tk, int64_t rows, int64_t H)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, tk->call->req.msgid);
    answer_head(&w, tk);
    mp_write_cstr(&w, "y");
    if (tk->nccl) { /* y goes on the communicator, queued before this answer */
        /* y is queued first (its pieces the lane's piece loop did not queue
         * yet): the client's receives of y are already posted, so y does
         * not wait for the answer's round trip; where it cannot be queued
         * (the communicator failed) the answer is an error and the client
         * aborts its receive */
        moe_err e = MOE_OK;
        while (e == MOE_OK && tk->nccl_ysent < tk->nccl_pieces)
            e = dp_nccl_y_piece(tk, tk->nccl_ysent);
        if (e != MOE_OK) {
            mp_writer_fini(&w);
            rpc_reply_err(tk->call, MOE_EUNAVAIL,
                          "the NCCL communicator failed before y could be sent");
            tk->call = NULL;
            return;
        }
        write_y_apart(&w, "nccl", tk->x.dtype, rows, H);
        rpc_reply(tk->call, &w);
        tk->call = NULL;
        return;
    }
    mp_write_map(&w, 4);
    mp_write_cstr(&w, "dtype");
    mp_write_cstr(&w, moe_dtype_name(tk->x.dtype));
    mp_write_cstr(&w, "shape");
    mp_write_array(&w, 2);
    mp_write_i64(&w, rows);
    mp_write_i64(&w, H);
    mp_write_cstr(&w, "region");
    mp_write_u64(&w, tk->yregion->id);
    mp_write_cstr(&w, "offset");
    mp_write_u64(&w, tk->y_off);
    rpc_reply(tk->call, &w);
    tk->call = NULL;
}

int dp_x_on_device(const dp_ticket *tk)
{
    return tk->region && tk->region->cuda;
}

int dp_y_on_device(const dp_ticket *tk)
{
    return tk->region && tk->yregion->cuda;
}

void *dp_y_ptr(const dp_ticket *tk)
{
    return tk->region ? tk->yregion->base + tk->y_off : NULL;
}

/* answer_bulk: y (rows,H) of the ticket's dtype is in its bulk buffer;
 * the connection's thread writes it to the client, and data.rows is
 * answered {y: {bulk: true, dtype, shape}}. */
static void answer_bulk(dp_ticket *tk, int64_t rows, int64_t H)
{
    dp_bulk *b = tk->bulk;
    pthread_mutex_lock(b->mu);
    bulk_finish(b, MOE_OK, "");
    pthread_mutex_unlock(b->mu);
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, tk->call->req.msgid);
    answer_head(&w, tk);
    mp_write_cstr(&w, "y");
    write_y_apart(&w, "bulk", tk->x.dtype, rows, H);
    rpc_reply(tk->call, &w);
    tk->call = NULL;
}

void dp_answer_f32(dp_ticket *tk, const float *y, int64_t rows, int64_t H)
{
    if (tk->bulk) { /* into the buffer x came in (same shape and dtype) */
        rows_f32_to_dtype(y, tk->x.dtype, tk->bulk->buf, (size_t)rows * (size_t)H);
        answer_bulk(tk, rows, H);
        return;
    }
    if (tk->region && dp_y_on_device(tk)) { /* converted here, then to the GPU */
        size_t n = (size_t)rows * (size_t)H, nb = n * moe_dtype_size(tk->x.dtype);
        void *tmp = malloc(nb ? nb : 1);
        if (!tmp) {
            dp_answer_err(tk, MOE_ENOMEM, "out of memory for a %zu byte answer", nb);
            return;
        }
        rows_f32_to_dtype(y, tk->x.dtype, tmp, n);
        moe_err e = wkr_gpu_copy(dp_y_ptr(tk), tmp, nb);
        free(tmp);
        if (e != MOE_OK) {
            dp_answer_err(tk, e, "copying y to the client's GPU buffer failed");
            return;
        }
        answer_region(tk, rows, H);
        return;
    }
    if (tk->region) {
        rows_f32_to_dtype(y, tk->x.dtype, dp_y_ptr(tk), (size_t)rows * (size_t)H);
        answer_region(tk, rows, H);
        return;
    }
    answer_inline(tk, tk->x.dtype, rows, H, y, 1);
}

void dp_answer_raw(dp_ticket *tk, const void *y, int64_t rows, int64_t H)
{
    if (tk->bulk) {
        size_t nb = (size_t)rows * (size_t)H * moe_dtype_size(tk->x.dtype);
        if ((const uint8_t *)y != tk->bulk->buf)
            par_memcpy(tk->bulk->buf, y, nb);
        answer_bulk(tk, rows, H);
        return;
    }
    if (tk->region) {
        void *dst = dp_y_ptr(tk);
        size_t nb = (size_t)rows * (size_t)H * moe_dtype_size(tk->x.dtype);
        if (dst != y && dp_y_on_device(tk)) {
            if (wkr_gpu_copy(dst, y, nb) != MOE_OK) {
                dp_answer_err(tk, MOE_EINTERNAL, "copying y to the client's GPU buffer failed");
                return;
            }
        } else if (dst != y) {
            par_memcpy(dst, y, nb);
        }
        answer_region(tk, rows, H);
        return;
    }
    answer_inline(tk, tk->x.dtype, rows, H, y, 0);
}

void dp_answer_err(dp_ticket *tk, moe_err e, const char *fmt, ...)
{
    char text[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (tk->bulk) {
        pthread_mutex_lock(tk->bulk->mu);
        bulk_finish(tk->bulk, e, text);
        pthread_mutex_unlock(tk->bulk->mu);
    }
    if (tk->call)
        rpc_reply_err(tk->call, e, "%s", text);
    tk->call = NULL;
}

/* ---- requests ---- */

static int auth_ok(dp_table *t, rpc_call *c)
{
    if (!t->auth_token || !t->auth_token[0])
        return 1;
    mp_reader r = c->req.params;
    for (uint32_t i = 0; i < c->req.nparams; i++) {
        const char *k, *v;
        uint32_t kl, vl;
        if (mp_read_str(&r, &k, &kl, NULL) != MOE_OK)
            return 0;
        if (mp_str_eq(k, kl, "auth"))
            return mp_read_str(&r, &v, &vl, NULL) == MOE_OK && vl == strlen(t->auth_token) &&
                   memcmp(v, t->auth_token, vl) == 0;
        if (mp_skip(&r, NULL) != MOE_OK)
            return 0;
    }
    return 0;
}

/* read_pair reads [a, b] of two unsigned integers. */
static int read_pair(mp_reader *r, uint64_t *a, uint64_t *b)
{
    uint32_t n;
    return mp_read_array(r, &n, NULL) == MOE_OK && n == 2 && mp_read_u64(r, a, NULL) == MOE_OK &&
           mp_read_u64(r, b, NULL) == MOE_OK;
}

/* data.rows {ticket: [cid, seq], x: tensor, deadline_ms?} or, by reference,
 * {ticket, dtype, shape: [R, H], region, x_offset, y_offset, y_region?,
 * deadline_ms?} */
/* start_run: the lane's run of a filed ticket (run: its params, rows and
 * dtype set); when the run cannot be queued, nobody will take the ticket:
 * it is answered with the error and freed here (unless the compute thread
 * took it meanwhile) */
static void start_run(dp_table *t, dp_ticket *tk, dp_run *run)
{
    char err[256];
    rpc_call *c = tk->call;
    moe_err e = t->run(t->run_arg, run, err, sizeof(err));
    if (e == MOE_OK)
        return;
    pthread_mutex_lock(&t->mu);
    if (!tk->taken) {
        unlink_ticket(t, tk);
        pthread_mutex_unlock(&t->mu);
        rpc_reply_err(c, e, "%s", err);
        tk->call = NULL;
        pthread_mutex_lock(&t->mu);
        ticket_free(t, tk);
    }
    pthread_mutex_unlock(&t->mu);
}

/* parse_run reads data.rows' "run": {model: str, layer: int, generation:
 * uint} (the lane: the worker runs the inference forward of these rows at
 * once, without the coordinator). */
static moe_err parse_run(const dp_table *t, mp_reader *r, dp_run *run, char *err, size_t errlen)
{
    uint32_t n;
    int64_t gen = 0;
    bool fanout = false;
    if (!t->run) {
        snprintf(err, errlen, "this worker has no lane: send the forward to the coordinator");
        return MOE_EPRECOND;
    }
    if (mp_peek(r) != MP_MAP || mp_read_map(r, &n, NULL) != MOE_OK) {
        snprintf(err, errlen, "parameter 'run' must be a map {model, layer, generation}");
        return MOE_EPROTO;
    }
    pspec sp[] = {
        {"model", P_STR, run->model, true, 0, 0, sizeof(run->model), false},
        {"layer", P_INT, &run->layer, true, 0, 1e6, 0, false},
        {"generation", P_INT, &gen, true, 1, 9e18, 0, false},
        {"fanout", P_BOOL, &fanout, false, 0, 0, 0, false},
    };
    moe_err e = params_parse(r, n, sp, 4, err, errlen);
    run->generation = (uint64_t)gen;
    run->fanout = fanout;
    return e;
}

void dp_rows_call(dp_table *t, rpc_call *c)
{
    char err[256], dtname[8] = "";
    mp_reader rt, rshape, rrun;
    moe_tensor x;
    int64_t deadline_ms = 60000, region = 0, xoff = 0, yoff = 0, yregion = 0, nccl = 0;
    int64_t pieces = 1;
    bool bulk = false;
    memset(&x, 0, sizeof(x));
    pspec sp[] = {
        {"ticket", P_RAW, &rt, true, 0, 0, 0, false},
        {"x", P_TENSOR, &x, false, 0, 0, 0, false},
        {"deadline_ms", P_INT, &deadline_ms, false, 1, 3600000, 0, false},
        {"dtype", P_STR, dtname, false, 0, 0, sizeof(dtname), false},
        {"shape", P_RAW, &rshape, false, 0, 0, 0, false},
        {"region", P_INT, &region, false, 1, 9e18, 0, false},
        {"x_offset", P_INT, &xoff, false, 0, 9e18, 0, false},
        {"y_offset", P_INT, &yoff, false, 0, 9e18, 0, false},
        {"y_region", P_INT, &yregion, false, 1, 9e18, 0, false},
        {"run", P_RAW, &rrun, false, 0, 0, 0, false},
        {"bulk", P_BOOL, &bulk, false, 0, 0, 0, false},
        {"nccl", P_INT, &nccl, false, 1, 9e18, 0, false},
        {"pieces", P_INT, &pieces, false, 0, 0, 0, false}, /* nccl_pieces_check */
    };
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 13, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    uint64_t cid, seq;
    if (!read_pair(&rt, &cid, &seq)) {
        rpc_reply_err(c, MOE_EINVAL, "ticket must be [client_id, seq] (two unsigned integers)");
        return;
    }
    dp_run run = {cid, seq, "", 0, 0, 0, MOE_F32, c->recv_ns, 0};
    if (sp[9].seen && (e = parse_run(t, &rrun, &run, err, sizeof(err))) != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    dp_ticket *tk = calloc(1, sizeof(*tk));
    if (!tk) {
        rpc_reply_err(c, MOE_ENOMEM, "out of memory");
        return;
    }
    tk->cid = cid;
    tk->seq = seq;
    tk->call = c;
    tk->pipe = rpc_call_pipe(c);
    tk->deadline_ns = rpc_now_ns() + (uint64_t)deadline_ms * 1000000ull;
    if (sp[11].seen && !sp[1].seen && !sp[5].seen && !bulk) { /* x comes over NCCL */
        uint32_t nd;
        int64_t R = -1, H = -1;
        moe_dtype dt;
        if (!sp[3].seen || moe_dtype_parse(dtname, strlen(dtname), &dt) != MOE_OK || !sp[4].seen ||
            mp_read_array(&rshape, &nd, NULL) != MOE_OK || nd != 2 ||
            mp_read_i64(&rshape, &R, NULL) != MOE_OK || mp_read_i64(&rshape, &H, NULL) != MOE_OK ||
            R < 0 || H <= 0 || R > (1ll << 31) || H > (1ll << 20)) {
            dp_ticket_discard(t, tk, MOE_EINVAL, "rows over NCCL need dtype and shape [R, H]");
            return;
        }
        /* before any receive is posted: both sides must post the same */
        if ((e = nccl_pieces_check(pieces, R, sp[9].seen, run.fanout, err, sizeof(err))) !=
            MOE_OK) {
            dp_ticket_discard(t, tk, e, "%s", err);
            return;
        }
        wnc_submit(t, tk, (uint64_t)nccl, dt, R, H, sp[9].seen ? &run : NULL, (int)pieces);
        return;
    }
    if (sp[12].seen && pieces != 1) {
        dp_ticket_discard(t, tk, MOE_EINVAL,
                          "pieces = %lld: only rows over NCCL (nccl: comm) travel in pieces",
                          (long long)pieces);
        return;
    }
    pthread_mutex_lock(&t->mu);
    int ways = sp[1].seen + sp[5].seen + (bulk ? 1 : 0) + sp[11].seen;
    if (ways != 1) {
        e = MOE_EINVAL;
        snprintf(err, sizeof(err),
                 "data.rows needs one of x (inline), region (shared memory), bulk: true (rows "
                 "sent on the bulk connection) or nccl (rows over a communicator), not %s",
                 ways ? "several" : "none");
        goto fail;
    }
    if (bulk) { /* the rows came first, on a bulk connection */
        if (!bulk_claim(t, tk)) {
            e = MOE_ENOTFOUND;
            snprintf(err, sizeof(err),
                     "no bulk rows of ticket [%llu, %llu] are here (send them on the bulk "
                     "connection and wait for its ack first)",
                     (unsigned long long)cid, (unsigned long long)seq);
            goto fail;
        }
        x = tk->x;
    } else if (sp[5].seen) { /* by reference into a region of this connection */
        dp_region *g = region_find(t, tk->pipe, (uint64_t)region);
        dp_region *gy = sp[8].seen ? region_find(t, tk->pipe, (uint64_t)yregion) : g;
        uint32_t nd;
        int64_t R = -1, H = -1;
        if (!g || !gy) {
            e = MOE_ENOTFOUND;
            snprintf(err, sizeof(err), "region %lld is not attached on this connection",
                     (long long)(!g ? region : yregion));
            goto fail;
        }
        if (!sp[3].seen || moe_dtype_parse(dtname, strlen(dtname), &x.dtype) != MOE_OK ||
            !sp[4].seen || mp_read_array(&rshape, &nd, NULL) != MOE_OK || nd != 2 ||
            mp_read_i64(&rshape, &R, NULL) != MOE_OK || mp_read_i64(&rshape, &H, NULL) != MOE_OK ||
            R < 0 || H <= 0 || R > (1ll << 31) || H > (1ll << 20)) {
            e = MOE_EINVAL;
            snprintf(err, sizeof(err), "a region reference needs dtype and shape [R, H]");
            goto fail;
        }
        size_t nbytes = (size_t)R * (size_t)H * moe_dtype_size(x.dtype);
        if ((uint64_t)xoff > g->size || nbytes > g->size - (uint64_t)xoff ||
            (uint64_t)yoff > gy->size || nbytes > gy->size - (uint64_t)yoff) {
            e = MOE_EINVAL;
            snprintf(err, sizeof(err),
                     "x [%lld, +%zu) outside region %llu of %zu bytes, or y [%lld, +%zu) outside "
                     "region %llu of %zu bytes",
                     (long long)xoff, nbytes, (unsigned long long)g->id, g->size, (long long)yoff,
                     nbytes, (unsigned long long)gy->id, gy->size);
            goto fail;
        }
        x.ndim = 2;
        x.shape[0] = R;
        x.shape[1] = H;
        x.data = g->base + xoff;
        x.nbytes = nbytes;
        tk->region = g;
        tk->yregion = gy;
        tk->y_off = (uint64_t)yoff;
        g->refs++;
        gy->refs++;
    } else {
        if (x.ndim != 2) {
            e = MOE_EINVAL;
            snprintf(err, sizeof(err), "x must be 2-d (R, H)");
            goto fail;
        }
        if (t->staged_bytes + x.nbytes > t->max_staged_bytes) {
            e = MOE_EBUSY;
            snprintf(err, sizeof(err), "%zu bytes of rows already wait here (cap %zu)",
                     t->staged_bytes, t->max_staged_bytes);
            goto fail;
        }
    }
    tk->x = x;
    for (dp_ticket *o = t->head; o; o = o->next)
        if (o->cid == cid && o->seq == seq) {
            e = MOE_EPRECOND;
            snprintf(err, sizeof(err), "ticket [%llu, %llu] is already here",
                     (unsigned long long)cid, (unsigned long long)seq);
            goto fail_unref;
        }
    if (t->ntickets >= t->max_tickets) {
        e = MOE_EBUSY;
        snprintf(err, sizeof(err), "%d tickets already wait here", t->ntickets);
        goto fail_unref;
    }
    if (!tk->region && !tk->bulk) /* bulk rows were counted when they arrived */
        t->staged_bytes += x.nbytes;
    t->ntickets++;
    t->rows_in_total += (uint64_t)x.shape[0];
    t->bytes_in_total += x.nbytes;
    tk->next = t->head;
    t->head = tk;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    run.rows = x.shape[0];
    run.dtype = x.dtype;
    if (sp[9].seen)
        start_run(t, tk, &run);
    return;
fail_unref: /* the regions are live (mu held since they were found) */
    if (tk->region) {
        tk->region->refs--;
        tk->yregion->refs--;
    }
    if (tk->bulk) { /* claimed: its bytes are the ticket's no more */
        t->staged_bytes -= tk->bulk->nbytes;
        bulk_finish(tk->bulk, e, err);
        bulk_unref(tk->bulk);
    }
fail:
    pthread_mutex_unlock(&t->mu);
    free(tk);
    rpc_reply_err(c, e, "%s", err);
}

void dp_ticket_discard(dp_table *t, dp_ticket *tk, moe_err e, const char *fmt, ...)
{
    char text[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    dp_answer_err(tk, e, "%s", text);
    pthread_mutex_lock(&t->mu);
    ticket_free(t, tk);
    pthread_mutex_unlock(&t->mu);
}

void dp_rows_file(dp_table *t, dp_ticket *tk, const dp_run *run_in)
{
    char err[256];
    moe_err e = MOE_OK;
    pthread_mutex_lock(&t->mu);
    for (dp_ticket *o = t->head; o && e == MOE_OK; o = o->next)
        if (o->cid == tk->cid && o->seq == tk->seq) {
            e = MOE_EPRECOND;
            snprintf(err, sizeof(err), "ticket [%llu, %llu] is already here",
                     (unsigned long long)tk->cid, (unsigned long long)tk->seq);
        }
    if (e == MOE_OK && t->ntickets >= t->max_tickets) {
        e = MOE_EBUSY;
        snprintf(err, sizeof(err), "%d tickets already wait here", t->ntickets);
    }
    if (e != MOE_OK) {
        pthread_mutex_unlock(&t->mu);
        dp_ticket_discard(t, tk, e, "%s", err);
        return;
    }
    t->ntickets++;
    t->rows_in_total += (uint64_t)tk->x.shape[0];
    t->bytes_in_total += tk->x.nbytes;
    tk->next = t->head;
    t->head = tk;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    if (!run_in)
        return;
    dp_run run = *run_in;
    run.rows = tk->x.shape[0];
    run.dtype = tk->x.dtype;
    start_run(t, tk, &run);
}

/* data.shm_attach {name, size}: map the client's segment /dev/shm/<name>. */
static void on_attach(dp_table *t, rpc_call *c)
{
    char name[256], err[256];
    int64_t size = 0;
    pspec sp[] = {
        {"name", P_STR, name, true, 0, 0, sizeof(name), false},
        {"size", P_INT, &size, true, 1, 1ll << 40, 0, false},
    };
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 2, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    /* only the client's own segments: "/moe-" then [A-Za-z0-9_.-] */
    int ok = strncmp(name, "/moe-", 5) == 0 && strlen(name) > 5;
    for (const char *p = name + 1; ok && *p; p++)
        ok = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
             *p == '_' || *p == '.' || *p == '-';
    if (!ok) {
        rpc_reply_err(c, MOE_EINVAL, "segment name must be /moe-[A-Za-z0-9_.-]+");
        return;
    }
    uint32_t pipe = rpc_call_pipe(c);
    pthread_mutex_lock(&t->mu);
    if (t->fail_attach > 0) {
        t->fail_attach--;
        pthread_mutex_unlock(&t->mu);
        rpc_reply_err(c, MOE_EUNAVAIL, "testing: --fail-shm-attach-for-tests");
        return;
    }
    int mine = regions_on_pipe(t, pipe);
    int over =
        mine >= DP_MAX_REGIONS_PER_PIPE || t->mapped_bytes + (size_t)size > t->max_mapped_bytes;
    pthread_mutex_unlock(&t->mu);
    if (over) {
        rpc_reply_err(c, MOE_ENOMEM, "too many shared regions (%d on this connection, %zu bytes)",
                      mine, t->mapped_bytes);
        return;
    }
    int fd = shm_open(name, O_RDWR, 0);
    struct stat stt;
    if (fd < 0 || fstat(fd, &stt) != 0 || stt.st_size < size) {
        int en = errno;
        if (fd >= 0)
            close(fd);
        rpc_reply_err(c, MOE_EINVAL, "cannot use shared segment %s: %s", name,
                      fd < 0 ? strerror(en) : "smaller than the size given");
        return;
    }
    void *base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    dp_region *g = calloc(1, sizeof(*g));
    if (base == MAP_FAILED || !g) {
        if (base != MAP_FAILED)
            munmap(base, (size_t)size);
        free(g);
        rpc_reply_err(c, MOE_ENOMEM, "cannot map shared segment %s", name);
        return;
    }
    g->base = base;
    g->size = (size_t)size;
    g->pipe = pipe;
    g->registered = t->gpu_register && wkr_gpu_host_register(base, (size_t)size) == MOE_OK;
    region_add(t, g);
    LOG_D("data plane: mapped %s (%lld bytes) as region %llu on connection %u", name,
          (long long)size, (unsigned long long)g->id, pipe);
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, c->req.msgid);
    mp_write_map(&w, 2);
    mp_write_cstr(&w, "region");
    mp_write_u64(&w, g->id);
    mp_write_cstr(&w, "pinned");
    mp_write_bool(&w, g->registered != 0);
    rpc_reply(c, &w);
}

/* data.cuda_attach {handle: bin (64 bytes, cudaIpcMemHandle_t), size}: open
 * a client's GPU allocation on this worker's GPU; rows by reference in it
 * are read and written by the device, never through the host. */
static void on_cuda_attach(dp_table *t, rpc_call *c)
{
    char err[256];
    int64_t size = 0;
    mp_reader rh;
    const void *h;
    uint32_t hl;
    pspec sp[] = {
        {"handle", P_RAW, &rh, true, 0, 0, 0, false},
        {"size", P_INT, &size, true, 1, 1ll << 40, 0, false},
    };
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 2, err, sizeof(err));
    if (e == MOE_OK && mp_read_bin(&rh, &h, &hl, NULL) != MOE_OK) {
        e = MOE_EINVAL;
        snprintf(err, sizeof(err), "handle must be a bin (cudaIpcMemHandle_t)");
    }
    if (e == MOE_OK && t->gpu_device < 0) {
        e = MOE_EINVAL;
        snprintf(err, sizeof(err), "this worker has no GPU: no CUDA IPC");
    }
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    uint32_t pipe = rpc_call_pipe(c);
    pthread_mutex_lock(&t->mu);
    int mine = regions_on_pipe(t, pipe);
    pthread_mutex_unlock(&t->mu);
    if (mine >= DP_MAX_REGIONS_PER_PIPE) {
        rpc_reply_err(c, MOE_ENOMEM, "too many regions on this connection (%d)", mine);
        return;
    }
    void *dptr = NULL;
    if (wkr_gpu_ipc_open(t->gpu_device, h, hl, &dptr, err, sizeof(err)) != MOE_OK) {
        rpc_reply_err(c, MOE_EINVAL, "cannot open the client's GPU buffer: %s", err);
        return;
    }
    dp_region *g = calloc(1, sizeof(*g));
    if (!g) {
        wkr_gpu_ipc_close(t->gpu_device, dptr);
        rpc_reply_err(c, MOE_ENOMEM, "out of memory");
        return;
    }
    g->base = dptr;
    g->size = (size_t)size; /* the client's word: its allocation must be this large */
    g->pipe = pipe;
    g->cuda = 1;
    g->device = t->gpu_device;
    region_add(t, g);
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, c->req.msgid);
    mp_write_map(&w, 2);
    mp_write_cstr(&w, "region");
    mp_write_u64(&w, g->id);
    mp_write_cstr(&w, "device");
    mp_write_bool(&w, true);
    rpc_reply(c, &w);
}

static void reply_empty(rpc_call *c)
{
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, c->req.msgid);
    mp_write_map(&w, 0);
    rpc_reply(c, &w);
}

/* data.shm_detach {region} */
static void on_detach(dp_table *t, rpc_call *c)
{
    char err[256];
    int64_t id = 0;
    pspec sp[] = {{"region", P_INT, &id, true, 1, 9e18, 0, false}};
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 1, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(c, e, "%s", err);
        return;
    }
    pthread_mutex_lock(&t->mu);
    dp_region *g = region_find(t, rpc_call_pipe(c), (uint64_t)id);
    if (g)
        region_drop(t, g);
    pthread_mutex_unlock(&t->mu);
    if (!g) {
        rpc_reply_err(c, MOE_ENOTFOUND, "region %lld is not attached on this connection",
                      (long long)id);
        return;
    }
    reply_empty(c);
}

/* data.cancel {ticket}: answer a waiting ticket (cancelled) if not taken */
static void on_cancel(dp_table *t, rpc_call *c)
{
    char err[256];
    mp_reader rt;
    uint64_t cid, seq;
    pspec sp[] = {{"ticket", P_RAW, &rt, true, 0, 0, 0, false}};
    mp_reader r = c->req.params;
    moe_err e = params_parse(&r, c->req.nparams, sp, 1, err, sizeof(err));
    if (e != MOE_OK || !read_pair(&rt, &cid, &seq)) {
        rpc_reply_err(c, MOE_EINVAL, "%s", e != MOE_OK ? err : "ticket must be [client_id, seq]");
        return;
    }
    dp_ticket *found = NULL;
    int taken = 0;
    pthread_mutex_lock(&t->mu);
    for (dp_ticket *tk = t->head; tk; tk = tk->next)
        if (tk->cid == cid && tk->seq == seq) {
            taken = tk->taken;
            if (!taken) {
                found = tk;
                unlink_ticket(t, tk);
            }
            break;
        }
    pthread_mutex_unlock(&t->mu);
    if (found) {
        dp_answer_err(found, MOE_ECLOSED, "ticket cancelled by the client");
        pthread_mutex_lock(&t->mu);
        ticket_free(t, found);
        pthread_mutex_unlock(&t->mu);
    }
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, c->req.msgid);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "cancelled");
    mp_write_bool(&w, found != NULL);
    rpc_reply(c, &w);
}

void dp_get_counters(dp_table *t, dp_counters *o)
{
    memset(o, 0, sizeof(*o));
    pthread_mutex_lock(&t->mu);
    for (dp_region *g = t->regions; g; g = g->next)
        o->regions++;
    o->tickets = t->ntickets;
    o->staged_bytes = t->staged_bytes;
    o->mapped_bytes = t->mapped_bytes;
    o->rows_in_total = t->rows_in_total;
    o->bytes_in_total = t->bytes_in_total;
    o->tickets_expired_total = t->tickets_expired_total;
    o->bulk_conns = t->bulk_conns;
    o->bulk_parked = t->bulk_parked;
    o->bulk_in_total = t->bulk_in_total;
    o->rings = t->nrings;
    pthread_mutex_unlock(&t->mu);
}

/* ping: what the data plane holds now (operators and tests read it) */
static void on_ping(dp_table *t, rpc_call *c)
{
    dp_counters k;
    dp_get_counters(t, &k);
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, c->req.msgid);
    mp_write_map(&w, 11);
    mp_write_cstr(&w, "role");
    mp_write_cstr(&w, "worker-data");
    mp_write_cstr(&w, "rings");
    mp_write_i64(&w, k.rings);
    mp_write_cstr(&w, "tickets");
    mp_write_i64(&w, k.tickets);
    mp_write_cstr(&w, "regions");
    mp_write_i64(&w, k.regions);
    mp_write_cstr(&w, "staged_bytes");
    mp_write_u64(&w, k.staged_bytes);
    mp_write_cstr(&w, "mapped_bytes");
    mp_write_u64(&w, k.mapped_bytes);
    mp_write_cstr(&w, "tickets_expired_total");
    mp_write_u64(&w, k.tickets_expired_total);
    mp_write_cstr(&w, "rows_in_total");
    mp_write_u64(&w, k.rows_in_total);
    mp_write_cstr(&w, "bulk_conns");
    mp_write_i64(&w, k.bulk_conns);
    mp_write_cstr(&w, "bulk_parked");
    mp_write_i64(&w, k.bulk_parked);
    mp_write_cstr(&w, "bulk_in_total");
    mp_write_u64(&w, k.bulk_in_total);
    rpc_reply(c, &w);
}

/* the data-plane endpoint's methods (clients call them; docs/PROTOCOL.md
 * "Data plane" lists them, checked by tests/unit/test_methods.c) */
const dp_method dp_methods[] = {
    {{"ping", RPC_NO_PARAMS}, on_ping},   {{"data.rows", 0}, dp_rows_call},
    {{"data.cancel", 0}, on_cancel},      {{"data.shm_attach", 0}, on_attach},
    {{"data.shm_detach", 0}, on_detach},  {{"data.cuda_attach", 0}, on_cuda_attach},
    {{"data.cuda_detach", 0}, on_detach}, {{"data.ring_attach", 0}, dp_on_ring_attach},
    {{"data.nccl_open", 0}, wnc_on_open}, {{"data.nccl_close", 0}, wnc_on_close},
    {{"data.nccl_echo", 0}, wnc_on_echo},
};
const int dp_nmethods = (int)(sizeof(dp_methods) / sizeof(dp_methods[0]));

void dp_on_request(dp_table *t, rpc_call *c)
{
    const moe_rpc_request *q = &c->req;
    if (!auth_ok(t, c)) {
        rpc_reply_err(c, MOE_EUNAUTH, "missing or wrong auth token");
        return;
    }
    const dp_method *m =
        rpc_method_find(dp_methods, dp_nmethods, sizeof(*m), q->method, q->method_len);
    char err[256];
    moe_err e;
    if (!m)
        rpc_reply_err(c, MOE_ENOMETHOD, "unknown data-plane method '%.*s'",
                      (int)(q->method_len > 64 ? 64 : q->method_len), q->method);
    else if ((e = rpc_method_check_params(&m->m, q, err, sizeof(err))) != MOE_OK)
        rpc_reply_err(c, e, "%s", err);
    else
        m->fn(t, c);
}

/* ---- connection close and expiry (loop thread) ---- */

void dp_on_pipe_closed(uint32_t pipe, void *arg)
{
    dp_table *t = arg;
    pthread_mutex_lock(&t->mu);
    if (t->nclosed < (int)(sizeof(t->closed) / sizeof(t->closed[0])))
        t->closed[t->nclosed++] = pipe;
    else
        t->closed_overflow = 1;
    pthread_mutex_unlock(&t->mu);
    uv_async_send(&t->closed_async);
}

/* drop_pipe answers the waiting tickets of a closed connection and drops its
 * regions (mu held; the answers go nowhere, but release the calls). */
static void drop_pipe(dp_table *t, uint32_t pipe, int all)
{
    dp_ticket **pp = &t->head;
    while (*pp) {
        dp_ticket *tk = *pp;
        if (!tk->taken && (all || tk->pipe == pipe)) {
            unlink_ticket(t, tk);
            rpc_reply_err(tk->call, MOE_ECLOSED, "connection closed");
            ticket_free(t, tk);
            continue;
        }
        pp = &tk->next;
    }
    dp_region *g = t->regions;
    while (g) {
        dp_region *next = g->next;
        if (all || g->pipe == pipe)
            region_drop(t, g);
        g = next;
    }
    wnc_pipe_closed_locked(t, pipe, all); /* their threads abort them */
}

static void on_closed_async(uv_async_t *h)
{
    dp_table *t = h->data;
    pthread_mutex_lock(&t->mu);
    if (t->closed_overflow) {
        /* too many at once to name: keep what live connections hold */
        LOG_W("data plane: many connections closed at once; dropping their regions by probe");
        t->closed_overflow = 0;
    }
    for (int i = 0; i < t->nclosed; i++)
        drop_pipe(t, t->closed[i], 0);
    t->nclosed = 0;
    pthread_mutex_unlock(&t->mu);
}

static void on_expire(uv_timer_t *h)
{
    dp_table *t = h->data;
    uint64_t now = rpc_now_ns();
    pthread_mutex_lock(&t->mu);
    dp_ticket **pp = &t->head;
    while (*pp) {
        dp_ticket *tk = *pp;
        if (!tk->taken && now > tk->deadline_ns) {
            unlink_ticket(t, tk);
            t->tickets_expired_total++;
            rpc_reply_err(tk->call, MOE_ETIMEDOUT,
                          "rows of ticket [%llu, %llu] were not asked for before their deadline",
                          (unsigned long long)tk->cid, (unsigned long long)tk->seq);
            ticket_free(t, tk);
            continue;
        }
        pp = &tk->next;
    }
    pthread_mutex_unlock(&t->mu);
}

moe_err dp_open(dp_table *t, uv_loop_t *loop, size_t max_staged_bytes, size_t max_mapped_bytes,
                const char *auth_token)
{
    memset(t, 0, sizeof(*t));
    pthread_mutex_init(&t->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->cv, &ca);
    pthread_condattr_destroy(&ca);
    t->max_tickets = 4096;
    t->max_staged_bytes = max_staged_bytes;
    t->max_mapped_bytes = max_mapped_bytes;
    t->auth_token = auth_token;
    t->gpu_device = -1;
    uv_async_init(loop, &t->closed_async, on_closed_async);
    t->closed_async.data = t;
    uv_timer_init(loop, &t->expire_timer);
    t->expire_timer.data = t;
    uv_timer_start(&t->expire_timer, on_expire, 100, 100);
    return MOE_OK;
}

void dp_stop(dp_table *t)
{
    pthread_mutex_lock(&t->mu);
    t->stopping = 1;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

void dp_close(dp_table *t)
{
    pthread_mutex_lock(&t->mu);
    drop_pipe(t, 0, 1);
    pthread_mutex_unlock(&t->mu);
    dp_rings_wait(t, 5000); /* their threads answer and give their regions back */
    wnc_wait_all(t, 5000);  /* the NCCL communicators' threads abort and end */
    uv_timer_stop(&t->expire_timer);
    uv_close((uv_handle_t *)&t->expire_timer, NULL);
    uv_close((uv_handle_t *)&t->closed_async, NULL);
}

/* ---- the compute thread's side ---- */

dp_ticket *dp_take(dp_table *t, uint64_t cid, uint64_t seq, uint64_t deadline_ns)
{
    struct timespec ts = {(time_t)(deadline_ns / 1000000000ull),
                          (long)(deadline_ns % 1000000000ull)};
    pthread_mutex_lock(&t->mu);
    for (;;) {
        for (dp_ticket *tk = t->head; tk; tk = tk->next)
            if (tk->cid == cid && tk->seq == seq && !tk->taken) {
                tk->taken = 1;
                pthread_mutex_unlock(&t->mu);
                return tk;
            }
        if (t->stopping || rpc_now_ns() >= deadline_ns ||
            pthread_cond_timedwait(&t->cv, &t->mu, &ts) == ETIMEDOUT) {
            /* one last look: it may have come with the timeout */
            for (dp_ticket *tk = t->head; tk; tk = tk->next)
                if (tk->cid == cid && tk->seq == seq && !tk->taken) {
                    tk->taken = 1;
                    pthread_mutex_unlock(&t->mu);
                    return tk;
                }
            pthread_mutex_unlock(&t->mu);
            return NULL;
        }
    }
}

/* gather_pieces_in: x of tk, taken, arriving over NCCL in pieces, is whole
 * (waited for here) unless the caller computes it piece by piece; 0 when
 * it never came (tk answered with the reason) */
static int gather_pieces_in(dp_ticket *tk, int piecewise)
{
    char why[300];
    if (tk->nccl_pieces <= 1 || piecewise)
        return 1;
    moe_err e = wnc_x_piece_wait(tk, tk->nccl_pieces - 1, why, sizeof(why));
    if (e == MOE_OK)
        return 1;
    dp_answer_err(tk, e, "%s", why);
    return 0;
}

moe_err dp_batch_gather(dp_table *t, mp_reader *r, moe_dtype dt, int64_t H, uint64_t deadline_ns,
                        int flags, dp_batch *b, char *err, size_t errlen)
{
    const int device_ok = (flags & DP_GATHER_DEVICE) != 0;
    uint32_t n;
    memset(b, 0, sizeof(*b));
    if (mp_read_array(r, &n, NULL) != MOE_OK || n == 0 || n > 65536) {
        snprintf(err, errlen, "pieces must be a non-empty array");
        return MOE_EINVAL;
    }
    b->n = (int)n;
    b->tk = calloc(n, sizeof(dp_ticket *));
    b->rows = calloc(n, sizeof(int64_t));
    b->refused_row = malloc(n * sizeof(int64_t));
    for (uint32_t i = 0; b->refused_row && i < n; i++)
        b->refused_row[i] = -1;
    uint64_t *cid = calloc(n, sizeof(uint64_t)), *seq = calloc(n, sizeof(uint64_t));
    moe_err e = MOE_OK;
    if (!b->tk || !b->rows || !b->refused_row || !cid || !seq) {
        e = MOE_ENOMEM;
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k;
        if (mp_read_array(r, &k, NULL) != MOE_OK || k != 3 ||
            mp_read_u64(r, &cid[i], NULL) != MOE_OK || mp_read_u64(r, &seq[i], NULL) != MOE_OK ||
            mp_read_i64(r, &b->rows[i], NULL) != MOE_OK || b->rows[i] < 0 ||
            b->rows[i] > (1ll << 31)) {
            snprintf(err, errlen, "piece %u must be [client_id, seq, rows]", i);
            e = MOE_EINVAL;
            goto out;
        }
    }
    int64_t T = 0;
    size_t es = moe_dtype_size(dt);
    for (uint32_t i = 0; i < n; i++) {
        if (b->rows[i] == 0)
            continue; /* the client sends nothing for an empty piece */
        dp_ticket *tk = dp_take(t, cid[i], seq[i], deadline_ns);
        if (tk && (tk->x.ndim != 2 || tk->x.shape[0] != b->rows[i] || tk->x.shape[1] != H ||
                   tk->x.dtype != dt)) {
            dp_answer_err(tk, MOE_EINVAL,
                          "rows must be (%lld, %lld) of %s for this job (d_model %lld)",
                          (long long)b->rows[i], (long long)H, moe_dtype_name(dt), (long long)H);
            dp_release(t, tk);
            tk = NULL;
        }
        /* piece by piece: the batch's only ticket, left on the device */
        const int piecewise =
            tk && n == 1 && device_ok && (flags & DP_GATHER_PIECES) && dp_x_on_device(tk);
        if (tk && !gather_pieces_in(tk, piecewise)) {
            dp_release(t, tk);
            tk = NULL;
        }
        if (!tk) {
            LOG_W("data plane: rows of ticket [%llu, %llu] did not arrive",
                  (unsigned long long)cid[i], (unsigned long long)seq[i]);
            b->missing++;
            continue;
        }
        if (piecewise && tk->nccl_pieces > 1)
            b->x_pieces = tk->nccl_pieces;
        b->tk[i] = tk;
        T += b->rows[i];
    }
    b->x.dtype = dt;
    b->x.ndim = 2;
    b->x.shape[0] = T;
    b->x.shape[1] = H;
    b->x.nbytes = (size_t)T * (size_t)H * es;
    int held = 0, only = -1;
    for (int i = 0; i < b->n; i++)
        if (b->tk[i]) {
            held++;
            only = i;
        }
    if (held == 1 && (!dp_x_on_device(b->tk[only]) || device_ok)) {
        b->x.data = b->tk[only]->x.data; /* zero copy */
        b->x_device = dp_x_on_device(b->tk[only]);
    } else if (held >= 1) {
        if (!(b->xbuf = malloc(b->x.nbytes ? b->x.nbytes : 1))) {
            e = MOE_ENOMEM;
            goto out;
        }
        size_t off = 0;
        for (int i = 0; i < b->n; i++)
            if (b->tk[i]) {
                if (dp_x_on_device(b->tk[i])) { /* rows on the client's GPU: to the host */
                    if (wkr_gpu_copy(b->xbuf + off, b->tk[i]->x.data, b->tk[i]->x.nbytes) !=
                        MOE_OK) {
                        snprintf(err, errlen, "copying rows from a client's GPU buffer failed");
                        e = MOE_EINTERNAL;
                        goto out;
                    }
                } else {
                    memcpy(b->xbuf + off, b->tk[i]->x.data, b->tk[i]->x.nbytes);
                }
                off += b->tk[i]->x.nbytes;
            }
        b->x.data = b->xbuf;
    } else {
        b->x.data = NULL;
    }
out:
    free(cid);
    free(seq);
    return e;
}

int dp_batch_refuse_nonfinite(dp_batch *b, float *x, int64_t H)
{
    size_t row = 0;
    int refused = 0;
    for (int i = 0; i < b->n; i++) {
        if (!b->tk[i])
            continue;
        float *p = x + row * (size_t)H;
        if (b->refused_row[i] < 0) {
            int64_t r = rows_first_nonfinite(p, b->rows[i], H);
            if (r < b->rows[i])
                b->refused_row[i] = r;
        }
        if (b->refused_row[i] >= 0) {
            dp_answer_err(b->tk[i], MOE_EINVAL,
                          "row %lld of these rows is not finite (NaN or Inf): refused",
                          (long long)b->refused_row[i]);
            memset(p, 0, (size_t)b->rows[i] * (size_t)H * sizeof(float));
            refused++;
        }
        row += (size_t)b->rows[i];
    }
    return refused;
}

void dp_batch_write_refused(mp_writer *w, const dp_batch *b)
{
    int n = 0;
    for (int i = 0; i < b->n; i++)
        n += b->refused_row && b->refused_row[i] >= 0;
    mp_write_array(w, (uint32_t)n);
    for (int i = 0; i < b->n; i++)
        if (b->refused_row && b->refused_row[i] >= 0) {
            mp_write_array(w, 2);
            mp_write_i64(w, i);
            mp_write_i64(w, b->refused_row[i]);
        }
}

void dp_batch_answer_f32(dp_batch *b, const float *y, int64_t H)
{
    size_t row = 0;
    for (int i = 0; i < b->n; i++)
        if (b->tk[i]) {
            if (b->tk[i]->call) /* not refused */
                dp_answer_f32(b->tk[i], y + row * (size_t)H, b->rows[i], H);
            row += (size_t)b->rows[i];
        }
}

void dp_batch_answer_raw(dp_batch *b, const void *y, int64_t H)
{
    size_t row = 0, es = moe_dtype_size(b->x.dtype);
    for (int i = 0; i < b->n; i++)
        if (b->tk[i]) {
            if (b->tk[i]->call)
                dp_answer_raw(b->tk[i], (const uint8_t *)y + row * (size_t)H * es, b->rows[i], H);
            row += (size_t)b->rows[i];
        }
}

void dp_batch_fail(dp_batch *b, moe_err e, const char *msg)
{
    for (int i = 0; i < b->n; i++)
        if (b->tk[i])
            dp_answer_err(b->tk[i], e, "%s", msg);
}

void dp_batch_write_missing(mp_writer *w, const dp_batch *b)
{
    int n = 0;
    for (int i = 0; i < b->n; i++)
        n += !b->tk[i] && b->rows[i] > 0;
    mp_write_array(w, (uint32_t)n);
    for (int i = 0; i < b->n; i++)
        if (!b->tk[i] && b->rows[i] > 0)
            mp_write_i64(w, i);
}

void dp_batch_free(dp_table *t, dp_batch *b)
{
    for (int i = 0; b->tk && i < b->n; i++)
        if (b->tk[i])
            dp_release(t, b->tk[i]);
    free(b->tk);
    free(b->rows);
    free(b->refused_row);
    free(b->xbuf);
    memset(b, 0, sizeof(*b));
}
