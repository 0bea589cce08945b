// The fp32 master and optimizer state in host memory (EngineConfig::optimizer_placement = host):
// the float64 reference under every policy and stage, the same bits as the state on the device
// through switches and checkpoints, host bytes planned = measured, and the JSON keys.
#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/backend.h"
#include "shardswap/config_json.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/reference_check.h"
#include "tests/support/plan_held.h"
#include "tests/support/small_models.h"

using namespace shardswap;
using test_support::require_plan_held;
using test_support::add_cosine_grads;
using test_support::Case;
using test_support::sine_init;

namespace {

constexpr OffloadUpdate kWays[] = {OffloadUpdate::streamed, OffloadUpdate::cpu};

EngineConfig config_at(Placement placement, int stage,
                       OffloadUpdate way = OffloadUpdate::streamed,
                       DType state_dtype = DType::f32,
                       MasterStorage master = MasterStorage::fp32) {
  EngineConfig cfg = test_support::small_lisa_config(stage);
  cfg.optimizer_placement = placement;
  cfg.offload_update = way;
  cfg.optimizer.state_dtype = state_dtype;
  cfg.optimizer.master = master;
  cfg.offload_chunk_elements = 97;  // chunks end inside params and decay spans
  return cfg;
}

// A LISA-like run on two ranks: switches under `policy` every 3 steps, a per-param weight decay
// (several decay spans per shard), 20 steps. Returns rank 0's training state with weights.
TrainingState lisa_run(Placement placement, int stage, DeactivatePolicy policy,
                       OffloadUpdate way = OffloadUpdate::streamed,
                       DType state_dtype = DType::f32,
                       MasterStorage master = MasterStorage::fp32) {
  TrainingState out;
  std::mutex mu;
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_at(placement, stage, way, state_dtype, master), comm, space);
    test_support::declare_small_lisa_model(e);
    e.set_param_weight_decay("layers.1.norm", 0.0);
    e.set_param_weight_decay("head.weight", 0.3);
    e.build(sine_init, std::vector<std::string>{"embed", "head", "layers.1"});
    require_plan_held(e, "after build");
    for (int step = 0; step < 20; ++step) {
      if (step % 3 == 2) {
        const std::string in = fmt::format("layers.{}", (step / 3) % 4);
        e.set_active({"embed", "head", in}, policy);
        require_plan_held(e, fmt::format("after the switch before step {}", step + 1));
      }
      add_cosine_grads(e, rank, step);
      RANK_REQUIRE(e.step().applied);
      require_plan_held(e, fmt::format("after step {}", step + 1));
    }
    e.set_active(e.groups(), policy);  // every master readable
    TrainingState s = e.training_state(true);
    std::lock_guard lock(mu);
    if (rank == 0) out = std::move(s);
  });
  return out;
}

// The small LISA model's params, as plan_memory takes them (declared on a probe engine).
std::vector<ParamDeclaration> small_lisa_declarations(int rank, Communicator& comm) {
  MemorySpace space(rank, make_host_allocator());
  Engine probe(config_at(Placement::device, 2), comm, space);
  test_support::declare_small_lisa_model(probe);
  std::vector<ParamDeclaration> out;
  for (const auto& p : probe.params()) out.push_back({p.name, p.shape, p.group});
  return out;
}

// Ten steps of the small LISA model on two ranks under `first` (layers.3 kept on the host from
// step 5), the training state handed to an engine under `second` (which must hold its plan and
// give back the same masters), ten more steps there (layers.3 active again from step 15).
// Returns rank 0's final training state with weights.
TrainingState moved_run(const EngineConfig& first, const EngineConfig& second) {
  TrainingState out;
  std::mutex mu;
  run_ranks(2, [&](int rank, Communicator& comm) {
    TrainingState half;
    {
      MemorySpace space(rank, make_host_allocator());
      Engine e(first, comm, space);
      test_support::declare_small_lisa_model(e);
      e.build(sine_init);
      for (int step = 0; step < 10; ++step) {
        if (step == 5) e.deactivate("layers.3", DeactivatePolicy::keep_host);
        add_cosine_grads(e, rank, step);
        e.step();
      }
      half = e.training_state(true);
    }
    MemorySpace space(rank, make_host_allocator());
    Engine e(second, comm, space);
    test_support::declare_small_lisa_model(e);
    e.build(sine_init, std::vector<std::string>{"embed"});
    e.restore_training_state(half);
    require_plan_held(e, "after the restore");
    const TrainingState back = e.training_state(true);  // restored: the state's masters exactly
    for (std::size_t i = 0; i < half.groups.size(); ++i)
      RANK_REQUIRE(back.groups[i].master == half.groups[i].master);
    for (int step = 10; step < 20; ++step) {
      if (step == 15) e.activate("layers.3");
      add_cosine_grads(e, rank, step);
      e.step();
    }
    TrainingState s = e.training_state(true);
    std::lock_guard lock(mu);
    if (rank == 0) out = std::move(s);
  });
  return out;
}

