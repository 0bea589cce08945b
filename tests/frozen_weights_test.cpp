// Frozen groups' weights in host memory (EngineConfig::frozen_weight_placement = host), brought
// to the device through two windows: a model that reads every group's weights in forward and
// backward gets the device placement's bits through switches, keep policies, the state on the
// host, re-forms and restores; the plan holds on both sides; misuse is refused with nothing
// changed. The same model, which fetches each group just before reading it, also runs with the
// update overlapping the next forward (EngineConfig::overlap_update).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "optimizer/optimizer.h"
#include "shardswap/backend.h"
#include "shardswap/batch_sizes.h"
#include "shardswap/config_json.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/plan_held.h"
#include "tests/support/small_models.h"

using namespace shardswap;
using test_support::require_plan_held;
using test_support::sine_init;

namespace {

const std::vector<std::string> kGroups = {"embed",    "layers.0", "layers.1",
                                          "layers.2", "layers.3", "head"};

EngineConfig config_of(Placement weights, Placement state = Placement::device) {
  EngineConfig cfg = test_support::small_lisa_config(2);
  cfg.frozen_weight_placement = weights;
  cfg.optimizer_placement = state;
  cfg.gradient_accumulation_steps = 2;
  return cfg;
}

// The weights of `param` as the model reads them: through weight(), from the window or the device.
std::vector<float> read(const Engine& e, const std::string& param) {
  const View w = e.weight(param);
  std::vector<float> out(w.count());
  cpu_device_ops().cast(out.data(), DType::f32, w.raw(), w.dtype(), out.size());
  return out;
}

// A weighted sum of a group's weights, read the way a layer reads them (fetch, use, release).
double use_group(Engine& e, const std::string& group, int salt) {
  e.fetch_weights(group);
  double s = 0.0;
  for (const auto& p : e.params())
    if (p.group == group) {
      const auto w = read(e, p.name);
      for (std::size_t i = 0; i < w.size(); ++i)
        s += static_cast<double>(w[i]) * std::sin(0.31 * static_cast<double>(i) + salt);
    }
  e.release_weights(group);
  return s;
}

// One micro-batch: forward reads every group in order, backward reads them in reverse down to
// the lowest active group and hands over gradients that depend on what both read, so a window
// holding the wrong weights changes the bits.
void micro_batch(Engine& e, int step, int micro) {
  double forward = 0.0;
  for (const auto& g : kGroups) forward += use_group(e, g, step + micro);
  std::size_t lowest = kGroups.size();
  for (std::size_t i = 0; i < kGroups.size(); ++i)
    if (e.is_active(kGroups[i]) && lowest == kGroups.size()) lowest = i;
  double flowing = forward;
  for (std::size_t i = kGroups.size(); i-- > lowest;) {
    const std::string& g = kGroups[i];
    flowing = 0.5 * flowing + 1e-3 * use_group(e, g, 7 * micro + step);
    if (!e.is_active(g)) continue;
    for (const auto& p : e.params())
      if (p.group == g) {
        std::vector<float> grad(static_cast<std::size_t>(p.numel));
        for (std::size_t k = 0; k < grad.size(); ++k)
          grad[k] = static_cast<float>(0.01 * std::sin(0.17 * static_cast<double>(k) + flowing));
        e.add_grad(p.name, grad);
      }
  }
}

struct Run {
  std::vector<double> norms;
  TrainingState state;
};

// 9 steps of 2 micro-batches on one rank, switching layers before steps 4 and 7 under `policy`.
Run run(const EngineConfig& cfg, DeactivatePolicy policy) {
  MemorySpace space(0, make_host_allocator());
  InProcessGroup group(1);
  Engine e(cfg, group.rank(0), space);
  test_support::declare_small_lisa_model(e);
  e.build(sine_init, std::vector<std::string>{"embed", "head", "layers.2"});
  require_plan_held(e, "after build");
  Run out;
  const std::vector<std::vector<std::string>> sets = {
      {"embed", "head", "layers.2"}, {"head", "layers.0", "layers.3"}, {"layers.1"}};
  for (int step = 0; step < 9; ++step) {
    if (step % 3 == 0 && step > 0) {
      e.set_active(sets[static_cast<std::size_t>(step / 3)], policy);
      require_plan_held(e, fmt::format("after the switch before step {}", step + 1));
    }
    for (int micro = 0; micro < 2; ++micro) micro_batch(e, step, micro);
    const StepResult r = e.step();
    REQUIRE(r.applied);
    out.norms.push_back(r.grad_norm);
    require_plan_held(e, fmt::format("after step {}", step + 1));
  }
  out.state = e.training_state(true);
  return out;
}

void require_same_bits(const Run& a, const Run& b) {
  REQUIRE(a.norms.size() == b.norms.size());
  for (std::size_t i = 0; i < a.norms.size(); ++i) {
    CAPTURE(i);
    REQUIRE(std::bit_cast<std::uint64_t>(a.norms[i]) == std::bit_cast<std::uint64_t>(b.norms[i]));
  }
  REQUIRE(a.state.groups.size() == b.state.groups.size());
  for (std::size_t i = 0; i < a.state.groups.size(); ++i) {
    CAPTURE(a.state.groups[i].group);
    REQUIRE(a.state.groups[i].active == b.state.groups[i].active);
    REQUIRE(a.state.groups[i].step == b.state.groups[i].step);
    REQUIRE(a.state.groups[i].master == b.state.groups[i].master);
    REQUIRE(a.state.groups[i].state == b.state.groups[i].state);
  }
  REQUIRE(a.state.weights == b.state.weights);
}

std::unique_ptr<Engine> built(MemorySpace& space, InProcessGroup& group, const EngineConfig& cfg,
                              const std::vector<std::string>& active) {
  auto e = std::make_unique<Engine>(cfg, group.rank(0), space);
  test_support::declare_small_lisa_model(*e);
  e->build(sine_init, active);
  return e;
}

}  // namespace

