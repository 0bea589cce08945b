// Optimizer names, config validation and the backend-independent scalars (state slots, clipping,
// the per-call scalars of the fused update).
#include "optimizer/optimizer.h"
#include "optimizer/config_names.h"
#include "optimizer/kernel_checks.h"
#include "support/quoted.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>

#include "shardswap/error.h"
#include "optimizer/update_scalars.h"

namespace shardswap {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// Throws unless `ok`; written so that callers state the condition that must hold, which makes a
// NaN (for which every comparison is false) fail too.
void require(bool ok, const std::string& name, double value, std::string_view rule) {
  if (!ok) throw ConfigError(fmt::format("{} = {}: must be {}", name, value, rule));
}

}  // namespace

OptimizerType optimizer_type_from_name(std::string_view name, std::string_view key) {
  const std::string l = lower(name);
  if (l == "adam") return OptimizerType::adam;
  if (l == "adamw") return OptimizerType::adamw;
  if (l == "sgd") return OptimizerType::sgd;
  throw ConfigError(
      fmt::format("{} = {}: unknown optimizer type; expected Adam, AdamW or SGD", key, quote_value(name)));
}

const char* optimizer_type_name(OptimizerType type) {
  switch (type) {
    case OptimizerType::adam:
      return "Adam";
    case OptimizerType::adamw:
      return "AdamW";
    case OptimizerType::sgd:
      return "SGD";
  }
  return "?";
}

const char* master_storage_name(MasterStorage storage) {
  return storage == MasterStorage::fp32 ? "fp32" : "bf16_remainder";
}

// Keys follow the DeepSpeed / torch.optim JSON spelling: "betas" is a pair, so beta1 and beta2
// are named "betas[0]" and "betas[1]" (fields: beta1, beta2).
void validate_optimizer_config(const OptimizerConfig& c, const ConfigNames& name) {
  require(std::isfinite(c.lr), name("lr", "lr"), c.lr, "finite");
  require(c.lr >= 0, name("lr", "lr"), c.lr, ">= 0");
  require(c.beta1 >= 0 && c.beta1 < 1, name("betas[0]", "beta1"), c.beta1, "in [0, 1)");
  require(c.beta2 >= 0 && c.beta2 < 1, name("betas[1]", "beta2"), c.beta2, "in [0, 1)");
  require(std::isfinite(c.eps), name("eps", "eps"), c.eps, "finite");
  require(c.eps > 0, name("eps", "eps"), c.eps, "> 0");
  require(std::isfinite(c.weight_decay), name("weight_decay", "weight_decay"), c.weight_decay,
          "finite");
  require(c.weight_decay >= 0, name("weight_decay", "weight_decay"), c.weight_decay, ">= 0");
  require(std::isfinite(c.momentum), name("momentum", "momentum"), c.momentum, "finite");
  require(c.momentum >= 0, name("momentum", "momentum"), c.momentum, ">= 0");
  require(c.dampening >= 0 && c.dampening <= 1, name("dampening", "dampening"), c.dampening,
          "in [0, 1]");
  if (c.state_dtype != DType::f32 && c.state_dtype != DType::bf16)
    throw ConfigError(fmt::format("{} = {}: must be fp32 or bf16",
                                  name("state_dtype", "state_dtype"), dtype_name(c.state_dtype)));
  if (c.nesterov && !(c.momentum > 0 && c.dampening == 0)) {
    throw ConfigError(fmt::format("{} = true: needs {} > 0 (got {}) and {} = 0 (got {})",
                                  name("nesterov", "nesterov"), name("momentum", "momentum"),
                                  c.momentum, name("dampening", "dampening"), c.dampening));
  }
}

void OptimizerConfig::validate() const {
  validate_optimizer_config(*this, ConfigNames::fields("OptimizerConfig"));
}

void OptimizerConfig::validate(std::string_view prefix) const {
  validate_optimizer_config(*this, ConfigNames::keys(fmt::format("{}.", prefix)));
}

int OptimizerConfig::state_slots() const {
  switch (type) {
    case OptimizerType::adam:
    case OptimizerType::adamw:
      return 2;
    case OptimizerType::sgd:
      return momentum > 0 ? 1 : 0;
  }
  return 0;
}

