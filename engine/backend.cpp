#include "shardswap/backend.h"
#include "support/quoted.h"

#include <fmt/format.h>

#include <optional>
#include <string_view>

#include "engine/backend_ops.h"
#include "shardswap/error.h"

namespace shardswap {

std::unique_ptr<Allocator> Backend::make_allocator(int rank) const {
  (void)rank;  // every rank of one process shares the backend's device
  return kind_ == DeviceKind::cuda ? make_cuda_allocator(device_) : make_host_allocator();
}

void Backend::synchronize() const {
  device_ops(*this).synchronize();
}

Backend cpu_backend() {
  return Backend(DeviceKind::host, -1, "cpu");
}

Backend cuda_backend(int device) {
  // Each lookup throws BackendUnavailable in a build without CUDA.
  (void)cuda_device_ops();
  (void)cuda_collective_ops();
  const int count = cuda_device_count();
  if (device < 0 || device >= count)
    throw ConfigError(
        fmt::format("cuda_backend: CUDA device {} does not exist ({} visible)", device, count));
  return Backend(DeviceKind::cuda, device, fmt::format("cuda:{}", device));
}

Backend backend_from_name(const std::string& name, const std::string& key) {
  if (name == "cpu") return cpu_backend();
  if (name == "cuda") return cuda_backend(0);
  if (name.rfind("cuda:", 0) == 0) {
    std::optional<int> device;
    try {
      std::size_t used = 0;
      const int n = std::stoi(name.substr(5), &used);
      if (used == name.size() - 5) device = n;
    } catch (const std::logic_error&) {
    }
    if (device) {
      // A device that does not exist is a mistake in the key: say so in the key's shape.
      try {
        return cuda_backend(*device);
      } catch (const ConfigError& e) {
        const std::string_view what = e.what();
        const auto colon = what.find(": ");
        throw ConfigError(
            fmt::format("{} = {}: {}", key, quote_value(name),
                        colon == std::string_view::npos ? what : what.substr(colon + 2)));
      }
    }
  }
  throw ConfigError(fmt::format("{} = {}: expected cpu, cuda or cuda:N", key, quote_value(name)));
}

const DeviceOps& device_ops(const Backend& backend) {
  return backend.kind() == DeviceKind::cuda ? cuda_device_ops() : cpu_device_ops();
}

const CollectiveOps& collective_ops(const Backend& backend) {
  return backend.kind() == DeviceKind::cuda ? cuda_collective_ops() : host_collective_ops();
}

}  // namespace shardswap
