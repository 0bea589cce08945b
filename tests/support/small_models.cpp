#include "tests/support/small_models.h"

#include <fmt/format.h>

#include <string>

namespace shardswap::test_support {

void declare_small_lisa_model(Engine& e) {
  e.add_param("embed.weight", {50, 16}, "embed");
  for (int l = 0; l < 4; ++l) {
    const auto g = fmt::format("layers.{}", l);
    e.add_param(g + ".fc1", {16, 37}, g);
    e.add_param(g + ".fc2", {37, 16}, g);
    e.add_param(g + ".norm", {16}, g);
  }
  e.add_param("head.weight", {16, 50}, "head");
}

EngineConfig small_lisa_config(int stage) {
  EngineConfig cfg;
  cfg.stage = stage;
  cfg.reduce_bucket_bytes = 4096;
  cfg.optimizer.type = OptimizerType::adamw;
  cfg.optimizer.lr = 0.01;
  return cfg;
}

}  // namespace shardswap::test_support
