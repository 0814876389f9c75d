/* bf16.c - float <-> bf16 conversion, round to nearest even. */
#include <string.h>

#include "kern.h"

uint16_t kern_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign, force quiet bit */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u); /* ties to even; overflow rounds to inf */
    return (uint16_t)(u >> 16);
}

float kern_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

float kern_bf16_round(float f)
{
    return kern_bf16_to_f32(kern_f32_to_bf16(f));
}

void kern_bf16_round_n(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = kern_bf16_round(x[i]);
}
