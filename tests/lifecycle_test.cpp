// Group lifecycle and layer switching: activation, deactivation under drop / keep_host /
// keep_device, the seed's LISA scenario, exact memory after every switch, errors that change
// nothing.
#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/reference_check.h"
#include "tests/support/forwarding_allocator.h"
#include "tests/support/small_models.h"

using namespace shardswap;
using test_support::Case;
using test_support::declare_small_lisa_model;  // the seed's model
using test_support::sine_init;
using test_support::small_lisa_config;

namespace {

// Gradients of every active param, varied by rank and step.
void backward(Engine& e, int rank, int step) {
  const auto& params = e.params();
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (!e.is_active(it->group)) continue;
    const View slot = e.grad_slot(it->name);
    std::vector<bf16_t> g(slot.count());
    for (std::size_t i = 0; i < g.size(); ++i)
      g[i] =
          bf16_t(0.01f * static_cast<float>((static_cast<int>(i) + 3 * rank + 7 * step) % 13 - 6));
    e.memory().write<bf16_t>(slot, g);
    e.grad_ready(it->name);
  }
}

// Called from rank threads: throws (naming the tag and both figures) instead of using Catch2.
void require_stats_equal_plan(const Engine& e) {
  const auto stats = e.memory_stats();
  const auto plan = e.plan();
  for (Tag t : kAllTags)
    if (stats.tag(t).requested.current != plan.of(t))
      throw std::runtime_error(fmt::format("rank {}: {} holds {} bytes, the plan says {}", e.rank(),
                                           tag_name(t), stats.tag(t).requested.current,
                                           plan.of(t)));
}

bool report_mentions(const Engine& e, const std::string& text) {
  for (const auto& b : e.memory().report())
    if (b.label.find(text) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("the seed's LISA scenario keeps the head's step count and restarts body layers") {
  // Steps 0-9: head + layers.0; 10-19: head + layers.1; 20-29: head + layers.0; drop policy.
  for (int stage : {1, 2})
    run_ranks(2, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(small_lisa_config(stage), comm, space);
      declare_small_lisa_model(e);
      e.build(sine_init, std::vector<std::string>{"head", "layers.0"});
      require_stats_equal_plan(e);
      for (int step = 0; step < 30; ++step) {
        if (step == 10 || step == 20) {
          const std::string in = step == 10 ? "layers.1" : "layers.0";
          const std::string out = step == 10 ? "layers.0" : "layers.1";
          const SwitchReport r = e.set_active({"head", in}, DeactivatePolicy::drop);
          RANK_REQUIRE(r.activated == std::vector<std::string>{in});
          RANK_REQUIRE(r.deactivated == std::vector<std::string>{out});
          RANK_REQUIRE(r.bytes_freed == r.bytes_allocated);  // same-sized layers
          require_stats_equal_plan(e);
          // Nothing is left of the layer that went out but its bit16 weights.
          RANK_REQUIRE(!report_mentions(e, "group " + out + " master"));
          RANK_REQUIRE(!report_mentions(e, "group " + out + " grad"));
          RANK_REQUIRE(!report_mentions(e, "group " + out + " AdamW state"));
          RANK_REQUIRE(report_mentions(e, "group " + out + " param16"));
          RANK_REQUIRE(e.group_step(out) == 0);
          RANK_REQUIRE(e.group_step(in) == 0);  // drop: starts again from step 0
        }
        backward(e, rank, step);
        RANK_REQUIRE(e.step().applied);
        RANK_REQUIRE(e.group_step("head") == step + 1);  // 1 -> 30 unbroken
      }
      RANK_REQUIRE(e.group_step("layers.0") == 10);  // reactivated at step 20
    });
}

TEST_CASE("switching layers matches the float64 reference under every policy and stage") {
  // The reference drops or keeps state exactly as the policy says; the last switch reactivates
  // everything so every master can be compared.
  const auto switches = test_support::switching_schedule();
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    for (int stage : {1, 2}) {
      Case c{4, stage, DType::bf16, OptimizerType::adamw};
      c.switches = switches;
      c.policy = policy;
      CAPTURE(deactivate_policy_name(policy));
      test_support::check_against_reference(c, cpu_backend());
    }
}

TEST_CASE("keep_host 100 times between steps is bitwise the same as never deactivating") {
  auto train = [](bool cycle) {
    std::vector<std::vector<float>> weights;
    std::vector<float> master;
    std::mutex mu;
    run_ranks(2, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(small_lisa_config(2), comm, space);
      declare_small_lisa_model(e);
      e.build(sine_init);
      for (int step = 0; step < 10; ++step) {
        if (cycle)
          for (int k = 0; k < 10; ++k) {  // 100 deactivations in all
            e.deactivate("layers.2", DeactivatePolicy::keep_host);
            e.activate("layers.2");
          }
        backward(e, rank, step);
        e.step();
      }
      std::lock_guard lock(mu);
      if (rank != 0) return;
      for (const auto& p : e.params()) weights.push_back(e.read_weight(p.name));
      for (const auto& piece : e.master_pieces("layers.2.fc1"))
        master.insert(master.end(), piece.values.begin(), piece.values.end());
    });
    return std::make_pair(weights, master);
  };
  const auto steady = train(false);
  const auto cycled = train(true);
  REQUIRE(cycled.first == steady.first);
  REQUIRE(cycled.second == steady.second);
  REQUIRE(!steady.second.empty());
}

