/*
 * ckpt.c - checkpoint.save / checkpoint.load at the coordinator.
 *
 * Layout of a checkpoint directory PATH:
 *   PATH/LATEST                                  name of the newest complete checkpoint
 *   PATH/ckpt-<step>-<time>/model-0000r-of-0000W.safetensors   one per worker
 *   PATH/ckpt-<step>-<time>/model.safetensors.index.json       {metadata, weight_map}
 * A save writes a fresh subdirectory; only when every worker has written and
 * fsynced its file, and the index is durable, does LATEST move (tmp + fsync
 * + rename). A crash at any point leaves the previous checkpoint loadable.
 * The last `keep` (3) checkpoints are kept, older ones removed.
 * Load is two-phase (prepare on every worker, then commit or abort).
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/confine.h"
#include "server/coord.h"
#include "common/json.h"
#include "common/log.h"
#include "common/params.h"
#include "common/safetensors.h"

#define CKPT_KEEP 3

/* the durable part of a checkpoint.save's finish, run off the loop */
typedef struct ckpt_io {
    uv_work_t req;
    coord *c;
    coord_job *j; /* current until save_io_after: its path and root stay as they are */
    char *index;  /* (ilen) the index's text, owned */
    size_t ilen;
    uint64_t total; /* the shards' bytes, for the answer */
    long long slow_ms;
    moe_err e; /* out */
    char err[512];
    double ms;
} ckpt_io;

static char *read_file(const char *path, size_t max, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = malloc(max + 1);
    size_t n = buf ? fread(buf, 1, max + 1, f) : 0;
    fclose(f);
    if (!buf || n > max) {
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int path_ok(const char *p)
{
    return p[0] && strlen(p) < CFG_STR_MAX - 80;
}

int coord_ckpt_roots(const coord *c, const char *roots[2])
{
    int n = 0;
    if (c->ckpt_root[0])
        roots[n++] = c->ckpt_root;
    if (c->ckpt_dir[0] && strcmp(c->ckpt_dir, c->ckpt_root) != 0)
        roots[n++] = c->ckpt_dir;
    return n;
}

int coord_train_refused(coord *c, const coord_model *m, rpc_call *call)
{
    if (c->ready && m->created_gen == (int)c->generation && !m->restoring)
        return 0;
    coord_count_error(c, MOE_EUNAVAIL);
    if (m->restoring == 2)
        rpc_reply_err(call, MOE_EUNAVAIL,
                      "model '%s' is restoring: its newest checkpoint could not be restored "
                      "(see the coordinator's log); training resumes after a checkpoint.load "
                      "succeeds",
                      m->cfg.name);
    else
        rpc_reply_err(call, MOE_EUNAVAIL,
                      "model '%s' is restoring: training calls wait until the cluster is "
                      "ready and the model holds its newest checkpoint (generation %llu); retry",
                      m->cfg.name, (unsigned long long)c->generation);
    return 1;
}

void coord_step_rollback(coord *c, coord_model *m)
{
    if (!c->ckpt_dir[0])
        return; /* no checkpoints: nothing durable to return to */
    LOG_W("model %s: the outcome of step %lld is unknown: re-forming the cluster to restore its "
          "newest checkpoint",
          m->cfg.name, (long long)m->step);
    m->restoring = 1;
    c->ready = 0;
    c->need_form = 1;
}

void coord_ckpt_init(coord *c)
{
    if (c->ckpt_root[0] && st_mkdir_p(c->ckpt_root) != MOE_OK)
        LOG_W("cannot create checkpoint root %s: %s (explicit checkpoint paths will be refused)",
              c->ckpt_root, strerror(errno));
}

/* confine_explicit resolves a client's checkpoint path into out: it must lie
 * under --checkpoint-root, or --checkpoint-dir when no root is set. */
static moe_err confine_explicit(const coord *c, const char *path, char *out, size_t outlen,
                                char *err, size_t errlen)
{
    const char *root = c->ckpt_root[0] ? c->ckpt_root : c->ckpt_dir;
    return path_confine(path, &root, 1, out, outlen, err, errlen);
}

/* dir_writable creates dir if missing; 1 when it is a directory we may
 * write in, else 0 with errno set. */
static int dir_writable(const char *dir)
{
    struct stat sb;
    if (st_mkdir_p(dir) != MOE_OK || stat(dir, &sb) != 0)
        return 0;
    if (!S_ISDIR(sb.st_mode)) {
        errno = ENOTDIR;
        return 0;
    }
    return access(dir, W_OK) == 0;
}

/* ckpt_save_job queues a save of m under root; call (may be NULL for the
 * coordinator's own saves) gets the reply. */
static moe_err ckpt_save_job(coord *c, coord_model *m, const char *root, rpc_call *call, int front,
                             char *err, size_t errlen, coord_job **queued)
{
    if (!path_ok(root)) {
        snprintf(err, errlen, "path must be 1-%d characters", CFG_STR_MAX - 81);
        return MOE_EINVAL;
    }
    if (!dir_writable(root)) {
        snprintf(err, errlen, "cannot write checkpoint directory %s: %s", root, strerror(errno));
        return MOE_EIO;
    }
    coord_job *j = calloc(1, sizeof(*j));
    if (!j)
        return MOE_ENOMEM;
    j->ops = &coord_job_ckpt_save;
    j->kind = JOB_CKPT_SAVE;
    j->call = call;
    j->model = m;
    snprintf(j->root, sizeof(j->root), "%s", root);
    if (coord_job_submit(c, j, front) != MOE_OK) {
        free(j);
        snprintf(err, errlen, "queue full (%lld jobs): retry later", c->queue_depth);
        return MOE_EBUSY;
    }
    if (queued)
        *queued = j;
    return MOE_OK;
}

void coord_ckpt_save(coord *c, rpc_call *call)
{
    char name[MODEL_NAME_MAX], path[CFG_STR_MAX], err[512];
    pspec sp[] = {
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"path", P_STR, path, true, 0, 0, sizeof(path), false},
    };
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 2, err, sizeof(err));
    coord_model *m = NULL;
    char real[CFG_STR_MAX];
    if (e == MOE_OK && !(m = coord_find_model(c, name))) {
        snprintf(err, sizeof(err), "no model named '%s'", name);
        e = MOE_ENOTFOUND;
    }
    if (e == MOE_OK)
        e = confine_explicit(c, path, real, sizeof(real), err, sizeof(err));
    if (e == MOE_OK && coord_train_refused(c, m, call))
        return; /* the workers do not hold its state yet: nothing to save */
    if (e == MOE_OK)
        e = ckpt_save_job(c, m, real, call, 0, err, sizeof(err), NULL);
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    coord_job_pump(c);
}

