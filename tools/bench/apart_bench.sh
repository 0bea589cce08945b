#!/usr/bin/env bash
# Documents apart against packed, in one run on a machine with an NVIDIA GPU: the same tokens
# (a text's bytes cut into documents of DOCS tokens and marked as --chat files mark theirs,
# tools/bench/train_bench.py --documents) trained at each SHAPE three ways: data.documents =
# "packed" (one stream a row, cuDNN), "apart" (the default for such files) with model.attention =
# "cudnn" (cuDNN in padded length classes, docs/data.md), and "apart" with model.attention = "own"
# (the decoder's own kernels, which take the boundaries themselves). Builds preset cuda first
# unless BIN names a binary.
# Prints each run's tokens/s and phase split, and apart / packed for both attentions.
#   usage: OUT=DIR [SHAPES="0.5b"] [DOCS=100-900] [STEPS=30] [BIN=build/cuda/tools/shardswap]
#          [TESTS="<GPU test filter>"] bash tools/bench/apart_bench.sh
# TESTS, when set, runs those GPU test cases first (shardswap_gpu_tests).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:?set OUT to the folder for the results}
SHAPES=${SHAPES:-0.5b}
DOCS=${DOCS:-100-900}
STEPS=${STEPS:-30}
BIN=${BIN:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
echo "tree: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' + changes')" |
  tee -a "$OUT/machine.txt"
if [ -z "$BIN" ]; then
  cmake --preset cuda > "$OUT/build.log" 2>&1 &&
    cmake --build --preset cuda -j "$(nproc)" >> "$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; exit 1; }
  BIN=build/cuda/tools/shardswap
fi
if [ -n "${TESTS:-}" ]; then
  build/cuda/tests/gpu/shardswap_gpu_tests "$TESTS" 2>&1 | tee "$OUT/tests.log" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

for shape in $SHAPES; do
  for way in packed apart own; do
    sets=()
    case $way in
      packed) sets=(--set data.documents=packed) ;;
      apart) sets=(--set model.attention=cudnn) ;;
      own) sets=(--set model.attention=own) ;;
    esac
    python3 tools/bench/train_bench.py --bin "$BIN" --out "$OUT/$way" --shapes "$shape" \
      --modes full --steps "$STEPS" --documents "$DOCS" "${sets[@]}" > "$OUT/$way-$shape.txt" 2>&1 ||
      status=1
    grep -m1 "documents apart:" "$OUT/$way"/train-bench-"$shape"-full.log || true
    tail -2 "$OUT/$way-$shape.txt"
  done
done

python3 - "$OUT" $SHAPES <<'EOF'
import json, os, sys
out, shapes = sys.argv[1], sys.argv[2:]
print(f"\n{'shape':>6} {'packed':>9} {'apart':>9} {'own':>9} {'apart/packed':>13} {'own/packed':>11}")
for shape in shapes:
    tps = {}
    for way in ("packed", "apart", "own"):
        path = os.path.join(out, way, "train-bench.json")
        rows = json.load(open(path))["rows"] if os.path.exists(path) else []
        r = next((r for r in rows if r["shape"] == shape and "void" not in r), None)
        tps[way] = r["tokens_per_s"] if r else None
    cell = lambda x: f"{x:9.0f}" if x else f"{'void':>9}"
    ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"
    print(f"{shape:>6} {cell(tps['packed'])} {cell(tps['apart'])} {cell(tps['own'])} "
          f"{ratio(tps['apart'], tps['packed']):>13} {ratio(tps['own'], tps['packed']):>11}")
EOF
exit $status
