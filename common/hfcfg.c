/* hfcfg.c - Hugging Face model directories; see hfcfg.h. */
#include "common/hfcfg.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"

#define HF_MAX_JSON (64u << 20)

const char *hf_family_name(hf_family f)
{
    switch (f) {
    case HF_MIXTRAL: return "mixtral";
    case HF_QWEN3_MOE: return "qwen3_moe";
    case HF_OLMOE: return "olmoe";
    case HF_QWEN2_MOE: return "qwen2_moe";
    case HF_DEEPSEEK_V3: return "deepseek_v3";
    default: return NULL;
    }
}

hf_family hf_family_parse(const char *s)
{
    for (int f = HF_MIXTRAL; f <= HF_FAMILY_LAST; f++)
        if (strcmp(s, hf_family_name((hf_family)f)) == 0)
            return (hf_family)f;
    return HF_NONE;
}

/* read_text reads a whole (small) file; NULL with errno when it cannot. */
static char *read_text(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = malloc(HF_MAX_JSON + 1);
    size_t n = buf ? fread(buf, 1, HF_MAX_JSON + 1, f) : 0;
    fclose(f);
    if (!buf || n > HF_MAX_JSON) {
        free(buf);
        errno = EFBIG;
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

/* families with routing this service does not compute yet */
static const struct {
    const char *type, *why;
} refused[] = {
    {"deepseek_v2", "shared experts and group-limited routing"},
    {"kimi_k2", "shared experts, sigmoid scoring with a correction bias, group-limited top-k"},
};

static int get_int(const json_node *root, const char *key, int *out)
{
    const json_node *v = json_get(root, key);
    if (!v || v->type != J_NUM || v->num != (double)(int)v->num)
        return 0;
    *out = (int)v->num;
    return 1;
}

/* get_num: a number key, dflt when absent; 0 when present but not a number */
static int get_num(const json_node *root, const char *key, double dflt, double *out)
{
    const json_node *v = json_get(root, key);
    *out = v && v->type == J_NUM ? v->num : dflt;
    return !v || v->type == J_NUM;
}

/* ds_routing reads DeepSeek-V3's routing keys. Absent keys take
 * transformers' DeepseekV3Config defaults (n_shared_experts 1, n_group 8,
 * topk_group 4, routed_scaling_factor 2.5, norm_topk_prob true);
 * scoring_func and topk_method, when present, must be sigmoid and
 * noaux_tc, what transformers computes. */
static moe_err ds_routing(const json_node *root, hf_cfg *out, const char *path, const char *type,
                          char *err, size_t errlen)
{
    static const struct {
        const char *key, *want;
    } fixed[] = {{"scoring_func", "sigmoid"}, {"topk_method", "noaux_tc"}};
    for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++) {
        const json_node *v = json_get(root, fixed[i].key);
        if (v && (v->type != J_STR || strcmp(v->str, fixed[i].want) != 0)) {
            snprintf(err, errlen, "%s (family %s): %s must be \"%s\" (the only one supported)",
                     path, type, fixed[i].key, fixed[i].want);
            return MOE_EINVAL;
        }
    }
    out->scoring = 1;
    out->score_bias = 1;
    double ns, ng, tg, sc;
    const char *bad = NULL;
    if (!get_num(root, "n_shared_experts", 1, &ns) || ns < 0 || ns != (double)(int)ns)
        bad = "n_shared_experts";
    else if (!get_num(root, "n_group", 8, &ng) || ng < 1 || ng != (double)(int)ng)
        bad = "n_group";
    else if (!get_num(root, "topk_group", 4, &tg) || tg < 1 || tg > ng || tg != (double)(int)tg)
        bad = "topk_group";
    else if (!get_num(root, "routed_scaling_factor", 2.5, &sc) || !(sc > 0))
        bad = "routed_scaling_factor";
    if (bad) {
        snprintf(err, errlen, "%s (family %s): bad key \"%s\"", path, type, bad);
        return MOE_EINVAL;
    }
    out->Fs = (int)ns * out->F;
    out->n_group = (int)ng;
    out->topk_group = (int)tg;
    out->routed_scale = sc;
    const json_node *nt = json_get(root, "norm_topk_prob");
    out->renormalize = !nt || (nt->type == J_BOOL && nt->num != 0);
    return MOE_OK;
}

moe_err hf_cfg_read(const char *dir, hf_cfg *out, char *err, size_t errlen)
{
    char path[4200];
    size_t n;
    memset(out, 0, sizeof(*out));
    snprintf(path, sizeof(path), "%s/config.json", dir);
    char *text = read_text(path, &n);
    if (!text) {
        snprintf(err, errlen, "%s: cannot read (%s): not a Hugging Face model directory", path,
                 strerror(errno));
        return MOE_EIO;
    }
    json_doc *doc = NULL;
    json_node *root;
    char jerr[200];
    moe_err e = json_parse(text, n, &doc, &root, jerr, sizeof(jerr));
    free(text);
    if (e != MOE_OK || root->type != J_OBJ) {
        snprintf(err, errlen, "%s: not a JSON object (%s)", path, e != MOE_OK ? jerr : "");
        json_free(doc);
        return MOE_EINVAL;
    }
    const json_node *mt = json_get(root, "model_type"), *ar = json_get(root, "architectures");
    const char *type = mt && mt->type == J_STR ? mt->str : NULL;
    const char *arch =
        ar && ar->type == J_ARR && ar->len && ar->kids[0].type == J_STR ? ar->kids[0].str : "";
    if (!type) { /* older files: the family from the architecture */
        if (strncmp(arch, "Mixtral", 7) == 0)
            type = "mixtral";
        else if (strncmp(arch, "Qwen3Moe", 8) == 0)
            type = "qwen3_moe";
        else if (strncmp(arch, "Olmoe", 5) == 0)
            type = "olmoe";
        else if (strncmp(arch, "Qwen2Moe", 8) == 0)
            type = "qwen2_moe";
        else if (strncmp(arch, "DeepseekV3", 10) == 0)
            type = "deepseek_v3";
    }
    e = MOE_EINVAL;
    if (!type) {
        snprintf(err, errlen, "%s: no model_type, and architectures (\"%s\") names no MoE family",
                 path, arch);
        goto out;
    }
    snprintf(out->model_type, sizeof(out->model_type), "%s", type);
    out->family = hf_family_parse(type);
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++)
        if (strcmp(type, refused[i].type) == 0) {
            snprintf(err, errlen, "%s: family %s is not supported yet (%s)", path, type,
                     refused[i].why);
            goto out;
        }
    if (out->family == HF_NONE) {
        snprintf(err, errlen,
                 "%s: model_type \"%s\" is not a supported MoE family (mixtral, qwen3_moe, "
                 "olmoe, qwen2_moe, deepseek_v3)",
                 path, type);
        goto out;
    }
    hf_family fam = out->family;
    const char *ekey = fam == HF_MIXTRAL       ? "num_local_experts"
                       : fam == HF_DEEPSEEK_V3 ? "n_routed_experts"
                                               : "num_experts";
    const char *fkey =
        fam == HF_MIXTRAL || fam == HF_OLMOE ? "intermediate_size" : "moe_intermediate_size";
    const struct {
        const char *key;
        int *dst;
    } req[] = {{"num_hidden_layers", &out->n_layers},
               {"hidden_size", &out->H},
               {fkey, &out->F},
               {ekey, &out->E},
               {"num_experts_per_tok", &out->K}};
    for (size_t i = 0; i < sizeof(req) / sizeof(req[0]); i++) {
        int ok = get_int(root, req[i].key, req[i].dst);
        if (!ok && req[i].dst == &out->E) /* the other spelling of the expert count */
            ok = get_int(root, fam == HF_MIXTRAL ? "num_experts" : "num_local_experts", req[i].dst);
        if (!ok || *req[i].dst < 1) {
            snprintf(err, errlen, "%s (family %s): missing or bad key \"%s\"", path, type,
                     req[i].key);
            goto out;
        }
    }
    if (out->n_layers > HF_MAX_LAYERS || out->K > out->E) {
        snprintf(err, errlen, "%s (family %s): %s", path, type,
                 out->K > out->E ? "num_experts_per_tok is larger than the expert count"
                                 : "more than 1024 layers");
        goto out;
    }
    const json_node *act = json_get(root, "hidden_act");
    if (act && (act->type != J_STR || strcmp(act->str, "silu") != 0)) {
        snprintf(err, errlen, "%s (family %s): hidden_act must be \"silu\" (SwiGLU experts)", path,
                 type);
        goto out;
    }
    const json_node *nt = json_get(root, "norm_topk_prob");
    out->renormalize = fam == HF_MIXTRAL ? 1 : (nt && nt->type == J_BOOL && nt->num != 0);
    const json_node *ac = json_get(root, "router_aux_loss_coef");
    out->router_aux_loss_coef = ac && ac->type == J_NUM ? ac->num : 0;
    out->n_group = out->topk_group = 1;
    out->routed_scale = 1.0;
    if (fam == HF_QWEN2_MOE) { /* a shared expert behind a sigmoid gate */
        out->shared_gate = 1;
        if (!get_int(root, "shared_expert_intermediate_size", &out->Fs) || out->Fs < 1) {
            snprintf(err, errlen,
                     "%s (family %s): missing or bad key \"shared_expert_intermediate_size\"", path,
                     type);
            goto out;
        }
    }
    if (fam == HF_DEEPSEEK_V3 && (e = ds_routing(root, out, path, type, err, errlen)) != MOE_OK)
        goto out;
    e = MOE_EINVAL;
    const json_node *dt = json_get(root, "dtype");
    if (!dt || dt->type != J_STR)
        dt = json_get(root, "torch_dtype");
    if (dt && dt->type == J_STR) {
        if (strcmp(dt->str, "bfloat16") != 0 && strcmp(dt->str, "float16") != 0 &&
            strcmp(dt->str, "float32") != 0) {
            snprintf(err, errlen,
                     "%s (family %s): dtype \"%s\" is not bfloat16, float16 or float32", path, type,
                     dt->str);
            goto out;
        }
        out->dtype_known = 1;
        snprintf(out->dtype, sizeof(out->dtype), "%s", dt->str);
    }
    /* which layers are MoE: Qwen3-MoE and Qwen2-MoE skip mlp_only_layers
     * and keep every decoder_sparse_step-th layer; DeepSeek-V3 keeps the
     * layers from first_k_dense_replace on; Mixtral and OLMoE: every layer */
    int step = 1, first = 0;
    const json_node *only = NULL;
    if (fam == HF_DEEPSEEK_V3 && json_get(root, "first_k_dense_replace") &&
        (!get_int(root, "first_k_dense_replace", &first) || first < 0)) {
        snprintf(err, errlen, "%s (family %s): bad key \"first_k_dense_replace\"", path, type);
        goto out;
    }
    if (fam == HF_QWEN3_MOE || fam == HF_QWEN2_MOE) {
        if (json_get(root, "decoder_sparse_step") && !get_int(root, "decoder_sparse_step", &step))
            step = 0;
        if (step < 1) {
            snprintf(err, errlen, "%s (family %s): bad key \"decoder_sparse_step\"", path, type);
            goto out;
        }
        only = json_get(root, "mlp_only_layers");
        if (only && only->type != J_ARR) {
            snprintf(err, errlen, "%s (family %s): bad key \"mlp_only_layers\"", path, type);
            goto out;
        }
    }
    for (int l = 0; l < out->n_layers; l++) {
        int dense = (l + 1) % step != 0 || l < first;
        for (size_t i = 0; only && i < only->len; i++)
            if (only->kids[i].type == J_NUM && only->kids[i].num == l)
                dense = 1;
        if (!dense)
            out->moe[out->n_moe++] = l;
    }
    if (out->n_moe == 0) {
        snprintf(err, errlen, "%s (family %s): no MoE layer (every layer is dense)", path, type);
        goto out;
    }
    e = MOE_OK;
out:
    json_free(doc);
    return e;
}

