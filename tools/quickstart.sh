#!/usr/bin/env bash
# Installs what is missing, builds ShardSwap and runs the CPU quickstart training job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
cmake --preset cpu >/dev/null
cmake --build --preset cpu -j "$(nproc)" --target shardswap
./build/cpu/tools/shardswap train --config configs/quickstart.json --metrics build/cpu/quickstart-metrics.jsonl "$@"
