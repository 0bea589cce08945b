#!/bin/sh
# One process per rank, as users launch DeepSpeed jobs: `mpirun -np N shardswap train` of CONFIG
# (world_size "auto": the job's N) writes the same metrics, bit for bit (timings aside), as the
# same config trained by N in-process ranks (world_size = N); rank 0 alone prints the run's
# header and summary and writes the metrics. With a checkpoint.dir, both save after the last
# step and their checkpoints export the same fp32 masters byte for byte; and a job resumed from
# the middle with checkpoint.load = latest (rank 0 picks it and tells the others) continues the
# in-process run's metrics exactly. A config warning is printed once, by rank 0.
# Usage: mpi_train.sh SHARDSWAP REPO_ROOT CONFIG NP STEPS [--set key=value]...
set -u
bin=$1
root=$2
config=$3
np=$4
steps=$5
shift 5
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root" || exit 1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
mpirun_sh() { sh "$here/mpirun.sh" "$@"; }

# same A B [STEP]: the metrics files A and B hold the same records, timings aside (at least one),
# resume lines skipped (a switch's seconds are timing too); STEP's val_loss ignored (the first half of a resumed run is evaluated at
# its last step, which the straight run is not).
same() {
  python3 - "$1" "$2" "${3:-0}" <<'PY'
import json, sys
timing = {"step_seconds", "tokens_per_s", "memory_bytes", "phase_seconds"}
cut = int(sys.argv[3])
def records(path):
    out = []
    for line in open(path):
        r = json.loads(line)
        if "resumed" in r:
            continue
        r = {k: v for k, v in r.items() if k not in timing}
        if "switch" in r:  # a layer switch's own time
            r["switch"] = {k: v for k, v in r["switch"].items() if k != "seconds"}
        if r.get("step") == cut:
            r.pop("val_loss", None)
        out.append(r)
    return out
a, b = records(sys.argv[1]), records(sys.argv[2])
if not a or a != b:
    sys.exit(f"{len(a)} / {len(b)} records; first difference: "
             f"{next(((x, y) for x, y in zip(a, b) if x != y), None)}")
PY
}

# The config with one key that ShardSwap reads and only warns about (DeepSpeed's steps_per_print):
# each rank reads the config, rank 0 alone prints the warning.
python3 - "$config" "$work/config.json" <<'PY' || exit 1
import json, sys
c = json.load(open(sys.argv[1]))
c["steps_per_print"] = 1
json.dump(c, open(sys.argv[2], "w"))
PY
config=$work/config.json

t0=$(date +%s)
"$bin" train --config "$config" --set world_size="$np" --set steps="$steps" "$@" \
  --set checkpoint.dir="$work/ckpt-threads" --set checkpoint.every="$steps" \
  --metrics "$work/threads.jsonl" > "$work/threads.log" 2>&1 ||
  fail "in-process train: exit $? ($(tail -3 "$work/threads.log"))"
t1=$(date +%s)
mpirun_sh "$np" "$bin" train --config "$config" --set world_size=auto --set steps="$steps" "$@" \
  --set checkpoint.dir="$work/ckpt-mpi" --set checkpoint.every="$steps" \
  --metrics "$work/mpi.jsonl" > "$work/mpi.log" 2>&1 ||
  fail "mpirun -np $np train: exit $? ($(tail -5 "$work/mpi.log"))"
t2=$(date +%s)
echo "$config at $np ranks, $steps steps: in-process $((t1 - t0)) s, mpirun $((t2 - t1)) s"

lines=$(wc -l < "$work/mpi.jsonl" 2>/dev/null || echo 0)
[ "$lines" -eq "$steps" ] || fail "mpirun metrics: $lines lines, not $steps"
same "$work/threads.jsonl" "$work/mpi.jsonl" || fail "metrics of mpirun -np $np differ from $np in-process ranks"
[ "$(grep -c '^shardswap train:' "$work/mpi.log")" -eq 1 ] ||
  fail "the run's header is not printed once: $(grep '^shardswap train:' "$work/mpi.log")"
grep -q "world size $np (cpu, mpi, a process per rank)" "$work/mpi.log" ||
  fail "the header does not say world size $np over mpi: $(grep '^shardswap train:' "$work/mpi.log")"
[ "$(grep -c '^done:' "$work/mpi.log")" -eq 1 ] || fail "the summary is not printed once"
[ "$(grep -c 'steps_per_print' "$work/mpi.log")" -eq 1 ] ||
  fail "the config's warning is not printed once: $(grep 'steps_per_print' "$work/mpi.log")"

export_master() {  # export_master DIR OUT: the fp32 masters of DIR's newest checkpoint
  ckpt=$(ls -d "$1"/step-* 2>/dev/null | tail -1)
  [ -n "$ckpt" ] && "$bin" ckpt export "$ckpt" --master --out "$2" > /dev/null 2>&1
}
if export_master "$work/ckpt-threads" "$work/threads.safetensors" &&
   export_master "$work/ckpt-mpi" "$work/mpi.safetensors"; then
  cmp -s "$work/threads.safetensors" "$work/mpi.safetensors" ||
    fail "the checkpoints' fp32 masters differ (in-process vs mpirun)"
  for f in "$work"/ckpt-mpi/step-*/rank-*; do
    [ -e "$work/ckpt-threads/$(basename "$(dirname "$f")")/$(basename "$f")" ] ||
      fail "mpirun wrote $(basename "$f"), which the in-process run did not"
  done
else
  fail "no checkpoint to export ($(ls "$work"/ckpt-* 2>&1 | tr '\n' ' '))"
fi

# Resumed in the middle: half the steps, then checkpoint.load = latest up to all of them.
half=$((steps / 2))
if [ "$half" -ge 1 ]; then
  mpirun_sh "$np" "$bin" train --config "$config" --set world_size=auto --set steps="$half" "$@" \
    --set checkpoint.dir="$work/ckpt-resume" --set checkpoint.every="$half" \
    --metrics "$work/resume.jsonl" > "$work/resume1.log" 2>&1 ||
    fail "mpirun first half: exit $? ($(tail -5 "$work/resume1.log"))"
  mpirun_sh "$np" "$bin" train --config "$config" --set world_size=auto --set steps="$steps" "$@" \
    --set checkpoint.dir="$work/ckpt-resume" --set checkpoint.every="$steps" \
    --set checkpoint.load=latest --metrics "$work/resume.jsonl" > "$work/resume2.log" 2>&1 ||
    fail "mpirun resumed: exit $? ($(tail -5 "$work/resume2.log"))"
  grep -q "resumed from .*step-0*$half" "$work/resume2.log" ||
    fail "the second job did not resume at step $half: $(grep -i resum "$work/resume2.log")"
  same "$work/threads.jsonl" "$work/resume.jsonl" "$half" ||
    fail "the resumed mpirun job's metrics differ from the straight in-process run"
fi
echo "resume: $(($(date +%s) - t2)) s"

[ $failures -eq 0 ] && echo "mpi_train: all checks passed ($config, $np ranks)"
exit $((failures != 0))
