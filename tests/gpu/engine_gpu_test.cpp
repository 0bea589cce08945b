// The engine on the CUDA backend: the same float64 reference as on the CPU, with one rank over
// NCCL and with 2 and 4 in-process ranks sharing the GPU; memory that really goes back to the
// device; compression's peak; out-of-memory as a typed error that leaves the engine usable.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/gpu/device_memory_guard.h"
#include "tests/support/compression_peak.h"
#include "tests/support/reference_check.h"

using namespace shardswap;
using test_support::Case;

namespace {

void check_all(OptimizerType optimizer) {
  const test::DeviceMemoryGuard guard;
  for (int stage : {1, 2})
    for (DType dtype : {DType::bf16, DType::f16}) {
      Case nccl{1, stage, dtype, optimizer};
      nccl.nccl = true;
      test_support::check_against_reference(nccl, cuda_backend());
      for (int world : {2, 4})
        test_support::check_against_reference({world, stage, dtype, optimizer}, cuda_backend());
    }
  guard.require_returned();
}

}  // namespace

TEST_CASE("cuda: sharded Adam matches the float64 reference over NCCL and in-process ranks") {
  check_all(OptimizerType::adam);
}

TEST_CASE("cuda: sharded AdamW matches the float64 reference over NCCL and in-process ranks") {
  check_all(OptimizerType::adamw);
}

TEST_CASE("cuda: sharded SGD matches the float64 reference over NCCL and in-process ranks") {
  check_all(OptimizerType::sgd);
}

TEST_CASE("cuda: compressed gradient communication matches the float64 reference") {
  const test::DeviceMemoryGuard guard;
  for (int stage : {1, 2})
    for (DType wire : {DType::bf16, DType::f16}) {
      Case c{4, stage, DType::bf16, OptimizerType::adamw};
      c.grad_dtype = DType::f32;
      c.comm_dtype = wire;
      test_support::check_against_reference(c, cuda_backend());
    }
  guard.require_returned();
}

TEST_CASE("cuda: a freed buffer goes back to the device, not into a cache") {
  const test::DeviceMemoryGuard guard;
  MemorySpace space(0, make_cuda_allocator(0));
  const auto before = cuda_device_memory(0).free;
  Buffer big = space.allocate(std::size_t{1} << 30, Tag::other, "1 GiB");
  const auto during = cuda_device_memory(0).free;
  REQUIRE(before - during >= (std::size_t{1} << 30));
  big.release("test");
  REQUIRE(space.stats().reserved.current == 0);
  guard.require_returned();
}

TEST_CASE("cuda: compression raises peak memory by at most one reduce bucket (10M to 1B params)") {
  const test::DeviceMemoryGuard guard;
  for (std::int64_t params :
       {std::int64_t{10'000'000}, std::int64_t{100'000'000}, std::int64_t{1'000'000'000}})
    for (int stage : {1, 2}) {
      const auto p = test_support::compression_peaks(cuda_backend(), params, stage, DType::bf16, 1);
      CAPTURE(params, stage, p.off, p.on, p.bucket);
      std::printf(
          "compression peak: %lld params, stage %d: off %lld B, on %lld B, on-off %lld B, "
          "bucket %lld B\n",
          static_cast<long long>(params), stage, static_cast<long long>(p.off),
          static_cast<long long>(p.on), static_cast<long long>(p.on - p.off),
          static_cast<long long>(p.bucket));
      REQUIRE(p.on - p.off <= p.bucket);
    }
  guard.require_returned();
}

TEST_CASE("cuda: out of memory in build is a typed error with the memory report and no leak") {
  const test::DeviceMemoryGuard guard;
  const auto total = cuda_device_memory(0).total;
  run_ranks(
      1,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, make_cuda_allocator(0));
        EngineConfig cfg;
        cfg.stage = 2;
        {
          Engine huge(cfg, comm, space, cuda_backend());
          // A small group first (it must be freed again), then bit16 weights of twice the card.
          huge.add_param("small", {1024}, "first");
          huge.add_param("huge", {static_cast<std::int64_t>(total)}, "second");
          const auto msg = test::message_of<OutOfMemory>([&] {
            huge.build(
                [](const ParamInfo&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); });
          });
          CAPTURE(msg);
          REQUIRE(test::contains(msg, "cudaMalloc"));
          REQUIRE(test::contains(msg, "param16"));
          REQUIRE(test::contains(msg, "rank 0 memory"));  // the report of what was held
          REQUIRE(space.stats().allocated.current == 0);  // the failed build kept nothing
        }
        // The device stays usable: a real engine builds and steps afterwards.
        Engine small(cfg, comm, space, cuda_backend());
        small.add_param("w", {64, 64}, "g");
        small.build(
            [](const ParamInfo&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.25f); });
        const View slot = small.grad_slot("w");
        std::vector<bf16_t> grad(slot.count(), bf16_t(1.0f));
        space.write<bf16_t>(slot, grad);
        small.grad_ready("w");
        REQUIRE(small.step().applied);
        REQUIRE(small.read_weight("w")[0] < 0.25f);
      },
      cuda_backend());
  guard.require_returned();
}

TEST_CASE("cuda: on every GPU, ZeRO-1/2 over NCCL matches the float64 reference") {
  const int world = std::min(cuda_device_count(), 8);
  if (world < 2) {
    WARN("only one GPU is visible: the multi-GPU engine check did not run");
    return;
  }
  for (Case c : test_support::multi_gpu_cases(world)) {
    c.nccl = true;
    test_support::check_against_reference(c, cuda_backend());
  }
}
