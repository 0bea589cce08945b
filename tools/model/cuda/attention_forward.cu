// The decoder's own causal GQA attention, forward (tools/model/cuda/kernels.h): what it runs
// without cuDNN, or with model.attention = "own". Flash style: the scores are never
// stored, only o and each row's logsumexp; the softmax is fp32, o is rounded to the operands'
// type.
#include <cmath>

#include "model/cuda/attention.cuh"
#include "model/cuda/kernels.h"

namespace shardswap::lm::dec {
namespace {

// Flash-style causal attention forward: a block holds kAttnTile query rows of head h in sequence
// b (grid: query tiles, H, B) and walks the key tiles up to its last row through shared memory,
// keeping per row the running max m, the running sum l and the unnormalized output, so memory is
// O(T) per head. Writes o (T) and the row's logsumexp m + log l. With positions (documents
// apart), row i sees keys i - positions[i] .. i only; key tiles wholly before that are skipped,
// so every tile a row takes holds a key it sees (m stays finite).
template <class T, int P>
__global__ void __launch_bounds__(32 * kAttnWarps)
    attention_forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const int* __restrict__ positions, int seq_len, int heads, int kv_heads,
                      int hd, float scale, T* __restrict__ o, float* __restrict__ lse) {
  __shared__ float ks[kAttnTile * kCudaMaxHeadDim], vs[kAttnTile * kCudaMaxHeadDim];
  const int h = blockIdx.y, g = h / (heads / kv_heads);
  const long long first = static_cast<long long>(blockIdx.z) * seq_len;
  const long long qw = static_cast<long long>(heads) * hd, kw = static_cast<long long>(kv_heads) * hd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = blockIdx.x * kAttnTile;
  float qr[kAttnRowsPerWarp][P], acc[kAttnRowsPerWarp][P], m[kAttnRowsPerWarp],
      l[kAttnRowsPerWarp];
  int lo[kAttnRowsPerWarp];  // each row's first key
  // The warp's rows are interleaved (q0 + warp + kAttnWarps r) to share the causal work evenly.
#pragma unroll
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = q0 + warp + kAttnWarps * r;
    if (i < seq_len) {
      load_lanes<P>(q + (first + i) * qw + h * hd, hd, lane, qr[r]);
    } else {
#pragma unroll
      for (int p = 0; p < P; ++p) qr[r][p] = 0.0f;
    }
#pragma unroll
    for (int p = 0; p < P; ++p) acc[r][p] = 0.0f;
    m[r] = -INFINITY;
    l[r] = 0.0f;
    lo[r] = first_key(positions, first, i, seq_len);
  }
  const int last = min(seq_len, q0 + kAttnTile) - 1;
  for (int j0 = 0; j0 <= last; j0 += kAttnTile) {
    __syncthreads();  // the previous tile is consumed
    load_tile(k, first, j0, seq_len, kw, g * hd, hd, ks);
    load_tile(v, first, j0, seq_len, kw, g * hd, hd, vs);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kAttnRowsPerWarp; ++r) {
      const int i = q0 + warp + kAttnWarps * r;
      // The same for the whole warp.
      if (i >= seq_len || j0 > i || j0 + kAttnTile <= lo[r]) continue;
      float s_mine = -INFINITY;  // lane j: the score of key j0 + j
      for (int j = 0; j < kAttnTile; ++j) {
        float part = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int d = lane + 32 * p;
          if (d < hd) part += qr[r][p] * ks[j * hd + d];
        }
        const float s = warp_sum(part) * scale;
        if (lane == j && j0 + j <= i && j0 + j >= lo[r]) s_mine = s;
      }
      const float m_new = fmaxf(m[r], warp_max(s_mine));  // finite: key j0 <= i is in the tile
      const float correction = expf(m[r] - m_new);         // 0 on the first tile
      const float p_mine = expf(s_mine - m_new);           // 0 for masked keys
      l[r] = l[r] * correction + warp_sum(p_mine);
#pragma unroll
      for (int p = 0; p < P; ++p) acc[r][p] *= correction;
      for (int j = 0; j < kAttnTile; ++j) {
        const float pj = __shfl_sync(kFullMask, p_mine, j);
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int d = lane + 32 * p;
          if (d < hd) acc[r][p] += pj * vs[j * hd + d];
        }
      }
      m[r] = m_new;
    }
  }
#pragma unroll
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = q0 + warp + kAttnWarps * r;
    if (i >= seq_len) continue;
    const float inv = 1.0f / l[r];
    T* out = o + (first + i) * qw + h * hd;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int d = lane + 32 * p;
      if (d < hd) out[d] = from_float<T>(acc[r][p] * inv);
    }
    if (lane == 0) lse[(first + i) * heads + h] = m[r] + logf(l[r]);
  }
}

}  // namespace

template <class T>
void launch_attention_forward(int sequences, int seq_len, int heads, int kv_heads, int hd,
                              const T* q, const T* k, const T* v, T* o, float* lse,
                              const int* positions) {
  const dim3 grid((seq_len + kAttnTile - 1) / kAttnTile, heads, sequences);
  const float scale = attention_scale(hd);
  with_lanes(hd, [&](auto lanes) {
    attention_forward<T, decltype(lanes)::value><<<grid, 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
        q, k, v, positions, seq_len, heads, kv_heads, hd, scale, o, lse);
  });
  check_launch();
}

template void launch_attention_forward(int, int, int, int, int, const __nv_bfloat16*,
                                       const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                                       float*, const int*);
template void launch_attention_forward(int, int, int, int, int, const __half*, const __half*,
                                       const __half*, __half*, float*, const int*);

void own_attention_forward(DType dtype, int sequences, int seq_len, int heads, int kv_heads,
                           int head_dim, const void* q, const void* k, const void* v, void* o,
                           float* lse) {
  with_bit16(dtype, "own_attention_forward", [&](auto zero) {
    using T = decltype(zero);
    launch_attention_forward<T>(sequences, seq_len, heads, kv_heads, head_dim,
                                static_cast<const T*>(q), static_cast<const T*>(k),
                                static_cast<const T*>(v), static_cast<T*>(o), lse, nullptr);
  });
}

}  // namespace shardswap::lm::dec
