/* moe_ref.c - the whole MoE layer in one process, built from the reference
 * pieces: the oracle the cluster and the fast paths are checked against. */
#include <stdlib.h>
#include <string.h>

#include "kernels/kern.h"

/* ref_state: the forward's intermediates, carved from one allocation. */
typedef struct ref_state {
    void *arena;
    const float *xin; /* (T,H) layer input as used (bf16-rounded copy or x) */
    float *xr;        /* (T,H) bf16-rounded copy of x, bf16 only */
    float *logits;    /* (T,E) */
    float *probs;     /* (T,E) */
    float *tw;        /* (T,K) top-k weights */
    float *xs;        /* (S,H) kept rows, sorted by expert */
    float *ys;        /* (S,H) expert outputs, sorted; dy rows in backward */
    float *ye;        /* (S,H) expert outputs, slot order; dye in backward */
    float *a, *b;     /* (S,F) pre-activations, sorted; backward only */
    float *dtw;       /* (T,K) backward only */
    int32_t *idx;     /* (S) = (T,K) */
    int32_t *counts;  /* (E) */
    int32_t *offsets; /* (E+1) */
    int32_t *perm;    /* (S) sorted position -> slot */
    int32_t *dropped; /* (E) */
    int32_t *kept;    /* (E) kept rows per expert */
    uint8_t *keep;    /* (S) */
} ref_state;

/* carve returns *p and advances it by bytes. */
static void *carve(unsigned char **p, size_t bytes)
{
    void *r = *p;
    *p += bytes;
    return r;
}

static moe_err check_shape(const kern_moe_shape *s, const kern_layer_weights *w, const float *x)
{
    if (!s || !w)
        return MOE_EINVAL;
    if (s->T < 0 || s->H < 1 || s->F < 1 || s->E < 1 || s->K < 1 || s->K > s->E)
        return MOE_EINVAL;
    if (!act_valid(s->act))
        return MOE_EINVAL;
    if ((size_t)s->T * (size_t)s->K > (size_t)INT32_MAX)
        return MOE_EINVAL;
    if (!w->wr || !w->w1 || !w->w2 || (act_gated(s->act) && !w->w3))
        return MOE_EINVAL;
    if (s->T > 0 && !x)
        return MOE_EINVAL;
    /* routing family and shared expert (kern_route_cfg) */
    if (s->scoring != KERN_SCORE_SOFTMAX && s->scoring != KERN_SCORE_SIGMOID)
        return MOE_EINVAL;
    if (s->E > KERN_ROUTE_MAX_E || s->n_group < 0 || s->n_group > KERN_ROUTE_MAX_GROUPS ||
        s->topk_group < 0 || s->group_topn < 0 || s->group_topn > 2 || s->route_scale < 0)
        return MOE_EINVAL;
    if (s->n_group > 1) {
        int tg = s->topk_group ? s->topk_group : s->n_group;
        if (s->E % s->n_group != 0 || tg > s->n_group || s->K > tg * (s->E / s->n_group))
            return MOE_EINVAL;
    }
    if (s->Fs < 0 || (s->Fs > 0 && (!w->ws1 || !w->ws2 || (act_gated(s->act) && !w->ws3) ||
                                    (s->shared_gate && !w->wsg))))
        return MOE_EINVAL;
    return MOE_OK;
}

kern_route_cfg kern_route_of_shape(const kern_moe_shape *s, const kern_layer_weights *w)
{
    kern_route_cfg rc = {s->scoring,    s->renorm,     w ? w->bias : NULL, s->n_group,
                         s->topk_group, s->group_topn, s->route_scale};
    return rc;
}

/* ref_forward runs the forward into st (allocating it) and, if y is not
 * NULL, writes y (T,H). With train set it also keeps a, b and room for the
 * backward. On MOE_OK the caller frees st->arena. */
