// The q|k|v projections' biases and RoPE, forward and backward, and RoPE's table of angles
// (tools/model/cuda/kernels.h).
//
// Precision: the projections arrive in fp32 from their GEMMs; bias and rotation are fp32 and
// only q, k, v (and the gradients' GEMM inputs) are rounded to the weights' type. The biases'
// gradients are summed over token rows by the backward itself (first pass of column_sums.cu's
// two), from the fp32 values, so no fp32 copy of the gradient is written for them.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

// Threads a block of the backward, each over kCudaRowsPerPartial rows (the forward's block, a
// token row, takes as many as the row has packs of units: launch_qkv_forward).
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
// One block per token row; each thread takes P units that lie side by side (P pairs of one
// head, or P columns of v), moved as packs (rope_pack).
template <class T, int P>
__global__ void qkv_forward(const float* __restrict__ qkv, const T* __restrict__ bq,
                            const T* __restrict__ bk, const T* __restrict__ bv,
                            const float* __restrict__ rope_cos, const float* __restrict__ rope_sin,
                            int seq_len, int heads, int kv_heads, int hd, T* __restrict__ q,
                            T* __restrict__ k, T* __restrict__ v,
                            const int* __restrict__ positions) {
  using F = Pack<float, P>;
  using B = Pack<T, P>;
  const int half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  const int packs = ((heads + kv_heads) * half + kv_heads * hd) / P;
  const long long t = blockIdx.x;
  const float* row = qkv + t * width;
  const long long pos = positions != nullptr ? positions[t] : t % seq_len;
  const float* cr = rope_cos + pos * half;
  const float* sr = rope_sin + pos * half;
  // The bias at column c of a part, or zeros where the model has none.
  const auto bias_at = [](const T* bias, int c) {
    B out;
    if (bias != nullptr) return *reinterpret_cast<const B*>(bias + c);
#pragma unroll
    for (int j = 0; j < P; ++j) out.v[j] = from_float<T>(0.0f);
    return out;
  };
  for (int w = threadIdx.x; w < packs; w += blockDim.x) {
    const QkvUnit p = unit_place(w * P, heads, kv_heads, hd);
    if (p.part == 2) {
      const F x = *reinterpret_cast<const F*>(row + p.column);
      const B bias = bias_at(bv, p.out_column);
      B out;
#pragma unroll
      for (int j = 0; j < P; ++j) out.v[j] = from_float<T>(x.v[j] + to_float(bias.v[j]));
      *reinterpret_cast<B*>(v + t * kv_heads * hd + p.out_column) = out;
      continue;
    }
    const T* bias = p.part == 0 ? bq : bk;
    T* out = (p.part == 0 ? q : k) + t * (p.part == 0 ? heads : kv_heads) * hd + p.out_column;
    const F xa = *reinterpret_cast<const F*>(row + p.column);
    const F xb = *reinterpret_cast<const F*>(row + p.column + half);
    const B ba = bias_at(bias, p.out_column), bb = bias_at(bias, p.out_column + half);
    const F c = *reinterpret_cast<const F*>(cr + p.freq);
    const F s = *reinterpret_cast<const F*>(sr + p.freq);
    B oa, ob;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const float a = xa.v[j] + to_float(ba.v[j]), b = xb.v[j] + to_float(bb.v[j]);
      oa.v[j] = from_float<T>(a * c.v[j] - b * s.v[j]);
      ob.v[j] = from_float<T>(b * c.v[j] + a * s.v[j]);
    }
    *reinterpret_cast<B*>(out) = oa;
    *reinterpret_cast<B*>(out + half) = ob;
  }
}

