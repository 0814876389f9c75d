/*
 * test_harden.c - hardening against an outside client, on real daemons:
 *   - model names: the charset, "." and ".." (they would escape
 *     --checkpoint-dir), an embedded NUL ("hm\0evil" is not "hm");
 *   - checkpoint paths: confined to --checkpoint-root (symlinks resolved,
 *     "..", relative paths), refused without a root, NUL refused; the
 *     worker refuses directories outside the root when called directly;
 *   - backward with a handle >= 2^63 is not_found;
 *   - the metrics HTTP server answers 414 / 431 to oversized requests.
 * Calls with hand-made params go through moe_call (libmoe checks nothing
 * on the way).
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client/client_dp.h" /* moe__set_cluster */
#include "tests/cluster.h"
#include "kernels/kern.h"

#define H 16

static void expect_err(moe_client *c, const char *method, const mp_writer *p, moe_err want,
                       const char *what)
{
    moe_reply rep;
    moe_err e = moe_call(c, method, p->buf, p->len, &rep);
    cr_assert_eq(e, want, "%s: got %s (%s), want %s", what, moe_err_code(e), rep.message,
                 moe_err_code(want));
    cr_assert(rep.message[0], "%s: empty message", what);
    cr_log_info("%s -> %s: %s", what, moe_err_code(e), rep.message);
    moe_reply_free(&rep);
}

/* create_params: model.create with the name given as len bytes */
static void create_params(mp_writer *w, const char *name, uint32_t len)
{
    mp_writer_init(w);
    mp_write_map(w, 6);
    mp_write_cstr(w, "name");
    mp_write_str(w, name, len);
    mp_write_cstr(w, "layers");
    mp_write_i64(w, 1);
    mp_write_cstr(w, "d_model");
    mp_write_i64(w, H);
    mp_write_cstr(w, "d_ff");
    mp_write_i64(w, 2 * H);
    mp_write_cstr(w, "n_experts");
    mp_write_i64(w, 4);
    mp_write_cstr(w, "top_k");
    mp_write_i64(w, 2);
}

/* ckpt_params: {model, path} with the path given as len bytes */
static void ckpt_params(mp_writer *w, const char *model, const char *path, uint32_t len)
{
    mp_writer_init(w);
    mp_write_map(w, 2);
    mp_write_cstr(w, "model");
    mp_write_cstr(w, model);
    mp_write_cstr(w, "path");
    mp_write_str(w, path, len);
}

static void create_ok(cluster *cl, const char *name)
{
    moe_model_config mc = {0};
    mc.name = name;
    mc.layers = 1;
    mc.d_model = H;
    mc.d_ff = 2 * H;
    mc.n_experts = 4;
    mc.top_k = 2;
    mc.seed = 1;
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "model.create %s: %s", name,
                 moe_last_error());
}

static void make_tmpdir(char *out, size_t len)
{
    snprintf(out, len, "/tmp/moe-harden-XXXXXX");
    cr_assert(mkdtemp(out) != NULL);
}

static void rm_rf(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

static int exists(const char *p)
{
    struct stat sb;
    return lstat(p, &sb) == 0;
}

Test(harden, model_names_dot_dotdot_and_nul_refused, .timeout = 30, .fini = cluster_fini_all)
{
    char base[128], ckdir[200], p[300];
    make_tmpdir(base, sizeof(base));
    snprintf(ckdir, sizeof(ckdir), "%s/ck", base);
    cluster_opts o = {.workers = 0, .expected_workers = 1, .no_wait = 1, .checkpoint_root = ""};
    o.coord_args[0] = "--checkpoint-dir";
    o.coord_args[1] = ckdir;
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    mp_writer w;
    static const char *bad[] = {".", "..", "", "a/b", "a b"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        create_params(&w, bad[i], (uint32_t)strlen(bad[i]));
        expect_err(cl->cli, "model.create", &w, MOE_EINVAL, bad[i]);
        mp_writer_fini(&w);
    }
    /* nothing was written next to the checkpoint directory (the ".." escape) */
    snprintf(p, sizeof(p), "%s/model.json", base);
    cr_assert(!exists(p), "%s was written", p);
    snprintf(p, sizeof(p), "%s/model.json", ckdir);
    cr_assert(!exists(p), "%s was written", p);

    /* "hm\0evil" is refused, and is never taken for "hm" */
    create_ok(cl, "hm");
    create_params(&w, "hm\0evil", 7);
    expect_err(cl->cli, "model.create", &w, MOE_EINVAL, "model.create hm\\0evil");
    mp_writer_fini(&w);
    mp_writer_init(&w);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "model");
    mp_write_str(&w, "hm\0evil", 7);
    expect_err(cl->cli, "model.info", &w, MOE_EINVAL, "model.info hm\\0evil");
    mp_writer_fini(&w);
    /* names with dots that are not "." or ".." stay valid */
    create_ok(cl, "a..b");
    create_ok(cl, ".hidden");
    cr_assert_eq(cluster_stop(cl), 0);
    rm_rf(base);
}

