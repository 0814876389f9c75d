#!/usr/bin/env bash
# gpu_owed.sh - the GPU checks a session owes after changing worker/, the
# exchange or the kernels, in two device calls of under 10 minutes each on a
# host with 2-4 GPUs (bin/, lib/ and .deps/ carried; logs under $OUT):
#
#   bash bench/gpu_owed.sh 1   check-gpu; parity on every GPU count; the
#                              lane at T=1 (one worker) with and without
#                              rings; pipelined train forwards
#   bash bench/gpu_owed.sh 2   the survivors' re-formation (kill test
#                              --min-workers) with and without training,
#                              then a short mixed kill series (KILLS=8)
#   bash bench/gpu_owed.sh 4   the lane at T=1 with spinning ring threads, the
#                              bulk path against raw nng, a cold-cache load
#                              of a 4-layer Qwen3-shaped checkpoint
#   bash bench/gpu_owed.sh 3   a kill series of mixed moments (inference,
#                              kill inside an optimizer step, kill in any
#                              call) on all GPUs: KILLS runs (default 16)
#   bash bench/gpu_owed.sh 6   on 2 GPUs, under 8 minutes: check-gpu, the
#                              families through a GPU worker against a CPU
#                              worker, bench/nccl_client_check.sh, the
#                              DeepSeek-V3 routing in bin/moe_bench, the
#                              bulk path against raw nng (7 logs)
#   bash bench/gpu_owed.sh 5   check-gpu, then issue 25's kill series on
#                              all GPUs for KILL_BUDGET seconds (default
#                              300; --mix: 4 moments x bf16/f32 models;
#                              KILL_SERIES_FIRST numbers the runs so that
#                              a 50-kill series spans calls), then the lane
#                              at T=1 with and without spinning ring threads;
#                              the failed runs' logs in $OUT/kill-fails.tgz
#   bash bench/gpu_owed.sh 7   the Python client's nccl path (torch CUDA
#                              tensors on GPU 0, a CUDA worker on GPU 1:
#                              python/dataplane_check.py --nccl), then the
#                              kill series on all GPUs for KILL_BUDGET
#                              seconds (default 380), after a series of kills
#                              inside optimizer.step for STEP_BUDGET seconds
#                              (default 0: none); failed runs' logs in
#                              $OUT/kill-fails.tgz
#
# Each step is bounded; a summary line per step goes to $OUT/owed.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-run/gpu-owed}
mkdir -p "$OUT"
NG=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
. deploy/deps-env.sh && { deps_env || true; } # the runtime libraries, for the binaries run directly
log() { tee -a "$OUT/owed.log"; }
step() { # timeout name command...: the last lines of its output, then rc
    local t=$1 name=$2
    shift 2
    echo "== $name: $*" | log
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep -E "PASS|FAIL|passed|failed|fwd |T=1 |re-formed|kill series|first error|ready again|GB/s" \
        "$OUT/$name.log" | grep -v "^[0-9]*:" | tail -n 12 | cut -c1-220 | log
    echo "rc=$rc" | log
}
# save_fails TABLE DIR ...: the logs of the runs each kill-series TABLE (in
# $OUT) marks FAIL, from /tmp/DIR, into $OUT/kill-fails.tgz
save_fails() {
    local tgz=()
    while [ $# -ge 2 ]; do
        for n in $(grep -E "^[0-9.]+ +FAIL" "$OUT/$1" 2>/dev/null | awk '{split($1, r, "."); print r[1]}' | sort -u); do
            [ -f "/tmp/$2/run-$n.log" ] && tgz+=("$2/run-$n.log")
        done
        shift 2
    done
    [ ${#tgz[@]} -gt 0 ] && (cd /tmp && tar czf "$OUT/kill-fails.tgz" "${tgz[@]}")
    return 0
}
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | head -1 | log
case "${1:-1}" in
1)
    step 150 check_gpu bin/check-gpu
    for W in $NG 2; do
        [ "$W" -ge 2 ] || continue
        step 80 "parity_w$W" deploy/gpu-cluster.sh -w "$W" -b cuda -- \
            python3 python/parity.py --dtype bf16 --d-model 128 --d-ff 256
    done
    # the lane at T=1 and 64 with and without shared-memory rings
    for RING in 1 0; do
        step 90 "lane_t1_ring$RING" env MOE_RING=$RING deploy/gpu-cluster.sh -w 1 -b cuda -- \
            bin/service_bench --d-model 2048 --d-ff 768 --experts 128 --top-k 8 --dtype bf16 \
            --tokens 1,64 --iters 201 --no-ref --paths coordinator,socket,shm,shm-zc
    done
    # several train forwards in flight per layer; the worker logs its recomputes
    step 90 pipeline env MOE_RUN_DIR="$OUT/pipeline-run" deploy/gpu-cluster.sh -w 1 -b cuda -- \
        python3 python/pipeline_check.py
    grep -h "recomputed\|gpu-train-states" "$OUT"/pipeline-run/worker*.log | cut -c1-200 | log
    ;;
2)
    if [ "$NG" -ge 3 ]; then
        step 120 shrink_inf deploy/gpu-kill-test.sh --backend cuda --min-workers $((NG - 1))
        step 150 shrink_train deploy/gpu-kill-test.sh --backend cuda --min-workers $((NG - 1)) \
            --train --checkpoint-dir "$OUT/ckpt-shrink"
    fi
    step 300 kills env KILL_SERIES_DIR="$OUT/kills" deploy/kill-series.sh "${KILLS:-8}" --mix \
        --backend cuda
    ;;
4)
    # the lane at T=1 with the ring threads spinning (cores to spare here)
    for SPIN in 0 100; do
        step 90 "lane_t1_spin$SPIN" env MOE_RING_SPIN_US=$((SPIN * 2)) \
            MOE_WORKER_RING_SPIN_US=$SPIN deploy/gpu-cluster.sh -w 1 -b cuda -- \
            bin/service_bench --d-model 2048 --d-ff 768 --experts 128 --top-k 8 --dtype bf16 \
            --tokens 1,64 --iters 401 --no-ref --paths socket,shm,shm-zc
    done
    # the bulk path against raw nng on this host's loopback, 64 MiB each way
    step 120 bulk deploy/gpu-cluster.sh -w 1 -b cpu -- bin/service_bench --d-model 4096 \
        --d-ff 16 --experts 4 --top-k 1 --dtype f32 --tokens 4096 --iters 5 --no-ref \
        --paths socket,bulk1,bulk
    # a Qwen3-30B-A3B-shaped checkpoint of 4 MoE layers loaded from a cold cache
    step 240 hf_load python3 bench/hf_load_bench.py --layers 4 --cold --workers 2 \
        --dir "${TMPDIR:-/tmp}/moe-hf-bench/q3"
    ;;
