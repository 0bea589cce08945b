#!/usr/bin/env bash
# The decoder on a machine with an NVIDIA GPU, python3 with torch and transformers: builds with
# preset cuda, runs the GPU decoder tests (against a float64 reference and the transformers
# fixtures), then
#  1. a LISA fine-tune of a fixture model on the CPU backend, exported as a Hugging Face folder,
#     loaded by transformers: its logits against ShardSwap's own forward (`eval --logits`);
#  2. a Qwen2.5-0.5B-shaped checkpoint saved by transformers (random init), LISA-fine-tuned from
#     model.path at world size 1 over NCCL and with 2 in-process ranks on the GPU: the plan
#     against the measured peak after step 1 and after each switch; exported and loaded by
#     transformers, logits against ShardSwap's CUDA forward (bf16 tolerance);
#  3. the Hugging Face round trip: a tiny Llama with a real tokenizer and chat template
#     (tools/checks/hf_roundtrip_check.py), its text tokenized by tools/data/tokenize_data.py,
#     fine-tuned from model.path, exported; AutoTokenizer, the chat template and generate() on
#     the export against the source;
#  4. the same with a tiny Qwen3 and chat JSON lines tokenized with --chat (documents apart on the
#     GPU, the loss on the assistant's tokens).
# Logs, metrics and a summary go under $OUT (default build/gpu-out).
#   usage: OUT=DIR bash tools/checks/gpu-decoder-check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-out}
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
step() { echo; echo "=== $* ==="; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/machine.txt"

step "configure and build"
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli shardswap_gpu_tests >> "$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then tail -60 "$OUT/build.log"; exit 1; fi
bin=build/cuda/tools/shardswap

step "GPU decoder tests"
build/cuda/tests/gpu/shardswap_gpu_tests "[decoder],[cudnn]" --durations yes > "$OUT/gpu-decoder-tests.log" 2>&1 || status=1
grep -E "cuda, bf16|cuDNN|handles took|FAILED|passed|failed" "$OUT/gpu-decoder-tests.log" | tail -12

# transformers' logits of a Hugging Face folder for the inputs of an `eval --logits` file,
# against the logits in it: normalized error, which must stay below $3.
compare_logits() {  # FOLDER LOGITS.safetensors BOUND
  python3 - "$@" <<'PY'
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
folder, logits_file, bound = sys.argv[1], sys.argv[2], float(sys.argv[3])
torch.backends.cuda.matmul.allow_tf32 = False
ours = load_file(logits_file)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
device = "cuda" if torch.cuda.is_available() else "cpu"
model = model.to(device).eval()
with torch.no_grad():
    theirs = model(input_ids=ours["inputs"].long().to(device)).logits.float().cpu()
error = ((ours["logits"] - theirs).norm() / theirs.norm()).item()
print(f"transformers from_pretrained({folder}): logits {tuple(theirs.shape)}, normalized error "
      f"against ShardSwap's {error:.2e} (bound {bound:g})")
sys.exit(0 if error < bound else 1)
PY
}

# Random token ids below VOCAB in llm.c's format (version 2: uint32).
random_tokens() {  # PATH COUNT VOCAB SEED
  python3 - "$@" <<'PY'
import random, struct, sys
path, count, vocab, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
with open(path, "wb") as f:
    f.write(struct.pack("<256i", 20240520, 2, count, *([0] * 253)))
    f.write(struct.pack("<%dI" % count, *(rng.randrange(vocab) for _ in range(count))))
PY
}

step "1. LISA fine-tune of a fixture model (CPU backend), exported, loaded by transformers"
random_tokens "$work/fx-train.bin" 20000 96 1
random_tokens "$work/fx-val.bin" 4000 96 2
fx=(--set world_size=2 --set steps=12 --set train_micro_batch_size_per_gpu=2
    --set 'model={"type": "decoder"}' --set model.path=tests/fixtures/decoder/qwen2_tied
    --set data.tokenizer=llmc --set "data.train=$work/fx-train.bin"
    --set "data.val=$work/fx-val.bin" --set data.seq_len=24 --set shardswap.backend=cpu
    --set shardswap.communicator=in_process --set layer_switching.interval=4
    --set layer_switching.gamma=1 --set checkpoint.dir="$work/fx-ckpt" --set checkpoint.every=12)
{ $bin train --config configs/qwen2.5-0.5b-lisa.json "${fx[@]}" &&
  $bin ckpt export "$work/fx-ckpt/step-00000012" --format hf --out "$work/fx-hf" &&
  $bin eval --config configs/qwen2.5-0.5b-lisa.json "${fx[@]}" --checkpoint "$work/fx-ckpt/step-00000012" \
    --logits "$work/fx-logits.safetensors" &&
  compare_logits "$work/fx-hf" "$work/fx-logits.safetensors" 1e-5; } > "$OUT/fixture-lisa.log" 2>&1 || status=1
grep -E "done:|wrote|validation loss|transformers|error" "$OUT/fixture-lisa.log"

step "2. Qwen2.5-0.5B shape from a transformers checkpoint: LISA from model.path"
python3 tools/fixtures/make_decoder_fixtures.py --qwen05b "$work/qwen05b" > "$OUT/qwen05b-save.log" 2>&1 || status=1
tail -1 "$OUT/qwen05b-save.log"
random_tokens "$work/q-train.bin" 400000 151936 3
random_tokens "$work/q-val.bin" 40000 151936 4
q=(--set 'model={"type": "decoder"}' --set model.path="$work/qwen05b"
   --set "data.train=$work/q-train.bin" --set "data.val=$work/q-val.bin" --set data.tokenizer=llmc
   --set steps=25 --set layer_switching.interval=10 --set logging.interval=5)
for run in "nccl1:world 1 over NCCL:--set world_size=1 --set shardswap.communicator=nccl" \
           "inproc2:2 in-process ranks on one GPU:--set world_size=2 --set shardswap.communicator=in_process --set train_micro_batch_size_per_gpu=4"; do
  tag=${run%%:*}; rest=${run#*:}; name=${rest%%:*}; read -r -a extra <<< "${rest#*:}"
  echo "--- $name"
  $bin train --config configs/qwen2.5-0.5b-lisa.json "${q[@]}" "${extra[@]}" \
    --set checkpoint.dir="$work/q-ckpt-$tag" --set checkpoint.every=25 \
    --metrics "$OUT/qwen05b-$tag.jsonl" > "$OUT/qwen05b-$tag.log" 2>&1 || status=1
  grep -E "shardswap train:|memory of rank 0|GPU 0 after|switch before|done:|validation loss after" "$OUT/qwen05b-$tag.log"
  # The plan against the measured peak: every report within 0.01%.
  awk '/measured peak/ { gsub(/[()%+]/, "", $NF); if ($NF > 0.01 || $NF < -0.01) bad = 1 }
       END { exit bad }' "$OUT/qwen05b-$tag.log" || { echo "plan != peak"; status=1; }
done
{ $bin ckpt export "$work/q-ckpt-nccl1/step-00000025" --format hf --out "$work/q-hf" &&
  $bin eval --config configs/qwen2.5-0.5b-lisa.json "${q[@]}" --set world_size=1 \
    --set shardswap.communicator=in_process --set train_micro_batch_size_per_gpu=2 \
    --set data.seq_len=256 --checkpoint "$work/q-ckpt-nccl1/step-00000025" \
    --logits "$work/q-logits.safetensors" &&
  compare_logits "$work/q-hf" "$work/q-logits.safetensors" 2e-2; } > "$OUT/qwen05b-export.log" 2>&1 || status=1
grep -E "wrote|validation loss|transformers|error" "$OUT/qwen05b-export.log"

step "3. Hugging Face round trip: tokenizer, chat template, token ids, generate()"
{ python3 tools/checks/hf_roundtrip_check.py make "$work/rt-model" /usr/share/common-licenses/GPL-3 &&
  python3 tools/data/tokenize_data.py --tokenizer "$work/rt-model/tokenizer.json" --eos \
    --out "$work/rt-train.bin" /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 &&
  python3 tools/data/tokenize_data.py --tokenizer "$work/rt-model/tokenizer.json" --eos \
    --out "$work/rt-val.bin" /usr/share/common-licenses/GPL-2 &&
  $bin train --config configs/finetune-lisa.json --set model.path="$work/rt-model" \
    --set data.train="$work/rt-train.bin" --set data.val="$work/rt-val.bin" --set data.seq_len=128 \
    --set steps=20 --set scheduler.params.warmup_num_steps=2 --set layer_switching.gamma=1 \
    --set layer_switching.interval=5 --set checkpoint.dir="$work/rt-ckpt" --set checkpoint.every=20 &&
  $bin ckpt export "$work/rt-ckpt/step-00000020" --format hf --out "$work/rt-hf" &&
  python3 tools/checks/hf_roundtrip_check.py check "$work/rt-model" "$work/rt-hf"; } \
  > "$OUT/hf-roundtrip.log" 2>&1 || status=1
grep -E "made|done:|wrote|beside|ok |FAIL|Error|error" "$OUT/hf-roundtrip.log"

step "4. Qwen3 from chat data: --chat tokens (documents apart), fine-tuned, exported, generate()"
{ python3 tools/checks/hf_roundtrip_check.py make "$work/q3-model" /usr/share/common-licenses/GPL-3 qwen3 &&
  python3 tools/checks/hf_roundtrip_check.py chats /usr/share/common-licenses/GPL-3 "$work/q3-train.jsonl" &&
  python3 tools/checks/hf_roundtrip_check.py chats /usr/share/common-licenses/GPL-2 "$work/q3-val.jsonl" &&
  python3 tools/data/tokenize_data.py --tokenizer "$work/q3-model/tokenizer.json" --chat \
    --out "$work/q3-train.bin" "$work/q3-train.jsonl" &&
  python3 tools/data/tokenize_data.py --tokenizer "$work/q3-model/tokenizer.json" --chat \
    --out "$work/q3-val.bin" "$work/q3-val.jsonl" &&
  $bin train --config configs/finetune-lisa.json --set model.path="$work/q3-model" \
    --set data.train="$work/q3-train.bin" --set data.val="$work/q3-val.bin" --set data.seq_len=128 \
    --set steps=20 --set scheduler.params.warmup_num_steps=2 --set layer_switching.gamma=1 \
    --set layer_switching.interval=5 --set checkpoint.dir="$work/q3-ckpt" --set checkpoint.every=20 \
    --metrics "$OUT/qwen3-chat-metrics.jsonl" &&
  $bin ckpt export "$work/q3-ckpt/step-00000020" --format hf --out "$work/q3-hf" &&
  python3 tools/checks/hf_roundtrip_check.py check "$work/q3-model" "$work/q3-hf"; } \
  > "$OUT/qwen3-chat.log" 2>&1 || status=1
grep -E "made|wrote|documents|validation loss|ok |FAIL|Error|error" "$OUT/qwen3-chat.log"

echo
[ $status -eq 0 ] && echo "gpu-decoder-check: all passed" || echo "gpu-decoder-check: FAILED (logs in $OUT)"
exit $status
