#include "engine/full_gradient_reducer.h"

#include <fmt/format.h>

#include <algorithm>

#include "shardswap/error.h"

namespace shardswap {

FullGradientReducer::FullGradientReducer(const EngineConfig& config, Communicator& comm,
                                         MemorySpace& space, const DeviceOps& ops,
                                         std::int64_t capacity, std::size_t param_count)
    : comm_(comm),
      ops_(ops),
      dtype_(config.grad_type()),
      wire_(config.comm_type()),
      capacity_(capacity),
      slots_(param_count) {
  if (config.compressed())
    compressed_ = space.allocate(static_cast<std::size_t>(capacity) * dtype_size(wire_),
                                 Tag::comm, fmt::format("compressed chunk ({})", dtype_name(wire_)));
}

std::string FullGradientReducer::grad_label(const Group& g) const {
  return fmt::format("group {} grads", g.name);
}

void FullGradientReducer::attach(Group& g, const std::vector<Param>& params) {
  const auto gsize = dtype_size(dtype_);
  for (auto i : g.params) {
    const Param& p = params[i];
    const auto& entry = g.layout.entry_of(p.index_in_group);
    slots_[i].view = g.grad.view(static_cast<std::size_t>(entry.offset) * gsize,
                                 static_cast<std::size_t>(p.info.numel), dtype_,
                                 p.info.name + ": grad slot");
    slots_[i].name = p.info.name;
  }
}

void FullGradientReducer::detach(Group& g) {
  for (auto i : g.params) slots_[i] = Slot{};
}

View FullGradientReducer::slot(Group& g, std::size_t index, const Param& p) {
  Slot& s = slots_[index];
  s.out = true;
  s.ready = false;
  g.holds_grads = true;
  return s.view;
}

bool FullGradientReducer::mark_ready(std::size_t index) {
  return slot_readiness::mark_ready(slots_, index);
}

void FullGradientReducer::finish() {
  slot_readiness::require_ready(slots_);
}

void FullGradientReducer::reduce_for_step(std::vector<Group>& groups) {
  for (auto& g : groups)
    if (g.active) reduce_scatter(g);
}

// Uncompressed, in place. Compressed, in chunks through the one comm buffer: the k-th slice of
// every rank's shard is cast to the wire type side by side, reduce-scattered there, and this
// rank's slice is cast back into its shard.
void FullGradientReducer::reduce_scatter(Group& g) {
  const auto gsize = dtype_size(dtype_), wsize = dtype_size(wire_);
  const auto shard = static_cast<std::size_t>(g.shard.numel());
  const auto rank = static_cast<std::size_t>(comm_.rank());
  auto* grads = g.grad.as<std::byte>();
  hand_overs_.push_back({g.index, 0, g.layout.total_numel()});
  if (!compressed_.valid()) {
    comm_.reduce_scatter(grads, grads + rank * shard * gsize, shard, dtype_, ReduceOp::sum);
    return;
  }
  const auto ranks = static_cast<std::size_t>(comm_.world_size());
  const std::size_t slice = static_cast<std::size_t>(capacity_) / ranks;
  auto* chunk = compressed_.as<std::byte>();
  for (std::size_t k = 0; k < shard; k += slice) {
    const std::size_t n = std::min(slice, shard - k);
    for (std::size_t r = 0; r < ranks; ++r)
      ops_.cast(chunk + r * n * wsize, wire_, grads + (r * shard + k) * gsize, dtype_, n);
    comm_.reduce_scatter(chunk, chunk + rank * n * wsize, n, wire_, ReduceOp::sum);
    ops_.cast(grads + (rank * shard + k) * gsize, dtype_, chunk + rank * n * wsize, wire_, n);
  }
}

std::byte* FullGradientReducer::partition(const Group& g) const {
  return g.grad.as<std::byte>() +
         g.shard.begin * static_cast<std::int64_t>(dtype_size(dtype_));
}

void FullGradientReducer::clear(std::vector<Group>& groups) {
  for (auto& g : groups) {
    if (g.active) ops_.fill_zero(g.grad.data(), g.grad.bytes());
    g.holds_grads = false;
  }
  for (auto& s : slots_) s.out = s.ready = false;
  hand_overs_.clear();
}

std::string FullGradientReducer::pending(const Group& g) const {
  return slot_readiness::pending(g, slots_);
}

}  // namespace shardswap
