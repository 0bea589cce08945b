#!/usr/bin/env bash
# Gradients on the host (shardswap.gradient_placement = "host") on a machine with an NVIDIA GPU:
# builds with preset cuda, then
#  1. (SUITE=1) the GPU tests of the host placements: gradients on the host against gradients on
#     the device, bit for bit, and the state and master tests beside them;
#  2. (SMALL=1) a Qwen2.5-0.5B full fine-tune from scratch on real text (tools/bench/
#     train_bench.py, micro 8, accumulation 4, 20 steps), the state on the host with the
#     gradients on the device and on the host: the losses step by step (the same bits are
#     expected) and tokens/s;
#  3. for each budget in BUDGETS ("none": unbudgeted), a Qwen2.5-7B full fine-tune or LISA run
#     (MODE; micro 3, accumulation 8, seq 2048, BIG_STEPS steps) under it, the planner choosing:
#     what it chose, tokens/s, plan = peak on the device and the host; with FROZEN=host, the
#     frozen layers' weights on the host too (shardswap.frozen_weight_placement).
# Logs and JSON go under $OUT (default build/gpu-out).
#   usage: OUT=DIR [SUITE=1] [SMALL=1] [MODE=full|lisa] [BUDGETS="24GiB"] [BIG_STEPS=5]
#          [FROZEN=device|host] bash tools/checks/gpu-host-grads-check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-out}
BUDGETS=${BUDGETS-24GiB}
BIG_STEPS=${BIG_STEPS:-5}
MODE=${MODE:-full}
FROZEN=${FROZEN:-device}
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $* ==="; }

step "machine"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "cores $(nproc), memory $(free -g | awk '/Mem:/ {print $2}') GiB"
} | tee "$OUT/machine.txt"

step "configure and build"
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli shardswap_gpu_tests \
    >> "$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then tail -60 "$OUT/build.log"; exit 1; fi
bin=build/cuda/tools/shardswap

if [ "${SUITE:-1}" = 1 ]; then
  step "GPU tests of the host placements"
  build/cuda/tests/gpu/shardswap_gpu_tests --durations yes \
    "cuda: gradients on the host*,cuda: state on the host*,cuda: the master as bf16*,cuda: frozen weights*,cuda decoder: weights handed out*" \
    > "$OUT/gpu-tests.log" 2>&1 || status=1
  grep -E "FAILED|passed|failed" "$OUT/gpu-tests.log" | tail -6
fi

if [ "${SMALL:-1}" = 1 ]; then
  step "Qwen2.5-0.5B full, state on the host: gradients on the device, then on the host"
  for grads in device host; do
    dir="$OUT/small-$grads"
    python3 tools/bench/train_bench.py --bin "$bin" --out "$dir" --shapes 0.5b --modes full \
      --steps 20 --warmup 5 --set gradient_accumulation_steps=4 \
      --set zero_optimization.offload_optimizer.device=cpu \
      --set zero_optimization.offload_optimizer.pin_memory=true \
      --set shardswap.gradient_placement=$grads > "$dir.txt" 2>&1 || status=1
    echo "--- gradients on the $grads"
    tail -1 "$dir.txt"
    grep -hE "host memory of rank 0" "$dir"/*.log | head -1
  done
  python3 - "$OUT" <<'PY'
import json, os, sys
def losses(run):
    path = os.path.join(sys.argv[1], f"small-{run}", "train-bench-0.5b-full.jsonl")
    return [json.loads(l)["loss"] for l in open(path)] if os.path.exists(path) else []
d, h = losses("device"), losses("host")
if d and len(d) == len(h):
    diff = max(abs(a - b) for a, b in zip(d, h))
    print(f"losses over {len(d)} steps: largest difference {diff} "
          f"({'the same' if diff == 0 else 'NOT the same'}); step 1 {d[0]:.6f}, last {d[-1]:.6f}")
else:
    print(f"losses missing: {len(d)} and {len(h)} steps")
PY
fi

for budget in $BUDGETS; do
  step "Qwen2.5-7B $MODE, micro 3, accumulation 8, budget $budget, frozen weights on the $FROZEN"
  dir="$OUT/7b-$MODE-$budget-$FROZEN"
  extra=(--set "shardswap.frozen_weight_placement=$FROZEN")
  [ "$budget" = none ] || extra+=(--set "shardswap.device_memory=$budget")
  python3 tools/bench/train_bench.py --bin "$bin" --out "$dir" --shapes 7b --modes "$MODE" \
    --steps "$BIG_STEPS" --warmup 2 --set gradient_accumulation_steps=8 "${extra[@]}" \
    > "$dir.txt" 2>&1 || status=1
  tail -1 "$dir.txt"
  grep -hE "chosen \(|host memory of rank 0|held outside|outside it|rank 0 peak" "$dir"/*.log |
    head -5
done
exit $status
