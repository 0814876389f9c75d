/*
 * test_python.c - the Python client (python/moe.py over lib/libmoe.so)
 * against a real cluster, and through it the parity check against an
 * independent float64 reference of the Hugging Face Mixtral MoE block
 * (python/parity.py: weights read back from the service's checkpoint,
 * forward and input gradient, f32 and bf16). Skipped when python3 with
 * NumPy is not installed (.ci/run installs it).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cluster.h"

static int have_numpy(void)
{
    return system("python3 -c 'import numpy' >/dev/null 2>&1") == 0;
}

static int run_py(const char *args, char *out, size_t len)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "python3 python/parity.py %s 2>&1", args);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, len - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(python, parity_with_mixtral_reference, .timeout = 120, .fini = cluster_fini_all)
{
    if (!have_numpy())
        cr_skip_test("python3 with numpy is not installed");
    if (access("lib/libmoe.so", R_OK) != 0)
        cr_skip_test("lib/libmoe.so not built");
    cluster_opts o = {0};
    o.workers = 2;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    char args[512], out[4096];
    for (int bf = 0; bf < 2; bf++) {
        snprintf(args, sizeof(args), "--url %s --numpy --dtype %s --workdir %s/parity-%d", cl->url,
                 bf ? "bf16" : "f32", cl->dir, bf);
        int rc = run_py(args, out, sizeof(out));
        cr_log_info("%s", out);
        cr_expect_eq(rc, 0, "parity.py %s failed:\n%s", bf ? "bf16" : "f32", out);
        cr_expect(strstr(out, "PASS") != NULL, "%s", out);
    }
    cr_assert_eq(cluster_stop(cl), 0);
}

/* A short chaos run (python/soak.py): inference and training with
 * expect_step under worker SIGKILLs every 4 s, with automatic checkpoints:
 * no unexpected error, no step lost or applied twice. */
Test(python, soak_with_worker_kills, .timeout = 90)
{
    if (!have_numpy())
        cr_skip_test("python3 with numpy is not installed");
    if (access("lib/libmoe.so", R_OK) != 0)
        cr_skip_test("lib/libmoe.so not built");
    char out[8192];
    FILE *p = popen("python3 python/soak.py --seconds 20 --workers 2 --kill-every 4 2>&1", "r");
    cr_assert(p);
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "soak failed:\n%s", out);
    cr_assert(strstr(out, "1 passed, 0 failed") != NULL, "%s", out);
}

/* The Python client over the data plane (python/dataplane_check.py): NumPy,
 * Client.buffer arrays, torch CPU tensors when torch is installed, all
 * byte-identical to the coordinator path; a closed client raises. */
Test(python, dataplane_numpy_and_torch, .timeout = 120, .fini = cluster_fini_all)
{
    if (!have_numpy())
        cr_skip_test("python3 with numpy is not installed");
    if (access("lib/libmoe.so", R_OK) != 0)
        cr_skip_test("lib/libmoe.so not built");
    cluster_opts o = {0};
    o.workers = 2;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    char cmd[1024], out[8192];
    snprintf(cmd, sizeof(cmd), "python3 python/dataplane_check.py --url %s 2>&1", cl->url);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "dataplane_check.py failed:\n%s", out);
    cr_assert(strstr(out, " 0 failed") != NULL, "%s", out);
    cr_assert_eq(cluster_stop(cl), 0);
}
