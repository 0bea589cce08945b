#!/usr/bin/env bash
# Decoder training at Qwen2.5 shapes (seq 2048), full fine-tune and LISA, on one NVIDIA GPU:
# ShardSwap (tools/bench/train_bench.py) beside transformers + PyTorch and DeepSpeed ZeRO-2 at
# world size 1 (tools/peers/train_throughput.py), at ShardSwap's micro-batches; one table of
# tokens/s, ratios and peak memory, printed last (tools/peers/train_report.py).
#   bash tools/peers/train_side_by_side.sh [OUT]       (from anywhere)
# OUT: the first argument, else $OUT, else build/train-side-by-side. Environment, all optional:
#   SHAPES=0.5b,1.5b       of 0.5b, 1.5b, 3b, 7b
#   MODES=full,lisa
#   SYSTEMS=shardswap,torch,deepspeed
#   STEPS=25 WARMUP=5      ShardSwap's steps per row (the first WARMUP untimed)
#   PEER_STEPS=10 PEER_WARMUP=3   the peers' timed steps and untimed steps before them
#   MICRO=0.5b=8,...       micro-batch per shape (default train_bench.py's: 0.5b=8, 1.5b=4, 3b=4,
#                          7b=3), the same for every system; a peer out of memory halves its own
#   BIN=build/cuda/tools/shardswap   built (target shardswap_cli only) when it is the default and missing
#   SS_TIMEOUT=600 PEER_TIMEOUT=600  seconds per ShardSwap row / per peer process
#   PEERS_COMMIT=<sha>     the commit to record where git metadata cannot be read
# DeepSpeed needs .whl/ (bash tools/peers/download-wheels.sh on a machine with network access,
# then the folder copied to the repository root here); it is installed offline into /tmp/site.
# Files under OUT: train-bench.json and train-bench-SHAPE-MODE.{log,jsonl} (ShardSwap),
# peers-train.jsonl (every peer try, one JSON line each), peer-SYSTEM-SHAPE-MODE.log,
# train-side-by-side.json (table, rows, machine, date, versions, commit), train-side-by-side.log
# (all output), build.log, fused_adam_build.log. Rows of an earlier run into the same OUT are
# kept unless this run redoes them, so a long list can be run in parts (e.g. SYSTEMS=shardswap,
# then SYSTEMS=torch,deepspeed). Exit status 1 when any row failed (the table says why).
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/peers/install-wheels.sh  # peers_env, peers_install_wheels, peers_build_shardswap, peers_fused_adam
peers_env

OUT=${1:-${OUT:-$PWD/build/train-side-by-side}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
SHAPES=${SHAPES:-0.5b,1.5b} MODES=${MODES:-full,lisa} SYSTEMS=${SYSTEMS:-shardswap,torch,deepspeed}
STEPS=${STEPS:-25} WARMUP=${WARMUP:-5} PEER_STEPS=${PEER_STEPS:-10} PEER_WARMUP=${PEER_WARMUP:-3}
SS_TIMEOUT=${SS_TIMEOUT:-600} PEER_TIMEOUT=${PEER_TIMEOUT:-600} MICRO=${MICRO:-}
BIN=${BIN:-$PEERS_BIN}
exec > >(tee -a "$OUT/train-side-by-side.log") 2>&1

status=0
step() { echo; echo "=== $* ==="; }
want() { [[ ",$SYSTEMS," == *",$1,"* ]]; }
for s in ${SYSTEMS//,/ }; do
  case $s in shardswap|torch|deepspeed) ;; *) echo "train_side_by_side.sh: unknown system '$s' in SYSTEMS" >&2; exit 2 ;; esac
done
for s in ${SHAPES//,/ }; do
  case $s in 0.5b|1.5b|3b|7b) ;; *) echo "train_side_by_side.sh: unknown shape '$s' in SHAPES" >&2; exit 2 ;; esac
