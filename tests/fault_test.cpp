// Fault injection: allocations that fail part-way through lifecycle calls and checkpoint saves,
// a rank that throws inside a collective or never arrives, and Inf/NaN gradients under fp16 and
// bf16. Each faulty engine is compared bit for bit against a control engine that made the same
// calls without the fault (random weights and gradients, never zeros).
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "engine/comm/collective_ops.h"
#include "memory/host_types.h"
#include "shardswap/batch_sizes.h"
#include "shardswap/checkpoint.h"
#include "shardswap/config_json.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/failing_allocator.h"
#include "tests/support/small_models.h"

using namespace shardswap;
using test_support::AllocationFaults;
using test_support::declare_small_lisa_model;
using test_support::FailingAllocator;

namespace {

// ---- a small LISA model (tests/support/small_models.h) from random weights ----

void random_init(const ParamInfo& p, std::span<float> v) {
  std::mt19937 rng(static_cast<unsigned>(std::hash<std::string>{}(p.name)));
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (auto& x : v) x = normal(rng);
}

EngineConfig make_config(int stage, DType dtype = DType::bf16) {
  EngineConfig cfg = test_support::small_lisa_config(stage);
  cfg.dtype = dtype;
  cfg.gradient_clipping = 1.0;
  return cfg;
}

// Random gradient magnitude in [1e-3, 5e-2] with a random sign: far from fp16's subnormals at
// any loss scale used here, so scaling by a power of two is exact.
float random_grad(std::mt19937& rng) {
  std::uniform_real_distribution<float> mag(1e-3f, 5e-2f);
  return (rng() & 1u) ? mag(rng) : -mag(rng);
}

// One micro-batch of random gradients for every active param, seeded by (seed, rank, param).
// Optionally one element of one param on this rank is replaced by `poison` (Inf or NaN).
void backward(Engine& e, unsigned seed, float poison = 0.0f, const std::string& poisoned = {},
              std::size_t poison_at = 0) {
  const auto& params = e.params();
  const double scale = e.loss_scale();
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (!e.is_active(it->group)) continue;
    std::mt19937 rng(seed * 7919u + static_cast<unsigned>(e.rank()) * 131u +
                     static_cast<unsigned>(std::hash<std::string>{}(it->name)));
    const View slot = e.grad_slot(it->name);
    std::vector<float> g(slot.count());
    for (auto& x : g) x = static_cast<float>(random_grad(rng) * scale);
    if (it->name == poisoned) g[poison_at % g.size()] = poison;
    if (slot.dtype() == DType::f16) {
      std::vector<f16_t> h(g.begin(), g.end());
      e.memory().write<f16_t>(slot, h);
    } else {
      std::vector<bf16_t> h(g.begin(), g.end());
      e.memory().write<bf16_t>(slot, h);
    }
    e.grad_ready(it->name);
  }
}

bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The first difference between two engines' complete observable state, or "" if none:
// groups, active set, every group's master/optimizer state/step (kept state included), the
// loss scaler, lr, the bit16 weights, and the memory each tag holds.
std::string difference(const Engine& a, const Engine& b, bool compare_scaler = true) {
  if (a.groups() != b.groups())
    return fmt::format("groups: {} vs {}", fmt::join(a.groups(), ","), fmt::join(b.groups(), ","));
  if (a.active_groups() != b.active_groups())
    return fmt::format("active: {} vs {}", fmt::join(a.active_groups(), ","),
                       fmt::join(b.active_groups(), ","));
  const TrainingState sa = a.training_state(true), sb = b.training_state(true);
  for (std::size_t i = 0; i < sa.groups.size(); ++i) {
    const auto &ga = sa.groups[i], &gb = sb.groups[i];
    if (ga.group != gb.group || ga.active != gb.active || ga.kept != gb.kept || ga.step != gb.step)
      return fmt::format("group {}: active/kept/step differ (step {} vs {})", ga.group, ga.step,
                         gb.step);
    if (!same_bytes(ga.master, gb.master)) return fmt::format("group {}: master", ga.group);
    if (!same_bytes(ga.state, gb.state)) return fmt::format("group {}: optimizer state", ga.group);
  }
  if (compare_scaler &&
      (sa.scaler.scale != sb.scaler.scale || sa.scaler.clean_steps != sb.scaler.clean_steps ||
       sa.scaler.hysteresis_left != sb.scaler.hysteresis_left))
    return fmt::format("loss scaler: scale {} vs {}", sa.scaler.scale, sb.scaler.scale);
  if (sa.lr != sb.lr) return "lr";
  if (sa.weights != sb.weights) return "bit16 weights";
  const auto ma = a.memory_stats(), mb = b.memory_stats();
  for (Tag t : kAllTags)
    if (ma.tag(t).requested.current != mb.tag(t).requested.current)
      return fmt::format("{} bytes: {} vs {}", tag_name(t), ma.tag(t).requested.current,
                         mb.tag(t).requested.current);
  return "";
}

