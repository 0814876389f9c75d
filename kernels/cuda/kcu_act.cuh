/*
 * kcu_act.cuh - the expert activations on the GPU: one functor per act_id
 * of common/act.h, holding the arithmetic every kernel uses (the GEMM
 * epilogues of kernels/cuda/gemm/, forward and backward, and the decode path's
 * up-projection in kcu_decode.cu). The CPU forms stay in kernels/act.c;
 * the GPU forms are not bit-identical to those (fast intrinsics, the
 * device erff), only close.
 *
 * A functor A is a type with static members, never an object with state:
 *   A::id     its act_id (the row of common/act.h)
 *   A::gated  true: h = f(a) * b (two pre-activations, a from w1 and b
 *             from w3); false: h = f(a), b unused (pass anything)
 *   A::fwd(a, b)      h, the form of the GEMM epilogues
 *   A::fwd_div(a, b)  h, the form of the decode path; where it differs
 *                     from fwd the functor says how (SwiGLU: its logistic
 *                     divides); both bit patterns are kept on purpose
 *   A::bwd(a, b, e, &h, &da, &db)
 *             the backward on one column (the wgmma epilogues, wg_dact): e =
 *             w dh (gate weight times the output gradient), h = the forward
 *             (unrounded), da = e dh/da, db = e dh/db (ungated: 0, unused)
 *   A::bwd2(a, b, w, d0, d1, rnd, &h0, &h1, st)
 *             the same on a column pair in the mma.sync epilogue's order
 *             (k_gemm): the backward epilogue, on a column pair (x, y) of one row:
 *             pre-activations a, b (b unused when ungated), gate weight w,
 *             output gradients d0, d1 (dL/dh unweighted): h0, h1 = rnd(the
 *             forward) (rnd: the epilogue's bf16 rounding of the stored h);
 *             then st(da, db) with two thunks: da() returns the float2
 *             (w d0 dh/da(x), w d1 dh/da(y)), db() likewise dh/db (ungated:
 *             zeros, not to be stored). The thunks let each epilogue
 *             evaluate and store them where it always did.
 * Every member is __forceinline__ and written as the kernels wrote it
 * before the functors (same operations in the same order, same
 * intrinsics, even the order of the two columns' statements), so that the
 * compiled code, and the bits, stay what they were.
 *
 * Adding an activation: its row in common/act.h and common/act.c, its CPU
 * pair in kernels/act.c, a functor here and its entry in kcu_acts (in id
 * order; the static assertions below check the count and the order).
 */
#ifndef MOE_KCU_ACT_CUH
#define MOE_KCU_ACT_CUH

#include <cuda_runtime.h>

#include "kernels/kern.h"

/* SwiGLU: h = silu(a) b = a sig(a) b; silu'(a) = sig(a) (1 + a (1 - sig(a))). */
struct act_swiglu {
    static constexpr kern_act id = KERN_ACT_SWIGLU;
    static constexpr bool gated = true;

    /* the logistic function in four instructions (FMUL, MUFU.EX2, FADD,
     * MUFU.RCP; flush-to-zero: a < -88 gives 1 / inf = 0, a > 88 gives 1):
     * the IEEE division and the denormal-safe __expf cost ~20 and a
     * slow-path call site per use, and the SwiGLU epilogues, which run with
     * the tensor cores idle, are bound by their instruction count
     * (bench/NOTES.md). The GEMM epilogues' form. */
    __device__ __forceinline__ static float sigm(float a)
    {
        float e, r;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-1.44269504088896341f * a));
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
        return r;
    }
    /* the logistic function by __expf and an IEEE division: the decode
     * path's form (a different bit pattern from sigm, kept as it was) */
    __device__ __forceinline__ static float sigm_div(float a)
    {
        return 1.f / (1.f + __expf(-a));
    }
    /* h = (a sig(a)) b, the GEMM epilogues (sigm) */
    __device__ __forceinline__ static float fwd(float a, float b)
    {
        return a * sigm(a) * b;
    }
    /* h = (a sig(a)) b, the decode path (sigm_div) */
    __device__ __forceinline__ static float fwd_div(float a, float b)
    {
        return a * sigm_div(a) * b;
    }
    /* one column: s = sig(a), sa = a s: h = sa b (unrounded), da = e b s
     * (1 + a (1 - s)), db = e sa; the wgmma epilogues' form (wg_dact) */
    __device__ __forceinline__ static void bwd(float a, float b, float e, float *h, float *da,
                                               float *db)
    {
        const float s = sigm(a);
        const float sa = a * s;
        *h = sa * b;
        *da = e * b * s * (1.f + a * (1.f - s));
        *db = e * sa;
    }
    /* s = sig(a), sa = a s, e = w d: h = sa b, da = e b s (1 + a (1 - s)),
     * db = e sa (sa shared by h and db, e by da and db) */
    template <class R, class ST>
    __device__ __forceinline__ static void bwd2(float2 a, float2 b, float w, float d0, float d1,
                                                R rnd, float *h0, float *h1, ST st)
    {
        const float s0 = sigm(a.x), s1 = sigm(a.y);
        const float sa0 = a.x * s0, sa1 = a.y * s1;
        *h0 = rnd(sa0 * b.x);
        *h1 = rnd(sa1 * b.y);
        const float e0 = w * d0, e1 = w * d1;
        st(
            [&] {
                return make_float2(e0 * b.x * s0 * (1.f + a.x * (1.f - s0)),
                                   e1 * b.y * s1 * (1.f + a.y * (1.f - s1)));
            },
            [&] { return make_float2(e0 * sa0, e1 * sa1); });
    }
};

