// In-process collectives on one GPU shared by all ranks (threads): the element work of
// CollectiveOps as device kernels, so ZeRO with world size > 1 runs on a single H200. Each
// function runs on the calling thread's stream and waits for it: the rendezvous of the in-process
// group then orders ranks, as it does on the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <string>

#include "engine/comm/collective_ops.h"
#include "engine/comm/cuda_scale.h"
#include "shardswap/error.h"
#include "support/cuda_check.h"
#include "support/work_stream.h"

namespace shardswap {
namespace {

constexpr int kMaxRanks = 64;
struct Sources {
  const void* p[kMaxRanks];
};

template <class T, class Acc>
__global__ void reduce_kernel(Sources src, int nsrc, T* dst, std::size_t count, int op) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x) {
    Acc acc = static_cast<Acc>(static_cast<const T*>(src.p[0])[i]);
    for (int q = 1; q < nsrc; ++q) {
      const Acc v = static_cast<Acc>(static_cast<const T*>(src.p[q])[i]);
      if (op == static_cast<int>(ReduceOp::max)) {
        if (isnan(v) || v > acc) acc = v;  // a NaN already in acc stays
      } else {
        acc += v;
      }
    }
    if (op == static_cast<int>(ReduceOp::avg)) acc /= static_cast<Acc>(nsrc);
    dst[i] = static_cast<T>(acc);  // bit16: __float2bfloat16_rn / __float2half_rn
  }
}

template <class T, class Acc>
void launch(const void* const* src, int nsrc, void* dst, std::size_t count, ReduceOp op) {
  Sources s{};
  for (int q = 0; q < nsrc; ++q) s.p[q] = src[q];
  const int threads = 256;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((count + threads - 1) / threads, 4096));
  reduce_kernel<T, Acc><<<blocks, threads, 0, detail::work_stream()>>>(s, nsrc, static_cast<T*>(dst),
                                                                     count, static_cast<int>(op));
  SHARDSWAP_CUDA_CHECK(cudaGetLastError());
}

void cuda_reduce(DType dtype, const void* const* src, int nsrc, void* dst, std::size_t count,
                 ReduceOp op) {
  if (nsrc > kMaxRanks)
    throw ConfigError("cuda_collective_ops: " + std::to_string(nsrc) +
                      " ranks exceed the in-process limit of " + std::to_string(kMaxRanks));
  switch (dtype) {
    case DType::f32: launch<float, float>(src, nsrc, dst, count, op); break;
    case DType::f64: launch<double, double>(src, nsrc, dst, count, op); break;
    case DType::bf16: launch<__nv_bfloat16, float>(src, nsrc, dst, count, op); break;
    case DType::f16: launch<__half, float>(src, nsrc, dst, count, op); break;
  }
  SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(detail::work_stream()));
}

void cuda_copy(void* dst, const void* src, std::size_t bytes) {
  SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, detail::work_stream()));
  SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(detail::work_stream()));
}

void cuda_sync() { SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(detail::work_stream())); }

// Grow-only scratch per thread, freed when the thread ends.
struct ThreadScratch {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  ~ThreadScratch() {
    if (ptr) SHARDSWAP_CUDA_WARN(cudaFree(ptr));
  }
};

void* cuda_scratch(std::size_t bytes) {
  thread_local ThreadScratch scratch;
  if (scratch.bytes < bytes) {
    if (scratch.ptr) SHARDSWAP_CUDA_CHECK(cudaFree(scratch.ptr));
    scratch.ptr = nullptr;
    scratch.bytes = 0;
    SHARDSWAP_CUDA_CHECK(cudaMalloc(&scratch.ptr, bytes));
    scratch.bytes = bytes;
  }
  return scratch.ptr;
}

template <class T, class Acc>
__global__ void scale_kernel(T* data, std::size_t count, Acc factor) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x)
    data[i] = static_cast<T>(static_cast<Acc>(data[i]) * factor);
}

template <class T, class Acc>
void launch_scale(void* data, std::size_t count, double factor, cudaStream_t stream) {
  const int threads = 256;
  const auto blocks =
      static_cast<unsigned>(std::min<std::size_t>((count + threads - 1) / threads, 4096));
  scale_kernel<T, Acc><<<blocks, threads, 0, stream>>>(static_cast<T*>(data), count,
                                                       static_cast<Acc>(factor));
  SHARDSWAP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void scale_on_stream(void* data, std::size_t count, DType dtype, double factor,
                     cudaStream_t stream) {
  if (count == 0) return;
  switch (dtype) {
    case DType::f32: launch_scale<float, float>(data, count, factor, stream); break;
    case DType::f64: launch_scale<double, double>(data, count, factor, stream); break;
    case DType::bf16: launch_scale<__nv_bfloat16, float>(data, count, factor, stream); break;
    case DType::f16: launch_scale<__half, float>(data, count, factor, stream); break;
  }
}

const CollectiveOps& cuda_collective_ops() {
  static const CollectiveOps ops{"cuda", DeviceKind::cuda, cuda_reduce, cuda_copy, cuda_sync, cuda_scratch};
  return ops;
}

}  // namespace shardswap
