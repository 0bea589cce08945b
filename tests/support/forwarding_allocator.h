// An allocator that passes every call to another one: the base of the test wrappers that watch
// or change a few of its calls (they override those, and say what host_staging() hands out).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "shardswap/allocator.h"

namespace shardswap::test_support {

class ForwardingAllocator : public Allocator {
 public:
  explicit ForwardingAllocator(std::unique_ptr<Allocator> inner) : inner_(std::move(inner)) {}
  Block allocate(std::size_t requested) override { return inner_->allocate(requested); }
  void deallocate(Block block) noexcept override { inner_->deallocate(block); }
  std::size_t reserved_bytes() const override { return inner_->reserved_bytes(); }
  std::size_t cached_bytes() const override { return inner_->cached_bytes(); }
  std::size_t trim() noexcept override { return inner_->trim(); }
  DeviceKind device() const override { return inner_->device(); }
  std::string name() const override { return inner_->name(); }
  void upload(void* dst, const void* src, std::size_t bytes) override {
    inner_->upload(dst, src, bytes);
  }
  void download(void* dst, const void* src, std::size_t bytes) override {
    inner_->download(dst, src, bytes);
  }

 protected:
  Allocator& inner() const { return *inner_; }

 private:
  std::unique_ptr<Allocator> inner_;
};

}  // namespace shardswap::test_support
