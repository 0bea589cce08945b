#!/usr/bin/env bash
# Installs what is missing, builds ShardSwap (preset "default") and runs the whole test suite
# and the consumer checks (tools/checks/consumer-check.sh), then the kill campaign (tools/checks/kill_campaign.py);
# then the reliability passes: the CPU suite again under ASan + UBSan (preset "asan", any report
# fails its test), and the libFuzzer targets (preset "fuzz", clang): once over their committed
# corpora (CTest), then for FUZZ_SECONDS (default 60) each from those corpora (tools/checks/fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
jobs="$(nproc)"
cmake --preset default
cmake --build --preset default -j "$jobs"
ctest --preset default -j "$jobs"
# ShardSwap as other projects use it: installed (find_package, pkg-config) and add_subdirectory.
bash tools/checks/consumer-check.sh
# Kills at random moments and at each rename, fsync, unlink and mkdir of the saves and prunes of a
# small run, each followed by resumes until it finishes: bounded to KILL_SECONDS (default 240).
python3 tools/checks/kill_campaign.py build/default/tools/shardswap "${KILL_SECONDS:-240}"

cmake --preset asan
cmake --build --preset asan -j "$jobs"
# Its own TMPDIR (the asan test preset sets it): temporary files of the two passes stay apart.
mkdir -p build/asan/tmp
ctest --preset asan -j "$jobs"
# The sanitized library as consumers install it: it must hand them its -fsanitize flags.
bash tools/checks/consumer-check.sh build/asan

cmake --preset fuzz
cmake --build --preset fuzz -j "$jobs"
ctest --preset fuzz -j "$jobs"
# Bounded fuzzing from the committed corpora: 60 s a target (FUZZ_SECONDS), seed 1 (FUZZ_SEED),
# so a run tries the same inputs each time and cannot fail an unrelated change by luck. Longer
# runs with fresh seeds are for by hand: FUZZ_SEED=0 bash tools/checks/fuzz.sh 600
FUZZ_SEED="${FUZZ_SEED:-1}" bash tools/checks/fuzz.sh "${FUZZ_SECONDS:-60}" build/fuzz
