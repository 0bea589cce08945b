// Engine behaviour besides numerics: memory per stage read from the stats, bad input, slots.
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "engine/engine_internals.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"

using namespace shardswap;

namespace {

struct Layer {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string group;
};

// Four groups of odd sizes; Ψ is about 70k params.
const std::vector<Layer> kLayers = {
    {"embed.weight", {97, 64}, "embed"},     {"layers.0.fc1", {64, 131}, "layers.0"},
    {"layers.0.fc2", {131, 64}, "layers.0"}, {"layers.0.norm", {64}, "layers.0"},
    {"layers.1.fc1", {64, 131}, "layers.1"}, {"layers.1.fc2", {131, 64}, "layers.1"},
    {"head.weight", {64, 97}, "head"},
};

void declare(Engine& e) {
  for (const auto& l : kLayers) e.add_param(l.name, l.shape, l.group);
}

void init_weights(const ParamInfo&, std::span<float> v) {
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.1f * static_cast<float>(i));
}

// One backward: every param's gradient, in reverse declaration order.
void backward(Engine& e, int rank, float value = 0.25f) {
  const float g = value * static_cast<float>(rank + 1);
  for (auto it = kLayers.rbegin(); it != kLayers.rend(); ++it) {
    View slot = e.grad_slot(it->name);
    if (slot.dtype() == DType::bf16)
      for (auto& x : slot.span<bf16_t>()) x = bf16_t(g);
    else
      for (auto& x : slot.span<f16_t>()) x = f16_t(g);
    e.grad_ready(it->name);
  }
}

EngineConfig base_config(int stage) {
  EngineConfig cfg;
  cfg.stage = stage;
  cfg.dtype = DType::bf16;
  cfg.reduce_bucket_bytes = 20000;  // holds the largest param (16768 bytes)
  cfg.optimizer.type = OptimizerType::adamw;
  return cfg;
}

struct RankMemory {
  MemoryStats stats;
  MemoryPlan plan;
  std::int64_t padded_param_bytes = 0;  // 2 x sum of padded flat sizes
  std::int64_t bucket_bytes = 0;
};

std::vector<RankMemory> train_and_measure(int world, int stage) {
  std::vector<RankMemory> out(static_cast<std::size_t>(world));
  std::mutex mu;
  run_ranks(world, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(base_config(stage), comm, space);
    declare(e);
    const MemoryPlan plan = e.plan();
    e.build(init_weights);
    space.reset_peaks();
    for (int step = 0; step < 3; ++step) {
      backward(e, rank);
      e.step();
    }
    std::lock_guard lock(mu);
    auto& m = out[static_cast<std::size_t>(rank)];
    m.stats = space.stats();
    m.plan = plan;
    for (const auto& g : e.groups()) m.padded_param_bytes += 2 * EngineInternals::layout(e, g).total_numel();
    m.bucket_bytes = static_cast<std::int64_t>(e.config().reduce_bucket_bytes);
  });
  return out;
}

std::int64_t psi() {
  std::int64_t n = 0;
  for (const auto& l : kLayers) {
    std::int64_t k = 1;
    for (auto e : l.shape) k *= e;
    n += k;
  }
  return n;
}

}  // namespace

TEST_CASE("stage 2 keeps at most 2 psi over N plus two buckets of gradient bytes per rank") {
  for (int world : {1, 2, 4, 8}) {
    CAPTURE(world);
    for (const auto& m : train_and_measure(world, 2)) {
      const auto& grad = m.stats.tag(Tag::grad).requested;
      // Ψ here counts the alignment padding of the flat layout, which is bounded below.
      const std::int64_t padded_psi = m.padded_param_bytes / 2;
      CAPTURE(grad.peak, psi(), padded_psi, m.bucket_bytes);
      REQUIRE(grad.peak <= 2 * padded_psi / world + 2 * m.bucket_bytes);
      REQUIRE(grad.peak == m.plan.of(Tag::grad));
      // Padding: < one alignment (128 elements) per param, plus < one per group and rank.
      REQUIRE(padded_psi - psi() < 128 * (static_cast<std::int64_t>(kLayers.size()) + 4 * world));
    }
  }
}

