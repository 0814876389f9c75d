#!/usr/bin/env python3
"""make_fixtures.py - tiny random Hugging Face MoE models and what
transformers computes with them, for tests/cluster/test_hf.c (no torch needed there).

For each family (Mixtral, Qwen3-MoE, OLMoE, and Qwen2-MoE and DeepSeek-V3:
shared experts, sigmoid scoring with a correction bias, group-limited
top-k) and dtype (f32, bf16), it builds a model with transformers, saves it with save_pretrained into
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
lbl / K) and fails if it does not hold. DeepSeek-V3 has no aux loss in
transformers: its fixture has no aux.i and dx is d/dx sum(y * dy). For
Qwen2-MoE and DeepSeek-V3 the script also recomputes y with moe's routing
rules (kernels/kern.h kern_route_cfg) in float64 and fails unless it agrees
with transformers' (f32: 1e-6; bf16: 1e-2, and the same experts chosen);
their grad.* include the shared expert(s) and the shared expert gate. The
bf16 DeepSeek-V3 keeps its correction bias in F32, as DeepSeek publishes it.

    pip install transformers safetensors
    python3 python/make_fixtures.py [--out tests/fixtures] [--families qwen2_moe,...]
                                    [--dtypes f32,bf16]
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

# ---- shared-expert families ----
FS_E, FS_F, FS_FS = 8, 32, 32  # experts, moe_intermediate_size, the shared expert's d_ff
DS_GROUPS, DS_TOPK_GROUP, DS_SCALE = 4, 2, 2.5


def build_shared(family, dtype):
    import transformers as tf

    common = dict(vocab_size=32, hidden_size=H, num_attention_heads=2, num_key_value_heads=1,
                  num_experts_per_tok=K, intermediate_size=F, moe_intermediate_size=FS_F,
                  num_hidden_layers=2, tie_word_embeddings=False)
    if family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(num_experts=FS_E, shared_expert_intermediate_size=FS_FS,
                                decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                                router_aux_loss_coef=0.02, **common)
        model = tf.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = tf.DeepseekV3Config(n_routed_experts=FS_E, n_shared_experts=FS_FS // FS_F,
                                  n_group=DS_GROUPS, topk_group=DS_TOPK_GROUP,
                                  routed_scaling_factor=DS_SCALE, norm_topk_prob=True,
                                  first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                  **common)
        model = tf.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "experts" in name or "shared_expert" in name:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    if dtype == "f32":
        return model.float().eval()
    model = model.to(torch.bfloat16)
    for _, blk in moe_blocks(model):  # the bias stays F32, as DeepSeek-V3 publishes it
        if hasattr(blk.gate, "e_score_correction_bias"):
            blk.gate.e_score_correction_bias = blk.gate.e_score_correction_bias.float()
    return model.eval()


def route_ref(family, logits, bias):
    """moe's routing (kernels/kern.h) in float64: (idx (T,K), weights (T,K),
    the smallest margin of a choice: K-th vs (K+1)-th, kept vs dropped group)."""
    lg = logits.double()
    if family == "qwen2_moe":
        s = torch.softmax(lg, dim=-1)
        c = s.clone()
        margin = float("inf")
    else:
        s = torch.sigmoid(lg)
        c = s + bias.double()
        gs = FS_E // DS_GROUPS
        g = torch.topk(c.view(-1, DS_GROUPS, gs), 2, dim=-1).values.sum(-1)
        gsorted = torch.sort(g, dim=-1, descending=True).values
        margin = float((gsorted[:, DS_TOPK_GROUP - 1] - gsorted[:, DS_TOPK_GROUP]).min())
        keep = torch.zeros_like(g, dtype=torch.bool)
        keep.scatter_(1, torch.topk(g, DS_TOPK_GROUP, dim=-1).indices, True)
        c = c.masked_fill(~keep.repeat_interleave(gs, dim=1), float("-inf"))
    cs = torch.sort(c, dim=-1, descending=True).values
    margin = min(margin, float((cs[:, K - 1] - cs[:, K]).min()))
    idx = torch.topk(c, K, dim=-1).indices
    w = s.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + (1e-20 if family == "deepseek_v3" else 0))
    if family == "deepseek_v3":
        w = w * DS_SCALE
    return idx, w, margin


def swiglu64(x, g, u, d):
    return torch.nn.functional.linear(torch.nn.functional.silu(x @ g.T) * (x @ u.T), d)


def y_ref(family, blk, x):
    """the block's output by moe's rules, float64."""
    x = x.double()
    wr = blk.gate.weight.detach().double()
    bias = getattr(blk.gate, "e_score_correction_bias", None)
    idx, w, _ = route_ref(family, x @ wr.T, bias)
    gu, dn = blk.experts.gate_up_proj.detach().double(), blk.experts.down_proj.detach().double()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(idx[t, j])
            y[t] += w[t, j] * swiglu64(x[t:t + 1], gu[e, :FS_F], gu[e, FS_F:], dn[e])[0]
    sh = blk.shared_expert if family == "qwen2_moe" else blk.shared_experts
    ys = swiglu64(x, sh.gate_proj.weight.detach().double(), sh.up_proj.weight.detach().double(),
                  sh.down_proj.weight.detach().double())
    if family == "qwen2_moe":
        ys = torch.sigmoid(x @ blk.shared_expert_gate.weight.detach().double().T) * ys
    return y + ys


def draw_x_shared(family, blk, dtype, gen):
    """T rows whose routing (choice and group) margins exceed MARGIN / 2
    (bf16: rows of bf16 values)."""
    w = blk.gate.weight.detach().double()
    bias = getattr(blk.gate, "e_score_correction_bias", None)
    rows = []
    while len(rows) < T:
        x = torch.randn(H, generator=gen)
        if dtype == "bf16":
            x = x.to(torch.bfloat16).float()
        if route_ref(family, (x.double() @ w.T)[None], bias)[2] > MARGIN / 2:
            rows.append(x)
    return torch.stack(rows)


def one_shared(family, dtype, out, gen):
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(2000 + ["qwen2_moe", "deepseek_v3"].index(family))
    model = build_shared(family, dtype)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    d = os.path.join(out, f"{family}-{dtype}")
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    if os.path.exists(os.path.join(d, "generation_config.json")):
        os.remove(os.path.join(d, "generation_config.json"))
    coef = getattr(model.config, "router_aux_loss_coef", 0.0) if family == "qwen2_moe" else 0.0
    sname = "shared_expert" if family == "qwen2_moe" else "shared_experts"
    tensors = {}
    blocks = moe_blocks(model)
    for i, (li, blk) in enumerate(blocks):
        prefix = f"model.layers.{li}.mlp"
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            up = f.get_tensor(f"{prefix}.experts.0.up_proj.weight")
            names = set(f.keys())
        assert torch.equal(up, blk.experts.gate_up_proj[0, FS_F:].detach()), "layout changed"
        assert up.dtype == tdt, up.dtype
        for need in (f"{prefix}.gate.weight", f"{prefix}.{sname}.gate_proj.weight") + (
                (f"{prefix}.shared_expert_gate.weight",) if family == "qwen2_moe" else
                (f"{prefix}.gate.e_score_correction_bias",)):
            assert need in names, need
        x = draw_x_shared(family, blk, dtype, gen)
        xt = x.to(tdt).clone().requires_grad_(dtype == "f32")
        logits, _, top = blk.gate(xt)
        y = blk(xt[None])
        y = (y[0] if isinstance(y, tuple) else y)[0]
        ref = y_ref(family, blk, x)
        err = float((ref - y.detach().double()).norm() / ref.norm())
        # bf16: transformers rounds the expert activations and sums to bf16
        assert err < (1e-6 if dtype == "f32" else 1e-2), \
            f"{family}-{dtype}: moe's rules vs transformers: rel err {err}"
        idx_ref = route_ref(family, (x.double() @ blk.gate.weight.detach().double().T),
                            getattr(blk.gate, "e_score_correction_bias", None))[0]
        assert torch.equal(torch.sort(idx_ref, -1).values, torch.sort(top, -1).values)
        counts = torch.bincount(top.flatten(), minlength=FS_E).float()
        tensors[f"x.{i}"] = x.contiguous()
        tensors[f"y.{i}"] = y.detach().float().contiguous()
        tensors[f"counts.{i}"] = counts
        if dtype != "f32":
            print(f"{family}-{dtype} layer {li}: moe's rules (float64) vs transformers rel err "
                  f"{err:.2e}, counts {counts.int().tolist()}")
            continue
        dy = torch.randn(T, H, generator=gen)
        loss = (y * dy).sum()
        if family == "qwen2_moe":
            lbl = mod.load_balancing_loss_func((logits,), FS_E, K)
            mine, theirs = moe_aux(logits.detach()), float(lbl.detach()) / K
            assert abs(mine - theirs) <= 1e-6 * abs(mine), (mine, theirs)
            loss = loss + coef * lbl
            tensors[f"aux.{i}"] = torch.tensor([theirs])
        sh = getattr(blk, sname)
        params = [xt, blk.gate.weight, blk.experts.gate_up_proj, blk.experts.down_proj,
                  sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight]
        if family == "qwen2_moe":
            params.append(blk.shared_expert_gate.weight)
        g = torch.autograd.grad(loss, params)
        tensors[f"dy.{i}"] = dy
        tensors[f"dx.{i}"] = g[0].contiguous()
        tensors[f"grad.{prefix}.gate.weight"] = g[1].contiguous()
        for e in range(FS_E):
            tensors[f"grad.{prefix}.experts.{e}.gate_proj.weight"] = g[2][e, :FS_F].contiguous()
            tensors[f"grad.{prefix}.experts.{e}.up_proj.weight"] = g[2][e, FS_F:].contiguous()
            tensors[f"grad.{prefix}.experts.{e}.down_proj.weight"] = g[3][e].contiguous()
        for k, m in enumerate(("gate_proj", "up_proj", "down_proj")):
            tensors[f"grad.{prefix}.{sname}.{m}.weight"] = g[4 + k].contiguous()
        if family == "qwen2_moe":
            tensors[f"grad.{prefix}.shared_expert_gate.weight"] = g[7].contiguous()
        print(f"{family} layer {li}: moe's rules vs transformers rel err {err:.2e}, counts "
              f"{counts.int().tolist()}")
    save_file(tensors, os.path.join(out, f"{family}-{dtype}.expected.safetensors"))
    print(f"{d}: {len(blocks)} MoE layers, files {sorted(os.listdir(d))}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "fixtures"))
    ap.add_argument("--families", default="mixtral,qwen3_moe,olmoe,qwen2_moe,deepseek_v3")
    ap.add_argument("--dtypes", default="f32,bf16")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    want, dtypes = a.families.split(","), a.dtypes.split(",")
    # the first three share one generator in this order: regenerating only
    # some of them changes their inputs (the fixtures stay self-consistent)
    gen = torch.Generator().manual_seed(21)
    for family in ("mixtral", "qwen3_moe", "olmoe"):
        for dtype in ("f32", "bf16"):
            if family in want and dtype in dtypes:
                one(family, dtype, a.out, gen)
    for family in ("qwen2_moe", "deepseek_v3"):
        for dtype in ("f32", "bf16"):
            if family in want and dtype in dtypes:
                seed = 22 if dtype == "f32" else 23
                one_shared(family, dtype, a.out, torch.Generator().manual_seed(seed))


if __name__ == "__main__":
    main()
