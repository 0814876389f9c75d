/* test_blas_pick.c - the worker's OpenBLAS core choice (worker/blas_pick.h):
 * the feature -> core mapping, the decision, the start line's text, and,
 * in fresh processes of this binary (OpenBLAS reads OPENBLAS_CORETYPE only
 * when it loads), that every core this CPU can run - the chosen one among
 * them - gives the expert FFN and router results of the plain-loop reference
 * within f32 tolerance, that a re-exec lands on the core it asked for, and
 * that an OPENBLAS_CORETYPE from the environment is kept. No timings. */
#include <cblas.h>
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include "worker/blas_pick.h"
#include "kernels/kern.h"
#include "common/rng.h"

#define OUT_ENV "MOE_BLAS_PICK_OUT"

Test(blas_pick, core_for_features)
{
    cr_expect_str_eq(blas_pick_core_for(1, 1, 1), "SkylakeX");
    cr_expect_str_eq(blas_pick_core_for(0, 1, 1), "Haswell");
    cr_expect_str_eq(blas_pick_core_for(0, 0, 1), "Sandybridge");
    cr_expect_null(blas_pick_core_for(0, 0, 0));
}

Test(blas_pick, core_rank)
{
    cr_expect_eq(blas_pick_core_rank("Prescott"), 0);
    cr_expect_eq(blas_pick_core_rank("Core2"), 0);
    cr_expect_eq(blas_pick_core_rank("Nehalem"), 0);
    cr_expect_eq(blas_pick_core_rank("unknown"), 0);
    cr_expect_eq(blas_pick_core_rank("Sandybridge"), 1);
    cr_expect_eq(blas_pick_core_rank("Haswell"), 2);
    cr_expect_eq(blas_pick_core_rank("Zen"), 2);
    cr_expect_eq(blas_pick_core_rank("SKYLAKEX"), 3);
    cr_expect_eq(blas_pick_core_rank("Cooperlake"), 3);
    cr_expect_eq(blas_pick_core_rank("sapphirerapids"), 3);
    cr_expect_eq(blas_pick_core_rank("NeoverseN1"), -1);
    cr_expect_eq(blas_pick_core_rank(NULL), -1);
}

#define CFG_DYN "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64"

Test(blas_pick, decide)
{
    /* an old core on a better CPU: the best core its features allow */
    cr_expect_str_eq(blas_pick_decide(NULL, NULL, CFG_DYN, "Prescott", 1, 1, 1), "SkylakeX");
    cr_expect_str_eq(blas_pick_decide(NULL, NULL, CFG_DYN, "Prescott", 0, 1, 1), "Haswell");
    cr_expect_str_eq(blas_pick_decide(NULL, NULL, CFG_DYN, "Nehalem", 0, 0, 1), "Sandybridge");
    cr_expect_str_eq(blas_pick_decide(NULL, NULL, CFG_DYN, "Unknown", 1, 1, 1), "SkylakeX");
    cr_expect_str_eq(blas_pick_decide(NULL, NULL, CFG_DYN, "Sandybridge", 0, 1, 1), "Haswell");
    cr_expect_str_eq(blas_pick_decide("", NULL, CFG_DYN, "Core2", 1, 1, 1), "SkylakeX");
    /* nothing better on this CPU */
    cr_expect_null(blas_pick_decide(NULL, NULL, CFG_DYN, "Prescott", 0, 0, 0));
    cr_expect_null(blas_pick_decide(NULL, NULL, CFG_DYN, "Sandybridge", 0, 0, 1));
    /* AVX2-class and AVX-512 cores, and names not in the list, stay */
    cr_expect_null(blas_pick_decide(NULL, NULL, CFG_DYN, "Haswell", 1, 1, 1));
    cr_expect_null(blas_pick_decide(NULL, NULL, CFG_DYN, "Zen", 1, 1, 1));
    cr_expect_null(blas_pick_decide(NULL, NULL, CFG_DYN, "Cooperlake", 1, 1, 1));
    cr_expect_null(blas_pick_decide(NULL, NULL, CFG_DYN, "SomeFutureCore", 1, 1, 1));
    /* the user's OPENBLAS_CORETYPE, a second pass, a library that ignores it */
    cr_expect_null(blas_pick_decide("Prescott", NULL, CFG_DYN, "Prescott", 1, 1, 1));
    cr_expect_null(blas_pick_decide(NULL, "Prescott", CFG_DYN, "Prescott", 1, 1, 1));
    cr_expect_null(blas_pick_decide(NULL, NULL, "OpenBLAS 0.3.21 Prescott", "Prescott", 1, 1, 1));
    cr_expect_null(blas_pick_decide(NULL, NULL, NULL, "Prescott", 1, 1, 1));
}

