/* parcopy.c - large copies on several threads; see parcopy.h. */
#include "common/parcopy.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* One thread moves a few GB/s; a 64 MiB batch in and out of a shared
 * buffer is then most of a layer call on a GPU worker (bench/history/service.md). */
#define PAR_MIN    ((size_t)8 << 20)
#define PAR_MAX_TH 8

typedef struct par_part {
    uint8_t *dst;
    const uint8_t *src;
    size_t n;
} par_part;

static void *par_main(void *arg)
{
    par_part *p = arg;
    memcpy(p->dst, p->src, p->n);
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
    int k = n < PAR_MIN ? 1 : ncpu < PAR_MAX_TH ? ncpu : PAR_MAX_TH;
    if (k <= 1) {
        memcpy(dst, src, n);
        return;
    }
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
