// Learning-rate schedules with DeepSpeed's meaning (WarmupLR, WarmupDecayLR, WarmupCosineLR), as a
// value: the lr of an update is a pure function of how many updates came before it, so every rank
// and a resumed run compute the same lr without carrying scheduler state.
#pragma once

#include <cstdint>
#include <string_view>

namespace shardswap {

enum class LrScheduleType {
  constant,      ///< no scheduler: peak_lr throughout
  warmup,        ///< DeepSpeed's WarmupLR: warm up, then hold peak_lr
  warmup_decay,  ///< WarmupDecayLR: warm up, then fall linearly to warmup_min_lr at total_num_steps
  warmup_cosine,  ///< WarmupCosineLR: warm up, then a half cosine to cos_min_ratio * peak_lr
};

/// How warmup rises from its start to peak_lr over W = max(2, warmup_num_steps) iterations:
/// log: fraction ln(i + 1) / ln(W); linear: fraction i / W (i = 0 .. W-1).
enum class WarmupCurve { log, linear };

/// "WarmupLR", "WarmupDecayLR", "WarmupCosineLR" (DeepSpeed's spelling, exact). Throws ConfigError
/// "KEY = \"NAME\": ..." listing the accepted names otherwise.
LrScheduleType lr_schedule_type_from_name(std::string_view name, std::string_view key);
const char* lr_schedule_type_name(LrScheduleType type);
/// "log" or "linear". Throws ConfigError "KEY = \"NAME\": ..." otherwise (DeepSpeed silently
/// uses log).
WarmupCurve warmup_curve_from_name(std::string_view name, std::string_view key);

struct LrSchedule {
  LrScheduleType type = LrScheduleType::constant;
  /// The lr at the end of warmup: constant: the lr; WarmupLR, WarmupDecayLR: warmup_max_lr;
  /// WarmupCosineLR: the optimizer's lr, which its ratios multiply.
  double peak_lr = 1e-3;
  double warmup_min_lr = 0.0;     ///< WarmupLR, WarmupDecayLR: lr at the start of warmup
  double warmup_min_ratio = 0.0;  ///< WarmupCosineLR: start lr / peak_lr
  double cos_min_ratio = 1e-4;    ///< WarmupCosineLR: final lr / peak_lr
  /// As written in the config; the schedules use max(2, this), as DeepSpeed does.
  std::int64_t warmup_num_steps = 1000;
  WarmupCurve warmup_type = WarmupCurve::log;
  std::int64_t total_num_steps = 0;  ///< WarmupDecayLR, WarmupCosineLR: where the decay ends

  /// The lr of update `update` (0 for the first; count applied updates only, as DeepSpeed does
  /// not advance its scheduler on an fp16 step skipped for overflow). DeepSpeed steps its
  /// scheduler after each update, so update k uses the schedule's value at iteration k - 1 and
  /// updates 0 and 1 both use its starting value; lr_at reproduces that sequence. Throws
  /// ConfigError for update < 0.
  double lr_at(std::int64_t update) const;

  /// The effective warmup length, max(2, warmup_num_steps).
  std::int64_t warmup_iterations() const;

  /// Throws ConfigError "NAME = VALUE: must be ...", NAME the field ("LrSchedule.peak_lr"),
  /// for: an lr or ratio negative or not finite, a ratio above 1, warmup_num_steps < 0, and for
  /// the decaying schedules total_num_steps < the effective warmup (WarmupDecayLR) or <= it
  /// (WarmupCosineLR; DeepSpeed divides by zero there).
  void validate() const;
  /// The same, naming the JSON key under `prefix` ("scheduler.params" gives
  /// "scheduler.params.warmup_max_lr"; the peak of WarmupCosineLR and the constant lr are
  /// "optimizer.params.lr"): for a config read from JSON.
  void validate(std::string_view prefix) const;
};

}  // namespace shardswap
