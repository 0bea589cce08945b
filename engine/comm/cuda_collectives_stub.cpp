// Linked when CUDA is off: the same symbol, failing with a clear error.
#include "engine/comm/collective_ops.h"
#include "shardswap/error.h"

namespace shardswap {

const CollectiveOps& cuda_collective_ops() {
  throw BackendUnavailable("cuda_collective_ops: ShardSwap was built without CUDA");
}

}  // namespace shardswap
