#!/usr/bin/env bash
# gpu-kill-test.sh - the "Faults" check: SIGKILL one worker of a running
# cluster in the middle of a stream of requests; check that the coordinator
# stays up, the requests in flight and those sent during the outage get an
# error (`unavailable`) within a bound, cluster.status reports the worker
# down, and that after a restart of the worker (same flags) the cluster
# re-forms (new generation) and requests succeed again; with --train and
# --checkpoint-dir also that no acknowledged optimizer step is lost.
# Prints timestamped events and a PASS/FAIL table; exits 1 on a failed check.
#
#   deploy/gpu-kill-test.sh [--workers N] [--backend auto|cpu|cuda] [--xchg auto|nng|nccl]
#                           [--train] [--checkpoint-dir DIR] [--time-limit S] [OPTIONS]
#
# With GPUs (and a CUDA build in bin/): one worker per GPU (--device i),
# --backend cuda, --xchg nccl. Without: 2 workers, --backend cpu, nng.
# OPTIONS are tests/faults/kill_test.py's (--help lists them: model shape
# --d-model/--d-ff/--experts/--top-k/--layers, --tokens, --clients,
# --victim, --kill-after, --kill-during any|step|ckpt, the bounds,
# --keep-logs). --kill-during ckpt (with --train --checkpoint-dir) kills
# while a step's automatic checkpoint is being written.
#
# Like deploy/gpu-cluster.sh, on a bare host it unpacks the runtime .debs of
# .deps/ into /opt/moe-deps (only when bin/ cannot find its libraries).
# --kills K kills K times in a row in the same cluster (the victims in
# turn, each kill after the re-formation and checks of the one before).
# NCCL_NVLS_ENABLE=0. The whole run is bounded (--time-limit, default 170 s
# and 60 s more for each kill after the first);
# every process it started is stopped on exit, Ctrl-C or timeout.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

ts() { date +%H:%M:%S.%3N; }
say() { echo "$(ts) gpu-kill-test: $*"; }

LIMIT=
KILLS=1
HELP=0
BACKEND=
XCHG=
WORKERS=
CKPT=
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --workers | -w) WORKERS=$2; shift 2 ;;
    --backend | -b) BACKEND=$2; shift 2 ;;
    --xchg | -x) XCHG=$2; shift 2 ;;
    --time-limit) LIMIT=$2; shift 2 ;;
    --kills) KILLS=$2; ARGS+=("$1" "$2"); shift 2 ;;
    --checkpoint-dir) CKPT=$2; shift 2 ;;
    -h | --help) HELP=1; shift ;;
    *) ARGS+=("$1"); shift ;;
    esac
done
case "$KILLS" in '' | *[!0-9]*) say "--kills must be a number, not '$KILLS'"; exit 2 ;; esac
[ -n "$LIMIT" ] || LIMIT=$((170 + 60 * (KILLS > 1 ? KILLS - 1 : 0)))

for b in moe-coordinator moe-worker moectl; do
    [ -x "bin/$b" ] || { say "bin/$b is missing: build with 'make' (or carry bin/ and lib/)"; exit 2; }
done
[ -f lib/libmoe.so ] || { say "lib/libmoe.so is missing: build with 'make'"; exit 2; }

# runtime libraries from .deps/ on a host without them (as deploy/gpu-cluster.sh)
# (the whole ldd output is read: under pipefail, grep -q stopping early would
# kill ldd with SIGPIPE and make the test false)
MISSING=$({ ldd bin/moe-worker; ldd lib/libmoe.so; } 2>/dev/null | grep -c "not found" || true)
. deploy/deps-env.sh
if [ "${MISSING:-0}" -gt 0 ] && deps_env; then
    say "runtime libraries unpacked from .deps/ into $MOE_DEPS_DIR"
fi
export NCCL_NVLS_ENABLE=0
if [ "$HELP" -eq 1 ]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exec python3 tests/faults/kill_test.py --help
fi

python3 -c 'import numpy' 2>/dev/null || { say "python3 with numpy is needed (tests/faults/kill_test.py)"; exit 2; }

