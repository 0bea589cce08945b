// Argument checks every backend's kernels make before touching memory (one place, so the
// backends refuse exactly the same calls with the same messages). Internal to optimizer/.
#pragma once

#include <cstddef>

#include "optimizer/optimizer.h"

namespace shardswap::detail {

/// ConfigError "<fn>: <name> is null for <count> <unit>" when p is null (count > 0 assumed).
void require_data(const void* p, const char* fn, const char* name, std::size_t count,
                  const char* unit = "elements");

/// Checks an update's arguments: bit16 params, gradients of the param type or fp32, step >= 1
/// and every tensor the rule reads present. `fn` names the caller ("cpu_device_ops().update").
/// Returns false when there is nothing to do (count 0).
bool check_update(const char* fn, const OptimizerConfig& config, const StepArgs& args,
                  const ShardTensors& t);

}  // namespace shardswap::detail
