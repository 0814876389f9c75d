/* cluster.c - test harness: real daemons on loopback; see cluster.h. */
#include "tests/cluster.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define MAX_LIVE       8
#define LOG_TAIL_BYTES 24576
/* how long a daemon may take to exit after SIGTERM before it counts as
 * hung: 15 s, so that a 2-core machine loaded past its cores (a suite run
 * beside a build) does not fail a stop that is only slow (a worker took
 * more than 5 s there once, session 30) */
#define STOP_WAIT_MS 15000

/* The clusters' storage: static, so that a cluster outlives the test's stack
 * (a failed cr_assert unwinds it before .fini). live = started, not stopped.
 * Paths are precomputed so the watchdog (a signal handler) needs no snprintf. */
static cluster g_slot[MAX_LIVE];
static int g_watchdog_armed;
static char g_err[512];

const char *cluster_error(void)
{
    return g_err;
}

/* set_err formats the reason into cl->err (if cl) and the global. */
static void set_err(cluster *cl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_err(cluster *cl, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof(g_err), fmt, ap);
    va_end(ap);
    if (cl)
        snprintf(cl->err, sizeof(cl->err), "%s", g_err);
}

int64_t cluster_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* ---- writing without stdio (also used from the watchdog) ---- */

static void put_str(const char *s)
{
    size_t n = strlen(s);
    while (n > 0) {
        ssize_t w = write(STDERR_FILENO, s, n);
        if (w <= 0)
            return;
        s += w;
        n -= (size_t)w;
    }
}

static void dump_file(const char *path)
{
    char buf[4096];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    off_t size = lseek(fd, 0, SEEK_END);
    off_t from = size > LOG_TAIL_BYTES ? size - LOG_TAIL_BYTES : 0;
    put_str("----- ");
    put_str(path);
    put_str(from > 0 ? " (last 24 KiB) -----\n" : " -----\n");
    lseek(fd, from, SEEK_SET);
    for (;;) {
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n <= 0)
            break;
        ssize_t off = 0;
        while (off < n) {
            ssize_t w = write(STDERR_FILENO, buf + off, (size_t)(n - off));
            if (w <= 0)
                break;
            off += w;
        }
    }
    close(fd);
}

static void dump_all(const cluster *cl)
{
    dump_file(cl->paths_coord_log);
    for (int i = 0; i < CLUSTER_MAX_WORKERS; i++)
        dump_file(cl->paths_worker_log[i]);
    put_str("----- end of daemon logs -----\n");
}

void cluster_dump_logs(const cluster *cl, const char *why)
{
    put_str("\n***** cluster harness: ");
    put_str(why ? why : "logs");
    put_str(" *****\n");
    dump_all(cl);
}

/* remove_files deletes the known files and the directory (signal safe). */
static void remove_files(const cluster *cl)
{
    char tmp[340];
    size_t n = strlen(cl->paths_addr);
    unlink(cl->paths_addr);
    if (n + 5 < sizeof(tmp)) { /* the coordinator's addr-file temporary */
        memcpy(tmp, cl->paths_addr, n);
        memcpy(tmp + n, ".tmp", 5);
        unlink(tmp);
    }
    unlink(cl->paths_coord_log);
    unlink(cl->paths_secret);
    for (int i = 0; i < CLUSTER_MAX_WORKERS; i++)
        unlink(cl->paths_worker_log[i]);
    rmdir(cl->dir);
}

/* ---- the watchdog: runs shortly before the test's .timeout ---- */

static void on_watchdog(int sig)
{
    (void)sig;
    put_str("\n***** cluster harness: the test is about to time out; daemon logs follow *****\n");
    for (int i = 0; i < MAX_LIVE; i++) {
        cluster *cl = &g_slot[i];
        if (!cl->live)
            continue;
        dump_all(cl);
        if (cl->coord_pid > 0)
            kill(cl->coord_pid, SIGKILL);
        for (int w = 0; w < CLUSTER_MAX_WORKERS; w++)
            if (cl->worker_pid[w] > 0)
                kill(cl->worker_pid[w], SIGKILL);
        if (cl->coord_pid > 0)
            waitpid(cl->coord_pid, NULL, 0);
        for (int w = 0; w < CLUSTER_MAX_WORKERS; w++)
            if (cl->worker_pid[w] > 0)
                waitpid(cl->worker_pid[w], NULL, 0);
        remove_files(cl);
        cl->live = 0;
    }
    _exit(3);
}

