#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU: configure and build with its own cmake and nvcc, run
# the CPU and GPU suites, compute-sanitizer memcheck over the GPU suite, the NCCL/MPI smoke check,
# `shardswap train` under mpirun against the threaded launch (tools/checks/gpu-mpirun-check.sh), and the
# optimizer benchmark beside PyTorch's fused AdamW. Logs and JSON go under $OUT; a short
# table is printed last.
#   usage: bash tools/checks/gpu-check.sh [quick]      (quick: no sanitizer, smaller benchmark)
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-out}
mkdir -p "$OUT"
mode=${1:-full}
status=0
step() { echo; echo "=== $* ==="; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/machine.txt" || true

step "configure and build"
cmake --preset cuda > "$OUT/build.log" 2>&1 && cmake --build --preset cuda -j 16 >> "$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then tail -60 "$OUT/build.log"; exit 1; fi
tail -2 "$OUT/build.log"

step "CPU suite"
# Drawing a plot needs gnuplot (tools/install-deps.sh installs it); a GPU machine that has no
# package manager to reach skips the three tests that draw ("plot draws"), and says so.
skip=()
if ! command -v gnuplot >/dev/null; then
  echo "gnuplot not installed: the tests that draw a plot are left out"
  skip=(-E "plot draws")
fi
ctest --test-dir build/cuda -LE gpu "${skip[@]}" -j 16 --output-on-failure > "$OUT/ctest-cpu.log" 2>&1 || status=1
tail -3 "$OUT/ctest-cpu.log"

step "GPU suite"
build/cuda/tests/gpu/shardswap_gpu_tests --durations yes > "$OUT/gpu-tests.log" 2>&1 || status=1
grep -E "compression peak|soak|FAILED|passed|failed|device memory|NOT RETURNED" "$OUT/gpu-tests.log" | tail -20

if [ -x build/cuda/tools/shardswap_nccl_mpi_check ] && command -v mpirun >/dev/null; then
  step "NCCL under mpirun (one process per GPU)"
  ngpu=$(nvidia-smi -L | wc -l)
  mpirun --allow-run-as-root -np "$ngpu" -x NCCL_NVLS_ENABLE build/cuda/tools/shardswap_nccl_mpi_check \
    > "$OUT/mpi.log" 2>&1 || status=1
  tail -4 "$OUT/mpi.log"
  step "one MPI session for the MPI and NCCL communicators, made and freed in both orders"
  for order in mpi-first nccl-first; do
    timeout 120 mpirun --allow-run-as-root -np "$ngpu" -x NCCL_NVLS_ENABLE \
      build/cuda/tests/shardswap_mpi_session_check "$order" > "$OUT/mpi-session-$order.log" 2>&1 \
      || status=1
    echo "$order: $(grep -c ': ok: ' "$OUT/mpi-session-$order.log") checks held, \
$(grep -c 'FAILED' "$OUT/mpi-session-$order.log") failed"
  done
  step "engine over NCCL under mpirun against the float64 reference ($ngpu processes)"
  timeout 300 mpirun --allow-run-as-root -np "$ngpu" -x NCCL_NVLS_ENABLE \
    build/cuda/tests/gpu/shardswap_mpi_engine_tests > "$OUT/mpi-engine.log" 2>&1 || status=1
  grep -E "PASS|FAIL|passed|failed" "$OUT/mpi-engine.log" | tail -6
  if [ "$ngpu" -ge 2 ]; then
    step "collective bandwidth: engine against plain NCCL ($ngpu processes)"
    timeout 300 mpirun --allow-run-as-root -np "$ngpu" -x NCCL_NVLS_ENABLE \
      build/cuda/tools/shardswap_bench_comm --json "$OUT/bench-comm.json" 2>&1 | tee "$OUT/bench-comm.log" || status=1
  fi
fi

step "a 300M-param byte decoder on the GPU: plan, then configs/gpu-300m.json (LISA, ZeRO-2 bf16)"
bin=build/cuda/tools/shardswap
gpu_train() {  # name, then --set overrides
  local name=$1; shift
  echo "--- $name"
  timeout 300 $bin train --config configs/gpu-300m.json --metrics "$OUT/metrics-$name.jsonl" "$@" \
    > "$OUT/train-$name.log" 2>&1 || status=1
  grep -E "memory of rank 0 after step 1|cuBLAS|validation loss (before|after step 60)|^done|step time|failed|error" "$OUT/train-$name.log"
}
$bin plan --config configs/gpu-300m.json | tee "$OUT/plan-300m.txt" || status=1
for c in quickstart lisa; do  # the CPU configs on the GPU backend: plan = measured peak
  echo "--- configs/$c.json on cuda"
  $bin train --config configs/$c.json --set shardswap.backend=cuda --set steps=41 \
    --set logging.eval_interval=1000 2>&1 | grep -E "memory of rank 0|^done|error" || status=1
done
gpu_train nccl-world1
gpu_train inproc-world4 --set world_size=4 --set shardswap.communicator=in_process
gpu_train gemm-rate --set layer_switching.type=none --set steps=20
if command -v mpirun >/dev/null; then
  step "shardswap train under mpirun against the threaded launch (same metrics, timings aside)"
  bash tools/checks/gpu-mpirun-check.sh "$OUT/mpirun-train" > "$OUT/mpirun-train.log" 2>&1 || status=1
  grep -E "^---|identical|differ|records|not run" "$OUT/mpirun-train.log"
fi
step "checkpoints on the GPU: exact resume (LISA, keep_host), safetensors export read by Python"
bash tools/checks/gpu-ckpt-check.sh "$OUT" || status=1

ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -ge 2 ]; then
  step "overlap of stage-2 reduction with backward ($ngpu GPUs, no layer switching)"
  # Micro-batch 8192: GEMM-bound; 1024: reduction a larger share of the step. The fraction of
  # reduction hidden is (t_off - t_on) / (t_off - t_world1), from the step times of these runs.
  for mb in 8192 1024; do
    for o in false true; do
      gpu_train "overlap-$mb-$o" --set world_size=$ngpu --set layer_switching.type=none \
        --set steps=40 --set logging.timing=false --set zero_optimization.overlap_comm=$o \
        --set train_micro_batch_size_per_gpu=$mb
    done
    gpu_train "overlap-$mb-world1" --set layer_switching.type=none --set steps=40 \
      --set logging.timing=false --set train_micro_batch_size_per_gpu=$mb
  done
fi

if [ "$mode" != quick ]; then
  step "compute-sanitizer memcheck (GPU suite without the 1B-param case and the soak)"
  timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
    build/cuda/tests/gpu/shardswap_gpu_tests "~*compression raises* ~*10000 switches*" > "$OUT/memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
fi

step "optimizer benchmark"
sizes=64M,256M,1G
[ "$mode" = quick ] && sizes=64M,256M
build/cuda/tools/shardswap bench optimizer --backend cuda --sizes "$sizes" --json "$OUT/bench-shardswap.json" \
  > "$OUT/bench.log" 2>&1 || status=1
python3 tools/bench/torch_adamw.py --sizes "$sizes" --json "$OUT/bench-torch.json" >> "$OUT/bench.log" 2>&1 || status=1
python3 tools/bench/summary.py "$OUT/bench-shardswap.json" "$OUT/bench-torch.json" | tee "$OUT/summary.txt"

step "layer switch benchmark"
build/cuda/tools/shardswap bench switch --backend cuda --json "$OUT/bench-switch.json" 2>&1 | tee "$OUT/bench-switch.log" || status=1
exit $status
