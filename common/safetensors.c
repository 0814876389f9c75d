/* safetensors.c - safetensors reader/writer; see safetensors.h. */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"

#define ST_MAX_HEADER (64u << 20)

uint64_t st_fnv1a64(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* ---- writer ---- */

typedef struct st_meta_kv {
    char *key, *value;
} st_meta_kv;

struct st_writer {
    st_tensor *t;
    int n, cap;
    st_meta_kv *meta;
    int nmeta, capmeta;
};

moe_err st_writer_new(st_writer **out)
{
    *out = calloc(1, sizeof(st_writer));
    return *out ? MOE_OK : MOE_ENOMEM;
}

void st_writer_free(st_writer *w)
{
    if (!w)
        return;
    for (int i = 0; i < w->n; i++)
        free(w->t[i].name);
    for (int i = 0; i < w->nmeta; i++) {
        free(w->meta[i].key);
        free(w->meta[i].value);
    }
    free(w->t);
    free(w->meta);
    free(w);
}

moe_err st_writer_add(st_writer *w, const char *name, int ndim, const int64_t *shape,
                      const float *data)
{
    if (ndim < 1 || ndim > ST_MAX_DIMS)
        return MOE_EINVAL;
    if (w->n == w->cap) {
        int nc = w->cap ? w->cap * 2 : 64;
        st_tensor *nt = realloc(w->t, (size_t)nc * sizeof(st_tensor));
        if (!nt)
            return MOE_ENOMEM;
        w->t = nt;
        w->cap = nc;
    }
    st_tensor *t = &w->t[w->n];
    memset(t, 0, sizeof(*t));
    t->name = strdup(name);
    if (!t->name)
        return MOE_ENOMEM;
    t->ndim = ndim;
    size_t n = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        n *= (size_t)shape[i];
    }
    t->data = data;
    t->nbytes = n * sizeof(float);
    w->n++;
    return MOE_OK;
}

moe_err st_writer_meta(st_writer *w, const char *key, const char *value)
{
    if (w->nmeta == w->capmeta) {
        int nc = w->capmeta ? w->capmeta * 2 : 16;
        st_meta_kv *nm = realloc(w->meta, (size_t)nc * sizeof(st_meta_kv));
        if (!nm)
            return MOE_ENOMEM;
        w->meta = nm;
        w->capmeta = nc;
    }
    w->meta[w->nmeta].key = strdup(key);
    w->meta[w->nmeta].value = strdup(value);
    if (!w->meta[w->nmeta].key || !w->meta[w->nmeta].value)
        return MOE_ENOMEM;
    w->nmeta++;
    return MOE_OK;
}

static moe_err write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t k = write(fd, p, len);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return MOE_EIO;
        }
        p += k;
        len -= (size_t)k;
    }
    return MOE_OK;
}

static moe_err fsync_dir_of(const char *path)
{
    char *copy = strdup(path);
    if (!copy)
        return MOE_ENOMEM;
    int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY);
    free(copy);
    if (fd < 0)
        return MOE_EIO;
    int rc = fsync(fd);
    close(fd);
    return rc == 0 ? MOE_OK : MOE_EIO;
}

/* st_save_parts writes the header and data parts to tmp, fsyncs, renames. */
static moe_err save_parts(const char *path, const void *head, size_t head_len, st_tensor *t, int n,
                          char *err, size_t errlen)
{
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %s: %s", tmp, strerror(errno));
        return MOE_EIO;
    }
    moe_err e = write_all(fd, head, head_len);
    for (int i = 0; e == MOE_OK && i < n; i++)
        e = write_all(fd, t[i].data, t[i].nbytes);
    if (e == MOE_OK && fsync(fd) != 0)
        e = MOE_EIO;
    if (close(fd) != 0)
        e = MOE_EIO;
    if (e != MOE_OK) {
        snprintf(err, errlen, "cannot write %s: %s", tmp, strerror(errno));
        unlink(tmp);
        return e;
    }
    if (rename(tmp, path) != 0) {
        snprintf(err, errlen, "cannot rename %s: %s", tmp, strerror(errno));
        unlink(tmp);
        return MOE_EIO;
    }
    if (fsync_dir_of(path) != MOE_OK) {
        snprintf(err, errlen, "cannot fsync the directory of %s", path);
        return MOE_EIO;
    }
    return MOE_OK;
}

