"""dataplane_check.py - the Python client over every data path, against a
running cluster: NumPy arrays, Client.buffer arrays (no copy), torch tensors
on the CPU (f32, bf16, requires_grad) and, where a GPU is present, CUDA
tensors (CUDA IPC); every result byte-identical to the coordinator path.
Also: a closed client raises moe.Error, never crashes.

    python3 python/dataplane_check.py --url tcp://127.0.0.1:7000

Prints one line per check and "N passed, M failed"; exit status 1 on any
failure. Parts whose library (torch, CUDA) is missing are reported skipped.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402

passed = failed = 0


def check(ok, what):
    global passed, failed
    print("%s %s" % ("PASS" if ok else "FAIL", what))
    if ok:
        passed += 1
    else:
        failed += 1


def bits(t):
    """a bf16 torch tensor (any device) as uint16 NumPy bits"""
    import torch
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def nccl_checks(url, torch, x, xb, ybref, ref):
    """data_path="nccl": rows GPU to GPU over NCCL (the worker's GPU and
    this process's), every result byte-identical to the coordinator path"""
    if not torch.cuda.is_available():
        print("SKIP no CUDA device: the nccl path")
        return
    n = moe.Client(url, data_path="nccl")
    tb = torch.from_numpy(xb.view(np.int16).copy()).view(torch.bfloat16).cuda()
    yg, st = n.forward("pyb", 0, tb)
    check(yg.is_cuda and np.array_equal(bits(yg), ybref),
          "nccl: torch CUDA bf16 in, CUDA out, equal to the coordinator path")
    check(sum(st["tokens_per_expert"]) == tb.shape[0] * 2, "nccl: stats come back")
    out = torch.empty_like(tb)
    for _ in range(3):
        n.forward("pyb", 0, tb, out=out)
    check(np.array_equal(bits(out), ybref), "nccl: forward(out=) repeated")
    yh, _ = n.forward("pyb", 0, xb)  # host rows, staged through a GPU
    check(np.array_equal(np.asarray(yh).view(np.uint16), ybref),
          "nccl: NumPy bf16 rows (staged on the GPU) equal")
    # training: forward(train) and backward with CUDA tensors against the
    # coordinator path's dx for the same dy
    dy = np.random.default_rng(2).uniform(-1, 1, xb.shape).astype(np.float32)
    dyb = moe.to_bf16(dy)
    _, h0 = ref.forward_train("pyb", 0, xb)
    dxref = ref.backward(h0, dyb)
    _, h1 = n.forward_train("pyb", 0, tb)
    dyg = torch.from_numpy(dyb.view(np.int16).copy()).view(torch.bfloat16).cuda()
    dxg = n.backward(h1, dyg)
    check(dxg.is_cuda and np.array_equal(bits(dxg), np.asarray(dxref).view(np.uint16)),
          "nccl: backward with CUDA dy, dx equal to the coordinator path")
    n.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="tcp://127.0.0.1:7000")
    ap.add_argument("--nccl", action="store_true",
                    help="also the nccl path (CUDA workers, a client GPU): torch CUDA "
                         "tensors and NumPy rows over NCCL")
    a = ap.parse_args()
    H, T = 64, 37
    ref = moe.Client(a.url, data_path="coordinator")
    ref.model_create("pyf", 1, H, 96, 6, 2, dtype="f32", seed=3)
    ref.model_create("pyb", 1, H, 96, 6, 2, dtype="bf16", seed=4)
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (T, H)).astype(np.float32)
    xb = moe.to_bf16(x)
    yref, _ = ref.forward("pyf", 0, x)
    ybref, _ = ref.forward("pyb", 0, xb)

    c = moe.Client(a.url)  # the default: the data plane (shared memory here)
    y, st = c.forward("pyf", 0, x)
    check(np.array_equal(y, yref), "numpy f32 over the data plane equals the coordinator path")
    check(sum(st["tokens_per_expert"]) == T * 2, "stats come back with the rows")
    buf = c.buffer((2 * T, H), "f32")
    buf[:T] = x
    yb, _ = c.forward("pyf", 0, buf[:T], out=buf[T:])
    check(yb is buf[T:] or np.shares_memory(yb, buf), "forward(out=) writes into the buffer")
    check(np.array_equal(buf[T:], yref), "Client.buffer rows (no copy) equal the coordinator path")
    c.free(buf)

    try:
        import torch
    except ImportError:
        torch = None
        print("SKIP torch is not installed")
    if torch is not None:
        tx = torch.from_numpy(x.copy()).requires_grad_(True)
        ty, _ = c.forward("pyf", 0, tx)
        check(isinstance(ty, torch.Tensor) and ty.dtype == torch.float32 and
              np.array_equal(ty.numpy(), yref), "torch f32 (requires_grad) in, torch out, equal")
        tb = torch.from_numpy(xb.view(np.int16).copy()).view(torch.bfloat16)
        tyb, _ = c.forward("pyb", 0, tb)
        check(tyb.dtype == torch.bfloat16 and
              np.array_equal(tyb.view(torch.int16).numpy().view(np.uint16), ybref),
              "torch bf16 in, torch bf16 out, equal")
        y2, h = c.forward_train("pyf", 0, tx)
        dx = c.backward(h, torch.ones_like(ty))
        check(isinstance(dx, torch.Tensor) and dx.shape == tx.shape, "torch backward")
        if torch.cuda.is_available():
            tg = tb.cuda()
            yg, _ = c.forward("pyb", 0, tg)
            check(yg.is_cuda and np.array_equal(yg.cpu().view(torch.int16).numpy().view(np.uint16),
                                                ybref),
                  "torch CUDA bf16 (CUDA IPC) equals the coordinator path")
            out = torch.empty_like(tg)
            for _ in range(3):  # the same allocations: registered once
                c.forward("pyb", 0, tg, out=out)
            check(np.array_equal(out.cpu().view(torch.int16).numpy().view(np.uint16), ybref),
                  "torch CUDA forward(out=) repeated")
        else:
            print("SKIP no CUDA device: the CUDA IPC checks")
        if a.nccl:
            nccl_checks(a.url, torch, x, xb, ybref, ref)
    c.close()
    try:
        c.forward("pyf", 0, x)
        check(False, "a closed client raised nothing")
    except moe.Error as e:
        check(e.code == "closed", "a closed client raises moe.Error(closed): %s" % e)
    ref.close()
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
