// EngineConfig from a DeepSpeed-style JSON config (keys mean what they mean in DeepSpeed).
#pragma once

#include "engine/config_reader.h"
#include "engine/engine_config.h"

namespace shardswap {

/// Reads optimizer.{type, params}, bf16.enabled, fp16.{enabled, loss_scale, initial_scale_power,
/// loss_scale_window, hysteresis, min_loss_scale}, gradient_clipping,
/// gradient_accumulation_steps, zero_optimization.{stage, reduce_bucket_size (elements, as in
/// DeepSpeed), round_robin_gradients}, shardswap.alignment_bytes. Validates the result; throws
/// ConfigError naming the key and the file.
EngineConfig engine_config_from_json(ConfigReader& config);

}  // namespace shardswap