static void arm_watchdog(void)
{
    if (g_watchdog_armed)
        return;
    g_watchdog_armed = 1;
    const struct criterion_test *t = criterion_current_test;
    double timeout = t && t->data ? t->data->timeout : 0;
    if (timeout < 4)
        return;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_watchdog;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGALRM, &sa, NULL);
    alarm((unsigned)(timeout * 0.9 - 1));
}

/* ---- spawning ---- */

const char *cluster_bin_dir(void)
{
    static char dir[PATH_MAX + 16];
    if (dir[0])
        return dir;
    const char *env = getenv("MOE_BIN_DIR");
    if (env && *env) {
        snprintf(dir, sizeof(dir), "%s", env);
        return dir;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    /* <dir of the test binary>/../bin */
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            char probe[PATH_MAX + 32];
            snprintf(probe, sizeof(probe), "%s/../bin/moe-coordinator", exe);
            if (access(probe, X_OK) == 0) {
                snprintf(dir, sizeof(dir), "%s/../bin", exe);
                return dir;
            }
        }
    }
    snprintf(dir, sizeof(dir), "bin");
    return dir;
}

/* clean_env: the environment without MOE_COORD_* / MOE_WORKER_* (built once). */
static char **clean_env(void)
{
    static char **env;
    if (env)
        return env;
    size_t n = 0;
    while (environ[n])
        n++;
    env = calloc(n + 1, sizeof(char *));
    if (!env)
        return environ;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "MOE_COORD_", 10) != 0 &&
            strncmp(environ[i], "MOE_WORKER_", 11) != 0)
            env[k++] = environ[i];
    env[k] = NULL;
    return env;
}

/* spawn fork+execs argv with stdout/stderr appended to log. Only async
 * signal safe calls happen in the child (the test process has threads). */
static pid_t spawn(cluster *cl, char *const argv[], const char *log)
{
    char **envp = clean_env();
    if (access(argv[0], X_OK) != 0) {
        set_err(cl, "%s is not executable (run make all first): %s", argv[0], strerror(errno));
        return -1;
    }
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        set_err(cl, "cannot open %s: %s", log, strerror(errno));
        return -1;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        set_err(cl, "fork: %s", strerror(errno));
        close(fd);
        return -1;
    }
    if (pid == 0) {
        /* die with the test process, whatever kills it */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = SIG_DFL;
        sigaction(SIGPIPE, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGALRM, &sa, NULL);
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0)
            dup2(devnull, STDIN_FILENO);
        /* do not hold the test runner's pipes or sockets open */
        if (syscall(SYS_close_range, 3u, ~0u, 0) != 0)
            for (int i = 3; i < 1024; i++)
                close(i);
        execve(argv[0], argv, envp);
        static const char msg[] = "cluster harness: execve failed\n";
        ssize_t w = write(STDERR_FILENO, msg, sizeof(msg) - 1);
        (void)w;
        _exit(127);
    }
    close(fd);
    return pid;
}

/* argv builder: pointers to strings that outlive the spawn */
typedef struct argv_buf {
    char *v[2 * CLUSTER_MAX_ARGS + 24];
    int n;
    char exe[PATH_MAX + 32];
} argv_buf;

static void av_add(argv_buf *a, const char *s)
{
    if (a->n < (int)(sizeof(a->v) / sizeof(a->v[0])) - 1)
        a->v[a->n++] = (char *)s;
    a->v[a->n] = NULL;
}

static void av_exe(argv_buf *a, const char *name)
{
    snprintf(a->exe, sizeof(a->exe), "%s/%s", cluster_bin_dir(), name);
    a->n = 0;
    av_add(a, a->exe);
}

