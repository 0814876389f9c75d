#!/usr/bin/env python3
"""family_check.py - the routing families on a GPU worker against a CPU
worker: a DeepSeek-V3-like layer (sigmoid scores, choice bias, 8 groups of
which 4 kept, top-2 group sums, renormalised, routed scaling 2.5, one
shared expert) and a Qwen2-MoE-like one (softmax, no renormalisation, a
shared expert of 4 d_ff behind a sigmoid gate), bf16, created with the same
seed on each cluster.

    python3 python/family_check.py --url URL --save ref.npz      (CPU cluster)
    python3 python/family_check.py --url URL --against ref.npz   (GPU cluster)

With --against: y (inference, T=200 and T=4), dx and every weight gradient
of a training forward and backward - with an inference forward of 4 rows
between them (on several GPU workers a training layer of one state, as a
shared expert's, refuses the fan-out and the forward takes the ordered
road) - compared with the saved run (relative
error <= 3e-2: bf16 on both, summed in other orders), and the tokens per
expert equal. Prints "N passed, M failed"; exit status 1 on a failure.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402
from checklib import Checks, rel, drop_model  # noqa: E402

H, F, E = 256, 256, 64
FAMILIES = {
    "dsv3": dict(top_k=8, renormalize=True, scoring="sigmoid", score_bias=True, n_group=8,
                 topk_group=4, group_topn=2, routed_scaling_factor=2.5, shared_d_ff=F),
    "qwen2": dict(top_k=6, renormalize=False, shared_d_ff=4 * F, shared_gate=True),
}
TOL = 3e-2
ck = Checks()


def run(c, name, fam):
    drop_model(c, name)
    p = dict(name=name, layers=1, d_model=H, d_ff=F, n_experts=E, activation="swiglu",
             dtype="bf16", seed=11, aux_loss_coef=0.01, z_loss_coef=0.001)
    p.update(fam)
    c.call("model.create", p)
    rng = np.random.default_rng(3)
    out = {}
    for T in (200, 4):
        x = rng.standard_normal((T, H)).astype(np.float32)
        y, st = c.forward(name, 0, x)
        out["y%d" % T] = y
        out["tpe%d" % T] = np.asarray(st["tokens_per_expert"], dtype=np.int64)
    x4 = rng.standard_normal((4, H)).astype(np.float32)
    x = rng.standard_normal((64, H)).astype(np.float32)
    dy = rng.standard_normal((64, H)).astype(np.float32)
    _, h = c.forward_train(name, 0, x)
    out["y4t"], _ = c.forward(name, 0, x4)
    out["dx"] = c.backward(h, dy)
    for k, g in c.model_grads(name, 0).items():
        out["g:" + k] = g
    c.step(name, lr=0.0)
    c.model_delete(name)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=os.environ.get("MOE_URL", "tcp://127.0.0.1:7000"))
    ap.add_argument("--save")
    ap.add_argument("--against")
    a = ap.parse_args()
    c = moe.Client(a.url)
    got = {}
    for fam, cfg in FAMILIES.items():
        for k, v in run(c, "fc_" + fam, cfg).items():
            got[fam + "/" + k] = v
    if a.save:
        np.savez(a.save, **got)
        print("saved %d arrays to %s" % (len(got), a.save))
        return 0
    ref = np.load(a.against)
    ck.check(set(ref.files) == set(got), "the same tensors (%d)" % len(got))
    for k in sorted(set(ref.files) & set(got)):
        if "/tpe" in k:
            ck.check(np.array_equal(ref[k], got[k]), "%s: tokens per expert equal" % k)
        else:
            e = rel(got[k], ref[k])
            ck.check(e <= TOL and np.isfinite(got[k]).all(), "%s: rel err %.2e" % (k, e))
    return ck.done()


if __name__ == "__main__":
    sys.exit(main())
