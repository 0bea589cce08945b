#!/bin/sh
# Signals to a running `shardswap train`: SIGTERM finishes the step, saves it, says so and exits
# 143, and `checkpoint.load=latest` resumes there, continuing exactly as the run made straight
# through; SIGINT and SIGHUP likewise exit 130 and 129 (no checkpoint.dir: nothing saved, and
# said); a second signal ends the process at once, without the save.
# Usage: signals.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/tiny_decoder.json
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "FAIL $*"; exit 1; }
# A shell ignores SIGINT in its background jobs; env gives the run the default back, as a
# terminal's foreground job has it. It execs (so that $! is the run's pid): call it in a subshell.
small() {
  exec env --default-signal=INT,HUP "$bin" train --config "$config" --set world_size=2 \
    --set logging.eval_interval=100000 "$@"
}
# start NAME ARGS...: runs in the background until it has made 3 steps
start() {
  name=$1
  shift
  small "$@" --metrics "$work/$name.jsonl" > "$work/$name.log" 2>&1 &
  pid=$!
  tries=0
  while [ "$(cat "$work/$name.jsonl" 2>/dev/null | wc -l)" -lt 3 ]; do
    kill -0 "$pid" 2>/dev/null || fail "$name ended before its third step: $(cat "$work/$name.log")"
    tries=$((tries + 1))
    [ "$tries" -lt 600 ] || fail "$name made no 3 steps in 60 s"
    sleep 0.1
  done
}
finish() {  # waits for the run started last; its exit code in $code
  wait "$pid"
  code=$?
  pid=
}
last_step() { tail -n 1 "$work/$1.jsonl" | sed 's/.*"step":\([0-9]*\).*/\1/'; }

# SIGTERM with checkpointing: saved at the step it stopped after (not one of `every`'s).
steps=3000
start term --set steps=$steps --set checkpoint.dir="$work/ck" --set checkpoint.every=1000
kill -TERM "$pid"
finish
echo "SIGTERM: exit $code: $(grep -i 'stop' "$work/term.log")"
[ "$code" -eq 143 ] || fail "exit $code, expected 143: $(tail -3 "$work/term.log")"
n=$(last_step term)
[ "$n" -lt "$steps" ] || fail "the run went on to the end"
grep -q "stopping on SIGTERM (signal 15) after step $n of $steps: checkpoint saved: $work/ck/step-$(printf %08d "$n")" \
  "$work/term.log" || fail "no line saying the signal, step $n and the checkpoint"
[ -f "$work/ck/step-$(printf %08d "$n")/metadata.json" ] || fail "no checkpoint at step $n: $(ls "$work/ck")"

# The resume continues where it stopped, exactly as a straight run (timings aside).
(small --set steps=$((n + 20)) --set checkpoint.dir="$work/ck" --set checkpoint.load=latest \
  --metrics "$work/resumed.jsonl") > "$work/resumed.log" 2>&1 || fail "resume: $(cat "$work/resumed.log")"
grep -q "resumed from $work/ck/step-$(printf %08d "$n")" "$work/resumed.log" ||
  fail "the resume did not start at step $n: $(cat "$work/resumed.log")"
(small --set steps=$((n + 20)) --metrics "$work/straight.jsonl") > "$work/straight.log" 2>&1 ||
  fail "straight: $(cat "$work/straight.log")"
python3 - "$work" "$n" <<'PY' || fail "the resumed run differs from the straight one"
import json, sys
work, n = sys.argv[1], int(sys.argv[2])
def lines(name):
    out = []
    for line in open(f"{work}/{name}"):
        m = json.loads(line)
        if "resumed" in m:  # the line saying where a resumed run resumed
            continue
        for k in ("tokens_per_s", "step_seconds"):
            m.pop(k, None)
        out.append(m)
    return out
straight = [m for m in lines("straight.jsonl") if m["step"] > n]
resumed = lines("resumed.jsonl")
assert len(resumed) == 20 and resumed == straight, (resumed[:1], straight[:1])
print(f"resumed at step {n}: 20 steps equal to the straight run's")
PY

# SIGINT and SIGHUP, no checkpoint.dir: the same stop, nothing to save.
for sig in INT:130 HUP:129; do
  name=${sig%:*} want=${sig#*:}
  start "$name" --set steps=$steps
  kill -"$name" "$pid"
  finish
  echo "SIG$name: exit $code: $(grep -i 'stop' "$work/$name.log")"
  [ "$code" -eq "$want" ] || fail "SIG$name: exit $code, expected $want"
  grep -q "stopping on SIG$name .* after step $(last_step "$name") of $steps: no checkpoint" \
    "$work/$name.log" || fail "SIG$name: no line saying the signal, the step and no checkpoint"
done

# A second signal does not wait for the step: the process dies of it, no stop line, no save.
start twice --set steps=$steps --set checkpoint.dir="$work/ck2" --set checkpoint.every=1000 \
  --set model.hidden_size=256 --set model.intermediate_size=1024
kill -TERM "$pid"
kill -INT "$pid"
finish
echo "SIGTERM then SIGINT: exit $code"
[ "$code" -eq 130 ] || [ "$code" -eq 143 ] || fail "exit $code, expected death by SIGINT or SIGTERM"
! grep -q "stopping on\|^done:" "$work/twice.log" || fail "the second signal waited for the step"
[ -z "$(ls "$work/ck2" | grep -v '^\.')" ] || fail "a checkpoint was saved: $(ls "$work/ck2")"
echo "ok"
