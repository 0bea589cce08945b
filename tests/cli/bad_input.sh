#!/bin/sh
# Every class of bad input to `shardswap train` (and `plan`): exit code 2, a message in the one
# shape of config mistakes ("shardswap: FILE: KEY = VALUE: what" or "shardswap: FILE: KEY: what",
# no C++ function names), and nothing written (no metrics file).
# Usage: bad_input.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/tiny_decoder.json
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
  # Bounded: a command that blocks (on a FIFO, say) fails the case instead of hanging the test.
  out=$(timeout 60 "$bin" train "$@" --metrics "$work/m.jsonl" 2>&1)
  code=$?
  if [ "$code" -ne 2 ]; then
    echo "FAIL $name: exit $code, expected 2: $out"; failures=$((failures + 1)); return
  fi
  case "$out" in
    *"$text"*) ;;
    *) echo "FAIL $name: message lacks '$text': $out"; failures=$((failures + 1)); return ;;
  esac
  case "$out" in
    *::*|*_from_name*)
      echo "FAIL $name: message names C++ code: $out"; failures=$((failures + 1)); return ;;
  esac
  if [ -e "$work/m.jsonl" ]; then
    echo "FAIL $name: the metrics file was written"; failures=$((failures + 1)); return
  fi
  echo "ok   $name: $out" | head -c 300; echo
}

printf '{\n  "steps": 3,\n  "world_size": 2,,\n}\n' > "$work/malformed.json"
expect "malformed JSON (file, line and column)" "shardswap: $work/malformed.json:3:" \
  --config "$work/malformed.json"
expect "missing config file" "shardswap: /nonexistent/run.json: cannot open the config file" \
  --config /nonexistent/run.json
expect "wrong type" "shardswap: $config: optimizer.params.lr = \"fast\": must be a number" \
  --config "$config" --set 'optimizer.params.lr="fast"'
expect "negative size" "shardswap: $config: train_micro_batch_size_per_gpu = -4: must be >= 1" \
  --config "$config" --set train_micro_batch_size_per_gpu=-4
expect "zero size" "shardswap: $config: model.hidden_size = 0: must be in [1, " --config "$config" \
  --set model.hidden_size=0
expect "negative bucket" \
  "shardswap: $config: zero_optimization.reduce_bucket_size = -1 elements: must be >= 1" \
  --config "$config" --set zero_optimization.reduce_bucket_size=-1
expect "missing data file" \
  "shardswap: $config: data.train = \"/nonexistent/corpus.txt\": no such file" \
  --config "$config" --set data.train=/nonexistent/corpus.txt
expect "ZeRO stage 3" "shardswap: $config: zero_optimization.stage = 3: ZeRO-3" \
  --config "$config" --set zero_optimization.stage=3
expect "batch sizes that do not multiply out" "shardswap: $config: train_batch_size = 1000: " \
  --config "$config" --set train_batch_size=1000
expect "unknown optimizer" \
  "shardswap: $config: optimizer.type = \"Adagrad\": unknown optimizer type" --config "$config" --set optimizer.type=Adagrad
expect "unknown backend" "shardswap: $config: shardswap.backend = \"tpu\": expected cpu, cuda" \
  --config "$config" --set shardswap.backend=tpu
expect "unknown schedule type" \
  "shardswap: $config: layer_switching.type = \"galore\": expected none, lisa, badam or explicit" \
  --config "$config" --set layer_switching.type=galore
expect "negative checkpoint interval" "shardswap: $config: checkpoint.every = -1: must be >= 0" \
  --config "$config" --set checkpoint.every=-1
expect "unknown key in model" \
  "shardswap: $config: model.hiden_size: not a key of ShardSwap's section model (did you mean 'model.hidden_size'?)" \
  --config "$config" --set model.hiden_size=3
expect "the removed byte LM's model.type" \
  "shardswap: $config: model.type = \"byte_lm\": the byte-level MLP LM was removed" \
  --config "$config" --set model.type=byte_lm
expect "a key of the removed byte LM" \
  "shardswap: $config: model.type: model.width is a key of the byte-level MLP LM, which was removed" \
  --config "$config" --set model.width=128
expect "unknown key in logging" \
  "shardswap: $config: logging.intervall: not a key of ShardSwap's section logging (did you mean" \
  --config "$config" --set logging.intervall=3
expect "unknown key in layer_switching" "shardswap: $config: layer_switching.gama: not a key" \
  --config "$config" --set layer_switching.type=lisa \
  --set 'layer_switching.layers=["layers.0","layers.1"]' --set layer_switching.gama=1

# Hostile files: devices, FIFOs, folders and deep nesting are refused before anything is read
# unboundedly, built or blocked on.
mkfifo "$work/fifo.json"
expect "a device as the config" "shardswap: /dev/zero: not a regular file (a character device)" \
  --config /dev/zero
expect "a FIFO as the config" "shardswap: $work/fifo.json: not a regular file (a FIFO)" \
  --config "$work/fifo.json"
expect "a folder as the config" "shardswap: $work: not a regular file (a directory)" \
  --config "$work"
expect "a FIFO as the data file" \
  "shardswap: $config: data.train = \"$work/fifo.json\": not a regular file (a FIFO)" \
  --config "$config" --set "data.train=$work/fifo.json"
# 300 levels of objects under a key ShardSwap only warns about, and 300 of lists in a --set value.
awk 'BEGIN { printf "{\"steps\": 3, \"tensorboard\": "; for (i = 0; i < 300; i++) printf "{\"a\": ";
             printf "1"; for (i = 0; i <= 300; i++) printf "}" }' > "$work/deep.json"
expect "objects nested too deep" \
  "shardswap: $work/deep.json:1:1559: tensorboard.a.a.a.a.a ... .a.a.a: nested deeper than 256" \
  --config "$work/deep.json"
deep_list=$(awk 'BEGIN { for (i = 0; i < 300; i++) printf "["; for (i = 0; i < 300; i++) printf "]" }')
expect "a --set value nested too deep" \
  "shardswap: --set 'tensorboard=[[[[" --config "$config" --set "tensorboard=$deep_list"
expect "the key path of a --set value nested too deep" \
  ": tensorboard[0][0][0][0][0] ... [0][0][0]: nested deeper than 256" \
  --config "$config" --set "tensorboard=$deep_list"

cases=$((cases + 1))
out=$("$bin" plan --config "$config" --set model.num_hidden_layers=-1 2>&1)
if [ $? -ne 2 ]; then echo "FAIL plan: bad num_hidden_layers did not exit 2: $out"; failures=$((failures + 1)); fi
case "$out" in
  *"model.num_hidden_layers = -1"*) ;;
  *) echo "FAIL plan: the message does not name model.num_hidden_layers: $out"; failures=$((failures + 1)) ;;
esac

# The missing data file train refuses above is no mistake for `plan`, which opens no data: it
# plans from the model's shapes and data.seq_len alone.
cases=$((cases + 1))
out=$("$bin" plan --config "$config" --set data.train=/nonexistent/corpus.txt 2>&1)
if [ $? -ne 0 ]; then
  echo "FAIL plan without its data file: exit not 0: $out"; failures=$((failures + 1))
fi
case "$out" in
  *"total"*) ;;
  *) echo "FAIL plan without its data file: no plan printed: $out"; failures=$((failures + 1)) ;;
esac

echo "$cases cases, $failures failed"
[ "$failures" -eq 0 ]
