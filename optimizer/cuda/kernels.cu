// The CUDA optimizer kernels: one grid-stride pass per call, reading and writing 4 elements per
// thread with 16-byte (fp32) and 8-byte (bit16: params, gradients, bf16 optimizer state) loads and
// stores where every pointer is 16-byte aligned (the engine's flat shards are 256-byte aligned),
// and one element at a time for the tail and for unaligned pointers. Arithmetic is fp32, in the order of the CPU backend and without
// contraction into fused multiply-adds (the __f*_rn intrinsics), so the update gives the CPU
// backend's bits (which rounds alike: optimizer/cpu/kernels.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <initializer_list>
#include <type_traits>

#include "optimizer/cuda/kernels.h"
#include "optimizer/master_split.h"
#include "support/cuda_check.h"
#include "support/work_stream.h"

namespace shardswap::detail {

namespace {

constexpr int kThreads = 256;  // block_sum below assumes exactly this many threads per block
// Elements per vector unit: one 16-byte access of fp32, one 8-byte access of bit16, so every
// warp-wide load or store is one contiguous run (fully coalesced). Measured on the H200
// (2026-11-29): 8 elements per unit as two float4 reached 83% of the copy bandwidth.
constexpr int kVec = 4;

// --- element types: one value, or a unit of kVec values, as fp32 ---------------------------

struct F32 {
  using Storage = float;
  __device__ static float load(const float* p, std::size_t i) { return p[i]; }
  __device__ static void store(float* p, std::size_t i, float x) { p[i] = x; }
  // Streaming hints (evict first): every byte is touched once per call.
  __device__ static void load_vec(const float* p, std::size_t i, float (&x)[kVec]) {
    const float4 a = __ldcs(reinterpret_cast<const float4*>(p + i));
    x[0] = a.x;
    x[1] = a.y;
    x[2] = a.z;
    x[3] = a.w;
  }
  __device__ static void store_vec(float* p, std::size_t i, const float (&x)[kVec]) {
    __stcs(reinterpret_cast<float4*>(p + i), make_float4(x[0], x[1], x[2], x[3]));
  }
};

// A bit16 type through its bits; Conv converts one value (round to nearest even on the way down).
template <class Conv>
struct Bit16 {
  using Storage = unsigned short;
  __device__ static float load(const unsigned short* p, std::size_t i) {
    return Conv::to_float(p[i]);
  }
  __device__ static void store(unsigned short* p, std::size_t i, float x) {
    p[i] = Conv::from_float(x);
  }
  // Little-endian: the element at the lower address is the low half of each 32-bit word.
  __device__ static void load_vec(const unsigned short* p, std::size_t i, float (&x)[kVec]) {
    const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p + i));
    const unsigned int w[2] = {u.x, u.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      x[2 * k] = Conv::to_float(static_cast<unsigned short>(w[k] & 0xFFFFu));
      x[2 * k + 1] = Conv::to_float(static_cast<unsigned short>(w[k] >> 16));
    }
  }
  __device__ static void store_vec(unsigned short* p, std::size_t i, const float (&x)[kVec]) {
    unsigned int w[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      w[k] = static_cast<unsigned int>(Conv::from_float(x[2 * k])) |
             (static_cast<unsigned int>(Conv::from_float(x[2 * k + 1])) << 16);
    }
    __stcs(reinterpret_cast<uint2*>(p + i), make_uint2(w[0], w[1]));
  }
};

