#!/usr/bin/env bash
# Every kernel of whole decoder training steps under Nsight Compute, on a machine with an NVIDIA
# GPU and ncu: `shardswap train` of CONFIG with SHARDSWAP_CUDA_PROFILE_STEPS opening the capture
# for steps FIRST..FIRST+COUNT-1 of train_step (the forward, head, backward and the gradient
# reduction they queue, then engine.step()'s gradient norm and update: the capture closes as
# step FIRST+COUNT begins; the gradients' memset is no kernel), each kernel's GPU time measured
# alone at the clocks the GPU runs at (--clock-control none) with warm caches (--cache-control
# none), then tools/bench/kernel_table.py ranks them.
#   usage: bash tools/bench/profile_step.sh OUT_DIR CONFIG [--set KEY=VALUE ...]
#   env:   BIN (default build/cuda/tools/shardswap), FIRST (3), COUNT (1), NCU (ncu)
# Writes OUT_DIR/NAME.csv (ncu's raw rows), NAME.log (the run), NAME.txt (the table) and
# NAME-sequence.txt (every launch in order), NAME the config's file name without .json.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 2 ] || { echo "usage: bash tools/bench/profile_step.sh OUT_DIR CONFIG [--set KEY=VALUE ...]" >&2; exit 2; }
out=$1 config=$2
shift 2
bin=${BIN:-build/cuda/tools/shardswap} first=${FIRST:-3} count=${COUNT:-1}
name=$(basename "$config" .json)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
SHARDSWAP_CUDA_PROFILE_STEPS=$first,$count "${NCU:-ncu}" --profile-from-start off \
  --clock-control none --cache-control none --metrics gpu__time_duration.sum \
  --csv --print-units base --log-file "$out/$name.csv" \
  "$bin" train --config "$config" --set "steps=$((first + count))" --set logging.timing=true "$@" \
  > "$out/$name.log" 2>&1
status=$?
[ $status -eq 0 ] || { tail -20 "$out/$name.log"; exit $status; }
python3 tools/bench/kernel_table.py --sequence "$out/$name.csv" > "$out/$name-sequence.txt"
python3 tools/bench/kernel_table.py --steps "$count" "$out/$name.csv" | tee "$out/$name.txt"
