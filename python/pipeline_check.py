#!/usr/bin/env python3
"""pipeline_check.py - several training forwards in flight on one layer (a
pipeline schedule) give the bits of the same micro-batches run one after
the other, on a GPU cluster: one worker (--gpu-train-states N, the device
keeping N train forwards per layer for their backwards) or several
(--gpu-ep-train-states N, the expert-parallel path).

  schedule 1: fA fB bB bA        against fB bB fA bA (2 in flight: kept)
  schedule 2: fA fC fB bB bC bA  against fB bB fC bC fA bA (3 in flight:
              with 2 states A's forward is pushed out and recomputed)
  schedule 3: fA iD iC bA        against fA bA (inference forwards of 1 and
              20 rows between a train forward and its backward - fanned
              out on several GPU workers - displace nothing on the
              expert-parallel path, which runs them in a state of their own)

Each pair accumulates the weight gradients in the same order, so dx of
every micro-batch and every gradient (model.grads) must be bit-identical.
The worker logs at model delete how many backwards recomputed their
forward ("N backwards recomputed"): with 2 states that is 1 (schedule 2's
A), which the calling script checks in the log.

    python3 python/pipeline_check.py --url tcp://127.0.0.1:7000

Prints "N passed, M failed"; exit status 1 on a failure.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402
from checklib import Checks, rel, drop_model  # noqa: E402

H, F, E, K = 256, 256, 8, 2
ck = Checks()


def run(c, order, xs, dys):
    """order: ('f', name) / ('b', name) steps; returns (dx by name, grads)"""
    handles, dx = {}, {}
    for op, n in order:
        if op == "f":
            _, handles[n] = c.forward_train("pc", 0, xs[n])
        elif op == "i":
            c.forward("pc", 0, xs[n])
        else:
            dx[n] = c.backward(handles.pop(n), dys[n])
    grads = c.model_grads("pc", 0)
    c.step("pc", lr=0.0)  # clears the gradients, keeps the weights
    return dx, grads


def same(a, b):
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def compare(label, r1, r2):
    dx1, g1 = r1
    dx2, g2 = r2
    for n in sorted(dx1):
        ck.check(same(dx1[n], dx2[n]), "%s: dx of %s bit-identical" % (label, n))
    bad = [k for k in g1 if not same(g1[k], g2[k])]
    ck.check(not bad and set(g1) == set(g2),
          "%s: %d gradient tensors bit-identical%s" % (label, len(g1),
                                                        (" (differ: %s)" % bad[:3]) if bad else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=os.environ.get("MOE_URL", "tcp://127.0.0.1:7000"))
    a = ap.parse_args()
    c = moe.Client(a.url)
    drop_model(c, "pc")
    c.model_create("pc", 1, H, F, E, K, renormalize=True, dtype="bf16", seed=5)
    rng = np.random.default_rng(7)
    rows = {"A": 37, "B": 64, "C": 20, "D": 1}
    xs = {n: rng.standard_normal((t, H)).astype(np.float32) for n, t in rows.items()}
    dys = {n: rng.standard_normal((t, H)).astype(np.float32) for n, t in rows.items()}
    s1 = run(c, [("f", "A"), ("f", "B"), ("b", "B"), ("b", "A")], xs, dys)
    s1r = run(c, [("f", "B"), ("b", "B"), ("f", "A"), ("b", "A")], xs, dys)
    compare("2 in flight", s1, s1r)
    s2 = run(c, [("f", "A"), ("f", "C"), ("f", "B"), ("b", "B"), ("b", "C"), ("b", "A")], xs, dys)
    s2r = run(c, [("f", "B"), ("b", "B"), ("f", "C"), ("b", "C"), ("f", "A"), ("b", "A")], xs,
              dys)
    compare("3 in flight", s2, s2r)
    s3 = run(c, [("f", "A"), ("i", "D"), ("i", "C"), ("b", "A")], xs, dys)
    s3r = run(c, [("f", "A"), ("b", "A")], xs, dys)
    compare("inference between", s3, s3r)
    ck.check(all(np.isfinite(v).all() for v in s2[1].values()), "gradients finite")
    c.model_delete("pc")  # the worker logs its recompute count now
    return ck.done()


if __name__ == "__main__":
    sys.exit(main())
