#!/bin/sh
# A job of one process per rank never hangs on a failure (docs/launch.md): a world_size that is
# not the job's is refused with exit 2 naming the key, before anything is written; a rank killed
# mid-run (SIGKILL) ends the job with exit != 0 and mpirun's message naming it; a rank that stops
# (SIGSTOP: alive, but never joining the next collective) ends it once shardswap.comm_timeout_s
# runs out, every other rank printing the collective it timed out in.
# Usage: mpi_failure.sh SHARDSWAP REPO_ROOT
set -u
bin=$1
root=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
job=
victim=
cleanup() {
  [ -n "$victim" ] && kill -9 "$victim" 2> /dev/null
  [ -n "$job" ] && kill -9 "$job" 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT
cd "$root" || exit 1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# A world_size the job does not have: every rank refuses it, exit 2, no metrics file.
sh "$here/mpirun.sh" 2 "$bin" train --config configs/quickstart.json --set world_size=3 \
  --metrics "$work/bad.jsonl" > "$work/bad.log" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "world_size = 3 under mpirun -np 2: exit $rc, not 2"
grep -q "world_size = 3: this process is one of 2" "$work/bad.log" ||
  fail "world_size = 3: not named in: $(head -5 "$work/bad.log")"
[ ! -e "$work/bad.jsonl" ] || fail "world_size = 3: a metrics file was written"

# rank_pid JOB RANK: the pid of rank RANK among mpirun JOB's children.
rank_pid() {
  for p in $(ps -o pid= --ppid "$1"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$p"
      return
    fi
  done
}

# failed_rank SIGNAL TIMEOUT_S LIMIT_S: starts a long run, sends SIGNAL to rank 1 once it trains,
# and waits at most LIMIT_S for the job to end. Sets rc and seconds.
failed_rank() {
  rm -f "$work/run.jsonl"
  sh "$here/mpirun.sh" 2 "$bin" train --config configs/quickstart.json --set world_size=auto \
    --set steps=100000 --set logging.eval_interval=100000 --set logging.eval_batches=2 \
    --set shardswap.comm_timeout_s="$2" --metrics "$work/run.jsonl" > "$work/run.log" 2>&1 &
  job=$!
  waited=0
  while [ "$(cat "$work/run.jsonl" 2> /dev/null | wc -l)" -lt 2 ] && [ $waited -lt 300 ]; do
    sleep 0.2
    waited=$((waited + 1))
  done
  victim=$(rank_pid "$job" 1)
  [ -n "$victim" ] || { fail "$1: no rank 1 found under mpirun (pid $job)"; return; }
  start=$(date +%s)
  kill -s "$1" "$victim"
  while kill -0 "$job" 2> /dev/null && [ $(($(date +%s) - start)) -le "$3" ]; do sleep 0.2; done
  seconds=$(($(date +%s) - start))
  if kill -0 "$job" 2> /dev/null; then
    fail "$1 to rank 1: the job still runs after $3 s"
    kill -9 "$job" 2> /dev/null
  fi
  wait "$job"
  rc=$?
  job=
  kill -9 "$victim" 2> /dev/null  # a stopped rank the launcher could not end
  victim=
  echo "$1 to rank 1: job ended after $seconds s with exit $rc"
  cp "$work/run.log" "$work/run-$1.log"
}

failed_rank KILL 30 20
[ "$rc" -ne 0 ] || fail "SIGKILL to rank 1: exit 0"
grep -qi "signal 9\|killed" "$work/run.log" ||
  fail "SIGKILL to rank 1: no message naming it in: $(tail -5 "$work/run.log")"

failed_rank STOP 3 30
[ "$rc" -ne 0 ] || fail "SIGSTOP to rank 1: exit 0"
grep -q "shardswap: rank 0 of 2 failed: .*timed out after 3000 ms" "$work/run.log" ||
  fail "SIGSTOP to rank 1: rank 0 does not name the timeout: $(tail -5 "$work/run.log")"

[ $failures -eq 0 ] && echo "mpi_failure: all checks passed"
exit $((failures != 0))
