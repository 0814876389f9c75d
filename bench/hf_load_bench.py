#!/usr/bin/env python3
"""hf_load_bench.py - how long model.create from a Hugging Face directory
takes, against the bytes it reads and the disk's measured read bandwidth
(issue 21, "Performance"; results in bench/history/service.md).

1. Writes a random Qwen3-30B-A3B-shaped checkpoint (d_model 2048, 128
   experts of d_ff 768, top-8, BF16) with --layers MoE layers, sharded into
   files of about --shard-gb GB with model.safetensors.index.json, under
   --dir (kept and reused when its config.json matches). Only the MoE
   tensors (routers and experts) are written: attention, norms and
   embeddings are never read by model.create.
2. Reads the shards sequentially twice: through the page cache (what the
   workers' mmap sees: warm when the files are cached) and with O_DIRECT
   (the disk itself, no cache), and reports how much of each file was in
   the page cache before (fincore, when installed). With --cold the
   shards are then evicted (posix_fadvise DONTNEED) so that the create
   reads the disk.
3. Starts a coordinator and --workers CPU workers (bin/), times `moectl
   create --from-hf DIR` (the reply comes once every worker has loaded its
   experts), checks model.info, and stops everything.

    python3 bench/hf_load_bench.py [--dir /tmp/moe-hf-bench] [--layers 4]
"""
import argparse
import json
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

H, F, E, K = 2048, 768, 128, 8  # Qwen3-30B-A3B's MoE shape


def config(layers):
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": H, "moe_intermediate_size": F, "intermediate_size": 6144,
            "num_experts": E, "num_experts_per_tok": K, "num_hidden_layers": layers,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
            "hidden_act": "silu", "router_aux_loss_coef": 0.001, "dtype": "bfloat16",
            "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 151936}


def tensors(layers):
    """[(name, shape)] in file order: per layer the router, then each expert"""
    out = []
    for li in range(layers):
        p = f"model.layers.{li}.mlp"
        out.append((f"{p}.gate.weight", (E, H)))
        for e in range(E):
            out += [(f"{p}.experts.{e}.gate_proj.weight", (F, H)),
                    (f"{p}.experts.{e}.up_proj.weight", (F, H)),
                    (f"{p}.experts.{e}.down_proj.weight", (H, F))]
    return out


def random_bf16(rng, n):
    """n random BF16 values of magnitude 2^-7..2^-6 (finite, either sign)"""
    r = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    return (r & np.uint16(0x807F)) | np.uint16(0x3C00)


