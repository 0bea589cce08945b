#!/usr/bin/env bash
# Run-to-run reproducibility of GPU training, on a machine with an NVIDIA GPU: configs/gpu-300m.json
# (a 304M-parameter Llama-shaped byte decoder, LISA, ZeRO-2 bf16) trained twice with each
# attention — cuDNN with its deterministic backward (the default), cuDNN with the backward that
# sums dQ with atomics (model.attention = "cudnn-atomic"), the own kernels — and at four
# in-process ranks; each pair's metrics are compared field by field (timings aside) and each
# run's tokens/s printed. Builds build/cuda (as tools/checks/gpu-check.sh does) when it is absent.
#   usage: bash tools/checks/gpu-repro-check.sh [OUT_DIR]    (logs and metrics; default build/gpu-out)
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
out=${1:-${OUT:-build/gpu-out}}
mkdir -p "$out"
bin=build/cuda/tools/shardswap
status=0
if [ ! -x "$bin" ]; then
  cmake --preset cuda > "$out/build.log" 2>&1 && cmake --build --preset cuda -j "$(nproc)" >> "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
fi

run() {  # name, model.attention ("auto": the default), then --set overrides
  local name=$1 attention=$2
  shift 2
  timeout 300 $bin train --config configs/gpu-300m.json --set "model.attention=$attention" \
    --metrics "$out/repro-$name.jsonl" "$@" > "$out/repro-$name.log" 2>&1 || status=1
  grep -E "^done|error" "$out/repro-$name.log" | sed "s/^/  $name: /"
}

same() {  # two metrics files: identical bits in every field but the timings? (the atomic
  # backward's pair is expected to differ: reported, not a failure)
  local tolerate=()
  case $1 in *atomic*) tolerate=(--differ-ok) ;; esac
  python3 tools/checks/metrics_same.py "$1" "$2" "${tolerate[@]}" || status=1
}

pair() {  # name, attention, then --set overrides: two runs and their comparison
  local name=$1 attention=$2
  shift 2
  echo "--- $name: two runs (model.attention = $attention) $*"
  run "$name-1" "$attention" "$@"
  run "$name-2" "$attention" "$@"
  grep -m1 "attention:" "$out/repro-$name-1.log" | sed 's/^/  /'
  same "$out/repro-$name-1.jsonl" "$out/repro-$name-2.jsonl"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
pair deterministic auto
pair deterministic-4ranks auto --set world_size=4 --set shardswap.communicator=in_process
pair atomic cudnn-atomic  # expected to differ: reported, not a failure
pair own own --set steps=20
exit $status
