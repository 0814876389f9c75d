/*
 * promtext.h - the one writer of the Prometheus text exposition format
 * 0.0.4 (what /metrics serves), built so that the usual mistakes cannot be
 * written:
 *
 *   - a family is declared once, with its name, type and HELP
 *     (pt_family); its samples follow it and name no metric themselves, so
 *     every family is one group, with HELP and TYPE first;
 *   - a family name declared a second time, an invalid metric or label
 *     name, an empty HELP, a counter whose name does not end in "_total", a
 *     sample before any family, or a plain sample of a histogram family
 *     fails the writer: it records why (pt_error), writes nothing more, and
 *     pt_finish returns NULL;
 *   - label values are escaped as the format wants (backslash, double
 *     quote, newline); HELP text too;
 *   - a histogram's samples come from one call (pt_histogram): cumulative
 *     buckets ending in le="+Inf", then _sum and _count.
 *
 * promtext_check reads a text back and checks the same rules (one group per
 * family, HELP and TYPE before its samples, well-formed lines, no series
 * twice): the tests run it on a live /metrics.
 */
#ifndef MOE_PROMTEXT_H
#define MOE_PROMTEXT_H

#include <stddef.h>
#include <stdint.h>

#define PT_MAX_FAMILIES 96
#define PT_NAME_MAX     96
#define PT_MAX_LABELS   8

typedef enum pt_type { PT_COUNTER = 0, PT_GAUGE, PT_HISTOGRAM } pt_type;

typedef struct pt_label {
    const char *name;  /* [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__" */
    const char *value; /* any UTF-8 text; escaped on output */
} pt_label;

/* A writer. Zero it with pt_init; the text belongs to it until pt_finish. */
typedef struct promtext {
    char *buf; /* owned */
    size_t len, cap;
    char names[PT_MAX_FAMILIES][PT_NAME_MAX]; /* the families declared so far */
    int nfam;
    pt_type type; /* of the current family (names[nfam - 1]) */
    char err[192];
} promtext;

void pt_init(promtext *p);
/* pt_family starts family name (written as "# HELP" and "# TYPE" lines).
 * Returns 0, or -1 when the writer failed (now or before). */
int pt_family(promtext *p, const char *name, pt_type type, const char *help);
/* pt_sample_u64 / pt_sample_f64 write one sample of the current counter or
 * gauge family with labels l[0..nl) (nl <= PT_MAX_LABELS; l may be NULL
 * when nl is 0). */
void pt_sample_u64(promtext *p, const pt_label *l, int nl, uint64_t v);
void pt_sample_f64(promtext *p, const pt_label *l, int nl, double v);
/* pt_histogram writes one histogram series of the current histogram
 * family: counts[0..nb] are per bucket, not cumulative (counts[i] = values
 * <= bounds[i] and above bounds[i-1]; counts[nb] = above bounds[nb-1]),
 * bounds ascending; sum is the sum of the values. */
void pt_histogram(promtext *p, const pt_label *l, int nl, const double *bounds, int nb,
                  const uint64_t *counts, double sum);
/* pt_error: why the writer failed, or NULL while it has not. */
const char *pt_error(const promtext *p);
/* pt_finish returns the text (NUL terminated, the caller frees it) and
 * resets p; NULL when the writer failed (p is freed either way). */
char *pt_finish(promtext *p);
/* pt_free drops the text (a writer not finished). */
void pt_free(promtext *p);

/* A family as promtext_check found it. */
typedef struct pt_family_info {
    char name[PT_NAME_MAX];
    pt_type type;
    int samples;
} pt_family_info;

/* promtext_check checks text (NUL terminated). Returns the number of
 * families (their names in fams[0..min(n, maxfam)) when fams is not NULL),
 * or -1 with the first problem and its line number in err. */
int promtext_check(const char *text, pt_family_info *fams, int maxfam, char *err, size_t errlen);

#endif
