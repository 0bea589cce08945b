#include "shardswap/engine_config.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "shardswap/error.h"

namespace shardswap {

NonFinitePolicy nonfinite_policy_from_name(std::string_view name, std::string_view key) {
  if (name == "skip") return NonFinitePolicy::skip;
  if (name == "error") return NonFinitePolicy::error;
  throw ConfigError(fmt::format("{} = '{}': expected skip or error", key, name));
}

const char* nonfinite_policy_name(NonFinitePolicy policy) {
  return policy == NonFinitePolicy::error ? "error" : "skip";
}

void EngineConfig::validate(std::string_view prefix) const {
  const auto key = [&](std::string_view name) { return fmt::format("{}{}", prefix, name); };
  const auto fail = [&](std::string_view name, const std::string& why) {
    throw ConfigError(fmt::format("EngineConfig::validate: {} {}", key(name), why));
  };
  if (stage != 1 && stage != 2)
    fail("zero_optimization.stage",
         fmt::format("= {}: ShardSwap implements stages 1 and 2", stage));
  if (!is_bit16(dtype))
    fail("dtype",
         fmt::format("= {}: params and gradients must be bf16 or fp16", dtype_name(dtype)));
  const DType grads = grad_type(), comm = comm_type();
  if (grads != dtype && grads != DType::f32)
    fail("data_types.grad_accum_dtype",
         fmt::format("= {}: gradients are kept in the param type ({}) or fp32", dtype_name(grads),
                     dtype_name(dtype)));
  if (comm == DType::f64 || (is_bit16(grads) && comm != grads))
    fail("communication_data_type",
         fmt::format("= {}: with {} gradients communication is in {}; compression to bf16/fp16 "
                     "needs fp32 gradients (data_types.grad_accum_dtype = fp32)",
                     dtype_name(comm), dtype_name(grads), dtype_name(grads)));
  if (alignment_bytes == 0 || (alignment_bytes & (alignment_bytes - 1)) != 0 ||
      alignment_bytes < dtype_size(dtype))
    fail("alignment_bytes", fmt::format("= {} must be a power of two >= {} (the element size)",
                                        alignment_bytes, dtype_size(dtype)));
  if (reduce_bucket_bytes < alignment_bytes)
    fail("zero_optimization.reduce_bucket_size",
         fmt::format("= {} bytes is smaller than the alignment ({} bytes)", reduce_bucket_bytes,
                     alignment_bytes));
  if (gradient_accumulation_steps < 1)
    fail("gradient_accumulation_steps",
         fmt::format("= {} must be >= 1", gradient_accumulation_steps));
  if (!(gradient_clipping >= 0.0) || !std::isfinite(gradient_clipping))
    fail("gradient_clipping", fmt::format("= {} must be finite and >= 0", gradient_clipping));
  if (dtype == DType::f16 && nonfinite != NonFinitePolicy::skip)
    fail("shardswap.nonfinite",
         "= error applies to bf16 only: under fp16 Inf/NaN gradients are the loss scaler's "
         "overflow signal, and the step is always skipped");
  optimizer.validate(fmt::format("{}optimizer.params", prefix));
  if (dtype == DType::f16) loss_scale.validate(fmt::format("{}fp16", prefix));
}

}  // namespace shardswap
