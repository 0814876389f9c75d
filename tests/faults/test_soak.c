/*
 * test_soak.c - the service under faults, from C: a short run of
 * tests/faults/soak.py (the Python client's inference and training under
 * worker SIGKILLs, with automatic checkpoints). Its suite stays `python`
 * (python::soak_with_worker_kills), the name CI and the docs know it by.
 * The longer kill test (tests/faults/kill_test.py) is run by hand or by
 * deploy/gpu-kill-test.sh and deploy/kill-series.sh; a short run of its
 * --kills mode (two kills in one cluster, each inside an optimizer step,
 * the second of worker 0) keeps that tool honest here. Skipped when python3
 * with NumPy is not installed or lib/libmoe.so is not built.
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

/* kill_test.py --kills 2 on 2 CPU workers: each kill answered, the cluster
 * re-formed, no acknowledged step lost (checkpoints after every step), a
 * kill-summary line per kill; its bounds are generous (answers 16.5 s,
 * down 6.5 s, re-formation 60 s), so a loaded machine does not fail it */
Test(python, kill_test_two_kills_in_one_cluster, .timeout = 150)
{
    if (!have_numpy())
        cr_skip_test("python3 with numpy is not installed");
    if (access("lib/libmoe.so", R_OK) != 0)
        cr_skip_test("lib/libmoe.so not built");
    char dir[] = "/tmp/moe-kt-XXXXXX";
    cr_assert(mkdtemp(dir), "mkdtemp");
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "python3 tests/faults/kill_test.py --workers 2 --backend cpu --kills 2 --train "
             "--kill-during step --checkpoint-dir %s/ck --d-model 128 --d-ff 256 --seed 3 "
             "--time-limit 120 >%s/out.log 2>&1; rc=$?; "
             "grep -E '^kill-summary|^kill test:|check [0-9]+b? .*: FAIL|Abort' %s/out.log; "
             "[ $rc -ne 0 ] && tail -n 60 %s/out.log; exit $rc",
             dir, dir, dir, dir);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    char out[8192];
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kill test failed:\n%s", out);
    cr_assert(strstr(out, "kill-summary 1 PASS victim 1") &&
                  strstr(out, "kill-summary 2 PASS victim 0"),
              "a kill-summary line per kill, the victims in turn:\n%s", out);
    cr_assert(strstr(out, "2 of 2 kills made"), "%s", out);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    cr_expect(system(cmd) == 0);
}
