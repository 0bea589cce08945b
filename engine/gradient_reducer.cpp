#include "engine/gradient_reducer.h"

#include <fmt/format.h>

#include "engine/bucket_reducer.h"
#include "engine/full_gradient_reducer.h"
#include "engine/host_gradient_reducer.h"
#include "shardswap/error.h"

namespace shardswap {

void require_gradient_placement(const EngineConfig& config, int world_size) {
  if (config.gradient_placement == Placement::host && world_size != 1)
    throw ConfigError(fmt::format(
        "shardswap.gradient_placement = \"host\": world size {}; gradients on the host are "
        "supported on one rank only (their reduction across ranks is not built yet)",
        world_size));
}

std::unique_ptr<GradientReducer> make_gradient_reducer(const EngineConfig& config,
                                                       Communicator& comm, MemorySpace& space,
                                                       const DeviceOps& ops,
                                                       std::int64_t capacity,
                                                       std::size_t param_count) {
  require_gradient_placement(config, comm.world_size());
  if (config.gradient_placement == Placement::host)
    return std::make_unique<HostGradientReducer>(space, ops, config.grad_type(), capacity,
                                                 param_count);
  if (accumulates_in_place(config, comm.world_size()))
    return std::make_unique<FullGradientReducer>(config, comm, space, ops, capacity, param_count);
  return std::make_unique<BucketReducer>(comm, space, ops, config.grad_type(), config.comm_type(),
                                         capacity, config.overlap_comm);
}

}  // namespace shardswap
