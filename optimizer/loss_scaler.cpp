// Dynamic and static loss scaling for fp16 (policy in loss_scaler.h; DeepSpeed's key names).
#include "shardswap/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "optimizer/config_names.h"
#include "shardswap/error.h"

namespace shardswap {

namespace {

void require(bool ok, const std::string& name, double value, std::string_view rule) {
  if (!ok) throw ConfigError(fmt::format("{} = {}: must be {}", name, value, rule));
}

}  // namespace

void validate_loss_scale_config(const LossScaleConfig& c, const ConfigNames& name) {
  // Only the scale in use is checked: a parser may leave the other one at a placeholder (DeepSpeed
  // spells "dynamic" as loss_scale = 0). The JSON gives initial_scale as 2^initial_scale_power.
  if (c.dynamic) {
    if (!(std::isfinite(c.initial_scale) && c.initial_scale > 0)) {
      if (name.json)
        throw ConfigError(fmt::format(
            "{} = {}: gives an initial scale of {}; it must be finite and > 0",
            name("initial_scale_power", ""), std::log2(c.initial_scale), c.initial_scale));
      require(false, name("", "initial_scale"), c.initial_scale, "finite and > 0");
    }
  } else {
    require(std::isfinite(c.static_scale) && c.static_scale > 0, name("loss_scale", "static_scale"),
            c.static_scale, "finite and > 0");
  }
  require(c.window >= 1, name("loss_scale_window", "window"), c.window, ">= 1");
  require(c.hysteresis >= 1, name("hysteresis", "hysteresis"), c.hysteresis, ">= 1");
  require(std::isfinite(c.min_scale) && c.min_scale > 0, name("min_loss_scale", "min_scale"),
          c.min_scale, "finite and > 0");
}

void LossScaleConfig::validate() const {
  validate_loss_scale_config(*this, ConfigNames::fields("LossScaleConfig"));
}

void LossScaleConfig::validate(std::string_view prefix) const {
  validate_loss_scale_config(*this, ConfigNames::keys(fmt::format("{}.", prefix)));
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