void require_same_bits(const TrainingState& a, const TrainingState& b) {
  REQUIRE(a.groups.size() == b.groups.size());
  for (std::size_t i = 0; i < a.groups.size(); ++i) {
    CAPTURE(a.groups[i].group);
    REQUIRE(a.groups[i].step == b.groups[i].step);
    REQUIRE(a.groups[i].master == b.groups[i].master);  // float ==: the same values, no NaN here
    REQUIRE(a.groups[i].state == b.groups[i].state);
  }
  REQUIRE(a.weights == b.weights);
}

}  // namespace

TEST_CASE("state on the host matches the float64 reference under every policy and stage") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    for (int stage : {1, 2})
      for (DType dtype : {DType::bf16, DType::f16})
        for (OffloadUpdate way : kWays) {
          Case c{4, stage, dtype, OptimizerType::adamw};
          c.switches = test_support::switching_schedule();
          c.policy = policy;
          c.optimizer_placement = Placement::host;
          c.offload_update = way;
          CAPTURE(deactivate_policy_name(policy), stage, dtype_name(dtype),
                  offload_update_name(way));
          test_support::check_against_reference(c, cpu_backend());
        }
  for (OffloadUpdate way : kWays) {
    Case sgd{2, 2, DType::bf16, OptimizerType::sgd};
    sgd.optimizer_placement = Placement::host;
    sgd.offload_update = way;
    test_support::check_against_reference(sgd, cpu_backend());
  }
}

TEST_CASE("state on the host, streamed or updated on the CPU, has the device's bits through switches") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    for (int stage : {1, 2}) {
      CAPTURE(deactivate_policy_name(policy), stage);
      const TrainingState device = lisa_run(Placement::device, stage, policy);
      for (OffloadUpdate way : kWays) {
        CAPTURE(offload_update_name(way));
        require_same_bits(device, lisa_run(Placement::host, stage, policy, way));
      }
    }
}

TEST_CASE("the plan puts master, state and the staging buffers on the host, and they are held") {
  MemorySpace space(0, make_host_allocator());
  InProcessGroup group(1);
  EngineConfig cfg = config_at(Placement::host, 2, OffloadUpdate::cpu);
  Engine e(cfg, group.rank(0), space);
  test_support::declare_small_lisa_model(e);
  const MemoryPlan before = e.plan();
  EngineConfig on_device = cfg;
  on_device.optimizer_placement = Placement::device;
  std::vector<ParamDeclaration> declared;
  for (const auto& p : e.params()) declared.push_back({p.name, p.shape, p.group});
  const MemoryPlan device_plan = plan_memory(on_device, 1, 0, declared);
  // What leaves the device is exactly master32 and optim_state; the host adds one chunk each of
  // gradients (bf16) and weights (bf16): 97 elements, the configured chunk (< every shard).
  REQUIRE(before.of(Tag::master32) == 0);
  REQUIRE(before.of(Tag::optim_state) == 0);
  REQUIRE(before.host_of(Tag::master32) == device_plan.of(Tag::master32));
  REQUIRE(before.host_of(Tag::optim_state) == device_plan.of(Tag::optim_state));
  REQUIRE(before.host_of(Tag::grad) == 97 * 2);
  REQUIRE(before.host_of(Tag::param16) == 97 * 2);
  REQUIRE(before.total() + before.host_total() ==
          device_plan.total() + 2 * 97 * 2);
  REQUIRE(plan_memory(cfg, 1, 0, declared).host == before.host);  // the same code, no Engine
  e.build(sine_init);
  require_plan_held(e, "after build");
  REQUIRE(e.host_memory_stats().requested.peak == before.host_total());
  REQUIRE(test::contains(e.memory_report(), "offload gradient staging"));
  REQUIRE(test::contains(e.memory_report(), "group layers.0 master"));
  // Deactivation under each policy: keep_* leave the state in place (relabelled), drop frees it.
  e.deactivate("layers.0", DeactivatePolicy::keep_host);
  e.deactivate("layers.1", DeactivatePolicy::keep_device);
  e.deactivate("layers.2", DeactivatePolicy::drop);
  require_plan_held(e, "after deactivation");
  REQUIRE(test::contains(e.memory_report(), "group layers.0 master (kept on host)"));
  REQUIRE(test::contains(e.memory_report(), "group layers.1 state (kept on host)"));
  REQUIRE(!test::contains(e.memory_report(), "group layers.2 master"));
  REQUIRE(e.host_memory_stats().tag(Tag::master32).buffers == 5);  // 6 groups, one dropped
  e.activate("layers.0");
  e.activate("layers.2");
  require_plan_held(e, "after activation");
}

