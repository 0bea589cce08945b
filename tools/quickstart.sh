#!/usr/bin/env bash
# Installs what is missing, builds ShardSwap and runs the CPU quickstart training job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target shardswap_cli
./build/default/tools/shardswap train --config configs/quickstart.json --metrics build/default/quickstart-metrics.jsonl "$@"
