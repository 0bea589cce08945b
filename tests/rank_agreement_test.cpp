// What ranks may do differently, and what they get for it: gradients handed over in different
// orders or for different groups, declarations that differ, a rank that leaves early. Each used
// to mix gradients silently or hang; each is now an error on every rank that names both sides.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <future>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/checkpoint.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"

using namespace shardswap;
using test::contains;

namespace {

EngineConfig config(int stage) {
  EngineConfig cfg;
  cfg.stage = stage;
  cfg.dtype = DType::bf16;
  cfg.optimizer.type = OptimizerType::sgd;  // w -= lr * g: the mixing shows in the weights
  cfg.optimizer.lr = 1.0;
  cfg.optimizer.weight_decay = 0.0;
  return cfg;
}

// Two groups of one 64-element param each: equal sizes, so their reductions have equal counts.
void declare_two_groups(Engine& e) {
  e.add_param("a.w", {64}, "a");
  e.add_param("b.w", {64}, "b");
}

void random_init(const ParamInfo& p, std::span<float> v) {
  std::mt19937 rng(static_cast<unsigned>(std::hash<std::string>{}(p.name)));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : v) x = u(rng);
}

// A gradient of `value` for every element of `name`, exact in bf16.
void hand_over(Engine& e, const std::string& name, float value) {
  e.add_grad(name, std::vector<float>(64, value));
}

// Runs `fn` on `world` ranks; fails (instead of hanging the suite) if it has not returned after
// `limit`. Returns the message of what run_ranks threw ("" if nothing), and whether it was a
// PeerFailure / CommError.
struct Outcome {
  bool returned = false;
  std::string message;
  bool comm_error = false;
  bool peer_failure = false;
};
Outcome run_within(int world, std::chrono::seconds limit,
                   const std::function<void(int, Communicator&)>& fn) {
  auto done = std::make_shared<std::promise<Outcome>>();
  auto result = done->get_future();
  std::thread([world, fn, done] {
    Outcome o;
    o.returned = true;
    try {
      run_ranks(world, fn);
    } catch (const PeerFailure& e) {
      o.message = e.what();
      o.comm_error = o.peer_failure = true;
    } catch (const CommError& e) {
      o.message = e.what();
      o.comm_error = true;
    } catch (const std::exception& e) {
      o.message = e.what();
    }
    done->set_value(o);
  }).detach();  // a hung run stays blocked where it is; the test fails below
  if (result.wait_for(limit) != std::future_status::ready) return Outcome{};
  return result.get();
}

}  // namespace

TEST_CASE(
    "ranks that hand equal-sized params of different groups over in different orders fail the "
    "step with CommError naming both, and the weights stay as they were") {
  for (const int stage : {1, 2}) {
    CAPTURE(stage);
    std::vector<std::string> messages(2);
    run_ranks(2, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(config(stage), comm, space);
      declare_two_groups(e);
      e.build(random_init);
      const auto a0 = e.read_weight("a.w"), b0 = e.read_weight("b.w");
      // Rank 0: a then b; rank 1: b then a. At stage 2 each group's window is its own bucket,
      // flushed as the next group's gradient arrives; at stage 1 the order of the reduce-scatters
      // is the groups' order, so this is fine there (and must pass).
      if (rank == 0) {
        hand_over(e, "a.w", 1.0f);
        hand_over(e, "b.w", 2.0f);
      } else {
        hand_over(e, "b.w", 2.0f);
        hand_over(e, "a.w", 1.0f);
      }
      if (stage == 1) {
        const StepResult r = e.step();
        RANK_REQUIRE(r.applied);
        for (const float w : e.read_weight("a.w")) RANK_REQUIRE(std::isfinite(w));
        return;
      }
      messages[static_cast<std::size_t>(rank)] =
          test::rank_message_of<CommError>([&] { e.step(); });
      RANK_REQUIRE(e.read_weight("a.w") == a0);
      RANK_REQUIRE(e.read_weight("b.w") == b0);
      // The gradients were dropped: the next step, handed over alike, is the plain SGD step
      // (mean over ranks of 1 and 2: a.w -= 1, b.w -= 2, rounded to bf16).
      hand_over(e, "b.w", 2.0f);
      hand_over(e, "a.w", 1.0f);
      RANK_REQUIRE(e.step().applied);
      const auto a1 = e.read_weight("a.w"), b1 = e.read_weight("b.w");
      for (std::size_t i = 0; i < a1.size(); ++i) {
        RANK_REQUIRE(a1[i] == static_cast<float>(bf16_t(a0[i] - 1.0f)));
        RANK_REQUIRE(b1[i] == static_cast<float>(bf16_t(b0[i] - 2.0f)));
      }
    });
    if (stage == 1) continue;
    for (const auto& m : messages) {
      CAPTURE(m);
      CHECK(contains(m, "Engine::step: the ranks handed gradients over differently"));
      CHECK(contains(m, "reduction 1 since the last step is of group 'a' elements [0, 64) ('a.w') "
                        "on rank 0 but of group 'b' elements [0, 64) ('b.w') on rank 1"));
      CHECK(contains(m, "the step was not applied, the gradients were dropped"));
    }
    CHECK(messages[0] == messages[1]);
  }
}

