// The CPU backend of the optimizer kernels, on Eigen's bf16/fp16 host types. It computes as the
// CUDA kernels will (fp32 arithmetic, per-call scalars precomputed in double, one pass over each
// shard) so that it is the reference the other backends are tested against.
#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "memory/error.h"
#include "optimizer/optimizer.h"

namespace shardswap {

namespace {

// Calls f(T{}) with T the host type of a bit16 dtype; any other dtype is a caller's error.
template <class F>
decltype(auto) with_bit16(DType dtype, const char* fn, F&& f) {
  switch (dtype) {
    case DType::bf16:
      return f(bf16_t{});
    case DType::f16:
      return f(f16_t{});
    default:
      break;
  }
  throw ConfigError(fmt::format("cpu_kernels().{}: dtype {} is not a bit16 type (bf16 or fp16)", fn,
                                dtype_name(dtype)));
}

// Bits of the exponent field: all set means Inf or NaN.
template <class T>
constexpr std::uint16_t exponent_mask() {
  return std::is_same_v<T, bf16_t> ? 0x7F80 : 0x7C00;
}

void require_tensor(const void* p, const char* name, const ShardTensors& t) {
  if (p == nullptr) {
    throw ConfigError(
        fmt::format("cpu_kernels().update: {} is null for a shard of {} elements", name, t.count));
  }
}

// The fused update walks a shard in chunks small enough for their fp32 temporaries (the upcast
// gradient) to stay in L1: one pass over memory, while Eigen's array expressions vectorize the
// arithmetic (sqrt and division included, which plain loops do not without -fno-math-errno).
// Measured on Adam: about twice the speed of a plain per-element loop.
constexpr Eigen::Index kChunk = 512;
using ChunkF = Eigen::Array<float, Eigen::Dynamic, 1, 0, kChunk, 1>;  // on the stack
using MapF = Eigen::Map<Eigen::ArrayXf>;
template <class T>
using MapT = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using ConstMapT = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// Calls f(offset, n) for consecutive chunks covering [0, count).
template <class F>
void for_each_chunk(std::size_t count, F&& f) {
  for (std::size_t offset = 0; offset < count; offset += kChunk) {
    f(offset, static_cast<Eigen::Index>(std::min<std::size_t>(kChunk, count - offset)));
  }
}

// Adam and AdamW. Bias corrections are folded into two scalars as torch.optim.Adam does:
// master -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
template <class T>
void adam(const OptimizerConfig& c, const StepArgs& a, const ShardTensors& t) {
  const bool decoupled = c.type == OptimizerType::adamw;
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(a.step));
  const float beta1 = static_cast<float>(c.beta1);
  const float one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  const float beta2 = static_cast<float>(c.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  const float step_size = static_cast<float>(a.lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float eps = static_cast<float>(c.eps);
  // With no weight decay both terms below add exactly zero, so no branch is needed.
  const float l2 = decoupled ? 0.0f : static_cast<float>(a.weight_decay);
  const float lr_wd = decoupled ? static_cast<float>(a.lr * a.weight_decay) : 0.0f;

  for_each_chunk(t.count, [&](std::size_t at, Eigen::Index n) {
    MapF p(t.master + at, n), m(t.state0 + at, n), v(t.state1 + at, n);
    const ChunkF g =
        ConstMapT<T>(static_cast<const T*>(t.grad) + at, n).template cast<float>() * a.grad_scale +
        l2 * p;
    p -= lr_wd * p;
    m = beta1 * m + one_minus_beta1 * g;
    v = beta2 * v + one_minus_beta2 * g * g;
    p -= step_size * m / (v.sqrt() * inv_sqrt_bc2 + eps);
    // Eigen's float -> bf16/fp16 conversion rounds to nearest even.
    MapT<T>(static_cast<T*>(t.param) + at, n) = p.template cast<T>();
  });
}

// SGD as torch.optim.SGD: the momentum buffer starts as the first gradient (step 1), and
// dampening applies from the second step on.
template <class T>
void sgd(const OptimizerConfig& c, const StepArgs& a, const ShardTensors& t) {
  const bool has_momentum = c.momentum > 0;
  const bool first = a.step == 1;
  const float momentum = static_cast<float>(c.momentum);
  const float one_minus_dampening = static_cast<float>(1.0 - c.dampening);
  const float lr = static_cast<float>(a.lr);
  const float wd = static_cast<float>(a.weight_decay);

  for_each_chunk(t.count, [&](std::size_t at, Eigen::Index n) {
    MapF p(t.master + at, n);
    const ChunkF g =
        ConstMapT<T>(static_cast<const T*>(t.grad) + at, n).template cast<float>() * a.grad_scale +
        wd * p;
    if (!has_momentum) {
      p -= lr * g;
    } else {
      MapF buf(t.state0 + at, n);
      if (first) {
        buf = g;
      } else {
        buf = momentum * buf + one_minus_dampening * g;
      }
      if (c.nesterov) {
        p -= lr * (g + momentum * buf);
      } else {
        p -= lr * buf;
      }
    }
    MapT<T>(static_cast<T*>(t.param) + at, n) = p.template cast<T>();
  });
}

void update(const OptimizerConfig& config, const StepArgs& args, const ShardTensors& t) {
  with_bit16(t.dtype, "update", [&](auto tag) {
    using T = decltype(tag);
    if (t.count == 0) return;
    if (args.step < 1) {
      throw ConfigError(fmt::format(
          "cpu_kernels().update: step = {} must be >= 1 (the count after this update)", args.step));
    }
    require_tensor(t.master, "master", t);
    require_tensor(t.grad, "grad", t);
    require_tensor(t.param, "param", t);
    if (config.state_slots() >= 1) require_tensor(t.state0, "state0", t);
    if (config.state_slots() >= 2) require_tensor(t.state1, "state1", t);
    if (config.type == OptimizerType::sgd) {
      sgd<T>(config, args, t);
    } else {
      adam<T>(config, args, t);
    }
  });
}

double sum_squares(const void* data, DType dtype, std::size_t count, double scale) {
  return with_bit16(dtype, "sum_squares", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(data);
    double sum = 0.0;  // sequential order: the same input always gives the same bits
    for (std::size_t i = 0; i < count; ++i) {
      const double v = static_cast<double>(static_cast<float>(x[i])) * scale;
      sum += v * v;
    }
    return sum;
  });
}

bool has_inf_or_nan(const void* data, DType dtype, std::size_t count) {
  return with_bit16(dtype, "has_inf_or_nan", [&](auto tag) {
    using T = decltype(tag);
    constexpr std::uint16_t mask = exponent_mask<T>();
    const T* x = static_cast<const T*>(data);
    // No early exit: a branch-free OR over the bits vectorizes, and overflow is the rare case.
    bool found = false;
    for (std::size_t i = 0; i < count; ++i) {
      found |= (std::bit_cast<std::uint16_t>(x[i]) & mask) == mask;
    }
    return found;
  });
}

void cast_to_bit16(const float* src, void* dst, DType dtype, std::size_t count) {
  with_bit16(dtype, "cast_to_bit16", [&](auto tag) {
    using T = decltype(tag);
    const auto n = static_cast<Eigen::Index>(count);
    MapT<T>(static_cast<T*>(dst), n) = Eigen::Map<const Eigen::ArrayXf>(src, n).cast<T>();
  });
}

void cast_from_bit16(const void* src, float* dst, DType dtype, std::size_t count) {
  with_bit16(dtype, "cast_from_bit16", [&](auto tag) {
    using T = decltype(tag);
    const auto n = static_cast<Eigen::Index>(count);
    MapF(dst, n) = ConstMapT<T>(static_cast<const T*>(src), n).template cast<float>();
  });
}

void accumulate_bit16(void* dst, const void* src, DType dtype, std::size_t count) {
  with_bit16(dtype, "accumulate_bit16", [&](auto tag) {
    using T = decltype(tag);
    const auto n = static_cast<Eigen::Index>(count);
    MapT<T> out(static_cast<T*>(dst), n);
    out = (out.template cast<float>() +
           ConstMapT<T>(static_cast<const T*>(src), n).template cast<float>())
              .template cast<T>();
  });
}

// memset/memcpy with a null pointer are undefined even for zero bytes, hence the guards.
void fill_zero(void* dst, std::size_t bytes) {
  if (bytes > 0) std::memset(dst, 0, bytes);
}

void copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

}  // namespace

const OptimizerKernels& cpu_kernels() {
  static const OptimizerKernels table{
      update,          sum_squares,      has_inf_or_nan, cast_to_bit16,
      cast_from_bit16, accumulate_bit16, fill_zero,      copy};
  return table;
}

}  // namespace shardswap
