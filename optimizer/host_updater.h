// The fused update of shards that live in host memory (the fp32 master and optimizer state
// offloaded to pinned host memory, issue 31), spread over a fixed set of threads. Internal to
// ShardSwap, like optimizer/optimizer.h.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "optimizer/optimizer.h"

namespace shardswap {

/// A fixed set of threads that runs the parts of one job at a time: run(parts, work) calls
/// work(0), ..., work(parts - 1), part 0 on the calling thread and part k on worker k, and returns
/// when every part has returned. Threads are started once, not per job: a job costs a wake-up.
class ForkJoinPool {
 public:
  /// The calling thread and threads - 1 workers (threads >= 1).
  explicit ForkJoinPool(unsigned threads);
  /// Joins the workers. No run may be in progress.
  ~ForkJoinPool();
  ForkJoinPool(const ForkJoinPool&) = delete;
  ForkJoinPool& operator=(const ForkJoinPool&) = delete;

  unsigned threads() const { return static_cast<unsigned>(workers_.size()) + 1; }
  /// parts <= threads(). An exception thrown by a part is rethrown here once every part has
  /// finished (the lowest part's, if several threw). Calls from several threads take turns.
  void run(unsigned parts, const std::function<void(unsigned part)>& work);

 private:
  void serve(unsigned part);     // the loop of the worker that runs `part`
  void run_part(unsigned part);  // work(part), its exception kept in errors_[part]
  void stop() noexcept;          // ends and joins the workers started so far

  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;      // guards what follows up to workers_
  std::condition_variable start_, done_;
  const std::function<void(unsigned)>* work_ = nullptr;
  unsigned parts_ = 0;
  std::uint64_t job_ = 0;  // counts jobs: a worker starts when it changes
  unsigned running_ = 0;   // workers still in the current job
  bool stopping_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> workers_;
};

/// The fused update of a shard that lives in host memory, split over a fixed pool of threads:
/// the same bits as cpu_device_ops().update (and the CUDA kernels), at the host's memory
/// bandwidth. Each thread updates one contiguous range of whole 64-element blocks (the last range
/// takes the tail), so no vector tail or cache line is shared by two threads.
class HostUpdater {
 public:
  /// 0: std::thread::hardware_concurrency() (at least 1).
  explicit HostUpdater(unsigned threads = 0);
  HostUpdater(const HostUpdater&) = delete;
  HostUpdater& operator=(const HostUpdater&) = delete;

  unsigned threads() const { return pool_.threads(); }
  /// Blocks until the whole shard is updated. What cpu_device_ops().update rejects is thrown as
  /// ConfigError ("HostUpdater::update: ...") on the calling thread before any element changes.
  /// A shard below kSplitFrom elements is updated on the calling thread alone.
  void update(const OptimizerConfig& config, const StepArgs& args, const ShardTensors& t);

  /// Below this many elements one thread takes about 0.1 ms (AdamW, 64K elements: 136 us on a
  /// 2-vCPU Xeon VM), where waking the workers (2 us there for an idle pool, more on a loaded
  /// host) would start to eat the gain.
  static constexpr std::size_t kSplitFrom = std::size_t{1} << 16;
  /// The unit of a thread's range, in elements: 256 bytes of fp32, 128 of bit16.
  static constexpr std::size_t kBlock = 64;

 private:
  ForkJoinPool pool_;
};

}  // namespace shardswap
