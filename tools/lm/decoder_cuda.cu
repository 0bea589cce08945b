// The decoder's CUDA backend (the math is decoder_compute.h's). Every projection is a cuBLAS GEMM
// (cublasGemmEx, bit16 inputs, fp32 accumulation, CUBLAS_COMPUTE_32F); weight gradients are
// written by the GEMM straight into the engine's grad slot (beta = 1, alpha = grad scale /
// tokens). Small kernels do the rest: embedding gather, RMSNorm, bias + RoPE, causal GQA
// attention (flash style), SwiGLU, the chunked cross-entropy, bias and norm gradients and the
// embedding gradient.
//
// Precision: the residual stream, GEMM outputs that feed a reduction, norm statistics and the
// softmaxes are fp32; GEMM inputs and attention's operands are rounded to the weights' type, as a
// bf16 model in transformers rounds them. Activation gradients are those of the summed loss,
// O(1) per token whatever the batch or the loss scale, so fp16 neither underflows nor overflows
// there; grad_scale / tokens enters only where a param gradient is written.
//
// Reproducibility: no atomics. Sums over tokens (bias and norm gradients) are fixed two-pass
// trees; attention's dK and dV are summed by the block that owns the key tile, over queries in
// order; the embedding gradient sums each column of a token over its positions in order;
// cuBLAS is deterministic for a given handle, stream and workspace. Two runs give the same bits.
//
// Ordering: everything is queued on cudaStreamPerThread (the engine's contract); the host waits
// only to read the loss (or the logits) back.
//
// Attention: cuDNN's fused flash attention where the build has cuDNN (cudnn_attention.h) and
// head_dim is a multiple of 8, else (or with SHARDSWAP_DECODER_ATTENTION=own) the kernels
// below. cuDNN keeps lse as [sequence, head, position] and writes dQ, dK, dV in the operands'
// type (rounded from its fp32 sums, where the own kernels keep fp32), which the RoPE backward
// reads as they are. Its backward is the deterministic one (dP in its workspace, in
// calls of a few sequences) unless SHARDSWAP_DECODER_ATTENTION=cudnn-atomic asks for the one
// that sums dQ over key tiles with atomics, whose runs differ in the last bits.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_profiler_api.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "memory/cuda/cuda_check.h"
#include "shardswap/error.h"
#include "tools/lm/cublas_check.cuh"
#include "tools/lm/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 8;
// Attention: a block of kAttnWarps warps; a tile is kAttnTile keys (forward, dQ: each warp takes
// kAttnTile / kAttnWarps of the block's kAttnTile query rows) or kAttnTile queries (dK, dV: each
// warp owns kAttnTile / kAttnWarps keys).
constexpr int kAttnWarps = 8;
constexpr int kAttnTile = 32;
constexpr int kAttnRowsPerWarp = kAttnTile / kAttnWarps;
constexpr int kCeThreads = 256;
// The q|k|v kernels: a block per token row, its threads over the row's RoPE pairs and v columns
// (640 of them at Qwen2.5-0.5B's shape).
constexpr int kQkvThreads = 128;

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

template <class T>
constexpr cudaDataType_t cuda_type();
template <>
constexpr cudaDataType_t cuda_type<__nv_bfloat16>() {
  return CUDA_R_16BF;
}
template <>
constexpr cudaDataType_t cuda_type<__half>() {
  return CUDA_R_16F;
}
template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<__nv_bfloat16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<__half>() {
  return DType::f16;
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

// A fixed tree over the block (blockDim.x == kCeThreads); every thread gets the result.
template <bool kMax>
__device__ float block_reduce(float v, float* shared) {
  __syncthreads();  // shared is free (an earlier reduction has been read)
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kCeThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const float other = shared[threadIdx.x + stride];
      shared[threadIdx.x] = kMax ? fmaxf(shared[threadIdx.x], other) : shared[threadIdx.x] + other;
    }
    __syncthreads();
  }
  return shared[0];
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

// ---- kernels; activations are row-major [token, feature], token = sequence * T + position ----

#define GRID_STRIDE(i, count)                                                      \
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; \
       i < (count); i += static_cast<long long>(gridDim.x) * blockDim.x)

// x0[t, :] = embed[tokens[t], :]
template <class T>
__global__ void embed_forward(const T* __restrict__ table, const int* __restrict__ tokens, int n,
                              int d, float* __restrict__ x0) {
  GRID_STRIDE(i, static_cast<long long>(n) * d) {
    x0[i] = to_float(table[static_cast<long long>(tokens[i / d]) * d + i % d]);
  }
}

// One warp per row: y = x / rms(x) * w in T; keeps 1 / rms when rstd is not null. N columns a
// lane at a time (N = 4: 16-byte loads of x, where the launcher finds d a multiple of 4 and the
// operands aligned; else 1).
template <class T, int N>
__global__ void rms_norm_forward(const float* __restrict__ x, const T* __restrict__ w, int n,
                                 int d, float eps, T* __restrict__ y, float* __restrict__ rstd) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const auto* xr = reinterpret_cast<const FloatPack<N>*>(x + static_cast<long long>(row) * d);
  const auto* wr = reinterpret_cast<const Pack<T, N>*>(w);
  const int packs = d / N;
  float sq = 0.0f;
  for (int k = lane; k < packs; k += 32) {
    const FloatPack<N> v = xr[k];
#pragma unroll
    for (int e = 0; e < N; ++e) sq += v.v[e] * v.v[e];
  }
  const float r = rsqrtf(warp_sum(sq) / d + eps);
  auto* yr = reinterpret_cast<Pack<T, N>*>(y + static_cast<long long>(row) * d);
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

// One warp per row, given dz at the norm's output: dx (= or +=) the gradient at its input,
// r (g - xhat mean(g xhat)) with g = dz w, xhat = x r; and the new dx rounded to T into d16 (the
// next GEMMs' input) when d16 is not null. N columns a lane at a time, as the forward.
template <class T, int N>
__global__ void rms_norm_backward(const float* __restrict__ dz, const float* __restrict__ x,
                                  const float* __restrict__ rstd, const T* __restrict__ w, int n,
                                  int d, float* __restrict__ dx, bool accumulate,
                                  T* __restrict__ d16) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const long long base = static_cast<long long>(row) * d;
  const auto* dzr = reinterpret_cast<const FloatPack<N>*>(dz + base);
  const auto* xr = reinterpret_cast<const FloatPack<N>*>(x + base);
  const auto* wr = reinterpret_cast<const Pack<T, N>*>(w);
  auto* dxr = reinterpret_cast<FloatPack<N>*>(dx + base);
  auto* d16r = d16 != nullptr ? reinterpret_cast<Pack<T, N>*>(d16 + base) : nullptr;
  const int packs = d / N;
  const float r = rstd[row];
  float s = 0.0f;
  for (int k = lane; k < packs; k += 32) {
    const FloatPack<N> g = dzr[k], xv = xr[k];
    const Pack<T, N> wv = wr[k];
#pragma unroll
    for (int e = 0; e < N; ++e) s += g.v[e] * to_float(wv.v[e]) * xv.v[e] * r;
  }
  const float mean = warp_sum(s) / d;
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
  }
}

// The q|k|v projections' units of work: a rotated pair (i, i + hd/2) of a q or k head, or one
// element of v. unit_place finds a unit's first column in the q|k|v row, its output tensor
// (0 q, 1 k, 2 v), its column there and its frequency index (-1 for v).
struct QkvUnit {
  int column, part, out_column, freq;
};
__device__ __forceinline__ QkvUnit unit_place(int u, int heads, int kv_heads, int hd) {
  const int half = hd / 2;
  if (u < heads * half) return {u / half * hd + u % half, 0, u / half * hd + u % half, u % half};
  u -= heads * half;
  const int qw = heads * hd;
  if (u < kv_heads * half) {
    const int c = u / half * hd + u % half;
    return {qw + c, 1, c, u % half};
  }
  u -= kv_heads * half;
  return {qw + kv_heads * hd + u, 2, u, -1};
}

// cos and sin of RoPE's angles pos * inv_freq[f], [seq_len, hd / 2] each, once a forward: the
// q|k|v kernels below read them rather than evaluate cosf and sinf per element (with a 64-bit
// division per element as well, those kernels were bound by arithmetic: 2.1 ms forward and 1.8
// ms backward of a Qwen2.5-0.5B step on an H200, three times their memory traffic). The same
// expressions as before, so the same bits.
__global__ void rope_table(const float* __restrict__ inv_freq, int seq_len, int half,
                           float* __restrict__ cos_out, float* __restrict__ sin_out) {
  GRID_STRIDE(i, static_cast<long long>(seq_len) * half) {
    const int pos = static_cast<int>(i / half), f = static_cast<int>(i % half);
    const float angle = static_cast<float>(pos) * inv_freq[f];
    cos_out[i] = cosf(angle);
    sin_out[i] = sinf(angle);
  }
}

