// Checks NCCL results like support/cuda_check.h checks CUDA's: a failure becomes a DeviceError
// naming the statement, file, line and device, with NCCL's explanation. The _WARN form only logs,
// for cleanup paths (destructors) that must not throw.
#pragma once

#include <nccl.h>

namespace shardswap::detail {

[[noreturn]] void nccl_fail(ncclResult_t status, const char* statement, const char* file, int line);
void nccl_warn(ncclResult_t status, const char* statement, const char* file, int line);

inline void nccl_check(ncclResult_t status, const char* statement, const char* file, int line) {
  if (status != ncclSuccess) nccl_fail(status, statement, file, line);
}

}  // namespace shardswap::detail

#define SHARDSWAP_NCCL_CHECK(statement) \
  ::shardswap::detail::nccl_check((statement), #statement, __FILE__, __LINE__)
#define SHARDSWAP_NCCL_WARN(statement) \
  ::shardswap::detail::nccl_warn((statement), #statement, __FILE__, __LINE__)
