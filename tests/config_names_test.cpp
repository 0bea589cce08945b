// Which names a config error uses: code that fills EngineConfig, OptimizerConfig,
// LossScaleConfig or LrSchedule itself is told the field it set, in the field's unit; a config
// read from JSON is told the key it wrote, in the key's unit, with the file.
#include <string>

#include "shardswap/batch_sizes.h"
#include "shardswap/config_json.h"
#include "shardswap/engine_config.h"
#include "shardswap/error.h"
#include "shardswap/loss_scaler.h"
#include "shardswap/lr_schedule.h"
#include "tests/catch_compat.h"

using namespace shardswap;

TEST_CASE("C++ config validation names the struct's fields in their units, not JSON keys") {
  EngineConfig engine;
  engine.reduce_bucket_bytes = 128;
  CHECK(test::message_of<ConfigError>([&] { engine.validate(); }) ==
        "EngineConfig.reduce_bucket_bytes = 128 bytes: is smaller than alignment_bytes = 256");
  CHECK(test::message_of<ConfigError>([&] { engine.validate(""); }) ==
        "zero_optimization.reduce_bucket_size = 64 elements: 128 bytes of bf16 gradients is "
        "smaller than the alignment (256 bytes)");

  engine = EngineConfig{};
  engine.stage = 3;
  CHECK(test::message_of<ConfigError>([&] { engine.validate(); }) ==
        "EngineConfig.stage = 3: ShardSwap implements stages 1 and 2");
  engine = EngineConfig{};
  engine.optimizer.beta1 = 1.0;
  CHECK(test::message_of<ConfigError>([&] { engine.validate(); }) ==
        "EngineConfig.optimizer.beta1 = 1: must be in [0, 1)");
  CHECK(test::message_of<ConfigError>([&] { engine.validate(""); }) ==
        "optimizer.params.betas[0] = 1: must be in [0, 1)");
  engine = EngineConfig{};
  engine.dtype = DType::f16;
  engine.loss_scale.initial_scale = 0.0;
  CHECK(test::message_of<ConfigError>([&] { engine.validate(); }) ==
        "EngineConfig.loss_scale.initial_scale = 0: must be finite and > 0");
  CHECK(test::contains(test::message_of<ConfigError>([&] { engine.validate(""); }),
                       "fp16.initial_scale_power = "));

  LossScaleConfig scale;
  scale.min_scale = -1.0;
  CHECK(test::message_of<ConfigError>([&] { scale.validate(); }) ==
        "LossScaleConfig.min_scale = -1: must be finite and > 0");
  CHECK(test::message_of<ConfigError>([&] { scale.validate("fp16"); }) ==
        "fp16.min_loss_scale = -1: must be finite and > 0");

  LrSchedule schedule;
  schedule.type = LrScheduleType::warmup_cosine;
  schedule.warmup_num_steps = 10;
  schedule.total_num_steps = 5;
  CHECK(test::contains(test::message_of<ConfigError>([&] { schedule.validate(); }),
                       "LrSchedule.total_num_steps = 5: must be > the warmup"));
  schedule.total_num_steps = 50;
  schedule.peak_lr = -1.0;
  CHECK(test::message_of<ConfigError>([&] { schedule.validate(); }) ==
        "LrSchedule.peak_lr = -1: must be finite and >= 0");
  CHECK(test::message_of<ConfigError>([&] { schedule.validate("scheduler.params"); }) ==
        "optimizer.params.lr = -1: must be finite and >= 0");
}

TEST_CASE("a JSON config's errors still name its keys, in the keys' units, with the file") {
  auto reader = ConfigReader::from_text(
      R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 64},
          "shardswap": {"alignment_bytes": 256}})",
      "run.json");
  const BatchSizes batches = resolve_batch_sizes(reader, 1);
  const std::string message =
      test::message_of<ConfigError>([&] { engine_config_from_json(reader, batches); });
  CHECK(test::contains(message, "run.json"));
  CHECK(test::contains(message, "zero_optimization.reduce_bucket_size = 64 elements"));
  CHECK(!test::contains(message, "EngineConfig"));
}