// From the projections qkv [n, (H + 2K) hd] (fp32): q, k with their bias and RoPE (rotate-half:
// (a, b) -> (a cos - b sin, b cos + a sin) at angle pos * inv_freq[i]), v with its bias, in T.
// One block per token row.
template <class T>
__global__ void qkv_forward(const float* __restrict__ qkv, const T* __restrict__ bq,
                            const T* __restrict__ bk, const T* __restrict__ bv,
                            const float* __restrict__ rope_cos, const float* __restrict__ rope_sin,
                            int seq_len, int heads, int kv_heads, int hd, T* __restrict__ q,
                            T* __restrict__ k, T* __restrict__ v) {
  const int half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  const int units = (heads + kv_heads) * half + kv_heads * hd;
  const long long t = blockIdx.x;
  const float* row = qkv + t * width;
  const float* cr = rope_cos + static_cast<long long>(t % seq_len) * half;
  const float* sr = rope_sin + static_cast<long long>(t % seq_len) * half;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const QkvUnit p = unit_place(u, heads, kv_heads, hd);
    if (p.part == 2) {
      v[t * kv_heads * hd + p.out_column] =
          from_float<T>(row[p.column] + (bv ? to_float(bv[p.out_column]) : 0.0f));
      continue;
    }
    const T* bias = p.part == 0 ? bq : bk;
    T* out = p.part == 0 ? q : k;
    const long long ld = static_cast<long long>(p.part == 0 ? heads : kv_heads) * hd;
    const float a = row[p.column] + (bias ? to_float(bias[p.out_column]) : 0.0f);
    const float b = row[p.column + half] + (bias ? to_float(bias[p.out_column + half]) : 0.0f);
    const float c = cr[p.freq], s = sr[p.freq];
    out[t * ld + p.out_column] = from_float<T>(a * c - b * s);
    out[t * ld + p.out_column + half] = from_float<T>(b * c + a * s);
  }
}

// Backward of qkv_forward's RoPE: from dq|dk|dv [n, (H + 2K) hd] in `in` (fp32 from the own
// attention kernels, T from cuDNN's), the gradient at the projections into g (fp32, which the
// bias gradients sum) and the same rounded to T into g16 (the GEMMs' input). `in` may be g or
// g16: each unit reads its elements before it writes them. One block per token row.
template <class T, class In>
__global__ void qkv_backward(const In* in, float* g, const float* __restrict__ rope_cos,
                             const float* __restrict__ rope_sin, int seq_len, int heads,
                             int kv_heads, int hd, T* g16) {
  const int half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  const int units = (heads + kv_heads) * half + kv_heads * hd;
  const long long t = blockIdx.x;
  const In* row_in = in + t * width;
  float* row = g + t * width;
  T* row16 = g16 + t * width;
  const float* cr = rope_cos + static_cast<long long>(t % seq_len) * half;
  const float* sr = rope_sin + static_cast<long long>(t % seq_len) * half;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const QkvUnit p = unit_place(u, heads, kv_heads, hd);
    if (p.part == 2) {
      const float dv = to_float(row_in[p.column]);
      row[p.column] = dv;
      row16[p.column] = from_float<T>(dv);
      continue;
    }
    const float da = to_float(row_in[p.column]), db = to_float(row_in[p.column + half]);
    const float c = cr[p.freq], s = sr[p.freq];
    const float ga = da * c + db * s, gb = db * c - da * s;  // the rotation's transpose
    row[p.column] = ga;
    row[p.column + half] = gb;
    row16[p.column] = from_float<T>(ga);
    row16[p.column + half] = from_float<T>(gb);
  }
}

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

