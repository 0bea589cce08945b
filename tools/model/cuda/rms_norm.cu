// RMSNorm forward and backward (tools/model/cuda/kernels.h): the gradient at its input and the
// partials of its weight gradient's column sum in one pass (column_sums.cu finishes the sum).
//
// Precision: the residual stream x, the gradient dz at the norm's output and the stream's
// gradient dx are of R, fp32 or (model.bit16_residual) the weights' type T; the statistics and
// the arithmetic are fp32 either way, from the values as stored. Only the output, and the
// gradient's copy for the next GEMMs (where dx is fp32), are rounded to T.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

// One warp per row: y = x / rms(x) * w in T; keeps 1 / rms when rstd is not null. With kAdd,
// x is first made the residual sum in place: sum[row] = residual[row] + sum[row] (the
// GEMM that wrote the product into `sum` left the addition to this pass, one rounding to R as
// its epilogue's), and x is that sum as stored. N columns a lane at a time (N = 4: 16-byte fp32
// or 8-byte bit16 loads, where the launcher finds d a multiple of 4 and the operands aligned;
// else 1). Each lane reads back in the second loop only what it wrote in the first (through
// `sum`, not restrict: no read-only cache path for memory this kernel writes).
template <class T, class R, int N, bool kAdd>
__global__ void rms_norm_forward(const R* __restrict__ x, const T* __restrict__ w, int n, int d,
                                 float eps, T* __restrict__ y, float* __restrict__ rstd,
                                 const R* __restrict__ residual, R* sum) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const long long base = static_cast<long long>(row) * d;
  const auto* wr = reinterpret_cast<const Pack<T, N>*>(w);
  const int packs = d / N;
  float sq = 0.0f;
  if constexpr (kAdd) {
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> a = load_floats<N>(residual + base + k * N);
      FloatPack<N> v = load_floats<N>(sum + base + k * N);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        v.v[e] = through<R>(a.v[e] + v.v[e]);  // the sum as it is stored
        sq += v.v[e] * v.v[e];
      }
      store_floats<N>(sum + base + k * N, v);
    }
  }
  const R* src = kAdd ? sum : x;
  if constexpr (!kAdd)
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> v = load_floats<N>(src + base + k * N);
#pragma unroll
      for (int e = 0; e < N; ++e) sq += v.v[e] * v.v[e];
    }
  const float r = rsqrtf(warp_sum(sq) / d + eps);
  auto* yr = reinterpret_cast<Pack<T, N>*>(y + base);
  for (int k = lane; k < packs; k += 32) {
    const FloatPack<N> v = load_floats<N>(src + base + k * N);
    const Pack<T, N> wv = wr[k];
    Pack<T, N> out;
#pragma unroll
    for (int e = 0; e < N; ++e) out.v[e] = from_float<T>(v.v[e] * r * to_float(wv.v[e]));
    yr[k] = out;
  }
  if (rstd != nullptr && lane == 0) rstd[row] = r;
}

