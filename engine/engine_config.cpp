#include "shardswap/engine_config.h"
#include "memory/quoted.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "shardswap/error.h"

namespace shardswap {

NonFinitePolicy nonfinite_policy_from_name(std::string_view name, std::string_view key) {
  if (name == "skip") return NonFinitePolicy::skip;
  if (name == "error") return NonFinitePolicy::error;
  throw ConfigError(fmt::format("{} = {}: expected skip or error", key, quote_value(name)));
}

const char* nonfinite_policy_name(NonFinitePolicy policy) {
  return policy == NonFinitePolicy::error ? "error" : "skip";
}

void EngineConfig::validate(std::string_view prefix) const {
  const auto key = [&](std::string_view name) { return fmt::format("{}{}", prefix, name); };
  // "KEY = VALUE: why", the shape of every config error; the JSON reader adds the file.
  const auto fail = [&](std::string_view name, const std::string& value, std::string_view why) {
    throw ConfigError(fmt::format("{} = {}: {}", key(name), value, why));
  };
    if (stage != 1 && stage != 2)
    fail("zero_optimization.stage", fmt::format("{}", stage),
         "ShardSwap implements stages 1 and 2");
  if (!is_bit16(dtype))
    fail("dtype", quote_value(dtype_name(dtype)), "params and gradients must be bf16 or fp16");
  const DType grads = grad_type(), comm = comm_type();
  if (grads != dtype && grads != DType::f32)
    fail("data_types.grad_accum_dtype", quote_value(dtype_name(grads)),
         fmt::format("gradients are kept in the param type ({}) or fp32", dtype_name(dtype)));
  if (comm == DType::f64 || (is_bit16(grads) && comm != grads))
    fail("communication_data_type", quote_value(dtype_name(comm)),
         fmt::format("with {} gradients communication is in {}; compression to bf16/fp16 "
                     "needs fp32 gradients (data_types.grad_accum_dtype = fp32)",
                     dtype_name(grads), dtype_name(grads)));
  if (alignment_bytes == 0 || (alignment_bytes & (alignment_bytes - 1)) != 0 ||
      alignment_bytes < dtype_size(dtype))
    fail("shardswap.alignment_bytes", fmt::format("{} bytes", alignment_bytes),
         fmt::format("must be a power of two >= {} bytes (the element size)", dtype_size(dtype)));
  if (reduce_bucket_bytes < alignment_bytes) {
    // The JSON key counts elements of the gradient type; the field holds bytes: show both.
    const std::size_t element = dtype_size(grads);
    fail("zero_optimization.reduce_bucket_size",
         fmt::format("{} elements", reduce_bucket_bytes / element),
         fmt::format("{} bytes of {} gradients is smaller than the alignment ({} bytes)",
                     reduce_bucket_bytes, dtype_name(grads), alignment_bytes));
  }
  if (gradient_accumulation_steps < 1)
    fail("gradient_accumulation_steps", fmt::format("{}", gradient_accumulation_steps),
         "must be >= 1");
  if (!(gradient_clipping >= 0.0) || !std::isfinite(gradient_clipping))
    fail("gradient_clipping", fmt::format("{}", gradient_clipping), "must be finite and >= 0");
  if (dtype == DType::f16 && nonfinite != NonFinitePolicy::skip)
    fail("shardswap.nonfinite", quote_value(nonfinite_policy_name(nonfinite)),
         "applies to bf16 only: under fp16 Inf/NaN gradients are the loss scaler's overflow "
         "signal, and the step is always skipped");
  optimizer.validate(fmt::format("{}optimizer.params", prefix));
  if (dtype == DType::f16) loss_scale.validate(fmt::format("{}fp16", prefix));
}

}  // namespace shardswap