# GPUs: one worker per GPU, CUDA backend, NCCL between the workers
NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
# ask the binary what it can do (a stripped binary has no symbol to grep)
if ! VERSION=$(bin/moe-worker --version 2>&1); then
    say "bin/moe-worker does not run here: $VERSION"; exit 2
fi
CUDA_BUILD=0
echo "$VERSION" | grep -q '^backends:.* cuda' && CUDA_BUILD=1
if [ -z "$BACKEND" ]; then
    if [ "$NGPU" -ge 1 ] && [ "$CUDA_BUILD" -eq 1 ]; then BACKEND=cuda; else BACKEND=cpu; fi
    [ "$NGPU" -ge 1 ] && [ "$CUDA_BUILD" -eq 0 ] && say "$NGPU GPU(s) but bin/moe-worker has no CUDA: CPU workers"
fi
GPUS=0
[ "$BACKEND" != cpu ] && GPUS=$NGPU
if [ -z "$WORKERS" ]; then
    if [ "$GPUS" -ge 2 ]; then WORKERS=$GPUS; else WORKERS=2; fi
fi
if [ -z "$XCHG" ]; then
    if [ "$BACKEND" = cuda ]; then XCHG=nccl; else XCHG=auto; fi
fi
if [ "$BACKEND" != cpu ] && [ "$GPUS" -lt 1 ]; then
    say "--backend $BACKEND but no GPU found (nvidia-smi -L)"; exit 2
fi
[ "$GPUS" -ge 1 ] && [ "$WORKERS" -gt "$GPUS" ] && say "warning: $WORKERS workers on $GPUS GPUs: devices are shared"
[ -n "$CKPT" ] && ARGS+=(--checkpoint-dir "$CKPT")

say "$WORKERS workers, backend $BACKEND, xchg $XCHG, GPUs $NGPU, limit ${LIMIT}s, NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"

# the test runs in its own process group (it and every daemon it starts):
# the trap and the time limit stop the whole group
PY=
# shellcheck disable=SC2317 # (called by the trap)
cleanup() {
    local rc=$?
    trap - EXIT INT TERM HUP
    if [ -n "$PY" ] && kill -0 -- "-$PY" 2>/dev/null; then
        say "stopping what is left (process group $PY)"
        kill -TERM -- "-$PY" 2>/dev/null
        for _ in $(seq 100); do kill -0 -- "-$PY" 2>/dev/null || break; sleep 0.1; done
        if kill -0 -- "-$PY" 2>/dev/null; then
            say "SIGKILL to what ignored SIGTERM for 10 s"
            kill -KILL -- "-$PY" 2>/dev/null
        fi
        wait "$PY" 2>/dev/null
        [ "$rc" -eq 0 ] && rc=1
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM HUP

PYLIMIT=$((LIMIT > 40 ? LIMIT - 10 : LIMIT * 3 / 4)) # the test ends itself first, with its table
TEST=(python3 -u tests/faults/kill_test.py --workers "$WORKERS" --backend "$BACKEND" --xchg "$XCHG"
    --gpus "$GPUS" --time-limit "$PYLIMIT" "${ARGS[@]}")
set -m # job control: the background job gets its own process group (pgid = $!)
"${TEST[@]}" &
PY=$!
set +m
rc=
while :; do
    if ! kill -0 "$PY" 2>/dev/null; then
        wait "$PY"
        rc=$?
        break
    fi
    if [ "$SECONDS" -ge "$LIMIT" ]; then
        say "FAIL: time limit of ${LIMIT}s reached"
        rc=124
        break
    fi
    sleep 0.2
done
# nothing of the group may outlive the test
if [ "$rc" -ne 124 ] && kill -0 -- "-$PY" 2>/dev/null; then
    say "FAIL: processes left behind: $(pgrep -g "$PY" -d ' ' 2>/dev/null)"
    rc=1
fi
if [ "$rc" -eq 0 ]; then say "PASS"; else say "FAIL (exit $rc)"; fi
exit "$rc"
