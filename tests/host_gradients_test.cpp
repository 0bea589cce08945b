// Gradients in host memory (EngineConfig::gradient_placement = host): the device's bits through
// accumulation, switches and clipping whatever order the slots come in, windows that move under
// a slot held open, the plan's bytes on both sides held, misuse refused, and the JSON key.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "optimizer/optimizer.h"
#include "shardswap/backend.h"
#include "shardswap/config_json.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine.h"
#include "shardswap/batch_sizes.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/plan_held.h"
#include "tests/support/small_models.h"

using namespace shardswap;
using test_support::require_plan_held;
using test_support::sine_init;

namespace {

struct Placements {
  Placement state = Placement::device, grads = Placement::device;
  OffloadUpdate way = OffloadUpdate::streamed;
};

// Windows of 800 elements (bf16 grads: the largest param), so a layer group (1,200 elements and
// alignment) needs two and they move within a group; chunks of 97 elements end inside params.
EngineConfig config_of(const Placements& p, DType grad_dtype = DType::bf16) {
  EngineConfig cfg = test_support::small_lisa_config(2);
  cfg.optimizer_placement = p.state;
  cfg.gradient_placement = p.grads;
  cfg.offload_update = p.way;
  cfg.grad_dtype = grad_dtype;
  cfg.reduce_bucket_bytes = 256;  // the smallest allowed: grown to the largest param
  cfg.offload_chunk_elements = 97;
  cfg.gradient_accumulation_steps = 3;
  cfg.gradient_clipping = 1e-3;  // below every step's norm: the norm decides every update
  return cfg;
}

// One micro-batch's gradient of param `k`, part `part` (a param written twice in a micro-batch
// gets two), on random-looking data.
std::vector<float> grad_of(const ParamInfo& p, std::size_t k, int step, int micro, int part) {
  std::vector<float> g(static_cast<std::size_t>(p.numel));
  for (std::size_t i = 0; i < g.size(); ++i)
    g[i] = 0.02f * std::sin(0.173f * static_cast<float>(i) + 1.3f * static_cast<float>(k) +
                            0.7f * static_cast<float>(step) + 2.1f * static_cast<float>(micro) +
                            0.5f * static_cast<float>(part));
  return g;
}

void accumulate(const View& slot, const std::vector<float>& g) {
  cpu_device_ops().accumulate(slot.raw(), slot.dtype(), g.data(), DType::f32, g.size());
}

// The slots of one micro-batch in the order the schedule gives: descending (backward), ascending,
// or interleaved from both ends; the head written twice (as the decoder's head is, a chunk of
// rows at a time); with `tied`, the embedding's slot opened first and held to the end.
void backward(Engine& e, int step, int micro, bool tied) {
  const auto& params = e.params();
  std::vector<std::size_t> order;
  for (std::size_t k = 0; k < params.size(); ++k)
    if (e.is_active(params[k].group)) order.push_back(k);
  const int kind = (step + micro) % 3;
  if (kind == 0) std::reverse(order.begin(), order.end());
  if (kind == 2) {
    std::vector<std::size_t> mixed;
    for (std::size_t a = 0, b = order.size(); a < b;) {
      mixed.push_back(order[--b]);
      if (a < b) mixed.push_back(order[a++]);
    }
    order = mixed;
  }
  std::size_t embed = params.size();
  View held;
  if (tied && e.is_active("embed")) {
    for (std::size_t k = 0; k < params.size(); ++k)
      if (params[k].name == "embed.weight") embed = k;
    held = e.grad_slot("embed.weight");
    accumulate(held, grad_of(params[embed], embed, step, micro, 0));
  }
  for (std::size_t k : order) {
    if (k == embed) continue;
    const View slot = e.grad_slot(params[k].name);
    accumulate(slot, grad_of(params[k], k, step, micro, 0));
    if (params[k].name == "head.weight") accumulate(slot, grad_of(params[k], k, step, micro, 1));
    e.grad_ready(params[k].name);
  }
  if (embed < params.size()) {
    accumulate(held, grad_of(params[embed], embed, step, micro, 1));
    e.grad_ready("embed.weight");
  }
}

struct RunResult {
  TrainingState state;
  std::vector<double> norms;
};

// 12 steps of 3 micro-batches of the small LISA model on one rank, switching layers every 4
// steps under `policy`, a zero_grad() part-way through step 6's accumulation.
RunResult run(const Placements& p, DeactivatePolicy policy, bool tied,
              DType grad_dtype = DType::bf16) {
  MemorySpace space(0, make_host_allocator());
  InProcessGroup group(1);
  Engine e(config_of(p, grad_dtype), group.rank(0), space);
  test_support::declare_small_lisa_model(e);
  e.build(sine_init, std::vector<std::string>{"embed", "head", "layers.1"});
  require_plan_held(e, "after build");
  RunResult out;
  for (int step = 0; step < 12; ++step) {
    if (step % 4 == 3) {
      e.set_active({"embed", "head", fmt::format("layers.{}", step / 4)}, policy);
      require_plan_held(e, fmt::format("after the switch before step {}", step + 1));
    }
    if (step == 5) {  // a dropped accumulation: nothing of it may reach the step
      backward(e, 99, 0, tied);
      e.zero_grad();
    }
    for (int micro = 0; micro < 3; ++micro) backward(e, step, micro, tied);
    const StepResult r = e.step();
    REQUIRE(r.applied);
    out.norms.push_back(r.grad_norm);
    require_plan_held(e, fmt::format("after step {}", step + 1));
  }
  e.set_active(e.groups(), policy);
  out.state = e.training_state(true);
  return out;
}

void require_same_bits(const RunResult& a, const RunResult& b) {
  REQUIRE(a.norms.size() == b.norms.size());
  for (std::size_t i = 0; i < a.norms.size(); ++i) {
    CAPTURE(i);
    REQUIRE(std::bit_cast<std::uint64_t>(a.norms[i]) == std::bit_cast<std::uint64_t>(b.norms[i]));
  }
  REQUIRE(a.state.groups.size() == b.state.groups.size());
  for (std::size_t i = 0; i < a.state.groups.size(); ++i) {
    CAPTURE(a.state.groups[i].group);
    REQUIRE(a.state.groups[i].step == b.state.groups[i].step);
    REQUIRE(a.state.groups[i].master == b.state.groups[i].master);
    REQUIRE(a.state.groups[i].state == b.state.groups[i].state);
  }
  REQUIRE(a.state.weights == b.state.weights);
}

EngineConfig host_grads_at() { return config_of({Placement::host, Placement::host}); }

}  // namespace

