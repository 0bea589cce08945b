// Qwen3's RMSNorm of each q and k head over its head_dim features (DecoderShape::qk_norm), on
// the fp32 q|k|v projections before RoPE: forward, its backward at the projections and its
// weight gradient (tools/model/cuda/kernels.h).
//
// Precision: the statistics, the normalised values and the gradient are fp32, in place on the
// fp32 projections; what backward reads, each head's pre-weight values xhat = x / rms(x), is
// kept rounded to the weights' type (as q and k themselves are kept), with the fp32 1 / rms.
// The gradient's copy for the GEMMs is rounded to the weights' type, as RoPE's backward
// rounds it.
//
// Reproducibility: no atomics; the weight gradient is a fixed two-pass sum (partials of
// kCudaRowsPerPartial tokens, each summed in a fixed order, then column_sums.cu's
// launch_finish_columns over the partials in order), the same bits run to run.
#include <cstdint>
#include <initializer_list>

#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

// The warp-per-row kernels below stride over the (token, head) rows rather than launch a warp
// for each: n (H + K) rows can pass a grid's 2^31 blocks where n is near its 2^30 limit.
constexpr long long kMaxRowBlocks = 65535LL * 8;
// The weight gradient's partials: warps a block, a block a chunk of kCudaRowsPerPartial tokens
// (256 blocks at 8 x 2048 tokens: 16 warps a block keep enough loads in flight, 57 us for
// q_norm's partials at Qwen3-0.6B's shape on an H200, where 8 took 84 us).
constexpr int kPartialWarps = 16;

__device__ __forceinline__ long long first_row() {
  return static_cast<long long>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
}
__device__ __forceinline__ long long row_stride() {
  return static_cast<long long>(gridDim.x) * kWarpsPerBlock;
}

// One warp per (token, head) row, the H q heads then the K k heads of the token (contiguous at
// the start of its q|k|v row of qkv, rows ld apart): x (hd fp32 values) becomes x r w in place,
// r = 1 / rms(x), w = wq for a q head and wk for a k head; xhat [n (H + K), hd] gets x r in T
// and rstd [n (H + K)] r. N columns a lane at a time (N = 4: 16-byte loads of x, where the
// launcher finds hd a multiple of 4 and the operands aligned; else 1). hd <= kCudaMaxHeadDim:
// at most one 4-pack a lane.
template <class T, int N>
__global__ void head_norm_forward(float* __restrict__ qkv, long long ld, int n, int heads,
                                  int kv_heads, int hd, const T* __restrict__ wq,
                                  const T* __restrict__ wk, float eps, T* __restrict__ xhat,
                                  float* __restrict__ rstd) {
  const int per_token = heads + kv_heads, lane = threadIdx.x % 32, packs = hd / N;
  const long long rows = static_cast<long long>(n) * per_token;
  for (long long row = first_row(); row < rows; row += row_stride()) {
    const long long t = row / per_token;
    const int h = static_cast<int>(row % per_token);
    auto* xr = reinterpret_cast<FloatPack<N>*>(qkv + t * ld + static_cast<long long>(h) * hd);
    const auto* wr = reinterpret_cast<const Pack<T, N>*>(h < heads ? wq : wk);
    auto* hr = reinterpret_cast<Pack<T, N>*>(xhat + row * hd);
    float sq = 0.0f;
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> v = xr[k];
#pragma unroll
      for (int e = 0; e < N; ++e) sq += v.v[e] * v.v[e];
    }
    const float r = rsqrtf(warp_sum(sq) / hd + eps);
    for (int k = lane; k < packs; k += 32) {
      FloatPack<N> v = xr[k];
      const Pack<T, N> wv = wr[k];
      Pack<T, N> hat;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float x = v.v[e] * r;
        hat.v[e] = from_float<T>(x);
        v.v[e] = x * to_float(wv.v[e]);
      }
      xr[k] = v;
      hr[k] = hat;
    }
    if (lane == 0) rstd[row] = r;
  }
}

