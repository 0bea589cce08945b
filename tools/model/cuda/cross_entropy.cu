// The cross-entropy of a chunk of logits rows, with the gradient at the logits in place, and the
// mean of the rows' losses (tools/model/cuda/kernels.h).
//
// Precision and reproducibility: logsumexp and softmax in fp32 by fixed trees over the block;
// the mean in fp64 by a fixed tree. The same bits run to run.
#include <cstdint>
#include <type_traits>

#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"

namespace shardswap::lm::dec {
namespace {

constexpr int kCeThreads = 256;

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

// One block per token row of the chunk: loss = logsumexp(z) - z[target] for logits z of type L
// (fp32, or T with model.bit16_logits); with `grad`, the row is replaced in place by dz =
// softmax(z) - onehot(target) (the gradient of the summed loss) in T, at the row's start (so rows
// of T are 2 V apart for fp32 logits, V apart for T's). N columns a thread at a time: 16-byte
// loads of fp32 (N = 4) where the launcher finds vocab a multiple of 4, since one 4-byte load a
// thread keeps too few bytes in flight to reach the memory bandwidth (8.6 ms for the 16 chunks
// of a 0.5B step on an H200, ~3 TB/s). In place is safe: each round of kCeThreads N columns is
// read before the barrier and written after it, and writes of round t reach only columns below
// kCeThreads N (t + 1) sizeof(T) / sizeof(L), all read by then.
template <class T, class L, int N>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_rows(L* logits, int vocab, const int* __restrict__ targets,
                       float* __restrict__ row_loss, bool grad) {
  using LPack = std::conditional_t<std::is_same_v<L, float>, FloatPack<N>, Pack<T, N>>;
  __shared__ float shared[kCeThreads];
  L* z = logits + static_cast<long long>(blockIdx.x) * vocab;
  const LPack* zp = reinterpret_cast<const LPack*>(z);
  const int packs = vocab / N;
  // One pass for the row's max and sum of exp (each thread's running sum rescaled when its
  // max grows), then the gradient pass: the row is read twice, not three times.
  float m = -INFINITY, sum = 0.0f;
#pragma unroll 4
  for (int p = threadIdx.x; p < packs; p += kCeThreads) {
    const LPack x = zp[p];
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float xv = to_float(x.v[e]);
      if (xv > m) {
        sum = sum * expf(m - xv) + 1.0f;
        m = xv;
      } else {
        sum += expf(xv - m);
      }
    }
  }
  const float row_max = block_reduce<true>(m, shared);
  sum = m == -INFINITY ? 0.0f : sum * expf(m - row_max);
  const float lse = row_max + logf(block_reduce<false>(sum, shared));
  const int target = targets[blockIdx.x];
  // kIgnoredTarget (decoder_compute.h), the only negative target; the same for the whole block.
  const bool ignored = target < 0;
  if (threadIdx.x == 0)  // before writes
    row_loss[blockIdx.x] = ignored ? 0.0f : lse - to_float(z[target]);
  if (!grad) return;
  Pack<T, N>* dz = reinterpret_cast<Pack<T, N>*>(z);
  for (int base = 0; base < packs; base += kCeThreads) {
    const int p = base + threadIdx.x;
    Pack<T, N> out;
    if (p < packs) {
      const LPack x = zp[p];
#pragma unroll
      for (int e = 0; e < N; ++e)
        out.v[e] = ignored ? from_float<T>(0.0f)
                           : from_float<T>(expf(to_float(x.v[e]) - lse) -
                                           (p * N + e == target ? 1.0f : 0.0f));
    }
    __syncthreads();
    if (p < packs) dz[p] = out;
  }
}

// One block: out = sum of loss[0..n) / denominator in double, by a fixed tree (0 for a zero
// denominator: no target counted).
__global__ void mean_of(const float* __restrict__ loss, int n, double denominator,
                        double* __restrict__ out) {
  __shared__ double partial[256];
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += loss[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = denominator == 0.0 ? 0.0 : partial[0] / denominator;
}

}  // namespace

template <class T, class L>
void launch_cross_entropy_rows(L* logits, int rows, int vocab, const int* targets,
                               float* row_loss, bool grad) {
  // Every row starts 16-byte aligned when the chunk does and vocab is a multiple of 4 (fp32) or
  // 8 (bit16 logits).
  constexpr int kWide = std::is_same_v<L, float> ? 4 : 8;
  if (vocab % kWide == 0 && reinterpret_cast<std::uintptr_t>(logits) % 16 == 0)
    cross_entropy_rows<T, L, kWide><<<rows, kCeThreads, 0, cudaStreamPerThread>>>(
        logits, vocab, targets, row_loss, grad);
  else
    cross_entropy_rows<T, L, 1><<<rows, kCeThreads, 0, cudaStreamPerThread>>>(
        logits, vocab, targets, row_loss, grad);
  check_launch();
}

void launch_mean_of(const float* loss, int n, double denominator, double* out) {
  mean_of<<<1, 256, 0, cudaStreamPerThread>>>(loss, n, denominator, out);
  check_launch();
}

template void launch_cross_entropy_rows<__nv_bfloat16, float>(float*, int, int, const int*,
                                                              float*, bool);
template void launch_cross_entropy_rows<__half, float>(float*, int, int, const int*, float*,
                                                       bool);
template void launch_cross_entropy_rows<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, int, int,
                                                                      const int*, float*, bool);
template void launch_cross_entropy_rows<__half, __half>(__half*, int, int, const int*, float*,
                                                        bool);

}  // namespace shardswap::lm::dec