6)
    step 100 check_gpu bin/check-gpu
    step 50 fam_cpu deploy/gpu-cluster.sh -w 1 -b cpu -- python3 python/family_check.py \
        --save /tmp/famref.npz
    step 50 fam_gpu_w1 deploy/gpu-cluster.sh -w 1 -b cuda -- python3 python/family_check.py \
        --against /tmp/famref.npz
    step 150 nccl bash bench/nccl_client_check.sh
    step 75 bench_after env MOE_BENCH_NO_AB=1 bin/moe_bench --only "${CASES:-dsv3-route,qwen3-dec:1}"
    grep -hE "^(mixtral|qwen3)|dsv3-route T" "$OUT/bench_after.log" | cut -c1-240 | log >/dev/null
    # the bulk path against raw nng on this host's loopback, 64 MiB each way
    step 45 bulk deploy/gpu-cluster.sh -w 1 -b cpu -- bin/service_bench --d-model 4096 \
        --d-ff 16 --experts 4 --top-k 1 --dtype f32 --tokens 4096 --iters 5 --no-ref \
        --paths socket,bulk1,bulk
    ;;
5)
    step 150 check_gpu bin/check-gpu
    step $((${KILL_BUDGET:-300} + 120)) kills env KILL_SERIES_DIR=/tmp/moe-kills \
        KILL_SERIES_SECONDS="${KILL_BUDGET:-300}" deploy/kill-series.sh 50 --mix --backend cuda
    grep -E "^[0-9.]+ +(PASS|FAIL)|stopped|first error|ready again|kill series" \
        "$OUT/kills.log" | log >/dev/null
    save_fails kills.log moe-kills
    for SPIN in 0 100; do
        step 60 "lane_t1_spin$SPIN" env MOE_RING_SPIN_US=$((SPIN * 2)) \
            MOE_WORKER_RING_SPIN_US=$SPIN deploy/gpu-cluster.sh -w 1 -b cuda -- \
            bin/service_bench --d-model 2048 --d-ff 768 --experts 128 --top-k 8 --dtype bf16 \
            --tokens 1,64 --iters 401 --no-ref --paths socket,shm,shm-zc
    done
    ;;
