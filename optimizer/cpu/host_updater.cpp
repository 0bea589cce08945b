// HostUpdater: cpu_device_ops().update on consecutive ranges of a shard, one range per thread of
// a ForkJoinPool. The update is elementwise, so a range's call gives exactly the bits the whole
// shard's call gives there.
#include "optimizer/host_updater.h"

#include <algorithm>

#include "optimizer/kernel_checks.h"

namespace shardswap {

ForkJoinPool::ForkJoinPool(unsigned threads) {
  try {
    for (unsigned part = 1; part < threads; ++part)
      workers_.emplace_back([this, part] { serve(part); });
  } catch (...) {  // a thread that could not start: the started ones must not outlive the pool
    stop();
    throw;
  }
}

ForkJoinPool::~ForkJoinPool() {
  stop();
}

void ForkJoinPool::stop() noexcept {
  {
    const std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  start_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ForkJoinPool::run(unsigned parts, const std::function<void(unsigned)>& work) {
  const std::lock_guard one_job(run_mutex_);
  {
    const std::lock_guard lock(mutex_);
    errors_.assign(parts, nullptr);
    work_ = &work;
    parts_ = parts;
    running_ = parts > 0 ? parts - 1 : 0;
    ++job_;
  }
  if (parts > 1) start_.notify_all();
  if (parts > 0) run_part(0);
  {
    // `work` lives on the caller's stack: no worker may still be in it when run returns.
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return running_ == 0; });
    work_ = nullptr;
  }
  for (const std::exception_ptr& error : errors_) {
    if (error) std::rethrow_exception(error);
  }
}

void ForkJoinPool::run_part(unsigned part) {
  try {
    (*work_)(part);
  } catch (...) {  // rethrown by run on the caller's thread; a worker must never terminate
    errors_[part] = std::current_exception();
  }
}

void ForkJoinPool::serve(unsigned part) {
  std::uint64_t seen = 0;
  std::unique_lock lock(mutex_);
  for (;;) {
    start_.wait(lock, [&] { return stopping_ || job_ != seen; });
    if (stopping_) return;
    seen = job_;
    if (part >= parts_) continue;  // a job of fewer parts than threads
    lock.unlock();
    run_part(part);
    lock.lock();
    if (--running_ == 0) done_.notify_one();
  }
}

namespace {

// Part `part` of `parts` of a shard of `count` elements: whole kBlock blocks, shared out evenly,
// the tail with the last part.
ShardTensors range_of(const ShardTensors& t, unsigned part, unsigned parts) {
  const std::size_t blocks = (t.count + HostUpdater::kBlock - 1) / HostUpdater::kBlock;
  const std::size_t begin = blocks * part / parts * HostUpdater::kBlock;
  const std::size_t end = std::min(t.count, blocks * (part + 1) / parts * HostUpdater::kBlock);
  // An absent state slot (SGD's) stays null: no arithmetic on a null pointer.
  const auto state = [&](void* p) {
    return p == nullptr ? p : static_cast<std::byte*>(p) + begin * dtype_size(t.state_dtype);
  };
  ShardTensors r = t;
  // The master is fp32 values or their low halves: whichever is given moves.
  if (t.master != nullptr) r.master = t.master + begin;
  if (t.master_low != nullptr) r.master_low = t.master_low + begin;
  r.state0 = state(t.state0);
  r.state1 = state(t.state1);
  r.grad = static_cast<const unsigned char*>(t.grad) + begin * dtype_size(t.grad_dtype);
  r.param = static_cast<unsigned char*>(t.param) + begin * dtype_size(t.dtype);
  r.count = end - begin;
  return r;
}

unsigned hardware_threads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

HostUpdater::HostUpdater(unsigned threads) : pool_(threads == 0 ? hardware_threads() : threads) {}

void HostUpdater::update(const OptimizerConfig& config, const StepArgs& args,
                         const ShardTensors& t) {
  if (!detail::check_update("HostUpdater::update", config, args, t)) return;
  const std::size_t blocks = (t.count + kBlock - 1) / kBlock;
  const unsigned parts =
      t.count < kSplitFrom ? 1u : static_cast<unsigned>(std::min<std::size_t>(threads(), blocks));
  if (parts == 1) {
    cpu_device_ops().update(config, args, t);
    return;
  }
  pool_.run(parts, [&](unsigned part) {
    cpu_device_ops().update(config, args, range_of(t, part, parts));
  });
}

}  // namespace shardswap
