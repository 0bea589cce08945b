// A layer group: its params packed in one aligned bit16 flat buffer, and this rank's shard of
// the gradients, fp32 master and optimizer state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "partition/flat_layout.h"
#include "shardswap/buffer.h"
#include "shardswap/engine.h"

namespace shardswap {

struct Param {
  ParamInfo info;
  std::size_t group = 0;
  std::size_t index_in_group = 0;
  View weight;  // registered "<name>: weight view"
};

/// Optimizer state kept while a group is frozen under keep_host / keep_device.
struct KeptState {
  DeactivatePolicy policy = DeactivatePolicy::keep_device;
  Buffer master;  // keep_device: the device buffers themselves; keep_host: host copies
  Buffer state;
  std::int64_t step = 0;
};

// Frozen: param16 only. Active: also grad, master, state and a step count. A frozen group may
// hold `kept` state to resume from.
struct Group {
  std::string name;
  std::size_t index = 0;            // in the engine's groups (the same on every rank)
  std::vector<std::size_t> params;  // indices into the engine's params, declaration order
  double weight_decay = 0.0;
  FlatLayout layout;
  Shard shard;
  Buffer param16;  // full flat bit16 weights, every rank: where they are used and updated
  /// frozen_weight_placement = host only: the weights' home in host memory. A frozen group's
  /// param16 is its home (moved there); an active group's param16 is on the device and its home
  /// is written back when it is deactivated.
  Buffer home;
  Buffer grad;     // stage 1: full flat bit16 gradients; stage 2: this rank's partition
  Buffer master;   // fp32, this rank's shard
  Buffer state;    // optimizer state (OptimizerConfig::state_dtype), state_slots x shard
  std::int64_t step = 0;
  bool active = false;
  /// Gradients handed over since the last step or zero_grad (the GradientReducer sets and
  /// clears it): its buffer may not be freed meanwhile.
  bool holds_grads = false;
  std::optional<KeptState> kept;

  std::byte* param16_at(std::int64_t element, std::size_t elem_bytes) const {
    return param16.as<std::byte>() + element * static_cast<std::int64_t>(elem_bytes);
  }
  /// Element `element` of state slot `slot` (slots of shard.numel() values of `value_bytes`),
  /// or null for a slot the rule does not have (`slot` >= `slots`).
  void* state_at(int slot, int slots, std::size_t element, std::size_t value_bytes) const {
    if (slot >= slots) return nullptr;
    const auto n = static_cast<std::size_t>(shard.numel());
    return state.as<std::byte>() + (static_cast<std::size_t>(slot) * n + element) * value_bytes;
  }
};

}  // namespace shardswap
