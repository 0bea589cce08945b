#!/usr/bin/env bash
# Lighter optimizer state on a machine with an NVIDIA GPU (shardswap.optimizer_state_dtype bf16,
# shardswap.master_weights bf16_remainder): builds with preset cuda, runs the GPU suite (the
# update kernels give the CPU kernels' bits with every state and master storage), then
#  1. with BIG=1 first, Qwen2.5-7B full (micro 3, accumulation BIG_ACCUMULATION, BIG_STEPS steps)
#     unbudgeted and under a 48GiB budget with each of OPTIONS, in one run: tokens/s and their
#     ratio to the unbudgeted run;
#  2. Qwen2.5-shaped full fine-tunes (tools/bench/train_bench.py, from scratch on real text) with
#     each of OPTIONS, the state on the device (PLACEMENTS=none) and on the host streamed (cpu):
#     tokens/s, the plans, and the loss every 5 steps of each option against fp32's (none with
#     PLACEMENTS="").
# OPTIONS: fp32 (the default), bf16 (bf16 m and v), bf16-remainder (bf16 m and v, the master as
# its low 16 bits beside the bf16 weight), remainder (fp32 m and v, the master so).
# Logs and JSON go under $OUT (default build/gpu-out).
#   usage: OUT=DIR [SHAPES=0.5b] [STEPS=60] [ACCUMULATION=8] [OPTIONS="fp32 bf16 bf16-remainder"]
#          [PLACEMENTS="none cpu"] [BIG=0] [BIG_ACCUMULATION=8] [BIG_STEPS=6] [SUITE=1] bash tools/checks/gpu-light-state-check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-out}
SHAPES=${SHAPES:-0.5b}
STEPS=${STEPS:-60}
ACCUMULATION=${ACCUMULATION:-8}
OPTIONS=${OPTIONS:-fp32 bf16 bf16-remainder}
PLACEMENTS=${PLACEMENTS-none cpu}
BIG_ACCUMULATION=${BIG_ACCUMULATION:-8}
BIG_STEPS=${BIG_STEPS:-6}
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $* ==="; }

# The --set arguments of an option.
sets_of() {
  case $1 in
    fp32) echo "--set shardswap.optimizer_state_dtype=fp32 --set shardswap.master_weights=fp32" ;;
    bf16) echo "--set shardswap.optimizer_state_dtype=bf16 --set shardswap.master_weights=fp32" ;;
    bf16-remainder) echo "--set shardswap.optimizer_state_dtype=bf16 --set shardswap.master_weights=bf16_remainder" ;;
    remainder) echo "--set shardswap.optimizer_state_dtype=fp32 --set shardswap.master_weights=bf16_remainder" ;;
    *) echo "unknown option $1 (fp32, bf16, bf16-remainder, remainder)" >&2; exit 2 ;;
  esac
}
for option in $OPTIONS; do sets_of "$option" > /dev/null; done

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"

step "configure and build"
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli shardswap_gpu_tests \
    >> "$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then tail -60 "$OUT/build.log"; exit 1; fi
bin=build/cuda/tools/shardswap

if [ "${BIG:-0}" = 1 ]; then
  step "Qwen2.5-7B full, micro 3, accumulation $BIG_ACCUMULATION: unbudgeted, and under 48GiB with: $OPTIONS"
  for run in unbudgeted $OPTIONS; do
    extra=()
    [ "$run" = unbudgeted ] || extra=(--set shardswap.device_memory=48GiB $(sets_of "$run"))
    python3 tools/bench/train_bench.py --bin "$bin" --out "$OUT/7b-$run" --shapes 7b --modes full \
      --steps "$BIG_STEPS" --warmup 2 --set gradient_accumulation_steps="$BIG_ACCUMULATION" \
      "${extra[@]}" \
      > "$OUT/7b-$run.txt" 2>&1 || status=1
    echo "--- $run"
    tail -1 "$OUT/7b-$run.txt"
    grep -hE "chosen \(|host memory of rank 0" "$OUT/7b-$run"/*.log | head -2
  done
  python3 - "$OUT" $OPTIONS <<'PY'
import json, os, sys
out, options = sys.argv[1], sys.argv[2:]
def row(run):
    path = os.path.join(out, f"7b-{run}", "train-bench.json")
    return json.load(open(path))["rows"][0] if os.path.exists(path) else {}
base = row("unbudgeted").get("tokens_per_s")
for run in options:
    r = row(run)
    if base and "tokens_per_s" in r:
        print(f"48GiB, {run}: {r['tokens_per_s']:.0f} tokens/s = {r['tokens_per_s'] / base:.3f} of "
              f"unbudgeted {base:.0f}; engine.step() {r['split_ms'].get('engine.step()', 0):.1f} ms")
PY
fi

if [ "${SUITE:-1}" = 1 ]; then
  step "GPU suite (the update kernels with every state and master storage among it)"
  build/cuda/tests/gpu/shardswap_gpu_tests --durations yes > "$OUT/gpu-tests.log" 2>&1 || status=1
  grep -E "FAILED|passed|failed" "$OUT/gpu-tests.log" | tail -8
fi

[ -n "$PLACEMENTS" ] || exit $status
step "training: $OPTIONS ($SHAPES, accumulation $ACCUMULATION, $STEPS steps)"
for placement in $PLACEMENTS; do
  for option in $OPTIONS; do
    dir="$OUT/train-$placement-$option"
    python3 tools/bench/train_bench.py --bin "$bin" --out "$dir" --shapes "$SHAPES" --modes full \
      --steps "$STEPS" --warmup 5 --set gradient_accumulation_steps="$ACCUMULATION" \
      --set zero_optimization.offload_optimizer.device=$placement \
      --set zero_optimization.offload_optimizer.pin_memory=true \
      $(sets_of "$option") > "$dir.txt" 2>&1 || status=1
    echo "--- offload_optimizer.device $placement, $option"
    tail -1 "$dir.txt"
  done
done
python3 - "$OUT" "$SHAPES" "$PLACEMENTS" $OPTIONS <<'PY'
import json, os, sys
out, shape, placements, options = sys.argv[1], sys.argv[2].split(",")[0], sys.argv[3].split(), sys.argv[4:]
def losses(run):
    path = os.path.join(out, f"train-{run}", f"train-bench-{shape}-full.jsonl")
    return [json.loads(l)["loss"] for l in open(path)] if os.path.exists(path) else []
for placement in placements:
    runs = {o: losses(f"{placement}-{o}") for o in options}
    ref = runs.get("fp32") or next(iter(runs.values()))
    print(f"losses, offload_optimizer.device {placement}: step, " + ", ".join(options))
    for i in range(0, min(len(v) for v in runs.values()) if runs else 0, 5):
        print(f"  {i + 1:4d} " + " ".join(f"{runs[o][i]:.4f}" for o in options))
    for o, v in runs.items():
        if v and ref and o != "fp32":
            d = [b - a for a, b in zip(ref, v)]
            print(f"  {o} - fp32: largest {max(map(abs, d)):.4f}, mean {sum(d) / len(d):+.5f}")
PY
exit $status
