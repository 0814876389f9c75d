/*
 * kcu_ffn.cuh - one set of expert FFNs as an object (issue 23, "kernels as
 * tiles"): the bf16 weights w13 (E,N1,H) (w1/w3 interleaved by 8 rows for
 * SwiGLU, N1 = 2F; GELU N1 = F) and w2 (E,H,F), the activation, the
 * workspace rows h (rows,F) and ab (rows,N1) the GEMMs run over, the
 * rows-mode tile list, the weight gradients' groups and targets, and the
 * six grouped GEMMs of the expert FFN (kcu_ffn.cu): up (activation
 * epilogue), down, dh (activation gradient epilogue), dx, dW13, dW2. Each
 * builds the kcu_gemm_args the layer (kcu_layer.cu), the experts object
 * (kcu_experts.cu) and the expert-parallel owner (kcu_ep.cu) built by hand
 * before, and launches through kcu_gemm. Host side only.
 *
 * A kcu_ffn is a value built per call from its owner's fields (the owners'
 * builders: layer_ffn, experts_ffn, ep_ffn / ep_chunk_ffn): the workspace
 * pointers follow the selected state, grads_clean changes per backward.
 */
#pragma once

#include "kernels/cuda/kcu_internal.cuh"

/* the rows a rows-mode GEMM (up, down, dh, dx) runs over */
struct kcu_ffn_tiles {
    const int32_t *offs;    /* (E+1) group row offsets */
    const int32_t *tile_e;  /* tile list: expert of each m-tile */
    const int32_t *tile_r0; /* tile list: first row of each m-tile */
    const int32_t *ntiles;  /* device count of tiles in the list */
    int max_tiles;          /* host bound on *ntiles */
    int *sched;             /* v7 schedule counter (kcu_gemm_args.sched), or NULL */
    int few;                /* in pairs of one expert, ~2 per expert (kcu_gemm_args.few_tiles) */
    int walk;     /* inference rows dense in expert order: v10 may walk the experts of offs */
    int avg_rows; /* rows per expert on average, 0 unknown (kcu_gemm_args.avg_rows) */
};

struct kcu_ffn {
    int H, F, N1; /* model dim, d_ff, up-projection width (2F SwiGLU, F GELU) */
    kern_act act;
    int nsm;         /* SMs the GEMMs are launched for */
    const bf16 *w13; /* (E,N1,H) */
    const bf16 *w2;  /* (E,H,F) */
    bf16 *h;         /* (rows,F) activations; w*h after dh */
    bf16 *ab;        /* (rows,N1) pre-activations (train); (da, db) after dh */
    kcu_ffn_tiles t; /* rows-mode tile list (up, down, dh, dx) */
    int pdl;         /* rows-mode GEMMs launched with PDL (small inference batches) */
    /* the weight gradients (dW13, dW2): grouped over E groups of rows */
    int E;                    /* groups */
    const int32_t *goffs;     /* (E+1) group row offsets of the weight gradients */
    const int32_t *ws_gather; /* row k of h / ab for the weight gradients: h[ws_gather[k]]
                               * (NULL: identity) */
    float *g_w13, *g_w2;      /* fp32 gradients, (E,N1,H) and (E,H,F), or NULL */
    bf16 *gb_w13, *gb_w2;     /* bf16 gradients instead (kcu_layer, c.grad_bf16), or NULL */
    int beta0;                /* gradients logically zero: store instead of accumulating */
};

/* up: h (rows,F) = act(x[x_gather] w13_e^T) over the tile list; ab (rows,N1)
 * the raw pre-activations when keep_ab (kept for the backward) */
moe_err kcu_ffn_up(const kcu_ffn *f, const bf16 *x, const int32_t *x_gather, int keep_ab,
                   cudaStream_t st);
/* down: out[scatter[r]] (rows,H) = h w2_e^T: bf16 rows (dt MOE_BF16, scatter
 * NULL = identity) or fp32 rows (dt MOE_F32: scatter must be NULL). out is
 * aligned to 8 (bf16) or 16 (fp32) bytes (kcu_gemm_args) */
moe_err kcu_ffn_down(const kcu_ffn *f, void *out, moe_dtype dt, const int32_t *scatter,
                     cudaStream_t st);
/* forward: up then down, nothing between them */
moe_err kcu_ffn_forward(const kcu_ffn *f, const bf16 *x, const int32_t *x_gather, int keep_ab,
                        void *out, moe_dtype dt, const int32_t *scatter, cudaStream_t st);
/* dh: dy[dy_gather] w2_e -> (da, db) in place of ab, w*h in place of h, with
 * w = gate_w[slot[r]] (1 when gate_w is NULL) and the dL/dw partial sums in
 * dwpart (none when NULL) */
moe_err kcu_ffn_dh(const kcu_ffn *f, const bf16 *dy, const int32_t *dy_gather, const float *gate_w,
                   const int32_t *slot, float *dwpart, cudaStream_t st);
/* dx: out[scatter[r]] (rows,H) = dab w13_e (out, dt, scatter as kcu_ffn_down) */
moe_err kcu_ffn_dx(const kcu_ffn *f, void *out, moe_dtype dt, const int32_t *scatter,
                   cudaStream_t st);
/* dW13_e (+)= dab_e^T x_e, the B rows x[x_gather[k]] (x_gather NULL: dense) */
moe_err kcu_ffn_dw13(const kcu_ffn *f, const bf16 *x, const int32_t *x_gather, cudaStream_t st);
/* dW2_e (+)= dy_e^T (w h)_e, the A rows dy[dy_gather[k]] (dy_gather NULL: dense) */
moe_err kcu_ffn_dw2(const kcu_ffn *f, const bf16 *dy, const int32_t *dy_gather, cudaStream_t st);
