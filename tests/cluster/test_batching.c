/*
 * test_batching.c - concurrent inference forwards of one layer are merged
 * into one cluster job by the coordinator; each request still gets exactly
 * its own rows of y (equal to the reference on its own x), and replies
 * report how many requests shared the job.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

#define NREQ 24

typedef struct slot {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    moe_err err[NREQ];
    moe_reply *rep[NREQ];
} slot;

typedef struct req_arg {
    slot *s;
    int i;
} req_arg;

static void on_reply(moe_err e, moe_reply *r, void *arg)
{
    req_arg *a = arg;
    pthread_mutex_lock(&a->s->mu);
    a->s->err[a->i] = e;
    a->s->rep[a->i] = r;
    a->s->done++;
    pthread_cond_signal(&a->s->cv);
    pthread_mutex_unlock(&a->s->mu);
}

Test(batching, merged_requests_get_their_own_rows, .timeout = 60, .fini = cluster_fini_all)
{
    const int H = 32, F = 48, E = 8, K = 2;
    cluster_opts o = {0};
    o.workers = 2;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    moe_model_config cfg = {"b", 1, H, F, E, K, "swiglu", 0, 0, MOE_F32, 4, 0, 0};
    cr_assert_eq(moe_model_create(cl->cli, &cfg), MOE_OK, "%s", moe_last_error());
    /* reference weights */
    size_t fh = (size_t)F * H;
    float *wr = malloc((size_t)E * H * 4), *w1 = malloc(E * fh * 4), *w3 = malloc(E * fh * 4),
          *w2 = malloc(E * fh * 4);
    kern_init_weight(4, 0, 0, KERN_W_ROUTER, E, H, wr);
    for (int e = 0; e < E; e++) {
        kern_init_weight(4, 0, e, KERN_W1, F, H, w1 + e * fh);
        kern_init_weight(4, 0, e, KERN_W3, F, H, w3 + e * fh);
        kern_init_weight(4, 0, e, KERN_W2, H, F, w2 + e * fh);
    }
    kern_layer_weights lw = {.wr = wr, .w1 = w1, .w3 = w3, .w2 = w2};
    slot s;
    memset(&s, 0, sizeof(s));
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.cv, NULL);
    req_arg args[NREQ];
    float *xs[NREQ];
    int T[NREQ];
    for (int i = 0; i < NREQ; i++) {
        T[i] = 1 + i % 5;
        xs[i] = malloc((size_t)T[i] * H * 4);
        rng_fill_uniform(50 + (uint64_t)i, 1, -1, 1, xs[i], (size_t)T[i] * H);
        mp_writer w;
        mp_writer_init(&w);
        mp_write_map(&w, 3);
        mp_write_cstr(&w, "model");
        mp_write_cstr(&w, "b");
        mp_write_cstr(&w, "layer");
        mp_write_i64(&w, 0);
        mp_write_cstr(&w, "x");
        moe_tensor t = {MOE_F32, 2, {T[i], H, 0, 0}, xs[i], (size_t)T[i] * H * 4};
        moe_tensor_write(&w, &t);
        args[i] = (req_arg){&s, i};
        cr_assert_eq(moe_call_async(cl->cli, "forward", w.buf, w.len, on_reply, &args[i]), MOE_OK);
        mp_writer_fini(&w);
    }
    pthread_mutex_lock(&s.mu);
    while (s.done < NREQ)
        pthread_cond_wait(&s.cv, &s.mu);
    pthread_mutex_unlock(&s.mu);
    int max_batch = 0;
    for (int i = 0; i < NREQ; i++) {
        cr_assert_eq(s.err[i], MOE_OK, "request %d: %s", i, s.rep[i] ? s.rep[i]->message : "");
        mp_reader r = mp_reply_reader(s.rep[i]), r2 = r;
        cr_assert(mp_map_find(&r, "y") == 0);
        moe_tensor y;
        cr_assert_eq(moe_tensor_read(&r, &y, NULL), MOE_OK);
        cr_assert_eq(y.shape[0], T[i], "request %d got %lld rows, sent %d", i,
                     (long long)y.shape[0], T[i]);
        float *got = malloc(y.nbytes), *want = malloc(y.nbytes);
        memcpy(got, y.data, y.nbytes);
        kern_moe_shape sh = {.T = T[i],
                             .H = H,
                             .F = F,
                             .E = E,
                             .K = K,
                             .act = KERN_ACT_SWIGLU,
                             .renorm = 0,
                             .capacity_factor = 0,
                             .bf16 = 0};
        cr_assert_eq(kern_moe_forward_ref(&sh, &lw, xs[i], want, NULL), MOE_OK);
        double d = 0, n = 0;
        for (size_t k = 0; k < (size_t)T[i] * H; k++) {
            d += ((double)got[k] - want[k]) * ((double)got[k] - want[k]);
            n += (double)want[k] * want[k];
        }
        cr_expect(sqrt(d / n) < 1e-5, "request %d: rel err %g", i, sqrt(d / n));
        cr_assert(mp_map_find(&r2, "stats") == 0 && mp_map_find(&r2, "batch_requests") == 0);
        int64_t nb = 0;
        cr_assert_eq(mp_read_i64(&r2, &nb, NULL), MOE_OK);
        max_batch = nb > max_batch ? (int)nb : max_batch;
        free(got), free(want), free(xs[i]);
        moe_reply_free(s.rep[i]);
        free(s.rep[i]);
    }
    cr_log_info("largest merged batch: %d requests", max_batch);
    cr_expect(max_batch > 1, "no requests were merged");
    free(wr), free(w1), free(w3), free(w2);
    cr_assert_eq(cluster_stop(cl), 0);
}
