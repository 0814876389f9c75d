#!/usr/bin/env bash
# The Slurm deploy: deploy/slurm/moe.sbatch run here as a batch script, with
# stub srun / scontrol / hostname first in PATH (srun runs a step's tasks as
# local processes and forwards SIGTERM to them; scontrol lists the node
# localhost; hostname fails: the script must not take its address from it).
# Checks: the cluster forms (coordinator + 2 workers) on the address that
# `ip route get <coordinator>` gives, a forward through moectl; a worker
# SIGKILLed is restarted by its task and the cluster re-forms (a new
# generation); SIGTERM to the batch script (--signal=B:TERM@120) drains the
# coordinator, then stops the workers, and the job exits 0 with nothing
# left running. Exit 0 pass, 1 fail.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
T=$(mktemp -d /tmp/moe-slurm-XXXXXX)
JOB=0
fail() {
    echo "slurm.sh: FAIL: $*" >&2
    echo "--- job output ---" >&2
    tail -n 60 "$T/job.log" >&2 || true
    exit 1
}
cleanup() {
    if [ "$JOB" -gt 0 ] && kill -0 "$JOB" 2>/dev/null; then
        kill -KILL -- "-$JOB" 2>/dev/null || true # the job's own process group
    fi
    if [ -n "${MOE_TEST_KEEP_LOG:-}" ]; then # for a look at a passing run
        cp "$T/job.log" "$MOE_TEST_KEEP_LOG" 2>/dev/null || true
    fi
    rm -rf "$T"
}
trap cleanup EXIT

mkdir -p "$T/stub" "$T/home"
cat >"$T/stub/srun" <<'EOF'
#!/usr/bin/env bash
# stub srun: the step's tasks (--ntasks, else SLURM_NTASKS) as local processes
set -uo pipefail
ntasks=""
while [ $# -gt 0 ]; do
    case "$1" in
    --ntasks=*) ntasks=${1#*=}; shift ;;
    -n | --ntasks) ntasks=$2; shift 2 ;;
    --*) shift ;;
    *) break ;;
    esac
done
ntasks=${ntasks:-$SLURM_NTASKS}
pids=()
for ((i = 0; i < ntasks; i++)); do
    SLURM_PROCID=$i "$@" &
    pids+=($!)
    echo "$(basename "$1") $i $!" >>"$STUB_DIR/tasks" # program, task, pid
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
rc=0
for p in "${pids[@]}"; do
    while :; do
        wait "$p" && r=0 || r=$?
        kill -0 "$p" 2>/dev/null || break
    done
    [ "$r" = 0 ] || rc=$r
done
exit "$rc"
EOF
cat >"$T/stub/scontrol" <<'EOF'
#!/usr/bin/env bash
# stub scontrol: show hostnames LIST -> one name a line
[ "$1 $2" = "show hostnames" ] || { echo "stub scontrol: $*: not stubbed" >&2; exit 1; }
tr ',' '\n' <<<"$3"
EOF
cat >"$T/stub/hostname" <<'EOF'
#!/usr/bin/env bash
echo "stub hostname: the batch script must not take its address from hostname" >&2
exit 1
EOF
chmod +x "$T/stub/"*

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
MPORT=$(free_port)
export PATH="$T/stub:$PATH" HOME="$T/home" STUB_DIR="$T"
export SLURM_JOB_NODELIST=localhost SLURM_NTASKS=2 SLURM_JOB_ID=42
export MOE="$ROOT" MOE_PORT="$PORT" MOE_METRICS_PORT="$MPORT" MOE_CKPT="$T/ckpt" MOE_RESTART_MAX=3
unset MOE_AUTH_TOKEN MOE_DATA_IFACE
want_ip=$(ip -4 route get 127.0.0.1 | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -n1)

setsid bash "$ROOT/deploy/slurm/moe.sbatch" >"$T/job.log" 2>&1 &
JOB=$!

moectl() {
    [ -s "$T/home/.moe/auth-token" ] || return 1
    "$ROOT/bin/moectl" --url "tcp://127.0.0.1:$PORT" --token "$(cat "$T/home/.moe/auth-token")" \
        --timeout-ms 10000 "$@"
}
# wait_ready [GEN]: the cluster is ready with both workers up (and, given
# GEN, a generation above it); generous bound: a loaded machine is slow
wait_ready() {
    local i out gen
    for ((i = 0; i < 600; i++)); do
        kill -0 "$JOB" 2>/dev/null || fail "the batch script exited early"
        if out=$(moectl status 2>/dev/null) && grep -q '"ready": true' <<<"$out" &&
            grep -q '"up_workers": 2' <<<"$out"; then
            gen=$(sed -n 's/.*"generation": \([0-9]*\).*/\1/p' <<<"$out")
            if [ -z "${1:-}" ] || [ "$gen" -gt "$1" ]; then
                echo "$out"
                return 0
            fi
        fi
        sleep 0.2
    done
    fail "the cluster did not become ready${1:+ again after generation $1}"
}

status=$(wait_ready)
gen=$(sed -n 's/.*"generation": \([0-9]*\).*/\1/p' <<<"$status")
n=$(grep -c "\"rpc_url\": \"tcp://$want_ip:" <<<"$status" || true)
[ "$n" = 2 ] || fail "the workers do not listen on $want_ip (ip route get): $status"
moectl create --name m --layers 1 --d-model 16 --d-ff 32 --experts 4 --top-k 2 >/dev/null ||
    fail "model.create"
moectl forward --model m --tokens 8 >/dev/null || fail "forward"

# SIGKILL worker task 1's moe-worker: its task restarts it
loop=$(awk '$1 == "bash" && $2 == 1 {print $3}' "$T/tasks")
[ -n "$loop" ] || fail "no task 1 in the worker step: $(cat "$T/tasks")"
victim=$(pgrep -P "$loop" || true)
[ -n "$victim" ] || fail "task 1 ($loop) runs no worker"
kill -KILL "$victim"
wait_ready "$gen" >/dev/null
grep -q "worker exited 137: restart 1" "$T/job.log" || fail "no restart logged"
moectl forward --model m --tokens 8 >/dev/null || fail "forward after the restart"

# the signal before the time limit: drain, stop, exit 0
kill -TERM "$JOB"
for ((i = 0; i < 1500; i++)); do
    kill -0 "$JOB" 2>/dev/null || break
    sleep 0.2
done
kill -0 "$JOB" 2>/dev/null && fail "the batch script did not stop after SIGTERM"
rc=0
wait "$JOB" || rc=$?
JOB=0
[ "$rc" = 0 ] || fail "the batch script exited $rc after SIGTERM"
grep -q "draining the coordinator" "$T/job.log" || fail "no drain logged"
grep -q "coordinator stopped; stopping the workers" "$T/job.log" || fail "workers not stopped after the drain"
grep -q "SIGTERM: draining" "$T/job.log" || fail "the coordinator did not drain"
while read -r _ _ pid; do
    if kill -0 "$pid" 2>/dev/null; then fail "task process $pid still runs"; fi
done <"$T/tasks"
echo "slurm.sh: ok (ready on $want_ip, worker restarted, drained on SIGTERM)"
