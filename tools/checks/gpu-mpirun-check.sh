#!/usr/bin/env bash
# One process per rank on GPUs, on a machine with NVIDIA GPUs and an MPI: each config trained by
# the threaded launch (`shardswap train`) and by `mpirun -np N shardswap train`, NCCL between the
# ranks either way; the two metrics files must agree in every field but the timings and the
# driver's free-memory sample. N = 1 always (world 1 over NCCL, ranks from MPI); N = 2 too where
# the machine has two GPUs or more (one GPU per local rank). Builds build/cuda (as
# tools/checks/gpu-check.sh does) when it is absent.
#   usage: bash tools/checks/gpu-mpirun-check.sh [OUT_DIR]   (logs and metrics; default build/gpu-out)
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
grep -q "MPI launch: ON" "$out/build.log" 2>/dev/null || [ ! -f "$out/build.log" ] \
  || { echo "build/cuda was configured without MPI (install libopenmpi-dev)"; exit 1; }

run() {  # name, launcher ("" or the process count), then train's arguments
  local name=$1 np=$2
  shift 2
  local launcher=()
  [ -n "$np" ] && launcher=(sh tests/cli/mpirun.sh "$np")
  timeout 300 "${launcher[@]}" "$bin" train --metrics "$out/$name.jsonl" "$@" \
    > "$out/$name.log" 2> "$out/$name.err" || { status=1; tail -5 "$out/$name.err"; }
  grep -E "^done|^rank|error" "$out/$name.log" "$out/$name.err" | sed "s/^/  $name: /"
}

same() {  # two metrics files: identical bits in every field but the timings?
  python3 tools/checks/metrics_same.py "$1" "$2" || status=1
}

pair() {  # name, process count, then train's arguments
  local name=$1 np=$2
  shift 2
  echo "--- $name: threaded launch and mpirun -np $np: $*"
  run "$name-threaded" "" "$@"
  run "$name-mpirun" "$np" "$@"
  same "$out/$name-threaded.jsonl" "$out/$name-mpirun.jsonl"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mpirun --version 2>/dev/null | head -1
git rev-parse --short HEAD 2>/dev/null || true
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
cuda=(--set shardswap.backend=cuda --set shardswap.communicator=nccl)
pair gpu-300m-lisa 1 --config configs/gpu-300m.json
pair quickstart-cuda 1 --config configs/quickstart.json --set world_size=1 "${cuda[@]}" \
  --set steps=60 --set logging.eval_interval=20
if [ "$gpus" -ge 2 ]; then
  pair gpu-300m-lisa-2gpu 2 --config configs/gpu-300m.json --set world_size=2
  pair quickstart-cuda-2gpu 2 --config configs/quickstart.json --set world_size=2 "${cuda[@]}" \
    --set steps=60 --set logging.eval_interval=20
else
  echo "--- one GPU here: mpirun -np 2 (one GPU per local rank) not run"
fi
exit $status
