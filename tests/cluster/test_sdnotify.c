/*
 * test_sdnotify.c - the daemons speak systemd's notification protocol
 * (Type=notify, common/sdnotify.c): messages reach a path socket and an
 * abstract one; READY=1 once, STOPPING=1 once, WATCHDOG=1 every half
 * interval; and a real coordinator and worker, given a NOTIFY_SOCKET this
 * test creates (a unix datagram socket in a temp dir), send READY=1 (the
 * cluster is ready / the worker registered), WATCHDOG=1 (WATCHDOG_USEC set)
 * and, the coordinator on SIGTERM, STOPPING=1. Senders are told apart by
 * their pid (SCM_CREDENTIALS, as systemd does).
 */
#include <criterion/criterion.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "tests/cluster.h"
#include "common/sdnotify.h"

/* notify_socket binds a datagram socket at name ('@' = abstract) that
 * receives the sender's credentials */
static int notify_socket(const char *name)
{
    struct sockaddr_un a;
    memset(&a, 0, sizeof(a));
    a.sun_family = AF_UNIX;
    size_t n = strlen(name);
    cr_assert_lt(n, sizeof(a.sun_path));
    memcpy(a.sun_path, name, n);
    socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + 1);
    if (name[0] == '@') {
        a.sun_path[0] = 0;
        len--;
    }
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0);
    int one = 1;
    cr_assert_eq(setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)), 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, len), 0, "bind %s", name);
    return fd;
}

/* recv_msg waits up to timeout_ms for one datagram: its text in buf, the
 * sender's pid in *pid. 0, or -1 on timeout. */
static int recv_msg(int fd, char *buf, size_t cap, pid_t *pid, int timeout_ms)
{
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) != 1)
        return -1;
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(struct ucred))];
    } ctl;
    struct iovec iov = {buf, cap - 1};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl.b;
    m.msg_controllen = sizeof(ctl.b);
    ssize_t n = recvmsg(fd, &m, 0);
    if (n < 0)
        return -1;
    buf[n] = 0;
    *pid = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
            struct ucred u;
            memcpy(&u, CMSG_DATA(c), sizeof(u));
            *pid = u.pid;
        }
    return 0;
}

/* count_pending: datagrams waiting on fd that contain what (none waited for) */
static int count_pending(int fd, const char *what)
{
    char buf[512];
    pid_t pid;
    int n = 0;
    while (recv_msg(fd, buf, sizeof(buf), &pid, 0) == 0)
        n += strstr(buf, what) != NULL;
    return n;
}