TEST_CASE("streamed, the host holds master and state and the device two chunk slots of each") {
  MemorySpace space(0, make_host_allocator());
  InProcessGroup group(1);
  const EngineConfig cfg = config_at(Placement::host, 1, OffloadUpdate::streamed);
  Engine e(cfg, group.rank(0), space);
  test_support::declare_small_lisa_model(e);
  EngineConfig on_device = cfg;
  on_device.optimizer_placement = Placement::device;
  std::vector<ParamDeclaration> declared;
  for (const auto& p : e.params()) declared.push_back({p.name, p.shape, p.group});
  const MemoryPlan device_plan = plan_memory(on_device, 1, 0, declared);
  const MemoryPlan plan = e.plan();
  REQUIRE(plan.of(Tag::master32) == 2 * 97 * 4);      // two slots of 97 elements
  REQUIRE(plan.of(Tag::optim_state) == 2 * 2 * 97 * 4);  // AdamW: two state slots each
  REQUIRE(plan.host_of(Tag::master32) == device_plan.of(Tag::master32));
  REQUIRE(plan.host_of(Tag::optim_state) == device_plan.of(Tag::optim_state));
  REQUIRE(plan.host_of(Tag::grad) == 0);
  REQUIRE(plan.host_of(Tag::param16) == 0);
  e.build(sine_init);
  require_plan_held(e, "after build");
  REQUIRE(test::contains(e.memory_report(), "offload master slots"));
  for (int step = 0; step < 3; ++step) {
    add_cosine_grads(e, 0, step);
    e.step();
    require_plan_held(e, fmt::format("after step {}", step + 1));
  }
}

TEST_CASE("a training state moves between the host and the device placements bit for bit, with "
          "fp32 and bf16 state") {
  // Ten steps in one placement, the state handed to an engine of the other, ten more there:
  // the same bits as twenty steps on the device, both ways, with a group kept on the host.
  for (DType state_dtype : {DType::f32, DType::bf16}) {
  CAPTURE(dtype_name(state_dtype));
  auto run = [&](Placement first, Placement second) {
    return moved_run(config_at(first, 2, OffloadUpdate::streamed, state_dtype),
                     config_at(second, 2, OffloadUpdate::streamed, state_dtype));
  };
  const TrainingState device = run(Placement::device, Placement::device);
  require_same_bits(device, run(Placement::host, Placement::device));
  require_same_bits(device, run(Placement::device, Placement::host));
  require_same_bits(device, run(Placement::host, Placement::host));
  }
}

