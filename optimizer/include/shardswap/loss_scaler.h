// Loss scaling for fp16 training: dynamic (overflow -> skip, shrink after hysteresis; grow after a
// window of clean steps) or static. bf16 runs use a static scale of 1.
#pragma once

#include <cstdint>
#include <string_view>

namespace shardswap {

struct LossScaleConfig {
  bool dynamic = true;
  double initial_scale = 65536.0;  ///< 2^initial_scale_power in DeepSpeed's terms
  double static_scale = 1.0;       ///< used when !dynamic
  int window = 1000;               ///< clean steps before the scale doubles
  int hysteresis = 2;              ///< overflows tolerated before the scale halves
  double min_scale = 1.0;          ///< the scale never goes below this

  /// Throws ConfigError "NAME = VALUE: must be ...", NAME the field
  /// ("LossScaleConfig.window"), for a scale <= 0 or not finite, window < 1, hysteresis < 1,
  /// min_scale <= 0.
  void validate() const;
  /// The same, naming the JSON key under `prefix` ("fp16" gives "fp16.loss_scale_window",
  /// "fp16.initial_scale_power"): for a config read from JSON.
  void validate(std::string_view prefix) const;
};

/// A scaler's changing part, as checkpoints save and restore it.
struct LossScalerState {
  double scale = 1.0;
  std::int64_t clean_steps = 0;
  int hysteresis_left = 1;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaleConfig& config);

  double scale() const { return scale_; }
  /// Records one step's outcome. Returns true if the step must be applied, false if it must be
  /// skipped (any overflow skips the step). On overflow: hysteresis counts down; when it reaches
  /// zero the scale halves (never below min_scale) and hysteresis is restored. After `window`
  /// consecutive clean steps the scale doubles and hysteresis is restored (as in DeepSpeed). A
  /// static scaler never changes its scale.
  bool update(bool overflow);

  std::int64_t clean_steps() const { return clean_steps_; }
  int hysteresis_left() const { return hysteresis_left_; }
  const LossScaleConfig& config() const { return config_; }

  LossScalerState state() const { return {scale_, clean_steps_, hysteresis_left_}; }
  /// Resumes from a saved state. Throws ConfigError (changing nothing) for a state this config
  /// can never reach: a scale not finite or <= 0 (for a static scaler: not its scale), clean
  /// steps outside [0, window), hysteresis left outside [1, hysteresis].
  void restore(const LossScalerState& state);

 private:
  LossScaleConfig config_;
  double scale_;
  std::int64_t clean_steps_ = 0;
  int hysteresis_left_;
};

}  // namespace shardswap
