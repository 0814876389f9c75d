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
#   power     the bytes-bound layers (qwen235, qwen3-mid, mixtral-mid) with
#             cuBLAS's batched GEMMs beside them, clocks and power sampled
#   sol256    ncu's speed of light of moe's and cuBLAS's GEMMs at 256 rows
#             an expert (qwen235 T=4096)
#   rowpair   KCU_V10_ROWPAIR: racecheck and memcheck over check-gpu
#             --swapped, A/B at 256 rows an expert, ncu of its GEMMs
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
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
# sol_moe KERNEL NAME TITLE: ncu's speed-of-light of the first up and down
# of the kernels matching KERNEL in qwen235 T=4096 (past the warm-up calls)
sol_moe() {
    MOE_BENCH_NO_AB=1 MOE_BENCH_CUBLAS=0 timeout 150 "$NCU" --clock-control none --section SpeedOfLight \
        --kernel-name regex:"$1" --launch-skip 4 --launch-count 2 \
        bin/moe_bench --only qwen235:4096 >"$LOGS/sol_$2.log" 2>&1
    echo "== $3 (rc $?)" | log
    grep -E "k_gemm|Duration|Throughput" "$LOGS/sol_$2.log" | cut -c1-120 | log
}
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
if want power; then
    # the bytes-bound layers with the board's clock and power sampled every
    # 100 ms beside them (smi.csv), cuBLAS's batched GEMMs at their shapes
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,noheader -lms 100 >"$OUT/smi.csv" 2>&1 &
    smi=$!
    date +%T.%N | log
    MOE_BENCH_NO_AB=1 timeout 300 bin/moe_bench --only qwen235:,qwen3-mid:,mixtral-mid: \
        >"$LOGS/power.log" 2>&1
    echo "== bytes-bound layers, cuBLAS beside (rc $?)" | log
    date +%T.%N | log
    kill $smi
    grep -E "^device|^(qwen|mixtral)|phases|cuBLAS" "$LOGS/power.log" | cut -c1-240 | log
fi
if want sol256; then
    # ncu's speed-of-light of the GEMMs at 256 rows an expert (qwen235
    # T=4096): moe's v7 up and down, then cuBLAS's batched ones at the same
    # shapes (skipping moe_bench's 8192^3 peak runs: ~2340 launches)
    sol_moe k_gemm_wsc moe "moe's GEMMs, qwen235 T=4096"
    MOE_BENCH_NO_AB=1 timeout 240 "$NCU" --clock-control none --section SpeedOfLight \
        --kernel-name regex:"nvjet|xmma|cutlass|sm90" --launch-skip 2450 --launch-count 3 \
        bin/moe_bench --only qwen235:4096 >"$LOGS/sol_cublas.log" 2>&1
    echo "== cuBLAS's GEMMs after the peak runs (rc $?)" | log
    grep -E "\(|Duration|Throughput" "$LOGS/sol_cublas.log" | grep -v "^==PROF" | cut -c1-160 | log
fi
if want rowpair; then
    # v10's wide items split by rows on 2-CTA clusters (KCU_V10_ROWPAIR, on
    # by default since session 38): compute-sanitizer over v10's forms, two
    # A/B rounds at 256 rows an expert, then ncu's speed-of-light of its
    # up and down at qwen235 T=4096
    CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    for tool in racecheck memcheck; do
        timeout 150 "$CS" --tool $tool bin/check-gpu --swapped >"$LOGS/rowpair_$tool.log" 2>&1
        echo "== $tool bin/check-gpu --swapped (rc $?)" | log
        grep -E "hazard|ERROR SUMMARY|check-gpu" "$LOGS/rowpair_$tool.log" | tail -n 3 | log
    done
    for r in 1 2; do
        for v in 0 1; do
            env KCU_V10_ROWPAIR=$v MOE_BENCH_NO_AB=1 timeout 80 bin/moe_bench \
                --only qwen235:4096,qwen3-mid:4096,mixtral-mid:1024 >"$LOGS/rowpair$v.$r.log" 2>&1
            echo "== KCU_V10_ROWPAIR=$v, round $r (rc $?)" | log
            grep -E "^(qwen|mix)|phases|cuBLAS" "$LOGS/rowpair$v.$r.log" | cut -c1-170 | log
        done
    done
    sol_moe k_gemm_swap rowpair "rows paired up and down, qwen235 T=4096"
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
