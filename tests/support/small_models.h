// The small layer-switching model that the lifecycle and fault-injection tests train: embed and
// head always trained, four body layers switched in and out.
#pragma once

#include <span>

#include "shardswap/engine.h"

namespace shardswap::test_support {

/// Declares embed.weight [50, 16] (group embed); for l in 0..3, layers.l.fc1 [16, 37],
/// layers.l.fc2 [37, 16] and layers.l.norm [16] (group layers.l); head.weight [16, 50] (group
/// head).
void declare_small_lisa_model(Engine& e);

/// Weights 0.5 sin(0.37 i + numel mod 7): a WeightInit for any model, never all equal.
void sine_init(const ParamInfo& p, std::span<float> values);

/// Adds a gradient to every param of an active group, last declared first (backward's order):
/// 0.01 cos(0.11 i + 0.7 rank + 0.3 step), varied by position, rank and step.
void add_cosine_grads(Engine& e, int rank, int step);

/// Its config: `stage`, AdamW at lr 0.01, 4 KiB reduce buckets; the rest at the defaults.
EngineConfig small_lisa_config(int stage);

}  // namespace shardswap::test_support
