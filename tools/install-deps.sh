#!/usr/bin/env bash
# Installs the Debian packages ShardSwap builds against, only those missing (idempotent), and the
# Python package its tokenizer tool needs.
# pkg-config reads shardswap.pc in tools/consumer-check.sh.
# gnuplot-nox draws `shardswap plot`; its CLI tests need it.
# strace injects the kills of tools/kill_campaign.py at chosen system calls.
# clang and libclang-rt-14-dev (ASan, UBSan, libFuzzer runtimes) build the fuzz targets (preset fuzz).
set -euo pipefail
packages=(build-essential cmake ninja-build libeigen3-dev libspdlog-dev libfmt-dev
          nlohmann-json3-dev catch2 libopenmpi-dev gnuplot-nox pkg-config
          clang libclang-rt-14-dev strace)
# tools/tokenize_data.py uses Hugging Face tokenizers (PyPI), and so does its CLI test, which
# reports as skipped, saying why, where it cannot be installed.
if ! python3 -c "import tokenizers" 2>/dev/null; then
  echo "install-deps: pip install --user tokenizers"
  python3 -m pip install --quiet --user tokenizers 2>/dev/null ||
    python3 -m pip install --quiet --user --break-system-packages tokenizers ||
    echo "install-deps: tokenizers could not be installed; the tokenizer tool's test is skipped"
fi
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
