#!/bin/sh
# A command whose result cannot be written to stdout (a full disk: /dev/full; a closed stdout)
# exits 1 naming stdout and why, never 0: plan, eval, ckpt inspect, --help, and train (which still
# runs to its end: its checkpoint is saved). The same commands into a file exit 0.
# Usage: stdout_errors.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/tiny_decoder.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
small="--set world_size=1 --set logging.eval_batches=2"

# full NAME EXPECTED_TEXT COMMAND...: exit 1 with EXPECTED_TEXT on stderr, stdout on /dev/full
full() {
  name=$1 text=$2
  shift 2
  "$@" > /dev/full 2> "$work/err"
  code=$?
  if [ "$code" -ne 1 ]; then
    echo "FAIL $name: exit $code, expected 1: $(head -c 300 "$work/err")"
    failures=$((failures + 1)); return
  fi
  if grep -q -- "$text" "$work/err"; then
    echo "ok   $name: $(grep -- "$text" "$work/err")"
  else
    echo "FAIL $name: stderr lacks '$text': $(head -c 300 "$work/err")"
    failures=$((failures + 1))
  fi
}
# good NAME EXPECTED_TEXT COMMAND...: into a file, exit 0 and EXPECTED_TEXT in it
good() {
  name=$1 text=$2
  shift 2
  "$@" > "$work/out" 2> "$work/err"
  code=$?
  if [ "$code" -eq 0 ] && grep -q -- "$text" "$work/out"; then
    echo "ok   $name"
  else
    echo "FAIL $name: exit $code, stdout $(head -c 200 "$work/out"), stderr $(head -c 200 "$work/err")"
    failures=$((failures + 1))
  fi
}

# shellcheck disable=SC2086
good "train into a file" "done: 2 of 2 steps" "$bin" train --config "$config" $small \
  --set steps=2 --set checkpoint.dir="$work/ck" --set checkpoint.every=2
ck="$work/ck/step-00000002"
# shellcheck disable=SC2086
good "plan into a file" "^total" "$bin" plan --config "$config" $small
# shellcheck disable=SC2086
good "eval into a file" "validation loss" "$bin" eval --config "$config" $small \
  --checkpoint "$ck"
good "ckpt inspect into a file" "step" "$bin" ckpt inspect "$ck"

nospace="stdout: No space left on device"
# shellcheck disable=SC2086
full "plan onto a full disk" "$nospace" "$bin" plan --config "$config" $small
# shellcheck disable=SC2086
full "eval onto a full disk" "$nospace" "$bin" eval --config "$config" $small --checkpoint "$ck"
full "ckpt inspect onto a full disk" "$nospace" "$bin" ckpt inspect "$ck"
full "--help onto a full disk" "$nospace" "$bin" plan --help
# shellcheck disable=SC2086
full "train onto a full disk" "$nospace" "$bin" train --config "$config" $small \
  --set steps=2 --set checkpoint.dir="$work/ck2" --set checkpoint.every=2
if [ -f "$work/ck2/step-00000002/metadata.json" ]; then
  echo "ok   train onto a full disk still saved its checkpoint"
else
  echo "FAIL train onto a full disk saved no checkpoint: $(ls -R "$work/ck2" 2>&1)"
  failures=$((failures + 1))
fi

# A closed stdout: the write fails with EBADF.
# shellcheck disable=SC2086
"$bin" plan --config "$config" $small >&- 2> "$work/err"
code=$?
if [ "$code" -eq 1 ] && grep -q "stdout: Bad file descriptor" "$work/err"; then
  echo "ok   plan with stdout closed: $(cat "$work/err")"
else
  echo "FAIL plan with stdout closed: exit $code: $(head -c 300 "$work/err")"
  failures=$((failures + 1))
fi

[ "$failures" -eq 0 ]
