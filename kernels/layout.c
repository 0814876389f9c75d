/* layout.c - counting sort of routed slots by expert, and capacity drops. */
#include <math.h>

#include "kernels/kern.h"

void kern_layout_cpu(const int32_t *topk_idx, int T, int K, int E, int32_t *counts,
                     int32_t *offsets, int32_t *perm, int32_t *inv)
{
    /* topk_idx (S), counts (E), offsets (E+1), perm (S), inv (S) */
    int32_t S = (int32_t)T * K;
    for (int e = 0; e < E; e++)
        counts[e] = 0;
    for (int32_t s = 0; s < S; s++)
        counts[topk_idx[s]]++;
    offsets[0] = 0;
    for (int e = 0; e < E; e++)
        offsets[e + 1] = offsets[e] + counts[e];
    /* counts doubles as the fill cursor; it ends equal to the counts again */
    for (int e = 0; e < E; e++)
        counts[e] = 0;
    for (int32_t s = 0; s < S; s++) {
        int32_t e = topk_idx[s];
        int32_t pos = offsets[e] + counts[e]++;
        perm[pos] = s;
        if (inv)
            inv[s] = pos;
    }
}

int32_t kern_capacity(float capacity_factor, int T, int K, int E)
{
    if (!(capacity_factor > 0.0f))
        return INT32_MAX;
    if (T <= 0 || K <= 0 || E <= 0)
        return 0;
    /* The factor comes as a float (1.1f = 1.10000002...): shave its relative
     * representation error so that 1.1 * 10 gives 11, not 12. */
    double v = (double)capacity_factor * T * K / E;
    double c = ceil(v * (1.0 - 1.2e-7));
    if (c >= (double)INT32_MAX)
        return INT32_MAX;
    return (int32_t)c;
}

void kern_apply_capacity_cpu(const int32_t *counts, const int32_t *offsets, const int32_t *perm,
                             int E, int32_t cap, uint8_t *keep, int32_t *dropped)
{
    /* counts (E), offsets (E+1), perm (S), keep (S), dropped (E) */
    if (cap < 0)
        cap = 0;
    for (int e = 0; e < E; e++) {
        for (int32_t i = 0; i < counts[e]; i++)
            keep[perm[offsets[e] + i]] = i < cap;
        dropped[e] = counts[e] > cap ? counts[e] - cap : 0;
    }
}
