// Linked when CUDA is off: the same symbol, failing with a clear error.
#include "engine/comm/communicator.h"
#include "memory/error.h"

namespace shardswap {

const CollectiveOps& cuda_collective_ops() {
  throw BackendUnavailable("cuda_collective_ops: ShardSwap was built without CUDA");
}

}  // namespace shardswap