TEST_CASE("offload_optimizer.device and pin_memory read as DeepSpeed writes them") {
  auto read = [](const nlohmann::json& offload) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                        {"bf16", {{"enabled", true}}},
                        {"zero_optimization", {{"stage", 2}, {"offload_optimizer", offload}}}};
    ConfigReader reader(j, "test.json");
    return engine_config_from_json(reader, BatchSizes{});
  };
  const EngineConfig cpu = read({{"device", "cpu"}, {"pin_memory", true}});
  REQUIRE(cpu.optimizer_placement == Placement::host);
  REQUIRE(cpu.pin_host_memory);
  // DeepSpeed's default for pin_memory is false.
  REQUIRE(!read({{"device", "cpu"}}).pin_host_memory);
  REQUIRE(read({{"device", "none"}}).optimizer_placement == Placement::device);
  REQUIRE(cpu.offload_update == OffloadUpdate::streamed);
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { read({{"device", "nvme"}}); }),
                         "test.json: zero_optimization.offload_optimizer.device = \"nvme\": an "
                         "NVMe-offload setting"));
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { read({{"device", "gpu"}}); }),
                         "zero_optimization.offload_optimizer.device = \"gpu\": expected "
                         "\"none\" or \"cpu\""));
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { read(42); }),
                         "zero_optimization.offload_optimizer"));
}

TEST_CASE("shardswap.offload_update picks the way, and a bad name is refused naming the key") {
  auto read = [](const nlohmann::json& way) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                        {"bf16", {{"enabled", true}}},
                        {"shardswap", {{"offload_update", way}, {"offload_threads", 3}}}};
    ConfigReader reader(j, "test.json");
    return engine_config_from_json(reader, BatchSizes{});
  };
  REQUIRE(read("cpu").offload_update == OffloadUpdate::cpu);
  REQUIRE(read("cpu").offload_threads == 3);
  REQUIRE(read("streamed").offload_update == OffloadUpdate::streamed);
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { read("gpu"); }),
                         "shardswap.offload_update = \"gpu\": expected streamed or cpu"));
}

// --- optimizer state in bf16 (shardswap.optimizer_state_dtype) -----------------------------

// bf16 params (the pairing bf16 state is for): with fp16 params and their loss scale, the double
// reference's rounding ties fall apart from the engine's too often for a norm check to tell the
// two states apart (the kernels' bits are held to a float reference in optimizer_test.cpp).
TEST_CASE("bf16 state matches the float64 reference that rounds m and v after every step") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    for (int stage : {1, 2})
      for (DType dtype : {DType::bf16})
        for (Placement placement : {Placement::device, Placement::host}) {
          Case c{4, stage, dtype, OptimizerType::adamw};
          c.switches = test_support::switching_schedule();
          c.policy = policy;
          c.optimizer_placement = placement;
          c.state_dtype = DType::bf16;
          CAPTURE(deactivate_policy_name(policy), stage, dtype_name(dtype),
                  placement_name(placement));
          test_support::check_against_reference(c, cpu_backend());
        }
  for (OptimizerType rule : {OptimizerType::adam, OptimizerType::sgd}) {
    Case c{2, 2, DType::bf16, rule};
    c.state_dtype = DType::bf16;
    CAPTURE(optimizer_type_name(rule));
    test_support::check_against_reference(c, cpu_backend());
  }
}

TEST_CASE("bf16 state has the same bits on the device and on the host, both ways, through "
          "switches, in half the state's bytes") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device}) {
    CAPTURE(deactivate_policy_name(policy));
    const TrainingState device =
        lisa_run(Placement::device, 2, policy, OffloadUpdate::streamed, DType::bf16);
    for (OffloadUpdate way : kWays) {
      CAPTURE(offload_update_name(way));
      require_same_bits(device, lisa_run(Placement::host, 2, policy, way, DType::bf16));
    }
    // Every stored value is a bf16 value, and the run differs from the fp32 state's.
    std::size_t not_bf16 = 0;
    for (const auto& g : device.groups)
      for (float x : g.state)
        not_bf16 += static_cast<float>(bf16_t(x)) != x;
    REQUIRE(not_bf16 == 0);
    REQUIRE(device.weights != lisa_run(Placement::device, 2, policy).weights);
  }
  // The plan: the state's bytes halve, on the device and on the host (lisa_run checks that the
  // engine holds what its plan says at every step).
  run_ranks(1, [&](int rank, Communicator& comm) {
    for (Placement placement : {Placement::device, Placement::host}) {
      const auto decls = small_lisa_declarations(rank, comm);
      const MemoryPlan f32 = plan_memory(config_at(placement, 2), 1, 0, decls);
      const MemoryPlan b16 =
          plan_memory(config_at(placement, 2, OffloadUpdate::streamed, DType::bf16), 1, 0, decls);
      RANK_REQUIRE(f32.of(Tag::optim_state) + f32.host_of(Tag::optim_state) ==
                   2 * (b16.of(Tag::optim_state) + b16.host_of(Tag::optim_state)));
      RANK_REQUIRE(f32.of(Tag::master32) == b16.of(Tag::master32));
      RANK_REQUIRE(f32.host_of(Tag::master32) == b16.host_of(Tag::master32));
    }
  });
}

