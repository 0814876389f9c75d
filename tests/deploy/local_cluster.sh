#!/usr/bin/env bash
# local_cluster.sh - deploy/gpu-cluster.sh (the local cluster the GPU
# scripts and `make check-gpu-dataplane` start) on the CPU backend, twice in
# one run directory (MOE_RUN_DIR): the second start must reach its own
# coordinator, not the address the first one left behind (it used to wait
# on that dead address until the caller's timeout).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
[ -x bin/moectl ] && [ -x bin/moe-coordinator ] || { echo "local_cluster: build first (make)"; exit 1; }
RUN=$(mktemp -d /tmp/moe-localcl.XXXXXX)
trap 'rm -rf "$RUN"' EXIT
for i in 1 2; do
    out=$(MOE_RUN_DIR="$RUN" timeout 120 deploy/gpu-cluster.sh -w 2 -b cpu -- \
        sh -c 'bin/moectl --url "$MOE_URL" status' 2>&1)
    rc=$?
    if [ $rc -ne 0 ] || ! printf '%s\n' "$out" | grep -q "generation"; then
        echo "local_cluster: start $i in one run directory: exit $rc"
        printf '%s\n' "$out" | tail -n 30
        exit 1
    fi
    echo "local_cluster: start $i: $(printf '%s\n' "$out" | grep -m1 "generation")"
done
exit 0
