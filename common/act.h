/*
 * act.h - the expert activations by name: one id each (act_id) and one row
 * each in act_rows (common/act.c): its name on the wire, in configs and in
 * checkpoints, and whether it is gated. A gated activation takes two
 * pre-activations, h = f(a) * b with a = x w1^T and b = x w3^T, so its
 * experts hold a third matrix w3 (the up projection); an ungated one takes
 * h = f(a) and has no w3.
 *
 * The kernels' forward and backward of each id sit in a table of the same
 * length in kernels/act.c (a static assertion ties the two together).
 * Adding an activation: an id here, a row in common/act.c, a pair of
 * functions and a row in kernels/act.c.
 */
#ifndef MOE_COMMON_ACT_H
#define MOE_COMMON_ACT_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The activations; the values are stored in model_cfg.act (0 swiglu). */
typedef enum act_id {
    ACT_SWIGLU = 0, /* silu(a) * b, gated */
    ACT_GELU = 1,   /* gelu(a), erf form */
    ACT_COUNT       /* the number of rows, not an activation */
} act_id;

/* One activation's description: its name and whether it needs w3. */
typedef struct act_row {
    const char *name; /* lower case, at most ACT_NAME_MAX - 1 characters */
    int gated;        /* 1: h = f(a) * b (w1, w3, w2); 0: h = f(a) (w1, w2) */
} act_row;

#define ACT_NAME_MAX 16

/* act_rows: one row per act_id, in id order. */
extern const act_row act_rows[ACT_COUNT];

/* act_valid: 1 if act names a row (0 <= act < ACT_COUNT), else 0. */
int act_valid(int act);
/* act_name: the row's name, or "?" for an id that names no row (never
 * NULL, so it can go straight into a message). */
const char *act_name(int act);
/* act_gated: 1 if the activation is gated (its experts hold w3), else 0
 * (also 0 for an id that names no row). */
int act_gated(int act);
/* act_parse: the id named name (exact, case-sensitive), or -1. */
int act_parse(const char *name);
/* act_names: the names as a list for messages ("\"swiglu\", \"gelu\"")
 * into buf (len bytes, truncated if short); returns buf. */
char *act_names(char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
