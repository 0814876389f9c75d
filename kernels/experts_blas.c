/* experts_blas.c - the FFNs of several experts at once on a CPU worker:
 * column blocks of every expert's GEMMs as tasks, one BLAS thread each, on
 * kern_par_threads() threads (kern.h, kern_experts_ffn_blas).
 *
 * Why: OpenBLAS threading one sgemm over all cores, expert after expert,
 * ran the T=4096 layer's expert GEMMs (8 experts x ~1024 rows, d_model
 * 4096, d_ff 2048) at 978-988 GFLOP/s on the GPU host's 16-core Xeon, MKL
 * through torch at 982-1005; 16 one-thread sgemms at once on blocks of 256
 * (up) and 512 (down) columns at 1245-1363, same bits (bench/history/
 * service.md, session 27).
 *
 * Phase 1, per (expert, block of columns of d_ff): a = x w1^T and b = x
 * w3^T for those columns, then h = act(a, b) on them. Phase 2, per (expert,
 * block of columns of d_model): y = h w2^T. On 2 threads (the 2-core
 * development machine) 256-column blocks were 2-4% slower than whole
 * experts (x packed again per block): the blocks are as wide as ~4 tasks
 * per thread allows. Every
 * element is one sgemm's dot product over the whole of H or F, so the
 * blocks give what one sgemm over the expert gives. */
#include <cblas.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"

#define UP_COLS   256 /* the narrowest blocks: measured best on 16 threads */
#define DOWN_COLS 512

/* the BLAS thread count is the process's: one forward at a time sets it to 1 */
static pthread_mutex_t ex_mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct ex_job {
    const float *xe, *w1, *w3, *w2;
    const int32_t *kept;
    const size_t *row0; /* (ne) first row of expert i */
    int ne, H, F, gated, bf16;
    int up_cols, down_cols; /* block widths */
    kern_act act;
    float *a, *b, *h, *ye;
    int (*abort_fn)(void);
    /* the running phase (1: up, 2: down) and its tasks: task t is block
     * task_c[t] of expert task_e[t] */
    int phase, ntask;
    const int *task_e, *task_c; /* (ntask) of the running phase */
    atomic_int next;
    atomic_int aborted;
} ex_job;

static void up_block(const ex_job *j, int i, int c)
{
    const int H = j->H, F = j->F, n = j->kept[i];
    const int c0 = c * j->up_cols, cw = F - c0 < j->up_cols ? F - c0 : j->up_cols;
    const size_t fh = (size_t)F * H, r0 = j->row0[i];
    const float *x = j->xe + r0 * H;
    float *a = j->a + r0 * F + c0, *b = j->gated ? j->b + r0 * F + c0 : NULL;
    float *h = j->h + r0 * F + c0;
    /* a[:, c0:c0+cw] (n,cw) = x (n,H) w1[c0:c0+cw]^T */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, cw, H, 1.0f, x, H,
                j->w1 + i * fh + (size_t)c0 * H, H, 0.0f, a, F);
    if (j->gated)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, cw, H, 1.0f, x, H,
                    j->w3 + i * fh + (size_t)c0 * H, H, 0.0f, b, F);
    for (int r = 0; r < n; r++)
        kern_act_forward_n(j->act, a + (size_t)r * F, b ? b + (size_t)r * F : NULL, (size_t)cw,
                           j->bf16, h + (size_t)r * F);
}

static void down_block(const ex_job *j, int i, int c)
{
    const int H = j->H, F = j->F, n = j->kept[i];
    const int c0 = c * j->down_cols, cw = H - c0 < j->down_cols ? H - c0 : j->down_cols;
    const size_t fh = (size_t)F * H, r0 = j->row0[i];
    /* y[:, c0:c0+cw] (n,cw) = h (n,F) w2[c0:c0+cw]^T */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, cw, F, 1.0f, j->h + r0 * F, F,
                j->w2 + i * fh + (size_t)c0 * F, F, 0.0f, j->ye + r0 * H + c0, H);
}

static void ex_main(ex_job *j)
{
    for (;;) {
        if (atomic_load(&j->aborted))
            break;
        if (j->abort_fn && j->abort_fn()) {
            atomic_store(&j->aborted, 1);
            break;
        }
        int t = atomic_fetch_add(&j->next, 1);
        if (t >= j->ntask)
            break;
        if (j->phase == 1)
            up_block(j, j->task_e[t], j->task_c[t]);
        else
            down_block(j, j->task_e[t], j->task_c[t]);
    }
}

/* ex_part: kern_par_for's part = one taker of tasks (dynamic: experts
 * differ in rows) */
static void ex_part(void *arg, size_t i0, size_t i1)
{
    for (size_t i = i0; i < i1; i++)
        ex_main(arg);
}

