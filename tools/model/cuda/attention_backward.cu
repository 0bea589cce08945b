// The decoder's own causal GQA attention, backward (tools/model/cuda/kernels.h): dQ, dK and dV in
// fp32 from forward's logsumexp, the probabilities recomputed.
//
// Reproducibility: no atomics. dQ is summed by the block that owns the query rows, dK and dV by
// the block that owns the key tile, over the query heads of its group and the queries in order.
#include <cmath>

#include "model/cuda/attention.cuh"
#include "model/cuda/kernels.h"

namespace shardswap::lm::dec {
namespace {

// delta[t, h] = sum_d dout[t, h, d] * o[t, h, d]: one warp per (token, head).
template <class T>
__global__ void attention_delta(const T* __restrict__ dout, const T* __restrict__ o, int rows,
                                int hd, float* __restrict__ delta) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const long long base = static_cast<long long>(row) * hd;
  float s = 0.0f;
  for (int d = lane; d < hd; d += 32) s += to_float(dout[base + d]) * to_float(o[base + d]);
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// Attention backward, dQ: blocks as attention_forward's; per query row i, with the probabilities
// recomputed from the saved logsumexp, dq_i = scale sum_j p_ij (dp_ij - delta_i) k_j where
// dp_ij = dout_i . v_j, over the keys row i sees (its document's with positions). Writes fp32
// into dq (rows of length ld).
template <class T, int P>
__global__ void __launch_bounds__(32 * kAttnWarps)
    attention_backward_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const T* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, const int* __restrict__ positions,
                          int seq_len, int heads, int kv_heads, int hd, float scale,
                          float* __restrict__ dq, long long ld) {
  __shared__ float ks[kAttnTile * kCudaMaxHeadDim], vs[kAttnTile * kCudaMaxHeadDim];
  const int h = blockIdx.y, g = h / (heads / kv_heads);
  const long long first = static_cast<long long>(blockIdx.z) * seq_len;
  const long long qw = static_cast<long long>(heads) * hd, kw = static_cast<long long>(kv_heads) * hd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = blockIdx.x * kAttnTile;
  float qr[kAttnRowsPerWarp][P], dor[kAttnRowsPerWarp][P], acc[kAttnRowsPerWarp][P],
      row_lse[kAttnRowsPerWarp], row_delta[kAttnRowsPerWarp];
  int lo[kAttnRowsPerWarp];  // each row's first key
#pragma unroll
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = min(q0 + warp + kAttnWarps * r, seq_len - 1);  // rows past the end: unused
    load_lanes<P>(q + (first + i) * qw + h * hd, hd, lane, qr[r]);
    load_lanes<P>(dout + (first + i) * qw + h * hd, hd, lane, dor[r]);
#pragma unroll
    for (int p = 0; p < P; ++p) acc[r][p] = 0.0f;
    row_lse[r] = lse[(first + i) * heads + h];
    row_delta[r] = delta[(first + i) * heads + h];
    lo[r] = first_key(positions, first, i, seq_len);
  }
  const int last = min(seq_len, q0 + kAttnTile) - 1;
  for (int j0 = 0; j0 <= last; j0 += kAttnTile) {
    __syncthreads();
    load_tile(k, first, j0, seq_len, kw, g * hd, hd, ks);
    load_tile(v, first, j0, seq_len, kw, g * hd, hd, vs);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kAttnRowsPerWarp; ++r) {
      const int i = q0 + warp + kAttnWarps * r;
      if (i >= seq_len || j0 > i || j0 + kAttnTile <= lo[r]) continue;
      float ds_mine = 0.0f;  // lane j: p_ij (dp_ij - delta_i) of key j0 + j
      for (int j = 0; j < kAttnTile; ++j) {
        float ps = 0.0f, pd = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int d = lane + 32 * p;
          if (d < hd) {
            ps += qr[r][p] * ks[j * hd + d];
            pd += dor[r][p] * vs[j * hd + d];
          }
        }
        const float s = warp_sum(ps) * scale, dp = warp_sum(pd);
        if (lane == j && j0 + j <= i && j0 + j >= lo[r])
          ds_mine = expf(s - row_lse[r]) * (dp - row_delta[r]);
      }
      for (int j = 0; j < kAttnTile; ++j) {
        const float dsj = __shfl_sync(kFullMask, ds_mine, j);
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int d = lane + 32 * p;
          if (d < hd) acc[r][p] += dsj * ks[j * hd + d];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = q0 + warp + kAttnWarps * r;
    if (i >= seq_len) continue;
    float* out = dq + (first + i) * ld + h * hd;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int d = lane + 32 * p;
      if (d < hd) out[d] = acc[r][p] * scale;
    }
  }
}