// Flash-style causal attention forward: a block holds kAttnTile query rows of head h in sequence
// b (grid: query tiles, H, B) and walks the key tiles up to its last row through shared memory,
// keeping per row the running max m, the running sum l and the unnormalized output, so memory is
// O(T) per head. Writes o (T) and the row's logsumexp m + log l.
template <class T, int P>
__global__ void __launch_bounds__(32 * kAttnWarps)
    attention_forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      int seq_len, int heads, int kv_heads, int hd, float scale,
                      T* __restrict__ o, float* __restrict__ lse) {
  __shared__ float ks[kAttnTile * kCudaMaxHeadDim], vs[kAttnTile * kCudaMaxHeadDim];
  const int h = blockIdx.y, g = h / (heads / kv_heads);
  const long long first = static_cast<long long>(blockIdx.z) * seq_len;
  const long long qw = static_cast<long long>(heads) * hd, kw = static_cast<long long>(kv_heads) * hd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = blockIdx.x * kAttnTile;
  float qr[kAttnRowsPerWarp][P], acc[kAttnRowsPerWarp][P], m[kAttnRowsPerWarp],
      l[kAttnRowsPerWarp];
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
      if (i >= seq_len || j0 > i) continue;  // the same for the whole warp
      float s_mine = -INFINITY;  // lane j: the score of key j0 + j
      for (int j = 0; j < kAttnTile; ++j) {
        float part = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int d = lane + 32 * p;
          if (d < hd) part += qr[r][p] * ks[j * hd + d];
        }
        const float s = warp_sum(part) * scale;
        if (lane == j && j0 + j <= i) s_mine = s;
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
// dp_ij = dout_i . v_j. Writes fp32 into dq (rows of length ld).
template <class T, int P>
__global__ void __launch_bounds__(32 * kAttnWarps)
    attention_backward_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const T* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, int seq_len, int heads, int kv_heads,
                          int hd, float scale, float* __restrict__ dq, long long ld) {
  __shared__ float ks[kAttnTile * kCudaMaxHeadDim], vs[kAttnTile * kCudaMaxHeadDim];
  const int h = blockIdx.y, g = h / (heads / kv_heads);
  const long long first = static_cast<long long>(blockIdx.z) * seq_len;
  const long long qw = static_cast<long long>(heads) * hd, kw = static_cast<long long>(kv_heads) * hd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = blockIdx.x * kAttnTile;
  float qr[kAttnRowsPerWarp][P], dor[kAttnRowsPerWarp][P], acc[kAttnRowsPerWarp][P],
      row_lse[kAttnRowsPerWarp], row_delta[kAttnRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = min(q0 + warp + kAttnWarps * r, seq_len - 1);  // rows past the end: unused
    load_lanes<P>(q + (first + i) * qw + h * hd, hd, lane, qr[r]);
    load_lanes<P>(dout + (first + i) * qw + h * hd, hd, lane, dor[r]);
#pragma unroll
    for (int p = 0; p < P; ++p) acc[r][p] = 0.0f;
    row_lse[r] = lse[(first + i) * heads + h];
    row_delta[r] = delta[(first + i) * heads + h];
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
      if (i >= seq_len || j0 > i) continue;
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
        if (lane == j && j0 + j <= i) ds_mine = expf(s - row_lse[r]) * (dp - row_delta[r]);
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
// dv_j = sum_i p_ij dout_i, dk_j = scale sum_i p_ij (dp_ij - delta_i) q_i. Every sum has one
// owner and a fixed order: no atomics. Writes fp32 into dk, dv (rows of length ld).
template <class T, int P>
__global__ void __launch_bounds__(32 * kAttnWarps)
    attention_backward_dkv(const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, const T* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta,
                           int seq_len, int heads, int kv_heads, int hd, float scale,
                           float* __restrict__ dk, float* __restrict__ dv, long long ld) {
  __shared__ float qs[kAttnTile * kCudaMaxHeadDim], dos[kAttnTile * kCudaMaxHeadDim];
  __shared__ float lse_s[kAttnTile], delta_s[kAttnTile];
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
          if (j > i) continue;  // causal (and keys past the end, as j > i there)
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

// SwiGLU's elements go 8 at a time (16-byte loads of T: scalar 2-byte loads left these kernels
// at a third of the memory bandwidth, 0.35 ms a call at 8 x 2048 x 4864 on an H200); the
// launcher (with_pack) checks that every pointer is 16-byte aligned and count a multiple of 8,
// else they go one at a time. (Pack and FloatPack: above the kernels.)

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

// act = silu(gate) * up in T, N elements a thread.
template <class T, int N>
__global__ void swiglu_forward(const T* __restrict__ gate, const T* __restrict__ up,
                               long long packs, T* __restrict__ act) {
  GRID_STRIDE(i, packs) {
    const Pack<T, N> g = reinterpret_cast<const Pack<T, N>*>(gate)[i];
    const Pack<T, N> u = reinterpret_cast<const Pack<T, N>*>(up)[i];
    Pack<T, N> a;
#pragma unroll
    for (int e = 0; e < N; ++e) a.v[e] = from_float<T>(silu(to_float(g.v[e])) * to_float(u.v[e]));
    reinterpret_cast<Pack<T, N>*>(act)[i] = a;
  }
}

// Given dact (fp32): gate and up are replaced by their gradients (T; they are not needed after),
// and, when act is not null, act = silu(gate) * up is recomputed for the down projection's
// weight gradient in the same pass (backward does not keep act from forward).
template <class T, int N>
__global__ void swiglu_backward(const float* __restrict__ dact, T* __restrict__ gate,
                                T* __restrict__ up, T* __restrict__ act, long long packs) {
  GRID_STRIDE(i, packs) {
    const FloatPack<N> da = reinterpret_cast<const FloatPack<N>*>(dact)[i];
    Pack<T, N> g = reinterpret_cast<const Pack<T, N>*>(gate)[i];
    Pack<T, N> u = reinterpret_cast<const Pack<T, N>*>(up)[i];
    Pack<T, N> a;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float gv = to_float(g.v[e]), uv = to_float(u.v[e]);
      const float sig = 1.0f / (1.0f + expf(-gv));
      a.v[e] = from_float<T>(gv * sig * uv);
      g.v[e] = from_float<T>(da.v[e] * uv * sig * (1.0f + gv * (1.0f - sig)));
      u.v[e] = from_float<T>(da.v[e] * gv * sig);
    }
    reinterpret_cast<Pack<T, N>*>(gate)[i] = g;
    reinterpret_cast<Pack<T, N>*>(up)[i] = u;
    if (act != nullptr) reinterpret_cast<Pack<T, N>*>(act)[i] = a;
  }
}

// One block per token row of the chunk: loss = logsumexp(z) - z[target]; with `grad`, the row
// is replaced in place by dz = softmax(z) - onehot(target) (the gradient of the summed loss) in
// T, at the row's start (so rows of T are 2 V apart). N columns a thread at a time: 16-byte loads
// (N = 4) where the launcher finds vocab a multiple of 4, since one 4-byte load a thread keeps
// too few bytes in flight to reach the memory bandwidth (8.6 ms for the 16 chunks of a 0.5B
// step on an H200, ~3 TB/s). In place is safe: each round of kCeThreads N columns is read before
// the barrier and written after it, and writes of round t reach only fp32 columns below
// kCeThreads N (t + 1) / 2, all read by then.
template <class T, int N>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_rows(float* logits, int vocab, const int* __restrict__ targets,
                       float* __restrict__ row_loss, bool grad) {
  __shared__ float shared[kCeThreads];
  float* z = logits + static_cast<long long>(blockIdx.x) * vocab;
  const FloatPack<N>* zp = reinterpret_cast<const FloatPack<N>*>(z);
  const int packs = vocab / N;
  // One pass for the row's max and sum of exp (each thread's running sum rescaled when its
  // max grows), then the gradient pass: the row is read twice, not three times.
  float m = -INFINITY, sum = 0.0f;
#pragma unroll 4
  for (int p = threadIdx.x; p < packs; p += kCeThreads) {
    const FloatPack<N> x = zp[p];
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (x.v[e] > m) {
        sum = sum * expf(m - x.v[e]) + 1.0f;
        m = x.v[e];
      } else {
        sum += expf(x.v[e] - m);
      }
    }
  }
  const float row_max = block_reduce<true>(m, shared);
  sum = m == -INFINITY ? 0.0f : sum * expf(m - row_max);
  const float lse = row_max + logf(block_reduce<false>(sum, shared));
  const int target = targets[blockIdx.x];
  if (threadIdx.x == 0) row_loss[blockIdx.x] = lse - z[target];  // before any write below
  if (!grad) return;
  Pack<T, N>* dz = reinterpret_cast<Pack<T, N>*>(z);
  for (int base = 0; base < packs; base += kCeThreads) {
    const int p = base + threadIdx.x;
    Pack<T, N> out;
    if (p < packs) {
      const FloatPack<N> x = zp[p];
#pragma unroll
      for (int e = 0; e < N; ++e)
        out.v[e] = from_float<T>(expf(x.v[e] - lse) - (p * N + e == target ? 1.0f : 0.0f));
    }
    __syncthreads();
    if (p < packs) dz[p] = out;
  }
}

// One block: out = mean of loss[0..n) in double, by a fixed tree.
__global__ void mean_of(const float* __restrict__ loss, int n, double* __restrict__ out) {
  __shared__ double partial[256];
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += loss[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = partial[0] / n;
}

// First pass of a column sum of x [n, w] (rows ld apart): partials[chunk * w + k] = the sum
// over the chunk's kCudaRowsPerPartial rows.
__global__ void column_partials(const float* __restrict__ x, int n, int w, long long ld,
                                float* __restrict__ partials) {
  const int k = blockIdx.y * blockDim.x + threadIdx.x, chunk = blockIdx.x;
  if (k >= w) return;
  const int end = min(n, (chunk + 1) * kCudaRowsPerPartial);
  float acc = 0.0f;
  for (int s = chunk * kCudaRowsPerPartial; s < end; ++s) acc += x[s * ld + k];
  partials[static_cast<long long>(chunk) * w + k] = acc;
}

// First pass of an RMSNorm's weight gradient: per chunk, sum of dz * x * rstd.
__global__ void norm_partials(const float* __restrict__ dz, const float* __restrict__ x,
                              const float* __restrict__ rstd, int n, int d,
                              float* __restrict__ partials) {
  const int k = blockIdx.y * blockDim.x + threadIdx.x, chunk = blockIdx.x;
  if (k >= d) return;
  const int end = min(n, (chunk + 1) * kCudaRowsPerPartial);
  float acc = 0.0f;
  for (int s = chunk * kCudaRowsPerPartial; s < end; ++s) {
    const long long i = static_cast<long long>(s) * d + k;
    acc += dz[i] * x[i] * rstd[s];
  }
  partials[static_cast<long long>(chunk) * d + k] = acc;
}

// Second pass: slot[k] += alpha * (the partials summed over the chunks, in order).
template <class G>
__global__ void finish_columns(const float* __restrict__ partials, int chunks, int w, float alpha,
                               G* __restrict__ slot) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= w) return;
  float acc = 0.0f;
  for (int b = 0; b < chunks; ++b) acc += partials[static_cast<long long>(b) * w + k];
  slot[k] = from_float<G>(to_float(slot[k]) + alpha * acc);
}

// Blocks (distinct input token u, tile of kEmbedColumns columns): slot[rows[u], :] += alpha *
// the sum of dx over the positions that hold u, in ascending order, each column summed by one
// thread. Rows no position uses are left untouched. Text has a few very common tokens (bytes of
// source code: the space, the newline): one warp a token left each of those thousands of
// positions to sum alone, 12 ms a step at 8 x 2048 tokens, hidden 896, on an H200.
constexpr int kEmbedColumns = 128;
template <class G>
__global__ void __launch_bounds__(kEmbedColumns)
    embed_backward(const float* __restrict__ dx, const int* __restrict__ rows,
                   const int* __restrict__ starts, const int* __restrict__ positions, int d,
                   float alpha, G* __restrict__ slot) {
  const int u = blockIdx.x, k = blockIdx.y * kEmbedColumns + threadIdx.x;
  if (k >= d) return;
  const int begin = starts[u], end = starts[u + 1];
  float acc = 0.0f;
#pragma unroll 8
  for (int e = begin; e < end; ++e) acc += dx[static_cast<long long>(positions[e]) * d + k];
  G* out = slot + static_cast<long long>(rows[u]) * d + k;
  *out = from_float<G>(to_float(*out) + alpha * acc);
}

// ---- launching ----

int blocks_for(long long count, int threads = 256) {
  const long long b = (count + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 8 ? b : 65535 * 8);
}
int warp_blocks(long long rows) {
  return static_cast<int>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}
void check_launch() {
  SHARDSWAP_CUDA_CHECK(cudaGetLastError());
}

// Calls f(G{}) with G the device type of a gradient slot: fp32 or the weights' type T.
template <class T, class F>
void with_slot_type(const GradSlot& slot, ParamId id, F&& f) {
  if (slot.data == nullptr)
    throw ConfigError("decoder (cuda): the grad slot of " + param_name(id) + " is null");
  if (slot.dtype == DType::f32) return f(float{});
  if (slot.dtype == dtype_of<T>()) return f(T{});
  throw ConfigError("decoder (cuda): the grad slot of " + param_name(id) + " is " +
                    dtype_name(slot.dtype) + ", neither fp32 nor the weights' " +
                    dtype_name(dtype_of<T>()));
}

cudaDataType_t slot_type(DType t) {
  return t == DType::f32 ? CUDA_R_32F : t == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
}

