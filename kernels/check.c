/* check.c - comparison helpers for tests and check programs. */
#include <math.h>
#include <stdio.h>

#include "kernels/kern.h"

double kern_rel_err(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    num = sqrt(num);
    den = sqrt(den);
    return den > 0.0 ? num / den : num;
}

size_t kern_print_mismatches(const char *name, const float *a, const float *b, size_t n, double tol,
                             int max_print)
{
    double bmax = 0.0;
    for (size_t i = 0; i < n; i++)
        bmax = fmax(bmax, fabs((double)b[i]));
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > tol * (fabs((double)b[i]) + bmax / 100.0) || isnan(d)) {
            if ((int)bad < max_print)
                fprintf(stderr, "  %s[%zu]: got %.9g want %.9g (diff %.3g)\n", name, i,
                        (double)a[i], (double)b[i], d);
            bad++;
        }
    }
    if (bad)
        fprintf(stderr, "  %s: %zu of %zu mismatch (tol %.3g), rel err %.3g\n", name, bad, n, tol,
                kern_rel_err(a, b, n));
    return bad;
}
