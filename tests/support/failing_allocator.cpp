#include "tests/support/failing_allocator.h"

#include <fmt/format.h>

#include <utility>

#include "shardswap/error.h"

namespace shardswap::test_support {

FailingAllocator::FailingAllocator(std::unique_ptr<Allocator> inner,
                                   std::shared_ptr<AllocationFaults> faults, std::string role)
    : inner_(std::move(inner)), faults_(std::move(faults)), role_(std::move(role)) {}

Block FailingAllocator::allocate(std::size_t requested) {
  // Engines allocate from one thread per rank and each rank has its own faults: no lock needed.
  const std::size_t call = ++faults_->calls;
  if (faults_->fail_at != 0 && call == faults_->fail_at) {
    ++faults_->failures;
    faults_->failed_label = role_;
    throw OutOfMemory(
        fmt::format("FailingAllocator({}): injected failure of allocation #{} ({} "
                    "bytes)",
                    role_, call, requested));
  }
  return inner_->allocate(requested);
}

std::string FailingAllocator::name() const {
  return fmt::format("failing {} over {}", role_, inner_->name());
}

std::unique_ptr<Allocator> FailingAllocator::host_staging() const {
  return std::make_unique<FailingAllocator>(inner_->host_staging(), faults_, role_ + " staging");
}

}  // namespace shardswap::test_support
