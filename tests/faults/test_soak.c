/*
 * test_soak.c - the service under faults, from C: a short run of
 * tests/faults/soak.py (the Python client's inference and training under
 * worker SIGKILLs, with automatic checkpoints). Its suite stays `python`
 * (python::soak_with_worker_kills), the name CI and the docs know it by.
 * The longer kill test (tests/faults/kill_test.py) is run by hand or by
 * deploy/gpu-kill-test.sh. Skipped when python3 with NumPy is not installed
 * or lib/libmoe.so is not built.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int have_numpy(void)
{
    return system("python3 -c 'import numpy' >/dev/null 2>&1") == 0;
}

/* A short chaos run: inference and training with expect_step under worker
 * SIGKILLs every 4 s, with automatic checkpoints: no unexpected error, no
 * step lost or applied twice. */
Test(python, soak_with_worker_kills, .timeout = 90)
{
    if (!have_numpy())
        cr_skip_test("python3 with numpy is not installed");
    if (access("lib/libmoe.so", R_OK) != 0)
        cr_skip_test("lib/libmoe.so not built");
    char out[8192];
    FILE *p =
        popen("python3 tests/faults/soak.py --seconds 20 --workers 2 --kill-every 4 2>&1", "r");
    cr_assert(p);
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "soak failed:\n%s", out);
    cr_assert(strstr(out, "1 passed, 0 failed") != NULL, "%s", out);
}
