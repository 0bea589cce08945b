#!/usr/bin/env bash
# Fetch, on this machine, the Python packages the peer benchmarks need on the GPU machine and
# leave them as wheels in .whl/ (git-ignored), to be copied with the tree to the GPU machine.
#
# The GPU machine (Python 3.12, manylinux x86_64) already has torch 2.11, numpy, safetensors,
# einops, msgpack, ninja, packaging, psutil, py-cpuinfo and tqdm (KINDS.md's package list), so only
# DeepSpeed and what it needs beyond those travel. torch is never downloaded.
#
# DeepSpeed is published as an sdist only. Its setup.py builds without torch when no op is
# pre-compiled (DS_BUILD_OPS=0), giving a pure-Python py3 wheel; the CUDA ops (FusedAdam) are then
# JIT-built on the GPU machine by torch.utils.cpp_extension with its nvcc. So the wheel is built
# here, once, and the device installs wheels only, offline.
#   usage: bash tools/peers/download-wheels.sh        (from anywhere; writes <repo>/.whl)
set -euo pipefail
cd "$(dirname "$0")/../.."
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
dest=.whl
py=${PYTHON:-python3}

# Pure-Python or manylinux cp312 wheels; versions pinned so that two runs carry the same bytes.
# typing-extensions travels too: pydantic-core needs >= 4.14.1 and the machine's version is unread.
deps=(
  "hjson==3.1.0"
  "pydantic==2.12.5"
  "pydantic-core==2.41.5"
  "annotated-types==0.7.0"
  "typing-inspection==0.4.2"
  "typing-extensions==4.15.0"
)

rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${deps[@]}"

# DeepSpeed: sdist -> py3 wheel, no ops pre-compiled, accelerator forced to cuda so that the
# recorded accelerator name does not depend on this GPU-less machine.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip download --quiet --no-deps --no-binary=:all: -d "$work" "deepspeed==$DEEPSPEED_VERSION"
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$py" -m pip wheel --quiet --no-deps -w "$dest" \
  "$work/deepspeed-$DEEPSPEED_VERSION.tar.gz" > "$work/wheel.log" 2>&1 \
  || { tail -40 "$work/wheel.log"; echo "download-wheels.sh: building the DeepSpeed wheel failed" >&2; exit 1; }

# One version of each package, or pip's --no-deps install into one target stops.
dups=$(ls "$dest" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dups" ] || { echo "download-wheels.sh: two versions of: $dups" >&2; exit 1; }

ls -l "$dest"
bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
echo "total: $bytes bytes ($((bytes / 1024)) KiB) in $(ls "$dest" | wc -l) wheels; limit $limit"
[ "$bytes" -lt "$limit" ] || { echo "download-wheels.sh: .whl exceeds 64 MiB, more than we copy to the GPU machine" >&2; exit 1; }
