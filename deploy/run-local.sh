#!/usr/bin/env bash
# run-local.sh - `make run`: a local cluster on loopback and a short demo.
#
# Starts a coordinator (port 0, its address read from an --addr-file; the
# cluster secret in a --cluster-secret-file it creates in the run directory,
# which the workers read) and two CPU workers (or, with GPUs and a CUDA build, one worker per GPU and a bf16
# model), creates a model (2 layers, d_model 512, d_ff 1024, 8 experts,
# top-2), runs a forward on a random batch through each layer (the per-expert
# load table), benchmarks forward and ping round trips, prints a summary from
# `moectl stats`, then stops everything with SIGTERM (SIGKILL after 10 s).
# Cleanup also runs on Ctrl-C and on errors: no process is left behind.
#
# Environment: MOE_WORKERS (2), MOE_TOKENS (256 tokens per forward),
# MOE_KEEP_LOGS=1 keeps the run directory (logs) after a clean run.
set -euo pipefail
cd "$(dirname "$0")/.."

# GPUs present (and a CUDA build): one worker per GPU, bf16 demo model (the
# GPU kernels store bf16); otherwise CPU workers and an f32 model.
NGPU=0
WORKER_VERSION=$(bin/moe-worker --version 2>/dev/null || true)
if command -v nvidia-smi >/dev/null 2>&1 && [[ "$WORKER_VERSION" == *"backends: cpu cuda"* ]]; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "$NGPU" -ge 1 ]; then
    WORKERS=${MOE_WORKERS:-$NGPU}
    BACKEND=auto
    DTYPE=bf16
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
else
    WORKERS=${MOE_WORKERS:-2}
    BACKEND=cpu
    DTYPE=f32
fi
TOKENS=${MOE_TOKENS:-256}
NCPU=$(nproc 2>/dev/null || echo 2)
THREADS=$((NCPU / WORKERS))
[ "$THREADS" -ge 1 ] || THREADS=1

for b in moe-coordinator moe-worker moectl; do
    if [ ! -x "bin/$b" ]; then
        echo "run-local: bin/$b is missing: run 'make' (or 'make run') first" >&2
        exit 1
    fi
done

RUN=$(mktemp -d "${TMPDIR:-/tmp}/moe-run.XXXXXX")
pids=()
status=1
interrupted=0

