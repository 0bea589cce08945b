#!/bin/sh
# Every class of bad input to `shardswap train` (and `plan`): exit code 2, a message naming the key
# or the file, and nothing written (no metrics file). Usage: bad_input.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/quickstart.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
cases=0

# expect NAME EXPECTED_TEXT ARGS... : runs `train ARGS --metrics $work/m.jsonl`
expect() {
  name=$1 text=$2
  shift 2
  cases=$((cases + 1))
  rm -f "$work/m.jsonl"
  out=$("$bin" train "$@" --metrics "$work/m.jsonl" 2>&1)
  code=$?
  if [ "$code" -ne 2 ]; then
    echo "FAIL $name: exit $code, expected 2: $out"; failures=$((failures + 1)); return
  fi
  case "$out" in
    *"$text"*) ;;
    *) echo "FAIL $name: message lacks '$text': $out"; failures=$((failures + 1)); return ;;
  esac
  if [ -e "$work/m.jsonl" ]; then
    echo "FAIL $name: the metrics file was written"; failures=$((failures + 1)); return
  fi
  echo "ok   $name: $out" | head -c 300; echo
}

printf '{\n  "steps": 3,\n  "world_size": 2,,\n}\n' > "$work/malformed.json"
expect "malformed JSON (file, line and column)" "malformed.json:3:" --config "$work/malformed.json"
expect "missing config file" "/nonexistent/run.json" --config /nonexistent/run.json
expect "wrong type" "optimizer.params.lr" --config "$config" --set 'optimizer.params.lr="fast"'
expect "negative size" "train_micro_batch_size_per_gpu" --config "$config" \
  --set train_micro_batch_size_per_gpu=-4
expect "zero size" "model.width" --config "$config" --set model.width=0
expect "negative bucket" "zero_optimization.reduce_bucket_size" --config "$config" \
  --set zero_optimization.reduce_bucket_size=-1
expect "missing data file" "data.path" --config "$config" --set data.path=/nonexistent/corpus.txt
expect "ZeRO stage 3" "not supported" --config "$config" --set zero_optimization.stage=3
expect "batch sizes that do not multiply out" "train_batch_size" --config "$config" \
  --set train_batch_size=1000
expect "unknown key in model" "model.widht" --config "$config" --set model.widht=3
expect "unknown key in logging" "logging.intervall" --config "$config" --set logging.intervall=3
expect "unknown key in layer_switching" "layer_switching.gama" --config "$config" \
  --set layer_switching.type=lisa --set 'layer_switching.layers=["layers.0","layers.1"]' \
  --set layer_switching.gama=1

cases=$((cases + 1))
out=$("$bin" plan --config "$config" --set model.depth=-1 2>&1)
if [ $? -ne 2 ]; then echo "FAIL plan: bad depth did not exit 2: $out"; failures=$((failures + 1)); fi

echo "$cases cases, $failures failed"
[ "$failures" -eq 0 ]
