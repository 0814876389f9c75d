#!/usr/bin/env bash
# gpu-smoke.sh - the service on this host's GPUs: one GPU worker (the whole
# layer on the device), then every GPU with NCCL between the workers; each
# checked against the CPU reference and timed by bench/service_bench.
# Binaries come prebuilt in bin/ (see docs/OPERATIONS.md); logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe-gpu-out}
mkdir -p "$OUT"
NG=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $NG"; nvidia-smi -L
SB="./bin/service_bench --dtype bf16"
run() { # name workers -- args
    local name=$1 w=$2; shift 2
    echo "=== $name (workers $w)"
    deploy/gpu-cluster.sh -w "$w" -- "$@" 2>&1 | tee "$OUT/$name.log" | grep -vE "^\s+[a-z-]+ += "
}
# one worker: the whole layer on the device
run w1-small 1 $SB --d-model 1024 --d-ff 2048 --experts 8 --top-k 2 --tokens 1,7,256,4096 --iters 10 --train
run w1-qwen3 1 $SB --d-model 2048 --d-ff 768 --experts 128 --top-k 8 --tokens 1,64,4096 --iters 10
if [ "$NG" -ge 2 ]; then
    ./bin/xchg_nccl_check -n "$NG" -i 20 -s 64 >"$OUT/xchg_nccl_check.log" 2>&1
    echo "xchg_nccl_check rc=$?"; tail -25 "$OUT/xchg_nccl_check.log"
    run w$NG-small "$NG" $SB --d-model 1024 --d-ff 2048 --experts 8 --top-k 2 --tokens 1,7,256,4096 --iters 5 --train
    run w$NG-qwen3 "$NG" $SB --d-model 2048 --d-ff 768 --experts 128 --top-k 8 --tokens 64,4096 --iters 5
fi