TEST_CASE(
    "ranks whose active groups differ in name but not in size fail the stage 1 step with "
    "CommError naming both groups") {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config(1), comm, space);
    declare_two_groups(e);
    const std::string mine = rank == 0 ? "a" : "b";
    e.build(random_init, std::vector<std::string>{mine});
    hand_over(e, mine + ".w", 1.0f);
    messages[static_cast<std::size_t>(rank)] = test::rank_message_of<CommError>([&] { e.step(); });
  });
  for (const auto& m : messages) {
    CAPTURE(m);
    CHECK(contains(m, "of group 'a' elements [0, 256) ('a.w') on rank 0 but of group 'b' "
                      "elements [0, 256) ('b.w') on rank 1"));
  }
}

TEST_CASE(
    "ranks may hand the params of one bucket window over in any order: the step equals the "
    "one made in the same order") {
  // One group of two params, one bucket window for both: the reduction is the same whatever
  // the order within it, so this must not be refused.
  std::vector<std::vector<float>> after(2), control(2);
  for (const bool swapped : {false, true}) {
    run_ranks(2, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(config(2), comm, space);
      e.add_param("g.x", {64}, "g");
      e.add_param("g.y", {64}, "g");
      e.build(random_init);
      const float v = rank == 0 ? 0.5f : 1.5f;
      if (swapped && rank == 1) {
        hand_over(e, "g.y", v);
        hand_over(e, "g.x", v);
      } else {
        hand_over(e, "g.x", v);
        hand_over(e, "g.y", v);
      }
      RANK_REQUIRE(e.step().applied);
      auto& out = swapped ? after : control;
      out[static_cast<std::size_t>(rank)] = e.read_weight("g.x");
      const auto y = e.read_weight("g.y");
      out[static_cast<std::size_t>(rank)].insert(out[static_cast<std::size_t>(rank)].end(),
                                                 y.begin(), y.end());
    });
  }
  CHECK(after == control);
}

TEST_CASE(
    "a rank that declared an extra param that fits in the padding is refused at build on "
    "every rank, naming the param, before anything is allocated") {
  std::vector<std::string> messages(2);
  std::vector<std::int64_t> allocated(2, -1);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config(2), comm, space);
    e.add_param("a.w", {60}, "a");
    if (rank == 1) e.add_param("a.extra", {4}, "a");  // 64 elements: the same padded size
    messages[static_cast<std::size_t>(rank)] =
        test::rank_message_of<CommError>([&] { e.build(random_init); });
    allocated[static_cast<std::size_t>(rank)] = space.stats().allocated.current;
  });
  for (const auto& m : messages) {
    CAPTURE(m);
    CHECK(contains(m, "Engine::build: the ranks declared different params: declaration 2 is no "
                      "param (it declared 1) on rank 0 but param 'a.extra' [4] in group 'a' on "
                      "rank 1"));
    CHECK(contains(m, "nothing stays allocated"));
  }
  CHECK(allocated == std::vector<std::int64_t>{0, 0});
}

TEST_CASE("ranks that re-form their groups differently fail the next step naming the param") {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config(2), comm, space);
    declare_two_groups(e);
    e.build(random_init, std::vector<std::string>{});  // all frozen: re-formable
    const std::string moved = rank == 0 ? "a.w" : "b.w";
    e.reform({{moved, "c"}});  // group 'c' holds a 64-element param on both ranks
    e.activate("c");
    hand_over(e, moved, 1.0f);
    messages[static_cast<std::size_t>(rank)] = test::rank_message_of<CommError>([&] { e.step(); });
    RANK_REQUIRE(e.group_step("c") == 0);  // not applied
  });
  for (const auto& m : messages) {
    CAPTURE(m);
    CHECK(contains(m, "Engine::step: the ranks declared different params: declaration 1 is param "
                      "'a.w' [64] in group 'c' on rank 0 but param 'a.w' [64] in group 'a' on "
                      "rank 1"));
    CHECK(contains(m, "the step was not applied, the gradients were dropped"));
  }
}

TEST_CASE("ranks built with different EngineConfigs are refused at build, naming both") {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    EngineConfig cfg = config(2);
    if (rank == 1) cfg.reduce_bucket_bytes = 4096;
    Engine e(cfg, comm, space);
    declare_two_groups(e);
    messages[static_cast<std::size_t>(rank)] =
        test::rank_message_of<CommError>([&] { e.build(random_init); });
  });
  CAPTURE(messages[0]);
  CHECK(contains(messages[0], "declaration 0 is EngineConfig{stage 2, bf16 params"));
  CHECK(contains(messages[0], "buckets of 67108864 bytes"));
  CHECK(contains(messages[0], "buckets of 4096 bytes, declaration order} on rank 1"));
}