static moe_err ref_forward(const kern_moe_shape *s, const kern_layer_weights *w, const float *x,
                           int train, ref_state *st, float *y)
{
    int T = s->T, H = s->H, F = s->F, E = s->E, K = s->K;
    size_t S = (size_t)T * K;
    size_t nf = (s->bf16 ? (size_t)T * H : 0) + 2 * (size_t)T * E + S + 3 * S * H +
                (train ? 2 * S * F + S : 0);
    size_t ni = S + E + (E + 1) + S + E + E;
    size_t bytes = nf * sizeof(float) + ni * sizeof(int32_t) + S;
    memset(st, 0, sizeof(*st));
    st->arena = malloc(bytes ? bytes : 1);
    if (!st->arena)
        return MOE_ENOMEM;
    /* floats, then int32s, then bytes: every piece stays 4-byte aligned */
    unsigned char *bp = st->arena;
    if (s->bf16)
        st->xr = carve(&bp, (size_t)T * H * sizeof(float));
    st->logits = carve(&bp, (size_t)T * E * sizeof(float));
    st->probs = carve(&bp, (size_t)T * E * sizeof(float));
    st->tw = carve(&bp, S * sizeof(float));
    st->xs = carve(&bp, S * H * sizeof(float));
    st->ys = carve(&bp, S * H * sizeof(float));
    st->ye = carve(&bp, S * H * sizeof(float));
    if (train) {
        st->a = carve(&bp, S * F * sizeof(float));
        st->b = carve(&bp, S * F * sizeof(float));
        st->dtw = carve(&bp, S * sizeof(float));
    }
    st->idx = carve(&bp, S * sizeof(int32_t));
    st->counts = carve(&bp, (size_t)E * sizeof(int32_t));
    st->offsets = carve(&bp, (size_t)(E + 1) * sizeof(int32_t));
    st->perm = carve(&bp, S * sizeof(int32_t));
    st->dropped = carve(&bp, (size_t)E * sizeof(int32_t));
    st->kept = carve(&bp, (size_t)E * sizeof(int32_t));
    st->keep = carve(&bp, S);

    st->xin = x;
    if (s->bf16) {
        memcpy(st->xr, x, (size_t)T * H * sizeof(float));
        kern_bf16_round_n(st->xr, (size_t)T * H);
        st->xin = st->xr;
    }
    const float *xin = st->xin;

    /* router */
    kern_router_logits_cpu(xin, w->wr, T, H, E, st->logits);
    kern_route_cfg rc = kern_route_of_shape(s, w);
    kern_route_cpu(st->logits, T, E, K, &rc, st->probs, st->idx, st->tw);
    /* layout and capacity */
    kern_layout_cpu(st->idx, T, K, E, st->counts, st->offsets, st->perm, NULL);
    int32_t cap = kern_capacity(s->capacity_factor, T, K, E);
    kern_apply_capacity_cpu(st->counts, st->offsets, st->perm, E, cap, st->keep, st->dropped);

    /* experts: the kept rows of expert e are sorted positions
     * offsets[e] .. offsets[e] + kept[e] - 1 */
    memset(st->ye, 0, S * H * sizeof(float));
    for (int e = 0; e < E; e++) {
        int32_t off = st->offsets[e];
        int32_t n = st->counts[e] - st->dropped[e];
        st->kept[e] = n;
        for (int32_t i = 0; i < n; i++) {
            int32_t slot = st->perm[off + i];
            memcpy(st->xs + (size_t)(off + i) * H, xin + (size_t)(slot / K) * H,
                   (size_t)H * sizeof(float));
        }
        const float *w1 = w->w1 + (size_t)e * F * H;
        const float *w3 = w->w3 ? w->w3 + (size_t)e * F * H : NULL;
        const float *w2 = w->w2 + (size_t)e * H * F;
        kern_expert_ffn_cpu(st->xs + (size_t)off * H, n, H, F, w1, w3, w2, s->act, s->bf16,
                            train ? st->a + (size_t)off * F : NULL,
                            train ? st->b + (size_t)off * F : NULL, st->ys + (size_t)off * H);
        for (int32_t i = 0; i < n; i++) {
            int32_t slot = st->perm[off + i];
            memcpy(st->ye + (size_t)slot * H, st->ys + (size_t)(off + i) * H,
                   (size_t)H * sizeof(float));
        }
    }
    if (y) {
        kern_combine_cpu(st->ye, st->tw, st->keep, T, K, H, s->bf16, y);
        if (s->Fs > 0 && kern_shared_forward_cpu(xin, T, H, s->Fs, w->ws1, w->ws3, w->ws2,
                                                 s->shared_gate ? w->wsg : NULL, s->act, s->bf16, 0,
                                                 y) != MOE_OK) {
            free(st->arena);
            return MOE_ENOMEM;
        }
    }
    return MOE_OK;
}

moe_err kern_moe_forward_ref(const kern_moe_shape *s, const kern_layer_weights *w, const float *x,
                             float *y, kern_fwd_stats *stats)
{
    moe_err err = check_shape(s, w, x);
    if (err != MOE_OK)
        return err;
    if (s->T > 0 && !y)
        return MOE_EINVAL;
    ref_state st;
    err = ref_forward(s, w, x, 0, &st, y);
    if (err != MOE_OK)
        return err;
    if (stats) {
        if (stats->counts)
            memcpy(stats->counts, st.counts, (size_t)s->E * sizeof(int32_t));
        if (stats->dropped)
            memcpy(stats->dropped, st.dropped, (size_t)s->E * sizeof(int32_t));
        stats->aux_loss = kern_aux_loss_cpu(st.probs, st.counts, s->T, s->E, s->K);
        stats->z_loss = kern_z_loss_cpu(st.logits, s->T, s->E);
    }
    free(st.arena);
    return MOE_OK;
}

