// NCCL communicator: one rank of an NCCL clique, on one GPU.
//
// Ordering policy: the engine queues its kernels on each thread's work stream
// (support/work_stream.h: cudaStreamPerThread but for an update queued beside a forward). A
// collective runs on the communicator's own non-blocking stream between two events: `ready_`,
// recorded on the caller's stream and waited for by ours (communication after the compute that
// produced its input), and `done_`, recorded on ours and waited for by the caller's (later
// compute after the communication). The host never waits, except in barrier(). The two events
// are reused: a wait captures the event as it is when the wait is issued, and one communicator
// serves one thread at a time, so every record is consumed before the next one.
//
// Failure policy: arguments are checked before anything is queued (ConfigError). An NCCL call
// that fails throws DeviceError. Errors NCCL finds later (a peer died, a network fault) are read
// with ncclCommGetAsyncError before each collective and while barrier() or the destructor waits,
// so a dead peer gives a CommError instead of a hang; such a communicator is aborted at the end
// instead of destroyed.
//
// Timeout policy: a peer that never arrives does not make NCCL fail, it makes its kernels spin,
// and the host then blocks in whichever wait comes next (the engine's stream synchronize, a
// copy to the host), outside this class. Only another thread can end that: with a timeout, a
// watchdog thread per communicator records an event after every collective (or group) with the
// time it was issued, retires those that completed (cudaEventQuery), and also reads NCCL's
// asynchronous error. When the oldest outlives the timeout, or NCCL reports an error, it
// records why, bars new NCCL calls on the communicator (every one throws CommError saying why)
// and aborts it: NCCL's abort flag ends the stuck kernels, so the host's waits return (to
// garbage: check() says so), and it also ends a call blocked on the host waiting for a peer to
// connect. The owner's NCCL calls and the abort exclude each other (enter()/leave()), except a
// call still blocked after kAbortGrace, which only the abort can end. NCCL's non-blocking
// communicators were the alternative (every call returns at once and is polled against a
// deadline) but they do not help with a wait outside NCCL, and NCCL 2.28 then runs every
// collective's launch on a new thread: the watchdog costs nothing without a timeout, an event
// record per collective with one.
#include "shardswap/nccl.h"
#include "engine/comm/cuda_scale.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/comm/nccl_adopt.h"
#include "engine/comm/nccl_check.h"
#include "shardswap/error.h"
#include "support/cuda_check.h"
#include "support/work_stream.h"

namespace shardswap {
namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
  }
  throw ConfigError(fmt::format("NcclCommunicator: unknown dtype {}", static_cast<int>(dtype)));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclSum;  // then scaled by 1/world_size: see average()
    case ReduceOp::max:
      return ncclMax;
  }
  throw ConfigError(fmt::format("NcclCommunicator: unknown reduce op {}", static_cast<int>(op)));
}

/// True if the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

const std::byte* advance(const void* p, std::size_t bytes) {
  return static_cast<const std::byte*>(p) + bytes;
}

/// A blocking NCCL communicator never reports ncclInProgress once initialized; treat it as
/// "not failed" all the same.
bool is_failure(ncclResult_t r) {
  return r != ncclSuccess && r != ncclInProgress;
}

