// The float64 reference check of the sharded engine, shared by the CPU and GPU suites.
#pragma once

#include <optional>

#include "engine/backend.h"
#include "engine/engine.h"

namespace shardswap::test_support {

struct Case {
  int world_size;
  int stage;
  DType dtype;
  OptimizerType optimizer;
  LayoutOrder order = LayoutOrder::declaration;
  bool nccl = false;  ///< one rank over an NCCL communicator instead of in-process ranks
  std::optional<DType> grad_dtype = {};  ///< fp32: gradients accumulated in fp32
  std::optional<DType> comm_dtype = {};  ///< bf16/fp16 with fp32 gradients: compression
  /// Layer switching: (step, active groups) in increasing steps, the first at step 0 (the groups
  /// active at build); the last entry must make every group active (the check reads masters).
  /// Groups: embed, layers.0, layers.1, head. Empty: every group active throughout.
  std::vector<std::pair<int, std::vector<std::string>>> switches = {};
  DeactivatePolicy policy = DeactivatePolicy::drop;
};

/// A schedule over the reference model's groups that drops, brings back and finally reactivates
/// every group (shared by the CPU and GPU suites).
inline std::vector<std::pair<int, std::vector<std::string>>> switching_schedule() {
  return {{0, {"head", "layers.0"}},
          {4, {"head", "layers.1"}},
          {9, {"embed", "head", "layers.0"}},
          {14, {"embed", "head", "layers.0", "layers.1"}}};
}

/// Runs 20 steps of the engine on `backend` and REQUIREs its fp32 masters to match an unsharded
/// float64 reference (normalized error <= 1e-6), its bit16 weights to be its masters rounded, and
/// every rank's weights to agree.
void check_against_reference(const Case& c, const Backend& backend);

}  // namespace shardswap::test_support
