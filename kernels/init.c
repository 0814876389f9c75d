/* init.c - deterministic weights and test inputs from a counter hash
 * (splitmix64): value i depends only on the key and i, never on who asks. */
#include <math.h>

#include "kernels/kern.h"

#define GOLDEN 0x9e3779b97f4a7c15ull

static uint64_t splitmix64(uint64_t x)
{
    x += GOLDEN;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* fill_keyed: out[i] uniform in [lo, hi) from splitmix64(key + i*GOLDEN). */
static void fill_keyed(uint64_t key, float lo, float hi, float *out, size_t n)
{
    double span = (double)hi - (double)lo;
    for (size_t i = 0; i < n; i++) {
        uint64_t u = splitmix64(key + (uint64_t)i * GOLDEN);
        double u01 = (double)(u >> 40) * 0x1p-24; /* [0, 1) on 24 bits */
        float v = (float)((double)lo + span * u01);
        if (v >= hi && hi > lo)
            v = nextafterf(hi, lo);
        out[i] = v;
    }
}

void kern_init_weight(uint64_t seed, int layer, int expert, kern_wkind which, int rows, int cols,
                      float *out)
{
    if (rows <= 0 || cols <= 0)
        return;
    if (which == KERN_W_ROUTER)
        expert = 0;
    uint64_t key = splitmix64(seed ^ 0x6d6f652d77656967ull); /* "moe-weig" */
    key = splitmix64(key ^ (uint64_t)(uint32_t)layer);
    key = splitmix64(key ^ (uint64_t)(uint32_t)expert);
    key = splitmix64(key ^ (uint64_t)(uint32_t)which);
    float b = (float)(1.0 / sqrt((double)cols));
    fill_keyed(key, -b, b, out, (size_t)rows * (size_t)cols);
}

void kern_fill_uniform(uint64_t seed, uint64_t stream, float lo, float hi, float *out, size_t n)
{
    uint64_t key = splitmix64(seed ^ 0x6d6f652d74657374ull); /* "moe-test" */
    key = splitmix64(key ^ stream);
    fill_keyed(key, lo, hi, out, n);
}