/* the coordinator's own checkpoints of model m live in <checkpoint-dir>/<name> */
static int auto_root(const coord *c, const coord_model *m, char *out, size_t len)
{
    if (!c->ckpt_dir[0])
        return 0;
    snprintf(out, len, "%s/%s", c->ckpt_dir, m->cfg.name);
    return 1;
}

void coord_autosave(coord *c, coord_model *m, int front)
{
    char root[CFG_STR_MAX], err[512];
    /* never of a model whose workers do not hold its durable state: the
     * save would become its newest checkpoint */
    if (!auto_root(c, m, root, sizeof(root)) || m->saved_step == m->step || m->restoring ||
        m->created_gen != (int)c->generation)
        return;
    if (ckpt_save_job(c, m, root, NULL, front, err, sizeof(err), NULL) != MOE_OK)
        LOG_W("automatic checkpoint of %s not queued: %s", m->cfg.name, err);
}

moe_err coord_autosave_reply(coord *c, coord_model *m, rpc_call *call, uint8_t *reply, size_t len)
{
    char root[CFG_STR_MAX], err[512];
    coord_job *j = NULL;
    if (!auto_root(c, m, root, sizeof(root)))
        return MOE_EINVAL;
    /* queued without the call, so that a full queue cannot refuse it */
    moe_err e = ckpt_save_job(c, m, root, NULL, 1, err, sizeof(err), &j);
    if (e != MOE_OK) {
        LOG_W("automatic checkpoint of %s not queued: %s", m->cfg.name, err);
        return e;
    }
    j->call = call;
    j->deferred = reply;
    j->admit_gen = c->generation;
    j->deferred_len = len;
    return MOE_OK;
}

/* resolve_ckpt finds the checkpoint directory: PATH/LATEST's target, or PATH
 * itself when it holds an index. */
static moe_err resolve_ckpt(const char *path, char *dir, size_t len, char *err, size_t errlen)
{
    char p[CFG_STR_MAX + 64];
    size_t n;
    snprintf(p, sizeof(p), "%s/LATEST", path);
    char *latest = read_file(p, 255, &n);
    if (latest) {
        while (n && (latest[n - 1] == '\n' || latest[n - 1] == ' '))
            latest[--n] = 0;
        if (!n || strchr(latest, '/') || strcmp(latest, ".") == 0 || strcmp(latest, "..") == 0) {
            free(latest);
            snprintf(err, errlen, "%s is corrupt", p);
            return MOE_EINVAL;
        }
        snprintf(dir, len, "%s/%s", path, latest);
        free(latest);
        return MOE_OK;
    }
    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", path);
    if (access(p, R_OK) == 0) {
        snprintf(dir, len, "%s", path);
        return MOE_OK;
    }
    snprintf(err, errlen, "no checkpoint at %s (no LATEST or model.safetensors.index.json)", path);
    return MOE_ENOTFOUND;
}

