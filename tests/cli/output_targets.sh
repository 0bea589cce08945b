#!/bin/sh
# Every file a command writes (ckpt export --out, train --metrics, plot --out, bench --json) may
# only replace an absent path or a regular file that is none of the command's inputs and lies in
# no checkpoint: anything else is refused with exit 2 before any work, naming the path and what
# it is, and is left exactly as it was. A good target is replaced whole, with no temporary left.
# Usage: output_targets.sh SHARDSWAP CONFIGS_DIR
set -u
bin=$1
config=$2/tiny_decoder.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
small="--set world_size=2"
small="$small --set train_micro_batch_size_per_gpu=4 --set logging.eval_batches=2"

# A checkpoint to export from, and things to point the outputs at.
# shellcheck disable=SC2086
"$bin" train --config "$config" $small --set steps=2 --set checkpoint.dir="$work/ck" \
  --set checkpoint.every=2 > "$work/setup.log" 2>&1 || { cat "$work/setup.log"; exit 1; }
ck="$work/ck/step-00000002"
cp -p "$ck/weights.bin" "$work/weights.orig"
head -c 4096 /dev/urandom > "$work/victim"
cp "$work/victim" "$work/victim.orig"
ln -s "$work/victim" "$work/link"
ln -s "$work/victim" "$work/link.svg"
ln -s /dev/null "$work/devnull-link"
mkfifo "$work/fifo"
mkdir "$work/folder"
ln "$ck/weights.bin" "$work/hard-link.bin"
cp "$config" "$work/run.json"
head -c 20000 /usr/share/common-licenses/GPL-3 > "$work/corpus.txt"
cp "$work/corpus.txt" "$work/corpus.orig"

# refused NAME EXPECTED_TEXT COMMAND...: exit 2, the message holds EXPECTED_TEXT, no temporary left
refused() {
  name=$1 text=$2
  shift 2
  out=$("$@" 2>&1)
  code=$?
  if [ "$code" -ne 2 ]; then
    echo "FAIL $name: exit $code, expected 2: $out" | head -c 400; echo
    failures=$((failures + 1)); return
  fi
  case "$out" in
    *"$text"*) echo "ok   $name: $(echo "$out" | head -1)" ;;
    *) echo "FAIL $name: message lacks '$text': $out"; failures=$((failures + 1)) ;;
  esac
  if ls "$work" "$ck" | grep -q 'tmp-'; then
    echo "FAIL $name: a temporary was left: $(ls "$work" "$ck" | grep 'tmp-')"
    failures=$((failures + 1))
  fi
}
check() {  # NAME TEST...: a condition that must hold after the cases
  name=$1
  shift
  if "$@"; then echo "ok   $name"; else echo "FAIL $name"; failures=$((failures + 1)); fi
}

export_to() { "$bin" ckpt export "$ck" --out "$1"; }
refused "export onto a symbolic link" "--out '$work/link': a symbolic link; refusing to replace it" \
  export_to "$work/link"
refused "export onto a link to /dev/null" "--out '$work/devnull-link': a symbolic link" \
  export_to "$work/devnull-link"
refused "export onto a FIFO" "--out '$work/fifo': a FIFO; refusing to replace it" \
  export_to "$work/fifo"
refused "export onto a directory" "--out '$work/folder': a directory" export_to "$work/folder"
refused "export onto the checkpoint's own weights.bin" \
  "--out '$ck/weights.bin': inside the checkpoint directory '$ck'" export_to "$ck/weights.bin"
refused "export into the checkpoint directory" "inside the checkpoint directory '$ck'" \
  export_to "$ck/model.safetensors"
refused "export onto a hard link of a checkpoint file" \
  "--out '$work/hard-link.bin': the same file as the checkpoint file '$ck/weights.bin'" \
  export_to "$work/hard-link.bin"
refused "export into a folder that does not exist" \
  "--out '$work/none/m.safetensors': the folder '$work/none' does not exist" \
  export_to "$work/none/m.safetensors"

