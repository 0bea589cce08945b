#include "shardswap/engine_config.h"
#include "support/quoted.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "optimizer/config_names.h"
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

const char* placement_name(Placement placement) {
  return placement == Placement::host ? "host" : "device";
}

OffloadUpdate offload_update_from_name(std::string_view name, std::string_view key) {
  if (name == "streamed") return OffloadUpdate::streamed;
  if (name == "cpu") return OffloadUpdate::cpu;
  throw ConfigError(fmt::format("{} = {}: expected streamed or cpu", key, quote_value(name)));
}

const char* offload_update_name(OffloadUpdate way) {
  return way == OffloadUpdate::cpu ? "cpu" : "streamed";
}

namespace {

void validate_engine_config(const EngineConfig& c, const ConfigNames& name) {
  // "NAME = VALUE: why", the shape of every config error; the JSON reader adds the file.
  const auto fail = [&](std::string_view json_key, std::string_view field, const std::string& value,
                        std::string_view why) {
    throw ConfigError(fmt::format("{} = {}: {}", name(json_key, field), value, why));
  };
  if (c.stage != 1 && c.stage != 2)
    fail("zero_optimization.stage", "stage", fmt::format("{}", c.stage),
         "ShardSwap implements stages 1 and 2");
  // The JSON gives the dtype as bf16.enabled / fp16.enabled: named "dtype" either way.
  if (!is_bit16(c.dtype))
    fail("dtype", "dtype", quote_value(dtype_name(c.dtype)),
         "params and gradients must be bf16 or fp16");
  const DType grads = c.grad_type(), comm = c.comm_type();
  if (grads != c.dtype && grads != DType::f32)
    fail("data_types.grad_accum_dtype", "grad_dtype", quote_value(dtype_name(grads)),
         fmt::format("gradients are kept in the param type ({}) or fp32", dtype_name(c.dtype)));
  if (comm == DType::f64 || (is_bit16(grads) && comm != grads))
    fail("communication_data_type", "comm_dtype", quote_value(dtype_name(comm)),
         fmt::format("with {} gradients communication is in {}; compression to bf16/fp16 "
                     "needs fp32 gradients ({} = fp32)",
                     dtype_name(grads), dtype_name(grads),
                     name("data_types.grad_accum_dtype", "grad_dtype")));
  if (c.alignment_bytes == 0 || (c.alignment_bytes & (c.alignment_bytes - 1)) != 0 ||
      c.alignment_bytes < dtype_size(c.dtype))
    fail("shardswap.alignment_bytes", "alignment_bytes", fmt::format("{} bytes", c.alignment_bytes),
         fmt::format("must be a power of two >= {} bytes (the element size)", dtype_size(c.dtype)));
  if (c.reduce_bucket_bytes < c.alignment_bytes) {
    // The JSON key counts elements of the gradient type, the field bytes: each in its own unit.
    const std::size_t element = dtype_size(grads);
    fail("zero_optimization.reduce_bucket_size", "reduce_bucket_bytes",
         name.json ? fmt::format("{} elements", c.reduce_bucket_bytes / element)
                   : fmt::format("{} bytes", c.reduce_bucket_bytes),
         name.json ? fmt::format("{} bytes of {} gradients is smaller than the alignment ({} "
                                 "bytes)",
                                 c.reduce_bucket_bytes, dtype_name(grads), c.alignment_bytes)
                   : fmt::format("is smaller than alignment_bytes = {}", c.alignment_bytes));
  }
  if (c.gradient_accumulation_steps < 1)
    fail("gradient_accumulation_steps", "gradient_accumulation_steps",
         fmt::format("{}", c.gradient_accumulation_steps), "must be >= 1");
  if (!(c.gradient_clipping >= 0.0) || !std::isfinite(c.gradient_clipping))
    fail("gradient_clipping", "gradient_clipping", fmt::format("{}", c.gradient_clipping),
         "must be finite and >= 0");
  if (c.dtype == DType::f16 && c.nonfinite != NonFinitePolicy::skip)
    fail("shardswap.nonfinite", "nonfinite", quote_value(nonfinite_policy_name(c.nonfinite)),
         "applies to bf16 only: under fp16 Inf/NaN gradients are the loss scaler's overflow "
         "signal, and the step is always skipped");
  if (c.offload_chunk_elements == 0)
    fail("shardswap.offload_chunk_elements", "offload_chunk_elements", "0", "must be >= 1");
  // The step reads host gradients through the update's device slots, which only an update of
  // state on the host has.
  if (c.gradient_placement == Placement::host && c.optimizer_placement != Placement::host)
    fail("shardswap.gradient_placement", "gradient_placement", quote_value("host"),
         fmt::format("gradients on the host need the optimizer state there too ({} = {})",
                     name("zero_optimization.offload_optimizer.device", "optimizer_placement"),
                     name.json ? quote_value("cpu") : quote_value("host")));
  // An update of state on the host waits for its copies on the host: nothing is left to overlap.
  if (c.overlap_update && c.optimizer_placement == Placement::host)
    fail("shardswap.overlap_update", "overlap_update", "true",
         fmt::format("the update overlaps the next forward only with the optimizer state on the "
                     "device ({} = {})",
                     name("zero_optimization.offload_optimizer.device", "optimizer_placement"),
                     name.json ? quote_value("cpu") : quote_value("host")));
  validate_optimizer_config(c.optimizer, name.nested("optimizer.params", "optimizer"));
  // The weight is the master's high half: the master can only be split beside bf16 weights.
  if (c.optimizer.master == MasterStorage::bf16_remainder && c.dtype != DType::bf16)
    fail("shardswap.master_weights", "optimizer.master", quote_value("bf16_remainder"),
         fmt::format("the master's high half is the bf16 weight: needs bf16 params, not {}",
                     dtype_name(c.dtype)));
  if (c.dtype == DType::f16)
    validate_loss_scale_config(c.loss_scale, name.nested("fp16", "loss_scale"));
}

}  // namespace

void EngineConfig::validate() const {
  validate_engine_config(*this, ConfigNames::fields("EngineConfig"));
}

void EngineConfig::validate(std::string_view prefix) const {
  validate_engine_config(*this, ConfigNames::keys(prefix));
}

}  // namespace shardswap