// Row-major C[M, N] = alpha op(A) op(B) + beta C, with A stored [M, K] (or [K, M] when
// transposed) with row length lda, and B likewise: cuBLAS is column-major, so it computes
// C^T = op(B)^T op(A)^T on the same memory, the operands swapped.
void gemm(cublasHandle_t handle, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
          const void* a, cudaDataType_t at, long long lda, const void* b, cudaDataType_t bt,
          long long ldb, float beta, void* c, cudaDataType_t ct, long long ldc) {
  SHARDSWAP_CUBLAS_CHECK(cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                      trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, bt,
                                      static_cast<int>(ldb), a, at, static_cast<int>(lda), &beta,
                                      c, ct, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
}

// The device `p` lives on, made current on the calling thread.
int use_device_of(const void* p) {
  cudaPointerAttributes attr{};
  SHARDSWAP_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  if (attr.type != cudaMemoryTypeDevice)
    throw ConfigError("make_cuda_compute: the block is not device memory");
  SHARDSWAP_CUDA_CHECK(cudaSetDevice(attr.device));
  return attr.device;
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

// The GPU time of train_step's phases (PhaseTimes) from CUDA events on cudaStreamPerThread: a
// mark records an event as the next phase's work is queued; the time between two marks is the
// earlier mark's phase. Read after the stream was synchronized (read_loss), so reading waits
// for nothing; off, a mark does nothing.
class PhaseClock {
 public:
  enum Phase {
    forward,      // embedding, norms, q/k/v/o projections, RoPE
    forward_mlp,  // the MLP's norm, gate/up/down GEMMs, SwiGLU
    attention_forward,
    head,
    backward_mlp,
    backward,  // the rest of backward: norms, q/k/v/o, RoPE, embedding
    attention_backward,
    done
  };
  PhaseClock() = default;
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;
  ~PhaseClock() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void enable(bool on) { on_ = on; }
  // A step's first mark; what a step that threw left behind is dropped.
  void begin() {
    marks_.clear();
    mark(forward);
  }
  void mark(Phase p) {
    if (!on_) return;
    if (marks_.size() == events_.size()) {
      cudaEvent_t e;
      SHARDSWAP_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(events_[marks_.size()], cudaStreamPerThread));
    marks_.push_back(p);
  }
  // After the step's last mark (done) and a synchronize: adds the step's phases to the sums.
  void add_step() {
    if (!on_ || marks_.empty()) return;
    double* sums[] = {&times_.forward,      &times_.forward_mlp, &times_.attention_forward,
                      &times_.head,         &times_.backward_mlp, &times_.backward,
                      &times_.attention_backward};
    for (std::size_t i = 0; i + 1 < marks_.size(); ++i) {
      float ms = 0;
      SHARDSWAP_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
      if (marks_[i] != done) *sums[marks_[i]] += ms;
    }
    ++times_.steps;
    marks_.clear();
  }
  PhaseTimes take() { return std::exchange(times_, PhaseTimes{}); }

 private:
  bool on_ = false;
  std::vector<cudaEvent_t> events_;  // reused step after step
  std::vector<Phase> marks_;
  PhaseTimes times_;
};

// A profiler's capture window over train_step calls, from SHARDSWAP_CUDA_PROFILE_STEPS=FIRST or
// FIRST,COUNT (1-based; COUNT 1 by default): cudaProfilerStart before step FIRST, cudaProfilerStop
// after step FIRST + COUNT - 1, for a profiler started with capture off (Nsight Compute's
// --profile-from-start off, Nsight Systems' --capture-range=cudaProfilerApi), so that it sees
// whole steps and nothing of the set-up (tools/bench/profile_step.sh). Unset: nothing.
class ProfileWindow {
 public:
  ProfileWindow() {
    const char* v = std::getenv("SHARDSWAP_CUDA_PROFILE_STEPS");
    if (v == nullptr || *v == '\0') return;
    char* end = nullptr;
    const long first = std::strtol(v, &end, 10);
    long count = 1;
    if (end != v && *end == ',') {
      const char* c = end + 1;
      count = std::strtol(c, &end, 10);
      if (end == c) count = 0;
    }
    if (end == v || *end != '\0' || first < 1 || count < 1)
      throw ConfigError(std::string("SHARDSWAP_CUDA_PROFILE_STEPS=") + v +
                        ": not FIRST or FIRST,COUNT with FIRST, COUNT >= 1");
    first_ = first;
    last_ = first + count - 1;
  }
  void before_step() {
    ++step_;
    if (step_ == first_) SHARDSWAP_CUDA_CHECK(cudaProfilerStart());
  }
  void after_step() {
    if (step_ == last_) SHARDSWAP_CUDA_CHECK(cudaProfilerStop());
  }

 private:
  long first_ = 0, last_ = 0, step_ = 0;
};

template <class T>
class CudaCompute final : public Compute {
 public:
  CudaCompute(const DecoderShape& s, int max_sequences, int seq_len, int recompute,
              std::byte* memory, CudaAttention attention)
      : s_(s),
        max_sequences_(max_sequences),
        seq_len_(seq_len),
        recompute_(recompute),
        n_max_(static_cast<std::size_t>(max_sequences) * static_cast<std::size_t>(seq_len)),
        mem_(memory),
        l_(cuda_layout(s, max_sequences, seq_len, recompute)),
        device_(use_device_of(memory)),  // current before the handle is made on it
        cublas_(memory + l_.workspace, kCudaCublasWorkspaceBytes),
        inv_freq_(rope_inv_freq(s)) {
    if (attention != CudaAttention::own) {
      std::byte* scratch = memory + l_.attn_scratch;
      std::size_t bytes = cuda_cudnn_scratch_bytes(s, max_sequences, seq_len);
      deterministic_ = attention == CudaAttention::cudnn;
      if (!deterministic_) {  // the fp32 dQ accumulator first, the workspace after it
        const std::size_t dq32 = cuda_cudnn_dq32_bytes(s, max_sequences, seq_len);
        dq32_ = reinterpret_cast<float*>(scratch);
        scratch += dq32;
        bytes -= dq32;
      }
      cudnn_ = std::make_unique<CudnnAttention>(scratch, bytes);
      // The largest batch's plans now, so that a shape cuDNN refuses fails here.
      cudnn_->prepare(attention_shape(max_sequences, seq_len));
    }
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at(l_.inv_freq), inv_freq_.data(),
                                         inv_freq_.size() * sizeof(float), cudaMemcpyHostToDevice,
                                         cudaStreamPerThread));
  }

  double train_step(const Weights& w, const Batch& b, double grad_scale, GradSink& sink) override {
    check(w, b, "train_step");
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    prepare_attention(b);
    profile_.before_step();
    upload(b, true);
    clock_.begin();
    forward(w, b);
    const int lowest = lowest_active_group(sink);
    clock_.mark(PhaseClock::head);
    head_and_loss(w, b, lowest <= s_.layers + 1 ? &sink : nullptr, grad_scale, nullptr);
    clock_.mark(PhaseClock::backward);
    if (lowest <= s_.layers + 1) backward(w, b, grad_scale, sink, lowest);
    clock_.mark(PhaseClock::done);
    const double loss = read_loss();
    clock_.add_step();
    profile_.after_step();
    return loss;
  }

  void time_phases(bool on) override { clock_.enable(on); }
  PhaseTimes take_phase_times() override { return clock_.take(); }

  double loss(const Weights& w, const Batch& b) override {
    check(w, b, "loss");
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    prepare_attention(b);
    upload(b, false);
    forward(w, b);
    head_and_loss(w, b, nullptr, 0.0, nullptr);
    return read_loss();
  }

  void logits(const Weights& w, const Batch& b, float* out) override {
    check(w, b, "logits");
    if (out == nullptr) throw ConfigError("decoder (cuda): logits: the output is null");
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    prepare_attention(b);
    upload(b, false);
    forward(w, b);
    head_and_loss(w, b, nullptr, 0.0, out);
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  }

 private:
  using K = ParamKind;
  static constexpr cudaDataType_t t16 = cuda_type<T>();

  template <class U = float>
  U* at(std::size_t offset) const {
    return reinterpret_cast<U*>(mem_ + offset);
  }
  static const T* cw(const void* p) { return static_cast<const T*>(p); }
  // A kept region holds n_max_ rows of `width` per slot: slot i's start at i n_max_ width.
  template <class U>
  U* rows_at(std::size_t offset, std::size_t i, std::int64_t width) const {
    return at<U>(offset) + i * n_max_ * static_cast<std::size_t>(width);
  }
  // Layer l's rows of a per-layer region: in its slot (cuda_slot_of: the recomputed layers share
  // slot 0). Only xs holds every layer.
  template <class U>
  U* layer(std::size_t offset, int l, std::int64_t width) const {
    return rows_at<U>(offset, cuda_slot_of(l, recompute_), width);
  }
  float* xs(int l) const { return rows_at<float>(l_.xs, static_cast<std::size_t>(l), s_.hidden); }
  float* ys(int l) const { return layer<float>(l_.ys, l, s_.hidden); }
  float* rstd_attn(int l) const { return layer<float>(l_.rstd_attn, l, 1); }
  float* rstd_mlp(int l) const { return layer<float>(l_.rstd_mlp, l, 1); }
  float* rstd_final() const { return at(l_.rstd_final); }
  float* lse(int l) const {
    return at(l_.lse) + cuda_slot_of(l, recompute_) * cuda_lse_stride(n_max_, s_.heads);
  }
  std::int64_t qkv_width() const { return s_.q_width() + 2 * s_.kv_width(); }

  // Refuses, before anything is queued, a batch or weights this backend cannot run.
  void check(const Weights& w, const Batch& b, const char* call) const {
    const std::string where = std::string("decoder (cuda): ") + call + ": ";
    if (b.sequences < 1 || b.sequences > max_sequences_)
      throw ConfigError(where + "batch of " + std::to_string(b.sequences) +
                        " sequences: not in [1, max_sequences = " +
                        std::to_string(max_sequences_) + "]");
    if (b.seq_len < 1 || b.seq_len > seq_len_)
      throw ConfigError(where + "seq_len = " + std::to_string(b.seq_len) + ": not in [1, " +
                        std::to_string(seq_len_) + "]");
    if (b.inputs == nullptr || b.targets == nullptr)
      throw ConfigError(where + "the batch's inputs or targets are null");
    const auto n = static_cast<std::size_t>(b.sequences) * static_cast<std::size_t>(b.seq_len);
    for (std::size_t i = 0; i < n; ++i)
      for (const auto* ids : {b.inputs, b.targets})
        if (ids[i] < 0 || ids[i] >= s_.vocab)
          throw ConfigError(where + (ids == b.inputs ? "inputs[" : "targets[") +
                            std::to_string(i) + "] = " + std::to_string(ids[i]) +
                            ": not a token id below vocab = " + std::to_string(s_.vocab));
    if (w.dtype != dtype_of<T>())
      throw ConfigError(where + "weights of dtype " + dtype_name(w.dtype) + ", the backend's is " +
                        dtype_name(dtype_of<T>()));
    if (w.layers.size() != static_cast<std::size_t>(s_.layers))
      throw ConfigError(where + std::to_string(w.layers.size()) + " layers of weights, the shape has " +
                        std::to_string(s_.layers));
    if (w.embed == nullptr || w.final_norm == nullptr || w.head == nullptr)
      throw ConfigError(where + "embed, final_norm or head weight is null");
    if (s_.tied && w.head != w.embed)
      throw ConfigError(where + "the head is tied, but its weight is not the embedding");
    for (std::size_t l = 0; l < w.layers.size(); ++l) {
      const LayerWeights& lw = w.layers[l];
      const bool any_null = !lw.attn_norm || !lw.q || !lw.k || !lw.v || !lw.o || !lw.mlp_norm ||
                            !lw.gate || !lw.up || !lw.down;
      const bool biases = lw.q_bias && lw.k_bias && lw.v_bias;
      const bool no_biases = !lw.q_bias && !lw.k_bias && !lw.v_bias;
      if (any_null || (s_.qkv_bias ? !biases : !no_biases))
        throw ConfigError(where + "layers." + std::to_string(l) +
                          ": a weight is null, or q/k/v biases do not match qkv_bias");
    }
  }

  // Tokens and targets to the device; for train_step also the embedding gradient's grouping of
  // positions by token (made here, on the host, from the host batch).
  void upload(const Batch& b, bool embed_groups) {
    const auto n = static_cast<std::size_t>(b.sequences) * static_cast<std::size_t>(b.seq_len);
    const cudaStream_t stream = cudaStreamPerThread;
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.tokens), b.inputs, n * sizeof(int),
                                         cudaMemcpyHostToDevice, stream));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.targets), b.targets, n * sizeof(int),
                                         cudaMemcpyHostToDevice, stream));
    if (!embed_groups) return;
    positions_.resize(n);
    for (std::size_t i = 0; i < n; ++i) positions_[i] = static_cast<int>(i);
    std::stable_sort(positions_.begin(), positions_.end(),
                     [&](int x, int y) { return b.inputs[x] < b.inputs[y]; });
    rows_.clear();
    starts_.clear();
    for (std::size_t e = 0; e < n; ++e)
      if (e == 0 || b.inputs[positions_[e]] != b.inputs[positions_[e - 1]]) {
        rows_.push_back(b.inputs[positions_[e]]);
        starts_.push_back(static_cast<int>(e));
      }
    starts_.push_back(static_cast<int>(n));
    // Pageable host memory: each copy has read its source when the call returns.
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.embed_rows), rows_.data(),
                                         rows_.size() * sizeof(int), cudaMemcpyHostToDevice,
                                         stream));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.embed_starts), starts_.data(),
                                         starts_.size() * sizeof(int), cudaMemcpyHostToDevice,
                                         stream));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.embed_positions), positions_.data(),
                                         n * sizeof(int), cudaMemcpyHostToDevice, stream));
  }

  // out[n, o] (= or +=, of type ct) = in16[n, i] W^T for W [o, i].
  void linear(int n, int o, int i, const T* in, long long ld_in, const void* w, float beta,
              void* out, cudaDataType_t ct, long long ld_out) {
    gemm(cublas_.get(), false, true, n, o, i, 1.0f, in, t16, ld_in, w, t16, i, beta, out, ct,
         ld_out);
  }
  // din[n, i] (= or +=, fp32) = dout16[n, o] W for W [o, i].
  void linear_input_grad(int n, int o, int i, const T* dout, long long ld_dout, const void* w,
                         float beta, float* din) {
    gemm(cublas_.get(), false, false, n, i, o, 1.0f, dout, t16, ld_dout, w, t16, i, beta, din,
         CUDA_R_32F, i);
  }

  // 4 columns a lane where hidden is a multiple of 4 and every fp32 operand starts 16-byte
  // aligned, every T one 8-byte aligned (then so does every row), else 1.
  bool norm_packs(std::initializer_list<const void*> floats,
                  std::initializer_list<const void*> bit16) const {
    bool four = s_.hidden % 4 == 0;
    for (const void* p : floats) four = four && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
    for (const void* p : bit16) four = four && reinterpret_cast<std::uintptr_t>(p) % 8 == 0;
    return four;
  }

  void rms_norm(const float* x, const void* w, int n, T* y, float* rstd_out) {
    const float eps = static_cast<float>(s_.rms_eps);
    if (norm_packs({x}, {w, y}))
      rms_norm_forward<T, 4><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, cudaStreamPerThread>>>(
          x, cw(w), n, s_.hidden, eps, y, rstd_out);
    else
      rms_norm_forward<T, 1><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, cudaStreamPerThread>>>(
          x, cw(w), n, s_.hidden, eps, y, rstd_out);
    check_launch();
  }

  // Calls f(std::integral_constant<int, N>) with N = 8, SwiGLU's elements a thread, where every
  // pointer is 16-byte aligned and count a multiple of 8 (any intermediate_size that is a
  // multiple of 8: all Llama, Qwen2 and Mistral sizes), else N = 1.
  template <class F>
  static void with_pack(long long count, std::initializer_list<const void*> ptrs, F&& f) {
    bool eight = count % 8 == 0;
    for (const void* p : ptrs) eight = eight && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
    if (eight)
      f(std::integral_constant<int, 8>{});
    else
      f(std::integral_constant<int, 1>{});
    check_launch();
  }
  void swiglu(const T* gate, const T* up, long long count, T* act) {
    with_pack(count, {gate, up, act}, [&](auto pack) {
      constexpr int N = decltype(pack)::value;
      swiglu_forward<T, N><<<blocks_for(count / N), 256, 0, cudaStreamPerThread>>>(
          gate, up, count / N, act);
    });
  }
  void swiglu_grad(const float* dact, T* gate, T* up, T* act, long long count) {
    with_pack(count, {dact, gate, up, act}, [&](auto pack) {
      constexpr int N = decltype(pack)::value;
      swiglu_backward<T, N><<<blocks_for(count / N), 256, 0, cudaStreamPerThread>>>(
          dact, gate, up, act, count / N);
    });
  }

  void forward(const Weights& w, const Batch& b) {
    const int n = b.sequences * b.seq_len, d = s_.hidden, half = s_.head_dim / 2;
    rope_table<<<blocks_for(static_cast<long long>(b.seq_len) * half), 256, 0,
                 cudaStreamPerThread>>>(at(l_.inv_freq), b.seq_len, half, at(l_.rope_cos),
                                        at(l_.rope_sin));
    check_launch();
    embed_forward<T><<<blocks_for(static_cast<long long>(n) * d), 256, 0, cudaStreamPerThread>>>(
        cw(w.embed), at<int>(l_.tokens), n, d, xs(0));
    check_launch();
    for (int l = 0; l < s_.layers; ++l) forward_layer(w, b, l, false);
    rms_norm(xs(s_.layers), w.final_norm, n, at<T>(l_.normed), rstd_final());
  }

  // Layer l's forward from x_l into its slot, and x_{l+1}. A recompute (at the start of the
  // layer's backward) stops at what backward reads, gate and up: act and x_{l+1} are not
  // rewritten, and no phase is marked (its time counts in backward MLP). It writes only the slot
  // and the scratch normed and qkv32, both rewritten by backward before it reads them.
  void forward_layer(const Weights& w, const Batch& b, int l, bool recompute) {
    const int n = b.sequences * b.seq_len, d = s_.hidden, in = s_.intermediate;
    const int qw = static_cast<int>(s_.q_width()), kw = static_cast<int>(s_.kv_width());
    const long long width = qkv_width();
    const cudaStream_t stream = cudaStreamPerThread;
    const auto mark = [&](PhaseClock::Phase p) {
      if (!recompute) clock_.mark(p);
    };
    const LayerWeights& lw = w.layers[static_cast<std::size_t>(l)];
    T* normed = at<T>(l_.normed);
    float* qkv = at(l_.qkv32);
    T* q = layer<T>(l_.q, l, qw);
    T* k = layer<T>(l_.k, l, kw);
    T* v = layer<T>(l_.v, l, kw);
    T* o = layer<T>(l_.o, l, qw);
    mark(PhaseClock::forward);
    rms_norm(xs(l), lw.attn_norm, n, normed, rstd_attn(l));
    linear(n, qw, d, normed, d, lw.q, 0.0f, qkv, CUDA_R_32F, width);
    linear(n, kw, d, normed, d, lw.k, 0.0f, qkv + qw, CUDA_R_32F, width);
    linear(n, kw, d, normed, d, lw.v, 0.0f, qkv + qw + kw, CUDA_R_32F, width);
    qkv_forward<T><<<n, kQkvThreads, 0, stream>>>(
        qkv, cw(lw.q_bias), cw(lw.k_bias), cw(lw.v_bias), at(l_.rope_cos), at(l_.rope_sin),
        b.seq_len, s_.heads, s_.kv_heads, s_.head_dim, q, k, v);
    check_launch();
    mark(PhaseClock::attention_forward);
    attention(b, q, k, v, o, lse(l));
    mark(PhaseClock::forward);
    // y = x + o Wo^T: the GEMM adds onto a copy of x (fp32 sum of the fp32 product).
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(ys(l), xs(l), sizeof(float) * n * d,
                                         cudaMemcpyDeviceToDevice, stream));
    linear(n, d, qw, o, qw, lw.o, 1.0f, ys(l), CUDA_R_32F, d);
    mark(PhaseClock::forward_mlp);
    rms_norm(ys(l), lw.mlp_norm, n, normed, rstd_mlp(l));
    T* gate = layer<T>(l_.gate, l, in);
    T* up = layer<T>(l_.up, l, in);
    linear(n, in, d, normed, d, lw.gate, 0.0f, gate, t16, in);
    linear(n, in, d, normed, d, lw.up, 0.0f, up, t16, in);
    if (recompute) return;
    swiglu(gate, up, static_cast<long long>(n) * in, at<T>(l_.act));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(xs(l + 1), ys(l), sizeof(float) * n * d,
                                         cudaMemcpyDeviceToDevice, stream));
    linear(n, d, in, at<T>(l_.act), in, lw.down, 1.0f, xs(l + 1), CUDA_R_32F, d);
  }

  AttentionShape attention_shape(int sequences, int seq_len) const {
    return cuda_attention_shape(s_, sequences, seq_len, dtype_of<T>(), deterministic_);
  }
  // Plans for the batch's shape before anything is queued (a refusal changes nothing).
  void prepare_attention(const Batch& b) {
    if (cudnn_) cudnn_->prepare(attention_shape(b.sequences, b.seq_len));
  }

  void attention(const Batch& b, const T* q, const T* k, const T* v, T* o, float* lse) {
    if (cudnn_) {
      cudnn_->forward(attention_shape(b.sequences, b.seq_len), {q, k, v, o, lse});
      return;
    }
    const dim3 grid((b.seq_len + kAttnTile - 1) / kAttnTile, s_.heads, b.sequences);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s_.head_dim)));
    with_lanes(s_.head_dim, [&](auto lanes) {
      attention_forward<T, decltype(lanes)::value>
          <<<grid, 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
              q, k, v, b.seq_len, s_.heads, s_.kv_heads, s_.head_dim, scale, o, lse);
    });
    check_launch();
  }

  // The head over chunks of token rows: logits, per-row loss and the mean loss; with a sink,
  // also the head's weight gradient (when its group is active) and the gradient at the final
  // norm's output into dz; with `out`, the logits rows copied to the host.
  void head_and_loss(const Weights& w, const Batch& b, GradSink* sink, double grad_scale,
                     float* out) {
    const int n = b.sequences * b.seq_len, d = s_.hidden, vocab = s_.vocab;
    const cudaStream_t stream = cudaStreamPerThread;
    const cublasHandle_t cb = cublas_.get();
    const T* f = at<T>(l_.normed);
    float* logits = at(l_.logits);
    const T* dlogits = at<T>(l_.logits);  // in place, rows 2 V apart
    const float alpha = static_cast<float>(grad_scale / n);
    const bool head_matrix =
        sink != nullptr && sink->active(s_.tied ? 0 : s_.layers + 1);
    const ParamId head_id{s_.tied ? K::embed : K::head};
    GradSlot slot{};
    if (head_matrix) {
      slot = sink->open(head_id);
      with_slot_type<T>(slot, head_id, [](auto) {});
    }
    for (int r0 = 0; r0 < n; r0 += kCudaLossChunkRows) {
      const int rows = std::min(kCudaLossChunkRows, n - r0);
      gemm(cb, false, true, rows, vocab, d, 1.0f, f + static_cast<long long>(r0) * d, t16, d,
           w.head, t16, d, 0.0f, logits, CUDA_R_32F, vocab);
      if (out != nullptr)
        SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(out + static_cast<long long>(r0) * vocab, logits,
                                             sizeof(float) * rows * vocab, cudaMemcpyDeviceToHost,
                                             stream));
      // Every row starts 16-byte aligned when the chunk does and vocab is a multiple of 4.
      if (vocab % 4 == 0 && reinterpret_cast<std::uintptr_t>(logits) % 16 == 0)
        cross_entropy_rows<T, 4><<<rows, kCeThreads, 0, stream>>>(
            logits, vocab, at<int>(l_.targets) + r0, at(l_.row_loss) + r0, sink != nullptr);
      else
        cross_entropy_rows<T, 1><<<rows, kCeThreads, 0, stream>>>(
            logits, vocab, at<int>(l_.targets) + r0, at(l_.row_loss) + r0, sink != nullptr);
      check_launch();
      if (sink == nullptr) continue;
      if (head_matrix)  // slot [V, D] += alpha dlogits^T f
        gemm(cb, true, false, vocab, d, rows, alpha, dlogits, t16, 2LL * vocab,
             f + static_cast<long long>(r0) * d, t16, d, 1.0f, slot.data, slot_type(slot.dtype),
             d);
      gemm(cb, false, false, rows, d, vocab, 1.0f, dlogits, t16, 2LL * vocab, w.head, t16, d,
           0.0f, at(l_.dz) + static_cast<long long>(r0) * d, CUDA_R_32F, d);
    }
    // Closed here even when tied: one slot is open at a time (a stage-2 bucket is reduced once
    // backward moves on to another group); the lookup's gradient opens the embedding again.
    if (head_matrix) sink->close(head_id);
    mean_of<<<1, 256, 0, stream>>>(at(l_.row_loss), n, at<double>(l_.mean_loss));
    check_launch();
  }

  double read_loss() const {
    double loss = 0.0;
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(&loss, at<double>(l_.mean_loss), sizeof(double),
                                         cudaMemcpyDeviceToHost, cudaStreamPerThread));
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return loss;
  }

  int lowest_active_group(const GradSink& sink) const {
    int group = 0;
    while (group <= s_.layers + 1 && !sink.active(group)) ++group;
    return group;
  }

  // slot [rows, cols] += alpha dy^T x for dy [n, rows] (row length ld_dy), x [n, cols]: the
  // weight gradient, written by the GEMM into the slot in its own dtype.
  void weight_grad(GradSink& sink, ParamId id, int n, int rows, int cols, float alpha,
                   const T* dy, long long ld_dy, const T* x, long long ld_x) {
    const GradSlot slot = sink.open(id);
    with_slot_type<T>(slot, id, [](auto) {});
    gemm(cublas_.get(), true, false, rows, cols, n, alpha, dy, t16, ld_dy, x, t16, ld_x, 1.0f,
         slot.data, slot_type(slot.dtype), cols);
    sink.close(id);
  }

  // slot [w] += alpha * the column sums of x [n, w] (rows ld apart, fp32).
  void column_grad(GradSink& sink, ParamId id, int n, int w, float alpha, const float* x,
                   long long ld) {
    const int chunks = (n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial;
    column_partials<<<dim3(chunks, (w + 127) / 128), 128, 0, cudaStreamPerThread>>>(
        x, n, w, ld, at(l_.partials));
    check_launch();
    finish(sink, id, chunks, w, alpha);
  }

  // An RMSNorm's weight gradient, slot [D] += alpha sum_t dz x rstd.
  void norm_grad(GradSink& sink, ParamId id, int n, float alpha, const float* dz, const float* x,
                 const float* r) {
    const int d = s_.hidden;
    const int chunks = (n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial;
    norm_partials<<<dim3(chunks, (d + 127) / 128), 128, 0, cudaStreamPerThread>>>(
        dz, x, r, n, d, at(l_.partials));
    check_launch();
    finish(sink, id, chunks, d, alpha);
  }

  void finish(GradSink& sink, ParamId id, int chunks, int w, float alpha) {
    const GradSlot slot = sink.open(id);
    with_slot_type<T>(slot, id, [&](auto g) {
      using G = decltype(g);
      finish_columns<G><<<(w + 255) / 256, 256, 0, cudaStreamPerThread>>>(
          at(l_.partials), chunks, w, alpha, static_cast<G*>(slot.data));
    });
    check_launch();
    sink.close(id);
  }

  // dx (= or +=) the gradient at the norm's input, and rounded into d16 (every later use of dx
  // but the embedding's gradient starts from d16).
  void norm_backward(const float* dz, const float* x, const float* r, const void* w, int n,
                     bool accumulate) {
    if (norm_packs({dz, x, at(l_.dx)}, {w, at<T>(l_.d16)}))
      rms_norm_backward<T, 4><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, cudaStreamPerThread>>>(
          dz, x, r, cw(w), n, s_.hidden, at(l_.dx), accumulate, at<T>(l_.d16));
    else
      rms_norm_backward<T, 1><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, cudaStreamPerThread>>>(
          dz, x, r, cw(w), n, s_.hidden, at(l_.dx), accumulate, at<T>(l_.d16));
    check_launch();
  }

  // Entered with dz = the gradient at the final norm's output (head_and_loss).
  void backward(const Weights& w, const Batch& b, double grad_scale, GradSink& sink, int lowest) {
    const int n = b.sequences * b.seq_len, d = s_.hidden, in = s_.intermediate;
    const int L = s_.layers, head_group = L + 1;
    const int qw = static_cast<int>(s_.q_width()), kw = static_cast<int>(s_.kv_width());
    const long long width = qkv_width();
    const float alpha = static_cast<float>(grad_scale / n);
    const cudaStream_t stream = cudaStreamPerThread;
    float *dx = at(l_.dx), *dz = at(l_.dz), *g32 = at(l_.qkv32);
    T *d16 = at<T>(l_.d16), *normed = at<T>(l_.normed), *g16 = at<T>(l_.qkv16);
    T *act = at<T>(l_.act), *dout = at<T>(l_.dout);

    if (sink.active(head_group))
      norm_grad(sink, {K::final_norm}, n, alpha, dz, xs(L), rstd_final());
    if (lowest <= L) norm_backward(dz, xs(L), rstd_final(), w.final_norm, n, false);
    for (int l = L - 1; l >= 0 && l + 1 >= lowest; --l) {
      const LayerWeights& lw = w.layers[static_cast<std::size_t>(l)];
      const bool active = sink.active(l + 1);
      clock_.mark(PhaseClock::backward_mlp);
      // A recomputed layer's activations, from x_l, into the slot the recomputed layers share;
      // the highest of them still has its own there from forward.
      if (l < recompute_ - 1) forward_layer(w, b, l, true);
      T* gate = layer<T>(l_.gate, l, in);
      T* up = layer<T>(l_.up, l, in);
      // MLP: x_{l+1} = y + act Wdown^T, act = silu(gate) * up, gate|up = rmsnorm(y) W^T.
      // d16 = dx rounded, by the norm backward that made dx.
      linear_input_grad(n, d, in, d16, d, lw.down, 0.0f, at(l_.dact));
      // act (recomputed) for the down projection's weight gradient in the same pass.
      swiglu_grad(at(l_.dact), gate, up, active ? act : nullptr, static_cast<long long>(n) * in);
      if (active) {
        weight_grad(sink, {K::down, l}, n, d, in, alpha, d16, d, act, in);
        rms_norm(ys(l), lw.mlp_norm, n, normed, nullptr);
        weight_grad(sink, {K::gate, l}, n, in, d, alpha, gate, in, normed, d);
        weight_grad(sink, {K::up, l}, n, in, d, alpha, up, in, normed, d);
      }
      linear_input_grad(n, in, d, gate, in, lw.gate, 0.0f, dz);
      linear_input_grad(n, in, d, up, in, lw.up, 1.0f, dz);
      if (active) norm_grad(sink, {K::mlp_norm, l}, n, alpha, dz, ys(l), rstd_mlp(l));
      norm_backward(dz, ys(l), rstd_mlp(l), lw.mlp_norm, n, true);  // dx: now at y
      // Attention: y = x + o Wo^T.
      clock_.mark(PhaseClock::backward);
      const T* q = layer<T>(l_.q, l, qw);
      const T* k = layer<T>(l_.k, l, kw);
      const T* v = layer<T>(l_.v, l, kw);
      const T* o = layer<T>(l_.o, l, qw);
      const float* lse = this->lse(l);
      // d16 = dx rounded, by the norm backward that made dx.
      if (active) weight_grad(sink, {K::o, l}, n, d, qw, alpha, d16, d, o, qw);
      gemm(cublas_.get(), false, false, n, qw, d, 1.0f, d16, t16, d, lw.o, t16, qw, 0.0f, dout,
           t16, qw);
      clock_.mark(PhaseClock::attention_backward);
      const bool in_g16 = attention_backward(b, q, k, v, o, dout, lse, g32, g16, width);
      clock_.mark(PhaseClock::backward);
      if (in_g16)
        qkv_backward<T, T><<<n, kQkvThreads, 0, stream>>>(g16, g32, at(l_.rope_cos),
                                                         at(l_.rope_sin), b.seq_len, s_.heads,
                                                         s_.kv_heads, s_.head_dim, g16);
      else
        qkv_backward<T, float><<<n, kQkvThreads, 0, stream>>>(g32, g32, at(l_.rope_cos),
                                                             at(l_.rope_sin), b.seq_len, s_.heads,
                                                             s_.kv_heads, s_.head_dim, g16);
      check_launch();
      if (active) {
        rms_norm(xs(l), lw.attn_norm, n, normed, nullptr);
        weight_grad(sink, {K::q, l}, n, qw, d, alpha, g16, width, normed, d);
        if (s_.qkv_bias) column_grad(sink, {K::q_bias, l}, n, qw, alpha, g32, width);
        weight_grad(sink, {K::k, l}, n, kw, d, alpha, g16 + qw, width, normed, d);
        if (s_.qkv_bias) column_grad(sink, {K::k_bias, l}, n, kw, alpha, g32 + qw, width);
        weight_grad(sink, {K::v, l}, n, kw, d, alpha, g16 + qw + kw, width, normed, d);
        if (s_.qkv_bias) column_grad(sink, {K::v_bias, l}, n, kw, alpha, g32 + qw + kw, width);
      }
      linear_input_grad(n, qw, d, g16, width, lw.q, 0.0f, dz);
      linear_input_grad(n, kw, d, g16 + qw, width, lw.k, 1.0f, dz);
      linear_input_grad(n, kw, d, g16 + qw + kw, width, lw.v, 1.0f, dz);
      if (active) norm_grad(sink, {K::attn_norm, l}, n, alpha, dz, xs(l), rstd_attn(l));
      if (l + 1 > lowest) norm_backward(dz, xs(l), rstd_attn(l), lw.attn_norm, n, true);  // at x_l
    }
    if (lowest > 0) return;
    const ParamId id{K::embed};
    const GradSlot slot = sink.open(id);  // tied: a second time, after the head's gradient
    with_slot_type<T>(slot, id, [&](auto g) {
      using G = decltype(g);
      const dim3 grid(static_cast<unsigned>(rows_.size()),
                      static_cast<unsigned>((d + kEmbedColumns - 1) / kEmbedColumns));
      embed_backward<G><<<grid, kEmbedColumns, 0, stream>>>(
          dx, at<int>(l_.embed_rows), at<int>(l_.embed_starts), at<int>(l_.embed_positions), d,
          alpha, static_cast<G*>(slot.data));
    });
    check_launch();
    sink.close(id);
  }

  // dq|dk|dv (rows `width` apart): in T into g16 with cuDNN (returns true), else in fp32 into
  // g32 (false).
  bool attention_backward(const Batch& b, const T* q, const T* k, const T* v, const T* o,
                          const T* dout, const float* lse, float* g32, T* g16, long long width) {
    const int n = b.sequences * b.seq_len;
    if (cudnn_) {
      const long long qw = s_.q_width(), kw = s_.kv_width();
      cudnn_->backward(attention_shape(b.sequences, b.seq_len),
                       {q, k, v, o, dout, lse, g16, g16 + qw, g16 + qw + kw, dq32_,
                        at(l_.delta)});
      return true;
    }
    attention_delta<T><<<warp_blocks(static_cast<long long>(n) * s_.heads), 32 * kWarpsPerBlock,
                         0, cudaStreamPerThread>>>(dout, o, n * s_.heads, s_.head_dim,
                                                   at(l_.delta));
    check_launch();
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s_.head_dim)));
    const int tiles = (b.seq_len + kAttnTile - 1) / kAttnTile;
    const long long qw = s_.q_width(), kw = s_.kv_width();
    with_lanes(s_.head_dim, [&](auto lanes) {
      constexpr int P = decltype(lanes)::value;
      attention_backward_dq<T, P>
          <<<dim3(tiles, s_.heads, b.sequences), 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
              q, k, v, dout, lse, at(l_.delta), b.seq_len, s_.heads, s_.kv_heads, s_.head_dim,
              scale, g32, width);
      check_launch();
      attention_backward_dkv<T, P>
          <<<dim3(tiles, s_.kv_heads, b.sequences), 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
              q, k, v, dout, lse, at(l_.delta), b.seq_len, s_.heads, s_.kv_heads, s_.head_dim,
              scale, g32 + qw, g32 + qw + kw, width);
      check_launch();
    });
    return false;
  }

  DecoderShape s_;
  int max_sequences_, seq_len_;
  int recompute_;  // the lowest layers that run their forward again in backward
  std::size_t n_max_;
  std::byte* mem_;
  CudaLayout l_;
  int device_;
  detail::CublasHandle cublas_;
  std::vector<float> inv_freq_;
  std::vector<int> positions_, rows_, starts_;  // the embedding gradient's grouping (host)
  ProfileWindow profile_;                  // SHARDSWAP_CUDA_PROFILE_STEPS
  PhaseClock clock_;                       // train_step's phases (time_phases)
  std::unique_ptr<CudnnAttention> cudnn_;  // null: the own kernels
  bool deterministic_ = false;             // cuDNN's deterministic backward
  float* dq32_ = nullptr;                  // its atomic backward's fp32 dQ (in the scratch)
};

}  // namespace

