/*
 * test_tls.c - TLS (tls+tcp://) between clients, the coordinator and the
 * workers, with a CA and a server certificate made here by the openssl
 * command: calls work with the right CA, a client with another CA is
 * refused, a TLS address without its files is refused at start.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cluster.h"

/* tls_dir: a temporary directory with ca.pem, other-ca.pem (a CA that
 * signed nothing here), srv.pem and srv.key (CN and SAN 127.0.0.1, signed
 * by ca.pem) */
typedef struct tls_dir {
    char dir[64];
    char ca[128], other_ca[128], cert[128], key[128];
} tls_dir;

static const char *const tls_files[] = {"ca.pem",       "ca.key",     "ca.srl",  "other-ca.pem",
                                        "other-ca.key", "srv.pem",    "srv.key", "srv.csr",
                                        "san.ext",      "openssl.log"};

static int sh(const char *dir, const char *cmd)
{
    char full[2048];
    snprintf(full, sizeof(full), "cd %s && %s >>openssl.log 2>&1", dir, cmd);
    int st = system(full);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void tls_dir_remove(tls_dir *t)
{
    char p[256];
    for (size_t i = 0; i < sizeof(tls_files) / sizeof(tls_files[0]); i++) {
        snprintf(p, sizeof(p), "%s/%s", t->dir, tls_files[i]);
        unlink(p);
    }
    rmdir(t->dir);
}

static void tls_dir_make(tls_dir *t)
{
    if (system("command -v openssl >/dev/null 2>&1") != 0)
        cr_skip_test("the openssl command is not installed");
    snprintf(t->dir, sizeof(t->dir), "/tmp/moe-tls-XXXXXX");
    cr_assert(mkdtemp(t->dir), "mkdtemp");
    static const char *const cmds[] = {
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
        "-keyout ca.key -out ca.pem -days 2 -subj /CN=moe-test-ca",
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
        "-keyout other-ca.key -out other-ca.pem -days 2 -subj /CN=moe-other-ca",
        "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
        "-keyout srv.key -out srv.csr -subj /CN=127.0.0.1",
        "printf 'subjectAltName=DNS:127.0.0.1,DNS:localhost,IP:127.0.0.1\\n' > san.ext",
        "openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem "
        "-days 2 -extfile san.ext",
    };
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        int rc = sh(t->dir, cmds[i]);
        if (rc != 0) {
            char log[300];
            snprintf(log, sizeof(log), "cat %s/openssl.log >&2", t->dir);
            (void)!system(log);
            tls_dir_remove(t);
            cr_assert_fail("openssl step %zu failed (exit %d)", i, rc);
        }
    }
    snprintf(t->ca, sizeof(t->ca), "%s/ca.pem", t->dir);
    snprintf(t->other_ca, sizeof(t->other_ca), "%s/other-ca.pem", t->dir);
    snprintf(t->cert, sizeof(t->cert), "%s/srv.pem", t->dir);
    snprintf(t->key, sizeof(t->key), "%s/srv.key", t->dir);
}

/* tls_cluster_opts: every RPC and client address of the cluster on TLS;
 * the exchange between workers stays tcp:// (docs/OPERATIONS.md) */
static cluster_opts tls_cluster_opts(const tls_dir *t, int workers)
{
    cluster_opts o = {.workers = workers,
                      .expected_workers = workers ? workers : 1,
                      .tls_ca = t->ca,
                      .coord_args = {"--listen", "tls+tcp://127.0.0.1:0", "--tls-cert", t->cert,
                                     "--tls-key", t->key, "--tls-ca", t->ca},
                      .worker_args = {"--listen", "tls+tcp://127.0.0.1:0", "--client-listen",
                                      "tls+tcp://127.0.0.1:0", "--tls-cert", t->cert, "--tls-key",
                                      t->key, "--tls-ca", t->ca}};
    return o;
}

