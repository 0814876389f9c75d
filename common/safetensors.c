/* safetensors.c - safetensors reader/writer; see safetensors.h. */
#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/json.h"

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
    if (ndim < 1)
        return MOE_EINVAL;
    return st_writer_add_typed(w, name, "F32", sizeof(float), ndim, shape, data);
}

moe_err st_writer_add_typed(st_writer *w, const char *name, const char *dtype_name, size_t esize,
                            int ndim, const int64_t *shape, const void *data)
{
    if (ndim < 0 || ndim > ST_MAX_DIMS || esize == 0 || strlen(dtype_name) > 15)
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
    t->dtype_name = dtype_name;
    t->esize = esize;
    size_t n = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        n *= (size_t)shape[i];
    }
    t->data = data;
    t->nbytes = n * esize;
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
        fprintf(f, ":{\"dtype\":\"%s\",\"shape\":[", w->t[i].dtype_name);
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

/* the dtypes of the safetensors format and their sizes */
static const struct {
    const char *name;
    size_t size;
    st_dtype dt;
} st_dtypes[] = {
    {"F32", 4, ST_F32},    {"BF16", 2, ST_BF16},     {"F16", 2, ST_F16},       {"F64", 8, ST_OTHER},
    {"I64", 8, ST_OTHER},  {"U64", 8, ST_OTHER},     {"I32", 4, ST_OTHER},     {"U32", 4, ST_OTHER},
    {"I16", 2, ST_OTHER},  {"U16", 2, ST_OTHER},     {"I8", 1, ST_OTHER},      {"U8", 1, ST_OTHER},
    {"BOOL", 1, ST_OTHER}, {"F8_E4M3", 1, ST_OTHER}, {"F8_E5M2", 1, ST_OTHER},
};

static moe_err bad_t(st_file *f, char *err, size_t errlen, const char *path, const char *tensor,
                     const char *why)
{
    snprintf(err, errlen, "%s: tensor %s: %s", path, tensor, why);
    st_close(f);
    return MOE_EINVAL;
}

moe_err st_open(const char *path, st_file **out, char *err, size_t errlen)
{
    return st_open_flags(path, 0, out, err, errlen);
}

moe_err st_open_flags(const char *path, unsigned flags, st_file **out, char *err, size_t errlen)
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
        int di = -1;
        for (size_t k = 0; dt && dt->type == J_STR && k < sizeof(st_dtypes) / sizeof(st_dtypes[0]);
             k++)
            if (strcmp(dt->str, st_dtypes[k].name) == 0)
                di = (int)k;
        if (di < 0 || (!(flags & ST_OPEN_ANY_DTYPE) && st_dtypes[di].dt != ST_F32)) {
            char why[96];
            snprintf(why, sizeof(why), "dtype %s is not %s",
                     dt && dt->type == J_STR ? dt->str : "(missing)",
                     flags & ST_OPEN_ANY_DTYPE ? "a safetensors dtype" : "F32");
            return bad_t(f, err, errlen, path, m->key, why);
        }
        int min_dims = flags & ST_OPEN_ANY_DTYPE ? 0 : 1;
        if (!sh || sh->type != J_ARR || (int)sh->len < min_dims || sh->len > ST_MAX_DIMS || !of ||
            of->type != J_ARR || of->len != 2)
            return bad_t(f, err, errlen, path, m->key, "bad shape or data_offsets");
        st_tensor *t = &f->t[f->n];
        t->name = m->key;
        t->dtype = st_dtypes[di].dt;
        t->dtype_name = st_dtypes[di].name;
        t->esize = st_dtypes[di].size;
        t->ndim = (int)sh->len;
        double numel = 1;
        for (size_t d = 0; d < sh->len; d++) {
            /* a whole number that fits: the cast to int64 below is UB otherwise */
            if (sh->kids[d].type != J_NUM || !(sh->kids[d].num >= 0) ||
                sh->kids[d].num > 9007199254740992.0 ||
                sh->kids[d].num != (double)(int64_t)sh->kids[d].num)
                return bad_t(f, err, errlen, path, m->key, "bad shape");
            t->shape[d] = (int64_t)sh->kids[d].num;
            numel *= sh->kids[d].num;
        }
        double a = of->kids[0].num, z = of->kids[1].num;
        if (of->kids[0].type != J_NUM || of->kids[1].type != J_NUM || a < 0 || z < a)
            return bad_t(f, err, errlen, path, m->key, "corrupt data_offsets");
        if (z > (double)data_len) {
            char why[160];
            snprintf(why, sizeof(why),
                     "truncated or corrupt: data_offsets end at %.0f, past the file's %zu data "
                     "bytes",
                     z, data_len);
            return bad_t(f, err, errlen, path, m->key, why);
        }
        if ((z - a) != numel * (double)t->esize)
            return bad_t(f, err, errlen, path, m->key,
                         "corrupt: data_offsets do not span shape x dtype size");
        t->data = data + (size_t)a;
        t->nbytes = (size_t)(z - a);
        if ((size_t)z > end_max)
            end_max = (size_t)z;
        f->n++;
    }
    if (end_max != data_len)
        return bad(f, err, errlen, path, "truncated or padded: data length does not match");
    const char *ck = flags & ST_OPEN_NO_CHECKSUM ? NULL : st_meta(f, "moe.checksum");
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

float st_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) { /* inf, NaN */
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) { /* normal */
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) { /* zero */
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

void st_prefetch(const st_tensor *t)
{
    if (!t || !t->nbytes)
        return;
    const long pg = sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)t->data & ~(uintptr_t)(pg - 1);
    uintptr_t b = (uintptr_t)t->data + t->nbytes;
    (void)madvise((void *)a, b - a, MADV_WILLNEED); /* a hint: errors change nothing */
}

moe_err st_to_f32(const st_tensor *t, float *out, size_t n)
{
    if (t->esize == 0 || t->nbytes / t->esize != n)
        return MOE_EINVAL;
    return st_to_f32_range(t, out, 0, n);
}

moe_err st_to_f32_range(const st_tensor *t, float *out, size_t i0, size_t i1)
{
    if (t->esize == 0 || i1 < i0 || i1 > t->nbytes / t->esize)
        return MOE_EINVAL;
    const unsigned char *p = t->data; /* possibly unaligned: bytes, never cast */
    switch (t->dtype) {
    case ST_F32: memcpy(out + i0, p + 4 * i0, (i1 - i0) * sizeof(float)); return MOE_OK;
    case ST_BF16:
        for (size_t i = i0; i < i1; i++) {
            uint32_t u = ((uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 8) << 16;
            memcpy(&out[i], &u, sizeof(float));
        }
        return MOE_OK;
    case ST_F16:
        for (size_t i = i0; i < i1; i++)
            out[i] = st_f16_to_f32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
        return MOE_OK;
    default: return MOE_EINVAL;
    }
}