TEST_CASE("gradients on the host give the device's bits through accumulation, switches and "
          "clipping, in any slot order") {
  for (DType grad_dtype : {DType::bf16, DType::f32})
    for (DeactivatePolicy policy : {DeactivatePolicy::drop, DeactivatePolicy::keep_host})
      for (bool tied : {false, true}) {
        CAPTURE(dtype_name(grad_dtype), deactivate_policy_name(policy), tied);
        const RunResult device = run({}, policy, tied, grad_dtype);
        // The clip coefficient is below 1 at every step: the norm's bits steer the update.
        for (double n : device.norms) REQUIRE(n > 1e-3);
        const RunResult state_on_host =
            run({Placement::host, Placement::device}, policy, tied, grad_dtype);
        require_same_bits(device, state_on_host);
        for (OffloadUpdate way : {OffloadUpdate::streamed, OffloadUpdate::cpu}) {
          CAPTURE(offload_update_name(way));
          require_same_bits(device,
                            run({Placement::host, Placement::host, way}, policy, tied, grad_dtype));
        }
      }
}

TEST_CASE("gradients on the host: the plan puts the group buffers on the host and two windows and "
          "two gradient slots on the device") {
  MemorySpace space(0, make_host_allocator());
  InProcessGroup group(1);
  const EngineConfig cfg = host_grads_at();
  Engine e(cfg, group.rank(0), space);
  test_support::declare_small_lisa_model(e);
  e.build(sine_init, std::vector<std::string>{"embed", "head", "layers.1"});
  const MemoryPlan plan = e.plan();
  // The three active groups' bf16 gradients, whole, on the host.
  std::int64_t active = 0;
  for (const auto& g : {"embed", "head", "layers.1"}) {
    std::int64_t end = 0;
    for (const auto& p : e.params())
      if (p.group == g) end += p.numel;
    active += end;
  }
  REQUIRE(plan.host_of(Tag::grad) >= active * 2);
  REQUIRE(plan.host_of(Tag::grad) < (active + 3 * 256) * 2);  // alignment at most
  // The device: two windows of the largest param (800 bf16 elements), two slots of 97.
  REQUIRE(plan.of(Tag::grad) == 2 * 800 * 2 + 2 * 97 * 2);
  require_plan_held(e, "after build");
  backward(e, 0, 0, false);
  require_plan_held(e, "after a backward");
  e.step();
  require_plan_held(e, "after a step");
  // Deactivating a group gives its host buffer back.
  const std::int64_t before = e.host_memory_stats().tag(Tag::grad).requested.current;
  e.deactivate("layers.1", DeactivatePolicy::drop);
  REQUIRE(e.host_memory_stats().tag(Tag::grad).requested.current < before);
  require_plan_held(e, "after a deactivate");
}

