// A backend is data: how a rank gets memory, which kernels run the optimizer, and how
// in-process ranks exchange data. The engine takes one and never asks which it is.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "engine/comm/communicator.h"
#include "memory/allocator.h"
#include "optimizer/optimizer.h"

namespace shardswap {

struct Backend {
  std::string name;
  /// The allocator for one rank's MemorySpace.
  std::function<std::unique_ptr<Allocator>(int rank)> make_allocator;
  const OptimizerKernels* kernels = nullptr;
  /// For InProcessGroup / run_ranks: ranks as threads on this backend's memory.
  const CollectiveOps* collectives = nullptr;
};

Backend cpu_backend();
/// Every rank on CUDA `device` (in-process ranks share it). Throws BackendUnavailable in a build
/// without CUDA, ConfigError if the device does not exist.
Backend cuda_backend(int device = 0);
/// "cpu" or "cuda" (= cuda:0) or "cuda:N". Throws ConfigError naming `key` otherwise.
Backend backend_from_name(const std::string& name, const std::string& key);

}  // namespace shardswap
