/* bf16.c - float <-> bf16 conversion, round to nearest even. */
#include <string.h>

#include "kernels/kern.h"

/* The conversions are the inline ones of kern.h: ties to even, overflow
 * rounds to inf, NaN stays NaN (sign kept, quiet bit forced). */
uint16_t kern_f32_to_bf16(float f)
{
    return kern_f32_to_bf16_inl(f);
}

float kern_bf16_to_f32(uint16_t h)
{
    return kern_bf16_to_f32_inl(h);
}

float kern_bf16_round(float f)
{
    return kern_bf16_round_inl(f);
}

void kern_bf16_round_n(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = kern_bf16_round_inl(x[i]);
}
