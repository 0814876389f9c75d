/* par.c - the CPU phases around the GEMMs (activation, row copies, combine)
 * split over threads; see kern.h "threads". One pthread per extra part,
 * started and joined per call: a call is worth splitting only when each part
 * has at least `grain` items, which keeps the ~20 us of a thread start well
 * below the part's own time. */
#include <cblas.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "kernels/kern.h"

#define PAR_MAX_TH 64

static int par_threads_set; /* 0: follow the BLAS */

typedef struct par_part {
    kern_par_fn fn;
    void *arg;
    size_t i0, i1;
} par_part;

static void *par_main(void *p)
{
    par_part *pt = p;
    pt->fn(pt->arg, pt->i0, pt->i1);
    return NULL;
}

int kern_par_threads(void)
{
    int n = __atomic_load_n(&par_threads_set, __ATOMIC_RELAXED);
    if (n <= 0)
        n = openblas_get_num_threads();
    if (n < 1)
        n = 1;
    return n < PAR_MAX_TH ? n : PAR_MAX_TH;
}

void kern_par_set_threads(int n)
{
    __atomic_store_n(&par_threads_set, n > 0 ? n : 0, __ATOMIC_RELAXED);
}

void kern_par_for(size_t n, size_t grain, kern_par_fn fn, void *arg)
{
    if (n == 0)
        return;
    size_t k = (size_t)kern_par_threads(), g = grain ? grain : 1;
    if (k > n / g)
        k = n / g; /* each part at least grain items */
    if (k <= 1) {
        fn(arg, 0, n);
        return;
    }
    par_part part[PAR_MAX_TH];
    pthread_t th[PAR_MAX_TH];
    int started[PAR_MAX_TH];
    /* parts: [n*i/k, n*(i+1)/k), contiguous, in order */
    for (size_t i = 0; i < k; i++)
        part[i] = (par_part){fn, arg, n * i / k, n * (i + 1) / k};
    for (size_t i = 0; i + 1 < k; i++)
        started[i] = pthread_create(&th[i], NULL, par_main, &part[i]) == 0;
    par_main(&part[k - 1]); /* the caller takes the last part */
    for (size_t i = 0; i + 1 < k; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        else
            par_main(&part[i]); /* no thread: the caller does it */
    }
}

/* ---- the phases, split over kern_par_for ---- */

typedef struct act_job {
    kern_act act;
    const float *a, *b;
    int bf16;
    float *h;
} act_job;

static void act_part(void *p, size_t i0, size_t i1)
{
    const act_job *j = p;
    kern_act_forward_n(j->act, j->a + i0, j->b ? j->b + i0 : NULL, i1 - i0, j->bf16, j->h + i0);
}

void kern_act_forward_par(kern_act act, const float *a, const float *b, size_t n, int bf16,
                          float *h)
{
    /* a b h (n); elementwise, so any split gives kern_act_forward_n's bits */
    act_job j = {act, a, b, bf16, h};
    kern_par_for(n, KERN_PAR_GRAIN_ACT, act_part, &j);
}

typedef struct act_bwd_job {
    kern_act act;
    const float *a, *b, *dh;
    float *da, *db;
} act_bwd_job;

static void act_bwd_part(void *p, size_t i0, size_t i1)
{
    const act_bwd_job *j = p;
    kern_act_backward_n(j->act, j->a + i0, j->b ? j->b + i0 : NULL, j->dh + i0, i1 - i0, j->da + i0,
                        j->db ? j->db + i0 : NULL);
}

void kern_act_backward_par(kern_act act, const float *a, const float *b, const float *dh, size_t n,
                           float *da, float *db)
{
    /* a b dh da db (n), dh may alias da; elementwise, as kern_act_forward_par */
    act_bwd_job j = {act, a, b, dh, da, db};
    kern_par_for(n, KERN_PAR_GRAIN_ACT, act_bwd_part, &j);
}

typedef struct comb_job {
    const float *ye, *topk_w;
    const uint8_t *keep;
    int K, H, bf16;
    float *y;
} comb_job;

