#!/usr/bin/env bash
# Issue 9 on the GPU machine, one device call: build (preset cuda), the GPU suite, then the
# 10,000-step training soak (tools/checks/soak-check.sh configs/soak.json) beside compute-sanitizer's
# racecheck and initcheck. With two or more GPUs the soak runs alone on the last GPU while the
# sanitizers use GPU 0, so the soak's free-memory samples see no other process. Logs under $OUT;
# a short summary is printed last.
#   usage: bash tools/checks/gpu-reliability.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/build/gpu-reliability-out}
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $* ==="; }
ngpu=$(nvidia-smi -L | wc -l)

step "build (preset cuda)"
t0=$SECONDS
{ cmake --preset cuda && cmake --build --preset cuda -j "$(nproc)" --target shardswap_gpu_tests shardswap_cli; } > "$OUT/build.log" 2>&1 \
  || { tail -60 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"

step "GPU suite ($ngpu GPUs)"
t0=$SECONDS
timeout 240 build/cuda/tests/gpu/shardswap_gpu_tests --durations yes > "$OUT/gpu-tests.log" 2>&1 || status=1
grep -E "FAILED|passed|failed|NOT RETURNED|timed out" "$OUT/gpu-tests.log" | tail -12
echo "($((SECONDS - t0)) s)"

# Kernels with shared memory (racecheck's domain): optimizer reductions and the decoder's norm /
# softmax kernels. initcheck: the same plus the engine over in-process ranks (its buffers,
# collectives, switches). NCCL's own kernels are left out (multi-GPU cases excluded).
# One Catch2 spec each: Catch2 3.4 joins separate spec arguments into one filter (all must
# match), a comma means "or", and a space inside a name separates terms, so names are given by
# space-free wildcards.
race_spec='*sum_squares*,*has_inf_or_nan*,*agrees*,*frozen*'
init_spec="$race_spec,*policy,*communication*"
sanitize() {  # tool, GPU, test spec
  local tool=$1 gpu=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 3 \
    --print-limit 20 build/cuda/tests/gpu/shardswap_gpu_tests "$@" > "$OUT/$tool.log" 2>&1
  local rc=$?
  echo "$tool: exit $rc; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -1);" \
    "$(grep -E "test cases" "$OUT/$tool.log" | tail -1)"
  [ $rc -eq 0 ] || status=1
}
soak() {
  local dev=$(( ngpu - 1 ))
  CUDA_VISIBLE_DEVICES=$dev bash tools/checks/soak-check.sh configs/soak.json --out "$OUT/soak" \
    > "$OUT/soak.log" 2>&1
}

step "soak (GPU $((ngpu - 1))) beside racecheck and initcheck (GPU 0)"
t0=$SECONDS
if [ "$ngpu" -ge 2 ]; then
  soak & soak_pid=$!
  sanitize racecheck 0 "$race_spec"
  sanitize initcheck 0 "$init_spec"
  wait $soak_pid; soak_rc=$?
else
  soak; soak_rc=$?
  sanitize racecheck 0 "$race_spec"
  sanitize initcheck 0 "$init_spec"
fi
echo "soak: exit $soak_rc"; tail -25 "$OUT/soak.log"
[ $soak_rc -eq 0 ] || status=1
echo "($((SECONDS - t0)) s)"
exit $status