static moe_err check_meta(const json_node *meta, const model_cfg *cfg, int64_t *step, char *err,
                          size_t errlen)
{
    static const char *keys[] = {"moe.layers", "moe.d_model", "moe.d_ff", "moe.n_experts",
                                 "moe.top_k"};
    const int want[] = {cfg->layers, cfg->d_model, cfg->d_ff, cfg->n_experts, cfg->top_k};
    for (int i = 0; i < 5; i++) {
        const json_node *v = json_get(meta, keys[i]);
        if (!v || v->type != J_STR) {
            snprintf(err, errlen, "checkpoint index has no %s", keys[i]);
            return MOE_EINVAL;
        }
        if (atoll(v->str) != want[i]) {
            snprintf(err, errlen, "checkpoint is of another model shape: %s = %s, the model has %d",
                     keys[i] + 4, v->str, want[i]);
            return MOE_EINVAL;
        }
    }
    const json_node *a = json_get(meta, "moe.activation"), *d = json_get(meta, "moe.dtype"),
                    *s = json_get(meta, "moe.step");
    if (!a || a->type != J_STR || strcmp(a->str, act_name(cfg->act)) != 0) {
        snprintf(err, errlen, "checkpoint is of another activation");
        return MOE_EINVAL;
    }
    if (!d || d->type != J_STR || strcmp(d->str, moe_dtype_name(cfg->dtype)) != 0) {
        snprintf(err, errlen, "checkpoint is of another dtype");
        return MOE_EINVAL;
    }
    if (!s || s->type != J_STR) {
        snprintf(err, errlen, "checkpoint index has no moe.step");
        return MOE_EINVAL;
    }
    *step = atoll(s->str);
    return MOE_OK;
}

/* ckpt_load_job queues phase 1 of a load of m from path. */
static moe_err ckpt_load_job(coord *c, coord_model *m, const char *path, rpc_call *call, int front,
                             char *err, size_t errlen)
{
    char dir[CFG_STR_MAX + 300];
    moe_err e;
    if (!path_ok(path)) {
        snprintf(err, errlen, "path too long");
        return MOE_EINVAL;
    }
    if ((e = resolve_ckpt(path, dir, sizeof(dir), err, errlen)) != MOE_OK)
        return e;
    /* the checkpoint LATEST names may be a symlink: it stays under a root too */
    const char *roots[2];
    char real[CFG_STR_MAX + 300];
    if ((e = path_confine(dir, roots, coord_ckpt_roots(c, roots), real, sizeof(real), err,
                          errlen)) != MOE_OK)
        return e;
    snprintf(dir, sizeof(dir), "%s", real);
    char ip[sizeof(dir) + 40];
    size_t n;
    snprintf(ip, sizeof(ip), "%s/model.safetensors.index.json", dir);
    char *text = read_file(ip, 64u << 20, &n);
    if (!text) {
        snprintf(err, errlen, "cannot read %s", ip);
        return MOE_EIO;
    }
    json_doc *doc = NULL;
    json_node *root;
    e = json_parse(text, n, &doc, &root, err, errlen);
    free(text);
    const json_node *meta = e == MOE_OK ? json_get(root, "metadata") : NULL;
    const json_node *wm = e == MOE_OK ? json_get(root, "weight_map") : NULL;
    const json_node *om = e == MOE_OK ? json_get(root, "moe_optimizer_map") : NULL;
    int64_t step = 0;
    if (e == MOE_OK && (!meta || !wm || wm->type != J_OBJ)) {
        snprintf(err, errlen, "%s has no metadata or weight_map", ip);
        e = MOE_EINVAL;
    }
    if (e == MOE_OK)
        e = check_meta(meta, &m->cfg, &step, err, errlen);
    coord_job *j = NULL;
    if (e == MOE_OK && !(j = calloc(1, sizeof(*j))))
        e = MOE_ENOMEM;
    /* the distinct shard files of the weight map (and optimizer map) */
    size_t nw = e == MOE_OK ? wm->len : 0, no = om && om->type == J_OBJ ? om->len : 0;
    for (size_t i = 0; e == MOE_OK && i < nw + no; i++) {
        const json_node *f = i < nw ? &wm->kids[i] : &om->kids[i - nw];
        if (f->type != J_STR || !f->str[0] || strchr(f->str, '/')) {
            snprintf(err, errlen, "%s: bad file name in weight_map", ip);
            e = MOE_EINVAL;
            break;
        }
        int seen = 0;
        for (int k = 0; k < j->nfiles && !seen; k++)
            seen = strcmp(j->files[k], f->str) == 0;
        if (seen)
            continue;
        char **nf = realloc(j->files, (size_t)(j->nfiles + 1) * sizeof(char *));
        if (!nf || !(nf[j->nfiles] = strdup(f->str))) {
            if (nf)
                j->files = nf;
            e = MOE_ENOMEM;
            break;
        }
        j->files = nf;
        j->nfiles++;
    }
    json_free(doc);
    if (e == MOE_OK && j->nfiles == 0) {
        snprintf(err, errlen, "%s lists no files", ip);
        e = MOE_EINVAL;
    }
    if (e == MOE_OK) {
        j->ops = &coord_job_ckpt_load;
        j->kind = JOB_CKPT_LOAD;
        j->call = call;
        j->model = m;
        j->ckpt_step = step;
        snprintf(j->path, sizeof(j->path), "%s", dir);
        if (coord_job_submit(c, j, front) != MOE_OK) {
            snprintf(err, errlen, "queue full (%lld jobs): retry later", c->queue_depth);
            e = MOE_EBUSY;
        }
    }
    if (e != MOE_OK && j) {
        for (int k = 0; k < j->nfiles; k++)
            free(j->files[k]);
        free(j->files);
        free(j);
    }
    return e;
}