CudaAttention cuda_attention(const DecoderShape& s) {
  const char* v = std::getenv("SHARDSWAP_DECODER_ATTENTION");
  const std::string value = v == nullptr ? "" : v;
  // cuDNN's fused attention wants 16-byte head vectors.
  const bool fits = s.head_dim % 8 == 0 && s.head_dim <= kCudaMaxHeadDim;
  if (value.empty())
    return cudnn_attention_available() && fits ? CudaAttention::cudnn : CudaAttention::own;
  if (value == "own") return CudaAttention::own;
  if (value == "cudnn" || value == "cudnn-atomic") {
    if (!cudnn_attention_available())
      throw ConfigError("SHARDSWAP_DECODER_ATTENTION=" + value +
                        ": this build has no cuDNN (SHARDSWAP_CUDNN)");
    if (!fits)
      throw ConfigError("SHARDSWAP_DECODER_ATTENTION=" + value + ": head_dim = " +
                        std::to_string(s.head_dim) +
                        " is not a multiple of 8, as cuDNN's fused attention needs");
    return value == "cudnn" ? CudaAttention::cudnn : CudaAttention::cudnn_atomic;
  }
  throw ConfigError("SHARDSWAP_DECODER_ATTENTION=" + value +
                    ": not \"cudnn\", \"cudnn-atomic\" or \"own\"");
}

