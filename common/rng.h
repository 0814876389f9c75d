/*
 * rng.h - deterministic numbers from a counter hash (splitmix64): value i
 * depends only on the key and i, never on who asks or in what order. The
 * kernels' weights (kern_init_weight) and every test or bench input are made
 * here, so any process (worker, test, moectl, GPU check) makes the same
 * numbers. Callers own the output buffers (n floats each).
 */
#ifndef MOE_COMMON_RNG_H
#define MOE_COMMON_RNG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* rng_mix: one splitmix64 step of x (a key is built by mixing its parts in). */
uint64_t rng_mix(uint64_t x);
/* rng_fill_keyed: out[i] uniform in [lo, hi) from rng_mix(key + i*golden). */
void rng_fill_keyed(uint64_t key, float lo, float hi, float *out, size_t n);
/* rng_fill_uniform fills n values uniform in [lo, hi) from a counter hash of
 * (seed, stream, index) - for test and bench inputs. */
void rng_fill_uniform(uint64_t seed, uint64_t stream, float lo, float hi, float *out, size_t n);

#ifdef __cplusplus
}
#endif

#endif
