// What the optimizer is asked to do: its update rule and hyperparameters (the public part of
// optimizer/; the kernels that apply it are internal).
#pragma once

#include <cstddef>
#include <string_view>

#include "shardswap/dtype.h"

namespace shardswap {

enum class OptimizerType { adam, adamw, sgd };

/// How the fp32 master weights are stored. fp32: as fp32 values (4 bytes a param). bf16_remainder
/// (bf16 params only): as the low 16 bits of each fp32 value beside the bf16 weight, which is the
/// fp32 value rounded to nearest with ties away from zero: the same fp32 master in 2 bytes a
/// param instead of 4 (the weight differs from a ties-to-even rounding only at exact ties, one
/// value in 65,536). shardswap.master_weights.
enum class MasterStorage { fp32, bf16_remainder };
/// "fp32", "bf16_remainder".
const char* master_storage_name(MasterStorage storage);

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
  /// How the master is stored (MasterStorage); bf16_remainder needs bf16 params (the engine
  /// checks).
  MasterStorage master = MasterStorage::fp32;

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
  /// Bytes of one master value as stored: 4, or 2 (its low half) for bf16_remainder.
  std::size_t master_bytes() const { return master == MasterStorage::fp32 ? 4 : 2; }
};

}  // namespace shardswap
