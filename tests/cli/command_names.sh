#!/bin/sh
# A CLI error names the command as the user typed it, never an inner function: `bench optimizer`
# and `bench switch` (their messages said bench_optimizer: / bench_switch:), `bench offload`,
# `ckpt export --out`. Each exit 2.
# Usage: command_names.sh SHARDSWAP
set -u
bin=$1
failures=0
# expect NAME EXPECTED_START ARGS...: exit 2, stderr's first line starting with EXPECTED_START
expect() {
  name=$1 start=$2
  shift 2
  first=$("$bin" "$@" 2>&1 > /dev/null | head -1)
  "$bin" "$@" > /dev/null 2>&1
  code=$?
  case "$code:$first" in
    "2:$start"*) echo "ok   $name: $first" ;;
    *) echo "FAIL $name: exit $code: $first"; failures=$((failures + 1)) ;;
  esac
}
expect "bench optimizer, a bad --iters" "shardswap: bench optimizer: --iters '0'" \
  bench optimizer --iters 0
expect "bench optimizer, an unknown argument" "shardswap: bench optimizer: unknown argument" \
  bench optimizer --frobnicate
expect "bench offload, a bad --threads" "shardswap: bench offload: --threads '0'" \
  bench offload --threads 0
expect "bench offload, an unknown argument" "shardswap: bench offload: unknown argument" \
  bench offload --frobnicate
expect "bench switch, a bad --layers" "shardswap: bench switch: --layers must be >= " \
  bench switch --layers 0
expect "bench switch, an unknown argument" "shardswap: bench switch: unknown argument" \
  bench switch --frobnicate
[ "$failures" -eq 0 ]
