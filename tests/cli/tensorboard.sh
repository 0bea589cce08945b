#!/bin/sh
# DeepSpeed's tensorboard section as users run it: the quickstart config and a LISA run write
# event files under output_path/job_name beside their --metrics files, and TensorBoard's own
# reader (the PyPI package tensorboard, EventAccumulator) finds in them exactly the metrics
# lines' numbers, tag for tag and step for step (as float32), and the layer switches as text.
# The LISA run is stopped after step 11 with its last checkpoint lost and resumed from step 8: the
# reader then shows the first run's events up to step 8 and the resumed run's after it, as the
# metrics file's resume line says. Installs tensorboard with pip where it is missing; exits 77
# (skipped), saying why, where it cannot.
# Usage: tensorboard.sh SHARDSWAP CONFIGS_DIR
set -eu
bin=$1 configs=$2
importable() { python3 -c "import tensorboard.backend.event_processing.event_accumulator" 2>/dev/null; }
if ! importable; then
  pip_log=$(mktemp)
  python3 -m pip install --quiet --user tensorboard > "$pip_log" 2>&1 ||
    python3 -m pip install --quiet --user --break-system-packages tensorboard >> "$pip_log" 2>&1 ||
    true
  if ! importable; then
    echo "SKIP: the Python package 'tensorboard' is missing and pip could not install it:"
    tail -3 "$pip_log"
    rm -f "$pip_log"
    exit 77
  fi
  rm -f "$pip_log"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # NAME CONFIG [more arguments]
  name=$1 config=$2
  shift 2
  "$bin" train --config "$config" --set world_size=2 --set logging.eval_batches=2 \
    --set tensorboard.enabled=true --set tensorboard.output_path="$work/tb" \
    "$@" > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
}
run quick "$configs/quickstart.json" --set steps=6 --set logging.eval_interval=3 \
  --set tensorboard.job_name=quick --metrics "$work/quick.jsonl"
lisa="--set steps=11 --set layer_switching.interval=4 --set logging.eval_interval=5"
lisa="$lisa --set checkpoint.dir=$work/ck --set checkpoint.every=4 --set tensorboard.job_name=lisa"
# shellcheck disable=SC2086
run lisa "$configs/lisa.json" $lisa --metrics "$work/lisa.jsonl"
rm -r "$work/ck/$(ls "$work/ck" | grep '^step-' | tail -1)"  # the save after step 11 is lost
# Event files are read in name order, which starts with the time in seconds: the resumed run's
# must come after the first's.
sleep 1
# shellcheck disable=SC2086
run resumed "$configs/lisa.json" $lisa --set steps=12 --set checkpoint.load=latest \
  --metrics "$work/lisa.jsonl"
grep -h "resumed from" "$work/resumed.log"

python3 - "$work" <<'PY'
import json, math, os, re, socket, sys
import numpy as np
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.util import tensor_util

work = sys.argv[1]

def values_of(line):
    """The tags docs/config.md says a metrics line gives: every number by key path, booleans as
    1 and 0, nulls left out; lists of strings as texts of code spans."""
    scalars, texts = {}, {}
    def walk(node, tag):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{tag}/{k}")
        elif isinstance(node, bool):
            scalars[tag] = 1.0 if node else 0.0
        elif isinstance(node, (int, float)):
            scalars[tag] = float(node)
        elif isinstance(node, str):
            texts[tag] = node
        elif isinstance(node, list) and all(isinstance(x, str) for x in node):
            texts[tag] = ", ".join(f"`{x}`" for x in node) or "(none)"
    for k, v in line.items():
        if k != "step":
            walk(v, k)
    return scalars, texts

def expected(jsonl):
    """(tag, step) -> value of the scalars and of the texts the metrics file says TensorBoard
    shows: a resume line drops the lines after its step; active_groups comes at a process's
    first step and at every switch."""
    steps = {}
    first = True
    for text in open(jsonl):
        m = json.loads(text)
        if "resumed" in m:
            cut = m["resumed"]["step"]
            steps = {s: v for s, v in steps.items() if s <= cut}
            first = True
            continue
        steps[m["step"]] = (m, first)
        first = False
    scalars, texts = {}, {}
    for step, (m, first) in steps.items():
        s, t = values_of(m)
        if not (first or "switch" in m):
            t.pop("active_groups", None)
        scalars.update({(tag, step): v for tag, v in s.items()})
        texts.update({(tag, step): v for tag, v in t.items()})
    return scalars, texts

def check(job, must_have):
    folder = f"{work}/tb/{job}"
    names = sorted(os.listdir(folder))
    pattern = rf"events\.out\.tfevents\.\d+\.{re.escape(socket.gethostname())}\.\d+"
    assert names and all(re.fullmatch(pattern, n) for n in names), f"{folder}: {names}"
    acc = ea.EventAccumulator(folder, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    got_scalars, got_texts = {}, {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            assert (tag, e.step) not in got_scalars, f"{job}: {tag} twice at step {e.step}"
            got_scalars[(tag, e.step)] = e.value
    # The accumulator's purge on a SessionLog START leaves tensors alone (tensorboard 2.21: its
    # accumulated_attrs lack them), so the stopped run's texts past the checkpoint stay beside
    # the resumed run's, which it reads later: the last text of a tag and step is the one shown.
    for tag in acc.Tags()["tensors"]:
        for e in acc.Tensors(tag):
            got_texts[(tag, e.step)] = tensor_util.make_ndarray(e.tensor_proto).item().decode()
    want_scalars, want_texts = expected(f"{work}/{job}.jsonl")
    missing = sorted(set(want_scalars) - set(got_scalars))
    extra = sorted(set(got_scalars) - set(want_scalars))
    assert not missing and not extra, f"{job}: missing {missing[:8]}, not in the metrics {extra[:8]}"
    wrong = [(k, v, got_scalars[k]) for k, v in want_scalars.items()
             if not (np.float32(v) == np.float32(got_scalars[k]))]
    assert not wrong, f"{job}: (tag, step), metrics, tensorboard: {wrong[:8]}"
    assert got_texts == want_texts, f"{job}: texts {got_texts} != {want_texts}"
    tags = {t for t, _ in got_scalars} | {t for t, _ in got_texts}
    absent = [t for t in must_have if t not in tags]
    assert not absent, f"{job}: no {absent} among {sorted(tags)}"
    print(f"{job}: {len(names)} event file(s), {len(got_scalars)} scalars of {len(tags)} tags "
          f"and {len(got_texts)} texts, equal to {job}.jsonl")

core = ["loss", "val_loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "step_seconds",
        "memory_bytes/total", "memory_bytes/grad", "memory_bytes/peak", "active_groups"]
check("quick", core)
check("lisa", core + ["switch/in", "switch/out", "switch/bytes_freed", "switch/seconds"])
PY
