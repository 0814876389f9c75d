/*
 * proto.h - the wire format of moe: msgpack-rpc framing, a strict bounded
 * msgpack reader, a msgpack writer, and tensor encoding. docs/PROTOCOL.md
 * documents the bytes; this header is the C side.
 *
 * Request  = [0, msgid:uint32, method:str, params]   params = [ {map} ] (a bare map is accepted)
 * Response = [1, msgid:uint32, error, result]        error  = nil | {"code": str, "message": str}
 * Tensor   = {"dtype": "f32"|"bf16"|"f16", "shape": [int...], "data": bin}
 *
 * The reader never allocates and never trusts a count: every array/map/str/
 * bin length is checked against the bytes left before use (an array of n
 * elements needs at least n bytes, a map 2n). Nesting is capped at
 * MP_MAX_DEPTH. Strings and bins point into the caller's buffer (zero copy):
 * they live as long as that buffer.
 */
#ifndef MOE_PROTO_H
#define MOE_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"

#define MP_MAX_DEPTH 32
#define MOE_MAX_DIMS 4

/* mp_errbuf: a human-readable reason filled by failing proto functions. */
typedef struct mp_errbuf {
    char msg[256];
} mp_errbuf;

/* mp_errf fills eb (if not NULL) with a printf-style reason and returns err,
 * so a failing path reads `return mp_errf(eb, MOE_EINVAL, "...", ...);`. */
