// An Allocator that fails on purpose: the N-th allocation (counted from arm(), over this allocator
// and every host-staging allocator it hands out) throws OutOfMemory, as the real allocators do
// when memory runs out. Fault-injection tests arm it before a lifecycle call for N = 1, 2, ...
// until the call completes without reaching N, so every allocation inside the call fails once.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "shardswap/allocator.h"

namespace shardswap::test_support {

/// Shared by a FailingAllocator and its host-staging allocators, so one count spans device and
/// host allocations in the order the engine makes them.
struct AllocationFaults {
  std::size_t calls = 0;     ///< allocations seen since arm()
  std::size_t fail_at = 0;   ///< 1-based call that throws; 0: none
  std::size_t failures = 0;  ///< OutOfMemory thrown since arm()
  std::string failed_label;  ///< which allocator failed ("host" / "host staging"), for messages

  void arm(std::size_t nth) {
    calls = 0;
    fail_at = nth;
    failures = 0;
    failed_label.clear();
  }
  void disarm() { fail_at = 0; }
};

class FailingAllocator final : public Allocator {
 public:
  /// Wraps `inner`; `faults` decides which allocation fails. `role` names this allocator in
  /// the OutOfMemory message.
  FailingAllocator(std::unique_ptr<Allocator> inner, std::shared_ptr<AllocationFaults> faults,
                   std::string role = "device");

  Block allocate(std::size_t requested) override;
  void deallocate(Block block) noexcept override { inner_->deallocate(block); }
  std::size_t reserved_bytes() const override { return inner_->reserved_bytes(); }
  std::size_t cached_bytes() const override { return inner_->cached_bytes(); }
  std::size_t trim() noexcept override { return inner_->trim(); }
  DeviceKind device() const override { return inner_->device(); }
  std::string name() const override;
  void upload(void* dst, const void* src, std::size_t bytes) override {
    inner_->upload(dst, src, bytes);
  }
  void download(void* dst, const void* src, std::size_t bytes) override {
    inner_->download(dst, src, bytes);
  }
  /// The inner allocator's staging allocator, failing under the same count.
  std::unique_ptr<Allocator> host_staging() const override;

 private:
  std::unique_ptr<Allocator> inner_;
  std::shared_ptr<AllocationFaults> faults_;
  std::string role_;
};

}  // namespace shardswap::test_support