Test(harden, checkpoint_paths_confined_to_root, .timeout = 60, .fini = cluster_fini_all)
{
    char root[128], outside[128], p[400], link[300];
    make_tmpdir(root, sizeof(root));
    make_tmpdir(outside, sizeof(outside));
    cluster_opts o = {.workers = 1, .checkpoint_root = root};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    create_ok(cl, "m");
    mp_writer w;

    /* inside the root: fine */
    snprintf(p, sizeof(p), "%s/a", root);
    cr_assert_eq(moe_checkpoint_save(cl->cli, "m", p), MOE_OK, "%s", moe_last_error());
    int64_t step = -1;
    cr_assert_eq(moe_checkpoint_load(cl->cli, "m", p, &step), MOE_OK, "%s", moe_last_error());

    /* outside: refused, and nothing is created */
    static const char *etc = "/etc/moe-harden-test";
    ckpt_params(&w, "m", etc, (uint32_t)strlen(etc));
    expect_err(cl->cli, "checkpoint.save", &w, MOE_EINVAL, "save under /etc");
    mp_writer_fini(&w);
    cr_assert(!exists(etc), "%s was created", etc);
    snprintf(p, sizeof(p), "%s/x", outside);
    ckpt_params(&w, "m", p, (uint32_t)strlen(p));
    expect_err(cl->cli, "checkpoint.save", &w, MOE_EINVAL, "save in another directory");
    expect_err(cl->cli, "checkpoint.load", &w, MOE_EINVAL, "load from another directory");
    mp_writer_fini(&w);
    cr_assert(!exists(p), "%s was created", p);
    /* "..": resolved, outside */
    snprintf(p, sizeof(p), "%s/../%s/y", root, strrchr(outside, '/') + 1);
    ckpt_params(&w, "m", p, (uint32_t)strlen(p));
    expect_err(cl->cli, "checkpoint.save", &w, MOE_EINVAL, "save through ..");
    mp_writer_fini(&w);
    snprintf(p, sizeof(p), "%s/y", outside);
    cr_assert(!exists(p), "%s was created", p);
    /* ".." after a directory that does not exist yet */
    snprintf(p, sizeof(p), "%s/new/../../z", root);
    ckpt_params(&w, "m", p, (uint32_t)strlen(p));
    expect_err(cl->cli, "checkpoint.save", &w, MOE_EINVAL, "save through new/../..");
    mp_writer_fini(&w);
    /* a symlink inside the root that points outside it */
    snprintf(link, sizeof(link), "%s/link", root);
    cr_assert_eq(symlink(outside, link), 0);
    snprintf(p, sizeof(p), "%s/z", link);
    ckpt_params(&w, "m", p, (uint32_t)strlen(p));
    expect_err(cl->cli, "checkpoint.save", &w, MOE_EINVAL, "save through a symlink");
    mp_writer_fini(&w);
    snprintf(p, sizeof(p), "%s/z", outside);
    cr_assert(!exists(p), "%s was created", p);
    /* LATEST naming ".." */
    snprintf(p, sizeof(p), "%s/a/LATEST", root);
    FILE *f = fopen(p, "w");
    cr_assert(f);
    fputs("..\n", f);
    fclose(f);
    snprintf(p, sizeof(p), "%s/a", root);
    ckpt_params(&w, "m", p, (uint32_t)strlen(p));
    expect_err(cl->cli, "checkpoint.load", &w, MOE_EINVAL, "load of LATEST = ..");
    mp_writer_fini(&w);
    /* relative paths, and an embedded NUL */
    ckpt_params(&w, "m", "rel/dir", 7);
    expect_err(cl->cli, "checkpoint.save", &w, MOE_EINVAL, "relative path");
    mp_writer_fini(&w);
    snprintf(p, sizeof(p), "%s/b", root);
    size_t n = strlen(p);
    memcpy(p + n, "\0/etc", 6);
    ckpt_params(&w, "m", p, (uint32_t)n + 5);
    expect_err(cl->cli, "checkpoint.save", &w, MOE_EINVAL, "path with a NUL");
    mp_writer_fini(&w);
    cr_assert(!exists(p), "%s was created (the path was cut at the NUL)", p);

    cr_assert_eq(cluster_stop(cl), 0);
    rm_rf(root);
    rm_rf(outside);
}

