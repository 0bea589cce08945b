#!/usr/bin/env bash
# Installs what is missing, builds ShardSwap (preset "default") and runs the whole test suite;
# then the reliability passes: the CPU suite again under ASan + UBSan (preset "asan", any report
# fails its test), and the libFuzzer targets (preset "fuzz", clang): once over their committed
# corpora (CTest) and, with FUZZ_SECONDS > 0, for that many seconds each (tools/fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
jobs="$(nproc)"
cmake --preset default
cmake --build --preset default -j "$jobs"
ctest --preset default -j "$jobs"

cmake --preset asan
cmake --build --preset asan -j "$jobs"
# Its own TMPDIR (the asan test preset sets it): temporary files of the two passes stay apart.
mkdir -p build/asan/tmp
ctest --preset asan -j "$jobs"

cmake --preset fuzz
cmake --build --preset fuzz -j "$jobs"
ctest --preset fuzz -j "$jobs"
# Timed fuzzing (tools/fuzz.sh, 60 s a target) is not in CI yet: a new finding would fail an
# unrelated change nondeterministically. Run it by hand: FUZZ_SECONDS=60 bash tools/fuzz.sh 60
if [ "${FUZZ_SECONDS:-0}" -gt 0 ]; then bash tools/fuzz.sh "$FUZZ_SECONDS" build/fuzz; fi