moe_err mp_errf(mp_errbuf *eb, moe_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* mp_err_prefix prepends a printf-style context ("param \"x\": ") to the
 * reason already in eb (if not NULL); truncates at sizeof(eb->msg). */
void mp_err_prefix(mp_errbuf *eb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- reader ---- */

typedef enum mp_type {
    MP_NIL,
    MP_BOOL,
    MP_INT,
    MP_UINT,
    MP_FLOAT,
    MP_STR,
    MP_BIN,
    MP_ARRAY,
    MP_MAP,
    MP_EXT,
    MP_INVALID
} mp_type;

typedef struct mp_reader {
    const uint8_t *p;   /* private: next byte */
    const uint8_t *end; /* private: one past the last byte */
} mp_reader;

void mp_reader_init(mp_reader *r, const void *buf, size_t len);
size_t mp_left(const mp_reader *r);
/* mp_peek returns the type of the next value without consuming it
 * (MP_INVALID at end of buffer or on a reserved byte 0xc1).
 * Integers: MP_INT for a negative value, MP_UINT for a non-negative one,
 * whatever the encoding (0xd0 0x05 is MP_UINT). */
mp_type mp_peek(const mp_reader *r);
/* mp_type_name returns a static name ("nil", "int", "str", ...) for messages. */
const char *mp_type_name(mp_type t);

/* Each mp_read_* consumes one value of the expected type. On error it
 * returns MOE_EPROTO (truncated / wrong type / count larger than bytes
 * left) or MOE_EINVAL (value out of range), fills eb if not NULL, and leaves
 * the reader position unspecified. */
moe_err mp_read_nil(mp_reader *r, mp_errbuf *eb);
moe_err mp_read_bool(mp_reader *r, bool *out, mp_errbuf *eb);
moe_err mp_read_i64(mp_reader *r, int64_t *out, mp_errbuf *eb);  /* int or uint fitting int64 */
moe_err mp_read_u64(mp_reader *r, uint64_t *out, mp_errbuf *eb); /* non-negative ints only */
moe_err mp_read_f64(mp_reader *r, double *out, mp_errbuf *eb);   /* float32/64 or any int */
moe_err mp_read_str(mp_reader *r, const char **s, uint32_t *len, mp_errbuf *eb);
moe_err mp_read_bin(mp_reader *r, const void **data, uint32_t *len, mp_errbuf *eb);
moe_err mp_read_array(mp_reader *r, uint32_t *count, mp_errbuf *eb);
moe_err mp_read_map(mp_reader *r, uint32_t *count, mp_errbuf *eb);
/* mp_read_small_uints reads an array whose elements are all positive
 * fixints (0..127, one byte each; a count or flag per expert): *vals points
 * at its *count value bytes inside the buffer. MOE_EPROTO, with the reader
 * where it was, when the next value is not such an array (the caller reads
 * it element by element then). */
moe_err mp_read_small_uints(mp_reader *r, uint32_t *count, const uint8_t **vals, mp_errbuf *eb);
/* mp_skip consumes any one value, recursively, depth-capped. */
moe_err mp_skip(mp_reader *r, mp_errbuf *eb);
/* mp_skip_depth is mp_skip for a value already inside `depth` containers, so
 * the MP_MAX_DEPTH cap counts from the message root (0 = top level). */
moe_err mp_skip_depth(mp_reader *r, int depth, mp_errbuf *eb);
/* mp_str_eq compares a read string with a C string. */
bool mp_str_eq(const char *s, uint32_t len, const char *cstr);

/* ---- writer: a growable buffer (owned by the writer until taken) ---- */

typedef struct mp_writer {
    uint8_t *buf; /* private */
    size_t len;   /* read-only: bytes written */
    size_t cap;   /* private */
    bool failed;  /* read-only: an allocation failed; everything after is dropped */
} mp_writer;

void mp_writer_init(mp_writer *w);
void mp_writer_fini(mp_writer *w); /* frees the buffer unless taken */
/* mp_writer_take hands the buffer to the caller (free() it); the writer is
 * left empty. Returns NULL if w->failed. */
uint8_t *mp_writer_take(mp_writer *w, size_t *len);
/* mp_writer_reserve_bin writes a bin header of n bytes and returns a pointer
 * where the caller writes the n bytes (valid until the next write).
 * Returns NULL (and sets w->failed) if the buffer cannot grow. */
void *mp_writer_reserve_bin(mp_writer *w, uint32_t n);
/* mp_write_bin_head writes only the header of a bin of n bytes: the caller
 * appends the n bytes itself (e.g. straight into the message it sends). */
void mp_write_bin_head(mp_writer *w, uint32_t n);

void mp_write_nil(mp_writer *w);
void mp_write_bool(mp_writer *w, bool v);
void mp_write_i64(mp_writer *w, int64_t v); /* smallest encoding */
void mp_write_u64(mp_writer *w, uint64_t v);
void mp_write_f64(mp_writer *w, double v);
void mp_write_f32(mp_writer *w, float v);
void mp_write_str(mp_writer *w, const char *s, uint32_t len);
void mp_write_cstr(mp_writer *w, const char *s);
void mp_write_bin(mp_writer *w, const void *data, uint32_t len);
void mp_write_array(mp_writer *w, uint32_t count);
void mp_write_map(mp_writer *w, uint32_t count);
/* mp_write_raw appends already-encoded msgpack bytes. */
void mp_write_raw(mp_writer *w, const void *data, size_t len);

/* ---- tensors ---- */

/* moe_tensor: a view; data points into a message buffer or caller memory
 * (never owned by the view). Row-major, little-endian. A view read from a
 * message is NOT aligned: memcpy the data out, never cast it to float *. */
typedef struct moe_tensor {
    moe_dtype dtype;
    int ndim; /* 1..MOE_MAX_DIMS */
    int64_t shape[MOE_MAX_DIMS];
    const void *data;
    size_t nbytes; /* == product(shape) * dtype size */
} moe_tensor;

/* moe_tensor_read decodes a tensor map (keys in any order, unknown keys
 * rejected). Validates dtype, 1 <= ndim <= MOE_MAX_DIMS, every dim >= 0,
 * product * elsize without overflow, data length == product * elsize.
 * Errors: MOE_EPROTO (not a map, truncated), MOE_EINVAL (bad dtype/shape/len). */
moe_err moe_tensor_read(mp_reader *r, moe_tensor *t, mp_errbuf *eb);
/* moe_tensor_write encodes t (its data is copied into the writer). If t is
 * not valid (dtype, ndim, dims, nbytes != numel * elsize, nbytes >= 4 GiB)
 * nothing useful can be encoded: w->failed is set. */
void moe_tensor_write(mp_writer *w, const moe_tensor *t);
/* moe_tensor_write_reserve encodes a tensor map of the given dtype and shape
 * (ndim dims) and returns where the caller writes its numel * elsize data
 * bytes (valid until the next write; no second copy). Returns NULL and sets
 * w->failed if the shape is invalid or the buffer cannot grow. */
void *moe_tensor_write_reserve(mp_writer *w, moe_dtype dtype, int ndim, const int64_t *shape);
/* moe_tensor_write_head writes a tensor map whose data bin header ends the
 * writer: the caller appends the returned number of data bytes itself (e.g.
 * straight into the message it sends). 0 with w->failed on a bad shape. */
size_t moe_tensor_write_head(mp_writer *w, moe_dtype dtype, int ndim, const int64_t *shape);
/* moe_tensor_numel returns the product of the shape; -1 if ndim is out of
 * 1..MOE_MAX_DIMS, a dim is negative, or the product overflows int64. */
int64_t moe_tensor_numel(const moe_tensor *t);

/* ---- msgpack-rpc framing ---- */

typedef struct moe_rpc_request {
    uint32_t msgid;
    const char *method; /* points into the message buffer; not NUL terminated */
    uint32_t method_len;
    mp_reader params; /* positioned at the params map's first key */
    uint32_t nparams; /* number of key/value pairs in the params map */
} moe_rpc_request;

/* moe_rpc_parse_request parses a whole message. On success req->params is
 * positioned inside the params map. Errors: MOE_ETOOBIG if len > max_len,
 * MOE_EPROTO otherwise (with a reason in eb). *msgid_out is set whenever the
 * msgid could be read (so the error response can echo it), else left 0. */
moe_err moe_rpc_parse_request(const void *buf, size_t len, size_t max_len, moe_rpc_request *req,
                              uint32_t *msgid_out, mp_errbuf *eb);

#define MOE_RPC_MAX_GONE 8
typedef struct moe_rpc_response {
    uint32_t msgid;
    moe_err err;        /* MOE_OK when the error field is nil */
    const char *errmsg; /* points into the buffer when err != MOE_OK */
    uint32_t errmsg_len;
    int ngone;                  /* the error's "gone": workers known dead (ranks), */
    int gone[MOE_RPC_MAX_GONE]; /* the first MOE_RPC_MAX_GONE of them */
    mp_reader result;           /* positioned at the result value */
} moe_rpc_response;

/* moe_rpc_parse_response parses a response message (client side). */
moe_err moe_rpc_parse_response(const void *buf, size_t len, moe_rpc_response *resp, mp_errbuf *eb);

/* moe_rpc_write_request writes the header [0, msgid, method, [ and the
 * caller then writes exactly one params value (a map). */
void moe_rpc_write_request_head(mp_writer *w, uint32_t msgid, const char *method);
/* moe_rpc_write_response_ok writes [1, msgid, nil, and the caller writes
 * exactly one result value. */
void moe_rpc_write_response_ok_head(mp_writer *w, uint32_t msgid);
/* moe_rpc_write_response_err writes a complete error response. */
void moe_rpc_write_response_err(mp_writer *w, uint32_t msgid, moe_err err, const char *message);
/* moe_rpc_write_response_err_gone: the same with "gone": [rank, ...] in the
 * error object (docs/PROTOCOL.md, "Error object"): the workers of the
 * generation that the coordinator knows dead, so that a client stops
 * waiting for their rows at once */
void moe_rpc_write_response_err_gone(mp_writer *w, uint32_t msgid, moe_err err, const char *message,
                                     const int *gone, int ngone);

#endif /* MOE_PROTO_H */