/* GELU, erf form: h = a Phi(a) = 0.5 a (1 + erf(a / sqrt 2));
 * gelu'(a) = Phi(a) + a phi(a). Ungated: b unused. */
struct act_gelu {
    static constexpr kern_act id = KERN_ACT_GELU;
    static constexpr bool gated = false;

    __device__ __forceinline__ static float fwd(float a, float)
    {
        return 0.5f * a * (1.f + erff(a * 0.70710678118654752f));
    }
    /* the decode path computes GELU exactly as the GEMM epilogues do */
    __device__ __forceinline__ static float fwd_div(float a, float b)
    {
        return fwd(a, b);
    }
    /* dgelu(a) = Phi(a) + a phi(a), with __expf */
    __device__ __forceinline__ static float dfwd(float a)
    {
        return 0.5f * (1.f + erff(a * 0.70710678118654752f)) +
               a * 0.39894228040143268f * __expf(-0.5f * a * a);
    }
    /* one column: h = gelu(a) (unrounded), da = e gelu'(a), db = 0 */
    __device__ __forceinline__ static void bwd(float a, float b, float e, float *h, float *da,
                                               float *db)
    {
        *h = fwd(a, b);
        *da = e * dfwd(a);
        *db = 0.f;
    }
    /* h = gelu(a), da = w d gelu'(a), db = 0 (no w3) */
    template <class R, class ST>
    __device__ __forceinline__ static void bwd2(float2 a, float2 b, float w, float d0, float d1,
                                                R rnd, float *h0, float *h1, ST st)
    {
        *h0 = rnd(fwd(a.x, b.x));
        *h1 = rnd(fwd(a.y, b.y));
        st([&] { return make_float2(w * d0 * dfwd(a.x), w * d1 * dfwd(a.y)); },
           [&] { return make_float2(0.f, 0.f); });
    }
};

/* ---- the list of functors, in act_id order, and the dispatch ---- */
template <class... A> struct act_list {
    static constexpr int count = sizeof...(A);
};
using kcu_acts = act_list<act_swiglu, act_gelu>;

static_assert(kcu_acts::count == ACT_COUNT,
              "kcu_act.cuh: kcu_acts needs one functor per act_id of common/act.h");

/* act_ids_in_order: the I-th functor of the list has id I */
template <int I> constexpr bool act_ids_in_order(act_list<>)
{
    return true;
}
template <int I, class A0, class... As> constexpr bool act_ids_in_order(act_list<A0, As...>)
{
    return (int)A0::id == I && act_ids_in_order<I + 1>(act_list<As...>{});
}
static_assert(act_ids_in_order<0>(kcu_acts{}), "kcu_act.cuh: kcu_acts must be in act_id order");

/* act_of<id>::type: the functor of a compile-time id */
template <int ID, class L> struct act_at;
template <class A0, class... As> struct act_at<0, act_list<A0, As...>> {
    using type = A0;
};
template <int ID, class A0, class... As> struct act_at<ID, act_list<A0, As...>> {
    using type = typename act_at<ID - 1, act_list<As...>>::type;
};
template <int ID> using act_of = typename act_at<ID, kcu_acts>::type;

/* with_act(act, f): calls f(A{}) with the functor A of the run-time id act
 * (one instantiation of f's body per functor: the kernels f launches are
 * templated on A) and returns its moe_err; MOE_EINVAL for an id that names
 * no functor. f: a generic lambda [&](auto A) -> moe_err, decltype(A) the
 * functor type. */
template <class F> moe_err with_act_in(act_list<>, int, F &)
{
    return MOE_EINVAL;
}
template <class F, class A0, class... As> moe_err with_act_in(act_list<A0, As...>, int act, F &f)
{
    if (act == (int)A0::id)
        return f(A0{});
    return with_act_in(act_list<As...>{}, act, f);
}
template <class F> moe_err with_act(kern_act act, F &&f)
{
    return with_act_in(kcu_acts{}, (int)act, f);
}

#endif
