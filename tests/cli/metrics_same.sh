#!/bin/sh
# tools/checks/metrics_same.py, which the GPU scripts (tools/checks/gpu-repro-check.sh, gpu-mpirun-check.sh)
# compare their runs with: two runs of the same LISA config (switches and timings included) are
# identical, a run of another seed differs (exit 1; 0 with --differ-ok), a shorter file differs.
# Usage: metrics_same.sh SHARDSWAP REPO_ROOT
set -u
bin=$1
root=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root" || exit 1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
train() {  # OUT, then --set overrides
  out=$1
  shift
  "$bin" train --config configs/lisa.json --set steps=6 --set layer_switching.interval=2 \
    --set logging.timing=true --set logging.eval_interval=3 --set logging.eval_batches=2 \
    --metrics "$out" "$@" > /dev/null 2>&1 || fail "train $*: exit $?"
}
train "$work/a1.jsonl"
train "$work/a2.jsonl"
train "$work/b.jsonl" --set seed=2
head -3 "$work/a1.jsonl" > "$work/short.jsonl"
same() { python3 tools/checks/metrics_same.py "$@" > "$work/out.txt" 2>&1; }

same "$work/a1.jsonl" "$work/a2.jsonl" || fail "two runs of one config: $(cat "$work/out.txt")"
grep -q "identical: 6 records" "$work/out.txt" || fail "identical runs: $(cat "$work/out.txt")"
same "$work/a1.jsonl" "$work/b.jsonl" && fail "another seed compared identical"
grep -q "differ first at step 1" "$work/out.txt" || fail "another seed: $(cat "$work/out.txt")"
same "$work/a1.jsonl" "$work/b.jsonl" --differ-ok || fail "--differ-ok: exit $?"
same "$work/a1.jsonl" "$work/short.jsonl" && fail "a shorter file compared identical"

[ $failures -eq 0 ] && echo "metrics_same: all checks passed"
exit $((failures != 0))