void coord_ckpt_load(coord *c, rpc_call *call)
{
    char name[MODEL_NAME_MAX], path[CFG_STR_MAX], err[512];
    pspec sp[] = {
        {"model", P_STR, name, true, 0, 0, sizeof(name), false},
        {"path", P_STR, path, true, 0, 0, sizeof(path), false},
    };
    mp_reader r = call->req.params;
    moe_err e = params_parse(&r, call->req.nparams, sp, 2, err, sizeof(err));
    coord_model *m = NULL;
    char real[CFG_STR_MAX];
    if (e == MOE_OK && !(m = coord_find_model(c, name))) {
        snprintf(err, sizeof(err), "no model named '%s' (create it first)", name);
        e = MOE_ENOTFOUND;
    }
    if (e == MOE_OK)
        e = confine_explicit(c, path, real, sizeof(real), err, sizeof(err));
    if (e == MOE_OK)
        e = ckpt_load_job(c, m, real, call, 0, err, sizeof(err));
    if (e != MOE_OK) {
        rpc_reply_err(call, e, "%s", err);
        return;
    }
    coord_job_pump(c);
}

int coord_autorestore(coord *c, coord_model *m)
{
    char root[CFG_STR_MAX], err[512];
    if (!auto_root(c, m, root, sizeof(root)))
        return 0;
    moe_err e = ckpt_load_job(c, m, root, NULL, 1, err, sizeof(err));
    if (e == MOE_ENOTFOUND)
        return 0;
    if (e != MOE_OK) {
        LOG_W("cannot restore %s from %s: %s (training calls on it are refused until a "
              "checkpoint.load succeeds)",
              m->cfg.name, root, err);
        return -1;
    }
    LOG_I("restoring %s from %s", m->cfg.name, root);
    return 1;
}

static void ckpt_encode(coord *c, coord_job *j, int rank, mp_writer *w)
{
    (void)c;
    (void)rank;
    switch (j->kind) {
    case JOB_CKPT_SAVE:
        if (!j->path[0])
            snprintf(j->path, sizeof(j->path), "%s/ckpt-%08lld-%llx", j->root,
                     (long long)j->model->step, (unsigned long long)rpc_now_ns());
        mp_write_map(w, 2);
        mp_write_cstr(w, "model");
        mp_write_cstr(w, j->model->cfg.name);
        mp_write_cstr(w, "dir");
        mp_write_cstr(w, j->path);
        return;
    case JOB_CKPT_LOAD:
        mp_write_map(w, 4);
        mp_write_cstr(w, "model");
        mp_write_cstr(w, j->model->cfg.name);
        mp_write_cstr(w, "phase");
        mp_write_cstr(w, "prepare");
        mp_write_cstr(w, "dir");
        mp_write_cstr(w, j->path);
        mp_write_cstr(w, "files");
        mp_write_array(w, (uint32_t)j->nfiles);
        for (int i = 0; i < j->nfiles; i++)
            mp_write_cstr(w, j->files[i]);
        return;
    default:
        mp_write_map(w, 2);
        mp_write_cstr(w, "model");
        mp_write_cstr(w, j->model->cfg.name);
        mp_write_cstr(w, "phase");
        mp_write_cstr(w, j->commit ? "commit" : "abort");
        return;
    }
}

/* index_text makes the Hugging Face index of a saved checkpoint: *out
 * (owned by the caller, *outlen bytes) to be written as
 * PATH/model.safetensors.index.json. */
