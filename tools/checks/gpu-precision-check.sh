#!/usr/bin/env bash
# A precision option against the exact default (or any option against the default: an exact one
# should show no loss difference at all), on a machine with an NVIDIA GPU: builds with
# preset cuda, runs the GPU tests of TESTS (default: the decoder's), then for each shape trains
# from scratch on real text (tools/bench/train_bench.py: a text file's bytes, seq 2048, the
# shape's micro-batch) from the same seed without any option, then with each of OPTION's
# (space-separated; an option of several keys joins its key=value pairs with commas), one after
# the other: for each option tokens/s against the
# default's and their ratio, and the two loss curves step by step (the largest difference, and
# the mean of the last 10 steps of each). Logs and JSON under $OUT.
#   usage: OUT=DIR [OPTION="model.bit16_logits=true ..."] [SHAPES="0.5b 1.5b"] [STEPS=150]
#          [TESTS="cuda decoder*"] bash tools/checks/gpu-precision-check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:?set OUT to the folder for the results}
OPTION=${OPTION:-model.bit16_logits=true}
SHAPES=${SHAPES:-0.5b 1.5b}
STEPS=${STEPS:-150}
TESTS=${TESTS-cuda decoder*}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
status=0
step() { echo; echo "=== $* ==="; }

step "machine"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  git rev-parse --short HEAD 2>/dev/null
} | tee "$OUT/machine.txt"

step "configure and build"
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli shardswap_gpu_tests \
    >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }

if [ -n "$TESTS" ]; then
  step "GPU tests: $TESTS"
  build/cuda/tests/gpu/shardswap_gpu_tests --durations yes "$TESTS" > "$OUT/gpu-tests.log" 2>&1 ||
    status=1
  grep -E "FAILED|passed|failed" "$OUT/gpu-tests.log" | tail -6
fi

text=$(python3 -c "import sys; sys.path.insert(0, 'tools/bench'); import train_bench; print(train_bench.text_file('$OUT', None))")
read -ra options <<< "$OPTION"
for shape in $SHAPES; do
  step "$shape: without any option, then with each of ${options[*]}, $STEPS steps"
  sides=(default)
  for i in "${!options[@]}"; do sides+=("option$i"); done
  for side in "${sides[@]}"; do
    extra=()
    if [ "$side" != default ]; then
      IFS=, read -ra pairs <<< "${options[${side#option}]}"
      for kv in "${pairs[@]}"; do extra+=(--set "$kv"); done
    fi
    python3 tools/bench/train_bench.py --bin build/cuda/tools/shardswap --out "$OUT/$shape-$side" \
      --shapes "$shape" --modes full --steps "$STEPS" --warmup 5 --text "$text" "${extra[@]}" \
      > "$OUT/$shape-$side.txt" 2>&1 || status=1
    echo "$side ${extra[*]} $(tail -1 "$OUT/$shape-$side.txt")"
  done
  for i in "${!options[@]}"; do
  python3 - "$OUT" "$shape" "${options[$i]}" "option$i" <<'PY' || status=1
import json, os, statistics, sys
out, shape, option, side = sys.argv[1:5]
def run(side):
    d = os.path.join(out, f"{shape}-{side}")
    row = json.load(open(os.path.join(d, "train-bench.json")))["rows"][0]
    losses = [json.loads(l)["loss"] for l in open(os.path.join(d, f"train-bench-{shape}-full.jsonl"))
              if '"loss"' in l]
    return row, losses
(a, la), (b, lb) = run("default"), run(side)
n = min(len(la), len(lb))
diff = max(abs(x - y) for x, y in zip(la[:n], lb[:n])) if n else float("nan")
tail_a, tail_b = statistics.fmean(la[n - 10:n]), statistics.fmean(lb[n - 10:n])
ratio = b["tokens_per_s"] / a["tokens_per_s"]
print(f"{shape}, {option}: tokens/s {a['tokens_per_s']:.0f} -> {b['tokens_per_s']:.0f} (ratio {ratio:.3f}); "
      f"loss over {n} steps: first {la[0]:.5f} / {lb[0]:.5f}, largest difference {diff:.5f}, "
      f"mean of the last 10 {tail_a:.5f} / {tail_b:.5f} ({(tail_b - tail_a) / tail_a:+.3%})")
json.dump({"shape": shape, "option": option, "default": a, "with_option": b, "ratio": ratio,
           "losses_default": la, "losses_option": lb, "largest_difference": diff,
           "last10_default": tail_a, "last10_option": tail_b},
          open(os.path.join(out, f"{shape}-{side}-precision.json"), "w"), indent=1)
PY
  done
done
exit $status
