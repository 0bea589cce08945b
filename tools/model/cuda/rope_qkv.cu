// The q|k|v projections' biases and RoPE, forward and backward, and RoPE's table of angles
// (tools/model/cuda/kernels.h).
//
// Precision: the projections arrive in fp32 from their GEMMs; bias and rotation are fp32 and
// only q, k, v (and the gradients' GEMM inputs) are rounded to the weights' type. The biases'
// gradients are summed over token rows by the backward itself (first pass of column_sums.cu's
// two), from the fp32 values, so no fp32 copy of the gradient is written for them.
#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

// Threads a block: forward, a block per token row, its threads over the row's RoPE pairs and v
// columns (640 of them at Qwen2.5-0.5B's shape); backward, a thread per pair or v column over
// kCudaRowsPerPartial rows.
constexpr int kQkvThreads = 128;

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
                            T* __restrict__ k, T* __restrict__ v,
                            const int* __restrict__ positions) {
  const int half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  const int units = (heads + kv_heads) * half + kv_heads * hd;
  const long long t = blockIdx.x;
  const float* row = qkv + t * width;
  const long long pos = positions != nullptr ? positions[t] : t % seq_len;
  const float* cr = rope_cos + pos * half;
  const float* sr = rope_sin + pos * half;
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

// Backward of qkv_forward's RoPE, a block for kCudaRowsPerPartial token rows (blockIdx.x) and a
// thread for a unit (unit_place; blockIdx.y * blockDim.x + threadIdx.x) over those rows: from
// dq|dk|dv [n, (H + 2K) hd] in `in` (fp32 from the own attention kernels, T from cuDNN's), the
// gradient at the projections rounded to T into g16 (the GEMMs' input), in fp32 into g unless g
// is null (only Qwen3's head norms read it), and with `partials` (the biases' gradients) the
// sums of each column over the block's rows, added in row order from 0, into
// partials[blockIdx.x * width + column] for finish_columns. `in` may be g or g16: a thread
// reads each row's elements of its unit before it writes them.
template <class T, class In>
__global__ void qkv_backward(const In* in, float* g, const float* __restrict__ rope_cos,
                             const float* __restrict__ rope_sin, int n, int seq_len, int heads,
                             int kv_heads, int hd, T* g16, const int* __restrict__ positions,
                             float* __restrict__ partials) {
  const int half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  const int units = (heads + kv_heads) * half + kv_heads * hd;
  const int u = blockIdx.y * blockDim.x + threadIdx.x;
  if (u >= units) return;
  const QkvUnit p = unit_place(u, heads, kv_heads, hd);
  const int first = blockIdx.x * kCudaRowsPerPartial, end = min(n, first + kCudaRowsPerPartial);
  float sum_a = 0.0f, sum_b = 0.0f;
  // Unrolled so that each thread has several rows' loads in flight (the rows are independent
  // but for the sums).
  if (p.part == 2) {  // v: no rotation
#pragma unroll 4
    for (int t = first; t < end; ++t) {
      const long long at = static_cast<long long>(t) * width + p.column;
      const float dv = to_float(in[at]);
      if (g != nullptr) g[at] = dv;
      g16[at] = from_float<T>(dv);
      sum_a += dv;
    }
  } else {
#pragma unroll 4
    for (int t = first; t < end; ++t) {
      const long long at = static_cast<long long>(t) * width + p.column;
      const long long pos = positions != nullptr ? positions[t] : t % seq_len;
      const float c = rope_cos[pos * half + p.freq], s = rope_sin[pos * half + p.freq];
      const float da = to_float(in[at]), db = to_float(in[at + half]);
      const float ga = da * c + db * s, gb = db * c - da * s;  // the rotation's transpose
      if (g != nullptr) {
        g[at] = ga;
        g[at + half] = gb;
      }
      g16[at] = from_float<T>(ga);
      g16[at + half] = from_float<T>(gb);
      sum_a += ga;
      sum_b += gb;
    }
  }
  if (partials == nullptr) return;
  float* const sums = partials + static_cast<long long>(blockIdx.x) * width + p.column;
  sums[0] = sum_a;
  if (p.part != 2) sums[half] = sum_b;
}

}  // namespace

void launch_rope_table(const float* inv_freq, int seq_len, int half, float* cos_out,
                       float* sin_out) {
  rope_table<<<blocks_for(static_cast<long long>(seq_len) * half), 256, 0, cudaStreamPerThread>>>(
      inv_freq, seq_len, half, cos_out, sin_out);
  check_launch();
}

template <class T>
void launch_qkv_forward(int n, const float* qkv, const T* bq, const T* bk, const T* bv,
                        const float* rope_cos, const float* rope_sin, int seq_len, int heads,
                        int kv_heads, int hd, T* q, T* k, T* v, const int* positions) {
  qkv_forward<T><<<n, kQkvThreads, 0, cudaStreamPerThread>>>(
      qkv, bq, bk, bv, rope_cos, rope_sin, seq_len, heads, kv_heads, hd, q, k, v, positions);
  check_launch();
}

template <class T, class In>
void launch_qkv_backward(int n, const In* in, float* g, const float* rope_cos,
                         const float* rope_sin, int seq_len, int heads, int kv_heads, int hd,
                         T* g16, const int* positions, float* partials) {
  const int units = (heads + kv_heads) * (hd / 2) + kv_heads * hd;
  const dim3 grid((n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial,
                  (units + kQkvThreads - 1) / kQkvThreads);
  qkv_backward<T, In><<<grid, kQkvThreads, 0, cudaStreamPerThread>>>(
      in, g, rope_cos, rope_sin, n, seq_len, heads, kv_heads, hd, g16, positions, partials);
  check_launch();
}

template void launch_qkv_forward(int, const float*, const __nv_bfloat16*, const __nv_bfloat16*,
                                 const __nv_bfloat16*, const float*, const float*, int, int, int,
                                 int, __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*,
                                 const int*);
template void launch_qkv_forward(int, const float*, const __half*, const __half*, const __half*,
                                 const float*, const float*, int, int, int, int, __half*, __half*,
                                 __half*, const int*);
template void launch_qkv_backward(int, const __nv_bfloat16*, float*, const float*, const float*,
                                  int, int, int, int, __nv_bfloat16*, const int*, float*);
template void launch_qkv_backward(int, const float*, float*, const float*, const float*, int, int,
                                  int, int, __nv_bfloat16*, const int*, float*);
template void launch_qkv_backward(int, const __half*, float*, const float*, const float*, int,
                                  int, int, int, __half*, const int*, float*);
template void launch_qkv_backward(int, const float*, float*, const float*, const float*, int, int,
                                  int, int, __half*, const int*, float*);

}  // namespace shardswap::lm::dec
