#!/usr/bin/env bash
# Installs the Debian packages ShardSwap builds against, only those missing (idempotent).
# pkg-config reads shardswap.pc in tools/consumer-check.sh.
# gnuplot-nox draws `shardswap plot`; its CLI tests need it.
# strace injects the kills of tools/kill_campaign.py at chosen system calls.
# clang and libclang-rt-14-dev (ASan, UBSan, libFuzzer runtimes) build the fuzz targets (preset fuzz).
set -euo pipefail
packages=(build-essential cmake ninja-build libeigen3-dev libspdlog-dev libfmt-dev
          nlohmann-json3-dev catch2 libopenmpi-dev gnuplot-nox pkg-config
          clang libclang-rt-14-dev strace)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
