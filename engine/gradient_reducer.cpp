#include "engine/gradient_reducer.h"

#include "engine/bucket_reducer.h"
#include "engine/full_gradient_reducer.h"

namespace shardswap {

std::unique_ptr<GradientReducer> make_gradient_reducer(const EngineConfig& config,
                                                       Communicator& comm, MemorySpace& space,
                                                       const DeviceOps& ops,
                                                       std::int64_t capacity,
                                                       std::size_t param_count) {
  if (accumulates_in_place(config, comm.world_size()))
    return std::make_unique<FullGradientReducer>(config, comm, space, ops, capacity, param_count);
  return std::make_unique<BucketReducer>(comm, space, ops, config.grad_type(), config.comm_type(),
                                         capacity, config.overlap_comm);
}

}  // namespace shardswap
