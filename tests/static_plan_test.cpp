// plan_memory: the plan of an Engine before build() without the Engine, equal to Engine::plan()
// tag for tag over stages, world sizes, dtypes, compression, accumulation and active sets.
#include <fmt/format.h>

#include <optional>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"

using namespace shardswap;

namespace {

// Groups of odd sizes, one param larger than the small bucket below (the bucket grows to it).
const std::vector<ParamDeclaration> kParams = {
    {"embed.weight", {97, 64}, "embed"},     {"layers.0.fc1", {64, 131}, "layers.0"},
    {"layers.0.fc2", {131, 64}, "layers.0"}, {"layers.0.norm", {64}, "layers.0"},
    {"layers.1.fc1", {64, 131}, "layers.1"}, {"layers.1.fc2", {131, 64}, "layers.1"},
    {"layers.1.norm", {64}, "layers.1"},     {"head.weight", {64, 97}, "head"},
};

struct Case {
  int stage = 2;
  DType dtype = DType::bf16;
  bool compressed = false;  // fp32 gradients that travel in the bit16 type
  int accumulation = 1;
  std::size_t bucket_bytes = 20000;
  std::optional<std::vector<std::string>> active;

  EngineConfig config() const {
    EngineConfig c;
    c.stage = stage;
    c.dtype = dtype;
    if (compressed) {
      c.grad_dtype = DType::f32;
      c.comm_dtype = dtype;
    }
    c.gradient_accumulation_steps = accumulation;
    c.reduce_bucket_bytes = bucket_bytes;
    c.optimizer.type = OptimizerType::adamw;
    return c;
  }
  std::string name(int world, int rank) const {
    return fmt::format("stage {}, {}, {}compressed, accumulation {}, bucket {}, {}, rank {} of {}",
                       stage, dtype_name(dtype), compressed ? "" : "not ", accumulation,
                       bucket_bytes, active ? "some groups active" : "all active", rank, world);
  }
};

// Engine::plan of a declared, unbuilt Engine on `rank` of `world`: the group's ranks never
// exchange anything and the space never allocates.
MemoryPlan engine_plan(const Case& c, int world, int rank) {
  InProcessGroup group(world);
  MemorySpace space(rank, make_host_allocator());
  Engine engine(c.config(), group.rank(rank), space);
  for (const auto& p : kParams) engine.add_param(p.name, p.shape, p.group);
  return engine.plan(c.active);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const std::vector<std::optional<std::vector<std::string>>> actives = {
      std::nullopt, std::vector<std::string>{"embed", "layers.1"}};
  for (int stage : {1, 2})
    for (DType dtype : {DType::bf16, DType::f16})
      for (bool compressed : {false, true})
        for (int accumulation : {1, 4})
          for (const auto& active : actives)
            out.push_back({stage, dtype, compressed, accumulation, 20000, active});
  // A bucket smaller than the largest param (grown to it at stage 2) and one larger than any
  // group (capped at the largest group).
  out.push_back({.stage = 2, .bucket_bytes = 1024, .active = std::nullopt});
  out.push_back({.stage = 2,
                 .compressed = true,
                 .bucket_bytes = std::size_t{1} << 30,
                 .active = std::nullopt});
  return out;
}

}  // namespace

TEST_CASE("plan_memory equals Engine::plan tag for tag without an Engine") {
  int compared = 0;
  for (const Case& c : cases())
    for (int world = 1; world <= 4; ++world)
      for (int rank = 0; rank < world; ++rank) {
        INFO(c.name(world, rank));
        const MemoryPlan expected = engine_plan(c, world, rank);
        const MemoryPlan got = plan_memory(c.config(), world, rank, kParams, c.active);
        for (Tag t : kAllTags) {
          INFO(tag_name(t));
          CHECK(got.of(t) == expected.of(t));
        }
        CHECK(got.total() == expected.total());
        ++compared;
      }
  CHECK(compared == 34 * 10);
}

TEST_CASE("plan_memory refuses what the Engine and Engine::plan refuse, naming it") {
  const EngineConfig config = Case{}.config();
  CHECK(test::contains(test::message_of<ConfigError>([&] { plan_memory(config, 2, 2, kParams); }),
                       "plan_memory: rank 2 of world size 2"));
  CHECK(test::contains(test::message_of<ConfigError>([&] { plan_memory(config, 0, 0, kParams); }),
                       "rank 0 of world size 0"));
  CHECK(test::message_of<ConfigError>([&] { plan_memory(config, 1, 0, {}); }) ==
        "Engine::plan: no params declared");
  CHECK(test::message_of<ConfigError>([&] {
          plan_memory(config, 1, 0, kParams, std::vector<std::string>{"layers.7"});
        }) == "Engine::plan: no group named 'layers.7'");
  std::vector<ParamDeclaration> twice = kParams;
  twice.push_back(kParams.front());
  CHECK(test::message_of<ConfigError>([&] { plan_memory(config, 1, 0, twice); }) ==
        "Engine::add_param: duplicate param name 'embed.weight'");
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         plan_memory(config, 1, 0, {{"w", {4, 0}, "g"}});
                       }),
                       "'w' has zero elements"));
  EngineConfig bad = config;
  bad.stage = 3;
  const std::string why = test::message_of<ConfigError>([&] { plan_memory(bad, 1, 0, kParams); });
  InProcessGroup group(1);
  MemorySpace space(0, make_host_allocator());
  CHECK(why == test::message_of<ConfigError>([&] { Engine e(bad, group.rank(0), space); }));
}
