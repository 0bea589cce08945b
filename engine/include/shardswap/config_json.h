// EngineConfig and the lr schedule from a DeepSpeed-style JSON config (keys mean what they mean in
// DeepSpeed), and the reports on the keys ShardSwap does not read: warnings for DeepSpeed's,
// errors for its own sections'.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardswap/batch_sizes.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine_config.h"
#include "shardswap/lr_schedule.h"

namespace shardswap {

/// ShardSwap's own sections: an unread key in them is an error (reject_unknown_keys), where an
/// unread key elsewhere, in DeepSpeed's part of the file, is a warning (config_warnings).
inline const std::vector<std::string> kShardSwapSections = {
    "model", "data", "layer_switching", "checkpoint", "logging", "shardswap"};

/// Reads bf16.enabled (or DeepSpeed's older bfloat16.enabled), fp16.{enabled, loss_scale,
/// initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale},
/// optimizer.{type, params.{lr, betas, eps, weight_decay, adam_w_mode, amsgrad, bias_correction,
/// momentum, dampening, nesterov}}, gradient_clipping, communication_data_type,
/// data_types.grad_accum_dtype, zero_optimization.{stage, reduce_bucket_size,
/// allgather_bucket_size (elements, as in DeepSpeed, also written as floats: 5e8), overlap_comm,
/// contiguous_gradients, reduce_scatter, allgather_partitions, round_robin_gradients} and
/// shardswap.alignment_bytes; the accumulation steps come from `batches`. Validates the result.
/// A key holding "auto" takes what Hugging Face's Trainer fills in from its defaults
/// (gradient_clipping 1.0, lr 5e-5, betas [0.9, 0.999], eps 1e-8, weight_decay 0, fp16 and bf16
/// false, which would be fp32: then bf16), zero_optimization.reduce_bucket_size
/// `model_hidden_size` squared (ShardSwap's default, warned, where it is not given).
/// Throws ConfigError "FILE: KEY = VALUE: what is wrong" (ConfigReader's shape, also for the
/// validators' errors, which it prefixes with the file); settings it accepts but cannot honour
/// exactly are recorded as warnings in the reader.
EngineConfig engine_config_from_json(ConfigReader& config, const BatchSizes& batches,
                                     std::optional<std::int64_t> model_hidden_size = std::nullopt);

/// Reads scheduler.{type, params}: WarmupLR, WarmupDecayLR, WarmupCosineLR with DeepSpeed's
/// parameters and defaults, except that warmup_max_lr defaults to `optimizer_lr` (DeepSpeed:
/// 0.001; a warning says so when they differ) and total_num_steps to the run's `steps`. No
/// scheduler section: the constant `optimizer_lr`. "auto" takes what Hugging Face's Trainer fills
/// in: warmup_min_lr 0, warmup_max_lr `optimizer_lr`, warmup_num_steps 0 (its default warmup),
/// total_num_steps the run's `steps`. Throws ConfigError "FILE: KEY = VALUE: what".
LrSchedule lr_schedule_from_json(ConfigReader& config, double optimizer_lr);

/// Every warning of the config, once all of it has been read, in one list for the caller to
/// print: the reader's (values "auto", settings accepted but not honoured exactly), then one per
/// unread key: a known DeepSpeed key ShardSwap does not implement (a whole unread sub-object such
/// as zero_optimization.offload_optimizer counts as one key) says what ShardSwap does instead;
/// any other unread key is named as unknown, with the likely intended key when there is one.
/// Each message is "FILE: KEY: what" or "FILE: KEY = VALUE: what", as the errors are.
std::vector<std::string> config_warnings(const ConfigReader& config);

/// Throws one ConfigError with a line "FILE: KEY: not a key of ShardSwap's section S" for every
/// unread key inside `sections` (normally
/// kShardSwapSections), with the likely intended key when there is one; known DeepSpeed keys that
/// share a section name (checkpoint.tag_validation, ...) are left to config_warnings. Call it
/// after everything has been read.
void reject_unknown_keys(const ConfigReader& config, const std::vector<std::string>& sections);

/// Throws one ConfigError with a line "--set 'KEY=VALUE': KEY: what" for every --set override
/// (ConfigReader::overrides) that sets a key, or a key under it, that nothing read: an override
/// that changes nothing is a mistake in any mode (with the likely intended key when there is
/// one). Call it after everything has been read.
void reject_unread_overrides(const ConfigReader& config);

/// Strict mode (`--strict`, shardswap.strict: true): throws one ConfigError listing every one of
/// `warnings` (config_warnings'), each on its own line after a first one saying why; nothing if
/// there are none.
void refuse_warnings(const ConfigReader& config, const std::vector<std::string>& warnings);

}  // namespace shardswap
