// Device memory: cudaMalloc/cudaFree without a cache, so a freed block goes straight back to the
// driver and a test can see it come back in cudaMemGetInfo. (A stream-ordered pool may replace
// this once its release is made explicit.) Host staging memory: page-locked, with a cache
// bounded by its high-water mark (PinnedHostAllocator below).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#include "shardswap/allocator.h"
#include "shardswap/error.h"
#include "support/cuda_check.h"

namespace shardswap {
namespace {

// cudaMalloc hands out 256-byte aligned blocks in 512-byte granules (observed granularity of
// the driver's sub-allocator for small blocks is larger; we report what we can know).
constexpr std::size_t kGranule = 512;

// Page-locked host memory (cudaHostAlloc): copies to and from the device run at the link's full
// speed and need no staging.
//
// Freed blocks are cached for reuse. Pinning is the costly part of this memory: cudaHostAlloc
// maps, zeroes and locks every page and cudaFreeHost unlocks and unmaps them, which for the
// ~0.8 GB a keep_host layer moves takes longer than copying it over the link (docs/memory.md,
// "Pinned host memory"). The policy, in plain words:
//   - a request is served from a cached block of exactly its rounded size when there is one;
//     keep_host asks for the same few sizes again and again (each layer's master and state);
//   - reserved (live + cached) never exceeds the high-water mark of live bytes: a new block is
//     pinned only after enough cached blocks, largest first, went back to the driver. So the
//     process's peak pinned memory is what it would be with no cache, and a cache never holds
//     more than the engine once needed at one time;
//   - trim() and the destructor give every cached block back.
// Exact sizes, not best fit, keep that bound honest: a larger block handed out for a smaller
// request would be live bytes a cacheless allocator would not hold.
// One allocator serves one rank's host space; the mutex makes trim() and the figures safe from
// any thread all the same.
class PinnedHostAllocator final : public Allocator {
 public:
  PinnedHostAllocator() = default;
  PinnedHostAllocator(const PinnedHostAllocator&) = delete;
  PinnedHostAllocator& operator=(const PinnedHostAllocator&) = delete;
  ~PinnedHostAllocator() override { trim(); }

  Block allocate(std::size_t requested) override {
    const std::size_t bytes = (requested + kGranule - 1) / kGranule * kGranule;
    std::lock_guard lock(mu_);
    if (const auto it = cache_.find(bytes); it != cache_.end()) {
      const Block block{it->second, bytes};
      cache_.erase(it);
      cached_ -= bytes;
      add_live(bytes);
      return block;
    }
    const std::size_t limit = std::max(peak_live_, live_ + bytes);
    while (!cache_.empty() && live_ + bytes + cached_ > limit) release_largest_cached();
    void* p = nullptr;
    cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (status == cudaErrorMemoryAllocation && !cache_.empty()) {
      cudaGetLastError();  // not sticky; what the cache holds may be what the system lacks
      while (!cache_.empty()) release_largest_cached();
      status = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    }
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw OutOfMemory(fmt::format(
          "PinnedHostAllocator::allocate: cudaHostAlloc of {} bytes failed ({} bytes pinned "
          "and in use, none cached)",
          bytes, live_));
    }
    SHARDSWAP_CUDA_CHECK(status);
    add_live(bytes);
    return {p, bytes};
  }

  // Caching never raises reserved bytes (the block only moves from live to cached), so the
  // high-water bound is kept by allocate() alone.
  void deallocate(Block block) noexcept override {
    if (block.ptr == nullptr) return;
    std::lock_guard lock(mu_);
    live_ -= block.bytes;
    try {
      cache_.emplace(block.bytes, block.ptr);
      cached_ += block.bytes;
    } catch (...) {  // no memory for the map node: give the block back instead
      SHARDSWAP_CUDA_WARN(cudaFreeHost(block.ptr));
    }
  }