// An NCCL call on the communicator's comm_, inside one of its members, with `call` naming the
// collective for errors.
#define SHARDSWAP_NCCL_ON_COMM(call, statement) \
  nccl_result((call), (statement), #statement, __LINE__)

class NcclCommunicator final : public Communicator {
 public:
  /// Takes `comm` over: it is destroyed here even if this constructor throws. `keep_alive` is
  /// released only after the NCCL communicator is gone (an mpirun rank's MPI session). A
  /// positive `timeout` starts the watchdog.
  NcclCommunicator(ncclComm_t comm, int device, CommTimeout timeout,
                   std::shared_ptr<void> keep_alive)
      : keep_alive_(std::move(keep_alive)), comm_(comm), device_(device), timeout_(timeout) {
    try {
      SHARDSWAP_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
      SHARDSWAP_NCCL_CHECK(ncclCommCount(comm_, &world_size_));
      SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
      SHARDSWAP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
      SHARDSWAP_CUDA_CHECK(cudaMalloc(&barrier_scratch_, sizeof(float)));
      SHARDSWAP_CUDA_CHECK(cudaMemsetAsync(barrier_scratch_, 0, sizeof(float), stream_));
      if (watching()) watchdog_ = std::thread([this] { watch_loop(); });
    } catch (...) {
      release();
      throw;
    }
  }

  ~NcclCommunicator() override { release(); }

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  DeviceKind device() const override { return DeviceKind::cuda; }

  // avg is a sum scaled by 1/world_size on the comm stream. (ncclAvg itself left the last
  // element of an odd-sized out-of-place reduce_scatter unwritten with NCCL 2.28.3, one rank, on
  // the H200: tests/gpu/nccl_gpu_test.cpp caught it.)
  void average(ReduceOp op, void* data, std::size_t count, DType dtype) {
    // The scale must follow the collective on our stream; in a group the collective is only
    // queued at group_end(), so it would run before it.
    if (op == ReduceOp::avg && in_group_)
      throw ConfigError("NcclCommunicator: avg inside group_start()/group_end() is not supported");
    if (op == ReduceOp::avg && world_size_ > 1)
      scale_on_stream(data, count, dtype, 1.0 / world_size_, stream_);
  }

  void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op) override {
    const auto call = [&] {
      return fmt::format("NcclCommunicator::all_reduce(count={}, {}, {})", count, dtype_name(dtype),
                         reduce_op_name(op));
    };
    require_data(call, data, count, "data");
    const ncclDataType_t type = nccl_type(dtype);
    const ncclRedOp_t red = nccl_op(op);
    if (count == 0) return;
    const Use use = begin(call);
    SHARDSWAP_NCCL_ON_COMM(call, ncclAllReduce(data, data, count, type, red, comm_, stream_));
    average(op, data, count, dtype);
    end(call);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op) override {
    const auto call = [&] {
      return fmt::format("NcclCommunicator::reduce_scatter(count={}, {}, {})", recv_count,
                         dtype_name(dtype), reduce_op_name(op));
    };
    require_data(call, send, recv_count, "send");
    require_data(call, recv, recv_count, "recv");
    const ncclDataType_t type = nccl_type(dtype);
    const ncclRedOp_t red = nccl_op(op);
    if (recv_count == 0) return;
    const std::size_t chunk = recv_count * dtype_size(dtype);
    const void* own = advance(send, static_cast<std::size_t>(rank_) * chunk);
    if (recv != own && overlap(send, static_cast<std::size_t>(world_size_) * chunk, recv, chunk)) {
      throw ConfigError(fmt::format(
          "{}: recv overlaps send without being rank {}'s chunk of it (in place means recv == "
          "send + rank * recv_count)",
          call(), rank_));
    }
    const Use use = begin(call);
    SHARDSWAP_NCCL_ON_COMM(call,
                           ncclReduceScatter(send, recv, recv_count, type, red, comm_, stream_));
    average(op, recv, recv_count, dtype);
    end(call);
  }

  void reduce(void* data, std::size_t count, DType dtype, ReduceOp op, int root) override {
    const auto call = [&] {
      return fmt::format("NcclCommunicator::reduce(count={}, {}, {}, root={})", count,
                         dtype_name(dtype), reduce_op_name(op), root);
    };
    require_root(call, root);
    require_data(call, data, count, "data");
    const ncclDataType_t type = nccl_type(dtype);
    const ncclRedOp_t red = nccl_op(op);
    if (count == 0) return;
    const Use use = begin(call);
    SHARDSWAP_NCCL_ON_COMM(call, ncclReduce(data, data, count, type, red, root, comm_, stream_));
    if (rank_ == root) average(op, data, count, dtype);
    end(call);
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) override {
    const auto call = [&] {
      return fmt::format("NcclCommunicator::all_gather(count={}, {})", send_count,
                         dtype_name(dtype));
    };
    require_data(call, send, send_count, "send");
    require_data(call, recv, send_count, "recv");
    const ncclDataType_t type = nccl_type(dtype);
    if (send_count == 0) return;
    const std::size_t chunk = send_count * dtype_size(dtype);
    const void* own = advance(recv, static_cast<std::size_t>(rank_) * chunk);
    if (send != own && overlap(send, chunk, recv, static_cast<std::size_t>(world_size_) * chunk)) {
      throw ConfigError(fmt::format(
          "{}: send overlaps recv without being rank {}'s chunk of it (in place means send == "
          "recv + rank * send_count)",
          call(), rank_));
    }
    const Use use = begin(call);
    SHARDSWAP_NCCL_ON_COMM(call, ncclAllGather(send, recv, send_count, type, comm_, stream_));
    end(call);
  }

  void broadcast(void* data, std::size_t count, DType dtype, int root) override {
    const auto call = [&] {
      return fmt::format("NcclCommunicator::broadcast(count={}, {}, root={})", count,
                         dtype_name(dtype), root);
    };
    require_root(call, root);
    require_data(call, data, count, "data");
    const ncclDataType_t type = nccl_type(dtype);
    if (count == 0) return;
    const Use use = begin(call);
    SHARDSWAP_NCCL_ON_COMM(call, ncclBroadcast(data, data, count, type, root, comm_, stream_));
    end(call);
  }

  void set_deferred(bool deferred) override { deferred_ = deferred; }

  void group_start() override {
    const auto call = [] { return std::string("NcclCommunicator::group_start()"); };
    if (in_group_) throw ConfigError("NcclCommunicator::group_start: groups do not nest");
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    // The group holds the right to use comm_ until group_end(): the watchdog must not abort
    // it between a grouped collective and the ncclGroupEnd() that launches it.
    enter(call);
    try {
      SHARDSWAP_NCCL_CHECK(ncclGroupStart());
    } catch (...) {
      leave();
      throw;
    }
    in_group_ = true;
    grouped_ = 0;
  }

  void group_end() override {
    const auto call = [] { return std::string("NcclCommunicator::group_end()"); };
    if (!in_group_) throw ConfigError("NcclCommunicator::group_end without group_start");
    in_group_ = false;
    const Use use{this};  // taken over from group_start()
    // Called even after a failure, so that this thread's NCCL group is closed.
    SHARDSWAP_NCCL_ON_COMM(call, ncclGroupEnd());  // queues the group's collectives on our stream
    if (grouped_ == 0) return;
    if (watching())
      watch(fmt::format("a group of {} collective(s), the first {}", grouped_, group_first_),
            group_issued_);
    order_caller();
  }

  void join() override {
    if (!unjoined_) return;
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    // Our stream runs its collectives in order: one event after the last covers them all.
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(done_, stream_));
    SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(detail::work_stream(), done_, 0));
    unjoined_ = false;
  }

  void barrier() override {
    const auto call = [] { return std::string("NcclCommunicator::barrier()"); };
    if (in_group_) throw ConfigError(call() + ": not allowed inside group_start()/group_end()");
    {
      const Use use = begin(call);
      SHARDSWAP_NCCL_ON_COMM(call, ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclFloat32,
                                                 ncclSum, comm_, stream_));
      end(call);
    }
    // Every rank's all-reduce has completed once ours has: all of them reached the barrier.
    const Idle idle = wait_idle();
    if (idle.aborted) throw_if_aborted(call);
    detail::cuda_check(idle.cuda, "cudaStreamQuery(stream_) in NcclCommunicator::barrier", __FILE__,
                       __LINE__);
    if (is_failure(idle.nccl)) {
      const Use use = claim(call);
      throw async_failure(call, idle.nccl);
    }
  }

  void check() override {
    const auto call = [] { return std::string("NcclCommunicator::check()"); };
    const Use use = claim(call);
    ncclResult_t async = ncclSuccess;
    SHARDSWAP_NCCL_ON_COMM(call, ncclCommGetAsyncError(comm_, &async));
    if (is_failure(async)) throw async_failure(call, async);
  }

 private:
  using Clock = std::chrono::steady_clock;

  /// Checks the result of an NCCL call on comm_ (SHARDSWAP_NCCL_ON_COMM): a failure is the
  /// watchdog's CommError when it aborted the communicator meanwhile (NCCL's abort ends calls
  /// that wait for peers), a DeviceError otherwise.
  template <class Call>
  void nccl_result(const Call& call, ncclResult_t status, const char* statement, int line) {
    if (status == ncclSuccess) return;
    throw_if_aborted(call);
    detail::nccl_fail(status, statement, __FILE__, line);
  }

  /// The right to call NCCL on comm_, given back when destroyed (see enter()). Empty inside a
  /// group, whose right group_start() holds.
  struct Use {
    NcclCommunicator* comm = nullptr;
    Use() = default;
    explicit Use(NcclCommunicator* c) : comm(c) {}
    Use(Use&& o) noexcept : comm(std::exchange(o.comm, nullptr)) {}
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    Use& operator=(Use&&) = delete;
    ~Use() {
      if (comm != nullptr) comm->leave();
    }
  };

  /// One collective (or group) the watchdog waits for: `done` is recorded on our stream after it.
  struct Watched {
    cudaEvent_t done = nullptr;
    Clock::time_point issued;
    std::string what;
  };

  bool watching() const { return timeout_.count() > 0; }

  template <class Call>
  void require_data(const Call& call, const void* p, std::size_t count, const char* what) const {
    if (p == nullptr && count > 0) throw ConfigError(fmt::format("{}: {} is null", call(), what));
  }

  template <class Call>
  void require_root(const Call& call, int root) const {
    if (root < 0 || root >= world_size_) {
      throw ConfigError(
          fmt::format("{}: root {} is out of range for world size {}", call(), root, world_size_));
    }
  }

  /// Needs the right to use comm_ (ncclGetLastError reads it).
  template <class Call>
  CommError async_failure(const Call& call, ncclResult_t status) {
    failed_ = true;
    return CommError(fmt::format(
        "{}: rank {} of {} on device {}: the NCCL communicator failed: {}; NCCL last said: {}",
        call(), rank_, world_size_, device_, ncclGetErrorString(status), ncclGetLastError(comm_)));
  }

  template <class Call>
  void throw_if_aborted(const Call& call) {
    std::lock_guard lock(watch_mutex_);
    if (aborted_) throw CommError(fmt::format("{}: {}", call(), failure_));
  }

  /// Takes the right to call NCCL on comm_: while the owner holds it the watchdog does not
  /// abort comm_ (it waits up to kAbortGrace for it, then aborts all the same: see
  /// fail_and_abort). Throws CommError once the watchdog has failed the communicator.
  template <class Call>
  void enter(const Call& call) {
    std::string what = watching() ? call() : std::string();
    std::lock_guard lock(watch_mutex_);
    if (aborted_) throw CommError(fmt::format("{}: {}", call(), failure_));
    in_nccl_ = true;
    entered_ = Clock::now();
    entered_what_ = std::move(what);
  }

  void leave() noexcept {
    std::lock_guard lock(watch_mutex_);
    in_nccl_ = false;
    if (abort_waits_) watch_cv_.notify_all();  // only then: not a wake-up per collective
  }

  template <class Call>
  [[nodiscard]] Use claim(const Call& call) {
    if (in_group_) {
      throw_if_aborted(call);
      return Use{};
    }
    enter(call);
    return Use{this};
  }

  /// Makes the rank's GPU current, takes the right to use comm_, checks NCCL's asynchronous
  /// error and orders our stream after the caller's queued work.
  template <class Call>
  [[nodiscard]] Use begin(const Call& call) {
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    Use use = claim(call);
    ncclResult_t async = ncclSuccess;
    SHARDSWAP_NCCL_ON_COMM(call, ncclCommGetAsyncError(comm_, &async));
    if (is_failure(async)) throw async_failure(call, async);
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(ready_, detail::work_stream()));
    SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    issued_ = Clock::now();
    return use;
  }

  /// After a collective was queued on our stream: the watchdog watches it, and the caller's
  /// later work is ordered after it. In a group both wait for group_end().
  template <class Call>
  void end(const Call& call) {
    if (in_group_) {
      if (grouped_++ == 0 && watching()) {
        group_first_ = call();
        group_issued_ = issued_;
      }
      return;
    }
    if (watching()) watch(call(), issued_);
    order_caller();
  }

  /// Orders the caller's later work after what was just queued on our stream, unless deferred
  /// (then join() does it).
  void order_caller() {
    if (deferred_) {
      unjoined_ = true;
      return;
    }
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(done_, stream_));
    SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(detail::work_stream(), done_, 0));
  }

  /// Hands what was just queued on our stream to the watchdog. Events are reused.
  void watch(std::string what, Clock::time_point issued) {
    cudaEvent_t done = nullptr;
    {
      std::lock_guard lock(watch_mutex_);
      if (!spare_events_.empty()) {
        done = spare_events_.back();
        spare_events_.pop_back();
      }
    }
    if (done == nullptr)
      SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    const cudaError_t recorded = cudaEventRecord(done, stream_);
    std::lock_guard lock(watch_mutex_);
    if (recorded != cudaSuccess) {
      spare_events_.push_back(done);
      detail::cuda_check(recorded, "cudaEventRecord(done, stream_)", __FILE__, __LINE__);
    }
    watched_.push_back(Watched{done, issued, std::move(what)});
  }

  /// The watchdog thread: retires the collectives that have completed and fails the
  /// communicator when the oldest one outlives the timeout or NCCL reports an error. Ends then,
  /// or when the communicator is released.
  void watch_loop() noexcept {
    if (cudaSetDevice(device_) != cudaSuccess) {
      spdlog::error(
          "NcclCommunicator: rank {} on device {}: the watchdog cannot select the GPU; "
          "the timeout is not enforced",
          rank_, device_);
      return;
    }
    // Often enough that a timeout is noticed within a tenth of it (or 100 ms).
    const auto poll = std::clamp<Clock::duration>(timeout_ / 10, std::chrono::milliseconds(1),
                                                  std::chrono::milliseconds(100));
    std::unique_lock lock(watch_mutex_);
    for (;;) {
      watch_cv_.wait_for(lock, poll, [&] { return stop_; });
      if (stop_) return;
      std::string expired;
      while (!watched_.empty()) {
        Watched& w = watched_.front();
        const cudaError_t status = cudaEventQuery(w.done);
        if (status == cudaSuccess) {
          spare_events_.push_back(w.done);
          watched_.pop_front();
          continue;
        }
        if (status != cudaErrorNotReady) {
          // Sticky: the owner's next CUDA call reports it; nothing left to watch.
          spdlog::error("NcclCommunicator: rank {} on device {}: the watchdog stops: {}", rank_,
                        device_, cudaGetErrorString(status));
          return;
        }
        const auto waited =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - w.issued);
        if (waited > timeout_) {
          expired = fmt::format(
              "rank {} of {} on device {}: {} did not complete within the communicator's "
              "timeout of {} ms (waited {} ms): a peer never joined it or is stuck; the NCCL "
              "communicator was aborted",
              rank_, world_size_, device_, w.what, timeout_.count(), waited.count());
        }
        break;
      }
      if (expired.empty() && in_nccl_) {
        // An NCCL call that does not return: NCCL connects peers on first use, on the host.
        const auto inside =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - entered_);
        if (inside > timeout_) {
          expired = fmt::format(
              "rank {} of {} on device {}: {} did not return within the communicator's timeout "
              "of {} ms (waited {} ms inside NCCL on the host, most likely for a peer to "
              "connect); the NCCL communicator was aborted",
              rank_, world_size_, device_, entered_what_, timeout_.count(), inside.count());
        }
      }
      if (expired.empty()) {
        // NCCL's asynchronous error: an atomic read, safe alongside the owner's NCCL calls.
        ncclResult_t async = ncclSuccess;
        const ncclResult_t got = ncclCommGetAsyncError(comm_, &async);
        const ncclResult_t error = is_failure(got) ? got : async;
        if (is_failure(error)) {
          expired = fmt::format(
              "rank {} of {} on device {}: NCCL reported an asynchronous error: {}; NCCL last "
              "said: {}; the NCCL communicator was aborted",
              rank_, world_size_, device_, ncclGetErrorString(error), ncclGetLastError(comm_));
        }
      }
      if (!expired.empty()) {
        fail_and_abort(lock, std::move(expired));
        return;
      }
    }
  }

  /// How long the watchdog waits for the owner to leave an NCCL call before aborting under it.
  static constexpr std::chrono::seconds kAbortGrace{1};

  /// Called by the watchdog with watch_mutex_ held. From here on the owner makes no new NCCL
  /// call on comm_ (enter() throws). An owner inside one is normally out within microseconds
  /// (queueing a kernel); one that is not is blocked on the host waiting for a peer (NCCL
  /// connects peers on first use), and only the abort can free it. Aborting under a running
  /// call is safe where NCCL frees the communicator later (several ranks in one process: it
  /// does so when the last of them is destroyed or aborted), and a small race with one rank per
  /// process: hence the warning.
  void fail_and_abort(std::unique_lock<std::mutex>& lock, std::string message) noexcept {
    failure_ = std::move(message);
    aborted_ = true;
    abort_waits_ = true;
    const bool left = watch_cv_.wait_for(lock, kAbortGrace, [&] { return !in_nccl_; });
    spdlog::error("NcclCommunicator: {}", failure_);
    if (!left) {
      spdlog::warn(
          "NcclCommunicator: rank {} on device {} is still inside an NCCL call after {} s "
          "(waiting for a peer); aborting the communicator under it",
          rank_, device_, kAbortGrace.count());
    }
    lock.unlock();
    SHARDSWAP_NCCL_WARN(ncclCommAbort(comm_));
  }

  /// Stops the watchdog and waits for it. Once it has returned, comm_ is either aborted
  /// (aborted_) or untouched, and nothing else watches it.
  void stop_watchdog() noexcept {
    if (!watchdog_.joinable()) return;
    {
      std::lock_guard lock(watch_mutex_);
      stop_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
  }

  struct Idle {
    cudaError_t cuda = cudaSuccess;   // a CUDA error seen while waiting (likely sticky)
    ncclResult_t nccl = ncclSuccess;  // an asynchronous NCCL error seen while waiting
    bool aborted = false;             // the watchdog aborted the communicator meanwhile
  };

  /// Blocks until our stream is idle, or until CUDA or NCCL reports an error, or the watchdog
  /// aborts the communicator: polling NCCL's asynchronous error is what keeps a dead peer from
  /// leaving us waiting forever where there is no watchdog.
  Idle wait_idle() noexcept {
    for (;;) {
      const cudaError_t status = cudaStreamQuery(stream_);
      if (status == cudaSuccess) return {};
      if (status != cudaErrorNotReady) return {status, ncclSuccess, false};
      ncclResult_t async = ncclSuccess;
      ncclResult_t got = ncclSuccess;
      {
        std::lock_guard lock(watch_mutex_);
        if (aborted_) return {cudaSuccess, ncclSuccess, true};
        // An atomic read in NCCL; the lock only keeps the watchdog's abort from freeing comm_
        // under it.
        got = ncclCommGetAsyncError(comm_, &async);
      }
      if (is_failure(got)) return {cudaSuccess, got, false};
      if (is_failure(async)) return {cudaSuccess, async, false};
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  /// Never throws, and leaves the calling thread's current GPU as it was. Waits for queued
  /// collectives (until the watchdog aborts them, where there is one), stops the watchdog, then
  /// destroys the NCCL communicator, or aborts it after an NCCL failure (not twice: not after
  /// the watchdog did). After a CUDA error (sticky: every later call fails the same way) the
  /// CUDA objects are left to the process's teardown.
  void release() noexcept {
    int previous = -1;  // the caller's current GPU, restored at the end
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    release_on_device();
    if (previous >= 0) SHARDSWAP_CUDA_WARN(cudaSetDevice(previous));
  }

  void release_on_device() noexcept {
    bool cuda_ok = cudaSetDevice(device_) == cudaSuccess;
    bool nccl_ok = !failed_;
    if (in_group_) {  // left open by an exception: its right to use comm_ goes with it
      in_group_ = false;
      leave();
    }
    if (comm_ != nullptr && stream_ != nullptr && cuda_ok && nccl_ok) {
      const Idle idle = wait_idle();
      if (idle.cuda != cudaSuccess) {
        SHARDSWAP_CUDA_WARN(idle.cuda);
        cuda_ok = false;
        nccl_ok = false;  // an NCCL kernel may still be stuck on the stream: abort, not wait
      }
      if (is_failure(idle.nccl)) {
        spdlog::warn(
            "NcclCommunicator: rank {} on device {}: the NCCL communicator failed ({}); "
            "aborting it",
            rank_, device_, ncclGetErrorString(idle.nccl));
        nccl_ok = false;
      }
    }
    stop_watchdog();
    if (comm_ != nullptr) {
      if (aborted_) {
        // The watchdog aborted it; NCCL frees it (with the process's last rank).
      } else if (nccl_ok) {
        SHARDSWAP_NCCL_WARN(ncclCommDestroy(comm_));
      } else {
        SHARDSWAP_NCCL_WARN(ncclCommAbort(comm_));
      }
      comm_ = nullptr;
    }
    if (!cuda_ok) {
      spdlog::warn(
          "NcclCommunicator: rank {} on device {}: skipping the release of its stream, "
          "events and barrier scratch after a CUDA error",
          rank_, device_);
      return;
    }
    // Events still recorded on the stream are released by CUDA once they complete.
    for (const Watched& w : watched_) SHARDSWAP_CUDA_WARN(cudaEventDestroy(w.done));
    for (cudaEvent_t e : spare_events_) SHARDSWAP_CUDA_WARN(cudaEventDestroy(e));
    watched_.clear();
    spare_events_.clear();
    if (barrier_scratch_ != nullptr) SHARDSWAP_CUDA_WARN(cudaFree(barrier_scratch_));
    if (done_ != nullptr) SHARDSWAP_CUDA_WARN(cudaEventDestroy(done_));
    if (ready_ != nullptr) SHARDSWAP_CUDA_WARN(cudaEventDestroy(ready_));
    if (stream_ != nullptr) SHARDSWAP_CUDA_WARN(cudaStreamDestroy(stream_));
    barrier_scratch_ = nullptr;
    done_ = ready_ = nullptr;
    stream_ = nullptr;
  }

  std::shared_ptr<void> keep_alive_;  // first member: destroyed after everything else
  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  CommTimeout timeout_{0};  // zero: no watchdog
  int rank_ = 0;
  int world_size_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;  // recorded on the caller's work stream
  cudaEvent_t done_ = nullptr;   // recorded on stream_
  float* barrier_scratch_ = nullptr;
  bool failed_ = false;       // NCCL reported an asynchronous error: abort instead of destroy
  bool deferred_ = false;     // set_deferred(true): end() leaves the caller's stream unordered
  bool in_group_ = false;     // between group_start() and group_end()
  int grouped_ = 0;           // collectives queued in the open group
  bool unjoined_ = false;     // collectives the caller's stream has not been ordered after yet
  Clock::time_point issued_;  // when the latest collective was issued (begin())
  std::string group_first_;   // with a watchdog: the open group's first collective
  Clock::time_point group_issued_;  // and when it was issued

  // Shared with the watchdog, under watch_mutex_.
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;  // stop_ set, or in_nccl_ cleared while abort_waits_
  std::deque<Watched> watched_;       // issued, not yet seen complete; oldest first
  std::vector<cudaEvent_t> spare_events_;
  bool in_nccl_ = false;       // the owner holds the right to call NCCL on comm_ (enter())
  Clock::time_point entered_;  // since when, with a watchdog
  std::string entered_what_;   // and for what
  bool aborted_ = false;       // the watchdog failed the communicator and aborts (or aborted) comm_
  bool abort_waits_ = false;   // the watchdog waits for in_nccl_ to clear before aborting
  std::string failure_;        // why, once aborted_
  bool stop_ = false;          // release() asks the watchdog to end
  std::thread watchdog_;       // only with a timeout; joined before comm_ is released
};

/// Restores the calling thread's current GPU on scope exit.
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() { SHARDSWAP_CUDA_CHECK(cudaGetDevice(&previous_)); }
  ~CurrentDeviceGuard() { SHARDSWAP_CUDA_WARN(cudaSetDevice(previous_)); }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace

/// Number of visible GPUs; 0 when CUDA finds none (or no driver).
int visible_cuda_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return 0;
  }
  return count;
}

