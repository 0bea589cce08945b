// Per-param weight decay on the CUDA backend: the update runs once per stretch of equal decay,
// on pointers into the middle of a shard; the same check as on the CPU
// (tests/support/decay_runs.h), with 2 in-process ranks sharing the GPU.
#include "shardswap/backend.h"
#include "tests/catch_compat.h"
#include "tests/gpu/device_memory_guard.h"
#include "tests/support/decay_runs.h"

using namespace shardswap;

TEST_CASE("cuda: a param's own weight decay updates it as a group of that decay would, bit for bit") {
  const test::DeviceMemoryGuard guard;
  test_support::check_per_param_decay(cuda_backend());
  guard.require_returned();
}
