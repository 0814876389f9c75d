#!/usr/bin/env python3
"""train_check.py - training through moe.torch.RemoteMoE against the same
model trained locally in PyTorch.

The network: Linear(D, H) -> MoE layer -> Linear(H, D), MSE loss on fixed
random data, STEPS training steps. Remote: the MoE layer is a RemoteMoE on
the service (f32), the linears are torch modules updated by torch's AdamW,
the experts and router by the service's AdamW (client.step). Local: the
same network in float64, its MoE layer a plain torch implementation (softmax
router, top-k, renormalised gate weights, SwiGLU experts w2(silu(w1 x) *
w3 x), load-balancing and z losses as docs/PROTOCOL.md defines them) whose
weights are read back from the service's checkpoint before training, every
parameter updated by torch's AdamW with the same hyperparameters.

Compared: the loss at every step, the aux loss the service reports, the
input layer's gradient of the first step (it comes through the service's
dx), and after the last step every weight (the remote ones read back from a
new checkpoint) and an inference forward (eval, no_grad). Also: a RemoteMoE
whose input needs no grad still sends its backward in training mode.

    python3 python/train_check.py --url tcp://127.0.0.1:7000 [--workdir DIR]

Prints the errors, "N passed, M failed"; exit status 1 on a failure.
Prints "SKIP: ..." and exits 0 when torch is not installed.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402

T, D, H, F, E, K = 24, 8, 16, 32, 4, 2
STEPS = 5
AUX, ZLOSS = 0.01, 0.001
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
PRE = "model.layers.0.block_sparse_moe."

passed = failed = 0


def check(ok, what):
    global passed, failed
    print("%s %s" % ("PASS" if ok else "FAIL", what))
    if ok:
        passed += 1
    else:
        failed += 1


def rel(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def remote_weights(c, model, work):
    """(wr (E,H), w1 (E,F,H), w3 (E,F,H), w2 (E,H,F)) from a checkpoint of the service."""
    c.checkpoint_save(model, work)
    wts, _ = moe.read_checkpoint(work)
    wr = wts[PRE + "gate.weight"]
    w1 = np.stack([wts[PRE + "experts.%d.w1.weight" % e] for e in range(E)])
    w3 = np.stack([wts[PRE + "experts.%d.w3.weight" % e] for e in range(E)])
    w2 = np.stack([wts[PRE + "experts.%d.w2.weight" % e] for e in range(E)])
    return wr, w1, w3, w2


def make_local_moe(torch, wr, w1, w3, w2):
    nn = torch.nn

    class LocalMoE(nn.Module):
        """The MoE layer in plain torch (float64), with the service's router losses."""

        def __init__(self):
            super().__init__()
            dt = torch.float64
            self.wr = nn.Parameter(torch.tensor(wr, dtype=dt))
            self.w1 = nn.Parameter(torch.tensor(w1, dtype=dt))
            self.w3 = nn.Parameter(torch.tensor(w3, dtype=dt))
            self.w2 = nn.Parameter(torch.tensor(w2, dtype=dt))
            self.router_loss = None
            self.aux = 0.0

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, H)
            n = x.shape[0]
            logits = x @ self.wr.T
            p = torch.softmax(logits, dim=1)
            w, top = torch.topk(p, K, dim=1)
            w = w / w.sum(dim=1, keepdim=True)
            y = torch.zeros_like(x)
            for e in range(E):
                tok, slot = torch.where(top == e)
                if tok.numel() == 0:
                    continue
                xe = x[tok]
                h = torch.nn.functional.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                y = y.index_add(0, tok, (h @ self.w2[e].T) * w[tok, slot, None])
            # aux = E/(K T) sum_e count_e mean_t p[t,e] (counts carry no gradient);
            # z = mean_t logsumexp(logits_t)^2
            counts = torch.bincount(top.reshape(-1), minlength=E).to(x.dtype)
            aux = E / (K * n) * (counts * p.mean(dim=0)).sum()
            z = (torch.logsumexp(logits, dim=1) ** 2).mean()
            self.router_loss = AUX * aux + ZLOSS * z
            self.aux = float(aux.detach())
            return y.reshape(shape)

    return LocalMoE()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=os.environ.get("MOE_URL", "tcp://127.0.0.1:7000"))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    try:
        import torch
        import moe.torch as moe_torch
    except ImportError as e:
        print("SKIP: torch is not installed (%s)" % e)
        return 0
    torch.manual_seed(0)
    work = args.workdir or tempfile.mkdtemp(prefix="moe-train-")
    c = moe.Client(args.url, timeout_ms=120000)
    name = "train_check_%d" % os.getpid()  # a fresh model (at step 0) on every run
    c.model_create(name, layers=1, d_model=H, d_ff=F, n_experts=E, top_k=K, renormalize=True,
                   dtype="f32", seed=11, aux_loss_coef=AUX, z_loss_coef=ZLOSS)
    wr, w1, w3, w2 = remote_weights(c, name, os.path.join(work, "before"))

    rng = np.random.default_rng(5)
    xs = rng.uniform(-1, 1, (4, T // 4, D)).astype(np.float32)  # 3-D: RemoteMoE reshapes
    target = rng.uniform(-1, 1, (4, T // 4, D)).astype(np.float32)

    remote_moe = moe_torch.RemoteMoE(c, name, 0)
    remote = torch.nn.Sequential(torch.nn.Linear(D, H), remote_moe, torch.nn.Linear(H, D))
    local_moe = make_local_moe(torch, wr, w1, w3, w2)
    local = torch.nn.Sequential(torch.nn.Linear(D, H), local_moe, torch.nn.Linear(H, D))
    local = local.double()
    with torch.no_grad():
        for i in (0, 2):
            local[i].weight.copy_(remote[i].weight.double())
            local[i].bias.copy_(remote[i].bias.double())
    check(len(list(remote_moe.parameters())) == 0, "RemoteMoE has no torch parameters")
    opt_r = torch.optim.AdamW(remote.parameters(), **HP)
    opt_l = torch.optim.AdamW(local.parameters(), **HP)

    xr, tr = torch.from_numpy(xs), torch.from_numpy(target)
    xl, tl = xr.double(), tr.double()
    remote.train()
    local.train()
    worst_loss = worst_aux = 0.0
    losses = []
    for step in range(STEPS):
        opt_r.zero_grad()
        opt_l.zero_grad()
        loss_r = torch.nn.functional.mse_loss(remote(xr), tr)
        loss_r.backward()  # RemoteMoE: the service's backward (aux and z losses inside)
        task_l = torch.nn.functional.mse_loss(local(xl), tl)
        (task_l + local_moe.router_loss).backward()
        if step == 0:
            g = rel(remote[0].weight.grad.numpy(), local[0].weight.grad.numpy())
            check(g < 1e-5, "step 0: input layer gradient (through the service's dx) "
                  "rel err %.2e" % g)
        opt_r.step()
        n, norm = c.step(name, **HP)
        opt_l.step()
        check(n == step + 1, "client.step returned step %d" % n)
        losses.append(loss_r.item())
        worst_loss = max(worst_loss, abs(loss_r.item() - task_l.item()) / task_l.item())
        worst_aux = max(worst_aux, abs(remote_moe.aux_loss - local_moe.aux) / local_moe.aux)
        print("step %d: loss remote %.8f local %.8f, aux remote %.6f local %.6f, grad norm %.4f"
              % (step, loss_r.item(), task_l.item(), remote_moe.aux_loss, local_moe.aux, norm))
    check(worst_loss < 1e-5, "loss at every step: worst rel err %.2e" % worst_loss)
    check(worst_aux < 1e-5, "aux loss (RemoteMoE.aux_loss) at every step: worst rel err %.2e"
          % worst_aux)
    check(losses[-1] < losses[0], "the loss went down (%.6f -> %.6f)" % (losses[0], losses[-1]))

    after = remote_weights(c, name, os.path.join(work, "after"))
    names = ("router", "w1", "w3", "w2")
    params = (local_moe.wr, local_moe.w1, local_moe.w3, local_moe.w2)
    for nm, a, before, p in zip(names, after, (wr, w1, w3, w2), params):
        ref = p.detach().numpy()
        moved = rel(ref, before)
        err = rel(a, ref)
        # and no single weight off by a sizeable part of one Adam update (lr)
        worst = float(np.abs(a - ref).max()) / HP["lr"]
        check(moved > 1e-2 and err < 1e-5 and worst < 1e-2,
              "remote %s after %d steps: rel err %.2e, max abs err %.1e lr (the weights "
              "moved by %.2e)" % (nm, STEPS, err, worst, moved))
    for i, nm in ((0, "input"), (2, "output")):
        err = rel(remote[i].weight.detach().numpy(), local[i].weight.detach().numpy())
        check(err < 1e-4, "%s layer weights after %d steps: rel err %.2e" % (nm, STEPS, err))

    remote.eval()
    local.eval()
    with torch.no_grad():
        yr = remote(xr)
        yl = local(xl)
    err = rel(yr.numpy(), yl.numpy())
    check(err < 1e-5, "inference forward (eval, no_grad) after training: rel err %.2e" % err)
    check(remote_moe.last_stats.get("tokens_per_expert") is not None and
          sum(remote_moe.last_stats["tokens_per_expert"]) == T * K,
          "RemoteMoE.last_stats: tokens_per_expert sums to T*K")

    # RemoteMoE first in a network: its input needs no grad, yet in training
    # mode the backward must reach the service (the weight gradients)
    first = name + "_first"
    c.model_create(first, layers=1, d_model=H, d_ff=F, n_experts=E, top_k=K, renormalize=True,
                   dtype="f32", seed=12, aux_loss_coef=AUX, z_loss_coef=ZLOSS)
    m = moe_torch.RemoteMoE(c, first, 0)
    x0 = torch.from_numpy(rng.uniform(-1, 1, (T, H)).astype(np.float32))
    m.eval()
    y_inf = m(x0)  # grad enabled, eval, x needs no grad: an inference forward
    check(not y_inf.requires_grad, "eval mode, input without grad: inference forward")
    m.train()
    y_tr = m(x0)
    err = rel(y_tr.detach().numpy(), y_inf.numpy())
    check(y_tr.requires_grad and err < 1e-6,
          "training mode, input without grad: a training forward, the same y (rel err %.1e)"
          % err)
    y_tr.square().sum().backward()
    n, norm = m.step(lr=1e-3)
    check(n == 1 and norm > 0, "its backward reached the service: step %d, grad norm %.4f"
          % (n, norm))
    c.close()
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
