/* pool.c - cached large host buffers; see pool.h. */
#include "worker/pool.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define WPOOL_HDR   64 /* keeps the caller's pointer 64-byte aligned */
#define WPOOL_MAGIC 0x6d6f65706f6f6c31ull
#define WPOOL_SLOTS 64

typedef struct wpool_hdr {
    uint64_t magic;
    size_t size; /* usable bytes */
} wpool_hdr;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void *cache[WPOOL_SLOTS]; /* headers of free blocks */
static size_t cached, limit = (size_t)2 << 30;

static wpool_hdr *hdr_of(void *p)
{
    return (wpool_hdr *)((uint8_t *)p - WPOOL_HDR);
}

void *wpool_alloc(size_t n)
{
    if (n >= WPOOL_MIN) { /* the smallest cached block that fits */
        pthread_mutex_lock(&mu);
        int best = -1;
        for (int i = 0; i < WPOOL_SLOTS; i++) {
            wpool_hdr *h = cache[i];
            if (h && h->size >= n && (best < 0 || h->size < ((wpool_hdr *)cache[best])->size))
                best = i;
        }
        /* not one twice the size or more: that wastes what a larger call needs */
        if (best >= 0 && ((wpool_hdr *)cache[best])->size <= 2 * n) {
            wpool_hdr *h = cache[best];
            cache[best] = NULL;
            cached -= h->size;
            pthread_mutex_unlock(&mu);
            return (uint8_t *)h + WPOOL_HDR;
        }
        pthread_mutex_unlock(&mu);
    }
    wpool_hdr *h = NULL;
    if (posix_memalign((void **)&h, WPOOL_HDR, WPOOL_HDR + (n ? n : 1)) != 0)
        return NULL;
    h->magic = WPOOL_MAGIC;
    h->size = n;
    return (uint8_t *)h + WPOOL_HDR;
}

void *wpool_calloc(size_t n, size_t sz)
{
    if (sz && n > SIZE_MAX / sz)
        return NULL;
    void *p = wpool_alloc(n * sz);
    if (p)
        memset(p, 0, n * sz);
    return p;
}

void wpool_free(void *p)
{
    if (!p)
        return;
    wpool_hdr *h = hdr_of(p);
    if (h->magic != WPOOL_MAGIC)
        abort(); /* not ours: a programming error, never input */
    if (h->size < WPOOL_MIN) {
        free(h);
        return;
    }
    pthread_mutex_lock(&mu);
    /* room: drop cached blocks, largest first, until this one fits the limit */
    while (cached + h->size > limit) {
        int big = -1;
        for (int i = 0; i < WPOOL_SLOTS; i++)
            if (cache[i] &&
                (big < 0 || ((wpool_hdr *)cache[i])->size > ((wpool_hdr *)cache[big])->size))
                big = i;
        if (big < 0 || ((wpool_hdr *)cache[big])->size < h->size)
            break;
        cached -= ((wpool_hdr *)cache[big])->size;
        free(cache[big]);
        cache[big] = NULL;
    }
    int slot = -1;
    for (int i = 0; i < WPOOL_SLOTS && slot < 0; i++)
        if (!cache[i])
            slot = i;
    if (slot < 0 || cached + h->size > limit) {
        pthread_mutex_unlock(&mu);
        free(h);
        return;
    }
    cache[slot] = h;
    cached += h->size;
    pthread_mutex_unlock(&mu);
}

void wpool_set_limit(size_t bytes)
{
    pthread_mutex_lock(&mu);
    limit = bytes;
    pthread_mutex_unlock(&mu);
    if (bytes < wpool_cached())
        wpool_trim();
}

size_t wpool_cached(void)
{
    pthread_mutex_lock(&mu);
    size_t n = cached;
    pthread_mutex_unlock(&mu);
    return n;
}

void wpool_trim(void)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < WPOOL_SLOTS; i++) {
        free(cache[i]);
        cache[i] = NULL;
    }
    cached = 0;
    pthread_mutex_unlock(&mu);
}
