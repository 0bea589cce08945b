// One check for cuBLAS results, in the spirit of SHARDSWAP_CUDA_CHECK: a failure becomes a
// DeviceError naming the statement, the status, file, line and device. Header-only and free of
// fmt, which nvcc cannot compile.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

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
