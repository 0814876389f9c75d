/*
 * parcopy.h - memcpy of large buffers on several threads. One thread moves a
 * few GB/s; a 64 MiB batch of rows copied in and out is then most of a layer
 * call on a GPU worker (bench/NOTES.md, "The data plane"). Used where rows
 * are copied whole: libmoe into and out of its shared buffers and messages,
 * a worker into its answers.
 */
#ifndef MOE_PARCOPY_H
#define MOE_PARCOPY_H

#include <stddef.h>

/* par_memcpy: memcpy(dst, src, n) (no overlap); n of 8 MiB or more is split
 * over up to 12 threads and written with streaming (non-temporal) stores,
 * which do not read the destination first. Returns when all of it is copied
 * and visible to other threads and processes. */
void par_memcpy(void *dst, const void *src, size_t n);

#endif