Test(blas_pick, format)
{
    char b[256];
    cr_expect_str_eq(blas_pick_format(b, sizeof(b), CFG_DYN, "Cooperlake", NULL, NULL, NULL, 2),
                     "openblas 0.3.21 core Cooperlake (library's choice), 2 threads");
    cr_expect_str_eq(
        blas_pick_format(b, sizeof(b), CFG_DYN, "SkylakeX", "SkylakeX", "Prescott", NULL, 1),
        "openblas 0.3.21 core SkylakeX (chosen from cpu features; library said Prescott), 1 "
        "thread");
    cr_expect_str_eq(blas_pick_format(b, sizeof(b), CFG_DYN, "Haswell", "haswell", NULL, NULL, 0),
                     "openblas 0.3.21 core Haswell (OPENBLAS_CORETYPE=haswell from the "
                     "environment)");
    cr_expect_str_eq(blas_pick_format(b, sizeof(b), CFG_DYN, "Prescott", "Bogus", NULL, NULL, 0),
                     "openblas 0.3.21 core Prescott (OPENBLAS_CORETYPE=Bogus from the "
                     "environment not honoured)");
    cr_expect_str_eq(
        blas_pick_format(b, sizeof(b), CFG_DYN, "Prescott", NULL, NULL, "SkylakeX", 0),
        "openblas 0.3.21 core Prescott (library's choice; re-exec for SkylakeX failed)");
    cr_expect_str_eq(blas_pick_format(b, sizeof(b), "weird", NULL, NULL, NULL, NULL, 0),
                     "openblas ? core ? (library's choice)");
    /* truncation keeps the string terminated */
    char s[8];
    blas_pick_format(s, sizeof(s), CFG_DYN, "Cooperlake", NULL, NULL, NULL, 2);
    cr_expect_str_eq(s, "openbla");
}

/* ---- numerics under the core this process loaded ---- */

static float *rnd(uint64_t seed, uint64_t stream, size_t n, float scale)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    cr_assert(p);
    rng_fill_uniform(seed, stream, -scale, scale, p, n);
    return p;
}

/* ffn_err: rel err of the sgemm expert FFN (SwiGLU, f32) against the loops. */
static double ffn_err(int N, int H, int F)
{
    size_t nh = (size_t)N * H, fh = (size_t)F * H;
    uint64_t seed = 900 + (uint64_t)N + (uint64_t)H * 3 + (uint64_t)F * 5;
    float *x = rnd(seed, 0, nh, 1.0f), *w1 = rnd(seed, 1, fh, 1.0f / sqrtf((float)H));
    float *w3 = rnd(seed, 2, fh, 1.0f / sqrtf((float)H));
    float *w2 = rnd(seed, 3, fh, 1.0f / sqrtf((float)F));
    float *ya = rnd(seed, 4, nh, 1.0f), *yb = rnd(seed, 5, nh, 1.0f);
    kern_expert_ffn_cpu(x, N, H, F, w1, w3, w2, KERN_ACT_SWIGLU, 0, NULL, NULL, ya);
    kern_expert_ffn_blas(x, N, H, F, w1, w3, w2, KERN_ACT_SWIGLU, 0, NULL, NULL, yb);
    double r = kern_rel_err(yb, ya, nh);
    free(x), free(w1), free(w3), free(w2), free(ya), free(yb);
    return r;
}