/* run_phase: the phase's tasks, taken by up to nth threads at once */
static void run_phase(ex_job *j, int nth)
{
    atomic_store(&j->next, 0);
    kern_par_for((size_t)(nth < j->ntask ? nth : j->ntask), 1, ex_part, j);
}

int kern_experts_ffn_blas(const float *xe, const int32_t *n, const int32_t *kept, int ne, int H,
                          int F, const float *w1, const float *w3, const float *w2, kern_act act,
                          int bf16, float *a, float *b, float *h, float *ye, int (*abort_fn)(void))
{
    if (ne <= 0 || H <= 0)
        return 0;
    const int gated = act_gated(act);
    size_t *row0 = malloc((size_t)ne * sizeof(size_t));
    int nup = 0, ndown = 0, many = 0;
    size_t r = 0;
    if (!row0)
        return -1;
    for (int i = 0; i < ne; i++) {
        row0[i] = r;
        r += (size_t)n[i];
        many += kept[i] > KERN_BLAS_GEMV_ROWS && F > 0;
    }
    /* blocks: about 4 tasks per thread over the experts with rows, none
     * narrower than UP_COLS / DOWN_COLS (16 threads, 8 experts: 256 and
     * 512; 2 threads: whole experts - narrower blocks only pack x again) */
    const int nth = kern_par_threads();
    const int want = many ? (4 * nth + many - 1) / many : 1;
    int up = (F / want + 63) / 64 * 64, down = (H / want + 63) / 64 * 64;
    up = up < UP_COLS ? UP_COLS : up;
    down = down < DOWN_COLS ? DOWN_COLS : down;
    for (int i = 0; i < ne; i++)
        if (kept[i] > KERN_BLAS_GEMV_ROWS && F > 0) {
            nup += (F + up - 1) / up;
            ndown += (H + down - 1) / down;
        }
    int *te = malloc((size_t)(nup + ndown + 1) * sizeof(int));
    int *tc = malloc((size_t)(nup + ndown + 1) * sizeof(int));
    if (!te || !tc) {
        free(row0);
        free(te);
        free(tc);
        return -1;
    }
    int k = 0;
    for (int i = 0; i < ne; i++)
        if (kept[i] > KERN_BLAS_GEMV_ROWS && F > 0)
            for (int c = 0; c * up < F; c++, k++) {
                te[k] = i;
                tc[k] = c;
            }
    for (int i = 0; i < ne; i++)
        if (kept[i] > KERN_BLAS_GEMV_ROWS && F > 0)
            for (int c = 0; c * down < H; c++, k++) {
                te[k] = i;
                tc[k] = c;
            }
    ex_job j = {.xe = xe,
                .w1 = w1,
                .w3 = w3,
                .w2 = w2,
                .kept = kept,
                .row0 = row0,
                .ne = ne,
                .H = H,
                .F = F,
                .gated = gated,
                .bf16 = bf16,
                .act = act,
                .a = a,
                .b = b,
                .h = h,
                .ye = ye,
                .abort_fn = abort_fn,
                .up_cols = up,
                .down_cols = down};
    atomic_init(&j.next, 0);
    atomic_init(&j.aborted, 0);
    int rc = 0;
    /* the experts with few rows: one sgemv per row, threaded by the BLAS */
    const size_t fh = (size_t)F * H;
    for (int i = 0; i < ne && !rc; i++) {
        if (abort_fn && abort_fn())
            rc = 1;
        else if (kept[i] > 0 && (kept[i] <= KERN_BLAS_GEMV_ROWS || F <= 0))
            kern_expert_ffn_blas(xe + row0[i] * H, kept[i], H, F, w1 + i * fh,
                                 gated ? w3 + i * fh : NULL, w2 + i * fh, act, bf16,
                                 a + row0[i] * F, gated ? b + row0[i] * F : NULL, ye + row0[i] * H);
    }
    if (many && !rc) {
        pthread_mutex_lock(&ex_mu);
        int blas_th = openblas_get_num_threads();
        openblas_set_num_threads(1); /* each task's sgemm on its own thread */
        j.phase = 1;
        j.ntask = nup;
        j.task_e = te;
        j.task_c = tc;
        run_phase(&j, nth);
        if (!atomic_load(&j.aborted)) {
            j.phase = 2;
            j.ntask = ndown;
            j.task_e = te + nup;
            j.task_c = tc + nup;
            run_phase(&j, nth);
        }
        openblas_set_num_threads(blas_th);
        pthread_mutex_unlock(&ex_mu);
        rc = atomic_load(&j.aborted) ? 1 : 0;
    }
    /* dropped rows (n - kept) give zero rows */
    for (int i = 0; i < ne; i++)
        if (n[i] > kept[i])
            memset(ye + (row0[i] + (size_t)kept[i]) * H, 0,
                   (size_t)(n[i] - kept[i]) * H * sizeof(float));
    free(row0);
    free(te);
    free(tc);
    return rc;
}
