#!/usr/bin/env bash
# nccl_client_check.sh - the NCCL data path (docs/PROTOCOL.md, "Data plane",
# "9. NCCL") on a host with 2 GPUs: a coordinator and one CUDA worker on
# GPU 1, service_bench as the client on GPU 0.
#
#   bench/nccl_client_check.sh            (after: make bin/moe-coordinator
#                                          bin/moe-worker bin/moectl bin/service_bench)
#
# Steps, each under `timeout`, about 190 s at most in all:
#   1. NVLink/P2P (NCCL's default transports): service_bench, paths socket
#      and nccl, T = 64 and 256 (checked against the CPU reference; the
#      nccl path's y must equal the first call's, byte for byte), then
#      T = 32768 (64 MiB each way in bf16 at d_model 1024; timing only, y
#      compared with the socket path's), in the default pieces (2 from
#      16 MiB: x and y travel in 2 transfers of rows each, overlapped with
#      the forward; docs/PROTOCOL.md "Pieces"), then again on the nccl path
#      with MOE_NCCL_PIECES=1 (one transfer each way: the path before
#      pieces), both lines printed for comparison.
#   2. a client killed mid-transfer (kill -9 during a run of nccl forwards):
#      the worker aborts that communicator ("NCCL communicator ... closes" in
#      its log) and keeps serving (a socket-path run right after passes).
#   3. NCCL's socket transport, as between two hosts (NCCL_P2P_DISABLE=1
#      NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo, for the
#      worker and the client alike): the same runs.
# PASS lines:
#   - every service_bench run ends "1 passed, 0 failed" (correct rows, the
#     same bytes on both paths);
#   - socket transport, T=32768: the nccl path's "floor/path" >= 80% (the
#     rows move at >= 80% of raw ncclSend/ncclRecv of the same bytes between
#     the same two processes, measured in the same run: moe_nccl_floor);
#   - NVLink, T=32768, default pieces: the call <= compute + floor (floor:
#     x out and y back, raw, i.e. 2 NVLink transfers of 64 MiB); the
#     MOE_NCCL_PIECES=1 line is shown beside it, not judged.
# The last line says PASS or FAIL; the exit status is 0 only on PASS.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0
# NCCL's own warnings (the reason behind an "invalid argument" or "remote
# process exited") go to the worker's log and the client's stderr, which
# land in this script's output when a step fails
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
for b in bin/moe-coordinator bin/moe-worker bin/moectl bin/service_bench; do
    [ -x "$b" ] || { echo "nccl_client_check: $b missing (build it first)"; exit 2; }
done
NG=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
[ "$NG" -ge 2 ] || { echo "nccl_client_check: needs 2 GPUs, found $NG"; exit 2; }
OUT=$(mktemp -d /tmp/nccl-check.XXXXXX)
FAIL=0
say() { echo "== $*"; }
verdict() { # verdict NAME OK DETAIL
    if [ "$2" = 1 ]; then echo "PASS  $1  $3"; else echo "FAIL  $1  $3"; FAIL=1; fi
}
# errlines FILE N: the last N lines of FILE that tell of trouble (only the
# end of this script's output comes back from a GPU machine: kept short)
errlines() {
    [ -f "$1" ] || { echo "   ($1 missing)"; return; }
    grep -aiE ' [WE] |error|fail|warn|invalid|abort|closes|refus|timed? ?out|kcu:|segfault|core' "$1" |
        grep -avE '^ +(socket|shm|bulk)[a-z0-9-]* +fwd ' | tail -n "$2" | cut -c1-400 | sed 's/^/   | /'
}
# why TAG: the worker's log (errors, last 30) and the cluster's output
why() {
    local d="$OUT/$1"
    for l in "$d"/worker*.log; do
        echo "   -- $(basename "$l") (error lines, last 30; then its last 5 lines):"
        errlines "$l" 30
        tail -n 5 "$l" 2>/dev/null | cut -c1-400 | sed 's/^/   . /'
    done
    echo "   -- $1.cluster (error lines, last 10):"
    errlines "$OUT/$1.cluster" 10
}
export MOE_NCCL_TRACE=1 # the client's phase medians (stderr, when a link closes)
SB="bin/service_bench --d-model 1024 --d-ff 2048 --experts 8 --top-k 2 --dtype bf16 --client-device 0"

