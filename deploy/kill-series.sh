#!/usr/bin/env bash
# kill-series.sh - N SIGKILLs in a row: deploy/gpu-kill-test.sh run N times,
# each with its own seed and kill moment (1.0-3.9 s into the stream), and a
# table of what each kill cost: when the worker was shown down, when the
# requests in flight were answered, when the cluster was ready again after
# the restart, and whether every check passed (training: no acknowledged
# step lost).
#
#   deploy/kill-series.sh N [gpu-kill-test.sh options: --backend cuda --train
#                           --checkpoint-dir DIR ...]
#
# Logs of each run under $KILL_SERIES_DIR (default a fresh /tmp/moe-kills.*).
# Exit status 0 when every run passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
N=${1:-10}
shift || true
DIR=${KILL_SERIES_DIR:-$(mktemp -d /tmp/moe-kills.XXXXXX)}
mkdir -p "$DIR"
pass=0
fail=0
printf "%-4s %-6s %-12s %-14s %-14s %s\n" run result "down (s)" "answered (s)" "ready (s)" "kill at"
for i in $(seq 1 "$N"); do
    at=$(awk -v s="$i" 'BEGIN { srand(s * 7919); printf "%.1f", 1.0 + rand() * 2.9 }')
    log="$DIR/run-$i.log"
    ckpt=()
    for a in "$@"; do [ "$a" = "--checkpoint-dir" ] && ckpt=(--checkpoint-dir "$DIR/ckpt-$i"); done
    args=()
    skip=0
    for a in "$@"; do # a fresh checkpoint directory per run
        if [ "$skip" = 1 ]; then skip=0; continue; fi
        if [ "$a" = "--checkpoint-dir" ]; then skip=1; continue; fi
        args+=("$a")
    done
    deploy/gpu-kill-test.sh "${args[@]}" "${ckpt[@]}" --seed "$i" --kill-after "$at" >"$log" 2>&1
    rc=$?
    down=$(grep -o 'state down [0-9.]* s after the kill' "$log" | head -1 | awk '{print $3}')
    ans=$(grep -o 'in-flight ones answered within [0-9.]* s' "$log" | head -1 | awk '{print $5}')
    ready=$(grep -o 'after the restart, [0-9.]* s after the kill' "$log" | head -1 | awk '{print $4}')
    if [ "$rc" -eq 0 ]; then res=PASS; pass=$((pass + 1)); else res=FAIL; fail=$((fail + 1)); fi
    printf "%-4s %-6s %-12s %-14s %-14s %s\n" "$i" "$res" "${down:--}" "${ans:--}" "${ready:--}" "$at"
done
echo "kill series: $pass passed, $fail failed (logs in $DIR)"
[ "$fail" -eq 0 ]