/* router_err: rel err of the sgemm router logits against the loops. */
static double router_err(int T, int H, int E)
{
    float *x = rnd(77, 0, (size_t)T * H, 1.0f), *wr = rnd(77, 1, (size_t)E * H, 0.1f);
    float *la = rnd(77, 2, (size_t)T * E, 1.0f), *lb = rnd(77, 3, (size_t)T * E, 1.0f);
    kern_router_logits_cpu(x, wr, T, H, E, la);
    kern_router_logits_blas(x, wr, T, H, E, lb);
    double r = kern_rel_err(lb, la, (size_t)T * E);
    free(x), free(wr), free(la), free(lb);
    return r;
}

/* The probe the other tests run in a fresh process of this binary; on its
 * own it checks the core this process loaded. With OUT_ENV set it also
 * writes "core <name>\nerr <worst rel err>\ndesc <blas_pick_describe>\n". */
Test(blas_pick, landing)
{
    /* decode-like N=1, odd sizes, and sizes past the kernels' blocking */
    static const int ffn[][3] = {{1, 256, 384}, {7, 96, 160}, {37, 129, 67}, {130, 256, 320}};
    double worst = 0;
    for (size_t i = 0; i < sizeof(ffn) / sizeof(ffn[0]); i++) {
        double r = ffn_err(ffn[i][0], ffn[i][1], ffn[i][2]);
        cr_expect(r <= 1e-5, "ffn N=%d H=%d F=%d: rel err %.3g (core %s)", ffn[i][0], ffn[i][1],
                  ffn[i][2], r, openblas_get_corename());
        worst = r > worst ? r : worst;
    }
    double r = router_err(33, 256, 8);
    cr_expect(r <= 1e-5, "router: rel err %.3g (core %s)", r, openblas_get_corename());
    worst = r > worst ? r : worst;
    const char *out = getenv(OUT_ENV);
    if (!out)
        return;
    char desc[256];
    FILE *f = fopen(out, "w");
    cr_assert(f, "cannot write %s", out);
    fprintf(f, "core %s\nerr %.6g\ndesc %s\n", openblas_get_corename(), worst,
            blas_pick_describe(desc, sizeof(desc)));
    fclose(f);
}

/* ---- fresh processes ---- */

typedef struct {
    char core[64], desc[256];
    double err;
} landing_out;

static char *landing_argv[] = {"moe-tests", "--filter", "blas_pick/landing", "-q", "-j1", NULL};

typedef enum { RUN_CORE, RUN_EXEC_CORE, RUN_REEXEC } run_mode;

/* child_main: the forked child's environment for a new Criterion run (not
 * this run's sandbox), then the exec that mode asks for. Never returns. */
static void child_main(run_mode mode, const char *core, const char *out)
{
    unsetenv("BXFI_MAP");
    unsetenv(BLAS_PICK_MARKER);
    setenv(OUT_ENV, out, 1);
    if (mode == RUN_CORE && core)
        setenv("OPENBLAS_CORETYPE", core, 1);
    else if (mode == RUN_CORE)
        unsetenv("OPENBLAS_CORETYPE");
    if (mode == RUN_EXEC_CORE)
        blas_pick_exec_core(core, "Prescott", landing_argv);
    if (mode == RUN_REEXEC)
        blas_pick_reexec(5, landing_argv);
    /* RUN_CORE, or nothing to re-exec for: run the probe as is */
    if (mode != RUN_EXEC_CORE)
        execv("/proc/self/exe", landing_argv);
    _exit(127);
}

