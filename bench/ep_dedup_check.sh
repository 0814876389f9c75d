#!/usr/bin/env bash
# ep_dedup_check.sh - the deduplicated dispatch (kcu_ep.h, on by default for
# inference forwards) against the one-GPU layer on the GPUs of this host:
# bin/ep_bench --check-infer (y bit-identical to kcu_layer's inference
# forward of all W*T tokens, at chunks 1, 4 and auto) for the shapes and
# routings a user runs (Qwen3 random and skewed, Qwen3 on 3 GPUs where 128
# experts do not divide, Mixtral, DeepSeek-V3 with its routing family and
# shared expert, Qwen2-MoE's gated shared expert), then training with the
# dedup in training forwards too (--dedup-train --check: y, dx and every
# gradient against the one-GPU layer). Then the service: python/parity.py
# through GPU workers on every GPU count (their layers dedup by default).
# About 3 minutes on 4 GPUs. Logs and a summary under ${OUT:-.}.
#
#   OUT=$OUT bash bench/ep_dedup_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-.}
NG=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
B=./bin/ep_bench
FAIL=0
log() { tee -a "$OUT/ep_dedup_check.log"; }
# check NAME TIMEOUT ep_bench-args...: its check lines; a line without
# "pass" (or no line at all) fails
check() {
    local name=$1 t=$2
    shift 2
    timeout "$t" $B "$@" >"$OUT/dd_$name.log" 2>&1
    local rc=$? lines
    lines=$(grep -E "^check" "$OUT/dd_$name.log")
    if [ $rc -ne 0 ] || [ -z "$lines" ] || grep -E "^check" "$OUT/dd_$name.log" | grep -qv "pass"; then
        echo "FAIL  $name (rc $rc): $*" | log
        FAIL=1
    else
        echo "PASS  $name: $(echo "$lines" | wc -l) checks" | log
    fi
    echo "$lines" | cut -c1-200 | sed 's/^/      /' | log >/dev/null
}
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | head -1 | log
[ "$NG" -ge 2 ] || { echo "ep_dedup_check: needs 2 GPUs ($NG here)" | log; exit 2; }
CI="--infer --check-infer --chunks 1,4,0 --iters 2"
check "qwen3_w$NG" 120 --gpus "$NG" --shape qwen3 --tokens 16384 $CI
check "qwen3_w${NG}_skew" 120 --gpus "$NG" --shape qwen3 --tokens 16384 --skew $CI
[ "$NG" -ge 3 ] && check qwen3_w3 120 --gpus 3 --shape qwen3 --tokens 8192 $CI
check qwen3_w2 120 --gpus 2 --shape qwen3 --tokens 8192 $CI
check "mixtral_w$NG" 120 --gpus "$NG" --shape mixtral --tokens 4096 $CI
check "dsv3_w$NG" 180 --gpus "$NG" --shape deepseek --tokens 2048 --family dsv3 $CI
check "qwen2_w$NG" 120 --gpus "$NG" --shape qwen3 --tokens 8192 --family qwen2 $CI
check "train_w$NG" 150 --gpus "$NG" --shape qwen3 --tokens 8192 --chunks 1 --check \
    --check-chunks 4 --dedup-train --iters 2
for W in $NG 2; do
    name="parity_w$W"
    timeout 120 deploy/gpu-cluster.sh -w "$W" -b cuda -- \
        python3 python/parity.py --dtype bf16 --d-model 128 --d-ff 256 >"$OUT/dd_$name.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] && echo "PASS  $name" | log || { echo "FAIL  $name (rc $rc)" | log; FAIL=1; }
    tail -n 3 "$OUT/dd_$name.log" | cut -c1-200 | sed 's/^/      /' | log >/dev/null
    [ "$NG" -eq 2 ] && break
done
[ $FAIL -eq 0 ] && echo "ep_dedup_check: PASS" | log || echo "ep_dedup_check: FAIL" | log
exit $FAIL
