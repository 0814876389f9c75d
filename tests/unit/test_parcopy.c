/*
 * test_parcopy.c - par_memcpy (common/parcopy.h) copies every byte, for
 * sizes below, at and above the size it starts threads at, odd sizes and
 * offsets included, and never writes past the end.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/parcopy.h"

Test(parcopy, every_byte_and_nothing_more)
{
    static const size_t sizes[] = {
        0, 1, 63, 4096, (8u << 20) - 1, 8u << 20, (8u << 20) + 1, (21u << 20) + 13};
    size_t max = (21u << 20) + 13 + 64 + 8;
    uint8_t *src = malloc(max), *dst = malloc(max + 64);
    cr_assert(src && dst);
    uint32_t z = 12345;
    for (size_t i = 0; i < max; i++) {
        z = z * 1664525u + 1013904223u;
        src[i] = (uint8_t)(z >> 24);
    }
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        for (size_t off = 0; off < 3; off++) {
            /* off 2: source and destination on different alignments */
            size_t n = sizes[k], so = off == 2 ? 7 : off;
            memset(dst, 0xa5, max + 64);
            par_memcpy(dst + off, src + so, n);
            cr_assert(memcmp(dst + off, src + so, n) == 0, "n=%zu off=%zu: bytes differ", n, off);
            for (size_t i = off + n; i < off + n + 64; i++)
                cr_assert_eq(dst[i], 0xa5, "n=%zu: wrote past the end at %zu", n, i);
            if (off)
                cr_assert_eq(dst[0], 0xa5, "n=%zu: wrote before the start", n);
        }
    }
    free(src);
    free(dst);
}
