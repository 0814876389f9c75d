/* init.c - deterministic weights from the counter hash of common/rng.h:
 * value i depends only on (seed, layer, expert, tensor) and i, never on who
 * asks. */
#include <math.h>

#include "kernels/kern.h"
#include "common/rng.h"

void kern_init_weight(uint64_t seed, int layer, int expert, kern_wkind which, int rows, int cols,
                      float *out)
{
    if (rows <= 0 || cols <= 0)
        return;
    if (which == KERN_W_ROUTER)
        expert = 0;
    uint64_t key = rng_mix(seed ^ 0x6d6f652d77656967ull); /* "moe-weig" */
    key = rng_mix(key ^ (uint64_t)(uint32_t)layer);
    key = rng_mix(key ^ (uint64_t)(uint32_t)expert);
    key = rng_mix(key ^ (uint64_t)(uint32_t)which);
    float b = (float)(1.0 / sqrt((double)cols));
    rng_fill_keyed(key, -b, b, out, (size_t)rows * (size_t)cols);
}
