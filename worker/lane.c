/*
 * lane.c - the lane: in a generation of one worker there is no collective
 * to keep in order, so a client's inference forward runs here at once, on
 * the rows of its data.rows, without the coordinator (docs/PROTOCOL.md,
 * "The lane"). The job goes through the compute thread's queue like the
 * coordinator's (one order for everything the worker runs) and through the
 * same handler, wkr_op_forward, called with a local call. What the
 * coordinator would have counted (forwards, tokens, the experts' load,
 * latency) goes to it with the next heartbeat.
 *
 * Threads: wkr_lane_enqueue runs on the loop thread (the data plane's
 * hook); wkr_lane_run and the local call's answer on the compute thread;
 * wkr_lane_write_report on the loop thread. The accumulated reports are
 * under lane_mu.
 */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/routing_stats.h"
#include "worker/lane_trace.h"
#include "worker/worker.h"

moe_err wkr_lane_enqueue(void *arg, const dp_run *r, char *err, size_t errlen)
{
    wkr *w = arg;
    wkr_queue_item *it = calloc(1, sizeof(*it));
    if (!it) {
        snprintf(err, errlen, "worker out of memory");
        return MOE_ENOMEM;
    }
    it->run = *r;
    it->is_run = 1;
    /* stamped before the compute thread can see it (the queue's mutex
     * orders this stamp before the compute thread's) */
    lane_trace(LT_QUEUED);
    pthread_mutex_lock(&w->qmu);
    if (w->qtail)
        w->qtail->next = it;
    else
        w->qhead = it;
    w->qtail = it;
    pthread_cond_signal(&w->qcv);
    pthread_mutex_unlock(&w->qmu);
    atomic_fetch_add(&w->qposted, 1); /* for a compute thread that spins (compute.c) */
    return MOE_OK;
}

/* lane_slot finds (or makes) the report entry of model/layer (lane_mu held);
 * NULL when the table is full or out of memory. */
static wkr_lane_report *lane_slot(wkr *w, const char *model, int layer, int E)
{
    for (int i = 0; i < w->nlane; i++)
        if (w->lane[i].layer == layer && w->lane[i].E == E && !strcmp(w->lane[i].model, model))
            return &w->lane[i];
    if (w->nlane >= WKR_LANE_REPORTS)
        return NULL;
    wkr_lane_report *r = &w->lane[w->nlane];
    memset(r, 0, sizeof(*r));
    r->counts = calloc((size_t)E, sizeof(int64_t));
    r->dropped = calloc((size_t)E, sizeof(int64_t));
    if (!r->counts || !r->dropped) {
        free(r->counts);
        free(r->dropped);
        return NULL;
    }
    snprintf(r->model, sizeof(r->model), "%s", model);
    r->layer = layer;
    r->E = E;
    w->nlane++;
    return r;
}

typedef struct lane_ctx {
    wkr *w;
    dp_run run;
} lane_ctx;

/* lane_done: the answer of the local worker.forward call (the client's
 * rows were answered by the handler itself): count what the coordinator
 * would have counted. */
