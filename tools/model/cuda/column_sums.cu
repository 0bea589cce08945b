// Sums over token rows for the gradients of the q/k/v biases and of the RMSNorm weights
// (tools/model/cuda/kernels.h): partials of kCudaRowsPerPartial rows, made by the backward
// kernels that compute the values (RoPE's in rope_qkv.cu, the norms' in rms_norm.cu and
// head_norm.cu), then here one ordered sum of the partials added into the grad slot.
//
// Reproducibility: no atomics; a fixed two-pass tree, the same bits run to run.
#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

// slot[k] += alpha * (the partials summed over the chunks, in order); a chunk's
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