void require_comm_timeout(const char* factory, CommTimeout timeout) {
  if (timeout.count() < 0)
    throw ConfigError(fmt::format("{}: the timeout must be >= 0 ms (0 waits forever), got {} ms",
                                  factory, timeout.count()));
}

std::unique_ptr<Communicator> adopt_nccl_comm(ncclComm_t comm, int device, CommTimeout timeout,
                                             std::shared_ptr<void> keep_alive) {
  return std::make_unique<NcclCommunicator>(comm, device, timeout, std::move(keep_alive));
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<int>& devices,
                                                                   CommTimeout timeout) {
  require_comm_timeout("make_nccl_communicators", timeout);
  if (devices.empty()) throw ConfigError("make_nccl_communicators: the device list is empty");
  const int count = visible_cuda_devices();
  std::set<int> seen;
  for (const int d : devices) {
    if (d < 0 || d >= count) {
      throw ConfigError(
          fmt::format("make_nccl_communicators: device {} does not exist ({} visible)", d, count));
    }
    if (!seen.insert(d).second) {
      throw ConfigError(
          fmt::format("make_nccl_communicators: device {} is listed twice (one rank per GPU)", d));
    }
  }

  CurrentDeviceGuard guard;
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  SHARDSWAP_NCCL_CHECK(ncclCommInitAll(comms.data(), n, devices.data()));
  std::vector<std::unique_ptr<Communicator>> ranks;
  try {
    ranks.reserve(devices.size());
    for (std::size_t i = 0; i < devices.size(); ++i) {
      // The communicator owns comms[i] from here, even if its constructor throws.
      ncclComm_t comm = std::exchange(comms[i], nullptr);
      ranks.push_back(std::make_unique<NcclCommunicator>(comm, devices[i], timeout, nullptr));
    }
  } catch (...) {
    for (ncclComm_t comm : comms) {
      if (comm != nullptr) SHARDSWAP_NCCL_WARN(ncclCommDestroy(comm));
    }
    throw;
  }
  return ranks;
}

}  // namespace shardswap
