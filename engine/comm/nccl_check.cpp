#include "engine/comm/nccl_check.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <string>

#include "shardswap/error.h"

namespace shardswap::detail {

namespace {

std::string describe(ncclResult_t status, const char* statement, const char* file, int line) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();  // best effort
  std::string message =
      fmt::format("{} failed on device {} at {}:{}: {} (ncclResult_t {})", statement, device, file,
                  line, ncclGetErrorString(status), static_cast<int>(status));
  // NCCL's last error names the cause (a peer that went away, a bad argument); it may also be
  // left over from an earlier failure, so it is reported as what NCCL last said.
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') message += fmt::format("; NCCL last said: {}", last);
  return message;
}

}  // namespace

void nccl_fail(ncclResult_t status, const char* statement, const char* file, int line) {
  throw DeviceError(describe(status, statement, file, line));
}

void nccl_warn(ncclResult_t status, const char* statement, const char* file, int line) {
  if (status != ncclSuccess) spdlog::warn("{}", describe(status, statement, file, line));
}

}  // namespace shardswap::detail
