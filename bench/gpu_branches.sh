#!/usr/bin/env bash
# gpu_branches.sh - device calls on a 2-GPU host (about 6 minutes a branch;
# ONLY="NAME ..." runs those alone) that decide the merge of branches whose
# binaries were built on the development machine and carried (`carry:
# ["run/carry", ".deps"]`):
#
#   run/carry/main.tar.xz              main's bin/ and lib/ (the baseline)
#   run/carry/branches/NAME.tar.xz     branch NAME's bin/ and lib/ files
#
#   ep-ce            the branch's copy-engine all-to-all measurement
#                    (bin/ep_bench --ce: the GEMMs' slowdown under a CE
#                    ncclAlltoAll against under NCCL's kernels) and, where
#                    built, KCU_EP_CE=1 checked and timed (bench/ep_ce_check.sh
#                    of the branch)
#
# (Earlier branches and their outcomes: bench/history/service.md.)
# A branch whose archive is missing is skipped. Logs under $OUT (six files:
# a device call returns eight at most), a summary in $OUT/branches.log.
#
#   OUT=$OUT ONLY=ep-ce bash bench/gpu_branches.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-run/gpu-branches}
mkdir -p "$OUT"
. deploy/deps-env.sh && { deps_env || true; } # the runtime libraries
log() { tee -a "$OUT/branches.log"; }
step() { # timeout name command...: its summary lines, then rc
    local t=$1 name=$2
    shift 2
    echo "== $name: $*" | log
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep -E "check-gpu:|FAIL|^(mixtral|qwen3) |dsv3-route T|^PASS|nccl_client_check:" \
        "$OUT/$name.log" | cut -c1-220 | tail -n 14 | log
    echo "rc=$rc" | log
}
# unpack NAME: branch NAME's files into /tmp/br/NAME beside a copy of this
# tree's scripts (the checks run from there); 1 when its archive is missing
unpack() {
    local a=run/carry/branches/$1.tar.xz d=/tmp/br/$1
    [ -f "$a" ] || { echo "== $1: no $a, skipped" | log; return 1; }
    rm -rf "$d" && mkdir -p "$d" && cp -r bench deploy python "$d/" && tar xJf "$a" -C "$d"
}
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | head -1 | log
[ -f run/carry/main.tar.xz ] && tar xJf run/carry/main.tar.xz
CASES=${CASES:-mixtral:8192,qwen3:16384,qwen3-dec:1,mixtral-dec:1}
NG=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
if want ep-ce && [ "$NG" -ge 2 ] && unpack ep-ce; then
    if [ -f /tmp/br/ep-ce/bench/ep_ce_check.sh ]; then
        # its seven logs packed in one file (a device call returns eight)
        mkdir -p /tmp/ep-ce-out
        (cd /tmp/br/ep-ce && OUT=/tmp/ep-ce-out timeout 420 bash bench/ep_ce_check.sh) \
            >"$OUT/ep_ce.log" 2>&1
        tar czf "$OUT/ep_ce_logs.tgz" -C /tmp ep-ce-out
        tail -n 40 "$OUT/ep_ce.log" | cut -c1-220 | log >/dev/null
    else
        step 200 ep_ce /tmp/br/ep-ce/bin/ep_bench --gpus "$NG" --shape qwen3 --tokens 16384 \
            --infer --chunks 1,4 --iters 5 --ce
    fi
fi
exit 0