# the client's part, run inside a cluster (its url in $MOE_URL); $1: tag
client_runs() {
    local tag=$1
    # (T=1024 was dropped: its naive CPU reference, forward and backward,
    # about 80 GFLOP, ran past the 25 s bound on the GPU hosts)
    timeout 25 $SB --url "$MOE_URL" --tokens 64,256 --iters 3 --paths socket,nccl \
        >"$OUT/$tag.small" 2>&1
    echo "rc=$?" >>"$OUT/$tag.small"
    timeout 35 $SB --url "$MOE_URL" --tokens 32768 --iters 10 --no-ref --paths socket,nccl \
        >"$OUT/$tag.big" 2>&1
    echo "rc=$?" >>"$OUT/$tag.big"
    [ "$tag" = nvlink ] || return 0
    # the same rows in one piece each way (the path before pieces)
    MOE_NCCL_PIECES=1 timeout 25 $SB --url "$MOE_URL" --tokens 32768 --iters 10 --no-ref \
        --paths nccl >"$OUT/$tag.big1" 2>&1
    echo "rc=$?" >>"$OUT/$tag.big1"
}
export -f client_runs
export OUT SB

# nccl_line FILE: "call_ms compute_ms floor_ms floor_pct" of the nccl path's line
nccl_line() {
    grep -E '^ +nccl ' "$1" | head -1 | sed -E \
        's/.*fwd ([0-9.]+) ms.*compute ([0-9.]+) ms.*nccl floor ([0-9.]+) ms +floor\/path ([0-9]+)%.*/\1 \2 \3 \4/'
}

say "1+2. NVLink / P2P: worker on GPU 1, client on GPU 0 (logs in $OUT/nvlink)"
MOE_RUN_DIR="$OUT/nvlink" timeout 115 deploy/gpu-cluster.sh -w 1 -d 1 -b cuda -- bash -c '
    client_runs nvlink
    # 2. a client killed mid-transfer: once its communicator is up (the
    # worker says so; the first one, of client_runs, closed with its client)
    n0=$(grep -c "NCCL communicator .* is up" "$MOE_RUN_DIR"/worker0.log)
    timeout 20 $SB --url "$MOE_URL" --tokens 32768 --iters 50 --no-ref --paths nccl \
        >"$OUT/kill.run" 2>&1 &
    p=$!
    for i in $(seq 150); do
        [ "$(grep -c "NCCL communicator .* is up" "$MOE_RUN_DIR"/worker0.log)" -gt "$n0" ] && break
        sleep 0.1
    done
    sleep 0.5
    kill -9 $p 2>/dev/null
    wait $p 2>/dev/null
    sleep 2
    timeout 15 $SB --url "$MOE_URL" --tokens 64 --iters 3 --paths socket,nccl >"$OUT/kill.after" 2>&1
    echo "rc=$?" >>"$OUT/kill.after"
' >"$OUT/nvlink.cluster" 2>&1
say "3. socket transport over loopback (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)"
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
    MOE_RUN_DIR="$OUT/socket" timeout 60 deploy/gpu-cluster.sh -w 1 -d 1 -b cuda -- \
    bash -c 'client_runs socket' >"$OUT/socket.cluster" 2>&1

SHOWN=""
for tag in nvlink socket; do
    bad=0
    files="$OUT/$tag.small $OUT/$tag.big"
    [ "$tag" = nvlink ] && files="$files $OUT/$tag.big1"
    for f in $files; do
        echo "---- $f"
        if [ -f "$f" ]; then # the result lines (NCCL's own warnings below, on failure)
            grep -avE 'NCCL (WARN|INFO)' "$f" | tail -n 30 | cut -c1-400
        else
            echo "(missing: see $OUT/$tag.cluster)"
        fi
        grep -q '^1 passed, 0 failed' "$f" 2>/dev/null && ok=1 || ok=0
        verdict "$tag $(basename "$f"): service_bench checks" $ok ""
        if [ $ok = 0 ]; then
            bad=1
            echo "   -- client stderr (error lines, last 15):"
            errlines "$f" 15
        fi
    done
    if [ $bad = 1 ]; then # the worker's side, once per step
        why "$tag"
        SHOWN="$SHOWN $tag"
    fi
