/*
 * routing_stats.h - what a batch's routing says, from its routed slots per
 * expert: the load-balancing (aux) loss and the imbalance. The coordinator
 * (merged workers' counts) and a lane worker (its own) report the same
 * numbers through this one function.
 */
#ifndef MOE_ROUTING_STATS_H
#define MOE_ROUTING_STATS_H

#include <stdint.h>

/* routing_stats: counts (E) routed slots per expert, probs_sum (E) the
 * router probabilities summed over the batch's T tokens, K choices per
 * token. *aux = E/(K T) * sum_e counts_e * probs_sum_e / T (0 when T = 0);
 * *imbalance = max_e counts_e / mean_e counts_e (0 with no slot). */
void routing_stats(const int64_t *counts, const double *probs_sum, int E, int K, int64_t T,
                   double *aux, double *imbalance);

#endif