TEST_CASE("a single rank keeps no reduce buckets at stage 2: its gradients accumulate in place") {
  // At world size 1 the partition is the whole group; buckets would only copy into it.
  const RankMemory one = train_and_measure(1, 2)[0];
  const auto& grad = one.stats.tag(Tag::grad).requested;
  CAPTURE(grad.peak, one.padded_param_bytes, one.bucket_bytes);
  REQUIRE(grad.peak == one.padded_param_bytes);  // the groups' gradients, nothing else
  REQUIRE(grad.peak == one.plan.of(Tag::grad));
  // Two ranks keep their two buckets beside their partitions.
  const RankMemory two = train_and_measure(2, 2)[0];
  const auto& grad2 = two.stats.tag(Tag::grad).requested;
  CAPTURE(grad2.peak);
  REQUIRE(grad2.peak == two.padded_param_bytes / 2 + 2 * two.bucket_bytes);
  REQUIRE(grad2.peak == two.plan.of(Tag::grad));
}

TEST_CASE("stage 1 keeps the full gradients, 2 psi plus padding, on every rank") {
  for (const auto& m : train_and_measure(4, 1)) {
    const auto& grad = m.stats.tag(Tag::grad).requested;
    REQUIRE(grad.peak == m.padded_param_bytes);
    REQUIRE(grad.peak >= 2 * psi());
    REQUIRE(grad.peak == m.plan.of(Tag::grad));
  }
}

TEST_CASE("after build every tag holds exactly the planned bytes") {
  for (int stage : {1, 2})
    for (const auto& m : train_and_measure(3, stage))
      for (Tag t : kAllTags) {
        CAPTURE(stage, tag_name(t));
        REQUIRE(m.stats.tag(t).requested.current == m.plan.of(t));
        REQUIRE(m.stats.tag(t).requested.peak == m.plan.of(t));
      }
}

TEST_CASE("the sharded state of one rank shrinks as one over N") {
  const auto one = train_and_measure(1, 2)[0].stats;
  const auto eight = train_and_measure(8, 2)[0].stats;
  const double ratio = static_cast<double>(one.tag(Tag::master32).requested.current) /
                       static_cast<double>(eight.tag(Tag::master32).requested.current);
  CAPTURE(ratio);
  REQUIRE(ratio > 6.0);  // 8 with no padding; alignment padding of small groups costs a little
  REQUIRE(eight.tag(Tag::param16).requested.current >= 2 * psi());  // bit16 weights stay whole
}

TEST_CASE("engine memory returns to zero when the engine is destroyed") {
  MemorySpace space(0, make_host_allocator());
  run_ranks(1, [&](int, Communicator& comm) {
    Engine e(base_config(2), comm, space);
    declare(e);
    e.build(init_weights);
    backward(e, 0);
    e.step();
    REQUIRE(space.stats().requested.current > 0);
  });
  const auto s = space.stats();
  REQUIRE(s.requested.current == 0);
  REQUIRE(s.buffers == 0);
  REQUIRE(s.views == 0);
}

TEST_CASE("a stage 2 grad slot goes stale once its bucket was reduced") {
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    auto cfg = base_config(2);
    cfg.reduce_bucket_bytes = 256 * 2 * 64;  // holds one 64x131 weight, not two
    Engine e(cfg, comm, space);
    declare(e);
    e.build(init_weights);
    View first = e.grad_slot("layers.1.fc2");
    e.grad_ready("layers.1.fc2");
    View second = e.grad_slot("layers.1.fc1");  // does not fit: the first bucket is reduced
    e.grad_ready("layers.1.fc1");
    const auto msg = test::rank_message_of<StaleView>([&] { (void)first.data<bf16_t>(); });
    RANK_REQUIRE(test::contains(msg, "layers.1.fc2: grad slot"));
    RANK_REQUIRE(test::contains(msg, "reduce of grad bucket"));
    RANK_REQUIRE(!second.stale());
    e.step();
  });
}

TEST_CASE("a grad slot never marked ready is named when the gradients are reduced") {
  for (int stage : {1, 2}) {
    run_ranks(1, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(base_config(stage), comm, space);
      declare(e);
      e.build(init_weights);
      (void)e.grad_slot("head.weight");
      const auto msg = test::message_of<Error>([&] { e.step(); });
      REQUIRE(test::contains(msg, "head.weight"));
    });
  }
}

