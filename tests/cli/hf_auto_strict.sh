#!/bin/sh
# Hugging Face's ZeRO-2 config as the Trainer's users have it (tests/configs/hf_ds_config_zero2.json
# has the keys and values of huggingface/transformers' tests/deepspeed/ds_config_zero2.json: "auto"
# everywhere, offload_optimizer to the cpu), given only a model and data by --set:
# - trains 200 steps, exit 0, each resolved "auto" named once with its value;
# - under --strict (and shardswap.strict: true) is refused with exit 2, listing every key it would
#   only warn about in one message, writing nothing;
# - `--set gradient_cliping=1` (nothing reads it) is an error with and without --strict;
# - a misspelt key in the file warns with "did you mean".
# Usage: hf_auto_strict.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/hf_ds_config_zero2.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# A tiny decoder and its data: HF's file names neither (the Trainer's script does).
model='model={"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
  "max_position_embeddings": 64, "tie_word_embeddings": true}'
data='data={"tokenizer": "bytes", "train": "/usr/share/common-licenses/GPL-3", "seq_len": 16,
  "val_fraction": 0.1}'
logging='logging={"interval": 50, "eval_interval": 100000, "eval_batches": 1}'

# run NAME ARGS...: runs `train ARGS --metrics $work/m.jsonl`, leaving $out and $code
run() {
  rm -f "$work/m.jsonl"
  out=$(timeout 120 "$bin" train "$@" --metrics "$work/m.jsonl" 2>&1)
  code=$?
}

# has NAME TEXT: $out contains TEXT
has() {
  case "$out" in
    *"$2"*) ;;
    *) fail "$1: output lacks '$2': $out" ;;
  esac
}

# Each "auto" resolved, and its value, as the Trainer fills it in (TrainingArguments' defaults).
autos='train_micro_batch_size_per_gpu = "auto": ShardSwap uses 8
gradient_accumulation_steps = "auto": ShardSwap uses 1
train_batch_size = "auto": ShardSwap uses 8 = 8 x 1 x world size 1
fp16.enabled = "auto": ShardSwap uses false
bf16.enabled = "auto": ShardSwap uses true
optimizer.params.lr = "auto": ShardSwap uses 5e-05
optimizer.params.betas = "auto": ShardSwap uses [0.9,0.999]
optimizer.params.eps = "auto": ShardSwap uses 1e-08
optimizer.params.weight_decay = "auto": ShardSwap uses 0.0
gradient_clipping = "auto": ShardSwap uses 1.0
scheduler.params.warmup_min_lr = "auto": ShardSwap uses 0.0
scheduler.params.warmup_max_lr = "auto": ShardSwap uses 5e-05
scheduler.params.warmup_num_steps = "auto": ShardSwap uses 0'
# What else the file has that ShardSwap only warns about.
others='zero_optimization.allgather_bucket_size = 200000000.0: no effect
steps_per_print: a DeepSpeed setting
wall_clock_breakdown: a DeepSpeed setting'

# ok NAME: says the case passed if it added no failure since `before` was set.
ok() { [ "$failures" -eq "$before" ] && echo "ok   $1"; }

# 1. Trains 200 steps as it is, each resolved "auto" warned once with its value.
before=$failures
run --config "$config" --set "$model" --set "$data" --set "$logging" --set steps=200
if [ "$code" -ne 0 ]; then
  fail "HF ZeRO-2 config: exit $code, expected 0: $out"
else
  has "HF ZeRO-2 config" "done: 200 of 200 steps"
  lines=$(wc -l < "$work/m.jsonl")
  [ "$lines" -ge 200 ] || fail "HF ZeRO-2 config: $lines metrics lines, expected 200 steps"
  echo "$autos
$others" | while IFS= read -r line; do
    n=$(printf '%s\n' "$out" | grep -cF -- "$config: $line")
    [ "$n" -eq 1 ] || { echo "FAIL HF ZeRO-2 config: '$line' warned $n times, expected once"; exit 1; }
  done || failures=$((failures + 1))
  ok "HF ZeRO-2 config trains 200 steps with its autos named"
fi

# 2. --strict (or shardswap.strict) refuses it: exit 2, every key in one message, nothing written.
for strict in "--strict" "--set shardswap.strict=true"; do
  before=$failures
  # shellcheck disable=SC2086  # $strict is one flag or a flag and its value
  run --config "$config" --set "$model" --set "$data" --set "$logging" --set steps=200 $strict
  if [ "$code" -ne 2 ]; then
    fail "$strict: exit $code, expected 2: $out"
    continue
  fi
  has "$strict" "shardswap: $config: strict mode (--strict or shardswap.strict): 16 keys would only be warned about; each is an error:"
  echo "$autos
$others" | while IFS= read -r line; do
    printf '%s\n' "$out" | grep -qF -- "shardswap: $config: $line" ||
      { echo "FAIL $strict: the message does not list '$line': $out"; exit 1; }
  done || failures=$((failures + 1))
  [ -e "$work/m.jsonl" ] && fail "$strict: the metrics file was written"
  case "$out" in *"done:"*|*"validation loss"*) fail "$strict: it trained: $out" ;; esac
  ok "$strict refuses the HF ZeRO-2 config listing every key"
done

# 3. plan and eval take --strict too.
for command in plan eval; do
  out=$(timeout 120 "$bin" $command --config "$config" --set "$model" --set "$data" --strict 2>&1)
  code=$?
  [ "$code" -eq 2 ] || fail "$command --strict: exit $code, expected 2: $out"
  has "$command --strict" "16 keys would only be warned about"
done

# 4. A --set key nothing reads is an error with and without --strict, naming the intended key.
tiny=$2/tiny_decoder.json
for strict in "" "--strict"; do
  # shellcheck disable=SC2086
  run --config "$tiny" --set gradient_cliping=1 $strict
  [ "$code" -eq 2 ] || fail "--set gradient_cliping=1 $strict: exit $code, expected 2: $out"
  has "--set gradient_cliping=1 $strict" "shardswap: --set 'gradient_cliping=1': gradient_cliping: not a key ShardSwap reads (did you mean 'gradient_clipping'?)"
  [ -e "$work/m.jsonl" ] && fail "--set gradient_cliping=1 $strict: the metrics file was written"
done

# 5. A misspelt key in the file warns with "did you mean" (and trains), and is an error under
# --strict.
sed 's/"gradient_clipping"/"gradient_cliping"/' "$tiny" > "$work/misspelt.json"
run --config "$work/misspelt.json" --set steps=2
[ "$code" -eq 0 ] || fail "misspelt key: exit $code, expected 0: $out"
has "misspelt key" "$work/misspelt.json: gradient_cliping: not a key ShardSwap knows; ignored (did you mean 'gradient_clipping'?)"
run --config "$work/misspelt.json" --set steps=2 --strict
[ "$code" -eq 2 ] || fail "misspelt key --strict: exit $code, expected 2: $out"
has "misspelt key --strict" "shardswap: $work/misspelt.json: gradient_cliping: not a key ShardSwap knows"

[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all cases passed"
