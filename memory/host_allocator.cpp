#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "shardswap/allocator.h"
#include "shardswap/error.h"

namespace shardswap {
namespace {

class HostAllocator final : public Allocator {
 public:
  explicit HostAllocator(std::size_t alignment) : alignment_(alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment < sizeof(void*))
      throw ConfigError(fmt::format("make_host_allocator: alignment {} is not a power of two >= {}",
                                    alignment, sizeof(void*)));
  }

  Block allocate(std::size_t requested) override {
    const std::size_t bytes = (requested + alignment_ - 1) / alignment_ * alignment_;
    void* p = std::aligned_alloc(alignment_, bytes);
    if (p == nullptr)
      throw OutOfMemory(
          fmt::format("HostAllocator::allocate: {} bytes ({} requested) failed", bytes, requested));
    reserved_ += bytes;
    return {p, bytes};
  }

  void deallocate(Block block) noexcept override {
    std::free(block.ptr);
    reserved_ -= block.bytes;
  }

  std::size_t reserved_bytes() const override { return reserved_; }
  DeviceKind device() const override { return DeviceKind::host; }
  std::string name() const override { return "host"; }
  void upload(void* dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  std::unique_ptr<Allocator> host_staging() const override {
    return std::make_unique<HostAllocator>(alignment_);
  }

 private:
  std::size_t alignment_;
  std::atomic<std::size_t> reserved_{0};
};

}  // namespace

std::unique_ptr<Allocator> make_host_allocator(std::size_t alignment) {
  return std::make_unique<HostAllocator>(alignment);
}

}  // namespace shardswap