struct Bf16Conv {
  __device__ static float to_float(unsigned short b) {
    return __bfloat162float(__ushort_as_bfloat16(b));
  }
  __device__ static unsigned short from_float(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};

struct F16Conv {
  __device__ static float to_float(unsigned short b) { return __half2float(__ushort_as_half(b)); }
  __device__ static unsigned short from_float(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

using BF16 = Bit16<Bf16Conv>;
using F16 = Bit16<F16Conv>;

// --- the master: fp32 values, or low halves beside the bf16 params (master_split.h) ----------

// Read as fp32; written with the param P rounded to nearest even.
struct MasterF32 {
  using Storage = float;
  template <class P>
  __device__ static void load_vec(const float* master, const typename P::Storage*, std::size_t i,
                                  float (&x)[kVec]) {
    F32::load_vec(master, i, x);
  }
  template <class P>
  __device__ static float load(const float* master, const typename P::Storage*, std::size_t i) {
    return master[i];
  }
  template <class P>
  __device__ static void store_vec(float* master, typename P::Storage* param, std::size_t i,
                                   const float (&x)[kVec]) {
    F32::store_vec(master, i, x);
    P::store_vec(param, i, x);
  }
  template <class P>
  __device__ static void store(float* master, typename P::Storage* param, std::size_t i, float x) {
    master[i] = x;
    P::store(param, i, x);
  }
};

// Joined from the bf16 param and the low half on the way in, split into both on the way out
// (P is BF16: with_update_types instantiates nothing else).
struct MasterLow {
  using Storage = unsigned short;
  template <class P>
  __device__ static void load_vec(const unsigned short* low, const unsigned short* param,
                                  std::size_t i, float (&x)[kVec]) {
    const uint2 w = __ldcs(reinterpret_cast<const uint2*>(param + i));
    const uint2 l = __ldcs(reinterpret_cast<const uint2*>(low + i));
    const unsigned int ws[2] = {w.x, w.y}, ls[2] = {l.x, l.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      x[2 * k] = __uint_as_float(join_master(static_cast<std::uint16_t>(ws[k] & 0xFFFFu),
                                             static_cast<std::uint16_t>(ls[k] & 0xFFFFu)));
      x[2 * k + 1] = __uint_as_float(
          join_master(static_cast<std::uint16_t>(ws[k] >> 16), static_cast<std::uint16_t>(ls[k] >> 16)));
    }
  }
  template <class P>
  __device__ static float load(const unsigned short* low, const unsigned short* param,
                               std::size_t i) {
    return __uint_as_float(join_master(param[i], low[i]));
  }
  template <class P>
  __device__ static void store_vec(unsigned short* low, unsigned short* param, std::size_t i,
                                   const float (&x)[kVec]) {
    unsigned int w[2], l[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const MasterHalves a = split_master(__float_as_uint(x[2 * k]));
      const MasterHalves b = split_master(__float_as_uint(x[2 * k + 1]));
      w[k] = static_cast<unsigned int>(a.weight) | (static_cast<unsigned int>(b.weight) << 16);
      l[k] = static_cast<unsigned int>(a.low) | (static_cast<unsigned int>(b.low) << 16);
    }
    __stcs(reinterpret_cast<uint2*>(param + i), make_uint2(w[0], w[1]));
    __stcs(reinterpret_cast<uint2*>(low + i), make_uint2(l[0], l[1]));
  }
  template <class P>
  __device__ static void store(unsigned short* low, unsigned short* param, std::size_t i,
                               float x) {
    const MasterHalves h = split_master(__float_as_uint(x));
    param[i] = h.weight;
    low[i] = h.low;
  }
};

// --- the update rules on one element (formulas and order: update_scalars.h, cpu/kernels.cpp) -

__device__ __forceinline__ void adam_element(const AdamScalars& s, float grad, float& p, float& m,
                                             float& v) {
  const float g = __fadd_rn(__fmul_rn(grad, s.grad_scale), __fmul_rn(s.l2, p));
  p = __fsub_rn(p, __fmul_rn(s.lr_wd, p));
  m = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(s.one_minus_beta1, g));
  v = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), s.inv_sqrt_bc2), s.eps);
  p = __fsub_rn(p, __fdiv_rn(__fmul_rn(s.step_size, m), denom));
}

