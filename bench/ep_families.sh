#!/usr/bin/env bash
# ep_families.sh - the expert-parallel layer (kcu_ep) with the routing
# families and shared experts against the one-GPU kcu_layer on the same
# tokens and weights: bin/ep_bench --check --family dsv3|qwen2 on W GPUs
# (y, y of an inference forward, dx, the router's, the routed experts',
# the shared expert's and the gate's gradients within the bf16 tolerance),
# over shapes, overlap degrees (--check-chunks 1, 2 and auto), skewed
# routing and a few tokens a GPU (the shared expert's decode path in the
# inference forward), then the plain check as a regression. From the
# repository root with bin/ built; logs under $OUT.
#   bash bench/ep_families.sh [W]     (W GPUs, default: all of them)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-run/ep-families}
mkdir -p "$OUT"
W=${1:-$(nvidia-smi -L | wc -l)}
log() { tee -a "$OUT/ep_families.log"; }
fails=0
one() { # name args...
    local name=$1
    shift
    timeout 300 bin/ep_bench --gpus "$W" --check --chunks 1 --iters 1 "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name (rc=$rc): $(grep -E '^check vs' "$OUT/$name.log" | cut -c1-300)" | log
    [ $rc -eq 0 ] || fails=$((fails + 1))
}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | log
echo "== W=$W" | log
for fam in dsv3 qwen2; do
    for cc in 1 2 0; do
        one "${fam}_small_c$cc" --family "$fam" --shape small --tokens 4096 --check-chunks "$cc"
    done
    one "${fam}_moe64" --family "$fam" --shape moe64 --tokens 4096
    one "${fam}_qwen3" --family "$fam" --shape qwen3 --tokens 4096
    one "${fam}_skew" --family "$fam" --shape moe64 --tokens 4096 --skew
    one "${fam}_t5" --family "$fam" --shape moe64 --tokens 5
done
one plain_small --shape small --tokens 4096
echo "failed: $fails" | log
exit $((fails > 0))