TEST_CASE(
    "a rank whose run_ranks function returns while another is inside step() fails that one "
    "with PeerFailure naming it, with no timeout set") {
  const Outcome o = run_within(2, std::chrono::seconds(20), [](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config(2), comm, space);
    declare_two_groups(e);
    e.build(random_init);
    if (rank == 1) return;  // leaves: destroys its Engine and returns
    hand_over(e, "a.w", 1.0f);
    hand_over(e, "b.w", 1.0f);
    e.step();
  });
  REQUIRE(o.returned);  // it used to wait forever
  CAPTURE(o.message);
  CHECK(o.peer_failure);
  CHECK(contains(o.message, "rank 1 left the group"));
}

TEST_CASE("ranks that all return normally from run_ranks raise nothing") {
  const Outcome o = run_within(3, std::chrono::seconds(20), [](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config(2), comm, space);
    declare_two_groups(e);
    e.build(random_init);
    hand_over(e, "a.w", 1.0f);
    hand_over(e, "b.w", 1.0f);
    e.step();
    // Uneven finishing times: the last collective is done for every rank before any returns
    // from it, so a rank leaving then harms nobody.
    std::this_thread::sleep_for(std::chrono::milliseconds(20 * rank));
  });
  REQUIRE(o.returned);
  CHECK(o.message.empty());
}

TEST_CASE("add_param refuses a shape whose element count overflows, naming the param") {
  MemorySpace space(0, make_host_allocator());
  run_ranks(1, [&](int, Communicator& comm) {
    Engine e(config(2), comm, space);
    for (const auto& shape : std::vector<std::vector<std::int64_t>>{
             {std::int64_t{1} << 32, std::int64_t{1} << 32},
             {std::numeric_limits<std::int64_t>::max(), 4},
             {std::int64_t{1} << 30, std::int64_t{1} << 30, 1}}) {
      const auto msg = test::rank_message_of<ConfigError>([&] { e.add_param("big", shape, "g"); });
      RANK_REQUIRE(contains(msg, "Engine::add_param: 'big' (shape ["));
      RANK_REQUIRE(contains(msg, "has more than 288230376151711744 elements"));
    }
    RANK_REQUIRE(e.params().empty());  // nothing was declared
    e.add_param("largest", {std::int64_t{1} << 29, std::int64_t{1} << 29}, "g");  // 2^58: fine
    RANK_REQUIRE(e.params().at(0).numel == std::int64_t{1} << 58);
  });
}

TEST_CASE("plan counts 50,000 groups in time linear in the declarations") {
  // Each group was a scan of every param (and add_param a scan of every group): 10^10 string
  // comparisons for 50,000 groups of 4 params; linear, a fraction of a second.
  MemorySpace space(0, make_host_allocator());
  run_ranks(1, [&](int, Communicator& comm) {
    Engine e(config(2), comm, space);
    const auto started = std::chrono::steady_clock::now();
    for (int g = 0; g < 50000; ++g)
      for (int p = 0; p < 4; ++p)
        e.add_param("layers." + std::to_string(g) + ".p" + std::to_string(p), {8}, std::to_string(g));
    const MemoryPlan plan = e.plan();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    RANK_REQUIRE(plan.of(Tag::param16) == 50000 * 4 * 128 * 2);  // each param padded to 128
    RANK_REQUIRE(seconds < 10.0);
  });
}

TEST_CASE("errors name the call the user made, not an inner one") {
  MemorySpace space(0, make_host_allocator());
  const test_support::ScratchFolder dir("agreement-names");
  run_ranks(1, [&](int, Communicator& comm) {
    Engine e(config(2), comm, space);
    declare_two_groups(e);
    e.build(random_init, std::vector<std::string>{"a"});
    const auto frozen = test::rank_message_of<StateError>([&] { hand_over(e, "b.w", 1.0f); });
    RANK_REQUIRE(contains(frozen, "Engine::add_grad: 'b.w' belongs to frozen group 'b'"));
    hand_over(e, "a.w", 1.0f);  // pending: a save now is refused
    const auto saving =
        test::rank_message_of<StateError>([&] { save_checkpoint(e, dir / "ckpt", {}); });
    RANK_REQUIRE(saving.starts_with("save_checkpoint: group 'a' has gradients pending"));
    RANK_REQUIRE(!std::filesystem::exists(dir / "ckpt"));
    e.step();
    save_checkpoint(e, dir / "ckpt", {});
    hand_over(e, "a.w", 1.0f);
    const auto loading = test::rank_message_of<StateError>([&] { load_checkpoint(e, dir / "ckpt"); });
    RANK_REQUIRE(loading.starts_with("load_checkpoint: group 'a' has gradients pending"));
  });
}
