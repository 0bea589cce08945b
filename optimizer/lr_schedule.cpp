// The schedules' formulas, written from DeepSpeed's documented definitions (deepspeed.runtime.
// lr_schedules): `iteration` below is DeepSpeed's last_batch_iteration.
#include "shardswap/lr_schedule.h"
#include "support/quoted.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "optimizer/config_names.h"
#include "shardswap/error.h"

namespace shardswap {

namespace {

// Throws unless `ok`, stated as the condition that must hold so a NaN fails too.
void require(bool ok, const std::string& name, double value, std::string_view rule) {
  if (!ok) throw ConfigError(fmt::format("{} = {}: must be {}", name, value, rule));
}

// Fraction of warmup done at `iteration` (< warmup iterations W): 0 at iteration 0.
double warmup_fraction(WarmupCurve curve, std::int64_t iteration, std::int64_t w) {
  const double i = static_cast<double>(iteration);
  if (curve == WarmupCurve::log) return std::log(i + 1.0) / std::log(static_cast<double>(w));
  return i / static_cast<double>(w);
}

}  // namespace

LrScheduleType lr_schedule_type_from_name(std::string_view name, std::string_view key) {
  if (name == "WarmupLR") return LrScheduleType::warmup;
  if (name == "WarmupDecayLR") return LrScheduleType::warmup_decay;
  if (name == "WarmupCosineLR") return LrScheduleType::warmup_cosine;
  const bool deepspeed_only = name == "OneCycle" || name == "LRRangeTest";
  throw ConfigError(fmt::format(
      "{} = {}: {}; ShardSwap implements WarmupLR, WarmupDecayLR and WarmupCosineLR (without "
      "a scheduler the lr is constant)",
      key, quote_value(name), deepspeed_only ? "a DeepSpeed schedule ShardSwap does not implement" : "unknown"));
}

const char* lr_schedule_type_name(LrScheduleType type) {
  switch (type) {
    case LrScheduleType::constant:
      return "constant";
    case LrScheduleType::warmup:
      return "WarmupLR";
    case LrScheduleType::warmup_decay:
      return "WarmupDecayLR";
    case LrScheduleType::warmup_cosine:
      return "WarmupCosineLR";
  }
  return "?";
}

WarmupCurve warmup_curve_from_name(std::string_view name, std::string_view key) {
  if (name == "log") return WarmupCurve::log;
  if (name == "linear") return WarmupCurve::linear;
  throw ConfigError(fmt::format("{} = {}: unknown; expected \"log\" or \"linear\"", key, quote_value(name)));
}

std::int64_t LrSchedule::warmup_iterations() const {
  return std::max<std::int64_t>(2, warmup_num_steps);
}

double LrSchedule::lr_at(std::int64_t update) const {
  if (update < 0)
    throw ConfigError(fmt::format("LrSchedule::lr_at: update {} is negative", update));
  if (type == LrScheduleType::constant) return peak_lr;
  const std::int64_t iteration = std::max<std::int64_t>(update - 1, 0);
  const std::int64_t w = warmup_iterations();
  if (type == LrScheduleType::warmup_cosine) {
    double ratio;
    if (iteration < w) {
      ratio =
          warmup_min_ratio + (1.0 - warmup_min_ratio) * warmup_fraction(warmup_type, iteration, w);
    } else {
      // DeepSpeed's cosine keeps turning past total_num_steps (the lr climbs again); ShardSwap
      // holds the final ratio there instead, which is what a schedule's end means.
      const double progress = std::min(
          1.0, static_cast<double>(iteration - w + 1) / static_cast<double>(total_num_steps - w));
      ratio = cos_min_ratio +
              (1.0 - cos_min_ratio) * (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
    }
    return peak_lr * std::max(0.0, ratio);
  }
  double gamma;
  if (iteration < w)
    gamma = warmup_fraction(warmup_type, iteration, w);
  else if (type == LrScheduleType::warmup)
    gamma = 1.0;
  else  // warmup_decay: linear from 1 at the end of warmup to 0 at total_num_steps, then 0
    gamma = std::max(0.0, static_cast<double>(total_num_steps - iteration) /
                              static_cast<double>(std::max<std::int64_t>(1, total_num_steps - w)));
  return warmup_min_lr + (peak_lr - warmup_min_lr) * gamma;
}

namespace {

// The lr of the schedule's peak is optimizer.params.lr in the JSON, except WarmupLR's and
// WarmupDecayLR's warmup_max_lr.
void validate_schedule(const LrSchedule& s, const ConfigNames& name, const ConfigNames& peak) {
  const auto lr_ok = [](double v) { return std::isfinite(v) && v >= 0.0; };
  const auto ratio_ok = [](double v) { return v >= 0.0 && v <= 1.0; };
  switch (s.type) {
    case LrScheduleType::constant:
      require(lr_ok(s.peak_lr), peak("lr", "peak_lr"), s.peak_lr, "finite and >= 0");
      return;
    case LrScheduleType::warmup:
    case LrScheduleType::warmup_decay:
      require(lr_ok(s.warmup_min_lr), name("warmup_min_lr", "warmup_min_lr"), s.warmup_min_lr,
              "finite and >= 0");
      require(lr_ok(s.peak_lr), name("warmup_max_lr", "peak_lr"), s.peak_lr, "finite and >= 0");
      break;
    case LrScheduleType::warmup_cosine:
      require(lr_ok(s.peak_lr), peak("lr", "peak_lr"), s.peak_lr, "finite and >= 0");
      require(ratio_ok(s.warmup_min_ratio), name("warmup_min_ratio", "warmup_min_ratio"),
              s.warmup_min_ratio, "in [0, 1]");
      require(ratio_ok(s.cos_min_ratio), name("cos_min_ratio", "cos_min_ratio"), s.cos_min_ratio,
              "in [0, 1]");
      break;
  }
  if (s.warmup_num_steps < 0)
    throw ConfigError(fmt::format(
        "{} = {}: must be >= 0", name("warmup_num_steps", "warmup_num_steps"), s.warmup_num_steps));
  const std::int64_t w = s.warmup_iterations();
  const auto total = name("total_num_steps", "total_num_steps");
  if (s.type == LrScheduleType::warmup_decay && s.total_num_steps < w)
    throw ConfigError(fmt::format(
        "{} = {}: must be >= the warmup, max(2, "
        "warmup_num_steps) = {}: after warmup the lr would drop straight to warmup_min_lr",
        total, s.total_num_steps, w));
  if (s.type == LrScheduleType::warmup_cosine && s.total_num_steps <= w)
    throw ConfigError(
        fmt::format("{} = {}: must be > the warmup, max(2, "
                    "warmup_num_steps) = {}: the cosine needs steps to decay over",
                    total, s.total_num_steps, w));
}

}  // namespace

void LrSchedule::validate() const {
  const auto fields = ConfigNames::fields("LrSchedule");
  validate_schedule(*this, fields, fields);
}

void LrSchedule::validate(std::string_view prefix) const {
  validate_schedule(*this, ConfigNames::keys(fmt::format("{}.", prefix)),
                    ConfigNames::keys("optimizer.params."));
}

}  // namespace shardswap
