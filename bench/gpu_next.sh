#!/usr/bin/env bash
# gpu_next.sh - the measurements owed with main's binaries (carried in
# run/carry/main.tar.xz, unpacked here), each a step the next session picks
# with ONLY="NAME ..."; logs packed in $OUT/next.tgz and a summary in
# $OUT/next.log (a device call returns eight files at most). The branches'
# checks are bench/gpu_branches.sh's.
#
#   kills     GPU workers killed with today's defaults (the deduplicated
#             dispatch since session 23, the copy-engine exchange since
#             session 24): deploy/kill-series.sh 4 --mix --kills 4 --backend
#             cuda on all GPUs (about 4-6 minutes)
#   scaling   issue 24's table with today's defaults: bash bench/ep_scaling.sh
#             on 1, 2 and 4 GPUs (8 where lent), the PyTorch peer beside it
#             (about 8-10 minutes on 4 GPUs: split with W lists if needed)
#   qwen235   the bytes-bound layers (issue 23: qwen235 T=2048 76-77% of
#             copy since session 25, 85% asked; qwen235, qwen3-mid and
#             mixtral-mid cases) with today's defaults and with each of
#             session 25's switches off (tile pairs with the sorted rows,
#             v1n, the one-pair raster group), one bin/moe_bench run each
#             (about 40 s each)
#   owed36    session 36's unrun work: bin/check-gpu (the combine's
#             dispatch by K), racecheck over v10's GEMM forms (held, store
#             warps), Mixtral and Qwen3 training's f.combine phases, the
#             router's v1n at KCU_GEMM_NARROW=16 and 32 (ncu of the logits
#             GEMM), KCU_STATS_ONE=1's check-gpu and ncu; both switches'
#             A/B at qwen3-mid:2048 and qwen235:2048 (about 6 minutes)
#   ipc       issue 19's T=1 through CUDA IPC with the lane's rings, then
#             without (MOE_RING=0), beside the decode kernel alone
#             (bin/moe_bench qwen3-dec:1) in the same call
#
#   OUT=$OUT ONLY="qwen235 ipc" bash bench/gpu_next.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-run/gpu-next}
LOGS=/tmp/gpu-next
mkdir -p "$OUT" "$LOGS"
. deploy/deps-env.sh && { deps_env || true; } # the runtime libraries
[ -f run/carry/main.tar.xz ] && tar xJf run/carry/main.tar.xz
log() { tee -a "$OUT/next.log"; }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | head -1 | log

if want qwen235; then
    # one line per setting: the case's row (time, GB/s, fraction of copy)
    for s in "" "KCU_TILE_PAIRS=0 KCU_SORTED_INFER_RPE=0" KCU_GEMM_NARROW=0 KCU_GROUP_M=8; do
        name=qwen235_$(echo "${s:-default}" | tr ' =' '__')
        # shellcheck disable=SC2086 # the switches' words, split on purpose
        env MOE_BENCH_NO_AB=1 $s timeout 150 bin/moe_bench --only qwen235:,qwen3-mid:,mixtral-mid: \
            >"$LOGS/$name.log" 2>&1
        echo "== ${s:-default} (rc $?)" | log
        grep -E "^(qwen|mixtral)|copy" "$LOGS/$name.log" | cut -c1-220 | head -n 8 | log
    done
