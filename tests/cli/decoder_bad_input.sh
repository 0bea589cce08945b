#!/bin/sh
# Bad input of a decoder run (issue 16's list): a config.json of a model type the decoder does not
# implement, a checkpoint missing a tensor, a tensor of the wrong shape, a token file with a wrong
# magic or cut short, token ids at or above the vocabulary size, seq_len above
# max_position_embeddings. Each: exit 2, the field or file named, nothing written (no metrics
# file, no checkpoint directory).
# Usage: decoder_bad_input.sh SHARDSWAP FIXTURES_DIR (tests/fixtures/decoder)
set -u
bin=$1
fixtures=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
cases=0

# A token file in llm.c's format: token_file PATH MAGIC VERSION COUNT_IN_HEADER ID...
token_file() {
  python3 - "$@" <<'PY'
import struct, sys
path, magic, version, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ids = [int(x) for x in sys.argv[5:]]
header = [magic, version, count] + [0] * 253
with open(path, "wb") as f:
    f.write(struct.pack("<256i", *header))
    f.write(struct.pack("<%d%s" % (len(ids), "H" if version == 1 else "I"), *ids))
PY
}

ids=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randrange(96)) for _ in range(2000)))")
token_file "$work/train.bin" 20240520 1 2000 $ids
token_file "$work/val.bin" 20240520 1 2000 $ids
cp -r "$fixtures/qwen2_tied" "$work/model"
cat > "$work/run.json" <<JSON
{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 1,
  "world_size": 1,
  "steps": 2,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
  "model": {"type": "decoder", "path": "$work/model"},
  "data": {"train": "$work/train.bin", "val": "$work/val.bin", "seq_len": 32},
  "checkpoint": {"dir": "$work/ckpt", "every": 1}
}
JSON

# expect NAME EXPECTED_TEXT ARGS... : runs `train ARGS --metrics $work/m.jsonl`
expect() {
  name=$1 text=$2
  shift 2
  cases=$((cases + 1))
  rm -rf "$work/m.jsonl" "$work/ckpt"
  out=$(timeout 60 "$bin" train "$@" --metrics "$work/m.jsonl" 2>&1)
  code=$?
  if [ "$code" -ne 2 ]; then
    echo "FAIL $name: exit $code, expected 2: $out"; failures=$((failures + 1)); return
  fi
  case "$out" in
    *"$text"*) ;;
    *) echo "FAIL $name: message lacks '$text': $out"; failures=$((failures + 1)); return ;;
  esac
  if [ -e "$work/m.jsonl" ] || [ -e "$work/ckpt" ]; then
    echo "FAIL $name: something was written"; failures=$((failures + 1)); return
  fi
  echo "ok   $name: $out" | head -c 300; echo
}

# The good config first: it must train, or every refusal below proves nothing.
cases=$((cases + 1))
if out=$(timeout 120 "$bin" train --config "$work/run.json" 2>&1); then
  echo "ok   the unaltered config trains"
else
  echo "FAIL the unaltered config does not train: $out"; failures=$((failures + 1))
fi
rm -rf "$work/ckpt"

sed 's/"model_type": "qwen2"/"model_type": "gpt2"/' "$fixtures/qwen2_tied/config.json" \
  > "$work/model/config.json"
expect "unsupported model_type" "'model_type' = \"gpt2\"" --config "$work/run.json"
cp "$fixtures/qwen2_tied/config.json" "$work/model/config.json"

python3 - "$fixtures/qwen2_tied/model.safetensors" "$work/model/model.safetensors" drop <<'PY'
import json, struct, sys
src, dst, mode = sys.argv[1:4]
data = open(src, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
body = data[8 + n:]
name = "model.layers.1.mlp.up_proj.weight"
entry = header.pop(name)
begin, end = entry["data_offsets"]
# Drop the tensor: the data after it moves down.
out_body = body[:begin] + body[end:]
for k, v in header.items():
    if k != "__metadata__" and v["data_offsets"][0] >= end:
        v["data_offsets"] = [v["data_offsets"][0] - (end - begin), v["data_offsets"][1] - (end - begin)]
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(dst, "wb").write(struct.pack("<Q", len(text)) + text + out_body)
PY
expect "a checkpoint missing a tensor" "model.layers.1.mlp.up_proj.weight" --config "$work/run.json"

python3 - "$fixtures/qwen2_tied/model.safetensors" "$work/model/model.safetensors" <<'PY'
import json, struct, sys
src, dst = sys.argv[1:3]
data = open(src, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
# Same bytes, another shape: [96, 48] read as [48, 96].
header["model.layers.0.mlp.gate_proj.weight"]["shape"] = list(reversed(header["model.layers.0.mlp.gate_proj.weight"]["shape"]))
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(dst, "wb").write(struct.pack("<Q", len(text)) + text + data[8 + n:])
PY
expect "a tensor of the wrong shape" "model.layers.0.mlp.gate_proj.weight" --config "$work/run.json"
cp "$fixtures/qwen2_tied/model.safetensors" "$work/model/model.safetensors"

token_file "$work/bad.bin" 1234 1 2000 $ids
expect "a token file with a wrong magic" "$work/bad.bin" --config "$work/run.json" \
  --set data.train="$work/bad.bin"
token_file "$work/bad.bin" 20240520 1 3000 $ids
expect "a token file cut short" "$work/bad.bin" --config "$work/run.json" \
  --set data.train="$work/bad.bin"
token_file "$work/bad.bin" 20240520 1 2000 $ids
python3 - "$work/bad.bin" <<'PY'
import struct, sys
with open(sys.argv[1], "r+b") as f:
    f.seek(1024 + 2 * 1500)
    f.write(struct.pack("<H", 96))  # the vocabulary is 96 ids: 0..95
PY
expect "a token id at the vocabulary size" "$work/bad.bin" --config "$work/run.json" \
  --set data.train="$work/bad.bin"
expect "seq_len above max_position_embeddings" "max_position_embeddings" \
  --config "$work/run.json" --set data.seq_len=129

echo "$cases cases, $failures failed"
[ "$failures" -eq 0 ]
