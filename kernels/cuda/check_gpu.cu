/*
 * check_gpu.cu - every CUDA kernel of the layer against the CPU reference
 * (kernels/kern.h) on fresh random inputs, over a sweep of shapes; the
 * workspace and host outputs are poisoned (NaN) before each run. Prints one
 * pass/fail table; exits 1 on any failure.
 *
 *   bin/check-gpu            full sweep (T up to 16384, E up to 256, K 1/2/8)
 *   bin/check-gpu --small    small sweep, for compute-sanitizer
 *
 * Each stage is checked on the GPU's own upstream values (the CPU top-k runs
 * on the GPU logits, the CPU experts on the GPU routing), so that a near-tie
 * in the router cannot flip an expert choice between the two sides.
 */
#include <cblas.h>
#include <functional>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <thread>
#include <vector>

#include "kcu_internal.cuh"

/* The reference's OpenBLAS paths are not used here, and the GPU machine has
 * no OpenBLAS: this definition satisfies the linker for router.o. */
extern "C" void cblas_sgemm(const enum CBLAS_ORDER, const enum CBLAS_TRANSPOSE,
                            const enum CBLAS_TRANSPOSE, const blasint, const blasint, const blasint,
                            const float, const float *, const blasint, const float *, const blasint,
                            const float, float *, const blasint)
{
    fprintf(stderr, "check-gpu: cblas_sgemm is not available\n");
    abort();
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)
#define CKM(call)                                                                                  \
    do {                                                                                           \
        moe_err r_ = (call);                                                                       \
        if (r_ != MOE_OK) {                                                                        \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, moe_strerror(r_));       \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

struct tcase {
    int T, H, F, E, K;
    kern_act act;
    int renorm, skew;
};

static const double TOL = 1e-2;

/* ||a-b|| / ||b||; NaN or Inf anywhere in a gives +inf */
static double relerr(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]))
            return INFINITY;
        const double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    if (den == 0)
        return sqrt(num);
    return sqrt(num / den);
}

static void parallel_for(int n, const std::function<void(int)> &fn)
{
    int nt = (int)std::thread::hardware_concurrency();
    if (nt < 1)
        nt = 1;
    if (nt > 32)
        nt = 32;
    std::vector<std::thread> th;
    for (int w = 0; w < nt; w++)
        th.emplace_back([&, w] {
            for (int i = w; i < n; i += nt)
                fn(i);
        });
    for (auto &t : th)
        t.join();
}

