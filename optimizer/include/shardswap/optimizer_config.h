// What the optimizer is asked to do: its update rule and hyperparameters (the public part of
// optimizer/; the kernels that apply it are internal).
#pragma once

#include <cstddef>
#include <string_view>

#include "shardswap/dtype.h"

namespace shardswap {

enum class OptimizerType { adam, adamw, sgd };

/// "Adam", "AdamW", "SGD" (case-insensitive). Throws ConfigError "KEY = \"NAME\": ..." otherwise.
OptimizerType optimizer_type_from_name(std::string_view name, std::string_view key);
const char* optimizer_type_name(OptimizerType type);

struct OptimizerConfig {
  OptimizerType type = OptimizerType::adamw;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  ///< Adam, SGD: L2 added to the gradient; AdamW: decoupled
  double momentum = 0.0;      ///< SGD only
  double dampening = 0.0;     ///< SGD only
  bool nesterov = false;      ///< SGD only; needs momentum > 0 and dampening == 0
  /// The optimizer state's type (Adam's m and v, SGD's momentum buffer): fp32, or bf16 (half the
  /// bytes; read into fp32, updated in fp32, stored rounded to nearest even), the master fp32
  /// either way. shardswap.optimizer_state_dtype.
  DType state_dtype = DType::f32;

  /// Throws ConfigError "NAME = VALUE: must be ...", NAME the field ("OptimizerConfig.lr",
  /// "OptimizerConfig.beta1"), for: lr < 0 or not finite, betas outside [0, 1), eps <= 0,
  /// weight_decay < 0, momentum < 0, dampening outside [0, 1], nesterov without momentum or with
  /// dampening, a state_dtype other than fp32 or bf16.
  void validate() const;
  /// The same, naming the JSON key under `prefix` ("optimizer.params" gives
  /// "optimizer.params.lr", "optimizer.params.betas[0]"): for a config read from JSON.
  void validate(std::string_view prefix) const;

  /// State values kept per parameter element: Adam/AdamW 2 (exp_avg, exp_avg_sq),
  /// SGD 1 with momentum (momentum buffer), 0 without.
  int state_slots() const;
  /// Bytes of one state value (of state_dtype).
  std::size_t state_bytes() const { return dtype_size(state_dtype); }
};

}  // namespace shardswap
