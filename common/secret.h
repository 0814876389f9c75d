/*
 * secret.h - the cluster secret (the daemons' proof to each other) and the
 * loopback test behind "no public listener without a token".
 *
 * The scheme (docs/OPERATIONS.md, "Cluster secret"): both daemons take
 * --cluster-secret, else read --cluster-secret-file (default
 * ~/.moe/cluster-secret). The coordinator creates that file (mode 0600,
 * random secret) when it does not exist; workers read it each time they
 * register. A secret file must be a regular file owned by the user that
 * reads it, with no access for group or others (as ssh keys).
 */
#ifndef MOE_SECRET_H
#define MOE_SECRET_H

#include <stddef.h>

#include "base/moe.h"

/* SECRET_MAX: room for a secret and its NUL (a generated one is 64 hex) */
#define SECRET_MAX 256

/* secret_generate writes 64 random hex digits and a NUL into out (cap >= 65). */
moe_err secret_generate(char *out, size_t cap);

/* secret_expand_path: path with a leading "~/" replaced by $HOME/ into out;
 * MOE_EINVAL (reason in err) when HOME is unset or the result is too long. */
moe_err secret_expand_path(const char *path, char *out, size_t cap, char *err, size_t errlen);

/* secret_read_file reads the secret (the first line, blanks trimmed) of
 * path into out. MOE_ENOTFOUND when the file does not exist; MOE_EINVAL
 * when it is not a regular file of this user with mode 0600 or stricter, or
 * holds no secret; MOE_EIO on other failures. The reason goes to err. */
moe_err secret_read_file(const char *path, char *out, size_t cap, char *err, size_t errlen);

/* secret_write_file writes secret to path (mode 0600, through a temporary
 * file and a rename; the parent directory is created, mode 0700, when
 * missing). */
moe_err secret_write_file(const char *path, const char *secret, char *err, size_t errlen);

/* url_is_loopback: whether a listen address is reachable only from this
 * host: ipc:// and inproc://, or tcp/tls+tcp/ws/http on 127.0.0.0/8,
 * [::1] or localhost. Wildcards (0.0.0.0, *, an empty host) and any other
 * host are not. */
int url_is_loopback(const char *url);

#endif
