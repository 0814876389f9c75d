#!/usr/bin/env python3
"""kill_test.py - the "Faults" check: SIGKILL one worker in the middle of a
stream of requests and check that the service fails cleanly and recovers.

Run through deploy/gpu-kill-test.sh (it picks GPU or CPU workers, sets up
the runtime libraries and NCCL_NVLS_ENABLE=0, bounds the whole run and kills
whatever is left); it can also be run directly:

    python3 tests/faults/kill_test.py --workers 2 --backend cpu [--train --checkpoint-dir DIR]

What it does: starts a coordinator and --workers workers on loopback (with
--gpus: worker i on --device i), creates a bf16 inference model (and with
--train a training model), runs --clients threads of forwards (and with
--train one thread of forward(train) + backward + optimizer.step with
expect_step), SIGKILLs worker --victim in the middle of the stream (with
--train while an optimizer.step is in flight, --step-delay-s after it was
sent; with --kill-during ckpt while the automatic checkpoint that makes a
step durable is being written), restarts it with the same flags, and checks,
with timestamps:

  1. the coordinator stays up (process alive, ping answered);
  2. the requests in flight at the kill and those sent until the cluster
     re-formed are answered with an error of an expected code (`unavailable`;
     `expired` for a backward, `failed_precondition` for a step); none takes
     longer than --answer-bound-s;
  3. cluster.status (moectl status) reports the killed worker down;
  4. after the restart the cluster re-forms (a new generation, every worker
     up) and requests succeed again (the inference model's output equals
     the one before the kill, within a bf16 tolerance);
  5. with --train and --checkpoint-dir: the step counter after recovery is
     the last acknowledged step, the weights equal that step's checkpoint
     bit for bit (an explicit checkpoint.save compared with the automatic
     one) and a probe forward equals the one taken right after that step;
     with --kill-during ckpt also that the step whose checkpoint lost the
     victim was answered `unavailable` ("outcome unknown") before the
     survivors finished writing their shards, and was not kept;
  6. every process started is stopped.

--kill-during ckpt finds its moment without any worker test flag (so that
it works on GPU workers too): it watches the checkpoint directory for the
in-flight step's new ckpt-<step>-* directory (made by the first worker that
starts writing, after every worker finished the step itself) and kills while
the victim's shard is not in it yet (a shard is written as .tmp and renamed
once fsynced). The default model's save is about 600 MB (fp32 masters and
AdamW moments), long enough a window on CPU and GPU hosts.

Prints a PASS/FAIL table and exits 1 when a check failed.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import moe  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.path.join(ROOT, "bin")

T0 = time.monotonic()
_plock = threading.Lock()


def log(msg):
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + ".%03d" % int(now % 1 * 1000)
    with _plock:
        print("%s +%7.3fs  %s" % (stamp, time.monotonic() - T0, msg), flush=True)


class Abort(Exception):
    """A step that cannot go on (its check failed or the time is up)."""


DTYPE = "bf16"  # --dtype: the models' dtype and so the rows' on the wire


def to_rows(a):
    """float32 rows as the models' dtype takes them (bf16: uint16 bits)"""
    return moe.to_bf16(a) if DTYPE == "bf16" else np.ascontiguousarray(a, dtype=np.float32)


def from_rows(y):
    """a forward's rows as float32"""
    return moe.from_bf16(y) if DTYPE == "bf16" else np.asarray(y, dtype=np.float32)


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))


# ---------------------------------------------------------------- cluster --

