// Master and optimizer state in host memory (EngineConfig::optimizer_placement = host): the
// update runs on the CPU with the device kernel's arithmetic, the gradient partition coming
// down and the updated bit16 shard going up a chunk at a time through two host staging buffers.
#include <algorithm>

#include "engine/engine_impl.h"
#include "shardswap/dtype.h"

namespace shardswap {

std::int64_t offload_chunk(const EngineConfig& config, const std::vector<Group>& groups) {
  std::int64_t largest = 1;
  for (const auto& g : groups) largest = std::max(largest, g.shard.numel());
  return std::min(static_cast<std::int64_t>(config.offload_chunk_elements), largest);
}

void Engine::Impl::allocate_staging(const std::vector<Group>& planned) {
  chunk = offload_chunk(config, planned);
  MemorySpace& h = host_space();
  const auto n = static_cast<std::size_t>(chunk);
  staging_grad =
      h.allocate(n * dtype_size(config.grad_type()), Tag::grad, "offload gradient staging");
  staging_param = h.allocate(n * dtype_size(config.dtype), Tag::param16, "offload param staging");
  updater = std::make_unique<HostUpdater>(config.offload_threads);
}

void Engine::Impl::seed_master_on_host(const Group& g, Buffer& master) {
  const auto psize = dtype_size(config.dtype);
  const std::int64_t n = g.shard.numel();
  for (std::int64_t at = 0; at < n; at += chunk) {
    const auto count = static_cast<std::size_t>(std::min(chunk, n - at));
    space.download(staging_param.data(), g.param16_at(g.shard.begin + at, psize), count * psize);
    cpu_device_ops().cast(master.as<float>() + at, DType::f32, staging_param.data(), config.dtype,
                          count);
  }
}

void Engine::Impl::update_on_host(Group& g, const StepArgs& args, std::int64_t at,
                                  std::int64_t count) {
  const DType dtype = config.dtype, grad_dtype = config.grad_type();
  const auto psize = dtype_size(dtype), gsize = dtype_size(grad_dtype);
  const auto shard = static_cast<std::size_t>(g.shard.numel());
  const int slots = config.optimizer.state_slots();
  const std::byte* grads = reducer->partition(g);
  for (std::int64_t done = 0; done < count; done += chunk) {
    const auto n = static_cast<std::size_t>(std::min(chunk, count - done));
    const auto i = static_cast<std::size_t>(at + done);
    space.download(staging_grad.data(), grads + i * gsize, n * gsize);
    ShardTensors t;
    t.master = g.master.as<float>() + i;
    t.state0 = slots >= 1 ? g.state.as<float>() + i : nullptr;
    t.state1 = slots >= 2 ? g.state.as<float>() + shard + i : nullptr;
    t.grad = staging_grad.data();
    t.param = staging_param.data();
    t.dtype = dtype;
    t.grad_dtype = grad_dtype;
    t.count = n;
    updater->update(config.optimizer, args, t);
    space.upload(g.param16_at(g.shard.begin + static_cast<std::int64_t>(i), psize),
                 staging_param.data(), n * psize);
  }
}

}  // namespace shardswap
