/*
 * model_cfg.h - the configuration of one model (a stack of MoE layers), as
 * model.create takes it. Parsed and validated once at the coordinator, sent
 * to every worker in the same encoding.
 */
#ifndef MOE_MODEL_CFG_H
#define MOE_MODEL_CFG_H

#include <stddef.h>
#include <stdint.h>

#include "common/act.h"
#include "proto/proto.h"

#define MODEL_NAME_MAX   64
#define MODEL_HF_DIR_MAX 256

typedef struct model_cfg {
    char name[MODEL_NAME_MAX];
    int layers;             /* MoE layers, 1..1024 */
    int d_model;            /* H */
    int d_ff;               /* F */
    int n_experts;          /* E, 1..4096 */
    int top_k;              /* K, 1..E */
    int act;                /* act_id (common/act.h): 0 swiglu, 1 gelu */
    int renormalize;        /* 0/1 */
    double capacity_factor; /* 0 = dropless */
    moe_dtype dtype;        /* MOE_F32 or MOE_BF16 */
    uint64_t seed;
    double aux_loss_coef;
    double z_loss_coef;
    /* routing family (kernels/kern.h kern_route_cfg; docs/PROTOCOL.md):
     * the defaults (0, 0, 1, 1, 2, 1.0, 0, 0) are softmax top-k */
    int scoring;         /* kern_scoring: 0 softmax, 1 sigmoid */
    int score_bias;      /* 0/1: a per-expert choice bias (e_score_correction_bias) */
    int n_group;         /* expert groups, 1 = none; divides n_experts */
    int topk_group;      /* groups kept per token, 1..n_group */
    int group_topn;      /* a group's score: the sum of its 1 or 2 best */
    double routed_scale; /* routed_scaling_factor, > 0 */
    int shared_d_ff;     /* d_ff of the shared expert(s), 0 = none */
    int shared_gate;     /* 0/1: the shared expert is gated by sigmoid(x . w) */
    /* a model loaded from a Hugging Face directory (server/hf.c): the
     * directory, resolved under the checkpoint root, and its family
     * ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3"); both ""
     * otherwise. Set by the coordinator (model.create from_hf), never by
     * a client. */
    char hf_dir[MODEL_HF_DIR_MAX];
    char hf_family[16];
} model_cfg;

/* model_cfg_shared_tensors: the trainable shared-expert tensors of a
 * layer: its gate, (up,) down projections, then its sigmoid gate, each
 * when the config has it (0 without a shared expert). */
static inline int model_cfg_shared_tensors(const model_cfg *c)
{
    return (c->shared_d_ff > 0 ? (act_gated(c->act) ? 3 : 2) : 0) + (c->shared_gate ? 1 : 0);
}

/* model_name_valid: 1-63 characters of [A-Za-z0-9_.-], not "." or ".."
 * (docs/PROTOCOL.md, model.create). */
int model_name_valid(const char *s, size_t len);
/* model_cfg_parse reads model.create params (r inside the map) and validates
 * every field. extra_specs (may be NULL) are accepted too (e.g. "worker"
 * fields); err gets a message naming the bad field. */
moe_err model_cfg_parse(mp_reader *r, uint32_t nparams, model_cfg *out, char *err, size_t errlen);
/* model_cfg_write writes the config as a params map (the model.create form). */
void model_cfg_write(mp_writer *w, const model_cfg *c);
/* model_cfg_write_request writes model.create's params as a client sends
 * them: the keys whose values are set (a NaN double or a NULL / empty
 * string is left out: the coordinator's default applies). MOE_EINVAL when a
 * string is too long. */
moe_err model_cfg_write_request(mp_writer *w, const char *name, int64_t layers, int64_t d_model,
                                int64_t d_ff, int64_t n_experts, int64_t top_k,
                                const char *activation, int renormalize, double capacity_factor,
                                const char *dtype, uint64_t seed, double aux_loss_coef,
                                double z_loss_coef);
/* model_cfg_same: equal in every field. */
int model_cfg_same(const model_cfg *a, const model_cfg *b);
/* model_cfg_routing_extra: NULL for the softmax top-k routing without a
 * shared expert (what every path computes), else the first knob beyond it
 * ("sigmoid scoring", "score_bias", "n_group", "routed_scaling_factor",
 * "shared expert"), for the paths that have only the plain routing. */
const char *model_cfg_routing_extra(const model_cfg *c);
/* model_cfg_params: parameter count (router + all experts, all layers). */
int64_t model_cfg_params(const model_cfg *c);

#endif