fi
if want owed36; then
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    CSAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    # ncu_time SETTING REGEX NAME: the matching kernels' times in one qwen235:2048 forward
    ncu_time() {
        env "$1" MOE_BENCH_NO_AB=1 timeout 120 "$NCU" --clock-control none \
            --kernel-name "regex:$2" --launch-skip 6 --launch-count 3 \
            --metrics gpu__time_duration.sum bin/moe_bench --only qwen235:2048 >"$LOGS/$3.log" 2>&1
        echo "== $1, ncu (rc $?)" | log
        grep -E "$2|duration" "$LOGS/$3.log" | head -n 6 | log
    }
    for s in "" KCU_STATS_ONE=1; do
        env $s timeout 240 bin/check-gpu >"$LOGS/check$s.log" 2>&1
        echo "== ${s:-default} check-gpu (rc $?)" | log
        grep -E "FAIL|check-gpu:" "$LOGS/check$s.log" | tail -n 10 | log
    done
    timeout 300 "$CSAN" --tool racecheck bin/check-gpu --gemm-only >"$LOGS/race.log" 2>&1
    echo "== racecheck --gemm-only (rc $?)" | log
    grep -E "v10|ERROR SUMMARY|hazard|check-gpu" "$LOGS/race.log" | head -n 20 | log
    MOE_BENCH_NO_AB=1 timeout 150 bin/moe_bench --only mixtral:8192,qwen3:16384 >"$LOGS/train.log" 2>&1
    echo "== training phases (rc $?)" | log
    grep -E "^(mixtral|qwen3) |phases" "$LOGS/train.log" | cut -c1-220 | log
    # the switches, one moe_bench line each, two rounds; then their kernels by ncu
    for r in 1 2; do
        for s in KCU_GEMM_NARROW=16 KCU_GEMM_NARROW=32 KCU_STATS_ONE=0 KCU_STATS_ONE=1; do
            env $s MOE_BENCH_NO_AB=1 timeout 60 bin/moe_bench --only qwen3-mid:2048,qwen235:2048 \
                >"$LOGS/ab_$s.$r.log" 2>&1
            echo "== $s, round $r (rc $?)" | log
            grep -E "^qwen" "$LOGS/ab_$s.$r.log" | cut -c1-200 | log
        done
    done
    for n in 16 32; do ncu_time KCU_GEMM_NARROW=$n k_gemm_narrow "ncu_narrow$n"; done
    for one in 0 1; do ncu_time KCU_STATS_ONE=$one k_stats "ncu_stats$one"; done
fi
if want ipc; then
    MOE_BENCH_NO_AB=1 timeout 90 bin/moe_bench --only qwen3-dec:1 >"$LOGS/dec.log" 2>&1
    echo "== the decode kernel alone" | log
    grep -E "^qwen3-dec" "$LOGS/dec.log" | cut -c1-160 | log
    for r in 1 0; do
        env MOE_RING=$r timeout 240 deploy/gpu-cluster.sh -w 1 -b cuda -- \
            bin/cuda_ipc_check --iters 201 >"$LOGS/ipc_ring$r.log" 2>&1
        echo "== CUDA IPC, MOE_RING=$r (rc $?)" | log
        grep -E "^(PASS|FAIL|qwen3 T=)" "$LOGS/ipc_ring$r.log" | cut -c1-160 | log
    done
fi
if want scaling; then
    mkdir -p "$LOGS/scaling"
    OUT="$LOGS/scaling" timeout 540 bash bench/ep_scaling.sh ${SCALING_WS:-1 2 4} >/dev/null 2>&1
    echo "== scaling (rc $?)" | log
    grep -E "^== |^[0-9] |rc=" "$LOGS/scaling/ep_scaling.log" | cut -c1-200 | tail -n 60 | log
fi
if want kills; then
    NG=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
    KILL_SERIES_SECONDS=${KILL_SECONDS:-330} KILL_SERIES_DIR=/tmp/gpu-next-kills \
        timeout 420 deploy/kill-series.sh 4 --mix --kills 4 --backend cuda \
        >"$LOGS/kills.log" 2>&1
    echo "== kills on $NG GPUs, the dedup on (rc $?)" | log
    grep -E "^[0-9]+\.[0-9]+ +(PASS|FAIL)|first error|ready again|kill series" "$LOGS/kills.log" |
        cut -c1-200 | log
fi
tar czf "$OUT/next.tgz" -C /tmp gpu-next 2>/dev/null
exit 0
