#!/bin/sh
# A metrics file that stops taking lines (a full disk, here the file size limit: with SIGXFSZ
# ignored, write(2) fails with EFBIG like it fails with ENOSPC on a full disk): by default the run
# fails with exit 1 naming the file and the step; with --metrics-errors=warn it goes on, exits 0
# and says how many lines were lost. Either way the file holds whole lines only.
# Usage: metrics_full_disk.sh SHARDSWAP CONFIG
set -u
bin=$1 config=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
trap '' XFSZ  # inherited by the runs below: a write past the limit fails instead of killing
failures=0
steps=30
small="--set world_size=2"
small="$small --set train_micro_batch_size_per_gpu=4 --set logging.eval_batches=2"

# run METRICS [more args]: the train under a limit of 8 blocks (4 or 8 KiB, as the shell counts
# them): room for a few lines of about 450 bytes. Its output goes to a pipe, which has no limit.
run() {
  m=$1
  shift
  # shellcheck disable=SC2086
  out=$( (ulimit -f 8 && exec "$bin" train --config "$config" $small --set steps=$steps \
            --metrics "$m" "$@") 2>&1)
  code=$?
}
whole_lines() {  # FILE: every line is a complete JSON object and the file ends with a newline
  python3 - "$1" <<'PY'
import json, sys
data = open(sys.argv[1], "rb").read()
assert data.endswith(b"\n"), "the file ends in a cut-off line"
print(sum(1 for line in data.decode().splitlines() if json.loads(line)))
PY
}

run "$work/fail.jsonl"
lines=$(whole_lines "$work/fail.jsonl") || { echo "FAIL: $work/fail.jsonl holds a partial line"; failures=$((failures + 1)); }
if [ "$code" -eq 1 ] && echo "$out" | grep -q "metrics '$work/fail.jsonl': cannot write the line of step [0-9]*: File too large"; then
  echo "ok   default: exit 1 naming the file and the step: $(echo "$out" | tail -1)"
else
  echo "FAIL default: exit $code, expected 1 naming $work/fail.jsonl:"; echo "$out" | tail -3
  failures=$((failures + 1))
fi
[ "${lines:-0}" -gt 0 ] && [ "${lines:-0}" -lt $steps ] ||
  { echo "FAIL default: the limit let ${lines:-?} of $steps lines through"; failures=$((failures + 1)); }

run "$work/warn.jsonl" --metrics-errors=warn
lines=$(whole_lines "$work/warn.jsonl") || { echo "FAIL: $work/warn.jsonl holds a partial line"; failures=$((failures + 1)); }
lost=$((steps - ${lines:-0}))
if [ "$code" -eq 0 ] && echo "$out" | grep -q "warning: --metrics '$work/warn.jsonl': cannot write the line of step" &&
   echo "$out" | grep -q "warning: --metrics '$work/warn.jsonl': $lost of $steps lines lost"; then
  echo "ok   warn: exit 0, $lost of $steps lines counted lost: $(echo "$out" | grep 'lines lost')"
else
  echo "FAIL warn: exit $code, expected 0 and '$lost of $steps lines lost':"; echo "$out" | tail -4
  failures=$((failures + 1))
fi

[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