void hf_tensor_name(hf_family f, int layer, int expert, hf_mat mat, char *out, size_t len)
{
    static const char *mix[] = {"w1", "w3", "w2"}, *qo[] = {"gate_proj", "up_proj", "down_proj"};
    const char *block = f == HF_MIXTRAL ? "block_sparse_moe" : "mlp";
    const char *sh = f == HF_QWEN2_MOE ? "shared_expert" : "shared_experts";
    switch (mat) {
    case HF_ROUTER: snprintf(out, len, "model.layers.%d.%s.gate.weight", layer, block); break;
    case HF_BIAS:
        snprintf(out, len, "model.layers.%d.%s.gate.e_score_correction_bias", layer, block);
        break;
    case HF_SH_GATE:
    case HF_SH_UP:
    case HF_SH_DOWN:
        snprintf(out, len, "model.layers.%d.%s.%s.%s.weight", layer, block, sh,
                 qo[mat - HF_SH_GATE]);
        break;
    case HF_SH_GATEW:
        snprintf(out, len, "model.layers.%d.%s.shared_expert_gate.weight", layer, block);
        break;
    default:
        snprintf(out, len, "model.layers.%d.%s.experts.%d.%s.weight", layer, block, expert,
                 (f == HF_MIXTRAL ? mix : qo)[mat - 1]);
    }
}

