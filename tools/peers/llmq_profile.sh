#!/usr/bin/env bash
# One training step of llm.q and one of ShardSwap at a Qwen2.5 shape (SHAPE: 0.5b at micro 8, the
# default, or 1.5b at micro 4; seq 2048), every kernel timed alone under Nsight Compute
# (--clock-control none: the GPU's own clocks), on a machine with an NVIDIA GPU, ncu, and llm.q's
# archive unpacked at the repository root as .llmq-src/ (../shared/peers/llmq: `tar xzf
# llmq-src.tgz`). Issue 32's first item: where llm.q's step is shorter, kernel by kernel.
#  1. llm.q: built and run for 3 steps by its own bench/gpu_run.sh (bf16 setting, CUDA graphs),
#     then its exact command run again under ncu for STEPS steps from its start; the table is one
#     step's launches, those after its classifier kernel's SEGMENT-th launch (counted from 0) up to
#     and with the next (tools/bench/kernel_table.py --segment): that step's backward, optimizer
#     (its AdamW kernel runs once a tensor, so it cannot mark steps), next forward and head.
#  2. ShardSwap: tools/bench/profile_step.sh over configs/qwen2.5-SHAPE.json on real text
#     (train_step and the engine.step() after it: its norm and AdamW kernels are the table's
#     "optimizer step" row, beside llm.q's),
#     with OPTIONS (space-separated KEY=VALUE config overrides, e.g. "model.bit16_logits=true").
# Writes under OUT: llmq-build/ (gpu_run.sh's files), llmq.csv, llmq.txt (the table),
# llmq-sequence.txt (the step's launches in order), shardswap/ (profile_step.sh's files), and
# llmq-kinds.txt and shardswap-kinds.txt: both steps by kind of kernel, row for row.
#   usage: OUT=DIR [SHAPE=0.5b] [OPTIONS="..."] [STEPS=4] [SEGMENT=1]
#          bash tools/peers/llmq_profile.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:?set OUT to the folder for the results}
STEPS=${STEPS:-4}
SEGMENT=${SEGMENT:-1}
SHAPE=${SHAPE:-0.5b}
OPTIONS=${OPTIONS:-}
case $SHAPE in
  0.5b) micro=8 ;;
  1.5b) micro=4 ;;
  *) echo "SHAPE=$SHAPE: 0.5b or 1.5b" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
status=0
step() { echo; echo "=== $* ==="; }
[ -f .llmq-src/bench/gpu_run.sh ] || { echo "no .llmq-src/: unpack llm.q's archive first" >&2; exit 2; }
command -v ncu > /dev/null || { echo "no ncu on the PATH" >&2; exit 2; }

step "llm.q: build, 3 steps (bf16, ${SHAPE^^}, micro $micro)"
LLMQ_RUNS="bf16:${SHAPE^^}:$micro:1:3" LLMQ_BUDGET_S=400 \
  bash .llmq-src/bench/gpu_run.sh "$OUT/llmq-build" > "$OUT/llmq-build.txt" 2>&1 || status=1
cmd_file=$(ls "$OUT"/llmq-build/*.cmd 2>/dev/null | head -1)
if [ -z "$cmd_file" ]; then
  tail -20 "$OUT/llmq-build.txt"
  status=1
else
  step "llm.q under ncu, $STEPS steps"
  # The command gpu_run.sh ran, its step count replaced; shell-quoted by printf %q.
  eval "args=($(sed -e "s/--steps=[0-9]*/--steps=$STEPS/" "$cmd_file"))"
  ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
    --print-units base --log-file "$OUT/llmq.csv" "${args[@]}" > "$OUT/llmq-ncu.log" 2>&1 ||
    { tail -20 "$OUT/llmq-ncu.log"; status=1; }
  python3 tools/bench/kernel_table.py --segment "fused_classifier:$SEGMENT" --sequence "$OUT/llmq.csv" \
    > "$OUT/llmq-sequence.txt" || status=1
  python3 tools/bench/kernel_table.py --segment "fused_classifier:$SEGMENT" --top 60 "$OUT/llmq.csv" |
    tee "$OUT/llmq.txt" || status=1
  python3 tools/bench/kernel_table.py --segment "fused_classifier:$SEGMENT" --by kind \
    "$OUT/llmq.csv" | tee "$OUT/llmq-kinds.txt" || status=1
fi

step "ShardSwap: one train_step under ncu"
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli >> "$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; exit 1; }
text=$(python3 -c "import sys; sys.path.insert(0, 'tools/bench'); import train_bench; print(train_bench.text_file('$OUT', None))")
sets=()
for kv in $OPTIONS; do sets+=(--set "$kv"); done
bash tools/bench/profile_step.sh "$OUT/shardswap" "configs/qwen2.5-$SHAPE.json" \
  --set data.seq_len=2048 --set "data.train=$text" --set "train_micro_batch_size_per_gpu=$micro" \
  "${sets[@]}" | head -60 || status=1
python3 tools/bench/kernel_table.py --by kind "$OUT/shardswap/qwen2.5-$SHAPE.csv" |
  tee "$OUT/shardswap-kinds.txt" || status=1
exit $status