TEST_CASE("1000 switches leave exactly the bytes in use after the first") {
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(sine_init, std::vector<std::string>{"head", "layers.0", "layers.1"});
    const DeactivatePolicy policies[] = {DeactivatePolicy::drop, DeactivatePolicy::keep_host,
                                         DeactivatePolicy::keep_device};
    std::int64_t after_first = -1, views_after_first = -1;
    for (int s = 0; s < 1000; ++s) {
      const int a = s % 4, b = (s + 1 + s / 4) % 4 == a ? (a + 1) % 4 : (s + 1 + s / 4) % 4;
      e.set_active({"head", fmt::format("layers.{}", a), fmt::format("layers.{}", b)},
                   DeactivatePolicy::drop);
      if (s % 50 == 0) {  // a keep_* round trip now and then, restored before the next switch
        const auto p = policies[(s / 50) % 3];
        e.deactivate(fmt::format("layers.{}", a), p);
        e.activate(fmt::format("layers.{}", a));
      }
      if (s % 10 == 0) {
        backward(e, rank, s);
        e.step();
      }
      require_stats_equal_plan(e);
      if (after_first < 0) {
        after_first = e.memory_stats().requested.current;
        views_after_first = e.memory_stats().views;
      }
    }
    e.set_active({"head", "layers.0", "layers.1"}, DeactivatePolicy::drop);
    const auto s = e.memory_stats();
    RANK_REQUIRE(s.requested.current == after_first);
    RANK_REQUIRE(s.views == views_after_first);  // no alias left behind either
  });
}

namespace {

// Host memory whose host_staging() allocators count themselves, so a test can see when the
// engine lets its keep_host space (and the cache a pinned allocator keeps) go.
class CountedStagingAllocator final : public test_support::ForwardingAllocator {
 public:
  CountedStagingAllocator(std::unique_ptr<Allocator> inner, std::shared_ptr<std::atomic<int>> live,
                          bool staging)
      : ForwardingAllocator(std::move(inner)), live_(std::move(live)), staging_(staging) {
    if (staging_) ++*live_;
  }
  ~CountedStagingAllocator() override {
    if (staging_) --*live_;
  }
  std::unique_ptr<Allocator> host_staging() const override {
    return std::make_unique<CountedStagingAllocator>(inner().host_staging(), live_, true);
  }

 private:
  std::shared_ptr<std::atomic<int>> live_;
  bool staging_;
};

}  // namespace

TEST_CASE("the keep_host space goes once no group is kept on the host, and comes back on demand") {
  auto live = std::make_shared<std::atomic<int>>(0);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(
        rank, std::make_unique<CountedStagingAllocator>(make_host_allocator(), live, false));
    Engine e(small_lisa_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(sine_init);
    // Both ranks reach each check before either changes the shared count again.
    const auto expect_live = [&](int n) {
      comm.barrier();
      RANK_REQUIRE(live->load() == n);
      comm.barrier();
    };
    const auto all =
        std::vector<std::string>{"embed", "head", "layers.0", "layers.1", "layers.2", "layers.3"};
    e.set_active({"embed", "head", "layers.0"}, DeactivatePolicy::keep_host);
    expect_live(2);          // one keep_host space per rank
    e.activate("layers.1");  // two of three kept groups still on the host
    expect_live(2);
    e.set_active(all, DeactivatePolicy::keep_host);  // the last ones come back
    expect_live(0);
    require_stats_equal_plan(e);
    e.deactivate("layers.3", DeactivatePolicy::keep_host);  // made again on first use
    expect_live(2);
    e.deactivate("layers.2", DeactivatePolicy::drop);  // a dropped group keeps nothing there
    e.activate("layers.3");
    expect_live(0);
    e.activate("layers.2");
    backward(e, rank, 0);
    e.step();
    require_stats_equal_plan(e);
  });
}

