#!/bin/sh
# Two `shardswap train` processes on one checkpoint.dir: the second is refused at start (exit 1),
# naming the directory and the first's pid and host, and writes nothing; the first finishes as if
# alone; once it is done the directory is free again. A checkpoint.dir that cannot take files is
# refused before the first step (exit 2), naming it.
# Usage: checkpoint_lock.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/tiny_decoder.json
work=$(mktemp -d)
first=
trap '[ -n "$first" ] && kill "$first" 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "FAIL $*"; exit 1; }
# A small model, so that the runs are quick. It execs (so that $! is the run's pid): call it in
# a subshell.
small() {
  exec "$bin" train --config "$config" --set world_size=2 --set logging.eval_interval=100000 "$@"
}

small --set steps=200 --set checkpoint.dir="$work/ck" --set checkpoint.every=100 \
  --metrics "$work/first.jsonl" > "$work/first.log" 2>&1 &
first=$!
tries=0
while [ ! -s "$work/first.jsonl" ]; do  # training, not just starting
  kill -0 "$first" 2>/dev/null || fail "the first run ended before its first step: $(cat "$work/first.log")"
  tries=$((tries + 1))
  [ "$tries" -lt 600 ] || fail "the first run made no step in 60 s"
  sleep 0.1
done

out=$(small --set steps=10 --set checkpoint.dir="$work/ck" --set checkpoint.every=2 \
  --metrics "$work/second.jsonl" 2>&1)
code=$?
kill -0 "$first" 2>/dev/null ||
  fail "the first run was over before the second was refused: the check proves nothing"
echo "second run: exit $code: $out"
[ "$code" -eq 1 ] || fail "the second run exited $code, expected 1"
case "$out" in *"'$work/ck'"*) ;; *) fail "the message does not name the directory" ;; esac
case "$out" in
  *"pid $first on host $(uname -n)"*) ;;
  *) fail "the message does not name the holder, pid $first on host $(uname -n)" ;;
esac
[ ! -s "$work/second.jsonl" ] || fail "the refused run wrote metrics"
case "$out" in *"shardswap train: decoder"*) fail "the refused run built its model" ;; esac

wait "$first"
code=$?
first=
[ "$code" -eq 0 ] || fail "the first run exited $code: $(tail -5 "$work/first.log")"
[ "$(wc -l < "$work/first.jsonl")" -eq 200 ] || fail "the first run's metrics are not 200 lines"
for step in 00000100 00000200; do
  [ -f "$work/ck/step-$step/metadata.json" ] || fail "step-$step missing: $(ls -a "$work/ck")"
done
"$bin" ckpt inspect "$work/ck/step-00000200" > /dev/null || fail "step-00000200 does not verify"
echo "first run: exit 0, 200 steps, checkpoints 100 and 200 present, 200 verified"

out=$(small --set steps=202 --set checkpoint.dir="$work/ck" --set checkpoint.load=latest 2>&1) ||
  fail "a run after the first could not take the directory: $out"
echo "after the first: the directory taken again, resumed at step 200"

# Before the first step: a checkpoint.dir under a regular file (fails for root too).
printf 'not a directory\n' > "$work/file"
out=$(small --set steps=10 --set checkpoint.dir="$work/file/ck" --set checkpoint.every=5 \
  --metrics "$work/third.jsonl" 2>&1)
code=$?
echo "under a regular file: exit $code: $out"
[ "$code" -eq 2 ] || fail "exit $code, expected 2"
case "$out" in *"'$work/file/ck'"*"Not a directory"*) ;; *) fail "the directory or the reason is not named" ;; esac
[ ! -s "$work/third.jsonl" ] || fail "steps ran before the refusal"
echo "ok"
