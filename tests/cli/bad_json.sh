#!/bin/sh
# Hostile JSON from outside, through every command that reads it (issue 28): a checkpoint whose
# metadata.json `extra` nests 100,000 levels (valid checksum), lacks the trainer's step, holds it
# as a string, or is a list; a metadata.json without shardswap_version; a metrics line that is not
# JSON; --set of a number beyond double's range; a model folder's config.json that is not JSON or
# has text after a NUL byte; a safetensors header that is not JSON. Each: exit 2, the file and the
# field or position named, never the JSON library's "[json.exception...]" text, never a crash.
# Usage: bad_json.sh SHARDSWAP FIXTURES_DIR (tests/fixtures/decoder)
set -u
bin=$1
fixtures=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
cases=0

python3 - "$work" <<'PY'
import random, struct, sys
random.seed(1)
ids = [random.randrange(96) for _ in range(2000)]
for name in ("train.bin", "val.bin"):
    with open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(struct.pack("<256i", *([20240520, 1, len(ids)] + [0] * 253)))
        f.write(struct.pack("<%dH" % len(ids), *ids))
PY
cp -r "$fixtures/qwen2_tied" "$work/model"
cat > "$work/run.json" <<JSON
{
  "train_micro_batch_size_per_gpu": 2,
  "world_size": 1,
  "steps": 2,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
  "model": {"type": "decoder", "path": "$work/model"},
  "data": {"train": "$work/train.bin", "val": "$work/val.bin", "seq_len": 32},
  "checkpoint": {"dir": "$work/ckpt", "every": 2},
  "logging": {"eval_batches": 1}
}
JSON

# The good run first: it must train, save, inspect and resume, or the refusals prove nothing.
if ! out=$(timeout 300 "$bin" train --config "$work/run.json" --metrics "$work/m.jsonl" 2>&1); then
  echo "FAIL the unaltered config does not train: $out"; exit 1
fi
good=$work/ckpt/$(ls "$work/ckpt" | head -1)
if ! out=$(timeout 60 "$bin" ckpt inspect "$good" 2>&1); then
  echo "FAIL the saved checkpoint does not inspect: $out"; exit 1
fi
echo "ok   trained and saved $good"

# forge NAME PYTHON: a copy of the good checkpoint whose metadata `m` (a dict) the Python
# statements change; `deep` in m["extra"] is replaced by 100,000 nested lists (too deep for
# Python's own json to write). The checksum is made anew, as a forger would.
forge() {
  rm -rf "$work/$1"
  cp -r "$good" "$work/$1"
  python3 - "$work/$1/metadata.json" "$2" <<'PY'
import json, sys
path, change = sys.argv[1], sys.argv[2]
text = open(path, "rb").read().decode()
middle = '","metadata":'
body = text.index(middle) + len(middle)
m = json.loads(text[body:-2])
exec(change)
inner = json.dumps(m, indent=1).replace('"deep"', "[" * 100000 + "]" * 100000)
data = inner.encode()
h = 0xcbf29ce484222325
for b in data:
    h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
out = '{"format":"shardswap-checkpoint","fnv1a64":"%016x%s%s}\n' % (h, middle, inner)
open(path, "wb").write(out.encode())
PY
}

# expect NAME EXPECTED_TEXT COMMAND...: exit 2, the text in the message, no library tags.
expect() {
  name=$1 text=$2
  shift 2
  cases=$((cases + 1))
  out=$(timeout 60 "$@" 2>&1)
  code=$?
  if [ "$code" -ne 2 ]; then
    echo "FAIL $name: exit $code, expected 2: $(echo "$out" | head -c 400)"
    failures=$((failures + 1)); return
  fi
  case "$out" in
    *"$text"*) ;;
    *) echo "FAIL $name: message lacks '$text': $out"; failures=$((failures + 1)); return ;;
  esac
  case "$out" in
    *json.exception*)
      echo "FAIL $name: the JSON library's message: $out"; failures=$((failures + 1)); return ;;
  esac
  echo "ok   $name: $out" | head -c 300; echo
}
# `$bin train $resume --set checkpoint.load=DIR`: one more step from checkpoint DIR.
resume="--config $work/run.json --set steps=3 --set checkpoint.dir=$work/resumed"
resume="$resume --metrics $work/r.jsonl"
# shellcheck disable=SC2086
if ! out=$(timeout 300 "$bin" train $resume --set checkpoint.load="$good" 2>&1); then
  echo "FAIL the saved checkpoint does not resume: $out"; exit 1