std::string cuda_attention_name(const DecoderShape& s) {
  const CudaAttention a = cuda_attention(s);
  if (a == CudaAttention::own) {
    const char* v = std::getenv("SHARDSWAP_DECODER_ATTENTION");
    return std::string("own kernels (") +
           (v != nullptr && std::string(v) == "own" ? "SHARDSWAP_DECODER_ATTENTION=own"
            : !cudnn_attention_available()             ? "this build has no cuDNN"
                                                       : "head_dim is not a multiple of 8") +
           ")";
  }
  const long v = CudnnAttention::version();  // major * 10000 + minor * 100 + patch (cuDNN 9)
  return "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100) + " fused flash attention" +
         (a == CudaAttention::cudnn
              ? ", deterministic backward"
              : " (SHARDSWAP_DECODER_ATTENTION=cudnn-atomic: its backward sums dQ with atomics, "
                "two runs may differ in the last bits)");
}

namespace {
template <class F>
void with_bit16(DType dtype, const char* call, F&& f) {
  if (dtype == DType::bf16) return f(__nv_bfloat16{});
  if (dtype == DType::f16) return f(__half{});
  throw ConfigError(std::string(call) + ": dtype " + dtype_name(dtype) + " is not bf16 or fp16");
}
}  // namespace

void own_attention_forward(DType dtype, int sequences, int seq_len, int heads, int kv_heads,
                           int head_dim, const void* q, const void* k, const void* v, void* o,
                           float* lse) {
  with_bit16(dtype, "own_attention_forward", [&](auto zero) {
    using T = decltype(zero);
    const dim3 grid((seq_len + kAttnTile - 1) / kAttnTile, heads, sequences);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    with_lanes(head_dim, [&](auto lanes) {
      attention_forward<T, decltype(lanes)::value><<<grid, 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
          static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), seq_len,
          heads, kv_heads, head_dim, scale, static_cast<T*>(o), lse);
    });
    check_launch();
  });
}

