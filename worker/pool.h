/*
 * pool.h - the worker's host buffers for one layer call: large blocks are
 * kept when freed and handed out again, so that a forward does not fault in
 * (and zero) fresh pages for every buffer of every request. A 64 MiB batch
 * uses about ten buffers of its size; with fresh pages each time their
 * faults cost more than the copies themselves (bench/NOTES.md).
 *
 * Blocks of WPOOL_MIN bytes or more are cached, up to wpool_set_limit bytes
 * in all (the largest ones dropped first beyond it); smaller ones are plain
 * malloc. Every block carries a header: free a block from here only with
 * wpool_free, never free(). Thread safe (a mutex; the compute thread is the
 * only real user).
 */
#ifndef MOE_WKR_POOL_H
#define MOE_WKR_POOL_H

#include <stddef.h>

#define WPOOL_MIN ((size_t)256 << 10)

/* wpool_alloc: n bytes (64-byte aligned), NULL when out of memory. */
void *wpool_alloc(size_t n);
/* wpool_calloc: a zeroed array of n elements of size sz. */
void *wpool_calloc(size_t n, size_t sz);
/* wpool_free: p (from wpool_alloc/wpool_calloc, or NULL) back to the pool. */
void wpool_free(void *p);
/* wpool_set_limit: most bytes kept cached (0 = cache nothing). */
void wpool_set_limit(size_t bytes);
/* wpool_cached: bytes cached now (for tests and the log). */
size_t wpool_cached(void);
/* wpool_trim frees every cached block. */
void wpool_trim(void);

#endif