// "" when every tag holds exactly the planned bytes.
std::string stats_vs_plan(const Engine& e) {
  const auto stats = e.memory_stats();
  const auto plan = e.plan();
  for (Tag t : kAllTags)
    if (stats.tag(t).requested.current != plan.of(t))
      return fmt::format("{} holds {} bytes, the plan says {}", tag_name(t),
                         stats.tag(t).requested.current, plan.of(t));
  return "";
}

// One engine on a one-rank group whose allocations can be made to fail.
struct Faulty {
  explicit Faulty(int stage)
      : faults(std::make_shared<AllocationFaults>()),
        space(0, std::make_unique<FailingAllocator>(make_host_allocator(), faults)),
        engine(make_config(stage), group.rank(0), space) {}
  std::shared_ptr<AllocationFaults> faults;
  InProcessGroup group{1};
  MemorySpace space;
  Engine engine;
};

// The state every operation starts from: trained, with one group frozen under each policy.
void prepare(Engine& e) {
  declare_small_lisa_model(e);
  e.build(random_init);
  for (unsigned s = 0; s < 2; ++s) {
    backward(e, s);
    e.step();
  }
  e.deactivate("layers.1", DeactivatePolicy::drop);
  e.deactivate("layers.2", DeactivatePolicy::keep_host);
  e.deactivate("layers.3", DeactivatePolicy::keep_device);
  backward(e, 2);
  e.step();
}

struct Operation {
  std::string name;
  std::function<void(Engine&)> run;
  /// Words the error must contain (besides the injected failure): what failed.
  std::vector<std::string> names;
  bool partial = false;  ///< set_active: each call inside is all or nothing, not the whole
  DeactivatePolicy policy = DeactivatePolicy::keep_host;  ///< for partial ones
};

std::vector<Operation> operations() {
  const std::vector<std::string> next{"embed", "head", "layers.1", "layers.2"};
  const auto ckpt =
      std::filesystem::temp_directory_path() / fmt::format("shardswap-fault-test-{}", ::getpid());
  return {
      {"activate(layers.1) after drop", [](Engine& e) { e.activate("layers.1"); }, {"layers.1"}},
      {"activate(layers.2) from keep_host",
       [](Engine& e) { e.activate("layers.2"); },
       {"layers.2"}},
      {"activate(layers.3) from keep_device",
       [](Engine& e) { e.activate("layers.3"); },
       {"layers.3"}},
      {"deactivate(layers.0, keep_host)",
       [](Engine& e) { e.deactivate("layers.0", DeactivatePolicy::keep_host); },
       {"layers.0", "kept on host"}},
      {"set_active(embed, head, layers.1, layers.2; keep_host)",
       [next](Engine& e) { e.set_active(next, DeactivatePolicy::keep_host); },
       {"group layers.", "Engine::set_active: ", "failed (deactivated so far: ["},
       true,
       DeactivatePolicy::keep_host},
      {"set_active(embed, head, layers.1, layers.2; drop)",
       [next](Engine& e) { e.set_active(next, DeactivatePolicy::drop); },
       {"group layers.", "Engine::set_active: ", "failed (deactivated so far: ["},
       true,
       DeactivatePolicy::drop},
      {"reform(layers.1.norm -> norms, layers.1.fc2 -> layers.1b)",
       [](Engine& e) {
         e.reform({{"layers.1.norm", "norms"}, {"layers.1.fc2", "layers.1b"}});
       },
       {"param16"}},
      {"restore_training_state (all groups active, trained elsewhere)",
       [](Engine& e) {
         Faulty source(e.config().stage);  // its own allocator: only `e`'s allocations fail
         prepare(source.engine);
         for (const char* g : {"layers.1", "layers.2", "layers.3"}) source.engine.activate(g);
         backward(source.engine, 5);
         source.engine.step();
         e.restore_training_state(source.engine.training_state(true));
       },
       {"group layers."}},
      {"save_checkpoint",
       [ckpt](Engine& e) {
         save_checkpoint(e, ckpt);
         std::filesystem::remove_all(ckpt);
       },
       {"save_checkpoint"}},
  };
}

}  // namespace

