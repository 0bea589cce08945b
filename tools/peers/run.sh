#!/usr/bin/env bash
# The ONE device call of issue 7: ShardSwap beside DeepSpeed ZeRO-2 and PyTorch on the same GPU(s).
#   bash tools/peers/run.sh [a] [b] [c] [d]     (no argument: all four workloads)
# Needs .whl/ (bash tools/peers/download-wheels.sh on a machine with network access, then the
# folder copied here). Builds the
# shardswap CLI into build/cuda if it is not there yet (only that target). Every workload runs in
# its own process(es); each writes JSON lines to $OUT/peers.jsonl; the table is printed last and
# written with machine, date, versions and commit to $OUT/peers.json. Exit status 1 when any row
# failed (the table lists why).
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/peers/install-wheels.sh  # peers_env, peers_install_wheels, peers_build_shardswap, peers_fused_adam
peers_env
OUT=${OUT:-$PWD/build/peers-out}
mkdir -p "$OUT"
results=$OUT/peers.jsonl log=$OUT/peers.log
: > "$results"; : > "$log"
workloads=${*:-a b c d}
SWITCHES=${PEERS_SWITCHES:-100}
status=0
step() { echo; echo "=== $* ===" | tee -a "$log"; }
want() { [[ " $workloads " == *" $1 "* ]]; }
# run LIMIT_S LABEL CMD...: one process (tree), output to the log, a timeout becomes an error row.
run() {
  local limit=$1 label=$2; shift 2
  echo "--- $label: $*" >> "$log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "--- $label: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    printf '{"workload": "%s", "system": "-", "status": "error", "error": "timed out after %s s"}\n' \
      "$label" "$limit" >> "$results"
  fi
  [ $rc -eq 0 ] || status=1
}

step "wheels (offline, into /tmp/site)"
peers_install_wheels run.sh || exit 1

ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$ngpu" -ge 1 ] || { echo "run.sh: no GPU visible to torch" >&2; exit 1; }
if [ ! -x "$PEERS_BIN" ]; then
  step "build the shardswap CLI (build/cuda, target shardswap only)"
  peers_build_shardswap run.sh "$OUT/build.log" || exit 1
fi

python3 - "$OUT/meta.json" "$ngpu" <<'PY'
import json, os, subprocess, sys, datetime, platform
import torch, deepspeed
def sh(c):
    try: return subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
    except Exception as e: return f"unavailable: {e}"
meta = {"machine": f"{sys.argv[2]} x {torch.cuda.get_device_name(0)}",
        "driver": sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("PEERS_COMMIT") or sh("git rev-parse --short HEAD 2>/dev/null") or "unknown",
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "deepspeed": deepspeed.__version__, "gpus": int(sys.argv[2])}
json.dump(meta, open(sys.argv[1], "w"), indent=2)
print(meta)
PY

step "DeepSpeed FusedAdam: JIT build (nvcc, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
peers_fused_adam "$OUT/fused_adam_build.log" "torch_adam fallback in every DeepSpeed row"

P=tools/peers
J="--jsonl $results"
if want a; then
  step "a. optimizer step"
  run 120 shardswap-optimizer python3 $P/shardswap_side.py $J optimizer --sizes 64M,256M
  run 120 torch-adamw bash -c "python3 tools/bench/torch_adamw.py --sizes 64M,256M --json $OUT/torch.json && python3 -c \"
import json; d = json.load(open('$OUT/torch.json'))
with open('$results', 'a') as f:
    for r in d['rows']:
        f.write(json.dumps({'workload': 'optimizer_step', 'system': 'pytorch', 'impl': 'torch_adamw_fused',
            'params': r['params'], 'step_ms': r['update_ms'], 'tbps': r['update_tbps'], 'copy_tbps': r['copy_tbps'],
            'ratio': r['ratio'], 'check': r['check'], 'master_error': r['master_error'],
            'status': 'ok' if r['check'] == 'PASS' else 'error'}) + '\n')
\""
  run 180 deepspeed-fused-adam python3 $P/ds_adam.py $J --sizes 64M,256M
fi
if want b; then
  step "b. ZeRO-2 memory, >= 1B params (byte decoder 2048/8192, 18 layers), world size 1 over NCCL"
  run 180 deepspeed-zero2-memory torchrun --standalone --nproc_per_node 1 $P/ds_zero2_memory.py $J
  run 180 shardswap-zero2-memory python3 $P/shardswap_side.py $J memory
fi
if want c; then
  step "c. seed 000: compression peak memory, world size $ngpu, one process (tree) per configuration"
  for model in linear stack; do
    for hook in none fp16 bf16; do
      run 120 "ddp-$model-$hook" torchrun --standalone --nproc_per_node "$ngpu" $P/ddp_compress.py $J --model $model --hook $hook
    done
    for comm in fp32 fp16; do
      run 120 "shardswap-$model-$comm" python3 $P/shardswap_side.py $J compress --shape $model --comm $comm --world "$ngpu"
    done
  done
fi
if want d; then
  step "d. seed 004: switching 2 of 32 layers ($SWITCHES switches)"
  run 120 shardswap-switch python3 $P/shardswap_side.py $J switch --switches "$SWITCHES"
  for method in destroy destroy_clear_hooks; do
    run 300 "deepspeed-lisa-switch-$method" torchrun --standalone --nproc_per_node 1 $P/ds_lisa_switch.py $J \
      --method $method --switches "$SWITCHES"
  done
fi

step "table"
python3 $P/report.py "$results" --meta "$OUT/meta.json" --json "$OUT/peers.json" || status=1
exit $status