7)
    # torch's NCCL (the client's) may not be the system's (the worker's):
    # first as installed (a version mismatch must be refused clearly), then
    # the worker started with torch's library
    NCCL_LIB=$(python3 -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null)
    echo "torch's NCCL: ${NCCL_LIB:-none found} ($(python3 -c 'import torch; print(torch.cuda.nccl.version())' 2>&1 | tail -1))" | log
    step 60 py_nccl_asis env MOE_RUN_DIR=/tmp/py-nccl-asis deploy/gpu-cluster.sh -w 1 -d 1 -b cuda -- \
        bash -c 'python3 python/dataplane_check.py --url "$MOE_URL" --nccl'
    grep -ho "NCCL versions differ[^;]*" "$OUT/py_nccl_asis.log" | head -1 | log
    step 90 py_nccl env LD_LIBRARY_PATH="$NCCL_LIB:${LD_LIBRARY_PATH:-}" MOE_RUN_DIR=/tmp/py-nccl-run \
        deploy/gpu-cluster.sh -w 1 -d 1 -b cuda -- \
        bash -c 'python3 python/dataplane_check.py --url "$MOE_URL" --nccl'
    grep -h "NCCL" /tmp/py-nccl-run/worker*.log | tail -n 4 | cut -c1-200 | log
    # kills inside optimizer.step only (STEP_BUDGET seconds, 0: none), then
    # the mixed series (KILL_BUDGET seconds)
    if [ "${STEP_BUDGET:-0}" -gt 0 ]; then
        step $((STEP_BUDGET + 100)) kills_step env KILL_SERIES_DIR=/tmp/moe-kills-step \
            KILL_SERIES_FIRST=101 KILL_SERIES_SECONDS="$STEP_BUDGET" deploy/kill-series.sh 50 \
            --backend cuda --train --kill-during step --checkpoint-dir /tmp/moe-kills-step/ck
        grep -E "^[0-9.]+ +(PASS|FAIL)|stopped" "$OUT/kills_step.log" | log >/dev/null
    fi
    step $((${KILL_BUDGET:-380} + 100)) kills env KILL_SERIES_DIR=/tmp/moe-kills \
        KILL_SERIES_FIRST="${KILL_SERIES_FIRST:-1}" KILL_SERIES_SECONDS="${KILL_BUDGET:-380}" \
        deploy/kill-series.sh 50 --mix --backend cuda
    grep -E "^[0-9.]+ +(PASS|FAIL)|stopped|first error|ready again|kill series" \
        "$OUT/kills.log" | log >/dev/null
    save_fails kills.log moe-kills kills_step.log moe-kills-step
    ;;
3)
    step 580 kills env KILL_SERIES_DIR="$OUT/kills" deploy/kill-series.sh "${KILLS:-16}" --mix \
        --backend cuda
    ;;
esac
exit 0
