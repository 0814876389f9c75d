/* err.c - moe_err descriptions, wire codes and dtype helpers. */
#include <string.h>

#include "base/moe.h"

static const struct {
    const char *code;
    const char *text;
} err_table[MOE_ERR_COUNT] = {
    [MOE_OK] = {"ok", "success"},
    [MOE_EINVAL] = {"invalid_argument", "invalid argument"},
    [MOE_EUNAUTH] = {"unauthenticated", "missing or wrong auth token"},
    [MOE_EBUSY] = {"busy", "server busy, queue full"},
    [MOE_ETIMEDOUT] = {"deadline_exceeded", "deadline exceeded"},
    [MOE_EUNAVAIL] = {"unavailable", "service unavailable"},
    [MOE_ENOTFOUND] = {"not_found", "not found"},
    [MOE_ENOMEM] = {"resource_exhausted", "out of memory or resources"},
    [MOE_ETOOBIG] = {"too_large", "message too large"},
    [MOE_EPROTO] = {"malformed", "malformed message"},
    [MOE_ENOMETHOD] = {"unknown_method", "unknown method"},
    [MOE_EEXPIRED] = {"expired", "handle expired"},
    [MOE_EPRECOND] = {"failed_precondition", "failed precondition"},
    [MOE_EIO] = {"io_error", "input/output error"},
    [MOE_EINTERNAL] = {"internal", "internal error"},
    [MOE_ECLOSED] = {"closed", "closed"},
};

const char *moe_strerror(moe_err err)
{
    if ((unsigned)err >= MOE_ERR_COUNT)
        return "unknown error";
    return err_table[err].text;
}

const char *moe_err_code(moe_err err)
{
    if ((unsigned)err >= MOE_ERR_COUNT)
        return "internal";
    return err_table[err].code;
}

moe_err moe_err_from_code(const char *code, size_t len)
{
    for (int i = 0; i < MOE_ERR_COUNT; i++) {
        if (strlen(err_table[i].code) == len && memcmp(err_table[i].code, code, len) == 0)
            return (moe_err)i;
    }
    return MOE_EINTERNAL;
}

size_t moe_dtype_size(moe_dtype dt)
{
    switch (dt) {
    case MOE_F32: return 4;
    case MOE_BF16: return 2;
    case MOE_F16: return 2;
    }
    return 0;
}

const char *moe_dtype_name(moe_dtype dt)
{
    switch (dt) {
    case MOE_F32: return "f32";
    case MOE_BF16: return "bf16";
    case MOE_F16: return "f16";
    }
    return NULL;
}

moe_err moe_dtype_parse(const char *name, size_t len, moe_dtype *out)
{
    static const moe_dtype all[] = {MOE_F32, MOE_BF16, MOE_F16};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        const char *n = moe_dtype_name(all[i]);
        if (strlen(n) == len && memcmp(n, name, len) == 0) {
            *out = all[i];
            return MOE_OK;
        }
    }
    return MOE_EINVAL;
}
