// Argument checks every backend's kernels make before touching memory (one place, so the
// backends refuse exactly the same calls with the same messages). Internal to optimizer/.
#pragma once

#include <cstddef>

#include "optimizer/optimizer.h"

namespace shardswap::detail {

/// ConfigError "<fn>: <name> is null for <count> <unit>" when p is null (count > 0 assumed).
void require_data(const void* p, const char* fn, const char* name, std::size_t count,
                  const char* unit = "elements");

/// Checks an update's arguments: bit16 params, gradients of the param type or fp32, step >= 1
/// and every tensor the rule reads present. `fn` names the caller ("cpu_device_ops().update").
/// Returns false when there is nothing to do (count 0).
bool check_update(const char* fn, const OptimizerConfig& config, const StepArgs& args,
                  const ShardTensors& t);

/// check_update for update_streamed, and every slot the rule uses present with a chunk >= 1.
bool check_streamed(const char* fn, const OptimizerConfig& config, const StepArgs& args,
                    const StreamedTensors& s);

/// The update of elements [at, at + n) of a streamed shard, with master and state in `slot`.
inline ShardTensors slot_tensors(const StreamedTensors& s, int slot, std::size_t at,
                                 std::size_t n) {
  ShardTensors c = s.t;
  c.master = s.slot_master[slot];
  c.state0 = s.t.state0 != nullptr ? s.slot_state0[slot] : nullptr;
  c.state1 = s.t.state1 != nullptr ? s.slot_state1[slot] : nullptr;
  c.grad = static_cast<const std::byte*>(s.t.grad) + at * dtype_size(s.t.grad_dtype);
  c.param = static_cast<std::byte*>(s.t.param) + at * dtype_size(s.t.dtype);
  c.count = n;
  return c;
}

}  // namespace shardswap::detail