Test(harden, explicit_paths_refused_without_root, .timeout = 30, .fini = cluster_fini_all)
{
    char dir[128], p[200];
    make_tmpdir(dir, sizeof(dir));
    cluster_opts o = {.workers = 0, .expected_workers = 1, .no_wait = 1, .checkpoint_root = ""};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    create_ok(cl, "m");
    snprintf(p, sizeof(p), "%s/x", dir);
    mp_writer w;
    ckpt_params(&w, "m", p, (uint32_t)strlen(p));
    expect_err(cl->cli, "checkpoint.save", &w, MOE_EPRECOND, "save without a root");
    expect_err(cl->cli, "checkpoint.load", &w, MOE_EPRECOND, "load without a root");
    mp_writer_fini(&w);
    cr_assert(strstr(moe_last_error(), "--checkpoint-root"), "%s", moe_last_error());
    cr_assert(!exists(p));
    cr_assert_eq(cluster_stop(cl), 0);
    rm_rf(dir);
}

/* worker_url: the rpc_url of the first worker in cluster.status. */
static void worker_url(cluster *cl, char *out, size_t cap)
{
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "cluster.status", NULL, 0, &rep), MOE_OK);
    mp_reader r = mp_reply_reader(&rep);
    uint32_t n = 0;
    cr_assert_eq(mp_map_find(&r, "workers"), 0);
    cr_assert_eq(mp_read_array(&r, &n, NULL), MOE_OK);
    cr_assert(n >= 1);
    const char *s;
    uint32_t len;
    cr_assert_eq(mp_map_find(&r, "rpc_url"), 0);
    cr_assert_eq(mp_read_str(&r, &s, &len, NULL), MOE_OK);
    snprintf(out, cap, "%.*s", (int)len, s);
    moe_reply_free(&rep);
}

Test(harden, worker_refuses_checkpoint_dirs_outside_root, .timeout = 60, .fini = cluster_fini_all)
{
    char root[128], outside[128], p[300], url[256];
    make_tmpdir(root, sizeof(root));
    make_tmpdir(outside, sizeof(outside));
    cluster_opts o = {.workers = 1, .checkpoint_root = root};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    create_ok(cl, "m");
    worker_url(cl, url, sizeof(url));
    moe_client *wc = NULL;
    moe_client_opts co = {.timeout_ms = 10000, .data_path = "coordinator"};
    cr_assert_eq(moe_client_open(url, &co, &wc), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe__set_cluster(wc, cl->secret), MOE_OK); /* worker.* require it */
    mp_writer w;
    snprintf(p, sizeof(p), "%s/ckpt-1", outside);
    mp_writer_init(&w);
    mp_write_map(&w, 2);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    mp_write_cstr(&w, "dir");
    mp_write_cstr(&w, p);
    expect_err(wc, "worker.checkpoint_save", &w, MOE_EINVAL, "worker save outside the root");
    mp_writer_fini(&w);
    cr_assert(!exists(p), "the worker created %s", p);
    /* prepare a load from outside */
    mp_writer_init(&w);
    mp_write_map(&w, 4);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    mp_write_cstr(&w, "phase");
    mp_write_cstr(&w, "prepare");
    mp_write_cstr(&w, "dir");
    mp_write_cstr(&w, "/etc");
    mp_write_cstr(&w, "files");
    mp_write_array(&w, 1);
    mp_write_cstr(&w, "passwd");
    expect_err(wc, "worker.checkpoint_load", &w, MOE_EINVAL, "worker load outside the root");
    mp_writer_fini(&w);
    /* inside the root the worker writes */
    snprintf(p, sizeof(p), "%s/ckpt-1", root);
    mp_writer_init(&w);
    mp_write_map(&w, 2);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, "m");
    mp_write_cstr(&w, "dir");
    mp_write_cstr(&w, p);
    moe_reply rep;
    cr_assert_eq(moe_call(wc, "worker.checkpoint_save", w.buf, w.len, &rep), MOE_OK, "%s",
                 rep.message);
    moe_reply_free(&rep);
    mp_writer_fini(&w);
    cr_assert(exists(p));
    moe_client_close(wc);
    cr_assert_eq(cluster_stop(cl), 0);
    rm_rf(root);
    rm_rf(outside);
}