// Given dz at the norm's output, block b takes rows [b R, b R + R) (R = kCudaNormRowsPerPartial), its
// warps the rows w, w + warps, ..., each lane its N-column packs of every row:
// - with dx: dx (= or +=) the gradient at the norm's input, r (g - xhat mean(g xhat)) with
//   g = dz w and xhat = x r, stored in RS; and the new dx rounded to T into d16 when d16 is not
//   null (where RS is fp32);
// - with partials: partials[b d + k] = the sum over the block's rows of dz x r in column k (the
//   weight gradient's first pass), each warp summing its rows in a shared-memory row of d floats,
//   then the warps' rows added in warp order. A fixed assignment and order: the same bits run to
//   run. One read of dz and x for both, where a separate pass over the columns read them again.
template <class T, class RS, int N>
__global__ void rms_norm_backward(const RS* __restrict__ dz, const RS* __restrict__ x,
                                  const float* __restrict__ rstd, const T* __restrict__ w, int n,
                                  int d, RS* __restrict__ dx, bool accumulate,
                                  T* __restrict__ d16, float* __restrict__ partials) {
  extern __shared__ float sums[];  // [warps][d], with partials
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int packs = d / N;
  auto* mine = reinterpret_cast<FloatPack<N>*>(sums + static_cast<long long>(warp) * d);
  if (partials != nullptr)
    for (int k = lane; k < packs; k += 32) mine[k] = FloatPack<N>{};
  const auto* wr = reinterpret_cast<const Pack<T, N>*>(w);
  const int r0 = blockIdx.x * kCudaNormRowsPerPartial,
            rows = min(n - r0, kCudaNormRowsPerPartial);
  for (int i = warp; i < rows; i += warps) {
    const long long base = static_cast<long long>(r0 + i) * d;
    const float r = rstd[r0 + i];
    if (dx == nullptr) {  // the weight gradient's partials alone
      for (int k = lane; k < packs; k += 32) {
        const FloatPack<N> g = load_floats<N>(dz + base + k * N),
                           xv = load_floats<N>(x + base + k * N);
        FloatPack<N> acc = mine[k];
#pragma unroll
        for (int e = 0; e < N; ++e) acc.v[e] += g.v[e] * xv.v[e] * r;
        mine[k] = acc;
      }
      continue;
    }
    float s = 0.0f;
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> g = load_floats<N>(dz + base + k * N),
                         xv = load_floats<N>(x + base + k * N);
      const Pack<T, N> wv = wr[k];
#pragma unroll
      for (int e = 0; e < N; ++e) s += g.v[e] * to_float(wv.v[e]) * xv.v[e] * r;
    }
    const float mean = warp_sum(s) / d;
    auto* d16r = d16 != nullptr ? reinterpret_cast<Pack<T, N>*>(d16 + base) : nullptr;
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> g = load_floats<N>(dz + base + k * N),
                         xv = load_floats<N>(x + base + k * N);
      const Pack<T, N> wv = wr[k];
      FloatPack<N> out;
      if (accumulate) out = load_floats<N>(dx + base + k * N);
      Pack<T, N> out16;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float v = r * (g.v[e] * to_float(wv.v[e]) - xv.v[e] * r * mean);
        out.v[e] = accumulate ? out.v[e] + v : v;
        out16.v[e] = from_float<T>(out.v[e]);
      }
      store_floats<N>(dx + base + k * N, out);
      if (d16r != nullptr) d16r[k] = out16;
      if (partials != nullptr) {
        FloatPack<N> acc = mine[k];
#pragma unroll
        for (int e = 0; e < N; ++e) acc.v[e] += g.v[e] * xv.v[e] * r;
        mine[k] = acc;
      }
    }
  }
  if (partials == nullptr) return;
  __syncthreads();
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float s = 0.0f;
    for (int v = 0; v < warps; ++v) s += sums[static_cast<long long>(v) * d + c];
    partials[static_cast<long long>(blockIdx.x) * d + c] = s;
  }
}

// Whether p (null counts as aligned: it is never read) starts a pack of 4 elements of its type.
template <class E>
bool pack_aligned(const E* p) {
  return reinterpret_cast<std::uintptr_t>(p) % (4 * sizeof(E)) == 0;
}
// 4 columns a lane where d is a multiple of 4 and every operand starts a pack (then so does
// every row), else 1.
template <class... E>
bool four_a_lane(int d, const E*... operands) {
  return d % 4 == 0 && (pack_aligned(operands) && ...);
}

}  // namespace

template <class T, class R>
void launch_rms_norm_forward(const R* x, const T* w, int n, int d, float eps, T* y, float* rstd) {
  if (four_a_lane(d, x, w, y))
    rms_norm_forward<T, R, 4, false><<<warp_blocks(n), 32 * kWarpsPerBlock, 0,
                                       cudaStreamPerThread>>>(x, w, n, d, eps, y, rstd, nullptr,
                                                              nullptr);
  else
    rms_norm_forward<T, R, 1, false><<<warp_blocks(n), 32 * kWarpsPerBlock, 0,
                                       cudaStreamPerThread>>>(x, w, n, d, eps, y, rstd, nullptr,
                                                              nullptr);
  check_launch();
}

