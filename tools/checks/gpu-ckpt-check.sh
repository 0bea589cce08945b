#!/usr/bin/env bash
# Checkpoints on the GPU machine (after tools/checks/gpu-check.sh has built build/cuda): exact resume of a
# LISA run on the cuda backend, then `shardswap ckpt export` read back by Python's safetensors.
#   usage: bash tools/checks/gpu-ckpt-check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/gpu-out}
bin=build/cuda/tools/shardswap
status=0
sh tools/checks/resume-check.sh $bin configs/lisa.json 60 --set shardswap.backend=cuda \
  --set layer_switching.policy=keep_host || status=1
dir=$(mktemp -d)
$bin train --config configs/lisa.json --set shardswap.backend=cuda --set steps=30 \
  --set checkpoint.dir="$dir" --set checkpoint.every=30 > "$out/ckpt-train.log" 2>&1 || status=1
ckpt=$(ls -d "$dir"/step-* | tail -1)
$bin ckpt inspect "$ckpt" | tee "$out/ckpt-inspect.txt" || status=1
$bin ckpt export "$ckpt" --out "$dir/model.safetensors" || status=1
$bin ckpt export "$ckpt" --out "$dir/master.safetensors" --master || status=1
python3 tools/bench/check_safetensors.py "$ckpt" "$dir/model.safetensors" "$dir/master.safetensors" \
  || status=1
rm -rf "$dir"
exit $status
