/*
 * blas_pick.c - OpenBLAS core type from the CPU's features, set before the
 * library's kernels are in use (blas_pick.h). The decisions are pure
 * functions of strings and feature bits (tested in tests/unit/test_blas_pick.c);
 * blas_pick_reexec and blas_pick_describe feed them this process's state.
 */
#include <cblas.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "worker/blas_pick.h"

/* The core a failed re-exec asked for (empty if none), for the start line. */
static char exec_failed_core[32];

const char *blas_pick_core_for(int avx512, int avx2_fma, int avx)
{
    if (avx512)
        return "SkylakeX";
    if (avx2_fma)
        return "Haswell";
    if (avx)
        return "Sandybridge";
    return NULL;
}

typedef struct {
    const char *name;
    int rank;
} core_class;

/* OpenBLAS 0.3.x x86-64 DYNAMIC_ARCH core names by instruction class. */
static const core_class core_classes[] = {
    {"SkylakeX", 3},   {"Cooperlake", 3},  {"SapphireRapids", 3}, {"Haswell", 2},
    {"Zen", 2},        {"Excavator", 2},   {"Sandybridge", 1},    {"Bulldozer", 1},
    {"Piledriver", 1}, {"Steamroller", 1}, {"Unknown", 0},        {"Prescott", 0},
    {"Core2", 0},      {"Penryn", 0},      {"Dunnington", 0},     {"Nehalem", 0},
    {"Atom", 0},       {"Opteron", 0},     {"Opteron_SSE3", 0},   {"Barcelona", 0},
    {"Bobcat", 0},     {"Nano", 0},        {"Katmai", 0},         {"Coppermine", 0},
    {"Northwood", 0},  {"Banias", 0},      {"Athlon", 0},         {"Generic", 0},
};

int blas_pick_core_rank(const char *core)
{
    if (!core)
        return -1;
    for (size_t i = 0; i < sizeof(core_classes) / sizeof(core_classes[0]); i++)
        if (strcasecmp(core, core_classes[i].name) == 0)
            return core_classes[i].rank;
    return -1;
}

const char *blas_pick_decide(const char *env_core, const char *marker, const char *config,
                             const char *lib_core, int avx512, int avx2_fma, int avx)
{
    if ((env_core && *env_core) || marker)
        return NULL;
    if (!config || !strstr(config, "DYNAMIC_ARCH"))
        return NULL;
    int have = blas_pick_core_rank(lib_core);
    /* AVX2-class kernels are kept: on an AVX-512 EPYC they run this
     * project's GEMMs as fast as SkylakeX's (bench/history/service.md). */
    if (have < 0 || have >= 2)
        return NULL;
    const char *want = blas_pick_core_for(avx512, avx2_fma, avx);
    return want && blas_pick_core_rank(want) > have ? want : NULL;
}

/* cpu_features reads the feature bits (the OS's support of the AVX and
 * AVX-512 register state included: libgcc checks XCR0). */
static void cpu_features(int *avx512, int *avx2_fma, int *avx)
{
    __builtin_cpu_init();
    *avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
              __builtin_cpu_supports("avx512cd");
    *avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    *avx = __builtin_cpu_supports("avx");
}

int blas_pick_exec_core(const char *core, const char *lib_core, char **argv)
{
    if (!core || !argv || !argv[0])
        return -1;
    if (setenv("OPENBLAS_CORETYPE", core, 1) == 0 &&
        setenv(BLAS_PICK_MARKER, lib_core ? lib_core : "unknown", 1) == 0) {
        fflush(NULL);
        execv("/proc/self/exe", argv);
    }
    int e = errno;
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv(BLAS_PICK_MARKER);
    snprintf(exec_failed_core, sizeof(exec_failed_core), "%s", core);
    fprintf(stderr, "%s: re-exec for OpenBLAS core %s failed (%s); keeping %s\n",
            program_invocation_short_name, core, strerror(e),
            lib_core ? lib_core : "the library's core");
    return -1;
}

int blas_pick_reexec(int argc, char **argv)
{
    int avx512, avx2_fma, avx;
    cpu_features(&avx512, &avx2_fma, &avx);
    const char *lib_core = openblas_get_corename();
    const char *want = blas_pick_decide(getenv("OPENBLAS_CORETYPE"), getenv(BLAS_PICK_MARKER),
                                        openblas_get_config(), lib_core, avx512, avx2_fma, avx);
    if (!want || argc < 1)
        return 0;
    return blas_pick_exec_core(want, lib_core, argv);
}

/* version_of copies the version word of "OpenBLAS 0.3.21 ..." into v. */
static void version_of(const char *config, char *v, size_t len)
{
    snprintf(v, len, "?");
    if (!config || strncmp(config, "OpenBLAS ", 9) != 0)
        return;
    const char *p = config + 9;
    size_t n = strcspn(p, " ");
    if (n > 0 && n < len)
        snprintf(v, len, "%.*s", (int)n, p);
}

/* source_of writes why the running core is the one it is. */
static void source_of(char *s, size_t len, const char *corename, const char *env_core,
                      const char *marker, const char *exec_failed)
{
    int honoured = env_core && corename && strcasecmp(env_core, corename) == 0;
    if (env_core && *env_core && marker)
        snprintf(s, len,
                 honoured ? "chosen from cpu features; library said %s"
                          : "library's choice; OPENBLAS_CORETYPE=%s from cpu features not honoured",
                 honoured ? marker : env_core);
    else if (env_core && *env_core)
        snprintf(s, len, "OPENBLAS_CORETYPE=%s from the environment%s", env_core,
                 honoured ? "" : " not honoured");
    else if (exec_failed)
        snprintf(s, len, "library's choice; re-exec for %s failed", exec_failed);
    else
        snprintf(s, len, "library's choice");
}

const char *blas_pick_format(char *buf, size_t len, const char *config, const char *corename,
                             const char *env_core, const char *marker, const char *failed_core,
                             int threads)
{
    if (!buf || len == 0)
        return buf;
    char ver[32], src[160], thr[32] = "";
    version_of(config, ver, sizeof(ver));
    source_of(src, sizeof(src), corename, env_core, marker, failed_core);
    if (threads > 0)
        snprintf(thr, sizeof(thr), ", %d thread%s", threads, threads == 1 ? "" : "s");
    snprintf(buf, len, "openblas %s core %s (%s)%s", ver, corename ? corename : "?", src, thr);
    return buf;
}

const char *blas_pick_describe(char *buf, size_t len)
{
    return blas_pick_format(buf, len, openblas_get_config(), openblas_get_corename(),
                            getenv("OPENBLAS_CORETYPE"), getenv(BLAS_PICK_MARKER),
                            exec_failed_core[0] ? exec_failed_core : NULL,
                            openblas_get_num_threads());
}