TEST_CASE("lifecycle calls that do not fit the group's state are typed errors changing nothing") {
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(sine_init, std::vector<std::string>{"head", "layers.0"});
    const auto before = space.stats().requested.current;
    REQUIRE(test::contains(test::message_of<StateError>([&] { e.activate("head"); }),
                           "'head' is already active"));
    REQUIRE(test::contains(
        test::message_of<StateError>([&] { e.deactivate("layers.3", DeactivatePolicy::drop); }),
        "'layers.3' is not active"));
    REQUIRE(test::contains(test::message_of<StateError>([&] { e.grad_slot("layers.2.fc1"); }),
                           "frozen group 'layers.2'"));
    REQUIRE(test::contains(test::message_of<ConfigError>([&] { e.activate("layers.9"); }),
                           "no group named 'layers.9'"));
    REQUIRE(test::contains(test::message_of<ConfigError>([&] {
                             e.set_active({"head", "nope"}, DeactivatePolicy::drop);
                           }),
                           "'nope'"));
    // A bucket holding this group's gradients must be reduced or dropped first.
    (void)e.grad_slot("layers.0.fc2");
    REQUIRE(test::contains(
        test::message_of<StateError>([&] { e.deactivate("layers.0", DeactivatePolicy::drop); }),
        "pending"));
    e.zero_grad();
    REQUIRE(space.stats().requested.current == before);
    REQUIRE(e.active_groups() == std::vector<std::string>{"layers.0", "head"});
  });
}

TEST_CASE("deactivating a pinned group fails naming the pin, or reports what the pin holds") {
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(1), comm, space);
    declare_small_lisa_model(e);
    e.build(sine_init, std::vector<std::string>{"head", "layers.0"});
    const auto before = space.stats();
    Pin pin = e.master("layers.0").pin("trainer: EMA of layers.0");
    const auto msg =
        test::message_of<PinnedMemory>([&] { e.deactivate("layers.0", DeactivatePolicy::drop); });
    REQUIRE(test::contains(msg, "trainer: EMA of layers.0"));
    REQUIRE(test::contains(msg, "group layers.0 master"));
    REQUIRE(e.is_active("layers.0"));  // nothing changed
    REQUIRE(space.stats().requested.current == before.requested.current);
    // Asked to proceed, it frees what it can and says what the pin still holds.
    const auto held = e.deactivate("layers.0", DeactivatePolicy::drop, ReleasePolicy::allow_pinned);
    REQUIRE(held == pin.bytes());
    REQUIRE(held > 0);
    REQUIRE(space.stats().requested.current == e.plan().total() + static_cast<std::int64_t>(held));
    pin.reset();
    require_stats_equal_plan(e);
  });
}

TEST_CASE("a group built frozen holds only its bit16 weights until activated") {
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(sine_init, std::vector<std::string>{"head"});
    require_stats_equal_plan(e);
    RANK_REQUIRE(e.active_groups() == std::vector<std::string>{"head"});
    RANK_REQUIRE(!report_mentions(e, "group layers.1 master"));
    e.activate("layers.1");
    require_stats_equal_plan(e);
    RANK_REQUIRE(report_mentions(e, "group layers.1 master"));
  });
}

