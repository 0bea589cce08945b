// What ShardSwap's own code (checkpoints, tests) reads of an Engine beyond the public API: the
// flat layout of a group. Not installed.
#pragma once

#include <string>

#include "partition/flat_layout.h"
#include "shardswap/engine.h"

namespace shardswap {

struct EngineInternals {
  /// The group's flat layout (ConfigError naming the group if there is none).
  static const FlatLayout& layout(const Engine& engine, const std::string& group);
};

}  // namespace shardswap
