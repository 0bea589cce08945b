// Linked when CUDA is off: the same symbol, failing with a clear error.
#include "shardswap/error.h"
#include "optimizer/optimizer.h"

namespace shardswap {

const DeviceOps& cuda_device_ops() {
  throw BackendUnavailable("cuda_device_ops: ShardSwap was built without CUDA");
}

}  // namespace shardswap
