/*
 * rpc.c - msgpack-rpc framing.
 *   request  [0, msgid:uint32, method:str, [ {params} ]]   ({params} bare is accepted)
 *   response [1, msgid:uint32, nil | {"code": str, "message": str}, result]
 * Parsing walks the whole message once (mp_skip, depth counted from the
 * root) so that a request that parses is complete and has no trailing bytes;
 * handlers reading params afterwards can only meet wrong types, never
 * truncation.
 */
#include <inttypes.h>
#include <string.h>

#include "proto/proto.h"

/* read_head reads "[type, msgid" of a 4-element message. */
static moe_err read_head(mp_reader *r, uint64_t want_type, uint32_t *msgid, mp_errbuf *eb)
{
    static const char *const kind[] = {"request", "response", "notification"};
    mp_type t = mp_peek(r);
    if (t != MP_ARRAY) {
        if (t == MP_INVALID && mp_left(r) == 0)
            return mp_errf(eb, MOE_EPROTO, "empty message");
        if (t == MP_INVALID)
            return mp_errf(eb, MOE_EPROTO, "not msgpack: reserved byte 0xc1");
        return mp_errf(eb, MOE_EPROTO, "not a msgpack-rpc %s: expected an array of 4, got %s",
                       kind[want_type], mp_type_name(t));
    }
    uint32_t n;
    moe_err e = mp_read_array(r, &n, eb);
    if (e)
        return e;
    if (n != 4)
        return mp_errf(eb, MOE_EPROTO,
                       "not a msgpack-rpc %s: expected an array of 4, got an array of %" PRIu32,
                       kind[want_type], n);
    uint64_t type;
    e = mp_read_u64(r, &type, eb);
    if (e) {
        mp_err_prefix(eb, "message type: ");
        return MOE_EPROTO;
    }
    if (type != want_type)
        return mp_errf(eb, MOE_EPROTO,
                       "message type %" PRIu64 " (%s) where a %s (%" PRIu64 ") was expected", type,
                       type <= 2 ? kind[type] : "unknown", kind[want_type], want_type);
    uint64_t id;
    e = mp_read_u64(r, &id, eb);
    if (e) {
        mp_err_prefix(eb, "msgid: ");
        return MOE_EPROTO;
    }
    if (id > UINT32_MAX)
        return mp_errf(eb, MOE_EPROTO, "msgid %" PRIu64 " does not fit uint32", id);
    *msgid = (uint32_t)id;
    return MOE_OK;
}

/* check_rest skips `values` values found at `depth` (a failure is prefixed
 * with what) and requires the end of the message. */
static moe_err check_rest(mp_reader *r, uint64_t values, int depth, const char *what, mp_errbuf *eb)
{
    for (uint64_t i = 0; i < values; i++) {
        if (mp_skip_depth(r, depth, eb) != MOE_OK) {
            mp_err_prefix(eb, "%s: ", what);
            return MOE_EPROTO;
        }
    }
    if (mp_left(r) != 0)
        return mp_errf(eb, MOE_EPROTO, "%zu trailing bytes after the message", mp_left(r));
    return MOE_OK;
}

moe_err moe_rpc_parse_request(const void *buf, size_t len, size_t max_len, moe_rpc_request *req,
                              uint32_t *msgid_out, mp_errbuf *eb)
{
    if (msgid_out)
        *msgid_out = 0;
    memset(req, 0, sizeof(*req));
    if (len > max_len)
        return mp_errf(eb, MOE_ETOOBIG, "message of %zu bytes exceeds the %zu byte limit", len,
                       max_len);
    mp_reader r;
    mp_reader_init(&r, buf, len);
    uint32_t msgid;
    moe_err e = read_head(&r, 0, &msgid, eb);
    if (e)
        return e;
    req->msgid = msgid;
    if (msgid_out)
        *msgid_out = msgid;
    e = mp_read_str(&r, &req->method, &req->method_len, eb);
    if (e) {
        mp_err_prefix(eb, "method: ");
        return MOE_EPROTO;
    }
    int depth = 1; /* inside the outer array */
    mp_type t = mp_peek(&r);
    if (t == MP_ARRAY) {
        uint32_t n;
        if ((e = mp_read_array(&r, &n, eb)) != MOE_OK)
            return e;
        if (n == 0) {
            /* [] : a method called with no arguments, as generic clients send it */
            req->nparams = 0;
            req->params = r;
            return check_rest(&r, 0, depth + 1, "params", eb);
        }
        if (n != 1 || mp_peek(&r) != MP_MAP)
            return mp_errf(
                eb, MOE_EPROTO,
                "params must be [ {map} ] or {map}, got an array of %" PRIu32 " element%s%s%s", n,
                n == 1 ? "" : "s", n == 1 ? ": " : "", n == 1 ? mp_type_name(mp_peek(&r)) : "");
        depth = 2;
    } else if (t != MP_MAP) {
        return mp_errf(eb, MOE_EPROTO, "params must be [ {map} ] or {map}, got %s",
                       mp_type_name(t));
    }
    if ((e = mp_read_map(&r, &req->nparams, eb)) != MOE_OK)
        return e;
    req->params = r;
    return check_rest(&r, 2 * (uint64_t)req->nparams, depth + 1, "params", eb);
}

