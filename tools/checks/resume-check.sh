#!/bin/sh
# Exact resume through the CLI: N steps straight against N/2 steps, save, and N/2 more in a new
# process resuming from the checkpoint. Every metrics line after the save point (timings and the
# driver's device memory figures aside) and the final checkpoint's binary files must be identical;
# where a line differs it says which keys, and how.
#   usage: resume-check.sh SHARDSWAP CONFIG STEPS [--set k=v]...
set -eu
bin=$1 config=$2 steps=$3
shift 3
half=$((steps / 2))
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # dir metrics steps [more --set]
  dir=$1 metrics=$2 n=$3
  shift 3
  "$bin" train --config "$config" "$@" --set steps="$n" --set checkpoint.dir="$dir" \
    --set checkpoint.every="$half" --set checkpoint.keep=4 --metrics "$metrics" > "$dir.log" 2>&1 ||
    { cat "$dir.log"; exit 1; }
}
mkdir -p "$work/straight" "$work/resumed"
run "$work/straight" "$work/straight.jsonl" "$steps" "$@"
run "$work/resumed" "$work/first.jsonl" "$half" "$@"
run "$work/resumed" "$work/second.jsonl" "$steps" --set checkpoint.load=latest "$@"
grep -h "resumed from" "$work/resumed.log"
python3 - "$work" "$half" <<'PY'
import json, sys
work, half = sys.argv[1], int(sys.argv[2])
def lines(name):
    out = []
    for line in open(f"{work}/{name}"):
        m = json.loads(line)
        if "resumed" in m:  # the resumed run's first line: where it resumed, no step
            continue
        # Timings, and the driver's free/total device memory: figures of the process (a resumed
        # process logs them at its first step, and its CUDA context holds other bytes than the
        # straight one's), not of the training state this check compares.
        for k in ("tokens_per_s", "step_seconds", "device_free_bytes", "device_total_bytes"):
            m.pop(k, None)
        if "switch" in m:
            m["switch"].pop("seconds", None)
        out.append(m)
    return out
straight = [m for m in lines("straight.jsonl") if m["step"] > half]
resumed = lines("second.jsonl")
assert [m["step"] for m in resumed] == [m["step"] for m in straight], "different steps"
bad = [a["step"] for a, b in zip(straight, resumed) if a != b]
switches = sum(1 for m in lines("straight.jsonl") if "switch" in m)
print(f"{len(resumed)} steps after the save point compared, {switches} switches in the run, "
      f"{len(bad)} differing" + (f": steps {bad[:5]}" if bad else ""))
for a, b in [(a, b) for a, b in zip(straight, resumed) if a != b][:3]:  # what differs, and how
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    print(f"  step {a['step']}: " + "; ".join(f"{k}: straight {a.get(k)!r}, resumed {b.get(k)!r}"
                                           for k in keys))
sys.exit(1 if bad else 0)
PY
a=$(ls -d "$work"/straight/step-* | tail -1) b=$(ls -d "$work"/resumed/step-* | tail -1)
# Every save has its own random save id (in each file's header, and so in its checksum): the
# files must be identical but for it.
python3 - "$a" "$b" <<'PY'
import json, os, struct, sys
def content(path):
    b = open(path, "rb").read()
    (h,) = struct.unpack("<Q", b[8:16])
    header = json.loads(b[16:16 + h])
    header.pop("save_id")
    return b[:8], header, b[16 + h:-8]
names = sorted(f for f in os.listdir(sys.argv[1]) if f.endswith(".bin"))
for f in names:
    if content(os.path.join(sys.argv[1], f)) != content(os.path.join(sys.argv[2], f)):
        sys.exit(f"final checkpoints differ: {f}")
print("final checkpoint files identical but for their save id: " + " ".join(names))
PY