int hf_tensor_shape(const hf_cfg *c, hf_mat mat, int64_t shape[2])
{
    switch (mat) {
    case HF_ROUTER: shape[0] = c->E, shape[1] = c->H; return 2;
    case HF_BIAS: shape[0] = c->E, shape[1] = 1; return 1;
    case HF_SH_GATE:
    case HF_SH_UP: shape[0] = c->Fs, shape[1] = c->H; return 2;
    case HF_SH_DOWN: shape[0] = c->H, shape[1] = c->Fs; return 2;
    case HF_SH_GATEW: shape[0] = 1, shape[1] = c->H; return 2;
    case HF_DOWN: shape[0] = c->H, shape[1] = c->F; return 2;
    default: shape[0] = c->F, shape[1] = c->H; return 2;
    }
}

int hf_cfg_has(const hf_cfg *c, hf_mat mat)
{
    switch (mat) {
    case HF_BIAS: return c->score_bias;
    case HF_SH_GATE:
    case HF_SH_UP:
    case HF_SH_DOWN: return c->Fs > 0;
    case HF_SH_GATEW: return c->shared_gate;
    default: return 1;
    }
}

/* ---- which file holds a tensor ---- */

typedef struct hf_entry {
    char *name; /* owned */
    int file;
} hf_entry;