static int run_cmd(const char *cmd, char *out, size_t len)
{
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, len - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void forward_ok(moe_client *c, const char *what)
{
    enum { T = 6, H = 32 };
    float x[T * H], y[T * H];
    for (int i = 0; i < T * H; i++)
        x[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
    memset(y, 0, sizeof(y));
    moe_err e = moe_forward(c, "tm", 0, MOE_F32, x, T, H, y, NULL);
    cr_assert_eq(e, MOE_OK, "%s: forward: %s", what, moe_last_error());
    int nonzero = 0;
    for (int i = 0; i < T * H; i++) {
        cr_assert(isfinite(y[i]), "%s: y[%d] = %f", what, i, y[i]);
        nonzero += y[i] != 0.0f;
    }
    cr_assert_gt(nonzero, 0, "%s: y is all zero", what);
}

Test(tls, cluster_over_tls_and_wrong_ca_refused, .timeout = 120, .fini = cluster_fini_all)
{
    tls_dir t;
    tls_dir_make(&t);
    cluster_opts o = tls_cluster_opts(&t, 2);
    cluster *cl = cluster_start(&o);
    if (!cl)
        tls_dir_remove(&t);
    cr_assert(cl, "TLS cluster: %s", cluster_error());
    cr_assert(strncmp(cl->url, "tls+tcp://127.0.0.1:", 20) == 0, "url %s", cl->url);
    moe_model_config mc = {.name = "tm",
                           .layers = 1,
                           .d_model = 32,
                           .d_ff = 64,
                           .n_experts = 4,
                           .top_k = 2,
                           .dtype = MOE_F32,
                           .seed = 3};
    cr_assert_eq(moe_model_create(cl->cli, &mc), MOE_OK, "create: %s", moe_last_error());
    /* the default data path: the rows go to the workers' TLS client-listen */
    forward_ok(cl->cli, "auto");
    const char *paths[2] = {"socket", "coordinator"};
    for (int i = 0; i < 2; i++) {
        moe_client_opts co = {.timeout_ms = 30000, .data_path = paths[i], .tls_ca = t.ca};
        moe_client *c;
        cr_assert_eq(moe_client_open(cl->url, &co, &c), MOE_OK, "%s", moe_last_error());
        forward_ok(c, paths[i]);
        moe_client_close(c);
    }
    /* a client trusting another CA: the handshake fails, no call goes through */
    moe_client_opts bad = {.timeout_ms = 1500, .tls_ca = t.other_ca};
    moe_client *bc;
    cr_assert_eq(moe_client_open(cl->url, &bad, &bc), MOE_OK, "%s", moe_last_error());
    moe_reply r;
    moe_err e = moe_call(bc, "ping", NULL, 0, &r);
    cr_expect_neq(e, MOE_OK, "a client with the wrong CA was answered");
    cr_expect(r.transport, "refused by the handshake, not by the server: %s", r.message);
    moe_reply_free(&r);
    moe_client_close(bc);
    /* no CA at all: refused at open, saying what is missing */
    moe_client_opts none = {.timeout_ms = 1500};
    moe_client *nc = NULL;
    cr_expect_eq(moe_client_open(cl->url, &none, &nc), MOE_EINVAL);
    cr_expect(strstr(moe_last_error(), "tls-ca"), "%s", moe_last_error());
    /* plain TCP to the TLS port: no answer */
    char plain[256];
    snprintf(plain, sizeof(plain), "tcp://%s", cl->url + strlen("tls+tcp://"));
    cr_assert_eq(moe_client_open(plain, &bad, &bc), MOE_OK, "%s", moe_last_error());
    cr_expect_neq(moe_ping(bc), MOE_OK, "plain TCP to a TLS listener was answered");
    moe_client_close(bc);
    /* the Python client: the right CA answers, another CA does not */
    if (system("python3 -c 'import numpy' >/dev/null 2>&1") == 0 &&
        access("lib/libmoe.so", R_OK) == 0) {
        char cmd[2048], out[4096];
        snprintf(cmd, sizeof(cmd),
                 "PYTHONPATH=python python3 -c \"import moe\n"
                 "c = moe.Client('%s', tls_ca='%s')\nc.ping()\n"
                 "print(c.model_info('tm')['params'])\n"
                 "b = moe.Client('%s', tls_ca='%s', timeout_ms=1500)\n"
                 "try:\n    b.ping()\n    print('WRONG CA ANSWERED')\n"
                 "except moe.Error as e:\n    print('refused', e.code)\n"
                 "c.model_delete('tm')\n"
                 "try:\n    c.model_info('tm')\n    print('NOT DELETED')\n"
                 "except moe.NotFoundError:\n    print('deleted')\n\" 2>&1",
                 cl->url, t.ca, cl->url, t.other_ca);
        int rc = run_cmd(cmd, out, sizeof(out));
        cr_expect_eq(rc, 0, "python: %s", out);
        cr_expect(strstr(out, "refused") && !strstr(out, "WRONG"), "python: %s", out);
        cr_expect(strstr(out, "deleted") && !strstr(out, "NOT DELETED"), "python: %s", out);
    }
    /* the right CA still works after all that */
    cr_assert_eq(moe_ping(cl->cli), MOE_OK, "%s", moe_last_error());
    int st = cluster_stop(cl);
    tls_dir_remove(&t);
    cr_assert_eq(st, 0, "the TLS cluster did not stop cleanly");
}

Test(tls, tls_address_without_files_refused_at_start, .timeout = 60)
{
    tls_dir t;
    tls_dir_make(&t);
    char cmd[1024], out[4096];
    const char *bin = cluster_bin_dir();
    snprintf(cmd, sizeof(cmd),
             "%s/moe-coordinator --listen tls+tcp://127.0.0.1:0 --cluster-secret s 2>&1 "
             "</dev/null",
             bin);
    int rc = run_cmd(cmd, out, sizeof(out));
    cr_expect_eq(rc, 2, "coordinator on TLS without a certificate: exit %d: %s", rc, out);
    cr_expect(strstr(out, "--tls-cert"), "%s", out);
    snprintf(cmd, sizeof(cmd),
             "%s/moe-worker --backend cpu --coordinator tls+tcp://127.0.0.1:1 --cluster-secret s "
             "--tls-cert %s --tls-key %s 2>&1 </dev/null",
             bin, t.cert, t.key);
    rc = run_cmd(cmd, out, sizeof(out));
    cr_expect_eq(rc, 2, "worker dialing TLS without a CA: exit %d: %s", rc, out);
    cr_expect(strstr(out, "--tls-ca"), "%s", out);
    snprintf(cmd, sizeof(cmd),
             "%s/moe-worker --backend cpu --coordinator tls+tcp://127.0.0.1:1 --cluster-secret s "
             "--data tls+tcp://127.0.0.1:0 --tls-cert %s --tls-key %s --tls-ca %s 2>&1 "
             "</dev/null",
             bin, t.cert, t.key, t.ca);
    rc = run_cmd(cmd, out, sizeof(out));
    cr_expect_eq(rc, 2, "worker with a TLS data address: exit %d: %s", rc, out);
    cr_expect(strstr(out, "does not run over TLS"), "%s", out);
    tls_dir_remove(&t);
}
