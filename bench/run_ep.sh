#!/bin/bash
# bench/run_ep.sh - issue 5's GPU runs on a machine with 2 or 4 GPUs, from
# the repository root with bin/, lib/ and .deps/ carried (built elsewhere):
#   1. the service on W GPU workers (expert-parallel mode): parity with
#      PyTorch, service_bench against the CPU reference (T <= 64: the plain
#      reference's forward and backward at T=4096 did not end within 10
#      minutes on one core), and a T=4096 forward timed without it;
#   2. bin/ep_bench: kcu_ep against the single-GPU layer (--check), and the
#      scaling table at 1, 2, 4 GPUs, 16384 tokens per GPU, Mixtral and
#      Qwen3-30B-A3B shapes, random and skewed routing.
#   check: a short pass of both (the --check runs on 4 and 2 GPUs, the
#   1-GPU baselines, parity and service_bench on all GPUs) for a lease of a
#   few minutes.
# Logs go to ${OUT:-.}.   bash bench/run_ep.sh [service|ep|all|check]
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-.}
NG=$(nvidia-smi -L | wc -l)
WHAT=${1:-all}
B=./bin/ep_bench
log() { tee -a "$OUT/run_ep.log"; }
step() { # timeout name command...
    local t=$1 name=$2; shift 2
    echo "== $name: $*" | log
    timeout "$t" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -v "^moe \|^ *$" "$OUT/$name.log" | tail -n 14 | log
    echo "rc=$rc" | log
}
# the service on W GPU workers: parity with PyTorch, service_bench's checks
parity() { # timeout W
    step "$1" "parity_w$2" deploy/gpu-cluster.sh -w "$2" -- python3 python/parity.py --dtype bf16 \
        --d-model 128 --d-ff 256
}
SB_LAYER="--dtype bf16 --d-model 1024 --d-ff 2048 --experts 8 --top-k 2 --iters 10"
service_checks() { # timeout W
    step "$1" "service_w$2" deploy/gpu-cluster.sh -w "$2" -- bin/service_bench $SB_LAYER \
        --tokens 1,7,64 --train
}
if [ "$WHAT" = service ] || [ "$WHAT" = all ]; then
    for W in 4 2; do
        [ "$W" -gt "$NG" ] && continue
        parity 90 "$W"
        service_checks 120 "$W"
        step 90 "service_fwd_w$W" deploy/gpu-cluster.sh -w "$W" -- bin/service_bench $SB_LAYER \
            --tokens 4096 --no-ref
    done
fi
if [ "$WHAT" = ep ] || [ "$WHAT" = all ]; then
    [ "$NG" -ge 4 ] && step 120 qwen3_w4 $B --gpus 4 --shape qwen3 --chunks 1,2,4
    [ "$NG" -ge 4 ] && step 120 qwen3_w4_sms32 $B --gpus 4 --shape qwen3 --chunks 1,2,4 --comm-sms 32
    [ "$NG" -ge 4 ] && step 150 mixtral_w4 $B --gpus 4 --shape mixtral --chunks 1,2
    [ "$NG" -ge 4 ] && step 150 qwen3_w4_skew $B --gpus 4 --shape qwen3 --check --skew --chunks 1,4
    [ "$NG" -ge 4 ] && step 150 mixtral_w4_skew $B --gpus 4 --shape mixtral --check --skew --chunks 1
    step 120 qwen3_w2 $B --gpus 2 --shape qwen3 --check --chunks 1,2,4
    step 150 mixtral_w2 $B --gpus 2 --shape mixtral --check --chunks 1,2
    step 90 qwen3_w1 $B --gpus 1 --shape qwen3 --chunks 1
    step 120 mixtral_w1 $B --gpus 1 --shape mixtral --chunks 1
fi
if [ "$WHAT" = check ]; then
    nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv | log
    [ "$NG" -ge 4 ] && step 100 qwen3_w4 $B --gpus 4 --shape qwen3 --check --chunks 1,4
    [ "$NG" -ge 4 ] && step 110 mixtral_w4 $B --gpus 4 --shape mixtral --check --chunks 1
    step 80 qwen3_w2 $B --gpus 2 --shape qwen3 --check --chunks 1,2,4
    step 45 qwen3_w1 $B --gpus 1 --shape qwen3 --chunks 1
    step 60 mixtral_w1 $B --gpus 1 --shape mixtral --chunks 1
    parity 60 "$NG"
    service_checks 90 "$NG"
fi
exit 0