moe_err kern_moe_backward_ref(const kern_moe_shape *s, const kern_layer_weights *w, const float *x,
                              const float *dy, float aux_coef, float z_coef, float *dx, float *dwr,
                              float *dw1, float *dw3, float *dw2)
{
    if (s && s->Fs > 0)
        return MOE_EINVAL; /* the shared expert's gradients: kern_moe_backward_ref_g */
    kern_layer_grads g = {dwr, dw1, dw3, dw2, NULL, NULL, NULL, NULL};
    return kern_moe_backward_ref_g(s, w, x, dy, aux_coef, z_coef, dx, &g);
}

moe_err kern_moe_backward_ref_g(const kern_moe_shape *s, const kern_layer_weights *w,
                                const float *x, const float *dy, float aux_coef, float z_coef,
                                float *dx, const kern_layer_grads *g)
{
    moe_err err = check_shape(s, w, x);
    if (err != MOE_OK)
        return err;
    if (!g)
        return MOE_EINVAL;
    float *dwr = g->dwr, *dw1 = g->dw1, *dw3 = g->dw3, *dw2 = g->dw2;
    if ((s->T > 0 && (!dy || !dx)) || !dwr || !dw1 || !dw2 || (act_gated(s->act) && !dw3))
        return MOE_EINVAL;
    if (s->Fs > 0 &&
        (!g->dws1 || !g->dws2 || (act_gated(s->act) && !g->dws3) || (s->shared_gate && !g->dwsg)))
        return MOE_EINVAL;
    int T = s->T, H = s->H, F = s->F, E = s->E, K = s->K;
    size_t S = (size_t)T * K;
    ref_state st;
    err = ref_forward(s, w, x, 1, &st, NULL);
    if (err != MOE_OK)
        return err;

    memset(dwr, 0, (size_t)E * H * sizeof(float));
    memset(dw1, 0, (size_t)E * F * H * sizeof(float));
    if (dw3)
        memset(dw3, 0, (size_t)E * F * H * sizeof(float));
    memset(dw2, 0, (size_t)E * H * F * sizeof(float));
    if (T > 0)
        memset(dx, 0, (size_t)T * H * sizeof(float));

    /* combine backward: ye now holds dye (S,H) in slot order */
    float *dye = st.ys; /* reuse: ys is (S,H) and no longer needed */
    kern_combine_backward_cpu(dy, st.ye, st.tw, st.keep, T, K, H, dye, st.dtw);
    float *dys = st.ye; /* (S,H) dy rows sorted by expert */
    for (size_t p = 0; p < S; p++)
        memcpy(dys + p * H, dye + (size_t)st.perm[p] * H, (size_t)H * sizeof(float));
    float *dxs = st.ys; /* (S,H) dx rows sorted by expert */

    for (int e = 0; e < E; e++) {
        int32_t off = st.offsets[e], n = st.kept[e];
        size_t fh = (size_t)e * F * H;
        kern_expert_ffn_backward_cpu(
            st.xs + (size_t)off * H, st.a + (size_t)off * F, st.b + (size_t)off * F,
            dys + (size_t)off * H, n, H, F, w->w1 + fh, w->w3 ? w->w3 + fh : NULL, w->w2 + fh,
            s->act, dxs + (size_t)off * H, dw1 + fh, dw3 ? dw3 + fh : NULL, dw2 + fh);
        for (int32_t i = 0; i < n; i++) {
            float *dxt = dx + (size_t)(st.perm[off + i] / K) * H;
            const float *src = dxs + (size_t)(off + i) * H;
            for (int h = 0; h < H; h++)
                dxt[h] += src[h];
        }
    }
    kern_route_cfg rc = kern_route_of_shape(s, w);
    kern_route_backward_cpu(st.xin, w->wr, st.logits, st.probs, st.idx, st.dtw, T, H, E, K, &rc,
                            st.counts, T, aux_coef, z_coef, dwr, dx);
    if (s->Fs > 0) {
        size_t sfh = (size_t)s->Fs * H;
        memset(g->dws1, 0, sfh * sizeof(float));
        if (g->dws3)
            memset(g->dws3, 0, sfh * sizeof(float));
        memset(g->dws2, 0, sfh * sizeof(float));
        if (s->shared_gate)
            memset(g->dwsg, 0, (size_t)H * sizeof(float));
        err = kern_shared_backward_cpu(st.xin, dy, T, H, s->Fs, w->ws1, w->ws3, w->ws2,
                                       s->shared_gate ? w->wsg : NULL, s->act, s->bf16, 0, dx,
                                       g->dws1, g->dws3, g->dws2, s->shared_gate ? g->dwsg : NULL);
    }
    free(st.arena);
    return err;
}
