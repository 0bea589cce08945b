#!/bin/sh
# What `shardswap train` prints says what happened, on the quickstart decoder at one rank:
#  - a resumed run prints the restored step, active set and validation loss (the checkpoint's,
#    equal to what the first run printed after that step), not the fresh model's; its closing
#    line counts the steps this process ran and the run's total;
#  - resuming a finished run says so and exits 0 with the metrics file and checkpoints as they
#    were;
#  - after a switch that shrinks the active set, the memory check compares the plan with what
#    is held after the switch (+0.000%), not with a window that includes the bytes before it;
#  - a switch has one step number: the console's "switch before step N" is metrics line N's;
#  - steps=1 reports a rate, not "0 tokens/s"; without a measured GEMM rate the timing line says
#    "not measured", not "0% of cuBLAS";
#  - warnings go to stderr, results to stdout; --help on every command exits 0;
#  - a missing gnuplot is exit 1 naming the package to install.
# Usage: honest_output.sh SHARDSWAP REPO_ROOT
set -u
bin=$1
root=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root" || exit 1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
has() { grep -q -- "$2" "$1" || fail "'$2' not in $1: $(cat "$1")"; }
lacks() { ! grep -q -- "$2" "$1" || fail "'$2' in $1: $(grep -- "$2" "$1")"; }
small="--set world_size=1 --set logging.interval=1 --set logging.eval_interval=2"

# --- resume: the restored state, and the steps counted ---
"$bin" train --config configs/quickstart.json $small --set steps=4 \
  --set checkpoint.dir="$work/ck" --set checkpoint.every=2 --metrics "$work/m.jsonl" \
  > "$work/first.out" 2> "$work/first.err" || fail "first run: exit $?"
has "$work/first.out" "done: 4 of 4 steps,"
at4=$(sed -n 's/^validation loss after step 4: //p' "$work/first.out")
[ -n "$at4" ] || fail "no validation loss after step 4 in: $(cat "$work/first.out")"
"$bin" train --config configs/quickstart.json $small --set steps=6 \
  --set checkpoint.dir="$work/ck" --set checkpoint.every=2 --set checkpoint.load=latest \
  --metrics "$work/m.jsonl" \
  > "$work/resumed.out" 2> "$work/resumed.err" || fail "resumed run: exit $?"
has "$work/resumed.out" "step 4, "
has "$work/resumed.out" "validation loss at step 4 (resumed): $at4"
lacks "$work/resumed.out" "validation loss before training"
has "$work/resumed.out" "done: 2 steps this run (5 to 6), 6 of 6 in all,"

# --- resuming the finished run: said, exit 0, nothing changed ---
cp "$work/m.jsonl" "$work/m.before"
ls -lR --time-style=full-iso "$work/ck" > "$work/ck.before"
"$bin" train --config configs/quickstart.json $small --set steps=6 \
  --set checkpoint.dir="$work/ck" --set checkpoint.every=2 --set checkpoint.load=latest \
  --metrics "$work/m.jsonl" \
  > "$work/again.out" 2> "$work/again.err"
rc=$?
[ $rc -eq 0 ] || fail "resuming a finished run: exit $rc, not 0"
has "$work/again.out" "already finished: the checkpoint resumed is at step 6 of steps = 6"
lacks "$work/again.out" "validation loss"
cmp -s "$work/m.jsonl" "$work/m.before" || fail "the metrics file changed"
ls -lR --time-style=full-iso "$work/ck" > "$work/ck.after"
cmp -s "$work/ck.before" "$work/ck.after" || fail "the checkpoints changed: $(diff "$work/ck.before" "$work/ck.after")"

# --- a switch that shrinks the active set: checked after it; one step number ---
shrink='{"type":"explicit","schedule":[{"step":0,"active":["embed","layers.0","layers.1","layers.2","layers.3","head"]},{"step":3,"active":["embed","layers.3"]}]}'
"$bin" train --config configs/quickstart.json $small --set steps=5 \
  --set "layer_switching=$shrink" --metrics "$work/switch.jsonl" \
  > "$work/switch.out" 2> "$work/switch.err" || fail "switching run: exit $?"
has "$work/switch.out" "switch before step 4: in \[\] out \[layers.0, layers.1, layers.2, head\]"
has "$work/switch.out" "memory of rank 0 after step 4: predicted .* (+0.000%)"
python3 - "$work/switch.jsonl" <<'PY' || fail "the metrics' switch is not at step 4"
import json, sys
steps = [l["step"] for l in map(json.loads, open(sys.argv[1])) if "switch" in l]
sys.exit(0 if steps == [4] else f"switch lines at {steps}")
PY
python3 - "$work/m.before" <<'PY' || fail "the first line lacks initial_val_loss"
import json, sys
first = json.loads(open(sys.argv[1]).readline())
sys.exit(0 if first["step"] == 1 and isinstance(first.get("initial_val_loss"), float) else first)
PY

# --- one step: a rate; timing without a GEMM rate: "not measured" ---
"$bin" train --config configs/quickstart.json $small --set steps=1 --set logging.timing=true \
  > "$work/one.out" 2> "$work/one.err" || fail "one step: exit $?"
has "$work/one.out" "tokens/s (one step: with its one-off warm-up)"
lacks "$work/one.out" " 0 tokens/s"
has "$work/one.out" "model GEMM rate not measured"
lacks "$work/one.out" "of cuBLAS"

# --- warnings on stderr, results on stdout ---
"$bin" plan --config configs/quickstart.json --set gradient_clipping='"auto"' \
  > "$work/plan.out" 2> "$work/plan.err" || fail "plan with an auto value: exit $?"
has "$work/plan.err" "gradient_clipping"
lacks "$work/plan.out" "gradient_clipping"
has "$work/plan.out" "total"

# --- --help everywhere ---
for cmd in "train" "plan" "eval" "bench optimizer" "bench offload" "bench switch" "ckpt export" \
           "ckpt inspect" "plot"; do
  # shellcheck disable=SC2086
  "$bin" $cmd --help > "$work/help.out" 2>&1
  rc=$?
  [ $rc -eq 0 ] || fail "$cmd --help: exit $rc"
  grep -q "usage:" "$work/help.out" || fail "$cmd --help: no usage"
done

# --- no gnuplot: exit 1, the package named ---
PATH=/nonexistent "$bin" plot "$work/switch.jsonl" --out "$work/p.svg" > "$work/plot.out" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "plot without gnuplot: exit $rc, not 1"
has "$work/plot.out" "gnuplot-nox"
[ ! -e "$work/p.svg" ] || fail "plot without gnuplot wrote its output"

[ $failures -eq 0 ] && echo "honest_output: all checks passed"
exit $((failures != 0))
