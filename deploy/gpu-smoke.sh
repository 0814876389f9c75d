#!/usr/bin/env bash
# gpu-smoke.sh - the service on this host's GPUs: one GPU worker (the whole
# layer on the device), then every GPU with NCCL between the workers. Small
# batches are checked against the CPU reference (bench/service_bench); large
# ones are timed only (the plain-loop reference would take minutes).
# Binaries come prebuilt in bin/ (see docs/OPERATIONS.md); logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe-gpu-out}
mkdir -p "$OUT"
NG=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $NG"
SMALL="--d-model 1024 --d-ff 2048 --experts 8 --top-k 2"
QWEN="--d-model 2048 --d-ff 768 --experts 128 --top-k 8"
MIX="--d-model 4096 --d-ff 14336 --experts 8 --top-k 2"
suite() { # workers: checks then timings, all against one cluster each
    local w=$1
    deploy/gpu-cluster.sh -w "$w" -- bash -c "
        ./bin/service_bench --url \$MOE_URL --dtype bf16 $SMALL --tokens 1,7,256 --iters 3 --train &&
        ./bin/service_bench --url \$MOE_URL --dtype bf16 $SMALL --tokens 16,4096 --iters 10 --no-ref &&
        ./bin/service_bench --url \$MOE_URL --dtype bf16 $SMALL --tokens 4096 --iters 5 --no-ref --train" \
        >"$OUT/w$w-small.log" 2>&1
    echo "w$w small rc=$?"; grep -E "^T=|dx err|passed|FAIL|cluster of" "$OUT/w$w-small.log"
    deploy/gpu-cluster.sh -w "$w" -- bash -c "
        ./bin/service_bench --url \$MOE_URL --dtype bf16 $QWEN --tokens 1,33 --iters 3 --train &&
        ./bin/service_bench --url \$MOE_URL --dtype bf16 $QWEN --tokens 1,256,16384 --iters 5 --no-ref" \
        >"$OUT/w$w-qwen3.log" 2>&1
    echo "w$w qwen3 rc=$?"; grep -E "^T=|dx err|passed|FAIL" "$OUT/w$w-qwen3.log"
}
suite 1
if [ "$NG" -ge 2 ]; then
    timeout 120 ./bin/xchg_nccl_check -n "$NG" -i 20 -s 64 >"$OUT/xchg_nccl_check.log" 2>&1
    echo "xchg_nccl_check rc=$?"; tail -20 "$OUT/xchg_nccl_check.log"
    suite "$NG"
fi
