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
};

/// Runs 20 steps of the engine on `backend` and REQUIREs its fp32 masters to match an unsharded
/// float64 reference (normalized error <= 1e-6), its bit16 weights to be its masters rounded, and
/// every rank's weights to agree.
void check_against_reference(const Case& c, const Backend& backend);

}  // namespace shardswap::test_support
