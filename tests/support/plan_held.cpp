#include "tests/support/plan_held.h"

#include <fmt/format.h>

#include <cstdint>
#include <stdexcept>

#include "shardswap/engine.h"

namespace shardswap::test_support {

void require_plan_held(const Engine& e, const std::string& when) {
  const MemoryPlan plan = e.plan();
  const MemoryStats device = e.memory_stats(), host = e.host_memory_stats();
  for (Tag t : kAllTags) {
    const std::int64_t on_device = device.tag(t).requested.current;
    const std::int64_t on_host = host.tag(t).requested.current;
    if (on_device != plan.of(t) || on_host != plan.host_of(t))
      throw std::runtime_error(fmt::format(
          "rank {} {}: {} holds {} bytes on the device and {} on the host, the plan says {} and {}",
          e.rank(), when, tag_name(t), on_device, on_host, plan.of(t), plan.host_of(t)));
  }
}

}  // namespace shardswap::test_support
