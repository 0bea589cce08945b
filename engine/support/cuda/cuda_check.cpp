#include "support/cuda_check.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "shardswap/error.h"

namespace shardswap::detail {

namespace {

std::string describe(cudaError_t status, const char* statement, const char* file, int line) {
  int device = -1;
  cudaGetDevice(&device);  // best effort: the error itself may be sticky
  return fmt::format("{} failed on device {} at {}:{}: {} ({})", statement, device, file, line,
                     cudaGetErrorString(status), cudaGetErrorName(status));
}

}  // namespace

void cuda_check(cudaError_t status, const char* statement, const char* file, int line) {
  if (status == cudaSuccess) return;
  const auto message = describe(status, statement, file, line);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it so the context stays usable
    throw OutOfMemory(message);
  }
  throw DeviceError(message);
}

void cuda_warn(cudaError_t status, const char* statement, const char* file, int line) {
  if (status != cudaSuccess) spdlog::warn("{}", describe(status, statement, file, line));
}

}  // namespace shardswap::detail