static void lane_done(rpc_call *call, const void *buf, size_t len, void *arg)
{
    lane_ctx *cx = arg;
    wkr *w = cx->w;
    moe_rpc_response resp;
    mp_errbuf eb;
    (void)call;
    int ok = moe_rpc_parse_response(buf, len, &resp, &eb) == MOE_OK;
    if (!ok || resp.err != MOE_OK) {
        /* refused before the rows were taken (an unknown model or layer, a
         * shape that does not fit): the rows get the same answer */
        dp_ticket *tk = dp_take(&w->dp, cx->run.cid, cx->run.seq, rpc_now_ns());
        if (tk) {
            dp_answer_err(tk, ok ? resp.err : MOE_EINTERNAL, "%.*s", ok ? (int)resp.errmsg_len : 0,
                          ok ? resp.errmsg : "");
            dp_release(&w->dp, tk);
        }
    } else {
        const void *cnt = NULL, *drop = NULL;
        uint32_t clen = 0, dlen = 0, n;
        double phase[4] = {0, 0, 0, 0};
        static const char *pn[4] = {"gate_s", "dispatch_s", "experts_s", "combine_s"};
        mp_reader r = resp.result;
        if (mp_read_map(&r, &n, NULL) == MOE_OK)
            for (uint32_t i = 0; i < n; i++) {
                const char *k;
                uint32_t kl;
                int done = 0;
                if (mp_read_str(&r, &k, &kl, NULL) != MOE_OK)
                    break;
                if (mp_str_eq(k, kl, "counts"))
                    done = mp_read_bin(&r, &cnt, &clen, NULL) == MOE_OK;
                else if (mp_str_eq(k, kl, "dropped"))
                    done = mp_read_bin(&r, &drop, &dlen, NULL) == MOE_OK;
                for (int p = 0; p < 4 && !done; p++)
                    if (mp_str_eq(k, kl, pn[p]))
                        done = mp_read_f64(&r, &phase[p], NULL) == MOE_OK;
                if (!done && mp_skip(&r, NULL) != MOE_OK)
                    break;
            }
        int E = (int)(clen / 4);
        double lat = (double)(rpc_now_ns() - cx->run.recv_ns) * 1e-9;
        /* a fan-out forward ran on every member, each with all the tokens:
         * rank 0 counts the forward, its tokens and routing; every rank
         * the slots its own experts dropped */
        const int primary = !cx->run.fanout || w->rank == 0;
        pthread_mutex_lock(&w->lane_mu);
        wkr_lane_report *rep =
            cnt && dlen == clen ? lane_slot(w, cx->run.model, (int)cx->run.layer, E) : NULL;
        if (rep) {
            rep->forwards += (uint64_t)primary;
            rep->tokens += primary ? (uint64_t)cx->run.rows : 0;
            for (int e = 0; e < E; e++) {
                int32_t cv, dv;
                memcpy(&cv, (const uint8_t *)cnt + 4 * (size_t)e, 4);
                memcpy(&dv, (const uint8_t *)drop + 4 * (size_t)e, 4);
                rep->counts[e] += primary ? cv : 0;
                rep->dropped[e] += dv;
            }
            for (int p = 0; p < 4 && primary; p++)
                rep->phase_s[p] += phase[p];
            if (primary && rep->nlat < WKR_LANE_LAT) {
                for (int p = 0; p < 4; p++)
                    rep->phase_v[rep->nlat][p] = (float)phase[p];
                rep->lat_s[rep->nlat++] = (float)lat;
            }
        }
        pthread_mutex_unlock(&w->lane_mu);
    }
    free(cx);
}

void wkr_lane_run(wkr *w, const dp_run *r)
{
    /* the lane is open only inside the generation the client's map names,
     * and only while it has one worker - or, fanned out, several */
    int open = r->fanout ? w->world > 1 : w->world == 1;
    if (!open || !w->xc || w->generation != r->generation) {
        dp_ticket *tk = dp_take(&w->dp, r->cid, r->seq, rpc_now_ns());
        if (tk) {
            dp_answer_err(tk, MOE_EUNAVAIL,
                          "the lane is closed: the cluster is at generation %llu with %d workers "
                          "(the request named generation %llu); ask dataplane.info again",
                          (unsigned long long)w->generation, w->world,
                          (unsigned long long)r->generation);
            dp_release(&w->dp, tk);
        }
        return;
    }
    mp_writer p;
    mp_writer_init(&p);
    mp_write_map(&p, r->fanout ? 10 : 9);
    if (r->fanout) {
        mp_write_cstr(&p, "fanout");
        mp_write_bool(&p, true);
    }
    mp_write_cstr(&p, "handle");
    mp_write_u64(&p, 0);
    mp_write_cstr(&p, "model");
    mp_write_cstr(&p, r->model);
    mp_write_cstr(&p, "layer");
    mp_write_i64(&p, r->layer);
    mp_write_cstr(&p, "T_total");
    mp_write_i64(&p, r->rows);
    mp_write_cstr(&p, "row0");
    mp_write_i64(&p, 0);
    mp_write_cstr(&p, "train");
    mp_write_bool(&p, false);
    mp_write_cstr(&p, "dtype");
    mp_write_cstr(&p, moe_dtype_name(r->dtype));
    mp_write_cstr(&p, "pieces");
    mp_write_array(&p, 1);
    mp_write_array(&p, 3);
    mp_write_u64(&p, r->cid);
    mp_write_u64(&p, r->seq);
    mp_write_i64(&p, r->rows);
    mp_write_cstr(&p, "lane");
    mp_write_bool(&p, true);
    lane_ctx *cx = malloc(sizeof(*cx));
    rpc_call *c =
        cx && !p.failed ? rpc_call_local("worker.forward", p.buf, p.len, lane_done, cx) : NULL;
    mp_writer_fini(&p);
    if (!c) {
        free(cx);
        dp_ticket *tk = dp_take(&w->dp, r->cid, r->seq, rpc_now_ns());
        if (tk) {
            dp_answer_err(tk, MOE_ENOMEM, "worker out of memory");
            dp_release(&w->dp, tk);
        }
        return;
    }
    cx->w = w;
    cx->run = *r;
    wkr_op_forward(w, c);
}

