#!/usr/bin/env bash
# fanout_check.sh - the fan-out of decode batches on GPU workers (several
# GPUs of this host): through 2 GPU workers, service_bench's forwards of
# T = 1, 4, 16 (fanned out) and 65 (the ordered road) against the CPU
# reference, over rings and sockets, once through the decode chain and once
# through the two-step path (KCU_LOCAL_CHAIN=0); T = 17, 32, 64 fanned out
# (libmoe's default on GPU workers, 64 rows: past the chain's graphs); the experts backend (--ep
# off: routing on the host); then the routing families (a shared expert:
# the two-step path) against a CPU worker. Exit 1 on any failure, or when
# no fan-out forward ran on the workers. Last, bin/cuda_ipc_check through 2
# GPU workers.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
    echo "fanout_check: fewer than 2 GPUs here; skipped"
    exit 0
fi
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$(mktemp -d /tmp/moe-fanout.XXXXXX)}
mkdir -p "$OUT"
Q="--d-model 2048 --d-ff 768 --experts 128 --top-k 8 --dtype bf16"
fail=0
for ch in 1 0; do
    run="$OUT/chain$ch"
    rm -rf "$run"
    KCU_LOCAL_CHAIN=$ch KCU_LOCAL_TRACE=20 MOE_RUN_DIR="$run" timeout 300 deploy/gpu-cluster.sh \
        -w 2 -b cuda -- sh -c "bin/service_bench --url \$MOE_URL $Q --tokens 1,4,16,65 --iters 20 --paths shm,socket" \
        >"$OUT/chain$ch.log" 2>&1
    rc=$?
    npass=$(grep -c "PASS" "$OUT/chain$ch.log")
    nfan=$(cat "$run"/worker*.log | grep -c "kcu_ep_forward_local")
    echo "fanout_check: KCU_LOCAL_CHAIN=$ch rc $rc, $npass PASS, $(grep -c FAIL "$OUT/chain$ch.log") FAIL, $nfan fan-out trace lines"
    if [ $rc -ne 0 ] || [ "$npass" -lt 4 ] || grep -q FAIL "$OUT/chain$ch.log" || [ "$nfan" -lt 2 ]; then
        fail=1
    fi
done
# batches past the 16 rows the decode chain keeps as graphs, fanned out
# (libmoe's default on GPU workers: up to 64 rows): the chain kernel by kernel (a worker once took the
# legacy stream, NULL, for "use a graph", indexed its 17 graph slots with
# T and died or failed the call)
run="$OUT/wide"
rm -rf "$run"
KCU_LOCAL_TRACE=20 MOE_RUN_DIR="$run" timeout 300 deploy/gpu-cluster.sh \
    -w 2 -b cuda -- sh -c "bin/service_bench --url \$MOE_URL $Q --tokens 17,32,64 --iters 20 --paths shm,socket" \
    >"$OUT/wide.log" 2>&1
rc=$?
npass=$(grep -c "PASS" "$OUT/wide.log")
nfan=$(cat "$run"/worker*.log | grep -c "kcu_ep_forward_local")
echo "fanout_check: T = 17, 32, 64 fanned out by default: rc $rc, $npass PASS, $(grep -c FAIL "$OUT/wide.log") FAIL, $nfan fan-out trace lines"
if [ $rc -ne 0 ] || [ "$npass" -lt 3 ] || grep -q FAIL "$OUT/wide.log" || [ "$nfan" -lt 2 ]; then
    fail=1
fi
# the experts backend (--ep off): the host routes, the GPUs run the experts
run="$OUT/ep_off"
rm -rf "$run"
MOE_WORKER_EP=off MOE_LANE_TRACE=10 MOE_RUN_DIR="$run" timeout 300 deploy/gpu-cluster.sh -w 2 -b cuda \
    -- sh -c "bin/service_bench --url \$MOE_URL $Q --tokens 1,4,64 --iters 20 --paths shm,socket" \
    >"$OUT/ep_off.log" 2>&1
rc=$?
npass=$(grep -c "PASS" "$OUT/ep_off.log")
nlane=$(cat "$run"/worker*.log | grep -c "lane trace")
nexp=$(cat "$run"/worker*.log | grep -c "experts mode")
echo "fanout_check: --ep off rc $rc, $npass PASS, $(grep -c FAIL "$OUT/ep_off.log") FAIL, $nlane lane trace lines, $nexp workers in experts mode"
if [ $rc -ne 0 ] || [ "$npass" -lt 3 ] || grep -q FAIL "$OUT/ep_off.log" || [ "$nlane" -lt 2 ] ||
    [ "$nexp" -lt 2 ]; then
    fail=1
fi
timeout 200 deploy/gpu-cluster.sh -w 1 -b cpu -- python3 python/family_check.py \
    --save "$OUT/famref.npz" >"$OUT/fam_cpu.log" 2>&1 || fail=1
timeout 200 deploy/gpu-cluster.sh -w 2 -b cuda -- python3 python/family_check.py \
    --against "$OUT/famref.npz" >"$OUT/fam_gpu2.log" 2>&1 || fail=1
echo "fanout_check: families through 2 GPU workers: $(grep -E 'passed' "$OUT/fam_gpu2.log" | tail -1)"
# rows already on a GPU (CUDA IPC) through 2 GPU workers: a decode batch
# staged through host memory and fanned out, the rest on the ordered road,
# bad handles refused (a fan-out once read device pointers on the host and
# crashed here)
run="$OUT/ipc2"
rm -rf "$run"
MOE_RUN_DIR="$run" timeout 200 deploy/gpu-cluster.sh -w 2 -b cuda -- bin/cuda_ipc_check --no-timing \
    >"$OUT/ipc2.log" 2>&1
rc=$?
echo "fanout_check: CUDA IPC through 2 GPU workers rc $rc, $(grep -c "^PASS" "$OUT/ipc2.log") PASS, $(grep -c "FAIL" "$OUT/ipc2.log") FAIL"
if [ $rc -ne 0 ] || grep -q FAIL "$OUT/ipc2.log" || [ "$(grep -c "^PASS" "$OUT/ipc2.log")" -lt 5 ]; then
    fail=1
fi
[ $fail -eq 0 ] && echo "fanout_check: PASS (logs in $OUT)" || echo "fanout_check: FAIL (logs in $OUT)"
exit $fail
