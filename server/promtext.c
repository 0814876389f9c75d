/*
 * promtext.c - the Prometheus text writer and its checker (promtext.h).
 */
#include "server/promtext.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *type_name[3] = {"counter", "gauge", "histogram"};

void pt_init(promtext *p)
{
    memset(p, 0, sizeof(*p));
}

static void fail(promtext *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(promtext *p, const char *fmt, ...)
{
    if (p->err[0])
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err, sizeof(p->err), fmt, ap);
    va_end(ap);
    if (!p->err[0])
        snprintf(p->err, sizeof(p->err), "failed");
}

/* put appends n bytes; an allocation failure fails the writer */
static void put(promtext *p, const char *s, size_t n)
{
    if (p->err[0])
        return;
    if (p->len + n + 1 > p->cap) {
        size_t nc = p->cap ? p->cap : 8192;
        while (p->len + n + 1 > nc)
            nc *= 2;
        char *nb = realloc(p->buf, nc);
        if (!nb) {
            fail(p, "out of memory");
            return;
        }
        p->buf = nb;
        p->cap = nc;
    }
    memcpy(p->buf + p->len, s, n);
    p->len += n;
    p->buf[p->len] = 0;
}

static void puts_(promtext *p, const char *s)
{
    put(p, s, strlen(s));
}

static int is_name_start(char ch, int colon)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_' ||
           (colon && ch == ':');
}

static int is_name_char(char ch, int colon)
{
    return is_name_start(ch, colon) || (ch >= '0' && ch <= '9');
}

/* valid_name: a metric name (colon 1) or a label name (colon 0) */
static int valid_name(const char *s, int colon)
{
    if (!s || !is_name_start(s[0], colon))
        return 0;
    for (const char *q = s + 1; *q; q++)
        if (!is_name_char(*q, colon))
            return 0;
    return colon || strncmp(s, "__", 2) != 0;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* put_escaped writes s with backslash and newline escaped (and the double
 * quote too when quote is set: label values) */
static void put_escaped(promtext *p, const char *s, int quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            puts_(p, "\\\\");
        else if (*s == '\n')
            puts_(p, "\\n");
        else if (quote && *s == '"')
            puts_(p, "\\\"");
        else
            put(p, s, 1);
    }
}

int pt_family(promtext *p, const char *name, pt_type type, const char *help)
{
    if (p->err[0])
        return -1;
    if (!valid_name(name, 1) || strlen(name) >= PT_NAME_MAX) {
        fail(p, "invalid metric name '%s'", name ? name : "(null)");
        return -1;
    }
    if ((unsigned)type > PT_HISTOGRAM) {
        fail(p, "%s: invalid type", name);
        return -1;
    }
    if (!help || !help[0]) {
        fail(p, "%s: no HELP text", name);
        return -1;
    }
    if (type == PT_COUNTER && !ends_with(name, "_total")) {
        fail(p, "counter %s: the name must end in _total", name);
        return -1;
    }
    if (type != PT_COUNTER && ends_with(name, "_total")) {
        fail(p, "%s %s: only counters end in _total", type_name[type], name);
        return -1;
    }
    if (ends_with(name, "_bucket") || ends_with(name, "_sum") || ends_with(name, "_count")) {
        fail(p, "%s: _bucket, _sum and _count are a histogram's sample suffixes", name);
        return -1;
    }
    for (int i = 0; i < p->nfam; i++)
        if (strcmp(p->names[i], name) == 0) {
            fail(p, "family %s declared twice", name);
            return -1;
        }
    if (p->nfam == PT_MAX_FAMILIES) {
        fail(p, "more than %d families", PT_MAX_FAMILIES);
        return -1;
    }
    snprintf(p->names[p->nfam++], PT_NAME_MAX, "%s", name);
    p->type = type;
    puts_(p, "# HELP ");
    puts_(p, name);
    put(p, " ", 1);
    put_escaped(p, help, 0);
    puts_(p, "\n# TYPE ");
    puts_(p, name);
    put(p, " ", 1);
    puts_(p, type_name[type]);
    put(p, "\n", 1);
    return p->err[0] ? -1 : 0;
}

