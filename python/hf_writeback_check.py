#!/usr/bin/env python3
"""hf_writeback_check.py - a checkpoint that moe saved of a model created
from a Hugging Face directory loads into transformers with from_pretrained,
as it is: no missing or unexpected keys, the checkpoint's dtype, every
tensor that is not a MoE router, expert or shared expert (Qwen2-MoE,
DeepSeek-V3) as in the source directory, and
the first MoE block computing what moe computed (y of moe for x, in
MOE_Y: a safetensors file with tensors x and y).

    python3 python/hf_writeback_check.py SAVED_DIR SOURCE_DIR MOE_Y

Exits 0 when all hold (prints what it compared), 1 otherwise, 2 when
transformers is not installed.
"""
import sys

try:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
except ImportError as e:
    print(f"skip: {e}")
    sys.exit(2)


def main():
    saved, source, moe_y = sys.argv[1:4]
    model, info = AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
    src = AutoModelForCausalLM.from_pretrained(source)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        print(f"loading info: {bad}")
        return 1
    if model.dtype != src.dtype:
        print(f"dtype {model.dtype}, the source is {src.dtype}")
        return 1
    sp = dict(src.named_parameters())
    same = diff = 0
    for name, p in model.named_parameters():
        moe = (".experts." in name or ".shared_expert" in name
               or name.endswith((".block_sparse_moe.gate.weight", ".mlp.gate.weight")))
        if moe:
            diff += int(not torch.equal(p, sp[name]))
        elif not torch.equal(p, sp[name]):
            print(f"{name} differs from the source")
            return 1
        else:
            same += 1
    t = load_file(moe_y)
    layer = next(i for i, l in enumerate(model.model.layers)
                 if hasattr(getattr(l, "block_sparse_moe", None) or l.mlp, "experts"))
    blk = getattr(model.model.layers[layer], "block_sparse_moe", None) or \
        model.model.layers[layer].mlp
    with torch.no_grad():
        y = blk(t["x"].to(model.dtype)[None])
    y = (y[0] if isinstance(y, tuple) else y)[0].float()
    err = float((y - t["y"]).norm() / t["y"].norm())
    print(f"{saved}: loaded ({model.dtype}), {same} other tensors as the source, "
          f"{diff} MoE tensors trained, block of layer {layer} vs moe: rel err {err:.2e}")
    return 0 if err < 2e-2 and diff > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