static moe_err index_text(coord_job *j, uint64_t total, char **out, size_t *outlen)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    const model_cfg *cfg = &j->model->cfg;
    if (!f)
        return MOE_ENOMEM;
    fprintf(f, "{\n  \"metadata\": {\n    \"total_size\": %llu,\n", (unsigned long long)total);
    fprintf(f, "    \"format\": \"moe\",\n    \"moe.name\": ");
    json_write_str(f, cfg->name);
    fprintf(f, ",\n    \"moe.step\": \"%lld\",\n    \"moe.world\": \"%d\",\n",
            (long long)j->model->step, j->nsent);
    fprintf(f,
            "    \"moe.layers\": \"%d\",\n    \"moe.d_model\": \"%d\",\n    \"moe.d_ff\": \"%d\",\n"
            "    \"moe.n_experts\": \"%d\",\n    \"moe.top_k\": \"%d\",\n"
            "    \"moe.activation\": \"%s\",\n    \"moe.dtype\": \"%s\"\n  },\n",
            cfg->layers, cfg->d_model, cfg->d_ff, cfg->n_experts, cfg->top_k, act_name(cfg->act),
            moe_dtype_name(cfg->dtype));
    /* weight_map: the model's tensors; moe_optimizer_map (models from a
     * Hugging Face directory): the optimizer files' tensors, kept out of
     * weight_map so that transformers loads the directory as it is */
    char *otext = NULL;
    size_t olen = 0;
    FILE *of = open_memstream(&otext, &olen);
    if (!of) {
        fclose(f);
        free(text);
        return MOE_ENOMEM;
    }
    fprintf(f, "  \"weight_map\": {");
    int first = 1, ofirst = 1;
    for (int r = 0; r < j->nsent; r++) {
        const moe_reply *rep = j->replies[r];
        mp_reader rd;
        uint32_t n;
        const char *file = NULL, *ofile = NULL;
        uint32_t flen = 0, oflen = 0;
        mp_reader_init(&rd, rep->buf + rep->result_off, rep->len - rep->result_off);
        if (mp_read_map(&rd, &n, NULL) != MOE_OK)
            break;
        for (uint32_t i = 0; i < n; i++) {
            const char *k;
            uint32_t kl, nn;
            if (mp_read_str(&rd, &k, &kl, NULL) != MOE_OK)
                break;
            int opt = mp_str_eq(k, kl, "opt_names");
            if (mp_str_eq(k, kl, "file")) {
                mp_read_str(&rd, &file, &flen, NULL);
            } else if (mp_str_eq(k, kl, "opt_file")) {
                mp_read_str(&rd, &ofile, &oflen, NULL);
            } else if ((mp_str_eq(k, kl, "names") && file) || (opt && ofile)) {
                if (mp_read_array(&rd, &nn, NULL) != MOE_OK)
                    break;
                for (uint32_t t = 0; t < nn; t++) {
                    const char *s;
                    uint32_t sl;
                    if (mp_read_str(&rd, &s, &sl, NULL) != MOE_OK)
                        break;
                    char nm[256], fl[256];
                    snprintf(nm, sizeof(nm), "%.*s", (int)sl, s);
                    snprintf(fl, sizeof(fl), "%.*s", (int)(opt ? oflen : flen), opt ? ofile : file);
                    fprintf(opt ? of : f, "%s\n    ", (opt ? ofirst : first) ? "" : ",");
                    json_write_str(opt ? of : f, nm);
                    fprintf(opt ? of : f, ": ");
                    json_write_str(opt ? of : f, fl);
                    *(opt ? &ofirst : &first) = 0;
                }
            } else {
                mp_skip(&rd, NULL);
            }
        }
    }
    fclose(of);
    if (!ofirst)
        fprintf(f, "\n  },\n  \"moe_optimizer_map\": {%s", otext);
    free(otext);
    fprintf(f, "\n  }\n}\n");
    fclose(f);
    *out = text;
    *outlen = len;
    return MOE_OK;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void remove_tree(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    char p[CFG_STR_MAX + 300];
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
        unlink(p);
    }
    if (d)
        closedir(d);
    rmdir(dir);
}

/* prune keeps the newest CKPT_KEEP checkpoints (names sort by step, time). */
static void prune(const char *root, const char *keep_name)
{
    DIR *d = opendir(root);
    struct dirent *de;
    char *names[4096];
    int n = 0;
    while (d && (de = readdir(d)) && n < 4096)
        if (strncmp(de->d_name, "ckpt-", 5) == 0 && (names[n] = strdup(de->d_name)))
            n++; /* never a NULL name: cmp_str would crash on it */
    if (d)
        closedir(d);
    qsort(names, (size_t)n, sizeof(char *), cmp_str);
    for (int i = 0; i < n; i++) {
        if (i < n - CKPT_KEEP && names[i] && strcmp(names[i], keep_name) != 0) {
            char p[CFG_STR_MAX + 300];
            snprintf(p, sizeof(p), "%s/%s", root, names[i]);
            remove_tree(p);
        }
        free(names[i]);
    }
}

/* save_settle answers a checkpoint.save (or the optimizer.step waiting on
 * it) once its index and LATEST are durable (e == MOE_OK) or failed. */
static void save_settle(coord *c, coord_job *j, moe_err e, const char *err, uint64_t total)
{
    if (e != MOE_OK) {
        LOG_W("checkpoint.save of %s failed: %s", j->model->cfg.name, err);
        if (j->deferred)
            j->model->step_unsettled = 0;
        if (j->call && j->deferred) {
            rpc_reply_err(j->call, MOE_EUNAVAIL,
                          "optimizer.step outcome unknown: step %lld of model '%s' ran on "
                          "the workers but its checkpoint did not become durable (%s); the "
                          "model returns to its newest checkpoint: retry with expect_step",
                          (long long)j->model->step, j->model->cfg.name, err);
            coord_step_rollback(c, j->model);
        } else if (j->call)
            rpc_reply_err(j->call, e, "checkpoint.save: %s", err);
        coord_count_error(c, j->call && j->deferred ? MOE_EUNAVAIL : e);
        return;
    }
    j->model->saved_step = j->model->step;
    LOG_I("checkpoint of %s at step %lld: %s (%llu bytes)", j->model->cfg.name,
          (long long)j->model->step, j->path, (unsigned long long)total);
    if (!j->call)
        return;
    if (j->deferred) { /* the optimizer.step this checkpoint made durable */
        j->model->step_unsettled = 0;
        rpc_reply_bytes(j->call, j->deferred, j->deferred_len);
        return;
    }
    mp_writer w;
    mp_writer_init(&w);
    moe_rpc_write_response_ok_head(&w, j->call->req.msgid);
    mp_write_map(&w, 3);
    mp_write_cstr(&w, "path");
    mp_write_cstr(&w, j->path);
    mp_write_cstr(&w, "step");
    mp_write_i64(&w, j->model->step);
    mp_write_cstr(&w, "bytes");
    mp_write_u64(&w, total);
    rpc_reply(j->call, &w);
}

