/*
 * confine.h - keep file system paths given by clients inside configured
 * roots (checkpoint directories: docs/OPERATIONS.md, --checkpoint-root).
 *
 * A path is resolved the way the kernel will walk it: the longest prefix
 * that exists goes through realpath (symlinks and ".." resolved), and the
 * components after it, which do not exist yet, are appended as they are;
 * none of those may be "." or "..". The result must be a root or lie under
 * one (each root resolved with realpath too). Paths must be absolute.
 */
#ifndef MOE_CONFINE_H
#define MOE_CONFINE_H

#include <stddef.h>

#include "base/moe.h"

#define CONFINE_MAX_ROOTS 4

/* path_confine resolves path into out (outlen bytes) and checks it against
 * roots (nroots of them; empty strings are skipped). Returns MOE_OK, or
 * MOE_EPRECOND when there is no root at all, or MOE_EINVAL (not absolute,
 * a "." or ".." that does not resolve, too long, outside every root), with
 * the reason in err. Nothing is created. */
moe_err path_confine(const char *path, const char *const *roots, int nroots, char *out,
                     size_t outlen, char *err, size_t errlen);

#endif
