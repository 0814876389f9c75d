/*
 * check_gpu.cu - every CUDA kernel of the layer against the CPU reference
 * (kernels/kern.h) on fresh random inputs, over a sweep of shapes; the
 * workspace and host outputs are poisoned (NaN) before each run. Prints one
 * pass/fail table; exits 1 on any failure.
 *
 *   bin/check-gpu            full sweep (T up to 16384, E up to 256, K 1/2/8)
 *   bin/check-gpu --small    small sweep, for compute-sanitizer
 *   bin/check-gpu --gemm-only  only the grouped-GEMM checks: every mode and
 *                            epilogue on each kernel version (v1, v2, v4 with
 *                            and without TMA), one PASS/FAIL line each
 *   bin/check-gpu --families  only the routing-family checks (kcu_route_config,
 *                            shared experts) against kern_moe_forward_ref
 *   bin/check-gpu --pipelined  only kcu_forward_pipelined against kcu_forward
 *   bin/check-gpu --swapped  only v10's forms (the swapped GEMMs) against v4,
 *                            for compute-sanitizer over them alone
 *
 * Each stage is checked on the GPU's own upstream values (the CPU top-k runs
 * on the GPU logits, the CPU experts on the GPU routing), so that a near-tie
 * in the router cannot flip an expert choice between the two sides.
 */
#include <algorithm>
#include <cblas.h>
#include <functional>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <thread>
#include <vector>

#include "kernels/cuda/kcu_internal.cuh"
#include "kernels/cuda/kcu_tool.h"
#include "common/rng.h"

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
/* the same for the oracle's shared expert (kern_moe_forward_ref links
 * shared.o, whose BLAS path is not taken) and the thread count of par.o
 * (one thread: the CPU paths here run serially or under parallel_for) */
extern "C" void cblas_sgemv(const enum CBLAS_ORDER, const enum CBLAS_TRANSPOSE, const blasint,
                            const blasint, const float, const float *, const blasint, const float *,
                            const blasint, const float, float *, const blasint)
{
    fprintf(stderr, "check-gpu: cblas_sgemv is not available\n");
    abort();
}
extern "C" int openblas_get_num_threads(void)
{
    return 1;
}

struct tcase {
    int T, H, F, E, K;
    kern_act act;
    int renorm, skew;
    float cf; /* capacity factor, 0 = dropless */
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
    int idx_ok, layout_ok, determ_ok, accum_ok, modes_ok, g16_ok, infer_ok, ndrop;
};

/* bf16 gradient store (kcu_config.grad_bf16): the first backward's expert
 * gradients must be the fp32 ones rounded to bf16, and a second backward
 * (same forward, no zeroing) bf16(bf16(g) + g), bit for bit; the router
 * gradient stays fp32 (2 g) */
static int bf16_grads_same(const kcu_config &cfg0, const std::vector<float> &wr,
                           const std::vector<float> &w1, const std::vector<float> &w3,
                           const std::vector<float> &w2, const std::vector<float> &x,
                           const std::vector<float> &dy, const std::vector<float> &g_wr,
                           const std::vector<float> &g_w1, const std::vector<float> &g_w3,
                           const std::vector<float> &g_w2)
{
    const int swiglu = cfg0.act == KERN_ACT_SWIGLU;
    kcu_config cfg = cfg0;
    cfg.grad_bf16 = 1;
    kcu_layer *l;
    CKM(kcu_layer_create(&cfg, &l));
    CKM(kcu_layer_upload(l, wr.data(), w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    std::vector<float> y(x.size()), dx(x.size());
    int ok = 1;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 0)
            CKM(kcu_layer_zero_grads(l, NULL));
        CKM(kcu_forward(l, cfg.T_max, x.data(), MOE_F32, y.data(), MOE_F32, 1, NULL));
        CKM(kcu_backward(l, dy.data(), MOE_F32, dx.data(), MOE_F32, 0.01f, 0.001f, NULL, 0, NULL));
        std::vector<float> h_wr(g_wr.size()), h_w1(g_w1.size()), h_w3(g_w3.size()),
            h_w2(g_w2.size());
        CKM(kcu_layer_download_grads(l, h_wr.data(), h_w1.data(), swiglu ? h_w3.data() : NULL,
                                     h_w2.data()));
        auto expect = [&](const std::vector<float> &g) {
            std::vector<float> r = g;
            kern_bf16_round_n(r.data(), r.size());
            if (pass == 1) {
                for (size_t i = 0; i < r.size(); i++)
                    r[i] += g[i];
                kern_bf16_round_n(r.data(), r.size());
            }
            return r;
        };
        std::vector<float> wr2 = g_wr;
        for (auto &v : wr2)
            v *= (float)(pass + 1);
        ok = ok && h_wr == wr2 && h_w1 == expect(g_w1) && h_w2 == expect(g_w2) &&
             (!swiglu || h_w3 == expect(g_w3));
    }
    kcu_layer_destroy(l);
    if (!ok)
        fprintf(stderr, "check-gpu: bf16 gradients differ from the rounded fp32 ones\n");
    return ok;
}

/* the same forward + backward on a layer created in sorted mode `mode`
 * (kcu_sorted_mode), with device f32 inputs and outputs: y, dx and every
 * gradient must equal the reference run's bits */
