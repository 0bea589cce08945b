// Master and optimizer state in host memory (EngineConfig::optimizer_placement = host), updated
// with the device kernel's arithmetic a chunk at a time: streamed through two device slots (up,
// the kernel, down), or on the CPU, the gradient partition coming down and the updated bit16
// shard going up through two host staging buffers.
#include <algorithm>
#include <vector>

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
  const auto n = static_cast<std::size_t>(chunk);
  if (grads_on_host())
    slot_grad = space.allocate(2 * n * dtype_size(config.grad_type()), Tag::grad,
                               "offload gradient slots");
  if (streamed()) {
    const auto slots = static_cast<std::size_t>(config.optimizer.state_slots());
    slot_master = space.allocate(2 * n * config.optimizer.master_bytes(), Tag::master32,
                                 "offload master slots");
    slot_state = space.allocate(2 * slots * n * config.optimizer.state_bytes(), Tag::optim_state,
                                "offload state slots");
    return;
  }
  MemorySpace& h = host_space();
  if (!grads_on_host())  // else the update reads them where they are
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
    const std::byte* weights = g.param16_at(g.shard.begin + at, psize);
    float* to = master.as<float>() + at;
    if (streamed()) {  // cast on the device, then down
      ops.cast(slot_master.data(), DType::f32, weights, config.dtype, count);
      space.download(to, slot_master.data(), count * 4);
    } else {
      space.download(staging_param.data(), weights, count * psize);
      cpu_device_ops().cast(to, DType::f32, staging_param.data(), config.dtype, count);
    }
  }
}

void Engine::Impl::update_on_host(Group& g, const StepArgs& args, std::int64_t at,
                                  std::int64_t count) {
  if (streamed())
    update_streamed(g, args, at, count);
  else
    update_on_cpu(g, args, at, count);
}

namespace {

// The master and state of elements [at, at + count) of a group's shard, in host memory.
ShardTensors host_state(const Group& g, const OptimizerConfig& optimizer, std::int64_t at,
                        std::int64_t count) {
  const int slots = optimizer.state_slots();
  const auto i = static_cast<std::size_t>(at);
  ShardTensors t;
  set_master(t, optimizer, g.master, i);
  t.state0 = g.state_at(0, slots, i, optimizer.state_bytes());
  t.state1 = g.state_at(1, slots, i, optimizer.state_bytes());
  t.count = static_cast<std::size_t>(count);
  t.state_dtype = optimizer.state_dtype;
  return t;
}

}  // namespace

void Engine::Impl::update_streamed(Group& g, const StepArgs& args, std::int64_t at,
                                   std::int64_t count) {
  const DType dtype = config.dtype, grad_dtype = config.grad_type();
  StreamedPiece p{args, host_state(g, config.optimizer, at, count)};
  p.t.grad = reducer->partition(g) + static_cast<std::size_t>(at) * dtype_size(grad_dtype);
  p.t.param = g.param16_at(g.shard.begin + at, dtype_size(dtype));
  p.t.dtype = dtype;
  p.t.grad_dtype = grad_dtype;
  streaming.push_back(p);
}

void Engine::Impl::flush_host_updates() {
  if (streaming.empty()) return;
  const int slots = config.optimizer.state_slots();
  const auto n = static_cast<std::size_t>(chunk);
  StreamedTensors s;
  s.pieces = std::move(streaming);
  streaming.clear();
  for (std::size_t k = 0; k < 2; ++k) {
    s.slot_master[k] = slot_master.as<std::byte>() + k * n * config.optimizer.master_bytes();
    const std::size_t state_bytes = config.optimizer.state_bytes();
    std::byte* slot = slot_state.as<std::byte>();
    if (slots >= 1) s.slot_state0[k] = slot + k * slots * n * state_bytes;
    if (slots >= 2) s.slot_state1[k] = slot + (k * slots + 1) * n * state_bytes;
  }
  if (grads_on_host())
    for (std::size_t k = 0; k < 2; ++k)
      s.slot_grad[k] = slot_grad.as<std::byte>() + k * n * dtype_size(config.grad_type());
  s.chunk = n;
  ops.update_streamed(config.optimizer, s);
}

double Engine::Impl::gradient_squares(double scale) {
  const DType grad_dtype = config.grad_type();
  const auto gsize = dtype_size(grad_dtype);
  const std::size_t piece = config.offload_chunk_elements;  // <= chunk, the slots' size
  std::vector<ConstSpan> pieces;
  std::vector<std::size_t> first_piece;  // of each active group, then the end
  for (const Group& g : groups) {
    if (!g.active) continue;
    first_piece.push_back(pieces.size());
    const std::byte* grads = reducer->partition(g);
    const auto n = static_cast<std::size_t>(g.shard.numel());
    for (std::size_t at = 0; at < n; at += piece)
      pieces.push_back({grads + at * gsize, std::min(piece, n - at)});
  }
  first_piece.push_back(pieces.size());
  std::vector<double> sums(pieces.size());
  if (!grads_on_host()) {
    ops.sum_squares(pieces.data(), pieces.size(), grad_dtype, scale, sums.data());
  } else {
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      space.upload(slot_grad.data(), pieces[i].data, pieces[i].count * gsize);
      const ConstSpan up{slot_grad.data(), pieces[i].count};
      ops.sum_squares(&up, 1, grad_dtype, scale, &sums[i]);
    }
  }
  double squares = 0.0;
  for (std::size_t k = 0; k + 1 < first_piece.size(); ++k) {
    double group = 0.0;  // as when each group was summed on its own
    for (std::size_t i = first_piece[k]; i < first_piece[k + 1]; ++i) group += sums[i];
    squares += group;
  }
  return squares;
}

void Engine::Impl::update_on_cpu(Group& g, const StepArgs& args, std::int64_t at,
                                 std::int64_t count) {
  const DType dtype = config.dtype, grad_dtype = config.grad_type();
  const auto psize = dtype_size(dtype), gsize = dtype_size(grad_dtype);
  const std::byte* grads = reducer->partition(g);
  for (std::int64_t done = 0; done < count; done += chunk) {
    const std::int64_t n = std::min(chunk, count - done);
    const auto i = static_cast<std::size_t>(at + done);
    const std::byte* grad = grads + i * gsize;
    if (!grads_on_host()) {
      space.download(staging_grad.data(), grad, static_cast<std::size_t>(n) * gsize);
      grad = staging_grad.as<std::byte>();
    }
    // A master kept as low halves is joined with the bf16 weights, which come down too.
    if (config.optimizer.master == MasterStorage::bf16_remainder)
      space.download(staging_param.data(), g.param16_at(g.shard.begin + at + done, psize),
                     static_cast<std::size_t>(n) * psize);
    ShardTensors t = host_state(g, config.optimizer, at + done, n);
    t.grad = grad;
    t.param = staging_param.data();
    t.dtype = dtype;
    t.grad_dtype = grad_dtype;
    updater->update(config.optimizer, args, t);
    space.upload(g.param16_at(g.shard.begin + at + done, psize), staging_param.data(),
                 static_cast<std::size_t>(n) * psize);
  }
}

}  // namespace shardswap