# stop: SIGTERM every daemon (the coordinator first: it drains), wait up to
# 10 s, SIGKILL what is left, reap everything.
stop() {
    local p left i
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for i in $(seq 100); do
        left=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
        [ "$left" -eq 0 ] && break
        sleep 0.1
    done
    for p in "${pids[@]}"; do
        if kill -0 "$p" 2>/dev/null; then
            echo "run-local: pid $p ignored SIGTERM for 10 s: killing it" >&2
            kill -KILL "$p" 2>/dev/null || true
        fi
    done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    stop
    if [ "$interrupted" -eq 1 ] || [ "$rc" -eq 130 ] || [ "$rc" -eq 143 ]; then
        echo "run-local: interrupted; every process stopped" >&2
        rm -rf "$RUN"
        exit 130
    fi
    if [ "$status" -ne 0 ] || [ "$rc" -ne 0 ]; then
        echo "run-local: failed; the last lines of each log ($RUN):" >&2
        for f in "$RUN"/*.log; do
            [ -f "$f" ] || continue
            echo "== $f" >&2
            tail -n 15 "$f" >&2
        done
        exit $((rc ? rc : 1))
    fi
    if [ "${MOE_KEEP_LOGS:-0}" = 1 ]; then
        echo "logs kept in $RUN"
    else
        rm -rf "$RUN"
    fi
    exit 0
}
trap on_exit EXIT
trap 'interrupted=1; exit 130' INT TERM

# a free port for /metrics: the first port from 19100 that nothing listens on
mport=19100
while (exec 3<>"/dev/tcp/127.0.0.1/$mport") 2>/dev/null; do mport=$((mport + 1)); done
METRICS="http://127.0.0.1:$mport"

echo "== starting a coordinator and $WORKERS $([ "$BACKEND" = cpu ] && echo CPU || echo GPU) workers ($THREADS BLAS thread(s) each) in $RUN"
./bin/moe-coordinator --listen tcp://127.0.0.1:0 --addr-file "$RUN/addr" --workers "$WORKERS" \
    --cluster-secret-file "$RUN/secret" --metrics "$METRICS" >"$RUN/coordinator.log" 2>&1 &
pids+=($!)
for i in $(seq 100); do
    [ -s "$RUN/addr" ] && break
    kill -0 "${pids[0]}" 2>/dev/null || { echo "run-local: the coordinator exited" >&2; exit 1; }
    sleep 0.05
done
[ -s "$RUN/addr" ] || { echo "run-local: no coordinator address after 5 s" >&2; exit 1; }
URL=$(cat "$RUN/addr")
for i in $(seq 0 $((WORKERS - 1))); do
    dev=()
    [ "$BACKEND" = cpu ] || dev=(--device $((i % NGPU)))
    ./bin/moe-worker --coordinator "$URL" --cluster-secret-file "$RUN/secret" --backend "$BACKEND" \
        "${dev[@]}" --threads "$THREADS" >"$RUN/worker$i.log" 2>&1 &
    pids+=($!)
done
ctl() { ./bin/moectl --url "$URL" "$@"; }

ready=0
for i in $(seq 150); do
    if ctl status 2>/dev/null | grep -q '"ready": true'; then
        ready=1
        break
    fi
    for p in "${pids[@]}"; do
        kill -0 "$p" 2>/dev/null || { echo "run-local: a daemon (pid $p) exited" >&2; exit 1; }
    done
    sleep 0.2
done
[ "$ready" -eq 1 ] || { echo "run-local: the cluster is not ready after 30 s" >&2; exit 1; }
echo "cluster ready at $URL (metrics: $METRICS/metrics, $METRICS/readyz)"
ctl status | awk '/"generation"/ { gsub(/,/, ""); g = $2 } /"up_workers"/ { gsub(/,/, ""); u = $2 }
    END { printf "generation %s, %s workers up\n", g, u }'

echo
echo "== model demo: 2 layers, d_model 512, d_ff 1024, 8 experts, top-2 (SwiGLU, $DTYPE)"
ctl create --name demo --layers 2 --d-model 512 --d-ff 1024 --experts 8 --top-k 2 --dtype "$DTYPE"

for layer in 0 1; do
    echo
    echo "== forward: layer $layer, $TOKENS random tokens"
    ctl forward --model demo --layer "$layer" --tokens "$TOKENS" --seed $((layer + 1)) --dtype "$DTYPE"
done

echo
echo "== bench"
{
    ctl bench --model demo --layer 0 --tokens "$TOKENS" --requests 50 --concurrency 2 --dtype "$DTYPE"
    ctl bench --model demo --layer 1 --tokens 1 --requests 200 --dtype "$DTYPE"
    ctl bench --ping --requests 500
} | tee "$RUN/bench.txt"

echo
echo "== summary"
sed -nE 's/^bench forward demo layer [0-9]+: (T=[0-9]+).*: ([0-9]+ tokens\/s).*(p50 [0-9.]+ ms), (p99 [0-9.]+ ms).*/  throughput \1: \2, \3, \4/p;
    s/^bench ping: .*(p50 [0-9.]+ ms), (p99 [0-9.]+ ms).*/  ping round trip: \1, \2/p' "$RUN/bench.txt"
# forwards served without the coordinator in their path (the lane, fan-out)
# reach its counts with the workers' next heartbeats: wait for all 254 (the
# two above, 51 and 201 with the benches' warm-ups), at most 5 s
for i in $(seq 50); do
    ctl stats >"$RUN/stats.json"
    fw=$(awk '/"forward_total"/ { gsub(/[^0-9]/, "", $2); print $2; exit }' "$RUN/stats.json")
    [ "${fw:-0}" -ge 254 ] && break
    sleep 0.1
done
awk '
    BEGIN { nl = 0 }
    function num(s) { gsub(/[^0-9.eE+-]/, "", s); return s }
    /"forward_total"/ && !nf  { fw = num($2); nf = 1 }
    /"tokens_total"/          { tok = num($2) }
    /"errors_total"/          { err = num($2) }
    /"forward_latency_mean_s"/ { lat = num($2) }
    /"tokens_per_expert"/     { sub(/.*: /, ""); sub(/,$/, ""); tpe[nl] = $0 }
    /"imbalance"/             { imb[nl++] = num($2) }
    END {
        printf "  %d forwards, %d tokens, %d errors, mean forward latency %.2f ms\n", fw, tok, err, lat * 1000
        for (l = 0; l < nl; l++)
            printf "  layer %d: tokens per expert %s  imbalance (max/mean) %.3f\n", l, tpe[l], imb[l]
        print "  (a bench repeats one batch, so its routing repeats too: layer 1 holds the T=1 bench)"
    }
' "$RUN/stats.json"
if readyz=$( (exec 3<>"/dev/tcp/127.0.0.1/$mport" && printf 'GET /readyz HTTP/1.0\r\n\r\n' >&3 &&
    head -1 <&3) 2>/dev/null); then
    echo "  $METRICS/readyz: ${readyz%$'\r'}"
fi

echo
echo "== stopping (SIGTERM)"
stop
for f in "$RUN"/*.log; do
    if grep -q " E " "$f"; then
        echo "run-local: errors in $f:" >&2
        grep " E " "$f" | head -5 >&2
    fi
done
echo "all processes stopped"
status=0
