#!/bin/sh
# A checkpoint.dir and a metrics file whose names hold bytes that are not UTF-8 (valid Linux paths)
# at world sizes 1 and 2: the saves succeed, `load=latest` resumes from them, `ckpt inspect` reads
# them, and the run ends as the same run made under a plain name does (loss and validation loss).
# Usage: non_utf8_paths.sh SHARDSWAP CONFIGS_DIR
set -u
export LC_ALL=C  # the paths are bytes: grep and sed must not read them as UTF-8
bin=$1
config=$2/tiny_decoder.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL $*"; exit 1; }
odd=$(printf 'ck_\351\377')  # Latin-1 e-acute and a byte no UTF-8 text holds
run() {  # world dir steps [more --set]
  w=$1 dir=$2 n=$3
  shift 3
  "$bin" train --config "$config" --set world_size="$w" --set steps="$n" \
    --set checkpoint.dir="$dir" --set checkpoint.every=3 --metrics "$dir.jsonl" "$@"
}
for w in 1 2; do
  run "$w" "$work/$odd-$w" 6 > "$work/first.log" 2>&1 || fail "world $w, first part: $(cat "$work/first.log")"
  run "$w" "$work/$odd-$w" 9 --set checkpoint.load=latest > "$work/resumed.log" 2>&1 ||
    fail "world $w, resume: $(cat "$work/resumed.log")"
  grep -q "resumed from .*step-00000006.*: step 6" "$work/resumed.log" ||
    fail "world $w: did not resume at step 6: $(cat "$work/resumed.log")"
  "$bin" ckpt inspect "$work/$odd-$w/step-00000009" > "$work/inspect.log" 2>&1 ||
    fail "world $w: inspect: $(cat "$work/inspect.log")"
  run "$w" "$work/plain-$w" 9 > "$work/plain.log" 2>&1 || fail "world $w, plain: $(cat "$work/plain.log")"
  got=$(grep "^done:" "$work/resumed.log" | sed 's/.*loss \([^;]*\); validation loss \([^;]*\);.*/\2/')
  want=$(grep "^done:" "$work/plain.log" | sed 's/.*loss \([^;]*\); validation loss \([^;]*\);.*/\2/')
  want_end=${want#*-> }
  got_end=${got#*-> }
  [ -n "$got_end" ] && [ "$got_end" = "$want_end" ] ||
    fail "world $w: final validation loss '$got_end' under the odd name, '$want_end' under a plain one"
  [ "$(wc -l < "$work/$odd-$w.jsonl")" -eq 10 ] ||  # 9 steps and the resume line
    fail "world $w: the metrics file holds $(wc -l < "$work/$odd-$w.jsonl") lines, expected 10"
  echo "world $w: saved, resumed and inspected under a non-UTF-8 name; final validation loss $got_end"
done
