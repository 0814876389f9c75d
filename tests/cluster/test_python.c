/*
 * test_python.c - the Python package (python/moe over lib/libmoe.so)
 * against a real cluster, and through it the parity check against an
 * independent float64 reference of the Hugging Face Mixtral MoE block
 * (python/parity.py: weights read back from the service's checkpoint,
 * forward and input gradient, f32 and bf16), its API (python/api_check.py),
 * training through moe.torch.RemoteMoE against a local torch model
 * (python/train_check.py), and pip install into a fresh venv
 * (python/install_check.py). Skipped when python3 with NumPy is not
 * installed; the torch test when torch is not (.ci/run installs both). The
 * soak under worker kills is tests/faults/test_soak.c.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cluster.h"

static int have_numpy(void)
{
    return system("python3 -c 'import numpy' >/dev/null 2>&1") == 0;
}

static int have_torch(void)
{
    return system("python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

/* run_script runs python3 python/<script> <args>, its stdout and stderr
 * into out (NUL terminated, truncated); returns its exit status or -1. */
static int run_script(const char *script, const char *args, char *out, size_t len)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "python3 python/%s %s 2>&1", script, args);
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
        int rc = run_script("parity.py", args, out, sizeof(out));
        cr_log_info("%s", out);
        cr_expect_eq(rc, 0, "parity.py %s failed:\n%s", bf ? "bf16" : "f32", out);
        cr_expect(strstr(out, "PASS") != NULL, "%s", out);
    }
    cr_assert_eq(cluster_stop(cl), 0);
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

/* The package's API (python/api_check.py): status, model_info, stats,
 * dataplane_info and call; one moe.Error subclass per wire code, the same
 * codes as moe_err_code; the msgpack codec; import moe without torch. */
Test(python, api_calls_and_error_classes, .timeout = 120, .fini = cluster_fini_all)
{
    if (!have_numpy())
        cr_skip_test("python3 with numpy is not installed");
    if (access("lib/libmoe.so", R_OK) != 0)
        cr_skip_test("lib/libmoe.so not built");
    cluster_opts o = {0};
    o.workers = 2;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    char args[512], out[8192];
    snprintf(args, sizeof(args), "--url %s", cl->url);
    int rc = run_script("api_check.py", args, out, sizeof(out));
    cr_log_info("%s", out);
    cr_expect_eq(rc, 0, "api_check.py failed:\n%s", out);
    cr_expect(strstr(out, " 0 failed") != NULL, "%s", out);
    cr_assert_eq(cluster_stop(cl), 0);
}

/* A small model (Linear, moe.torch.RemoteMoE, Linear) trained for 5 AdamW
 * steps through the service (python/train_check.py) against the same model
 * trained locally in float64 torch, from the service's own checkpointed
 * weights: the loss and aux loss at every step, the first step's input-layer
 * gradient (the service's dx), every weight after the last step (read back
 * from a checkpoint) and an inference forward agree. */
Test(python, remote_moe_training_matches_torch, .timeout = 180, .fini = cluster_fini_all)
{
    if (!have_numpy())
        cr_skip_test("python3 with numpy is not installed");
    if (!have_torch())
        cr_skip_test("python3 with torch is not installed");
    if (access("lib/libmoe.so", R_OK) != 0)
        cr_skip_test("lib/libmoe.so not built");
    cluster_opts o = {0};
    o.workers = 2;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    char args[512], out[8192];
    snprintf(args, sizeof(args), "--url %s --workdir %s/train", cl->url, cl->dir);
    int rc = run_script("train_check.py", args, out, sizeof(out));
    cr_log_info("%s", out);
    cr_expect_eq(rc, 0, "train_check.py failed:\n%s", out);
    cr_expect(strstr(out, " 0 failed") != NULL, "%s", out);
    cr_assert_eq(cluster_stop(cl), 0);
}

/* pip install of the package into a fresh venv (python/install_check.py):
 * the installed moe loads the libmoe.so copied into it and pings a
 * coordinator. Skipped where venv, pip or a wheel-building setuptools is
 * missing (the script says which). */
Test(python, pip_install_into_fresh_venv, .timeout = 180, .fini = cluster_fini_all)
{
    if (!have_numpy())
        cr_skip_test("python3 with numpy is not installed");
    if (access("lib/libmoe.so", R_OK) != 0)
        cr_skip_test("lib/libmoe.so not built");
    cluster_opts o = {0};
    o.workers = 0; /* a coordinator alone answers ping */
    o.no_wait = 1;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster: %s", cluster_error());
    char args[512], out[8192];
    snprintf(args, sizeof(args), "--url %s", cl->url);
    int rc = run_script("install_check.py", args, out, sizeof(out));
    cr_log_info("%s", out);
    cr_assert_eq(cluster_stop(cl), 0);
    if (rc == 0 && strncmp(out, "SKIP:", 5) == 0)
        cr_skip_test("%s", out);
    cr_expect_eq(rc, 0, "install_check.py failed:\n%s", out);
    cr_expect(strstr(out, " 0 failed") != NULL, "%s", out);
}
