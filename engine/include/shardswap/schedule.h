// Layer-switching schedules (config section `layer_switching`): which groups are active at each
// step. Pure functions of the step and the config: every rank computes the same sets, and a
// resumed run picks the schedule up where it stopped.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardswap/config_reader.h"
#include "shardswap/engine.h"

namespace shardswap {

/// Config key layer_switching.type: which schedule picks the active groups.
enum class SwitchingType {
  none,           ///< "none": every group always active
  lisa,           ///< "lisa": gamma layers drawn at random every interval
  badam,          ///< "badam": one block at a time, every interval
  explicit_list,  ///< "explicit": a table of (first step, active groups)
};
/// "none", "lisa", "badam", "explicit". Throws ConfigError "KEY = \"NAME\": expected ..." naming
/// `key` otherwise.
SwitchingType switching_type_from_name(std::string_view name, std::string_view key);
const char* switching_type_name(SwitchingType type);

/// Config key layer_switching.order: the order in which BAdam visits its blocks.
enum class BlockOrder {
  ascending,   ///< "ascending": the blocks in list order
  descending,  ///< "descending": from the last of the list to the first
  random,      ///< "random": a fresh permutation every epoch, drawn from the seed
};
/// "ascending", "descending", "random". Throws ConfigError naming `key` otherwise.
BlockOrder block_order_from_name(std::string_view name, std::string_view key);
const char* block_order_name(BlockOrder order);

struct LayerSwitchingConfig {
  SwitchingType type = SwitchingType::none;
  std::int64_t interval = 10;              ///< steps between switches (lisa, badam)
  int gamma = 2;                           ///< lisa: body layers active at a time
  std::vector<std::string> layers;         ///< lisa: sampled from; badam: the blocks, in order
  std::vector<std::string> always_active;  ///< lisa, badam: active at every step
  BlockOrder order = BlockOrder::ascending;  ///< badam
  std::uint64_t seed = 0;                  ///< lisa draws, badam random order
  DeactivatePolicy policy = DeactivatePolicy::drop;
  /// explicit: (first step, active groups), steps strictly increasing, the first one 0.
  std::vector<std::pair<std::int64_t, std::vector<std::string>>> steps;
};

/// Reads layer_switching.{type, interval, gamma, layers, always_active, order, seed, policy,
/// schedule: [{step, active: [...]}, ...]}. Throws ConfigError "FILE: KEY = VALUE: what is wrong"
/// for a value of the wrong type, an unknown type, order or policy, or an incomplete entry.
LayerSwitchingConfig layer_switching_from_json(ConfigReader& config);

class LayerSchedule {
 public:
  /// Validates against the model's groups (declaration order) and throws ConfigError naming the
  /// key (layer_switching.*), as "KEY = VALUE: what is wrong", for: an unknown group name;
  /// interval < 1; gamma < 1
  /// or larger than the number of layers; a layer both always-active and sampled; an empty
  /// layers list (lisa, badam); explicit steps not strictly increasing or not starting at 0.
  LayerSchedule(LayerSwitchingConfig config, std::vector<std::string> groups);

  /// The active groups for step `step` (0-based), in group declaration order.
  std::vector<std::string> active_at(std::int64_t step) const;
  /// True if the active set may change at `step` (a switch boundary).
  bool boundary(std::int64_t step) const;
  bool enabled() const { return config_.type != SwitchingType::none; }
  DeactivatePolicy policy() const { return config_.policy; }
  const LayerSwitchingConfig& config() const { return config_; }

 private:
  LayerSwitchingConfig config_;
  std::vector<std::string> groups_;
  std::unordered_map<std::string, std::size_t> group_index_;  ///< a group's place in groups_
};

}  // namespace shardswap
