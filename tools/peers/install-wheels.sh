# Shared steps of the peer scripts (tools/peers/run.sh, tools/peers/train_side_by_side.sh):
# sourced from the repository root, never run on its own.
#   source tools/peers/install-wheels.sh
#   peers_env                              the environment every peer run gets
#   peers_install_wheels NAME || exit 1    .whl/*.whl offline into /tmp/site, PYTHONPATH, import check
#   peers_build_shardswap NAME LOG || exit 1   the shardswap CLI into build/cuda, when missing
#   peers_fused_adam LOG [NOTE]            DeepSpeed's FusedAdam JIT build (nvcc, sm_90); on failure
#                                          prints NOTE and the log's tail and returns 1
# NAME prefixes the error messages (the calling script's name).

PEERS_SITE=${PEERS_SITE:-/tmp/site}
PEERS_BIN=build/cuda/tools/shardswap

peers_env() {
  # NVLink multicast (NVLS) stays off for every NCCL, symmetric-memory and NVSHMEM user.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # The machine sets TORCH_CUDA_ARCH_LIST=9.0a, which DeepSpeed 0.19.8's op builder cannot parse.
  export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=9.0
  export MAX_JOBS=${MAX_JOBS:-16}
}

peers_install_wheels() {
  local name=$1
  ls .whl/*.whl >/dev/null 2>&1 || {
    echo "$name: no .whl/*.whl: run tools/peers/download-wheels.sh and copy .whl here" >&2; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$PEERS_SITE" .whl/*.whl || { echo "$name: installing the wheels of .whl/ failed" >&2; return 1; }
  case ":${PYTHONPATH:-}:" in
    *":$PEERS_SITE:"*) ;;
    *) export PYTHONPATH=$PEERS_SITE${PYTHONPATH:+:$PYTHONPATH} ;;
  esac
  python3 -c "import deepspeed, pydantic; print('deepspeed', deepspeed.__version__, 'pydantic', pydantic.__version__)" \
    || { echo "$name: import deepspeed failed" >&2; return 1; }
}

peers_build_shardswap() {
  local name=$1 log=$2 t0=$SECONDS
  [ -x "$PEERS_BIN" ] && return 0
  echo "building the shardswap CLI (build/cuda, target shardswap_cli only); log: $log"
  { cmake --preset cuda && cmake --build --preset cuda -j "$(nproc)" --target shardswap_cli; } > "$log" 2>&1 \
    || { tail -40 "$log"; echo "$name: building shardswap failed" >&2; return 1; }
  echo "built in $((SECONDS - t0)) s"
}

peers_fused_adam() {
  local log=$1 note=${2:-} t0=$SECONDS rc=0
  python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load(); print('FusedAdam loaded')" \
    > "$log" 2>&1 && tail -1 "$log" \
    || { rc=1; echo "FusedAdam did not build${note:+ ($note)}:"; tail -15 "$log"; }
  echo "($((SECONDS - t0)) s)"
  return $rc
}