def write_shard(path, items, rng):
    head, off = {}, 0
    for name, shape in items:
        nb = shape[0] * shape[1] * 2
        head[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    hb = json.dumps(head, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, shape in items:
            random_bf16(rng, shape[0] * shape[1]).tofile(f)


def generate(d, layers, shard_gb):
    cfg = config(layers)
    cj = os.path.join(d, "config.json")
    if os.path.exists(cj) and json.load(open(cj)) == cfg:
        print(f"reusing {d}")
        return
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    items, shards, cur, size = tensors(layers), [], [], 0
    for name, shape in items:
        nb = shape[0] * shape[1] * 2
        if cur and size + nb > shard_gb * 1e9:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nb
    shards.append(cur)
    rng = np.random.default_rng(21)
    wmap, t0 = {}, time.time()
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(os.path.join(d, fn), sh, rng)
        wmap.update({n: fn for n, _ in sh})
    total = sum(s[0] * s[1] * 2 for _, s in items)
    json.dump({"metadata": {"total_size": total}, "weight_map": wmap},
              open(os.path.join(d, "model.safetensors.index.json"), "w"), indent=1)
    json.dump(cfg, open(cj, "w"), indent=1)
    print(f"wrote {len(shards)} shards, {total / 1e9:.2f} GB in {time.time() - t0:.1f} s")


def shard_files(d):
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


def cached_fraction(files):
    """fraction of the files' pages in the page cache (fincore), or None"""
    if not shutil.which("fincore"):
        return None
    res = subprocess.run(["fincore", "-b", "-n", "-o", "RES,SIZE"] + files, capture_output=True,
                         text=True)
    if res.returncode:
        return None
    rows = [list(map(int, ln.split())) for ln in res.stdout.split("\n") if ln.strip()]
    return sum(r[0] for r in rows) / max(1, sum(r[1] for r in rows))


def read_all(files, direct):
    """sequential read of every file, 16 MiB at a time; (bytes, seconds)"""
    buf = mmap.mmap(-1, 16 << 20)  # page-aligned, as O_DIRECT needs
    total, t0 = 0, time.time()
    for p in files:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            while True:
                n = os.readv(fd, [buf])
                total += n
                if n < len(buf):
                    break
        finally:
            os.close(fd)
    return total, time.time() - t0


def start_cluster(root, workers, run):
    coord = subprocess.Popen(
        ["bin/moe-coordinator", "--listen", "tcp://127.0.0.1:0", "--addr-file", f"{run}/addr",
         "--workers", str(workers), "--cluster-secret-file", f"{run}/secret",
         "--checkpoint-root", root, "--worker-timeout-ms", "600000"],
        stdout=open(f"{run}/coord.log", "w"), stderr=subprocess.STDOUT)
    procs = [coord]
    for _ in range(200):
        if os.path.exists(f"{run}/addr") and os.path.getsize(f"{run}/addr"):
            break
        if coord.poll() is not None:
            break
        time.sleep(0.05)
    else:
        raise SystemExit(f"the coordinator wrote no address in 10 s (log {run}/coord.log)")
    if coord.poll() is not None:
        with open(f"{run}/coord.log", errors="replace") as f:
            tail = f.read()[-600:]
        raise SystemExit(f"the coordinator exited with {coord.returncode} at start: {tail}")
    url = open(f"{run}/addr").read().strip()
    threads = max(1, (os.cpu_count() or 2) // workers)
    for i in range(workers):
        procs.append(subprocess.Popen(
            ["bin/moe-worker", "--coordinator", url, "--cluster-secret-file", f"{run}/secret",
             "--backend", "cpu", "--threads", str(threads)],
            stdout=open(f"{run}/worker{i}.log", "w"), stderr=subprocess.STDOUT))
    for _ in range(300):
        st = subprocess.run(["bin/moectl", "--url", url, "status"], capture_output=True, text=True)
        if '"ready": true' in st.stdout:
            return url, procs
        time.sleep(0.2)
    raise SystemExit("the cluster is not ready after 60 s (logs in " + run + ")")


def stop(procs):
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/moe-hf-bench/qwen3-30b-a3b-shaped")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cold", action="store_true",
                    help="evict the shards from the page cache (posix_fadvise DONTNEED) before "
                         "the create: the load reads the disk")
    a = ap.parse_args()
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    generate(a.dir, a.layers, a.shard_gb)
    print("load average (1, 5, 15 min): %.2f %.2f %.2f" % os.getloadavg())
    files = shard_files(a.dir)
    nbytes = sum(os.path.getsize(f) for f in files)
    frac = cached_fraction(files)
    print(f"{len(files)} shards, {nbytes / 1e9:.2f} GB; in the page cache before reading: "
          + ("unknown (no fincore)" if frac is None else f"{100 * frac:.0f}%"))
    n, sd = read_all(files, direct=True)
    bw_disk = n / sd
    print(f"O_DIRECT sequential read (the disk, no cache): {n / 1e9:.2f} GB in {sd:.2f} s = "
          f"{bw_disk / 1e9:.2f} GB/s")
    n, sc = read_all(files, direct=False)
    bw_cache = n / sc
    frac2 = cached_fraction(files)
    print(f"buffered sequential read (through the page cache): {n / 1e9:.2f} GB in {sc:.2f} s = "
          f"{bw_cache / 1e9:.2f} GB/s; cached after: "
          + ("unknown" if frac2 is None else f"{100 * frac2:.0f}%"))

    if a.cold:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        frac3 = cached_fraction(files)
        print("--cold: shards evicted from the page cache; cached now: "
              + ("unknown" if frac3 is None else f"{100 * frac3:.0f}%"))
    run = tempfile.mkdtemp(prefix="moe-hf-bench-run.")
    root = os.path.dirname(os.path.abspath(a.dir))
    url, procs = start_cluster(root, a.workers, run)
    try:
        t0 = time.time()
        res = subprocess.run(["bin/moectl", "--url", url, "--timeout-ms", "600000", "create",
                              "--name", "q3", "--from-hf", a.dir], capture_output=True, text=True)
        dt = time.time() - t0
        if res.returncode:
            raise SystemExit(f"create failed: {res.stdout}{res.stderr}")
        info = subprocess.run(["bin/moectl", "--url", url, "info", "--model", "q3"],
                              capture_output=True, text=True).stdout
        assert '"ready": true' in info, info[:400]
    finally:
        stop(procs)
    print(f"moectl create --from-hf ({a.workers} CPU workers, {a.layers} layers"
          f"{', cold cache' if a.cold else ''}): {dt:.2f} s "
          f"for {nbytes / 1e9:.2f} GB = {nbytes / dt / 1e9:.2f} GB/s; bytes / disk bandwidth "
          f"{nbytes / bw_disk:.2f} s, bytes / page-cache read bandwidth {nbytes / bw_cache:.2f} s")
    print("load average (1, 5, 15 min): %.2f %.2f %.2f" % os.getloadavg())
    shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
