// Where one rank's memory and compute live: the host ("cpu") or one CUDA device ("cuda:N"). A
// small value: the Engine takes one and checks that the memory space and the communicator it is
// given work on the same memory (the device operations it runs are chosen from it).
#pragma once

#include <memory>
#include <string>

#include "shardswap/allocator.h"

namespace shardswap {

class Backend {
 public:
  DeviceKind kind() const { return kind_; }
  /// The CUDA device; -1 for the cpu backend.
  int device() const { return device_; }
  /// "cpu" or "cuda:N".
  const std::string& name() const { return name_; }
  /// A new allocator for one rank's MemorySpace (host memory, or cudaMalloc on the device).
  std::unique_ptr<Allocator> make_allocator(int rank) const;
  /// Waits until the work the calling thread queued on the backend has finished (a no-op on
  /// the cpu backend): for timing a step from the host.
  void synchronize() const;

 private:
  friend Backend cpu_backend();
  friend Backend cuda_backend(int device);
  Backend(DeviceKind kind, int device, std::string name)
      : kind_(kind), device_(device), name_(std::move(name)) {}
  DeviceKind kind_;
  int device_;
  std::string name_;
};

Backend cpu_backend();
/// Every rank on CUDA `device` (in-process ranks share it). Throws BackendUnavailable in a build
/// without CUDA, ConfigError if the device does not exist.
Backend cuda_backend(int device = 0);
/// "cpu" or "cuda" (= cuda:0) or "cuda:N". Throws ConfigError "KEY = \"NAME\": what is wrong"
/// otherwise, and for a CUDA device that does not exist.
Backend backend_from_name(const std::string& name, const std::string& key);

}  // namespace shardswap