TEST_CASE("frozen weights on the host give the device placement's bits through switches, keep "
          "policies and the state on the host") {
  for (Placement state : {Placement::device, Placement::host})
    for (DeactivatePolicy policy :
         {DeactivatePolicy::drop, DeactivatePolicy::keep_device, DeactivatePolicy::keep_host}) {
      CAPTURE(state == Placement::host, deactivate_policy_name(policy));
      const Run device = run(config_of(Placement::device, state), policy);
      const Run host = run(config_of(Placement::host, state), policy);
      require_same_bits(device, host);
      // The weights did train: the last state differs from the first weights.
      const Run first = [&] {
        Run r;
        MemorySpace space(0, make_host_allocator());
        InProcessGroup group(1);
        r.state = built(space, group, config_of(Placement::host, state), kGroups)
                      ->training_state(true);
        return r;
      }();
      REQUIRE(first.state.weights != host.state.weights);
    }
}

TEST_CASE("an update overlapping the next forward gives the bits of one that does not, the "
          "weights on the device or the host, through switches under every keep policy") {
  for (Placement weights : {Placement::device, Placement::host})
    for (DeactivatePolicy policy :
         {DeactivatePolicy::drop, DeactivatePolicy::keep_device, DeactivatePolicy::keep_host}) {
      CAPTURE(weights == Placement::host, deactivate_policy_name(policy));
      EngineConfig overlapped = config_of(weights);
      overlapped.overlap_update = true;
      require_same_bits(run(overlapped, policy), run(config_of(weights), policy));
    }
}

TEST_CASE("shardswap.overlap_update reads true or false and needs the optimizer state on the "
          "device, naming both keys") {
  const auto read = [](const nlohmann::json& value, bool offload) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                        {"bf16", {{"enabled", true}}},
                        {"zero_optimization", {{"stage", 2}}},
                        {"shardswap", {{"overlap_update", value}}}};
    if (offload) j["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
    ConfigReader reader(j, "test.json");
    return engine_config_from_json(reader, BatchSizes{});
  };
  REQUIRE(read(true, false).overlap_update);
  REQUIRE(!read(false, false).overlap_update);
  REQUIRE(!EngineConfig{}.overlap_update);  // off unless asked for
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { read("yes", false); }),
                         "shardswap.overlap_update"));
  const std::string offloaded = test::message_of<ConfigError>([&] { read(true, true); });
  REQUIRE(test::contains(offloaded, "shardswap.overlap_update = true"));
  REQUIRE(test::contains(offloaded, "zero_optimization.offload_optimizer.device = \"cpu\""));
  EngineConfig cfg = config_of(Placement::device, Placement::host);
  cfg.overlap_update = true;
  const std::string fields = test::message_of<ConfigError>([&] { cfg.validate(); });
  REQUIRE(test::contains(fields, "EngineConfig.overlap_update = true"));
  REQUIRE(test::contains(fields, "optimizer_placement = \"host\""));
}

