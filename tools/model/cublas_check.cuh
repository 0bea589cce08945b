// One check for cuBLAS results, in the spirit of SHARDSWAP_CUDA_CHECK: a failure becomes a
// DeviceError naming the statement, the status, file, line and device; and the one owner of a
// cuBLAS handle that the decoder and the GEMM-rate measurement share. Header-only and free of
// fmt, which nvcc cannot compile.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>
#include <string>

#include "shardswap/error.h"

namespace shardswap::detail {

inline void cublas_check(cublasStatus_t status, const char* statement, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  int device = -1;
  cudaGetDevice(&device);  // best effort
  throw DeviceError(std::string(statement) + " failed on device " + std::to_string(device) +
                    " at " + file + ":" + std::to_string(line) + ": " +
                    cublasGetStatusName(status) + " (" + cublasGetStatusString(status) + ")");
}

}  // namespace shardswap::detail

#define SHARDSWAP_CUBLAS_CHECK(statement) \
  ::shardswap::detail::cublas_check((statement), #statement, __FILE__, __LINE__)

namespace shardswap::detail {

// Owns a cuBLAS handle (not copyable) on cudaStreamPerThread with a given workspace.
class CublasHandle {
 public:
  CublasHandle(void* workspace, std::size_t bytes) {
    SHARDSWAP_CUBLAS_CHECK(cublasCreate(&handle_));
    try {
      // setStream resets the workspace to cuBLAS's own pool: set ours after it, so that cuBLAS
      // allocates nothing.
      SHARDSWAP_CUBLAS_CHECK(cublasSetStream(handle_, cudaStreamPerThread));
      SHARDSWAP_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace, bytes));
    } catch (...) {
      cublasDestroy(handle_);
      throw;
    }
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() {
    const cublasStatus_t status = cublasDestroy(handle_);
    if (status != CUBLAS_STATUS_SUCCESS)
      std::fprintf(stderr, "warning: cublasDestroy failed: %s\n", cublasGetStatusName(status));
  }
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

}  // namespace shardswap::detail
