/* version.c - moe_version and the public bf16 conversions; see moe.h. */
#include <string.h>

#include "client/moe.h"

const char *moe_version(void)
{
    return MOE_VERSION_STRING;
}

void moe_bf16_from_f32(const float *in, uint16_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &in[i], 4);
        if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) /* NaN: keep it quiet NaN */
            out[i] = (uint16_t)((u >> 16) | 0x0040u);
        else
            out[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

void moe_f32_from_bf16(const uint16_t *in, float *out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)in[i] << 16;
        memcpy(&out[i], &u, 4);
    }
}
