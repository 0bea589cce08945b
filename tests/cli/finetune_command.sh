#!/bin/sh
# The README's fine-tune command, as written, on a tiny Hugging Face folder (a copy of the llama3
# fixture that transformers made) and token files of its vocabulary: configs/finetune-lisa.json
# with model.path, data.train and data.val set on the command line, sized for this CPU by --set.
# Then the same folder with a config written for another model (configs/qwen2.5-0.5b-lisa.json):
# model.path wins, each field that differs is a warning (an error under --strict), and its
# byte tokenizer is refused naming the key to change. Then the README's command on the Qwen3
# fixture, its last checkpoint exported as a Hugging Face folder and trained from again.
# Usage: finetune_command.sh SHARDSWAP CONFIGS_DIR FIXTURES_DIR
set -u
bin=$1
configs=$2
fixtures=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok   $*"; }

cp -r "$fixtures/llama3" "$work/model"
mkdir "$work/tokens"
python3 - "$work" <<'PY' || exit 1
import random, struct, sys
work = sys.argv[1]
rng = random.Random(5)
def write(path, n):  # llm.c version 1: 256 int32 header, uint16 tokens below the vocab (96)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
        f.write(struct.pack("<%dH" % n, *(rng.randrange(96) for _ in range(n))))
write(f"{work}/tokens/a.bin", 3000)
write(f"{work}/tokens/b.bin", 2000)
write(f"{work}/val.bin", 800)
PY
cpu="--set shardswap.backend=cpu --set steps=6 --set data.seq_len=32 \
  --set gradient_accumulation_steps=1 --set layer_switching.interval=2 \
  --set logging.eval_interval=3 --set checkpoint.dir=$work/ck --set checkpoint.every=3 \
  --set scheduler.params.warmup_num_steps=2 --set layer_switching.gamma=1"
cpu_other="--set shardswap.backend=cpu --set shardswap.communicator=in_process --set steps=4 \
  --set data.seq_len=32 --set train_micro_batch_size_per_gpu=2"

# --- the README's command ---
# shellcheck disable=SC2086
if "$bin" train --config "$configs/finetune-lisa.json" \
    --set model.path="$work/model" --set data.train="$work/tokens/*.bin" --set data.val="$work/val.bin" \
    $cpu --metrics "$work/m.jsonl" > "$work/out" 2>&1; then
  ok "README fine-tune command: exit 0"
else
  fail "README fine-tune command: $(cat "$work/out")"
fi
grep -q "from $work/model" "$work/out" && ok "trains from the folder" || fail "no 'from FOLDER' in: $(cat "$work/out")"
grep -qi "warn" "$work/out" && fail "warnings: $(grep -i warn "$work/out")" || ok "no warning"
[ -d "$work/ck/step-00000006" ] && ok "checkpoint of the last step saved" || fail "no step-00000006 in $work/ck"
# LISA at gamma 1 over the folder's 2 layers: the embedding, one layer and the head active.
active=$(python3 -c "import json,sys; print(' '.join(sorted({str(len(json.loads(l)['active_groups'])) for l in open(sys.argv[1]) if 'active_groups' in json.loads(l)})))" "$work/m.jsonl")
[ "$active" = 3 ] && ok "LISA: 3 groups active at every step" || fail "active group counts: $active"

# --- a config written for another model: the folder wins, differences are warnings ---
other="$configs/qwen2.5-0.5b-lisa.json"
# shellcheck disable=SC2086
"$bin" train --config "$other" --set model.path="$work/model" --set data.train="$work/tokens/*.bin" \
  --set data.val="$work/val.bin" $cpu_other > "$work/out2" 2>&1
rc=$?
[ "$rc" = 2 ] && ok "qwen config + token files: exit 2" || fail "qwen config + token files: exit $rc"
# (this folder's vocabulary of 96 is refused first; token_data_test checks the llm.c file refusal)
grep -q 'data.tokenizer = "bytes"' "$work/out2" &&
  ok "byte tokenizer on this folder refused, naming data.tokenizer" || fail "$(cat "$work/out2")"
# shellcheck disable=SC2086
"$bin" train --config "$other" --set model.path="$work/model" --set data.train="$work/tokens/*.bin" \
  --set data.val="$work/val.bin" --set data.tokenizer=llmc $cpu_other > "$work/out3" 2>&1
rc=$?
[ "$rc" = 0 ] && ok "qwen config + model.path + llmc: exit 0" || fail "exit $rc: $(cat "$work/out3")"
grep -q "model.hidden_size = 896: model.path's config.json says 48: model.path wins" "$work/out3" &&
  ok "a differing field is a warning naming both values" || fail "no hidden_size warning in: $(cat "$work/out3")"
# shellcheck disable=SC2086
"$bin" train --strict --config "$other" --set model.path="$work/model" --set data.train="$work/tokens/*.bin" \
  --set data.val="$work/val.bin" --set data.tokenizer=llmc $cpu_other > "$work/out4" 2>&1
rc=$?
[ "$rc" = 2 ] && grep -q "model.hidden_size" "$work/out4" && ok "--strict: the warning is an error" ||
  fail "--strict: exit $rc: $(cat "$work/out4")"

# --- the same command on a Qwen3 folder (q/k norms), exported and read back ---
cp -r "$fixtures/qwen3" "$work/qwen3"
# shellcheck disable=SC2086
if "$bin" train --config "$configs/finetune-lisa.json" \
    --set model.path="$work/qwen3" --set data.train="$work/tokens/*.bin" --set data.val="$work/val.bin" \
    $cpu --set checkpoint.dir="$work/ck3" > "$work/out5" 2>&1; then
  ok "README fine-tune command on a Qwen3 folder: exit 0"
else
  fail "Qwen3 folder: $(cat "$work/out5")"
fi
if "$bin" ckpt export "$work/ck3/step-00000006" --format hf --out "$work/qwen3-out" > "$work/out6" 2>&1 &&
   python3 - "$work/qwen3-out" <<'PY'
import json, struct, sys
folder = sys.argv[1]
config = json.load(open(f"{folder}/config.json"))
assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"], config
assert config["head_dim"] == 16 and config["attention_bias"] is False, config
data = open(f"{folder}/model.safetensors", "rb").read()
header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
for l in range(2):
    for norm in ("q_norm", "k_norm"):
        name = f"model.layers.{l}.self_attn.{norm}.weight"
        assert header[name]["shape"] == [16], (name, header.get(name))
PY
then
  ok "Qwen3 export: config.json of qwen3, q_norm and k_norm [16] in each layer"
else
  fail "Qwen3 export: $(cat "$work/out6")"
fi
# shellcheck disable=SC2086
"$bin" train --config "$configs/finetune-lisa.json" --set model.path="$work/qwen3-out" \
  --set data.train="$work/tokens/*.bin" --set data.val="$work/val.bin" $cpu --set steps=3 \
  --set checkpoint.dir="$work/ck4" > "$work/out7" 2>&1 &&
  ok "the Qwen3 export trains as model.path" || fail "Qwen3 export as model.path: $(cat "$work/out7")"

[ "$failures" = 0 ] || exit 1
