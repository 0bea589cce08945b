#!/bin/sh
# Two `shardswap train` processes on one checkpoint.dir: the second is refused at start (exit 1),
# naming the directory and the first's pid and host, and writes nothing; the first finishes as if
# alone; once it is done the directory is free again. A checkpoint.dir that cannot take files is
# refused before the first step (exit 2), naming it.
# Usage: checkpoint_lock.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/byte_lm.json
work=$(mktemp -d)
first=
trap '[ -n "$first" ] && kill "$first" 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "FAIL $*"; exit 1; }
# A small model, so that the runs are quick. It execs (so that $! is the run's pid): call it in
# a subshell.
small() {
  exec "$bin" train --config "$config" --set world_size=2 --set model.width=32 --set model.hidden=64 \
    --set model.depth=2 --set train_micro_batch_size_per_gpu=16 --set logging.eval_interval=100000 \
    "$@"
}

small --set steps=2000 --set checkpoint.dir="$work/ck" --set checkpoint.every=1000 \
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
case "$out" in *"shardswap train: byte_lm"*) fail "the refused run built its model" ;; esac

wait "$first"
code=$?
first=
[ "$code" -eq 0 ] || fail "the first run exited $code: $(tail -5 "$work/first.log")"
[ "$(wc -l < "$work/first.jsonl")" -eq 2000 ] || fail "the first run's metrics are not 2000 lines"
for step in 00001000 00002000; do
  [ -f "$work/ck/step-$step/metadata.json" ] || fail "step-$step missing: $(ls -a "$work/ck")"
done
"$bin" ckpt inspect "$work/ck/step-00002000" > /dev/null || fail "step-00002000 does not verify"
echo "first run: exit 0, 2000 steps, checkpoints 1000 and 2000 present, 2000 verified"

out=$(small --set steps=2002 --set checkpoint.dir="$work/ck" --set checkpoint.load=latest 2>&1) ||
  fail "a run after the first could not take the directory: $out"
echo "after the first: the directory taken again, resumed at step 2000"

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
