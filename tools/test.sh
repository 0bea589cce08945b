#!/usr/bin/env bash
# Installs what is missing, builds ShardSwap (preset "cpu") and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
cmake --preset cpu
cmake --build --preset cpu -j "$(nproc)"
ctest --preset cpu -j "$(nproc)"
