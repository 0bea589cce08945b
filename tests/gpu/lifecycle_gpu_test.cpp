// Layer switching on the CUDA backend: the float64 reference with switches over 4 in-process
// ranks on one GPU, and a 10,000-switch soak whose memory, in the stats and in cudaMemGetInfo,
// ends where it started.
#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "tests/catch_compat.h"
#include "tests/support/reference_check.h"

using namespace shardswap;
using test_support::Case;

TEST_CASE("cuda: switching layers matches the float64 reference under every policy") {
  const auto switches = test_support::switching_schedule();
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    for (int stage : {1, 2}) {
      Case c{4, stage, DType::bf16, OptimizerType::adamw};
      c.switches = switches;
      c.policy = policy;
      CAPTURE(deactivate_policy_name(policy), stage);
      test_support::check_against_reference(c, cuda_backend());
    }
}

TEST_CASE("cuda: 10000 switches end with exactly the bytes and the free memory of the first") {
  // Policies rotate every 100 switches: drop, keep_device, keep_host. Layer buffers are whole
  // multiples of 2 MiB: the driver packs smaller cudaMalloc blocks into shared 2 MiB pages, so
  // with 0.25-1 MiB layer buffers cudaMemGetInfo read 2-6 MiB lower at the end (same engine
  // bytes, other page packing; H200, 2026-11-29). Both figures are compared from switch 0.
  std::int64_t first_bytes = -1, last_bytes = -1;
  std::size_t first_free = 0, last_free = 0;
  run_ranks(
      1,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, make_cuda_allocator(0));
        EngineConfig cfg;
        cfg.stage = 2;
        Engine e(cfg, comm, space, cuda_backend());
        for (int l = 0; l < 8; ++l)
          e.add_param(fmt::format("layers.{}.w", l), {1024, 1024}, fmt::format("layers.{}", l));
        e.add_param("head.w", {1024, 64}, "head");
        e.build([](const ParamInfo&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.1f); },
                std::vector<std::string>{"head", "layers.0", "layers.1"});
        const DeactivatePolicy policies[] = {DeactivatePolicy::drop, DeactivatePolicy::keep_device,
                                             DeactivatePolicy::keep_host};
        for (int s = 0; s < 10000; ++s) {
          const int a = (2 * s + 2) % 8, b = (2 * s + 3) % 8;
          e.set_active({"head", fmt::format("layers.{}", a), fmt::format("layers.{}", b)},
                       policies[(s / 100) % 3]);
          if (s % 100 == 0) {  // a training step now and then
            for (const auto& name : {fmt::format("layers.{}.w", b), fmt::format("layers.{}.w", a),
                                     std::string("head.w")}) {
              const View slot = e.grad_slot(name);
              std::vector<bf16_t> g(slot.count(), bf16_t(0.01f * static_cast<float>(s % 7 + 1)));
              space.write<bf16_t>(slot, g);
              e.grad_ready(name);
            }
            e.step();
          }
          if (s == 0) {
            first_bytes = space.stats().requested.current;
            first_free = cuda_device_memory(0).free;
          }
        }
        // Back to the first switch's set, with nothing kept.
        e.set_active({"head", "layers.2", "layers.3"}, DeactivatePolicy::drop);
        for (int l = 0; l < 8; ++l) {
          const auto g = fmt::format("layers.{}", l);
          if (!e.is_active(g)) {  // clear kept states by a drop round trip
            e.activate(g);
            e.deactivate(g, DeactivatePolicy::drop);
          }
        }
        last_bytes = space.stats().requested.current;
        last_free = cuda_device_memory(0).free;
      },
      cuda_backend());
  std::printf(
      "soak: 10000 switches; requested bytes after the first %lld, after the last %lld; "
      "device free after the first %zu, after the last %zu\n",
      static_cast<long long>(first_bytes), static_cast<long long>(last_bytes), first_free,
      last_free);
  REQUIRE(last_bytes == first_bytes);
  const auto drift = static_cast<std::int64_t>(first_free) - static_cast<std::int64_t>(last_free);
  CAPTURE(drift);
  REQUIRE(drift <= 2 * 1024 * 1024);
  REQUIRE(drift >= -2 * 1024 * 1024);
}
