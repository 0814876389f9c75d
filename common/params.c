/* params.c - declarative params parsing; see params.h. */
#include "common/params.h"

#include <stdio.h>
#include <string.h>

static moe_err bad(char *err, size_t errlen, const char *fmt, const char *key, const char *why)
{
    snprintf(err, errlen, fmt, key, why);
    return MOE_EINVAL;
}

/* wrong_type: a value of the wrong msgpack type is "malformed"
 * (docs/PROTOCOL.md); a right type with a bad value is "invalid_argument". */
static moe_err wrong_type(char *err, size_t errlen, const char *key, const char *what)
{
    snprintf(err, errlen, "parameter '%s' must be %s", key, what);
    return MOE_EPROTO;
}

static moe_err parse_one(mp_reader *r, pspec *p, char *err, size_t errlen)
{
    mp_errbuf eb = {{0}};
    moe_err e;
    bool ranged = !(p->min == 0 && p->max == 0);
    switch (p->type) {
    case P_STR: {
        const char *s;
        uint32_t len;
        if (mp_read_str(r, &s, &len, &eb) != MOE_OK)
            return wrong_type(err, errlen, p->key, "a string");
        if (len + 1 > p->cap)
            return bad(err, errlen, "parameter '%s' is too long%s", p->key, "");
        /* the value is used as a C string: an embedded NUL would cut it short */
        if (memchr(s, 0, len))
            return bad(err, errlen, "parameter '%s' contains a NUL byte%s", p->key, "");
        memcpy(p->out, s, len);
        ((char *)p->out)[len] = 0;
        return MOE_OK;
    }
    case P_INT: {
        int64_t v;
        mp_type t = mp_peek(r);
        if (t != MP_INT && t != MP_UINT)
            return wrong_type(err, errlen, p->key, "an integer");
        if (mp_read_i64(r, &v, &eb) != MOE_OK)
            return bad(err, errlen, "parameter '%s': %s", p->key, eb.msg);
        if (ranged && (v < p->min || v > p->max)) {
            snprintf(err, errlen, "parameter '%s' = %lld is outside [%.0f, %.0f]", p->key,
                     (long long)v, p->min, p->max);
            return MOE_EINVAL;
        }
        *(int64_t *)p->out = v;
        return MOE_OK;
    }
    case P_U64: {
        mp_type t = mp_peek(r);
        if (t != MP_INT && t != MP_UINT)
            return wrong_type(err, errlen, p->key, "an integer");
        if (mp_read_u64(r, (uint64_t *)p->out, &eb) != MOE_OK)
            return bad(err, errlen, "parameter '%s' must be >= 0 (%s)", p->key, eb.msg);
        return MOE_OK;
    }
    case P_F64: {
        double v;
        mp_type t = mp_peek(r);
        if (t != MP_INT && t != MP_UINT && t != MP_FLOAT)
            return wrong_type(err, errlen, p->key, "a number");
        if (mp_read_f64(r, &v, &eb) != MOE_OK)
            return bad(err, errlen, "parameter '%s': %s", p->key, eb.msg);
        if (v != v || (ranged && (v < p->min || v > p->max))) {
            snprintf(err, errlen, "parameter '%s' = %g is outside [%g, %g]", p->key, v, p->min,
                     p->max);
            return MOE_EINVAL;
        }
        *(double *)p->out = v;
        return MOE_OK;
    }
    case P_BOOL:
        if (mp_peek(r) != MP_BOOL || mp_read_bool(r, (bool *)p->out, &eb) != MOE_OK)
            return wrong_type(err, errlen, p->key, "a boolean");
        return MOE_OK;
    case P_TENSOR:
        e = moe_tensor_read(r, (moe_tensor *)p->out, &eb);
        if (e != MOE_OK) { /* MOE_EPROTO: not a tensor map; MOE_EINVAL: bad dtype/shape/len */
            snprintf(err, errlen, "parameter '%s': %s", p->key, eb.msg);
            return e == MOE_EPROTO ? MOE_EPROTO : MOE_EINVAL;
        }
        return MOE_OK;
    case P_RAW:
        *(mp_reader *)p->out = *r;
        if (mp_skip(r, &eb) != MOE_OK)
            return bad(err, errlen, "parameter '%s': %s", p->key, eb.msg);
        return MOE_OK;
    }
    return MOE_EINTERNAL;
}

