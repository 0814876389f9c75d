/*
 * bulk_wire.h - the headers of the data plane's bulk path: large rows over a
 * plain TCP connection, beside the nng endpoint that keeps the control
 * (docs/PROTOCOL.md, "Data plane", "7. Bulk rows"). Every field is
 * little-endian; the codecs below never trust a field they did not check.
 *
 * Client -> worker, once per transfer (64 bytes), then auth_len bytes of
 * the auth token, then nbytes of rows (R, H) in row-major order:
 *
 *   off size field
 *     0    4 magic    "MOEB" (4d 4f 45 42)
 *     4    2 version  1
 *     6    2 auth_len 0..255
 *     8    8 cid      the ticket [cid, seq]
 *    16    8 seq
 *    24    4 dtype    0 f32, 1 bf16, 2 f16
 *    28    4 zero
 *    32    8 rows     R, 1 .. 2^31
 *    40    8 cols     H, 1 .. 2^20
 *    48    8 nbytes   R x H x element size (of the whole transfer)
 *    56    2 part     0 .. parts - 1
 *    58    2 parts    0 or 1: one connection carries all R rows; 2 ..
 *                     MOE_BULK_MAX_PARTS (and <= R): the rows are split over
 *                     that many connections, part p carrying rows
 *                     [R p / parts, R (p + 1) / parts) (moe_bulk_part_rows)
 *    60    4 zero
 *
 * Worker -> client (48 bytes), then msg_len bytes of message (errors) or
 * nbytes of rows (kind y):
 *
 *     0    4 magic    "MOEB"
 *     4    2 version  1
 *     6    2 kind     1 ack (rows received), 2 y (rows follow), 3 error
 *     8    4 status   0, or the moe_err number of the error
 *    12    4 msg_len  0 .. 1024 (error text, UTF-8)
 *    16    8 cid
 *    24    8 seq
 *    32    8 rows     (kind ack, y) R - of this part for a split transfer
 *    40    8 nbytes   (kind ack, y) its bytes (kind y: the rows that follow)
 */
#ifndef MOE_PROTO_BULK_WIRE_H
#define MOE_PROTO_BULK_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"

#define MOE_BULK_MAGIC     0x42454f4du /* "MOEB" read as a little-endian uint32 */
#define MOE_BULK_VERSION   1
#define MOE_BULK_REQ_LEN   64
#define MOE_BULK_REP_LEN   48
#define MOE_BULK_AUTH_MAX  255
#define MOE_BULK_MSG_MAX   1024
#define MOE_BULK_MAX_ROWS  (1ll << 31)
#define MOE_BULK_MAX_COLS  (1ll << 20)
#define MOE_BULK_MAX_PARTS 16 /* connections one transfer may be split over */

enum { MOE_BULK_ACK = 1, MOE_BULK_Y = 2, MOE_BULK_ERR = 3 };

/* moe_bulk_req: the client's header, decoded */
typedef struct moe_bulk_req {
    uint32_t magic;
    uint16_t version, auth_len;
    uint64_t cid, seq;
    uint32_t dtype;
    int64_t rows, cols;
    uint64_t nbytes;
    uint16_t part, parts; /* parts 0 on the wire reads as 1 */
} moe_bulk_req;

/* moe_bulk_rep: the worker's header, decoded */
typedef struct moe_bulk_rep {
    uint32_t magic;
    uint16_t version, kind;
    uint32_t status, msg_len;
    uint64_t cid, seq;
    int64_t rows;
    uint64_t nbytes;
} moe_bulk_rep;

/* moe_bulk_req_encode writes h into out (MOE_BULK_REQ_LEN bytes). */
void moe_bulk_req_encode(const moe_bulk_req *h, uint8_t *out);
/* moe_bulk_req_decode reads MOE_BULK_REQ_LEN bytes and checks them: magic
 * and version (MOE_EPROTO), dtype, rows, cols, auth_len, nbytes = rows x
 * cols x element size and the reserved bytes zero (MOE_EINVAL); nbytes
 * over max_bytes is MOE_ETOOBIG. The reason goes to err. */
moe_err moe_bulk_req_decode(const uint8_t *in, uint64_t max_bytes, moe_bulk_req *h, char *err,
                            size_t errlen);
/* moe_bulk_part_rows: the rows [*row0, *row0 + *nrows) that part `part`
 * of a transfer of rows rows split in parts parts carries. */
void moe_bulk_part_rows(int64_t rows, int parts, int part, int64_t *row0, int64_t *nrows);
/* moe_bulk_rep_encode writes h into out (MOE_BULK_REP_LEN bytes). */
void moe_bulk_rep_encode(const moe_bulk_rep *h, uint8_t *out);
/* moe_bulk_rep_decode reads MOE_BULK_REP_LEN bytes: MOE_EPROTO for a bad
 * magic, version, kind or msg_len. */
moe_err moe_bulk_rep_decode(const uint8_t *in, moe_bulk_rep *h);

/* moe_bulk_url_split splits "tcp://host:port" (host may be [v6]) into
 * host (brackets removed) and port; MOE_EINVAL for another form. */
moe_err moe_bulk_url_split(const char *url, char *host, size_t hostlen, char *port, size_t portlen);

#endif
