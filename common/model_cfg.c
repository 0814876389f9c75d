/* model_cfg.c - model.create params; see model_cfg.h. */
#include "model_cfg.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "hfcfg.h"
#include "params.h"

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

moe_err model_cfg_parse(mp_reader *r, uint32_t nparams, model_cfg *out, char *err, size_t errlen)
{
    int64_t layers = 0, H = 0, F = 0, E = 0, K = 0, renorm = 0, seed = 0;
    double cf = 0, aux = 0.01, z = 0;
    char act[16] = "swiglu", dtype[8] = "f32";
    bool renorm_b = false;
    pspec sp[] = {
        {"name", P_STR, out->name, true, 0, 0, MODEL_NAME_MAX, false},
        {"layers", P_INT, &layers, true, 1, 1024, 0, false},
        {"d_model", P_INT, &H, true, 1, 65536, 0, false},
        {"d_ff", P_INT, &F, true, 1, 262144, 0, false},
        {"n_experts", P_INT, &E, true, 1, 4096, 0, false},
        {"top_k", P_INT, &K, true, 1, 4096, 0, false},
        {"activation", P_STR, act, false, 0, 0, sizeof(act), false},
        {"renormalize", P_BOOL, &renorm_b, false, 0, 0, 0, false},
        {"capacity_factor", P_F64, &cf, false, 0, 1000, 0, false},
        {"dtype", P_STR, dtype, false, 0, 0, sizeof(dtype), false},
        {"seed", P_INT, &seed, false, 0, 9.2e18, 0, false},
        {"aux_loss_coef", P_F64, &aux, false, 0, 1000, 0, false},
        {"z_loss_coef", P_F64, &z, false, 0, 1000, 0, false},
        {"hf_dir", P_STR, out->hf_dir, false, 0, 0, MODEL_HF_DIR_MAX, false},
        {"hf_family", P_STR, out->hf_family, false, 0, 0, sizeof(out->hf_family), false},
    };
    moe_err e = params_parse(r, nparams, sp, (int)(sizeof(sp) / sizeof(sp[0])), err, errlen);
    if (e != MOE_OK)
        return e;
    if (!model_name_valid(out->name, strlen(out->name))) {
        snprintf(err, errlen,
                 "model name must be 1-63 characters of [A-Za-z0-9_.-], not \".\" "
                 "or \"..\"");
        return MOE_EINVAL;
    }
    if ((out->hf_dir[0] != 0) != (out->hf_family[0] != 0) ||
        (out->hf_family[0] && hf_family_parse(out->hf_family) == HF_NONE) ||
        (out->hf_dir[0] && out->hf_dir[0] != '/')) {
        snprintf(err, errlen,
                 "hf_dir and hf_family go together (an absolute directory and "
                 "mixtral, qwen3_moe or olmoe)");
        return MOE_EINVAL;
    }
    if (K > E) {
        snprintf(err, errlen, "top_k = %lld is larger than n_experts = %lld", (long long)K,
                 (long long)E);
        return MOE_EINVAL;
    }
    if (strcmp(act, "swiglu") == 0)
        out->act = 0;
    else if (strcmp(act, "gelu") == 0)
        out->act = 1;
    else {
        snprintf(err, errlen, "activation must be \"swiglu\" or \"gelu\", not \"%s\"", act);
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
    renorm = renorm_b;
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
    int hf = c->hf_dir[0] != 0;
    mp_write_map(w, 13 + 2 * hf);
    if (hf) {
        mp_write_cstr(w, "hf_dir");
        mp_write_cstr(w, c->hf_dir);
        mp_write_cstr(w, "hf_family");
        mp_write_cstr(w, c->hf_family);
    }
    mp_write_cstr(w, "name");
    mp_write_cstr(w, c->name);
    mp_write_cstr(w, "layers");
    mp_write_i64(w, c->layers);
    mp_write_cstr(w, "d_model");
    mp_write_i64(w, c->d_model);
    mp_write_cstr(w, "d_ff");
    mp_write_i64(w, c->d_ff);
    mp_write_cstr(w, "n_experts");
    mp_write_i64(w, c->n_experts);
    mp_write_cstr(w, "top_k");
    mp_write_i64(w, c->top_k);
    mp_write_cstr(w, "activation");
    mp_write_cstr(w, c->act ? "gelu" : "swiglu");
    mp_write_cstr(w, "renormalize");
    mp_write_bool(w, c->renormalize != 0);
    mp_write_cstr(w, "capacity_factor");
    mp_write_f64(w, c->capacity_factor);
    mp_write_cstr(w, "dtype");
    mp_write_cstr(w, moe_dtype_name(c->dtype));
    mp_write_cstr(w, "seed");
    mp_write_i64(w, (int64_t)c->seed);
    mp_write_cstr(w, "aux_loss_coef");
    mp_write_f64(w, c->aux_loss_coef);
    mp_write_cstr(w, "z_loss_coef");
    mp_write_f64(w, c->z_loss_coef);
}

int model_cfg_same(const model_cfg *a, const model_cfg *b)
{
    return strcmp(a->name, b->name) == 0 && a->layers == b->layers && a->d_model == b->d_model &&
           a->d_ff == b->d_ff && a->n_experts == b->n_experts && a->top_k == b->top_k &&
           a->act == b->act && a->renormalize == b->renormalize &&
           a->capacity_factor == b->capacity_factor && a->dtype == b->dtype && a->seed == b->seed &&
           a->aux_loss_coef == b->aux_loss_coef && a->z_loss_coef == b->z_loss_coef &&
           strcmp(a->hf_dir, b->hf_dir) == 0 && strcmp(a->hf_family, b->hf_family) == 0;
}

int64_t model_cfg_params(const model_cfg *c)
{
    int64_t per_expert = (int64_t)c->d_model * c->d_ff * (c->act == 0 ? 3 : 2);
    return (int64_t)c->layers * ((int64_t)c->n_experts * c->d_model + c->n_experts * per_expert);
}
