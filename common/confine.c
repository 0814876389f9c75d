/* confine.c - paths kept inside configured roots; see confine.h. */
#include "common/confine.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* resolve_existing: realpath of the longest existing prefix of p (p is
 * modified: cut at that prefix); *tail gets the offset in the original
 * string of what follows it (0 = the whole path exists). */
static moe_err resolve_existing(char *p, char *real, size_t *tail, char *err, size_t errlen)
{
    *tail = 0;
    for (;;) {
        if (realpath(p, real))
            return MOE_OK;
        if (errno != ENOENT && errno != ENOTDIR) { /* a file in the way: creating fails later */
            snprintf(err, errlen, "path %s cannot be resolved: %s", p, strerror(errno));
            return MOE_EINVAL;
        }
        char *slash = strrchr(p, '/');
        if (!slash || (slash == p && p[1] == 0)) {
            snprintf(err, errlen, "path %s cannot be resolved", p);
            return MOE_EINVAL;
        }
        *tail = (size_t)(slash - p) + 1;
        slash[slash == p ? 1 : 0] = 0; /* "/x" leaves "/" */
    }
}

/* append_tail appends the not-yet-existing components of tail to out. */
static moe_err append_tail(const char *tail, char *out, size_t outlen, char *err, size_t errlen)
{
    const char *s = tail;
    while (*s) {
        const char *e = strchr(s, '/');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if ((n == 1 && s[0] == '.') || (n == 2 && s[0] == '.' && s[1] == '.')) {
            snprintf(err, errlen, "path component \"%.*s\" after a directory that does not exist",
                     (int)n, s);
            return MOE_EINVAL;
        }
        size_t ol = strlen(out);
        if (n > 0) {
            int sep = !(ol == 1 && out[0] == '/');
            if (ol + (size_t)sep + n + 1 > outlen) {
                snprintf(err, errlen, "path too long");
                return MOE_EINVAL;
            }
            if (sep)
                out[ol++] = '/';
            memcpy(out + ol, s, n);
            out[ol + n] = 0;
        }
        s += n;
        if (*s == '/')
            s++;
    }
    return MOE_OK;
}

/* under: out is root or lies below it (both resolved). */
static int under(const char *out, const char *root)
{
    size_t n = strlen(root);
    if (n == 1 && root[0] == '/')
        return 1;
    return strncmp(out, root, n) == 0 && (out[n] == 0 || out[n] == '/');
}

moe_err path_confine(const char *path, const char *const *roots, int nroots, char *out,
                     size_t outlen, char *err, size_t errlen)
{
    int any = 0;
    for (int i = 0; i < nroots; i++)
        any |= roots[i] && roots[i][0];
    if (!any) {
        snprintf(err, errlen,
                 "no checkpoint root is configured: start the coordinator with --checkpoint-root "
                 "(or --checkpoint-dir) to allow explicit paths");
        return MOE_EPRECOND;
    }
    if (path[0] != '/') {
        snprintf(err, errlen, "path %s must be absolute", path);
        return MOE_EINVAL;
    }
    char p[PATH_MAX], real[PATH_MAX];
    if (strlen(path) >= sizeof(p)) {
        snprintf(err, errlen, "path too long");
        return MOE_EINVAL;
    }
    snprintf(p, sizeof(p), "%s", path);
    size_t tail;
    moe_err e = resolve_existing(p, real, &tail, err, errlen);
    if (e != MOE_OK)
        return e;
    if (strlen(real) + 1 > outlen) {
        snprintf(err, errlen, "path too long");
        return MOE_EINVAL;
    }
    snprintf(out, outlen, "%s", real);
    if (tail && (e = append_tail(path + tail, out, outlen, err, errlen)) != MOE_OK)
        return e;
    for (int i = 0; i < nroots; i++) {
        char rr[PATH_MAX];
        if (roots[i] && roots[i][0] && realpath(roots[i], rr) && under(out, rr))
            return MOE_OK;
    }
    char list[512] = "";
    for (int i = 0; i < nroots; i++)
        if (roots[i] && roots[i][0])
            snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%s", list[0] ? ", " : "",
                     roots[i]);
    snprintf(err, errlen, "path %s (resolved: %s) is outside the checkpoint root (%s)", path, out,
             list);
    return MOE_EINVAL;
}