void own_attention_backward(DType dtype, int sequences, int seq_len, int heads, int kv_heads,
                            int head_dim, const void* q, const void* k, const void* v,
                            const void* o, const void* dout, const float* lse, float* delta,
                            float* grads, long long ld) {
  with_bit16(dtype, "own_attention_backward", [&](auto zero) {
    using T = decltype(zero);
    const int n = sequences * seq_len, tiles = (seq_len + kAttnTile - 1) / kAttnTile;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    const long long qw = static_cast<long long>(heads) * head_dim,
                    kw = static_cast<long long>(kv_heads) * head_dim;
    const T *tq = static_cast<const T*>(q), *tk = static_cast<const T*>(k),
            *tv = static_cast<const T*>(v), *tdout = static_cast<const T*>(dout);
    attention_delta<T><<<warp_blocks(static_cast<long long>(n) * heads), 32 * kWarpsPerBlock, 0,
                         cudaStreamPerThread>>>(tdout, static_cast<const T*>(o), n * heads,
                                                head_dim, delta);
    check_launch();
    with_lanes(head_dim, [&](auto lanes) {
      constexpr int P = decltype(lanes)::value;
      attention_backward_dq<T, P>
          <<<dim3(tiles, heads, sequences), 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
              tq, tk, tv, tdout, lse, delta, seq_len, heads, kv_heads, head_dim, scale, grads, ld);
      check_launch();
      attention_backward_dkv<T, P>
          <<<dim3(tiles, kv_heads, sequences), 32 * kAttnWarps, 0, cudaStreamPerThread>>>(
              tq, tk, tv, tdout, lse, delta, seq_len, heads, kv_heads, head_dim, scale,
              grads + qw, grads + qw + kw, ld);
      check_launch();
    });
  });
}