// `buf` is read only with momentum after the first step, written only with momentum.
__device__ __forceinline__ void sgd_element(const SgdScalars& s, float grad, float& p, float& buf) {
  const float g = __fadd_rn(__fmul_rn(grad, s.grad_scale), __fmul_rn(s.wd, p));
  if (!s.has_momentum) {
    p = __fsub_rn(p, __fmul_rn(s.lr, g));
    return;
  }
  buf = s.first ? g : __fadd_rn(__fmul_rn(s.momentum, buf), __fmul_rn(s.one_minus_dampening, g));
  const float d = s.nesterov ? __fadd_rn(g, __fmul_rn(s.momentum, buf)) : buf;
  p = __fsub_rn(p, __fmul_rn(s.lr, d));
}

// --- kernels: vector units [0, vec_units), then single elements [vec_units * kVec, count) -----

__device__ __forceinline__ std::size_t thread_index() {
  return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::size_t grid_threads() {
  return static_cast<std::size_t>(gridDim.x) * blockDim.x;
}

// S: the state's element type (F32, or BF16: read into fp32, stored rounded to nearest even);
// M: how the master is stored (MasterF32, MasterLow).
template <class P, class G, class S, class M>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(AdamScalars s, typename M::Storage* __restrict__ master,
                typename S::Storage* __restrict__ m,
                typename S::Storage* __restrict__ v, const typename G::Storage* __restrict__ grad,
                typename P::Storage* __restrict__ param, std::size_t count, std::size_t vec_units) {
  const std::size_t stride = grid_threads();
  for (std::size_t u = thread_index(); u < vec_units; u += stride) {
    const std::size_t i = u * kVec;
    float p[kVec], mu[kVec], nu[kVec], g[kVec];
    M::template load_vec<P>(master, param, i, p);
    S::load_vec(m, i, mu);
    S::load_vec(v, i, nu);
    G::load_vec(grad, i, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) adam_element(s, g[k], p[k], mu[k], nu[k]);
    M::template store_vec<P>(master, param, i, p);
    S::store_vec(m, i, mu);
    S::store_vec(v, i, nu);
  }
  for (std::size_t i = vec_units * kVec + thread_index(); i < count; i += stride) {
    float p = M::template load<P>(master, param, i), mu = S::load(m, i), nu = S::load(v, i);
    adam_element(s, G::load(grad, i), p, mu, nu);
    M::template store<P>(master, param, i, p);
    S::store(m, i, mu);
    S::store(v, i, nu);
  }
}

template <class P, class G, class S, class M>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(SgdScalars s, typename M::Storage* __restrict__ master,
               typename S::Storage* __restrict__ buf,
               const typename G::Storage* __restrict__ grad,
               typename P::Storage* __restrict__ param, std::size_t count, std::size_t vec_units) {
  const bool read_buf = s.has_momentum && !s.first;
  const std::size_t stride = grid_threads();
  for (std::size_t u = thread_index(); u < vec_units; u += stride) {
    const std::size_t i = u * kVec;
    float p[kVec], b[kVec] = {}, g[kVec];
    M::template load_vec<P>(master, param, i, p);
    if (read_buf) S::load_vec(buf, i, b);
    G::load_vec(grad, i, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) sgd_element(s, g[k], p[k], b[k]);
    M::template store_vec<P>(master, param, i, p);
    if (s.has_momentum) S::store_vec(buf, i, b);
  }
  for (std::size_t i = vec_units * kVec + thread_index(); i < count; i += stride) {
    float p = M::template load<P>(master, param, i);
    float b = read_buf ? S::load(buf, i) : 0.0f;
    sgd_element(s, G::load(grad, i), p, b);
    M::template store<P>(master, param, i, p);
    if (s.has_momentum) S::store(buf, i, b);
  }
}

// The sum over the block of every thread's x, valid in thread 0.
__device__ double block_sum(double x) {
  __shared__ double warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xFFFFFFFFu, x, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  x = 0.0;
  if (warp == 0) {
    x = lane < kThreads / 32 ? warp_sums[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xFFFFFFFFu, x, offset);
  }
  return x;
}

// The spans of one sum_squares launch: span i's blocks are first_block[i] .. + blocks[i] - 1.
struct SquaresSpans {
  const void* data[kMaxSquaresSpans];
  std::size_t count[kMaxSquaresSpans];
  std::size_t vec_units[kMaxSquaresSpans];
  int first_block[kMaxSquaresSpans];
  int blocks[kMaxSquaresSpans];
  int row[kMaxSquaresSpans];  // where its partials go: the caller's index (empty spans skipped)
  int n;
};

// Each block finds its span and runs as block b of a grid of that span's blocks alone would, so
// that a span's partials are those of a launch of its own whatever else shares the launch.
template <class T>
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const SquaresSpans spans, double scale, double* partials, int row) {
  int lo = 0, hi = spans.n - 1;  // the last span starting at or before this block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (spans.first_block[mid] <= static_cast<int>(blockIdx.x))
      lo = mid;
    else
      hi = mid - 1;
  }
  const auto* x = static_cast<const typename T::Storage*>(spans.data[lo]);
  const std::size_t count = spans.count[lo], vec_units = spans.vec_units[lo];
  const int block = static_cast<int>(blockIdx.x) - spans.first_block[lo];
  const std::size_t stride = static_cast<std::size_t>(spans.blocks[lo]) * kThreads;
  const std::size_t thread = static_cast<std::size_t>(block) * kThreads + threadIdx.x;
  double sum = 0.0;
  for (std::size_t u = thread; u < vec_units; u += stride) {
    float f[kVec];
    T::load_vec(x, u * kVec, f);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const double d = static_cast<double>(f[k]) * scale;
      sum += d * d;
    }
  }
  for (std::size_t i = vec_units * kVec + thread; i < count; i += stride) {
    const double d = static_cast<double>(T::load(x, i)) * scale;
    sum += d * d;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partials[static_cast<std::size_t>(spans.row[lo]) * row + block] = sum;
}

