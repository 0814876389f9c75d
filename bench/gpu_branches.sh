#!/usr/bin/env bash
# gpu_branches.sh - device calls on a 2-GPU host (about 6 minutes a branch;
# ONLY="NAME ..." runs those alone) that decide the merge of branches whose
# binaries were built on the development machine and carried (`carry:
# ["run/carry", ".deps"]`):
#
#   run/carry/main.tar.xz              main's bin/ and lib/ (the baseline)
#   run/carry/branches/NAME.tar.xz     branch NAME's bin/ and lib/ files
#
#   nccl-phases      bench/nccl_client_check.sh with main's binaries,
#                    then with the branch's (its own copy of the script:
#                    MOE_NCCL_TRACE=1): the client's and the worker's phase
#                    medians say where the NVLink line's time above compute
#                    + transfers goes; the branch's comm thread also waits
#                    awake for the next x after a y (compare the NVLink
#                    line with main's)
#   ep-dedup         bin/ep_bench on all GPUs (about 9 minutes): the
#                    deduplicated dispatch's inference forward against the
#                    single-GPU layer with and without --dedup
#                    (EP_DEDUP_CHECK), training with --dedup-train against
#                    it, then Qwen3 16384 tokens a GPU with main's ep_bench
#                    and the branch's --dedup (EP_DEDUP_BENCH)
#   topk-dedup       bin/check-gpu (the router's arg-max pick is one helper
#                    shared by the plain and the family router: the SASS of
#                    the router kernels and of the decode kernels, which
#                    inline it, changed), then bin/moe_bench's decode cases
#                    with main's binary and the branch's (about 5 minutes)
#
# (Earlier branches and their outcomes: bench/history/service.md.)
# A branch whose archive is missing is skipped. Logs under $OUT (six files:
# a device call returns eight at most), a summary in $OUT/branches.log.
#
#   OUT=$OUT ONLY=nccl-phases bash bench/gpu_branches.sh
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
NG=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
if want nccl-phases && unpack nccl-phases; then
    step 170 nccl_main bash bench/nccl_client_check.sh
    grep -A3 "where a request" "$OUT/nccl_main.log" | cut -c1-220 | log >/dev/null
    step 200 nccl_phases bash /tmp/br/nccl-phases/bench/nccl_client_check.sh
    grep -A14 "where a request" "$OUT/nccl_phases.log" | cut -c1-300 | log >/dev/null
fi
if want ep-dedup && [ "$NG" -ge 2 ] && unpack ep-dedup; then
    # correctness: the inference forward against kcu_layer on all tokens,
    # with and without --dedup (tiny batches may differ on main too: a
    # different GEMM kernel for few rows); then training (dedup 2)
    D=/tmp/br/ep-dedup/bin/ep_bench
    CHK="--gpus $NG --shape qwen3 --tokens 16384 --infer --chunks 1,4,0 --check-infer --iters 3"
    step 200 dedup_check ${EP_DEDUP_CHECK:-$D $CHK --dedup}
    step 150 dedup_base $D $CHK
    step 200 dedup_train $D --gpus "$NG" --shape qwen3 --tokens 16384 --chunks 1 --check \
        --check-chunks 4 --dedup-train
    for f in dedup_check dedup_base dedup_train; do
        grep -E "check|bit-identical|differs|FAIL" "$OUT/$f.log" | tail -n 6 | cut -c1-220 |
            sed "s/^/$f: /" | log >/dev/null
    done
    # the time: main's ep_bench, then the branch's with --dedup
    EPB="--gpus $NG --shape qwen3 --tokens 16384 --infer --chunks 1,4 --iters 5"
    step 150 ep_main bin/ep_bench $EPB
    step 150 ep_dedup ${EP_DEDUP_BENCH:-$D $EPB --dedup}
    for f in ep_main ep_dedup; do
        grep -E "^(1|4) +[0-9]|MB" "$OUT/$f.log" | cut -c1-220 | sed "s/^/$f: /" | log >/dev/null
    done
fi
if want topk-dedup && unpack topk-dedup; then
    step 150 check_topk /tmp/br/topk-dedup/bin/check-gpu
    DEC=${DEC_CASES:-qwen3-dec:1,qwen3-dec:64,mixtral-dec:1}
    step 90 dec_main env MOE_BENCH_NO_AB=1 bin/moe_bench --only "$DEC"
    step 90 dec_topk env MOE_BENCH_NO_AB=1 /tmp/br/topk-dedup/bin/moe_bench --only "$DEC"
    for f in dec_main dec_topk; do
        grep -E "^[a-z0-9]+-dec " "$OUT/$f.log" | cut -c1-200 | sed "s/^/$f: /" | log >/dev/null
    done
fi
exit 0
