// Sums over token rows for the gradients of the q/k/v biases and of the RMSNorm weights
// (tools/model/cuda/kernels.h): partials of kCudaRowsPerPartial rows (the biases' here, the
// norms' by their backward in rms_norm.cu and head_norm.cu), then one ordered sum of the
// partials added into the grad slot.
//
// Reproducibility: no atomics; a fixed two-pass tree, the same bits run to run.
#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

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

// Second pass: slot[k] += alpha * (the partials summed over the chunks, in order); a chunk's
// partials are `stride` floats apart (w, or more when they hold several params' columns).
template <class G>
__global__ void finish_columns(const float* __restrict__ partials, int chunks, int w, int stride,
                               float alpha, G* __restrict__ slot) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= w) return;
  float acc = 0.0f;
  for (int b = 0; b < chunks; ++b) acc += partials[static_cast<long long>(b) * stride + k];
  slot[k] = from_float<G>(to_float(slot[k]) + alpha * acc);
}

}  // namespace

void launch_column_partials(const float* x, int n, int w, long long ld, float* partials) {
  const int chunks = (n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial;
  column_partials<<<dim3(chunks, (w + 127) / 128), 128, 0, cudaStreamPerThread>>>(x, n, w, ld,
                                                                                  partials);
  check_launch();
}

template <class G>
void launch_finish_columns(const float* partials, int chunks, int w, int stride, float alpha,
                           G* slot) {
  finish_columns<G><<<(w + 255) / 256, 256, 0, cudaStreamPerThread>>>(partials, chunks, w, stride,
                                                                      alpha, slot);
  check_launch();
}

template void launch_finish_columns(const float*, int, int, int, float, float*);
template void launch_finish_columns(const float*, int, int, int, float, __nv_bfloat16*);
template void launch_finish_columns(const float*, int, int, int, float, __half*);

}  // namespace shardswap::lm::dec
