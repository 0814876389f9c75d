#!/bin/bash
# bench/run_ep.sh - the expert-parallel checks and scaling runs on a GPU
# machine (bin/ep_bench built and carried). Writes logs to ${OUT:-.}.
#   bash bench/run_ep.sh [quick]
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-.}
NG=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
run() { # name, args...
    local name=$1; shift
    echo "== ep_bench $*" | tee -a "$OUT/ep.log"
    timeout ${EP_TIMEOUT:-150} ./bin/ep_bench "$@" 2>&1 | tee "$OUT/$name.log" | tee -a "$OUT/ep.log" | tail -n 12
    echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/ep.log"
}
run small2 --gpus 2 --shape small --tokens 1024 --check --chunks 1,2 --iters 3
[ "${1:-}" = quick ] && exit 0
for W in 4 2 1; do
    [ "$W" -gt "$NG" ] && continue
    ck=""; [ "$W" -gt 1 ] && ck=--check
    run "qwen3_w$W" --gpus $W --shape qwen3 --tokens 16384 $ck --chunks 1,2,4
    run "mixtral_w$W" --gpus $W --shape mixtral --tokens 16384 $ck --chunks 1,2,4
done
[ "$NG" -ge 4 ] && run qwen3_w4_skew --gpus 4 --shape qwen3 --tokens 16384 --check --skew --chunks 1,2,4
[ "$NG" -ge 4 ] && run mixtral_w4_skew --gpus 4 --shape mixtral --tokens 16384 --check --skew --chunks 1,2
exit 0
