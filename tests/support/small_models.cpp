#include "tests/support/small_models.h"

#include <fmt/format.h>

#include <cmath>
#include <string>
#include <vector>

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

void sine_init(const ParamInfo& p, std::span<float> v) {
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = 0.5f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(p.numel % 7));
}

void add_cosine_grads(Engine& e, int rank, int step) {
  const auto& params = e.params();
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (!e.is_active(it->group)) continue;
    std::vector<float> g(static_cast<std::size_t>(it->numel));
    for (std::size_t i = 0; i < g.size(); ++i)
      g[i] = 0.01f * std::cos(0.11f * static_cast<float>(i) + 0.7f * static_cast<float>(rank) +
                              0.3f * static_cast<float>(step));
    e.add_grad(it->name, g);
  }
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
