// Per-param weight decay (Engine::set_param_weight_decay) against groups of their own decay, on
// a backend: shared by the CPU and GPU suites.
#pragma once

#include "shardswap/backend.h"
#include "shardswap/engine.h"

namespace shardswap::test_support {

/// How a model's params of other weight decays are given it.
enum class Arrangement {
  per_param,    ///< layer groups; set_param_weight_decay on norms and layers.1.fc2
  own_groups,   ///< each param of another decay in a group of its own, set_group_weight_decay
  all_decayed,  ///< layer groups, no override: what the check must tell apart
};

/// Trains the three arrangements at ZeRO stage 1 and 2 over 2 ranks on `backend` and checks
/// (Catch2 CHECKs) that per-param decay ends bit for bit as groups of their own, and that the
/// overrides change what they override and nothing else.
void check_per_param_decay(const Backend& backend);

}  // namespace shardswap::test_support