moe_err st_writer_save(st_writer *w, const char *path, char *err, size_t errlen)
{
    uint64_t h = ST_FNV_INIT, off = 0;
    for (int i = 0; i < w->n; i++)
        h = st_fnv1a64(h, w->t[i].data, w->t[i].nbytes);
    char *json = NULL;
    size_t json_len = 0;
    FILE *f = open_memstream(&json, &json_len);
    if (!f)
        return MOE_ENOMEM;
    fputc('{', f);
    fprintf(f, "\"__metadata__\":{");
    for (int i = 0; i < w->nmeta; i++) {
        json_write_str(f, w->meta[i].key);
        fputc(':', f);
        json_write_str(f, w->meta[i].value);
        fputc(',', f);
    }
    fprintf(f, "\"moe.checksum\":\"%016llx\"}", (unsigned long long)h);
    for (int i = 0; i < w->n; i++) {
        fputc(',', f);
        json_write_str(f, w->t[i].name);
        fprintf(f, ":{\"dtype\":\"F32\",\"shape\":[");
        for (int d = 0; d < w->t[i].ndim; d++)
            fprintf(f, "%s%lld", d ? "," : "", (long long)w->t[i].shape[d]);
        fprintf(f, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                (unsigned long long)(off + w->t[i].nbytes));
        off += w->t[i].nbytes;
    }
    fputc('}', f);
    /* pad the header with spaces to 8 bytes, as the format allows */
    long pos = ftell(f);
    while (pos % 8) {
        fputc(' ', f);
        pos++;
    }
    if (fclose(f) != 0) {
        free(json);
        return MOE_ENOMEM;
    }
    size_t head_len = 8 + json_len;
    unsigned char *head = malloc(head_len);
    if (!head) {
        free(json);
        return MOE_ENOMEM;
    }
    uint64_t n = json_len;
    for (int i = 0; i < 8; i++)
        head[i] = (unsigned char)(n >> (8 * i));
    memcpy(head + 8, json, json_len);
    free(json);
    moe_err e = save_parts(path, head, head_len, w->t, w->n, err, errlen);
    free(head);
    return e;
}

moe_err st_mkdir_p(const char *dir)
{
    char buf[4096];
    if (strlen(dir) >= sizeof(buf))
        return MOE_EINVAL;
    snprintf(buf, sizeof(buf), "%s", dir);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return MOE_EIO;
            *p = '/';
        }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return MOE_EIO;
    return MOE_OK;
}

moe_err st_write_durable(const char *path, const void *data, size_t len, char *err, size_t errlen)
{
    st_tensor t = {0};
    t.data = data;
    t.nbytes = len;
    return save_parts(path, data, 0, &t, 1, err, errlen);
}

/* ---- reader ---- */

struct st_file {
    void *map;
    size_t size;
    json_doc *doc;
    st_tensor *t;
    int n;
    const json_node *meta;
};

void st_close(st_file *f)
{
    if (!f)
        return;
    if (f->map && f->map != MAP_FAILED)
        munmap(f->map, f->size);
    json_free(f->doc);
    free(f->t);
    free(f);
}

static moe_err bad(st_file *f, char *err, size_t errlen, const char *path, const char *why)
{
    snprintf(err, errlen, "%s: %s", path, why);
    st_close(f);
    return MOE_EINVAL;
}

