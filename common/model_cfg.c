/* model_cfg.c - model.create params; see model_cfg.h. */
#include "common/model_cfg.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/hfcfg.h"
#include "common/params.h"

int model_name_valid(const char *s, size_t len)
{
    if (len == 0 || len >= MODEL_NAME_MAX)
        return 0;
    /* a name is a directory under --checkpoint-dir: never "." or ".." */
    if ((len == 1 && s[0] == '.') || (len == 2 && s[0] == '.' && s[1] == '.'))
        return 0;
    for (size_t i = 0; i < len; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-' && s[i] != '.')
            return 0;
    return 1;
}

/* cfg_wire: model.create's params in the wire's types; cfg_specs makes the
 * one spec that both reads (model_cfg_parse) and writes (model_cfg_write,
 * libmoe's moe_model_create) them */
typedef struct cfg_wire {
    char name[MODEL_NAME_MAX];
    int64_t layers, H, F, E, K, seed;
    double cf, aux, z;
    char act[ACT_NAME_MAX], dtype[8];
    bool renorm;
    char scoring[16];
    bool score_bias, shared_gate;
    int64_t n_group, topk_group, group_topn, shared_F;
    double rscale;
    char hf_dir[MODEL_HF_DIR_MAX], hf_family[16]; /* "" = not from a directory (unset) */
} cfg_wire;
#define CFG_NSPECS 23

static void cfg_specs(pspec sp[CFG_NSPECS], cfg_wire *v)
{
    const pspec s[CFG_NSPECS] = {
        {"name", P_STR, v->name, true, 0, 0, MODEL_NAME_MAX, false},
        {"layers", P_INT, &v->layers, true, 1, 1024, 0, false},
        {"d_model", P_INT, &v->H, true, 1, 65536, 0, false},
        {"d_ff", P_INT, &v->F, true, 1, 262144, 0, false},
        {"n_experts", P_INT, &v->E, true, 1, 4096, 0, false},
        {"top_k", P_INT, &v->K, true, 1, 4096, 0, false},
        {"activation", P_STR, v->act, false, 0, 0, sizeof(v->act), false},
        {"renormalize", P_BOOL, &v->renorm, false, 0, 0, 0, false},
        {"capacity_factor", P_F64, &v->cf, false, 0, 1000, 0, false},
        {"dtype", P_STR, v->dtype, false, 0, 0, sizeof(v->dtype), false},
        {"seed", P_INT, &v->seed, false, 0, 9.2e18, 0, false},
        {"aux_loss_coef", P_F64, &v->aux, false, 0, 1000, 0, false},
        {"z_loss_coef", P_F64, &v->z, false, 0, 1000, 0, false},
        {"hf_dir", P_STR, v->hf_dir, false, 0, 0, MODEL_HF_DIR_MAX, false},
        {"hf_family", P_STR, v->hf_family, false, 0, 0, sizeof(v->hf_family), false},
        {"scoring", P_STR, v->scoring, false, 0, 0, sizeof(v->scoring), false},
        {"score_bias", P_BOOL, &v->score_bias, false, 0, 0, 0, false},
        {"n_group", P_INT, &v->n_group, false, 0, 256, 0, false},
        {"topk_group", P_INT, &v->topk_group, false, 0, 256, 0, false},
        {"group_topn", P_INT, &v->group_topn, false, 0, 2, 0, false},
        {"routed_scaling_factor", P_F64, &v->rscale, false, 0, 1e6, 0, false},
        {"shared_d_ff", P_INT, &v->shared_F, false, 0, 262144, 0, false},
        {"shared_gate", P_BOOL, &v->shared_gate, false, 0, 0, 0, false},
    };
    memcpy(sp, s, sizeof(s));
}

moe_err model_cfg_parse(mp_reader *r, uint32_t nparams, model_cfg *out, char *err, size_t errlen)
{
    /* the protocol's defaults (docs/PROTOCOL.md, model.create) */
    cfg_wire v = {.cf = 0,
                  .aux = 0.01,
                  .z = 0,
                  .act = "swiglu", /* act_rows[ACT_SWIGLU] */
                  .dtype = "f32",
                  .scoring = "softmax",
                  .rscale = 1.0};
    pspec sp[CFG_NSPECS];
    cfg_specs(sp, &v);
    int64_t layers, H, F, E, K, renorm, seed;
    double cf, aux, z;
    char *act = v.act, *dtype = v.dtype;
    moe_err e = params_parse(r, nparams, sp, CFG_NSPECS, err, errlen);
    if (e != MOE_OK)
        return e;
    memcpy(out->name, v.name, sizeof(out->name));
    memcpy(out->hf_dir, v.hf_dir, sizeof(out->hf_dir));
    memcpy(out->hf_family, v.hf_family, sizeof(out->hf_family));
    if ((out->hf_dir[0] != 0) != (out->hf_family[0] != 0) ||
        (out->hf_family[0] && hf_family_parse(out->hf_family) == HF_NONE) ||
        (out->hf_dir[0] && out->hf_dir[0] != '/')) {
        snprintf(err, errlen,
                 "hf_dir and hf_family go together (an absolute directory and "
                 "mixtral, qwen3_moe or olmoe)");
        return MOE_EINVAL;
    }
    layers = v.layers, H = v.H, F = v.F, E = v.E, K = v.K, seed = v.seed;
    cf = v.cf, aux = v.aux, z = v.z;
    if (!model_name_valid(out->name, strlen(out->name))) {
        snprintf(err, errlen,
                 "model name must be 1-63 characters of [A-Za-z0-9_.-], not \".\" "
                 "or \"..\"");
        return MOE_EINVAL;
    }
    if (K > E) {
        snprintf(err, errlen, "top_k = %lld is larger than n_experts = %lld", (long long)K,
                 (long long)E);
        return MOE_EINVAL;
    }
    out->act = act_parse(act);
    if (out->act < 0) {
        char names[128];
        snprintf(err, errlen, "activation must be one of %s, not \"%s\"",
                 act_names(names, sizeof(names)), act);
        return MOE_EINVAL;
    }
    if (moe_dtype_parse(dtype, strlen(dtype), &out->dtype) != MOE_OK || out->dtype == MOE_F16) {
        snprintf(err, errlen, "dtype must be \"f32\" or \"bf16\", not \"%s\"", dtype);
        return MOE_EINVAL;
    }
    /* Weights of one expert must fit comfortably in memory and in one message. */
    if ((double)H * (double)F * 3.0 > 4e9) {
        snprintf(err, errlen, "d_model * d_ff = %lld is too large for one expert",
                 (long long)(H * F));
        return MOE_EINVAL;
    }
    /* routing family: 0 means the default for the group knobs */
    if (strcmp(v.scoring, "softmax") == 0)
        out->scoring = 0;
    else if (strcmp(v.scoring, "sigmoid") == 0)
        out->scoring = 1;
    else {
        snprintf(err, errlen, "scoring must be \"softmax\" or \"sigmoid\", not \"%s\"", v.scoring);
        return MOE_EINVAL;
    }
    int64_t ng = v.n_group ? v.n_group : 1, tg = v.topk_group ? v.topk_group : ng;
    if (E % ng != 0) {
        snprintf(err, errlen, "n_group = %lld does not divide n_experts = %lld", (long long)ng,
                 (long long)E);
        return MOE_EINVAL;
    }
    if (tg > ng) {
        snprintf(err, errlen, "topk_group = %lld is larger than n_group = %lld", (long long)tg,
                 (long long)ng);
        return MOE_EINVAL;
    }
    if (K > tg * (E / ng)) {
        snprintf(err, errlen,
                 "top_k = %lld is larger than the experts of topk_group groups (%lld * %lld)",
                 (long long)K, (long long)tg, (long long)(E / ng));
        return MOE_EINVAL;
    }
    if (!(v.rscale > 0)) {
        snprintf(err, errlen, "routed_scaling_factor must be > 0, not %g", v.rscale);
        return MOE_EINVAL;
    }
    if (v.shared_gate && v.shared_F == 0) {
        snprintf(err, errlen, "shared_gate needs a shared expert (shared_d_ff > 0)");
        return MOE_EINVAL;
    }
    if ((double)H * (double)v.shared_F * 3.0 > 4e9) {
        snprintf(err, errlen, "d_model * shared_d_ff = %lld is too large for one expert",
                 (long long)(H * v.shared_F));
        return MOE_EINVAL;
    }
    out->score_bias = v.score_bias;
    out->n_group = (int)ng;
    out->topk_group = (int)tg;
    out->group_topn = v.group_topn ? (int)v.group_topn : 2;
    out->routed_scale = v.rscale;
    out->shared_d_ff = (int)v.shared_F;
    out->shared_gate = v.shared_gate;
    renorm = v.renorm;
    out->layers = (int)layers;
    out->d_model = (int)H;
    out->d_ff = (int)F;
    out->n_experts = (int)E;
    out->top_k = (int)K;
    out->renormalize = (int)renorm;
    out->capacity_factor = cf;
    out->seed = (uint64_t)seed;
    out->aux_loss_coef = aux;
    out->z_loss_coef = z;
    return MOE_OK;
}

void model_cfg_write(mp_writer *w, const model_cfg *c)
{
    cfg_wire v = {.layers = c->layers,
                  .H = c->d_model,
                  .F = c->d_ff,
                  .E = c->n_experts,
                  .K = c->top_k,
                  .seed = (int64_t)c->seed,
                  .cf = c->capacity_factor,
                  .aux = c->aux_loss_coef,
                  .z = c->z_loss_coef,
                  .renorm = c->renormalize != 0,
                  .score_bias = c->score_bias != 0,
                  .shared_gate = c->shared_gate != 0,
                  .n_group = c->n_group,
                  .topk_group = c->topk_group,
                  .group_topn = c->group_topn,
                  .shared_F = c->shared_d_ff,
                  .rscale = c->routed_scale};
    snprintf(v.scoring, sizeof(v.scoring), "%s", c->scoring ? "sigmoid" : "softmax");
    snprintf(v.name, sizeof(v.name), "%s", c->name);
    snprintf(v.act, sizeof(v.act), "%s", act_name(c->act));
    snprintf(v.dtype, sizeof(v.dtype), "%s", moe_dtype_name(c->dtype));
    snprintf(v.hf_dir, sizeof(v.hf_dir), "%s", c->hf_dir);
    snprintf(v.hf_family, sizeof(v.hf_family), "%s", c->hf_family);
    pspec sp[CFG_NSPECS];
    cfg_specs(sp, &v);
    params_write(w, sp, CFG_NSPECS);
}

moe_err model_cfg_write_request(mp_writer *w, const char *name, int64_t layers, int64_t d_model,
                                int64_t d_ff, int64_t n_experts, int64_t top_k,
                                const char *activation, int renormalize, double capacity_factor,
                                const char *dtype, uint64_t seed, double aux_loss_coef,
                                double z_loss_coef)
{
    cfg_wire v = {.layers = layers,
                  .H = d_model,
                  .F = d_ff,
                  .E = n_experts,
                  .K = top_k,
                  .seed = (int64_t)seed,
                  .cf = capacity_factor,
                  .aux = aux_loss_coef,
                  .z = z_loss_coef,
                  .renorm = renormalize != 0,
                  .rscale = NAN}; /* routing keys unset: the protocol's defaults */
    if (strlen(name) >= sizeof(v.name) || (activation && strlen(activation) >= sizeof(v.act)) ||
        (dtype && strlen(dtype) >= sizeof(v.dtype)))
        return MOE_EINVAL;
    snprintf(v.name, sizeof(v.name), "%s", name);
    snprintf(v.act, sizeof(v.act), "%s", activation ? activation : "");
    snprintf(v.dtype, sizeof(v.dtype), "%s", dtype ? dtype : "");
    pspec sp[CFG_NSPECS];
    cfg_specs(sp, &v);
    params_write(w, sp, CFG_NSPECS);
    return MOE_OK;
}

int model_cfg_same(const model_cfg *a, const model_cfg *b)
{
    return strcmp(a->name, b->name) == 0 && a->layers == b->layers && a->d_model == b->d_model &&
           a->d_ff == b->d_ff && a->n_experts == b->n_experts && a->top_k == b->top_k &&
           a->act == b->act && a->renormalize == b->renormalize &&
           a->capacity_factor == b->capacity_factor && a->dtype == b->dtype && a->seed == b->seed &&
           a->aux_loss_coef == b->aux_loss_coef && a->z_loss_coef == b->z_loss_coef &&
           a->scoring == b->scoring && a->score_bias == b->score_bias && a->n_group == b->n_group &&
           a->topk_group == b->topk_group && a->group_topn == b->group_topn &&
           a->routed_scale == b->routed_scale && a->shared_d_ff == b->shared_d_ff &&
           a->shared_gate == b->shared_gate && strcmp(a->hf_dir, b->hf_dir) == 0 &&
           strcmp(a->hf_family, b->hf_family) == 0;
}

const char *model_cfg_routing_extra(const model_cfg *c)
{
    if (c->scoring != 0)
        return "sigmoid scoring";
    if (c->score_bias)
        return "score_bias";
    if (c->n_group > 1)
        return "n_group";
    if (c->routed_scale != 1.0)
        return "routed_scaling_factor";
    if (c->shared_d_ff > 0)
        return "shared expert";
    return NULL;
}

int64_t model_cfg_params(const model_cfg *c)
{
    int nmat = act_gated(c->act) ? 3 : 2;
    int64_t per_expert = (int64_t)c->d_model * c->d_ff * nmat;
    int64_t shared =
        (int64_t)c->d_model * c->shared_d_ff * nmat + (c->shared_gate ? c->d_model : 0);
    return (int64_t)c->layers *
           ((int64_t)c->n_experts * c->d_model + c->n_experts * per_expert + shared);
}