// Attention backward, dK and dV: a block owns kAttnTile keys of kv head g in sequence b (grid:
// key tiles, K, B), each warp kAttnRowsPerWarp of them in registers, and walks, for each query
// head of the group in order, the query tiles at and after its keys through shared memory:
// dv_j = sum_i p_ij dout_i, dk_j = scale sum_i p_ij (dp_ij - delta_i) q_i, over the queries
// that see key j (with positions, those of its document). Every sum has one owner and a fixed
// order: no atomics. Writes fp32 into dk, dv (rows of length ld).
template <class T, int P>
__global__ void __launch_bounds__(32 * kAttnWarps)
    attention_backward_dkv(const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, const T* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta,
                           const int* __restrict__ positions, int seq_len, int heads,
                           int kv_heads, int hd, float scale, float* __restrict__ dk,
                           float* __restrict__ dv, long long ld) {
  __shared__ float qs[kAttnTile * kCudaMaxHeadDim], dos[kAttnTile * kCudaMaxHeadDim];
  __shared__ float lse_s[kAttnTile], delta_s[kAttnTile];
  __shared__ int lo_s[kAttnTile];
  const int g = blockIdx.y, group = heads / kv_heads;
  const long long first = static_cast<long long>(blockIdx.z) * seq_len;
  const long long qw = static_cast<long long>(heads) * hd, kw = static_cast<long long>(kv_heads) * hd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k0 = blockIdx.x * kAttnTile;
  float kr[kAttnRowsPerWarp][P], vr[kAttnRowsPerWarp][P], dkr[kAttnRowsPerWarp][P],
      dvr[kAttnRowsPerWarp][P];
#pragma unroll
  for (int c = 0; c < kAttnRowsPerWarp; ++c) {
    const int j = min(k0 + warp * kAttnRowsPerWarp + c, seq_len - 1);  // past the end: unused
    load_lanes<P>(k + (first + j) * kw + g * hd, hd, lane, kr[c]);
    load_lanes<P>(v + (first + j) * kw + g * hd, hd, lane, vr[c]);
#pragma unroll
    for (int p = 0; p < P; ++p) dkr[c][p] = dvr[c][p] = 0.0f;
  }
  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    for (int i0 = k0; i0 < seq_len; i0 += kAttnTile) {
      __syncthreads();
      load_tile(q, first, i0, seq_len, qw, h * hd, hd, qs);
      load_tile(dout, first, i0, seq_len, qw, h * hd, hd, dos);
      for (int r = threadIdx.x; r < kAttnTile; r += blockDim.x) {
        const bool in = i0 + r < seq_len;
        lse_s[r] = in ? lse[(first + i0 + r) * heads + h] : 0.0f;
        delta_s[r] = in ? delta[(first + i0 + r) * heads + h] : 0.0f;
        lo_s[r] = in ? first_key(positions, first, i0 + r, seq_len) : 0;
      }
      __syncthreads();
      const int rows = min(kAttnTile, seq_len - i0);
      for (int r = 0; r < rows; ++r) {
        const int i = i0 + r;
#pragma unroll
        for (int c = 0; c < kAttnRowsPerWarp; ++c) {
          float ps = 0.0f, pd = 0.0f;
#pragma unroll
          for (int p = 0; p < P; ++p) {
            const int d = lane + 32 * p;
            if (d < hd) {
              ps += kr[c][p] * qs[r * hd + d];
              pd += vr[c][p] * dos[r * hd + d];
            }
          }
          const float s = warp_sum(ps) * scale, dp = warp_sum(pd);
          const int j = k0 + warp * kAttnRowsPerWarp + c;
          // Causal (and keys past the end, as j > i there), within the query's document.
          if (j > i || j < lo_s[r]) continue;
          const float prob = expf(s - lse_s[r]), ds = prob * (dp - delta_s[r]);
#pragma unroll
          for (int p = 0; p < P; ++p) {
            const int d = lane + 32 * p;
            if (d < hd) {
              dvr[c][p] += prob * dos[r * hd + d];
              dkr[c][p] += ds * qs[r * hd + d];
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kAttnRowsPerWarp; ++c) {
    const int j = k0 + warp * kAttnRowsPerWarp + c;
    if (j >= seq_len) continue;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int d = lane + 32 * p;
      if (d < hd) {
        dk[(first + j) * ld + g * hd + d] = dkr[c][p] * scale;
        dv[(first + j) * ld + g * hd + d] = dvr[c][p];
      }
    }
  }
}

}  // namespace

template <class T>
void launch_attention_backward(int sequences, int seq_len, int heads, int kv_heads, int hd,
                               const T* q, const T* k, const T* v, const T* o, const T* dout,
                               const float* lse, float* delta, float* grads, long long ld,
                               const int* positions) {
  const int n = sequences * seq_len, tiles = (seq_len + kAttnTile - 1) / kAttnTile;
  attention_delta<T><<<warp_blocks(static_cast<long long>(n) * heads), 32 * kWarpsPerBlock, 0,
                       cudaStreamPerThread>>>(dout, o, n * heads, hd, delta);
  check_launch();
  const float scale = attention_scale(hd);
  const long long qw = static_cast<long long>(heads) * hd,
                  kw = static_cast<long long>(kv_heads) * hd;
  with_lanes(hd, [&](auto lanes) {
    constexpr int P = decltype(lanes)::value;
    attention_backward_dq<T, P>
        <<<dim3(tiles, heads, sequences), 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
            q, k, v, dout, lse, delta, positions, seq_len, heads, kv_heads, hd, scale, grads, ld);
    check_launch();
    attention_backward_dkv<T, P>
        <<<dim3(tiles, kv_heads, sequences), 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
            q, k, v, dout, lse, delta, positions, seq_len, heads, kv_heads, hd, scale, grads + qw,
            grads + qw + kw, ld);
    check_launch();
  });
}

template void launch_attention_backward(int, int, int, int, int, const __nv_bfloat16*,
                                        const __nv_bfloat16*, const __nv_bfloat16*,
                                        const __nv_bfloat16*, const __nv_bfloat16*, const float*,
                                        float*, float*, long long, const int*);
template void launch_attention_backward(int, int, int, int, int, const __half*, const __half*,
                                        const __half*, const __half*, const __half*, const float*,
                                        float*, float*, long long, const int*);

void own_attention_backward(DType dtype, int sequences, int seq_len, int heads, int kv_heads,
                            int head_dim, const void* q, const void* k, const void* v,
                            const void* o, const void* dout, const float* lse, float* delta,
                            float* grads, long long ld) {
  with_bit16(dtype, "own_attention_backward", [&](auto zero) {
    using T = decltype(zero);
    launch_attention_backward<T>(sequences, seq_len, heads, kv_heads, head_dim,
                                 static_cast<const T*>(q), static_cast<const T*>(k),
                                 static_cast<const T*>(v), static_cast<const T*>(o),
                                 static_cast<const T*>(dout), lse, delta, grads, ld, nullptr);
  });
}

}  // namespace shardswap::lm::dec
