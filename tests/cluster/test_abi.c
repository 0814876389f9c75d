/*
 * test_abi.c - libmoe's public surface: lib/libmoe.so exports exactly the
 * functions of base/moe.h (nothing internal), moe_version agrees with
 * the header, the public bf16 conversions are the kernels' bit for bit,
 * and the clients' defaults: fields left unset (MOE_UNSET, NULL) are not
 * sent, so the service's defaults apply (MOE_MODEL_CONFIG_DEFAULT,
 * MOE_ADAMW_DEFAULT).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cluster.h"
#include "kernels/kern.h"
#include "common/rng.h"

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "%s not found (run from the repository root)", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    cr_assert(s && fread(s, 1, (size_t)n, f) == (size_t)n);
    s[n] = 0;
    fclose(f);
    return s;
}

Test(abi, libmoe_exports_only_its_public_functions)
{
    char cmd[512], name[256];
    snprintf(cmd, sizeof(cmd), "nm -D --defined-only %s/../lib/libmoe.so 2>&1", cluster_bin_dir());
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    char *hdr = read_file("base/moe.h");
    int n = 0;
    char line[512];
    while (fgets(line, sizeof(line), p)) {
        char type;
        unsigned long long addr;
        if (sscanf(line, "%llx %c %255s", &addr, &type, name) != 3)
            continue;
        if (type != 'T' && type != 'D' && type != 'B' && type != 'R')
            continue; /* not a function or object of ours (e.g. version nodes) */
        n++;
        cr_expect(strncmp(name, "moe_", 4) == 0 && strncmp(name, "moe__", 5) != 0,
                  "libmoe.so exports '%s', which is not part of its API", name);
        char decl[300], pdecl[300];
        snprintf(decl, sizeof(decl), " %s(", name);
        snprintf(pdecl, sizeof(pdecl), "*%s(", name);
        cr_expect(strstr(hdr, decl) || strstr(hdr, pdecl),
                  "exported '%s' is not declared in base/moe.h", name);
    }
    pclose(p);
    cr_assert_gt(n, 20, "nm listed %d symbols (is binutils installed?)", n);
    free(hdr);
}

/* libmoe loads in any process: no GPU library among what it needs (a linked
 * libnccl.so.2 bound PyTorch's libraries, imported after moe, to the wrong
 * NCCL); its NCCL path finds the CUDA runtime and NCCL at run time */
Test(abi, libmoe_needs_no_gpu_library)
{
    char cmd[512], line[512];
    snprintf(cmd, sizeof(cmd), "readelf -d %s/../lib/libmoe.so 2>&1", cluster_bin_dir());
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    int needed = 0;
    while (fgets(line, sizeof(line), p)) {
        if (!strstr(line, "(NEEDED)"))
            continue;
        needed++;
        cr_expect(!strstr(line, "nccl") && !strstr(line, "cuda") && !strstr(line, "cublas"),
                  "libmoe.so needs a GPU library: %s", line);
    }
    pclose(p);
    cr_assert_gt(needed, 0, "readelf listed no NEEDED entry (is binutils installed?)");
}

Test(abi, version_and_bf16)
{
    cr_assert_str_eq(moe_version(), MOE_VERSION_STRING);
    char v[32];
    snprintf(v, sizeof(v), "%d.%d.%d", MOE_VERSION_MAJOR, MOE_VERSION_MINOR, MOE_VERSION_PATCH);
    cr_assert_str_eq(v, MOE_VERSION_STRING);
    enum { N = 4096 };
    static float x[N], back[N];
    static uint16_t h[N];
    rng_fill_uniform(5, 5, -1e4, 1e4, x, N);
    x[0] = NAN, x[1] = INFINITY, x[2] = -INFINITY, x[3] = 1e-40f, x[4] = -0.0f, x[5] = 3.4e38f;
    moe_bf16_from_f32(x, h, N);
    moe_f32_from_bf16(h, back, N);
    for (int i = 0; i < N; i++) {
        uint16_t k = kern_f32_to_bf16(x[i]);
        if (x[i] != x[i]) {
            cr_assert(back[i] != back[i], "NaN must stay NaN");
            continue;
        }
        cr_assert_eq(h[i], k, "element %d (%g): 0x%04x, the kernels 0x%04x", i, x[i], h[i], k);
        float kb = kern_bf16_to_f32(k);
        cr_assert(memcmp(&back[i], &kb, 4) == 0, "element %d back", i);
    }
}

/* model.info's config value of key */
static double info_num(cluster *cl, const char *model, const char *key)
{
    mp_writer w;
    mp_writer_init(&w);
    mp_write_map(&w, 1);
    mp_write_cstr(&w, "model");
    mp_write_cstr(&w, model);
    moe_reply rep;
    cr_assert_eq(moe_call(cl->cli, "model.info", w.buf, w.len, &rep), MOE_OK, "%s", rep.message);
    mp_writer_fini(&w);
    mp_reader r = mp_reply_reader(&rep);
    double v = -1;
    cr_assert(mp_map_find(&r, "config") == 0 && mp_map_find(&r, key) == 0 &&
                  mp_read_f64(&r, &v, NULL) == MOE_OK,
              "model.info: no config.%s", key);
    moe_reply_free(&rep);
    return v;
}

Test(abi, unset_fields_take_the_service_defaults, .timeout = 90, .fini = cluster_fini_all)
{
    cluster_opts o = {.workers = 1};
    cluster *cl = cluster_start(&o);
    cr_assert(cl, "cluster_start: %s", cluster_error());
    moe_model_config d = MOE_MODEL_CONFIG_DEFAULT;
    d.name = "d";
    d.layers = 1, d.d_model = 16, d.d_ff = 16, d.n_experts = 4, d.top_k = 2;
    cr_assert_eq(moe_model_create(cl->cli, &d), MOE_OK, "%s", moe_last_error());
    cr_assert_float_eq(info_num(cl, "d", "aux_loss_coef"), 0.01, 1e-12,
                       "an unset aux_loss_coef takes the protocol's default");
    moe_model_config z = {0};
    z.name = "z";
    z.layers = 1, z.d_model = 16, z.d_ff = 16, z.n_experts = 4, z.top_k = 2;
    cr_assert_eq(moe_model_create(cl->cli, &z), MOE_OK, "%s", moe_last_error());
    cr_assert_float_eq(info_num(cl, "z", "aux_loss_coef"), 0, 1e-12, "a zero is sent as zero");
    /* a training step with every hyperparameter unset */
    float x[3 * 16], y[3 * 16], dx[3 * 16];
    rng_fill_uniform(9, 9, -1, 1, x, 3 * 16);
    moe_fwd_info info;
    cr_assert_eq(moe_forward_train(cl->cli, "d", 0, MOE_F32, x, 3, 16, y, &info), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(moe_backward(cl->cli, info.handle, MOE_F32, y, 3, 16, dx), MOE_OK, "%s",
                 moe_last_error());
    moe_fwd_info_free(&info);
    moe_adamw opt = MOE_ADAMW_DEFAULT;
    int64_t step = 0;
    cr_assert_eq(moe_optimizer_step(cl->cli, "d", &opt, &step, NULL), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(step, 1);
    /* a zeroed moe_adamw sends eps = 0, which the service refuses, naming it */
    moe_adamw zero = {0};
    cr_assert_eq(moe_optimizer_step(cl->cli, "d", &zero, &step, NULL), MOE_EINVAL);
    cr_assert(strstr(moe_last_error(), "eps"), "%s", moe_last_error());
    cr_assert_eq(cluster_stop(cl), 0, "%s", cluster_error());
}
