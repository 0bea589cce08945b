// Per-param weight decay, checked on any backend (tests/weight_decay_test.cpp on the CPU,
// tests/gpu/weight_decay_gpu_test.cpp on a GPU).
#include "tests/support/decay_runs.h"

#include <fmt/format.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"

namespace shardswap::test_support {

namespace {

struct Declared {
  std::string name;
  std::vector<std::int64_t> shape;
};
// Four layers of fc1 (decayed), fc2 (decayed at half the rate in layer 1) and a norm weight
// (not decayed), between an embedding and a head.
std::vector<Declared> decay_model() {
  std::vector<Declared> out = {{"embed.weight", {50, 16}}};
  for (int l = 0; l < 4; ++l) {
    out.push_back({fmt::format("layers.{}.fc1", l), {16, 37}});
    out.push_back({fmt::format("layers.{}.fc2", l), {37, 16}});
    out.push_back({fmt::format("layers.{}.norm", l), {16}});
  }
  out.push_back({"head.weight", {16, 50}});
  return out;
}
constexpr double kDecay = 0.5;
double decay_of(const std::string& name) {
  if (name.ends_with(".norm")) return 0.0;
  if (name == "layers.1.fc2") return kDecay / 2;
  return kDecay;
}
std::string layer_of(const std::string& name) {
  return name.starts_with("layers.") ? name.substr(0, name.find('.', 7)) : name.substr(0, 4);
}

void init(const ParamInfo& p, std::span<float> v) {
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = 0.5f + 0.25f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(p.numel % 7));
}

// Every param's weights after three steps of gradients that depend on the param, element, rank
// and step only (not on the grouping).
std::map<std::string, std::vector<float>> train(Arrangement how, int stage, const Backend& backend) {
  std::map<std::string, std::vector<float>> out;
  std::mutex mu;
  run_ranks(
      2,
      [&](int rank, Communicator& comm) {
    MemorySpace space(rank, backend.make_allocator(rank));
    EngineConfig cfg;
    cfg.stage = stage;
    cfg.reduce_bucket_bytes = 4096;
    cfg.optimizer.type = OptimizerType::adamw;
    cfg.optimizer.lr = 0.01;
    cfg.optimizer.weight_decay = kDecay;
    cfg.gradient_clipping = 0.0;  // a norm summed in another order must not change the steps
    Engine e(cfg, comm, space, backend);
    for (const auto& p : decay_model()) {
      const bool apart = how == Arrangement::own_groups && decay_of(p.name) != kDecay;
      e.add_param(p.name, p.shape, apart ? p.name : layer_of(p.name));
    }
    for (const auto& p : decay_model()) {
      if (decay_of(p.name) == kDecay) continue;
      if (how == Arrangement::per_param) e.set_param_weight_decay(p.name, decay_of(p.name));
      if (how == Arrangement::own_groups) e.set_group_weight_decay(p.name, decay_of(p.name));
    }
    e.build(init);
    for (int step = 0; step < 3; ++step) {
      const auto params = e.params();
      for (auto it = params.rbegin(); it != params.rend(); ++it) {
        std::vector<float> g(static_cast<std::size_t>(it->numel));
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] = (0.01f * static_cast<float>((static_cast<int>(i) + 3 * rank + 7 * step +
                                                    static_cast<int>(it->name.size())) %
                                                       13 -
                                                   6));
        e.add_grad(it->name, g);
      }
      if (!e.step().applied) throw Error("a step was skipped");
    }
    if (rank == 0) {
      std::lock_guard lock(mu);
      for (const auto& p : e.params()) out[p.name] = e.read_weight(p.name);
    }
      },
      backend);
  return out;
}


}  // namespace

void check_per_param_decay(const Backend& backend) {
  for (int stage : {1, 2}) {
    INFO("stage " << stage);
    const auto per_param = train(Arrangement::per_param, stage, backend);
    const auto own_groups = train(Arrangement::own_groups, stage, backend);
    const auto all_decayed = train(Arrangement::all_decayed, stage, backend);
    for (const auto& p : decay_model()) {
      INFO(p.name);
      CHECK(per_param.at(p.name) == own_groups.at(p.name));
      // The overrides changed what they override and nothing else.
      if (decay_of(p.name) == kDecay)
        CHECK(per_param.at(p.name) == all_decayed.at(p.name));
      else
        CHECK(per_param.at(p.name) != all_decayed.at(p.name));
    }
  }
}

}  // namespace shardswap::test_support