struct hf_files {
    char **files; /* (nfiles) owned */
    int nfiles;
    hf_entry *t; /* (nt) sorted by name */
    int nt;
};

void hf_files_close(hf_files *h)
{
    if (!h)
        return;
    for (int i = 0; i < h->nfiles; i++)
        free(h->files[i]);
    for (int i = 0; i < h->nt; i++)
        free(h->t[i].name);
    free(h->files);
    free(h->t);
    free(h);
}

static int cmp_entry(const void *a, const void *b)
{
    return strcmp(((const hf_entry *)a)->name, ((const hf_entry *)b)->name);
}

static int add_file(hf_files *h, const char *name)
{
    for (int i = 0; i < h->nfiles; i++)
        if (strcmp(h->files[i], name) == 0)
            return i;
    char **nf = realloc(h->files, (size_t)(h->nfiles + 1) * sizeof(char *));
    if (!nf)
        return -1;
    h->files = nf;
    if (!(nf[h->nfiles] = strdup(name)))
        return -1;
    return h->nfiles++;
}

static int plain_name(const char *s)
{
    return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0 &&
           strlen(s) < 256;
}

moe_err hf_files_open(const char *dir, hf_files **out, char *err, size_t errlen)
{
    char path[4200];
    size_t n;
    hf_files *h = calloc(1, sizeof(*h));
    if (!h)
        return MOE_ENOMEM;
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    char *text = read_text(path, &n);
    if (!text) {
        int why = errno;
        snprintf(path, sizeof(path), "%s/model.safetensors", dir);
        if (why != ENOENT || access(path, R_OK) != 0) {
            snprintf(err, errlen,
                     "%s: neither model.safetensors.index.json nor model.safetensors can be "
                     "read (%s)",
                     dir, strerror(why != ENOENT ? why : errno));
            hf_files_close(h);
            return MOE_EIO;
        }
        if (add_file(h, "model.safetensors") < 0) {
            hf_files_close(h);
            return MOE_ENOMEM;
        }
        *out = h;
        return MOE_OK;
    }
    json_doc *doc = NULL;
    json_node *root;
    char jerr[200];
    moe_err e = json_parse(text, n, &doc, &root, jerr, sizeof(jerr));
    free(text);
    const json_node *wm = e == MOE_OK ? json_get(root, "weight_map") : NULL;
    if (e != MOE_OK || !wm || wm->type != J_OBJ || wm->len == 0) {
        snprintf(err, errlen, "%s/model.safetensors.index.json: %s", dir,
                 e != MOE_OK ? jerr : "no weight_map object (or an empty one)");
        e = MOE_EINVAL;
    }
    if (e == MOE_OK && !(h->t = calloc(wm->len, sizeof(hf_entry))))
        e = MOE_ENOMEM;
    for (size_t i = 0; e == MOE_OK && i < wm->len; i++) {
        const json_node *f = &wm->kids[i];
        if (f->type != J_STR || !plain_name(f->str)) {
            snprintf(err, errlen,
                     "%s/model.safetensors.index.json: tensor %s: the file must be a plain file "
                     "name",
                     dir, f->key);
            e = MOE_EINVAL;
            break;
        }
        int fi = add_file(h, f->str);
        if (fi < 0 || !(h->t[h->nt].name = strdup(f->key))) {
            e = MOE_ENOMEM;
            break;
        }
        h->t[h->nt++].file = fi;
    }
    json_free(doc);
    if (e != MOE_OK) {
        hf_files_close(h);
        return e;
    }
    qsort(h->t, (size_t)h->nt, sizeof(hf_entry), cmp_entry);
    *out = h;
    return MOE_OK;
}

int hf_files_count(const hf_files *h)
{
    return h->nfiles;
}

const char *hf_files_name(const hf_files *h, int i)
{
    return h->files[i];
}

int hf_files_find(const hf_files *h, const char *name)
{
    if (h->nt == 0)
        return 0; /* one model.safetensors */
    hf_entry key = {(char *)name, 0};
    const hf_entry *t = bsearch(&key, h->t, (size_t)h->nt, sizeof(hf_entry), cmp_entry);
    return t ? t->file : -1;
}

const char *hf_files_tensor(const hf_files *h, int i)
{
    return h->t[i].name;
}

int hf_files_ntensors(const hf_files *h)
{
    return h->nt;
}