/* put_series writes "<family><suffix>{labels[,le="..."]} " */
static void put_series(promtext *p, const char *suffix, const pt_label *l, int nl, const char *le)
{
    if (nl < 0 || nl > PT_MAX_LABELS || (nl > 0 && !l)) {
        fail(p, "%s: bad label count %d", p->names[p->nfam - 1], nl);
        return;
    }
    for (int i = 0; i < nl; i++) {
        if (!valid_name(l[i].name, 0) || !l[i].value) {
            fail(p, "%s: invalid label '%s'", p->names[p->nfam - 1],
                 l[i].name ? l[i].name : "(null)");
            return;
        }
        if (strcmp(l[i].name, "le") == 0) {
            fail(p, "%s: label le is the histogram's own", p->names[p->nfam - 1]);
            return;
        }
        for (int j = 0; j < i; j++)
            if (strcmp(l[i].name, l[j].name) == 0) {
                fail(p, "%s: label %s twice", p->names[p->nfam - 1], l[i].name);
                return;
            }
    }
    puts_(p, p->names[p->nfam - 1]);
    puts_(p, suffix);
    if (nl > 0 || le) {
        put(p, "{", 1);
        for (int i = 0; i < nl; i++) {
            if (i)
                put(p, ",", 1);
            puts_(p, l[i].name);
            puts_(p, "=\"");
            put_escaped(p, l[i].value, 1);
            put(p, "\"", 1);
        }
        if (le) {
            puts_(p, nl ? ",le=\"" : "le=\"");
            puts_(p, le);
            put(p, "\"", 1);
        }
        put(p, "}", 1);
    }
    put(p, " ", 1);
}

/* fmt_f64: Go's ParseFloat reads it back to v; NaN and infinities spelled
 * as the format wants */
static void fmt_f64(char *out, size_t cap, double v)
{
    if (isnan(v))
        snprintf(out, cap, "NaN");
    else if (isinf(v))
        snprintf(out, cap, v > 0 ? "+Inf" : "-Inf");
    else {
        snprintf(out, cap, "%.15g", v);
        if (strtod(out, NULL) != v)
            snprintf(out, cap, "%.17g", v);
    }
}

static int sample_ok(promtext *p)
{
    if (p->err[0])
        return 0;
    if (p->nfam == 0) {
        fail(p, "a sample before any family");
        return 0;
    }
    if (p->type == PT_HISTOGRAM) {
        fail(p, "%s: a histogram's samples come from pt_histogram", p->names[p->nfam - 1]);
        return 0;
    }
    return 1;
}

void pt_sample_u64(promtext *p, const pt_label *l, int nl, uint64_t v)
{
    if (!sample_ok(p))
        return;
    char num[32];
    snprintf(num, sizeof(num), "%llu\n", (unsigned long long)v);
    put_series(p, "", l, nl, NULL);
    puts_(p, num);
}

void pt_sample_f64(promtext *p, const pt_label *l, int nl, double v)
{
    if (!sample_ok(p))
        return;
    char num[40];
    fmt_f64(num, sizeof(num), v);
    put_series(p, "", l, nl, NULL);
    puts_(p, num);
    put(p, "\n", 1);
}

void pt_histogram(promtext *p, const pt_label *l, int nl, const double *bounds, int nb,
                  const uint64_t *counts, double sum)
{
    if (p->err[0])
        return;
    if (p->nfam == 0 || p->type != PT_HISTOGRAM) {
        fail(p, "pt_histogram outside a histogram family");
        return;
    }
    for (int i = 1; i < nb; i++)
        if (!(bounds[i] > bounds[i - 1])) {
            fail(p, "%s: bucket bounds not ascending", p->names[p->nfam - 1]);
            return;
        }
    uint64_t cum = 0;
    char le[40], num[40];
    for (int i = 0; i <= nb; i++) {
        cum += counts[i];
        if (i < nb)
            fmt_f64(le, sizeof(le), bounds[i]);
        else
            snprintf(le, sizeof(le), "+Inf");
        put_series(p, "_bucket", l, nl, le);
        snprintf(num, sizeof(num), "%llu\n", (unsigned long long)cum);
        puts_(p, num);
    }
    put_series(p, "_sum", l, nl, NULL);
    fmt_f64(num, sizeof(num), sum);
    puts_(p, num);
    put(p, "\n", 1);
    put_series(p, "_count", l, nl, NULL);
    snprintf(num, sizeof(num), "%llu\n", (unsigned long long)cum);
    puts_(p, num);
}

