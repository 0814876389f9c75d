#!/usr/bin/env python3
"""pipeline_bench.py - the time of a pipeline schedule with two training
forwards in flight on one layer (fA fB bB bA) against the same micro-batches
one after the other (fA bA fB bB), through a running cluster. With one
train state per layer (GPU workers: --gpu-train-states / --gpu-ep-train-states
1) bA recomputes A's forward; with 2 it does not.

    python3 bench/pipeline_bench.py --url $MOE_URL [--tokens 4096] [--iters 20]
        [--d-model 2048 --d-ff 768 --experts 128 --top-k 8]

Prints the p50 of each schedule in ms per iteration (two forwards and two
backwards of --tokens rows each).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import moe  # noqa: E402
from checklib import drop_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=os.environ.get("MOE_URL", "tcp://127.0.0.1:7000"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    a = ap.parse_args()
    c = moe.Client(a.url)
    drop_model(c, "pb")
    c.model_create("pb", 1, a.d_model, a.d_ff, a.experts, a.top_k, renormalize=True,
                   dtype="bf16", seed=3)
    rng = np.random.default_rng(1)
    x = {n: rng.standard_normal((a.tokens, a.d_model)).astype(np.float32) for n in "AB"}
    dy = {n: rng.standard_normal((a.tokens, a.d_model)).astype(np.float32) * 0.01 for n in "AB"}
    y = {n: np.empty_like(x[n]) for n in "AB"}
    dx = {n: np.empty_like(x[n]) for n in "AB"}

    def schedule(order):
        h = {}
        t0 = time.perf_counter()
        for op, n in order:
            if op == "f":
                _, h[n] = c.forward_train("pb", 0, x[n], out=y[n])
            else:
                c.backward(h.pop(n), dy[n], out=dx[n])
        return time.perf_counter() - t0

    plans = {"pipeline fA fB bB bA": [("f", "A"), ("f", "B"), ("b", "B"), ("b", "A")],
             "sequential fA bA fB bB": [("f", "A"), ("b", "A"), ("f", "B"), ("b", "B")]}
    times = {k: [] for k in plans}
    for it in range(a.iters + 2):  # interleaved, two warm-up rounds
        for k, order in plans.items():
            t = schedule(order)
            if it >= 2:
                times[k].append(t)
        if it % 4 == 3:
            c.step("pb", lr=0.0)  # clears the gradients, keeps the weights
    for k, v in times.items():
        print("%-24s %.3f ms per iteration (p50 of %d; 2 x %d tokens, %d/%d/%d/top-%d bf16)" %
              (k, 1e3 * float(np.median(v)), len(v), a.tokens, a.d_model, a.d_ff, a.experts,
               a.top_k))
    c.model_delete("pb")
    return 0


if __name__ == "__main__":
    sys.exit(main())