AdamScalars adam_scalars(const OptimizerConfig& c, const StepArgs& a) {
  const bool decoupled = c.type == OptimizerType::adamw;
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(a.step));
  AdamScalars s;
  s.beta1 = static_cast<float>(c.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  s.step_size = static_cast<float>(a.lr / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = static_cast<float>(c.eps);
  s.l2 = decoupled ? 0.0f : static_cast<float>(a.weight_decay);
  s.lr_wd = decoupled ? static_cast<float>(a.lr * a.weight_decay) : 0.0f;
  s.grad_scale = a.grad_scale;
  return s;
}

SgdScalars sgd_scalars(const OptimizerConfig& c, const StepArgs& a) {
  SgdScalars s;
  s.momentum = static_cast<float>(c.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - c.dampening);
  s.lr = static_cast<float>(a.lr);
  s.wd = static_cast<float>(a.weight_decay);
  s.grad_scale = a.grad_scale;
  s.has_momentum = c.momentum > 0;
  s.first = a.step == 1;
  s.nesterov = c.nesterov;
  return s;
}

double clip_coefficient(double total_norm, double max_norm) {
  // The 1e-6 matches torch.nn.utils.clip_grad_norm_; a NaN norm fails the test and gives 1 (an
  // overflowed step is skipped elsewhere, not clipped).
  if (max_norm > 0 && total_norm > max_norm) return max_norm / (total_norm + 1e-6);
  return 1.0;
}

namespace detail {

void require_data(const void* p, const char* fn, const char* name, std::size_t count,
                  const char* unit) {
  if (p == nullptr)
    throw ConfigError(fmt::format("{}: {} is null for {} {}", fn, name, count, unit));
}

void check_squares(const char* fn, const ConstSpan* spans, std::size_t n, const double* sums) {
  if (n == 0) return;
  require_data(spans, fn, "spans", n, "spans");
  require_data(sums, fn, "sums", n, "spans");
  for (std::size_t i = 0; i < n; ++i)
    if (spans[i].count > 0)
      require_data(spans[i].data, fn, fmt::format("spans[{}].data", i).c_str(), spans[i].count);
}

bool check_update(const char* fn, const OptimizerConfig& config, const StepArgs& args,
                  const ShardTensors& t) {
  if (!is_bit16(t.dtype))
    throw ConfigError(
        fmt::format("{}: dtype {} is not a bit16 type (bf16 or fp16)", fn, dtype_name(t.dtype)));
  // A bf16 gradient with fp16 params (say, from a forgotten grad_dtype) is refused, not misread.
  if (t.grad_dtype != t.dtype && t.grad_dtype != DType::f32)
    throw ConfigError(
        fmt::format("{}: grad dtype {} does not go with param dtype {}: gradients "
                    "are {} or fp32",
                    fn, dtype_name(t.grad_dtype), dtype_name(t.dtype), dtype_name(t.dtype)));
  if (t.state_dtype != DType::f32 && t.state_dtype != DType::bf16)
    throw ConfigError(fmt::format("{}: state dtype {} is not fp32 or bf16", fn,
                                  dtype_name(t.state_dtype)));
  const bool low = config.master == MasterStorage::bf16_remainder;
  if (low && t.dtype != DType::bf16)
    throw ConfigError(fmt::format("{}: master kept as bf16_remainder needs bf16 params, not {}", fn,
                                  dtype_name(t.dtype)));
  if (t.count == 0) return false;
  if (args.step < 1)
    throw ConfigError(
        fmt::format("{}: step = {} must be >= 1 (the count after this update)", fn, args.step));
  const auto shard = [&](const void* p, const char* name) {
    require_data(p, fn, name, t.count, "elements of a shard");
  };
  if (low)
    shard(t.master_low, "master_low");
  else
    shard(t.master, "master");
  shard(t.grad, "grad");
  shard(t.param, "param");
  if (config.state_slots() >= 1) shard(t.state0, "state0");
  if (config.state_slots() >= 2) shard(t.state1, "state1");
  return true;
}

bool check_streamed(const char* fn, const OptimizerConfig& config, const StreamedTensors& s) {
  bool any = false;
  for (const StreamedPiece& p : s.pieces) {
    any |= check_update(fn, config, p.args, p.t);
    // The slots hold one state dtype: every piece must have it.
    if (p.t.state_dtype != s.pieces.front().t.state_dtype)
      throw ConfigError(fmt::format("{}: pieces of state dtypes {} and {}: the slots hold one", fn,
                                    dtype_name(s.pieces.front().t.state_dtype),
                                    dtype_name(p.t.state_dtype)));
  }
  if (!any) return false;
  if (s.chunk == 0) throw ConfigError(fmt::format("{}: chunk = 0 elements: must be >= 1", fn));
  for (int slot = 0; slot < 2; ++slot) {
    require_data(s.slot_master[slot], fn, "slot_master", s.chunk);
    if (config.state_slots() >= 1) require_data(s.slot_state0[slot], fn, "slot_state0", s.chunk);
    if (config.state_slots() >= 2) require_data(s.slot_state1[slot], fn, "slot_state1", s.chunk);
    if (s.slot_grad[0] != nullptr || s.slot_grad[1] != nullptr)
      require_data(s.slot_grad[slot], fn, "slot_grad", s.chunk);
  }
  return true;
}

}  // namespace detail

}  // namespace shardswap
