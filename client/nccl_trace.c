/* nccl_trace.c - the client's NCCL path phase times; see nccl_trace.h. */
#include "client/nccl_trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t nt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void nccl_trace_init(nccl_trace *t)
{
    const char *s = getenv("MOE_NCCL_TRACE");
    memset(t, 0, sizeof(*t));
    t->on = s && *s && strcmp(s, "0") != 0;
}

void nccl_trace_mark(nccl_trace *t, int p)
{
    if (!t->on || p < 0 || p >= NT_N)
        return;
    if (p == NT_START)
        memset(t->mark_ns, 0, sizeof(t->mark_ns));
    t->mark_ns[p] = nt_now_ns();
}

void nccl_trace_pieces(nccl_trace *t, int pieces)
{
    t->cur_pieces = pieces;
}

void nccl_trace_end(nccl_trace *t)
{
    if (!t->on)
        return;
    for (int p = 0; p < NT_N; p++)
        if (!t->mark_ns[p])
            return;
    t->pieces[t->calls % NCCL_TRACE_KEEP] = t->cur_pieces > 0 ? t->cur_pieces : 1;
    int32_t *row = t->us[t->calls % NCCL_TRACE_KEEP];
    row[0] = (int32_t)((t->mark_ns[NT_N - 1] - t->mark_ns[0]) / 1000);
    for (int p = 1; p < NT_N; p++) /* a mark may come before the one listed ahead of it */
        row[p] = (int32_t)(((int64_t)t->mark_ns[p] - (int64_t)t->mark_ns[p - 1]) / 1000);
    t->calls++;
}

static int nt_cmp(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

void nccl_trace_print(nccl_trace *t, int device)
{
    static const char *names[NT_N] = {"total",    "rows sent", "x posted", "x done",
                                      "y posted", "answered",  "y done"};
    if (!t->on || !t->calls)
        return;
    const uint32_t n = t->calls < NCCL_TRACE_KEEP ? t->calls : NCCL_TRACE_KEEP;
    /* the first call opens NCCL's connections: left out when there are others */
    const uint32_t skip = t->calls <= NCCL_TRACE_KEEP && n > 1 ? 1 : 0;
    int32_t col[NCCL_TRACE_KEEP] = {0};
    char line[512];
    for (uint32_t i = skip; i < n; i++)
        col[i - skip] = t->pieces[i];
    qsort(col, n - skip, sizeof(col[0]), nt_cmp);
    int len =
        snprintf(line, sizeof(line),
                 "moe nccl trace (GPU %d): %u calls, pieces %d, median us of the last %u:", device,
                 t->calls, col[(n - skip) / 2], n - skip);
    for (int p = 0; p < NT_N && len < (int)sizeof(line); p++) {
        for (uint32_t i = skip; i < n; i++)
            col[i - skip] = t->us[i][p];
        qsort(col, n - skip, sizeof(col[0]), nt_cmp);
        len += snprintf(line + len, sizeof(line) - (size_t)len, "%s %s %d", p ? "," : "", names[p],
                        col[(n - skip) / 2]);
    }
    fprintf(stderr, "%s\n", line);
    t->calls = 0;
}