TEST_CASE("re-forming frozen groups moves weights on the device and rebinds every weight view") {
  // The seed's regrouping: the norms of the body layers leave their layers for a no-decay group.
  for (int stage : {1, 2})
    run_ranks(2, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(small_lisa_config(stage), comm, space);
      declare_small_lisa_model(e);
      e.build(sine_init);
      for (int step = 0; step < 3; ++step) {
        backward(e, rank, step);
        e.step();
      }
      std::vector<std::vector<float>> before;
      for (const auto& p : e.params()) before.push_back(e.read_weight(p.name));
      const View old_norm = e.weight("layers.1.norm");
      e.set_active({"embed", "head"}, DeactivatePolicy::drop);
      e.reform({{"layers.0.norm", "norms"},
                {"layers.1.norm", "norms"},
                {"layers.2.norm", "norms"},
                {"layers.3.norm", "norms"}});
      e.set_group_weight_decay("norms", 0.0);
      require_stats_equal_plan(e);
      // Every weight is where it was, bit for bit; the old view names the re-form.
      for (std::size_t i = 0; i < e.params().size(); ++i)
        RANK_REQUIRE(e.read_weight(e.params()[i].name) == before[i]);
      RANK_REQUIRE(e.params()[3].group == "norms");
      RANK_REQUIRE(
          test::contains(test::rank_message_of<StaleView>([&] { (void)old_norm.data<bf16_t>(); }),
                         "re-form of group layers.1"));
      RANK_REQUIRE(e.groups().back() == "norms");
      // Training goes on with the new groups.
      e.set_active({"embed", "head", "layers.0", "layers.1", "norms"}, DeactivatePolicy::drop);
      backward(e, rank, 3);
      RANK_REQUIRE(e.step().applied);
      RANK_REQUIRE(e.group_step("norms") == 1);
      require_stats_equal_plan(e);
    });
}

TEST_CASE("re-forming an active group is refused and changes nothing") {
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(sine_init, std::vector<std::string>{"head", "layers.0"});
    const auto groups = e.groups();
    REQUIRE(test::contains(test::message_of<StateError>([&] {
                             e.reform({{"layers.0.norm", "norms"}});
                           }),
                           "'layers.0' must be frozen"));
    REQUIRE(test::contains(test::message_of<ConfigError>([&] {
                             e.reform({{"layers.9.norm", "norms"}});
                           }),
                           "layers.9.norm"));
    REQUIRE(e.groups() == groups);
    REQUIRE(e.params()[3].group == "layers.0");
  });
}

TEST_CASE("a Pin on a weight of a group to re-form refuses the re-form and changes nothing") {
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(sine_init, std::vector<std::string>{"head"});
    const auto groups = e.groups();
    const auto stats = e.memory_stats();
    std::vector<std::vector<float>> before;
    for (const auto& p : e.params()) before.push_back(e.read_weight(p.name));
    const View norm = e.weight("layers.1.norm");
    {
      const Pin pin = norm.pin("user's copy of layers.1");
      const auto msg = test::message_of<PinnedMemory>(
          [&] { e.reform({{"layers.1.norm", "norms"}, {"layers.2.norm", "norms"}}); });
      CAPTURE(msg);
      REQUIRE(test::contains(msg, "user's copy of layers.1"));
      REQUIRE(test::contains(msg, "nothing was changed"));
      // Nothing moved: groups, bytes, weights, and the View still reads.
      REQUIRE(e.groups() == groups);
      REQUIRE(e.memory_stats().requested.current == stats.requested.current);
      for (std::size_t i = 0; i < e.params().size(); ++i)
        REQUIRE(e.read_weight(e.params()[i].name) == before[i]);
      REQUIRE(norm.data<bf16_t>() != nullptr);
    }
    // Without the Pin the same re-form goes through.
    e.reform({{"layers.1.norm", "norms"}, {"layers.2.norm", "norms"}});
    REQUIRE(e.groups().back() == "norms");
    require_stats_equal_plan(e);
  });
}

TEST_CASE("a stale View names its own group and the event after set_active hands its block on") {
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(small_lisa_config(2), comm, space);
    declare_small_lisa_model(e);
    e.build(sine_init, std::vector<std::string>{"head", "layers.0"});
    const View master = e.master("layers.0");
    // layers.1 has layers.0's shape: its master takes layers.0's block over.
    e.set_active({"head", "layers.1"}, DeactivatePolicy::drop);
    const auto msg = test::message_of<StaleView>([&] { (void)master.data<float>(); });
    CAPTURE(msg);
    REQUIRE(test::contains(msg, "view 'group layers.0 master shard' of 'group layers.0 master'"));
    REQUIRE(test::contains(msg, "by 'deactivate(layers.0, drop)'"));
    REQUIRE(test::contains(msg, "the block now belongs to 'group layers.1 master'"));
    // A later event on the block does not rewrite why this View went stale.
    e.set_active({"head", "layers.2"}, DeactivatePolicy::drop);
    REQUIRE(test::contains(test::message_of<StaleView>([&] { (void)master.data<float>(); }),
                           "by 'deactivate(layers.0, drop)'"));
  });
}
