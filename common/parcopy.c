/* parcopy.c - large copies on several threads; see parcopy.h. */
#include "common/parcopy.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* One thread moves a few GB/s; a 64 MiB batch in and out of a shared
 * buffer is then most of a layer call on a GPU worker. Measured on the GPU
 * host's 16-core Xeon (64 MiB, median of 9; bench/history/service.md,
 * session 27): memcpy 5.4 GB/s on 1 thread, 31 on 8, 45 on 16; streaming
 * stores 42 on 8, 64 on 12, 54 on 16 - a copy this large leaves the caches
 * anyway, and a streaming store does not read the destination first. */
#define PAR_MIN    ((size_t)8 << 20)
#define PAR_MAX_TH 12

typedef struct par_part {
    uint8_t *dst;
    const uint8_t *src;
    size_t n;
} par_part;

/* copy_stream: memcpy with non-temporal stores (x86-64: SSE2, always
 * there); the fence makes the stores visible before the caller's next
 * store (a ring post, a thread join). Elsewhere memcpy. */
static void copy_stream(uint8_t *d, const uint8_t *s, size_t n)
{
#if defined(__x86_64__)
    size_t i = 0;
    while (i < n && ((uintptr_t)(d + i) & 15)) { /* to a 16-byte boundary of d */
        d[i] = s[i];
        i++;
    }
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    if (i < n)
        memcpy(d + i, s + i, n - i);
    _mm_sfence();
#else
    memcpy(d, s, n);
#endif
}

static void *par_main(void *arg)
{
    par_part *p = arg;
    copy_stream(p->dst, p->src, p->n);
    return NULL;
}

/* par_memcpy: memcpy, split over up to PAR_MAX_TH threads for large n (the
 * calling thread copies the last part; a thread that cannot start leaves
 * its part to the caller). */
void par_memcpy(void *dst, const void *src, size_t n)
{
    static int ncpu;
    if (!ncpu) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        ncpu = c > 0 ? (int)c : 1;
    }
    if (n < PAR_MIN) {
        memcpy(dst, src, n);
        return;
    }
    int k = ncpu < PAR_MAX_TH ? ncpu : PAR_MAX_TH;
    pthread_t th[PAR_MAX_TH];
    par_part part[PAR_MAX_TH];
    int started[PAR_MAX_TH] = {0};
    size_t chunk = (n / (size_t)k + 63) & ~(size_t)63;
    for (int i = 0; i < k; i++) {
        size_t a = chunk * (size_t)i, b = i == k - 1 || a + chunk > n ? n : a + chunk;
        a = a < n ? a : n;
        part[i] = (par_part){(uint8_t *)dst + a, (const uint8_t *)src + a, b - a};
    }
    for (int i = 0; i < k - 1; i++)
        started[i] = part[i].n && pthread_create(&th[i], NULL, par_main, &part[i]) == 0;
    par_main(&part[k - 1]);
    for (int i = 0; i < k - 1; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        else
            par_main(&part[i]);
    }
}