TEST_CASE(
    "an allocation failing at any point of a lifecycle call or a save leaves the engine as "
    "before, names what failed, and training goes on") {
  int injected = 0;
  for (int stage : {1, 2}) {
    for (const Operation& op : operations()) {
      std::size_t points = 0;
      for (std::size_t n = 1;; ++n) {
        INFO(fmt::format("stage {}, {}, allocation #{}", stage, op.name, n));
        Faulty a(stage), b(stage);  // b: the control, never failing
        prepare(a.engine);
        prepare(b.engine);
        // Views taken before the call must survive a failed one.
        std::vector<View> views;
        for (const auto& p : a.engine.params()) views.push_back(a.engine.weight(p.name));
        a.faults->arm(n);
        bool failed = false;
        try {
          op.run(a.engine);
        } catch (const OutOfMemory& e) {
          failed = true;
          const std::string what = e.what();
          CHECK(what.find(fmt::format("injected failure of allocation #{}", n)) !=
                std::string::npos);
          bool named = false;
          for (const auto& word : op.names) named = named || what.find(word) != std::string::npos;
          CHECK(named);
          if (!named) WARN(what);
        }
        a.faults->disarm();
        if (!failed) {
          points = a.faults->calls;
          CHECK(points < n);
          op.run(b.engine);  // both made the call: same state from here
        } else {
          ++injected;
          CHECK(a.faults->failures == 1);
          if (op.partial) {
            // Each lifecycle call inside set_active is all or nothing: bring the control to the
            // same set of groups call by call, then they must agree bit for bit.
            const auto now = a.engine.active_groups();
            const std::set<std::string> active(now.begin(), now.end());
            for (const auto& g : b.engine.groups())
              if (b.engine.is_active(g) && !active.count(g)) b.engine.deactivate(g, op.policy);
            for (const auto& g : b.engine.groups())
              if (!b.engine.is_active(g) && active.count(g)) b.engine.activate(g);
          } else {
            for (std::size_t i = 0; i < views.size(); ++i)
              CHECK(a.space.read<bf16_t>(views[i]) ==
                    a.space.read<bf16_t>(a.engine.weight(a.engine.params()[i].name)));
          }
        }
        CHECK(difference(a.engine, b.engine) == "");
        CHECK(stats_vs_plan(a.engine) == "");
        for (unsigned s = 10; s < 12; ++s) {  // a step afterwards works, the same on both
          backward(a.engine, s);
          backward(b.engine, s);
          const StepResult ra = a.engine.step(), rb = b.engine.step();
          CHECK(ra.applied);
          CHECK(ra.grad_norm == rb.grad_norm);
        }
        CHECK(difference(a.engine, b.engine) == "");
        CHECK(stats_vs_plan(a.engine) == "");
        if (!failed) break;
      }
      // Only save_checkpoint allocates nothing through the engine's allocator.
      if (op.name != "save_checkpoint") CHECK(points > 0);
      WARN(fmt::format("stage {}: {}: {} allocation(s), each failed once", stage, op.name, points));
    }
  }
  WARN(fmt::format("allocation failures injected: {}", injected));
}

// ---- a rank that fails inside a collective, or never arrives ----

