/* version.c - moe_version and the public bf16 conversions; see moe.h. The
 * conversions are base/bf16.h's, the same inline forms the kernels use
 * (kernels/kern.h), so the library's bf16 is bit for bit the kernels'. */
#include "base/bf16.h"
#include "base/moe.h"

const char *moe_version(void)
{
    return MOE_VERSION_STRING;
}

void moe_bf16_from_f32(const float *in, uint16_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = bf16_from_f32_inl(in[i]);
}

void moe_f32_from_bf16(const uint16_t *in, float *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = bf16_to_f32_inl(in[i]);
}
