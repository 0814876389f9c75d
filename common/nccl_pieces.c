/* nccl_pieces.c - the NCCL client path's pieces; see nccl_pieces.h. */
#include "common/nccl_pieces.h"

#include <stdio.h>
#include <stdlib.h>

moe_err nccl_pieces_check(int64_t pieces, int64_t R, int lane, int fanout, char *err, size_t errlen)
{
    if (pieces < 1 || pieces > NCCL_PIECES_MAX) {
        snprintf(err, errlen, "pieces = %lld: the rows over NCCL travel in 1 to %d pieces",
                 (long long)pieces, NCCL_PIECES_MAX);
        return MOE_EINVAL;
    }
    if (pieces == 1)
        return MOE_OK;
    if (pieces > R) {
        snprintf(err, errlen,
                 "pieces = %lld for %lld rows: every piece needs at least one row (ask for at "
                 "most %lld pieces)",
                 (long long)pieces, (long long)R, (long long)(R > 0 ? R : 1));
        return MOE_EINVAL;
    }
    if (!lane || fanout) {
        snprintf(err, errlen,
                 "pieces = %lld: only a lane forward of one worker (data.rows with run, no "
                 "fanout) travels in pieces; send pieces 1 (or none) here",
                 (long long)pieces);
        return MOE_EINVAL;
    }
    return MOE_OK;
}

int nccl_pieces_choose(size_t xbytes, int64_t R, int pieces_max, const char *env)
{
    int p = xbytes >= NCCL_PIECES_MIN_BYTES ? 2 : 1;
    if (env && *env) {
        char *end = NULL;
        long v = strtol(env, &end, 10);
        if (end != env && *end == '\0')
            p = v < 1 ? 1 : v > NCCL_PIECES_MAX ? NCCL_PIECES_MAX : (int)v;
    }
    if (p > pieces_max)
        p = pieces_max;
    if ((int64_t)p > R)
        p = (int)R;
    return p < 1 ? 1 : p;
}
