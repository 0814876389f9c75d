/* test_rows.c - rows_first_nonfinite (worker/rows.h): the first row holding
 * a NaN or an Inf (either sign), on sizes split over threads and not; the
 * largest finite values, subnormals and -0 are finite; n when none. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "worker/rows.h"
#include "common/rng.h"

static void expect_first(int64_t n, int64_t H, const int64_t *bad_rows, int nbad, float bad,
                         int64_t want)
{
    float *x = malloc((size_t)(n * H > 0 ? n * H : 1) * sizeof(float));
    cr_assert(x);
    rng_fill_uniform(5, (uint64_t)(n + H), -1, 1, x, (size_t)(n * H));
    if (n * H >= 4) { /* finite edge values somewhere */
        x[0] = FLT_MAX;
        x[1] = -FLT_MAX;
        x[2] = FLT_TRUE_MIN;
        x[3] = -0.0f;
    }
    for (int i = 0; i < nbad; i++)
        x[bad_rows[i] * H + (bad_rows[i] * 7 + 3) % H] = bad;
    int64_t got = rows_first_nonfinite(x, n, H);
    cr_expect_eq(got, want, "n %lld H %lld bad %g: first %lld, want %lld", (long long)n,
                 (long long)H, (double)bad, (long long)got, (long long)want);
    free(x);
}

Test(rows, first_nonfinite_row)
{
    const int64_t one[1] = {13}, late[2] = {2900, 2999}, two[2] = {1700, 250};
    const float bads[3] = {NAN, INFINITY, -INFINITY};
    for (int k = 0; k < 3; k++) {
        /* small: one thread's part */
        expect_first(20, 16, one, 1, bads[k], 13);
        expect_first(20, 16, NULL, 0, bads[k], 20);
        /* 3000 x 1000: several parts; the earliest bad row wins whichever
         * part finds its own first */
        expect_first(3000, 1000, late, 2, bads[k], 2900);
        expect_first(3000, 1000, two, 2, bads[k], 250);
        expect_first(3000, 1000, NULL, 0, bads[k], 3000);
    }
    cr_expect_eq(rows_first_nonfinite(NULL, 0, 16), 0);
}