// Backward of qkv_forward's RoPE, a block for kCudaRowsPerPartial token rows (blockIdx.x) and a
// thread for P units side by side (unit_place; (blockIdx.y * blockDim.x + threadIdx.x) * P) over
// those rows: from dq|dk|dv [n, (H + 2K) hd] in `in` (fp32 from the own attention kernels, T
// from cuDNN's), the gradient at the projections rounded to T into g16 (the GEMMs' input), in
// fp32 into g unless g is null (only Qwen3's head norms read it), and with `partials` (the
// biases' gradients) the sums of each column over the block's rows, added in row order from 0,
// into partials[blockIdx.x * width + column] for finish_columns. `in` may be g or g16: a thread
// reads each row's elements of its units before it writes them.
template <class T, class In, int P>
__global__ void qkv_backward(const In* in, float* g, const float* __restrict__ rope_cos,
                             const float* __restrict__ rope_sin, int n, int seq_len, int heads,
                             int kv_heads, int hd, T* g16, const int* __restrict__ positions,
                             float* __restrict__ partials) {
  using F = Pack<float, P>;
  using B = Pack<T, P>;
  using I = Pack<In, P>;
  const int half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  const int packs = ((heads + kv_heads) * half + kv_heads * hd) / P;
  const int w = blockIdx.y * blockDim.x + threadIdx.x;
  if (w >= packs) return;
  const QkvUnit p = unit_place(w * P, heads, kv_heads, hd);
  const int first = blockIdx.x * kCudaRowsPerPartial, end = min(n, first + kCudaRowsPerPartial);
  F sum_a, sum_b;
#pragma unroll
  for (int j = 0; j < P; ++j) sum_a.v[j] = sum_b.v[j] = 0.0f;
  // Unrolled so that each thread has several rows' loads in flight (the rows are independent
  // but for the sums).
  if (p.part == 2) {  // v: no rotation
#pragma unroll 4
    for (int t = first; t < end; ++t) {
      const long long at = static_cast<long long>(t) * width + p.column;
      const I d = *reinterpret_cast<const I*>(in + at);
      F f;
      B h;
#pragma unroll
      for (int j = 0; j < P; ++j) {
        f.v[j] = to_float(d.v[j]);
        h.v[j] = from_float<T>(f.v[j]);
        sum_a.v[j] += f.v[j];
      }
      if (g != nullptr) *reinterpret_cast<F*>(g + at) = f;
      *reinterpret_cast<B*>(g16 + at) = h;
    }
  } else {
#pragma unroll 4
    for (int t = first; t < end; ++t) {
      const long long at = static_cast<long long>(t) * width + p.column;
      const long long pos = positions != nullptr ? positions[t] : t % seq_len;
      const F c = *reinterpret_cast<const F*>(rope_cos + pos * half + p.freq);
      const F s = *reinterpret_cast<const F*>(rope_sin + pos * half + p.freq);
      const I da = *reinterpret_cast<const I*>(in + at);
      const I db = *reinterpret_cast<const I*>(in + at + half);
      F ga, gb;
      B ha, hb;
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const float a = to_float(da.v[j]), b = to_float(db.v[j]);
        ga.v[j] = a * c.v[j] + b * s.v[j];  // the rotation's transpose
        gb.v[j] = b * c.v[j] - a * s.v[j];
        ha.v[j] = from_float<T>(ga.v[j]);
        hb.v[j] = from_float<T>(gb.v[j]);
        sum_a.v[j] += ga.v[j];
        sum_b.v[j] += gb.v[j];
      }
      if (g != nullptr) {
        *reinterpret_cast<F*>(g + at) = ga;
        *reinterpret_cast<F*>(g + at + half) = gb;
      }
      *reinterpret_cast<B*>(g16 + at) = ha;
      *reinterpret_cast<B*>(g16 + at + half) = hb;
    }
  }
  if (partials == nullptr) return;
  float* const sums = partials + static_cast<long long>(blockIdx.x) * width + p.column;
  *reinterpret_cast<F*>(sums) = sum_a;
  if (p.part != 2) *reinterpret_cast<F*>(sums + half) = sum_b;
}

// Units a thread: 4 where a head's half (hd / 2) is a multiple of 4 (then every pack lies
// within one head's half or one run of v columns, and every row, column and table offset is a
// multiple of 4 elements) and every operand starts 16-byte aligned; else 1. A null operand (no
// bias, no fp32 copy, no partials) is not read or written and does not count.
int rope_pack(int hd, std::initializer_list<const void*> operands) {
  bool four = hd % 8 == 0;
  for (const void* ptr : operands)
    four = four && reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;  // nullptr: 0, passes
  return four ? 4 : 1;
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
  const int units = (heads + kv_heads) * (hd / 2) + kv_heads * hd;
  const int pack = rope_pack(hd, {qkv, bq, bk, bv, rope_cos, rope_sin, q, k, v});
  // Enough whole warps for a row's packs in one pass, up to 256 threads (160 at Qwen2.5-0.5B).
  const int threads = std::min(256, (units / pack + 31) / 32 * 32);
  if (pack == 4)
    qkv_forward<T, 4><<<n, threads, 0, cudaStreamPerThread>>>(
        qkv, bq, bk, bv, rope_cos, rope_sin, seq_len, heads, kv_heads, hd, q, k, v, positions);
  else
    qkv_forward<T, 1><<<n, threads, 0, cudaStreamPerThread>>>(
        qkv, bq, bk, bv, rope_cos, rope_sin, seq_len, heads, kv_heads, hd, q, k, v, positions);
  check_launch();
}

template <class T, class In>
void launch_qkv_backward(int n, const In* in, float* g, const float* rope_cos,
                         const float* rope_sin, int seq_len, int heads, int kv_heads, int hd,
                         T* g16, const int* positions, float* partials) {
  const int units = (heads + kv_heads) * (hd / 2) + kv_heads * hd;
  const int pack = rope_pack(hd, {in, g, rope_cos, rope_sin, g16, partials});
  const auto launch = [&](auto kernel) {
    const int threads = units / pack;
    const dim3 grid((n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial,
                    (threads + kQkvThreads - 1) / kQkvThreads);
    kernel<<<grid, kQkvThreads, 0, cudaStreamPerThread>>>(in, g, rope_cos, rope_sin, n, seq_len,
                                                          heads, kv_heads, hd, g16, positions,
                                                          partials);
  };
  if (pack == 4)
    launch(qkv_backward<T, In, 4>);
  else
    launch(qkv_backward<T, In, 1>);
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
