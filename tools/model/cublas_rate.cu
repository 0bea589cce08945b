// measure_cublas_gemm_tflops (cublas_rate.h): cuBLAS's rate on one GEMM, with buffers of its own.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>
#include <string>

#include "shardswap/error.h"
#include "support/cuda_check.h"
#include "model/cublas_check.cuh"
#include "model/cublas_rate.h"

namespace shardswap {

namespace {

// What cuBLAS may use as its workspace here: given to it, so that it allocates nothing itself.
constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;

__global__ void fill_random(void* data, bool bf16, long long count, unsigned seed) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    const float v = static_cast<float>(x & 0xffff) / 65536.0f - 0.5f;
    if (bf16)
      static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(v);
    else
      static_cast<__half*>(data)[i] = __float2half_rn(v);
  }
}

// cudaMalloc'ed for one call; freed when it goes out of scope.
struct DeviceScratch {
  void* ptr = nullptr;
  explicit DeviceScratch(std::size_t bytes) { SHARDSWAP_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() { SHARDSWAP_CUDA_WARN(cudaFree(ptr)); }
};

struct Event {
  cudaEvent_t e = nullptr;
  Event() { SHARDSWAP_CUDA_CHECK(cudaEventCreate(&e)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { SHARDSWAP_CUDA_WARN(cudaEventDestroy(e)); }
};


}  // namespace

double measure_cublas_gemm_tflops(int m, int n, int k, DType dtype) {
  if (m < 1 || n < 1 || k < 1)
    throw ConfigError("measure_cublas_gemm_tflops: sizes " + std::to_string(m) + " x " +
                      std::to_string(n) + " x " + std::to_string(k) + " must be positive");
  if (dtype != DType::bf16 && dtype != DType::f16)
    throw ConfigError(std::string("measure_cublas_gemm_tflops: dtype ") + dtype_name(dtype) +
                      " is not bf16 or fp16");
  constexpr int kWarmup = 3, kTimed = 10;
  const auto mm = static_cast<std::size_t>(m), nn = static_cast<std::size_t>(n),
             kk = static_cast<std::size_t>(k);
  DeviceScratch a(mm * kk * 2), b(kk * nn * 2), c(mm * nn * 2), workspace(kWorkspaceBytes);
  const bool bf16 = dtype == DType::bf16;
  const cudaStream_t stream = cudaStreamPerThread;
  fill_random<<<1024, 256, 0, stream>>>(a.ptr, bf16, static_cast<long long>(mm * kk), 1u);
  fill_random<<<1024, 256, 0, stream>>>(b.ptr, bf16, static_cast<long long>(kk * nn), 2u);
  SHARDSWAP_CUDA_CHECK(cudaGetLastError());
  const detail::CublasHandle handle(workspace.ptr, kWorkspaceBytes);
  const cudaDataType_t t = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  const float one = 1.0f, zero = 0.0f;
  const auto run = [&] {  // row-major C[m, n] = A[m, k] B[k, n]: column-major C^T = B^T A^T
    SHARDSWAP_CUBLAS_CHECK(cublasGemmEx(handle.get(), CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, b.ptr,
                                        t, n, a.ptr, t, k, &zero, c.ptr, t, n, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
  };
  for (int i = 0; i < kWarmup; ++i) run();
  Event start, stop;
  SHARDSWAP_CUDA_CHECK(cudaEventRecord(start.e, stream));
  for (int i = 0; i < kTimed; ++i) run();
  SHARDSWAP_CUDA_CHECK(cudaEventRecord(stop.e, stream));
  SHARDSWAP_CUDA_CHECK(cudaEventSynchronize(stop.e));
  float ms = 0.0f;
  SHARDSWAP_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e, stop.e));
  return 2.0 * static_cast<double>(m) * n * k * kTimed / (ms * 1e-3) / 1e12;
}

}  // namespace shardswap
