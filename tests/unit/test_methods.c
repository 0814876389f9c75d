/*
 * test_methods.c - docs/PROTOCOL.md's method table (the rows after the
 * "<!-- method-table -->" marker) says exactly what the daemons' method
 * tables do: the same methods on each endpoint (coordinator, worker, data
 * plane), and for each the same flags - exactly-once, refused while
 * draining, called by the cluster, run on the compute thread. Every method
 * is also described somewhere else in the document (its params).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/coord.h"
#include "worker/dataplane.h"
#include "worker/worker.h"

typedef struct doc_row {
    char endpoint[32], method[64], once[32], drain[32], caller[32], thread[32];
} doc_row;

static char *read_doc(void)
{
    FILE *f = fopen("docs/PROTOCOL.md", "rb");
    cr_assert(f, "docs/PROTOCOL.md not found (run from the repository root)");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    cr_assert(s && fread(s, 1, (size_t)n, f) == (size_t)n);
    s[n] = 0;
    fclose(f);
    return s;
}

/* cell copies the trimmed cell text (backticks dropped) into out */
static void cell(const char *a, const char *b, char *out, size_t cap)
{
    while (a < b && (*a == ' ' || *a == '`'))
        a++;
    while (b > a && (b[-1] == ' ' || b[-1] == '`'))
        b--;
    size_t n = (size_t)(b - a) < cap - 1 ? (size_t)(b - a) : cap - 1;
    memcpy(out, a, n);
    out[n] = 0;
}

/* parse_table reads the method table's data rows into rows (at most max). */
static int parse_table(const char *doc, doc_row *rows, int max)
{
    const char *p = strstr(doc, "<!-- method-table -->");
    cr_assert(p, "docs/PROTOCOL.md has no <!-- method-table --> marker");
    p = strchr(p, '\n') + 1;
    int n = 0, line = 0;
    while (*p == '|') {
        const char *eol = strchr(p, '\n');
        if (!eol)
            eol = p + strlen(p);
        if (line++ >= 2) { /* after the header and the |---| row */
            char *cells[6];
            doc_row *r = &rows[n];
            cells[0] = r->endpoint, cells[1] = r->method, cells[2] = r->once;
            cells[3] = r->drain, cells[4] = r->caller, cells[5] = r->thread;
            const char *a = p + 1;
            for (int k = 0; k < 6; k++) {
                const char *b = memchr(a, '|', (size_t)(eol - a));
                cr_assert(b, "method table row %d has fewer than 6 cells", line);
                cell(a, b, cells[k], 32);
                a = b + 1;
            }
            cr_assert(n < max);
            n++;
        }
        p = *eol ? eol + 1 : eol;
    }
    return n;
}

static const doc_row *find_row(const doc_row *rows, int n, const char *ep, const char *m)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(rows[i].endpoint, ep) && !strcmp(rows[i].method, m))
            return &rows[i];
    return NULL;
}

/* check_row: the documented flags of one table row equal m's flags */
static void check_row(const doc_row *rows, int n, const char *ep, const rpc_method *m)
{
    const doc_row *r = find_row(rows, n, ep, m->name);
    cr_assert(r, "%s method '%s' is missing from docs/PROTOCOL.md's method table", ep, m->name);
    const char *once = (m->flags & RPC_MUTATING)            ? "yes"
                       : (m->flags & RPC_MUTATING_IF_TRAIN) ? "with train: true"
                                                            : "";
    cr_expect_str_eq(r->once, once, "%s %s: exactly-once", ep, m->name);
    cr_expect_str_eq(r->drain, (m->flags & RPC_REFUSED_DRAINING) ? "refused" : "",
                     "%s %s: draining", ep, m->name);
    cr_expect_str_eq(r->caller, (m->flags & RPC_INTERNAL) ? "cluster" : "clients",
                     "%s %s: called by", ep, m->name);
    if (!strcmp(ep, "worker"))
        cr_expect_str_eq(r->thread, (m->flags & RPC_COMPUTE) ? "compute" : "loop", "%s %s: thread",
                         ep, m->name);
}

Test(methods, protocol_doc_matches_the_method_tables)
{
    char *doc = read_doc();
    static doc_row rows[128];
    int n = parse_table(doc, rows, 128);
    cr_assert_eq(n, coord_nmethods + wkr_nmethods + dp_nmethods,
                 "the docs' method table has %d rows; the daemons have %d + %d + %d methods", n,
                 coord_nmethods, wkr_nmethods, dp_nmethods);
    for (int i = 0; i < coord_nmethods; i++)
        check_row(rows, n, "coordinator", &coord_methods[i].m);
    for (int i = 0; i < wkr_nmethods; i++)
        check_row(rows, n, "worker", &wkr_methods[i].m);
    for (int i = 0; i < dp_nmethods; i++)
        check_row(rows, n, "data plane", &dp_methods[i].m);
    /* every method is described beyond the summary: a params row of a
     * method table ("| `name`") or a data-plane call ("name {") */
    const char *after = strstr(doc, "### Client methods");
    cr_assert(after);
    for (int i = 0; i < n; i++) {
        char a[96], b[96];
        snprintf(a, sizeof(a), "| `%s`", rows[i].method);
        snprintf(b, sizeof(b), "%s {", rows[i].method);
        cr_expect(strstr(after, a) || strstr(after, b),
                  "method '%s' has no description of its params in docs/PROTOCOL.md",
                  rows[i].method);
    }
    free(doc);
}

/* the lookup finds every row by its exact name and nothing else */
Test(methods, lookup_is_exact)
{
    for (int i = 0; i < coord_nmethods; i++) {
        const char *name = coord_methods[i].m.name;
        const coord_method *m = rpc_method_find(coord_methods, coord_nmethods, sizeof(coord_method),
                                                name, strlen(name));
        cr_assert_eq(m, &coord_methods[i]);
        cr_assert_null(rpc_method_find(coord_methods, coord_nmethods, sizeof(coord_method), name,
                                       strlen(name) - 1));
    }
    cr_assert_null(rpc_method_find(wkr_methods, wkr_nmethods, sizeof(wkr_method), "forward", 7));
    cr_assert_not_null(
        rpc_method_find(wkr_methods, wkr_nmethods, sizeof(wkr_method), "worker.forward", 14));
}
