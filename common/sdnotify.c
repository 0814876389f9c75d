/* sdnotify.c - systemd notifications without libsystemd; see sdnotify.h. */
#include "common/sdnotify.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* notify_addr fills addr from $NOTIFY_SOCKET; its length in *len. 1: an
 * address, 0: no socket set, -1: a name that is no unix socket address. */
static int notify_addr(struct sockaddr_un *addr, socklen_t *len)
{
    const char *name = getenv("NOTIFY_SOCKET");
    if (!name || !name[0])
        return 0;
    size_t n = strlen(name);
    if ((name[0] != '/' && name[0] != '@') || n < 2 || n >= sizeof(addr->sun_path))
        return -1;
    memset(addr, 0, sizeof(*addr));
    addr->sun_family = AF_UNIX;
    memcpy(addr->sun_path, name, n);
    if (name[0] == '@') {
        addr->sun_path[0] = 0; /* the abstract namespace: no terminating NUL counted */
        *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
    } else {
        *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + 1);
    }
    return 1;
}

moe_err sdn_send(const char *msg)
{
    struct sockaddr_un addr;
    socklen_t len = 0;
    int r = notify_addr(&addr, &len);
    if (r <= 0)
        return r == 0 ? MOE_OK : MOE_EINVAL;
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return MOE_EIO;
    size_t n = strlen(msg);
    ssize_t sent; /* never blocks the loop: a full receiver loses the message */
    do {
        sent = sendto(fd, msg, n, MSG_NOSIGNAL | MSG_DONTWAIT, (struct sockaddr *)&addr, len);
    } while (sent < 0 && errno == EINTR);
    close(fd);
    return sent == (ssize_t)n ? MOE_OK : MOE_EIO;
}

void sdn_init(sdn *s)
{
    memset(s, 0, sizeof(*s));
    const char *usec = getenv("WATCHDOG_USEC");
    const char *pid = getenv("WATCHDOG_PID");
    if (!usec || !usec[0])
        return;
    if (pid && pid[0]) {
        char *end;
        long p = strtol(pid, &end, 10);
        if (*end || p != (long)getpid())
            return; /* the watchdog is another process's */
    }
    char *end;
    unsigned long long us = strtoull(usec, &end, 10);
    if (*end || us == 0 || us > 86400ull * 1000000ull * 365)
        return;
    s->watchdog_ns = (uint64_t)us * 1000ull;
}

uint64_t sdn_period_ms(const sdn *s)
{
    if (!s->watchdog_ns)
        return 0;
    uint64_t ms = s->watchdog_ns / 4000000ull;
    return ms ? ms : 1;
}

void sdn_tick(sdn *s, int ready, int stopping, const char *status, uint64_t now_ns)
{
    if (ready && !s->ready_sent) {
        char msg[512];
        if (status)
            snprintf(msg, sizeof(msg), "READY=1\nSTATUS=%s", status);
        else
            snprintf(msg, sizeof(msg), "READY=1");
        s->ready_sent = 1;
        sdn_send(msg);
    }
    if (stopping && !s->stopping_sent) {
        s->stopping_sent = 1;
        sdn_send("STOPPING=1");
    }
    if (s->watchdog_ns && now_ns - s->last_watchdog_ns >= s->watchdog_ns / 2) {
        s->last_watchdog_ns = now_ns;
        sdn_send("WATCHDOG=1");
    }
}