// One warp per (token, head) row as the forward, given dz at the norm's output in g's q|k
// columns (fp32, rows ld apart): in place the gradient at its input, r (dz w - xhat mean(dz w
// xhat)), into g and rounded to T into g16 (same rows). Each lane reads its elements again in
// the second pass before it writes them, and no other lane touches them: in place is safe.
template <class T, int N>
__global__ void head_norm_backward(float* __restrict__ g, T* __restrict__ g16, long long ld,
                                   int n, int heads, int kv_heads, int hd,
                                   const T* __restrict__ wq, const T* __restrict__ wk,
                                   const T* __restrict__ xhat, const float* __restrict__ rstd) {
  const int per_token = heads + kv_heads, lane = threadIdx.x % 32, packs = hd / N;
  const long long rows = static_cast<long long>(n) * per_token;
  for (long long row = first_row(); row < rows; row += row_stride()) {
    const long long t = row / per_token;
    const int h = static_cast<int>(row % per_token);
    const long long at = t * ld + static_cast<long long>(h) * hd;
    auto* gr = reinterpret_cast<FloatPack<N>*>(g + at);
    auto* g16r = reinterpret_cast<Pack<T, N>*>(g16 + at);
    const auto* wr = reinterpret_cast<const Pack<T, N>*>(h < heads ? wq : wk);
    const auto* hr = reinterpret_cast<const Pack<T, N>*>(xhat + row * hd);
    const float r = rstd[row];
    float s = 0.0f;
    for (int k = lane; k < packs; k += 32) {
      const FloatPack<N> dz = gr[k];
      const Pack<T, N> wv = wr[k], xv = hr[k];
#pragma unroll
      for (int e = 0; e < N; ++e) s += dz.v[e] * to_float(wv.v[e]) * to_float(xv.v[e]);
    }
    const float mean = warp_sum(s) / hd;
    for (int k = lane; k < packs; k += 32) {
      FloatPack<N> dz = gr[k];
      const Pack<T, N> wv = wr[k], xv = hr[k];
      Pack<T, N> out16;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        dz.v[e] = r * (dz.v[e] * to_float(wv.v[e]) - to_float(xv.v[e]) * mean);
        out16.v[e] = from_float<T>(dz.v[e]);
      }
      gr[k] = dz;
      g16r[k] = out16;
    }
  }
}

// First pass of a head norm's weight gradient over heads [first, first + count) of each token's
// per_token = H + K: partials[chunk * hd + k] = the sum of dz * xhat in column k over the chunk's
// kCudaRowsPerPartial tokens and those heads of each. A block a chunk; its kPartialWarps warps
// take the chunk's (token, head) rows in turn (warp w the rows w, w + kPartialWarps, ...), each
// lane its columns of every row (N = 4: the 4-pack `lane`; N = 1: columns lane + 32 p, p < 4;
// hd <= kCudaMaxHeadDim); then the warps' sums are added in warp order through shared memory.
// A fixed assignment and order: the same bits run to run. At Qwen3-0.6B's shape, 8 x 2048
// tokens, q_norm's partials take 57 us on an H200 (3.6 TB/s); a thread a column, over the
// chunk's 1024 rows in turn, took 221 us.
template <class T, int N>
__global__ void head_norm_partials(const float* __restrict__ dz, long long ld,
                                   const T* __restrict__ xhat, int n, int per_token, int first,
                                   int count, int hd, float* __restrict__ partials) {
  static_assert(N == 1 || N == 4, "4-packs, or one column a lane");
  constexpr int P = N == 4 ? 1 : 4;  // packs a lane: 32 P N columns >= kCudaMaxHeadDim
  static_assert(32 * P * N >= kCudaMaxHeadDim, "a warp covers a head");
  __shared__ float sums[kPartialWarps][kCudaMaxHeadDim];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, chunk = blockIdx.x;
  const int t0 = chunk * kCudaRowsPerPartial, packs = hd / N;
  const int rows = min(n - t0, kCudaRowsPerPartial) * count;
  float acc[P][N] = {};
#pragma unroll 4
  for (int r = warp; r < rows; r += kPartialWarps) {
    const long long t = t0 + r / count;
    const int h = first + r % count;
    const auto* dzr = reinterpret_cast<const FloatPack<N>*>(dz + t * ld +
                                                            static_cast<long long>(h) * hd);
    const auto* xr = reinterpret_cast<const Pack<T, N>*>(xhat + (t * per_token + h) * hd);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int k = lane + 32 * p;
      if (k >= packs) continue;
      const FloatPack<N> g = dzr[k];
      const Pack<T, N> x = xr[k];
#pragma unroll
      for (int e = 0; e < N; ++e) acc[p][e] += g.v[e] * to_float(x.v[e]);
    }
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int k = lane + 32 * p;
    if (k >= packs) continue;
#pragma unroll
    for (int e = 0; e < N; ++e) sums[warp][k * N + e] = acc[p][e];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < hd; c += blockDim.x) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kPartialWarps; ++w) s += sums[w][c];
    partials[static_cast<long long>(chunk) * hd + c] = s;
  }
}