static int same_in_mode(int mode, const kcu_config &cfg, const std::vector<float> &wr,
                        const std::vector<float> &w1, const std::vector<float> &w3,
                        const std::vector<float> &w2, const std::vector<float> &x,
                        const std::vector<float> &dy, const std::vector<float> &y,
                        const std::vector<float> &dx, const std::vector<float> &g_wr,
                        const std::vector<float> &g_w1, const std::vector<float> &g_w3,
                        const std::vector<float> &g_w2)
{
    const int swiglu = cfg.act == KERN_ACT_SWIGLU;
    kcu_sorted_override = mode;
    kcu_layer *l;
    CKM(kcu_layer_create(&cfg, &l));
    kcu_sorted_override = -1;
    int ok = l->sorted == mode;
    CKM(kcu_layer_upload(l, wr.data(), w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
    const size_t n = x.size();
    float *d;
    CK(cudaMalloc(&d, 4 * n * 4));
    float *dx_d = d, *dy_d = d + n, *x_d = d + 2 * n, *y_d = d + 3 * n;
    CK(cudaMemcpy(x_d, x.data(), n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dy_d, dy.data(), n * 4, cudaMemcpyHostToDevice));
    CKM(kcu_layer_zero_grads(l, NULL));
    CKM(kcu_forward(l, cfg.T_max, x_d, MOE_F32, y_d, MOE_F32, 1, NULL));
    CKM(kcu_backward(l, dy_d, MOE_F32, dx_d, MOE_F32, 0.01f, 0.001f, NULL, 0, NULL));
    CK(cudaDeviceSynchronize());
    std::vector<float> ym(n), dxm(n), h_wr(g_wr.size()), h_w1(g_w1.size()), h_w3(g_w3.size()),
        h_w2(g_w2.size());
    CK(cudaMemcpy(ym.data(), y_d, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dxm.data(), dx_d, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaFree(d));
    CKM(kcu_layer_download_grads(l, h_wr.data(), h_w1.data(), swiglu ? h_w3.data() : NULL,
                                 h_w2.data()));
    kcu_layer_destroy(l);
    ok = ok && ym == y && dxm == dx && h_wr == g_wr && h_w1 == g_w1 && h_w2 == g_w2 &&
         (!swiglu || h_w3 == g_w3);
    if (!ok)
        fprintf(stderr, "check-gpu: sorted mode %d differs from mode %d\n", mode,
                kcu_sorted_mode(&cfg));
    return ok;
}

/* the second backward (no zeroing, same forward) must give exactly 2x */
static int twice(const std::vector<float> &g1, const std::vector<float> &g2)
{
    for (size_t i = 0; i < g1.size(); i++)
        if (!(g2[i] == 2.f * g1[i]))
            return 0;
    return 1;
}

/* the GPU routing of layer l's last forward (c.T tokens): its logits against
 * x wr^T on the CPU, its probabilities, top-k weights and indices against
 * the CPU softmax/top-k of those logits (the errors and index match out);
 * the GPU values in g for the later checks */
struct route_gpu {
    std::vector<float> lg, probs, tw;          /* logits (T,E) unpadded, (T,E), (S) */
    std::vector<int32_t> idx, counts, dropped; /* (S), (E), (E) */
    float aux, z;
};
static void check_route(kcu_layer *l, const tcase &c, const std::vector<float> &x,
                        const std::vector<float> &wr, route_gpu &g, double &e_logits,
                        double &e_probs, double &e_tw, int &idx_ok)
{
    const int T = c.T, H = c.H, E = c.E, K = c.K, S = T * K;
    g.counts.resize(E);
    g.dropped.resize(E);
    CKM(kcu_forward_stats(l, g.counts.data(), g.dropped.data(), &g.aux, &g.z, NULL));
    const std::vector<float> lg_pad = dl(l->logits, (size_t)T * l->Ep);
    std::vector<float> lref((size_t)T * E), probs_r((size_t)T * E), tw_r(S);
    g.lg.resize((size_t)T * E);
    for (int t = 0; t < T; t++)
        memcpy(&g.lg[(size_t)t * E], &lg_pad[(size_t)t * l->Ep], E * 4);
    kern_router_logits_cpu(x.data(), wr.data(), T, H, E, lref.data());
    e_logits = relerr(g.lg.data(), lref.data(), g.lg.size());
    g.probs = dl(l->probs, (size_t)T * E);
    g.idx = dl(l->topk_idx, S);
    g.tw = dl(l->topk_w, S);
    std::vector<int32_t> idx_r(S);
    kern_softmax_topk_cpu(g.lg.data(), T, E, K, c.renorm, probs_r.data(), idx_r.data(),
                          tw_r.data());
    e_probs = relerr(g.probs.data(), probs_r.data(), g.probs.size());
    e_tw = relerr(g.tw.data(), tw_r.data(), S);
    idx_ok = g.idx == idx_r;
}

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
    rng_fill_uniform(seed, 1, -1.f, 1.f, x.data(), x.size());
    rng_fill_uniform(seed, 2, -1.f, 1.f, dy.data(), dy.size());
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

    kcu_config cfg = {H, F, E, K, c.act, c.renorm, T, 1, c.cf};
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
    route_gpu g;
    check_route(l, c, x, wr, g, r->logits, r->probs, r->tw, r->idx_ok);
    const std::vector<float> &lg = g.lg, &probs_g = g.probs, &tw_g = g.tw;
    const std::vector<int32_t> &idx_g = g.idx, &counts = g.counts, &dropped = g.dropped;
    const float aux_g = g.aux, z_g = g.z;

    /* layout and capacity on the GPU routing: kept rows of expert e are
     * perm_r[off_r[e] .. off_r[e] + kept[e]); the GPU compacts them */
    std::vector<int32_t> cnt_r(E), off_r(E + 1), perm_r(S), drop_r(E), kept(E);
    std::vector<uint8_t> keep(S);
    kern_layout_cpu(idx_g.data(), T, K, E, cnt_r.data(), off_r.data(), perm_r.data(), NULL);
    const int32_t cap = kern_capacity(c.cf, T, K, E);
    kern_apply_capacity_cpu(cnt_r.data(), off_r.data(), perm_r.data(), E, cap, keep.data(),
                            drop_r.data());
    std::vector<int32_t> off_g = dl(l->offs, E + 1), perm_g = dl(l->perm, S);
    r->layout_ok =
        cnt_r == counts && drop_r == dropped && off_r[E] == S && cap == kcu_capacity(c.cf, T, K, E);
    r->ndrop = 0;
    for (int e = 0, ko = 0; e < E; e++) {
        kept[e] = cnt_r[e] - drop_r[e];
        r->ndrop += drop_r[e];
        if (off_g[e] != ko)
            r->layout_ok = 0;
        for (int i = 0; i < kept[e] && r->layout_ok; i++)
            if (perm_g[ko + i] != perm_r[off_r[e] + i])
                r->layout_ok = 0;
        ko += kept[e];
        if (e == E - 1 && off_g[E] != ko)
            r->layout_ok = 0;
    }
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
        const int o = off_r[e], n = kept[e];
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
    kern_combine_cpu(ye.data(), tw_g.data(), keep.data(), T, K, H, 1, yref.data());
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
    kern_combine_backward_cpu(dy.data(), ye.data(), tw_g.data(), keep.data(), T, K, H, dye.data(),
                              dw_r.data());
    std::vector<float> r_w1((size_t)E * F * H, 0.f), r_w3((size_t)E * F * H, 0.f),
        r_w2((size_t)E * H * F, 0.f), r_wr((size_t)E * H, 0.f), dxr((size_t)T * H, 0.f);
    parallel_for(E, [&](int e) {
        const int o = off_r[e], n = kept[e];
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
    /* the other sorted-rows modes give the same bits (same products, same
     * order; only where the rows come from differs) */
    r->g16_ok = bf16_grads_same(cfg, wr, w1, w3, w2, x, dy, g_wr, g_w1, g_w3, g_w2);
    r->modes_ok = 1;
    for (int m = 0; m < 3; m++)
        if (m != l->sorted)
            r->modes_ok &=
                same_in_mode(m, cfg, wr, w1, w3, w2, x, dy, y, dx, g_wr, g_w1, g_w3, g_w2);

    /* same forward again, backward without zeroing: exactly twice the
     * gradients, and the same dx bit for bit */
    std::vector<float> dx2((size_t)T * H, NAN), h_wr((size_t)E * H), h_w1((size_t)E * F * H),
        h_w3((size_t)E * F * H), h_w2((size_t)E * H * F);
    CKM(kcu_forward(l, T, x.data(), MOE_F32, y2.data(), MOE_F32, 1, NULL));
    CKM(kcu_backward(l, dy.data(), MOE_F32, dx2.data(), MOE_F32, aux_c, z_c, NULL, 0, NULL));
    CK(cudaDeviceSynchronize());
    CKM(kcu_layer_download_grads(l, h_wr.data(), h_w1.data(), swiglu ? h_w3.data() : NULL,
                                 h_w2.data()));
    r->accum_ok = twice(g_wr, h_wr) && twice(g_w1, h_w1) && (!swiglu || twice(g_w3, h_w3)) &&
                  twice(g_w2, h_w2) && memcmp(dx.data(), dx2.data(), dx.size() * 4) == 0;
    /* an inference forward on the GEMM path with the router GEMM: sorted
     * rows on v7 where rows per expert are few, the tile list in pairs of
     * one expert where they average 192 or fewer (kcu_forward) - the same
     * products in the same order as the training forward: y's bits */
    r->infer_ok = 1;
    if (!kcu_layer_route_small(l, T, 0) && !kcu_decode_use(l, T, 0)) {
        std::vector<float> yi((size_t)T * H, NAN);
        CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
        CKM(kcu_forward(l, T, x.data(), MOE_F32, yi.data(), MOE_F32, 0, NULL));
        CK(cudaDeviceSynchronize());
        r->infer_ok = memcmp(yi.data(), y.data(), y.size() * 4) == 0;
    }
    kcu_layer_destroy(l);

    const double v[] = {r->logits, r->probs, r->tw,  r->y,  r->dx,  r->dwr,
                        r->dw1,    r->dw3,   r->dw2, r->dw, r->aux, r->z};
    int ok = r->idx_ok && r->layout_ok && r->determ_ok && r->accum_ok && r->modes_ok && r->g16_ok &&
             r->infer_ok;
    for (double d : v)
        ok = ok && d < TOL; /* NaN compares false */
    return ok;
}

/* ---- train-forward states (kcu_config.states, kcu_layer_set_state) ----
 * A pipeline schedule on a 2-state layer - forward A (state 0), forward B
 * (state 1), backward B (state 1), backward A (state 0) - against a 1-state
 * layer with the same weights running forward B, backward B, forward A,
 * backward A (the same gradient accumulation order: B stores, A adds). y
 * and dx of A and B and every gradient must be the same bits. cf_b > 0:
 * B runs with that capacity factor, A dropless (the capacity of each
 * forward is per state). sorted: kcu_sorted_mode forced for both layers
 * (-1: the default). Also: a second backward on state 1 is MOE_EPRECOND,
 * set_state out of range MOE_EINVAL, states > KCU_MAX_STATES refused. */
struct scase {
    int TA, TB, H, F, E, K;
    kern_act act;
    int sorted;
    float cf_b;
};

static int states_check(const scase &c, uint64_t seed)
{
    const int H = c.H, F = c.F, E = c.E, K = c.K, TA = c.TA, TB = c.TB;
    const int swiglu = c.act == KERN_ACT_SWIGLU;
    const int T_max = TA > TB ? TA : TB;
    std::vector<float> wr((size_t)E * H), w1((size_t)E * F * H), w3((size_t)E * F * H),
        w2((size_t)E * H * F), xa((size_t)TA * H), dya((size_t)TA * H), xb((size_t)TB * H),
        dyb((size_t)TB * H);
    for (int e = 0; e < E; e++) {
        kern_init_weight(seed, 0, e, KERN_W1, F, H, w1.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W3, F, H, w3.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W2, H, F, w2.data() + (size_t)e * H * F);
    }
    kern_init_weight(seed, 0, 0, KERN_W_ROUTER, E, H, wr.data());
    rng_fill_uniform(seed, 1, -1.f, 1.f, xa.data(), xa.size());
    rng_fill_uniform(seed, 2, -1.f, 1.f, dya.data(), dya.size());
    rng_fill_uniform(seed, 3, -1.f, 1.f, xb.data(), xb.size());
    rng_fill_uniform(seed, 4, -1.f, 1.f, dyb.data(), dyb.size());
    for (std::vector<float> *v : {&wr, &w1, &w3, &w2, &xa, &dya, &xb, &dyb})
        kern_bf16_round_n(v->data(), v->size());
    const float aux_c = 0.01f, z_c = 0.001f;

    /* y, dx of A and B and the gradients of one layer (host f32) */
    struct run_out {
        std::vector<float> ya, yb, dxa, dxb, g_wr, g_w1, g_w3, g_w2;
    };
    auto alloc_out = [&](run_out &o) {
        o.ya.assign((size_t)TA * H, NAN);
        o.dxa.assign((size_t)TA * H, NAN);
        o.yb.assign((size_t)TB * H, NAN);
        o.dxb.assign((size_t)TB * H, NAN);
        o.g_wr.resize((size_t)E * H);
        o.g_w1.resize((size_t)E * F * H);
        o.g_w3.resize(swiglu ? (size_t)E * F * H : 0);
        o.g_w2.resize((size_t)E * H * F);
    };
    int ok = 1;
    kcu_config cfg = {H, F, E, K, c.act, 1, T_max, 1, 0.f};

    /* a layer with too many states is refused */
    {
        kcu_config bad = cfg;
        bad.states = KCU_MAX_STATES + 1;
        kcu_layer *lb = NULL;
        ok = ok && kcu_layer_create(&bad, &lb) == MOE_EINVAL && lb == NULL;
    }

    /* 2 states: fwd A (0), fwd B (1), bwd B (1), bwd A (0) */
    run_out p;
    alloc_out(p);
    cfg.states = 2;
    kcu_sorted_override = c.sorted;
    kcu_layer *l2;
    CKM(kcu_layer_create(&cfg, &l2));
    kcu_sorted_override = -1;
    CKM(kcu_layer_upload(l2, wr.data(), w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    CK(cudaMemset(l2->ws, 0xff, l2->ws_bytes)); /* every state poisoned */
    CKM(kcu_layer_zero_grads(l2, NULL));
    CKM(kcu_layer_set_state(l2, 0));
    CKM(kcu_forward(l2, TA, xa.data(), MOE_F32, p.ya.data(), MOE_F32, 1, NULL));
    CKM(kcu_layer_set_state(l2, 1));
    CKM(kcu_layer_set_capacity(l2, c.cf_b));
    CKM(kcu_forward(l2, TB, xb.data(), MOE_F32, p.yb.data(), MOE_F32, 1, NULL));
    CKM(kcu_layer_set_capacity(l2, 0.f));
    CKM(kcu_backward(l2, dyb.data(), MOE_F32, p.dxb.data(), MOE_F32, aux_c, z_c, NULL, 0, NULL));
    /* state 1 was consumed; nothing is enqueued by the refused call */
    const int again_ok = kcu_backward(l2, dyb.data(), MOE_F32, p.dxb.data(), MOE_F32, aux_c, z_c,
                                      NULL, 0, NULL) == MOE_EPRECOND;
    const int range_ok = kcu_layer_set_state(l2, 2) == MOE_EINVAL &&
                         kcu_layer_set_state(l2, -1) == MOE_EINVAL && l2->state == 1;
    CKM(kcu_layer_set_state(l2, 0));
    CKM(kcu_backward(l2, dya.data(), MOE_F32, p.dxa.data(), MOE_F32, aux_c, z_c, NULL, 0, NULL));
    CK(cudaDeviceSynchronize());
    CKM(kcu_layer_download_grads(l2, p.g_wr.data(), p.g_w1.data(), swiglu ? p.g_w3.data() : NULL,
                                 p.g_w2.data()));

    /* 1 state: fwd B, bwd B, fwd A, bwd A */
    run_out q;
    alloc_out(q);
    cfg.states = 1;
    kcu_sorted_override = c.sorted;
    kcu_layer *l1;
    CKM(kcu_layer_create(&cfg, &l1));
    kcu_sorted_override = -1;
    CKM(kcu_layer_upload(l1, wr.data(), w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    CK(cudaMemset(l1->ws, 0xff, l1->ws_bytes));
    CKM(kcu_layer_zero_grads(l1, NULL));
    CKM(kcu_layer_set_capacity(l1, c.cf_b));
    CKM(kcu_forward(l1, TB, xb.data(), MOE_F32, q.yb.data(), MOE_F32, 1, NULL));
    CKM(kcu_layer_set_capacity(l1, 0.f));
    CKM(kcu_backward(l1, dyb.data(), MOE_F32, q.dxb.data(), MOE_F32, aux_c, z_c, NULL, 0, NULL));
    CKM(kcu_forward(l1, TA, xa.data(), MOE_F32, q.ya.data(), MOE_F32, 1, NULL));
    CKM(kcu_backward(l1, dya.data(), MOE_F32, q.dxa.data(), MOE_F32, aux_c, z_c, NULL, 0, NULL));
    CK(cudaDeviceSynchronize());
    CKM(kcu_layer_download_grads(l1, q.g_wr.data(), q.g_w1.data(), swiglu ? q.g_w3.data() : NULL,
                                 q.g_w2.data()));
    const int one_ok = kcu_layer_set_state(l1, 0) == MOE_OK &&
                       kcu_layer_set_state(l1, 1) == MOE_EINVAL && l1->nstates == 1;
    const int bytes_ok =
        l2->nstates == 2 && l2->ws_bytes == 2 * l1->ws_bytes && l2->ws_state_bytes == l1->ws_bytes;
    kcu_layer_destroy(l1);
    kcu_layer_destroy(l2);

    auto same = [](const std::vector<float> &a, const std::vector<float> &b) {
        return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * 4) == 0;
    };
    auto finite = [](const std::vector<float> &a) {
        for (float v : a)
            if (!isfinite(v))
                return 0;
        return 1;
    };
    const int y_ok = same(p.ya, q.ya) && same(p.yb, q.yb) && finite(p.ya) && finite(p.yb);
    const int dx_ok = same(p.dxa, q.dxa) && same(p.dxb, q.dxb) && finite(p.dxa) && finite(p.dxb);
    const int g_ok = same(p.g_wr, q.g_wr) && same(p.g_w1, q.g_w1) && same(p.g_w3, q.g_w3) &&
                     same(p.g_w2, q.g_w2) && finite(p.g_w1) && finite(p.g_w2);
    ok = ok && y_ok && dx_ok && g_ok && again_ok && range_ok && one_ok && bytes_ok;
    printf("states 2 vs 1 TA=%d TB=%d H=%d F=%d E=%d K=%d %s sorted=%d cf_b=%.2g | y %s dx %s "
           "grads %s | consumed %s range %s one %s bytes %s | %s\n",
           TA, TB, H, F, E, K, swiglu ? "sw" : "ge", c.sorted, c.cf_b, y_ok ? "ok" : "BAD",
           dx_ok ? "ok" : "BAD", g_ok ? "ok" : "BAD", again_ok ? "ok" : "BAD",
           range_ok ? "ok" : "BAD", one_ok ? "ok" : "BAD", bytes_ok ? "ok" : "BAD",
           ok ? "PASS" : "FAIL");
    fflush(stdout);
    return !ok;
}

/* ---- kcu_forward_pipelined: chunked inference forward of host x, y ----
 * The same layer runs one kcu_forward of all T tokens (host x, y: the
 * staged path) and kcu_forward_pipelined in chunks of `chunk` tokens; host
 * memory from cudaMallocHost (reg = 0) or malloc + cudaHostRegister (reg =
 * 1), x and y bf16 or f32. In a dropless layer each token's y does not
 * depend on the other tokens (the chunks take the whole batch's path), so
 * y must be the same bits; counts the same, dropped 0, aux and z within
 * 1e-5 relative (summed in another order). cf > 0: the pipelined call falls
 * back to one kcu_forward (same y bits, same statistics). */
struct pcase {
    int T, H, F, E, K;
    kern_act act;
    int chunk;
    moe_dtype xdt, ydt;
    int reg;
    float cf;
    int family; /* 1: DeepSeek-V3-like routing (sigmoid, 4 groups of which 2
                 * kept, scale 2.5) and one gated shared expert of d_ff F */
};

/* host buffer of `bytes`, pinned (reg 0) or malloc'd and registered (reg 1) */
static void *pipe_host_alloc(size_t bytes, int reg)
{
    void *p = NULL;
    if (!reg) {
        CK(cudaMallocHost(&p, bytes));
        return p;
    }
    p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "check-gpu: malloc of %zu bytes failed\n", bytes);
        exit(2);
    }
    CK(cudaHostRegister(p, bytes, cudaHostRegisterDefault));
    return p;
}

static void pipe_host_free(void *p, int reg)
{
    if (!reg) {
        CK(cudaFreeHost(p));
        return;
    }
    CK(cudaHostUnregister(p));
    free(p);
}

static int pipe_check(const pcase &c, uint64_t seed)
{
    const int H = c.H, F = c.F, E = c.E, K = c.K, T = c.T;
    const int swiglu = c.act == KERN_ACT_SWIGLU;
    const size_t xs = c.xdt == MOE_F32 ? 4 : 2, ys = c.ydt == MOE_F32 ? 4 : 2;
    const size_t n = (size_t)T * H;
    std::vector<float> wr((size_t)E * H), w1((size_t)E * F * H), w3((size_t)E * F * H),
        w2((size_t)E * H * F), x(n);
    for (int e = 0; e < E; e++) {
        kern_init_weight(seed, 0, e, KERN_W1, F, H, w1.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W3, F, H, w3.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W2, H, F, w2.data() + (size_t)e * H * F);
    }
    kern_init_weight(seed, 0, 0, KERN_W_ROUTER, E, H, wr.data());
    rng_fill_uniform(seed, 1, -1.f, 1.f, x.data(), n);
    for (std::vector<float> *v : {&wr, &w1, &w3, &w2, &x})
        kern_bf16_round_n(v->data(), v->size());

    /* T_max = T: the one-call reference needs it (the chunks need only chunk) */
    kcu_config cfg = {H, F, E, K, c.act, 1, T, 0, c.cf};
    kcu_route_config rc;
    memset(&rc, 0, sizeof(rc));
    if (c.family) {
        rc.scoring = KERN_SCORE_SIGMOID;
        rc.n_group = 4;
        rc.topk_group = 2;
        rc.route_scale = 2.5f;
        rc.shared_experts = 1;
        rc.shared_gate = 1;
    }
    kcu_layer *l;
    CKM(kcu_layer_create_ex(&cfg, &rc, &l));
    CKM(kcu_layer_upload(l, wr.data(), w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    if (c.family) { /* the shared expert: expert 0's weights, wsg a router row */
        CKM(kcu_layer_upload_shared(l, w1.data(), swiglu ? w3.data() : NULL, w2.data(), wr.data()));
    }
    CK(cudaMemset(l->ws, 0xff, l->ws_bytes));

    /* host x (T,H) in its dtype; y of the reference and of the pipeline */
    void *xh = pipe_host_alloc(n * xs, c.reg);
    void *ya = pipe_host_alloc(n * ys, c.reg);
    void *yb = pipe_host_alloc(n * ys, c.reg);
    if (c.xdt == MOE_F32)
        memcpy(xh, x.data(), n * 4);
    else
        for (size_t i = 0; i < n; i++)
            ((uint16_t *)xh)[i] = kcu_host_bf16(x[i]);
    memset(ya, 0xff, n * ys); /* NaN in both dtypes */
    memset(yb, 0xff, n * ys);

    std::vector<int32_t> ca(E, -1), da(E, -1), cb(E, -1), db(E, -1);
    float aux_a = NAN, z_a = NAN, aux_b = NAN, z_b = NAN;
    CKM(kcu_forward(l, T, xh, c.xdt, ya, c.ydt, 0, NULL));
    CKM(kcu_forward_stats(l, ca.data(), da.data(), &aux_a, &z_a, NULL));
    CK(cudaDeviceSynchronize());
    /* the statistics buffers poisoned between the two: the pipeline must
     * write all of them */
    CK(cudaMemset(l->counts, 0xff, (size_t)E * 4));
    CK(cudaMemset(l->dropped, 0xff, (size_t)E * 4));
    CK(cudaMemset(l->stats, 0xff, 2 * 4));
    CKM(kcu_forward_pipelined(l, T, xh, c.xdt, yb, c.ydt, c.chunk, NULL));
    /* returned: y already in host memory (no synchronisation before reading it) */
    const int y_same = memcmp(ya, yb, n * ys) == 0;
    CKM(kcu_forward_stats(l, cb.data(), db.data(), &aux_b, &z_b, NULL));
    /* a second pipelined call on the same layer (buffers and streams reused) */
    memset(yb, 0xff, n * ys);
    CKM(kcu_forward_pipelined(l, T, xh, c.xdt, yb, c.ydt, c.chunk, NULL));
    const int y_again = memcmp(ya, yb, n * ys) == 0;

    /* y against the reference within bf16 tolerance too (what differs if
     * the bits do not), and finite */
    std::vector<float> fa(n), fb(n);
    int finite = 1;
    for (size_t i = 0; i < n; i++) {
        if (c.ydt == MOE_F32) {
            fa[i] = ((const float *)ya)[i];
            fb[i] = ((const float *)yb)[i];
        } else {
            fa[i] = kern_bf16_to_f32_inl(((const uint16_t *)ya)[i]);
            fb[i] = kern_bf16_to_f32_inl(((const uint16_t *)yb)[i]);
        }
        finite = finite && isfinite(fa[i]) && isfinite(fb[i]);
    }
    const double yerr = relerr(fb.data(), fa.data(), n);
    int cnt_ok = 1, drop_ok = 1;
    long long csum = 0;
    for (int e = 0; e < E; e++) {
        cnt_ok = cnt_ok && ca[e] == cb[e];
        drop_ok = drop_ok && db[e] == da[e] && (c.cf > 0.f || db[e] == 0);
        csum += cb[e];
    }
    cnt_ok = cnt_ok && csum == (c.cf > 0.f ? csum : (long long)T * K);
    auto rel = [](float a, float b) { return (double)fabsf(a - b) / fmax(fabs((double)b), 1e-30); };
    const double aux_e = rel(aux_b, aux_a), z_e = rel(z_b, z_a);
    const int stat_ok = isfinite(aux_b) && isfinite(z_b) && aux_e <= 1e-5 && z_e <= 1e-5;
    size_t pbytes = 0, wbytes = 0;
    kcu_layer_bytes(l, &pbytes, &wbytes);
    const int ok = y_same && y_again && finite && cnt_ok && drop_ok && stat_ok;
    printf("pipelined T=%d H=%d F=%d E=%d K=%d %s%s chunk=%d x %s y %s %s cf=%.2g | y %s (rel "
           "%.1e) again %s | counts %s dropped %s | aux %.3e z %.3e | ws %.1f MiB | %s\n",
           T, H, F, E, K, swiglu ? "sw" : "ge", c.family ? " v3+shared" : "", c.chunk,
           c.xdt == MOE_F32 ? "f32" : "bf16", c.ydt == MOE_F32 ? "f32" : "bf16",
           c.reg ? "registered" : "pinned", c.cf, y_same ? "bits" : "BAD", yerr,
           y_again ? "ok" : "BAD", cnt_ok ? "ok" : "BAD", drop_ok ? "ok" : "BAD", aux_e, z_e,
           wbytes / 1048576.0, ok ? "PASS" : "FAIL");
    fflush(stdout);
    pipe_host_free(xh, c.reg);
    pipe_host_free(ya, c.reg);
    pipe_host_free(yb, c.reg);
    kcu_layer_destroy(l);
    return !ok;
}

/* ---- direct grouped-GEMM checks: each mode on both operand majors ---- */
static uint64_t lcg(uint64_t &st)
{
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    return st >> 33;
}

/* one GEMM mode against a double CPU product; the kernel version that ran
 * is kcu_gemm_version's */
static int gemm_checks(uint64_t seed)
{
    const int nsm = [] {
        int d = 0, n = 0;
        CK(cudaGetDevice(&d));
        CK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, d));
        return n;
    }();
    uint64_t st = seed;
    auto rnd = [&](size_t n) {
        std::vector<float> v(n);
        rng_fill_uniform(seed, lcg(st), -1.f, 1.f, v.data(), n);
        kern_bf16_round_n(v.data(), n);
        return v;
    };
    auto up_bf = [&](const std::vector<float> &v) {
        std::vector<uint16_t> hb(v.size());
        for (size_t i = 0; i < v.size(); i++)
            hb[i] = kern_f32_to_bf16(v[i]);
        bf16 *d;
        CK(cudaMalloc(&d, hb.size() * 2));
        CK(cudaMemcpy(d, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
        return d;
    };
    auto up_i = [&](const std::vector<int32_t> &v) {
        int32_t *d;
        CK(cudaMalloc(&d, v.size() * 4 + 4));
        CK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
        return d;
    };
    int fails = 0;
    const std::vector<int32_t> cnt = {130, 0, 77, 256}; /* rows per group */
    const int G = (int)cnt.size();
    std::vector<int32_t> offs(G + 1, 0), te, tr;
    for (int e = 0; e < G; e++) {
        offs[e + 1] = offs[e] + cnt[e];
        for (int r = 0; r < cnt[e]; r += KCU_BM) {
            te.push_back(e);
            tr.push_back(offs[e] + r);
        }
    }
    const int R = offs[G], NT_ = (int)te.size(), SRC = 600;
    std::vector<int32_t> gat(R), gat2(R);
    for (int r = 0; r < R; r++) {
        gat[r] = (int)(lcg(st) % SRC);
        gat2[r] = (int)(lcg(st) % SRC);
    }
    int32_t *d_offs = up_i(offs), *d_te = up_i(te), *d_tr = up_i(tr), *d_gat = up_i(gat),
            *d_gat2 = up_i(gat2), *d_nt = up_i({NT_});

    /* rows mode: C (R,N) = A[gat[r]] (K) . B_e, B_e K-major (N,K) or N-major (K,N) */
    for (int bm = 0; bm < 2; bm++) {
        const int K = 192, N = 512;
        std::vector<float> A = rnd((size_t)SRC * K), B = rnd((size_t)G * K * N);
        bf16 *dA = up_bf(A), *dB = up_bf(B);
        float *dC;
        CK(cudaMalloc(&dC, (size_t)R * N * 4));
        CK(cudaMemset(dC, 0xff, (size_t)R * N * 4));
        kcu_gemm_args a;
        memset(&a, 0, sizeof(a));
        a.A = dA;
        a.lda = K;
        a.a_gather = d_gat;
        a.B = dB;
        a.ldb = bm ? N : K;
        a.b_gstride = (long long)K * N;
        a.N = N;
        a.K = K;
        a.offs = d_offs;
        a.tile_e = d_te;
        a.tile_r0 = d_tr;
        a.ntiles_m = d_nt;
        a.max_tiles_m = NT_;
        a.Cf = dC;
        a.ldc = N;
        const kcu_bmode bmode = bm ? KCU_B_N : KCU_B_K;
        CKM(kcu_gemm(KCU_A_K, bmode, KCU_EPI_F32, &a, nsm, NULL));
        CK(cudaDeviceSynchronize());
        std::vector<float> C = dl(dC, (size_t)R * N), ref((size_t)R * N);
        for (int e = 0; e < G; e++)
            for (int r = offs[e]; r < offs[e + 1]; r++)
                for (int n = 0; n < N; n++) {
                    double acc = 0;
                    for (int k = 0; k < K; k++)
                        acc += (double)A[(size_t)gat[r] * K + k] *
                               (bm ? B[(size_t)e * K * N + (size_t)k * N + n]
                                   : B[(size_t)e * K * N + (size_t)n * K + k]);
                    ref[(size_t)r * N + n] = (float)acc;
                }
        const double err = relerr(C.data(), ref.data(), C.size());
        const int ok = err < 1e-5;
        fails += !ok;
        printf("gemm rows  A_K %s F32  (v%d): rel err %.1e %s\n", bm ? "B_N" : "B_K",
               kcu_gemm_version(KCU_A_K, bmode, KCU_EPI_F32, &a, nsm), err, ok ? "PASS" : "FAIL");
        if (!ok)
            kern_print_mismatches("gemm rows", C.data(), ref.data(), C.size(), 1e-3, 8);
        CK(cudaFree(dA));
        CK(cudaFree(dB));
        CK(cudaFree(dC));
    }
    /* wgrad: C_e (M,N) (+)= sum_{k in group e} A[gat[k]]^T B[gat2[k]], twice
     * (beta0 then accumulate) */
    {
        const int M = 256, N = 512;
        std::vector<float> A = rnd((size_t)SRC * M), B = rnd((size_t)SRC * N);
        bf16 *dA = up_bf(A), *dB = up_bf(B);
        float *dC;
        CK(cudaMalloc(&dC, (size_t)G * M * N * 4));
        CK(cudaMemset(dC, 0xff, (size_t)G * M * N * 4));
        kcu_gemm_args a;
        memset(&a, 0, sizeof(a));
        a.A = dA;
        a.lda = M;
        a.a_gather = d_gat;
        a.B = dB;
        a.ldb = N;
        a.b_gather = d_gat2;
        a.M = M;
        a.N = N;
        a.ngroups = G;
        a.offs = d_offs;
        a.Cf = dC;
        a.ldc = N;
        a.c_gstride = (long long)M * N;
        a.beta0 = 1;
        CKM(kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, nsm, NULL));
        CK(cudaDeviceSynchronize());
        std::vector<float> C1 = dl(dC, (size_t)G * M * N);
        a.beta0 = 0;
        CKM(kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, nsm, NULL));
        CK(cudaDeviceSynchronize());
        std::vector<float> C2 = dl(dC, (size_t)G * M * N), ref((size_t)G * M * N);
        parallel_for(G, [&](int e) {
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) {
                    double acc = 0;
                    for (int k = offs[e]; k < offs[e + 1]; k++)
                        acc += (double)A[(size_t)gat[k] * M + m] * B[(size_t)gat2[k] * N + n];
                    ref[((size_t)e * M + m) * N + n] = (float)acc;
                }
        });
        const double err = relerr(C1.data(), ref.data(), C1.size());
        const int ok = err < 1e-5 && twice(C1, C2);
        fails += !ok;
        printf("gemm wgrad A_M B_N ACC  (v%d): rel err %.1e, accumulate %s %s\n",
               kcu_gemm_version(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, nsm), err,
               twice(C1, C2) ? "ok" : "BAD", ok ? "PASS" : "FAIL");
        if (!ok)
            kern_print_mismatches("gemm wgrad", C1.data(), ref.data(), C1.size(), 1e-3, 8);
        CK(cudaFree(dA));
        CK(cudaFree(dB));
        CK(cudaFree(dC));
    }
    for (int32_t *p : {d_offs, d_te, d_tr, d_gat, d_gat2, d_nt})
        CK(cudaFree(p));
    return fails;
}

/* ---- GEMM self-check: every mode and epilogue on each kernel version ----
 * Small shapes against a double CPU product, one line per (case, version),
 * so that one run on the device says which mode of which version is broken:
 *   v1 mma.sync, v2 wgmma, v4 warp-specialised with TMA where possible
 *   ("v4-tma") and with cp.async only ("v4-cpa"), and v7 (v4 on 2-CTA
 *   clusters with the weight tile multicast, "v7-clu": rows mode with a
 *   dense A over a tile list; the weight gradients with A and B dense run
 *   v9, their B tile multicast; else it runs v4); "v4-reg", "v7-reg": v4 and
 *   v7 with the register epilogue where a staged one would run (TMA stores
 *   of the weight gradients, dh's (a, b) loaded by TMA); "v7-dyn": v7 with
 *   its items dealt from a counter (kcu_gemm_args.sched), which it must
 *   leave zero. v2, v4, v7 and v9 run
 *   the same wgmma sequence: their outputs must agree bit for bit ("==v2").
 * nsm is set to 3 so that each persistent CTA walks several items. */
struct st_ver {
    int v, tma, cl; /* cl: v7 / v9, 2-CTA clusters where they apply */
    int ts;         /* staged epilogues (v4, v7): TMA stores, dh's (a, b) by TMA */
    int dyn;        /* v7: items dealt from a counter (kcu_gemm_args.sched) */
    const char *name;
};
static const st_ver ST_VERS[] = {{1, -1, 0, 0, 0, "v1"},    {2, -1, 0, 0, 0, "v2"},
                                 {4, 1, 0, 1, 0, "v4-tma"}, {4, 1, 0, 0, 0, "v4-reg"},
                                 {4, 0, 0, 1, 0, "v4-cpa"}, {4, 1, 1, 1, 0, "v7-clu"},
                                 {4, 1, 1, 0, 0, "v7-reg"}, {4, 1, 1, 1, 1, "v7-dyn"}};

/* the activation references: the CPU table (kernels/act.c) on one value,
 * the one definition of each activation on the host (the GPU's are the
 * functors of kernels/cuda/kcu_act.cuh); b unused when ungated */
static float st_act_fwd(kern_act act, float a, float b)
{
    float h;
    kern_act_ops_of(act)->forward(&a, &b, 1, &h);
    return h;
}
static void st_act_bwd(kern_act act, float a, float b, float dh, float *da, float *db)
{
    *db = 0.f;
    kern_act_ops_of(act)->backward(&a, &b, &dh, 1, da, db);
}

/* ---- v1n (the router's logits in 16- or 32-row tiles): v1's bits ----
 * A_K, B_K, EPI_F32 over dense rows, the router's shapes and ragged M (4
 * checks, counted with the 3 GEMM groups in the summary line):
 * v1n with each tile height must give v1's output bit for bit (the same
 * instruction chain per element), and both the double CPU product within
 * 1e-5. One line per shape. */
static int narrow_check(uint64_t seed)
{
    struct ncase {
        int M, N, K;
    };
    const ncase cases[] = {{1, 128, 256}, {37, 128, 2048}, {2048, 128, 4096}, {3001, 256, 1024}};
    int fails = 0;
    uint64_t st = seed ^ 0x51ed27u;
    for (const ncase &c : cases) {
        std::vector<float> A((size_t)c.M * c.K), B((size_t)c.N * c.K);
        rng_fill_uniform(seed, lcg(st), -1.f, 1.f, A.data(), A.size());
        rng_fill_uniform(seed, lcg(st), -1.f, 1.f, B.data(), B.size());
        kern_bf16_round_n(A.data(), A.size());
        kern_bf16_round_n(B.data(), B.size());
        std::vector<uint16_t> Ah(A.size()), Bh(B.size());
        for (size_t i = 0; i < A.size(); i++)
            Ah[i] = kern_f32_to_bf16(A[i]);
        for (size_t i = 0; i < B.size(); i++)
            Bh[i] = kern_f32_to_bf16(B[i]);
        void *dA, *dB;
        float *dC;
        CK(cudaMalloc(&dA, Ah.size() * 2));
        CK(cudaMalloc(&dB, Bh.size() * 2));
        CK(cudaMalloc(&dC, (size_t)c.M * c.N * 4));
        CK(cudaMemcpy(dA, Ah.data(), Ah.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dB, Bh.data(), Bh.size() * 2, cudaMemcpyHostToDevice));
        kcu_gemm_args a;
        memset(&a, 0, sizeof(a));
        a.A = (const bf16 *)dA;
        a.lda = c.K;
        a.B = (const bf16 *)dB;
        a.ldb = c.K;
        a.M = c.M;
        a.N = c.N;
        a.K = c.K;
        a.Cf = dC;
        a.ldc = c.N;
        std::vector<float> C[3];
        for (int v = 0; v < 3; v++) { /* v1, v1n 16 rows, v1n 32 rows */
            kcu_gemm_narrow_override = v;
            kcu_gemm_select(1, -1, -1, -1, -1);
            CK(cudaMemset(dC, 0xff, (size_t)c.M * c.N * 4));
            CKM(kcu_gemm(KCU_A_K, KCU_B_K, KCU_EPI_F32, &a, 3, NULL));
            CK(cudaDeviceSynchronize());
            C[v].resize((size_t)c.M * c.N);
            CK(cudaMemcpy(C[v].data(), dC, C[v].size() * 4, cudaMemcpyDeviceToHost));
        }
        kcu_gemm_narrow_override = -1;
        kcu_gemm_select(-1, -1, -1, -1, -1);
        std::vector<float> ref((size_t)c.M * c.N);
        parallel_for(c.M, [&](int m) {
            for (int n = 0; n < c.N; n++) {
                double acc = 0;
                for (int k = 0; k < c.K; k++)
                    acc += (double)A[(size_t)m * c.K + k] * B[(size_t)n * c.K + k];
                ref[(size_t)m * c.N + n] = (float)acc;
            }
        });
        const double err = relerr(C[0].data(), ref.data(), ref.size());
        const int same = memcmp(C[0].data(), C[1].data(), ref.size() * 4) == 0 &&
                         memcmp(C[0].data(), C[2].data(), ref.size() * 4) == 0;
        const int ok = err < 1e-5 && same;
        fails += !ok;
        printf("gemm v1n M=%d N=%d K=%d: rel err %.1e, 16- and 32-row tiles %s v1 %s\n", c.M, c.N,
               c.K, err, same ? "==" : "!=", ok ? "PASS" : "FAIL");
        CK(cudaFree(dA));
        CK(cudaFree(dB));
        CK(cudaFree(dC));
    }
    return fails;
}

/* host <-> device helpers of the GEMM checks */
static std::vector<uint16_t> bf_of(const std::vector<float> &v)
{
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); i++)
        h[i] = kern_f32_to_bf16(v[i]);
    return h;
}
static std::vector<float> f_of(const std::vector<uint16_t> &h)
{
    std::vector<float> v(h.size());
    for (size_t i = 0; i < h.size(); i++)
        v[i] = kern_bf16_to_f32(h[i]);
    return v;
}
static void *dmalloc(size_t bytes)
{
    void *p;
    CK(cudaMalloc(&p, bytes));
    return p;
}
static void up(void *d, const void *h, size_t bytes)
{
    CK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
}
static void down(void *h, const void *d, size_t bytes)
{
    CK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

/* v10 (gemm/swapped.cu), the rows mode with its operands swapped: the
 * up-projection's SwiGLU h and the down-projection's scattered bf16 rows
 * over experts of 0 to 700 rows (chunks of up to 256 rows in narrow items,
 * 192 in wide ones; n padded to 16), in each of its forms (narrow, wide,
 * paired, held, held with store warps, rows paired), against the CPU (double sums) and bit for bit
 * against v4 over a tile list of the same rows (the same products summed in the same k order) */
static int swapped_check(uint64_t seed)
{
    if (!kcu_sm90())
        return 0; /* Hopper only */
    const int counts[] = {0, 5, 16, 64, 70, 128, 133, 200, 256, 257, 300, 700, 1, 31, 129, 90};
    const int E = (int)(sizeof(counts) / sizeof(counts[0])), H = 512, F = 256;
    std::vector<int32_t> offs(E + 1, 0), te, tr;
    for (int e = 0; e < E; e++) {
        offs[e + 1] = offs[e] + counts[e];
        for (int r = 0; r < counts[e]; r += KCU_BM) {
            te.push_back(e);
            tr.push_back(offs[e] + r);
        }
    }
    const int S = offs[E], NTL = (int)te.size();
    const int NSM = 3; /* several items and chunks per CTA: the stage ring across them */
    uint64_t st = seed ^ 0x5a9b1du;
    int fails = 0;
    for (int which = 0; which < 2; which++) { /* 0 up (SWIGLU), 1 down (SCATTER) */
        const int N = which ? H : 2 * F, K = which ? F : H;
        const kcu_epi epi = which ? KCU_EPI_SCATTER : KCU_EPI_SWIGLU;
        std::vector<float> A((size_t)S * K), B((size_t)E * N * K);
        rng_fill_uniform(seed, lcg(st), -1.f, 1.f, A.data(), A.size());
        rng_fill_uniform(seed, lcg(st), -0.1f, 0.1f, B.data(), B.size());
        kern_bf16_round_n(A.data(), A.size());
        kern_bf16_round_n(B.data(), B.size());
        std::vector<int32_t> perm(S);
        for (int r = 0; r < S; r++)
            perm[r] = r;
        for (int r = S - 1; r > 0; r--)
            std::swap(perm[r], perm[(int)(lcg(st) % (uint64_t)(r + 1))]);
        /* the reference: acc (S, N) in double, then h or the scattered rows */
        std::vector<double> acc((size_t)S * N);
        parallel_for(E, [&](int e) {
            for (int r = offs[e]; r < offs[e + 1]; r++)
                for (int n = 0; n < N; n++) {
                    double a = 0;
                    for (int k = 0; k < K; k++)
                        a += (double)A[(size_t)r * K + k] * B[((size_t)e * N + n) * K + k];
                    acc[(size_t)r * N + n] = a;
                }
        });
        const int OW = which ? N : F; /* output row width */
        std::vector<float> ref((size_t)S * OW);
        for (int r = 0; r < S; r++)
            for (int n = 0; n < N; n++) {
                if (which)
                    ref[(size_t)perm[r] * N + n] = (float)acc[(size_t)r * N + n];
                else if (n % 16 < 8)
                    ref[(size_t)r * F + (n / 16) * 8 + n % 8] =
                        st_act_fwd(KERN_ACT_SWIGLU, (float)acc[(size_t)r * N + n],
                                   (float)acc[(size_t)r * N + n + 8]);
            }
        const std::vector<uint16_t> Ab = bf_of(A), Bb = bf_of(B);
        bf16 *dA = (bf16 *)dmalloc(Ab.size() * 2), *dB = (bf16 *)dmalloc(Bb.size() * 2);
        bf16 *dO = (bf16 *)dmalloc((size_t)S * OW * 2);
        int32_t *d_offs = (int32_t *)dmalloc((E + 1) * 4), *d_te = (int32_t *)dmalloc(NTL * 4);
        int32_t *d_tr = (int32_t *)dmalloc(NTL * 4), *d_nt = (int32_t *)dmalloc(4);
        int32_t *d_perm = (int32_t *)dmalloc((size_t)S * 4);
        up(dA, Ab.data(), Ab.size() * 2);
        up(dB, Bb.data(), Bb.size() * 2);
        up(d_offs, offs.data(), (E + 1) * 4);
        up(d_te, te.data(), NTL * 4);
        up(d_tr, tr.data(), NTL * 4);
        up(d_nt, &NTL, 4);
        up(d_perm, perm.data(), (size_t)S * 4);
        /* v10's forms, then v4 (the last): narrow and wide items, wide items
         * paired on 2-CTA clusters with the rows multicast (where N allows),
         * wide items in 4 stages with the epilogue in the held stage, and with
         * store warps (the up-projection only), wide items on 2-CTA clusters
         * split by rows (halves of chunks of up to 384 rows, the weights
         * multicast; the 0-16-row experts leave one CTA none) in 3 stages and
         * held */
        struct sform {
            const char *name;
            int wide, pair, held, sw, rowpair;
        };
        const sform forms[] = {{"narrow", 0, 0, 0, 0, 0},
                               {"wide", 1, 0, 0, 0, 0},
                               {"wide paired", 1, 1, 0, 0, 0},
                               {"wide held", 1, 0, 1, 0, 0},
                               {"wide held sw", 1, 0, 1, 1, 0},
                               {"wide rowpair", 1, 0, 0, 0, 1},
                               {"wide rowpair held", 1, 0, 1, 0, 1},
                               {"v4", 0, 0, 0, 0, 0}};
        const int V4 = (int)(sizeof(forms) / sizeof(forms[0])) - 1;
        std::vector<uint16_t> out[sizeof(forms) / sizeof(forms[0])];
        int ver[sizeof(forms) / sizeof(forms[0])] = {0};
        for (int v = 0; v <= V4; v++) {
            const sform &f = forms[v];
            if (f.sw && which)
                continue;
            kcu_gemm_args a;
            memset(&a, 0, sizeof(a));
            a.A = dA;
            a.lda = K;
            a.B = dB;
            a.ldb = K;
            a.b_gstride = (long long)N * K;
            a.N = N;
            a.K = K;
            a.offs = d_offs;
            a.tile_e = d_te;
            a.tile_r0 = d_tr;
            a.ntiles_m = d_nt;
            a.max_tiles_m = NTL;
            a.few_tiles = 1;
            a.ngroups = E;
            if (which) {
                a.Cb = dO;
                a.ldc = N;
                a.scatter = d_perm;
            } else {
                a.h = dO;
                a.F = F;
            }
            const int v4 = v == V4;
            kcu_gemm_select(v4 ? 4 : -1, v4 ? 1 : -1, v4 ? 0 : -1, -1, -1);
            kcu_gemm_swap_override = v4 ? -1 : 2; /* both projections, any rows */
            kcu_gemm_swap_wide_override = v4 ? -1 : f.wide;
            kcu_gemm_v10_pair_override = v4 ? -1 : f.pair;
            kcu_gemm_v10_held_override = v4 ? -1 : f.held;
            kcu_gemm_v10_sw_override = v4 ? -1 : f.sw;
            kcu_gemm_v10_rowpair_override = v4 ? -1 : f.rowpair;
            CK(cudaMemset(dO, 0xff, (size_t)S * OW * 2));
            ver[v] = kcu_gemm_version(KCU_A_K, KCU_B_K, epi, &a, NSM);
            CKM(kcu_gemm(KCU_A_K, KCU_B_K, epi, &a, NSM, NULL));
            CK(cudaDeviceSynchronize());
            out[v].resize((size_t)S * OW);
            down(out[v].data(), dO, out[v].size() * 2);
        }
        kcu_gemm_select(-1, -1, -1, -1, -1);
        kcu_gemm_swap_override = -1;
        kcu_gemm_swap_wide_override = -1;
        kcu_gemm_v10_pair_override = -1;
        kcu_gemm_v10_held_override = -1;
        kcu_gemm_v10_sw_override = -1;
        kcu_gemm_v10_rowpair_override = -1;
        for (int v = 0; v < V4; v++) {
            if (forms[v].sw && which)
                continue;
            const std::vector<float> got = f_of(out[v]);
            const double err = relerr(got.data(), ref.data(), ref.size());
            const int same = out[v] == out[V4];
            const int ok = err < TOL && same && ver[v] == 10 && ver[V4] == 4;
            fails += !ok;
            printf("gemm v10 %s %s (%d experts of 0-700 rows, N=%d K=%d): version %d, rel err "
                   "%.1e, %s v%d %s\n",
                   forms[v].name, which ? "SCATTER" : "SWIGLU", E, N, K, ver[v], err,
                   same ? "==" : "!=", ver[V4], ok ? "PASS" : "FAIL");
        }
        for (void *p : {(void *)dA, (void *)dB, (void *)dO, (void *)d_offs, (void *)d_te,
                        (void *)d_tr, (void *)d_nt, (void *)d_perm})
            CK(cudaFree(p));
    }
    return fails;
}

static int gemm_selftest(uint64_t seed)
{
    const int NSM = 3;
    uint64_t st = seed ^ 0x9e3779b97f4a7c15ull;
    auto rnd = [&](size_t n, float lo, float hi) {
        std::vector<float> v(n);
        rng_fill_uniform(seed, lcg(st), lo, hi, v.data(), n);
        kern_bf16_round_n(v.data(), n);
        return v;
    };
    /* groups and tile list as the layer builds them */
    const std::vector<int32_t> cnt = {130, 0, 77, 256};
    const int G = (int)cnt.size();
    std::vector<int32_t> offs(G + 1, 0), te, tr;
    for (int e = 0; e < G; e++) {
        offs[e + 1] = offs[e] + cnt[e];
        for (int r = 0; r < cnt[e]; r += KCU_BM) {
            te.push_back(e);
            tr.push_back(offs[e] + r);
        }
    }
    const int R = offs[G], NTL = (int)te.size(), SRC = 600;
    std::vector<int32_t> gat(R), gat2(R), perm(R);
    for (int r = 0; r < R; r++) {
        gat[r] = (int)(lcg(st) % SRC);
        gat2[r] = (int)(lcg(st) % SRC);
        perm[r] = r;
    }
    for (int r = R - 1; r > 0; r--) /* scatter: a permutation of the rows */
        std::swap(perm[r], perm[lcg(st) % (r + 1)]);
    std::vector<int32_t> ntl = {NTL};
    /* v7-dyn's schedule counter: zero now, and left zero by every launch */
    int32_t *d_sched = (int32_t *)dmalloc(8);
    CK(cudaMemset(d_sched, 0, 8));
    int32_t *d_offs = (int32_t *)dmalloc((G + 1) * 4), *d_te = (int32_t *)dmalloc(NTL * 4),
            *d_tr = (int32_t *)dmalloc(NTL * 4), *d_gat = (int32_t *)dmalloc(R * 4),
            *d_gat2 = (int32_t *)dmalloc(R * 4), *d_perm = (int32_t *)dmalloc(R * 4),
            *d_nt = (int32_t *)dmalloc(4);
    up(d_offs, offs.data(), (G + 1) * 4);
    up(d_te, te.data(), NTL * 4);
    up(d_tr, tr.data(), NTL * 4);
    up(d_gat, gat.data(), R * 4);
    up(d_gat2, gat2.data(), R * 4);
    up(d_perm, perm.data(), R * 4);
    up(d_nt, ntl.data(), 4);

    int fails = 0, lines = 0;
    auto report = [&](const char *mode, const st_ver &sv, double err, double tol, int bitwise,
                      const char *extra) {
        const int ok = err < tol && bitwise != 0;
        fails += !ok;
        lines++;
        printf("gemm-self %-34s %-7s err %.1e (tol %.0e)%s%s %s\n", mode, sv.name, err, tol,
               bitwise < 0 ? ""
               : bitwise   ? " ==v2"
                           : " !=v2",
               extra, ok ? "PASS" : "FAIL");
        fflush(stdout);
    };

    /* ---- rows mode: C rows r of the tile list (or M fixed) = A[src(r)] . B_e ---- */
    const int K = 384, N = 512; /* 6 k tiles: the 4-stage ring wraps */
    for (int bm = 0; bm < 2; bm++) {
        const kcu_bmode bmode = bm ? KCU_B_N : KCU_B_K;
        std::vector<float> B = rnd((size_t)G * K * N, -1.f, 1.f);
        bf16 *dB = (bf16 *)dmalloc(B.size() * 2);
        up(dB, bf_of(B).data(), B.size() * 2);
        std::vector<kcu_epi> epis = {KCU_EPI_F32, KCU_EPI_SCATTER};
        if (bm) {
            epis.push_back(KCU_EPI_DSWIGLU);
            epis.push_back(KCU_EPI_DGELU);
        } else {
            epis.push_back(KCU_EPI_SWIGLU);
            epis.push_back(KCU_EPI_GELU);
        }
        for (int gath = 0; gath < 3; gath++) { /* 0 gathered A, 1 dense A, 2 dense, M fixed */
            const int fixed = gath == 2, rows = fixed ? 300 : R, arows = gath == 0 ? SRC : rows;
            std::vector<float> A = rnd((size_t)arows * K, -1.f, 1.f);
            bf16 *dA = (bf16 *)dmalloc(A.size() * 2);
            up(dA, bf_of(A).data(), A.size() * 2);
            /* acc[r][n] in double; group of row r */
            std::vector<int> grp(rows, 0);
            if (!fixed)
                for (int e = 0; e < G; e++)
                    for (int r = offs[e]; r < offs[e + 1]; r++)
                        grp[r] = e;
            std::vector<double> acc((size_t)rows * N);
            parallel_for(rows, [&](int r) {
                const float *ar = &A[(size_t)(gath == 0 ? gat[r] : r) * K];
                const float *Be = &B[(size_t)grp[r] * K * N];
                for (int n = 0; n < N; n++) {
                    double s = 0;
                    for (int k = 0; k < K; k++)
                        s += (double)ar[k] * (bm ? Be[(size_t)k * N + n] : Be[(size_t)n * K + k]);
                    acc[(size_t)r * N + n] = s;
                }
            });
            for (kcu_epi epi : epis) {
                if (fixed && epi != KCU_EPI_F32)
                    continue;
                const int dsw = epi == KCU_EPI_DSWIGLU, dge = epi == KCU_EPI_DGELU;
                const int F = epi == KCU_EPI_SWIGLU ? N / 2 : N;
                const int ld_ab = dsw ? 2 * N : N;
                /* inputs of the backward epilogues: pre-activations, gate weights */
                std::vector<float> ab_in, gw;
                if (dsw || dge) {
                    ab_in = rnd((size_t)rows * ld_ab, -2.f, 2.f);
                    gw = rnd(rows, 0.f, 1.f);
                }
                /* references */
                std::vector<float> rC((size_t)rows * N), rH, rAB, rDW;
                for (size_t i = 0; i < rC.size(); i++)
                    rC[i] = (float)acc[i];
                if (epi == KCU_EPI_SCATTER) {
                    std::vector<float> t((size_t)rows * N);
                    for (int r = 0; r < rows; r++)
                        memcpy(&t[(size_t)perm[r] * N], &rC[(size_t)r * N], N * 4);
                    rC = t;
                }
                /* the activation of SWIGLU, GELU, DSWIGLU, DGELU */
                const kern_act act = (kern_act)(kcu_epi_act(epi) < 0 ? 0 : kcu_epi_act(epi));
                if (epi == KCU_EPI_SWIGLU || epi == KCU_EPI_GELU) {
                    rH.assign((size_t)rows * F, 0.f);
                    rAB = rC;
                    for (int r = 0; r < rows; r++)
                        for (int n = 0; n < N; n++) {
                            const float v = (float)acc[(size_t)r * N + n];
                            if (epi == KCU_EPI_GELU)
                                rH[(size_t)r * F + n] = st_act_fwd(act, v, 0.f);
                            else if (n % 16 < 8) {
                                const float u = (float)acc[(size_t)r * N + n + 8];
                                rH[(size_t)r * F + (n / 16) * 8 + n % 8] = st_act_fwd(act, v, u);
                            }
                        }
                }
                if (dsw || dge) {
                    rH.assign((size_t)rows * N, 0.f);
                    rAB = ab_in;
                    rDW.assign(rows, 0.f);
                    for (int r = 0; r < rows; r++) {
                        const double w = gw[perm[r]];
                        double dws = 0;
                        for (int f = 0; f < N; f++) {
                            const double d = acc[(size_t)r * N + f];
                            /* gated: (a, b) interleaved by 8; else a alone */
                            const size_t ia = dsw ? (size_t)r * ld_ab + (f >> 3) * 16 + (f & 7)
                                                  : (size_t)r * ld_ab + f;
                            const float a = ab_in[ia], b = dsw ? ab_in[ia + 8] : 0.f;
                            float da, db;
                            const double h0 = kern_bf16_round(st_act_fwd(act, a, b));
                            st_act_bwd(act, a, b, (float)(w * d), &da, &db);
                            rAB[ia] = da;
                            if (dsw)
                                rAB[ia + 8] = db;
                            rH[(size_t)r * N + f] = (float)(w * h0);
                            dws += d * h0;
                        }
                        rDW[r] = (float)dws;
                    }
                }
                /* device buffers */
                float *dCf = (float *)dmalloc((size_t)rows * N * 4);
                bf16 *dCb = (bf16 *)dmalloc((size_t)rows * N * 2);
                bf16 *dH = (bf16 *)dmalloc((size_t)rows * N * 2);
                bf16 *dAB = (bf16 *)dmalloc((size_t)rows * ld_ab * 2);
                float *dDW = (float *)dmalloc((size_t)rows * (N / KCU_BN) * 4);
                float *dGW = (float *)dmalloc((size_t)rows * 4 + 4);
                if (!gw.empty())
                    up(dGW, gw.data(), gw.size() * 4);
                const std::vector<uint16_t> ab_bf =
                    ab_in.empty() ? std::vector<uint16_t>() : bf_of(ab_in);
                std::vector<float> v2C, v2H, v2AB, v2DW;
                for (const st_ver &sv : ST_VERS) {
                    if (sv.v != 1 && !kcu_sm90())
                        continue; /* the portable image has v1 alone */
                    kcu_gemm_select(sv.v, sv.tma, sv.cl, sv.ts, sv.dyn ? 1 : -1);
                    CK(cudaMemset(dCf, 0xff, (size_t)rows * N * 4));
                    CK(cudaMemset(dCb, 0xff, (size_t)rows * N * 2));
                    CK(cudaMemset(dH, 0xff, (size_t)rows * N * 2));
                    CK(cudaMemset(dAB, 0xff, (size_t)rows * ld_ab * 2));
                    CK(cudaMemset(dDW, 0xff, (size_t)rows * (N / KCU_BN) * 4));
                    if (!ab_bf.empty())
                        up(dAB, ab_bf.data(), ab_bf.size() * 2);
                    kcu_gemm_args a;
                    memset(&a, 0, sizeof(a));
                    a.A = dA;
                    a.lda = K;
                    a.a_gather = gath == 0 ? d_gat : NULL;
                    a.B = dB;
                    a.ldb = bm ? N : K;
                    a.b_gstride = fixed ? 0 : (long long)K * N;
                    a.N = N;
                    a.K = K;
                    if (fixed) {
                        a.M = rows;
                    } else {
                        a.offs = d_offs;
                        a.tile_e = d_te;
                        a.tile_r0 = d_tr;
                        a.ntiles_m = d_nt;
                        a.max_tiles_m = NTL;
                    }
                    a.Cf = dCf;
                    a.Cb = dCb;
                    a.ldc = N;
                    a.scatter = d_perm;
                    a.h = dH;
                    a.F = F;
                    a.ab = dAB;
                    a.ld_ab = ld_ab;
                    a.gate_w = (dsw || dge) ? dGW : NULL;
                    a.dwpart = dDW;
                    a.sched = sv.dyn ? d_sched : NULL;
                    const int ver = kcu_gemm_version(KCU_A_K, bmode, epi, &a, NSM);
                    CKM(kcu_gemm(KCU_A_K, bmode, epi, &a, NSM, NULL));
                    CK(cudaDeviceSynchronize());
                    int32_t sched_left[2] = {0, 0};
                    down(sched_left, d_sched, 8);
                    std::vector<float> C, H, AB, DW;
                    double err = 0, tol = TOL;
                    char extra[96] = "";
                    if (epi == KCU_EPI_F32) {
                        C = dl(dCf, (size_t)rows * N);
                        err = relerr(C.data(), rC.data(), C.size());
                        tol = 1e-5;
                    } else if (epi == KCU_EPI_SCATTER) {
                        std::vector<uint16_t> cb((size_t)rows * N);
                        down(cb.data(), dCb, cb.size() * 2);
                        C = f_of(cb);
                        err = relerr(C.data(), rC.data(), C.size());
                    } else {
                        std::vector<uint16_t> hb((size_t)rows * F), abb((size_t)rows * ld_ab);
                        down(hb.data(), dH, hb.size() * 2);
                        down(abb.data(), dAB, abb.size() * 2);
                        H = f_of(hb);
                        AB = f_of(abb);
                        const double eh = relerr(H.data(), rH.data(), H.size());
                        const double ea = relerr(AB.data(), rAB.data(), AB.size());
                        err = fmax(eh, ea);
                        if (dsw || dge) {
                            const int np = N / KCU_BN;
                            std::vector<float> dw = dl(dDW, (size_t)rows * np), sums(rows);
                            for (int r = 0; r < rows; r++) {
                                double s = 0;
                                for (int j = 0; j < np; j++)
                                    s += dw[(size_t)r * np + j];
                                sums[r] = (float)s;
                            }
                            DW = dw;
                            const double ed = relerr(sums.data(), rDW.data(), rows);
                            snprintf(extra, sizeof(extra), " [h %.1e ab %.1e dw %.1e]", eh, ea, ed);
                            err = fmax(err, ed * 100); /* dw sums: tolerance 1e-4 */
                        } else {
                            snprintf(extra, sizeof(extra), " [h %.1e ab %.1e]", eh, ea);
                        }
                    }
                    int bitwise = -1;
                    if (sv.v == 2) {
                        v2C = C;
                        v2H = H;
                        v2AB = AB;
                        v2DW = DW;
                    } else if (sv.v == 4 && (ver == 4 || ver == 7)) {
                        bitwise = C == v2C && H == v2H && AB == v2AB && DW == v2DW;
                        /* NaN != NaN: a poisoned value left anywhere already fails err */
                    }
                    if (sched_left[0] || sched_left[1]) { /* the next launch would skip items */
                        bitwise = 0;
                        snprintf(extra + strlen(extra), sizeof(extra) - strlen(extra),
                                 " [sched left %d %d]", sched_left[0], sched_left[1]);
                    }
                    char mode[64], ran[16] = "";
                    if (ver != sv.v)
                        snprintf(ran, sizeof(ran), " (ran v%d)", ver);
                    snprintf(mode, sizeof(mode), "rows A_K %s %-7s %s%s", bm ? "B_N" : "B_K",
                             epi == KCU_EPI_F32       ? "F32"
                             : epi == KCU_EPI_SCATTER ? "SCATTER"
                             : epi == KCU_EPI_SWIGLU  ? "SWIGLU"
                             : epi == KCU_EPI_GELU    ? "GELU"
                             : epi == KCU_EPI_DSWIGLU ? "DSWIGLU"
                                                      : "DGELU",
                             gath == 0   ? "gathered"
                             : gath == 1 ? "dense"
                                         : "M-fixed",
                             ran);
                    report(mode, sv, err, tol, bitwise, extra);
                    if (err >= tol && epi == KCU_EPI_F32)
                        kern_print_mismatches("gemm-self", C.data(), rC.data(), C.size(), 1e-3, 8);
                }
                for (void *p :
                     {(void *)dCf, (void *)dCb, (void *)dH, (void *)dAB, (void *)dDW, (void *)dGW})
                    CK(cudaFree(p));
            }
            CK(cudaFree(dA));
        }
        CK(cudaFree(dB));
    }

    /* ---- wgrad: C_e (M,N) (+)= sum over the group's rows k of A[ga(k)]^T B[gb(k)] ---- */
    {
        /* M: 3 m-tiles, so that v9's second pair has one CTA without a tile */
        const int M = 384, NW = 512;
        for (int gcase = 0; gcase < 5; gcase++) {
            /* 0 both gathered, 1 A gathered, 2 B gathered, 3 both dense, 4 dense no offs */
            const int ga = gcase == 0 || gcase == 1, gb = gcase == 0 || gcase == 2;
            const int nooffs = gcase == 4, KF = 200, ng = nooffs ? 1 : G;
            const int krows = nooffs ? KF : R;
            std::vector<float> A = rnd((size_t)(ga ? SRC : krows) * M, -1.f, 1.f),
                               B = rnd((size_t)(gb ? SRC : krows) * NW, -1.f, 1.f);
            bf16 *dA = (bf16 *)dmalloc(A.size() * 2), *dB = (bf16 *)dmalloc(B.size() * 2);
            up(dA, bf_of(A).data(), A.size() * 2);
            up(dB, bf_of(B).data(), B.size() * 2);
            float *dC = (float *)dmalloc((size_t)ng * M * NW * 4);
            std::vector<float> ref((size_t)ng * M * NW);
            parallel_for(ng * M, [&](int em) {
                const int e = em / M, m = em % M;
                const int k0 = nooffs ? 0 : offs[e], k1 = nooffs ? KF : offs[e + 1];
                for (int n = 0; n < NW; n++) {
                    double s = 0;
                    for (int k = k0; k < k1; k++)
                        s += (double)A[(size_t)(ga ? gat[k] : k) * M + m] *
                             B[(size_t)(gb ? gat2[k] : k) * NW + n];
                    ref[(size_t)em * NW + n] = (float)s;
                }
            });
            std::vector<float> v2C;
            for (const st_ver &sv : ST_VERS) {
                if (sv.v != 1 && !kcu_sm90())
                    continue;
                kcu_gemm_select(sv.v, sv.tma, sv.cl, sv.ts, sv.dyn ? 1 : -1);
                CK(cudaMemset(dC, 0xff, (size_t)ng * M * NW * 4));
                kcu_gemm_args a;
                memset(&a, 0, sizeof(a));
                a.A = dA;
                a.lda = M;
                a.a_gather = ga ? d_gat : NULL;
                a.B = dB;
                a.ldb = NW;
                a.b_gather = gb ? d_gat2 : NULL;
                a.M = M;
                a.N = NW;
                a.K = nooffs ? KF : 0;
                a.ngroups = ng;
                a.offs = nooffs ? NULL : d_offs;
                a.Cf = dC;
                a.ldc = NW;
                a.c_gstride = (long long)M * NW;
                a.beta0 = 1;
                const int ver = kcu_gemm_version(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, NSM);
                CKM(kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, NSM, NULL));
                CK(cudaDeviceSynchronize());
                std::vector<float> C1 = dl(dC, (size_t)ng * M * NW);
                a.beta0 = 0;
                CKM(kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, NSM, NULL));
                CK(cudaDeviceSynchronize());
                std::vector<float> C2 = dl(dC, (size_t)ng * M * NW);
                const double err = relerr(C1.data(), ref.data(), C1.size());
                const int acc_ok = twice(C1, C2);
                int bitwise = -1;
                if (sv.v == 2)
                    v2C = C1;
                else if (sv.v == 4 && (ver == 4 || ver == 9))
                    bitwise = C1 == v2C;
                char mode[64], ran[16] = "";
                if (ver != sv.v)
                    snprintf(ran, sizeof(ran), " (ran v%d)", ver);
                snprintf(mode, sizeof(mode), "wgrad A_M B_N ACC %s%s",
                         gcase == 0   ? "A,B gathered"
                         : gcase == 1 ? "A gathered"
                         : gcase == 2 ? "B gathered"
                         : gcase == 3 ? "dense"
                                      : "dense, no offs",
                         ran);
                report(mode, sv, acc_ok ? err : INFINITY, 1e-5, bitwise,
                       acc_ok ? "" : " accumulate BAD");
                if (err >= 1e-5)
                    kern_print_mismatches("gemm-self wgrad", C1.data(), ref.data(), C1.size(), 1e-3,
                                          8);
            }
            CK(cudaFree(dA));
            CK(cudaFree(dB));
            CK(cudaFree(dC));
        }
    }
    kcu_gemm_select(-1, -1, -1, -1, -1); /* back to the environment's choice */
    for (int32_t *p : {d_offs, d_te, d_tr, d_gat, d_gat2, d_perm, d_nt, d_sched})
        CK(cudaFree(p));
    printf("gemm-self: %d checks, %d failed -> %s\n", lines, fails, fails ? "FAIL" : "PASS");
    fflush(stdout);
    return fails;
}

/* ---- experts-only object against kern_expert_ffn_cpu / _backward_cpu / kern_adamw_cpu ---- */
struct ecase {
    int H, F;
    kern_act act;
    std::vector<int32_t> counts;
};

static int experts_check(const ecase &c, uint64_t seed)
{
    const int H = c.H, F = c.F, ne = (int)c.counts.size();
    const int swiglu = c.act == KERN_ACT_SWIGLU;
    std::vector<int32_t> off(ne + 1, 0);
    for (int e = 0; e < ne; e++)
        off[e + 1] = off[e] + c.counts[e];
    const int N = off[ne];
    std::vector<float> w1((size_t)ne * F * H), w3((size_t)ne * F * H), w2((size_t)ne * H * F),
        x((size_t)N * H), dy((size_t)N * H);
    for (int e = 0; e < ne; e++) {
        kern_init_weight(seed, 3, e, KERN_W1, F, H, w1.data() + (size_t)e * F * H);
        kern_init_weight(seed, 3, e, KERN_W3, F, H, w3.data() + (size_t)e * F * H);
        kern_init_weight(seed, 3, e, KERN_W2, H, F, w2.data() + (size_t)e * H * F);
    }
    rng_fill_uniform(seed, 5, -1.f, 1.f, x.data(), x.size());
    rng_fill_uniform(seed, 6, -1.f, 1.f, dy.data(), dy.size());
    kern_bf16_round_n(x.data(), x.size());
    kern_bf16_round_n(dy.data(), dy.size());
    /* the uploaded weights stay fp32 (master); the compute copy is bf16 */
    std::vector<float> r1 = w1, r3 = w3, r2 = w2;
    kern_bf16_round_n(r1.data(), r1.size());
    kern_bf16_round_n(r3.data(), r3.size());
    kern_bf16_round_n(r2.data(), r2.size());

    kcu_experts *ex;
    CKM(kcu_experts_create(H, F, ne, c.act, N + 5, 1, &ex));
    CKM(kcu_experts_upload(ex, w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    CK(cudaMemset(ex->ws, 0xff, ex->ws_bytes));

    auto cpu_fwd = [&](const std::vector<float> &q1, const std::vector<float> &q3,
                       const std::vector<float> &q2, std::vector<float> &y, std::vector<float> &a,
                       std::vector<float> &b) {
        parallel_for(ne, [&](int e) {
            const size_t o = off[e];
            if (c.counts[e] == 0)
                return;
            kern_expert_ffn_cpu(&x[o * H], c.counts[e], H, F, &q1[(size_t)e * F * H],
                                &q3[(size_t)e * F * H], &q2[(size_t)e * H * F], c.act, 1, &a[o * F],
                                &b[o * F], &y[o * H]);
        });
    };
    std::vector<float> yref((size_t)N * H), a((size_t)N * F), b((size_t)N * F);
    cpu_fwd(r1, r3, r2, yref, a, b);

    /* forward: host f32 in and out, kept */
    std::vector<float> y((size_t)N * H, NAN);
    CKM(kcu_experts_forward(ex, N, x.data(), MOE_F32, c.counts.data(), y.data(), MOE_F32, 1, NULL));
    CK(cudaDeviceSynchronize());
    const double ey = relerr(y.data(), yref.data(), y.size());
    /* device bf16 in and out: the same values rounded */
    int dev_ok = 1;
    {
        std::vector<uint16_t> xb(x.size()), yb(x.size());
        for (size_t i = 0; i < x.size(); i++)
            xb[i] = kern_f32_to_bf16(x[i]);
        bf16 *dx_, *dy_;
        CK(cudaMalloc(&dx_, xb.size() * 2));
        CK(cudaMalloc(&dy_, xb.size() * 2 + 16));
        CK(cudaMemcpy(dx_, xb.data(), xb.size() * 2, cudaMemcpyHostToDevice));
        /* out 2 bytes past an aligned address: staged, not stored 8 bytes
         * at a time to a misaligned address */
        CKM(kcu_experts_forward(ex, N, dx_, MOE_BF16, c.counts.data(), dy_ + 1, MOE_BF16, 0, NULL));
        CK(cudaMemcpy(yb.data(), dy_ + 1, yb.size() * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < yb.size(); i++)
            dev_ok = dev_ok && yb[i] == kern_f32_to_bf16(y[i]);
        /* and an f32 output 4 bytes past an aligned address */
        float *df;
        std::vector<float> yf(y.size());
        CK(cudaMalloc(&df, yf.size() * 4 + 16));
        CKM(kcu_experts_forward(ex, N, dx_, MOE_BF16, c.counts.data(), df + 1, MOE_F32, 0, NULL));
        CK(cudaMemcpy(yf.data(), df + 1, yf.size() * 4, cudaMemcpyDeviceToHost));
        dev_ok = dev_ok && yf == y;
        CK(cudaFree(df));
        CK(cudaFree(dx_));
        CK(cudaFree(dy_));
    }
    /* backward (the bf16 forward above did not keep: keep again) */
    CKM(kcu_experts_forward(ex, N, x.data(), MOE_F32, c.counts.data(), y.data(), MOE_F32, 1, NULL));
    std::vector<float> dx((size_t)N * H, NAN), dxr((size_t)N * H);
    std::vector<float> g1((size_t)ne * F * H, 0.f), g3((size_t)ne * F * H, 0.f),
        g2((size_t)ne * H * F, 0.f);
    CKM(kcu_experts_backward(ex, dy.data(), MOE_F32, dx.data(), MOE_F32, NULL));
    CK(cudaDeviceSynchronize());
    const int again = kcu_experts_backward(ex, dy.data(), MOE_F32, dx.data(), MOE_F32, NULL) ==
                      MOE_EPRECOND; /* state consumed */
    parallel_for(ne, [&](int e) {
        const size_t o = off[e];
        if (c.counts[e] == 0)
            return;
        kern_expert_ffn_backward_cpu(
            &x[o * H], &a[o * F], &b[o * F], &dy[o * H], c.counts[e], H, F, &r1[(size_t)e * F * H],
            &r3[(size_t)e * F * H], &r2[(size_t)e * H * F], c.act, &dxr[o * H],
            &g1[(size_t)e * F * H], &g3[(size_t)e * F * H], &g2[(size_t)e * H * F]);
    });
    std::vector<float> G1((size_t)ne * F * H), G3((size_t)ne * F * H), G2((size_t)ne * H * F);
    CKM(kcu_experts_download_grads(ex, G1.data(), swiglu ? G3.data() : NULL, G2.data()));
    const double edx = relerr(dx.data(), dxr.data(), dx.size());
    const double e1 = relerr(G1.data(), g1.data(), G1.size());
    const double e3 = swiglu ? relerr(G3.data(), g3.data(), G3.size()) : 0.0;
    const double e2 = relerr(G2.data(), g2.data(), G2.size());
    /* accumulate: same forward/backward again, no zeroing */
    CKM(kcu_experts_forward(ex, N, x.data(), MOE_F32, c.counts.data(), y.data(), MOE_F32, 1, NULL));
    CKM(kcu_experts_backward(ex, dy.data(), MOE_F32, dx.data(), MOE_F32, NULL));
    std::vector<float> H1((size_t)ne * F * H), H3((size_t)ne * F * H), H2((size_t)ne * H * F);
    CKM(kcu_experts_download_grads(ex, H1.data(), swiglu ? H3.data() : NULL, H2.data()));
    const int acc_ok = twice(G1, H1) && (!swiglu || twice(G3, H3)) && twice(G2, H2);

    /* global norm and AdamW, two steps, on the downloaded gradients */
    double ss_g = 0;
    CKM(kcu_experts_grad_sumsq(ex, &ss_g, NULL));
    double ss_r = kern_sumsq_cpu(H1.data(), H1.size()) + kern_sumsq_cpu(H2.data(), H2.size()) +
                  (swiglu ? kern_sumsq_cpu(H3.data(), H3.size()) : 0.0);
    const double ess = fabs(ss_g - ss_r) / ss_r;
    std::vector<float> p1 = w1, p3 = w3, p2 = w2;
    std::vector<float> m1(p1.size(), 0.f), v1(p1.size(), 0.f), m3(p3.size(), 0.f),
        v3(p3.size(), 0.f), m2(p2.size(), 0.f), v2(p2.size(), 0.f);
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
    double eadam = 0;
    std::vector<float> q1(p1.size()), q3(p3.size()), q2(p2.size());
    for (int step = 1; step <= 2; step++) {
        CKM(kcu_experts_adamw(ex, lr, b1, b2, eps, wd, step, gs, NULL));
        kern_adamw_cpu(p1.data(), H1.data(), m1.data(), v1.data(), p1.size(), lr, b1, b2, eps, wd,
                       step, gs);
        if (swiglu)
            kern_adamw_cpu(p3.data(), H3.data(), m3.data(), v3.data(), p3.size(), lr, b1, b2, eps,
                           wd, step, gs);
        kern_adamw_cpu(p2.data(), H2.data(), m2.data(), v2.data(), p2.size(), lr, b1, b2, eps, wd,
                       step, gs);
        CKM(kcu_experts_download_weights(ex, q1.data(), swiglu ? q3.data() : NULL, q2.data()));
        eadam = fmax(eadam, relerr(q1.data(), p1.data(), p1.size()));
        if (swiglu)
            eadam = fmax(eadam, relerr(q3.data(), p3.data(), p3.size()));
        eadam = fmax(eadam, relerr(q2.data(), p2.data(), p2.size()));
    }
    /* the bf16 compute copy follows the master weights */
    kern_bf16_round_n(q1.data(), q1.size());
    kern_bf16_round_n(q3.data(), q3.size());
    kern_bf16_round_n(q2.data(), q2.size());
    cpu_fwd(q1, q3, q2, yref, a, b);
    CKM(kcu_experts_forward(ex, N, x.data(), MOE_F32, c.counts.data(), y.data(), MOE_F32, 0, NULL));
    CK(cudaDeviceSynchronize());
    const double ey2 = relerr(y.data(), yref.data(), y.size());
    kcu_experts_destroy(ex);

    const int ok = ey < TOL && edx < TOL && e1 < TOL && e3 < TOL && e2 < TOL && ey2 < TOL &&
                   ess < 1e-6 && eadam < 1e-6 && dev_ok && acc_ok && again;
    printf("experts H=%d F=%d %s ne=%d N=%d | y %.1e dx %.1e dw1 %.1e dw3 %.1e dw2 %.1e | "
           "bf16-io %s accum %s consumed %s | sumsq %.1e adamw %.1e y-after %.1e | %s\n",
           H, F, swiglu ? "sw" : "ge", ne, N, ey, edx, e1, e3, e2, dev_ok ? "ok" : "BAD",
           acc_ok ? "ok" : "BAD", again ? "ok" : "BAD", ess, eadam, ey2, ok ? "PASS" : "FAIL");
    fflush(stdout);
    return !ok;
}

/* ---- decode path (kcu_decode.cu): inference forwards with few rows per
 * expert, forced on (kcu_decode_override = 1), on a layer created without
 * train. Each stage is checked on the decode path's own upstream values
 * (logits -> CPU top-k, GPU top-k -> CPU layout and experts). Also: bf16
 * device input and output against the f32 run rounded, the split of the
 * k range forced to 1 and 2 warps, and the GEMM path (decode off) on the
 * same input when both pick the same experts. ---- */
struct dresult {
    double logits, probs, tw, y, y_ks1, y_ks2, y_gemm, aux, z;
    int idx_ok, layout_ok, determ_ok, bf16_ok, path_ok, ndrop, gemm_same;
};

/* y (T,H) of the CPU experts + combine on the given routing; the layout and
 * capacity (counts, offsets, perm, keep, dropped) of that routing out */
static std::vector<float> ref_decode_y(const tcase &c, const std::vector<float> &x,
                                       const std::vector<float> &w1, const std::vector<float> &w3,
                                       const std::vector<float> &w2,
                                       const std::vector<int32_t> &idx,
                                       const std::vector<float> &tw, std::vector<int32_t> &cnt,
                                       std::vector<int32_t> &off, std::vector<int32_t> &perm,
                                       std::vector<uint8_t> &keep, std::vector<int32_t> &drop)
{
    const int T = c.T, H = c.H, F = c.F, E = c.E, K = c.K, S = T * K;
    cnt.assign(E, 0);
    off.assign(E + 1, 0);
    perm.assign(S, 0);
    keep.assign(S, 0);
    drop.assign(E, 0);
    kern_layout_cpu(idx.data(), T, K, E, cnt.data(), off.data(), perm.data(), NULL);
    kern_apply_capacity_cpu(cnt.data(), off.data(), perm.data(), E, kern_capacity(c.cf, T, K, E),
                            keep.data(), drop.data());
    std::vector<float> ye((size_t)S * H, 0.f);
    parallel_for(E, [&](int e) {
        const int o = off[e], n = cnt[e] - drop[e];
        if (n <= 0)
            return;
        std::vector<float> xe((size_t)n * H), yo((size_t)n * H);
        for (int i = 0; i < n; i++)
            memcpy(&xe[(size_t)i * H], &x[(size_t)(perm[o + i] / K) * H], H * 4);
        kern_expert_ffn_cpu(xe.data(), n, H, F, &w1[(size_t)e * F * H], &w3[(size_t)e * F * H],
                            &w2[(size_t)e * H * F], c.act, 1, NULL, NULL, yo.data());
        for (int i = 0; i < n; i++)
            memcpy(&ye[(size_t)perm[o + i] * H], &yo[(size_t)i * H], H * 4);
    });
    std::vector<float> y((size_t)T * H);
    kern_combine_cpu(ye.data(), tw.data(), keep.data(), T, K, H, 1, y.data());
    return y;
}

static int decode_case(const tcase &c, uint64_t seed, dresult *r)
{
    const int T = c.T, H = c.H, F = c.F, E = c.E, K = c.K, S = T * K;
    const int swiglu = c.act == KERN_ACT_SWIGLU;
    std::vector<float> wr((size_t)E * H), w1((size_t)E * F * H), w3((size_t)E * F * H),
        w2((size_t)E * H * F), x((size_t)T * H);
    for (int e = 0; e < E; e++) {
        kern_init_weight(seed, 0, e, KERN_W1, F, H, w1.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W3, F, H, w3.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W2, H, F, w2.data() + (size_t)e * H * F);
    }
    kern_init_weight(seed, 0, 0, KERN_W_ROUTER, E, H, wr.data());
    rng_fill_uniform(seed, 1, -1.f, 1.f, x.data(), x.size());
    if (c.skew) {
        for (auto &v : x)
            v += 0.5f;
        for (int h = 0; h < H; h++) {
            wr[h] += 16.f / H;
            if (E > 1)
                wr[H + h] += 12.f / H;
        }
    }
    for (std::vector<float> *v : {&wr, &w1, &w3, &w2, &x})
        kern_bf16_round_n(v->data(), v->size());

    kcu_config cfg = {H, F, E, K, c.act, c.renorm, T, 0, c.cf};
    kcu_layer *l;
    CKM(kcu_layer_create(&cfg, &l));
    CKM(kcu_layer_upload(l, wr.data(), w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    kcu_decode_override = 1;
    kcu_decode_force_ks = 0;
    const long long calls0 = kcu_decode_calls;
    auto fwd = [&](std::vector<float> &y) {
        y.assign((size_t)T * H, NAN);
        CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
        CKM(kcu_forward(l, T, x.data(), MOE_F32, y.data(), MOE_F32, 0, NULL));
        CK(cudaDeviceSynchronize());
    };
    std::vector<float> y, y2, yk1, yk2, yg;
    fwd(y2);
    fwd(y);
    r->determ_ok = memcmp(y.data(), y2.data(), y.size() * 4) == 0;
    /* y in page-locked host memory: the last kernel writes it there
     * (KCU_Y_MAPPED, small y) or it is staged and copied - the same bytes;
     * and the statistics written into mapped memory by the last kernel
     * (KCU_STATS_MAPPED) or copied out: the same values */
    {
        float *yp = nullptr;
        CK(cudaMallocHost(&yp, y.size() * 4));
        std::vector<int32_t> cnt[2], drp[2];
        float aux[2], z[2];
        for (int m = 0; m < 2; m++) {
            memset(yp, 0xff, y.size() * 4);
            CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
            kcu_stats_mapped_override = m;
            CKM(kcu_forward(l, T, x.data(), MOE_F32, yp, MOE_F32, 0, NULL));
            cnt[m].assign(E, -1);
            drp[m].assign(E, -1);
            CKM(kcu_forward_stats(l, cnt[m].data(), drp[m].data(), &aux[m], &z[m], NULL));
            r->determ_ok = r->determ_ok && memcmp(yp, y.data(), y.size() * 4) == 0;
            if (m == 1) /* the statistics' copy is gone only where the device maps it */
                r->determ_ok = r->determ_ok && l->stats_in_host == (l->stats_map != nullptr);
        }
        kcu_stats_mapped_override = -1;
        r->determ_ok = r->determ_ok && cnt[0] == cnt[1] && drp[0] == drp[1] &&
                       memcmp(&aux[0], &aux[1], 4) == 0 && memcmp(&z[0], &z[1], 4) == 0;
        CK(cudaFreeHost(yp));
    }
    r->path_ok = kcu_decode_calls == calls0 + 4;
    route_gpu g;
    check_route(l, c, x, wr, g, r->logits, r->probs, r->tw, r->idx_ok);
    const std::vector<float> &lg = g.lg, &probs_g = g.probs, &tw_g = g.tw;
    const std::vector<int32_t> &idx_g = g.idx, &counts = g.counts, &dropped = g.dropped;
    const float aux_g = g.aux, z_g = g.z;

    std::vector<int32_t> cnt_r, off_r, perm_r, drop_r;
    std::vector<uint8_t> keep;
    const std::vector<float> yref =
        ref_decode_y(c, x, w1, w3, w2, idx_g, tw_g, cnt_r, off_r, perm_r, keep, drop_r);
    r->y = relerr(y.data(), yref.data(), y.size());
    /* layout: kept rows compacted, in stable order; spos the inverse */
    std::vector<int32_t> off_g = dl(l->offs, E + 1), perm_g = dl(l->perm, S),
                         spos_g = dl(l->spos, S);
    r->layout_ok = cnt_r == counts && drop_r == dropped;
    r->ndrop = 0;
    for (int e = 0, ko = 0; e < E && r->layout_ok; e++) {
        const int kept = cnt_r[e] - drop_r[e];
        r->ndrop += drop_r[e];
        if (off_g[e] != ko)
            r->layout_ok = 0;
        for (int i = 0; i < kept && r->layout_ok; i++)
            if (perm_g[ko + i] != perm_r[off_r[e] + i] || spos_g[perm_g[ko + i]] != ko + i)
                r->layout_ok = 0;
        for (int i = kept; i < cnt_r[e] && r->layout_ok; i++)
            if (spos_g[perm_r[off_r[e] + i]] != -1)
                r->layout_ok = 0;
        ko += kept;
        if (e == E - 1 && off_g[E] != ko)
            r->layout_ok = 0;
    }
    {
        const float aux_r = kern_aux_loss_cpu(probs_g.data(), counts.data(), T, E, K);
        const float z_r = kern_z_loss_cpu(lg.data(), T, E);
        r->aux = fabs(aux_g - aux_r) / fmax(fabs(aux_r), 1e-6);
        r->z = fabs(z_g - z_r) / fmax(fabs(z_r), 1e-6);
    }
    /* bf16 device input and output: the f32 result rounded, bit for bit */
    {
        std::vector<uint16_t> xb(x.size()), yb(x.size());
        for (size_t i = 0; i < x.size(); i++)
            xb[i] = kern_f32_to_bf16(x[i]);
        bf16 *dx_, *dy_;
        CK(cudaMalloc(&dx_, xb.size() * 2));
        CK(cudaMalloc(&dy_, xb.size() * 2));
        CK(cudaMemcpy(dx_, xb.data(), xb.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
        CKM(kcu_forward(l, T, dx_, MOE_BF16, dy_, MOE_BF16, 0, NULL));
        CK(cudaMemcpy(yb.data(), dy_, yb.size() * 2, cudaMemcpyDeviceToHost));
        r->bf16_ok = 1;
        for (size_t i = 0; i < yb.size(); i++)
            r->bf16_ok = r->bf16_ok && yb[i] == kern_f32_to_bf16(y[i]);
        CK(cudaFree(dx_));
        CK(cudaFree(dy_));
        /* bf16 x and y in page-locked host memory (a worker's shared-memory
         * rows): x copied in, y written there by the last kernel (or staged
         * beyond KCU_Y_MAPPED) - the device run's bits */
        uint16_t *hx, *hy;
        CK(cudaMallocHost(&hx, xb.size() * 2));
        CK(cudaMallocHost(&hy, yb.size() * 2));
        memcpy(hx, xb.data(), xb.size() * 2);
        memset(hy, 0xff, yb.size() * 2);
        CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
        CKM(kcu_forward(l, T, hx, MOE_BF16, hy, MOE_BF16, 0, NULL));
        CK(cudaDeviceSynchronize());
        r->bf16_ok = r->bf16_ok && memcmp(hy, yb.data(), yb.size() * 2) == 0;
        CK(cudaFreeHost(hx));
        CK(cudaFreeHost(hy));
    }
    kcu_decode_force_ks = 1;
    fwd(yk1);
    kcu_decode_force_ks = 2;
    fwd(yk2);
    kcu_decode_force_ks = 0;
    r->y_ks1 = relerr(yk1.data(), yref.data(), y.size());
    r->y_ks2 = relerr(yk2.data(), yref.data(), y.size());
    r->path_ok = r->path_ok && kcu_decode_calls == calls0 + 8;
    /* the GEMM path on the same layer and input */
    kcu_decode_override = 0;
    fwd(yg);
    kcu_decode_override = -1;
    r->path_ok = r->path_ok && kcu_decode_calls == calls0 + 8;
    r->gemm_same = dl(l->topk_idx, S) == idx_g;
    r->y_gemm = r->gemm_same ? relerr(y.data(), yg.data(), y.size()) : 0.0;
    { /* the GEMM path's counts, drops and statistics (kcu_route_small for few
       * slots, else kcu_route + kcu_stats) against the same references */
        std::vector<int32_t> cg(E), dg(E);
        float ag, zg;
        CKM(kcu_forward_stats(l, cg.data(), dg.data(), &ag, &zg, NULL));
        if (r->gemm_same) {
            r->layout_ok = r->layout_ok && cg == cnt_r && dg == drop_r;
            const float aux_r = kern_aux_loss_cpu(probs_g.data(), cg.data(), T, E, K);
            const float z_r = kern_z_loss_cpu(lg.data(), T, E);
            r->aux = fmax(r->aux, fabs(ag - aux_r) / fmax(fabs(aux_r), 1e-6));
            r->z = fmax(r->z, fabs(zg - z_r) / fmax(fabs(z_r), 1e-6));
        }
    }
    kcu_layer_destroy(l);

    const double v[] = {r->logits, r->probs,  r->tw,  r->y, r->y_ks1,
                        r->y_ks2,  r->y_gemm, r->aux, r->z};
    int ok = r->idx_ok && r->layout_ok && r->determ_ok && r->bf16_ok && r->path_ok;
    for (double d : v)
        ok = ok && d < TOL;
    return ok;
}

/* experts object without train, decode path forced: rows grouped by counts */
static int experts_decode_check(const ecase &c, uint64_t seed)
{
    const int H = c.H, F = c.F, ne = (int)c.counts.size();
    const int swiglu = c.act == KERN_ACT_SWIGLU;
    std::vector<int32_t> off(ne + 1, 0);
    for (int e = 0; e < ne; e++)
        off[e + 1] = off[e] + c.counts[e];
    const int N = off[ne];
    std::vector<float> w1((size_t)ne * F * H), w3((size_t)ne * F * H), w2((size_t)ne * H * F),
        x((size_t)N * H);
    for (int e = 0; e < ne; e++) {
        kern_init_weight(seed, 4, e, KERN_W1, F, H, w1.data() + (size_t)e * F * H);
        kern_init_weight(seed, 4, e, KERN_W3, F, H, w3.data() + (size_t)e * F * H);
        kern_init_weight(seed, 4, e, KERN_W2, H, F, w2.data() + (size_t)e * H * F);
    }
    rng_fill_uniform(seed, 7, -1.f, 1.f, x.data(), x.size());
    for (std::vector<float> *v : {&w1, &w3, &w2, &x})
        kern_bf16_round_n(v->data(), v->size());
    std::vector<float> yref((size_t)N * H);
    parallel_for(ne, [&](int e) {
        const size_t o = off[e];
        if (c.counts[e] == 0)
            return;
        kern_expert_ffn_cpu(&x[o * H], c.counts[e], H, F, &w1[(size_t)e * F * H],
                            &w3[(size_t)e * F * H], &w2[(size_t)e * H * F], c.act, 1, NULL, NULL,
                            &yref[o * H]);
    });
    kcu_experts *ex;
    CKM(kcu_experts_create(H, F, ne, c.act, N + 3, 0, &ex));
    CKM(kcu_experts_upload(ex, w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    kcu_decode_override = 1;
    const long long calls0 = kcu_decode_calls;
    std::vector<float> y((size_t)N * H, NAN), y2((size_t)N * H, NAN), yk((size_t)N * H, NAN);
    CK(cudaMemset(ex->ws, 0xff, ex->ws_bytes));
    CKM(kcu_experts_forward(ex, N, x.data(), MOE_F32, c.counts.data(), y.data(), MOE_F32, 0, NULL));
    CK(cudaMemset(ex->ws, 0xff, ex->ws_bytes));
    CKM(kcu_experts_forward(ex, N, x.data(), MOE_F32, c.counts.data(), y2.data(), MOE_F32, 0,
                            NULL));
    kcu_decode_force_ks = 1;
    CKM(kcu_experts_forward(ex, N, x.data(), MOE_F32, c.counts.data(), yk.data(), MOE_F32, 0,
                            NULL));
    kcu_decode_force_ks = 0;
    CK(cudaDeviceSynchronize());
    const int det = memcmp(y.data(), y2.data(), y.size() * 4) == 0;
    const double ey = relerr(y.data(), yref.data(), y.size());
    const double ek = relerr(yk.data(), yref.data(), y.size());
    int dev_ok = 1;
    {
        std::vector<uint16_t> xb(x.size()), yb(x.size());
        for (size_t i = 0; i < x.size(); i++)
            xb[i] = kern_f32_to_bf16(x[i]);
        bf16 *dx_, *dy_;
        CK(cudaMalloc(&dx_, xb.size() * 2));
        CK(cudaMalloc(&dy_, xb.size() * 2));
        CK(cudaMemcpy(dx_, xb.data(), xb.size() * 2, cudaMemcpyHostToDevice));
        CKM(kcu_experts_forward(ex, N, dx_, MOE_BF16, c.counts.data(), dy_, MOE_BF16, 0, NULL));
        CK(cudaMemcpy(yb.data(), dy_, yb.size() * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < yb.size(); i++)
            dev_ok = dev_ok && yb[i] == kern_f32_to_bf16(y[i]);
        CK(cudaFree(dx_));
        CK(cudaFree(dy_));
    }
    const int path = kcu_decode_calls == calls0 + 4;
    kcu_decode_override = -1;
    kcu_experts_destroy(ex);
    const int ok = ey < TOL && ek < TOL && det && dev_ok && path;
    printf("experts-decode H=%d F=%d %s ne=%d N=%d | y %.1e y(ks=1) %.1e | det %s bf16-io %s "
           "path %s | %s\n",
           H, F, swiglu ? "sw" : "ge", ne, N, ey, ek, det ? "ok" : "BAD", dev_ok ? "ok" : "BAD",
           path ? "ok" : "BAD", ok ? "PASS" : "FAIL");
    fflush(stdout);
    return !ok;
}

/* ---- routing families (kcu_route_config, kern_cuda.h "Routing families") ----
 * An inference forward of a layer with a routing family and shared experts
 * against the whole-layer oracle kern_moe_forward_ref (bf16): y within the
 * bf16 tolerance, counts and dropped (E routed experts) equal, aux and z
 * close. x (multiples of 1/64 in [-1, 1]) and wr (multiples of 1/1024 in
 * [-1/16, 1/16]) are chosen so that every partial sum of a logit is exact in
 * fp32: the GPU's logits equal the oracle's whatever the summation order, so
 * the two sides choose the same experts (no near-tie flips). Besides, the
 * CPU routing (kern_route_cpu) run on the GPU's own logits gives the GPU's
 * expert indices exactly and its weights and scores within tolerance, and
 * the shared slots hold experts E.. with weight 1 or sigmoid(logit E). With
 * decode set (inference), the decode path (kcu_decode.cu: the family router
 * between its kernels, shared experts in its layout or, held apart, added
 * in its combine) must be taken by each forward - forced on (decode 1), or
 * by the default thresholds (decode 2: KCU_DECODE* unset) - and besides:
 * bf16 device input and output give the f32 result rounded, bit for bit;
 * the general path on the same layer and input gives the same routing bit
 * for bit (probs, topk_idx, topk_w: the same family router on the same
 * exact logits), the same counts, and y within the tolerance. With train
 * set, a backward
 * (aux and z coefficients on) against kern_moe_backward_ref_g: dx, dwr,
 * dw1, dw3, dw2, and the shared expert's dws1, dws3, dws2 (reassembled by
 * kcu_layer_download_shared_grads) and dwsg, each within the tolerance.
 * E + m > 256: the layer holds the shared expert apart (kcu_layer.sh, no
 * shared slots in the layout; checked to be so exactly then); the same
 * comparisons, the gate and shared slots aside. */
struct fcase {
    const char *name;
    int T, H, F, E, K;
    kern_act act;
    int renorm, scoring, n_group, topk_group, group_topn;
    float scale;
    int m;    /* shared experts: Fs = m * F (0: none) */
    int gate; /* shared gate sigmoid(x . wsg) */
    int bias; /* 1: random choice bias; 2: an all-zero bias (the family router on a plain routing)
               */
    float cf;
    int decode; /* inference: 1 the decode path forced on, 2 by its default thresholds; both
                 * must take it */
    int train;
};

static int family_case(const fcase &c, uint64_t seed)
{
    const int T = c.T, H = c.H, F = c.F, E = c.E, K = c.K, m = c.m, Fs = c.m * c.F;
    const int swiglu = c.act == KERN_ACT_SWIGLU;
    std::vector<float> wr((size_t)E * H), w1((size_t)E * F * H), w3((size_t)E * F * H),
        w2((size_t)E * H * F), x((size_t)T * H), bias(E, 0.f);
    std::vector<float> ws1((size_t)Fs * H + 1), ws3((size_t)Fs * H + 1), ws2((size_t)H * Fs + 1),
        wsg(H);
    for (int e = 0; e < E; e++) {
        kern_init_weight(seed, 0, e, KERN_W1, F, H, w1.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W3, F, H, w3.data() + (size_t)e * F * H);
        kern_init_weight(seed, 0, e, KERN_W2, H, F, w2.data() + (size_t)e * H * F);
    }
    if (Fs > 0) { /* the shared expert: (Fs,H), (Fs,H), (H,Fs) */
        kern_init_weight(seed, 1, 0, KERN_W1, Fs, H, ws1.data());
        kern_init_weight(seed, 1, 0, KERN_W3, Fs, H, ws3.data());
        kern_init_weight(seed, 1, 0, KERN_W2, H, Fs, ws2.data());
    }
    /* the shared gate's row exact too (as wr below): the decode router and
     * the general path's router GEMM sum x . wsg in different orders, and
     * their routing is compared bit for bit */
    rng_fill_uniform(seed, 5, -1.f, 1.f, wsg.data(), wsg.size());
    for (auto &v : wsg)
        v = rintf(v * 64.f) / 1024.f;
    if (c.bias == 1)
        rng_fill_uniform(seed, 6, -0.05f, 0.05f, bias.data(), bias.size());
    /* exact logits: x = i/64, wr = j/1024 with |i|, |j| <= 64: products are
     * multiples of 2^-16 below 2^-4 in size, H of them sum below 2^4 */
    rng_fill_uniform(seed, 1, -1.f, 1.f, x.data(), x.size());
    for (auto &v : x)
        v = rintf(v * 64.f) / 64.f;
    rng_fill_uniform(seed, 7, -1.f, 1.f, wr.data(), wr.size());
    for (auto &v : wr)
        v = rintf(v * 64.f) / 1024.f;
    for (auto *w : {&w1, &w3, &w2, &ws1, &ws3, &ws2, &wsg})
        kern_bf16_round_n(w->data(), w->size());

    kcu_config cfg = {H, F, E, K, c.act, c.renorm, T, c.train, c.cf};
    kcu_route_config rc = {c.scoring, c.n_group, c.topk_group, c.group_topn, c.scale, m, c.gate};
    kcu_layer *l;
    CKM(kcu_layer_create_ex(&cfg, &rc, &l));
    /* Kt slots a token: K routed and ms = m shared ones, or ms = 0 with the
     * shared expert held apart (E + m > 256: l->sh, no shared slots) */
    const int Kt = kcu_nslot(l), ms = Kt - K, apart = l->sh != NULL;
    CKM(kcu_layer_upload(l, wr.data(), w1.data(), swiglu ? w3.data() : NULL, w2.data()));
    if (c.bias)
        CKM(kcu_layer_upload_bias(l, bias.data()));
    if (m > 0)
        CKM(kcu_layer_upload_shared(l, ws1.data(), swiglu ? ws3.data() : NULL, ws2.data(),
                                    c.gate ? wsg.data() : NULL));

    /* ---- forward (poisoned workspace and output) ---- */
    std::vector<float> y((size_t)T * H, NAN), y2((size_t)T * H, NAN);
    const int dec_mode = c.decode == 2 ? -1 : 1; /* kcu_decode_override for the decode checks */
    if (c.decode)
        kcu_decode_override = dec_mode;
    /* inference with decode set: decode forwards per layer forward - the
     * layer's, and a shared expert held apart's (a kcu_experts of T rows,
     * inside the layer's decode forward) where its own thresholds take it */
    int dec_calls = 0;
    if (c.decode && !c.train) {
        const int32_t rows_t = T;
        dec_calls = 1 + (apart && kcu_decode_use_experts(l->sh, T, &rows_t, 0));
    }
    const long long calls0 = kcu_decode_calls;
    CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
    CKM(kcu_forward(l, T, x.data(), MOE_F32, y2.data(), MOE_F32, c.train, NULL));
    CK(cudaDeviceSynchronize());
    CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
    CKM(kcu_forward(l, T, x.data(), MOE_F32, y.data(), MOE_F32, c.train, NULL));
    CK(cudaDeviceSynchronize());
    int path_ok = kcu_decode_calls - calls0 == 2 * dec_calls;
    kcu_decode_override = 0;
    const int det_ok = memcmp(y.data(), y2.data(), y.size() * 4) == 0;
    std::vector<int32_t> counts(E), dropped(E);
    float aux = 0.f, z = 0.f;
    CKM(kcu_forward_stats(l, counts.data(), dropped.data(), &aux, &z, NULL));

    /* ---- the oracle ---- */
    kern_moe_shape sh;
    memset(&sh, 0, sizeof(sh));
    sh.T = T, sh.H = H, sh.F = F, sh.E = E, sh.K = K, sh.act = c.act, sh.renorm = c.renorm;
    sh.capacity_factor = c.cf, sh.bf16 = 1;
    sh.scoring = (kern_scoring)c.scoring, sh.n_group = c.n_group, sh.topk_group = c.topk_group;
    sh.group_topn = c.group_topn, sh.route_scale = c.scale, sh.Fs = Fs, sh.shared_gate = c.gate;
    kern_layer_weights lw = {wr.data(),
                             w1.data(),
                             swiglu ? w3.data() : NULL,
                             w2.data(),
                             c.bias ? bias.data() : NULL,
                             Fs ? ws1.data() : NULL,
                             Fs && swiglu ? ws3.data() : NULL,
                             Fs ? ws2.data() : NULL,
                             c.gate ? wsg.data() : NULL};
    std::vector<float> yref((size_t)T * H);
    std::vector<int32_t> counts_r(E), dropped_r(E);
    kern_fwd_stats st = {counts_r.data(), dropped_r.data(), 0.f, 0.f};
    CKM(kern_moe_forward_ref(&sh, &lw, x.data(), yref.data(), &st));
    const double ey = relerr(y.data(), yref.data(), y.size());
    const int cnt_ok = counts == counts_r && dropped == dropped_r;
    const double eaux = fabs(aux - st.aux_loss) / fmax(fabs(st.aux_loss), 1e-6);
    const double ez = fabs(z - st.z_loss) / fmax(fabs(st.z_loss), 1e-6);

    /* ---- the routing on the GPU's own logits ---- */
    const std::vector<float> lg_pad = dl(l->logits, (size_t)T * l->Ep);
    std::vector<float> lg((size_t)T * E), lref((size_t)T * E);
    for (int t = 0; t < T; t++)
        memcpy(&lg[(size_t)t * E], &lg_pad[(size_t)t * l->Ep], E * 4);
    kern_router_logits_cpu(x.data(), wr.data(), T, H, E, lref.data());
    const int logits_exact = lg == lref;
    const std::vector<float> probs_g = dl(l->probs, (size_t)T * E),
                             tw_g = dl(l->topk_w, (size_t)T * Kt);
    const std::vector<int32_t> idx_g = dl(l->topk_idx, (size_t)T * Kt);
    kern_route_cfg rcc = kern_route_of_shape(&sh, &lw);
    std::vector<float> probs_r((size_t)T * E), tw_r((size_t)T * K), twg_r((size_t)T * K);
    std::vector<int32_t> idx_r((size_t)T * K);
    kern_route_cpu(lg.data(), T, E, K, &rcc, probs_r.data(), idx_r.data(), tw_r.data());
    int idx_ok = 1;
    std::vector<float> gate_g, gate_r;
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < K; j++) {
            idx_ok &= idx_g[(size_t)t * Kt + j] == idx_r[(size_t)t * K + j];
            twg_r[(size_t)t * K + j] = tw_g[(size_t)t * Kt + j];
        }
        const float gl = lg_pad[(size_t)t * l->Ep + E];
        const float g = c.gate ? 1.f / (1.f + expf(-gl)) : 1.f;
        for (int j = 0; j < ms; j++) {
            idx_ok &= idx_g[(size_t)t * Kt + K + j] == E + j;
            gate_g.push_back(tw_g[(size_t)t * Kt + K + j]);
            gate_r.push_back(g);
        }
    }
    const double eprobs = relerr(probs_g.data(), probs_r.data(), probs_r.size());
    const double etw = relerr(twg_r.data(), tw_r.data(), tw_r.size());
    const double egate = ms ? relerr(gate_g.data(), gate_r.data(), gate_r.size()) : 0.0;

    /* ---- decode set: bf16 device input and output against the f32 y
     * rounded (bit for bit), then the general path on the same input: the
     * same routing bit for bit, the same counts, y within the tolerance ---- */
    int bf16_ok = 1, gemm_same = 1;
    double ey_gemm = 0.0;
    if (dec_calls) {
        std::vector<uint16_t> xb16(x.size()), yb16(x.size());
        for (size_t i = 0; i < x.size(); i++)
            xb16[i] = kern_f32_to_bf16(x[i]); /* exact: x = i/64 */
        bf16 *dx_, *dy_;
        CK(cudaMalloc(&dx_, xb16.size() * 2));
        CK(cudaMalloc(&dy_, xb16.size() * 2));
        CK(cudaMemcpy(dx_, xb16.data(), xb16.size() * 2, cudaMemcpyHostToDevice));
        kcu_decode_override = dec_mode;
        const long long c1 = kcu_decode_calls;
        CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
        CKM(kcu_forward(l, T, dx_, MOE_BF16, dy_, MOE_BF16, 0, NULL));
        CK(cudaMemcpy(yb16.data(), dy_, yb16.size() * 2, cudaMemcpyDeviceToHost));
        path_ok = path_ok && kcu_decode_calls - c1 == dec_calls;
        for (size_t i = 0; i < yb16.size(); i++)
            bf16_ok = bf16_ok && yb16[i] == kern_f32_to_bf16(y[i]);
        CK(cudaFree(dx_));
        CK(cudaFree(dy_));
        /* the general path (kcu_route + GEMMs, the shared expert apart by
         * kcu_shared_combine): decode off */
        kcu_decode_override = 0;
        const long long c2 = kcu_decode_calls;
        std::vector<float> yg((size_t)T * H, NAN);
        CK(cudaMemset(l->ws, 0xff, l->ws_bytes));
        CKM(kcu_forward(l, T, x.data(), MOE_F32, yg.data(), MOE_F32, 0, NULL));
        CK(cudaDeviceSynchronize());
        path_ok = path_ok && kcu_decode_calls == c2;
        std::vector<int32_t> cg(E), dg(E);
        CKM(kcu_forward_stats(l, cg.data(), dg.data(), NULL, NULL, NULL));
        gemm_same = dl(l->probs, (size_t)T * E) == probs_g &&
                    dl(l->topk_idx, (size_t)T * Kt) == idx_g &&
                    dl(l->topk_w, (size_t)T * Kt) == tw_g && cg == counts && dg == dropped;
        ey_gemm = relerr(y.data(), yg.data(), y.size());
    }

    /* ---- backward against kern_moe_backward_ref_g: dx, the routed
     * experts' and the router's gradients, the shared expert's (reassembled
     * from the extra experts) and its gate's ---- */
    double edx = 0, edwr = 0, edw1 = 0, edw3 = 0, edw2 = 0, eds1 = 0, eds3 = 0, eds2 = 0, edsg = 0;
    if (c.train) {
        const float aux_c = 0.01f, z_c = 0.001f;
        std::vector<float> dy((size_t)T * H), dx((size_t)T * H, NAN), dx_r((size_t)T * H);
        rng_fill_uniform(seed, 2, -1.f, 1.f, dy.data(), dy.size());
        kern_bf16_round_n(dy.data(), dy.size());
        CKM(kcu_backward(l, dy.data(), MOE_F32, dx.data(), MOE_F32, aux_c, z_c, NULL, 0, NULL));
        CK(cudaDeviceSynchronize());
        std::vector<float> g_wr((size_t)E * H), g_w1((size_t)E * F * H), g_w3((size_t)E * F * H),
            g_w2((size_t)E * H * F), g_s1((size_t)Fs * H + 1), g_s3((size_t)Fs * H + 1),
            g_s2((size_t)H * Fs + 1), g_sg(H);
        std::vector<float> r_wr = g_wr, r_w1 = g_w1, r_w3 = g_w3, r_w2 = g_w2, r_s1 = g_s1,
                           r_s3 = g_s3, r_s2 = g_s2, r_sg = g_sg;
        CKM(kcu_layer_download_grads(l, g_wr.data(), g_w1.data(), swiglu ? g_w3.data() : NULL,
                                     g_w2.data()));
        if (m > 0)
            CKM(kcu_layer_download_shared_grads(l, g_s1.data(), swiglu ? g_s3.data() : NULL,
                                                g_s2.data(), c.gate ? g_sg.data() : NULL));
        kern_layer_grads rg = {r_wr.data(),
                               r_w1.data(),
                               swiglu ? r_w3.data() : NULL,
                               r_w2.data(),
                               Fs ? r_s1.data() : NULL,
                               Fs && swiglu ? r_s3.data() : NULL,
                               Fs ? r_s2.data() : NULL,
                               c.gate ? r_sg.data() : NULL};
        CKM(kern_moe_backward_ref_g(&sh, &lw, x.data(), dy.data(), aux_c, z_c, dx_r.data(), &rg));
        edx = relerr(dx.data(), dx_r.data(), dx.size());
        edwr = relerr(g_wr.data(), r_wr.data(), r_wr.size());
        edw1 = relerr(g_w1.data(), r_w1.data(), r_w1.size());
        edw3 = swiglu ? relerr(g_w3.data(), r_w3.data(), r_w3.size()) : 0.0;
        edw2 = relerr(g_w2.data(), r_w2.data(), r_w2.size());
        if (m > 0) {
            const size_t fh = (size_t)Fs * H;
            eds1 = relerr(g_s1.data(), r_s1.data(), fh);
            eds3 = swiglu ? relerr(g_s3.data(), r_s3.data(), fh) : 0.0;
            eds2 = relerr(g_s2.data(), r_s2.data(), fh);
            edsg = c.gate ? relerr(g_sg.data(), r_sg.data(), H) : 0.0;
        }
    }
    const int apart_ok = apart == (E + m > 256); /* held apart exactly when E + m > 256 */
    kcu_layer_destroy(l);

    const double ev[] = {ey,   eaux, ez,   eprobs, etw,  egate, edx,  edwr,
                         edw1, edw3, edw2, eds1,   eds3, eds2,  edsg, ey_gemm};
    int ok = cnt_ok && idx_ok && det_ok && path_ok && apart_ok && bf16_ok && gemm_same;
    for (double d : ev)
        ok = ok && d < TOL; /* NaN compares false */
    printf("%-12s T=%-4d E=%-3d K=%d m=%d%s %s cf=%g | y %.1e probs %.1e topk_w %.1e gate %.1e aux "
           "%.1e z %.1e | logits %s idx %s counts %s det %s path %s | %s\n",
           c.name, T, E, K, m, apart ? (apart_ok ? " apart" : " apart BAD") : "",
           swiglu ? "sw" : "ge", c.cf, ey, eprobs, etw, egate, eaux, ez,
           logits_exact ? "exact" : "inexact", idx_ok ? "ok" : "BAD", cnt_ok ? "ok" : "BAD",
           det_ok ? "ok" : "BAD", path_ok ? "ok" : "BAD", ok ? "PASS" : "FAIL");
    if (dec_calls)
        printf("%-12s   decode (%s) | bf16-io %s | general path: routing %s, y %.1e\n", "",
               c.decode == 2 ? "default thresholds" : "forced", bf16_ok ? "ok" : "BAD",
               gemm_same ? "same" : "BAD", ey_gemm);
    if (c.train)
        printf("%-12s   backward | dx %.1e dwr %.1e dw1 %.1e dw3 %.1e dw2 %.1e | dws1 %.1e dws3 "
               "%.1e dws2 %.1e dwsg %.1e\n",
               "", edx, edwr, edw1, edw3, edw2, eds1, eds3, eds2, edsg);
    if (!cnt_ok)
        for (int e = 0; e < E; e++)
            if (counts[e] != counts_r[e] || dropped[e] != dropped_r[e])
                fprintf(stderr, "  expert %d: counts %d vs %d, dropped %d vs %d\n", e, counts[e],
                        counts_r[e], dropped[e], dropped_r[e]);
    fflush(stdout);
    return !ok;
}

/* shapes and settings kcu_layer_create_ex and kcu_shared_split refuse */
static int family_refusals(void)
{
    struct bad {
        int E, K;
        kcu_route_config r;
    } bads[] = {
        {64, 8, {2, 0, 0, 0, 0.f, 0, 0}},    /* scoring */
        {64, 8, {1, 6, 3, 2, 0.f, 0, 0}},    /* n_group does not divide E */
        {256, 8, {1, 128, 4, 2, 0.f, 0, 0}}, /* n_group > KCU_MAX_GROUPS */
        {64, 8, {1, 8, 9, 2, 0.f, 0, 0}},    /* topk_group > n_group */
        {64, 8, {1, 32, 3, 2, 0.f, 0, 0}},   /* K > topk_group * E / n_group */
        {64, 8, {1, 8, 4, 3, 0.f, 0, 0}},    /* group_topn */
        {64, 8, {1, 8, 4, 2, -1.f, 0, 0}},   /* route_scale */
        {64, 8, {0, 0, 0, 0, 0.f, 0, 1}},    /* a gate without shared experts */
        {250, 8, {0, 0, 0, 0, 0.f, 257, 0}}, /* E + m > 256, held apart: m F > 65536 */
        {64, 8, {0, 0, 0, 0, 0.f, -1, 0}},   /* m < 0 */
    };
    int ok = 1;
    for (const bad &b : bads) {
        kcu_config cfg = {256, 256, b.E, b.K, KERN_ACT_SWIGLU, 1, 16, 0, 0.f};
        kcu_layer *l = NULL;
        const int refused = kcu_layer_create_ex(&cfg, &b.r, &l) == MOE_EINVAL && l == NULL;
        if (!refused)
            kcu_layer_destroy(l);
        ok &= refused;
    }
    { /* E + m > 256 with two states: the shared expert held apart keeps one forward */
        kcu_config cfg = {256, 256, 256, 8, KERN_ACT_SWIGLU, 1, 16, 1, 0.f, 0, 2};
        const kcu_route_config r = {1, 8, 4, 2, 2.5f, 1, 0};
        kcu_layer *l = NULL;
        const int refused = kcu_layer_create_ex(&cfg, &r, &l) == MOE_EINVAL && l == NULL;
        if (!refused)
            kcu_layer_destroy(l);
        ok &= refused;
    }
    int m = -1;
    ok &= kcu_shared_split(384, 256, &m) == MOE_EINVAL &&
          kcu_shared_split(-256, 256, &m) == MOE_EINVAL;
    ok &= kcu_shared_split(1024, 256, &m) == MOE_OK && m == 4;
    ok &= kcu_shared_split(0, 256, &m) == MOE_OK && m == 0;
    printf("family refusals (bad routing shapes, Fs %% F != 0) | %s\n", ok ? "PASS" : "FAIL");
    fflush(stdout);
    return !ok;
}

int main(int argc, char **argv)
{
    int small = 0, gemm_only = 0, families_only = 0, pipelined_only = 0, swapped_only = 0;
    uint64_t seed = 0x5eed;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small"))
            small = 1;
        else if (!strcmp(argv[i], "--gemm-only"))
            gemm_only = 1;
        else if (!strcmp(argv[i], "--families"))
            families_only = 1;
        else if (!strcmp(argv[i], "--pipelined"))
            pipelined_only = 1;
        else if (!strcmp(argv[i], "--swapped"))
            swapped_only = 1;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 0);
        else {
            fprintf(stderr,
                    "usage: %s [--small | --gemm-only | --families | --pipelined | --swapped] "
                    "[--seed N]\n",
                    argv[0]);
            return 2;
        }
    }
    {
        cudaDeviceProp prop;
        int ptx = 0, bin = 0;
        CK(cudaGetDeviceProperties(&prop, 0));
        if (kcu_arch_image(&ptx, &bin) != 0) {
            printf("check-gpu: no kernel image of this build loads on %s (sm_%d%d) -> FAIL\n",
                   prop.name, prop.major, prop.minor);
            return 1;
        }
        printf("device %s (sm_%d%d): image compute_%d / sm_%d -> %s\n", prop.name, prop.major,
               prop.minor, ptx, bin, kcu_arch_name());
    }
    const kern_act SW = KERN_ACT_SWIGLU, GE = KERN_ACT_GELU;
    kcu_decode_override = 0; /* the GEMM path; the decode checks below force it on */
    /* routing families and shared experts against kern_moe_forward_ref:
     * name T H F E K act renorm scoring n_group topk_group group_topn scale
     * m gate bias cf decode train */
    const int SM = KERN_SCORE_SOFTMAX, SG = KERN_SCORE_SIGMOID;
    std::vector<fcase> fcases = {
        {"mixtral-fam", 200, 256, 256, 64, 8, SW, 1, SM, 0, 0, 0, 0.f, 0, 0, 2, 0.f, 0, 1},
        {"deepseek-v3", 200, 256, 256, 64, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 0, 1},
        {"deepseek-v3", 5, 256, 256, 64, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 1, 0},
        {"deepseek-v2", 200, 256, 256, 64, 6, SW, 0, SM, 8, 3, 1, 16.f, 2, 0, 0, 0.f, 0, 1},
        {"deepseek-v2", 1, 256, 256, 64, 6, SW, 0, SM, 8, 3, 1, 16.f, 2, 0, 0, 0.f, 1, 0},
        {"qwen2-moe", 200, 256, 256, 64, 8, SW, 0, SM, 0, 0, 0, 0.f, 4, 1, 0, 0.f, 0, 1},
        {"qwen2-moe", 8, 256, 256, 64, 8, SW, 0, SM, 0, 0, 0, 0.f, 4, 1, 0, 0.f, 1, 0},
        /* E + m > 256: the shared expert held apart (kcu_layer.sh): the
         * DeepSeek-V3 layer (256 routed + 1 shared), forward and backward at
         * T 300 and 4, an inference forward with the decode path forced on
         * (taken by the layer and by the shared expert's kcu_experts), and
         * a gated shared expert of d_ff 8 F beside 250 experts */
        {"v3-256", 300, 256, 128, 256, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 0, 1},
        {"v3-256", 4, 256, 128, 256, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 0, 1},
        {"v3-256", 4, 256, 128, 256, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 1, 0},
        {"e250-m8-gate", 300, 256, 128, 250, 8, SW, 0, SM, 0, 0, 0, 0.f, 8, 1, 0, 0.f, 0, 1}};
    /* the decode path with the families (inference, bf16 weights): a
     * DeepSeek-V3-like layer (sigmoid + bias, 8 groups of which 4 kept,
     * top-8, renormalised, x2.5, one shared expert: in the layout at E = 64,
     * held apart at E = 256) and a Qwen2-MoE-like one (softmax, no
     * renormalisation, a gated shared expert of d_ff 4 F: 4 experts in the
     * layout), at T 1, 4, 16, 64
     * with the path forced on, then with the default thresholds where they
     * take it (families: T K_t <= E_t) */
    for (int T : {1, 4, 16, 64}) {
        fcases.push_back(
            {"v3-dec", T, 256, 256, 64, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 1, 0});
        fcases.push_back(
            {"v3-256-dec", T, 256, 128, 256, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 1, 0});
        fcases.push_back(
            {"qwen2-dec", T, 256, 256, 64, 8, SW, 0, SM, 0, 0, 0, 0.f, 4, 1, 0, 0.f, 1, 0});
    }
    fcases.push_back({"v3-dec", 4, 256, 256, 64, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 2, 0});
    fcases.push_back(
        {"v3-256-dec", 32, 256, 128, 256, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 2, 0});
    fcases.push_back(
        {"v3-256-dec", 1, 256, 128, 256, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 0.f, 2, 0});
    fcases.push_back(
        {"qwen2-dec", 4, 256, 256, 64, 8, SW, 0, SM, 0, 0, 0, 0.f, 4, 1, 0, 0.f, 2, 0});
    if (!small) {
        const std::vector<fcase> more = {
            {"v3-cap", 200, 256, 256, 64, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 0, 1, 1.0f, 0, 1},
            {"v2-gelu", 200, 256, 256, 64, 6, GE, 0, SM, 8, 3, 1, 16.f, 2, 0, 0, 0.f, 0, 1},
            {"qwen2-moe", 3, 256, 256, 64, 8, SW, 0, SM, 0, 0, 0, 0.f, 4, 1, 0, 0.f, 1, 0},
            {"v3-e255", 300, 256, 256, 255, 8, SW, 1, SG, 5, 2, 2, 2.5f, 1, 1, 1, 0.f, 0, 1},
            /* many layout chunks, the router gradient split over tokens */
            {"v3-t1024", 1024, 256, 256, 64, 8, SW, 1, SG, 8, 4, 2, 2.5f, 1, 1, 1, 0.f, 0, 1}};
        fcases.insert(fcases.end(), more.begin(), more.end());
    }
    auto family_checks = [&]() {
        int nf = 0;
        printf("routing families (kcu_route_config) vs kern_moe_forward_ref\n");
        for (size_t i = 0; i < fcases.size(); i++)
            nf += family_case(fcases[i], seed + 419 * i);
        nf += family_refusals();
        return nf;
    };
    /* kcu_forward_pipelined against one kcu_forward (host x, y) */
    const moe_dtype B16 = MOE_BF16, F32 = MOE_F32;
    std::vector<pcase> pcases;
    if (small)
        pcases = {{1000, 128, 128, 16, 2, SW, 256, B16, B16, 0, 0.f},
                  {1000, 128, 128, 16, 2, GE, 300, F32, F32, 1, 0.f}};
    else
        pcases = {/* T K = 2000 slots: the small router for the batch and its chunks */
                  {1000, 256, 256, 16, 2, SW, 256, B16, B16, 0, 0.f},
                  {1000, 256, 256, 16, 2, SW, 300, B16, B16, 1, 0.f},
                  {1000, 256, 256, 16, 2, GE, 256, F32, F32, 0, 0.f},
                  {1000, 256, 256, 16, 2, GE, 300, F32, B16, 1, 0.f},
                  {1000, 256, 256, 16, 2, SW, 300, B16, F32, 0, 0.f},
                  /* the router GEMM and kcu_route (T K > 2048) */
                  {3000, 256, 256, 16, 2, SW, 1024, B16, B16, 1, 0.f},
                  {3000, 256, 256, 16, 2, GE, 700, F32, F32, 0, 0.f},
                  {5000, 256, 256, 128, 8, SW, 2048, B16, B16, 0, 0.f},
                  /* a capacity factor: one kcu_forward */
                  {1000, 256, 256, 16, 2, SW, 300, B16, B16, 0, 1.0f},
                  {3000, 256, 256, 16, 2, GE, 700, F32, F32, 1, 1.25f},
                  /* a routing family and a gated shared expert (counts over E routed) */
                  {1000, 256, 256, 16, 2, SW, 300, B16, B16, 0, 0.f, 1},
                  /* 256 routed + 1 shared: the shared expert held apart, run per chunk */
                  {1000, 256, 128, 256, 8, SW, 300, B16, F32, 0, 0.f, 1}};
    auto pipe_checks = [&]() {
        int np = 0;
        for (size_t i = 0; i < pcases.size(); i++)
            np += pipe_check(pcases[i], seed + 733 * i);
        return np;
    };
    if (pipelined_only) {
        const int np = pipe_checks();
        printf("check-gpu --pipelined: %zu checks, %d failed -> %s\n", pcases.size(), np,
               np ? "FAIL" : "PASS");
        return np ? 1 : 0;
    }
    if (families_only) {
        const int nf = family_checks();
        printf("check-gpu --families: %zu checks, %d failed -> %s\n", fcases.size() + 1, nf,
               nf ? "FAIL" : "PASS");
        return nf ? 1 : 0;
    }
    if (swapped_only) {
        const int ns = swapped_check(seed);
        printf("check-gpu --swapped: %d failed -> %s\n", ns, ns ? "FAIL" : "PASS");
        return ns ? 1 : 0;
    }
    int fails = gemm_checks(seed);
    fails += gemm_selftest(seed); /* every GEMM mode on each version, v4 included */
    fails += narrow_check(seed);
    fails += swapped_check(seed);
    const int gemm_fails = fails;
    if (gemm_only) {
        printf("check-gpu --gemm-only: %d failed -> %s\n", fails, fails ? "FAIL" : "PASS");
        return fails ? 1 : 0;
    }

    std::vector<ecase> ecases;
    if (small)
        ecases = {{128, 256, SW, {3, 0, 140}}};
    else
        ecases = {{256, 256, SW, {70, 0, 200}},
                  {128, 384, GE, {1, 129}},
                  {512, 256, SW, {300, 5, 0, 260, 1}}};
    for (size_t i = 0; i < ecases.size(); i++)
        fails += experts_check(ecases[i], seed + 31 * i);
    const int exp_fails = fails - gemm_fails;

    std::vector<tcase> cases;
    if (small) {
        cases = {{1, 128, 128, 8, 2, SW, 1, 0, 0.f},
                 {7, 128, 256, 60, 2, GE, 0, 0, 0.f},
                 {130, 128, 128, 8, 8, SW, 1, 1, 0.f},
                 {40, 256, 128, 256, 8, SW, 0, 0, 0.f},
                 {130, 128, 256, 8, 2, SW, 1, 1, 0.5f}};
    } else {
        cases = {{1, 256, 256, 8, 2, SW, 1, 0, 0.f},
                 {1, 256, 256, 128, 8, SW, 1, 0, 0.f},
                 {7, 256, 384, 60, 2, SW, 0, 0, 0.f},
                 {7, 256, 256, 256, 8, GE, 1, 0, 0.f},
                 {300, 256, 256, 128, 8, SW, 1, 0, 0.f},
                 {4096, 256, 256, 8, 1, SW, 0, 0, 0.f},
                 {4096, 256, 256, 60, 2, GE, 0, 0, 0.f},
                 {4096, 256, 256, 256, 8, SW, 1, 0, 0.f},
                 {4096, 256, 256, 60, 2, SW, 1, 1, 0.f},
                 {512, 512, 512, 8, 2, GE, 1, 0, 0.f},
                 {16384, 128, 128, 128, 8, SW, 1, 0, 0.f},
                 {16384, 128, 256, 8, 2, SW, 0, 1, 0.f},
                 {16384, 128, 128, 256, 1, GE, 0, 1, 0.f},
                 {4096, 256, 256, 16, 2, SW, 1, 0, 1.0f},
                 {4096, 256, 256, 60, 2, SW, 1, 1, 1.0f},
                 {2048, 256, 512, 8, 2, GE, 0, 1, 0.5f},
                 {2048, 256, 256, 64, 8, SW, 1, 0, 0.5f},
                 {16384, 256, 256, 8, 2, SW, 1, 0, 0.f},
                 /* inference with 128 rows per expert: the tile list in pairs */
                 {1024, 256, 512, 64, 8, SW, 1, 0, 0.f},
                 {1024, 256, 512, 64, 8, SW, 1, 1, 1.0f}};
    }
    printf("%-5s %-6s %-4s %-4s %-4s %-2s %-3s %-2s %-4s | %-8s %-8s %-8s %-8s %-8s %-8s %-8s "
           "%-8s %-8s %-8s %-8s %-8s | idx lay det acc srt g16 inf drops | %s\n",
           "T", "H", "F", "E", "K", "ac", "rn", "sk", "cf", "logits", "probs", "topk_w", "y", "dx",
           "dwr", "dw1", "dw3", "dw2", "dgate", "aux", "z", "result");
    for (size_t i = 0; i < cases.size(); i++) {
        const tcase &c = cases[i];
        result r;
        memset(&r, 0, sizeof(r));
        /* odd cases: every v7 GEMM with its items dealt from the layer's
         * counter (by default only items of >= 64 k steps, none here) */
        kcu_gemm_select(-1, -1, -1, -1, (i & 1) ? 1 : -1);
        const int ok = run_case(c, seed + 977 * i, &r);
        kcu_gemm_select(-1, -1, -1, -1, -1);
        fails += !ok;
        printf("%-5d %-6d %-4d %-4d %-4d %-2s %-3d %-2d %-4.2g | %-8.1e %-8.1e %-8.1e %-8.1e "
               "%-8.1e %-8.1e %-8.1e %-8.1e %-8.1e %-8.1e %-8.1e %-8.1e | %-3s %-3s %-3s %-3s "
               "%-3s %-3s %-3s %-5d | %s\n",
               c.T, c.H, c.F, c.E, c.K, c.act == SW ? "sw" : "ge", c.renorm, c.skew, c.cf, r.logits,
               r.probs, r.tw, r.y, r.dx, r.dwr, r.dw1, r.dw3, r.dw2, r.dw, r.aux, r.z,
               r.idx_ok ? "ok" : "BAD", r.layout_ok ? "ok" : "BAD", r.determ_ok ? "ok" : "BAD",
               r.accum_ok ? "ok" : "BAD", r.modes_ok ? "ok" : "BAD", r.g16_ok ? "ok" : "BAD",
               r.infer_ok ? "ok" : "BAD", r.ndrop, ok ? "PASS" : "FAIL");
        fflush(stdout);
    }
    /* train-forward states: a pipeline schedule on a 2-state layer against
     * the same micro-batches one after the other on a 1-state layer */
    std::vector<scase> scases;
    if (small)
        scases = {{64, 37, 128, 128, 8, 2, SW, -1, 0.f}};
    else
        scases = {{64, 37, 256, 256, 8, 2, SW, -1, 0.f},
                  {64, 37, 256, 256, 8, 2, GE, 2, 0.f},
                  {37, 64, 256, 384, 16, 4, SW, 1, 1.0f}};
    for (size_t i = 0; i < scases.size(); i++)
        fails += states_check(scases[i], seed + 613 * i);

    fails += family_checks(); /* routing families (above) */

    fails += pipe_checks(); /* kcu_forward_pipelined (above) */
    const int layer_fails = fails - gemm_fails - exp_fails;

    /* decode path: inference forwards, forced on */
    std::vector<tcase> dcases;
    std::vector<ecase> decases;
    if (small) {
        dcases = {{1, 128, 128, 8, 2, SW, 1, 0, 0.f},
                  {3, 256, 128, 128, 8, GE, 0, 0, 0.f},
                  {16, 128, 256, 8, 2, SW, 1, 1, 0.f},
                  {40, 128, 128, 16, 2, GE, 1, 1, 0.5f}};
        decases = {{128, 256, SW, {3, 0, 40}}};
    } else {
        dcases = {{1, 256, 256, 8, 2, SW, 1, 0, 0.f},     {1, 256, 256, 128, 8, SW, 1, 0, 0.f},
                  {2, 256, 384, 8, 2, GE, 0, 0, 0.f},     {3, 256, 256, 128, 8, GE, 1, 0, 0.f},
                  {16, 256, 256, 128, 8, SW, 1, 0, 0.f},  {16, 256, 256, 8, 2, GE, 1, 0, 0.f},
                  {1, 128, 128, 256, 8, GE, 0, 0, 0.f},   {7, 256, 384, 60, 2, SW, 0, 0, 0.f},
                  {33, 256, 256, 8, 2, SW, 1, 1, 0.f},    {64, 128, 256, 128, 8, SW, 1, 0, 0.f},
                  {64, 256, 128, 8, 1, GE, 0, 1, 0.f},    {128, 128, 128, 8, 8, SW, 1, 0, 0.f},
                  {16, 256, 256, 16, 2, SW, 1, 0, 1.0f},  {40, 256, 256, 64, 8, GE, 0, 1, 0.5f},
                  {2, 2048, 256, 16, 8, SW, 1, 0, 0.f},   {1, 1024, 1536, 4, 2, GE, 1, 0, 0.f},
                  {16, 256, 2048, 8, 2, SW, 1, 0, 0.f},   {5, 512, 512, 32, 4, SW, 1, 1, 0.f},
                  {64, 1024, 256, 128, 8, SW, 1, 0, 0.f}, {256, 256, 256, 128, 8, SW, 1, 1, 0.f},
                  {200, 256, 128, 64, 8, GE, 0, 0, 1.25f}};
        decases = {{256, 256, SW, {1, 0, 3, 1}},
                   {128, 384, GE, {7, 70}},
                   {512, 256, SW, {2, 5, 0, 9, 1, 33}}};
    }
    printf("decode (inference, kcu_decode.cu forced on)\n");
    printf("%-5s %-6s %-4s %-4s %-4s %-2s %-3s %-2s %-4s | %-8s %-8s %-8s %-8s %-8s %-8s %-8s "
           "%-8s %-8s | idx lay det bf16 path drops | %s\n",
           "T", "H", "F", "E", "K", "ac", "rn", "sk", "cf", "logits", "probs", "topk_w", "y",
           "y(ks=1)", "y(ks=2)", "vs gemm", "aux", "z", "result");
    for (size_t i = 0; i < dcases.size(); i++) {
        const tcase &c = dcases[i];
        dresult r;
        memset(&r, 0, sizeof(r));
        const int ok = decode_case(c, seed + 1231 * i, &r);
        fails += !ok;
        char gm[16];
        if (r.gemm_same)
            snprintf(gm, sizeof(gm), "%-8.1e", r.y_gemm);
        else
            snprintf(gm, sizeof(gm), "%-8s", "tie");
        printf("%-5d %-6d %-4d %-4d %-4d %-2s %-3d %-2d %-4.2g | %-8.1e %-8.1e %-8.1e %-8.1e "
               "%-8.1e %-8.1e %s %-8.1e %-8.1e | %-3s %-3s %-3s %-4s %-4s %-5d | %s\n",
               c.T, c.H, c.F, c.E, c.K, c.act == SW ? "sw" : "ge", c.renorm, c.skew, c.cf, r.logits,
               r.probs, r.tw, r.y, r.y_ks1, r.y_ks2, gm, r.aux, r.z, r.idx_ok ? "ok" : "BAD",
               r.layout_ok ? "ok" : "BAD", r.determ_ok ? "ok" : "BAD", r.bf16_ok ? "ok" : "BAD",
               r.path_ok ? "ok" : "BAD", r.ndrop, ok ? "PASS" : "FAIL");
        fflush(stdout);
    }
    for (size_t i = 0; i < decases.size(); i++)
        fails += experts_decode_check(decases[i], seed + 57 * i);
    const int dec_fails = fails - gemm_fails - exp_fails - layer_fails;

    printf("check-gpu: %d gemm + %zu experts + %zu layer + %zu decode checks, %d failed (gemm %d, "
           "experts %d, decode %d) (bf16 tolerance %.0e) -> %s\n",
           3 + 4, ecases.size(), cases.size() + scases.size() + fcases.size() + 1 + pcases.size(),
           dcases.size() + decases.size(), fails, gemm_fails, exp_fails, dec_fails, TOL,
           fails ? "FAIL" : "PASS");
    return fails ? 1 : 0;
}
