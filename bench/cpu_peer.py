#!/usr/bin/env python3
"""cpu_peer.py - one MoE layer forward on this CPU: moe's CPU worker kernels
per OpenBLAS core, beside PyTorch on the same layer, in one run.

moe side: bin/cpu_layer_bench (make bin/cpu_layer_bench), the kernels the
CPU worker runs (worker/forward.c: router sgemm, softmax top-k, layout, rows
into expert order, one sgemm SwiGLU FFN per expert, combine), one process
per configuration, since OpenBLAS reads OPENBLAS_CORETYPE only when it loads:

  default   the core the library picks by itself
  pick      --pick: blas_pick_reexec first, as moe-worker does (the core
            the worker runs with)
  Prescott  OPENBLAS_CORETYPE=Prescott: the SSE3 fallback that OpenBLAS
            0.3.21 takes on CPUs newer than its table (the issue's Xeon)
  Haswell   OPENBLAS_CORETYPE=Haswell: the AVX2 kernels (what the pick
            chooses on an AVX2 CPU; on an AVX-512 CPU, the class kept)
  pick+fresh  the pick's core with the forward's buffers malloc'd per call
            (--fresh-buffers: page faults on every call, as before the
            worker's buffer pool)

torch side: the Hugging Face Mixtral sparse-MoE block written out (router
linear, softmax, top-k renormalised, one F.linear SwiGLU per expert that
has tokens, index_add_), f32, no autograd, torch's default threads (one per
core), in its own process, on the very weights and tokens of the moe run
(bin/cpu_layer_bench --dump); its output is checked against moe's first.

Each T: warm-up of --warm-s (at least one call), then the median of --reps
timed calls; with --rounds N every configuration runs N times, interleaved
with torch, and the table gives the median of the rounds' medians (and the
lowest, the least disturbed round on a shared host). GFLOP/s counts 2*T*K*3*H*F + 2*T*H*E. "vs torch" is torch's
time over this row's (above 1: faster than torch).

  python3 bench/cpu_peer.py [--T 1,4096] [--H 4096] [--F 2048] [--E 8]
                            [--K 2] [--reps 5] [--warm-s 1]
                            [--rounds 1] [--configs default,pick,Prescott,Haswell]
                            [--before OLD_BIN]

A config named before:NAME runs NAME with the binary given by --before (a
build of an older commit), so that a change is timed before and after in
the same run as torch.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bin", "cpu_layer_bench")


def flops(T, H, F, E, K):
    return 2.0 * T * K * 3 * H * F + 2.0 * T * H * E


def shape_args(a):
    return ["--H", str(a.H), "--F", str(a.F), "--E", str(a.E), "--K", str(a.K)]


def parse_results(text, phases=None):
    """{T: (median_ms, min_ms)} and the BLAS line of a run's output; the
    PHASES lines into phases {T: "gate=.. ..."} when given"""
    res, blas = {}, ""
    for line in text.splitlines():
        if line.startswith("BLAS "):
            blas = line[5:]
        m = re.match(r"RESULT T=(\d+) median_ms=([\d.]+) min_ms=([\d.]+)", line)
        if m:
            res[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
        m = re.match(r"PHASES T=(\d+) (.*) \(ms, medians\)", line)
        if m and phases is not None:
            phases[int(m.group(1))] = m.group(2)
    return res, blas


def run_moe(a, name, phases):
    env = dict(os.environ)
    env.pop("MOE_BLAS_REEXEC", None)
    bench = BENCH
    if name.startswith("before:"):
        if not a.before:
            sys.exit("config %s needs --before BIN" % name)
        bench, name = a.before, name[len("before:"):]
    cmd = [bench, "--T", a.T, "--reps", str(a.reps), "--warm-s", str(a.warm_s)] + shape_args(a)
    if name.endswith("+fresh"):
        cmd.append("--fresh-buffers")
        name = name[:-len("+fresh")]
    if name == "pick":
        cmd.append("--pick")
        env.pop("OPENBLAS_CORETYPE", None)
    elif name == "default":
        env.pop("OPENBLAS_CORETYPE", None)
    else:
        env["OPENBLAS_CORETYPE"] = name
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("cpu_layer_bench (%s) failed: %s" % (name, p.stderr.strip()))
    return parse_results(p.stdout, phases)


# ---------------- torch side (its own process) ----------------

def torch_worker(a):
    import numpy as np
    import torch
    import torch.nn.functional as Fn

    raw = np.fromfile(a.torch_worker, dtype=np.uint8)
    T0, H, F, E, K = (int(v) for v in raw[:20].view(np.int32))
    vals = torch.from_numpy(raw[20:].view(np.float32))
    sizes = [T0 * H, E * H, E * F * H, E * F * H, E * H * F, T0 * H]
    parts, off = [], 0
    for n in sizes:
        parts.append(vals[off:off + n])
        off += n
    x = parts[0].view(T0, H)
    wr = parts[1].view(E, H)
    w1, w3 = parts[2].view(E, F, H), parts[3].view(E, F, H)
    w2 = parts[4].view(E, H, F)
    y_moe = parts[5].view(T0, H)

    def layer(xt):
        logits = Fn.linear(xt, wr)
        probs = logits.softmax(dim=-1)
        tw, ti = probs.topk(K, dim=-1)
        tw = tw / tw.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(xt)
        for e in range(E):
            tok, kk = torch.where(ti == e)
            if tok.numel() == 0:
                continue
            xe = xt[tok]
            h = Fn.silu(Fn.linear(xe, w1[e])) * Fn.linear(xe, w3[e])
            y.index_add_(0, tok, Fn.linear(h, w2[e]) * tw[tok, kk, None])
        return y

    with torch.no_grad():
        y = layer(x)
        rel = float((y - y_moe).norm() / y_moe.norm())
        print("CHECK T=%d rel_err_vs_moe=%.3g threads=%d torch=%s" %
              (T0, rel, torch.get_num_threads(), torch.__version__))
        for T in (int(t) for t in a.T.split(",")):
            xt = x[:T].clone()
            t0 = time.perf_counter()
            layer(xt)
            while time.perf_counter() - t0 < a.warm_s:
                layer(xt)
            ts = []
            for _ in range(a.reps):
                t1 = time.perf_counter()
                layer(xt)
                ts.append(time.perf_counter() - t1)
            ts.sort()
            n = len(ts)
            med = ts[n // 2] if n % 2 else 0.5 * (ts[n // 2 - 1] + ts[n // 2])
            print("RESULT T=%d median_ms=%.4f min_ms=%.4f" % (T, med * 1e3, ts[0] * 1e3))
            sys.stdout.flush()


def run_torch(a, dump_path):
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", dump_path, "--T", a.T,
           "--reps", str(a.reps), "--warm-s", str(a.warm_s)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        err = p.stderr.strip().splitlines()
        return None, "torch run failed: %s" % (err[-1] if err else p.returncode)
    res, _ = parse_results(p.stdout)
    check = next((l for l in p.stdout.splitlines() if l.startswith("CHECK")), "")
    return res, check


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="1,4096")
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--F", type=int, default=2048)
    ap.add_argument("--E", type=int, default=8)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warm-s", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times, keep each one's best median")
    ap.add_argument("--configs", default="default,pick,Prescott,Haswell")
    ap.add_argument("--before", default=None,
                    help="another cpu_layer_bench binary (an older build), run by configs "
                    "named before:NAME")
    ap.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        return torch_worker(a)
    if not os.access(BENCH, os.X_OK):
        sys.exit("%s missing: run `make bin/cpu_layer_bench` first" % BENCH)
    Ts = [int(t) for t in a.T.split(",")]
    model = open("/proc/cpuinfo").read()
    cpu = re.search(r"model name\s*:\s*(.*)", model)
    print("cpu: %s, %d cores; layer H=%d F=%d E=%d K=%d f32 SwiGLU; reps %d, warm-up %.1f s" %
          (cpu.group(1) if cpu else "?", os.cpu_count(), a.H, a.F, a.E, a.K, a.reps, a.warm_s))
    print("load average at start: %.2f" % os.getloadavg()[0])

    rows = {}  # label: [blas, {T: [(med, min) of each round]}]
    phases = {}  # label: {T: [text of each round]}

    def keep(label, blas, res, ph=None):
        row = rows.setdefault(label, [blas, {}])
        for T, v in res.items():
            row[1].setdefault(T, []).append(v)
            if ph is not None and T in ph:
                phases.setdefault(label, {}).setdefault(T, []).append(ph[T])

    def brief(res):
        return " ".join("T=%d %.3f ms" % (T, v[0]) for T, v in sorted(res.items()))

    names = [c for c in a.configs.split(",") if c]
    # the layer's weights and tokens for torch (the largest T's tokens)
    fd, dump_path = tempfile.mkstemp(prefix="moe_cpu_peer_", suffix=".bin")
    os.close(fd)
    try:
        env = dict(os.environ)
        env.pop("OPENBLAS_CORETYPE", None)
        d = subprocess.run([BENCH, "--T", str(max(Ts)), "--dump", dump_path] + shape_args(a),
                           env=env, capture_output=True, text=True)
        if d.returncode != 0:
            sys.exit("cpu_layer_bench --dump failed: %s" % d.stderr.strip())
        for rnd in range(a.rounds):
            for i, name in enumerate(names):
                ph = {}
                res, blas = run_moe(a, name, ph)
                keep("moe " + name, blas, res, ph)
                print("  round %d: moe %-11s %s  %s  (load %.2f)" %
                      (rnd + 1, name, brief(res), blas, os.getloadavg()[0]))
                if i == 1 or len(names) == 1:  # torch in the middle of the moe runs
                    tres, check = run_torch(a, dump_path)
                    print("  round %d: torch %s  %s  (load %.2f)" %
                          (rnd + 1, brief(tres or {}), check, os.getloadavg()[0]))
                    if tres is not None:
                        keep("torch", "PyTorch, MKL (F.linear per expert)", tres)
    finally:
        os.unlink(dump_path)
    print("load average at end: %.2f" % os.getloadavg()[0])
    rows = [(label, r[0], r[1]) for label, r in rows.items()]

    def med_of(vals):
        v = sorted(vals)
        n = len(v)
        return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])

    torch_row = next((r for r in rows if r[0] == "torch"), None)
    print()
    print("median ms: the median over the rounds of each round's median; best: the lowest")
    print("round median; vs torch: torch's median ms over the row's")
    print()
    print("| T | run | BLAS | median ms | best ms | rounds | GFLOP/s | vs torch |")
    print("|---|---|---|---|---|---|---|---|")
    for T in Ts:
        for label, blas, res in rows:
            if T not in res:
                continue
            meds = [v[0] for v in res[T]]
            med, best = med_of(meds), min(meds)
            g = flops(T, a.H, a.F, a.E, a.K) / (med * 1e-3) * 1e-9
            vs = "-"
            if torch_row and T in torch_row[2]:
                vs = "%.2f" % (med_of([v[0] for v in torch_row[2][T]]) / med)
            print("| %d | %s | %s | %.3f | %.3f | %d | %.1f | %s |" %
                  (T, label, blas, med, best, len(meds), g, vs))
    print()
    print("phases of the moe runs, each round (ms, medians; act_alone is part of experts):")
    for T in Ts:
        for label, ph in phases.items():
            for i, text in enumerate(ph.get(T, [])):
                print("  T=%d %-18s r%d %s" % (T, label, i + 1, text))

if __name__ == "__main__":
    main()