TEST_CASE("shardswap.optimizer_state_dtype reads fp32 or bf16 and refuses anything else") {
  auto read = [](const nlohmann::json& dtype) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                        {"bf16", {{"enabled", true}}},
                        {"shardswap", {{"optimizer_state_dtype", dtype}}}};
    ConfigReader reader(j, "test.json");
    return engine_config_from_json(reader, BatchSizes{});
  };
  REQUIRE(read("bf16").optimizer.state_dtype == DType::bf16);
  REQUIRE(read("fp32").optimizer.state_dtype == DType::f32);
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { read("fp16"); }),
                         "test.json: shardswap.optimizer_state_dtype = \"fp16\": expected"));
  OptimizerConfig bad;
  bad.state_dtype = DType::f16;
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { bad.validate(); }),
                         "OptimizerConfig.state_dtype = fp16: must be fp32 or bf16"));
}

// --- the master as the bf16 weight and its low half (shardswap.master_weights) ---------------

namespace {

constexpr MasterStorage kLow = MasterStorage::bf16_remainder;

// Weights that differ between `a` (fp32 masters) and `b` (low halves) other than as a tie does:
// a's weight even (ties go to even) and b's one bf16 ulp further from zero (ties away from zero).
// The TrainingStates hold one rank's masters but every weight, so the weights tell it alone.
std::size_t weights_off_but_ties(const TrainingState& a, const TrainingState& b) {
  std::size_t off = 0;
  for (std::size_t p = 0; p < a.weights.size(); ++p)
    for (std::size_t i = 0; i + 1 < a.weights[p].size(); i += 2) {
      std::uint16_t x = 0, y = 0;
      std::memcpy(&x, a.weights[p].data() + i, 2);
      std::memcpy(&y, b.weights[p].data() + i, 2);
      off += x != y && !((x & 1u) == 0 && y == x + 1 && (x & 0x7F80u) != 0x7F80u);
    }
  return off;
}

}  // namespace

TEST_CASE("bf16_remainder matches the float64 reference under every policy, stage and placement") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    for (int stage : {1, 2})
      for (Placement placement : {Placement::device, Placement::host}) {
        Case c{4, stage, DType::bf16, OptimizerType::adamw};
        c.switches = test_support::switching_schedule();
        c.policy = policy;
        c.optimizer_placement = placement;
        c.master = kLow;
        CAPTURE(deactivate_policy_name(policy), stage, placement_name(placement));
        test_support::check_against_reference(c, cpu_backend());
      }
  for (OptimizerType rule : {OptimizerType::adam, OptimizerType::sgd}) {
    Case c{2, 2, DType::bf16, rule};
    c.master = kLow;
    c.state_dtype = DType::bf16;
    CAPTURE(optimizer_type_name(rule));
    test_support::check_against_reference(c, cpu_backend());
  }
}