  std::size_t reserved_bytes() const override {
    std::lock_guard lock(mu_);
    return live_ + cached_;
  }
  std::size_t cached_bytes() const override {
    std::lock_guard lock(mu_);
    return cached_;
  }
  std::size_t trim() noexcept override {
    std::lock_guard lock(mu_);
    const std::size_t released = cached_;
    while (!cache_.empty()) release_largest_cached();
    return released;
  }

  DeviceKind device() const override { return DeviceKind::host; }
  std::string name() const override { return "pinned host"; }
  void upload(void* dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  std::unique_ptr<Allocator> host_staging() const override {
    return std::make_unique<PinnedHostAllocator>();
  }

 private:
  // Caller holds mu_.
  void add_live(std::size_t bytes) {
    live_ += bytes;
    peak_live_ = std::max(peak_live_, live_);
  }
  void release_largest_cached() noexcept {
    const auto last = std::prev(cache_.end());
    SHARDSWAP_CUDA_WARN(cudaFreeHost(last->second));
    cached_ -= last->first;
    cache_.erase(last);
  }

  mutable std::mutex mu_;
  std::multimap<std::size_t, void*> cache_;  // rounded size -> block
  std::size_t live_ = 0;                     // bytes handed out, not yet deallocated
  std::size_t cached_ = 0;                   // bytes in cache_
  std::size_t peak_live_ = 0;                // high-water mark of live_: the bound on reserved
};

class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {
    int count = 0;
    SHARDSWAP_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count)
      throw ConfigError(
          fmt::format("make_cuda_allocator: device {} does not exist ({} devices)", device, count));
  }

  Block allocate(std::size_t requested) override {
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    const std::size_t bytes = (requested + kGranule - 1) / kGranule * kGranule;
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, bytes);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      const auto mem = cuda_device_memory(device_);
      throw OutOfMemory(
          fmt::format("CudaAllocator::allocate: cudaMalloc of {} bytes on device {} "
                      "failed: {} bytes free of {}",
                      bytes, device_, mem.free, mem.total));
    }
    SHARDSWAP_CUDA_CHECK(status);
    reserved_ += bytes;
    return {p, bytes};
  }

  void deallocate(Block block) noexcept override {
    cudaSetDevice(device_);
    SHARDSWAP_CUDA_WARN(cudaFree(block.ptr));
    reserved_ -= block.bytes;
  }

  std::size_t reserved_bytes() const override { return reserved_; }
  DeviceKind device() const override { return DeviceKind::cuda; }
  std::string name() const override { return fmt::format("cuda:{}", device_); }
  std::unique_ptr<Allocator> host_staging() const override {
    return std::make_unique<PinnedHostAllocator>();
  }

  // The engine's kernels run on each thread's default stream (cudaStreamPerThread): copies go
  // there too, so they are ordered after the work that produced the data.
  void upload(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    SHARDSWAP_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cudaStreamPerThread));
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  }
  void download(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    SHARDSWAP_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cudaStreamPerThread));
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  }

 private:
  int device_;
  std::atomic<std::size_t> reserved_{0};
};

}  // namespace

std::unique_ptr<Allocator> make_cuda_allocator(int device) {
  return std::make_unique<CudaAllocator>(device);
}

DeviceMemory cuda_device_memory(int device) {
  int previous = 0;
  SHARDSWAP_CUDA_CHECK(cudaGetDevice(&previous));
  SHARDSWAP_CUDA_CHECK(cudaSetDevice(device));
  DeviceMemory m;
  SHARDSWAP_CUDA_CHECK(cudaMemGetInfo(&m.free, &m.total));
  SHARDSWAP_CUDA_CHECK(cudaSetDevice(previous));
  return m;
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

void cuda_set_device(int device) {
  const int count = cuda_device_count();
  if (device < 0 || device >= count)
    throw ConfigError(
        fmt::format("cuda_set_device: CUDA device {} does not exist ({} visible)", device, count));
  SHARDSWAP_CUDA_CHECK(cudaSetDevice(device));
}

int cuda_current_device() {
  int device = 0;
  SHARDSWAP_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace shardswap