const char *pt_error(const promtext *p)
{
    return p->err[0] ? p->err : NULL;
}

char *pt_finish(promtext *p)
{
    char *out = NULL;
    if (!p->err[0]) {
        out = p->buf ? p->buf : calloc(1, 1); /* no family at all: "" */
        p->buf = NULL;
        if (!out)
            fail(p, "out of memory");
    }
    free(p->buf);
    char err[sizeof(p->err)];
    memcpy(err, p->err, sizeof(err));
    pt_init(p);
    memcpy(p->err, err, sizeof(err)); /* pt_error still says why */
    return out;
}

void pt_free(promtext *p)
{
    free(p->buf);
    pt_init(p);
}

/* ---- the checker ---- */

typedef struct ck_fam {
    char name[PT_NAME_MAX];
    int help, type; /* seen */
    pt_type t;
    int samples;
    int closed; /* another family's lines came after its own */
} ck_fam;

typedef struct ck {
    ck_fam *fams;
    int n, cap, cur; /* cur: index of the family whose lines come now, -1 none */
    char **series;
    size_t nseries, capseries;
    char *err;
    size_t errlen;
    int line;
} ck;

static int ck_fail(ck *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int ck_fail(ck *k, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (k->err && k->errlen)
        snprintf(k->err, k->errlen, "line %d: %s", k->line, msg);
    return -1;
}

static ck_fam *ck_find(ck *k, const char *name, size_t n)
{
    for (int i = 0; i < k->n; i++)
        if (strlen(k->fams[i].name) == n && memcmp(k->fams[i].name, name, n) == 0)
            return &k->fams[i];
    return NULL;
}

/* ck_enter: the lines of family f start or continue here */
static int ck_enter(ck *k, ck_fam *f)
{
    int idx = (int)(f - k->fams);
    if (k->cur == idx)
        return 0;
    if (f->closed)
        return ck_fail(k, "%s: its lines are not one group (another family came between)", f->name);
    if (k->cur >= 0)
        k->fams[k->cur].closed = 1;
    k->cur = idx;
    return 0;
}

static ck_fam *ck_add(ck *k, const char *name, size_t n)
{
    if (n >= PT_NAME_MAX)
        return NULL;
    if (k->n == k->cap) {
        int nc = k->cap ? k->cap * 2 : 32;
        ck_fam *nf = realloc(k->fams, (size_t)nc * sizeof(*nf));
        if (!nf)
            return NULL;
        k->fams = nf;
        k->cap = nc;
    }
    ck_fam *f = &k->fams[k->n++];
    memset(f, 0, sizeof(*f));
    memcpy(f->name, name, n);
    f->name[n] = 0;
    return f;
}

static size_t name_len(const char *s, int colon)
{
    if (!is_name_start(*s, colon))
        return 0;
    size_t n = 1;
    while (is_name_char(s[n], colon))
        n++;
    return n;
}

/* ck_meta: a "# HELP" or "# TYPE" line (other comments are ignored) */
static int ck_meta(ck *k, const char *s, const char *end)
{
    int help = strncmp(s, "# HELP ", 7) == 0, type = strncmp(s, "# TYPE ", 7) == 0;
    if (!help && !type)
        return 0;
    s += 7;
    size_t n = name_len(s, 1);
    if (!n)
        return ck_fail(k, "invalid metric name after # %s", help ? "HELP" : "TYPE");
    ck_fam *f = ck_find(k, s, n);
    if (!f && !(f = ck_add(k, s, n)))
        return ck_fail(k, "out of memory or name too long");
    if (ck_enter(k, f) < 0)
        return -1;
    if (f->samples)
        return ck_fail(k, "%s: # %s after its samples", f->name, help ? "HELP" : "TYPE");
    const char *rest = s + n;
    if (help) {
        if (f->help)
            return ck_fail(k, "%s: two HELP lines", f->name);
        if (rest >= end || *rest != ' ' || rest + 1 >= end)
            return ck_fail(k, "%s: empty HELP", f->name);
        f->help = 1;
        return 0;
    }
    if (f->type)
        return ck_fail(k, "%s: two TYPE lines", f->name);
    if (rest >= end || *rest != ' ')
        return ck_fail(k, "%s: TYPE without a type", f->name);
    rest++;
    size_t tl = (size_t)(end - rest);
    for (int t = 0; t < 3; t++)
        if (strlen(type_name[t]) == tl && memcmp(rest, type_name[t], tl) == 0) {
            f->type = 1;
            f->t = (pt_type)t;
            return 0;
        }
    return ck_fail(k, "%s: type '%.*s' is not counter, gauge or histogram", f->name, (int)tl, rest);
}

/* ck_value: a sample value (Go ParseFloat syntax, roughly) */
static int ck_value(const char *s, const char *end)
{
    size_t n = (size_t)(end - s);
    if (n == 0)
        return -1;
    if ((n == 3 && memcmp(s, "NaN", 3) == 0) || (n == 4 && memcmp(s, "+Inf", 4) == 0) ||
        (n == 4 && memcmp(s, "-Inf", 4) == 0))
        return 0;
    char tmp[64];
    if (n >= sizeof(tmp))
        return -1;
    memcpy(tmp, s, n);
    tmp[n] = 0;
    char *e;
    strtod(tmp, &e);
    return *e == 0 && e != tmp &&
                   (tmp[0] == '-' || tmp[0] == '+' || tmp[0] == '.' ||
                    (tmp[0] >= '0' && tmp[0] <= '9'))
               ? 0
               : -1;
}

static int ck_sample(ck *k, const char *s, const char *end)
{
    size_t n = name_len(s, 1);
    if (!n)
        return ck_fail(k, "not a sample: '%.40s'", s);
    /* the family: the name itself, or a histogram's name_bucket/_sum/_count */
    ck_fam *f = ck_find(k, s, n);
    const char *suffix = "";
    if (!f) {
        static const char *sfx[3] = {"_bucket", "_sum", "_count"};
        for (int i = 0; i < 3 && !f; i++) {
            size_t sl = strlen(sfx[i]);
            if (n > sl && memcmp(s + n - sl, sfx[i], sl) == 0) {
                f = ck_find(k, s, n - sl);
                if (f && f->t != PT_HISTOGRAM)
                    return ck_fail(k, "%.*s: %s of a %s", (int)n, s, sfx[i], type_name[f->t]);
                suffix = sfx[i];
            }
        }
    } else if (f->t == PT_HISTOGRAM)
        return ck_fail(k, "%s: a histogram has no plain samples", f->name);
    if (!f)
        return ck_fail(k, "%.*s: a sample without # HELP and # TYPE", (int)n, s);
    if (!f->help || !f->type)
        return ck_fail(k, "%s: a sample before its # %s", f->name, f->help ? "TYPE" : "HELP");
    if (ck_enter(k, f) < 0)
        return -1;
    const char *q = s + n;
    int has_le = 0;
    if (q < end && *q == '{') {
        q++;
        while (q < end && *q != '}') {
            size_t ln = name_len(q, 0);
            if (!ln)
                return ck_fail(k, "%s: invalid label name", f->name);
            if (ln == 2 && memcmp(q, "le", 2) == 0)
                has_le = 1;
            q += ln;
            if (q + 1 >= end || q[0] != '=' || q[1] != '"')
                return ck_fail(k, "%s: label without =\"value\"", f->name);
            q += 2;
            while (q < end && *q != '"') {
                if (*q == '\\') {
                    if (q + 1 >= end || (q[1] != '\\' && q[1] != '"' && q[1] != 'n'))
                        return ck_fail(k, "%s: bad escape in a label value", f->name);
                    q++;
                }
                q++;
            }
            if (q >= end)
                return ck_fail(k, "%s: unterminated label value", f->name);
            q++;
            if (q < end && *q == ',')
                q++;
            else if (q < end && *q != '}')
                return ck_fail(k, "%s: labels not separated by ','", f->name);
        }
        if (q >= end)
            return ck_fail(k, "%s: unterminated label set", f->name);
        q++;
    }
    if (strcmp(suffix, "_bucket") == 0 && !has_le)
        return ck_fail(k, "%s_bucket without le", f->name);
    /* the series key (name and labels as written) must be new */
    size_t kl = (size_t)(q - s);
    if (q >= end || *q != ' ')
        return ck_fail(k, "%s: no value", f->name);
    const char *v = q + 1, *ve = v;
    while (ve < end && *ve != ' ')
        ve++;
    if (ck_value(v, ve) < 0)
        return ck_fail(k, "%s: bad value '%.*s'", f->name, (int)(ve - v), v);
    if (ve < end) { /* a timestamp: an integer */
        const char *t = ve + 1;
        if (t >= end)
            return ck_fail(k, "%s: trailing space", f->name);
        for (const char *d = (*t == '-' ? t + 1 : t); d < end; d++)
            if (*d < '0' || *d > '9')
                return ck_fail(k, "%s: bad timestamp", f->name);
    }
    if (k->nseries == k->capseries) {
        size_t nc = k->capseries ? k->capseries * 2 : 256;
        char **ns = realloc(k->series, nc * sizeof(*ns));
        if (!ns)
            return ck_fail(k, "out of memory");
        k->series = ns;
        k->capseries = nc;
    }
    char *key = strndup(s, kl);
    if (!key)
        return ck_fail(k, "out of memory");
    k->series[k->nseries++] = key;
    f->samples++;
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int promtext_check(const char *text, pt_family_info *fams, int maxfam, char *err, size_t errlen)
{
    ck k = {.cur = -1, .err = err, .errlen = errlen};
    int rc = 0;
    const char *s = text;
    if (err && errlen)
        err[0] = 0;
    while (*s && rc == 0) {
        k.line++;
        const char *end = strchr(s, '\n');
        if (!end) {
            rc = ck_fail(&k, "the text does not end with a newline");
            break;
        }
        if (end > s) {
            if (*s == '#')
                rc = ck_meta(&k, s, end);
            else
                rc = ck_sample(&k, s, end);
        }
        s = end + 1;
    }
    for (int i = 0; rc == 0 && i < k.n; i++)
        if (!k.fams[i].help || !k.fams[i].type)
            rc = ck_fail(&k, "%s: no # %s", k.fams[i].name, k.fams[i].help ? "TYPE" : "HELP");
    if (rc == 0 && k.nseries > 1) {
        qsort(k.series, k.nseries, sizeof(*k.series), cmp_str);
        for (size_t i = 1; i < k.nseries && rc == 0; i++)
            if (strcmp(k.series[i], k.series[i - 1]) == 0) {
                k.line = 0;
                rc = ck_fail(&k, "series %s twice", k.series[i]);
            }
    }
    if (rc == 0) {
        for (int i = 0; fams && i < k.n && i < maxfam; i++) {
            snprintf(fams[i].name, sizeof(fams[i].name), "%s", k.fams[i].name);
            fams[i].type = k.fams[i].t;
            fams[i].samples = k.fams[i].samples;
        }
        rc = k.n;
    }
    for (size_t i = 0; i < k.nseries; i++)
        free(k.series[i]);
    free(k.series);
    free(k.fams);
    return rc;
}
