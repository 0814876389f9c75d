#!/usr/bin/env bash
# gpu_families.sh - the routing families on the GPU, in one device call on
# one GPU (bin/, lib/ and .deps/ carried; logs under $OUT): check-gpu (the
# family cases against the CPU oracle, and every other case), a DeepSeek-V3
# and a Qwen2-MoE layer through a GPU worker against a CPU worker
# (python/family_check.py; with 2 GPUs also 2 GPU workers on the "experts"
# backend, --ep off), and the DeepSeek-V3 routing's cost in bin/moe_bench
# beside softmax top-8 of the same shape (the family on the decode path at
# T=64 and T=1).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-run/gpu-families}
mkdir -p "$OUT"
log() { tee -a "$OUT/families.log"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | log
echo "== check-gpu" | log
timeout 300 bin/check-gpu >"$OUT/check_gpu.log" 2>&1
echo "rc=$?" | log
grep -E "FAIL|families|check-gpu:" "$OUT/check_gpu.log" | tail -n 40 | cut -c1-220 | log
echo "== family_check: CPU worker (reference), then GPU worker" | log
timeout 150 deploy/gpu-cluster.sh -w 1 -b cpu -- python3 python/family_check.py \
    --save "$OUT/famref.npz" >"$OUT/family_cpu.log" 2>&1
echo "rc=$?" | log
MOE_RUN_DIR="$OUT/fam-gpu-run" timeout 150 deploy/gpu-cluster.sh -w 1 -b cuda -- \
    python3 python/family_check.py --against "$OUT/famref.npz" >"$OUT/family_gpu.log" 2>&1
echo "rc=$?" | log
grep -E "FAIL|passed" "$OUT/family_gpu.log" | head -n 30 | log
grep -h "whole-layer\|CPU path\|not on the GPU\|routing" "$OUT"/fam-gpu-run/worker*.log |
    cut -c1-200 | head -n 6 | log
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    # the "experts" GPU backend (--ep off): the host routes the family and
    # runs the shared expert, the GPUs the routed experts
    echo "== family_check: 2 GPU workers, --ep off (the experts backend)" | log
    MOE_WORKER_EP=off MOE_RUN_DIR="$OUT/fam-experts-run" timeout 150 deploy/gpu-cluster.sh -w 2 \
        -b cuda -- python3 python/family_check.py --against "$OUT/famref.npz" \
        >"$OUT/family_experts.log" 2>&1
    echo "rc=$?" | log
    grep -E "FAIL|passed" "$OUT/family_experts.log" | head -n 30 | log
    grep -h "experts mode\|CPU path\|routing" "$OUT"/fam-experts-run/worker*.log |
        cut -c1-200 | head -n 4 | log
fi
echo "== moe_bench dsv3-route" | log
timeout 240 bin/moe_bench --only dsv3-route >"$OUT/bench.log" 2>&1
echo "rc=$?" | log
grep -E "device:|dsv3-route" "$OUT/bench.log" | log
exit 0
