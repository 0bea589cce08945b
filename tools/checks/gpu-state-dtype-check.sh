#!/usr/bin/env bash
# Optimizer state in bf16 (shardswap.optimizer_state_dtype) on a machine with an NVIDIA GPU: builds
# with preset cuda, runs the GPU suite (the update kernels give the CPU kernels' bits with fp32 and
# bf16 state), then
#  1. Qwen2.5-shaped full fine-tunes (tools/bench/train_bench.py, from scratch on real text) with
#     fp32 and bf16 state, on the device and on the host (streamed), side by side: tokens/s, the
#     plan, and the loss every step of both states from the same data;
#  2. with BIG=1, Qwen2.5-7B full under a 48GiB budget with bf16 state beside the unbudgeted run.
# Logs and JSON go under $OUT (default build/gpu-out).
#   usage: OUT=DIR [SHAPES=0.5b] [STEPS=60] [ACCUMULATION=8] [BIG=0] bash tools/checks/gpu-state-dtype-check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-out}
SHAPES=${SHAPES:-0.5b}
STEPS=${STEPS:-60}
ACCUMULATION=${ACCUMULATION:-8}
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $* ==="; }

step "configure and build"
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli shardswap_gpu_tests \
    >> "$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then tail -60 "$OUT/build.log"; exit 1; fi
bin=build/cuda/tools/shardswap

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"

step "GPU suite (the update kernels with fp32 and bf16 state among it)"
build/cuda/tests/gpu/shardswap_gpu_tests --durations yes > "$OUT/gpu-tests.log" 2>&1 || status=1
grep -E "FAILED|passed|failed" "$OUT/gpu-tests.log" | tail -8

step "training: fp32 and bf16 state ($SHAPES, accumulation $ACCUMULATION, $STEPS steps)"
for placement in none cpu; do
  for dtype in fp32 bf16; do
    dir="$OUT/train-$placement-$dtype"
    python3 tools/bench/train_bench.py --bin "$bin" --out "$dir" --shapes "$SHAPES" --modes full \
      --steps "$STEPS" --warmup 5 --set gradient_accumulation_steps="$ACCUMULATION" \
      --set zero_optimization.offload_optimizer.device=$placement \
      --set zero_optimization.offload_optimizer.pin_memory=true \
      --set shardswap.optimizer_state_dtype=$dtype > "$dir.txt" 2>&1 || status=1
    echo "--- offload_optimizer.device $placement, state $dtype"
    tail -2 "$dir.txt"
  done
done
python3 - "$OUT" "$SHAPES" <<'PY'
import json, os, sys
out, shape = sys.argv[1], sys.argv[2].split(",")[0]
def losses(run):
    path = os.path.join(out, f"train-{run}", f"train-bench-{shape}-full.jsonl")
    return [json.loads(l)["loss"] for l in open(path)] if os.path.exists(path) else []
for placement in ("none", "cpu"):
    a, b = losses(f"{placement}-fp32"), losses(f"{placement}-bf16")
    print(f"losses, state on {'the device' if placement == 'none' else 'the host'}: step, fp32, bf16, bf16 - fp32")
    for i in range(0, min(len(a), len(b)), 5):
        print(f"  {i + 1:4d} {a[i]:.4f} {b[i]:.4f} {b[i] - a[i]:+.4f}")
    if a and b:
        k = min(len(a), len(b), 10)
        print(f"  mean of the last {k}: {sum(a[-k:]) / k:.4f} {sum(b[-k:]) / k:.4f}")
PY

if [ "${BIG:-0}" = 1 ]; then
  step "Qwen2.5-7B full, 48GiB budget, bf16 state, beside the unbudgeted run"
  OUT="$OUT/7b" BUDGET=48GiB STEPS=8 WARMUP=3 bash tools/checks/gpu-budget-check.sh \
    > "$OUT/7b-unbudgeted-and-fp32.txt" 2>&1 || status=1
  python3 tools/bench/train_bench.py --bin "$bin" --out "$OUT/7b-bf16" --shapes 7b --modes full \
    --steps 8 --warmup 3 --set gradient_accumulation_steps=8 \
    --set shardswap.device_memory=48GiB --set shardswap.optimizer_state_dtype=bf16 \
    > "$OUT/7b-bf16.txt" 2>&1 || status=1
  tail -12 "$OUT/7b-unbudgeted-and-fp32.txt"
  tail -2 "$OUT/7b-bf16.txt"
fi
exit $status