Test(sdnotify, send_to_path_and_abstract_socket)
{
    char buf[512];
    pid_t pid;
    unsetenv("NOTIFY_SOCKET");
    cr_assert_eq(sdn_send("READY=1"), MOE_OK, "no socket: nothing to do");
    setenv("NOTIFY_SOCKET", "relative/path", 1);
    cr_assert_eq(sdn_send("READY=1"), MOE_EINVAL);

    char dir[] = "/tmp/moe-sdn-XXXXXX", path[128];
    cr_assert(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/notify", dir);
    int fd = notify_socket(path);
    setenv("NOTIFY_SOCKET", path, 1);
    cr_assert_eq(sdn_send("READY=1"), MOE_OK);
    cr_assert_eq(recv_msg(fd, buf, sizeof(buf), &pid, 10000), 0);
    cr_assert_str_eq(buf, "READY=1");
    cr_assert_eq(pid, getpid());
    close(fd);
    unlink(path);
    rmdir(dir);
    cr_assert_eq(sdn_send("READY=1"), MOE_EIO, "the socket is gone");

    char abs[64];
    snprintf(abs, sizeof(abs), "@moe-sdn-test-%d", (int)getpid());
    fd = notify_socket(abs);
    setenv("NOTIFY_SOCKET", abs, 1);
    cr_assert_eq(sdn_send("WATCHDOG=1"), MOE_OK);
    cr_assert_eq(recv_msg(fd, buf, sizeof(buf), &pid, 10000), 0);
    cr_assert_str_eq(buf, "WATCHDOG=1");
    close(fd);
    unsetenv("NOTIFY_SOCKET");
}

Test(sdnotify, tick_sends_ready_and_stopping_once_watchdog_each_half)
{
    char abs[64];
    snprintf(abs, sizeof(abs), "@moe-sdn-tick-%d", (int)getpid());
    int fd = notify_socket(abs);
    setenv("NOTIFY_SOCKET", abs, 1);
    setenv("WATCHDOG_USEC", "1000000", 1); /* 1 s: a ping every 0.5 s */
    char pid[32];
    snprintf(pid, sizeof(pid), "%d", (int)getpid());
    setenv("WATCHDOG_PID", pid, 1);
    sdn s;
    sdn_init(&s);
    cr_assert_eq(s.watchdog_ns, 1000000000ull);
    cr_assert_eq(sdn_period_ms(&s), 250);

    uint64_t t = 10000000000ull; /* a clock the test moves */
    sdn_tick(&s, 0, 0, NULL, t);
    cr_assert_eq(count_pending(fd, "WATCHDOG=1"), 1, "the first tick pings");
    sdn_tick(&s, 1, 0, "cluster ready", t + 100000000ull);
    sdn_tick(&s, 1, 0, "cluster ready", t + 200000000ull);
    char buf[512];
    pid_t from;
    cr_assert_eq(recv_msg(fd, buf, sizeof(buf), &from, 10000), 0);
    cr_assert_str_eq(buf, "READY=1\nSTATUS=cluster ready");
    cr_assert_eq(count_pending(fd, "READY=1"), 0, "READY=1 once");
    sdn_tick(&s, 1, 0, NULL, t + 500000000ull);
    cr_assert_eq(count_pending(fd, "WATCHDOG=1"), 1, "half the interval: a ping");
    sdn_tick(&s, 1, 1, NULL, t + 600000000ull);
    sdn_tick(&s, 1, 1, NULL, t + 700000000ull);
    cr_assert_eq(count_pending(fd, "STOPPING=1"), 1, "STOPPING=1 once");

    setenv("WATCHDOG_PID", "1", 1); /* another process's watchdog */
    sdn_init(&s);
    cr_assert_eq(sdn_period_ms(&s), 0);
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
    sdn_init(&s);
    sdn_tick(&s, 0, 0, NULL, t);
    cr_assert_eq(count_pending(fd, "WATCHDOG=1"), 0, "no watchdog asked for");
    close(fd);
    unsetenv("NOTIFY_SOCKET");
}

/* wait_for waits (bounded, generously) for a datagram from pid containing
 * what; other datagrams are skipped. */
static int wait_for(int fd, pid_t want, const char *what)
{
    char buf[512];
    pid_t from;
    int64_t end = cluster_now_ms() + 60000;
    while (cluster_now_ms() < end) {
        if (recv_msg(fd, buf, sizeof(buf), &from, 1000) != 0)
            continue;
        if (from == want && strstr(buf, what))
            return 0;
    }
    return -1;
}

Test(sdnotify, daemons_send_ready_watchdog_stopping, .timeout = 120, .fini = cluster_fini_all)
{
    char dir[] = "/tmp/moe-sdn-XXXXXX", path[128];
    cr_assert(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/notify", dir);
    int fd = notify_socket(path);
    /* the daemons inherit these (cluster.h passes the environment on) */
    setenv("NOTIFY_SOCKET", path, 1);
    setenv("WATCHDOG_USEC", "10000000", 1); /* a ping every 5 s */
    unsetenv("WATCHDOG_PID");

    cluster_opts o = {.workers = 1, .expected_workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");

    cr_assert_eq(wait_for(fd, cl->worker_pid[0], "READY=1"), 0, "worker READY=1");
    cr_assert_eq(wait_for(fd, cl->coord_pid, "READY=1"), 0, "coordinator READY=1");
    cr_assert_eq(wait_for(fd, cl->worker_pid[0], "WATCHDOG=1"), 0, "worker WATCHDOG=1");
    cr_assert_eq(wait_for(fd, cl->coord_pid, "WATCHDOG=1"), 0, "coordinator WATCHDOG=1");

    pid_t coord = cl->coord_pid;
    cr_assert_eq(cluster_coord_signal(cl, SIGTERM), 0, "%s", cluster_error());
    cr_assert_eq(wait_for(fd, coord, "STOPPING=1"), 0, "coordinator STOPPING=1 on drain");
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
    close(fd);
    unlink(path);
    rmdir(dir);
}
