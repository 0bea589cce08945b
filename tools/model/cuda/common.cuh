// What every kernel file of the decoder's CUDA backend shares (tools/model/cuda/*.cu): element
// conversions between fp32 and the weights' bf16 / fp16, warp reductions, the packs that move
// several elements in one load or store, and the grid helpers of the launchers. Device code:
// included by .cu files only. Everything here is inline, so each kernel file compiles alone
// (no relocatable device code) and the kernels see the same helpers as before they were split.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "support/cuda_check.h"
#include "shardswap/error.h"
#include "model/decoder_compute.h"

namespace shardswap::lm::dec {

inline constexpr unsigned kFullMask = 0xffffffffu;
// Warp-per-row kernels (RMSNorm, attention's delta): rows per block of 32 * kWarpsPerBlock.
inline constexpr int kWarpsPerBlock = 8;

// ---- element conversions ----

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// N elements moved by one load or store: Pack<T, 8> and FloatPack<4> are 16 bytes, Pack<T, 4>
// 8 (the launchers check the alignment and fall back to N = 1).
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};
template <int N>
struct alignas(N >= 4 ? 16 : sizeof(float) * N) FloatPack {
  float v[N];
};

// N values of R (fp32, or the weights' bf16 / fp16: the residual stream's type) at p, one pack
// aligned, as fp32; and N fp32 values stored there, rounded to R.
template <int N, class R>
__device__ __forceinline__ FloatPack<N> load_floats(const R* p) {
  if constexpr (std::is_same_v<R, float>) {
    return *reinterpret_cast<const FloatPack<N>*>(p);
  } else {
    const Pack<R, N> a = *reinterpret_cast<const Pack<R, N>*>(p);
    FloatPack<N> f;
#pragma unroll
    for (int e = 0; e < N; ++e) f.v[e] = to_float(a.v[e]);
    return f;
  }
}
template <int N, class R>
__device__ __forceinline__ void store_floats(R* p, const FloatPack<N>& f) {
  if constexpr (std::is_same_v<R, float>) {
    *reinterpret_cast<FloatPack<N>*>(p) = f;
  } else {
    Pack<R, N> a;
#pragma unroll
    for (int e = 0; e < N; ++e) a.v[e] = from_float<R>(f.v[e]);
    *reinterpret_cast<Pack<R, N>*>(p) = a;
  }
}
// x as a value of R reads back (itself for fp32).
template <class R>
__device__ __forceinline__ float through(float x) {
  return to_float(from_float<R>(x));
}

// Activations are row-major [token, feature], token = sequence * T + position.

#define GRID_STRIDE(i, count)                                                      \
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; \
       i < (count); i += static_cast<long long>(gridDim.x) * blockDim.x)

// ---- launching ----

inline int blocks_for(long long count, int threads = 256) {
  const long long b = (count + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 8 ? b : 65535 * 8);
}
inline int warp_blocks(long long rows) {
  return static_cast<int>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}
inline void check_launch() {
  SHARDSWAP_CUDA_CHECK(cudaGetLastError());
}

// Calls f(T{}) with T the device type of a bit16 dtype (the public entry points that take a
// DType rather than a type).
template <class F>
void with_bit16(DType dtype, const char* call, F&& f) {
  if (dtype == DType::bf16) return f(__nv_bfloat16{});
  if (dtype == DType::f16) return f(__half{});
  throw ConfigError(std::string(call) + ": dtype " + dtype_name(dtype) + " is not bf16 or fp16");
}

}  // namespace shardswap::lm::dec
