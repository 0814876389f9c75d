/* json.c - strict JSON reader; see json.h. */
#include "common/json.h"

#include <stdlib.h>
#include <string.h>

#define JSON_MAX_DEPTH 64

struct json_doc {
    void **blocks; /* every allocation, freed together */
    size_t nblocks, cap;
};

typedef struct parser {
    const char *start, *p, *end;
    json_doc *doc;
    char *err;
    size_t errlen;
} parser;

static void *doc_alloc(json_doc *d, size_t n)
{
    if (d->nblocks == d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 64;
        void **nb = realloc(d->blocks, nc * sizeof(void *));
        if (!nb)
            return NULL;
        d->blocks = nb;
        d->cap = nc;
    }
    void *m = calloc(1, n ? n : 1);
    if (m)
        d->blocks[d->nblocks++] = m;
    return m;
}

static int fail(parser *ps, const char *what)
{
    snprintf(ps->err, ps->errlen, "JSON: %s at byte %zu", what, (size_t)(ps->p - ps->start));
    return -1;
}

static void skip_ws(parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t'))
        ps->p++;
}

static int parse_value(parser *ps, json_node *out, int depth);

static int parse_string(parser *ps, char **out, size_t *outlen)
{
    if (ps->p >= ps->end || *ps->p != '"')
        return fail(ps, "expected a string");
    ps->p++;
    const char *s = ps->p;
    size_t n = 0;
    while (s < ps->end && *s != '"') {
        if (*s == '\\')
            s++;
        s++;
        n++;
    }
    if (s >= ps->end)
        return fail(ps, "unterminated string");
    char *buf = doc_alloc(ps->doc, n + 1), *d = buf;
    if (!buf)
        return fail(ps, "out of memory");
    while (ps->p < ps->end && *ps->p != '"') {
        char ch = *ps->p++;
        if ((unsigned char)ch < 0x20)
            return fail(ps, "control character in string");
        if (ch == '\\') {
            if (ps->p >= ps->end)
                return fail(ps, "bad escape");
            char e = *ps->p++;
            switch (e) {
            case '"': ch = '"'; break;
            case '\\': ch = '\\'; break;
            case '/': ch = '/'; break;
            case 'b': ch = '\b'; break;
            case 'f': ch = '\f'; break;
            case 'n': ch = '\n'; break;
            case 'r': ch = '\r'; break;
            case 't': ch = '\t'; break;
            case 'u':
                /* \uXXXX: keep ASCII, replace others with '?' (names are ASCII) */
                if (ps->end - ps->p < 4)
                    return fail(ps, "bad \\u escape");
                {
                    unsigned v = 0;
                    for (int i = 0; i < 4; i++) {
                        char h = ps->p[i];
                        v <<= 4;
                        if (h >= '0' && h <= '9')
                            v |= (unsigned)(h - '0');
                        else if (h >= 'a' && h <= 'f')
                            v |= (unsigned)(h - 'a' + 10);
                        else if (h >= 'A' && h <= 'F')
                            v |= (unsigned)(h - 'A' + 10);
                        else
                            return fail(ps, "bad \\u escape");
                    }
                    ps->p += 4;
                    ch = v < 0x80 ? (char)v : '?';
                }
                break;
            default: return fail(ps, "bad escape");
            }
        }
        *d++ = ch;
    }
    ps->p++; /* closing quote */
    *d = 0;
    *out = buf;
    *outlen = (size_t)(d - buf);
    return 0;
}

