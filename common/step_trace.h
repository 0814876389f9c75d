/*
 * step_trace.h - where a call's time goes, for diagnostics: with the
 * environment variable `env` set to N, each step of the call is stamped
 * (host time since the previous stamp), and every N calls stderr gets the
 * mean of each step in microseconds. Off (one branch per stamp) without the
 * variable. One caller at a time (a decode loop): calls in flight at once
 * mix their stamps. Header-only, for C and CUDA C++ alike (libmoe's
 * MOE_FANOUT_TRACE, the fan-out forward's KCU_LOCAL_TRACE).
 */
#ifndef MOE_COMMON_STEP_TRACE_H
#define MOE_COMMON_STEP_TRACE_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { STEP_TRACE_MAX = 8 };

typedef struct step_trace {
    const char *env;  /* the variable that turns it on: every N calls */
    const char *what; /* the line's prefix */
    int nsteps;       /* names used, at most STEP_TRACE_MAX */
    const char *names[STEP_TRACE_MAX];
    int every;                /* -1: the variable not read yet; 0: off */
    int n;                    /* calls since the last line */
    double t[STEP_TRACE_MAX]; /* summed step times, us */
} step_trace;

static inline double step_trace_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

/* step_trace_begin: 1 when on (the variable read once); *last = now */
static inline int step_trace_begin(step_trace *s, double *last)
{
    if (s->every < 0) {
        const char *v = getenv(s->env);
        s->every = v && *v ? atoi(v) : 0;
        if (s->every < 0)
            s->every = 0;
    }
    if (s->every > 0)
        *last = step_trace_now_us();
    return s->every > 0;
}

/* step_trace_stamp: step i took the time since *last */
static inline void step_trace_stamp(step_trace *s, int i, double *last)
{
    if (s->every <= 0 || i < 0 || i >= STEP_TRACE_MAX)
        return;
    const double now = step_trace_now_us();
    s->t[i] += now - *last;
    *last = now;
}

/* step_trace_end: one call done; every N, the means to stderr */
static inline void step_trace_end(step_trace *s)
{
    if (s->every <= 0 || ++s->n < s->every)
        return;
    fprintf(stderr, "%s: mean of %d (us):", s->what, s->n);
    for (int i = 0; i < s->nsteps; i++) {
        fprintf(stderr, " %s %.1f", s->names[i], s->t[i] / s->n);
        s->t[i] = 0;
    }
    fprintf(stderr, "\n");
    s->n = 0;
}

#endif
