// Checks that a GPU test gives back what it took: the device's free memory (cudaMemGetInfo) at
// the end is within 2 MiB of what it was at the start.
#pragma once

#include <cstdint>

#include "shardswap/allocator.h"
#include "tests/catch_compat.h"

namespace test {

class DeviceMemoryGuard {
 public:
  DeviceMemoryGuard() : before_(shardswap::cuda_device_memory(0).free) {}
  void require_returned() const {
    const auto after = shardswap::cuda_device_memory(0).free;
    const auto lost = static_cast<std::int64_t>(before_) - static_cast<std::int64_t>(after);
    CAPTURE(before_, after, lost);
    REQUIRE(lost <= 2 * 1024 * 1024);
  }

 private:
  std::size_t before_;
};

}  // namespace test