static int parse_container(parser *ps, json_node *out, int depth, char close)
{
    size_t cap = 8, n = 0;
    json_node *kids = malloc(cap * sizeof(json_node));
    if (!kids)
        return fail(ps, "out of memory");
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        goto done;
    }
    for (;;) {
        if (n == cap) {
            cap *= 2;
            json_node *nk = realloc(kids, cap * sizeof(json_node));
            if (!nk) {
                free(kids);
                return fail(ps, "out of memory");
            }
            kids = nk;
        }
        memset(&kids[n], 0, sizeof(json_node));
        skip_ws(ps);
        if (close == '}') {
            size_t kl;
            if (parse_string(ps, &kids[n].key, &kl)) {
                free(kids);
                return -1;
            }
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':') {
                free(kids);
                return fail(ps, "expected ':'");
            }
            ps->p++;
        }
        char *key = kids[n].key;
        if (parse_value(ps, &kids[n], depth + 1)) {
            free(kids);
            return -1;
        }
        kids[n].key = key;
        n++;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            break;
        }
        free(kids);
        return fail(ps, "expected ',' or a closing bracket");
    }
done:
    out->type = close == '}' ? J_OBJ : J_ARR;
    out->len = n;
    out->kids = doc_alloc(ps->doc, n * sizeof(json_node));
    if (!out->kids) {
        free(kids);
        return fail(ps, "out of memory");
    }
    memcpy(out->kids, kids, n * sizeof(json_node));
    free(kids);
    return 0;
}

static int parse_value(parser *ps, json_node *out, int depth)
{
    if (depth > JSON_MAX_DEPTH)
        return fail(ps, "nested too deeply");
    skip_ws(ps);
    if (ps->p >= ps->end)
        return fail(ps, "unexpected end");
    char ch = *ps->p;
    if (ch == '{')
        return parse_container(ps, out, depth, '}');
    if (ch == '[')
        return parse_container(ps, out, depth, ']');
    if (ch == '"') {
        out->type = J_STR;
        return parse_string(ps, &out->str, &out->len);
    }
    static const struct {
        const char *word;
        json_type t;
        double v;
    } words[] = {{"true", J_BOOL, 1}, {"false", J_BOOL, 0}, {"null", J_NULL, 0}};
    for (int i = 0; i < 3; i++) {
        size_t wl = strlen(words[i].word);
        if ((size_t)(ps->end - ps->p) >= wl && memcmp(ps->p, words[i].word, wl) == 0) {
            ps->p += wl;
            out->type = words[i].t;
            out->num = words[i].v;
            return 0;
        }
    }
    if (ch == '-' || (ch >= '0' && ch <= '9')) {
        char buf[64];
        size_t n = 0;
        while (ps->p + n < ps->end && n < sizeof(buf) - 1 && strchr("+-0123456789.eE", ps->p[n]))
            n++;
        memcpy(buf, ps->p, n);
        buf[n] = 0;
        char *e;
        out->num = strtod(buf, &e);
        if (e != buf + n || n == 0)
            return fail(ps, "bad number");
        ps->p += n;
        out->type = J_NUM;
        return 0;
    }
    return fail(ps, "unexpected character");
}

moe_err json_parse(const char *text, size_t len, json_doc **doc, json_node **root, char *err,
                   size_t errlen)
{
    json_doc *d = calloc(1, sizeof(*d));
    if (!d)
        return MOE_ENOMEM;
    parser ps = {text, text, text + len, d, err, errlen};
    json_node *r = doc_alloc(d, sizeof(json_node));
    if (!r || parse_value(&ps, r, 0)) {
        if (!r)
            snprintf(err, errlen, "out of memory");
        json_free(d);
        return MOE_EINVAL;
    }
    skip_ws(&ps);
    if (ps.p != ps.end) {
        snprintf(err, errlen, "JSON: trailing bytes after the value");
        json_free(d);
        return MOE_EINVAL;
    }
    *doc = d;
    *root = r;
    return MOE_OK;
}

void json_free(json_doc *d)
{
    if (!d)
        return;
    for (size_t i = 0; i < d->nblocks; i++)
        free(d->blocks[i]);
    free(d->blocks);
    free(d);
}

const json_node *json_get(const json_node *obj, const char *key)
{
    if (!obj || obj->type != J_OBJ)
        return NULL;
    for (size_t i = 0; i < obj->len; i++)
        if (obj->kids[i].key && strcmp(obj->kids[i].key, key) == 0)
            return &obj->kids[i];
    return NULL;
}

void json_write_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}
