#!/usr/bin/env bash
# ep_nccl_env.sh - the expert-parallel exchange under NCCL settings: one
# bin/ep_bench run per setting (same shape, GPU count and chunks), so that
# the all-to-all's time against ncclAlltoAll's, and the forward's, can be
# compared in one call on one machine.
#
#   bench/ep_nccl_env.sh [GPUS] [SHAPE] [TOKENS] [CHUNKS]   (default 4 qwen3 16384 1,4)
#
# Settings: NCCL's defaults; NCCL_P2P_USE_CUDA_MEMCPY=1 (peer copies on the
# copy engines, no SMs taken from the GEMMs); NCCL_P2P_NVL_CHUNKSIZE=2 MiB;
# NCCL_MIN_NCHANNELS=32. Prints each run's table lines. About 1-1.5 minutes a
# setting on 2x H200 (most of it the setup): give a device call 6 minutes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
G=${1:-4}
SHAPE=${2:-qwen3}
T=${3:-16384}
C=${4:-1,4}
run() { # label env...
    local label=$1
    shift
    echo "== $label"
    env "$@" timeout 150 bin/ep_bench --gpus "$G" --shape "$SHAPE" --tokens "$T" --chunks "$C" \
        --infer --iters 5 2>&1 | grep -vE "^#|NCCL (INFO|WARN)" | tail -n 6
}
run default
run ce-copies NCCL_P2P_USE_CUDA_MEMCPY=1
run chunk-2MiB NCCL_P2P_NVL_CHUNKSIZE=2097152
run min-32-channels NCCL_MIN_NCHANNELS=32
