// The engine's exactness claim, checked: every tag holds on the device and on the host exactly
// the bytes its plan says. Throws (rather than REQUIRE) so that rank threads can call it too: an
// exception inside a test case fails it with the message, and a rank thread's is carried back.
#pragma once

#include <string>

namespace shardswap {
class Engine;
}

namespace shardswap::test_support {

/// Throws std::runtime_error naming the rank, `when`, the tag and both byte counts where a tag's
/// device or host bytes differ from the engine's plan.
void require_plan_held(const Engine& e, const std::string& when);

}  // namespace shardswap::test_support