moe_err st_open(const char *path, st_file **out, char *err, size_t errlen)
{
    st_file *f = calloc(1, sizeof(*f));
    if (!f)
        return MOE_ENOMEM;
    int fd = open(path, O_RDONLY);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        free(f);
        return MOE_EIO;
    }
    f->size = (size_t)sb.st_size;
    if (f->size < 8) {
        close(fd);
        return bad(f, err, errlen, path, "truncated: shorter than the 8-byte header length");
    }
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        return bad(f, err, errlen, path, "cannot map the file");
    }
    const unsigned char *b = f->map;
    uint64_t hn = 0;
    for (int i = 0; i < 8; i++)
        hn |= (uint64_t)b[i] << (8 * i);
    if (hn > ST_MAX_HEADER || hn > f->size - 8)
        return bad(f, err, errlen, path, "truncated or corrupt: header length past the end");
    json_node *root;
    char jerr[200];
    if (json_parse((const char *)b + 8, hn, &f->doc, &root, jerr, sizeof(jerr)) != MOE_OK ||
        root->type != J_OBJ)
        return bad(f, err, errlen, path, "corrupt header (not a JSON object)");
    const unsigned char *data = b + 8 + hn;
    size_t data_len = f->size - 8 - hn, end_max = 0;
    f->t = calloc(root->len ? root->len : 1, sizeof(st_tensor));
    if (!f->t)
        return bad(f, err, errlen, path, "out of memory");
    for (size_t i = 0; i < root->len; i++) {
        const json_node *m = &root->kids[i];
        if (strcmp(m->key, "__metadata__") == 0) {
            f->meta = m;
            continue;
        }
        const json_node *dt = json_get(m, "dtype"), *sh = json_get(m, "shape"),
                        *of = json_get(m, "data_offsets");
        if (!dt || dt->type != J_STR || strcmp(dt->str, "F32") != 0)
            return bad(f, err, errlen, path, "a tensor is not F32");
        if (!sh || sh->type != J_ARR || sh->len < 1 || sh->len > ST_MAX_DIMS || !of ||
            of->type != J_ARR || of->len != 2)
            return bad(f, err, errlen, path, "a tensor has a bad shape or offsets");
        st_tensor *t = &f->t[f->n];
        t->name = m->key;
        t->ndim = (int)sh->len;
        double numel = 1;
        for (size_t d = 0; d < sh->len; d++) {
            /* a whole number that fits: the cast to int64 below is UB otherwise */
            if (sh->kids[d].type != J_NUM || !(sh->kids[d].num >= 0) ||
                sh->kids[d].num > 9007199254740992.0 ||
                sh->kids[d].num != (double)(int64_t)sh->kids[d].num)
                return bad(f, err, errlen, path, "a tensor has a bad shape");
            t->shape[d] = (int64_t)sh->kids[d].num;
            numel *= sh->kids[d].num;
        }
        double a = of->kids[0].num, z = of->kids[1].num;
        if (of->kids[0].type != J_NUM || of->kids[1].type != J_NUM || a < 0 || z < a ||
            z > (double)data_len || (z - a) != numel * 4)
            return bad(f, err, errlen, path, "truncated or corrupt: tensor data out of range");
        t->data = data + (size_t)a;
        t->nbytes = (size_t)(z - a);
        if ((size_t)z > end_max)
            end_max = (size_t)z;
        f->n++;
    }
    if (end_max != data_len)
        return bad(f, err, errlen, path, "truncated or padded: data length does not match");
    const char *ck = st_meta(f, "moe.checksum");
    if (ck) {
        uint64_t h = ST_FNV_INIT;
        for (int i = 0; i < f->n; i++)
            h = st_fnv1a64(h, f->t[i].data, f->t[i].nbytes);
        char hex[32];
        snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)h);
        if (strcmp(hex, ck) != 0)
            return bad(f, err, errlen, path, "corrupt: checksum mismatch");
    }
    *out = f;
    return MOE_OK;
}

const st_tensor *st_find(const st_file *f, const char *name)
{
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->t[i].name, name) == 0)
            return &f->t[i];
    return NULL;
}

const char *st_meta(const st_file *f, const char *key)
{
    const json_node *v = json_get(f->meta, key);
    return v && v->type == J_STR ? v->str : NULL;
}

int st_count(const st_file *f)
{
    return f->n;
}

const st_tensor *st_at(const st_file *f, int i)
{
    return &f->t[i];
}
