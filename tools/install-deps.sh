#!/usr/bin/env bash
# Installs the Debian packages ShardSwap builds against, only those missing (idempotent), the
# Python package its tokenizer tool needs, and TensorBoard (its event files' CLI test reads them).
# pkg-config reads shardswap.pc in tools/checks/consumer-check.sh.
# gnuplot-nox draws `shardswap plot`; its CLI tests need it.
# strace injects the kills of tools/checks/kill_campaign.py at chosen system calls.
# python3-jinja2 renders chat templates in tools/data/tokenize_data.py --chat, as transformers does.
# clang and libclang-rt-14-dev (ASan, UBSan, libFuzzer runtimes) build the fuzz targets (preset fuzz).
set -euo pipefail
packages=(build-essential cmake ninja-build libeigen3-dev libspdlog-dev libfmt-dev
          nlohmann-json3-dev catch2 libopenmpi-dev gnuplot-nox pkg-config
          clang libclang-rt-14-dev strace python3-jinja2)
# A Python package from PyPI for the user, where it is missing; a test that needs it reports as
# skipped, saying why, where it cannot be installed.
pip_user() {  # PACKAGE WHAT-IS-SKIPPED
  python3 -c "import $1" 2>/dev/null && return 0
  echo "install-deps: pip install --user $1"
  python3 -m pip install --quiet --user "$1" 2>/dev/null ||
    python3 -m pip install --quiet --user --break-system-packages "$1" ||
    echo "install-deps: $1 could not be installed; $2 is skipped"
}
# tools/data/tokenize_data.py uses Hugging Face tokenizers, and so does its CLI test.
pip_user tokenizers "the tokenizer tool's test"
# tests/cli/tensorboard.sh reads the tensorboard section's event files with TensorBoard's reader.
pip_user tensorboard "the tensorboard CLI test"
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
