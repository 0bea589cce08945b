// What ShardSwap's own code (checkpoints, tests) reads of an Engine beyond the public API: the
// flat layout of a group, whether gradients are pending. Not installed.
#pragma once

#include <string>
#include <string_view>

#include "partition/flat_layout.h"
#include "shardswap/engine.h"

namespace shardswap {

struct EngineInternals {
  /// The group's flat layout (ConfigError naming the group if there is none).
  static const FlatLayout& layout(const Engine& engine, const std::string& group);
  /// Throws StateError "<who>: group 'G' has gradients pending (...); call step() or zero_grad()
  /// first; nothing was changed" if any group has: for the free functions over an Engine
  /// (save_checkpoint, load_checkpoint) to refuse in their own name.
  static void require_none_pending(const Engine& engine, std::string_view who);
};

}  // namespace shardswap
