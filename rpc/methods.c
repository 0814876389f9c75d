/* methods.c - method table lookup; see methods.h. */
#include "methods.h"

#include <string.h>

const void *rpc_method_find(const void *table, int n, size_t stride, const char *name, uint32_t len)
{
    const char *row = table;
    for (int i = 0; i < n; i++, row += stride) {
        const rpc_method *m = (const rpc_method *)row;
        if (strlen(m->name) == len && memcmp(m->name, name, len) == 0)
            return row;
    }
    return NULL;
}

int rpc_method_mutating(const rpc_method *m, int train)
{
    return (m->flags & RPC_MUTATING) || ((m->flags & RPC_MUTATING_IF_TRAIN) && train);
}