class Cluster:
    def __init__(self, a, run):
        self.a = a
        self.run = run
        self.procs = []  # every Popen started, for the final stop
        self.logs = []
        self.coord = None
        self.workers = {}  # i -> Popen (current)
        self.wargv = {}  # i -> argv (restarts reuse it)
        self.winfo = {}  # i -> (pid, rpc_url) from the worker's first log line
        self.nstart = {}
        self.url = None

    def _spawn(self, name, argv):
        path = os.path.join(self.run, name + ".log")
        f = open(path, "ab")
        self.logs.append(f)
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((name, p))
        return p, path

    def start_coordinator(self, ckpt_dir):
        a = self.a
        addr = os.path.join(self.run, "addr")
        if os.path.exists(addr):  # a --run-dir used before
            os.unlink(addr)
        argv = [os.path.join(BIN, "moe-coordinator"), "--listen", "tcp://127.0.0.1:0",
                "--addr-file", addr, "--workers", str(a.workers), "--xchg", a.xchg,
                "--cluster-secret-file", os.path.join(self.run, "secret"),
                "--heartbeat-timeout-ms", str(a.heartbeat_timeout_ms),
                "--worker-timeout-ms", str(a.worker_timeout_ms)]
        if a.min_workers:
            argv += ["--min-workers", str(a.min_workers),
                     "--shrink-after-ms", str(a.shrink_after_ms)]
        if ckpt_dir:
            # explicit checkpoint.save paths (the durability check's) lie in the run directory
            argv += ["--checkpoint-dir", ckpt_dir, "--checkpoint-every", "1",
                     "--checkpoint-root", self.run]
        self.coord, _ = self._spawn("coordinator", argv)
        t = time.monotonic()
        while time.monotonic() - t < 10:
            if os.path.exists(addr):
                self.url = open(addr).read().strip()
                if self.url:
                    return
            if self.coord.poll() is not None:
                raise Abort("the coordinator exited with %s at start" % self.coord.returncode)
            time.sleep(0.05)
        raise Abort("the coordinator wrote no address in 10 s")

    def start_worker(self, i):
        a = self.a
        if i not in self.wargv:
            argv = [os.path.join(BIN, "moe-worker"), "--coordinator", self.url,
                    "--cluster-secret-file", os.path.join(self.run, "secret"),
                    "--backend", a.backend, "--heartbeat-ms", str(a.heartbeat_ms),
                    "--xchg-timeout-ms", str(a.xchg_timeout_ms), "--threads", str(a.threads)]
            if a.gpus:
                argv += ["--device", str(i % a.gpus)]
            self.wargv[i] = argv
        n = self.nstart.get(i, 0) + 1
        self.nstart[i] = n
        p, path = self._spawn("worker%d" % i if n == 1 else "worker%d-start%d" % (i, n),
                              self.wargv[i])
        self.workers[i] = p
        # the worker's first line: "moe-worker pid P backend B (D) rpc URL data URL"
        t = time.monotonic()
        while time.monotonic() - t < 30:
            with open(path, "rb") as f:
                m = re.search(rb"moe-worker pid (\d+) backend (\S+) \((.*?)\) rpc (\S+) data (\S+)",
                              f.read())
            if m:
                self.winfo[i] = (int(m.group(1)), m.group(4).decode())
                return p
            if p.poll() is not None:
                raise Abort("worker %d exited with %s at start (log %s)" % (i, p.returncode, path))
            time.sleep(0.05)
        raise Abort("worker %d printed no address in 30 s (log %s)" % (i, path))

    def status(self):
        """cluster.status as a dict (moectl status), or None when not answered."""
        try:
            r = subprocess.run([os.path.join(BIN, "moectl"), "--url", self.url, "--timeout-ms",
                                "2000", "status"], capture_output=True, timeout=5)
            if r.returncode == 0:
                return json.loads(r.stdout)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            pass
        return None

    def stop(self):
        """SIGTERM the coordinator (it drains), then the workers; SIGKILL what is
        left after the bound. Returns [(name, pid, exit code, killed)]."""
        out = []

        def wait_all(items, bound):
            t = time.monotonic() + bound
            for _, p in items:
                try:
                    p.wait(timeout=max(0.0, t - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

        live = [(n, p) for n, p in self.procs if p.poll() is None]
        coord = [(n, p) for n, p in live if p is self.coord]
        for _, p in coord:
            p.send_signal(signal.SIGTERM)
        wait_all(coord, 15)
        rest = [(n, p) for n, p in live if p is not self.coord]
        for _, p in rest:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        wait_all(rest, 10)
        for n, p in live:
            killed = p.poll() is None
            if killed:
                p.kill()
                p.wait()
            out.append((n, p.pid, p.returncode, killed))
        for f in self.logs:
            f.close()
        return out


# ------------------------------------------------------------- checkpoint --

def shard_name(rank, world):
    """The file a worker of this rank writes into a checkpoint (worker/ckpt.c)."""
    return "model-%05d-of-%05d.safetensors" % (rank + 1, world)


def save_in_flight(root, step, vshard):
    """The directory of step's automatic checkpoint while it is being written
    and the victim's shard is not in it yet, else None. The coordinator names
    it ckpt-<step>-<time> once every worker finished the step; the first
    worker to start writing makes it; a shard appears as .tmp and is renamed
    once fsynced; the index comes last, after every shard."""
    pre = "ckpt-%08d-" % step
    try:
        names = [n for n in os.listdir(root) if n.startswith(pre)]
    except OSError:  # the model's root is made by the first save
        return None
    for n in names:
        d = os.path.join(root, n)
        if not (os.path.exists(os.path.join(d, vshard))
                or os.path.exists(os.path.join(d, "model.safetensors.index.json"))):
            return d
    return None


def describe_save(d):
    """The files of a checkpoint directory with their sizes, for the log."""
    out = []
    try:
        for n in sorted(os.listdir(d)):
            try:
                out.append("%s %.0f MB" % (n, os.path.getsize(os.path.join(d, n)) / 1e6))
            except OSError:  # renamed or removed meanwhile
                out.append(n)
    except OSError as e:
        return "cannot list: %s" % e
    return ", ".join(out) or "none yet"


class ShardWatch(threading.Thread):
    """When each named shard appears in a checkpoint directory (renamed into
    place once written and fsynced): when the survivors finished writing."""

    def __init__(self, d, names, until):
        super().__init__(daemon=True)
        self.d, self.names, self.until = d, names, until
        self.done = {}  # name -> monotonic time seen
        self.stop = threading.Event()

    def run(self):
        while (not self.stop.is_set() and time.monotonic() < self.until
               and len(self.done) < len(self.names)):
            for n in self.names:
                if n not in self.done and os.path.exists(os.path.join(self.d, n)):
                    self.done[n] = time.monotonic()
            self.stop.wait(0.005)


# ----------------------------------------------------------------- stream --

class Rec:
    __slots__ = ("thread", "kind", "t0", "t1", "code", "msg")

    def __init__(self, thread, kind, t0, t1, code, msg):
        self.thread, self.kind, self.t0, self.t1, self.code, self.msg = \
            thread, kind, t0, t1, code, msg


class Stream:
    """Client threads that call the service until stopped; every call recorded."""

    def __init__(self, a, url, prev=None):
        """prev: the stream of the kill before (its training thread's step and
        probes go on here), or None."""
        self.a = a
        self.url = url
        self.recs = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.inflight = {}  # thread -> (kind, t0)
        self.threads = []
        self.printed = {}
        self.t_kill = None
        self.crashes = []
        # training state (the train thread's view)
        self.step = 0  # last acknowledged step
        self.acked = []  # (t, step) per acknowledged step
        self.probes = {}  # step -> probe forward output (float32)
        if prev is not None:
            self.step, self.probes = prev.step, prev.probes
        self.step_unacked = False  # a step call failed: it may have been applied
        self.recovered_step = None  # the step counter after the recovery (check_durable)
        self.reset_ok = False  # no checkpoints: the re-formed model restarts at step 0
        self.reset_note = ""
        self.pause_req = threading.Event()
        self.paused = threading.Event()
        self.resume = threading.Event()

    def _call(self, name, kind, fn, *args):
        with self.lock:
            self.inflight[name] = (kind, time.monotonic())
        t0 = time.monotonic()
        code = msg = None
        try:
            return fn(*args)
        except moe.Error as e:
            code, msg = e.code, str(e)
            raise
        finally:
            t1 = time.monotonic()
            with self.lock:
                self.inflight.pop(name, None)
                self.recs.append(Rec(name, kind, t0, t1, code, msg))
            if code is not None:
                n = self.printed.get(name, 0)
                self.printed[name] = n + 1
                after = " (%.3f s after the kill)" % (t1 - self.t_kill) if self.t_kill else ""
                if n < self.a.print_errors:
                    log("  %s: %s took %.3f s -> error %s%s" % (name, kind, t1 - t0, msg, after))
                elif n == self.a.print_errors:
                    log("  %s: (further errors counted, not printed)" % name)

    def forward_loop(self, k, model, x):
        name = "fwd%d" % k
        try:
            c = moe.Client(self.url, timeout_ms=self.a.client_timeout_ms)
        except moe.Error as e:
            self.crashes.append("%s: cannot connect: %s" % (name, e))
            return
        try:
            while not self.stop.is_set():
                try:
                    self._call(name, "forward", c.forward, model, 0, x)
                except moe.Error:
                    self.stop.wait(0.05)
        except Exception as e:  # noqa: BLE001 - report anything else as a failure
            self.crashes.append("%s: %r" % (name, e))
        finally:
            c.close()

    def train_loop(self, model, x, dy, probe_x):
        name = "train"
        try:
            c = moe.Client(self.url, timeout_ms=self.a.client_timeout_ms)
        except moe.Error as e:
            self.crashes.append("%s: cannot connect: %s" % (name, e))
            return
        try:
            while not self.stop.is_set():
                if self.pause_req.is_set():
                    self.paused.set()
                    while not self.resume.wait(0.1):
                        if self.stop.is_set():
                            return
                    self.resume.clear()
                    self.paused.clear()
                    continue
                try:
                    _, h = self._call(name, "forward_train", c.forward_train, model, 0, x)
                    self._call(name, "backward", c.backward, h, dy)
                    try:
                        s, _ = self._call(name, "step", c.step, model, self.a.lr, (0.9, 0.999),
                                          1e-8, 0.0, 1.0, self.step)
                    except moe.Error:
                        self.step_unacked = True
                        raise
                    if s != self.step + 1:
                        if self.reset_ok and s == 1:
                            self.reset_note = ("the first step after the re-formation (expect_step"
                                               " %d accepted) returned step 1" % self.step)
                            log("  train: %s" % self.reset_note)
                        else:
                            self.crashes.append("step went from %d to %d" % (self.step, s))
                    self.reset_ok = False
                    self.step = s
                    self.step_unacked = False
                    self.acked.append((time.monotonic(), s))
                    y, _ = self._call(name, "probe", c.forward, model, 0, probe_x)
                    self.probes[s] = from_rows(y)
                except moe.Error as e:
                    m = re.search(r"is at step (\d+), not", str(e))
                    if e.code == "failed_precondition" and m and self.reset_ok and \
                            int(m.group(1)) == 0:
                        # no checkpoints: the re-formed model starts again at step 0
                        self.reset_note = ("after the re-formation the model is at step 0 "
                                           "(was %d)" % self.step)
                        log("  train: %s" % self.reset_note)
                        self.step = 0
                        self.reset_ok = False
                    elif e.code == "failed_precondition" and m:
                        self.crashes.append("step %d refused: %s" % (self.step, e))
                    self.stop.wait(0.05)
        except Exception as e:  # noqa: BLE001
            self.crashes.append("%s: %r" % (name, e))
        finally:
            c.close()

    def start(self, target, *args):
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, bound):
        self.stop.set()
        self.resume.set()
        t = time.monotonic() + bound
        for th in self.threads:
            th.join(timeout=max(0.0, t - time.monotonic()))
        return [th for th in self.threads if th.is_alive()]

    def snapshot(self):
        with self.lock:
            return list(self.recs), dict(self.inflight)


# ------------------------------------------------------------------- main --

ALLOWED = {  # error codes a call may get while a worker is dead or the cluster re-forms
    "forward": {"unavailable"},
    "probe": {"unavailable"},
    "forward_train": {"unavailable"},
    "backward": {"unavailable", "expired"},
    "step": {"unavailable", "failed_precondition"},
}


KILL_DURING = {
    "any": "any call",
    "step": "an optimizer.step",
    "ckpt": "the automatic checkpoint of an optimizer.step",
}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backend", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--gpus", type=int, default=0,
                    help="GPUs on this host: worker i gets --device i %% GPUS (0 = none)")
    ap.add_argument("--xchg", default="auto", choices=["auto", "nng", "nccl"])
    ap.add_argument("--victim", type=int, default=1, help="the worker to SIGKILL (0-based)")
    ap.add_argument("--kills", type=int, default=1,
                    help="kills in a row in the same cluster, the victims in turn (--victim, "
                    "then the next worker, ...), each after the re-formation and checks of the "
                    "one before; the kill moments after the first drawn from --seed")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"],
                    help="the models' dtype (and the rows')")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per forward")
    ap.add_argument("--clients", type=int, default=2, help="forward threads")
    ap.add_argument("--train", action="store_true", help="also a stream of training steps")
    ap.add_argument("--train-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--checkpoint-dir", default="",
                    help="with --train: coordinator --checkpoint-dir (a fresh directory is "
                    "made inside) --checkpoint-every 1, and check that no step is lost")
    ap.add_argument("--kill-after", type=float, default=3.0,
                    help="seconds of stream before the kill")
    ap.add_argument("--kill-during", choices=["any", "step", "ckpt"], default="",
                    help="kill while any call is in flight, or (with --train) while an "
                    "optimizer.step is, or (with --train and --checkpoint-dir) while the "
                    "automatic checkpoint of a step is being written (default: step with "
                    "--train, else any)")
    ap.add_argument("--ckpt-wait-s", type=float, default=40,
                    help="--kill-during ckpt: longest wait for a save in flight before "
                    "killing anyway (the check then fails)")
    ap.add_argument("--min-steps", type=int, default=2,
                    help="with --train: acknowledged steps before the kill")
    ap.add_argument("--step-delay-s", type=float, default=0.0,
                    help="--kill-during step: kill this long after the step was sent")
    ap.add_argument("--heartbeat-ms", type=int, default=200)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1500)
    ap.add_argument("--xchg-timeout-ms", type=int, default=0,
                    help="workers' bound on a collective (0 = 5000 on CPU, 10000 on GPUs)")
    ap.add_argument("--worker-timeout-ms", type=int, default=30000)
    ap.add_argument("--threads", type=int, default=0,
                    help="worker BLAS threads (0 = cores / workers)")
    ap.add_argument("--answer-bound-s", type=float, default=0,
                    help="longest a call may take (0 = xchg timeout + heartbeat timeout + 10 s)")
    ap.add_argument("--down-bound-s", type=float, default=0,
                    help="kill -> status down (0 = heartbeat timeout + 5 s)")
    ap.add_argument("--start-bound-s", type=float, default=90)
    ap.add_argument("--recover-bound-s", type=float, default=60)
    ap.add_argument("--min-workers", type=int, default=0,
                    help="the coordinator's --min-workers: before the restart, the survivors "
                         "must re-form without the victim and serve (0 = off)")
    ap.add_argument("--shrink-after-ms", type=int, default=1000,
                    help="with --min-workers: the coordinator's --shrink-after-ms")
    ap.add_argument("--after-requests", type=int, default=3,
                    help="successful forwards per thread needed after the re-formation")
    ap.add_argument("--tolerance", type=float, default=2e-2,
                    help="relative error allowed between outputs before and after (bf16)")
    ap.add_argument("--time-limit", type=float, default=160, help="seconds for the whole run")
    ap.add_argument("--run-dir", default="",
                    help="the daemons' logs go here, kept (default: a fresh temp dir, removed "
                    "after a PASS)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the temp dir after a PASS")
    ap.add_argument("--strict-survivors", action="store_true",
                    help="check 4 fails when a survivor exited 3 (its device could not be "
                    "recovered) and had to be started again: the re-formation must keep "
                    "every survivor's process")
    ap.add_argument("--print-errors", type=int, default=4, help="errors printed per thread")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.workers < 2:
        ap.error("--workers must be >= 2 (one is killed)")
    if not 0 <= a.victim < a.workers:
        ap.error("--victim must be in 0..workers-1")
    if a.kills < 1:
        ap.error("--kills must be >= 1")
    if not a.kill_during:
        a.kill_during = "step" if a.train else "any"
    if a.kill_during == "step" and not a.train:
        ap.error("--kill-during step needs --train")
    if a.kill_during == "ckpt" and not (a.train and a.checkpoint_dir):
        ap.error("--kill-during ckpt needs --train and --checkpoint-dir")
    if a.threads <= 0:
        a.threads = max(1, (os.cpu_count() or 2) // a.workers)
    if a.xchg_timeout_ms <= 0:
        a.xchg_timeout_ms = 10000 if a.gpus else 5000
    if a.answer_bound_s <= 0:
        a.answer_bound_s = (a.xchg_timeout_ms + a.heartbeat_timeout_ms) / 1000 + 10
    if a.down_bound_s <= 0:
        a.down_bound_s = a.heartbeat_timeout_ms / 1000 + 5
    # the client gives up a little after the bound: a hang shows as a long call
    a.client_timeout_ms = int((a.answer_bound_s + 5) * 1000)
    return a


CHECKS = [
    ("coord", "1 coordinator stays up"),
    ("errors", "2 in-flight/after-kill requests get an error"),
    ("bounded", "2 no request hangs"),
    ("down", "3 cluster.status reports the worker down"),
    ("shrink", "3b re-forms with the survivors (--min-workers)"),
    ("reform", "4 re-forms (new generation), requests succeed"),
    ("durable", "5 no committed training step lost"),
    ("ckpt", "5b a step whose checkpoint lost a worker: answered at once, not kept"),
    ("cleanup", "6 every process stopped"),
]


def describe_fds(pid):
    """The victim's open files by kind, fd numbers in order ("sockets 3-9,
    12; nvidia 10-11, 14"): a dying process closes them in that order after
    its memory is torn down, and the coordinator sees it gone when a socket
    closes."""
    kinds = {}
    try:
        for fd in sorted(int(f) for f in os.listdir("/proc/%d/fd" % pid)):
            try:
                t = os.readlink("/proc/%d/fd/%d" % (pid, fd))
            except OSError:
                continue
            k = ("socket" if t.startswith("socket:") else "nvidia" if "/dev/nvidia" in t
                 else "shm" if t.startswith("/dev/shm") else "other")
            kinds.setdefault(k, []).append(fd)
    except OSError as e:
        return "unreadable (%s)" % e
    def runs(v):
        out, a = [], v[0]
        for i in range(1, len(v) + 1):
            if i == len(v) or v[i] != v[i - 1] + 1:
                out.append(str(a) if a == v[i - 1] else "%d-%d" % (a, v[i - 1]))
                if i < len(v):
                    a = v[i]
        return ", ".join(out)
    return "; ".join("%s %s" % (k, runs(v)) for k, v in sorted(kinds.items())) or "none"


def coord_saw_loss(path, rpc_url, t_kill_wall):
    """Seconds from the SIGKILL (wall clock) to the coordinator's own log line
    marking the victim down ("worker N (...) lost: marked down"), or None.
    Beside the client-side figures it tells a late-seen death (the
    coordinator's loop late: busy, or starved of CPU) from a late answer."""
    lt = time.localtime(t_kill_wall)
    kill_sod = lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec + t_kill_wall % 1
    pat = re.compile(r"coord (\d\d):(\d\d):(\d\d)\.(\d{3}) W .*worker \d+ \(%s, rank .*"
                     r"(lost: marked down|missed heartbeats)" % re.escape(rpc_url))
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = pat.search(line)
                if not m:
                    continue
                h, mi, se, ms = (int(g) for g in m.groups()[:4])
                d = h * 3600 + mi * 60 + se + ms / 1000.0 - kill_sod
                if d < -43200:
                    d += 86400  # past midnight
                if d >= -0.002:
                    return max(d, 0.0)
    except OSError:
        return None
    return None


class TeardownWatch(threading.Thread):
    """Logs how long the SIGKILLed process took to finish dying, polled every
    ms: when its thread-group leader showed as a zombie in /proc (that thread
    alone can be done while the others still tear the process down), and
    when the whole process was gone (waitpid: every thread exited, its
    memory unmapped and its files - the sockets the coordinator watches -
    closed)."""

    def __init__(self, proc, t_kill):
        super().__init__(daemon=True)
        self.proc, self.t_kill = proc, t_kill
        self.dying = None  # seconds from the SIGKILL to the process gone

    def run(self):
        leader = None
        while time.monotonic() - self.t_kill < 10:
            if leader is None:
                try:
                    with open("/proc/%d/stat" % self.proc.pid) as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    state = "gone"
                if state in ("Z", "X", "gone"):
                    leader = time.monotonic() - self.t_kill
            if self.proc.poll() is not None:
                self.dying = time.monotonic() - self.t_kill
                log("  the victim finished dying %.3f s after the SIGKILL (its leader thread a "
                    "zombie after %s)" % (self.dying,
                                         "%.3f s" % leader if leader is not None else "-"))
                return
            time.sleep(0.001)
        log("  the victim was still dying 10 s after the SIGKILL")


def main():
    global DTYPE
    a = parse_args()
    DTYPE = a.dtype
    deadline = T0 + a.time_limit
    res = {k: None for k, _ in CHECKS}  # key -> (PASS|FAIL|SKIP, detail): this kill's
    tables = []  # per kill made or begun: (index, its checks, its figures for the summary line)

    def put(key, ok, detail):
        if ok is None:
            res[key] = ("SKIP", detail)
        else:
            res[key] = ("PASS" if ok else "FAIL", detail)
        log("check %s: %s - %s" % (dict(CHECKS)[key], res[key][0], detail))

    def left(bound):
        r = deadline - time.monotonic()
        if r <= 0:
            raise Abort("time limit (%.0f s) reached" % a.time_limit)
        return min(bound, r)

    run = a.run_dir or tempfile.mkdtemp(prefix="moe-kill-test.")
    os.makedirs(run, exist_ok=True)
    ckpt = ""
    if a.checkpoint_dir:
        os.makedirs(a.checkpoint_dir, exist_ok=True)
        ckpt = tempfile.mkdtemp(prefix="moe-kill-test.", dir=a.checkpoint_dir)
    log("kill test: %d workers (backend %s%s, xchg %s), victim worker %d; model %d layer(s), "
        "d_model %d, d_ff %d, %d experts, top-%d, %s; %d forward thread(s) of %d tokens%s; "
        "kill during %s; logs in %s" % (a.workers, a.backend, ", devices 0-%d" % (a.gpus - 1) if a.gpus else "",
                        a.xchg, a.victim, a.layers, a.d_model, a.d_ff, a.experts, a.top_k,
                        a.dtype, a.clients, a.tokens,
                        "; training (%d tokens, checkpoints %s)" % (a.train_tokens, ckpt or "off")
                        if a.train else "", KILL_DURING[a.kill_during], run))
    log("bounds: answer %.1f s, down %.1f s, recover %.0f s, whole run %.0f s; heartbeat "
        "timeout %d ms, xchg timeout %d ms; NCCL_NVLS_ENABLE=%s" % (
            a.answer_bound_s, a.down_bound_s, a.recover_bound_s, a.time_limit,
            a.heartbeat_timeout_ms, a.xchg_timeout_ms, os.environ.get("NCCL_NVLS_ENABLE", "unset")))

    if a.kill_during != "ckpt":
        put("ckpt", None, "not --kill-during ckpt")
    cl = Cluster(a, run)
    st = None
    ctl = None
    coord_fail = []
    try:
        # ---- start ------------------------------------------------------
        cl.start_coordinator(ckpt)
        log("coordinator pid %d at %s" % (cl.coord.pid, cl.url))
        for i in range(a.workers):
            cl.start_worker(i)
            log("worker %d pid %d rpc %s: %s" % (i, cl.winfo[i][0], cl.winfo[i][1],
                                                 " ".join(cl.wargv[i][3:])))
        t = time.monotonic()
        bound = left(a.start_bound_s)
        s = None
        while time.monotonic() - t < bound:
            s = cl.status()
            if s and s.get("ready"):
                break
            for i, p in cl.workers.items():
                if p.poll() is not None:
                    raise Abort("worker %d exited with %s before the cluster formed"
                                % (i, p.returncode))
            time.sleep(0.1)
        else:
            raise Abort("cluster not ready after %.0f s: %s" % (bound, s))
        log("cluster ready in %.2f s: generation %d, %d workers: %s" % (
            time.monotonic() - t, s["generation"], s["up_workers"],
            ", ".join("id %d rank %d %s" % (w["id"], w["rank"], w["device"])
                      for w in s["workers"])))
        ctl = moe.Client(cl.url, timeout_ms=a.client_timeout_ms)
        ping = moe.Client(cl.url, timeout_ms=2000)
        ctl.model_create("kt_inf", layers=a.layers, d_model=a.d_model, d_ff=a.d_ff,
                         n_experts=a.experts, top_k=a.top_k, renormalize=True, dtype=a.dtype,
                         seed=a.seed)
        if a.train:
            ctl.model_create("kt_train", layers=a.layers, d_model=a.d_model, d_ff=a.d_ff,
                             n_experts=a.experts, top_k=a.top_k, renormalize=True,
                             dtype=a.dtype, seed=a.seed + 1)
        log("model(s) created: kt_inf%s" % (", kt_train" if a.train else ""))
        rng = np.random.default_rng(a.seed)
        x = to_rows(rng.uniform(-1, 1, (a.tokens, a.d_model)).astype(np.float32))
        xref = to_rows(rng.uniform(-1, 1, (17, a.d_model)).astype(np.float32))
        xt = to_rows(rng.uniform(-1, 1, (a.train_tokens, a.d_model)).astype(np.float32))
        dy = to_rows(rng.uniform(-1e-2, 1e-2, (a.train_tokens, a.d_model))
                         .astype(np.float32))
        probe_x = to_rows(rng.uniform(-1, 1, (9, a.d_model)).astype(np.float32))
        t = time.monotonic()
        yref, _ = ctl.forward("kt_inf", 0, xref)
        yref = from_rows(yref)
        log("reference forward (17 tokens) %.3f s" % (time.monotonic() - t))

        # ---- the kills: each one in the same cluster, the victims in turn --
        krng = np.random.default_rng(a.seed + 7919)
        sm = None
        for kn in range(a.kills):
            victim = (a.victim + kn) % a.workers
            kill_after = a.kill_after if kn == 0 else 1.0 + int(krng.integers(0, 30)) / 10
            m = {"victim": victim, "at": kill_after}  # this kill's figures (seconds)
            if kn:  # the next kill's checks (a failed kill ended the loop)
                res = {k: None for k, _ in CHECKS}
                if a.kill_during != "ckpt":
                    put("ckpt", None, "not --kill-during ckpt")
            tables.append((kn, res, m))
            coord_fail = []
            s = cl.status() or s
            # the victim's rank names its checkpoint shard (--kill-during ckpt)
            vrank = next((w["rank"] for w in s["workers"]
                          if w["rpc_url"] == cl.winfo[victim][1]), victim)
            if a.kills > 1:
                log("==== kill %d of %d: worker %d (rank %d), %.1f s into the stream" % (
                    kn + 1, a.kills, victim, vrank, kill_after))
            # ---- stream -----------------------------------------------------
            sm = Stream(a, cl.url, sm)  # the training thread goes on from the last step
            for k in range(a.clients):
                sm.start(sm.forward_loop, k, "kt_inf", x)
            if a.train:
                sm.start(sm.train_loop, "kt_train", xt, dy, probe_x)
            log("stream started: %d forward thread(s)%s" % (a.clients,
                                                            " + 1 training thread" if a.train else ""))
            t = time.monotonic()
            bound = left(kill_after + 60 + (a.ckpt_wait_s if a.kill_during == "ckpt" else 0))
            t_ready_kill = None
            save = None  # --kill-during ckpt: (directory, step) of the save in flight
            while True:
                recs, infl = sm.snapshot()
                nok = sum(r.code is None for r in recs if r.kind == "forward")
                bad = [r for r in recs if r.code is not None]
                if bad:
                    raise Abort("errors before the kill: %s" % bad[0].msg)
                if sm.crashes:
                    raise Abort("client failure before the kill: %s" % sm.crashes[0])
                el = time.monotonic() - t
                # with --train: after the probe of the newest step (to compare with
                # after the recovery); --kill-during step: while a step is running;
                # ckpt: while that step's automatic checkpoint is being written
                # (for up to 20 s, ckpt --ckpt-wait-s, more; then whatever is in flight)
                if (el >= kill_after and nok >= a.clients
                        and (not a.train or (sm.step >= a.min_steps and sm.step in sm.probes))
                        and infl):
                    if t_ready_kill is None:
                        t_ready_kill = time.monotonic()
                    tr = infl.get("train")
                    stepping = tr and tr[0] == "step" and sm.step in sm.probes
                    if a.kill_during == "ckpt":
                        d = save_in_flight(os.path.join(ckpt, "kt_train"), sm.step + 1,
                                           shard_name(vrank, a.workers)) if stepping else None
                        if d:
                            save = (d, sm.step + 1, tr[1])
                            break
                    elif (a.kill_during == "any" or (stepping and
                                                     time.monotonic() - tr[1] > a.step_delay_s)):
                        break
                    wait = a.ckpt_wait_s if a.kill_during == "ckpt" else 20
                    if time.monotonic() - t_ready_kill > wait:
                        log("no %s in flight seen in %.0f s: killing now" % (
                            KILL_DURING[a.kill_during], wait))
                        break
                if el > bound:
                    raise Abort("stream too slow: %d forwards, %d steps in %.0f s"
                                % (nok, sm.step, el))
                # a save is a few hundred ms: look often enough to land inside it
                time.sleep(0.002 if a.kill_during == "ckpt" else 0.01)

            # ---- kill -------------------------------------------------------
            s = cl.status()
            gen0 = s["generation"] if s else 0
            vpid, vrpc = cl.winfo[victim]
            recs, infl = sm.snapshot()
            committed = k_committed = sm.step
            fds = describe_fds(vpid)
            load1 = m["load"] = os.getloadavg()[0]
            sm.t_kill = t_kill = time.monotonic()
            t_kill_wall = time.time()
            os.kill(vpid, signal.SIGKILL)
            gone = TeardownWatch(cl.workers[victim], t_kill)
            gone.start()
            # the save's files as the kill found them (the victim's shard must
            # be missing), then a watcher for the survivors' shards: when they
            # finish writing tells whether the step was answered before
            shards = describe_save(save[0]) if save else ""
            watch = None
            if save:
                watch = ShardWatch(save[0], [shard_name(r, a.workers) for r in range(a.workers)
                                             if r != vrank], t_kill + 120)
                watch.start()
            log("SIGKILL worker %d (pid %d, rpc %s); generation %d; %d forwards and %d training "
                "steps done; in flight: %s" % (
                    victim, vpid, vrpc, gen0, sum(r.code is None for r in recs if r.kind ==
                                                    "forward"), committed,
                    ", ".join("%s %s (started %.3f s before)" % (n, k, t_kill - t0)
                              for n, (k, t0) in sorted(infl.items())) or "nothing"))
            log("  the victim's open files at the kill: %s" % fds)
            if save:
                log("  the kill is inside the automatic checkpoint of step %d: %s (the step was "
                    "sent %.3f s before); the victim is rank %d; files then: %s" % (
                        save[1], os.path.basename(save[0]), t_kill - save[2], vrank, shards))
            elif a.kill_during == "ckpt":
                log("  the kill MISSED the checkpoint window (no save of a step in flight seen)")
            cl.workers[victim].wait()
            # the coordinator: alive, answers a ping
            time.sleep(0.2)
            seen = m["seen"] = coord_saw_loss(os.path.join(cl.run, "coordinator.log"), vrpc, t_kill_wall)
            log("  the coordinator saw the loss %s (its log); load average at the kill %.1f on %d "
                "cores" % ("%.3f s after the kill" % seen if seen is not None else "- not logged yet",
                           load1, os.cpu_count() or 0))
            pt = time.monotonic()
            try:
                ping.ping()
                log("coordinator (pid %d) alive, ping answered in %.1f ms" % (
                    cl.coord.pid, (time.monotonic() - pt) * 1000))
            except moe.Error as e:
                coord_fail.append("ping after the kill: %s" % e)
                log("coordinator ping after the kill FAILED: %s" % e)

            # ---- status: the victim down -----------------------------------
            bound = left(a.down_bound_s)
            entry = None
            while time.monotonic() - t_kill < bound:
                s = cl.status()
                if s:
                    entry = next((w for w in s["workers"] if w["rpc_url"] == vrpc), None)
                    if entry and entry["state"] == "down":
                        break
                time.sleep(0.1)
            t_down = time.monotonic()
            if entry and entry["state"] == "down":
                m["down"] = t_down - t_kill
                put("down", True, "worker id %d (rpc %s) state down %.2f s after the kill; "
                    "ready %s, %d of %d up, generation %d" % (
                        entry["id"], vrpc, t_down - t_kill, str(s["ready"]).lower(),
                        s["up_workers"], s["expected_workers"], s["generation"]))
            else:
                put("down", False, "after %.1f s%s cluster.status still shows %s" % (
                    bound, " (bound cut by the time limit)" if bound < a.down_bound_s else "",
                    json.dumps(entry) if entry else "no entry for %s" % vrpc))
            if cl.coord.poll() is not None:
                raise Abort("the coordinator exited (%s) after the kill" % cl.coord.returncode)

            # ---- the survivors alone (--min-workers) -------------------------
            if a.min_workers:
                bound = left(a.recover_bound_s)
                s = None
                while time.monotonic() - t_kill < bound:
                    s = cl.status()
                    if (s and s.get("ready") and s["generation"] > gen0
                            and s.get("world") == a.workers - 1):
                        break
                    time.sleep(0.05)
                else:
                    s = None
                if s is None:
                    put("shrink", False, "no generation of %d survivors within %.0f s of the kill" % (
                        a.workers - 1, bound))
                else:
                    t_shrunk = time.monotonic()
                    gen_s = s["generation"]
                    log("re-formed with %d survivors: generation %d, %.2f s after the kill" % (
                        a.workers - 1, gen_s, t_shrunk - t_kill))
                    e_s, why = None, ""
                    t = time.monotonic()
                    while time.monotonic() - t < left(a.answer_bound_s):
                        try:
                            ys, _ = ctl.forward("kt_inf", 0, xref)
                            e_s = rel_err(from_rows(ys), yref)
                            break
                        except moe.Error as e:  # a moment of `unavailable` while models restore
                            why = str(e)
                            time.sleep(0.05)
                    put("shrink", e_s is not None and e_s <= a.tolerance,
                        "generation %d -> %d of %d workers %.2f s after the kill (--shrink-after-ms "
                        "%d); kt_inf output vs before the kill: %s" % (
                            gen0, gen_s, a.workers - 1, t_shrunk - t_kill, a.shrink_after_ms,
                            "rel err %.2e (tolerance %.0e)" % (e_s, a.tolerance) if e_s is not None
                            else "no answer (%s)" % why))
                    gen0 = gen_s  # the restart must form a newer one: the cluster grows back
            else:
                put("shrink", None, "no --min-workers")

            # ---- restart ----------------------------------------------------
            if a.train:
                sm.pause_req.set()
            cl.start_worker(victim)
            t_restart = time.monotonic()
            log("worker %d restarted with the same flags: pid %d rpc %s" % (
                victim, cl.winfo[victim][0], cl.winfo[victim][1]))
            bound = left(a.recover_bound_s)
            s = None
            supervised = []  # survivors that exited 3 (stuck device) and were started again
            while time.monotonic() - t_restart < bound:
                s = cl.status()
                if (s and s.get("ready") and s["generation"] > gen0
                        and s["up_workers"] == a.workers and s.get("world", a.workers) == a.workers):
                    break
                if cl.workers[victim].poll() is not None:
                    raise Abort("the restarted worker exited with %s" % cl.workers[victim].returncode)
                for i, p in list(cl.workers.items()):
                    # a survivor whose compute thread could not come back exits 3
                    # for its supervisor (systemd Restart=on-failure, a k8s pod):
                    # the test plays that supervisor and says so
                    if i != victim and p.poll() == 3:
                        cl.start_worker(i)
                        supervised.append((i, time.monotonic() - t_kill))
                        log("worker %d exited with status 3 (its device could not be recovered, "
                            "%.2f s after the kill): started again as its supervisor would" % (
                                i, supervised[-1][1]))
                time.sleep(0.1)
            else:
                raise Abort("cluster not re-formed %.0f s after the restart: %s" % (bound, s))
            t_ready = time.monotonic()
            m["ready"] = t_ready - t_kill
            m["restarts"] = len(supervised)
            gen1 = s["generation"]
            log("cluster re-formed: generation %d -> %d, %d of %d up, %.2f s after the restart, "
                "%.2f s after the kill" % (gen0, gen1, s["up_workers"], s["expected_workers"],
                                           t_ready - t_restart, t_ready - t_kill))

            # ---- training: nothing committed lost ---------------------------
            if a.train:
                t = time.monotonic()
                while not sm.paused.is_set() and time.monotonic() - t < left(a.answer_bound_s):
                    time.sleep(0.05)
                if not sm.paused.is_set():
                    raise Abort("the training thread did not pause")
                committed = sm.step
                if ckpt:
                    put("durable", *check_durable(a, ctl, sm, ckpt, run, committed, probe_x))
                else:
                    sm.reset_ok = True
                sm.pause_req.clear()
                sm.resume.set()
            else:
                put("durable", None, "no --train")

            # ---- requests succeed again ------------------------------------
            t = time.monotonic()
            bound = left(a.recover_bound_s)
            names = ["fwd%d" % k for k in range(a.clients)] + (["train"] if a.train else [])
            while True:
                recs, _ = sm.snapshot()
                ok_after = {n: 0 for n in names}
                steps_after = sum(1 for ts, _ in sm.acked if ts > t_ready)
                for r in recs:
                    if r.t0 >= t_ready and r.code is None and r.kind == "forward":
                        ok_after[r.thread] += 1
                if a.train:
                    ok_after["train"] = steps_after
                need = {n: (2 if n == "train" else a.after_requests) for n in names}
                if all(ok_after[n] >= need[n] for n in names):
                    break
                if time.monotonic() - t > bound:
                    break
                time.sleep(0.05)
            t_end = time.monotonic()
            stuck = sm.join(a.client_timeout_ms / 1000 + 2)
            # alone, as the reference before the stream (queued forwards are merged)
            yafter, _ = ctl.forward("kt_inf", 0, xref)
            e_inf = rel_err(from_rows(yafter), yref)
            recs, infl = sm.snapshot()
            short = [n for n in names if ok_after[n] < need[n]]
            late = [r for r in recs if r.t0 >= t_ready and r.code is not None]
            put("reform", not short and not late and e_inf <= a.tolerance
                and not (a.strict_survivors and supervised),
                "generation %d -> %d; after ready: %s, %d errors%s; kt_inf output vs before the kill: "
                "rel err %.2e (tolerance %.0e)%s" % (
                    gen0, gen1, ", ".join("%s %d %s" % (n, ok_after[n], "steps" if n == "train"
                                                       else "forwards ok") for n in names),
                    len(late), " (%s %s: %s)" % (late[0].thread, late[0].kind, late[0].msg)
                    if late else "", e_inf, a.tolerance,
                    "; too few successes in %.1f s: %s" % (bound, ", ".join(short)) if short else "")
                + "".join("; worker %d exited 3 (stuck device) %.1f s after the kill and was "
                          "started again" % w for w in supervised))

            if a.train and not ckpt:
                put("durable", None, "no --checkpoint-dir: a re-formed cluster rebuilds the weights "
                    "from the seed (last acknowledged step before the kill %d)%s" % (
                        committed, "; " + sm.reset_note if sm.reset_note else ""))

            # ---- the errors -------------------------------------------------
            inflight = [r for r in recs if r.t0 < t_kill <= r.t1]
            outage = [r for r in recs if t_kill <= r.t0 < t_ready]
            errs = [r for r in recs if r.code is not None]
            unexpected = [r for r in errs if r.code not in ALLOWED[r.kind]
                          or r.t1 < t_kill]
            for r in inflight:
                log("  in flight at the kill: %s %s, answered %.3f s after the kill: %s" % (
                    r.thread, r.kind, r.t1 - t_kill, r.msg or "ok"))
                if r.thread == "train" and r.kind == "step":
                    m["step"] = r.t1 - t_kill
            codes = {}
            for r in errs:
                codes["%s %s" % (r.kind, r.code)] = codes.get("%s %s" % (r.kind, r.code), 0) + 1
            first = min((r for r in errs if r.t1 >= t_kill), key=lambda r: r.t1, default=None)
            if first:
                m["first"] = first.t1 - t_kill
            n_unavail = sum(r.code == "unavailable" for r in errs if r.t1 >= t_kill)
            ok = n_unavail > 0 and not unexpected and not sm.crashes
            put("errors", ok,
                "%d in flight at the kill (%d got an error), %d sent during the outage (%d errors), "
                "%d errors after the re-formation; codes: %s; first: %s%s%s" % (
                    len(inflight), sum(r.code is not None for r in inflight), len(outage),
                    sum(r.code is not None for r in outage), len(late),
                    ", ".join("%s x%d" % kv for kv in sorted(codes.items())) or "none",
                    "%.3f s after the kill, %s %s: %s" % (first.t1 - t_kill, first.thread,
                                                          first.kind, first.msg) if first else "-",
                    "; UNEXPECTED: " + "; ".join("%s %s: %s" % (r.thread, r.kind, r.msg)
                                                 for r in unexpected[:3]) if unexpected else "",
                    "; client failures: " + "; ".join(sm.crashes[:3]) if sm.crashes else ""))
            longest = max(recs, key=lambda r: r.t1 - r.t0)
            inf_max = m["answered"] = max((r.t1 - t_kill for r in inflight), default=0.0)
            put("bounded", longest.t1 - longest.t0 <= a.answer_bound_s and not stuck and not infl,
                "%d calls; longest %.3f s (%s %s, %s); in-flight ones answered within %.3f s of "
                "the kill; bound %.1f s%s" % (
                    len(recs), longest.t1 - longest.t0, longest.thread, longest.kind,
                    longest.code or "ok", inf_max, a.answer_bound_s,
                    "; threads still in a call: %s" % ", ".join(sorted(infl)) if infl else ""))
            if save:
                put("ckpt", *check_ckpt_kill(sm, inflight, save, watch, t_kill, k_committed))
            elif a.kill_during == "ckpt":
                put("ckpt", False, "the kill missed the checkpoint: no automatic checkpoint of a "
                    "step seen being written in %.0f s" % a.ckpt_wait_s)
            if cl.coord.poll() is not None:
                coord_fail.append("exited with %s" % cl.coord.returncode)
            try:
                ping.ping()
            except moe.Error as e:
                coord_fail.append("ping at the end: %s" % e)
            put("coord", not coord_fail, "pid %d up from start to %.1f s after the kill, "
                "answered ping after the kill and at the end%s" % (
                    cl.coord.pid, t_end - t_kill,
                    "; " + "; ".join(coord_fail) if coord_fail else ""))
            gone.join(1)
            m["dying"] = gone.dying
            if any(v and v[0] == "FAIL" for v in res.values()):
                break  # the cluster's state is unknown: no further kill
        ping.close()
    except Exception as e:  # noqa: BLE001 - any failure ends in the table
        log("ABORT: %s: %s" % (type(e).__name__, e))
        for k, _ in CHECKS:
            if res[k] is None and k != "cleanup":
                res[k] = ("FAIL", "not reached: %s" % e)
        if cl.coord is not None and cl.coord.poll() is not None and res["coord"][0] != "PASS":
            res["coord"] = ("FAIL", "the coordinator exited with %s" % cl.coord.returncode)
    finally:
        if "sm" in locals():
            sm.join(a.client_timeout_ms / 1000 + 2)
        if ctl is not None:
            ctl.close()
        log("stopping every process (SIGTERM: coordinator first, then workers)")
        st = cl.stop()
        alive = [n for n, pid, _, _ in st if os.path.exists("/proc/%d" % pid)
                 and open("/proc/%d/stat" % pid).read().split()[2] != "Z"]
        killed = [n for n, _, _, k in st if k]
        put("cleanup", not alive and not killed,
            "%d processes started, %d were running at the end: %s%s" % (
                len(cl.procs), len(st), ", ".join("%s %s" % (n, "SIGKILL" if k else "exit %s" % rc)
                                                  for n, _, rc, k in st),
                "; STILL ALIVE: " + ", ".join(alive) if alive else ""))

    # ---- tables: one per kill, then a summary line per kill ---------------
    w = max(len(n) for _, n in CHECKS)
    failed = []
    made = len(tables)
    short = made < a.kills
    if not tables:  # the start failed: its checks, no kill
        tables = [(0, res, {})]
    for kn, r, _ in tables:
        if r["cleanup"] is None:  # stopped once, after the last kill
            r["cleanup"] = ("SKIP", "checked after the last kill")
        if len(tables) > 1 or a.kills > 1:
            print("\nkill %d of %d" % (kn + 1, a.kills))
        print("\n%-*s  %-6s %s" % (w, "check", "result", "detail"))
        print("%s  %s %s" % ("-" * w, "-" * 6, "-" * 40))
        for k, n in CHECKS:
            print("%-*s  %-6s %s" % (w, n, r[k][0], r[k][1]))
        failed += [k for k, _ in CHECKS if r[k][0] == "FAIL"]
    print()
    for kn, r, m in tables:  # deploy/kill-series.sh reads these lines
        print("kill-summary %d %s victim %s at %s %s" % (
            kn + 1, "FAIL" if any(r[k][0] == "FAIL" for k, _ in CHECKS) else "PASS",
            m.get("victim", "-"), m.get("at", "-"), " ".join(
                "%s %s" % (k, "%.3f" % m[k] if m.get(k) is not None else "-")
                for k in ("dying", "seen", "load", "down", "first", "answered", "step", "ready"))
            + " restarts %d" % m.get("restarts", 0)))
    print("\nkill test: %s (%d workers, backend %s, xchg %s%s; %d of %d kills made) in %.1f s" % (
        "FAIL" if failed or short else "PASS", a.workers, a.backend, a.xchg,
        ", train" if a.train else "", made, a.kills, time.monotonic() - T0), flush=True)
    failed += ["kills"] if short else []
    if failed or a.keep_logs:
        print("logs in %s" % run)
        for name in sorted(os.listdir(run)):
            if failed and name.endswith(".log"):
                with open(os.path.join(run, name), errors="replace") as f:
                    lines = f.read().splitlines()
                print("== %s (last 15 lines)" % name)
                print("\n".join(lines[-15:]))
    elif not a.run_dir:
        shutil.rmtree(run, ignore_errors=True)
    if ckpt and not failed:
        shutil.rmtree(ckpt, ignore_errors=True)
    elif ckpt:
        print("checkpoints in %s" % ckpt)
    return 1 if failed else 0


def check_ckpt_kill(sm, inflight, save, watch, t_kill, committed):
    """--kill-during ckpt: the optimizer.step whose automatic checkpoint lost
    the victim is answered `unavailable` ("outcome unknown") as soon as the
    victim's connection drops - before the survivors finish writing their
    shards - and is not kept: after the recovery the model is at the last
    acknowledged step (check_durable compares the weights). Returns (ok, detail)."""
    watch.stop.set()
    watch.join()
    d, step = os.path.basename(save[0]), save[1]
    r = next((r for r in inflight if r.thread == "train" and r.kind == "step"), None)
    if r is None:
        return False, "no optimizer.step was in flight at the kill (%s)" % d
    ans = r.t1 - t_kill
    log("  in-flight step %d answered %.3f s after the kill (%s)" % (step, ans, r.code or "ok"))
    done = sorted((t - t_kill, n) for n, t in watch.done.items())
    if done:
        surv = "survivors' shards written %s" % ", ".join(
            "%.3f s after the kill (%s)" % (t, n) for t, n in done)
    else:
        surv = "no survivor's shard written by %.1f s after the kill" % (
            time.monotonic() - t_kill)
    if len(done) < len(watch.names) and done:
        surv += "; missing: %s" % ", ".join(n for n in watch.names if n not in watch.done)
    ok = r.code == "unavailable" and "outcome unknown" in (r.msg or "")
    notes = ["kill in the save of step %d (%s)" % (step, d),
             "the step answered %.3f s after the kill: %s" % (
                 ans, "unavailable, outcome unknown" if ok else r.msg or "acknowledged"), surv]
    if r.code is None:
        # the victim had written its shard and answered just before it died
        notes.append("the kill came after the victim's part of the save")
        return False, "; ".join(notes)
    # early: not held until the survivors finished (every shard there = the end of their part)
    early = len(done) < len(watch.names) or ans < done[-1][0]
    if not early:
        notes.append("NOT answered before the survivors finished writing")
    kept = sm.recovered_step
    if kept != committed:
        notes.append("the step counter after recovery is %s, not the last acknowledged %d: the "
                     "unacknowledged step was kept" % (kept, committed))
    else:
        notes.append("not kept (step %d after recovery)" % kept)
    return ok and early and kept == committed, "; ".join(notes)


def check_durable(a, ctl, sm, ckpt, run, committed, probe_x):
    """Step counter, weights and a probe forward of kt_train after the recovery
    against the last acknowledged step. Returns (ok, detail)."""
    notes = []
    # a forward runs behind the restore job queued at the re-formation
    t = time.monotonic()
    y, _ = ctl.forward("kt_train", 0, probe_x)
    log("  durability: probe forward (behind the restore) %.2f s" % (time.monotonic() - t))
    y = from_rows(y)
    # the step counter without changing it: expect_step no model is at
    try:
        ctl.step("kt_train", expect_step=1 << 62)
        return False, "optimizer.step with expect_step 2^62 was applied"
    except moe.Error as e:
        m = re.search(r"is at step (\d+)", str(e))
        if not m:
            return False, "cannot read the step counter: %s" % e
        at = int(m.group(1))
    ok = at == committed or (at == committed + 1 and sm.step_unacked)
    sm.recovered_step = at
    notes.append("step after recovery %d, last acknowledged %d%s" % (
        at, committed, " (+1: a step whose reply was an error was applied)"
        if at == committed + 1 else ""))
    sm.step = at
    # the weights: an explicit save of the live model against the newest automatic checkpoint
    root = os.path.join(ckpt, "kt_train")
    with open(os.path.join(root, "LATEST")) as f:
        latest = f.read().strip()
    mm = re.match(r"ckpt-0*(\d+)-", latest)
    ck_step = int(mm.group(1)) if mm else -1
    ver = os.path.join(run, "verify")
    t = time.monotonic()
    ctl.checkpoint_save("kt_train", ver)
    log("  durability: checkpoint.save of the live model %.2f s" % (time.monotonic() - t))
    t = time.monotonic()
    a_t, _ = moe.read_checkpoint(root)
    b_t, _ = moe.read_checkpoint(ver)
    shutil.rmtree(ver, ignore_errors=True)
    diff = [n for n in a_t if n not in b_t or not np.array_equal(a_t[n], b_t[n])]
    same = not diff and len(a_t) == len(b_t)
    log("  durability: read and compared %.0f MB in %.2f s" % (
        2 * sum(v.nbytes for v in a_t.values()) / 1e6, time.monotonic() - t))
    ok = ok and same and ck_step == at
    notes.append("newest checkpoint %s (step %d); live weights and AdamW moments %s it (%d "
                 "tensors)" % (latest, ck_step, "equal" if same else "DIFFER from", len(a_t)))
    if at in sm.probes:
        e = rel_err(y, sm.probes[at])
        e_prev = rel_err(y, sm.probes[at - 1]) if at - 1 in sm.probes else None
        ok = ok and e <= a.tolerance and (e_prev is None or e < e_prev)
        notes.append("probe forward vs after step %d: rel err %.2e%s" % (
            at, e, " (vs step %d: %.2e)" % (at - 1, e_prev) if e_prev is not None else ""))
    else:
        notes.append("no probe recorded after step %d (the kill came first)" % at)
    return ok, "; ".join(notes)


if __name__ == "__main__":
    def _term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _term)
    sys.exit(main())
