// Per-param weight decay (Engine::set_param_weight_decay) on the CPU backend: a group whose
// params decay differently updates each element as it would in a group of its own weight decay,
// across shard boundaries inside params, at ZeRO stage 1 and 2 (tests/support/decay_runs.h).
#include <cmath>

#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/decay_runs.h"

using namespace shardswap;

TEST_CASE("a param's own weight decay updates it as a group of that decay would, bit for bit") {
  test_support::check_per_param_decay(cpu_backend());
}

TEST_CASE("set_param_weight_decay refuses an unknown param or a bad value") {
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(EngineConfig{}, comm, space);
    e.add_param("w", {4}, "g");
    REQUIRE(test::contains(
        test::message_of<ConfigError>([&] { e.set_param_weight_decay("v", 0.0); }), "'v'"));
    for (const double bad : {-1.0, std::nan(""), HUGE_VAL})
      REQUIRE(test::contains(
          test::message_of<ConfigError>([&] { e.set_param_weight_decay("w", bad); }),
          "must be finite and >= 0"));
  });
}
