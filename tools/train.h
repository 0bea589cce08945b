// `shardswap train`: a JSON-configured run of the built-in model with world_size ranks.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "engine/config_reader.h"
#include "engine/engine_config.h"
#include "engine/schedule.h"
#include "tools/residual_mlp.h"

namespace shardswap {

struct TrainConfig {
  EngineConfig engine;
  MlpShape model;
  int world_size = 1;
  std::int64_t steps = 100;
  int micro_batch = 32;  ///< train_micro_batch_size_per_gpu
  std::uint64_t seed = 1;
  double noise = 0.01;  ///< data.noise
  int log_interval = 10;
  LayerSwitchingConfig switching;  ///< layer_switching; validated against the model's groups
};

/// Reads every key of the run (engine keys and layer_switching included) and checks the schedule
/// against the model's groups, before anything is allocated. Throws ConfigError naming the key
/// and the file. Keys present but never read are left in reader.unread_keys().
TrainConfig train_config_from_json(ConfigReader& reader);

struct TrainSummary {
  double first_loss = 0.0;  ///< mean over ranks, first step
  double final_loss = 0.0;  ///< mean over ranks and over the last log interval
  std::int64_t steps = 0;
  std::int64_t skipped = 0;
  std::int64_t switches = 0;  ///< layer switches made
};

/// The group names of the built-in model, in declaration order.
std::vector<std::string> model_groups(const MlpShape& shape);

/// Runs the training. Progress lines go to `log`, one JSON object per step to `metrics` (if not
/// null), a memory report after build to `report` (if not null).
TrainSummary train(const TrainConfig& config, std::ostream& log, std::ostream* metrics,
                   std::ostream* report = nullptr);

}  // namespace shardswap
