// The embedding lookup and its gradient (tools/model/cuda/kernels.h).
//
// Reproducibility: the gradient sums each column of a token over the positions that hold it in
// ascending order, one thread a column: no atomics, the same bits run to run.
#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"

namespace shardswap::lm::dec {
namespace {

// x0[t, :] = embed[tokens[t], :] (exact in R: float, or T itself)
template <class T, class R>
__global__ void embed_forward(const T* __restrict__ table, const int* __restrict__ tokens, int n,
                              int d, R* __restrict__ x0) {
  GRID_STRIDE(i, static_cast<long long>(n) * d) {
    x0[i] = from_float<R>(to_float(table[static_cast<long long>(tokens[i / d]) * d + i % d]));
  }
}

// Blocks (distinct input token u, tile of kEmbedColumns columns): slot[rows[u], :] += alpha *
// the sum of dx over the positions that hold u, in ascending order, each column summed by one
// thread. Rows no position uses are left untouched. Text has a few very common tokens (bytes of
// source code: the space, the newline): one warp a token left each of those thousands of
// positions to sum alone, 12 ms a step at 8 x 2048 tokens, hidden 896, on an H200.
constexpr int kEmbedColumns = 128;
template <class G, class R>
__global__ void __launch_bounds__(kEmbedColumns)
    embed_backward(const R* __restrict__ dx, const int* __restrict__ rows,
                   const int* __restrict__ starts, const int* __restrict__ positions, int d,
                   float alpha, G* __restrict__ slot) {
  const int u = blockIdx.x, k = blockIdx.y * kEmbedColumns + threadIdx.x;
  if (k >= d) return;
  const int begin = starts[u], end = starts[u + 1];
  float acc = 0.0f;
#pragma unroll 8
  for (int e = begin; e < end; ++e)
    acc += to_float(dx[static_cast<long long>(positions[e]) * d + k]);
  G* out = slot + static_cast<long long>(rows[u]) * d + k;
  *out = from_float<G>(to_float(*out) + alpha * acc);
}

}  // namespace

template <class T, class R>
void launch_embed_forward(const T* table, const int* tokens, int n, int d, R* x0) {
  embed_forward<T, R><<<blocks_for(static_cast<long long>(n) * d), 256, 0,
                        cudaStreamPerThread>>>(table, tokens, n, d, x0);
  check_launch();
}

template <class G, class R>
void launch_embed_backward(const R* dx, const int* rows, int distinct, const int* starts,
                           const int* positions, int d, float alpha, G* slot) {
  const dim3 grid(static_cast<unsigned>(distinct),
                  static_cast<unsigned>((d + kEmbedColumns - 1) / kEmbedColumns));
  embed_backward<G, R><<<grid, kEmbedColumns, 0, cudaStreamPerThread>>>(
      dx, rows, starts, positions, d, alpha, slot);
  check_launch();
}

template void launch_embed_forward(const __nv_bfloat16*, const int*, int, int, float*);
template void launch_embed_forward(const __half*, const int*, int, int, float*);
template void launch_embed_forward(const __nv_bfloat16*, const int*, int, int, __nv_bfloat16*);
template void launch_embed_forward(const __half*, const int*, int, int, __half*);
// The slot's type G (float or T) with the stream's R (float or T), for each T.
#define SHARDSWAP_EMBED_BACKWARD(G, R)                                                      \
  template void launch_embed_backward(const R*, const int*, int, const int*, const int*, int, \
                                      float, G*);
SHARDSWAP_EMBED_BACKWARD(float, float)
SHARDSWAP_EMBED_BACKWARD(__nv_bfloat16, float)
SHARDSWAP_EMBED_BACKWARD(__half, float)
SHARDSWAP_EMBED_BACKWARD(float, __nv_bfloat16)
SHARDSWAP_EMBED_BACKWARD(__nv_bfloat16, __nv_bfloat16)
SHARDSWAP_EMBED_BACKWARD(float, __half)
SHARDSWAP_EMBED_BACKWARD(__half, __half)
#undef SHARDSWAP_EMBED_BACKWARD

}  // namespace shardswap::lm::dec
