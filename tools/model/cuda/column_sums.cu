// Sums over token rows for the gradients of the q/k/v biases and of the RMSNorm weights
// (tools/model/cuda/kernels.h): partials of kCudaRowsPerPartial rows (the norms':
// kCudaNormRowsPerPartial), made by the backward kernels that compute the values (RoPE's in
// rope_qkv.cu, the norms' in rms_norm.cu and head_norm.cu), then here one ordered sum of the
// partials added into the grad slot.
//
// Reproducibility: no atomics; a fixed tree (rows of threads over the chunks, then their sums in
// row order), the same bits run to run.
#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

// slot[k] += alpha * (the partials summed over the chunks); a chunk's partials are `stride`
// floats apart (w, or more when they hold several params' columns). A block takes 32 columns
// with kFinishRows rows of threads: row y sums chunks y, y + kFinishRows, ... in order, then
// row 0 adds the rows' sums in row order. One thread a column, serial over the 256 chunks of
// the 0.5B shape, took 8-11 us a call, 121 calls a step (Nsight Compute, H200, 2026-12-05).
constexpr int kFinishRows = 32;
template <class G>
__global__ void finish_columns(const float* __restrict__ partials, int chunks, int w, int stride,
                               float alpha, G* __restrict__ slot) {
  __shared__ float sums[kFinishRows][33];  // 33: rows of a column fall in different banks
  const int k = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.0f;
  if (k < w)
    for (int b = threadIdx.y; b < chunks; b += kFinishRows)
      acc += partials[static_cast<long long>(b) * stride + k];
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || k >= w) return;
  float total = 0.0f;
  for (int y = 0; y < kFinishRows; ++y) total += sums[y][threadIdx.x];
  slot[k] = from_float<G>(to_float(slot[k]) + alpha * total);
}

}  // namespace

template <class G>
void launch_finish_columns(const float* partials, int chunks, int w, int stride, float alpha,
                           G* slot) {
  finish_columns<G><<<(w + 31) / 32, dim3(32, kFinishRows), 0, cudaStreamPerThread>>>(
      partials, chunks, w, stride, alpha, slot);
  check_launch();
}

template void launch_finish_columns(const float*, int, int, int, float, float*);
template void launch_finish_columns(const float*, int, int, int, float, __nv_bfloat16*);
template void launch_finish_columns(const float*, int, int, int, float, __half*);

}  // namespace shardswap::lm::dec
