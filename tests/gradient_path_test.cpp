// The gradient path against the lifecycle: a lifecycle call made while a group's gradients are
// pending (an open bucket, a reduce issued and not settled, stage-1 accumulation, or reduced and
// waiting for step()) is refused naming the group and what is pending, changes nothing, and the
// step that follows applies every gradient -- at stages 1 and 2, with and without overlap, at
// 1 and 2 ranks, under every policy. Each sequence here once crashed (a deferred reduce writing
// into a freed gradient partition) or silently dropped the gradients.
#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/forwarding_allocator.h"
#include "tests/support/small_models.h"

using namespace shardswap;
using test_support::declare_small_lisa_model;
using test_support::small_lisa_config;

namespace {

void init(const ParamInfo& p, std::span<float> v) {
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = 0.5f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(p.numel % 7));
}

// A gradient that differs by param, element and rank: never zero as a whole.
void write_grad(Engine& e, const std::string& name, int rank) {
  const View slot = e.grad_slot(name);
  std::vector<bf16_t> g(slot.count());
  for (std::size_t i = 0; i < g.size(); ++i)
    g[i] = bf16_t(0.02f * static_cast<float>((static_cast<int>(i) * 7 + 5 * rank +
                                              static_cast<int>(name.size())) % 11 - 5));
  e.memory().write<bf16_t>(slot, g);
  e.grad_ready(name);
}

struct Setup {
  int world = 1;
  int stage = 2;
  bool overlap = true;
};

std::string describe(const Setup& s) {
  return fmt::format("world {}, stage {}, overlap {}", s.world, s.stage, s.overlap);
}

// What the trainer tries between the gradients and the step; it must be refused.
using Attempt = std::function<void(Engine&, const TrainingState& before)>;

struct Outcome {
  std::vector<std::vector<float>> weights;  // rank 0's, after the step
  std::string refusal;                      // rank 0's error message; empty if none was thrown
};

// Builds the small LISA model with head, layers.0 and layers.1 active, hands over gradients for
// layers.1 (A) and then takes a slot of layers.0 (B), which in stage 2 flushes A's bucket: A's
// reduce is issued (deferred under overlap) while B's bucket is open. Then `attempt`, if given,
// and the step. Stats are checked against the plan around the attempt.
Outcome run(const Setup& s, const Attempt& attempt) {
  Outcome out;
  std::mutex mu;
  run_ranks(s.world, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    EngineConfig cfg = small_lisa_config(s.stage);
    cfg.overlap_comm = s.overlap;
    Engine e(cfg, comm, space);
    declare_small_lisa_model(e);
    e.build(init, std::vector<std::string>{"head", "layers.0", "layers.1"});
    const TrainingState before = e.training_state(true);
    write_grad(e, "layers.1.fc2", rank);
    write_grad(e, "layers.1.fc1", rank);
    write_grad(e, "layers.0.fc2", rank);  // stage 2: A's bucket is reduced here
    std::string refusal;
    const auto requested = space.stats().requested.current;
    const auto active = e.active_groups();
    if (attempt) {
      try {
        attempt(e, before);
      } catch (const StateError& err) {
        refusal = err.what();
      }
    }
    const auto requested_after = space.stats().requested.current;
    const auto active_after = e.active_groups();
    // Refused or not, the step runs before anything is checked: a call that freed A's partition
    // under a deferred reduce makes this step write into freed memory (AddressSanitizer says so).
    write_grad(e, "head.weight", rank);
    const bool applied = e.step().applied;
    RANK_REQUIRE(requested_after == requested);  // the refused call changed nothing
    RANK_REQUIRE(active_after == active);
    RANK_REQUIRE(applied);
    RANK_REQUIRE(space.stats().requested.current == e.plan().total());
    if (rank == 0) {
      std::lock_guard lock(mu);
      out.refusal = refusal;
      for (const auto& p : e.params()) out.weights.push_back(e.read_weight(p.name));
    }
  });
  return out;
}

std::vector<Setup> every_setup() {
  std::vector<Setup> all;
  for (int world : {1, 2}) {
    all.push_back({world, 2, true});  // the deferred reduce first: where freed memory was written
    all.push_back({world, 2, false});
    all.push_back({world, 1, true});
  }
  return all;
}

