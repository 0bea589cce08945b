// One check for CUDA runtime, cuBLAS and NCCL results: a failure becomes a typed error naming the
// statement, file, line and device. Out-of-memory becomes OutOfMemory. The _WARN form only logs,
// for cleanup paths (destructors) that must not throw.
#pragma once

#include <cuda_runtime.h>

namespace shardswap::detail {

void cuda_check(cudaError_t status, const char* statement, const char* file, int line);
void cuda_warn(cudaError_t status, const char* statement, const char* file, int line);

}  // namespace shardswap::detail

#define SHARDSWAP_CUDA_CHECK(statement) \
  ::shardswap::detail::cuda_check((statement), #statement, __FILE__, __LINE__)
#define SHARDSWAP_CUDA_WARN(statement) \
  ::shardswap::detail::cuda_warn((statement), #statement, __FILE__, __LINE__)
