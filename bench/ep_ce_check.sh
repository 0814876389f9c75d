#!/usr/bin/env bash
# ep_ce_check.sh - issue 24: does NCCL's copy-engine (CE) all-to-all leave the
# expert GEMMs their SMs? On every GPU of this host, Qwen3's shape, 16384
# tokens a GPU, inference:
#   1. bin/ep_bench --ce: ncclAlltoAll round trips on a CTAPolicy-ZERO
#      communicator over symmetric windows against the default (kernel) one,
#      alone and under the local expert GEMMs, the GEMMs' slowdown under each,
#      and which path NCCL took (a captured CE all-to-all must have no kernel
#      node). The "ce:" lines and the table.
#   2. where the transport exists (KCU_EP_CE in bin/ep_bench; built on
#      branch ep-ce, see bench/NOTES.md "Copy-engine exchange"): KCU_EP_CE=1
#      with --check-infer --layers 3 (y bit-identical to the one-GPU layer at chunks 1,
#      4 and auto; each check line names the exchange it took), skewed
#      routing (falls back to send/recv), 2 GPUs, then the forward's time
#      with and without it (the table's "ce" column: forwards on the CE
#      path / timed).
# About 4 minutes on 4 GPUs (most of it input generation and setup); every
# run bounded by timeout. Logs under ${OUT:-.}.
#
#   OUT=$OUT bash bench/ep_ce_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-.}
NG=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
B=./bin/ep_bench
A="--gpus $NG --shape qwen3 --tokens 16384 --infer"
log() { tee -a "$OUT/ep_ce_check.log"; }
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | head -1 | log
ncclv=$(ldconfig -p 2>/dev/null | grep -o 'libnccl.so[^ ]*' | head -1)
echo "NCCL library: ${ncclv:-not in ldconfig}" | log
[ "$NG" -ge 2 ] || { echo "ep_ce_check: needs 2 GPUs ($NG here)" | log; exit 2; }

echo "== 1. --ce on $NG GPUs" | log
timeout 300 $B $A --chunks 1,4 --iters 10 --ce >"$OUT/ce_measure.log" 2>&1
echo "rc $?" | log
grep -E "^(ce:|chunks|[0-9]|rows received|ep_bench:)" "$OUT/ce_measure.log" | log
grep -E "NCCL (WARN|INFO).*(CE|[Ss]ymmetric|[Ww]indow)" "$OUT/ce_measure.log" | head -5 | log

if grep -q KCU_EP_CE "$B"; then
    echo "== 2. KCU_EP_CE=1: check-infer on $NG GPUs" | log
    KCU_EP_CE=1 timeout 240 $B $A --chunks 1,4,0 --check-infer --layers 3 --iters 2 >"$OUT/ce_check.log" 2>&1
    echo "rc $?" | log
    grep -E "^(check|kcu_ep)|CE" "$OUT/ce_check.log" | cut -c1-220 | log
    # skewed routing: padding past 1.25x must fall back to send/recv (the
    # check names each forward's exchange), y still bit-identical
    echo "== 2. KCU_EP_CE=1: check-infer, skewed routing (expect send/recv)" | log
    KCU_EP_CE=1 timeout 240 $B $A --chunks 1,4 --skew --check-infer --iters 2 \
        >"$OUT/ce_check_skew.log" 2>&1
    echo "rc $?" | log
    grep -E "^(check|kcu_ep)|CE" "$OUT/ce_check_skew.log" | cut -c1-220 | log
    if [ "$NG" -ge 3 ]; then
        echo "== 2. KCU_EP_CE=1: check-infer on 2 GPUs" | log
        KCU_EP_CE=1 timeout 240 $B --gpus 2 --shape qwen3 --tokens 16384 --infer --chunks 1,4 \
            --check-infer --iters 2 >"$OUT/ce_check_2.log" 2>&1
        echo "rc $?" | log
        grep -E "^(check|kcu_ep)|CE" "$OUT/ce_check_2.log" | cut -c1-220 | log
    fi
    for v in 0 1; do
        echo "== 2. timing, KCU_EP_CE=$v" | log
        KCU_EP_CE=$v timeout 240 $B $A --chunks 1,2,4 --iters 10 >"$OUT/ce_time_$v.log" 2>&1
        echo "rc $?" | log
        grep -E "^(chunks|[0-9]|rows received)|CE" "$OUT/ce_time_$v.log" | log
    done
else
    echo "== 2. skipped: bin/ep_bench has no KCU_EP_CE (the transport is not built)" | log
fi