template <class T, class R>
void launch_residual_rms_norm_forward(const R* residual, R* sum, const T* w, int n, int d,
                                      float eps, T* y, float* rstd) {
  if (four_a_lane(d, residual, static_cast<const R*>(sum), w, y))
    rms_norm_forward<T, R, 4, true><<<warp_blocks(n), 32 * kWarpsPerBlock, 0,
                                      cudaStreamPerThread>>>(nullptr, w, n, d, eps, y, rstd,
                                                             residual, sum);
  else
    rms_norm_forward<T, R, 1, true><<<warp_blocks(n), 32 * kWarpsPerBlock, 0,
                                      cudaStreamPerThread>>>(nullptr, w, n, d, eps, y, rstd,
                                                             residual, sum);
  check_launch();
}

// Warps a block of the backward: 4 (4 rows each of the block's 16), fewer where their
// shared-memory rows of the weight gradient's sums would pass kNormSumBytes. Small blocks, many
// of them: one of 8 warps a 64-row chunk left the 0.5B shape's backward at 256 blocks, 88 us a
// norm, about half the GPU's bandwidth (Nsight Compute, H200, 2026-12-05).
constexpr int kNormWarps = 4;
static_assert(kCudaNormRowsPerPartial % kNormWarps == 0);
constexpr int kNormSumBytes = 192 * 1024;
int norm_backward_warps(int d, bool sums) {
  if (!sums) return kNormWarps;
  const long long fit = kNormSumBytes / (static_cast<long long>(d) * sizeof(float));
  return static_cast<int>(fit < kNormWarps ? (fit < 1 ? 1 : fit) : kNormWarps);
}

template <class T, class R, int N>
void launch_norm_backward(const R* dz, const R* x, const float* rstd, const T* w, int n, int d,
                          R* dx, bool accumulate, T* d16, float* partials) {
  const int warps = norm_backward_warps(d, partials != nullptr);
  const std::size_t bytes =
      partials != nullptr ? static_cast<std::size_t>(warps) * d * sizeof(float) : 0;
  if (bytes > 48 * 1024)  // past the default: the kernel must be allowed it
    SHARDSWAP_CUDA_CHECK(cudaFuncSetAttribute(
        rms_norm_backward<T, R, N>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(bytes)));
  const int blocks = (n + kCudaNormRowsPerPartial - 1) / kCudaNormRowsPerPartial;
  rms_norm_backward<T, R, N><<<blocks, 32 * warps, bytes, cudaStreamPerThread>>>(
      dz, x, rstd, w, n, d, dx, accumulate, d16, partials);
}

template <class T, class R>
void launch_rms_norm_backward(const R* dz, const R* x, const float* rstd, const T* w, int n,
                              int d, R* dx, bool accumulate, T* d16, float* partials) {
  if (four_a_lane(d, dz, x, static_cast<const R*>(dx), static_cast<const float*>(partials), w,
                  static_cast<const T*>(d16)))
    launch_norm_backward<T, R, 4>(dz, x, rstd, w, n, d, dx, accumulate, d16, partials);
  else
    launch_norm_backward<T, R, 1>(dz, x, rstd, w, n, d, dx, accumulate, d16, partials);
  check_launch();
}

#define SHARDSWAP_RMS_NORM(T, R)                                                             \
  template void launch_rms_norm_forward(const R*, const T*, int, int, float, T*, float*);    \
  template void launch_residual_rms_norm_forward(const R*, R*, const T*, int, int, float, T*, \
                                                 float*);                                    \
  template void launch_rms_norm_backward(const R*, const R*, const float*, const T*, int, int, \
                                         R*, bool, T*, float*);
SHARDSWAP_RMS_NORM(__nv_bfloat16, float)
SHARDSWAP_RMS_NORM(__half, float)
SHARDSWAP_RMS_NORM(__nv_bfloat16, __nv_bfloat16)
SHARDSWAP_RMS_NORM(__half, __half)
#undef SHARDSWAP_RMS_NORM

}  // namespace shardswap::lm::dec
