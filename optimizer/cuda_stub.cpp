// Linked when CUDA is off: the same symbol, failing with a clear error.
#include "memory/error.h"
#include "optimizer/optimizer.h"

namespace shardswap {

const OptimizerKernels& cuda_kernels() {
  throw BackendUnavailable("cuda_kernels: ShardSwap was built without CUDA");
}

}  // namespace shardswap
