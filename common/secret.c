/* secret.c - the cluster secret and the loopback test; see secret.h. */
#include "common/secret.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

moe_err secret_generate(char *out, size_t cap)
{
    unsigned char raw[32];
    size_t got = 0;
    if (cap < 2 * sizeof(raw) + 1)
        return MOE_EINVAL;
    while (got < sizeof(raw)) {
        ssize_t n = getrandom(raw + got, sizeof(raw) - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return MOE_EIO;
        got += (size_t)n;
    }
    for (size_t i = 0; i < sizeof(raw); i++)
        snprintf(out + 2 * i, 3, "%02x", raw[i]);
    return MOE_OK;
}

moe_err secret_expand_path(const char *path, char *out, size_t cap, char *err, size_t errlen)
{
    const char *home = getenv("HOME");
    int n;
    if (strncmp(path, "~/", 2) != 0) {
        n = snprintf(out, cap, "%s", path);
    } else if (!home || !home[0]) {
        snprintf(err, errlen, "%s: HOME is not set", path);
        return MOE_EINVAL;
    } else {
        n = snprintf(out, cap, "%s/%s", home, path + 2);
    }
    if (n < 0 || (size_t)n >= cap) {
        snprintf(err, errlen, "%s: path too long", path);
        return MOE_EINVAL;
    }
    return MOE_OK;
}

/* check_owner: a secret file must be ours and unreadable to others */
static moe_err check_owner(const struct stat *st, const char *path, char *err, size_t errlen)
{
    if (!S_ISREG(st->st_mode)) {
        snprintf(err, errlen, "%s is not a regular file", path);
        return MOE_EINVAL;
    }
    if (st->st_uid != geteuid()) {
        snprintf(err, errlen, "%s belongs to uid %u, not to this user", path, (unsigned)st->st_uid);
        return MOE_EINVAL;
    }
    if (st->st_mode & 077) {
        snprintf(err, errlen, "%s is readable or writable by others (mode %03o): chmod 600 it",
                 path, (unsigned)(st->st_mode & 0777));
        return MOE_EINVAL;
    }
    return MOE_OK;
}

moe_err secret_read_file(const char *path, char *out, size_t cap, char *err, size_t errlen)
{
    char buf[SECRET_MAX + 2];
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return errno == ENOENT ? MOE_ENOTFOUND : MOE_EIO;
    }
    moe_err e = fstat(fd, &st) == 0 ? check_owner(&st, path, err, errlen) : MOE_EIO;
    ssize_t n = e == MOE_OK ? read(fd, buf, sizeof(buf) - 1) : -1;
    close(fd);
    if (e != MOE_OK)
        return e;
    if (n < 0) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return MOE_EIO;
    }
    buf[n] = 0;
    char *s = buf, *end = strchr(buf, '\n');
    if (end)
        *end = 0;
    while (isspace((unsigned char)*s))
        s++;
    end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = 0;
    if (!*s || strlen(s) >= cap || strlen(s) >= SECRET_MAX) {
        snprintf(err, errlen, "%s holds no secret (empty, or longer than %d bytes)", path,
                 SECRET_MAX - 1);
        return MOE_EINVAL;
    }
    memcpy(out, s, strlen(s) + 1);
    return MOE_OK;
}

moe_err secret_write_file(const char *path, const char *secret, char *err, size_t errlen)
{
    char dir[1024], tmp[1100];
    if (snprintf(dir, sizeof(dir), "%s", path) >= (int)sizeof(dir)) {
        snprintf(err, errlen, "%s: path too long", path);
        return MOE_EINVAL;
    }
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = 0;
        if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
            snprintf(err, errlen, "cannot create %s: %s", dir, strerror(errno));
            return MOE_EIO;
        }
    }
    snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %s: %s", tmp, strerror(errno));
        return MOE_EIO;
    }
    size_t len = strlen(secret);
    int ok = write(fd, secret, len) == (ssize_t)len && write(fd, "\n", 1) == 1 && fsync(fd) == 0;
    ok = close(fd) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
        return MOE_EIO;
    }
    return MOE_OK;
}

/* host_is_loopback: host[0..len) names this host only */
static int host_is_loopback(const char *host, size_t len)
{
    if (len == 9 && strncmp(host, "localhost", 9) == 0)
        return 1;
    if ((len == 3 && strncmp(host, "::1", 3) == 0) || (len == 5 && strncmp(host, "[::1]", 5) == 0))
        return 1;
    if (len < 4 || strncmp(host, "127.", 4) != 0)
        return 0;
    for (size_t i = 4; i < len; i++)
        if (!isdigit((unsigned char)host[i]) && host[i] != '.')
            return 0;
    return 1;
}

int url_is_loopback(const char *url)
{
    if (strncmp(url, "ipc://", 6) == 0 || strncmp(url, "inproc://", 9) == 0)
        return 1;
    const char *sep = strstr(url, "://");
    if (!sep)
        return 0;
    const char *host = sep + 3;
    const char *end = host + strcspn(host, "/");
    if (*host == '[') { /* [v6]:port */
        const char *close = memchr(host, ']', (size_t)(end - host));
        return close && host_is_loopback(host, (size_t)(close - host + 1));
    }
    const char *colon = memchr(host, ':', (size_t)(end - host));
    if (colon)
        end = colon;
    return host_is_loopback(host, (size_t)(end - host));
}
