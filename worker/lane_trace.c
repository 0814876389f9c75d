/*
 * lane_trace.c - the stamps of lane_trace.h. The stamps of the request in
 * progress live in one array (one request at a time: each step happens
 * after the one before it on some thread, ordered by the queue and the
 * ring that hand the request on); LT_DONE moves its step times into a
 * window of the last LT_WINDOW requests and, every N, logs their medians.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "rpc/rpcsrv.h"
#include "worker/lane_trace.h"

#define LT_WINDOW 4096

static atomic_int every = -1; /* -1: not read yet; 0: off */
static _Atomic uint64_t stamp[LT_N];
/* under mu: the window (step i: stamp[i] - stamp[i - 1], us), its fill,
 * the requests closed, and the sort's scratch (no 16 KB on a thread's
 * stack; two rings answered at once take turns here) */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static float win[LT_N][LT_WINDOW], scratch[LT_WINDOW];
static int nwin, ndone;

static int trace_every(void)
{
    int n = atomic_load_explicit(&every, memory_order_relaxed);
    if (n < 0) {
        const char *s = getenv("MOE_LANE_TRACE");
        n = s && *s ? atoi(s) : 0;
        n = n < 0 ? 0 : n > LT_WINDOW ? LT_WINDOW : n;
        atomic_store(&every, n);
    }
    return n;
}

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* median of v[0 .. n) (n <= LT_WINDOW; mu held) */
static float median(const float *v, int n)
{
    memcpy(scratch, v, (size_t)n * sizeof(float));
    qsort(scratch, (size_t)n, sizeof(float), cmp_float);
    return scratch[n / 2];
}

void lane_trace(lane_step step)
{
    const int n = trace_every();
    if (!n)
        return;
    atomic_store_explicit(&stamp[step], rpc_now_ns(), memory_order_relaxed);
    if (step != LT_DONE)
        return;
    uint64_t t[LT_N];
    for (int i = 0; i < LT_N; i++)
        t[i] = atomic_exchange_explicit(&stamp[i], 0, memory_order_relaxed);
    /* a request that skipped steps (refused before the forward) is not counted */
    for (int i = 1; i < LT_N; i++)
        if (t[i] < t[i - 1] || !t[i - 1])
            return;
    pthread_mutex_lock(&mu);
    const int slot = nwin < LT_WINDOW ? nwin++ : ndone % LT_WINDOW;
    for (int i = 1; i < LT_N; i++)
        win[i][slot] = (float)(t[i] - t[i - 1]) * 1e-3f;
    if (++ndone % n == 0) {
        float m[LT_N];
        for (int i = 1; i < LT_N; i++)
            m[i] = median(win[i], nwin);
        LOG_I("lane trace, medians of %d requests (us): seen->queued %.1f, ->taken %.1f, "
              "->fwd start %.1f, ->fwd done %.1f, ->answer %.1f, ->done %.1f",
              nwin, m[LT_QUEUED], m[LT_TAKEN], m[LT_FWD0], m[LT_FWD1], m[LT_ANSWER], m[LT_DONE]);
    }
    pthread_mutex_unlock(&mu);
}
