/* methods.c - method table lookup; see methods.h. */
#include "rpc/methods.h"

#include <string.h>

#include "common/params.h"

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

moe_err rpc_method_check_params(const rpc_method *m, const moe_rpc_request *q, char *err,
                                size_t errlen)
{
    if (!(m->flags & RPC_NO_PARAMS))
        return MOE_OK;
    mp_reader r = q->params;
    return params_parse(&r, q->nparams, NULL, 0, err, errlen);
}

int rpc_cluster_ok(const moe_rpc_request *q, const char *secret)
{
    const char *v;
    uint32_t len;
    size_t n = strlen(secret);
    if (n == 0 || !params_find_str(&q->params, q->nparams, "cluster", &v, &len) || len != n)
        return 0;
    unsigned char diff = 0;
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)(v[i] ^ secret[i]);
    return diff == 0;
}
