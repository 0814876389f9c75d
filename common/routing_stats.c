/* routing_stats.c - the aux loss and the imbalance of a batch; see routing_stats.h. */
#include "common/routing_stats.h"

void routing_stats(const int64_t *counts, const double *probs_sum, int E, int K, int64_t T,
                   double *aux, double *imbalance)
{
    int64_t mx = 0, tot = 0;
    double a = 0;
    for (int e = 0; e < E; e++) {
        mx = counts[e] > mx ? counts[e] : mx;
        tot += counts[e];
        if (T > 0)
            a += (double)counts[e] * (probs_sum[e] / (double)T);
    }
    *aux = T > 0 ? a * E / ((double)K * (double)T) : 0;
    *imbalance = tot > 0 ? (double)mx / ((double)tot / E) : 0;
}
