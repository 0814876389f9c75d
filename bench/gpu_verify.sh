#!/usr/bin/env bash
# gpu_verify.sh - after kernel or worker changes, one device call on a host
# with 2+ GPUs: correctness first, then no kernel slower (logs under $OUT):
#   1. bin/check-gpu (every kernel against the CPU oracle)
#   2. bin/moe_bench before and after, the same cases in one run: the
#      binary of the previous tree as $BEFORE (default run/carry/moe_bench_before)
#   3. the expert-parallel layer with the routing families against the
#      one-GPU layer (bin/ep_bench --check --family, 2 GPUs), the plain check
#   4. through the service: parity with PyTorch on 2 GPU workers, the
#      families on 2 GPU workers (expert parallel) and on 1 against a CPU
#      worker, the lane at T=1 and Qwen3 T=16384 on one GPU worker
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-run/gpu-verify}
BEFORE=${BEFORE:-run/carry/moe_bench_before}
mkdir -p "$OUT"
log() { tee -a "$OUT/verify.log"; }
step() { # timeout name command...
    local t=$1 name=$2
    shift 2
    echo "== $name" | log
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    echo "rc=$?" | log
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | log
step 300 check_gpu bin/check-gpu
grep -E "FAIL|check-gpu:" "$OUT/check_gpu.log" | tail -n 12 | cut -c1-200 | log
CASES=${CASES:-mixtral:8192,qwen3:16384,qwen3-dec:1,mixtral-dec:1}
if [ -x "$BEFORE" ]; then
    step 240 bench_before env MOE_BENCH_NO_AB=1 "$BEFORE" --only "$CASES"
    grep -E "^(device|mixtral|qwen3)" "$OUT/bench_before.log" | cut -c1-160 | log
fi
step 300 bench_after env MOE_BENCH_NO_AB=1 bin/moe_bench --only "$CASES,pipelined,qwen235"
grep -E "^(device|mixtral|qwen3|qwen235)|pipelined|kcu_forward" "$OUT/bench_after.log" |
    cut -c1-200 | log
for c in "dsv3 small" "qwen2 moe64"; do
    set -- $c
    step 120 "ep_$1" bin/ep_bench --gpus 2 --check --chunks 1 --iters 1 --family "$1" \
        --shape "$2" --tokens 4096 --check-chunks 2
    grep -E "^check vs" "$OUT/ep_$1.log" | cut -c1-240 | log
done
step 120 ep_plain bin/ep_bench --gpus 2 --check --chunks 1 --iters 1 --shape small --tokens 4096
grep -E "^check vs" "$OUT/ep_plain.log" | cut -c1-240 | log
step 100 parity_w2 deploy/gpu-cluster.sh -w 2 -b cuda -- python3 python/parity.py --dtype bf16 \
    --d-model 128 --d-ff 256
grep -E "PASS|FAIL" "$OUT/parity_w2.log" | head -n 3 | log
step 150 fam_cpu deploy/gpu-cluster.sh -w 1 -b cpu -- python3 python/family_check.py \
    --save "$OUT/famref.npz"
for W in 2 1; do
    step 150 "fam_gpu_w$W" deploy/gpu-cluster.sh -w "$W" -b cuda -- python3 \
        python/family_check.py --against "$OUT/famref.npz"
    grep -E "FAIL|passed" "$OUT/fam_gpu_w$W.log" | head -n 12 | log
done
step 120 service_qwen3 deploy/gpu-cluster.sh -w 1 -b cuda -- bin/service_bench --d-model 2048 \
    --d-ff 768 --experts 128 --top-k 8 --dtype bf16 --tokens 1,16384 --iters 21 --no-ref \
    --paths socket,shm,shm-zc
grep -E "^T=|^ +(socket|shm)" "$OUT/service_qwen3.log" | cut -c1-200 | log
exit 0