/* save_io_run: on a libuv pool thread (or here, when none takes it) - the
 * index, then LATEST, each written and fsynced with its directory, then the
 * old checkpoints pruned. Touches only io: the loop goes on meanwhile (an
 * fsync behind the workers' shard writes took long enough to hide a
 * worker's death from the loop), and the job stays current. */
static void save_io_run(ckpt_io *io)
{
    const coord_job *j = io->j;
    const char *leaf = strrchr(j->path, '/');
    leaf = leaf ? leaf + 1 : j->path;
    char path[CFG_STR_MAX + 64], line[300];
    uint64_t t0 = rpc_now_ns();
    if (io->slow_ms > 0)
        usleep((useconds_t)(io->slow_ms * 1000));
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", j->path);
    io->e = st_write_durable(path, io->index, io->ilen, io->err, sizeof(io->err));
    if (io->e == MOE_OK) {
        snprintf(path, sizeof(path), "%s/LATEST", j->root);
        const int n = snprintf(line, sizeof(line), "%s\n", leaf);
        io->e = st_write_durable(path, line, (size_t)n, io->err, sizeof(io->err));
    }
    if (io->e == MOE_OK)
        prune(j->root, leaf);
    io->ms = (double)(rpc_now_ns() - t0) * 1e-6;
}

static void save_io_work(uv_work_t *req)
{
    save_io_run(req->data);
}

/* save_io_after: back on the loop - answer, then the next job */
static void save_io_after(uv_work_t *req, int status)
{
    ckpt_io *io = req->data;
    coord *c = io->c;
    coord_job *j = io->j;
    if (status != 0 && io->e == MOE_OK) {
        io->e = MOE_EINTERNAL;
        snprintf(io->err, sizeof(io->err), "the checkpoint's writes did not run (%s)",
                 uv_strerror(status));
    }
    if (io->ms >= 100)
        LOG_I("checkpoint of %s: index and LATEST durable after %.0f ms (off the loop)",
              j->model->cfg.name, io->ms);
    save_settle(c, j, io->e, io->err, io->total);
    free(io->index);
    free(io);
    coord_job_io_done(c, j);
}

static void ckpt_finish(coord *c, coord_job *j, moe_err first, int bad_rank)
{
    (void)first, (void)bad_rank;
    char err[512] = "";
    int bad = -1;
    for (int r = 0; r < j->nsent && bad < 0; r++)
        if (j->errs[r] != MOE_OK)
            bad = r;
    moe_err e = bad >= 0 ? j->errs[bad] : MOE_OK;
    if (bad >= 0)
        snprintf(err, sizeof(err), "worker rank %d: %s", bad,
                 j->replies[bad] ? j->replies[bad]->message : moe_strerror(e));
    switch (j->kind) {
    case JOB_CKPT_SAVE: {
        uint64_t total = 0;
        for (int r = 0; e == MOE_OK && r < j->nsent; r++) {
            mp_reader rd;
            uint32_t n;
            const moe_reply *rep = j->replies[r];
            mp_reader_init(&rd, rep->buf + rep->result_off, rep->len - rep->result_off);
            if (mp_read_map(&rd, &n, NULL) == MOE_OK)
                for (uint32_t i = 0; i < n; i++) {
                    const char *k;
                    uint32_t kl;
                    uint64_t b;
                    if (mp_read_str(&rd, &k, &kl, NULL) != MOE_OK)
                        break;
                    if (mp_str_eq(k, kl, "bytes") && mp_read_u64(&rd, &b, NULL) == MOE_OK)
                        total += b;
                    else if (mp_skip(&rd, NULL) != MOE_OK)
                        break;
                }
        }
        ckpt_io *io = e == MOE_OK ? calloc(1, sizeof(*io)) : NULL;
        if (e == MOE_OK && !io) {
            e = MOE_ENOMEM;
            snprintf(err, sizeof(err), "out of memory");
        }
        if (e == MOE_OK && (e = index_text(j, total, &io->index, &io->ilen)) != MOE_OK)
            snprintf(err, sizeof(err), "out of memory for the index");
        if (e == MOE_OK) {
            io->c = c;
            io->j = j;
            io->total = total;
            io->slow_ms = c->slow_durable_ms;
            io->req.data = io;
            if (uv_queue_work(c->loop, &io->req, save_io_work, save_io_after) == 0) {
                j->io_pending = 1; /* save_io_after settles it */
                return;
            }
            save_io_run(io); /* no thread to take it: here, as before */
            e = io->e;
            snprintf(err, sizeof(err), "%s", io->err);
        }
        if (io)
            free(io->index);
        free(io);
        save_settle(c, j, e, err, total);
        return;
    }
    case JOB_CKPT_LOAD: {
        /* phase 2: commit everywhere, or abort everywhere */
        coord_job *k = calloc(1, sizeof(*k));
        if (!k) {
            if (j->call)
                rpc_reply_err(j->call, MOE_ENOMEM, "out of memory");
            return;
        }
        k->ops = &coord_job_ckpt_commit;
        k->kind = JOB_CKPT_COMMIT;
        k->model = j->model;
        k->commit = e == MOE_OK;
        k->ckpt_step = j->ckpt_step;
        if (e != MOE_OK) {
            if (j->call) {
                rpc_reply_err(j->call, e, "checkpoint.load: %s (the model is unchanged)", err);
            } else {
                LOG_W("restore of %s failed: %s (training calls on it are refused until a "
                      "checkpoint.load succeeds, or the cluster re-forms)",
                      j->model->cfg.name, err);
                j->model->restoring = 2;
            }
            coord_count_error(c, e);
        }
        /* phase 2 continues a running job: submitted without the call, so a
         * full queue cannot refuse it (which would leak it and leave the
         * client unanswered and the workers' staging in place) */
        coord_job_submit(c, k, 1);
        if (e == MOE_OK)
            k->call = j->call; /* the reply comes after the commit */
        return;
    }
    default:
        if (e == MOE_OK && j->commit) {
            j->model->step = j->ckpt_step;
            j->model->saved_step = j->ckpt_step;
            j->model->pending_grads = 0;
            j->model->restoring = 0; /* the workers hold a durable state again */
            LOG_I("model %s at step %lld from its checkpoint", j->model->cfg.name,
                  (long long)j->ckpt_step);
        } else if (!j->call && j->commit) {
            LOG_W("restore of %s failed at commit: %s", j->model->cfg.name, err);
            j->model->restoring = 2;
        }
        if (j->call) {
            if (e != MOE_OK) {
                rpc_reply_err(j->call, e, "checkpoint.load commit: %s", err);
                return;
            }
            mp_writer w;
            mp_writer_init(&w);
            moe_rpc_write_response_ok_head(&w, j->call->req.msgid);
            mp_write_map(&w, 1);
            mp_write_cstr(&w, "step");
            mp_write_i64(&w, j->model->step);
            rpc_reply(j->call, &w);
        }
        return;
    }
}

