#include "engine/config_json.h"

#include <fmt/format.h>

#include <cmath>

#include "memory/error.h"

namespace shardswap {

namespace {

EngineConfig read(ConfigReader& c) {
  EngineConfig cfg;
  const bool bf16 = c.boolean("bf16.enabled", false);
  const bool fp16 = c.boolean("fp16.enabled", false);
  if (bf16 && fp16) c.fail("bf16.enabled", "and fp16.enabled cannot both be true");
  if (!bf16 && !fp16)
    c.fail("bf16.enabled", "or fp16.enabled must be true: ShardSwap trains bit16 params only");
  cfg.dtype = bf16 ? DType::bf16 : DType::f16;
  cfg.grad_dtype = dtype_from_name(c.string("data_types.grad_accum_dtype", dtype_name(cfg.dtype)),
                                   "data_types.grad_accum_dtype");
  cfg.comm_dtype = dtype_from_name(c.string("communication_data_type", dtype_name(cfg.grad_type())),
                                   "communication_data_type");

  if (fp16) {
    const double loss_scale = c.number("fp16.loss_scale", 0.0);
    cfg.loss_scale.dynamic = loss_scale == 0.0;
    cfg.loss_scale.static_scale = loss_scale;
    const auto power = c.integer("fp16.initial_scale_power", 16);
    if (power < 0 || power > 64)
      c.fail("fp16.initial_scale_power", fmt::format("= {} must lie in [0, 64]", power));
    cfg.loss_scale.initial_scale = std::ldexp(1.0, static_cast<int>(power));
    cfg.loss_scale.window = static_cast<int>(c.integer("fp16.loss_scale_window", 1000));
    cfg.loss_scale.hysteresis = static_cast<int>(c.integer("fp16.hysteresis", 2));
    cfg.loss_scale.min_scale = c.number("fp16.min_loss_scale", 1.0);
  }

  cfg.optimizer.type =
      optimizer_type_from_name(c.string("optimizer.type", "AdamW"), "optimizer.type");
  cfg.optimizer.lr = c.number("optimizer.params.lr", 1e-3);
  const auto betas = c.numbers("optimizer.params.betas", {0.9, 0.999});
  if (betas.size() != 2) c.fail("optimizer.params.betas", "must hold two numbers");
  cfg.optimizer.beta1 = betas[0];
  cfg.optimizer.beta2 = betas[1];
  cfg.optimizer.eps = c.number("optimizer.params.eps", 1e-8);
  cfg.optimizer.weight_decay = c.number("optimizer.params.weight_decay", 0.0);
  cfg.optimizer.momentum = c.number("optimizer.params.momentum", 0.0);
  cfg.optimizer.dampening = c.number("optimizer.params.dampening", 0.0);
  cfg.optimizer.nesterov = c.boolean("optimizer.params.nesterov", false);

  cfg.gradient_clipping = c.number("gradient_clipping", 0.0);
  const auto accumulation = c.integer("gradient_accumulation_steps", 1);
  if (accumulation < 1)
    c.fail("gradient_accumulation_steps", fmt::format("= {} must be >= 1", accumulation));
  cfg.gradient_accumulation_steps = static_cast<int>(accumulation);

  cfg.stage = static_cast<int>(c.integer("zero_optimization.stage", 2));
  const auto bucket = c.integer("zero_optimization.reduce_bucket_size", 500'000'000);
  if (bucket < 1)
    c.fail("zero_optimization.reduce_bucket_size", fmt::format("= {} must be >= 1", bucket));
  cfg.reduce_bucket_bytes = static_cast<std::size_t>(bucket) * dtype_size(cfg.grad_type());
  cfg.order = c.boolean("zero_optimization.round_robin_gradients", false)
                  ? LayoutOrder::round_robin
                  : LayoutOrder::declaration;
  const auto alignment = c.integer("shardswap.alignment_bytes", 256);
  if (alignment < 1)
    c.fail("shardswap.alignment_bytes", fmt::format("= {} must be >= 1", alignment));
  cfg.alignment_bytes = static_cast<std::size_t>(alignment);
  cfg.validate();
  return cfg;
}

}  // namespace

EngineConfig engine_config_from_json(ConfigReader& c) {
  try {
    return read(c);
  } catch (const ConfigError& e) {
    // Errors from validators below know the key but not the file: add it.
    const std::string what = e.what();
    if (what.find(c.source()) != std::string::npos) throw;
    throw ConfigError(fmt::format("config {}: {}", c.source(), what));
  }
}

}  // namespace shardswap
