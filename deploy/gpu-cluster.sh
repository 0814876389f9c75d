#!/usr/bin/env bash
# gpu-cluster.sh - start a coordinator and one worker per GPU on this host,
# run a command against it (its URL in $MOE_URL), stop everything.
#
#   deploy/gpu-cluster.sh [-w WORKERS] [-d FIRST_GPU] [-x auto|nng|nccl] [-b auto|cpu|cuda] -- COMMAND...
#
# Worker i runs on GPU FIRST_GPU + i (default 0): -w 1 -d 1 puts the one
# worker on GPU 1 and leaves GPU 0 to a client (bench/nccl_client_check.sh).
# MOE_WORKER_PREFIX: words put before each worker's command line (a
# profiler: MOE_WORKER_PREFIX="nsys profile -o /tmp/w --force-overwrite true").
#
# For air-gapped GPU hosts: if .deps/*.deb exists (see docs/OPERATIONS.md),
# the runtime libraries are unpacked into /opt/moe-deps first.
set -euo pipefail
cd "$(dirname "$0")/.."
W=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
[ "$W" -ge 1 ] || W=1
XCHG=auto
BACKEND=auto
FIRST=0
while [ $# -gt 0 ]; do
    case "$1" in
    -w) W=$2; shift 2 ;;
    -x) XCHG=$2; shift 2 ;;
    -b) BACKEND=$2; shift 2 ;;
    -d) FIRST=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-w N] [-d FIRST_GPU] [-x auto|nng|nccl] [-b auto|cpu|cuda] -- COMMAND" >&2; exit 2 ;;
    esac
done
. deploy/deps-env.sh && { deps_env || true; } # the runtime libraries from .deps/, where carried
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
RUN=${MOE_RUN_DIR:-$(mktemp -d /tmp/moe-gpu.XXXXXX)}
mkdir -p "$RUN"
# a run directory used before: its address would name a coordinator gone
rm -f "$RUN/addr" "$RUN/secret"
pids=()
# stop: SIGTERM, then SIGKILL for what still runs after 1 s (60 s with a
# MOE_WORKER_PREFIX: a profiler writes its report after its program exits)
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    local t
    for t in $(seq $([ -n "${MOE_WORKER_PREFIX:-}" ] && echo 600 || echo 10)); do
        local alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.1
    done
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
# the coordinator writes the cluster secret to $RUN/secret (mode 0600) before
# its address; the workers read it from there. Checkpoints may go under
# MOE_CHECKPOINT_ROOT (default the temporary directory, where python/parity.py
# and the benchmarks write theirs)
./bin/moe-coordinator --listen tcp://127.0.0.1:0 --addr-file "$RUN/addr" --workers "$W" \
    --cluster-secret-file "$RUN/secret" --xchg "$XCHG" --worker-timeout-ms 120000 \
    --checkpoint-root "${MOE_CHECKPOINT_ROOT:-${TMPDIR:-/tmp}}" \
    >"$RUN/coord.log" 2>&1 &
pids+=($!)
for i in $(seq 50); do [ -s "$RUN/addr" ] && break; sleep 0.1; done
export MOE_URL=$(cat "$RUN/addr")
for i in $(seq 0 $((W - 1))); do
    # shellcheck disable=SC2086 # the prefix's words, split on purpose
    ${MOE_WORKER_PREFIX:-} ./bin/moe-worker --coordinator "$MOE_URL" --cluster-secret-file "$RUN/secret" --device "$((FIRST + i))" \
        --backend "$BACKEND" --xchg-timeout-ms 120000 >"$RUN/worker$i.log" 2>&1 &
    pids+=($!)
done
for i in $(seq 300); do
    ./bin/moectl --url "$MOE_URL" status 2>/dev/null | grep -q '"ready": true' && break
    sleep 0.2
done
echo "cluster of $W workers ready at $MOE_URL (logs in $RUN)"
set +e
"$@"
rc=$?
set -e
for f in "$RUN"/*.log; do echo "== $f"; tail -5 "$f"; done
exit $rc
