// Linked when CUDA is off: the same symbols, failing with a clear error.
#include "shardswap/allocator.h"
#include "shardswap/error.h"

namespace shardswap {

std::unique_ptr<Allocator> make_cuda_allocator(int) {
  throw BackendUnavailable("make_cuda_allocator: ShardSwap was built without CUDA");
}
void cuda_set_device(int) {
  throw BackendUnavailable("cuda_set_device: ShardSwap was built without CUDA");
}
int cuda_current_device() {
  throw BackendUnavailable("cuda_current_device: ShardSwap was built without CUDA");
}
DeviceMemory cuda_device_memory(int) {
  throw BackendUnavailable("cuda_device_memory: ShardSwap was built without CUDA");
}
int cuda_device_count() {
  return 0;
}

}  // namespace shardswap
