// What the decoder's own attention kernels share (attention_forward.cu, attention_backward.cu):
// the tiling and the loads of head vectors into registers and of tiles into shared memory.
// Device code, included by those .cu files only.
#pragma once

#include <cmath>
#include <type_traits>

#include "model/cuda/common.cuh"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {

// Attention: a block of kAttnWarps warps; a tile is kAttnTile keys (forward, dQ: each warp takes
// kAttnTile / kAttnWarps of the block's kAttnTile query rows) or kAttnTile queries (dK, dV: each
// warp owns kAttnTile / kAttnWarps keys).
inline constexpr int kAttnWarps = 8;
inline constexpr int kAttnTile = 32;
inline constexpr int kAttnRowsPerWarp = kAttnTile / kAttnWarps;

// Loads a head vector's elements d = lane + 32 p (p < P) of row `row` (zero past hd).
template <int P, class T>
__device__ __forceinline__ void load_lanes(const T* row, int hd, int lane, float (&out)[P]) {
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int d = lane + 32 * p;
    out[p] = d < hd ? to_float(row[d]) : 0.0f;
  }
}

// Rows [t0, t0 + kAttnTile) of one head (columns [col, col + hd) of rows of length ld) into
// shared memory as fp32 [kAttnTile][hd], zero past the sequence's end.
template <class T>
__device__ void load_tile(const T* __restrict__ src, long long first_row, int t0, int seq_len,
                          long long ld, int col, int hd, float* __restrict__ tile) {
  for (int e = threadIdx.x; e < kAttnTile * hd; e += blockDim.x) {
    const int r = e / hd, d = e % hd;
    tile[e] = t0 + r < seq_len ? to_float(src[(first_row + t0 + r) * ld + col + d]) : 0.0f;
  }
}

// The first key row i (of the sequence whose first token is `first`) sees: 0, or with
// positions (documents apart) its document's first token, i - positions[first + i]. Rows past
// the sequence's end: 0 (unused).
__device__ __forceinline__ int first_key(const int* __restrict__ positions, long long first,
                                         int i, int seq_len) {
  return positions != nullptr && i < seq_len ? i - positions[first + i] : 0;
}

// Calls f(std::integral_constant<int, P>) with P = head_dim / 32 rounded up (1..4).
template <class F>
void with_lanes(int hd, F&& f) {
  switch ((hd + 31) / 32) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    default:
      return f(std::integral_constant<int, 4>{});
  }
}

// 1 / sqrt(head_dim), the scores' scale, as both directions compute it.
inline float attention_scale(int hd) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
}

}  // namespace shardswap::lm::dec