void coord_model_persist(coord *c, const coord_model *m)
{
    char root[CFG_STR_MAX], path[CFG_STR_MAX + 16], err[512];
    const model_cfg *g = &m->cfg;
    if (!auto_root(c, m, root, sizeof(root)))
        return;
    if (st_mkdir_p(root) != MOE_OK) {
        LOG_W("cannot create %s: %s", root, strerror(errno));
        return;
    }
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return;
    fprintf(f, "{\"name\": ");
    json_write_str(f, g->name);
    fprintf(f,
            ", \"layers\": %d, \"d_model\": %d, \"d_ff\": %d, \"n_experts\": %d, \"top_k\": %d, "
            "\"activation\": \"%s\", \"renormalize\": %s, \"capacity_factor\": %.17g, "
            "\"dtype\": \"%s\", \"seed\": %llu, \"aux_loss_coef\": %.17g, \"z_loss_coef\": "
            "%.17g}\n",
            g->layers, g->d_model, g->d_ff, g->n_experts, g->top_k, act_name(g->act),
            g->renormalize ? "true" : "false", g->capacity_factor, moe_dtype_name(g->dtype),
            (unsigned long long)g->seed, g->aux_loss_coef, g->z_loss_coef);
    if (model_cfg_routing_extra(g)) { /* a routing family: its keys (docs/PROTOCOL.md) */
        fseek(f, -2, SEEK_CUR);       /* before "}\n" */
        fprintf(f,
                ", \"scoring\": \"%s\", \"score_bias\": %s, \"n_group\": %d, \"topk_group\": %d, "
                "\"group_topn\": %d, \"routed_scaling_factor\": %.17g, \"shared_d_ff\": %d, "
                "\"shared_gate\": %s}\n",
                g->scoring ? "sigmoid" : "softmax", g->score_bias ? "true" : "false", g->n_group,
                g->topk_group, g->group_topn, g->routed_scale, g->shared_d_ff,
                g->shared_gate ? "true" : "false");
    }
    if (g->hf_dir[0]) {         /* from a Hugging Face directory: it is read again at restart */
        fseek(f, -2, SEEK_CUR); /* before "}\n" */
        fprintf(f, ", \"hf_dir\": ");
        json_write_str(f, g->hf_dir);
        fprintf(f, ", \"hf_family\": ");
        json_write_str(f, g->hf_family);
        fprintf(f, "}\n");
    }
    fclose(f);
    snprintf(path, sizeof(path), "%s/model.json", root);
    if (st_write_durable(path, text, len, err, sizeof(err)) != MOE_OK)
        LOG_W("cannot persist the config of %s: %s", g->name, err);
    free(text);
}

