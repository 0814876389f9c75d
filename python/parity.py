#!/usr/bin/env python3
"""parity.py - the service against an independent reference of the
Hugging Face Mixtral sparse MoE block (router softmax, top-k, renormalised
weights, SwiGLU experts w2(silu(w1 x) * w3 x), weighted sum).

The model's weights are read back from the service's own checkpoint (Hugging
Face tensor names), so nothing is shared with the C code but the bytes.
With PyTorch installed the reference is a torch module and dx comes from
autograd; without it, NumPy in float64 and dx from central differences.

    python3 python/parity.py --url tcp://127.0.0.1:7000 [--dtype f32|bf16] [--workdir DIR]

Prints the relative errors and exits non-zero if a bound is exceeded
(f32: 1e-5 for y, 1e-4 for dx; bf16: 2e-2).
"""
import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402

T, H, F, E, K = 37, 64, 128, 8, 2


def moe_block_np(x, wr, w1, w3, w2):
    """float64 NumPy forward of the Mixtral block. x (T,H); weights nn.Linear layout."""
    logits = x @ wr.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top = np.argsort(-p, axis=1, kind="stable")[:, :K]
    w = np.take_along_axis(p, top, axis=1)
    w /= w.sum(axis=1, keepdims=True)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = top[t, j]
            a, b = w1[e] @ x[t], w3[e] @ x[t]
            h = a / (1 + np.exp(-a)) * b
            y[t] += w[t, j] * (w2[e] @ h)
    return y


def reference_torch(x, dy, wr, w1, w3, w2):
    import torch

    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wr_, w1_, w3_, w2_ = (torch.tensor(a, dtype=torch.float64) for a in (wr, w1, w3, w2))
    logits = xt @ wr_.T
    p = torch.softmax(logits, dim=1)
    w, top = torch.topk(p, K, dim=1)
    w = w / w.sum(dim=1, keepdim=True)
    y = torch.zeros_like(xt)
    for e in range(E):
        tok, slot = torch.where(top == e)
        if tok.numel() == 0:
            continue
        xe = xt[tok]
        h = torch.nn.functional.silu(xe @ w1_[e].T) * (xe @ w3_[e].T)
        y = y.index_add(0, tok, (h @ w2_[e].T) * w[tok, slot, None])
    (y * torch.tensor(dy, dtype=torch.float64)).sum().backward()
    return y.detach().numpy(), xt.grad.numpy()


def reference_numpy(x, dy, wr, w1, w3, w2):
    y = moe_block_np(x, wr, w1, w3, w2)
    dx = np.zeros_like(x)
    eps = 1e-6
    for t in range(x.shape[0]):  # token t's output depends on x[t] only
        for i in range(x.shape[1]):
            xp, xm = x[t:t + 1].copy(), x[t:t + 1].copy()
            xp[0, i] += eps
            xm[0, i] -= eps
            lp = (moe_block_np(xp, wr, w1, w3, w2) * dy[t:t + 1]).sum()
            lm = (moe_block_np(xm, wr, w1, w3, w2) * dy[t:t + 1]).sum()
            dx[t, i] = (lp - lm) / (2 * eps)
    return y, dx


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    global H, F
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=os.environ.get("MOE_URL", "tcp://127.0.0.1:7000"))
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--numpy", action="store_true", help="NumPy reference even if torch exists")
    ap.add_argument("--d-model", type=int, default=H)
    ap.add_argument("--d-ff", type=int, default=F)
    args = ap.parse_args()
    H, F = args.d_model, args.d_ff
    c = moe.Client(args.url, timeout_ms=120000)
    name = "parity_" + args.dtype
    c.model_create(name, layers=1, d_model=H, d_ff=F, n_experts=E, top_k=K, renormalize=True,
                   dtype=args.dtype, seed=3, aux_loss_coef=0.0, z_loss_coef=0.0)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (T, H)).astype(np.float32)
    dy = rng.uniform(-1, 1, (T, H)).astype(np.float32)
    if args.dtype == "bf16":
        x, dy = moe.from_bf16(moe.to_bf16(x)), moe.from_bf16(moe.to_bf16(dy))
        y, h = c.forward_train(name, 0, moe.to_bf16(x))
        dx = moe.from_bf16(c.backward(h, moe.to_bf16(dy)))
        y = moe.from_bf16(y)
    else:
        y, h = c.forward_train(name, 0, x)
        dx = c.backward(h, dy)
    work = args.workdir or tempfile.mkdtemp(prefix="moe-parity-")
    c.checkpoint_save(name, work)
    wts, meta = moe.read_checkpoint(work)
    pre = "model.layers.0.block_sparse_moe."
    wr = wts[pre + "gate.weight"].astype(np.float64)
    w1 = np.stack([wts[pre + "experts.%d.w1.weight" % e] for e in range(E)]).astype(np.float64)
    w3 = np.stack([wts[pre + "experts.%d.w3.weight" % e] for e in range(E)]).astype(np.float64)
    w2 = np.stack([wts[pre + "experts.%d.w2.weight" % e] for e in range(E)]).astype(np.float64)
    try:
        if args.numpy:
            raise ImportError
        yr, dxr = reference_torch(x.astype(np.float64), dy.astype(np.float64), wr, w1, w3, w2)
        kind = "torch (autograd)"
    except ImportError:
        yr, dxr = reference_numpy(x.astype(np.float64), dy.astype(np.float64), wr, w1, w3, w2)
        kind = "numpy float64 (central differences)"
    ey, edx = rel(y, yr), rel(dx, dxr)
    by, bdx = (1e-5, 1e-4) if args.dtype == "f32" else (2e-2, 2e-2)
    ok = ey < by and edx < bdx
    print("parity vs %s, %s, T=%d H=%d F=%d E=%d K=%d: y rel err %.2e (bound %.0e), "
          "dx rel err %.2e (bound %.0e): %s" % (kind, args.dtype, T, H, F, E, K, ey, by, edx,
                                                bdx, "PASS" if ok else "FAIL"))
    print("%d passed, %d failed" % (1 if ok else 0, 0 if ok else 1))
    c.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
