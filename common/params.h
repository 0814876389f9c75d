/*
 * params.h - declarative parsing of an RPC params map. Each spec names a key,
 * its type and where the value goes. Unknown keys, wrong types, duplicates,
 * missing required keys and out-of-range numbers are errors with a message
 * naming the key. "auth", "rid" and "cluster" are always accepted and skipped (checked
 * separately: the coordinator's dispatch and server/dedupe.c).
 */
#ifndef MOE_PARAMS_H
#define MOE_PARAMS_H

#include <stdbool.h>
#include <stdint.h>

#include "proto/proto.h"

typedef enum pspec_type {
    P_STR,    /* out: char[cap] (NUL terminated); longer values and values with an
               * embedded NUL are an error (invalid_argument) */
    P_INT,    /* out: int64_t, within [min, max] */
    P_U64,    /* out: uint64_t, any value 0 .. 2^64-1 (min, max ignored) */
    P_F64,    /* out: double, within [min, max] */
    P_BOOL,   /* out: bool */
    P_TENSOR, /* out: moe_tensor (a view into the message) */
    P_RAW,    /* out: mp_reader positioned at the value (the value is skipped) */
} pspec_type;

typedef struct pspec {
    const char *key;
    pspec_type type;
    void *out;
    bool required;
    double min, max; /* P_INT, P_F64 bounds (ignored when min == max == 0) */
    uint32_t cap;    /* P_STR buffer size */
    bool seen;       /* out: the key was present */
} pspec;

/* params_parse walks nparams pairs of r (positioned inside the map). */
moe_err params_parse(mp_reader *r, uint32_t nparams, pspec *specs, int nspecs, char *err,
                     size_t errlen);
/* params_write writes the map params_parse reads back: the specs' values
 * (from out) - every required key, and each optional one that is set: a
 * P_F64 that is not NaN, a P_STR that is not empty (P_INT and P_BOOL are
 * always set). An unset key is left out, so the reader's default applies.
 * P_TENSOR and P_RAW specs are not written. */
void params_write(mp_writer *w, const pspec *specs, int nspecs);
/* params_find_str finds a string value for key without consuming r (a
 * copy is walked). Returns false if absent or not a string. */
bool params_find_str(const mp_reader *r, uint32_t nparams, const char *key, const char **s,
                     uint32_t *len);

#endif
