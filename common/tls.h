/*
 * tls.h - TLS for the nng endpoints of the daemons and of libmoe
 * (tls+tcp:// addresses), through nng's TLS (mbedTLS in Debian's libnng).
 *
 * The scheme (docs/OPERATIONS.md, "TLS"): a listener on a tls+tcp://
 * address presents --tls-cert with its private key --tls-key; it asks
 * clients for no certificate (callers prove themselves with --auth-token
 * and the cluster secret). A dialer to a tls+tcp:// address verifies the
 * server's certificate against --tls-ca (required: no unverified TLS) and
 * the host name of the address; it presents --tls-cert/--tls-key when
 * given. Other addresses (tcp://, ipc://) ignore these settings.
 */
#ifndef MOE_TLS_H
#define MOE_TLS_H

#include <nng/nng.h>
#include <stddef.h>

#include "base/moe.h"

/* moe_tls_files: the PEM files of one process (paths, borrowed; NULL or
 * "" = not given). */
typedef struct moe_tls_files {
    const char *cert; /* certificate chain presented to peers */
    const char *key;  /* its private key (unencrypted PEM) */
    const char *ca;   /* the CA certificates that peers' certificates must chain to */
} moe_tls_files;

/* moe_tls_url: 1 when url uses TLS (tls+tcp://, tls+tcp4://, tls+tcp6://,
 * wss://), else 0. */
int moe_tls_url(const char *url);

/* moe_tls_available: 1 when the linked nng has a TLS engine (so that
 * tls+tcp:// works), else 0 and the reason in why. */
int moe_tls_available(char *why, size_t len);

/* moe_tls_listener_setup gives listener l (created, not started, on url)
 * the certificate and key of f. Nothing to do (MOE_OK) when url is not a
 * TLS address. MOE_EINVAL when a TLS url has no cert or key; MOE_EIO when
 * a file cannot be read; MOE_EINVAL when nng refuses its content. The
 * reason goes to err. */
moe_err moe_tls_listener_setup(nng_listener l, const char *url, const moe_tls_files *f, char *err,
                               size_t errlen);

/* moe_tls_dialer_setup gives dialer d (created, not started, on url) the CA
 * of f to verify the server with, and f's certificate when given. Nothing
 * to do when url is not a TLS address. MOE_EINVAL when a TLS url has no CA
 * (or a cert without a key); errors as moe_tls_listener_setup. */
moe_err moe_tls_dialer_setup(nng_dialer d, const char *url, const moe_tls_files *f, char *err,
                             size_t errlen);

#endif