done
read -r call cmp fl pct <<<"$(nccl_line "$OUT/socket.big" 2>/dev/null)"
if [[ "${pct:-}" =~ ^[0-9]+$ ]]; then
    verdict "socket transport, 64 MiB: rows at >= 80% of raw ncclSend/ncclRecv" \
        "$([ "$pct" -ge 80 ] && echo 1 || echo 0)" "floor/path ${pct}% (call ${call} ms, compute ${cmp} ms, floor ${fl} ms)"
else
    verdict "socket transport, 64 MiB: rows at >= 80% of raw ncclSend/ncclRecv" 0 "no nccl line"
fi
read -r call1 cmp1 fl1 pct1 <<<"$(nccl_line "$OUT/nvlink.big1" 2>/dev/null)"
if [[ "${pct1:-}" =~ ^[0-9]+$ ]]; then
    echo "NVLink, 64 MiB each way, MOE_NCCL_PIECES=1 (one piece): call ${call1} ms, compute" \
        "${cmp1} ms, floor (x out + y back) ${fl1} ms, over the floor" \
        "$(awk -v a="$call1" -v c="$cmp1" -v f="$fl1" 'BEGIN { printf "%.3f", a - c - f }') ms"
else
    echo "NVLink, 64 MiB each way, MOE_NCCL_PIECES=1 (one piece): no nccl line"
fi
read -r call cmp fl pct <<<"$(nccl_line "$OUT/nvlink.big" 2>/dev/null)"
if [[ "${pct:-}" =~ ^[0-9]+$ ]]; then
    ok=$(awk -v a="$call" -v c="$cmp" -v f="$fl" 'BEGIN { print (a <= c + f) ? 1 : 0 }')
    verdict "NVLink, 64 MiB each way (default pieces): call <= kernel + 2 transfers" "$ok" \
        "call ${call} ms, compute ${cmp} ms, floor (x out + y back) ${fl} ms, over the floor $(awk -v a="$call" -v c="$cmp" -v f="$fl" 'BEGIN { printf "%.3f", a - c - f }') ms"
else
    verdict "NVLink, 64 MiB each way (default pieces): call <= kernel + 2 transfers" 0 "no nccl line"
fi
echo "---- where a request's time went on the worker (each communicator: a client run)"
for tag in nvlink socket; do
    grep -ah "requests, mean us\|median us of" "$OUT/$tag"/worker*.log 2>/dev/null | tail -n 8 |
        cut -c1-300 | sed "s/^/   $tag: /"
done
echo "---- where a call's time went on the client (MOE_NCCL_TRACE=1; medians per link)"
for tag in nvlink socket; do
    grep -ah "moe nccl trace" "$OUT/$tag.small" "$OUT/$tag.big" "$OUT/$tag.big1" 2>/dev/null |
        cut -c1-300 |
        sed "s/^/   $tag: /"
done
echo "---- kill test"
grep -avE 'NCCL (WARN|INFO)' "$OUT/kill.after" 2>/dev/null | tail -n 15 | cut -c1-400
grep -q '^1 passed, 0 failed' "$OUT/kill.after" 2>/dev/null && ok=1 || ok=0
verdict "client killed mid-transfer: the worker serves on (socket and nccl)" $ok ""
if [ $ok = 0 ]; then
    echo "   -- the killed client (error lines, last 8):"
    errlines "$OUT/kill.run" 8
    echo "   -- the run after it (error lines, last 15):"
    errlines "$OUT/kill.after" 15
    [[ " $SHOWN " == *" nvlink "* ]] || why nvlink
fi
grep -h "NCCL communicator" "$OUT"/nvlink/worker*.log 2>/dev/null | tail -4
grep -q "NCCL communicator .* closes" "$OUT"/nvlink/worker*.log 2>/dev/null && ok=1 || ok=0
verdict "client killed mid-transfer: its communicator aborted on the worker" $ok ""
echo "(all output in $OUT)"
if [ $FAIL = 0 ]; then echo "nccl_client_check: PASS"; else echo "nccl_client_check: FAIL"; fi
exit $FAIL
