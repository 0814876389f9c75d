/*
 * hfcfg.h - a Hugging Face model directory as published: the MoE
 * configuration in its config.json, the names of its router and expert
 * tensors, and which file holds each tensor (model.safetensors, or the
 * shards listed by model.safetensors.index.json). The coordinator checks a
 * directory with these before a model is created; every worker reads the
 * same files with the same code to find its own experts' tensors.
 *
 * Families (docs/OPERATIONS.md, "Hugging Face models"): mixtral, qwen3_moe,
 * olmoe - softmax routing over all experts, top-k, renormalised or not,
 * SwiGLU experts; qwen2_moe - the same plus a shared expert behind a
 * sigmoid gate; deepseek_v3 - sigmoid scoring with a correction bias,
 * group-limited top-k, a scale, and shared experts. Other families
 * (deepseek_v2, kimi_k2 ...) are refused naming the family.
 */
#ifndef MOE_HFCFG_H
#define MOE_HFCFG_H

#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"

#define HF_MAX_LAYERS 1024

typedef enum hf_family {
    HF_NONE = 0,
    HF_MIXTRAL,
    HF_QWEN3_MOE,
    HF_OLMOE,
    HF_QWEN2_MOE,
    HF_DEEPSEEK_V3,
    HF_FAMILY_LAST = HF_DEEPSEEK_V3
} hf_family;

/* which tensor of a layer: the router, an expert's gate (w1), up (w3),
 * down (w2) projection; the router's correction bias (E) (deepseek_v3);
 * the shared expert's gate, up, down projections (qwen2_moe, deepseek_v3:
 * the n_shared_experts stacked as one); the shared expert's gate (1,H)
 * (qwen2_moe). The expert index is ignored for all but HF_GATE..HF_DOWN. */
typedef enum hf_mat {
    HF_ROUTER = 0,
    HF_GATE,
    HF_UP,
    HF_DOWN,
    HF_BIAS,
    HF_SH_GATE,
    HF_SH_UP,
    HF_SH_DOWN,
    HF_SH_GATEW
} hf_mat;

typedef struct hf_cfg {
    hf_family family;
    char model_type[32];
    int n_layers;           /* num_hidden_layers */
    int n_moe;              /* MoE layers */
    int moe[HF_MAX_LAYERS]; /* (n_moe) the model's index of each MoE layer, ascending */
    int H, F, E, K;
    int renormalize; /* norm_topk_prob (Mixtral: always) */
    /* routing family (common/model_cfg.h); zero for the softmax families */
    int scoring;         /* 1: sigmoid (deepseek_v3) */
    int score_bias;      /* e_score_correction_bias (deepseek_v3) */
    int n_group;         /* 1 = none */
    int topk_group;      /* 1..n_group */
    double routed_scale; /* routed_scaling_factor (1 unless deepseek_v3) */
    int Fs;              /* the shared expert's d_ff, 0 = none */
    int shared_gate;     /* the shared expert is gated (qwen2_moe) */
    double router_aux_loss_coef;
    int dtype_known; /* config.json names a dtype ("dtype" or "torch_dtype") */
    char dtype[16];  /* "bfloat16", "float16", "float32" */
} hf_cfg;

/* hf_family_name: "mixtral", "qwen3_moe", "olmoe", "qwen2_moe",
 * "deepseek_v3" (NULL for HF_NONE). */
const char *hf_family_name(hf_family f);
/* hf_family_parse: the family of a name as hf_family_name writes it. */
hf_family hf_family_parse(const char *s);

/* hf_cfg_read reads DIR/config.json into out. Errors (MOE_EINVAL, MOE_EIO)
 * say which key is missing or bad and which family was detected. */
moe_err hf_cfg_read(const char *dir, hf_cfg *out, char *err, size_t errlen);

/* hf_tensor_name writes the name of tensor `mat` of expert `expert` (used
 * by HF_GATE..HF_DOWN only) of the model's layer `layer` (its own index,
 * not the MoE layer's). */
void hf_tensor_name(hf_family f, int layer, int expert, hf_mat mat, char *out, size_t len);
/* hf_tensor_shape: the shape config.json implies for mat, (rows, cols);
 * returns its rank (1 for HF_BIAS: shape[0] = E). */
int hf_tensor_shape(const hf_cfg *c, hf_mat mat, int64_t shape[2]);
/* hf_cfg_has: 1 when the family's layers have tensor mat (the router and
 * the experts always; the bias, the shared expert, its gate per config). */
int hf_cfg_has(const hf_cfg *c, hf_mat mat);

/* hf_files: where each tensor of a directory lives. */
typedef struct hf_files hf_files;
/* hf_files_open reads DIR/model.safetensors.index.json (weight_map), or
 * else takes DIR/model.safetensors as the one file. File names must be
 * plain names (no '/'). Nothing is mapped yet. */
moe_err hf_files_open(const char *dir, hf_files **out, char *err, size_t errlen);
void hf_files_close(hf_files *h);
/* hf_files_count / hf_files_name: the distinct files, in first-seen order. */
int hf_files_count(const hf_files *h);
const char *hf_files_name(const hf_files *h, int i);
/* hf_files_find: the index of the file holding tensor name, -1 if none
 * names it (with a single model.safetensors: 0, found or not). */
int hf_files_find(const hf_files *h, const char *name);
/* hf_files_tensor / hf_files_ntensors: the tensor names the index lists,
 * sorted (none for a single model.safetensors). */
const char *hf_files_tensor(const hf_files *h, int i);
int hf_files_ntensors(const hf_files *h);

struct st_tensor;
struct st_file;

/* ---- hfread.c: the tensors of the MoE layers, checked against config.json ---- */
typedef struct hf_reader hf_reader;
/* hf_reader_open prepares to read DIR's tensors (files open on first use,
 * mapped, header only: data pages are read when touched). Every file read
 * must resolve under one of roots (nroots of them; symlinks included). */
moe_err hf_reader_open(const char *dir, const hf_cfg *cfg, const char *const *roots, int nroots,
                       hf_reader **out, char *err, size_t errlen);
void hf_reader_close(hf_reader *r);
/* hf_reader_get finds matrix mat of expert `expert` of the model's layer
 * `layer` and checks it: present (in the file the index names, which must
 * exist and be a whole safetensors file), dtype F32, BF16 or F16 and the
 * one config.json names (HF_BIAS: any of the three; DeepSeek-V3 keeps it
 * in F32 beside BF16 weights), shape as config.json implies. *t points into the
 * mapped file until hf_reader_close. Errors name the file and the tensor. */
moe_err hf_reader_get(hf_reader *r, int layer, int expert, hf_mat mat, const struct st_tensor **t,
                      char *err, size_t errlen);
/* hf_reader_file: the file (within DIR) that holds a tensor, "" if none. */
const char *hf_reader_file(const hf_reader *r, const char *tensor);
/* hf_reader_files: the index of files, for copying the other tensors. */
const hf_files *hf_reader_files(const hf_reader *r);
/* hf_reader_file_open returns file i of hf_reader_files, opened (cached). */
moe_err hf_reader_file_open(hf_reader *r, int i, struct st_file **f, char *err, size_t errlen);

#endif