/* run_landing forks, runs the probe in a fresh process and reads its report. */
static int run_landing(run_mode mode, const char *core, landing_out *o)
{
    char out[64];
    snprintf(out, sizeof(out), "/tmp/moe_blas_pick_%d.txt", (int)getpid());
    unlink(out);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0)
        child_main(mode, core, out);
    int st = 0;
    cr_assert(waitpid(pid, &st, 0) == pid);
    memset(o, 0, sizeof(*o));
    FILE *f = fopen(out, "r");
    if (!f)
        return -1;
    int n = fscanf(f, "core %63s\nerr %lf\ndesc %255[^\n]", o->core, &o->err, o->desc);
    fclose(f);
    unlink(out);
    return n == 3 && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

static int cpu_rank(void)
{
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512cd");
    int avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const char *best = blas_pick_core_for(avx512, avx2_fma, __builtin_cpu_supports("avx"));
    return best ? blas_pick_core_rank(best) : 0;
}

Test(blas_pick, every_runnable_core_matches_reference, .timeout = 120)
{
    /* NULL: the library's own choice */
    const char *cores[] = {NULL, "Prescott", "Sandybridge", "Haswell", "SkylakeX"};
    int have = cpu_rank();
    for (size_t i = 0; i < sizeof(cores) / sizeof(cores[0]); i++) {
        if (cores[i] && blas_pick_core_rank(cores[i]) > have)
            continue;
        landing_out o;
        cr_assert_eq(run_landing(RUN_CORE, cores[i], &o), 0, "probe under %s failed",
                     cores[i] ? cores[i] : "the library's core");
        if (cores[i])
            cr_expect(strcasecmp(o.core, cores[i]) == 0, "asked %s, ran %s", cores[i], o.core);
        cr_expect(o.err <= 1e-5, "core %s: rel err %.3g", o.core, o.err);
    }
}

Test(blas_pick, exec_core_lands_on_it, .timeout = 60)
{
    if (cpu_rank() < 2)
        cr_skip_test("no AVX2 and FMA on this CPU");
    landing_out o;
    cr_assert_eq(run_landing(RUN_EXEC_CORE, "Haswell", &o), 0);
    cr_expect_str_eq(o.core, "Haswell");
    cr_expect(strstr(o.desc, "core Haswell (chosen from cpu features; library said Prescott)"),
              "%s", o.desc);
    cr_expect(o.err <= 1e-5);
}

Test(blas_pick, reexec_keeps_the_users_core, .timeout = 60)
{
    /* RUN_CORE sets OPENBLAS_CORETYPE, then the probe's process would be the
     * one to re-exec: emulate a worker started with the variable set */
    landing_out o;
    cr_assert_eq(run_landing(RUN_CORE, "Prescott", &o), 0);
    cr_expect_str_eq(o.core, "Prescott");
    cr_expect(strstr(o.desc, "(OPENBLAS_CORETYPE=Prescott from the environment)"), "%s", o.desc);
    cr_expect_null(blas_pick_decide("Prescott", NULL, openblas_get_config(), "Prescott", 1, 1, 1));
}

Test(blas_pick, reexec_ends_on_a_fast_core, .timeout = 60)
{
    const char *env = getenv("OPENBLAS_CORETYPE");
    if (env && *env)
        cr_skip_test("OPENBLAS_CORETYPE=%s is set for this run", env);
    landing_out o;
    cr_assert_eq(run_landing(RUN_REEXEC, NULL, &o), 0);
    int got = blas_pick_core_rank(o.core), lib = blas_pick_core_rank(openblas_get_corename());
    /* either the library's own core was kept, or a better one was chosen */
    if (strcasecmp(o.core, openblas_get_corename()) == 0)
        cr_expect(strstr(o.desc, "(library's choice)"), "%s", o.desc);
    else
        cr_expect(got > lib && strstr(o.desc, "chosen from cpu features"), "%s", o.desc);
    /* an AVX2 CPU ends on AVX2-class kernels or better, whatever the library said */
    if (cpu_rank() >= 2 && lib >= 0)
        cr_expect(got >= 2, "ended on %s: %s", o.core, o.desc);
    cr_expect(o.err <= 1e-5);
}
