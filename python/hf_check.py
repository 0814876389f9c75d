#!/usr/bin/env python3
"""hf_check.py - the Python client on a Hugging Face fixture (made by
make_fixtures.py): Client.model_create_from_hf, model_info's "hf",
forward against transformers' y, and model_grads against transformers'
autograd gradients (every one the fixture has: the router, the experts, and
the shared expert and its gate where the family has them). NumPy only (the
expected file is read here).

    python3 python/hf_check.py --url URL --dir DIR/mixtral-f32 [--name py]

Prints PASS and exits 0 when every relative error is <= 1e-5.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402


def read_safetensors(path):
    """{name: float32 array} of an F32 safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[a:b], dtype=np.float32).reshape(v["shape"])
    return out


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", default="py")
    a = ap.parse_args()
    exp = read_safetensors(a.dir.rstrip("/") + ".expected.safetensors")
    c = moe.Client(a.url)
    c.model_create_from_hf(a.name, a.dir)
    info = c.model_info(a.name)["hf"]
    worst = 0.0
    y, _ = c.forward(a.name, 0, exp["x.0"].copy())
    worst = max(worst, rel(y, exp["y.0"]))
    y, h = c.forward_train(a.name, 0, exp["x.0"].copy())
    dx = c.backward(h, exp["dy.0"].copy())
    worst = max(worst, rel(dx, exp["dx.0"]))
    grads = c.model_grads(a.name, 0)
    for name, g in grads.items():
        worst = max(worst, rel(g, exp["grad." + name]))
    one = c.model_grads(a.name, 0, expert=3)
    # the first MoE layer's autograd gradients: those named like its router
    layer = next(k for k in grads if k.endswith(".gate.weight")).rsplit(".", 2)[0]
    want = [k for k in exp if k.startswith("grad." + layer + ".")]
    shared = [k for k in want if "shared" in k]
    ok = (worst <= 1e-5 and len(grads) == len(want)
          and len(grads) == 1 + len(shared) + 3 * len(exp["counts.0"])
          and len(one) == 1 + len(shared) + 3)
    print(f"{info['family']}: layers {[l['layer'] for l in info['layers']]}, "
          f"{len(grads)} gradient tensors ({len(shared)} shared), worst rel err {worst:.2e}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