namespace {

thread_local bool fail_own_work = false;

// Host collectives whose element work throws on the thread that set fail_own_work.
const CollectiveOps& faulty_ops() {
  static const CollectiveOps ops{
      "faulty host", DeviceKind::host,
      [](DType d, const void* const* src, int n, void* dst, std::size_t count, ReduceOp op) {
        if (fail_own_work) throw DeviceError("injected reduce failure");
        host_collective_ops().reduce(d, src, n, dst, count, op);
      },
      [](void* dst, const void* src, std::size_t bytes) {
        if (fail_own_work) throw DeviceError("injected copy failure");
        host_collective_ops().copy(dst, src, bytes);
      },
      [] {}, host_collective_ops().scratch};
  return ops;
}

enum class Coll { all_reduce, reduce_scatter, reduce, all_gather, broadcast, barrier };
const char* coll_name(Coll c) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "reduce",
                                "all_gather", "broadcast",      "barrier"};
  return names[static_cast<int>(c)];
}

// Calls collective `c` on `comm` with random data; `special` is the root for reduce (the rank
// that reduces) and the non-root for broadcast (a rank that copies).
void call(Coll c, Communicator& comm, int special) {
  const int n = comm.world_size();
  std::mt19937 rng(static_cast<unsigned>(comm.rank()) + 1u);
  std::vector<float> data(static_cast<std::size_t>(6 * n)), out(data.size());
  for (auto& x : data) x = random_grad(rng);
  switch (c) {
    case Coll::all_reduce:
      return comm.all_reduce(data.data(), data.size(), DType::f32, ReduceOp::sum);
    case Coll::reduce_scatter:
      return comm.reduce_scatter(data.data(), out.data(), 6, DType::f32, ReduceOp::sum);
    case Coll::reduce:
      return comm.reduce(data.data(), data.size(), DType::f32, ReduceOp::sum, special);
    case Coll::all_gather:
      return comm.all_gather(data.data(), out.data(), 6, DType::f32);
    case Coll::broadcast:
      return comm.broadcast(data.data(), data.size(), DType::f32, (special + 1) % n);
    case Coll::barrier:
      return comm.barrier();
  }
}

