#!/bin/bash
# bench/ep_scaling.sh - the expert-parallel scaling table of issue 24 in one
# run on the GPUs of this host: bin/ep_bench at 1, 2, 4 and 8 GPUs (as many
# as there are) for the Qwen3-30B-A3B (16384 tokens per GPU), Mixtral (8192)
# and DeepSeek-V3 (4096, 256 experts, inference only: its optimizer state
# does not fit) shapes, random routing, chunks 1 and 2 (Qwen3 inference
# also 4: the copy-engine exchange's best); then the PyTorch
# expert-parallel layer (bench/peer_ep.py: all_to_all_single +
# torch._grouped_mm) at the same sizes; then skewed routing at the largest
# GPU count. Run from the repository root with bin/ and lib/ built; logs and
# a summary go to ${OUT:-.}.      bash bench/ep_scaling.sh [W ...]
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-.}
NG=$(nvidia-smi -L | wc -l)
WS=${*:-1 2 4 8}
B=./bin/ep_bench
log() { tee -a "$OUT/ep_scaling.log"; }
step() { # timeout name command...
    local t=$1 name=$2; shift 2
    echo "== $name: $*" | log
    timeout "$t" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -v "^ *$" "$OUT/$name.log" | grep -v "^NCCL\|Warning\|warn(" | tail -n 8 | log
    echo "rc=$rc" | log
}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | head -1 | log
LAST=1
for W in $WS; do
    [ "$W" -gt "$NG" ] && continue
    LAST=$W
    step 150 "qwen3_w$W" $B --gpus "$W" --shape qwen3 --tokens 16384 --chunks 1,2
    # inference: the deduplicated dispatch and the copy-engine exchange
    # (both on by default) and their chunks
    step 150 "qwen3_infer_w$W" $B --gpus "$W" --shape qwen3 --tokens 16384 --chunks 1,2,4 --infer
    step 150 "mixtral_w$W" $B --gpus "$W" --shape mixtral --tokens 8192 --chunks 1,2
    step 200 "deepseek_w$W" $B --gpus "$W" --shape deepseek --tokens 4096 --chunks 1,2 --infer
    step 200 "peer_w$W" python3 -m torch.distributed.run --standalone --nproc_per_node "$W" \
        bench/peer_ep.py --shapes qwen3:16384,mixtral:8192,deepseek:4096
done
if [ "$LAST" -gt 1 ]; then
    step 150 "qwen3_w${LAST}_skew" $B --gpus "$LAST" --shape qwen3 --tokens 16384 --chunks 1,2 --skew
    step 200 "deepseek_w${LAST}_skew" $B --gpus "$LAST" --shape deepseek --tokens 4096 --chunks 1,2 \
        --infer --skew
    step 200 "peer_w${LAST}_skew" python3 -m torch.distributed.run --standalone \
        --nproc_per_node "$LAST" bench/peer_ep.py --shapes qwen3:16384,deepseek:4096 --skew
fi
exit 0