train_into() {  # METRICS [more args]
  m=$1
  shift
  # shellcheck disable=SC2086
  "$bin" train --config "$work/run.json" $small --set steps=2 --metrics "$m" "$@"
}
refused "train --metrics onto the config file" \
  "--metrics '$work/run.json': the same file as the config file '$work/run.json'" \
  train_into "$work/run.json"
refused "train --metrics onto the data file" \
  "--metrics '$work/corpus.txt': the same file as an input of the run '$work/corpus.txt'" \
  train_into "$work/corpus.txt" --set data.train="$work/corpus.txt"
head -c 8000 /usr/share/common-licenses/GPL-3 > "$work/val.txt"
cp "$work/val.txt" "$work/val.orig"
refused "train --metrics onto the validation file" \
  "--metrics '$work/val.txt': the same file as an input of the run '$work/val.txt'" \
  train_into "$work/val.txt" --set data.train="$work/corpus.txt" --set data.val="$work/val.txt"
refused "train --metrics onto a symbolic link" "--metrics '$work/link': a symbolic link" \
  train_into "$work/link"
refused "train --metrics onto a FIFO" "--metrics '$work/fifo': a FIFO" train_into "$work/fifo"
refused "train --metrics into a checkpoint" "inside the checkpoint directory '$ck'" \
  train_into "$ck/metrics.jsonl"

# A metrics file named like a plot: plot --out it would draw over its own input.
# shellcheck disable=SC2086
"$bin" train --config "$config" $small --set steps=3 --metrics "$work/m.svg" > /dev/null 2>&1
cp "$work/m.svg" "$work/m.orig"
refused "plot --out onto a symbolic link" "--out '$work/link.svg': a symbolic link" \
  "$bin" plot "$work/m.svg" --out "$work/link.svg"
refused "plot --out onto its own metrics file" \
  "--out '$work/m.svg': the same file as the metrics file '$work/m.svg'" \
  "$bin" plot "$work/m.svg" --out "$work/m.svg"
refused "bench optimizer --json onto a symbolic link" "--json '$work/link': a symbolic link" \
  "$bin" bench optimizer --backend cpu --sizes 1K --iters 1 --json "$work/link"
refused "bench switch --json onto a symbolic link" "--json '$work/link': a symbolic link" \
  "$bin" bench switch --backend cpu --layers 4 --dim 8 --switches 1 --json "$work/link"

check "every link is still a link, its target unchanged" \
  sh -c "test -L '$work/link' && test -L '$work/link.svg' && test -L '$work/devnull-link' && cmp -s '$work/victim' '$work/victim.orig'"
check "the FIFO is still a FIFO and the folder a folder" \
  sh -c "test -p '$work/fifo' && test -d '$work/folder'"
check "the checkpoint's weights.bin is unchanged" cmp -s "$ck/weights.bin" "$work/weights.orig"
check "the checkpoint holds no new file" test ! -e "$ck/model.safetensors" -a ! -e "$ck/metrics.jsonl"
check "the config, data and metrics files are unchanged" \
  sh -c "cmp -s '$work/run.json' '$config' && cmp -s '$work/corpus.txt' '$work/corpus.orig' && cmp -s '$work/val.txt' '$work/val.orig' && cmp -s '$work/m.svg' '$work/m.orig'"

# A regular file of ours is replaced whole, with nothing left beside it.
echo "an older export" > "$work/model.safetensors"
if export_to "$work/model.safetensors" > "$work/export.log" 2>&1 &&
   test "$(head -c 8 "$work/model.safetensors" | od -An -tu8 | tr -d ' ')" -gt 0 &&
   ! ls "$work" | grep -q 'tmp-'; then
  echo "ok   export replaces a regular file whole, no temporary left"
else
  echo "FAIL export into a regular file: $(cat "$work/export.log")"; failures=$((failures + 1))
fi

[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "every refused target named and left as it was"