// bf16 and fp16 Inf/NaN upcast to fp32 Inf/NaN and finite values stay finite, so one test of the
// fp32 exponent field serves every type.
__device__ __forceinline__ bool non_finite(float f) {
  return (__float_as_uint(f) & 0x7F800000u) == 0x7F800000u;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    find_inf_or_nan_kernel(const typename T::Storage* __restrict__ x, std::size_t count,
                           std::size_t vec_units, int* flags) {
  bool found = false;  // no early exit: overflow is the rare case
  const std::size_t stride = grid_threads();
  for (std::size_t u = thread_index(); u < vec_units; u += stride) {
    float f[kVec];
    T::load_vec(x, u * kVec, f);
#pragma unroll
    for (int k = 0; k < kVec; ++k) found |= non_finite(f[k]);
  }
  for (std::size_t i = vec_units * kVec + thread_index(); i < count; i += stride) {
    found |= non_finite(T::load(x, i));
  }
  found = __syncthreads_or(found) != 0;
  if (threadIdx.x == 0) flags[blockIdx.x] = found ? 1 : 0;
}

template <class D, class S>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(typename D::Storage* __restrict__ dst, const typename S::Storage* __restrict__ src,
                std::size_t count, std::size_t vec_units) {
  const std::size_t stride = grid_threads();
  for (std::size_t u = thread_index(); u < vec_units; u += stride) {
    float f[kVec];
    S::load_vec(src, u * kVec, f);
    D::store_vec(dst, u * kVec, f);
  }
  for (std::size_t i = vec_units * kVec + thread_index(); i < count; i += stride) {
    D::store(dst, i, S::load(src, i));
  }
}

template <class D, class S>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(typename D::Storage* __restrict__ dst,
                      const typename S::Storage* __restrict__ src, std::size_t count,
                      std::size_t vec_units) {
  const std::size_t stride = grid_threads();
  for (std::size_t u = thread_index(); u < vec_units; u += stride) {
    float a[kVec], b[kVec];
    D::load_vec(dst, u * kVec, a);
    S::load_vec(src, u * kVec, b);
#pragma unroll
    for (int k = 0; k < kVec; ++k) a[k] = __fadd_rn(a[k], b[k]);
    D::store_vec(dst, u * kVec, a);
  }
  for (std::size_t i = vec_units * kVec + thread_index(); i < count; i += stride) {
    D::store(dst, i, __fadd_rn(D::load(dst, i), S::load(src, i)));
  }
}

// --- launch helpers -----------------------------------------------------------------------

// Vector units only when every pointer is 16-byte aligned; otherwise all elements go singly.
std::size_t vector_units(std::size_t count, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return 0;
  }
  return count / kVec;
}