// The attempt is refused naming layers.1 and "pending", and the step that follows gives
// exactly the weights of the run that never tried it: no gradient was lost.
void require_refused_and_applied(const std::string& what, const Attempt& attempt) {
  for (const Setup& s : every_setup()) {
    CAPTURE(what, describe(s));
    const Outcome plain = run(s, nullptr);
    const Outcome tried = run(s, attempt);
    CAPTURE(tried.refusal);
    REQUIRE(test::contains(tried.refusal, "group 'layers.1' has gradients pending"));
    REQUIRE(test::contains(tried.refusal, "nothing was changed"));
    REQUIRE(tried.weights == plain.weights);
  }
}

}  // namespace

TEST_CASE("deactivate with gradients pending is refused under every policy and applied later") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    require_refused_and_applied(
        fmt::format("deactivate({})", deactivate_policy_name(policy)),
        [policy](Engine& e, const TrainingState&) { e.deactivate("layers.1", policy); });
}

TEST_CASE("set_active dropping a group with gradients pending is refused under every policy") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    require_refused_and_applied(
        fmt::format("set_active({})", deactivate_policy_name(policy)),
        [policy](Engine& e, const TrainingState&) {
          e.set_active({"head", "layers.0", "layers.2"}, policy);
        });
}

TEST_CASE("reform and restore_training_state with gradients pending are refused") {
  require_refused_and_applied("reform", [](Engine& e, const TrainingState&) {
    e.reform({{"layers.3.norm", "layers.3.norms"}});  // a frozen group; every group is rebuilt
  });
  require_refused_and_applied("restore_training_state", [](Engine& e, const TrainingState& t) {
    e.restore_training_state(t);
  });
}

TEST_CASE("the refusal says where the gradients are: bucket, reduce in flight, accumulated") {
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    for (int stage : {1, 2}) {
      Engine e(small_lisa_config(stage), comm, space);
      declare_small_lisa_model(e);
      e.build(init, std::vector<std::string>{"head", "layers.0", "layers.1"});
      const auto refusal = [&](const std::string& group) {
        return test::rank_message_of<StateError>(
            [&] { e.deactivate(group, DeactivatePolicy::keep_device); });
      };
      (void)e.grad_slot("layers.1.fc2");  // handed out, not ready
      RANK_REQUIRE(test::contains(refusal("layers.1"), stage == 1
                                                           ? "without grad_ready: 'layers.1.fc2'"
                                                           : "open reduce bucket: 'layers.1.fc2'"));
      e.grad_ready("layers.1.fc2");
      write_grad(e, "layers.0.fc2", rank);
      if (stage == 2) {
        RANK_REQUIRE(test::contains(refusal("layers.1"), "in a reduce issued and not yet settled"));
        RANK_REQUIRE(test::contains(refusal("layers.0"), "open reduce bucket: 'layers.0.fc2'"));
      } else {
        RANK_REQUIRE(test::contains(refusal("layers.1"), "accumulated since the last step"));
      }
      e.finish_backward();
      RANK_REQUIRE(test::contains(refusal("layers.1"), stage == 1
                                                           ? "accumulated since the last step"
                                                           : "reduced, not yet applied by step()"));
      // A group without gradients can go meanwhile; the pending ones stay.
      e.deactivate("head", DeactivatePolicy::drop);
      RANK_REQUIRE(e.step().applied);
      e.deactivate("layers.1", DeactivatePolicy::keep_device);  // cleared by the step
      write_grad(e, "layers.0.fc1", rank);
      e.zero_grad();
      e.deactivate("layers.0", DeactivatePolicy::drop);  // cleared by zero_grad
      RANK_REQUIRE(e.active_groups().empty());
      RANK_REQUIRE(space.stats().requested.current == e.plan().total());
    }
  });
}

TEST_CASE("stage 1 keeps accumulated gradients through a refused deactivate into the step") {
  // Before, this deactivate succeeded and the gradients were gone: after keep_device, activate
  // and step, the grad norm was 0.
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(1), comm, space);
    declare_small_lisa_model(e);
    e.build(init, std::vector<std::string>{"layers.1"});
    write_grad(e, "layers.1.fc1", rank);
    RANK_REQUIRE(test::contains(test::rank_message_of<StateError>([&] {
                                  e.deactivate("layers.1", DeactivatePolicy::keep_device);
                                }),
                                "accumulated since the last step"));
    RANK_REQUIRE(e.step().grad_norm > 0.0);
  });
}

