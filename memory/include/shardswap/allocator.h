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
  /// Bytes this allocator holds from the system (the driver, the C heap), caches included:
  /// the blocks handed out and not yet deallocated, plus cached_bytes().
  virtual std::size_t reserved_bytes() const = 0;
  /// Bytes of deallocated blocks kept for reuse: reserved, but handed out to no one (so counted
  /// in no tag). 0 for an allocator without a cache.
  virtual std::size_t cached_bytes() const { return 0; }
  /// Gives every cached block back to the system now and returns the bytes released (0 without
  /// a cache). Never throws. Blocks handed out are not affected.
  virtual std::size_t trim() noexcept { return 0; }
  virtual DeviceKind device() const = 0;
  virtual std::string name() const = 0;
  /// Copies between this allocator's memory and the host (synchronously with respect to the
  /// calling thread's work on the device).
  virtual void upload(void* device_dst, const void* host_src, std::size_t bytes) = 0;
  virtual void download(void* host_dst, const void* device_src, std::size_t bytes) = 0;
  /// An allocator of host memory that this one's device copies to and from fastest (pinned for
  /// CUDA, with a cache bounded by its high-water mark; plain for the host): where state kept on
  /// the host lives.
  virtual std::unique_ptr<Allocator> host_staging() const = 0;
};

/// Host memory, `alignment`-aligned (a power of two), rounded up to the alignment. No cache:
/// freed blocks go straight back to the C heap, so reserved == allocated.
std::unique_ptr<Allocator> make_host_allocator(std::size_t alignment = 256);

}  // namespace shardswap

namespace shardswap {

/// Device memory as the driver sees it (cudaMemGetInfo): what a test reads to show that freed
/// memory went back to the device and not only into a cache.
struct DeviceMemory {
  std::size_t free = 0;
  std::size_t total = 0;
};

/// cudaMalloc/cudaFree on `device`, no cache: every free returns memory to the driver, so
/// reserved == allocated. Its host_staging() allocator is page-locked host memory that does
/// cache freed blocks, never holding more than its peak of live bytes (memory/cuda/
/// cuda_allocator.cpp, docs/memory.md). Throws BackendUnavailable in a build without CUDA.
std::unique_ptr<Allocator> make_cuda_allocator(int device);
/// Throws BackendUnavailable in a build without CUDA.
DeviceMemory cuda_device_memory(int device);
/// Number of CUDA devices usable now; 0 in a build without CUDA or on a machine without a GPU.
int cuda_device_count();
/// Makes `device` the calling thread's current GPU (where its kernels and copies run), e.g. for a
/// rank thread of one process driving several GPUs. Throws ConfigError if it does not exist,
/// BackendUnavailable in a build without CUDA.
void cuda_set_device(int device);
/// The calling thread's current GPU. Throws BackendUnavailable in a build without CUDA.
int cuda_current_device();

}  // namespace shardswap
