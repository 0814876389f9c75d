/*
 * placement.h - which worker rank owns which experts. Each layer's E experts
 * are spread in contiguous blocks over the W ranks: rank r owns experts
 * [first(r), first(r+1)). Contiguous blocks keep the rows sorted by expert
 * also sorted by destination rank, so dispatch needs no second sort.
 */
#ifndef MOE_PLACEMENT_H
#define MOE_PLACEMENT_H

static inline int placement_first(int E, int W, int r)
{
    return (int)(((long long)E * r) / W);
}
static inline int placement_count(int E, int W, int r)
{
    return placement_first(E, W, r + 1) - placement_first(E, W, r);
}
static inline int placement_owner(int E, int W, int e)
{
    /* the largest r with first(r) <= e */
    int r = (int)(((long long)e * W) / E);
    while (r + 1 < W && placement_first(E, W, r + 1) <= e)
        r++;
    while (r > 0 && placement_first(E, W, r) > e)
        r--;
    return r;
}
/* Token-range sharding of a batch of T rows over W workers: rank r gets
 * rows [shard_first(T, W, r), shard_first(T, W, r + 1)). */
static inline long long shard_first(long long T, int W, int r)
{
    return (T * r) / W;
}

#endif
