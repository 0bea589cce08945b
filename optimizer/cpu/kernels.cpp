// The CPU backend of the optimizer kernels, on Eigen's bf16/fp16 host types. It computes as the
// CUDA kernels do (fp32 arithmetic, the per-call scalars of update_scalars.h, one pass over each
// shard) so that it is the reference the other backends are tested against.

// The same bits as the CUDA kernels (offloaded and on-device runs must agree, issue 31): Eigen's
// default EIGEN_FAST_MATH=1 makes a vector sqrt an rsqrt approximation and one Newton step, not
// correctly rounded as __fsqrt_rn is. Before any Eigen header. This file is also compiled with
// -ffp-contract=off (optimizer/CMakeLists.txt): no multiply is fused into an add that the CUDA
// kernels round apart. Nothing else here uses a function that the macro changes. Eigen's packet
// functions are inline with external linkage: should another file of a program use a vector float
// sqrt under the default, an unoptimized build could link its approximate copy in here (no other
// file does today); tests/optimizer_test.cpp's bit-for-bit tests would then fail.
#define EIGEN_FAST_MATH 0

#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "shardswap/error.h"
#include "memory/host_types.h"
#include "optimizer/kernel_checks.h"
#include "optimizer/master_split.h"
#include "optimizer/optimizer.h"
#include "optimizer/update_scalars.h"

