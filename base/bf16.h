/*
 * bf16.h - the one float <-> bf16 conversion of the project, inline (branch
 * free, so loops over it vectorize): round to nearest even, overflow rounds
 * to inf, NaN stays NaN (sign kept, quiet bit forced). Internal: the public
 * moe_bf16_from_f32 / moe_f32_from_bf16 (base/version.c) and the kernels'
 * kern_*bf16* (kernels/kern.h) are built on it, so both round bit for bit
 * the same. Values only: no pointers, nothing owned.
 */
#ifndef MOE_BASE_BF16_H
#define MOE_BASE_BF16_H

#include <stdint.h>

static inline uint16_t bf16_from_f32_inl(float f)
{
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof(u));
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* ties to even */
    uint32_t quiet_nan = (u >> 16) | 0x0040u;                  /* NaN keeps its sign */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

static inline float bf16_to_f32_inl(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof(f));
    return f;
}

/* bf16_round_inl: f rounded to the nearest bf16 value, as a float */
static inline float bf16_round_inl(float f)
{
    return bf16_to_f32_inl(bf16_from_f32_inl(f));
}

#endif