// Enough blocks for one loop iteration per thread (more memory requests in flight than a grid
// capped at the SMs' resident threads, which measured slower), at most max_blocks (the
// reductions cap it to their partial buffers).
int grid_size(std::size_t count, std::size_t vec_units, std::size_t max_blocks) {
  const std::size_t items = vec_units + (count - vec_units * kVec);
  const std::size_t wanted = (items + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<std::size_t>(
      1, std::min({wanted, max_blocks, static_cast<std::size_t>(std::numeric_limits<int>::max())})));
}

constexpr std::size_t kNoLimit = std::size_t{1} << 30;

// Calls f(T{}) with the element type of e.
template <class F>
void with_elem(Elem e, F&& f) {
  switch (e) {
    case Elem::f32:
      f(F32{});
      return;
    case Elem::bf16:
      f(BF16{});
      return;
    case Elem::f16:
      f(F16{});
      return;
  }
}
// Calls f(P{}, G{}, S{}, M{}) with the param type, the gradient type (the param's bit16 type or
// fp32), the state type (fp32 or bf16) and the master's storage (low halves with bf16 params
// only) of an update (backend.cpp rejects other choices).
template <class F>
void with_update_types(const UpdateLaunch& t, F&& f) {
  const auto with_master = [&](auto param_type, auto grad_type, auto state_type) {
    if constexpr (std::is_same_v<decltype(param_type), BF16>) {
      if (t.master_low) return f(param_type, grad_type, state_type, MasterLow{});
    }
    f(param_type, grad_type, state_type, MasterF32{});
  };
  const auto with_state = [&](auto param_type, auto grad_type) {
    if (t.state_elem == Elem::bf16) {
      with_master(param_type, grad_type, BF16{});
    } else {
      with_master(param_type, grad_type, F32{});
    }
  };
  const auto with_grad = [&](auto param_type) {
    if (t.grad_elem == Elem::f32) {
      with_state(param_type, F32{});
    } else {
      with_state(param_type, param_type);
    }
  };
  if (t.param_elem == Elem::bf16) {
    with_grad(BF16{});
  } else {
    with_grad(F16{});
  }
}

}  // namespace

void launch_adam(const AdamScalars& s, const UpdateLaunch& t) {
  with_update_types(t, [&](auto param_type, auto grad_type, auto state_type, auto master_type) {
    using P = decltype(param_type);
    using G = decltype(grad_type);
    using S = decltype(state_type);
    using M = decltype(master_type);
    const std::size_t units =
        vector_units(t.count, {t.master, t.state0, t.state1, t.grad, t.param});
    adam_kernel<P, G, S, M>
        <<<grid_size(t.count, units, kNoLimit), kThreads, 0, detail::work_stream()>>>(
            s, static_cast<typename M::Storage*>(t.master),
            static_cast<typename S::Storage*>(t.state0),
            static_cast<typename S::Storage*>(t.state1),
            static_cast<const typename G::Storage*>(t.grad),
            static_cast<typename P::Storage*>(t.param), t.count, units);
    SHARDSWAP_CUDA_CHECK(cudaGetLastError());
  });
}

