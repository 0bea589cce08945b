// Dynamic and static loss scaling for fp16 (policy in loss_scaler.h; DeepSpeed's key names).
#include "shardswap/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "shardswap/error.h"

namespace shardswap {

namespace {

void require(bool ok, std::string_view prefix, std::string_view key, double value,
             std::string_view rule) {
  if (!ok) {
    throw ConfigError(fmt::format("{}.{} = {}: must be {}", prefix, key, value, rule));
  }
}

}  // namespace

void LossScaleConfig::validate(std::string_view prefix) const {
  // Only the scale in use is checked: a parser may leave the other one at a placeholder (DeepSpeed
  // spells "dynamic" as loss_scale = 0). initial_scale is given as 2^initial_scale_power.
  if (dynamic) {
    if (!(std::isfinite(initial_scale) && initial_scale > 0)) {
      throw ConfigError(
          fmt::format("{}.initial_scale_power = {}: gives an initial scale of {}; it must be "
                      "finite and > 0",
                      prefix, std::log2(initial_scale), initial_scale));
    }
  } else {
    require(std::isfinite(static_scale) && static_scale > 0, prefix, "loss_scale", static_scale,
            "finite and > 0");
  }
  require(window >= 1, prefix, "loss_scale_window", window, ">= 1");
  require(hysteresis >= 1, prefix, "hysteresis", hysteresis, ">= 1");
  require(std::isfinite(min_scale) && min_scale > 0, prefix, "min_loss_scale", min_scale,
          "finite and > 0");
}

LossScaler::LossScaler(const LossScaleConfig& config)
    : config_(config),
      scale_(config.dynamic ? config.initial_scale : config.static_scale),
      hysteresis_left_(config.hysteresis) {
  config_.validate();
}

bool LossScaler::update(bool overflow) {
  if (!config_.dynamic) return !overflow;
  if (overflow) {
    clean_steps_ = 0;
    if (--hysteresis_left_ == 0) {
      scale_ = std::max(scale_ / 2, config_.min_scale);
      hysteresis_left_ = config_.hysteresis;
    }
    return false;
  }
  if (++clean_steps_ == config_.window) {
    scale_ *= 2;
    clean_steps_ = 0;
    // A full clean window forgives earlier overflows, as DeepSpeed does when it grows the scale.
    hysteresis_left_ = config_.hysteresis;
  }
  return true;
}

void LossScaler::restore(const LossScalerState& state) {
  const bool scale_ok = std::isfinite(state.scale) && state.scale > 0 &&
                        (config_.dynamic || state.scale == config_.static_scale);
  if (!scale_ok || state.clean_steps < 0 || state.clean_steps >= config_.window ||
      state.hysteresis_left < 1 || state.hysteresis_left > config_.hysteresis)
    throw ConfigError(fmt::format(
        "LossScaler::restore: state (scale {}, clean steps {}, hysteresis left {}) does not fit "
        "the config ({} scaling, window {}, hysteresis {})",
        state.scale, state.clean_steps, state.hysteresis_left,
        config_.dynamic ? "dynamic" : "static", config_.window, config_.hysteresis));
  scale_ = state.scale;
  clean_steps_ = state.clean_steps;
  hysteresis_left_ = state.hysteresis_left;
}

}  // namespace shardswap
