#!/usr/bin/env python3
"""peer_torch.py - two PyTorch MoE layers timed on this GPU, beside bin/moe_bench.

DESIGN §9's peer figures were taken on another H100 run; an H100 under its
700 W cap sustains less than its burst rate, and the lent H100s differ by a
few percent. To compare like with like, this script times two of §9's
peer columns on the machine and in the run where bin/moe_bench runs:

  grouped  - the torch `_grouped_mm` pipeline: router GEMM, softmax top-k
             (renormalised, as moe_bench), a stable sort of the (token, k)
             slots by expert, the gathered rows through two grouped GEMMs
             (`torch._grouped_mm`, bf16, the expert weights as stored by
             moe: w13 (E, 2F, H) gate/up, w2 (E, H, F)), SwiGLU, the gate
             weights, a scatter-add back to the tokens.
  loop     - the same with one `torch.mm` per expert (cuBLAS per expert).

Both run forward (no autograd) and forward+backward (autograd, gradients of
x, the router and both expert weights, bf16 as PyTorch keeps them), with the
same shapes and random routing as moe_bench's rows, CUDA events, a warm-up of
WARM_MS so that the GPU runs at the clock it holds under sustained load, and
the median of the timed calls. It also prints the cuBLAS dense 8192^3 rate
after the same warm-up. Written here (not a peer's code): it measures what
PyTorch's own operators give, the columns "torch _grouped_mm pipeline" and
"PyTorch per-expert loop" of §9, not MegaBlocks or ScatterMoE.

  python3 bench/peer_torch.py [--only mixtral,qwen3] [--impl grouped,loop]
"""
import argparse
import sys

import torch
import torch.nn.functional as F

WARM_MS = 3000.0

CASES = {
    # name: (T, H, F, E, K)
    "mixtral": (8192, 4096, 14336, 8, 2),
    "qwen3": (16384, 2048, 768, 128, 8),
}


def median_ms(fn, warm_ms=WARM_MS, reps=20):
    """median of reps timed calls after warm_ms of untimed ones"""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    n = max(3, min(20000, int(warm_ms / max(a.elapsed_time(b), 1e-3))))
    for _ in range(n):
        fn()
    t = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        t.append(a.elapsed_time(b))
    t.sort()
    return t[len(t) // 2]


def route(x, wr, k):
    """softmax top-k, renormalised; the slots sorted by expert (stable)"""
    logits = x @ wr.t()
    probs = torch.softmax(logits.float(), dim=-1)
    topv, topi = probs.topk(k, dim=-1)
    topv = topv / topv.sum(dim=-1, keepdim=True)
    flat = topi.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=wr.shape[0])
    return topv.reshape(-1), order, counts


def moe_grouped(x, wr, w13, w2, k):
    """w13 (E, 2F, H): rows [0, F) gate, [F, 2F) up; w2 (E, H, F)"""
    T, H = x.shape
    gate, order, counts = route(x, wr, k)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tok = order // k
    xs = x[tok]
    ab = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    a, b = ab.chunk(2, dim=-1)
    h = F.silu(a) * b
    ye = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    ye = ye * gate[order].to(ye.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add(0, tok, ye)


def moe_loop(x, wr, w13, w2, k):
    T, H = x.shape
    gate, order, counts = route(x, wr, k)
    tok = order // k
    xs = x[tok]
    outs = []
    start = 0
    for e, n in enumerate(counts.tolist()):  # the counts reach the host: one sync
        xe = xs[start : start + n]
        ab = xe @ w13[e].t()
        a, b = ab.chunk(2, dim=-1)
        outs.append((F.silu(a) * b) @ w2[e].t())
        start += n
    ye = torch.cat(outs) * gate[order].to(x.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add(0, tok, ye)


def dense_tflops():
    n = 8192
    a = torch.rand(n, n, device="cuda", dtype=torch.bfloat16) * 2 - 1
    b = torch.rand(n, n, device="cuda", dtype=torch.bfloat16) * 2 - 1
    ms = median_ms(lambda: a @ b, reps=15)
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def run_case(name, impl):
    T, H, Fd, E, K = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(1)

    def uni(shape, scale):
        return ((torch.rand(shape, device="cuda", generator=g) * 2 - 1) * scale).to(torch.bfloat16)

    x = uni((T, H), 1.0)
    wr = uni((E, H), H**-0.5)
    w13 = uni((E, 2 * Fd, H), H**-0.5)
    w2 = uni((E, H, Fd), Fd**-0.5)
    dy = uni((T, H), 1.0)
    fn = moe_grouped if impl == "grouped" else moe_loop

    with torch.no_grad():
        y = fn(x, wr, w13, w2, K)
        if not torch.isfinite(y.float()).all():
            raise RuntimeError(f"{name}/{impl}: non-finite output")
        fwd = median_ms(lambda: fn(x, wr, w13, w2, K))

    params = [t.detach().requires_grad_() for t in (x, wr, w13, w2)]

    def fwd_bwd():
        for p in params:
            p.grad = None
        fn(params[0], params[1], params[2], params[3], K).backward(dy)

    fb = median_ms(fwd_bwd)
    for p in params:  # memory: from the parameters alone to the peak of a step
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    S = T * K
    fl_fwd = 2.0 * S * H * 3 * Fd + 2.0 * T * H * E
    fl_fb = 3.0 * fl_fwd
    print(
        f"{name:8s} {impl:8s} | fwd {fwd:8.3f} ms {fl_fwd / fwd / 1e9:6.0f} TFLOP/s"
        f" | fwd+bwd {fb:8.3f} ms {fl_fb / fb / 1e9:6.0f} TFLOP/s"
        f" | extra memory of a step {extra / 1e9:5.2f} GB (bf16 gradients)",
        flush=True,
    )
    del params, x, wr, w13, w2, dy, y
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="mixtral,qwen3")
    ap.add_argument("--impl", default="grouped,loop")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("peer_torch: no CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"cuBLAS dense bf16 8192^3 after {WARM_MS:.0f} ms of load: {dense_tflops():.0f} TFLOP/s")
    for name in args.only.split(","):
        for impl in args.impl.split(","):
            try:
                run_case(name, impl)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                print(f"{name:8s} {impl:8s} | failed: {e}", flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