namespace shardswap {

namespace {

// Calls f(T{}) with T the host type of a bit16 dtype (a param); any other dtype is a caller's
// error.
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
  throw ConfigError(fmt::format("cpu_device_ops().{}: dtype {} is not a bit16 type (bf16 or fp16)", fn,
                                dtype_name(dtype)));
}

// Calls f(T{}) with T the host type of fp32, bf16 or fp16 (gradients, casts, reductions).
template <class F>
decltype(auto) with_any(DType dtype, const char* fn, F&& f) {
  switch (dtype) {
    case DType::f32:
      return f(float{});
    case DType::bf16:
      return f(bf16_t{});
    case DType::f16:
      return f(f16_t{});
    default:
      break;
  }
  throw ConfigError(
      fmt::format("cpu_device_ops().{}: dtype {} is not fp32, bf16 or fp16", fn, dtype_name(dtype)));
}

// The bits of T's exponent field: all set means Inf or NaN.
template <class T>
using BitsOf = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>;
template <class T>
constexpr BitsOf<T> exponent_mask() {
  if constexpr (std::is_same_v<T, float>) return 0x7F800000u;
  if constexpr (std::is_same_v<T, bf16_t>) return 0x7F80;
  return 0x7C00;
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

// The fp32 masters of elements [at, at + n): stored as they are, or (Low: MasterStorage::
// bf16_remainder) joined from the bf16 weight and the low halves (master_split.h).
template <bool Low>
ChunkF load_master(const ShardTensors& t, std::size_t at, Eigen::Index n) {
  if constexpr (Low) {
    ChunkF p(n);
    const auto* weight = static_cast<const std::uint16_t*>(t.param) + at;
    const std::uint16_t* low = t.master_low + at;
    for (Eigen::Index i = 0; i < n; ++i)
      p[i] = std::bit_cast<float>(detail::join_master(weight[i], low[i]));
    return p;
  } else {
    return MapF(t.master + at, n);
  }
}

// Writes the updated masters of elements [at, at + n) and the param of type T: the master and
// the param rounded to nearest even, or (Low) the two halves the master splits into.
template <bool Low, class T>
void store_master(const ShardTensors& t, std::size_t at, Eigen::Index n, const ChunkF& p) {
  if constexpr (Low) {
    auto* weight = static_cast<std::uint16_t*>(t.param) + at;
    std::uint16_t* low = t.master_low + at;
    for (Eigen::Index i = 0; i < n; ++i) {
      const detail::MasterHalves h = detail::split_master(std::bit_cast<std::uint32_t>(p[i]));
      weight[i] = h.weight;
      low[i] = h.low;
    }
  } else {
    MapF(t.master + at, n) = p;
    // Eigen's float -> bf16/fp16 conversion rounds to nearest even.
    MapT<T>(static_cast<T*>(t.param) + at, n) = p.template cast<T>();
  }
}

// Adam and AdamW with param type T, gradient type G, state type S (float, or bf16_t: read into
// fp32, stored rounded; formulas in update_scalars.h) and the master as fp32 or (Low) halves.
template <class T, class G, class S, bool Low>
void adam(const AdamScalars& s, const ShardTensors& t) {
  for_each_chunk(t.count, [&](std::size_t at, Eigen::Index n) {
    ChunkF p = load_master<Low>(t, at, n);
    MapT<S> m_stored(static_cast<S*>(t.state0) + at, n);
    MapT<S> v_stored(static_cast<S*>(t.state1) + at, n);
    const ChunkF g =
        ConstMapT<G>(static_cast<const G*>(t.grad) + at, n).template cast<float>() * s.grad_scale +
        s.l2 * p;
    p -= s.lr_wd * p;
    const ChunkF m = s.beta1 * m_stored.template cast<float>() + s.one_minus_beta1 * g;
    const ChunkF v = s.beta2 * v_stored.template cast<float>() + s.one_minus_beta2 * g * g;
    p -= s.step_size * m / (v.sqrt() * s.inv_sqrt_bc2 + s.eps);
    m_stored = m.template cast<S>();
    v_stored = v.template cast<S>();
    store_master<Low, T>(t, at, n, p);
  });
}

// SGD with param type T, gradient type G, momentum buffer type S and master storage Low
// (formulas in update_scalars.h).
template <class T, class G, class S, bool Low>
void sgd(const SgdScalars& s, const ShardTensors& t) {
  for_each_chunk(t.count, [&](std::size_t at, Eigen::Index n) {
    ChunkF p = load_master<Low>(t, at, n);
    const ChunkF g =
        ConstMapT<G>(static_cast<const G*>(t.grad) + at, n).template cast<float>() * s.grad_scale +
        s.wd * p;
    if (!s.has_momentum) {
      p -= s.lr * g;
    } else {
      MapT<S> buf_stored(static_cast<S*>(t.state0) + at, n);
      const ChunkF buf =
          s.first ? g : ChunkF(s.momentum * buf_stored.template cast<float>() +
                               s.one_minus_dampening * g);
      if (s.nesterov) {
        p -= s.lr * (g + s.momentum * buf);
      } else {
        p -= s.lr * buf;
      }
      buf_stored = buf.template cast<S>();
    }
    store_master<Low, T>(t, at, n, p);
  });
}

// Param type T, gradient type G, state type S, master storage Low.
template <class T, class G, class S, bool Low>
void update_rule(const OptimizerConfig& config, const StepArgs& args, const ShardTensors& t) {
  if (config.type == OptimizerType::sgd) {
    sgd<T, G, S, Low>(sgd_scalars(config, args), t);
  } else {
    adam<T, G, S, Low>(adam_scalars(config, args), t);
  }
}

template <class T, class G, class S>
void update_shard(const OptimizerConfig& config, const StepArgs& args, const ShardTensors& t) {
  // check_update admits bf16_remainder with bf16 params only.
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (config.master == MasterStorage::bf16_remainder)
      return update_rule<T, G, S, true>(config, args, t);
  }
  update_rule<T, G, S, false>(config, args, t);
}

void update(const OptimizerConfig& config, const StepArgs& args, const ShardTensors& t) {
  if (!detail::check_update("cpu_device_ops().update", config, args, t)) return;
  with_bit16(t.dtype, "update", [&](auto param_tag) {
    with_any(t.grad_dtype, "update", [&](auto grad_tag) {
      using T = decltype(param_tag);
      using G = decltype(grad_tag);
      if constexpr (std::is_same_v<G, T> || std::is_same_v<G, float>) {
        // check_update admits fp32 and bf16 state only.
        if (t.state_dtype == DType::bf16)
          update_shard<T, G, bf16_t>(config, args, t);
        else
          update_shard<T, G, float>(config, args, t);
      }
    });
  });
}

void sum_squares(const ConstSpan* spans, std::size_t n, DType dtype, double scale,
                 double* sums) {
  with_any(dtype, "sum_squares", [&](auto tag) {
    using T = decltype(tag);
    detail::check_squares("cpu_device_ops().sum_squares", spans, n, sums);
    for (std::size_t s = 0; s < n; ++s) {
      const T* x = static_cast<const T*>(spans[s].data);
      double sum = 0.0;  // sequential order: the same input always gives the same bits
      for (std::size_t i = 0; i < spans[s].count; ++i) {
        const double v = static_cast<double>(static_cast<float>(x[i])) * scale;
        sum += v * v;
      }
      sums[s] = sum;
    }
  });
}

bool has_inf_or_nan(const void* data, DType dtype, std::size_t count) {
  return with_any(dtype, "has_inf_or_nan", [&](auto tag) {
    using T = decltype(tag);
    constexpr BitsOf<T> mask = exponent_mask<T>();
    if (count > 0) detail::require_data(data, "cpu_device_ops().has_inf_or_nan", "data", count);
    const T* x = static_cast<const T*>(data);
    // No early exit: a branch-free OR over the bits vectorizes, and overflow is the rare case.
    bool found = false;
    for (std::size_t i = 0; i < count; ++i) {
      found |= (std::bit_cast<BitsOf<T>>(x[i]) & mask) == mask;
    }
    return found;
  });
}

// Between two types the value goes through fp32 (exact from bf16 and fp16), so it is rounded
// once; within one type the bits are copied unchanged.
void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t count) {
  with_any(dst_dtype, "cast", [&](auto dst_tag) {
    with_any(src_dtype, "cast", [&](auto src_tag) {
      using D = decltype(dst_tag);
      using S = decltype(src_tag);
      if (count == 0) return;
      detail::require_data(dst, "cpu_device_ops().cast", "dst", count);
      detail::require_data(src, "cpu_device_ops().cast", "src", count);
      if constexpr (std::is_same_v<D, S>) {
        std::memmove(dst, src, count * sizeof(D));
      } else {
        const auto n = static_cast<Eigen::Index>(count);
        MapT<D>(static_cast<D*>(dst), n) =
            ConstMapT<S>(static_cast<const S*>(src), n).template cast<float>().template cast<D>();
      }
    });
  });
}

