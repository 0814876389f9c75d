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

/* par_memcpy: memcpy(dst, src, n) (no overlap), split over up to 8 threads
 * for n of 8 MiB or more; returns when all of it is copied. */
void par_memcpy(void *dst, const void *src, size_t n);

#endif
