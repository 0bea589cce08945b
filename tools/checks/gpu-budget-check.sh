#!/usr/bin/env bash
# A device budget (shardswap.device_memory) on a machine with an NVIDIA GPU: builds with preset
# cuda, runs the GPU tests of the budget (tests/gpu/budget_gpu_test.cpp) and trains a
# Qwen2.5-shaped full fine-tune or LISA run (tools/bench/train_bench.py, seq 2048, from scratch on
# real text) twice in one run: as configured, with every byte on the GPU, and under the budget,
# where the planner chooses where the optimizer state lives and how many layers are
# recomputed. Prints what the planner chose, both rows, the budgeted run's tokens/s over the
# unbudgeted one's, and what the GPU held outside the plan against shardswap.device_reserve.
# GLOBAL=1 gives the budgeted run's config train_batch_size MICRO x ACCUMULATION alone (no
# micro-batch or accumulation), so that the budget may choose a smaller micro-batch for the same
# global batch as the unbudgeted run's.
# Logs and JSON go under $OUT (default build/gpu-out).
#   usage: OUT=DIR [SHAPE=7b] [MODE=full|lisa] [MICRO=3] [BUDGET=48GiB] [ACCUMULATION=8] [STEPS=8] [WARMUP=3]
#          [SKIP_UNBUDGETED=1] [GLOBAL=1] bash tools/checks/gpu-budget-check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-out}
SHAPE=${SHAPE:-7b}
MICRO=${MICRO:-3}
MODE=${MODE:-full}
config="configs/qwen2.5-$SHAPE.json"
[ "$MODE" = lisa ] && config="configs/qwen2.5-$SHAPE-lisa.json"
BUDGET=${BUDGET:-48GiB}
ACCUMULATION=${ACCUMULATION:-8}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $* ==="; }

step "machine"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "cores $(nproc), memory $(free -g | awk '/Mem:/ {print $2}') GiB"
} | tee "$OUT/machine.txt"

step "configure and build"
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli shardswap_gpu_tests \
    >> "$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then tail -60 "$OUT/build.log"; exit 1; fi
bin=build/cuda/tools/shardswap

step "GPU tests: a budgeted run against its arrangement written out, the cap"
build/cuda/tests/gpu/shardswap_gpu_tests "cuda: a run under a budget*,cuda: an allocation past*" \
  > "$OUT/gpu-budget-tests.log" 2>&1 || status=1
grep -E "FAILED|passed|failed" "$OUT/gpu-budget-tests.log" | tail -4

batch=(--set train_micro_batch_size_per_gpu="$MICRO" --set gradient_accumulation_steps="$ACCUMULATION")
GLOBAL_BATCH=
[ "${GLOBAL:-0}" = 1 ] && GLOBAL_BATCH=$((MICRO * ACCUMULATION))
if [ -n "$GLOBAL_BATCH" ]; then  # the config without its micro-batch and accumulation
  python3 - "$config" "$OUT/config-global.json" "$GLOBAL_BATCH" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
    c.pop(key, None)
c["train_batch_size"] = int(sys.argv[3])
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
  config="$OUT/config-global.json"
  batch=()
fi
step "the plan under a budget of $BUDGET ($SHAPE $MODE, micro $MICRO, accumulation $ACCUMULATION${GLOBAL_BATCH:+: the global batch $GLOBAL_BATCH alone})"
"$bin" plan --config "$config" --set data.seq_len=2048 "${batch[@]}" \
  --device-memory "$BUDGET" \
  2>&1 | tee "$OUT/plan.txt" || status=1

runs="budget"
[ "${SKIP_UNBUDGETED:-0}" = 1 ] || runs="unbudgeted budget"
for run in $runs; do
  step "training, $run"
  dir="$OUT/train-$run"
  extra=(--set gradient_accumulation_steps="$ACCUMULATION")
  [ "$run" = budget ] && extra+=(--set "shardswap.device_memory=$BUDGET")
  # Under GLOBAL=1 the budgeted run gives the global batch alone.
  [ "$run" = budget ] && [ -n "$GLOBAL_BATCH" ] &&
    extra=(--set "shardswap.device_memory=$BUDGET" --global-batch "$GLOBAL_BATCH")
  python3 tools/bench/train_bench.py --bin "$bin" --out "$dir" --shapes "$SHAPE" --modes "$MODE" \
    --micro "$SHAPE=$MICRO" --steps "$STEPS" --warmup "$WARMUP" "${extra[@]}" \
    > "$dir.txt" 2>&1 || status=1
  tail -3 "$dir.txt"
  grep -hE "device budget|chosen|held outside|outside it|host memory of rank 0|warning" \
    "$dir"/*.log | head -12
done

step "budgeted over unbudgeted tokens/s"
python3 - "$OUT" <<'PY'
import json, os, sys
rows = {}
for run in ("unbudgeted", "budget"):
    path = os.path.join(sys.argv[1], f"train-{run}", "train-bench.json")
    if os.path.exists(path):
        rows[run] = json.load(open(path))["rows"][0]
for run, r in rows.items():
    print(f"{run}: tokens/s {r.get('tokens_per_s', 0):.0f}, plan {r.get('plan_mib', 0):.1f} MiB, "
          f"peak {r.get('peak_mib', 0):.1f} MiB, engine.step() "
          f"{r.get('split_ms', {}).get('engine.step()', 0):.1f} ms, first loss "
          f"{r.get('loss_first', 0):.6f}, last five {r.get('loss_last5', 0):.6f}"
          + (f", VOID: {r['void']}" if "void" in r else ""))
if len(rows) == 2 and all("tokens_per_s" in r for r in rows.values()):
    print(f"ratio: {rows['budget']['tokens_per_s'] / rows['unbudgeted']['tokens_per_s']:.3f}")
PY
exit $status