void coord_model_unpersist(coord *c, const coord_model *m)
{
    char root[CFG_STR_MAX], path[CFG_STR_MAX + 48];
    if (!auto_root(c, m, root, sizeof(root)) || access(root, F_OK) != 0)
        return;
    snprintf(path, sizeof(path), "%s/model.json", root);
    if (unlink(path) != 0 && errno != ENOENT)
        LOG_W("cannot remove %s: %s", path, strerror(errno));
    /* '~' is no name character: the directory can never be a model's again */
    snprintf(path, sizeof(path), "%s~deleted-%llu", root, (unsigned long long)rpc_now_ns());
    if (rename(root, path) != 0)
        LOG_W("cannot rename %s to %s: %s", root, path, strerror(errno));
    else
        LOG_I("model %s: its checkpoints are kept in %s", m->cfg.name, path);
}

/* json_to_params re-encodes a flat JSON object as a msgpack map, so the one
 * validating parser (model_cfg_parse) reads it */
static int json_to_params(const json_node *o, mp_writer *w)
{
    if (!o || o->type != J_OBJ)
        return -1;
    mp_write_map(w, (uint32_t)o->len);
    for (size_t i = 0; i < o->len; i++) {
        const json_node *v = &o->kids[i];
        mp_write_cstr(w, v->key);
        switch (v->type) {
        case J_STR: mp_write_cstr(w, v->str); break;
        case J_BOOL: mp_write_bool(w, v->num != 0); break;
        case J_NUM:
            if (v->num == (double)(int64_t)v->num && v->num >= -9e18 && v->num <= 9e18)
                mp_write_i64(w, (int64_t)v->num);
            else
                mp_write_f64(w, v->num);
            break;
        default: return -1;
        }
    }
    return 0;
}

void coord_models_restore(coord *c)
{
    if (!c->ckpt_dir[0])
        return;
    DIR *d = opendir(c->ckpt_dir);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char path[CFG_STR_MAX + 300], err[256];
        size_t n;
        if (de->d_name[0] == '.')
            continue;
        snprintf(path, sizeof(path), "%s/%s/model.json", c->ckpt_dir, de->d_name);
        char *text = read_file(path, 1 << 16, &n);
        if (!text)
            continue;
        json_doc *doc = NULL;
        json_node *root;
        mp_writer w;
        mp_writer_init(&w);
        model_cfg cfg;
        memset(&cfg, 0, sizeof(cfg));
        moe_err e = json_parse(text, n, &doc, &root, err, sizeof(err));
        if (e == MOE_OK && json_to_params(root, &w) != 0) {
            snprintf(err, sizeof(err), "not a flat object of model.create params");
            e = MOE_EINVAL;
        }
        if (e == MOE_OK) {
            mp_reader r;
            uint32_t np;
            mp_reader_init(&r, w.buf, w.len);
            mp_read_map(&r, &np, NULL);
            e = model_cfg_parse(&r, np, &cfg, err, sizeof(err));
        }
        if (e == MOE_OK && strcmp(cfg.name, de->d_name) != 0) {
            snprintf(err, sizeof(err), "names model '%s'", cfg.name);
            e = MOE_EINVAL;
        }
        if (e == MOE_OK && !coord_find_model(c, cfg.name) &&
            coord_model_add(c, &cfg, err, sizeof(err)))
            LOG_I("model %s known again from %s", cfg.name, path);
        else if (e != MOE_OK)
            LOG_W("ignoring %s: %s", path, err);
        mp_writer_fini(&w);
        json_free(doc);
        free(text);
    }
    if (d)
        closedir(d);
}

/* ckpt_save_stale: the checkpoint of a step (deferred reply) whose cluster
 * is no longer the one that ran it - not ready, or re-formed (and restored)
 * since - cannot make that step durable: its outcome is unknown. */
static int ckpt_save_stale(coord *c, coord_job *j)
{
    if (!j->deferred || (c->ready && j->admit_gen == c->generation))
        return 0;
    j->model->step_unsettled = 0;
    rpc_reply_err(j->call, MOE_EUNAVAIL,
                  "optimizer.step outcome unknown: step %lld of model '%s' ran on the workers but "
                  "the cluster re-formed before its checkpoint was written; the model returns to "
                  "its newest checkpoint: retry with expect_step",
                  (long long)j->model->step, j->model->cfg.name);
    coord_count_error(c, MOE_EUNAVAIL);
    if (j->admit_gen == c->generation) /* not re-formed yet: it will restore */
        coord_step_rollback(c, j->model);
    return 1;
}

/* a save that lost a member cannot become durable: answered at once
 * (JOB_F_EARLY); the survivors' shards stay out of LATEST and the index */
const coord_job_ops coord_job_ckpt_save = {JOB_CKPT_SAVE, "worker.checkpoint_save",
                                           JOB_F_EARLY,   ckpt_encode,
                                           ckpt_finish,   ckpt_save_stale};
const coord_job_ops coord_job_ckpt_load = {
    JOB_CKPT_LOAD, "worker.checkpoint_load", 0, ckpt_encode, ckpt_finish, NULL};
const coord_job_ops coord_job_ckpt_commit = {
    JOB_CKPT_COMMIT, "worker.checkpoint_load", 0, ckpt_encode, ckpt_finish, NULL};
