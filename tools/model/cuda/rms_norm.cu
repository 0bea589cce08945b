// RMSNorm forward and backward (tools/model/cuda/kernels.h): the gradient at its input and the
// partials of its weight gradient's column sum in one pass (column_sums.cu finishes the sum).
//
// Precision: the statistics and the gradient are fp32 from the fp32 residual stream; only the
// output, and the gradient's copy for the next GEMMs, are rounded to the weights' type.
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

// One warp per row: y = x / rms(x) * w in T; keeps 1 / rms when rstd is not null. With kAdd,
// x is first made the residual sum in place: sum[row] = residual[row] + sum[row] (the
// GEMM that wrote the product into `sum` left the addition to this pass, one fp32 rounding as
// its epilogue's), and x is that sum. N columns a lane at a time (N = 4: 16-byte loads, where
// the launcher finds d a multiple of 4 and the operands aligned; else 1). Each lane reads back
// in the second loop only what it wrote in the first (through `sum`, not restrict: no read-only
// cache path for memory this kernel writes).
template <class T, int N, bool kAdd>
__global__ void rms_norm_forward(const float* __restrict__ x, const T* __restrict__ w, int n,
                                 int d, float eps, T* __restrict__ y, float* __restrict__ rstd,
                                 const float* __restrict__ residual, float* sum) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const long long base = static_cast<long long>(row) * d;
  const auto* wr = reinterpret_cast<const Pack<T, N>*>(w);
  const int packs = d / N;
  float sq = 0.0f;
  if constexpr (kAdd) {
    const auto* rr = reinterpret_cast<const FloatPack<N>*>(residual + base);
    auto* sr = reinterpret_cast<FloatPack<N>*>(sum + base);
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> a = rr[k];
      FloatPack<N> v = sr[k];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        v.v[e] = a.v[e] + v.v[e];
        sq += v.v[e] * v.v[e];
      }
      sr[k] = v;
    }
  }
  const float* src = kAdd ? sum : x;
  const auto* xr = reinterpret_cast<const FloatPack<N>*>(src + base);
  if constexpr (!kAdd)
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> v = xr[k];
#pragma unroll
      for (int e = 0; e < N; ++e) sq += v.v[e] * v.v[e];
    }
  const float r = rsqrtf(warp_sum(sq) / d + eps);
  auto* yr = reinterpret_cast<Pack<T, N>*>(y + base);
  for (int k = lane; k < packs; k += 32) {
    const FloatPack<N> v = xr[k];
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
//   g = dz w and xhat = x r; and the new dx rounded to T into d16 when d16 is not null;
// - with partials: partials[b d + k] = the sum over the block's rows of dz x r in column k (the
//   weight gradient's first pass), each warp summing its rows in a shared-memory row of d floats,
//   then the warps' rows added in warp order. A fixed assignment and order: the same bits run to
//   run. One read of dz and x for both, where a separate pass over the columns read them again.
template <class T, int N>
__global__ void rms_norm_backward(const float* __restrict__ dz, const float* __restrict__ x,
                                  const float* __restrict__ rstd, const T* __restrict__ w, int n,
                                  int d, float* __restrict__ dx, bool accumulate,
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
    const auto* dzr = reinterpret_cast<const FloatPack<N>*>(dz + base);
    const auto* xr = reinterpret_cast<const FloatPack<N>*>(x + base);
    const float r = rstd[r0 + i];
    if (dx == nullptr) {  // the weight gradient's partials alone
      for (int k = lane; k < packs; k += 32) {
        const FloatPack<N> g = dzr[k], xv = xr[k];
        FloatPack<N> acc = mine[k];
#pragma unroll
        for (int e = 0; e < N; ++e) acc.v[e] += g.v[e] * xv.v[e] * r;
        mine[k] = acc;
      }
      continue;
    }
    float s = 0.0f;
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> g = dzr[k], xv = xr[k];
      const Pack<T, N> wv = wr[k];
#pragma unroll
      for (int e = 0; e < N; ++e) s += g.v[e] * to_float(wv.v[e]) * xv.v[e] * r;
    }
    const float mean = warp_sum(s) / d;
    auto* dxr = reinterpret_cast<FloatPack<N>*>(dx + base);
    auto* d16r = d16 != nullptr ? reinterpret_cast<Pack<T, N>*>(d16 + base) : nullptr;
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> g = dzr[k], xv = xr[k];
      const Pack<T, N> wv = wr[k];
      FloatPack<N> out;
      if (accumulate) out = dxr[k];
      Pack<T, N> out16;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float v = r * (g.v[e] * to_float(wv.v[e]) - xv.v[e] * r * mean);
        out.v[e] = accumulate ? out.v[e] + v : v;
        out16.v[e] = from_float<T>(out.v[e]);
      }
      dxr[k] = out;
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

