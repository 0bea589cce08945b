#!/bin/sh
# model.recompute_layers from the CLI: configs/quickstart.json (a 4-layer byte decoder) trained
# 2 steps at one rank with every layer recomputed in backward gives the same metrics, bit for bit
# (timings aside), as without (two steps: the second's loss has seen the first's gradients);
# `shardswap plan` counts fewer activation bytes for both backends (the cuda backend's plan needs
# no GPU); a value outside [0, num_hidden_layers] is refused with exit 2, naming the key, before
# anything is written. (tests/model/decoder_cpu_test.cpp covers every R at several ranks; the GPU
# tests the cuda backend's bits.)
# Usage: decoder_recompute.sh SHARDSWAP REPO_ROOT
set -u
bin=$1
root=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root" || exit 1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

for r in 0 4; do
  "$bin" train --config configs/quickstart.json --set steps=2 --set world_size=1 \
    --set logging.interval=1 --set logging.eval_interval=2 \
    --set model.recompute_layers=$r --metrics "$work/m$r.jsonl" > "$work/out$r.log" 2>&1 \
    || fail "train with recompute_layers=$r: exit $? ($(tail -1 "$work/out$r.log"))"
done
python3 - "$work/m0.jsonl" "$work/m4.jsonl" <<'PY' || fail "metrics differ with recompute_layers=4"
import json, sys
timing = {"step_seconds", "tokens_per_s", "memory_bytes"}
a, b = ([{k: v for k, v in json.loads(l).items() if k not in timing} for l in open(p)]
        for p in sys.argv[1:3])
if len(a) < 2 or a != b:
    sys.exit(f"{len(a)} / {len(b)} records; first difference: "
             f"{next(((x, y) for x, y in zip(a, b) if x != y), None)}")
PY

activation() {  # plan's activation bytes (rank 0) for backend $1, recompute_layers=$2
  "$bin" plan --config configs/quickstart.json --set shardswap.backend=$1 \
    --set model.recompute_layers=$2 | awk '$1 == "activation" { print $2; exit }'
}
for backend in cpu cuda; do
  a0=$(activation $backend 0) a4=$(activation $backend 4)
  echo "$backend activation bytes: recompute 0: $a0, recompute 4: $a4"
  [ -n "$a0" ] && [ -n "$a4" ] && [ "$a4" -lt "$a0" ] ||
    fail "plan ($backend): activation '$a4' not below '$a0'"
done

refused() {  # refused CASE EXPECT --set ...: exit 2, EXPECT in the message, no metrics file
  name=$1 expect=$2
  shift 2
  "$bin" train --config configs/quickstart.json --metrics "$work/bad.jsonl" "$@" > "$work/bad.log" 2>&1
  rc=$?
  [ $rc -eq 2 ] || fail "$name: exit $rc, not 2"
  grep -q -- "$expect" "$work/bad.log" || fail "$name: '$expect' not in: $(cat "$work/bad.log")"
  [ ! -e "$work/bad.jsonl" ] || fail "$name: a metrics file was written"
  rm -f "$work/bad.jsonl"
}
refused "negative" "model.recompute_layers = -1" --set model.recompute_layers=-1
refused "above the layers" "model.recompute_layers = 5" --set model.recompute_layers=5
refused "above the layers (cuda)" "model.recompute_layers = 5" --set model.recompute_layers=5 \
  --set shardswap.backend=cuda

[ $failures -eq 0 ] && echo "decoder_recompute: all checks passed"
exit $((failures != 0))
