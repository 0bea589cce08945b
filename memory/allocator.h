// The allocator seam: the host backend implements it here, the CUDA backend over cudaMalloc.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace shardswap {

enum class DeviceKind { host, cuda };

/// A piece of memory as the allocator handed it out: `bytes` is what was allocated, which may
/// exceed what was requested (rounding to the allocator's granularity).
struct Block {
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  /// Never returns null for requested > 0; throws OutOfMemory naming the request instead.
  virtual Block allocate(std::size_t requested) = 0;
  virtual void deallocate(Block block) noexcept = 0;
  /// Bytes this allocator holds from the system (the driver, the C heap), caches included.
  virtual std::size_t reserved_bytes() const = 0;
  virtual DeviceKind device() const = 0;
  virtual std::string name() const = 0;
};

/// Host memory, `alignment`-aligned (a power of two), rounded up to the alignment. No cache:
/// freed blocks go straight back to the C heap, so reserved == allocated.
std::unique_ptr<Allocator> make_host_allocator(std::size_t alignment = 256);

}  // namespace shardswap
