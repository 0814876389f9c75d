/*
 * service_bench.c - checks and times a running cluster through libmoe.
 *
 *   service_bench --url URL [--d-model H --d-ff F --experts E --top-k K]
 *                 [--dtype bf16|f32] [--tokens T,T,...] [--iters N] [--train]
 *
 * Creates a model "sb" (seed 1), then for each T: forward (and with --train
 * backward) through the service, compared with the single-process CPU
 * reference (kern_moe_forward_ref / kern_moe_backward_ref) on the same
 * seeded weights: relative error ||out - ref|| / ||ref||, bound 1e-2 for bf16
 * and 1e-4 for f32. Then the time per call (median of --iters) and tokens/s.
 * Prints one line per case and exits non-zero if any check fails. Not a
 * test: it runs against whatever cluster you point it at (GPU workers too).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kern.h"
#include "moe.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double rel_err(const float *a, const float *b, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] != a[i])
            return INFINITY;
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r += (double)b[i] * b[i];
    }
    return sqrt(d / (r > 0 ? r : 1e-30));
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void to_wire(const float *x, size_t n, moe_dtype dt, void *out)
{
    if (dt == MOE_F32) {
        memcpy(out, x, n * 4);
        return;
    }
    uint16_t *h = out;
    for (size_t i = 0; i < n; i++)
        h[i] = kern_f32_to_bf16(x[i]);
}

static void from_wire(const void *in, size_t n, moe_dtype dt, float *x)
{
    if (dt == MOE_F32) {
        memcpy(x, in, n * 4);
        return;
    }
    const uint16_t *h = in;
    for (size_t i = 0; i < n; i++)
        x[i] = kern_bf16_to_f32(h[i]);
}

int main(int argc, char **argv)
{
    const char *url = getenv("MOE_URL") ? getenv("MOE_URL") : "tcp://127.0.0.1:7000";
    const char *dts = "bf16", *tok = "1,64,1024";
    const char *path = NULL; /* data path: auto | socket | shm | coordinator */
    int H = 1024, F = 2048, E = 8, K = 2, iters = 10, train = 0, ref = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--url"))
            url = v, i++;
        else if (!strcmp(a, "--d-model"))
            H = atoi(v), i++;
        else if (!strcmp(a, "--d-ff"))
            F = atoi(v), i++;
        else if (!strcmp(a, "--experts"))
            E = atoi(v), i++;
        else if (!strcmp(a, "--top-k"))
            K = atoi(v), i++;
        else if (!strcmp(a, "--dtype"))
            dts = v, i++;
        else if (!strcmp(a, "--tokens"))
            tok = v, i++;
        else if (!strcmp(a, "--iters"))
            iters = atoi(v), i++;
        else if (!strcmp(a, "--train"))
            train = 1;
        else if (!strcmp(a, "--no-ref"))
            ref = 0;
        else if (!strcmp(a, "--path"))
            path = v, i++;
        else {
            fprintf(stderr, "service_bench: unknown option %s\n", a);
            return 2;
        }
    }
    moe_dtype dt = strcmp(dts, "f32") == 0 ? MOE_F32 : MOE_BF16;
    double bound = dt == MOE_F32 ? 1e-4 : 1e-2;
    moe_client_opts co = {600000, 0, NULL, path};
    moe_client *c;
    if (moe_client_open(url, &co, &c) != MOE_OK) {
        fprintf(stderr, "service_bench: %s\n", moe_last_error());
        return 1;
    }
    moe_model_config cfg = {"sb", 1, H, F, E, K, "swiglu", 1, 0, dt, 1, 0.01, 0.001};
    if (moe_model_create(c, &cfg) != MOE_OK) {
        fprintf(stderr, "service_bench: model.create: %s\n", moe_last_error());
        return 1;
    }
    /* the reference weights, as the workers make them */
    size_t fh = (size_t)F * H;
    float *wr = malloc((size_t)E * H * 4), *w1 = malloc(E * fh * 4), *w3 = malloc(E * fh * 4),
          *w2 = malloc(E * fh * 4);
    if (!wr || !w1 || !w3 || !w2)
        return 1;
    kern_init_weight(1, 0, 0, KERN_W_ROUTER, E, H, wr);
    for (int e = 0; e < E; e++) {
        kern_init_weight(1, 0, e, KERN_W1, F, H, w1 + e * fh);
        kern_init_weight(1, 0, e, KERN_W3, F, H, w3 + e * fh);
        kern_init_weight(1, 0, e, KERN_W2, H, F, w2 + e * fh);
    }
    if (dt == MOE_BF16) {
        kern_bf16_round_n(wr, (size_t)E * H);
        kern_bf16_round_n(w1, E * fh);
        kern_bf16_round_n(w3, E * fh);
        kern_bf16_round_n(w2, E * fh);
    }
    kern_layer_weights lw = {wr, w1, w3, w2};
    int failures = 0;
    printf("# service_bench %s: d_model %d d_ff %d experts %d top-%d %s\n", url, H, F, E, K,
           moe_dtype_name(dt));
    for (const char *p = tok; *p;) {
        long T = strtol(p, (char **)&p, 10);
        if (*p == ',')
            p++;
        size_t n = (size_t)T * H, es = moe_dtype_size(dt);
        float *x = malloc(n * 4 + 4), *y = malloc(n * 4 + 4), *yr = malloc(n * 4 + 4);
        float *dy = malloc(n * 4 + 4), *dx = malloc(n * 4 + 4), *dxr = malloc(n * 4 + 4);
        void *xw = malloc(n * es + 4), *yw = malloc(n * es + 4), *dyw = malloc(n * es + 4),
             *dxw = malloc(n * es + 4);
        kern_fill_uniform(7, (uint64_t)T, -1, 1, x, n);
        kern_fill_uniform(8, (uint64_t)T, -1, 1, dy, n);
        if (dt == MOE_BF16) {
            kern_bf16_round_n(x, n);
            kern_bf16_round_n(dy, n);
        }
        to_wire(x, n, dt, xw);
        to_wire(dy, n, dt, dyw);
        moe_fwd_info info;
        moe_err e = train ? moe_forward_train(c, "sb", 0, dt, xw, T, H, yw, &info)
                          : moe_forward(c, "sb", 0, dt, xw, T, H, yw, &info);
        if (e == MOE_OK && train)
            e = moe_backward(c, info.handle, dt, dyw, T, H, dxw);
        if (e != MOE_OK) {
            printf("T=%-6ld FAIL %s\n", T, moe_last_error());
            failures++;
            continue;
        }
        moe_fwd_info_free(&info);
        double ey = 0, edx = 0;
        if (ref) {
            kern_moe_shape sh = {(int)T, H, F, E, K, KERN_ACT_SWIGLU, 1, 0, dt == MOE_BF16};
            kern_moe_forward_ref(&sh, &lw, x, yr, NULL);
            from_wire(yw, n, dt, y);
            ey = rel_err(y, yr, n);
            if (train) {
                float *g1 = malloc(E * fh * 4), *g3 = malloc(E * fh * 4), *g2 = malloc(E * fh * 4),
                      *gr = malloc((size_t)E * H * 4);
                kern_moe_backward_ref(&sh, &lw, x, dy, 0.01f, 0.001f, dxr, gr, g1, g3, g2);
                from_wire(dxw, n, dt, dx);
                edx = rel_err(dx, dxr, n);
                free(g1), free(g3), free(g2), free(gr);
            }
        }
        /* timing */
        double *lat = malloc((size_t)iters * sizeof(double));
        for (int it = 0; it < iters; it++) {
            double t0 = now_s();
            if (train) {
                e = moe_forward_train(c, "sb", 0, dt, xw, T, H, yw, &info);
                if (e == MOE_OK)
                    e = moe_backward(c, info.handle, dt, dyw, T, H, dxw);
                moe_fwd_info_free(&info);
            } else {
                e = moe_forward(c, "sb", 0, dt, xw, T, H, yw, NULL);
            }
            lat[it] = now_s() - t0;
            if (e != MOE_OK)
                failures++;
        }
        qsort(lat, (size_t)iters, sizeof(double), cmp_d);
        double med = lat[iters / 2];
        int ok = !ref || (ey < bound && (!train || edx < bound));
        failures += !ok;
        printf("T=%-6ld %s  y err %.2e%s  %s %.3f ms  %.0f tokens/s  (p50 of %d)\n", T,
               ok ? "PASS" : "FAIL", ey, train ? "" : "", train ? "fwd+bwd" : "fwd", med * 1e3,
               T / med, iters);
        if (train)
            printf("         dx err %.2e\n", edx);
        free(lat);
        free(x), free(y), free(yr), free(dy), free(dx), free(dxr);
        free(xw), free(yw), free(dyw), free(dxw);
    }
    moe_client_close(c);
    printf("%d passed, %d failed\n", failures ? 0 : 1, failures ? 1 : 0);
    return failures ? 1 : 0;
}
