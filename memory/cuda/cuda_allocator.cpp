// cudaMalloc/cudaFree without a cache: a freed block goes straight back to the driver, so a test
// can see it come back in cudaMemGetInfo. (A stream-ordered pool may replace this once its
// release is made explicit; the stats vocabulary already has room for reserved != allocated.)
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <atomic>
#include <cstring>

#include "memory/allocator.h"
#include "memory/cuda/cuda_check.h"
#include "memory/error.h"

namespace shardswap {
namespace {

// cudaMalloc hands out 256-byte aligned blocks in 512-byte granules (observed granularity of
// the driver's sub-allocator for small blocks is larger; we report what we can know).
constexpr std::size_t kGranule = 512;

// Page-locked host memory (cudaHostAlloc): copies to and from the device run at the link's full
// speed and need no staging.
class PinnedHostAllocator final : public Allocator {
 public:
  Block allocate(std::size_t requested) override {
    const std::size_t bytes = (requested + kGranule - 1) / kGranule * kGranule;
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw OutOfMemory(
          fmt::format("PinnedHostAllocator::allocate: cudaHostAlloc of {} bytes failed", bytes));
    }
    SHARDSWAP_CUDA_CHECK(status);
    reserved_ += bytes;
    return {p, bytes};
  }
  void deallocate(Block block) noexcept override {
    SHARDSWAP_CUDA_WARN(cudaFreeHost(block.ptr));
    reserved_ -= block.bytes;
  }
  std::size_t reserved_bytes() const override { return reserved_; }
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
  std::atomic<std::size_t> reserved_{0};
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