/* read_gone: the error's "gone" array of ranks (the first MOE_RPC_MAX_GONE
 * kept, the others read past) */
static moe_err read_gone(mp_reader *r, moe_rpc_response *resp, mp_errbuf *eb)
{
    uint32_t n;
    moe_err e = mp_read_array(r, &n, eb);
    for (uint32_t i = 0; i < n && e == MOE_OK; i++) {
        int64_t v;
        e = mp_read_i64(r, &v, eb);
        if (e == MOE_OK && v >= 0 && v <= INT32_MAX && resp->ngone < MOE_RPC_MAX_GONE)
            resp->gone[resp->ngone++] = (int)v;
    }
    return e;
}

/* read_error reads the error object {"code": str, "message": str, "gone":
 * [rank, ...]}; unknown keys are skipped (room for later fields), "message"
 * and "gone" may be missing. */
static moe_err read_error(mp_reader *r, moe_rpc_response *resp, mp_errbuf *eb)
{
    uint32_t n;
    moe_err e = mp_read_map(r, &n, eb);
    if (e) {
        mp_err_prefix(eb, "error: ");
        return MOE_EPROTO;
    }
    const char *code = NULL;
    uint32_t code_len = 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t klen;
        if ((e = mp_read_str(r, &k, &klen, eb)) != MOE_OK) {
            mp_err_prefix(eb, "error key: ");
            return MOE_EPROTO;
        }
        if (mp_str_eq(k, klen, "code"))
            e = mp_read_str(r, &code, &code_len, eb);
        else if (mp_str_eq(k, klen, "message"))
            e = mp_read_str(r, &resp->errmsg, &resp->errmsg_len, eb);
        else if (mp_str_eq(k, klen, "gone"))
            e = read_gone(r, resp, eb);
        else
            e = mp_skip_depth(r, 2, eb); /* inside the message and the error map */
        if (e) {
            mp_err_prefix(eb, "error.%.*s: ", (int)(klen > 32 ? 32 : klen), k);
            return MOE_EPROTO;
        }
    }
    if (!code)
        return mp_errf(eb, MOE_EPROTO, "error object has no \"code\"");
    resp->err = moe_err_from_code(code, code_len);
    if (resp->err == MOE_OK)
        return mp_errf(eb, MOE_EPROTO, "error object with code \"ok\"");
    if (!resp->errmsg) {
        resp->errmsg = "";
        resp->errmsg_len = 0;
    }
    return MOE_OK;
}

moe_err moe_rpc_parse_response(const void *buf, size_t len, moe_rpc_response *resp, mp_errbuf *eb)
{
    memset(resp, 0, sizeof(*resp));
    mp_reader r;
    mp_reader_init(&r, buf, len);
    moe_err e = read_head(&r, 1, &resp->msgid, eb);
    if (e)
        return e;
    if (mp_peek(&r) == MP_NIL) {
        (void)mp_read_nil(&r, eb);
    } else if (mp_peek(&r) == MP_MAP) {
        if ((e = read_error(&r, resp, eb)) != MOE_OK)
            return e;
    } else {
        return mp_errf(eb, MOE_EPROTO, "error must be nil or a map, got %s",
                       mp_type_name(mp_peek(&r)));
    }
    resp->result = r;
    return check_rest(&r, 1, 1, "result", eb);
}

void moe_rpc_write_request_head(mp_writer *w, uint32_t msgid, const char *method)
{
    mp_write_array(w, 4);
    mp_write_u64(w, 0);
    mp_write_u64(w, msgid);
    mp_write_cstr(w, method);
    mp_write_array(w, 1);
}

void moe_rpc_write_response_ok_head(mp_writer *w, uint32_t msgid)
{
    mp_write_array(w, 4);
    mp_write_u64(w, 1);
    mp_write_u64(w, msgid);
    mp_write_nil(w);
}

void moe_rpc_write_response_err_gone(mp_writer *w, uint32_t msgid, moe_err err, const char *message,
                                     const int *gone, int ngone)
{
    if (err == MOE_OK || (unsigned)err >= MOE_ERR_COUNT)
        err = MOE_EINTERNAL; /* "ok" is not an error code on the wire */
    if (ngone < 0 || !gone)
        ngone = 0;
    mp_write_array(w, 4);
    mp_write_u64(w, 1);
    mp_write_u64(w, msgid);
    mp_write_map(w, ngone ? 3 : 2);
    mp_write_cstr(w, "code");
    mp_write_cstr(w, moe_err_code(err));
    mp_write_cstr(w, "message");
    mp_write_cstr(w, message ? message : moe_strerror(err));
    if (ngone) {
        mp_write_cstr(w, "gone");
        mp_write_array(w, (uint32_t)ngone);
        for (int i = 0; i < ngone; i++)
            mp_write_i64(w, gone[i]);
    }
    mp_write_nil(w);
}

void moe_rpc_write_response_err(mp_writer *w, uint32_t msgid, moe_err err, const char *message)
{
    moe_rpc_write_response_err_gone(w, msgid, err, message, NULL, 0);
}
