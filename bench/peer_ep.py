#!/usr/bin/env python3
"""peer_ep.py - the expert-parallel MoE layer a PyTorch user would write, timed
beside bin/ep_bench on the same GPUs.

One process per GPU (torch.distributed, NCCL), E/W experts per rank, a fixed
number of tokens per GPU, bf16, the same routing as ep_bench (softmax top-k,
renormalised): the router GEMM; the (token, k) slots sorted by expert (which
also orders them by destination rank); the per-expert counts exchanged with
`all_to_all_single`; the split sizes brought to the host (one sync, as
Megatron's and most hand-written dispatchers do); the rows exchanged with
`all_to_all_single`; on the receiver the rows regrouped by local expert and
sent through two `torch._grouped_mm` (w13 (E/W, 2F, H) gate|up, w2 (E/W, H,
F)), SwiGLU; the rows put back in arrival order and returned with a second
`all_to_all_single`; the gate weights and an `index_add` back to the tokens.

Forward only (no autograd across the exchange), under torch.no_grad. Timed on
the wall clock between barriers: each rank synchronises its stream, the
slowest rank's time counts (all_reduce MAX), median of --iters after a
warm-up of WARM_MS so the GPUs hold their sustained clocks. Written here (not a
peer's code): what PyTorch's own operators give for expert parallelism.

    python3 -m torch.distributed.run --standalone --nproc_per_node W \\
        bench/peer_ep.py [--shapes qwen3:16384,mixtral:8192,deepseek:4096] [--skew]

Keep NCCL_NVLS_ENABLE=0 on the shared machines.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

WARM_MS = 3000.0

SHAPES = {  # name: (H, F, E, K), as bin/ep_bench
    "mixtral": (4096, 14336, 8, 2),
    "qwen3": (2048, 768, 128, 8),
    "deepseek": (7168, 2048, 256, 8),
    "small": (512, 256, 16, 2),
}


def ep_forward(x, wr, w13, w2, k, world):
    """x (T, H) bf16 on this rank; wr (E, H); w13 (El, 2F, H), w2 (El, H, F)
    this rank's experts. Returns y (T, H)."""
    T, H = x.shape
    E = wr.shape[0]
    El = E // world
    probs = torch.softmax((x @ wr.t()).float(), dim=-1)
    topv, topi = probs.topk(k, dim=-1)
    topv = topv / topv.sum(dim=-1, keepdim=True)
    flat = topi.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots by expert = by destination rank
    tok = order // k
    xs = x[tok]  # (T*K, H) in expert order
    counts = torch.bincount(flat, minlength=E).to(torch.int64)  # (E,)
    rcounts = torch.empty_like(counts)  # (W*El,): from each source, its counts of my experts
    dist.all_to_all_single(rcounts, counts)
    send = counts.view(world, El).sum(1)
    recv = rcounts.view(world, El).sum(1)
    splits = torch.stack([send, recv]).tolist()  # the host sync of the dispatch
    send_l, recv_l = splits[0], splits[1]
    nrecv = sum(recv_l)
    xr = x.new_empty((nrecv, H))
    dist.all_to_all_single(xr, xs, output_split_sizes=recv_l, input_split_sizes=send_l)
    # received rows: by source rank, inside each by local expert; regroup by expert
    local = torch.arange(El, device=x.device).repeat(world)
    eid = torch.repeat_interleave(local, rcounts, output_size=nrecv)
    order2 = torch.argsort(eid, stable=True)
    offs = torch.cumsum(rcounts.view(world, El).sum(0), 0).to(torch.int32)
    xe = xr[order2]
    ab = torch._grouped_mm(xe, w13.transpose(-2, -1), offs=offs)
    a, b = ab.chunk(2, dim=-1)
    ye = torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)
    yr = torch.empty_like(ye)
    yr[order2] = ye
    yb = x.new_empty((T * k, H))
    dist.all_to_all_single(yb, yr, output_split_sizes=send_l, input_split_sizes=recv_l)
    yb = yb * topv.reshape(-1)[order].to(yb.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add(0, tok, yb)


def timed_ms(fn, dev):
    """the slowest rank's wall time of fn, after a barrier"""
    dist.barrier()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(dev)
    t = torch.tensor([(time.perf_counter() - t0) * 1e3], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def uni(shape, scale, g, dev):
    return ((torch.rand(shape, device=dev, generator=g) * 2 - 1) * scale).to(torch.bfloat16)


def run_shape(name, T, skew, iters, rank, world, dev):
    H, Fd, E, K = SHAPES[name]
    if E % world:
        return f"{name}: {E} experts do not split over {world} GPUs"
    El = E // world
    g = torch.Generator(device=dev).manual_seed(1)  # the router: the same on every rank
    wr = uni((E, H), H**-0.5, g, dev)
    if skew:  # expert 0 wins for most tokens, as ep_bench --skew
        wr[0] += 4.0 / H
    g.manual_seed(100 + rank)
    x = uni((T, H), 1.0, g, dev)
    if skew:
        x += 0.5
    g.manual_seed(1000 + rank)
    w13 = torch.empty((El, 2 * Fd, H), device=dev, dtype=torch.bfloat16)
    w2 = torch.empty((El, H, Fd), device=dev, dtype=torch.bfloat16)
    for e in range(El):  # one expert at a time: no f32 copy of the whole layer
        w13[e] = uni((2 * Fd, H), H**-0.5, g, dev)
        w2[e] = uni((H, Fd), Fd**-0.5, g, dev)
    with torch.no_grad():
        y = ep_forward(x, wr, w13, w2, K, world)
        ok = torch.tensor([float(torch.isfinite(y.float()).all())], device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() != 1.0:
            return f"{name}: non-finite output"
        one = timed_ms(lambda: ep_forward(x, wr, w13, w2, K, world), dev)
        n = max(3, min(2000, int(WARM_MS / max(one, 1e-3))))
        nt = torch.tensor([n], device=dev)
        dist.all_reduce(nt, op=dist.ReduceOp.MAX)  # every rank runs as many
        for _ in range(int(nt.item())):
            ep_forward(x, wr, w13, w2, K, world)
        ts = sorted(timed_ms(lambda: ep_forward(x, wr, w13, w2, K, world), dev) for _ in range(iters))
    ms = ts[len(ts) // 2]
    fl = 2.0 * T * K * 3 * H * Fd
    del x, wr, w13, w2, y
    torch.cuda.empty_cache()
    return (
        f"{name:8s} W={world} T/GPU={T:6d} {'skewed' if skew else 'random'} | fwd {ms:8.3f} ms"
        f" | {T * world / (ms * 1e-3):12.0f} tokens/s | {fl / (ms * 1e-3) / 1e12:5.0f} TFLOP/s per GPU"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3:16384,mixtral:8192,deepseek:4096")
    ap.add_argument("--skew", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        print("peer_ep: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    if rank == 0:
        print(f"peer_ep: {torch.cuda.get_device_name(dev)} x{world}, torch {torch.__version__}", flush=True)
    for item in args.shapes.split(","):
        name, _, t = item.partition(":")
        if name not in SHAPES:
            if rank == 0:
                print(f"peer_ep: unknown shape {name}", file=sys.stderr)
            return 2
        try:
            line = run_shape(name, int(t or 4096), args.skew, args.iters, rank, world, dev)
        except torch.cuda.OutOfMemoryError as e:
            line = f"{name}: out of memory ({str(e).splitlines()[0]})"
            torch.cuda.empty_cache()
        if rank == 0:
            print(line, flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