TEST_CASE("frozen weights on the host: the plan puts every group's weights on the host, the "
          "active ones and two windows on the device") {
  MemorySpace space(0, make_host_allocator());
  InProcessGroup group(1);
  // The device's param16 bytes with the groups `active` at build, before any build.
  const auto device_bytes = [&](const std::vector<std::string>& active) {
    Engine e(config_of(Placement::host), group.rank(0), space);
    test_support::declare_small_lisa_model(e);
    return e.plan(active).of(Tag::param16);
  };
  const std::int64_t windows = device_bytes({});
  const std::int64_t layer = device_bytes({"layers.1"}) - windows;
  const std::int64_t embed = device_bytes({"embed"}) - windows;
  REQUIRE(layer >= (16 * 37 * 2 + 16) * 2);  // bf16, and any alignment padding
  REQUIRE(embed >= 50 * 16 * 2);
  REQUIRE(windows == 2 * layer);  // each as large as the largest group, a layer
  REQUIRE(device_bytes({"embed", "layers.1"}) == windows + embed + layer);
  auto e = built(space, group, config_of(Placement::host), {"embed", "layers.1"});
  const MemoryPlan plan = e->plan();
  REQUIRE(plan.of(Tag::param16) == windows + embed + layer);
  // Every group's home on the host: what the device placement holds on the device.
  REQUIRE(plan.host_of(Tag::param16) == 4 * layer + 2 * embed);  // the head is as large
  require_plan_held(*e, "after build");
  // The device placement holds all six groups on the device and none on the host.
  MemorySpace space2(0, make_host_allocator());
  auto d = built(space2, group, config_of(Placement::device), {"embed", "layers.1"});
  REQUIRE(d->plan().host_of(Tag::param16) == 0);
  REQUIRE(d->plan().of(Tag::param16) == plan.host_of(Tag::param16));
  // A switch moves weights between the sides and the plan follows.
  e->set_active({"layers.0", "layers.3", "head"}, DeactivatePolicy::drop);
  require_plan_held(*e, "after a switch");
  REQUIRE(e->plan().of(Tag::param16) > plan.of(Tag::param16));
}