void accumulate(void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t count) {
  with_any(dst_dtype, "accumulate", [&](auto dst_tag) {
    with_any(src_dtype, "accumulate", [&](auto src_tag) {
      using D = decltype(dst_tag);
      using S = decltype(src_tag);
      if (count == 0) return;
      detail::require_data(dst, "cpu_device_ops().accumulate", "dst", count);
      detail::require_data(src, "cpu_device_ops().accumulate", "src", count);
      const auto n = static_cast<Eigen::Index>(count);
      MapT<D> out(static_cast<D*>(dst), n);
      out = (out.template cast<float>() +
             ConstMapT<S>(static_cast<const S*>(src), n).template cast<float>())
                .template cast<D>();
    });
  });
}

// memset/memcpy with a null pointer are undefined even for zero bytes, hence the guards.
void fill_zero(void* dst, std::size_t bytes) {
  if (bytes == 0) return;
  detail::require_data(dst, "cpu_device_ops().fill_zero", "dst", bytes, "bytes");
  std::memset(dst, 0, bytes);
}

void copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  detail::require_data(dst, "cpu_device_ops().copy", "dst", bytes, "bytes");
  detail::require_data(src, "cpu_device_ops().copy", "src", bytes, "bytes");
  std::memcpy(dst, src, bytes);
}

void synchronize() {}

// The copy queue: every copy done at once, in call order.
thread_local std::uint64_t copies_queued = 0;

std::uint64_t queue_copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) {
    detail::require_data(dst, "cpu_device_ops().queue_copy", "dst", bytes, "bytes");
    detail::require_data(src, "cpu_device_ops().queue_copy", "src", bytes, "bytes");
    std::memcpy(dst, src, bytes);
  }
  return ++copies_queued;
}

void await_copy(std::uint64_t) {}
void finish_copies() {}

// Side work runs at once like all other work: only the marks are counted, per thread.
thread_local std::uint64_t side_marks = 0;
void begin_side() {}
void end_side() {}
std::uint64_t mark_side() { return ++side_marks; }
void await_side(std::uint64_t) {}

// The CUDA backend's walk without its overlap: chunk k goes through slot k % 2, so a CPU test
// covers the same chunk and slot arithmetic.
void update_streamed(const OptimizerConfig& config, const StreamedTensors& s) {
  if (!detail::check_streamed("cpu_device_ops().update_streamed", config, s)) return;
  detail::for_each_streamed_chunk(
      s, [&](const StreamedPiece& p, std::size_t k, std::size_t at, std::size_t n) {
        const ShardTensors c = detail::slot_tensors(s, p.t, static_cast<int>(k % 2), at, n);
        const auto copies = detail::chunk_copies(s, p.t, c, at, n);
        for (const auto& x : copies)
          if (x.slot != nullptr) std::memcpy(x.slot, x.host, x.bytes);
        update(config, p.args, c);
        for (const auto& x : copies)
          if (x.slot != nullptr && !x.up_only) std::memcpy(x.host, x.slot, x.bytes);
      });
}

}  // namespace

const DeviceOps& cpu_device_ops() {
  static const DeviceOps table{.name = "cpu",
                                      .update = update,
                                      .update_streamed = update_streamed,
                                      .sum_squares = sum_squares,
                                      .has_inf_or_nan = has_inf_or_nan,
                                      .cast = cast,
                                      .accumulate = accumulate,
                                      .fill_zero = fill_zero,
                                      .copy = copy,
                                      .synchronize = synchronize,
                                      .queue_copy = queue_copy,
                                      .await_copy = await_copy,
                                      .finish_copies = finish_copies,
                                      .begin_side = begin_side,
                                      .end_side = end_side,
                                      .mark_side = mark_side,
                                      .await_side = await_side};
  return table;
}

}  // namespace shardswap
