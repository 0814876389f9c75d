#!/usr/bin/env bash
# gpu_branches.sh - one device call on a 2-GPU host (about 8 minutes) that
# decides the merge of branches whose binaries were built on the development
# machine and carried (`carry: ["run/carry", ".deps"]`):
#
#   run/carry/main.tar.xz              main's bin/ and lib/ (the baseline)
#   run/carry/branches/NAME.tar.xz     branch NAME's bin/ and lib/ files
#
#   kcu-ffn          bin/check-gpu; bin/moe_bench against main's in the
#                    same call (no kernel may get slower)
#   qwen2-decode     bin/check-gpu (the qwen2-dec cases: decode path, bit
#                    for bit against the general path)
#   nccl-early-recv  bench/nccl_client_check.sh with that branch's daemons
#                    and service_bench (the NVLink line: call <= compute +
#                    raw transfers)
#   decode-dedup     bin/check-gpu (the decode forwards' shared operands
#                    filled by one helper: host code only)
#   nccl-spin        bench/nccl_client_check.sh with that branch's daemons
#                    (the comm thread awaits y awake; compare the NVLink
#                    line and the worker's "y handed over -> sent" with
#                    main's, run first)
#
# A branch whose archive is missing is skipped. Logs under $OUT (six files:
# a device call returns eight at most), a summary in $OUT/branches.log.
#
#   OUT=$OUT bash bench/gpu_branches.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-run/gpu-branches}
mkdir -p "$OUT"
if ls .deps/*.deb >/dev/null 2>&1; then # the runtime libraries (deploy/gpu-cluster.sh does the same)
    mkdir -p /opt/moe-deps
    for f in .deps/*.deb; do dpkg -x "$f" /opt/moe-deps; done
    L=/opt/moe-deps/usr/lib/x86_64-linux-gnu
    export LD_LIBRARY_PATH="$L:$L/openblas-pthread:${LD_LIBRARY_PATH:-}"
fi
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
if unpack kcu-ffn; then
    step 150 check_ffn /tmp/br/kcu-ffn/bin/check-gpu
    step 120 bench_main env MOE_BENCH_NO_AB=1 bin/moe_bench --only "$CASES"
    step 120 bench_ffn env MOE_BENCH_NO_AB=1 /tmp/br/kcu-ffn/bin/moe_bench --only "$CASES"
fi
if unpack qwen2-decode; then
    step 120 check_q2 /tmp/br/qwen2-decode/bin/check-gpu
    grep -E "^qwen2" "$OUT/check_q2.log" | cut -c1-200 | tail -n 12 | log >/dev/null
fi
if unpack decode-dedup; then
    step 150 check_dd /tmp/br/decode-dedup/bin/check-gpu
fi
if unpack nccl-early-recv; then
    step 170 nccl bash /tmp/br/nccl-early-recv/bench/nccl_client_check.sh
fi
if unpack nccl-spin; then
    step 170 nccl_main bash bench/nccl_client_check.sh
    grep -A3 "where a request" "$OUT/nccl_main.log" | cut -c1-220 | log >/dev/null
    step 170 nccl_spin bash /tmp/br/nccl-spin/bench/nccl_client_check.sh
    grep -A3 "where a request" "$OUT/nccl_spin.log" | cut -c1-220 | log >/dev/null
fi
exit 0