void launch_sgd(const SgdScalars& s, const UpdateLaunch& t) {
  with_update_types(t, [&](auto param_type, auto grad_type, auto state_type, auto master_type) {
    using P = decltype(param_type);
    using G = decltype(grad_type);
    using S = decltype(state_type);
    using M = decltype(master_type);
    auto* buf = static_cast<typename S::Storage*>(s.has_momentum ? t.state0 : nullptr);
    const std::size_t units = vector_units(t.count, {t.master, buf, t.grad, t.param});
    sgd_kernel<P, G, S, M>
        <<<grid_size(t.count, units, kNoLimit), kThreads, 0, detail::work_stream()>>>(
        s, static_cast<typename M::Storage*>(t.master), buf, static_cast<const typename G::Storage*>(t.grad),
        static_cast<typename P::Storage*>(t.param), t.count, units);
    SHARDSWAP_CUDA_CHECK(cudaGetLastError());
  });
}

void launch_sum_squares(const void* const* data, const std::size_t* counts, int n, Elem e,
                        double scale, double* partials, int max_blocks, int* blocks) {
  SquaresSpans spans{};
  int total = 0;
  for (int i = 0; i < n; ++i) {
    blocks[i] = 0;
    if (counts[i] == 0) continue;  // no block, no partial
    const int k = spans.n++;
    spans.data[k] = data[i];
    spans.count[k] = counts[i];
    spans.vec_units[k] = vector_units(counts[i], {data[i]});
    spans.blocks[k] = grid_size(counts[i], spans.vec_units[k], static_cast<std::size_t>(max_blocks));
    spans.first_block[k] = total;
    total += spans.blocks[k];
    spans.row[k] = i;
    blocks[i] = spans.blocks[k];
  }
  if (spans.n == 0) return;
  with_elem(e, [&](auto type) {
    using T = decltype(type);
    sum_squares_kernel<T><<<total, kThreads, 0, detail::work_stream()>>>(spans, scale, partials,
                                                                          max_blocks);
    SHARDSWAP_CUDA_CHECK(cudaGetLastError());
  });
}

int launch_find_inf_or_nan(const void* x, Elem e, std::size_t count, int* flags, int max_blocks) {
  int blocks = 0;
  with_elem(e, [&](auto type) {
    using T = decltype(type);
    const std::size_t units = vector_units(count, {x});
    blocks = grid_size(count, units, static_cast<std::size_t>(max_blocks));
    find_inf_or_nan_kernel<T><<<blocks, kThreads, 0, detail::work_stream()>>>(
        static_cast<const typename T::Storage*>(x), count, units, flags);
    SHARDSWAP_CUDA_CHECK(cudaGetLastError());
  });
  return blocks;
}

void launch_cast(void* dst, Elem dst_e, const void* src, Elem src_e, std::size_t count) {
  with_elem(dst_e, [&](auto dst_type) {
    with_elem(src_e, [&](auto src_type) {
      using D = decltype(dst_type);
      using S = decltype(src_type);
      const std::size_t units = vector_units(count, {dst, src});
      cast_kernel<D, S><<<grid_size(count, units, kNoLimit), kThreads, 0, detail::work_stream()>>>(
          static_cast<typename D::Storage*>(dst), static_cast<const typename S::Storage*>(src),
          count, units);
      SHARDSWAP_CUDA_CHECK(cudaGetLastError());
    });
  });
}

void launch_accumulate(void* dst, Elem dst_e, const void* src, Elem src_e, std::size_t count) {
  with_elem(dst_e, [&](auto dst_type) {
    with_elem(src_e, [&](auto src_type) {
      using D = decltype(dst_type);
      using S = decltype(src_type);
      const std::size_t units = vector_units(count, {dst, src});
      accumulate_kernel<D, S>
          <<<grid_size(count, units, kNoLimit), kThreads, 0, detail::work_stream()>>>(
              static_cast<typename D::Storage*>(dst), static_cast<const typename S::Storage*>(src),
              count, units);
      SHARDSWAP_CUDA_CHECK(cudaGetLastError());
    });
  });
}

}  // namespace shardswap::detail
