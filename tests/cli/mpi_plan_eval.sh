#!/bin/sh
# `shardswap plan` and `shardswap eval` under mpirun (docs/launch.md): each computes every rank in
# one process, so rank 0 alone runs it and prints its result once, the same text as the command
# run without a launcher at world_size N; a config error still ends the job with exit 2.
# Usage: mpi_plan_eval.sh SHARDSWAP REPO_ROOT
set -u
bin=$1
root=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root" || exit 1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
config=configs/quickstart.json
small="--set logging.eval_batches=2"

for command in plan eval; do
  "$bin" $command --config $config --set world_size=2 $small > "$work/$command-plain.out" 2>&1 ||
    fail "$command at world_size 2: exit $? ($(tail -3 "$work/$command-plain.out"))"
  sh "$here/mpirun.sh" 2 "$bin" $command --config $config --set world_size=auto $small \
    > "$work/$command-mpi.out" 2> "$work/$command-mpi.err" ||
    fail "mpirun -np 2 $command: exit $? ($(tail -3 "$work/$command-mpi.err"))"
  [ -s "$work/$command-mpi.out" ] || fail "mpirun -np 2 $command printed nothing"
  cmp -s "$work/$command-plain.out" "$work/$command-mpi.out" ||
    fail "mpirun -np 2 $command does not print what $command at world_size 2 prints once:
$(diff "$work/$command-plain.out" "$work/$command-mpi.out" | head -8)"
done

sh "$here/mpirun.sh" 2 "$bin" eval --config $config --set world_size=3 > "$work/bad.out" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "eval with world_size = 3 under mpirun -np 2: exit $rc, not 2"

[ $failures -eq 0 ] && echo "mpi_plan_eval: all checks passed"
exit $((failures != 0))
