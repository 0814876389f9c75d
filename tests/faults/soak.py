#!/usr/bin/env python3
"""soak.py - a bounded chaos run of a local cluster (not a test: a tool).

Starts a coordinator (with --checkpoint-dir, --checkpoint-every 1) and W CPU
workers on loopback, then for --seconds: inference forwards of random sizes,
training steps (forward(train) + backward + optimizer.step with expect_step),
and every --kill-every seconds a SIGKILL of a random worker, restarted at
once. Checks as it goes:
  - every call either succeeds or fails with `unavailable`/`expired`/
    `failed_precondition` (never a crash, a hang or another error);
  - the step count never moves backwards past the last checkpoint and never
    skips (exactly-once);
  - the daemons' memory (RSS) at the end against the start.
Prints a summary; exits non-zero on a violated check. Every process it starts
is stopped at the end (SIGTERM, then SIGKILL).

    python3 tests/faults/soak.py --seconds 120 --workers 2 --kill-every 20
"""
import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import moe  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def rss_kb(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=15)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    d = tempfile.mkdtemp(prefix="moe-soak-")
    ck = os.path.join(d, "ckpt")
    logs = []
    procs = {}

    def spawn(name, args):
        log = open(os.path.join(d, name + ".log"), "ab")
        logs.append(log)
        procs[name] = subprocess.Popen(args, stdout=log, stderr=log)

    addr = os.path.join(d, "addr")
    spawn("coord", [os.path.join(ROOT, "bin/moe-coordinator"), "--listen", "tcp://127.0.0.1:0",
                    "--addr-file", addr, "--workers", str(a.workers), "--checkpoint-dir", ck,
                    "--cluster-secret-file", os.path.join(d, "secret"),
                    "--checkpoint-every", "1", "--heartbeat-timeout-ms", "1000",
                    "--log-level", "warn"])
    for _ in range(100):
        if os.path.exists(addr):
            break
        time.sleep(0.05)
    url = open(addr).read().strip()

    def start_worker(i):
        spawn("w%d" % i, [os.path.join(ROOT, "bin/moe-worker"), "--coordinator", url,
                          "--cluster-secret-file", os.path.join(d, "secret"),
                          "--threads", "1", "--heartbeat-ms", "200", "--xchg-timeout-ms", "3000",
                          "--log-level", "warn"])

    for i in range(a.workers):
        start_worker(i)
    c = moe.Client(url, timeout_ms=30000)
    H, T = 64, 32
    c.model_create("soak", layers=2, d_model=H, d_ff=128, n_experts=8, top_k=2, seed=5)
    ok_codes = {"unavailable", "expired", "failed_precondition", "deadline_exceeded"}
    counts = {"forward": 0, "train_step": 0, "errors": 0, "kills": 0, "restores": 0}
    bad = []
    step = 0  # the service's step count as this client knows it
    t0 = time.time()
    rss0 = None
    next_kill = t0 + a.kill_every
    while time.time() - t0 < a.seconds:
        if rss0 is None and time.time() - t0 > 3:
            rss0 = {n: rss_kb(p.pid) for n, p in procs.items()}
        if time.time() >= next_kill:
            i = rnd.randrange(a.workers)
            procs["w%d" % i].send_signal(signal.SIGKILL)
            procs["w%d" % i].wait()
            start_worker(i)
            counts["kills"] += 1
            next_kill += a.kill_every
        try:
            if rnd.random() < 0.5:
                x = np.random.default_rng(rnd.randrange(1 << 30)).uniform(
                    -1, 1, (rnd.randrange(1, 64), H)).astype(np.float32)
                c.forward("soak", rnd.randrange(2), x)
                counts["forward"] += 1
            else:
                x = np.random.default_rng(rnd.randrange(1 << 30)).uniform(
                    -1, 1, (T, H)).astype(np.float32)
                y, h = c.forward_train("soak", 0, x)
                c.backward(h, y * 1e-2)
                s, _ = c.step("soak", lr=1e-3, expect_step=step)
                if s != step + 1:
                    bad.append("step went from %d to %d" % (step, s))
                step = s
                counts["train_step"] += 1
        except moe.Error as e:
            counts["errors"] += 1
            if e.code not in ok_codes:
                bad.append("unexpected error: %s" % e)
            if e.code == "failed_precondition" and "is at step" in str(e):
                # a restore brought the model back to its last checkpoint:
                # with --checkpoint-every 1 that is the last completed step
                at = int(str(e).split("is at step ")[1].split(",")[0])
                if at < step:
                    bad.append("step moved backwards from %d to %d" % (step, at))
                counts["restores"] += at != step
                step = at
            time.sleep(0.05)
    rss1 = {n: rss_kb(p.pid) for n, p in procs.items()}
    c.close()
    for p in procs.values():
        p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    for log in logs:
        log.close()
    print("soak %.0f s, %d workers: %d forwards, %d training steps (final step %d), %d errors "
          "(all expected kinds: %s), %d worker kills" % (
              time.time() - t0, a.workers, counts["forward"], counts["train_step"], step,
              counts["errors"], "yes" if not any(b.startswith("unexpected") for b in bad) else "no",
              counts["kills"]))
    if rss0:
        print("RSS kB start -> end: " + ", ".join(
            "%s %d -> %d" % (n, rss0.get(n, 0), rss1.get(n, 0)) for n in sorted(rss1)
            if n in rss0 and rss0[n]))
    for b in bad[:10]:
        print("VIOLATION: " + b)
    print("%d passed, %d failed" % (0 if bad else 1, 1 if bad else 0))
    if bad:
        print("logs in " + d)
    else:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
