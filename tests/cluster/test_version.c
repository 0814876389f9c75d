/*
 * test_version.c - `moe-worker --version` says what the binary can do (the
 * GPU scripts ask it instead of grepping symbols, which a stripped binary
 * does not have): its backends - cuda exactly when this build has CUDA -
 * the CUDA line, the GPU it finds and its BLAS; exit status 0.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "tests/cluster.h"

Test(version, worker_says_its_backends)
{
    char cmd[1024], out[2048];
    snprintf(cmd, sizeof(cmd), "%s/moe-worker --version 2>&1", cluster_bin_dir());
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status 0x%x: %s", st, out);
    cr_assert(strstr(out, "moe-worker "), "%s", out);
    const char *b = strstr(out, "backends: cpu");
    cr_assert(b, "no backends line: %s", out);
#ifdef MOE_HAVE_CUDA
    cr_assert(strncmp(b, "backends: cpu cuda\n", 19) == 0, "a CUDA build must say cuda: %s", out);
    cr_assert(strstr(out, "cuda: runtime "), "%s", out);
#else
    cr_assert(strncmp(b, "backends: cpu\n", 14) == 0, "a CPU build must not say cuda: %s", out);
    cr_assert(strstr(out, "cuda: not in this build"), "%s", out);
#endif
    cr_assert(strstr(out, "\ngpu 0: "), "%s", out);
    cr_assert(strstr(out, "\nblas: openblas"), "%s", out);
}
