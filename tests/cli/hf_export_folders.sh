#!/bin/sh
# `ckpt export --format hf` folders: made as mkdir makes one (0755 under umask 022, 0750 under
# 027; not mkdtemp's 0700), and the temporary folder of an export whose process died (SIGKILL,
# a crash: FOLDER.tmp-export-HOST-PID-*) is removed by the next export of FOLDER, while one of a
# live process, of another host or of another target is left alone. A used folder or a file as
# --out is refused naming --out, with exit 2.
# Usage: hf_export_folders.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/tiny_decoder.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok   $*"; }

"$bin" train --config "$config" --set world_size=1 --set steps=1 \
  --set checkpoint.dir="$work/ck" --set checkpoint.every=1 > "$work/train.log" 2>&1 ||
  { cat "$work/train.log"; exit 1; }
ck="$work/ck/step-00000001"
export_to() { "$bin" ckpt export "$ck" --format hf --out "$1" > "$work/export.log" 2>&1; }

# --- modes ---
for mask in 022 027; do
  (umask "$mask" && export_to "$work/hf-$mask") || fail "export under umask $mask: $(cat "$work/export.log")"
  want=$(printf '%o' $((0777 & ~0$mask)))
  got=$(stat -c %a "$work/hf-$mask")
  if [ "$got" = "$want" ]; then ok "umask $mask: folder mode $got"; else fail "umask $mask: folder mode $got, expected $want"; fi
done

# --- leftovers of dead exports ---
host=$(uname -n | tr -c 'A-Za-z0-9.\n' '_')
sh -c 'exit 0' &
dead=$!
wait "$dead"
if kill -0 "$dead" 2> /dev/null; then echo "pid $dead was reused at once; cannot test"; exit 1; fi
leftover() {  # NAME: a temporary folder with a partial shard in it
  mkdir "$work/$1"
  head -c 1000 /dev/zero > "$work/$1/model.safetensors"
}
leftover "out.tmp-export-$host-$dead-0badc0de"          # this target, a dead process: removed
leftover "out.tmp-export-$host-$$-0badc0de"             # a live process (this shell): kept
leftover "out.tmp-export-otherhost-$dead-0badc0de"      # another host: kept
leftover "other.tmp-export-$host-$dead-0badc0de"        # another target: kept
export_to "$work/out" || fail "export beside leftovers: $(cat "$work/export.log")"
[ -f "$work/out/config.json" ] || fail "the export wrote no config.json"
if [ -e "$work/out.tmp-export-$host-$dead-0badc0de" ]; then
  fail "a dead export's temporary folder was left: $(ls "$work")"
else
  ok "a dead export's temporary folder is removed by the next export"
fi
for kept in "out.tmp-export-$host-$$-0badc0de" "out.tmp-export-otherhost-$dead-0badc0de" \
  "other.tmp-export-$host-$dead-0badc0de"; do
  if [ -f "$work/$kept/model.safetensors" ]; then ok "kept $kept"; else fail "removed $kept"; fi
done
left=$(ls "$work" | grep -c 'tmp-export')
[ "$left" -eq 3 ] || fail "$left temporary folders beside the export, expected the 3 kept: $(ls "$work")"

# --- a refused folder is named as --out, before any work (not by an inner function) ---
mkdir "$work/used" && touch "$work/used/x" && touch "$work/afile"
for target in used afile; do
  export_to "$work/$target"
  code=$?
  first=$(head -1 "$work/export.log")
  case "$code:$first" in
    "2:shardswap: --out '$work/$target': "*"refusing to"*) ok "refused $target: $first" ;;
    *) fail "export into $target: exit $code: $first" ;;
  esac
done

[ "$failures" -eq 0 ]