static int free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a;
    socklen_t len = sizeof(a);
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int port = -1;
    if (s >= 0 && bind(s, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(s, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (s >= 0)
        close(s);
    return port;
}

/* reap_nohang: 1 if pid has exited (wait status in *status, -1 if unknown),
 * 0 if it still runs. */
static int reap_nohang(pid_t pid, int *status)
{
    int st = 0;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid || (r < 0 && errno == ECHILD)) {
        if (status)
            *status = r == pid ? st : -1;
        return 1;
    }
    return 0;
}

int cluster_worker_start(cluster *cl, int i)
{
    if (i < 0 || i >= CLUSTER_MAX_WORKERS) {
        set_err(cl, "worker index %d out of range", i);
        return -1;
    }
    if (cl->worker_pid[i] > 0) {
        set_err(cl, "worker %d is already running", i);
        return -1;
    }
    argv_buf a = {.n = 0};
    av_exe(&a, "moe-worker");
    av_add(&a, "--coordinator");
    av_add(&a, cl->url);
    av_add(&a, "--threads");
    av_add(&a, "1");
    av_add(&a, "--cluster-secret-file");
    av_add(&a, cl->paths_secret);
    if (cl->opts.auth_token) {
        av_add(&a, "--auth-token");
        av_add(&a, cl->opts.auth_token);
    }
    for (int k = 0; k < CLUSTER_MAX_ARGS && cl->opts.worker_args[k]; k++)
        av_add(&a, cl->opts.worker_args[k]);
    pid_t pid = spawn(cl, a.v, cl->paths_worker_log[i]);
    if (pid < 0)
        return -1;
    cl->worker_pid[i] = pid;
    if (i >= cl->nworkers)
        cl->nworkers = i + 1;
    return 0;
}

int cluster_worker_kill(cluster *cl, int i, int sig)
{
    if (i < 0 || i >= CLUSTER_MAX_WORKERS || cl->worker_pid[i] <= 0) {
        set_err(cl, "worker %d is not running", i);
        return -1;
    }
    if (kill(cl->worker_pid[i], sig) != 0) {
        set_err(cl, "kill worker %d: %s", i, strerror(errno));
        return -1;
    }
    int64_t t0 = cluster_now_ms();
    while (!reap_nohang(cl->worker_pid[i], NULL)) {
        if (cluster_now_ms() - t0 > STOP_WAIT_MS) {
            kill(cl->worker_pid[i], SIGKILL);
            waitpid(cl->worker_pid[i], NULL, 0);
            break;
        }
        sleep_ms(5);
    }
    cl->worker_pid[i] = 0;
    return 0;
}

/* read_addr waits for the coordinator's addr file. */
static int read_addr(cluster *cl, int timeout_ms)
{
    int64_t t0 = cluster_now_ms();
    for (;;) {
        FILE *f = fopen(cl->paths_addr, "r");
        if (f) {
            char line[256] = "";
            char *ok = fgets(line, sizeof(line), f);
            fclose(f);
            line[strcspn(line, "\r\n")] = 0;
            if (ok && line[0]) {
                snprintf(cl->url, sizeof(cl->url), "%s", line);
                return 0;
            }
        }
        int st;
        if (reap_nohang(cl->coord_pid, &st)) {
            cl->coord_pid = 0;
            cl->coord_status = st;
            set_err(cl, "the coordinator exited (status 0x%x) before writing its address", st);
            return -1;
        }
        if (cluster_now_ms() - t0 > timeout_ms) {
            set_err(cl, "no address in %s after %d ms", cl->paths_addr, timeout_ms);
            return -1;
        }
        sleep_ms(5);
    }
}

/* read_secret reads the cluster secret the coordinator wrote (it does so
 * before it writes its address) into cl->secret */
static int read_secret(cluster *cl)
{
    FILE *f = fopen(cl->paths_secret, "r");
    char *ok = f ? fgets(cl->secret, sizeof(cl->secret), f) : NULL;
    if (f)
        fclose(f);
    cl->secret[strcspn(cl->secret, "\r\n")] = 0;
    if (!ok || !cl->secret[0]) {
        set_err(cl, "no cluster secret in %s", cl->paths_secret);
        return -1;
    }
    return 0;
}

cluster *cluster_start(const cluster_opts *opts)
{
    cluster *cl = NULL;
    for (int i = 0; i < MAX_LIVE && !cl; i++)
        if (!g_slot[i].live)
            cl = &g_slot[i];
    if (!cl) {
        set_err(NULL, "more than %d live clusters", MAX_LIVE);
        return NULL;
    }
    memset(cl, 0, sizeof(*cl));
    cl->coord_status = -1;
    if (opts)
        cl->opts = *opts;
    if (cl->opts.workers > CLUSTER_MAX_WORKERS) {
        set_err(cl, "at most %d workers", CLUSTER_MAX_WORKERS);
        return NULL;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(cl->dir, sizeof(cl->dir), "%s/moe-test-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(cl->dir)) {
        set_err(cl, "mkdtemp %s: %s", cl->dir, strerror(errno));
        return NULL;
    }
    snprintf(cl->paths_addr, sizeof(cl->paths_addr), "%s/addr", cl->dir);
    snprintf(cl->paths_coord_log, sizeof(cl->paths_coord_log), "%s/coord.log", cl->dir);
    snprintf(cl->paths_secret, sizeof(cl->paths_secret), "%s/secret", cl->dir);
    for (int i = 0; i < CLUSTER_MAX_WORKERS; i++)
        snprintf(cl->paths_worker_log[i], sizeof(cl->paths_worker_log[i]), "%s/worker-%d.log",
                 cl->dir, i);
    cl->live = 1;
    arm_watchdog();

    char nworkers[16], metrics[64];
    int expected = cl->opts.expected_workers > 0 ? cl->opts.expected_workers
                   : cl->opts.workers > 0        ? cl->opts.workers
                                                 : 1;
    snprintf(nworkers, sizeof(nworkers), "%d", expected);
    argv_buf a = {.n = 0};
    av_exe(&a, "moe-coordinator");
    av_add(&a, "--listen");
    av_add(&a, "tcp://127.0.0.1:0");
    av_add(&a, "--addr-file");
    av_add(&a, cl->paths_addr);
    av_add(&a, "--workers");
    av_add(&a, nworkers);
    av_add(&a, "--cluster-secret-file");
    av_add(&a, cl->paths_secret);
    if (cl->opts.metrics) {
        cl->metrics_port = free_port();
        snprintf(metrics, sizeof(metrics), "http://127.0.0.1:%d", cl->metrics_port);
        av_add(&a, "--metrics");
        av_add(&a, metrics);
    }
    if (cl->opts.auth_token) {
        av_add(&a, "--auth-token");
        av_add(&a, cl->opts.auth_token);
    }
    if (!cl->opts.checkpoint_root || cl->opts.checkpoint_root[0]) {
        av_add(&a, "--checkpoint-root");
        av_add(&a, cl->opts.checkpoint_root ? cl->opts.checkpoint_root : "/tmp");
    }
    for (int k = 0; k < CLUSTER_MAX_ARGS && cl->opts.coord_args[k]; k++)
        av_add(&a, cl->opts.coord_args[k]);
    cl->coord_pid = spawn(cl, a.v, cl->paths_coord_log);
    if (cl->coord_pid < 0) {
        cl->coord_pid = 0;
        return NULL;
    }
    if (read_addr(cl, 10000) != 0 || read_secret(cl) != 0)
        return NULL;
    for (int i = 0; i < cl->opts.workers; i++)
        if (cluster_worker_start(cl, i) != 0)
            return NULL;
    if (cl->opts.no_client)
        return cl;
    moe_client_opts co = {.timeout_ms =
                              cl->opts.client_timeout_ms ? cl->opts.client_timeout_ms : 30000,
                          .auth_token = cl->opts.auth_token,
                          .data_path = cl->opts.data_path,
                          .tls_ca = cl->opts.tls_ca};
    if (moe_client_open(cl->url, &co, &cl->cli) != MOE_OK) {
        set_err(cl, "moe_client_open %s: %s", cl->url, moe_last_error());
        return NULL;
    }
    if (cl->opts.no_wait || cl->opts.workers == 0)
        return cl;
    if (cluster_wait_ready(cl, cl->opts.ready_timeout_ms ? cl->opts.ready_timeout_ms : 15000))
        return NULL;
    return cl;
}

int cluster_wait_ready(cluster *cl, int timeout_ms)
{
    int64_t t0 = cluster_now_ms();
    cluster_state st;
    moe_err e = MOE_OK;
    memset(&st, 0, sizeof(st));
    for (;;) {
        e = cluster_get_state(cl, &st);
        if (e == MOE_OK && st.ready)
            return 0;
        for (int i = 0; i < CLUSTER_MAX_WORKERS; i++) {
            int ws;
            if (cl->worker_pid[i] > 0 && reap_nohang(cl->worker_pid[i], &ws)) {
                set_err(cl, "worker %d (pid %d) exited, status 0x%x", i, (int)cl->worker_pid[i],
                        ws);
                cl->worker_pid[i] = 0;
                return -1;
            }
        }
        if (cl->coord_pid > 0 && reap_nohang(cl->coord_pid, &cl->coord_status)) {
            set_err(cl, "the coordinator exited, status 0x%x", cl->coord_status);
            cl->coord_pid = 0;
            return -1;
        }
        if (cluster_now_ms() - t0 > timeout_ms) {
            set_err(cl, "cluster not ready after %d ms (%s): up %d of %d, generation %llu",
                    timeout_ms, e == MOE_OK ? "status ok" : moe_last_error(), st.up, st.expected,
                    (unsigned long long)st.generation);
            return -1;
        }
        sleep_ms(20);
    }
}

int cluster_coord_signal(cluster *cl, int sig)
{
    if (cl->coord_pid <= 0) {
        set_err(cl, "the coordinator is not running");
        return -1;
    }
    if (kill(cl->coord_pid, sig) != 0) {
        set_err(cl, "kill coordinator: %s", strerror(errno));
        return -1;
    }
    return 0;
}

int cluster_coord_wait(cluster *cl, int timeout_ms)
{
    int64_t t0 = cluster_now_ms();
    int st = -1;
    if (cl->coord_pid <= 0) {
        set_err(cl, "the coordinator is not running");
        return -1;
    }
    while (!reap_nohang(cl->coord_pid, &st)) {
        if (cluster_now_ms() - t0 > timeout_ms) {
            set_err(cl, "the coordinator still runs after %d ms", timeout_ms);
            return -1;
        }
        sleep_ms(5);
    }
    cl->coord_pid = 0;
    cl->coord_status = st;
    return st;
}

int cluster_worker_wait(cluster *cl, int i, int timeout_ms)
{
    int64_t t0 = cluster_now_ms();
    int st = -1;
    if (i < 0 || i >= CLUSTER_MAX_WORKERS || cl->worker_pid[i] <= 0) {
        set_err(cl, "worker %d is not running", i);
        return -1;
    }
    while (!reap_nohang(cl->worker_pid[i], &st)) {
        if (cluster_now_ms() - t0 > timeout_ms) {
            set_err(cl, "worker %d still runs after %d ms", i, timeout_ms);
            return -1;
        }
        sleep_ms(5);
    }
    cl->worker_pid[i] = 0;
    return st;
}

/* append_stacks: every thread's backtrace of process pid (gdb, where it is
 * installed; at most 30 s) appended to the file at log, so that a daemon
 * that ignores SIGTERM says where it hangs before it is killed */
static void append_stacks(pid_t pid, const char *log)
{
    char cmd[768];
    snprintf(cmd, sizeof(cmd),
             "command -v gdb >/dev/null 2>&1 && { echo '----- stacks of pid %d (gdb) -----'; "
             "timeout 30 gdb -p %d -batch -nx -ex 'set backtrace limit 24' "
             "-ex 'thread apply all bt' 2>&1 | "
             "grep -E '^(Thread|#)'; } >>'%s' 2>&1",
             (int)pid, (int)pid, log);
    if (system(cmd) == -1)
        return;
}

int cluster_stop(cluster *cl)
{
    if (!cl || !cl->live)
        return 0;
    if (cl->cli) {
        moe_client_close(cl->cli);
        cl->cli = NULL;
    }
    pid_t *pids[CLUSTER_MAX_WORKERS + 1];
    int st[CLUSTER_MAX_WORKERS + 1], n = 0, bad = 0;
    if (cl->coord_pid > 0)
        pids[n++] = &cl->coord_pid;
    for (int i = 0; i < CLUSTER_MAX_WORKERS; i++)
        if (cl->worker_pid[i] > 0)
            pids[n++] = &cl->worker_pid[i];
    for (int i = 0; i < n; i++) {
        st[i] = -2; /* still running */
        kill(*pids[i], SIGTERM);
    }
    int64_t t0 = cluster_now_ms();
    int left = n;
    while (left > 0 && cluster_now_ms() - t0 < STOP_WAIT_MS) {
        left = 0;
        for (int i = 0; i < n; i++)
            if (st[i] == -2 && !reap_nohang(*pids[i], &st[i]))
                left++;
        if (left)
            sleep_ms(5);
    }
    char why[512] = "";
    size_t wl = 0;
    for (int i = 0; i < n; i++) {
        const char *name = pids[i] == &cl->coord_pid ? "coordinator" : "worker";
        int killed = st[i] == -2;
        if (killed) {
            /* where it hangs: its threads' stacks into its log (dumped below) */
            append_stacks(*pids[i], pids[i] == &cl->coord_pid
                                        ? cl->paths_coord_log
                                        : cl->paths_worker_log[pids[i] - &cl->worker_pid[0]]);
            kill(*pids[i], SIGKILL);
            waitpid(*pids[i], &st[i], 0);
        }
        if (killed || st[i] == -1 || !WIFEXITED(st[i]) || WEXITSTATUS(st[i]) != 0) {
            char how[64] = "did not exit 0 after SIGTERM";
            if (killed)
                snprintf(how, sizeof(how), "ignored SIGTERM for %d s and was killed",
                         STOP_WAIT_MS / 1000);
            int k = snprintf(why + wl, sizeof(why) - wl, "%s pid %d %s (status 0x%x); ", name,
                             (int)*pids[i], how, st[i]);
            if (k > 0 && wl + (size_t)k < sizeof(why))
                wl += (size_t)k;
            bad++;
        }
        if (pids[i] == &cl->coord_pid)
            cl->coord_status = st[i];
        *pids[i] = 0;
    }
    if (bad) {
        set_err(cl, "%s", why);
        cluster_dump_logs(cl, why);
    }
    if (getenv("MOE_TEST_KEEP_LOGS"))
        fprintf(stderr, "cluster harness: logs kept in %s\n", cl->dir);
    else
        remove_files(cl);
    cl->live = 0;
    return bad;
}

void cluster_fini_all(void)
{
    for (int i = 0; i < MAX_LIVE; i++) {
        cluster *cl = &g_slot[i];
        if (!cl->live)
            continue;
        char why[700];
        snprintf(why, sizeof(why), "test did not finish (failed assertion?)%s%s; daemon logs",
                 cl->err[0] ? "; last harness error: " : "", cl->err);
        cluster_dump_logs(cl, why);
        cluster_stop(cl);
    }
}

/* ---- cluster.status ---- */

moe_err cluster_get_state(cluster *cl, cluster_state *st)
{
    moe_reply rep;
    memset(st, 0, sizeof(*st));
    moe_err e = moe_call(cl->cli, "cluster.status", NULL, 0, &rep);
    if (e != MOE_OK) {
        moe_reply_free(&rep);
        return e;
    }
    mp_reader r = mp_reply_reader(&rep);
    uint32_t n;
    e = mp_read_map(&r, &n, NULL);
    for (uint32_t i = 0; e == MOE_OK && i < n; i++) {
        const char *k;
        uint32_t kl;
        int64_t v = 0;
        bool b = false;
        if ((e = mp_read_str(&r, &k, &kl, NULL)) != MOE_OK)
            break;
        if (mp_str_eq(k, kl, "ready")) {
            e = mp_read_bool(&r, &b, NULL);
            st->ready = b;
        } else if (mp_str_eq(k, kl, "draining")) {
            e = mp_read_bool(&r, &b, NULL);
            st->draining = b;
        } else if (mp_str_eq(k, kl, "waiting_for_all")) {
            e = mp_read_bool(&r, &b, NULL);
            st->waiting_for_all = b;
        } else if (mp_str_eq(k, kl, "expected_workers")) {
            e = mp_read_i64(&r, &v, NULL);
            st->expected = (int)v;
        } else if (mp_str_eq(k, kl, "world")) {
            e = mp_read_i64(&r, &v, NULL);
            st->world = (int)v;
        } else if (mp_str_eq(k, kl, "up_workers")) {
            e = mp_read_i64(&r, &v, NULL);
            st->up = (int)v;
        } else if (mp_str_eq(k, kl, "generation")) {
            e = mp_read_u64(&r, &st->generation, NULL);
        } else if (mp_str_eq(k, kl, "workers")) {
            uint32_t nw;
            if ((e = mp_read_array(&r, &nw, NULL)) != MOE_OK)
                break;
            st->listed = (int)nw;
            for (uint32_t w = 0; e == MOE_OK && w < nw; w++) {
                mp_reader one = r;
                const char *s;
                uint32_t sl;
                if (mp_map_find(&one, "state") == 0 && mp_read_str(&one, &s, &sl, NULL) == MOE_OK &&
                    mp_str_eq(s, sl, "down"))
                    st->down++;
                e = mp_skip(&r, NULL);
            }
        } else {
            e = mp_skip(&r, NULL);
        }
    }
    moe_reply_free(&rep);
    return e;
}

/* ---- msgpack helpers ---- */

int mp_map_find(mp_reader *r, const char *key)
{
    uint32_t n;
    if (mp_read_map(r, &n, NULL) != MOE_OK)
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if (mp_read_str(r, &k, &kl, NULL) != MOE_OK)
            return -1;
        if (mp_str_eq(k, kl, key))
            return 0;
        if (mp_skip(r, NULL) != MOE_OK)
            return -1;
    }
    return -1;
}

mp_reader mp_reply_reader(const moe_reply *rep)
{
    mp_reader r;
    mp_reader_init(&r, rep->buf + rep->result_off, rep->len - rep->result_off);
    return r;
}

/* cluster_http_get fetches path from 127.0.0.1:port: the status code, the headers
 * (up to the blank line) in head and the body in body, both NUL terminated
 * and truncated to their cap. -1 on failure. */
int cluster_http_get(int port, const char *path, char *head, size_t hcap, char *body, size_t bcap)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0)
        return -1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {5, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (connect(s, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(s);
        return -1;
    }
    char req[256];
    int n = snprintf(req, sizeof(req),
                     "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", path);
    if (write(s, req, (size_t)n) != n) {
        close(s);
        return -1;
    }
    static char resp[1 << 20];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(s, resp + len, sizeof(resp) - 1 - len);
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    close(s);
    resp[len] = 0;
    int code = -1;
    if (sscanf(resp, "HTTP/1.%*d %d", &code) != 1)
        return -1;
    const char *b = strstr(resp, "\r\n\r\n");
    size_t hl = b ? (size_t)(b - resp) : len;
    if (head && hcap)
        snprintf(head, hcap, "%.*s", (int)hl, resp);
    snprintf(body, bcap, "%s", b ? b + 4 : "");
    return code;
}

int cluster_worker_key(cluster *cl, int rank, const char *key, char *out, size_t len)
{
    moe_reply rep;
    if (moe_call(cl->cli, "dataplane.info", NULL, 0, &rep) != MOE_OK) {
        set_err(cl, "dataplane.info: %s", rep.message);
        moe_reply_free(&rep);
        return -1;
    }
    mp_reader r = mp_reply_reader(&rep);
    uint32_t n;
    const char *s;
    uint32_t sl;
    int ok = mp_map_find(&r, "workers") == 0 && mp_read_array(&r, &n, NULL) == MOE_OK &&
             rank >= 0 && (uint32_t)rank < n;
    for (int i = 0; ok && i < rank; i++)
        ok = mp_skip(&r, NULL) == MOE_OK;
    ok = ok && mp_map_find(&r, key) == 0 && mp_read_str(&r, &s, &sl, NULL) == MOE_OK;
    if (ok)
        snprintf(out, len, "%.*s", (int)sl, s);
    else
        set_err(cl, "dataplane.info has no %s for rank %d", key, rank);
    moe_reply_free(&rep);
    return ok ? 0 : -1;
}

int cluster_coord_stat(cluster *cl, const char *key, int64_t *out)
{
    moe_reply rep;
    if (moe_call(cl->cli, "stats", NULL, 0, &rep) != MOE_OK) {
        set_err(cl, "stats: %s", rep.message);
        moe_reply_free(&rep);
        return -1;
    }
    mp_reader r = mp_reply_reader(&rep);
    int ok = mp_map_find(&r, key) == 0 && mp_read_i64(&r, out, NULL) == MOE_OK;
    if (!ok)
        set_err(cl, "stats has no integer %s", key);
    moe_reply_free(&rep);
    return ok ? 0 : -1;
}

double cluster_metric_value(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; (p = strstr(p, name)) != NULL; p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return atof(p + n + 1);
    return -1;
}

int cluster_log_has(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[1024];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}
