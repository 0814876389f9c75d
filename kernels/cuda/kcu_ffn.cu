/*
 * kcu_ffn.cu - the expert FFN's grouped GEMMs (kcu_ffn.cuh): the
 * kcu_gemm_args of the up- and down-projection, forward and backward, built
 * once for the layer, the experts object and the expert-parallel owner.
 * Host side only: every GEMM launches through kcu_gemm (gemm/dispatch.cu).
 */
#include <string.h>

#include "kernels/cuda/kcu_ffn.cuh"

namespace
{

/* a rows-mode GEMM over f's tile list */
kcu_gemm_args rows_args(const kcu_ffn *f)
{
    kcu_gemm_args a;
    memset(&a, 0, sizeof(a));
    a.offs = f->t.offs;
    a.tile_e = f->t.tile_e;
    a.tile_r0 = f->t.tile_r0;
    a.ntiles_m = f->t.ntiles;
    a.max_tiles_m = f->t.max_tiles;
    a.sched = f->t.sched;
    a.few_tiles = f->t.few;
    a.ngroups = f->t.few || f->t.walk ? f->E : 0; /* v10 walks the experts of offs */
    a.avg_rows = f->t.avg_rows;
    a.pdl = f->pdl;
    return a;
}

/* the (rows,H) output of a rows-mode GEMM (A, B, K set): bf16 rows through
 * scatter, or fp32 rows */
moe_err rows_out(const kcu_ffn *f, kcu_gemm_args *a, kcu_bmode bm, void *out, moe_dtype dt,
                 const int32_t *scatter, cudaStream_t st)
{
    a->N = f->H;
    a->ldc = f->H;
    a->scatter = scatter;
    if (dt == MOE_F32) {
        a->Cf = (float *)out;
        return kcu_gemm(KCU_A_K, bm, KCU_EPI_F32, a, f->nsm, st);
    }
    a->Cb = (bf16 *)out;
    return kcu_gemm(KCU_A_K, bm, KCU_EPI_SCATTER, a, f->nsm, st);
}

/* a weight-gradient GEMM over f's E groups */
kcu_gemm_args wgrad_args(const kcu_ffn *f)
{
    kcu_gemm_args a;
    memset(&a, 0, sizeof(a));
    a.ngroups = f->E;
    a.offs = f->goffs;
    a.beta0 = f->beta0;
    return a;
}

} // namespace

moe_err kcu_ffn_up(const kcu_ffn *f, const bf16 *x, const int32_t *x_gather, int keep_ab,
                   cudaStream_t st)
{
    kcu_gemm_args a = rows_args(f);
    a.A = x;
    a.lda = f->H;
    a.a_gather = x_gather;
    a.B = f->w13;
    a.ldb = f->H;
    a.b_gstride = (long long)f->N1 * f->H;
    a.N = f->N1;
    a.K = f->H;
    a.h = f->h;
    a.F = f->F;
    a.ab = keep_ab ? f->ab : nullptr;
    a.ld_ab = f->N1;
    return kcu_gemm(KCU_A_K, KCU_B_K, kcu_epi_fwd(f->act), &a, f->nsm, st);
}

moe_err kcu_ffn_down(const kcu_ffn *f, void *out, moe_dtype dt, const int32_t *scatter,
                     cudaStream_t st)
{
    kcu_gemm_args a = rows_args(f);
    a.A = f->h;
    a.lda = f->F;
    a.B = f->w2;
    a.ldb = f->F;
    a.b_gstride = (long long)f->H * f->F;
    a.K = f->F;
    return rows_out(f, &a, KCU_B_K, out, dt, scatter, st);
}

moe_err kcu_ffn_forward(const kcu_ffn *f, const bf16 *x, const int32_t *x_gather, int keep_ab,
                        void *out, moe_dtype dt, const int32_t *scatter, cudaStream_t st)
{
    KCU_TRY(kcu_ffn_up(f, x, x_gather, keep_ab, st));
    return kcu_ffn_down(f, out, dt, scatter, st);
}

moe_err kcu_ffn_dh(const kcu_ffn *f, const bf16 *dy, const int32_t *dy_gather, const float *gate_w,
                   const int32_t *slot, float *dwpart, cudaStream_t st)
{
    kcu_gemm_args a = rows_args(f);
    a.A = dy;
    a.lda = f->H;
    a.a_gather = dy_gather;
    a.B = f->w2; /* (H,F) per expert: k = h, n = f */
    a.ldb = f->F;
    a.b_gstride = (long long)f->H * f->F;
    a.N = f->F;
    a.K = f->H;
    a.ab = f->ab;
    a.ld_ab = f->N1;
    a.h = f->h;
    a.F = f->F;
    a.gate_w = gate_w;
    a.scatter = slot;
    a.dwpart = dwpart;
    return kcu_gemm(KCU_A_K, KCU_B_N, kcu_epi_bwd(f->act), &a, f->nsm, st);
}

moe_err kcu_ffn_dx(const kcu_ffn *f, void *out, moe_dtype dt, const int32_t *scatter,
                   cudaStream_t st)
{
    kcu_gemm_args a = rows_args(f);
    a.A = f->ab;
    a.lda = f->N1;
    a.B = f->w13; /* (N1,H) per expert: k = n1, n = h */
    a.ldb = f->H;
    a.b_gstride = (long long)f->N1 * f->H;
    a.K = f->N1;
    return rows_out(f, &a, KCU_B_N, out, dt, scatter, st);
}

moe_err kcu_ffn_dw13(const kcu_ffn *f, const bf16 *x, const int32_t *x_gather, cudaStream_t st)
{
    kcu_gemm_args a = wgrad_args(f);
    a.A = f->ab; /* (rows,N1): k = row, m = n1 */
    a.lda = f->N1;
    a.a_gather = f->ws_gather;
    a.B = x;
    a.ldb = f->H;
    a.b_gather = x_gather;
    a.M = f->N1;
    a.N = f->H;
    a.Cf = f->g_w13;
    a.Cb = f->gb_w13;
    a.ldc = f->H;
    a.c_gstride = (long long)f->N1 * f->H;
    return kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, f->nsm, st);
}

moe_err kcu_ffn_dw2(const kcu_ffn *f, const bf16 *dy, const int32_t *dy_gather, cudaStream_t st)
{
    kcu_gemm_args a = wgrad_args(f);
    a.A = dy; /* k = row, m = h */
    a.lda = f->H;
    a.a_gather = dy_gather;
    a.B = f->h; /* w*h (rows,F) */
    a.ldb = f->F;
    a.b_gather = f->ws_gather;
    a.M = f->H;
    a.N = f->F;
    a.Cf = f->g_w2;
    a.Cb = f->gb_w2;
    a.ldc = f->F;
    a.c_gstride = (long long)f->H * f->F;
    return kcu_gemm(KCU_A_M, KCU_B_N, KCU_EPI_ACC, &a, f->nsm, st);
}
