/* loss.c - router auxiliary losses: load balancing (Switch/GShard) and z-loss. */
#include <math.h>

#include "kernels/kern.h"

float kern_aux_loss_cpu(const float *probs, const int32_t *counts, int T, int E, int K)
{
    /* probs (T,E), counts (E) */
    if (T <= 0 || K <= 0)
        return 0.0f;
    double acc = 0.0;
    for (int e = 0; e < E; e++) {
        double psum = 0.0;
        for (int t = 0; t < T; t++)
            psum += probs[(size_t)t * E + e];
        acc += (double)counts[e] * (psum / T);
    }
    return (float)((double)E / ((double)K * T) * acc);
}

float kern_z_loss_cpu(const float *logits, int T, int E)
{
    /* logits (T,E) */
    if (T <= 0 || E <= 0)
        return 0.0f;
    double acc = 0.0;
    for (int t = 0; t < T; t++) {
        const float *lt = logits + (size_t)t * E;
        float mx = lt[0];
        for (int e = 1; e < E; e++)
            mx = lt[e] > mx ? lt[e] : mx;
        double s = exp((double)lt[0] - mx);
        for (int e = 1; e < E; e++)
            s += exp((double)lt[e] - mx);
        double lse = mx + log(s);
        acc += lse * lse;
    }
    return (float)(acc / T);
}