// Runs fn on every rank of `group` on its own thread (no run_ranks: its abort on a throw must
// not be what saves us) and returns each rank's error message ("" if none) and type.
struct Outcome {
  std::string message;
  bool comm_error = false;
  double seconds = 0.0;
};
std::vector<Outcome> on_threads(InProcessGroup& group,
                                const std::function<void(int, Communicator&)>& fn) {
  std::vector<Outcome> out(static_cast<std::size_t>(group.world_size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < group.world_size(); ++r)
    threads.emplace_back([&, r] {
      const auto start = std::chrono::steady_clock::now();
      auto& o = out[static_cast<std::size_t>(r)];
      try {
        fn(r, group.rank(r));
      } catch (const CommError& e) {
        o.message = e.what();
        o.comm_error = true;
      } catch (const std::exception& e) {
        o.message = e.what();
      }
      o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  for (auto& t : threads) t.join();
  return out;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE(
    "a rank whose own share of a collective throws fails every other rank with CommError "
    "naming it",
    "[comm]") {
  int injected = 0;
  for (Coll c :
       {Coll::all_reduce, Coll::reduce_scatter, Coll::reduce, Coll::all_gather, Coll::broadcast}) {
    for (int bad = 0; bad < 3; ++bad) {
      INFO(fmt::format("{} failing on rank {}", coll_name(c), bad));
      InProcessGroup group(3, faulty_ops());
      group.set_timeout(std::chrono::seconds(20));  // a safety net only: must not be what ends it
      const auto out = on_threads(group, [&](int r, Communicator& comm) {
        fail_own_work = r == bad;
        call(c, comm, bad);
      });
      ++injected;
      for (int r = 0; r < 3; ++r) {
        const auto& o = out[static_cast<std::size_t>(r)];
        CHECK(o.seconds < 10.0);
        if (r == bad) {
          CHECK_FALSE(o.comm_error);  // its own error, with its own type
          CHECK(contains(o.message, "injected"));
        } else {
          CHECK(o.comm_error);
          CHECK(contains(o.message, fmt::format("rank {} failed in {}(", bad, coll_name(c))));
          CHECK(contains(o.message, "injected"));
          CHECK_FALSE(contains(o.message, "timed out"));
        }
      }
    }
  }
  WARN(fmt::format("collective failures injected: {}", injected));
}

TEST_CASE(
    "with a timeout, a rank that never arrives gives every rank CommError naming the "
    "collective and the missing rank",
    "[comm]") {
  int injected = 0;
  for (Coll c : {Coll::all_reduce, Coll::reduce_scatter, Coll::reduce, Coll::all_gather,
                 Coll::broadcast, Coll::barrier}) {
    const int missing = static_cast<int>(c) % 3;
    INFO(fmt::format("{} without rank {}", coll_name(c), missing));
    InProcessGroup group(3);
    group.set_timeout(std::chrono::milliseconds(200));
    const auto out = on_threads(group, [&](int r, Communicator& comm) {
      if (r == missing) {
        // Late, not absent: arriving after the others gave up, it must fail too, not wait.
        std::this_thread::sleep_for(std::chrono::milliseconds(600));
        comm.barrier();
        return;
      }
      call(c, comm, (missing + 1) % 3);
    });
    ++injected;
    for (int r = 0; r < 3; ++r) {
      const auto& o = out[static_cast<std::size_t>(r)];
      CHECK(o.comm_error);
      CHECK(contains(o.message, fmt::format("{}(", coll_name(c))));
      CHECK(contains(o.message,
                     fmt::format("timed out after 200 ms waiting for rank(s) {} ", missing)));
      if (r != missing) {
        CHECK(o.seconds >= 0.19);
        CHECK(o.seconds < 5.0);
      }
    }
  }
  // Two ranks missing are both named.
  InProcessGroup group(4);
  group.set_timeout(std::chrono::milliseconds(200));
  const auto out = on_threads(group, [&](int r, Communicator& comm) {
    if (r == 0 || r == 2) call(Coll::all_reduce, comm, 0);
  });
  CHECK(contains(out[0].message, "waiting for rank(s) 1, 3 "));
  ++injected;
  WARN(fmt::format("missing-rank faults injected: {}", injected));
}

TEST_CASE("an engine rank that never steps fails the other's step with CommError, no hang",
          "[comm]") {
  InProcessGroup group(2);
  group.set_timeout(std::chrono::milliseconds(200));
  const auto out = on_threads(group, [&](int r, Communicator& comm) {
    MemorySpace space(r, make_host_allocator());
    Engine e(make_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(random_init);
    backward(e, 1);
    if (r == 0) e.step();  // rank 1 drops out after its backward
  });
  CHECK(out[0].comm_error);
  CHECK(contains(out[0].message, "waiting for rank(s) 1 "));
  CHECK(out[0].seconds < 5.0);
  CHECK(out[1].message == "");
}

// ---- Inf and NaN gradients ----

namespace {

enum class Mode { fp16, bf16_skip, bf16_error };

// Two ranks train: 2 clean steps, one whose gradients carry `poison` on rank 1 (unless
// `with_bad_step` is false: the control), 2 clean steps. Returns each rank's final state.
std::vector<TrainingState> train(Mode mode, int stage, bool with_bad_step, float poison,
                                 double fp16_scale) {
  std::vector<TrainingState> final_state(2);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    auto cfg = make_config(stage, mode == Mode::fp16 ? DType::f16 : DType::bf16);
    cfg.loss_scale.initial_scale = fp16_scale;
    cfg.loss_scale.hysteresis = 1;
    if (mode == Mode::bf16_error) cfg.nonfinite = NonFinitePolicy::error;
    Engine e(cfg, comm, space);
    declare_small_lisa_model(e);
    e.build(random_init);
    for (unsigned s = 0; s < 2; ++s) {
      backward(e, s);
      RANK_REQUIRE(e.step().applied);
    }
    if (with_bad_step) {
      const TrainingState before = e.training_state(true);
      const double scale = e.loss_scale();
      backward(e, 2, poison, rank == 1 ? "layers.2.fc1" : "", 97);
      if (mode == Mode::bf16_error) {
        const auto what = test::rank_message_of<Error>([&] { e.step(); });
        RANK_REQUIRE(contains(what, "Engine::step: step 3 "));
        RANK_REQUIRE(contains(what, "non-finite"));
      } else {
        const StepResult r = e.step();
        RANK_REQUIRE(!r.applied);
        RANK_REQUIRE(!std::isfinite(r.grad_norm));
        RANK_REQUIRE(e.loss_scale() == (mode == Mode::fp16 ? scale / 2 : scale));
      }
      const TrainingState after = e.training_state(true);
      RANK_REQUIRE(after.weights == before.weights);
      for (std::size_t g = 0; g < after.groups.size(); ++g) {
        RANK_REQUIRE(after.groups[g].step == before.groups[g].step);
        RANK_REQUIRE(same_bytes(after.groups[g].master, before.groups[g].master));
        RANK_REQUIRE(same_bytes(after.groups[g].state, before.groups[g].state));
      }
    }
    for (unsigned s = 3; s < 5; ++s) {
      backward(e, s);
      RANK_REQUIRE(e.step().applied);
    }
    final_state[static_cast<std::size_t>(rank)] = e.training_state(true);
  });
  return final_state;
}

}  // namespace

TEST_CASE(
    "Inf and NaN gradients: fp16 skips and backs off, bf16 skips or fails as configured: "
    "weights and state untouched, training goes on as if the step never came") {
  int injected = 0;
  for (Mode mode : {Mode::fp16, Mode::bf16_skip, Mode::bf16_error})
    for (int stage : {1, 2})
      for (float poison :
           {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
            std::numeric_limits<float>::quiet_NaN()}) {
        INFO(fmt::format("mode {}, stage {}, poison {}", static_cast<int>(mode), stage, poison));
        const auto faulty = train(mode, stage, true, poison, 1024);
        // The control never saw the bad step; under fp16 it starts at the backed-off scale.
        const auto control = train(mode, stage, false, poison, 512);
        ++injected;
        for (int r = 0; r < 2; ++r) {
          const auto &a = faulty[static_cast<std::size_t>(r)],
                     &b = control[static_cast<std::size_t>(r)];
          CHECK(a.weights == b.weights);
          CHECK(a.scaler.scale == b.scaler.scale);
          for (std::size_t g = 0; g < a.groups.size(); ++g) {
            CHECK(a.groups[g].step == b.groups[g].step);
            CHECK(a.groups[g].step == 4);
            CHECK(same_bytes(a.groups[g].master, b.groups[g].master));
            CHECK(same_bytes(a.groups[g].state, b.groups[g].state));
          }
        }
      }
  WARN(fmt::format("non-finite gradient steps injected: {}", injected));
}

TEST_CASE("shardswap.nonfinite is read from JSON, refused with a wrong value or under fp16") {
  EngineConfig cfg = make_config(2);
  CHECK(nonfinite_policy_from_name("error", "k") == NonFinitePolicy::error);
  CHECK(nonfinite_policy_from_name("skip", "k") == NonFinitePolicy::skip);
  CHECK(contains(test::message_of<ConfigError>([] { nonfinite_policy_from_name("abort", "k"); }),
                 "k = \"abort\": expected skip or error"));
  cfg.dtype = DType::f16;
  cfg.nonfinite = NonFinitePolicy::error;
  CHECK(contains(test::message_of<ConfigError>([&] { cfg.validate(""); }), "shardswap.nonfinite"));
  CHECK(contains(test::message_of<ConfigError>([&] { cfg.validate(); }), "EngineConfig.nonfinite"));
  const auto from_json = [](const std::string& precision, const std::string& nonfinite) {
    auto c = ConfigReader::from_text(
        fmt::format(
            R"({{"train_micro_batch_size_per_gpu": 2, {}: {{"enabled": true}}{}}})", precision,
            nonfinite.empty() ? ""
                              : fmt::format(R"(, "shardswap": {{"nonfinite": {}}})", nonfinite)),
        "fault.json");
    const BatchSizes batches = resolve_batch_sizes(c, 1);
    return engine_config_from_json(c, batches);
  };
  CHECK(from_json(R"("bf16")", "").nonfinite == NonFinitePolicy::skip);
  CHECK(from_json(R"("bf16")", R"("skip")").nonfinite == NonFinitePolicy::skip);
  CHECK(from_json(R"("bf16")", R"("error")").nonfinite == NonFinitePolicy::error);
  const auto bad = test::message_of<ConfigError>([&] { from_json(R"("bf16")", R"("abort")"); });
  CHECK(contains(bad, "shardswap.nonfinite"));
  CHECK(contains(bad, "fault.json"));
  CHECK(contains(test::message_of<ConfigError>([&] { from_json(R"("fp16")", R"("error")"); }),
                 "shardswap.nonfinite"));
}