TEST_CASE("frozen weights on the host: weight(), fetch and release misused are refused and "
          "change nothing") {
  MemorySpace space(0, make_host_allocator());
  InProcessGroup group(1);
  auto e = built(space, group, config_of(Placement::host), {"embed", "head"});
  const auto before = e->training_state(true);
  // Not fetched: the error names the group and the call that brings it in.
  REQUIRE_THROWS_AS(e->weight("layers.0.fc1"), StateError);
  {
    const std::string m = test::message_of<Error>([&] { e->weight("layers.0.fc1"); });
    REQUIRE(test::contains(m, "group 'layers.0' is frozen"));
    REQUIRE(test::contains(m, "fetch_weights('layers.0')"));
  }
  // Active groups and read_weight need no fetch.
  REQUIRE(read(*e, "embed.weight") == e->read_weight("embed.weight"));
  REQUIRE(e->read_weight("layers.2.fc2").size() == 37 * 16);
  e->fetch_weights("embed");  // a no-op for an active group
  e->release_weights("embed");
  {
    const std::string m = test::message_of<Error>([&] { e->release_weights("layers.0"); });
    REQUIRE(test::contains(m, "'layers.0' is not fetched"));
  }
  {
    const std::string m = test::message_of<Error>([&] { e->fetch_weights("layers.9"); });
    REQUIRE(test::contains(m, "layers.9"));
  }
  e->fetch_weights("layers.0");
  REQUIRE(read(*e, "layers.0.fc1") == e->read_weight("layers.0.fc1"));
  {
    const std::string m = test::message_of<Error>([&] { e->fetch_weights("layers.0"); });
    REQUIRE(test::contains(m, "already fetched"));
  }
  e->fetch_weights("layers.3");
  {
    const std::string m = test::message_of<Error>([&] { e->fetch_weights("layers.1"); });
    REQUIRE(test::contains(m, "both weight windows are in use"));
    REQUIRE(test::contains(m, "'layers.0'"));
    REQUIRE(test::contains(m, "'layers.3'"));
  }
  // Lifecycle calls that would rewrite a fetched group's home are refused, nothing changed.
  {
    const std::string m = test::message_of<Error>([&] { e->activate("layers.0"); });
    REQUIRE(test::contains(m, "release_weights first"));
  }
  REQUIRE_FALSE(e->is_active("layers.0"));
  REQUIRE(test::contains(
      test::message_of<StateError>([&] { e->reform({{"layers.1.norm", "layers.2"}}); }),
      "release_weights first"));
  {
    const std::string m = test::message_of<Error>([&] { e->restore_training_state(before); });
    REQUIRE(test::contains(m, "release_weights first"));
  }
  require_plan_held(*e, "after the refusals");
  // A released window's Views are stale.
  const View held = e->weight("layers.3.fc2");
  e->release_weights("layers.3");
  REQUIRE_THROWS_AS(held.raw(), StaleView);
  e->release_weights("layers.0");
  REQUIRE(e->training_state(true).weights == before.weights);
  // Fetched again right after, the window still holds them.
  e->fetch_weights("layers.3");
  REQUIRE(read(*e, "layers.3.fc2") == e->read_weight("layers.3.fc2"));
  e->release_weights("layers.3");
}

TEST_CASE("frozen weights on the host: a re-form moves homes on the host, and a state saved under "
          "one placement restores under the other to the bit") {
  // Train with the weights on the device, save; restore into an engine with them on the host
  // (another active set), train both on: the same bits.
  MemorySpace space_d(0, make_host_allocator()), space_h(0, make_host_allocator());
  InProcessGroup group_d(1), group_h(1);
  auto d = built(space_d, group_d, config_of(Placement::device), {"head", "layers.1"});
  for (int micro = 0; micro < 2; ++micro) micro_batch(*d, 0, micro);
  REQUIRE(d->step().applied);
  const TrainingState saved = d->training_state(true);
  auto h = built(space_h, group_h, config_of(Placement::host), {"embed", "layers.3"});
  h->restore_training_state(saved);
  require_plan_held(*h, "after the restore");
  for (int step = 1; step < 4; ++step)
    for (Engine* e : {d.get(), h.get()}) {
      for (int micro = 0; micro < 2; ++micro) micro_batch(*e, step, micro);
      REQUIRE(e->step().applied);
    }
  REQUIRE(d->training_state(true).weights == h->training_state(true).weights);
  REQUIRE(d->training_state(true).groups[5].master == h->training_state(true).groups[5].master);
  // A re-form of frozen groups with their weights on the host keeps every weight.
  const auto weights = h->training_state(true).weights;
  h->reform({{"layers.0.norm", "norms"}, {"layers.2.norm", "norms"}});
  require_plan_held(*h, "after the re-form");
  REQUIRE(h->read_weight("layers.0.norm") == d->read_weight("layers.0.norm"));
  REQUIRE(h->training_state(true).weights == weights);
  // The moved norms are read through their new group's window.
  h->fetch_weights("norms");
  REQUIRE(read(*h, "layers.2.norm") == d->read_weight("layers.2.norm"));
  h->release_weights("norms");
  // A group larger than the windows (the largest group at build) is refused, nothing changed.
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { h->reform({{"layers.0.fc1", "layers.2"}}); }),
      "above the frozen weight windows'"));
  REQUIRE(h->training_state(true).weights == weights);
  require_plan_held(*h, "after the refused re-form");
}
