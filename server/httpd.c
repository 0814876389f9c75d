/* httpd.c - the coordinator's small HTTP/1.x server; see httpd.h. */
#include "server/httpd.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdint.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define HTTPD_IO_TIMEOUT_S 5          /* per read or write of one connection */
#define HTTPD_DRAIN_MAX    (1u << 20) /* request bytes read and dropped after an answer */
#define HTTPD_HEAD_S       10         /* bound on reading one request head */
#define HTTPD_DRAIN_S      2          /* bound on the drain after an answer */

static int64_t now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec;
}

struct httpd {
    int lfd;     /* listening socket */
    int wake[2]; /* a byte on wake[1] stops the accept thread */
    pthread_t acc;
    const httpd_route *routes;
    int nroutes;
    void *arg;
    pthread_mutex_t mu; /* guards active */
    pthread_cond_t cv;
    int active; /* connection threads running */
};

typedef struct conn {
    httpd *h;
    int fd;
} conn;

static const char *reason(int status)
{
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Internal Server Error";
    }
}

static int send_all(int fd, const char *p, size_t len)
{
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* send_resp writes the status line, headers and (unless head_only) body. */
static void send_resp(int fd, const httpd_resp *r, int head_only)
{
    char head[512];
    int n = snprintf(head, sizeof(head),
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                     "Connection: close\r\n\r\n",
                     r->status, reason(r->status), r->ctype ? r->ctype : "text/plain", r->len,
                     r->extra ? r->extra : "");
    if (send_all(fd, head, (size_t)n) == 0 && !head_only && r->len)
        send_all(fd, r->body, r->len);
}

static void send_error(int fd, int status, const char *text)
{
    httpd_resp r = {status,       "text/plain", status == 405 ? "Allow: GET, HEAD\r\n" : NULL,
                    (char *)text, strlen(text), 0};
    send_resp(fd, &r, 0);
}

/* read_head reads until the blank line that ends the request head. Returns
 * the bytes read (buf NUL terminated), 0 when the head does not fit in
 * HTTPD_HEAD_MAX, -1 when the peer closed or timed out first. */
static ssize_t read_head(int fd, char *buf)
{
    size_t n = 0;
    int64_t until = now_s() + HTTPD_HEAD_S;
    for (;;) {
        if (now_s() > until)
            return -1; /* a client that sends its head this slowly gets no answer */
        ssize_t r = recv(fd, buf + n, HTTPD_HEAD_MAX - n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        n += (size_t)r;
        buf[n] = 0;
        if (memmem(buf, n, "\r\n\r\n", 4))
            return (ssize_t)n;
        if (n == HTTPD_HEAD_MAX)
            return 0;
    }
}

static const httpd_route *find_route(const httpd *h, const char *target)
{
    size_t len = strcspn(target, "?#");
    while (len > 1 && target[len - 1] == '/')
        len--;
    for (int i = 0; i < h->nroutes; i++)
        if (strlen(h->routes[i].path) == len && strncmp(h->routes[i].path, target, len) == 0)
            return &h->routes[i];
    return NULL;
}

/* serve_one reads one request and answers it. */
static void serve_one(httpd *h, int fd)
{
    char buf[HTTPD_HEAD_MAX + 1];
    ssize_t n = read_head(fd, buf);
    if (n < 0)
        return;
    if (n == 0) { /* did not fit: the request line, or the header lines? */
        if (!memmem(buf, HTTPD_HEAD_MAX, "\r\n", 2))
            send_error(fd, 414, "URI too long\n");
        else
            send_error(fd, 431, "request header fields too large\n");
        return;
    }
    char *eol = strstr(buf, "\r\n");
    *eol = 0;
    char *method = buf, *target = strchr(buf, ' ');
    char *version = target ? strchr(target + 1, ' ') : NULL;
    if (!target || !version || strncmp(version + 1, "HTTP/1.", 7) != 0) {
        send_error(fd, 400, "bad request\n");
        return;
    }
    *target++ = 0;
    *version = 0;
    if (strlen(target) > HTTPD_URI_MAX) {
        send_error(fd, 414, "URI too long\n");
        return;
    }
    int head_only = strcmp(method, "HEAD") == 0;
    if (!head_only && strcmp(method, "GET") != 0) {
        send_error(fd, 405, "method not allowed\n");
        return;
    }
    const httpd_route *rt = find_route(h, target);
    if (!rt) {
        send_error(fd, 404, "not found\n");
        return;
    }
    httpd_resp r = {500, "text/plain", NULL, NULL, 0, 0};
    rt->cb(h->arg, &r);
    if (!r.body && r.len) { /* the handler could not make its answer */
        send_error(fd, 500, "internal error\n");
        return;
    }
    send_resp(fd, &r, head_only);
    if (r.owned)
        free(r.body);
}

/* drain reads what the client still sends (bounded) after the answer, so
 * that closing does not reset the connection before the answer is read. */
static void drain(int fd)
{
    char b[4096];
    size_t total = 0;
    int64_t until = now_s() + HTTPD_DRAIN_S;
    shutdown(fd, SHUT_WR);
    while (total < HTTPD_DRAIN_MAX && now_s() <= until) {
        ssize_t r = recv(fd, b, sizeof(b), 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return;
        total += (size_t)r;
    }
}

static void *conn_main(void *arg)
{
    conn *k = arg;
    httpd *h = k->h;
    struct timeval tv = {HTTPD_IO_TIMEOUT_S, 0};
    setsockopt(k->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(k->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    serve_one(h, k->fd);
    drain(k->fd);
    close(k->fd);
    free(k);
    pthread_mutex_lock(&h->mu);
    h->active--;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* start_conn hands fd to a new thread; closes it when it cannot. */
static void start_conn(httpd *h, int fd)
{
    pthread_mutex_lock(&h->mu);
    int full = h->active >= HTTPD_MAX_CONNS;
    if (!full)
        h->active++;
    pthread_mutex_unlock(&h->mu);
    if (full) {
        send_error(fd, 503, "too many connections\n");
        close(fd);
        return;
    }
    conn *k = malloc(sizeof(*k));
    pthread_attr_t at;
    pthread_t t;
    int ok = k && pthread_attr_init(&at) == 0;
    if (ok) {
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        k->h = h;
        k->fd = fd;
        ok = pthread_create(&t, &at, conn_main, k) == 0;
        pthread_attr_destroy(&at);
    }
    if (!ok) {
        free(k);
        close(fd);
        pthread_mutex_lock(&h->mu);
        h->active--;
        pthread_cond_broadcast(&h->cv);
        pthread_mutex_unlock(&h->mu);
    }
}

static void *accept_main(void *arg)
{
    httpd *h = arg;
    for (;;) {
        struct pollfd p[2] = {{h->lfd, POLLIN, 0}, {h->wake[0], POLLIN, 0}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            return NULL;
        }
        if (p[1].revents)
            return NULL;
        int fd = accept4(h->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)
                usleep(10000); /* out of descriptors: do not spin */
            continue;
        }
        start_conn(h, fd);
    }
}

/* listen_on binds "http://HOST:PORT"; returns the socket or -1. */
static int listen_on(const char *url, char *err, size_t errlen)
{
    char host[256], *port;
    if (strncmp(url, "http://", 7) != 0 || strlen(url + 7) >= sizeof(host)) {
        snprintf(err, errlen, "bad metrics url %s (want http://HOST:PORT)", url);
        return -1;
    }
    snprintf(host, sizeof(host), "%s", url + 7);
    host[strcspn(host, "/")] = 0;
    if (!(port = strrchr(host, ':'))) {
        snprintf(err, errlen, "bad metrics url %s (no port)", url);
        return -1;
    }
    *port++ = 0;
    char *hp = host;
    if (hp[0] == '[' && hp[strlen(hp) - 1] == ']') { /* [v6 address] */
        hp[strlen(hp) - 1] = 0;
        hp++;
    }
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    int rv = getaddrinfo(hp[0] ? hp : NULL, port, &hints, &ai);
    if (rv != 0) {
        snprintf(err, errlen, "metrics url %s: %s", url, gai_strerror(rv));
        return -1;
    }
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol), one = 1;
    if (fd >= 0)
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        snprintf(err, errlen, "cannot listen on %s: %s", url, strerror(errno));
        if (fd >= 0)
            close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

httpd *httpd_start(const char *url, const httpd_route *routes, int nroutes, void *arg, char *err,
                   size_t errlen)
{
    httpd *h = calloc(1, sizeof(*h));
    if (!h) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    h->routes = routes;
    h->nroutes = nroutes;
    h->arg = arg;
    h->wake[0] = h->wake[1] = -1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    if ((h->lfd = listen_on(url, err, errlen)) < 0)
        goto fail;
    if (pipe2(h->wake, O_CLOEXEC) != 0 || pthread_create(&h->acc, NULL, accept_main, h) != 0) {
        snprintf(err, errlen, "cannot start the HTTP server: %s", strerror(errno));
        goto fail;
    }
    return h;
fail:
    if (h->lfd >= 0)
        close(h->lfd);
    if (h->wake[0] >= 0) {
        close(h->wake[0]);
        close(h->wake[1]);
    }
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
    return NULL;
}

void httpd_stop(httpd *h)
{
    if (!h)
        return;
    if (write(h->wake[1], "x", 1) != 1)
        return; /* cannot wake the accept thread: leave it running */
    pthread_join(h->acc, NULL);
    close(h->lfd);
    /* connection threads end within their I/O timeouts */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 4 * HTTPD_IO_TIMEOUT_S;
    pthread_mutex_lock(&h->mu);
    int rv = 0;
    while (h->active > 0 && rv != ETIMEDOUT)
        rv = pthread_cond_timedwait(&h->cv, &h->mu, &until);
    int left = h->active;
    pthread_mutex_unlock(&h->mu);
    if (left)
        return; /* still in use by a stuck connection: not freed */
    close(h->wake[0]);
    close(h->wake[1]);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
}
