/*
 * fanout.h - libmoe's half of a fan-out forward (internal; docs/PROTOCOL.md
 * "Data plane", 6): every worker of a cluster of CPU workers answered the
 * same T rows with the expert rows of the slots its experts own; these
 * read one worker's answer, put the parts together into y with the layer's
 * own sum (common/combine.c), and merge the workers' stats. The transport
 * (sending, waiting) is client_dp.c's.
 */
#ifndef MOE_CLIENT_FANOUT_H
#define MOE_CLIENT_FANOUT_H

#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"
#include "proto/proto.h"

/* moe_fanout_part: one worker's answer; views into its message (valid
 * while the message is) */
typedef struct moe_fanout_part {
    int rank, top_k;
    moe_dtype dtype;      /* of rows and shared: f32 or bf16 (the model's) */
    const uint8_t *slots; /* (nslots) int32, little-endian, unaligned */
    size_t nslots;
    const uint8_t *rows;   /* (nslots, H) of dtype */
    const uint8_t *topk_w; /* (T, top_k) float32 */
    size_t ntopk;
    const uint8_t *shared; /* (rows, H) of dtype from token shared_row0 on, or NULL (a
                            * model with a shared expert: each worker's shard of the tokens) */
    size_t shared_len;
    int64_t shared_row0;
    size_t rows_len;
    const uint8_t *stats; /* the encoded stats map, or NULL */
    size_t stats_len;
} moe_fanout_part;

/* moe_fanout_read reads a data.rows answer {fanout: {...}, stats} at r.
 * MOE_EPROTO (reason in msg) for anything else. */
moe_err moe_fanout_read(mp_reader *r, moe_fanout_part *p, char *msg, size_t msglen);

/* moe_fanout_combine checks that the W parts name every slot of T tokens
 * exactly once, with the same top-k weights, and writes y (T,H) of dtype
 * dt (f32 or bf16) into out. MOE_EPROTO (reason in msg) for parts that do
 * not fit together; MOE_ENOMEM. */
moe_err moe_fanout_combine(const moe_fanout_part *parts, int W, int64_t T, int64_t H, moe_dtype dt,
                           void *out, char *msg, size_t msglen);

/* moe_fanout_stats writes the call's stats value into w: rank 0's, with
 * "dropped" summed over the parts (each counts its own experts). Returns 0,
 * or -1 when rank 0 sent none. */
int moe_fanout_stats(const moe_fanout_part *parts, int W, mp_writer *w);

#endif
