/*
 * test_deploy_scripts.c - the deploy checks written in bash (tests/deploy/,
 * run from the repository root): systemd units and `make install`'s layout,
 * the Kubernetes manifests and the Dockerfile, the Slurm batch script with
 * stub srun / scontrol, the air-gapped bundle started from a fresh
 * directory, and the local cluster script started twice in one run
 * directory. A script exits 0 (pass), 77 (skipped: a tool it needs is not
 * installed; its last line says which) or anything else (fail: its output is
 * printed).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char out[1 << 16];

/* run_script runs tests/deploy/<name> with bash; its output (the last part
 * that fits) in out; returns its exit code, -1 when it did not exit */
static int run_script(const char *name)
{
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "bash tests/deploy/%s 2>&1", name);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t len = 0;
    char line[1024];
    out[0] = 0;
    while (fgets(line, sizeof(line), p)) {
        size_t n = strlen(line);
        if (len + n >= sizeof(out)) { /* keep the end: the failure is there */
            size_t drop = len + n - sizeof(out) + 1;
            memmove(out, out + drop, len - drop);
            len -= drop;
        }
        memcpy(out + len, line, n + 1);
        len += n;
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void check_script(const char *name)
{
    cr_assert_eq(access("tests/deploy", R_OK), 0, "run from the repository root");
    int rc = run_script(name);
    if (rc == 77) {
        const char *last = out + strlen(out);
        while (last > out && last[-1] == '\n')
            last--;
        while (last > out && last[-1] != '\n')
            last--;
        cr_skip_test("%s", last);
    }
    cr_assert_eq(rc, 0, "tests/deploy/%s exited %d:\n%s", name, rc, out);
}

Test(deploy_files, systemd_units_install_and_verify, .timeout = 120)
{
    check_script("systemd.sh");
}

Test(deploy_files, kubernetes_manifests_and_dockerfile, .timeout = 120)
{
    check_script("k8s.sh");
}

Test(deploy_files, slurm_batch_script_with_stub_srun, .timeout = 300)
{
    check_script("slurm.sh");
}

Test(deploy_files, bundle_installs_and_runs_from_a_fresh_directory, .timeout = 600)
{
    check_script("bundle.sh");
}

Test(deploy_files, local_cluster_restarts_in_one_run_directory, .timeout = 300)
{
    check_script("local_cluster.sh");
}
