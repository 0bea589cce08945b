#!/usr/bin/env bash
# ShardSwap beside llm.q (issue 32) on a machine with an NVIDIA GPU, in one run: llm.q's `train`
# built from its unpacked source (.llmq-src/ at the repository root, the archive of
# ../shared/peers/llmq: `tar xzf llmq-src.tgz` there) by its own bench/gpu_run.sh, ShardSwap built
# with preset cuda, and each shape trained from scratch at seq 2048 by both, one after the other:
# llm.q's SETTINGS (bf16: bf16 weights, master and Adam m/v, its fastest; fp32opt: fp32 m/v) and
# ShardSwap's full fine-tune with fp32 master, m and v (tools/bench/train_bench.py). Prints
# tokens/s side by side and ShardSwap's over each llm.q setting's; writes $OUT/side-by-side.json.
# OPTIONS (space-separated KEY=VALUE config overrides, e.g. "model.bit16_logits=true
# model.keep_norm_outputs=true") trains each shape a second time with them, and that row's ratios
# print beside the defaults'.
#   usage: OUT=DIR [SHAPES="0.5b 1.5b 7b"] [SETTINGS="bf16 fp32opt"] [STEPS=30] [OPTIONS="..."]
#          bash tools/peers/llmq_side_by_side.sh
# Shapes and batches are llm.q's published anchors: 0.5b micro 8, 1.5b micro 4, 7b micro 3 x 4.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-out}
SHAPES=${SHAPES:-0.5b 1.5b 7b}
SETTINGS=${SETTINGS:-bf16 fp32opt}
STEPS=${STEPS:-30}
OPTIONS=${OPTIONS:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
status=0
step() { echo; echo "=== $* ==="; }

if [ ! -f .llmq-src/bench/gpu_run.sh ]; then
  echo "no .llmq-src/bench/gpu_run.sh: unpack llm.q's archive at the repository root first" >&2
  exit 2
fi
batch_of() {  # micro accumulation
  case $1 in
    0.5b) echo "8 1" ;;
    1.5b) echo "4 1" ;;
    7b) echo "3 4" ;;
    *) echo "unknown shape $1 (0.5b, 1.5b, 7b)" >&2; exit 2 ;;
  esac
}
for shape in $SHAPES; do batch_of "$shape" > /dev/null; done

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/machine.txt" || true

step "ShardSwap: configure and build"
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli >> "$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then tail -60 "$OUT/build.log"; exit 1; fi

step "llm.q: $SETTINGS on $SHAPES"
runs=""
for shape in $SHAPES; do
  read -r micro accumulation <<< "$(batch_of "$shape")"
  for setting in $SETTINGS; do
    runs="$runs $setting:${shape^^}:$micro:$accumulation:$STEPS"
  done
done
LLMQ_RUNS="${runs# }" LLMQ_BUDGET_S=${LLMQ_BUDGET_S:-100000} \
  bash .llmq-src/bench/gpu_run.sh "$OUT/llmq" > "$OUT/llmq.txt" 2>&1 || status=1
tail -15 "$OUT/llmq.txt"

step "ShardSwap: full fine-tunes, fp32 master, m and v${OPTIONS:+; then with $OPTIONS}"
option_sets=()
for kv in $OPTIONS; do option_sets+=(--set "$kv"); done
for shape in $SHAPES; do
  read -r micro accumulation <<< "$(batch_of "$shape")"
  for variant in shardswap ${OPTIONS:+options}; do
    extra=()
    [ "$variant" = options ] && extra=("${option_sets[@]}")
    python3 tools/bench/train_bench.py --bin build/cuda/tools/shardswap \
      --out "$OUT/$variant-$shape" --shapes "$shape" --modes full --micro "$shape=$micro" \
      --steps "$STEPS" --warmup 5 --set gradient_accumulation_steps="$accumulation" "${extra[@]}" \
      > "$OUT/$variant-$shape.txt" 2>&1 || status=1
    echo "$variant $(tail -1 "$OUT/$variant-$shape.txt")"
  done
done

step "side by side (tokens/s; ShardSwap over llm.q)"
python3 - "$OUT" "$SHAPES" "$SETTINGS" "$OPTIONS" <<'PY' || status=1
import json, os, sys
out, shapes, settings, options = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4]
variants = ["shardswap"] + (["options"] if options else [])
llmq_path = os.path.join(out, "llmq", "summary.json")
llmq = json.load(open(llmq_path)) if os.path.exists(llmq_path) else []
rows = []
for shape in shapes:
    for variant in variants:
        path = os.path.join(out, f"{variant}-{shape}", "train-bench.json")
        ours = json.load(open(path))["rows"][0] if os.path.exists(path) else {}
        row = {"shape": shape, "shardswap": ours.get("tokens_per_s"), "micro": ours.get("micro"),
               "options": options if variant == "options" else ""}
        for setting in settings:
            peer = [r for r in llmq
                    if r.get("setting") == setting and r.get("shape", "").lower() == shape]
            row[f"llmq_{setting}"] = peer[0].get("tokens_per_s") if peer else None
        rows.append(row)
if options:
    print(f"(+: ShardSwap with {options})")
head = f"{'shape':>7} {'ShardSwap':>10} " + " ".join(f"{'llm.q ' + s:>14} {'ratio':>6}" for s in settings)
print(head)
for r in rows:
    cells = []
    for s in settings:
        peer = r[f"llmq_{s}"]
        ratio = f"{r['shardswap'] / peer:6.2f}" if r["shardswap"] and peer else f"{'-':>6}"
        cells.append(f"{peer if peer else '-':>14} {ratio}")
    ours = f"{r['shardswap']:10.0f}" if r["shardswap"] else f"{'-':>10}"
    shape = r["shape"] + ("+" if r["options"] else "")
    print(f"{shape:>7} {ours} " + " ".join(cells))
json.dump({"rows": rows}, open(os.path.join(out, "side-by-side.json"), "w"), indent=1)
PY
exit $status