TEST_CASE("gradients on the host: a window does not move under a slot still open, and a slot "
          "whose window moved is stale") {
  MemorySpace space(0, make_host_allocator());
  InProcessGroup group(1);
  Engine e(host_grads_at(), group.rank(0), space);
  test_support::declare_small_lisa_model(e);
  e.build(sine_init);
  // Two slots held open in two windows: a third elsewhere has no window to take.
  const View embed = e.grad_slot("embed.weight");
  const View head = e.grad_slot("head.weight");
  const std::string msg = test::message_of<Error>([&] { e.grad_slot("layers.2.fc1"); });
  REQUIRE(msg.find("grad_ready never called") != std::string::npos);
  REQUIRE(msg.find("'embed.weight'") != std::string::npos);
  // Nothing moved: both slots still work and the backward goes on.
  accumulate(embed, std::vector<float>(800, 0.25f));
  e.grad_ready("embed.weight");
  accumulate(head, std::vector<float>(800, 0.5f));
  e.grad_ready("head.weight");
  // The embedding's window is the one free to move; the head's slot (ready) stays valid until
  // its own window moves too.
  const View fc1 = e.grad_slot("layers.2.fc1");
  e.grad_ready("layers.2.fc1");
  const std::string stale = test::message_of<StaleView>([&] { (void)embed.raw(); });
  REQUIRE(stale.find("written back to the host") != std::string::npos);
  (void)fc1;
  // A step with a slot out is refused naming it, and zero_grad() recovers.
  const View open = e.grad_slot("layers.0.norm");
  const std::string unready = test::message_of<Error>([&] { e.step(); });
  REQUIRE(unready.find("'layers.0.norm'") != std::string::npos);
  e.zero_grad();
  REQUIRE_THROWS_AS((void)open.raw(), StaleView);
  backward(e, 0, 0, false);
  REQUIRE(e.step().applied);
}

TEST_CASE("shardswap.gradient_placement reads device or host, needs the state on the host and one "
          "rank") {
  const auto read = [](const nlohmann::json& shardswap, bool offload) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                        {"bf16", {{"enabled", true}}},
                        {"zero_optimization", {{"stage", 2}}},
                        {"shardswap", shardswap}};
    if (offload) j["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
    ConfigReader reader(j, "test.json");
    return engine_config_from_json(reader, BatchSizes{});
  };
  REQUIRE(read({{"gradient_placement", "host"}}, true).gradient_placement == Placement::host);
  REQUIRE(read({{"gradient_placement", "device"}}, true).gradient_placement == Placement::device);
  REQUIRE(read(nlohmann::json::object(), false).gradient_placement == Placement::device);
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { read({{"gradient_placement", "cpu"}}, true); }),
      "test.json: shardswap.gradient_placement = \"cpu\": expected \"device\" or \"host\""));
  const std::string alone =
      test::message_of<ConfigError>([&] { read({{"gradient_placement", "host"}}, false); });
  REQUIRE(test::contains(alone, "shardswap.gradient_placement = \"host\""));
  REQUIRE(test::contains(alone, "zero_optimization.offload_optimizer.device = \"cpu\""));
  // Two ranks: refused by the plan and by build, with nothing left allocated.
  const EngineConfig cfg = host_grads_at();
  const std::vector<ParamDeclaration> params{{"w", {64}, "g"}};
  const std::string plan = test::message_of<ConfigError>([&] { plan_memory(cfg, 2, 0, params); });
  REQUIRE(test::contains(plan, "shardswap.gradient_placement = \"host\": world size 2"));
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(cfg, comm, space);
    e.add_param("w", {64}, "g");
    const std::string built = test::rank_message_of<ConfigError>([&] { e.build(sine_init); });
    RANK_REQUIRE(test::contains(built, "shardswap.gradient_placement"));
    RANK_REQUIRE(space.stats().tag(Tag::param16).requested.current == 0);
  });
}

TEST_CASE("gradients on the host: a training state restored into an engine that keeps them there "
          "goes on with the device's bits") {
  // Six steps with everything on the device, then six more in an engine with the state and the
  // gradients on the host (built with one group active, the restore activating the rest), against
  // twelve on the device.
  const auto steps = [](Engine& e, int from, int to) {
    for (int step = from; step < to; ++step) {
      for (int micro = 0; micro < 3; ++micro) backward(e, step, micro, false);
      REQUIRE(e.step().applied);
    }
  };
  InProcessGroup group(1);
  TrainingState straight, half;
  {
    MemorySpace space(0, make_host_allocator());
    Engine e(config_of({}), group.rank(0), space);
    test_support::declare_small_lisa_model(e);
    e.build(sine_init);
    steps(e, 0, 6);
    half = e.training_state(true);
    steps(e, 6, 12);
    straight = e.training_state(true);
  }
  MemorySpace space(0, make_host_allocator());
  Engine e(host_grads_at(), group.rank(0), space);
  test_support::declare_small_lisa_model(e);
  e.build(sine_init, std::vector<std::string>{"embed"});
  e.restore_training_state(half);
  require_plan_held(e, "after the restore");
  steps(e, 6, 12);
  require_plan_held(e, "after six more steps");
  const TrainingState moved = e.training_state(true);
  REQUIRE(moved.groups.size() == straight.groups.size());
  for (std::size_t i = 0; i < moved.groups.size(); ++i) {
    CAPTURE(moved.groups[i].group);
    REQUIRE(moved.groups[i].step == straight.groups[i].step);
    REQUIRE(moved.groups[i].master == straight.groups[i].master);
    REQUIRE(moved.groups[i].state == straight.groups[i].state);
  }
  REQUIRE(moved.weights == straight.weights);
}
