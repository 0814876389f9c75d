#!/usr/bin/env bash
# kill-series.sh - SIGKILLs in a row: deploy/gpu-kill-test.sh run N times
# (each run kills --kills M times, 1 by default), each run with its own seed
# and first kill moment (1.0-3.9 s into the stream), and a table of what
# each kill cost: when the coordinator logged the loss (and
# the load average at the kill), when the worker was shown down (polled
# every 0.1 s after a 0.2 s pause), when the
# first request in flight was answered with an error, when every request in
# flight was answered (some wait through the re-formation and succeed), when
# the optimizer.step in flight was answered (training), when the cluster was
# ready again after the restart, and whether every check passed (training:
# no acknowledged step lost).
#
#   deploy/kill-series.sh N [--mix] [gpu-kill-test.sh options: --backend cuda
#                           --train --checkpoint-dir DIR ...]
#
# --mix: the runs cycle through inference only, training with the kill in
# an optimizer step, training with the kill in any call (the issue's "50
# kills at random moments"), and training with the kill while a step's
# automatic checkpoint is being written (checkpoints after every step; a
# fresh directory per run), with bf16 models in runs 1-4, 9-12, ... and f32
# models in runs 5-8, 13-16, ... (every mode in both dtypes); the other
# options apply to every run.
#
# --kills M (passed on to the test): each run kills M times in a row in the
# same cluster, the victims in turn; the table has a row per kill (run.kill).
#
# Logs of each run under $KILL_SERIES_DIR (default a fresh /tmp/moe-kills.*).
# KILL_SERIES_FIRST=K numbers the runs K .. K+N-1 (seeds, kill moments and
# --mix modes follow the number): a long series split over several calls.
# KILL_SERIES_SECONDS=S starts no run once S seconds have passed (the table
# and its summary still come out inside a bounded device call).
# Exit status 0 when every run passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
N=${1:-10}
shift || true
MIX=0
KILLS=1
ARGS=()
prev=
for a in "$@"; do
    if [ "$a" = "--mix" ]; then MIX=1; else ARGS+=("$a"); fi
    [ "$prev" = "--kills" ] && KILLS=$a
    prev=$a
done
DIR=${KILL_SERIES_DIR:-$(mktemp -d /tmp/moe-kills.XXXXXX)}
mkdir -p "$DIR"
pass=0
fail=0
firsts=()
readys=()
restarts=0
printf "%-5s %-6s %-10s %-9s %-9s %-6s %-10s %-12s %-13s %-10s %-10s %-8s %-8s %s\n" run result \
    mode "dying (s)" "seen (s)" "load" "down (s)" "1st err (s)" "answered (s)" "step (s)" \
    "ready (s)" "restarts" "kill at" "run (s)"
FIRST=${KILL_SERIES_FIRST:-1}
BUDGET=${KILL_SERIES_SECONDS:-0}
START=$SECONDS
for i in $(seq "$FIRST" $((FIRST + N - 1))); do
    if [ "$BUDGET" -gt 0 ] && [ $((SECONDS - START)) -ge "$BUDGET" ]; then
        echo "stopped before run $i: ${BUDGET} s budget spent"
        break
    fi
    h=$(((i * 2654435761 + 40503) % 4294967296)) # spread over 1.0-3.9 s by a hash of i
    at=$(awk -v h="$h" 'BEGIN { printf "%.1f", 1.0 + (int(h / 65536) % 30) / 10 }')
    log="$DIR/run-$i.log"
    args=()
    skip=0
    ckpt=0
    for a in "${ARGS[@]}"; do # a fresh checkpoint directory per run
        if [ "$skip" = 1 ]; then skip=0; continue; fi
        if [ "$a" = "--checkpoint-dir" ]; then skip=1; ckpt=1; continue; fi
        args+=("$a")
    done
    mode=as-given
    if [ "$MIX" = 1 ]; then
        case $((i % 4)) in
        1) mode=infer ;;
        2) mode=step; args+=(--train --kill-during step); ckpt=1 ;;
        3) mode=train; args+=(--train --kill-during any); ckpt=1 ;;
        0) mode=ckpt; args+=(--train --kill-during ckpt); ckpt=1 ;;
        esac
        if [ $(((i - 1) / 4 % 2)) = 1 ]; then
            args+=(--dtype f32)
            mode=$mode/f32
        fi
    fi
    [ "$ckpt" = 1 ] && args+=(--checkpoint-dir "$DIR/ckpt-$i")
    t0=$SECONDS
    deploy/gpu-kill-test.sh "${args[@]}" --seed "$i" --kill-after "$at" >"$log" 2>&1
    rc=$?
    wall=$((SECONDS - t0))
    # the test's summary line per kill: "kill-summary K PASS|FAIL victim V at S
    # dying S seen S load L down S first S answered S step S ready S restarts N"
    # (restarts: survivors that exited 3 and were started again)
    rows=0
    while read -r _ k r _ _ _ at _ dying _ seen _ load _ down _ first _ ans _ step _ ready _ rst; do
        rows=$((rows + 1))
        id=$i
        [ "$KILLS" -gt 1 ] && id=$i.$k
        if [ "$r" = PASS ]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
        [ "$first" != - ] && firsts+=("$first")
        [ "$ready" != - ] && readys+=("$ready")
        restarts=$((restarts + ${rst:-0}))
        printf "%-5s %-6s %-10s %-9s %-9s %-6s %-10s %-12s %-13s %-10s %-10s %-8s %-8s %s\n" "$id" \
            "$r" "$mode" "$dying" "$seen" "$load" "$down" "$first" "$ans" "$step" "$ready" \
            "${rst:-0}" "$at" "$wall"
    done < <(grep "^kill-summary " "$log")
    # a run that failed outside its kills (start, cleanup) or made fewer than asked
    if [ "$rc" -ne 0 ] && ! grep -q "^kill-summary [0-9]* FAIL" "$log"; then
        fail=$((fail + 1))
        printf "%-5s %-6s %-10s run exit %s after %s kill(s) (%s s): see %s\n" "$i" FAIL "$mode" \
            "$rc" "$rows" "$wall" "$log"
    fi
done
summ() { # label values...: min, median, max
    local label=$1; shift
    [ $# -eq 0 ] && { echo "$label: none"; return; }
    printf '%s\n' "$@" | sort -g | awk -v l="$label" '{v[NR]=$1} END {
        printf "%s: min %.3f, median %.3f, max %.3f s (%d kills)\n", l, v[1], v[int((NR+1)/2)], v[NR], NR }'
}
summ "first error after the kill" "${firsts[@]}"
summ "ready again after the kill" "${readys[@]}"
echo "survivors restarted (exited 3: a device that could not be recovered): $restarts"
echo "kill series: $pass passed, $fail failed (kills; logs in $DIR)"
[ "$fail" -eq 0 ]
