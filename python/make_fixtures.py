#!/usr/bin/env python3
"""make_fixtures.py - tiny random Hugging Face MoE models and what
transformers computes with them, for tests/test_hf.c (no torch needed there).

For each family (Mixtral, Qwen3-MoE, OLMoE) and dtype (f32, bf16) it builds
a model with transformers, saves it with save_pretrained into
tests/fixtures/<family>-<dtype>/ (Qwen3-MoE f32 sharded, with its index),
and writes tests/fixtures/<family>-<dtype>.expected.safetensors with, per
MoE layer i (in order):

    x.i       (T,H)  the sparse MoE block's input (bf16 values for bf16)
    y.i       (T,H)  transformers' block output
    counts.i  (E)    routed slots per expert (transformers' top-k)
    dy.i      (T,H)  an upstream gradient                       (f32 only)
    dx.i      (T,H)  d/dx of  sum(y * dy) + coef * lbl          (f32 only)
    aux.i     (1)    lbl / K                                    (f32 only)
    grad.<tensor name>  the weight gradients of the same loss   (f32 only)

where lbl is transformers' load_balancing_loss_func on the layer's router
logits and coef the config's router_aux_loss_coef. The script checks moe's
aux-loss convention (aux = E / (K T) sum_e count_e mean_t p[t,e] equals
lbl / K) and fails if it does not hold.

    pip install transformers safetensors
    python3 python/make_fixtures.py [--out tests/fixtures]
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

T, H, F, FQ, E, K = 32, 32, 64, 48, 8, 2
MARGIN = 0.05  # rows whose K-th and (K+1)-th router logits are closer are redrawn


def build(family, dtype):
    import transformers as tf

    common = dict(vocab_size=32, hidden_size=H, num_attention_heads=2, num_key_value_heads=1,
                  num_experts_per_tok=K, router_aux_loss_coef=0.02, intermediate_size=F,
                  tie_word_embeddings=False)
    if family == "mixtral":
        cfg = tf.MixtralConfig(num_hidden_layers=2, num_local_experts=E, **common)
        model = tf.MixtralForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(num_hidden_layers=3, num_experts=E, moe_intermediate_size=FQ,
                                decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                                **common)
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = tf.OlmoeConfig(num_hidden_layers=2, num_experts=E, norm_topk_prob=False, **common)
        model = tf.OlmoeForCausalLM(cfg)
    # weights large enough that routing margins are wide and outputs O(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate.weight" in name and p.dim() == 2 and p.shape[0] == E:
                p.normal_(0, 0.5)
            elif "experts" in name:
                p.normal_(0, 0.15)
    return model.to(torch.bfloat16 if dtype == "bf16" else torch.float32).eval()


def moe_blocks(model):
    """[(layer index, block)] of the model's sparse MoE blocks."""
    out = []
    for i, layer in enumerate(model.model.layers):
        blk = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if hasattr(blk, "experts"):
            out.append((i, blk))
    return out


def draw_x(blk, dtype, gen):
    """T rows whose routing has no near-ties (in f32 logits)."""
    w = blk.gate.weight.detach().float()
    rows = []
    while len(rows) < T:
        x = torch.randn(H, generator=gen)
        if dtype == "bf16":
            x = x.to(torch.bfloat16).float()
        lg = torch.sort(x @ w.T, descending=True).values
        if lg[K - 1] - lg[K] > MARGIN:
            rows.append(x)
    return torch.stack(rows)


def moe_aux(logits):
    """moe's aux loss (kernels/loss.c): E / (K T) sum_e count_e mean_t p[t,e]."""
    p = torch.softmax(logits.double(), dim=-1)
    top = torch.topk(p, K, dim=-1).indices
    counts = torch.bincount(top.flatten(), minlength=E).double()
    return float(E / (K * logits.shape[0]) * (counts * p.mean(dim=0)).sum())


def one(family, dtype, out, gen):
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(1000 + ["mixtral", "qwen3_moe", "olmoe"].index(family))
    model = build(family, dtype)
    d = os.path.join(out, f"{family}-{dtype}")
    shutil.rmtree(d, ignore_errors=True)
    shard = "40KB" if (family, dtype) == ("qwen3_moe", "f32") else "50GB"
    model.save_pretrained(d, max_shard_size=shard)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(d, extra)):
            os.remove(os.path.join(d, extra))
    idx = os.path.join(d, "model.safetensors.index.json")
    files = json.load(open(idx))["weight_map"] if os.path.exists(idx) else None
    coef = model.config.router_aux_loss_coef
    tensors = {}
    for i, (li, blk) in enumerate(moe_blocks(model)):
        prefix = f"model.layers.{li}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}"
        # the saved per-expert tensors are the fused parameters' slices
        fname = files[f"{prefix}.experts.0.up_proj.weight" if family != "mixtral"
                      else f"{prefix}.experts.0.w3.weight"] if files else "model.safetensors"
        with safe_open(os.path.join(d, fname), "pt") as f:
            up = f.get_tensor(f"{prefix}.experts.0.{'w3' if family == 'mixtral' else 'up_proj'}"
                              ".weight")
        fi = blk.experts.gate_up_proj.shape[1] // 2
        assert torch.equal(up, blk.experts.gate_up_proj[0, fi:].detach()), "layout changed"
        x = draw_x(blk, dtype, gen)
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        xt = x.to(tdt).clone().requires_grad_(dtype == "f32")
        logits, _, top = blk.gate(xt)
        y = blk(xt[None])
        y = (y[0] if isinstance(y, tuple) else y)[0]
        counts = torch.bincount(top.flatten(), minlength=E).float()
        tensors[f"x.{i}"] = x.float().contiguous()
        tensors[f"y.{i}"] = y.detach().float().contiguous()
        tensors[f"counts.{i}"] = counts
        if dtype != "f32":
            continue
        lbl = mod.load_balancing_loss_func((logits,), E, K)
        mine, theirs = moe_aux(logits.detach()), float(lbl.detach()) / K
        assert abs(mine - theirs) <= 1e-6 * abs(mine), (mine, theirs)
        dy = torch.randn(T, H, generator=gen)
        params = [xt, blk.gate.weight, blk.experts.gate_up_proj, blk.experts.down_proj]
        g = torch.autograd.grad((y * dy).sum() + coef * lbl, params)
        tensors[f"dy.{i}"] = dy
        tensors[f"dx.{i}"] = g[0].contiguous()
        tensors[f"aux.{i}"] = torch.tensor([theirs])
        names = (("w1", "w3", "w2") if family == "mixtral"
                 else ("gate_proj", "up_proj", "down_proj"))
        tensors[f"grad.{prefix}.gate.weight"] = g[1].contiguous()
        for e in range(E):
            tensors[f"grad.{prefix}.experts.{e}.{names[0]}.weight"] = g[2][e, :fi].contiguous()
            tensors[f"grad.{prefix}.experts.{e}.{names[1]}.weight"] = g[2][e, fi:].contiguous()
            tensors[f"grad.{prefix}.experts.{e}.{names[2]}.weight"] = g[3][e].contiguous()
    save_file(tensors, os.path.join(out, f"{family}-{dtype}.expected.safetensors"))
    print(f"{d}: {len(moe_blocks(model))} MoE layers, files {sorted(os.listdir(d))}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "fixtures"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    gen = torch.Generator().manual_seed(21)
    for family in ("mixtral", "qwen3_moe", "olmoe"):
        for dtype in ("f32", "bf16"):
            one(family, dtype, a.out, gen)


if __name__ == "__main__":
    main()
