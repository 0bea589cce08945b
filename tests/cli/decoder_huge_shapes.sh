#!/bin/sh
# A decoder shape beyond any model (num_hidden_layers = 1000000000 in an HF config.json, a huge
# hidden_size, vocab_size, intermediate_size, head count, head_dim, or sizes each in range whose
# params pass 2^48) is refused with exit 2 naming the field of config.json (or model.FIELD), at
# once, before anything is made from it (once: std::bad_alloc). Sizes in range whose plan is
# more than the machine's memory: train and eval exit 1 saying so before allocating. The
# unaltered model still plans.
# Usage: decoder_huge_shapes.sh SHARDSWAP FIXTURES_DIR (tests/fixtures/decoder)
set -u
bin=$1
fixtures=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
cases=0
head -c 20000 /usr/share/common-licenses/GPL-3 > "$work/corpus.txt"
cp -r "$fixtures/qwen2_tied" "$work/model"
# Token files in llm.c's format for the fixture's vocabulary of 96.
python3 - "$work" <<'PY'
import random, struct, sys
random.seed(1)
for name in ("train.bin", "val.bin"):
    ids = [random.randrange(96) for _ in range(2000)]
    with open(sys.argv[1] + "/" + name, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(ids), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(ids), *ids))
PY
cat > "$work/run.json" <<JSON
{
  "train_micro_batch_size_per_gpu": 2,
  "world_size": 1,
  "steps": 2,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
  "model": {"type": "decoder", "path": "$work/model"},
  "data": {"train": "$work/train.bin", "val": "$work/val.bin", "seq_len": 32}
}
JSON
cat > "$work/scratch.json" <<JSON
{
  "train_micro_batch_size_per_gpu": 2,
  "world_size": 1,
  "steps": 2,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
  "model": {"type": "decoder", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64},
  "data": {"tokenizer": "bytes", "train": "$work/corpus.txt", "seq_len": 32, "val_fraction": 0.1}
}
JSON

# with KEY=VALUE...: the fixture's config.json with these fields changed
with() {
  python3 - "$fixtures/qwen2_tied/config.json" "$work/model/config.json" "$@" <<'PY'
import json, sys
src, dst = sys.argv[1:3]
config = json.load(open(src))
for pair in sys.argv[3:]:
    key, value = pair.split("=", 1)
    config[key] = json.loads(value)
json.dump(config, open(dst, "w"), indent=2)
PY
}

# refused NAME EXPECTED_TEXT ARGS...: `plan ARGS` exits 2 within 10 s, the message holding
# EXPECTED_TEXT
refused() {
  name=$1 text=$2
  shift 2
  cases=$((cases + 1))
  start=$(date +%s)
  out=$(timeout 60 "$bin" plan "$@" 2>&1)
  code=$?
  took=$(($(date +%s) - start))
  if [ "$code" -ne 2 ]; then
    echo "FAIL $name: exit $code, expected 2: $(echo "$out" | head -c 300)"
    failures=$((failures + 1)); return
  fi
  case "$out" in
    *"$text"*) ;;
    *) echo "FAIL $name: message lacks '$text': $out"; failures=$((failures + 1)); return ;;
  esac
  if [ "$took" -gt 10 ]; then
    echo "FAIL $name: refused after $took s"; failures=$((failures + 1)); return
  fi
  echo "ok   $name: $out" | head -c 300; echo
}

cases=$((cases + 1))
if out=$("$bin" plan --config "$work/run.json" 2>&1); then
  echo "ok   the unaltered model plans"
else
  echo "FAIL the unaltered model does not plan: $out"; failures=$((failures + 1))
fi

config="$work/model/config.json"
with num_hidden_layers=1000000000
refused "num_hidden_layers = 1e9" "$config 'num_hidden_layers' = 1000000000: above 131072" \
  --config "$work/run.json"
with hidden_size=2000000000
refused "a huge hidden_size" "'hidden_size' = 2000000000: above 1048576" --config "$work/run.json"
with vocab_size=2000000000
refused "a huge vocab_size" "'vocab_size' = 2000000000: above 16777216" --config "$work/run.json"
with intermediate_size=2000000000
refused "a huge intermediate_size" "'intermediate_size' = 2000000000: above 4194304" \
  --config "$work/run.json"
with num_attention_heads=131072
refused "a huge head count" "'num_attention_heads' = 131072: above 65536" --config "$work/run.json"
with head_dim=100000
refused "a huge head_dim" "'head_dim' = 100000: above 65536" --config "$work/run.json"
with head_dim=65536 num_attention_heads=64
refused "heads x head_dim too wide" "'head_dim' = 65536: num_attention_heads x head_dim = 64 x 65536" \
  --config "$work/run.json"
with num_hidden_layers=131072 hidden_size=1048576 intermediate_size=4194304
# The count of Qwen2's tensors (tied head; q/k/v biases) at those sizes, 4 heads, 2 kv heads of 12.
params=$(python3 -c "
d, i, v, q, kv, layers = 1048576, 4194304, 96, 4 * 12, 2 * 12, 131072
layer = 2 * d + q * d + 2 * kv * d + d * q + 3 * i * d + q + 2 * kv
print(v * d + layers * layer + d)")
refused "sizes in range, params above 2^48" \
  "'num_hidden_layers' = 131072 (hidden_size = 1048576, intermediate_size = 4194304, vocab_size = 96): $params params, above 281474976710656" \
  --config "$work/run.json"
cp "$fixtures/qwen2_tied/config.json" "$work/model/config.json"

# From scratch: the same fields under model.
refused "model.num_hidden_layers = 1e9 from scratch" \
  "model.num_hidden_layers = 1000000000: above 131072" --config "$work/scratch.json" \
  --set model.num_hidden_layers=1000000000
refused "model.vocab_size huge from scratch" "model.vocab_size = 2000000000: above 16777216" \
  --config "$work/scratch.json" --set model.vocab_size=2000000000

# Sizes each in range whose plan (about 2.4 TB at rank 0) no machine here holds: train and eval
# refuse it from the plan, exit 1, before allocating (once: 16 GB drawn and counting). Under a
# memory limit and SIGKILL, so that a regression cannot take the machine's memory or hang (no
# limit on the address space of a sanitized build: ASan reserves terabytes of it for its shadow).
sanitized=0
grep -q __asan_init "$bin" && sanitized=1
for command in train eval; do
  cases=$((cases + 1))
  out=$( ([ $sanitized -eq 1 ] || ulimit -v 8000000
    timeout -s KILL 60 "$bin" $command --config "$work/scratch.json" \
    --set model.hidden_size=65536 --set model.intermediate_size=262144 \
    --set model.num_attention_heads=512 --set model.num_key_value_heads=512) 2>&1)
  code=$?
  case "$code:$out" in
    "1:shardswap: error: the plan needs "*"GiB of host memory"*"refused before anything is allocated"*)
      echo "ok   $command of a plan above the machine's memory: $out" | head -c 300; echo ;;
    *) echo "FAIL $command of a plan above the machine's memory: exit $code: $(echo "$out" | head -c 300)"
       failures=$((failures + 1)) ;;
  esac
done

echo "$cases cases, $failures failed"
[ "$failures" -eq 0 ]