Test(harden, backward_handle_over_2_63_not_found, .timeout = 30, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 0, .expected_workers = 1, .no_wait = 1, .checkpoint_root = ""};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    static const uint64_t handles[] = {1ull << 63, (1ull << 63) + 5, ~0ull, 9000000000000000001ull};
    float dy[H] = {0};
    for (size_t i = 0; i < sizeof(handles) / sizeof(handles[0]); i++) {
        mp_writer w;
        mp_writer_init(&w);
        mp_write_map(&w, 2);
        mp_write_cstr(&w, "handle");
        mp_write_u64(&w, handles[i]);
        mp_write_cstr(&w, "dy");
        moe_tensor t = {MOE_F32, 2, {1, H}, dy, sizeof(dy)};
        moe_tensor_write(&w, &t);
        char what[64];
        snprintf(what, sizeof(what), "backward handle %llu", (unsigned long long)handles[i]);
        expect_err(cl->cli, "backward", &w, MOE_ENOTFOUND, what);
        mp_writer_fini(&w);
    }
    cr_assert_eq(cluster_stop(cl), 0);
}

/* http_raw sends req (len bytes) to the metrics port and reads the answer
 * (NUL terminated, truncated to cap); returns the status code or -1. */
static int http_raw(int port, const char *req, size_t len, char *out, size_t cap)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(s >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {20, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    cr_assert_eq(connect(s, (struct sockaddr *)&a, sizeof(a)), 0);
    size_t off = 0;
    while (off < len) { /* the server may answer and stop reading early */
        ssize_t n = send(s, req + off, len - off, MSG_NOSIGNAL);
        if (n <= 0)
            break;
        off += (size_t)n;
    }
    size_t got = 0;
    for (;;) {
        ssize_t n = recv(s, out + got, cap - 1 - got, 0);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(s);
    out[got] = 0;
    int code = -1;
    if (sscanf(out, "HTTP/1.%*d %d", &code) != 1)
        return -1;
    return code;
}

Test(harden, metrics_http_oversized_requests_answered, .timeout = 60, .fini = cluster_fini_all)
{
    cluster_opts o = {
        .workers = 0, .expected_workers = 1, .no_wait = 1, .metrics = 1, .checkpoint_root = ""};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "%s", cluster_error());
    static char req[300000], out[8192], body[4096];
    /* a 64 KiB URL: 414, then the connection is closed */
    size_t n = (size_t)snprintf(req, sizeof(req), "GET /metrics?");
    memset(req + n, 'a', 65536);
    n += 65536;
    n += (size_t)snprintf(req + n, sizeof(req) - n, " HTTP/1.1\r\nHost: x\r\n\r\n");
    int code = http_raw(cl->metrics_port, req, n, out, sizeof(out));
    cr_assert_eq(code, 414, "long URL: %s", out);
    cr_assert(strstr(out, "Connection: close"), "%s", out);
    /* a URL over the limit that still fits in the head buffer: 414 too */
    n = (size_t)snprintf(req, sizeof(req), "GET /");
    memset(req + n, 'b', 4000);
    n += 4000;
    n += (size_t)snprintf(req + n, sizeof(req) - n, " HTTP/1.1\r\nHost: x\r\n\r\n");
    cr_assert_eq(http_raw(cl->metrics_port, req, n, out, sizeof(out)), 414, "%s", out);
    /* 256 KiB of header lines: 431 */
    n = (size_t)snprintf(req, sizeof(req), "GET /metrics HTTP/1.1\r\nHost: x\r\n");
    while (n < 262144)
        n += (size_t)snprintf(req + n, sizeof(req) - n, "X-Pad: %0100d\r\n", 0);
    n += (size_t)snprintf(req + n, sizeof(req) - n, "\r\n");
    cr_assert_eq(http_raw(cl->metrics_port, req, n, out, sizeof(out)), 431, "%s", out);
    /* the server still serves */
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/livez", NULL, 0, body, sizeof(body)), 200);
    cr_assert_eq(cluster_http_get(cl->metrics_port, "/nope", NULL, 0, body, sizeof(body)), 404);
    cr_assert_eq(cluster_stop(cl), 0);
}