moe_err params_parse(mp_reader *r, uint32_t nparams, pspec *specs, int nspecs, char *err,
                     size_t errlen)
{
    mp_errbuf eb = {{0}};
    for (int i = 0; i < nspecs; i++)
        specs[i].seen = false;
    for (uint32_t k = 0; k < nparams; k++) {
        const char *key;
        uint32_t klen;
        if (mp_read_str(r, &key, &klen, &eb) != MOE_OK) {
            snprintf(err, errlen, "params keys must be strings");
            return MOE_EPROTO;
        }
        pspec *p = NULL;
        for (int i = 0; i < nspecs; i++)
            if (mp_str_eq(key, klen, specs[i].key))
                p = &specs[i];
        if (!p) {
            /* envelope keys every method accepts, checked elsewhere: "auth"
             * (the coordinator's dispatch), "rid" (server/dedupe.c),
             * "cluster" (the dispatch of internal methods) */
            if (mp_str_eq(key, klen, "auth") || mp_str_eq(key, klen, "rid") ||
                mp_str_eq(key, klen, "cluster")) {
                if (mp_skip(r, &eb) != MOE_OK)
                    return bad(err, errlen, "parameter '%s': %s",
                               klen == 3   ? "rid"
                               : klen == 4 ? "auth"
                                           : "cluster",
                               eb.msg);
                continue;
            }
            snprintf(err, errlen, "unknown parameter '%.*s'", (int)(klen > 64 ? 64 : klen), key);
            return MOE_EINVAL;
        }
        if (p->seen)
            return bad(err, errlen, "parameter '%s' given twice%s", p->key, "");
        p->seen = true;
        moe_err e = parse_one(r, p, err, errlen);
        if (e != MOE_OK)
            return e;
    }
    for (int i = 0; i < nspecs; i++)
        if (specs[i].required && !specs[i].seen)
            return bad(err, errlen, "missing parameter '%s'%s", specs[i].key, "");
    return MOE_OK;
}

bool params_find_str(const mp_reader *r0, uint32_t nparams, const char *key, const char **s,
                     uint32_t *len)
{
    mp_reader r = *r0;
    for (uint32_t k = 0; k < nparams; k++) {
        const char *kk;
        uint32_t kl;
        if (mp_read_str(&r, &kk, &kl, NULL) != MOE_OK)
            return false;
        if (mp_str_eq(kk, kl, key))
            return mp_peek(&r) == MP_STR && mp_read_str(&r, s, len, NULL) == MOE_OK;
        if (mp_skip(&r, NULL) != MOE_OK)
            return false;
    }
    return false;
}

/* spec_is_set: whether params_write writes the spec's value */
static int spec_is_set(const pspec *p)
{
    switch (p->type) {
    case P_INT:
    case P_BOOL: return 1;
    case P_F64: {
        double v = *(const double *)p->out;
        return p->required || v == v;
    }
    case P_STR: return p->required || ((const char *)p->out)[0] != 0;
    default: return 0;
    }
}

void params_write(mp_writer *w, const pspec *specs, int nspecs)
{
    uint32_t n = 0;
    for (int i = 0; i < nspecs; i++)
        n += (uint32_t)spec_is_set(&specs[i]);
    mp_write_map(w, n);
    for (int i = 0; i < nspecs; i++) {
        const pspec *p = &specs[i];
        if (!spec_is_set(p))
            continue;
        mp_write_cstr(w, p->key);
        switch (p->type) {
        case P_INT: mp_write_i64(w, *(const int64_t *)p->out); break;
        case P_BOOL: mp_write_bool(w, *(const bool *)p->out); break;
        case P_F64: mp_write_f64(w, *(const double *)p->out); break;
        case P_STR: mp_write_cstr(w, (const char *)p->out); break;
        default: break;
        }
    }
}