template <typename T> static std::vector<T> dl(const T *d, size_t n)
{
    std::vector<T> h(n);
    CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

struct result {
    double logits, probs, tw, y, dx, dwr, dw1, dw3, dw2, dw, aux, z;
    int idx_ok, layout_ok, determ_ok;
};

static int run_case(const tcase &c, uint64_t seed, result *r)
{
    const int T = c.T, H = c.H, F = c.F, E = c.E, K = c.K, S = T * K;
    const int swiglu = c.act == KERN_ACT_SWIGLU;
    std::vector<float> wr((size_t)E * H), w1((size_t)E * F * H), w3((size_t)E * F * H),
        w2((size_t)E * H * F), x((size_t)T * H), dy((size_t)T * H);
    for (int e = 0; e < E; e++) {
        kern_init_weight(seed, 0, e, KERN_W1, F, H, w1.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W3, F, H, w3.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W2, H, F, w2.data() + (size_t)e * H * F);
    }
    kern_init_weight(seed, 0, 0, KERN_W_ROUTER, E, H, wr.data());
    kern_fill_uniform(seed, 1, -1.f, 1.f, x.data(), x.size());
    kern_fill_uniform(seed, 2, -1.f, 1.f, dy.data(), dy.size());
    if (c.skew) { /* x mean 0.5; experts 0 and 1 get a large positive logit offset */
        for (auto &v : x)
            v += 0.5f;
        for (int h = 0; h < H; h++) {
            wr[h] += 16.f / H;
            if (E > 1)
                wr[H + h] += 12.f / H;
        }
    }
    kern_bf16_round_n(wr.data(), wr.size());
    kern_bf16_round_n(w1.data(), w1.size());
    kern_bf16_round_n(w3.data(), w3.size());
    kern_bf16_round_n(w2.data(), w2.size());
    kern_bf16_round_n(x.data(), x.size());
    kern_bf16_round_n(dy.data(), dy.size());

    kcu_config cfg = {H, F, E, K, c.act, c.renorm, T, 1};
    kcu_layer *l;
    CKM(kcu_layer_create(&cfg, &l));
    CKM(kcu_layer_upload(l, wr.data(), w1.data(), swiglu ? w3.data() : NULL, w2.data()));

    /* ---- forward on the GPU, poisoned workspace and output ---- */
    std::vector<float> y((size_t)T * H, NAN), y2((size_t)T * H, NAN);
    CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
    CKM(kcu_forward(l, T, x.data(), MOE_F32, y2.data(), MOE_F32, 1, NULL));
    CK(cudaDeviceSynchronize());
    CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
    CKM(kcu_forward(l, T, x.data(), MOE_F32, y.data(), MOE_F32, 1, NULL));
    CK(cudaDeviceSynchronize());
    r->determ_ok = memcmp(y.data(), y2.data(), y.size() * 4) == 0;
    std::vector<int32_t> counts(E);
    float aux_g, z_g;
    CKM(kcu_forward_stats(l, counts.data(), &aux_g, &z_g, NULL));

    /* router logits */
    std::vector<float> lg_pad = dl(l->logits, (size_t)T * l->Ep), lg((size_t)T * E),
                       lref((size_t)T * E);
    for (int t = 0; t < T; t++)
        memcpy(&lg[(size_t)t * E], &lg_pad[(size_t)t * l->Ep], E * 4);
    kern_router_logits_cpu(x.data(), wr.data(), T, H, E, lref.data());
    r->logits = relerr(lg.data(), lref.data(), lg.size());

    /* softmax/top-k on the GPU logits */
    std::vector<float> probs_g = dl(l->probs, (size_t)T * E), probs_r((size_t)T * E);
    std::vector<int32_t> idx_g = dl(l->topk_idx, S), idx_r(S);
    std::vector<float> tw_g = dl(l->topk_w, S), tw_r(S);
    kern_softmax_topk_cpu(lg.data(), T, E, K, c.renorm, probs_r.data(), idx_r.data(), tw_r.data());
    r->probs = relerr(probs_g.data(), probs_r.data(), probs_g.size());
    r->tw = relerr(tw_g.data(), tw_r.data(), S);
    r->idx_ok = idx_g == idx_r;

    /* layout on the GPU routing */
    std::vector<int32_t> cnt_r(E), off_r(E + 1), perm_r(S);
    kern_layout_cpu(idx_g.data(), T, K, E, cnt_r.data(), off_r.data(), perm_r.data(), NULL);
    std::vector<int32_t> off_g = dl(l->offs, E + 1), perm_g = dl(l->perm, S);
    r->layout_ok = cnt_r == counts && off_r == off_g && perm_r == perm_g;
    if (off_r[E] != S)
        r->layout_ok = 0;
    {
        const float aux_r = kern_aux_loss_cpu(probs_g.data(), counts.data(), T, E, K);
        const float z_r = kern_z_loss_cpu(lg.data(), T, E);
        r->aux = fabs(aux_g - aux_r) / fmax(fabs(aux_r), 1e-6);
        r->z = fabs(z_g - z_r) / fmax(fabs(z_r), 1e-6);
    }

    /* experts on the CPU with the GPU routing */
    const int N1 = swiglu ? 2 * F : F;
    (void)N1;
    std::vector<float> ye((size_t)S * H), a_s((size_t)S * F), b_s((size_t)S * F);
    parallel_for(E, [&](int e) {
        const int o = off_r[e], n = cnt_r[e];
        if (n == 0)
            return;
        std::vector<float> xe((size_t)n * H), a((size_t)n * F), b((size_t)n * F), yo((size_t)n * H);
        for (int i = 0; i < n; i++)
            memcpy(&xe[(size_t)i * H], &x[(size_t)(perm_r[o + i] / K) * H], H * 4);
        kern_expert_ffn_cpu(xe.data(), n, H, F, &w1[(size_t)e * F * H], &w3[(size_t)e * F * H],
                            &w2[(size_t)e * H * F], c.act, 1, a.data(), b.data(), yo.data());
        for (int i = 0; i < n; i++) {
            const size_t s = perm_r[o + i];
            memcpy(&ye[s * H], &yo[(size_t)i * H], H * 4);
            memcpy(&a_s[s * F], &a[(size_t)i * F], F * 4);
            memcpy(&b_s[s * F], &b[(size_t)i * F], F * 4);
        }
    });
    std::vector<float> yref((size_t)T * H);
    kern_combine_cpu(ye.data(), tw_g.data(), NULL, T, K, H, 1, yref.data());
    r->y = relerr(y.data(), yref.data(), y.size());

    /* ---- backward ---- */
    const float aux_c = 0.01f, z_c = 0.001f;
    std::vector<float> dx((size_t)T * H, NAN);
    CKM(kcu_layer_zero_grads(l, NULL));
    CKM(kcu_backward(l, dy.data(), MOE_F32, dx.data(), MOE_F32, aux_c, z_c, NULL, 0, NULL));
    CK(cudaDeviceSynchronize());
    std::vector<float> g_wr((size_t)E * H), g_w1((size_t)E * F * H), g_w3((size_t)E * F * H),
        g_w2((size_t)E * H * F);
    CKM(kcu_layer_download_grads(l, g_wr.data(), g_w1.data(), swiglu ? g_w3.data() : NULL,
                                 g_w2.data()));
    std::vector<float> dw_g = dl(l->dw, S);

    std::vector<float> dye((size_t)S * H), dw_r(S), dxs((size_t)S * H);
    kern_combine_backward_cpu(dy.data(), ye.data(), tw_g.data(), NULL, T, K, H, dye.data(),
                              dw_r.data());
    std::vector<float> r_w1((size_t)E * F * H, 0.f), r_w3((size_t)E * F * H, 0.f),
        r_w2((size_t)E * H * F, 0.f), r_wr((size_t)E * H, 0.f), dxr((size_t)T * H, 0.f);
    parallel_for(E, [&](int e) {
        const int o = off_r[e], n = cnt_r[e];
        if (n == 0)
            return;
        std::vector<float> xe((size_t)n * H), a((size_t)n * F), b((size_t)n * F), de((size_t)n * H),
            dxe((size_t)n * H);
        for (int i = 0; i < n; i++) {
            const size_t s = perm_r[o + i];
            memcpy(&xe[(size_t)i * H], &x[(s / K) * H], H * 4);
            memcpy(&a[(size_t)i * F], &a_s[s * F], F * 4);
            memcpy(&b[(size_t)i * F], &b_s[s * F], F * 4);
            memcpy(&de[(size_t)i * H], &dye[s * H], H * 4);
        }
        kern_expert_ffn_backward_cpu(
            xe.data(), a.data(), b.data(), de.data(), n, H, F, &w1[(size_t)e * F * H],
            &w3[(size_t)e * F * H], &w2[(size_t)e * H * F], c.act, dxe.data(),
            &r_w1[(size_t)e * F * H], &r_w3[(size_t)e * F * H], &r_w2[(size_t)e * H * F]);
        for (int i = 0; i < n; i++)
            memcpy(&dxs[(size_t)perm_r[o + i] * H], &dxe[(size_t)i * H], H * 4);
    });
    for (int t = 0; t < T; t++)
        for (int j = 0; j < K; j++)
            for (int h = 0; h < H; h++)
                dxr[(size_t)t * H + h] += dxs[((size_t)t * K + j) * H + h];
    kern_router_backward_cpu(x.data(), wr.data(), lg.data(), probs_g.data(), idx_g.data(),
                             dw_r.data(), T, H, E, K, c.renorm, counts.data(), T, aux_c, z_c,
                             r_wr.data(), dxr.data());
    r->dx = relerr(dx.data(), dxr.data(), dx.size());
    r->dwr = relerr(g_wr.data(), r_wr.data(), r_wr.size());
    r->dw1 = relerr(g_w1.data(), r_w1.data(), r_w1.size());
    r->dw3 = swiglu ? relerr(g_w3.data(), r_w3.data(), r_w3.size()) : 0.0;
    r->dw2 = relerr(g_w2.data(), r_w2.data(), r_w2.size());
    r->dw = relerr(dw_g.data(), dw_r.data(), S);
    kcu_layer_destroy(l);

    const double v[] = {r->logits, r->probs, r->tw,  r->y,  r->dx,  r->dwr,
                        r->dw1,    r->dw3,   r->dw2, r->dw, r->aux, r->z};
    int ok = r->idx_ok && r->layout_ok && r->determ_ok;
    for (double d : v)
        ok = ok && d < TOL; /* NaN compares false */
    return ok;
}

int main(int argc, char **argv)
{
    int small = 0;
    uint64_t seed = 0x5eed;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small"))
            small = 1;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 0);
        else {
            fprintf(stderr, "usage: %s [--small] [--seed N]\n", argv[0]);
            return 2;
        }
    }
    const kern_act SW = KERN_ACT_SWIGLU, GE = KERN_ACT_GELU;
    std::vector<tcase> cases;
    if (small) {
        cases = {{1, 128, 128, 8, 2, SW, 1, 0},
                 {7, 128, 256, 60, 2, GE, 0, 0},
                 {130, 128, 128, 8, 8, SW, 1, 1},
                 {40, 256, 128, 256, 8, SW, 0, 0}};
    } else {
        cases = {{1, 256, 256, 8, 2, SW, 1, 0},       {1, 256, 256, 128, 8, SW, 1, 0},
                 {7, 256, 384, 60, 2, SW, 0, 0},      {7, 256, 256, 256, 8, GE, 1, 0},
                 {300, 256, 256, 128, 8, SW, 1, 0},   {4096, 256, 256, 8, 1, SW, 0, 0},
                 {4096, 256, 256, 60, 2, GE, 0, 0},   {4096, 256, 256, 256, 8, SW, 1, 0},
                 {4096, 256, 256, 60, 2, SW, 1, 1},   {512, 512, 512, 8, 2, GE, 1, 0},
                 {16384, 128, 128, 128, 8, SW, 1, 0}, {16384, 128, 256, 8, 2, SW, 0, 1},
                 {16384, 128, 128, 256, 1, GE, 0, 1}};
    }
    printf("%-5s %-6s %-4s %-4s %-4s %-2s %-3s %-2s %-2s | %-8s %-8s %-8s %-8s %-8s %-8s %-8s "
           "%-8s %-8s %-8s %-8s %-8s | idx lay det | %s\n",
           "T", "H", "F", "E", "K", "ac", "rn", "sk", "", "logits", "probs", "topk_w", "y", "dx",
           "dwr", "dw1", "dw3", "dw2", "dgate", "aux", "z", "result");
    int fails = 0;
    for (size_t i = 0; i < cases.size(); i++) {
        const tcase &c = cases[i];
        result r;
        memset(&r, 0, sizeof(r));
        const int ok = run_case(c, seed + 977 * i, &r);
        fails += !ok;
        printf("%-5d %-6d %-4d %-4d %-4d %-2s %-3d %-2d %-2s | %-8.1e %-8.1e %-8.1e %-8.1e %-8.1e "
               "%-8.1e %-8.1e %-8.1e %-8.1e %-8.1e %-8.1e %-8.1e | %-3s %-3s %-3s | %s\n",
               c.T, c.H, c.F, c.E, c.K, c.act == SW ? "sw" : "ge", c.renorm, c.skew, "", r.logits,
               r.probs, r.tw, r.y, r.dx, r.dwr, r.dw1, r.dw3, r.dw2, r.dw, r.aux, r.z,
               r.idx_ok ? "ok" : "BAD", r.layout_ok ? "ok" : "BAD", r.determ_ok ? "ok" : "BAD",
               ok ? "PASS" : "FAIL");
        fflush(stdout);
    }
    printf("check-gpu: %zu cases, %d failed (bf16 tolerance %.0e) -> %s\n", cases.size(), fails,
           TOL, fails ? "FAIL" : "PASS");
    return fails ? 1 : 0;
}
