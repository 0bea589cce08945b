#!/usr/bin/env bash
# Runs each libFuzzer target of tests/fuzz for a bounded time on a copy of its committed corpus
# (the committed seeds stay as they are; new inputs go to the copy). Any crash, sanitizer report,
# unexpected exception, timeout or out-of-memory fails the script, and the input that caused it
# is left in the work directory (printed) to be added to tests/fuzz/corpus as a regression test.
#   tools/checks/fuzz.sh [SECONDS_PER_TARGET (default 60)] [BUILD_DIR (default build/fuzz)]
# FUZZ_SEED=N fixes libFuzzer's random seed (CI uses 1): the same binary then tries the same
# inputs in the same order, so a run can only differ by how far it gets in the time given.
# Unset or 0: a new seed each run (libFuzzer's default), for longer runs by hand.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-60}"
build="${2:-build/fuzz}"
work="$(mktemp -d "${TMPDIR:-/tmp}/shardswap-fuzz.XXXXXX")"
export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}"
status=0
for target in config checkpoint safetensors hf_config; do
  corpus="$work/$target-corpus"
  mkdir -p "$corpus" "$work/$target-artifacts"
  cp tests/fuzz/corpus/"$target"/* "$corpus"/
  echo "fuzz.sh: $target for ${seconds}s on $(ls "$corpus" | wc -l) seeds"
  # -rss_limit_mb / -timeout: a config that asks for terabytes or loops forever is a finding too.
  if ! "$build/tests/fuzz/shardswap_fuzz_$target" -max_total_time="$seconds" -timeout=10 \
      -seed="${FUZZ_SEED:-0}" \
      -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$work/$target-artifacts/" "$corpus" 2>&1 | tail -n 40; then
    status=1
  fi
  if [ -n "$(ls "$work/$target-artifacts")" ]; then
    echo "fuzz.sh: $target FOUND: $(ls "$work/$target-artifacts")"
    status=1
  fi
  echo "fuzz.sh: $target corpus now $(ls "$corpus" | wc -l) inputs"
done
if [ "$status" -eq 0 ]; then
  rm -rf "$work"
else
  echo "fuzz.sh: findings kept in $work"
fi
exit "$status"
