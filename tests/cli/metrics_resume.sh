#!/bin/sh
# A resumed run appends to its metrics file: N steps straight against a first run that saved at
# N/2, went on 3 steps more and stopped there mid-line (its last checkpoint lost, a line cut short
# as a kill leaves it), then a resume with checkpoint.load=latest into the same file. The file
# then holds every line of the first run (the cut-off one removed), the line saying where the run
# resumed, then the steps after it, equal to the straight run's (timings aside); `plot` of it
# draws one curve of N steps, and skips a cut-off last line with a warning. A fresh run into the
# file starts it empty.
# Usage: metrics_resume.sh SHARDSWAP CONFIG STEPS
set -eu
bin=$1 config=$2 steps=$3
half=$((steps / 2))
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
small="--set world_size=2"
small="$small --set train_micro_batch_size_per_gpu=4 --set logging.eval_batches=2"
run() {  # NAME METRICS STEPS [more --set]
  name=$1 metrics=$2 n=$3
  shift 3
  # shellcheck disable=SC2086
  "$bin" train --config "$config" $small "$@" --set steps="$n" --set checkpoint.every="$half" \
    --metrics "$metrics" > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
}
run straight "$work/straight.jsonl" "$steps" --set checkpoint.dir="$work/a"
run first "$work/run.jsonl" $((half + 3)) --set checkpoint.dir="$work/b"
rm -r "$work/b/$(ls "$work/b" | tail -1)"  # the save after step half + 3 never happened
printf '{"step": %d, "loss": 5.' $((half + 4)) >> "$work/run.jsonl"  # cut short by a kill
cp "$work/run.jsonl" "$work/cut.jsonl"
run resumed "$work/run.jsonl" "$steps" --set checkpoint.dir="$work/b" --set checkpoint.load=latest
grep -h "resumed from" "$work/resumed.log"

python3 - "$work" "$half" "$steps" <<'PY'
import json, sys
work, half, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def lines(name):
    out = []
    for line in open(f"{work}/{name}"):
        m = json.loads(line)  # every line whole: the cut-off one is gone
        for k in ("tokens_per_s", "step_seconds"):
            m.pop(k, None)
        out.append(m)
    return out
straight, run = lines("straight.jsonl"), lines("run.jsonl")
markers = [i for i, m in enumerate(run) if "resumed" in m]
assert len(markers) == 1, f"{len(markers)} resume lines in run.jsonl ({len(run)} lines), expected 1"
i = markers[0]
marker = run[i]["resumed"]
assert marker["step"] == half and marker["checkpoint"].endswith(f"step-{half:08d}"), marker
before, after = run[:i], run[i + 1:]
assert [m["step"] for m in before] == list(range(1, half + 4)), \
    f"the first run's lines: steps {[m['step'] for m in before]}, expected 1..{half + 3}"
assert [m["step"] for m in after] == list(range(half + 1, steps + 1)), \
    f"after the resume line: steps {[m['step'] for m in after]}"
assert before[:half] == straight[:half], "the first run's lines up to the resume differ"
assert after == straight[half:], "the resumed lines differ from the straight run's"
print(f"run.jsonl: {len(before)} lines of the first run, the resume line at step {half}, "
      f"{len(after)} after it, equal to the straight run")
PY

out=$("$bin" plot "$work/run.jsonl" --out "$work/run.svg" 2>&1)
echo "$out"
echo "$out" | grep -q "($steps steps," || { echo "FAIL: plot of the resumed file is not one curve of $steps steps"; exit 1; }
out=$("$bin" plot "$work/cut.jsonl" --out "$work/cut.svg" 2>&1)
echo "$out"
echo "$out" | grep -q "$work/cut.jsonl.*cut-off last line" ||
  { echo "FAIL: plot of a cut-off last line gives no warning naming the file"; exit 1; }
echo "$out" | grep -q "($((half + 3)) steps," || { echo "FAIL: plot of the cut file"; exit 1; }

run fresh "$work/run.jsonl" 3 --set checkpoint.dir="$work/c"
test "$(wc -l < "$work/run.jsonl")" -eq 3 || { echo "FAIL: a fresh run kept the old lines"; exit 1; }
echo "a fresh run starts the file empty"
