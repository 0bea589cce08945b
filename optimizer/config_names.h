// How a config struct's validate() names a bad value in its ConfigError "NAME = VALUE: rule": by
// the JSON key, for the config reader (which adds the file: "run.json: optimizer.params.lr = -1:
// ..."), or by the C++ field, for code that fills the struct itself and never wrote that key nor
// its unit ("EngineConfig.optimizer.lr = -1: ...").
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace shardswap {

struct OptimizerConfig;
struct LossScaleConfig;

struct ConfigNames {
  std::string prefix;  ///< put before every name: "optimizer.params.", "EngineConfig.", ""
  bool json = true;    ///< JSON keys; false: C++ fields

  static ConfigNames keys(std::string_view prefix) { return {std::string(prefix), true}; }
  static ConfigNames fields(std::string_view type) { return {fmt::format("{}.", type), false}; }

  /// The value's full name: its JSON key or its field, after the prefix.
  std::string operator()(std::string_view json_key, std::string_view field) const {
    return prefix + std::string(json ? json_key : field);
  }
  /// The names of a nested struct: under `json_key.` or `field.`.
  ConfigNames nested(std::string_view json_key, std::string_view field) const {
    return {fmt::format("{}.", (*this)(json_key, field)), json};
  }
};

void validate_optimizer_config(const OptimizerConfig& config, const ConfigNames& names);
void validate_loss_scale_config(const LossScaleConfig& config, const ConfigNames& names);

}  // namespace shardswap