// 4 columns a lane where hd and the row length are multiples of 4 (then every row of qkv and
// xhat starts where its operand does, plus a multiple of 4 elements) and every fp32 operand
// starts 16-byte aligned, every T one 8-byte aligned; else 1.
bool four_a_lane(int hd, long long ld, std::initializer_list<const void*> floats,
                 std::initializer_list<const void*> bit16) {
  bool four = hd % 4 == 0 && ld % 4 == 0;
  for (const void* p : floats) four = four && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  for (const void* p : bit16) four = four && reinterpret_cast<std::uintptr_t>(p) % 8 == 0;
  return four;
}

int row_blocks(int n, int heads, int kv_heads) {
  const long long rows = static_cast<long long>(n) * (heads + kv_heads);
  const long long blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<int>(blocks < kMaxRowBlocks ? blocks : kMaxRowBlocks);
}

}  // namespace

template <class T>
void launch_head_norm_forward(float* qkv, long long ld, int n, int heads, int kv_heads, int hd,
                              const T* wq, const T* wk, float eps, T* xhat, float* rstd) {
  const int blocks = row_blocks(n, heads, kv_heads);
  if (four_a_lane(hd, ld, {qkv}, {wq, wk, xhat}))
    head_norm_forward<T, 4><<<blocks, 32 * kWarpsPerBlock, 0, cudaStreamPerThread>>>(
        qkv, ld, n, heads, kv_heads, hd, wq, wk, eps, xhat, rstd);
  else
    head_norm_forward<T, 1><<<blocks, 32 * kWarpsPerBlock, 0, cudaStreamPerThread>>>(
        qkv, ld, n, heads, kv_heads, hd, wq, wk, eps, xhat, rstd);
  check_launch();
}

template <class T>
void launch_head_norm_backward(float* g, T* g16, long long ld, int n, int heads, int kv_heads,
                               int hd, const T* wq, const T* wk, const T* xhat,
                               const float* rstd) {
  const int blocks = row_blocks(n, heads, kv_heads);
  if (four_a_lane(hd, ld, {g}, {g16, wq, wk, xhat}))
    head_norm_backward<T, 4><<<blocks, 32 * kWarpsPerBlock, 0, cudaStreamPerThread>>>(
        g, g16, ld, n, heads, kv_heads, hd, wq, wk, xhat, rstd);
  else
    head_norm_backward<T, 1><<<blocks, 32 * kWarpsPerBlock, 0, cudaStreamPerThread>>>(
        g, g16, ld, n, heads, kv_heads, hd, wq, wk, xhat, rstd);
  check_launch();
}

template <class T>
void launch_head_norm_partials(const float* dz, long long ld, const T* xhat, int n,
                               int per_token, int first, int count, int hd, float* partials) {
  const int chunks = (n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial;
  if (four_a_lane(hd, ld, {dz}, {xhat}))
    head_norm_partials<T, 4><<<chunks, 32 * kPartialWarps, 0, cudaStreamPerThread>>>(
        dz, ld, xhat, n, per_token, first, count, hd, partials);
  else
    head_norm_partials<T, 1><<<chunks, 32 * kPartialWarps, 0, cudaStreamPerThread>>>(
        dz, ld, xhat, n, per_token, first, count, hd, partials);
  check_launch();
}

template void launch_head_norm_forward(float*, long long, int, int, int, int,
                                       const __nv_bfloat16*, const __nv_bfloat16*, float,
                                       __nv_bfloat16*, float*);
template void launch_head_norm_forward(float*, long long, int, int, int, int, const __half*,
                                       const __half*, float, __half*, float*);
template void launch_head_norm_backward(float*, __nv_bfloat16*, long long, int, int, int, int,
                                        const __nv_bfloat16*, const __nv_bfloat16*,
                                        const __nv_bfloat16*, const float*);
template void launch_head_norm_backward(float*, __half*, long long, int, int, int, int,
                                        const __half*, const __half*, const __half*,
                                        const float*);
template void launch_head_norm_partials(const float*, long long, const __nv_bfloat16*, int, int,
                                        int, int, int, float*);
template void launch_head_norm_partials(const float*, long long, const __half*, int, int, int,
                                        int, int, float*);

}  // namespace shardswap::lm::dec