fi
echo "ok   the saved checkpoint resumes"
rm -rf "$work/resumed"

forge deep 'm["extra"]["nested"] = "deep"'
expect "ckpt inspect: extra nested 100,000 levels" "$work/deep/metadata.json:" \
  "$bin" ckpt inspect "$work/deep"
expect "train: extra nested 100,000 levels" \
  "metadata.extra.nested[0][0][0] ... [0][0][0]: nested deeper than 1024 levels" \
  "$bin" train $resume --set checkpoint.load="$work/deep"

forge nostep 'del m["extra"]["step"]'
expect "train: extra.step missing" "$work/nostep/metadata.json: extra.step: missing" \
  "$bin" train $resume --set checkpoint.load="$work/nostep"
expect "eval: extra.step missing" "$work/nostep/metadata.json: extra.step: missing" \
  "$bin" eval --config "$work/run.json" --checkpoint "$work/nostep"
forge stringstep 'm["extra"]["step"] = "2"'
expect "train: extra.step a string" \
  "$work/stringstep/metadata.json: extra.step = \"2\": must be an integer >= 0" \
  "$bin" train $resume --set checkpoint.load="$work/stringstep"
forge noupdates 'del m["extra"]["updates"]'
expect "train: extra.updates missing" "$work/noupdates/metadata.json: extra.updates: missing" \
  "$bin" train $resume --set checkpoint.load="$work/noupdates"
forge listextra 'm["extra"] = [1, 2]'
expect "train: extra a list" \
  "$work/listextra/metadata.json': field 'extra': expected an object, got [1,2]" \
  "$bin" train $resume --set checkpoint.load="$work/listextra"
expect "ckpt inspect: extra a list" "field 'extra': expected an object" \
  "$bin" ckpt inspect "$work/listextra"
forge noversion 'del m["shardswap_version"]'
expect "ckpt inspect: shardswap_version missing" \
  "$work/noversion/metadata.json': field 'shardswap_version' is missing" \
  "$bin" ckpt inspect "$work/noversion"

printf '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": oops}\n' > "$work/bad.jsonl"
expect "plot: a metrics line that is not JSON" "plot: $work/bad.jsonl line 2, column 21: not valid JSON" \
  "$bin" plot "$work/bad.jsonl" --out "$work/p.svg"
expect "--set a number beyond double's range" \
  "--set 'optimizer.params.lr=1e999': optimizer.params.lr: the number 1e999 is beyond the range" \
  "$bin" plan --config "$work/run.json" --set optimizer.params.lr=1e999

cp -r "$work/model" "$work/badconfig"
printf '{"model_type": "qwen2",\n  "vocab_size": x}\n' > "$work/badconfig/config.json"
expect "a model's config.json that is not JSON" "$work/badconfig/config.json:2:17: not valid JSON" \
  "$bin" plan --config "$work/run.json" --set model.path="$work/badconfig"
cp "$work/model/config.json" "$work/badconfig/config.json"
printf '\000{"vocab_size": 1}' >> "$work/badconfig/config.json"
expect "a model's config.json with text after a NUL byte" "not valid JSON: a NUL byte" \
  "$bin" plan --config "$work/run.json" --set model.path="$work/badconfig"
cp "$work/model/config.json" "$work/badconfig/config.json"
python3 - "$work/badconfig/model.safetensors" <<'PY'
import struct, sys
header = b'{"w": nope}   '
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header)
PY
expect "a safetensors header that is not JSON" \
  "safetensors file '$work/badconfig/model.safetensors': the header, at 1:8: not valid JSON" \
  "$bin" eval --config "$work/run.json" --set model.path="$work/badconfig"

echo "$((cases - failures)) of $cases cases as expected"
[ "$failures" -eq 0 ]