static void comb_part(void *p, size_t t0, size_t t1)
{
    const comb_job *j = p;
    size_t s0 = t0 * (size_t)j->K, h = (size_t)j->H;
    kern_combine_cpu(j->ye + s0 * h, j->topk_w + s0, j->keep ? j->keep + s0 : NULL, (int)(t1 - t0),
                     j->K, j->H, j->bf16, j->y + t0 * h);
}

void kern_combine_par(const float *ye, const float *topk_w, const uint8_t *keep, int T, int K,
                      int H, int bf16, float *y)
{
    /* ye (S,H), topk_w (T,K), keep (S) or NULL, y (T,H); tokens are
     * independent, so any split gives kern_combine_cpu's bits */
    if (T <= 0)
        return;
    comb_job j = {ye, topk_w, keep, K, H, bf16, y};
    size_t per_tok = (size_t)K * (size_t)(H > 0 ? H : 1);
    kern_par_for((size_t)T, KERN_PAR_GRAIN / per_tok + 1, comb_part, &j);
}

typedef struct comb_bwd_job {
    const float *dy, *ye, *topk_w;
    const uint8_t *keep;
    int K, H;
    float *dye, *dw;
} comb_bwd_job;

static void comb_bwd_part(void *p, size_t t0, size_t t1)
{
    const comb_bwd_job *j = p;
    size_t s0 = t0 * (size_t)j->K, h = (size_t)j->H;
    kern_combine_backward_cpu(j->dy + t0 * h, j->ye + s0 * h, j->topk_w + s0,
                              j->keep ? j->keep + s0 : NULL, (int)(t1 - t0), j->K, j->H,
                              j->dye + s0 * h, j->dw + s0);
}

void kern_combine_backward_par(const float *dy, const float *ye_unweighted, const float *topk_w,
                               const uint8_t *keep, int T, int K, int H, float *dye, float *dw)
{
    /* dy (T,H), ye_unweighted (S,H), topk_w (T,K), keep (S) or NULL; dye
     * (S,H) out, dw (T,K) out; per token, as kern_combine_par */
    if (T <= 0)
        return;
    comb_bwd_job j = {dy, ye_unweighted, topk_w, keep, K, H, dye, dw};
    size_t per_tok = (size_t)K * (size_t)(H > 0 ? H : 1);
    kern_par_for((size_t)T, KERN_PAR_GRAIN / per_tok + 1, comb_bwd_part, &j);
}

typedef struct gather_job {
    float *dst;
    const float *src;
    const int32_t *idx;
    int div, H;
} gather_job;

static void gather_part(void *p, size_t r0, size_t r1)
{
    const gather_job *j = p;
    size_t h = (size_t)j->H;
    for (size_t r = r0; r < r1; r++) {
        size_t s = (size_t)(j->idx[r] / j->div);
        memcpy(j->dst + r * h, j->src + s * h, h * sizeof(float));
    }
}

void kern_rows_gather_par(float *dst, const float *src, const int32_t *idx, int div, size_t n,
                          int H)
{
    /* dst (n,H) out: row r = src row idx[r] / div; src (.,H) */
    gather_job j = {dst, src, idx, div > 0 ? div : 1, H};
    kern_par_for(n, KERN_PAR_GRAIN / (size_t)(H > 0 ? H : 1) + 1, gather_part, &j);
}

typedef struct scatter_job {
    float *dst;
    const float *src;
    const int32_t *idx;
    int H;
} scatter_job;

static void scatter_part(void *p, size_t r0, size_t r1)
{
    const scatter_job *j = p;
    size_t h = (size_t)j->H;
    for (size_t r = r0; r < r1; r++) {
        size_t d = (size_t)j->idx[r];
        memcpy(j->dst + d * h, j->src + r * h, h * sizeof(float));
    }
}

void kern_rows_scatter_par(float *dst, const float *src, const int32_t *idx, size_t n, int H)
{
    /* dst row idx[r] out = src row r (n,H); idx distinct (a permutation) */
    scatter_job j = {dst, src, idx, H};
    kern_par_for(n, KERN_PAR_GRAIN / (size_t)(H > 0 ? H : 1) + 1, scatter_part, &j);
}