TEST_CASE("bf16_remainder keeps the fp32 masters' bits in 2 bytes a param, on the device and on "
          "the host both ways, through switches") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    for (DType state_dtype : {DType::f32, DType::bf16}) {
      CAPTURE(deactivate_policy_name(policy), dtype_name(state_dtype));
      const TrainingState device =
          lisa_run(Placement::device, 2, policy, OffloadUpdate::streamed, state_dtype, kLow);
      for (OffloadUpdate way : kWays) {
        CAPTURE(offload_update_name(way));
        require_same_bits(device,
                          lisa_run(Placement::host, 2, policy, way, state_dtype, kLow));
      }
      // The gradients do not depend on the weights here, so the masters are the fp32 masters'
      // bits at the end, and the weights theirs but at ties.
      const TrainingState f32 =
          lisa_run(Placement::device, 2, policy, OffloadUpdate::streamed, state_dtype);
      for (std::size_t i = 0; i < f32.groups.size(); ++i) {
        CAPTURE(f32.groups[i].group);
        REQUIRE(f32.groups[i].master == device.groups[i].master);
        REQUIRE(f32.groups[i].state == device.groups[i].state);
      }
      REQUIRE(weights_off_but_ties(f32, device) == 0);
    }
  // The plan: the master's bytes halve, on the device and on the host (lisa_run checks that the
  // engine holds what its plan says at every step).
  run_ranks(1, [&](int rank, Communicator& comm) {
    for (Placement placement : {Placement::device, Placement::host}) {
      const auto decls = small_lisa_declarations(rank, comm);
      const MemoryPlan f32 = plan_memory(config_at(placement, 2), 1, 0, decls);
      const MemoryPlan low = plan_memory(
          config_at(placement, 2, OffloadUpdate::streamed, DType::f32, kLow), 1, 0, decls);
      RANK_REQUIRE(f32.of(Tag::master32) + f32.host_of(Tag::master32) ==
                   2 * (low.of(Tag::master32) + low.host_of(Tag::master32)));
      RANK_REQUIRE(low.of(Tag::master32) + low.host_of(Tag::master32) > 0);
      RANK_REQUIRE(f32.of(Tag::optim_state) == low.of(Tag::optim_state));
    }
  });
}

TEST_CASE("bf16_remainder: a training state moves to fp32 masters and back, and between "
          "placements, bit for bit") {
  // Ten steps under one storage and placement, the state handed to an engine of the other,
  // ten more there; the masters are fp32 values in the TrainingState either way.
  auto run = [&](MasterStorage first, Placement first_at, MasterStorage second,
                 Placement second_at) {
    return moved_run(config_at(first_at, 2, OffloadUpdate::streamed, DType::f32, first),
                     config_at(second_at, 2, OffloadUpdate::streamed, DType::f32, second));
  };
  constexpr MasterStorage kF32 = MasterStorage::fp32;
  const TrainingState low = run(kLow, Placement::device, kLow, Placement::device);
  require_same_bits(low, run(kLow, Placement::host, kLow, Placement::device));
  require_same_bits(low, run(kLow, Placement::device, kLow, Placement::host));
  const TrainingState f32 = run(kF32, Placement::device, kF32, Placement::device);
  for (const TrainingState& mixed : {run(kF32, Placement::device, kLow, Placement::host),
                                     run(kLow, Placement::host, kF32, Placement::device)}) {
    for (std::size_t i = 0; i < f32.groups.size(); ++i)
      REQUIRE(mixed.groups[i].master == f32.groups[i].master);
    REQUIRE(weights_off_but_ties(f32, mixed) == 0);
  }
}

TEST_CASE("shardswap.master_weights reads fp32 or bf16_remainder, and fp16 params, a bad value and "
          "Engine::master are refused, naming them") {
  auto read = [](const nlohmann::json& master, bool bf16 = true) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                        {bf16 ? "bf16" : "fp16", {{"enabled", true}}},
                        {"shardswap", {{"master_weights", master}}}};
    ConfigReader reader(j, "test.json");
    return engine_config_from_json(reader, BatchSizes{});
  };
  REQUIRE(read("bf16_remainder").optimizer.master == kLow);
  REQUIRE(read("fp32").optimizer.master == MasterStorage::fp32);
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { read("bf16"); }),
                         "test.json: shardswap.master_weights = \"bf16\": expected"));
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { read("bf16_remainder", false); }),
                         "shardswap.master_weights = \"bf16_remainder\": the master's high half "
                         "is the bf16 weight: needs bf16 params, not fp16"));
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_at(Placement::device, 2, OffloadUpdate::streamed, DType::f32, kLow), comm,
             space);
    test_support::declare_small_lisa_model(e);
    e.build(sine_init);
    RANK_REQUIRE(test::contains(test::message_of<StateError>([&] { e.master("embed"); }),
                                "Engine::master: group 'embed': the master is kept as the bf16 "
                                "weights and their low 16 bits"));
    // master_pieces joins the halves: the build's masters are the weights exactly.
    for (const auto& p : e.params()) {
      const std::vector<float> w = e.read_weight(p.name);
      for (const auto& piece : e.master_pieces(p.name))
        for (std::size_t k = 0; k < piece.values.size(); ++k)
          RANK_REQUIRE(piece.values[k] == w[static_cast<std::size_t>(piece.param_offset) + k]);
    }
  });
}