TEST_CASE("add_grad adds host floats into the slot's type, as grad_slot plus a write would") {
  for (int stage : {1, 2})
    run_ranks(1, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      const auto train = [&](bool through_add_grad) {
        Engine e(small_lisa_config(stage), comm, space);
        declare_small_lisa_model(e);
        e.build(init, std::vector<std::string>{"layers.0"});
        for (const char* name : {"layers.0.fc2", "layers.0.fc1", "layers.0.norm"}) {
          std::vector<float> g;
          for (const auto& p : e.params())
            if (p.name == name) g.resize(static_cast<std::size_t>(p.numel));
          for (std::size_t i = 0; i < g.size(); ++i)
            g[i] = 0.01f * static_cast<float>(static_cast<int>(i % 17) - 8);
          for (int micro = 0; micro < 2; ++micro) {  // repeated calls add up
            if (through_add_grad) {
              e.add_grad(name, g);
            } else {
              const View slot = e.grad_slot(name);
              std::vector<bf16_t> values = e.memory().read<bf16_t>(slot);
              for (std::size_t i = 0; i < values.size(); ++i)
                values[i] = bf16_t(static_cast<float>(values[i]) + g[i]);
              e.memory().write<bf16_t>(slot, values);
              e.grad_ready(name);
            }
          }
        }
        const double norm = e.step().grad_norm;
        std::vector<std::vector<float>> weights;
        for (const auto& p : e.params()) weights.push_back(e.read_weight(p.name));
        return std::make_pair(norm, weights);
      };
      const auto by_slot = train(false);
      const auto by_add = train(true);
      RANK_REQUIRE(by_slot.first > 0.0);
      RANK_REQUIRE(by_add.first == by_slot.first);
      RANK_REQUIRE(by_add.second == by_slot.second);
    });
}

TEST_CASE("add_grad refuses a wrong count, fp64 and a frozen group, naming the param") {
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(init, std::vector<std::string>{"layers.0"});
    const std::vector<float> three(3, 1.0f);
    RANK_REQUIRE(test::contains(
        test::rank_message_of<ConfigError>([&] { e.add_grad("layers.0.norm", three); }),
        "'layers.0.norm' has 16 elements, 3 values given"));
    const std::vector<double> wide(16, 1.0);
    RANK_REQUIRE(test::contains(test::rank_message_of<ConfigError>([&] {
                                  e.add_grad("layers.0.norm", wide.data(), DType::f64, 16);
                                }),
                                "'layers.0.norm': fp64"));
    const std::vector<float> norm(16, 1.0f);
    RANK_REQUIRE(test::contains(
        test::rank_message_of<StateError>([&] { e.add_grad("layers.1.norm", norm); }),
        "frozen group 'layers.1'"));
    RANK_REQUIRE(test::contains(
        test::rank_message_of<ConfigError>([&] { e.add_grad("layers.0.nope", norm); }),
        "no param named 'layers.0.nope'"));
    // Nothing was handed over by the refused calls: the group can go.
    e.deactivate("layers.0", DeactivatePolicy::drop);
  });
}

namespace {

// Host memory that says it is CUDA memory: what a CUDA MemorySpace looks like to the Engine.
class DeviceLabelledAllocator final : public test_support::ForwardingAllocator {
 public:
  DeviceLabelledAllocator() : ForwardingAllocator(make_host_allocator()) {}
  DeviceKind device() const override { return DeviceKind::cuda; }
  std::unique_ptr<Allocator> host_staging() const override { return make_host_allocator(); }
};

}  // namespace

TEST_CASE("an Engine refuses a memory space of other memory than its backend, naming both") {
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, std::make_unique<DeviceLabelledAllocator>());
    const auto msg = test::rank_message_of<ConfigError>(
        [&] { Engine e(small_lisa_config(2), comm, space, cpu_backend()); });
    RANK_REQUIRE(test::contains(msg, "backend 'cpu' runs on host memory"));
    RANK_REQUIRE(test::contains(msg, "MemorySpace (rank 0) allocates CUDA device memory"));
  });
}