TEST_CASE("fp16 overflow skips the step, leaves the weights and halves the scale") {
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    auto cfg = base_config(2);
    cfg.dtype = DType::f16;
    cfg.loss_scale.initial_scale = 1024;
    cfg.loss_scale.hysteresis = 1;
    Engine e(cfg, comm, space);
    declare(e);
    e.build(init_weights);
    std::vector<float> before;
    for (auto x : e.weight("layers.0.fc1").span<f16_t>()) before.push_back(static_cast<float>(x));
    for (auto it = kLayers.rbegin(); it != kLayers.rend(); ++it) {
      View g = e.grad_slot(it->name);
      for (auto& x : g.span<f16_t>()) x = f16_t(1.0f);
      if (rank == 1 && it->name == "layers.0.fc1") g.span<f16_t>()[5] = f16_t(INFINITY);
      e.grad_ready(it->name);
    }
    const StepResult r = e.step();
    RANK_REQUIRE(!r.applied);
    RANK_REQUIRE(!std::isfinite(r.grad_norm));
    RANK_REQUIRE(e.loss_scale() == 512);
    RANK_REQUIRE(e.group_step("layers.0") == 0);
    std::vector<float> after;
    for (auto x : e.weight("layers.0.fc1").span<f16_t>()) after.push_back(static_cast<float>(x));
    RANK_REQUIRE(after == before);
    backward(e, rank);  // a clean step afterwards is applied
    RANK_REQUIRE(e.step().applied);
    RANK_REQUIRE(e.group_step("layers.0") == 1);
  });
}

TEST_CASE("bad engine input is refused with a typed error that names it") {
  MemorySpace space(0, make_host_allocator());
  run_ranks(1, [&](int, Communicator& comm) {
    auto bad = [&](auto mutate, const std::string& expected) {
      auto cfg = base_config(2);
      mutate(cfg);
      const auto msg = test::message_of<ConfigError>([&] { Engine e(cfg, comm, space); });
      CAPTURE(msg);
      REQUIRE(test::contains(msg, expected));
    };
    // The struct's fields, as the caller set them (not the JSON keys of the config reader).
    bad([](EngineConfig& c) { c.optimizer.lr = -0.1; }, "EngineConfig.optimizer.lr = -0.1");
    bad([](EngineConfig& c) { c.alignment_bytes = 96; }, "EngineConfig.alignment_bytes = 96");
    bad([](EngineConfig& c) { c.reduce_bucket_bytes = 128; },
        "EngineConfig.reduce_bucket_bytes = 128 bytes");
    bad([](EngineConfig& c) { c.stage = 3; }, "EngineConfig.stage = 3");
    bad([](EngineConfig& c) { c.dtype = DType::f32; }, "EngineConfig.dtype");

    Engine e(base_config(2), comm, space);
    e.add_param("w", {4, 4}, "g");
    REQUIRE(test::contains(test::message_of<ConfigError>([&] { e.add_param("w", {2}, "g"); }),
                           "duplicate param name 'w'"));
    REQUIRE(test::contains(test::message_of<ConfigError>([&] {
                             e.add_param("z", {3, 0}, "g");
                           }),
                           "'z' has zero elements"));
    REQUIRE(e.params().size() == 1);  // the refused declarations changed nothing
  });
  REQUIRE(test::contains(test::message_of<ConfigError>([] { InProcessGroup group(0); }), "world"));
  REQUIRE(test::contains(
      test::message_of<ConfigError>([] { optimizer_type_from_name("Adagrad", "optimizer.type"); }),
      "optimizer.type"));
}

TEST_CASE("zero_grad discards accumulated gradients") {
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(base_config(2), comm, space);
    declare(e);
    e.build(init_weights);
    backward(e, rank, 100.0f);
    e.zero_grad();
    const StepResult r = e.step();  // nothing accumulated since: a zero gradient
    RANK_REQUIRE(r.grad_norm == 0.0);
  });
}

TEST_CASE("sum_across_ranks adds every rank's value, and one rank gets its own value back (NaN too)") {
  for (int world : {1, 3}) {
    CAPTURE(world);
    run_ranks(world, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(base_config(2), comm, space);
      declare(e);
      e.build(init_weights);
      // 0.1 + 0.2 x rank: no rank's value is exact in binary, so the sum is not one by luck.
      const double sum = e.sum_across_ranks(0.1 + 0.2 * rank);
      double expected = 0.0;
      for (int r = 0; r < world; ++r) expected += 0.1 + 0.2 * r;
      RANK_REQUIRE(std::abs(sum - expected) <= 1e-15 * world);
      RANK_REQUIRE(std::isnan(e.sum_across_ranks(rank == 0 ? std::nan("") : 1.0)));
      RANK_REQUIRE(e.sum_across_ranks(-2.5) == -2.5 * world);
    });
  }
  // Before build there is no scalars buffer to reduce through: refused, naming the call.
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(base_config(2), comm, space);
    declare(e);
    RANK_REQUIRE(test::contains(test::message_of<StateError>([&] { e.sum_across_ranks(1.0); }),
                                "sum_across_ranks"));
  });
}
