/*
 * test_layers.c - the include graph has no circle and no arrow pointing up
 * (tools/layers.py, run from the repository root): the repository passes,
 * and a temporary tree with planted violations (an upward include, an
 * include between two folders of one floor, a circle of headers, a bare
 * include, a folder on no floor) fails with each one named. Also the
 * coordinator's call order (tools/calls.py over the built objects).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char out[1 << 16];

/* run_layers runs tools/layers.py on root (NULL: the repository); its output
 * in out (truncated); returns its exit code, -1 when it did not exit. */
static int run_layers(const char *root)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "python3 tools/layers.py %s 2>&1", root ? root : "");
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t len = fread(out, 1, sizeof(out) - 1, p);
    out[len] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* plant writes text to root/rel, making its folder. */
static void plant(const char *root, const char *rel, const char *text)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", root, rel);
    char *slash = strrchr(path, '/');
    *slash = 0;
    mkdir(path, 0755);
    *slash = '/';
    FILE *f = fopen(path, "w");
    cr_assert(f, "fopen %s", path);
    fputs(text, f);
    fclose(f);
}

static void need_python(void)
{
    if (system("python3 -c 1 >/dev/null 2>&1") != 0)
        cr_skip_test("python3 is not installed");
}

Test(layers, repository_has_no_upward_include_and_no_circle)
{
    need_python();
    int rc = run_layers(NULL);
    cr_assert_eq(rc, 0, "tools/layers.py found violations:\n%s", out);
}

/* tools/calls.py: the coordinator's files call downward in the order of
 * server/coord.h, without circles (read from the objects in build/server,
 * built with this binary); --self-test plants a call upward and proves it
 * is caught. */
Test(layers, coordinator_calls_follow_the_declared_order)
{
    need_python();
    FILE *p = popen("python3 tools/calls.py 2>&1", "r");
    cr_assert(p, "popen tools/calls.py");
    size_t len = fread(out, 1, sizeof(out) - 1, p);
    out[len] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "tools/calls.py found violations:\n%s", out);
}

Test(layers, planted_upward_call_is_caught)
{
    need_python();
    FILE *p = popen("python3 tools/calls.py --self-test 2>&1", "r");
    cr_assert(p, "popen tools/calls.py --self-test");
    size_t len = fread(out, 1, sizeof(out) - 1, p);
    out[len] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "tools/calls.py --self-test:\n%s", out);
}

Test(layers, planted_violations_are_caught)
{
    need_python();
    char root[] = "/tmp/moe-layers-XXXXXX";
    cr_assert(mkdtemp(root), "mkdtemp");
    plant(root, "base/moe.h", "/* ground */\n");
    plant(root, "server/coord.h", "#include \"base/moe.h\"\n");
    plant(root, "worker/worker.h", "#include \"base/moe.h\"\n");
    /* the plants */
    plant(root, "proto/proto.h", "#include \"base/moe.h\"\n#include \"server/coord.h\"\n");
    plant(root, "worker/w.c", "#include \"server/coord.h\"\n");
    plant(root, "common/a.h", "#include \"common/b.h\"\n");
    plant(root, "common/b.h", "#include \"common/a.h\"\n");
    plant(root, "rpc/r.c", "#include \"moe.h\"\n");
    plant(root, "attic/old.c", "#include \"base/moe.h\"\n");

    int rc = run_layers(root);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
    cr_expect_eq(system(cmd), 0);
    cr_assert_eq(rc, 1, "exit %d, want 1:\n%s", rc, out);
    cr_expect(
        strstr(out, "proto/proto.h:2: includes \"server/coord.h\": proto (floor 1) points up"),
        "the upward include is not named:\n%s", out);
    cr_expect(
        strstr(out, "worker/w.c:1: includes \"server/coord.h\": worker and server share floor"),
        "the worker including the coordinator is not named:\n%s", out);
    cr_expect(strstr(out, "include circle: common/a.h -> common/b.h"),
              "the circle is not named:\n%s", out);
    cr_expect(strstr(out, "rpc/r.c:1: \"moe.h\" is not folder-qualified"),
              "the bare include is not named:\n%s", out);
    cr_expect(strstr(out, "attic/old.c: folder 'attic' is on no floor"),
              "the folder on no floor is not named:\n%s", out);
}
