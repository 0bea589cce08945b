#!/usr/bin/env bash
# Decoder training speed of this tree against another commit's, in one run on a machine with an
# NVIDIA GPU: the other commit checked out in a git worktree under OUT (or, where BASE names a
# folder, that folder's sources copied there: for a commit the machine's clone may not have,
# made by `git archive <commit> | tar x -C FOLDER`; a relative path is from the repository root),
# both built with preset cuda (target shardswap_cli), then tools/bench/train_bench.py for each
# shape and mode with the two binaries in turn (BASE, this tree, BASE, ...), so that both see
# the same machine state.
# Prints each pair's tokens/s, the ratio and the phase split, and writes OUT/ab.json.
#   usage: OUT=DIR BASE=<commit or folder> [SHAPES="0.5b 1.5b"] [MODES=full] [STEPS=25] [ROUNDS=1]
#          [TESTS="<GPU test filter>"] [SET="KEY=VALUE ..."] bash tools/bench/ab_train.sh
# SET's keys are set in both sides' runs (train_bench.py --set), logging.timing=false say.
# TESTS, when set, runs those GPU test cases of this tree first (shardswap_gpu_tests). PROFILE=1
# then times every kernel of one step of this tree at Qwen2.5-0.5B, micro 8, seq 2048 on the same
# text (tools/bench/profile_step.sh, needs ncu): OUT/profile/, and the table by kind of kernel in
# OUT/profile-kinds.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:?set OUT to the folder for the results}
BASE=${BASE:?set BASE to the commit, or a folder of the sources, to compare against}
SHAPES=${SHAPES:-0.5b 1.5b}
MODES=${MODES:-full}
STEPS=${STEPS:-25}
ROUNDS=${ROUNDS:-1}
if [ -d "$BASE" ] && [ ! -f "$BASE/CMakeLists.txt" ]; then
  echo "BASE=$BASE: a folder without CMakeLists.txt" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
status=0
step() { echo; echo "=== $* ==="; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
echo "this tree: $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' + changes'), base: $BASE${SET:+, set: $SET}" |
  tee -a "$OUT/machine.txt"

step "build this tree and $BASE"
targets=(shardswap_cli)
[ -n "${TESTS:-}" ] && targets+=(shardswap_gpu_tests)
cmake --preset cuda > "$OUT/build.log" 2>&1 &&
  cmake --build --preset cuda -j "$(nproc)" --target "${targets[@]}" >> "$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; exit 1; }
base_tree="$OUT/base-tree"
rm -rf "$base_tree"
git worktree prune
if [ -d "$BASE" ]; then
  mkdir -p "$base_tree" && (cd "$BASE" && tar cf - --exclude=./build --exclude=./.git .) |
    (cd "$base_tree" && tar xf -)
else
  git worktree add --detach "$base_tree" "$BASE"
fi > "$OUT/base-build.log" 2>&1 &&
  (cd "$base_tree" && cmake --preset cuda && cmake --build --preset cuda -j "$(nproc)" \
    --target shardswap_cli) >> "$OUT/base-build.log" 2>&1 ||
  { tail -40 "$OUT/base-build.log"; exit 1; }

if [ -n "${TESTS:-}" ]; then
  step "GPU tests: $TESTS"
  build/cuda/tests/gpu/shardswap_gpu_tests --durations yes "$TESTS" > "$OUT/gpu-tests.log" 2>&1 ||
    status=1
  grep -E "FAILED|passed|failed" "$OUT/gpu-tests.log" | tail -8
fi

step "train_bench: $BASE, then this tree, per shape and mode"
text=$(python3 -c "import sys; sys.path.insert(0, 'tools/bench'); import train_bench; print(train_bench.text_file('$OUT', None))")
for round in $(seq "$ROUNDS"); do
  for shape in $SHAPES; do
    for mode in $MODES; do
      for side in base this; do
        bin=build/cuda/tools/shardswap
        [ $side = base ] && bin="$base_tree/build/cuda/tools/shardswap"
        dir="$OUT/$side-$shape-$mode-$round"
        sets=()
        for kv in ${SET:-}; do sets+=(--set "$kv"); done
        python3 tools/bench/train_bench.py --bin "$bin" --out "$dir" --shapes "$shape" \
          --modes "$mode" --steps "$STEPS" --warmup 5 --text "$text" "${sets[@]}" > "$dir.txt" 2>&1 ||
          status=1
        echo "$side $(tail -1 "$dir.txt")"
      done
    done
  done
done

step "ratios (this tree over $BASE)"
python3 - "$OUT" "$SHAPES" "$MODES" "$ROUNDS" <<'PY' || status=1
import json, os, sys
out, shapes, modes, rounds = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4])
def row(side, shape, mode, r):
    path = os.path.join(out, f"{side}-{shape}-{mode}-{r}", "train-bench.json")
    return json.load(open(path))["rows"][0] if os.path.exists(path) else {}
pairs = []
for shape in shapes:
    for mode in modes:
        for r in range(1, rounds + 1):
            b, t = row("base", shape, mode, r), row("this", shape, mode, r)
            bt, tt = b.get("tokens_per_s"), t.get("tokens_per_s")
            ratio = tt / bt if bt and tt else None
            pairs.append({"shape": shape, "mode": mode, "round": r, "base": bt, "this": tt,
                          "ratio": ratio, "base_split_ms": b.get("split_ms"),
                          "this_split_ms": t.get("split_ms"), "base_loss_first": b.get("loss_first"),
                          "this_loss_first": t.get("loss_first"), "base_peak_mib": b.get("peak_mib"),
                          "this_peak_mib": t.get("peak_mib")})
            fmt = lambda v: f"{v:10.0f}" if v else f"{'-':>10}"
            print(f"{shape:>5} {mode:>5} round {r}: {fmt(bt)} -> {fmt(tt)} tokens/s  ratio "
                  f"{ratio:.3f}" if ratio else f"{shape} {mode} round {r}: a run failed")
json.dump({"pairs": pairs}, open(os.path.join(out, "ab.json"), "w"), indent=1)
PY
git worktree remove --force "$base_tree" 2>/dev/null || rm -rf "$base_tree"

if [ "${PROFILE:-0}" = 1 ]; then
  step "kernels of one step of this tree (Qwen2.5-0.5B, micro 8, seq 2048)"
  bash tools/bench/profile_step.sh "$OUT/profile" configs/qwen2.5-0.5b.json \
    --set data.seq_len=2048 --set "data.train=$text" --set train_micro_batch_size_per_gpu=8 \
    > "$OUT/profile.log" 2>&1 || status=1
  python3 tools/bench/kernel_table.py --by kind "$OUT/profile/qwen2.5-0.5b.csv" |
    tee "$OUT/profile-kinds.txt" || status=1
fi
exit $status
