#!/usr/bin/env bash
# Master and optimizer state on the host, on a machine with an NVIDIA GPU: builds with preset
# cuda, runs the GPU tests of the host placement (the float64 reference, the on-device run's bits
# with pinned and pageable memory) and of the update kernels (the CPU's bits against CUDA's), then
#  1. `shardswap bench offload`: host memory bandwidth, the CPU update over every core against it,
#     PCIe both ways, and the two ways to update state that lives in pinned host memory (on the
#     CPU, or streamed through the GPU), side by side;
#  2. Qwen2.5-shaped full fine-tunes (tools/bench/train_bench.py) with the state on the device and
#     on the host (pinned; streamed and updated on the CPU), at gradient accumulation 1 and 8:
#     tokens/s, and the host plan against the host peak the trainer measured.
# Logs, JSON and a summary go under $OUT (default build/gpu-out).
#   usage: OUT=DIR [SHAPES=0.5b] [PARAMS=1G] bash tools/checks/gpu-offload-check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-out}
SHAPES=${SHAPES:-0.5b}
PARAMS=${PARAMS:-1G}
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
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli shardswap_gpu_tests >> "$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then tail -60 "$OUT/build.log"; exit 1; fi
bin=build/cuda/tools/shardswap

step "GPU tests: state on the host, update kernels"
build/cuda/tests/gpu/shardswap_gpu_tests "cuda: state on the host*,*the CPU kernels' bits*" \
  --durations yes > "$OUT/gpu-offload-tests.log" 2>&1 || status=1
grep -E "FAILED|passed|failed" "$OUT/gpu-offload-tests.log" | tail -6

step "bench offload ($PARAMS params)"
"$bin" bench offload --backend cuda --params "$PARAMS" --json "$OUT/bench-offload.json" \
  2>&1 | tee "$OUT/bench-offload.txt" || status=1

step "training, state on the device and on the host ($SHAPES)"
for accumulation in 1 8; do
  for placement in none cpu:streamed cpu:cpu; do
    device=${placement%%:*} way=${placement#*:}
    [ "$way" = none ] && way=streamed
    dir="$OUT/train-acc$accumulation-$device-$way"
    python3 tools/bench/train_bench.py --bin "$bin" --out "$dir" --shapes "$SHAPES" --modes full \
      --steps 20 --warmup 5 --set gradient_accumulation_steps=$accumulation \
      --set zero_optimization.offload_optimizer.device=$device \
      --set zero_optimization.offload_optimizer.pin_memory=true \
      --set shardswap.offload_update=$way > "$dir.txt" 2>&1 || status=1
    echo "--- accumulation $accumulation, offload_optimizer.device $device, offload_update $way"
    tail -4 "$dir.txt"
    grep -h "host memory of rank 0" "$dir"/*.log | head -2
  done
done
exit $status
