/* tls.c - TLS settings of nng listeners and dialers (tls.h). */
#include <nng/nng.h>
#include <nng/supplemental/tls/tls.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tls.h"

#define TLS_PEM_MAX (1u << 20) /* a certificate chain or key larger than 1 MiB is refused */

static int given(const char *s)
{
    return s && s[0];
}

int moe_tls_url(const char *url)
{
    static const char *const schemes[] = {"tls+tcp://", "tls+tcp4://", "tls+tcp6://", "wss://"};
    for (size_t i = 0; url && i < sizeof(schemes) / sizeof(schemes[0]); i++)
        if (strncmp(url, schemes[i], strlen(schemes[i])) == 0)
            return 1;
    return 0;
}

int moe_tls_available(char *why, size_t len)
{
    nng_tls_config *cfg = NULL;
    int rv = nng_tls_config_alloc(&cfg, NNG_TLS_MODE_CLIENT);
    if (rv != 0) {
        snprintf(why, len, "this nng library has no TLS engine (%s)", nng_strerror(rv));
        return 0;
    }
    nng_tls_config_free(cfg);
    return 1;
}

/* url_host copies the host of scheme://host:port/... (the brackets of an
 * IPv6 address dropped) into out; -1 when there is none or it is too long. */
static int url_host(const char *url, char *out, size_t cap)
{
    const char *h = strstr(url, "://");
    if (!h)
        return -1;
    h += 3;
    size_t n;
    if (*h == '[') {
        const char *close = strchr(++h, ']');
        if (!close)
            return -1;
        n = (size_t)(close - h);
    } else {
        n = strcspn(h, ":/");
    }
    if (n == 0 || n >= cap)
        return -1;
    memcpy(out, h, n);
    out[n] = 0;
    return 0;
}

/* read_pem reads the whole file path into a NUL-terminated buffer (owned by
 * the caller: free). MOE_EIO with the reason in err. */
static moe_err read_pem(const char *what, const char *path, char **out, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %s file %s: %m", what, path);
        return MOE_EIO;
    }
    char *buf = malloc(TLS_PEM_MAX + 1);
    size_t n = buf ? fread(buf, 1, TLS_PEM_MAX + 1, f) : 0;
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad || n == 0 || n > TLS_PEM_MAX) {
        snprintf(err, errlen, "cannot read %s file %s: %s", what, path,
                 !buf     ? "out of memory"
                 : bad    ? "read error"
                 : n == 0 ? "empty"
                          : "over 1 MiB");
        free(buf);
        return MOE_EIO;
    }
    buf[n] = 0;
    *out = buf;
    return MOE_OK;
}

/* set_own_cert loads f->cert and f->key into cfg. */
static moe_err set_own_cert(nng_tls_config *cfg, const moe_tls_files *f, char *err, size_t errlen)
{
    char *cert = NULL, *key = NULL;
    moe_err e = read_pem("certificate", f->cert, &cert, err, errlen);
    if (e == MOE_OK)
        e = read_pem("key", f->key, &key, err, errlen);
    if (e == MOE_OK) {
        int rv = nng_tls_config_own_cert(cfg, cert, key, NULL);
        if (rv != 0) {
            snprintf(err, errlen, "certificate %s with key %s refused: %s", f->cert, f->key,
                     nng_strerror(rv));
            e = MOE_EINVAL;
        }
    }
    free(cert);
    free(key);
    return e;
}

/* set_ca loads f->ca into cfg and makes the peer's certificate required. */
static moe_err set_ca(nng_tls_config *cfg, const moe_tls_files *f, char *err, size_t errlen)
{
    char *ca = NULL;
    moe_err e = read_pem("CA", f->ca, &ca, err, errlen);
    if (e != MOE_OK)
        return e;
    int rv = nng_tls_config_ca_chain(cfg, ca, NULL);
    free(ca);
    if (rv == 0)
        rv = nng_tls_config_auth_mode(cfg, NNG_TLS_AUTH_MODE_REQUIRED);
    if (rv != 0) {
        snprintf(err, errlen, "CA file %s refused: %s", f->ca, nng_strerror(rv));
        return MOE_EINVAL;
    }
    return MOE_OK;
}

moe_err moe_tls_listener_setup(nng_listener l, const char *url, const moe_tls_files *f, char *err,
                               size_t errlen)
{
    if (!moe_tls_url(url))
        return MOE_OK;
    if (!f || !given(f->cert) || !given(f->key)) {
        snprintf(err, errlen,
                 "%s is a TLS address: it needs a certificate and its key (--tls-cert "
                 "and --tls-key)",
                 url);
        return MOE_EINVAL;
    }
    nng_tls_config *cfg = NULL; /* ours until the end; the listener holds its own reference */
    int rv = nng_tls_config_alloc(&cfg, NNG_TLS_MODE_SERVER);
    if (rv != 0) {
        snprintf(err, errlen, "%s: no TLS: %s", url, nng_strerror(rv));
        return MOE_EINVAL;
    }
    moe_err e = set_own_cert(cfg, f, err, errlen);
    if (e == MOE_OK && ((rv = nng_tls_config_auth_mode(cfg, NNG_TLS_AUTH_MODE_NONE)) != 0 ||
                        (rv = nng_listener_set_ptr(l, NNG_OPT_TLS_CONFIG, cfg)) != 0)) {
        snprintf(err, errlen, "%s: cannot set TLS: %s", url, nng_strerror(rv));
        e = MOE_EINVAL;
    }
    nng_tls_config_free(cfg);
    return e;
}

moe_err moe_tls_dialer_setup(nng_dialer d, const char *url, const moe_tls_files *f, char *err,
                             size_t errlen)
{
    if (!moe_tls_url(url))
        return MOE_OK;
    if (!f || !given(f->ca)) {
        snprintf(err, errlen,
                 "%s is a TLS address: it needs the CA that signed the server's "
                 "certificate (--tls-ca)",
                 url);
        return MOE_EINVAL;
    }
    if (given(f->cert) != given(f->key)) {
        snprintf(err, errlen, "--tls-cert and --tls-key go together");
        return MOE_EINVAL;
    }
    char host[256];
    if (url_host(url, host, sizeof(host)) != 0) {
        snprintf(err, errlen, "%s: no host name to verify the certificate against", url);
        return MOE_EINVAL;
    }
    nng_tls_config *cfg = NULL; /* ours until the end; the dialer holds its own reference */
    int rv = nng_tls_config_alloc(&cfg, NNG_TLS_MODE_CLIENT);
    if (rv != 0) {
        snprintf(err, errlen, "%s: no TLS: %s", url, nng_strerror(rv));
        return MOE_EINVAL;
    }
    moe_err e = set_ca(cfg, f, err, errlen);
    if (e == MOE_OK && given(f->cert))
        e = set_own_cert(cfg, f, err, errlen);
    if (e == MOE_OK && ((rv = nng_tls_config_server_name(cfg, host)) != 0 ||
                        (rv = nng_dialer_set_ptr(d, NNG_OPT_TLS_CONFIG, cfg)) != 0)) {
        snprintf(err, errlen, "%s: cannot set TLS: %s", url, nng_strerror(rv));
        e = MOE_EINVAL;
    }
    nng_tls_config_free(cfg);
    return e;
}
