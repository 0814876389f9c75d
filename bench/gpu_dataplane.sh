#!/usr/bin/env bash
# gpu_dataplane.sh - the data plane on GPU workers, in one run: correctness of
# every path against the CPU reference (small layer), then the Qwen3-30B-A3B
# and Mixtral layers through the service over each path beside the floors
# (raw nng, pinned copies) and the kernels alone (bin/moe_bench).
#
#   bench/gpu_dataplane.sh [WORKERS]     (results under $OUT, or ./run/gpu-dp)
#
# Needs bin/ built with CUDA and, on a GPU host without the libraries,
# .deps/*.deb (deploy/gpu-cluster.sh unpacks them).
set -uo pipefail
cd "$(dirname "$0")/.."
W=${1:-1}
OUT=${OUT:-run/gpu-dp}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
PATHS=${PATHS:-coordinator,socket,shm,shm-zc}
deploy/gpu-cluster.sh -w "$W" -b cuda -- bash -c "
  set -x
  bin/service_bench --url \$MOE_URL --d-model 1024 --d-ff 512 --experts 16 --top-k 4 --dtype bf16 \
      --tokens 1,64,1000 --iters 5 --paths $PATHS 2>&1 | tee $OUT/check.txt
  bin/service_bench --url \$MOE_URL --d-model 1024 --d-ff 512 --experts 16 --top-k 4 --dtype bf16 \
      --tokens 64 --iters 3 --train --paths $PATHS 2>&1 | tee $OUT/check_train.txt
" 2>&1 | tail -40 > "$OUT/cluster_check.log"
deploy/gpu-cluster.sh -w "$W" -b cuda -- bash -c "
  bin/service_bench --url \$MOE_URL --d-model 2048 --d-ff 768 --experts 128 --top-k 8 --dtype bf16 \
      --tokens 1,64,4096,16384 --iters 10 --no-ref --paths $PATHS 2>&1 | tee $OUT/qwen3.txt
" 2>&1 | tail -30 > "$OUT/cluster_qwen3.log"
deploy/gpu-cluster.sh -w "$W" -b cuda -- bash -c "
  bin/service_bench --url \$MOE_URL --d-model 4096 --d-ff 14336 --experts 8 --top-k 2 --dtype bf16 \
      --tokens 1,64,4096 --iters 10 --no-ref --paths $PATHS 2>&1 | tee $OUT/mixtral.txt
" 2>&1 | tail -30 > "$OUT/cluster_mixtral.log"
if [ "$W" = 1 ] && [ -x bin/moe_bench ] && [ -z "${SKIP_KERNELS:-}" ]; then
    MOE_BENCH_NO_AB=1 bin/moe_bench --only qwen3:,qwen3-dec:1,qwen3-dec:64,mixtral-dec:1,mixtral-dec:64 \
        2>&1 | tee "$OUT/moe_bench.txt" | tail -30
fi
