/*
 * test_cluster_harness.c - the cluster harness leaves nothing behind: after
 * cluster_stop every daemon is reaped and the temp dir is gone; when a test
 * dies without any cleanup (a forked child that _exits) the kernel kills its
 * daemons (PR_SET_PDEATHSIG); when a test fails, cluster_fini_all prints the
 * daemon logs and stops everything.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cluster.h"

/* gone: pid does not run any more (no such process, or a zombie whose new
 * parent has not reaped it yet). */
static int gone(pid_t pid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 1;
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *rp = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return rp && (rp[2] == 'Z' || rp[2] == 'X');
}

static int wait_gone(const pid_t *pids, int n, int timeout_ms)
{
    int64_t t0 = cluster_now_ms();
    for (;;) {
        int left = 0;
        for (int i = 0; i < n; i++)
            left += pids[i] > 0 && !gone(pids[i]);
        if (!left)
            return 0;
        if (cluster_now_ms() - t0 > timeout_ms)
            return left;
        usleep(10000);
    }
}

static int dir_exists(const char *dir)
{
    struct stat st;
    return stat(dir, &st) == 0;
}

Test(cluster_harness, stop_reaps_everything, .timeout = 30, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 2};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    pid_t pids[3] = {cl->coord_pid, cl->worker_pid[0], cl->worker_pid[1]};
    char dir[256];
    snprintf(dir, sizeof(dir), "%s", cl->dir);
    cr_assert(dir_exists(dir));
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
    for (int i = 0; i < 3; i++)
        cr_assert(kill(pids[i], 0) != 0 && errno == ESRCH, "pid %d still exists", (int)pids[i]);
    cr_assert(!dir_exists(dir), "%s left behind", dir);
}

typedef struct child_report {
    pid_t pids[3];
    char dir[256];
} child_report;

/* A child plays a test that dies abruptly: it starts a cluster, reports the
 * pids and _exits without stopping anything. (A forked child cannot use nng,
 * so it starts the daemons without a client.) */
Test(cluster_harness, daemons_die_with_their_test, .timeout = 30, .fini = cluster_fini_all)
{
    int fd[2];
    cr_assert_eq(pipe(fd), 0);
    pid_t child = fork();
    cr_assert_geq(child, 0);
    if (child == 0) {
        close(fd[0]);
        cluster_opts o = {.workers = 2, .no_client = 1}; /* no nng after fork */
        cluster *cl = cluster_start(&o);
        child_report rep;
        memset(&rep, 0, sizeof(rep));
        if (cl) {
            rep.pids[0] = cl->coord_pid;
            rep.pids[1] = cl->worker_pid[0];
            rep.pids[2] = cl->worker_pid[1];
            snprintf(rep.dir, sizeof(rep.dir), "%s", cl->dir);
        } else {
            fprintf(stderr, "child: cluster_start: %s\n", cluster_error());
        }
        ssize_t w = write(fd[1], &rep, sizeof(rep));
        (void)w;
        _exit(cl ? 0 : 1);
    }
    close(fd[1]);
    child_report rep;
    memset(&rep, 0, sizeof(rep));
    ssize_t n = read(fd[0], &rep, sizeof(rep));
    close(fd[0]);
    int st;
    waitpid(child, &st, 0);
    cr_assert(n == (ssize_t)sizeof(rep) && WIFEXITED(st) && WEXITSTATUS(st) == 0,
              "the child could not start its cluster (read %zd, status 0x%x)", n, st);
    int left = wait_gone(rep.pids, 3, 5000);
    /* the child could not clean its directory: do it for it */
    static const char *files[] = {"addr", "addr.tmp", "coord.log", "worker-0.log", "worker-1.log"};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        char path[400];
        snprintf(path, sizeof(path), "%s/%s", rep.dir, files[i]);
        unlink(path);
    }
    rmdir(rep.dir);
    cr_assert_eq(left, 0, "%d daemons outlived their test process", left);
}

/* A child plays a failed test: cluster_fini_all (what .fini runs) prints the
 * logs and stops the daemons. */
Test(cluster_harness, fini_prints_logs_and_stops, .timeout = 30, .fini = cluster_fini_all)
{
    int fd[2], out[2];
    cr_assert_eq(pipe(fd), 0);
    cr_assert_eq(pipe(out), 0);
    pid_t child = fork();
    cr_assert_geq(child, 0);
    if (child == 0) {
        close(fd[0]);
        close(out[0]);
        dup2(out[1], STDERR_FILENO);
        cluster_opts o = {.workers = 1, .no_client = 1}; /* no nng after fork */
        cluster *cl = cluster_start(&o);
        if (cl) /* let the daemons write their first lines */
            usleep(300000);
        pid_t pids[2] = {cl ? cl->coord_pid : 0, cl ? cl->worker_pid[0] : 0};
        ssize_t w = write(fd[1], pids, sizeof(pids));
        (void)w;
        cluster_fini_all();
        _exit(cl ? 0 : 1);
    }
    close(fd[1]);
    close(out[1]);
    pid_t pids[2] = {0, 0};
    ssize_t n = read(fd[0], pids, sizeof(pids));
    close(fd[0]);
    static char text[1 << 16];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(out[0], text + len, sizeof(text) - 1 - len);
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    close(out[0]);
    text[len] = 0;
    int st;
    waitpid(child, &st, 0);
    cr_assert(n == (ssize_t)sizeof(pids) && WIFEXITED(st) && WEXITSTATUS(st) == 0,
              "the child could not start its cluster (read %zd, status 0x%x)", n, st);
    cr_assert(strstr(text, "test did not finish"), "no header in:\n%s", text);
    cr_assert(strstr(text, "coord.log") && strstr(text, "worker-0.log"), "no logs in:\n%s", text);
    cr_assert(strstr(text, "moe-coordinator pid"), "coordinator log missing:\n%s", text);
    cr_assert_eq(wait_gone(pids, 2, 5000), 0, "daemons left running after cluster_fini_all");
}
