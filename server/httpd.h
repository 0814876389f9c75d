/*
 * httpd.h - the coordinator's small HTTP/1.x server for /metrics, /livez,
 * /readyz and /dashboard (docs/OPERATIONS.md, "Health and metrics").
 *
 * One accept thread; each connection is served by its own short-lived
 * thread (at most HTTPD_MAX_CONNS at once; more are answered 503), one
 * request per connection (answers carry "Connection: close"). GET and HEAD
 * only. A request head is read up to HTTPD_HEAD_MAX bytes: a request line
 * that does not fit, or a target longer than HTTPD_URI_MAX, is answered
 * 414 URI Too Long; header lines that do not fit are answered 431 Request
 * Header Fields Too Large; then the connection is closed.
 */
#ifndef MOE_HTTPD_H
#define MOE_HTTPD_H

#include <stddef.h>

#include "base/moe.h"

#define HTTPD_HEAD_MAX  8192
#define HTTPD_URI_MAX   2048
#define HTTPD_MAX_CONNS 32

/* A handler's answer. body is freed with free() when owned is set. */
typedef struct httpd_resp {
    int status;
    const char *ctype;
    const char *extra; /* extra header lines, each ending "\r\n" (may be NULL) */
    char *body;
    size_t len;
    int owned;
} httpd_resp;

typedef struct httpd_route {
    const char *path; /* exact path; a trailing '/' and a query string are ignored */
    void (*cb)(void *arg, httpd_resp *out);
} httpd_route;

typedef struct httpd httpd;

/* httpd_start listens on url ("http://HOST:PORT") and serves routes (the
 * array must outlive the server) with arg. NULL on failure, reason in err. */
httpd *httpd_start(const char *url, const httpd_route *routes, int nroutes, void *arg, char *err,
                   size_t errlen);
/* httpd_stop closes the listener and waits (bounded) for the connections
 * being served; then frees h. */
void httpd_stop(httpd *h);

#endif
