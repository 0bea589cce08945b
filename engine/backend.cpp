#include "engine/backend.h"

#include <fmt/format.h>

#include "memory/error.h"

namespace shardswap {

Backend cpu_backend() {
  return {"cpu", [](int) { return make_host_allocator(); }, &cpu_kernels(), &host_collective_ops()};
}

Backend cuda_backend(int device) {
  // Each lookup throws BackendUnavailable in a build without CUDA.
  const OptimizerKernels& kernels = cuda_kernels();
  const CollectiveOps& collectives = cuda_collective_ops();
  const int count = cuda_device_count();
  if (device < 0 || device >= count)
    throw ConfigError(
        fmt::format("cuda_backend: CUDA device {} does not exist ({} visible)", device, count));
  return {fmt::format("cuda:{}", device), [device](int) { return make_cuda_allocator(device); },
          &kernels, &collectives};
}

Backend backend_from_name(const std::string& name, const std::string& key) {
  if (name == "cpu") return cpu_backend();
  if (name == "cuda") return cuda_backend(0);
  if (name.rfind("cuda:", 0) == 0) {
    try {
      std::size_t used = 0;
      const int device = std::stoi(name.substr(5), &used);
      if (used == name.size() - 5) return cuda_backend(device);
    } catch (const std::logic_error&) {
    }
  }
  throw ConfigError(
      fmt::format("backend_from_name: {} = '{}': expected cpu, cuda or cuda:N", key, name));
}

}  // namespace shardswap