done
for m in ${MODES//,/ }; do
  case $m in full|lisa) ;; *) echo "train_side_by_side.sh: unknown mode '$m' in MODES" >&2; exit 2 ;; esac
done
# micro SHAPE: MICRO's entry, else train_bench.py's MICRO table (the one ShardSwap's rows use).
micro() {
  local kv
  for kv in ${MICRO//,/ }; do [ "${kv%%=*}" = "$1" ] && { echo "${kv#*=}"; return; }; done
  python3 -c "import sys; sys.path.insert(0, 'tools/bench'); import train_bench; print(train_bench.MICRO['$1'])"
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || { echo "train_side_by_side.sh: nvidia-smi failed" >&2; exit 1; }
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "${ngpu:-0}" -ge 1 ] || { echo "train_side_by_side.sh: no GPU visible to torch" >&2; exit 1; }
echo "OUT=$OUT SHAPES=$SHAPES MODES=$MODES SYSTEMS=$SYSTEMS STEPS=$STEPS PEER_STEPS=$PEER_STEPS"

if want deepspeed; then
  step "wheels (offline, into $PEERS_SITE)"
  peers_install_wheels train_side_by_side.sh || exit 1
fi

if want shardswap; then
  if [ ! -x "$BIN" ]; then
    [ "$BIN" = "$PEERS_BIN" ] || { echo "train_side_by_side.sh: BIN=$BIN is not an executable" >&2; exit 1; }
    step "build the shardswap CLI (build/cuda, target shardswap_cli only)"
    peers_build_shardswap train_side_by_side.sh "$OUT/build.log" || exit 1
  fi
  step "ShardSwap: train_bench.py, $STEPS steps a row ($WARMUP untimed)"
  # train_bench.py rewrites train-bench.json with this run's rows; an earlier run's other rows
  # are merged back afterwards. Its text (16 MiB of the standard library's sources) lives in /tmp.
  [ -f "$OUT/train-bench.json" ] && mv "$OUT/train-bench.json" "$OUT/train-bench.prev.json"
  text=$(python3 -c "import os, sys; sys.path.insert(0, 'tools/bench'); import train_bench
d = '/tmp/shardswap-train-text'; os.makedirs(d, exist_ok=True); print(train_bench.text_file(d, ''))")
  rows=$(( $(echo "${SHAPES//,/ }" | wc -w) * $(echo "${MODES//,/ }" | wc -w) ))
  t0=$SECONDS
  timeout --kill-after=10 $((rows * (SS_TIMEOUT + 30) + 60)) python3 tools/bench/train_bench.py \
    --bin "$BIN" --out "$OUT" --shapes "$SHAPES" --modes "$MODES" --steps "$STEPS" --warmup "$WARMUP" \
    --timeout "$SS_TIMEOUT" --text "$text" ${MICRO:+--micro "$MICRO"}
  rc=$?
  echo "--- train_bench.py: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
  SHAPES=$SHAPES MODES=$MODES python3 - "$OUT" <<'PY' || status=1
import json, os, sys
out = sys.argv[1]
new_path, prev_path = os.path.join(out, "train-bench.json"), os.path.join(out, "train-bench.prev.json")
new = json.load(open(new_path))["rows"] if os.path.exists(new_path) else []
prev = json.load(open(prev_path))["rows"] if os.path.exists(prev_path) else []
done = {(r["shape"], r["mode"]) for r in new}
redo = {(s, m) for s in os.environ["SHAPES"].split(",") for m in os.environ["MODES"].split(",")}
rows = new + [r for r in prev if (r["shape"], r["mode"]) not in done | redo]
json.dump({"rows": rows}, open(new_path, "w"), indent=1)
if os.path.exists(prev_path):
    os.remove(prev_path)
PY
fi

results=$OUT/peers-train.jsonl
touch "$results"
# Earlier rows of the (system, shape, mode) triples this run redoes go; the rest stay.
SHAPES=$SHAPES MODES=$MODES SYSTEMS=$SYSTEMS python3 - "$results" <<'PY'
import json, os, sys
path = sys.argv[1]
redo = {(y, f"qwen2.5-{s}", m) for y in os.environ["SYSTEMS"].split(",")
        for s in os.environ["SHAPES"].split(",") for m in os.environ["MODES"].split(",")}
keep = []
for line in open(path):
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        continue
    if (r.get("system"), r.get("shape"), r.get("mode")) not in redo:
        keep.append(line if line.endswith("\n") else line + "\n")
open(path, "w").writelines(keep)
PY

# error_row SYSTEM SHAPE MODE MICRO MESSAGE: a row for a peer that left none (or was killed).
error_row() {
  python3 -c "import json, sys
s, shape, mode, micro, msg = sys.argv[1:6]
print(json.dumps({'workload': 'train', 'system': s, 'shape': 'qwen2.5-' + shape, 'mode': mode,
                  'micro_batch': int(micro), 'seq_len': 2048, 'script': 'train_side_by_side.sh',
                  'status': 'error', 'error': msg}, sort_keys=True))" "$@" >> "$results"
}
# peer SYSTEM SHAPE MODE: one train_throughput.py process (tree) under a timeout.
peer() {
  local system=$1 shape=$2 mode=$3 m log before rc t0=$SECONDS
  m=$(micro "$shape") log=$OUT/peer-$system-$shape-$mode.log
  local cmd=(python3)
  [ "$system" = deepspeed ] && cmd=(torchrun --standalone --nproc_per_node 1)
  cmd+=(tools/peers/train_throughput.py --system "$system" --shape "$shape" --mode "$mode"
        --micro-batch "$m" --seq-len 2048 --warmup "$PEER_WARMUP" --steps "$PEER_STEPS" --jsonl "$results")
  echo "--- $system $shape $mode micro $m: ${cmd[*]}" > "$log"
  before=$(wc -l < "$results")
  timeout --kill-after=10 "$PEER_TIMEOUT" "${cmd[@]}" >> "$log" 2>&1
  rc=$?
  echo "--- $system $shape $mode: exit $rc after $((SECONDS - t0)) s (log: $log)"
  grep -h '^{' "$log" | sed 's/^/    /' | cut -c1-220
  [ $rc -eq 0 ] || status=1
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    error_row "$system" "$shape" "$mode" "$m" "timed out after $PEER_TIMEOUT s"
  elif [ $rc -ne 0 ] && [ "$(wc -l < "$results")" -eq "$before" ]; then
    error_row "$system" "$shape" "$mode" "$m" "exit $rc: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-300)"
  fi
}

if want deepspeed; then
  step "DeepSpeed FusedAdam: JIT build (nvcc, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
  fused_ok=1
  peers_fused_adam "$OUT/fused_adam_build.log" "the DeepSpeed rows are skipped" || fused_ok=0
fi
for shape in ${SHAPES//,/ }; do
  for mode in ${MODES//,/ }; do
    if want torch; then
      step "PyTorch: $shape $mode"
      peer torch "$shape" "$mode"
    fi
    if want deepspeed; then
      step "DeepSpeed ZeRO-2: $shape $mode"
      if [ $fused_ok -eq 1 ]; then
        peer deepspeed "$shape" "$mode"
      else
        error_row deepspeed "$shape" "$mode" "$(micro "$shape")" \
          "FusedAdam did not build: $(grep -v '^\s*$' "$OUT/fused_adam_build.log" | tail -1 | cut -c1-300)"
        status=1
      fi
    fi
  done
done

step "table"
python3 tools/peers/train_report.py --bench "$OUT/train-bench.json" --peers "$results" \
  --json "$OUT/train-side-by-side.json" --shapes "$SHAPES" --modes "$MODES" --require "$SYSTEMS" || status=1
exit $status