// 4 columns a lane where d is a multiple of 4 and every fp32 operand starts 16-byte aligned,
// every T one 8-byte aligned (then so does every row), else 1.
bool four_a_lane(int d, std::initializer_list<const void*> floats,
                 std::initializer_list<const void*> bit16) {
  bool four = d % 4 == 0;
  for (const void* p : floats) four = four && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  for (const void* p : bit16) four = four && reinterpret_cast<std::uintptr_t>(p) % 8 == 0;
  return four;
}

}  // namespace

template <class T>
void launch_rms_norm_forward(const float* x, const T* w, int n, int d, float eps, T* y,
                             float* rstd) {
  if (four_a_lane(d, {x}, {w, y}))
    rms_norm_forward<T, 4, false><<<warp_blocks(n), 32 * kWarpsPerBlock, 0,
                                    cudaStreamPerThread>>>(x, w, n, d, eps, y, rstd, nullptr,
                                                           nullptr);
  else
    rms_norm_forward<T, 1, false><<<warp_blocks(n), 32 * kWarpsPerBlock, 0,
                                    cudaStreamPerThread>>>(x, w, n, d, eps, y, rstd, nullptr,
                                                           nullptr);
  check_launch();
}

template <class T>
void launch_residual_rms_norm_forward(const float* residual, float* sum, const T* w, int n, int d,
                                      float eps, T* y, float* rstd) {
  if (four_a_lane(d, {residual, sum}, {w, y}))
    rms_norm_forward<T, 4, true><<<warp_blocks(n), 32 * kWarpsPerBlock, 0,
                                   cudaStreamPerThread>>>(nullptr, w, n, d, eps, y, rstd,
                                                          residual, sum);
  else
    rms_norm_forward<T, 1, true><<<warp_blocks(n), 32 * kWarpsPerBlock, 0,
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

template <class T, int N>
void launch_norm_backward(const float* dz, const float* x, const float* rstd, const T* w, int n,
                          int d, float* dx, bool accumulate, T* d16, float* partials) {
  const int warps = norm_backward_warps(d, partials != nullptr);
  const std::size_t bytes =
      partials != nullptr ? static_cast<std::size_t>(warps) * d * sizeof(float) : 0;
  if (bytes > 48 * 1024)  // past the default: the kernel must be allowed it
    SHARDSWAP_CUDA_CHECK(cudaFuncSetAttribute(
        rms_norm_backward<T, N>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(bytes)));
  const int blocks = (n + kCudaNormRowsPerPartial - 1) / kCudaNormRowsPerPartial;
  rms_norm_backward<T, N><<<blocks, 32 * warps, bytes, cudaStreamPerThread>>>(
      dz, x, rstd, w, n, d, dx, accumulate, d16, partials);
}

template <class T>
void launch_rms_norm_backward(const float* dz, const float* x, const float* rstd, const T* w,
                              int n, int d, float* dx, bool accumulate, T* d16, float* partials) {
  if (four_a_lane(d, {dz, x, dx, partials}, {w, d16}))
    launch_norm_backward<T, 4>(dz, x, rstd, w, n, d, dx, accumulate, d16, partials);
  else
    launch_norm_backward<T, 1>(dz, x, rstd, w, n, d, dx, accumulate, d16, partials);
  check_launch();
}

template void launch_rms_norm_forward(const float*, const __nv_bfloat16*, int, int, float,
                                      __nv_bfloat16*, float*);
template void launch_rms_norm_forward(const float*, const __half*, int, int, float, __half*,
                                      float*);
template void launch_residual_rms_norm_forward(const float*, float*, const __nv_bfloat16*, int,
                                               int, float, __nv_bfloat16*, float*);
template void launch_residual_rms_norm_forward(const float*, float*, const __half*, int, int,
                                               float, __half*, float*);
template void launch_rms_norm_backward(const float*, const float*, const float*,
                                       const __nv_bfloat16*, int, int, float*, bool,
                                       __nv_bfloat16*, float*);
template void launch_rms_norm_backward(const float*, const float*, const float*, const __half*,
                                       int, int, float*, bool, __half*, float*);

}  // namespace shardswap::lm::dec