std::unique_ptr<Compute> make_cuda_compute(const DecoderShape& s, int max_sequences, int seq_len,
                                           DType dtype, void* memory, std::size_t bytes,
                                           int recompute) {
  const std::size_t expected = cuda_bytes(s, max_sequences, seq_len, recompute);
  if (bytes != expected)
    throw ConfigError("make_cuda_compute: the block has " + std::to_string(bytes) +
                      " bytes, the layout " + std::to_string(expected));
  if (memory == nullptr) throw ConfigError("make_cuda_compute: the block is null");
  if (reinterpret_cast<std::uintptr_t>(memory) % 256 != 0)
    throw ConfigError("make_cuda_compute: the block is not 256-byte aligned");
  auto* base = static_cast<std::byte*>(memory);
  const CudaAttention attention = cuda_attention(s);
  switch (dtype) {
    case DType::bf16:
      return std::make_unique<CudaCompute<__nv_bfloat16>>(s, max_sequences, seq_len, recompute,
                                                          base, attention);
    case DType::f16:
      return std::make_unique<CudaCompute<__half>>(s, max_sequences, seq_len, recompute, base,
                                                   attention);
    default:
      break;
  }
  throw ConfigError(std::string("make_cuda_compute: dtype ") + dtype_name(dtype) +
                    " is not bf16 or fp16");
}

}  // namespace shardswap::lm::dec
