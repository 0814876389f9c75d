/* rng.c - counter-hash numbers (splitmix64); see rng.h. */
#include <math.h>

#include "common/rng.h"

#define GOLDEN 0x9e3779b97f4a7c15ull

uint64_t rng_mix(uint64_t x)
{
    x += GOLDEN;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void rng_fill_keyed(uint64_t key, float lo, float hi, float *out, size_t n)
{
    double span = (double)hi - (double)lo;
    for (size_t i = 0; i < n; i++) {
        uint64_t u = rng_mix(key + (uint64_t)i * GOLDEN);
        double u01 = (double)(u >> 40) * 0x1p-24; /* [0, 1) on 24 bits */
        float v = (float)((double)lo + span * u01);
        if (v >= hi && hi > lo)
            v = nextafterf(hi, lo);
        out[i] = v;
    }
}

void rng_fill_uniform(uint64_t seed, uint64_t stream, float lo, float hi, float *out, size_t n)
{
    uint64_t key = rng_mix(seed ^ 0x6d6f652d74657374ull); /* "moe-test" */
    key = rng_mix(key ^ stream);
    rng_fill_keyed(key, lo, hi, out, n);
}
