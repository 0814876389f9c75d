/*
 * test_nccl_pieces.c - the NCCL client path's pieces (common/nccl_pieces.h):
 * the row split both sides compute (every row in exactly one piece, in
 * order, sizes within one row of each other, awkward sizes included), the
 * worker's check of data.rows "pieces" (bounds, a piece of no rows, pieces
 * outside a lane forward: refused with a clear reason) and the client's
 * choice (2 from 16 MiB of x, MOE_NCCL_PIECES forcing, clamped to what the
 * worker and the rows allow).
 */
#include <criterion/criterion.h>
#include <string.h>

#include "common/nccl_pieces.h"

Test(nccl_pieces, split_covers_every_row_once)
{
    static const int64_t rows[] = {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 1000, 16383, 16384, 1ll << 31};
    for (size_t k = 0; k < sizeof(rows) / sizeof(rows[0]); k++)
        for (int P = 1; P <= NCCL_PIECES_MAX; P++) {
            const int64_t R = rows[k];
            cr_assert_eq(nccl_piece_first(R, P, 0), 0, "R %lld P %d: piece 0 starts at 0",
                         (long long)R, P);
            cr_assert_eq(nccl_piece_first(R, P, P), R, "R %lld P %d: the last ends at R",
                         (long long)R, P);
            int64_t lo = R, hi = 0;
            for (int i = 0; i < P; i++) {
                const int64_t n = nccl_piece_first(R, P, i + 1) - nccl_piece_first(R, P, i);
                cr_assert_geq(n, 0, "R %lld P %d piece %d: %lld rows", (long long)R, P, i,
                              (long long)n);
                lo = n < lo ? n : lo;
                hi = n > hi ? n : hi;
                /* floor(i R / P) exactly, as the other side computes it */
                cr_assert_eq(nccl_piece_first(R, P, i), R * (int64_t)i / (int64_t)P);
            }
            cr_assert_leq(hi - lo, 1, "R %lld P %d: pieces of %lld to %lld rows", (long long)R, P,
                          (long long)lo, (long long)hi);
            if (R >= P)
                cr_assert_geq(lo, 1, "R %lld P %d: an empty piece", (long long)R, P);
        }
}

Test(nccl_pieces, split_awkward_sizes)
{
    /* rows not divisible by the pieces: the extra rows go to the later pieces */
    const int64_t want7[4] = {0, 1, 3, 5}; /* 7 rows in 4: 1, 2, 2, 2 */
    for (int i = 0; i < 4; i++)
        cr_assert_eq(nccl_piece_first(7, 4, i), want7[i], "7 rows in 4, piece %d", i);
    /* fewer rows than pieces: some pieces are empty (which is why the
     * worker refuses more pieces than rows) */
    int empty = 0;
    for (int i = 0; i < 8; i++)
        empty += nccl_piece_first(3, 8, i + 1) == nccl_piece_first(3, 8, i);
    cr_assert_eq(empty, 5, "3 rows in 8 pieces: %d empty", empty);
    cr_assert_eq(nccl_piece_first(1, 2, 1), 0, "1 row in 2: all in piece 1");
    /* 16384 rows (64 MiB of bf16 at H 2048) in 2: 8192 each */
    cr_assert_eq(nccl_piece_first(16384, 2, 1), 8192);
}

static void refused(int64_t pieces, int64_t R, int lane, int fanout, const char *says)
{
    char err[256] = "";
    moe_err e = nccl_pieces_check(pieces, R, lane, fanout, err, sizeof(err));
    cr_assert_eq(e, MOE_EINVAL, "pieces %lld R %lld lane %d fanout %d: got %s", (long long)pieces,
                 (long long)R, lane, fanout, moe_err_code(e));
    cr_assert(strstr(err, says), "pieces %lld R %lld: '%s' does not say '%s'", (long long)pieces,
              (long long)R, err, says);
    cr_log_info("pieces %lld, %lld rows, lane %d, fanout %d: %s", (long long)pieces, (long long)R,
                lane, fanout, err);
}

Test(nccl_pieces, check_refuses_what_cannot_be_honoured)
{
    char err[256];
    refused(0, 100, 1, 0, "1 to 8 pieces");
    refused(-3, 100, 1, 0, "1 to 8 pieces");
    refused(9, 100, 1, 0, "1 to 8 pieces");
    refused(1ll << 40, 100, 1, 0, "1 to 8 pieces");
    refused(3, 2, 1, 0, "every piece needs at least one row");
    refused(2, 1, 1, 0, "at most 1 pieces");
    refused(2, 100, 0, 0, "only a lane forward");
    refused(2, 100, 1, 1, "only a lane forward");
    /* what may go */
    for (int P = 1; P <= NCCL_PIECES_MAX; P++)
        cr_assert_eq(nccl_pieces_check(P, 8, 1, 0, err, sizeof(err)), MOE_OK, "P %d: %s", P, err);
    /* one piece is what every request was before pieces: always taken */
    cr_assert_eq(nccl_pieces_check(1, 1, 0, 0, err, sizeof(err)), MOE_OK);
    cr_assert_eq(nccl_pieces_check(1, 5, 0, 1, err, sizeof(err)), MOE_OK);
}

Test(nccl_pieces, client_choice)
{
    const size_t MiB = (size_t)1 << 20;
    /* the default: 2 from 16 MiB of x, when the worker takes pieces */
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 8, NULL), 2);
    cr_assert_eq(nccl_pieces_choose(16 * MiB, 4096, 8, ""), 2);
    cr_assert_eq(nccl_pieces_choose(16 * MiB - 1, 4096, 8, NULL), 1);
    cr_assert_eq(nccl_pieces_choose(4096, 1, 8, NULL), 1);
    /* an older worker (no pieces_max: 1) or none (0): one piece */
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 1, NULL), 1);
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 0, "4"), 1);
    /* MOE_NCCL_PIECES forces, 1 disables, clamped to the worker and the rows */
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 8, "1"), 1);
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 8, "4"), 4);
    cr_assert_eq(nccl_pieces_choose(1024, 16, 8, "3"), 3);
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 8, "100"), 8);
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 4, "8"), 4);
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 3, 8, "8"), 3);
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 8, "0"), 1);
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 8, "-2"), 1);
    /* not a number: the default */
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 8, "two"), 2);
    cr_assert_eq(nccl_pieces_choose(64 * MiB, 16384, 8, "3x"), 2);
    /* whatever it picks, the worker's check takes it for a lane forward */
    char err[256];
    for (int64_t R = 1; R <= 20; R++)
        for (int pm = 0; pm <= 9; pm++) {
            int P = nccl_pieces_choose(64 * MiB, R, pm, "8");
            cr_assert_eq(nccl_pieces_check(P, R, 1, 0, err, sizeof(err)), MOE_OK,
                         "R %lld pieces_max %d: chose %d: %s", (long long)R, pm, P, err);
        }
}