void wkr_lane_stats_write(mp_writer *wr, const model_cfg *cfg, int64_t T, const int32_t *counts,
                          const int32_t *dropped, const double *probs_sum, double z_sum,
                          const double *aux_device, const double phase[4])
{
    const int E = cfg->n_experts;
    int64_t *c64 = malloc((size_t)(E ? E : 1) * sizeof(int64_t)); /* (E) */
    double aux = 0, imbalance = 0;
    if (c64) {
        for (int e = 0; e < E; e++)
            c64[e] = counts[e];
        routing_stats(c64, probs_sum, E, cfg->top_k, T, &aux, &imbalance);
        free(c64);
    }
    if (aux_device)
        aux = *aux_device;
    mp_write_cstr(wr, "stats");
    mp_write_map(wr, 10);
    mp_write_cstr(wr, "tokens_per_expert");
    mp_write_array(wr, (uint32_t)E);
    for (int e = 0; e < E; e++)
        mp_write_i64(wr, counts[e]);
    mp_write_cstr(wr, "dropped");
    mp_write_array(wr, (uint32_t)E);
    for (int e = 0; e < E; e++)
        mp_write_i64(wr, dropped[e]);
    mp_write_cstr(wr, "imbalance");
    mp_write_f64(wr, imbalance);
    mp_write_cstr(wr, "aux_loss");
    mp_write_f64(wr, aux);
    mp_write_cstr(wr, "z_loss");
    mp_write_f64(wr, T > 0 ? z_sum / (double)T : 0);
    static const char *pn[4] = {"gate_s", "dispatch_s", "experts_s", "combine_s"};
    for (int k = 0; k < 4; k++) {
        mp_write_cstr(wr, pn[k]);
        mp_write_f64(wr, phase[k]);
    }
    mp_write_cstr(wr, "batch_requests");
    mp_write_i64(wr, 1);
}

int wkr_lane_write_report(wkr *w, mp_writer *pw)
{
    pthread_mutex_lock(&w->lane_mu);
    int n = w->nlane;
    if (n) {
        mp_write_cstr(pw, "lane");
        mp_write_array(pw, (uint32_t)n);
    }
    for (int i = 0; i < n; i++) {
        wkr_lane_report *r = &w->lane[i];
        mp_write_map(pw, 9);
        mp_write_cstr(pw, "model");
        mp_write_cstr(pw, r->model);
        mp_write_cstr(pw, "layer");
        mp_write_i64(pw, r->layer);
        mp_write_cstr(pw, "forwards");
        mp_write_u64(pw, r->forwards);
        mp_write_cstr(pw, "tokens");
        mp_write_u64(pw, r->tokens);
        mp_write_cstr(pw, "counts");
        mp_write_array(pw, (uint32_t)r->E);
        for (int e = 0; e < r->E; e++)
            mp_write_i64(pw, r->counts[e]);
        mp_write_cstr(pw, "dropped");
        mp_write_array(pw, (uint32_t)r->E);
        for (int e = 0; e < r->E; e++)
            mp_write_i64(pw, r->dropped[e]);
        mp_write_cstr(pw, "phase_s");
        mp_write_array(pw, 4);
        for (int k = 0; k < 4; k++)
            mp_write_f64(pw, r->phase_s[k]);
        mp_write_cstr(pw, "latency_s");
        mp_write_array(pw, (uint32_t)r->nlat);
        for (int k = 0; k < r->nlat; k++)
            mp_write_f64(pw, r->lat_s[k]);
        mp_write_cstr(pw, "phases_s"); /* (nlat, 4): for the phase histograms */
        mp_write_array(pw, (uint32_t)r->nlat);
        for (int k = 0; k < r->nlat; k++) {
            mp_write_array(pw, 4);
            for (int p = 0; p < 4; p++)
                mp_write_f64(pw, r->phase_v[k][p]);
        }
        free(r->counts);
        free(r->dropped);
    }
    w->nlane = 0;
    pthread_mutex_unlock(&w->lane_mu);
    return n > 0;
}
