// In-process communicator: N ranks as threads of one process, exchanging data through host memory.
//
// Policy: every collective is a rendezvous of all ranks. Each rank posts a `Call` (what it asked
// for and its buffer pointers); the last rank to arrive compares the calls, so every rank sees
// the same verdict and a mismatch fails all of them. Then each rank does its own share of the
// work by reading the others' buffers directly (no copies through a shared staging area), and a
// closing rendezvous keeps everyone's inputs alive and unmodified until all reads are done.
// Reductions run in rank order 0..N-1 and round once, so results are reproducible bit for bit.
// The barrier is hand-written (mutex + condition variable) because it must be abortable: when a
// rank fails, abort() wakes every waiting rank with a CommError instead of leaving it blocked.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "engine/backend_ops.h"
#include "engine/comm/collective_call.h"
#include "engine/comm/collective_ops.h"
#include "shardswap/communicator.h"
#include "shardswap/error.h"
#include "memory/host_types.h"

namespace shardswap {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
  }
  return "?";
}

namespace {

using Kind = CollectiveKind;

/// One rank's side of a collective, as posted at the opening rendezvous.
/// (CollectiveCall: the part that must agree across ranks.)
struct Call : CollectiveCall {
  const void* send = nullptr;
  void* recv = nullptr;
  void* scratch = nullptr;  // all_reduce: this rank's reduced chunk, read by all in phase 2
};

const std::byte* bytes(const void* p) {
  return static_cast<const std::byte*>(p);
}
std::byte* bytes(void* p) {
  return static_cast<std::byte*>(p);
}

/// dst[i] = op over ranks q = 0..N-1 of src[q][i], accumulated in Acc in rank order and rounded
/// once to T. Each block is read completely before it is written, so dst may equal one src.
template <class T, class Acc>
void reduce_typed(const std::vector<const void*>& src, void* dst, std::size_t count, ReduceOp op) {
  constexpr std::size_t kBlock = 256;  // small stack accumulator; keeps the inner loops simple
  Acc acc[kBlock];
  for (std::size_t base = 0; base < count; base += kBlock) {
    const std::size_t n = std::min(kBlock, count - base);
    const T* first = static_cast<const T*>(src[0]) + base;
    for (std::size_t i = 0; i < n; ++i) acc[i] = static_cast<Acc>(first[i]);
    for (std::size_t q = 1; q < src.size(); ++q) {
      const T* s = static_cast<const T*>(src[q]) + base;
      if (op == ReduceOp::max) {
        for (std::size_t i = 0; i < n; ++i) {
          const Acc v = static_cast<Acc>(s[i]);
          if (std::isnan(v) || v > acc[i]) acc[i] = v;  // a NaN already in acc stays
        }
      } else {
        for (std::size_t i = 0; i < n; ++i) acc[i] += static_cast<Acc>(s[i]);
      }
    }
    if (op == ReduceOp::avg) {
      const Acc ranks = static_cast<Acc>(src.size());
      for (std::size_t i = 0; i < n; ++i) acc[i] /= ranks;
    }
    T* d = static_cast<T*>(dst) + base;
    for (std::size_t i = 0; i < n; ++i) d[i] = T(acc[i]);  // bit16: round to nearest even
  }
}

void reduce_into(DType dtype, const std::vector<const void*>& src, void* dst, std::size_t count,
                 ReduceOp op) {
  switch (dtype) {
    case DType::f32:
      return reduce_typed<float, float>(src, dst, count, op);
    case DType::f64:
      return reduce_typed<double, double>(src, dst, count, op);
    case DType::bf16:
      return reduce_typed<bf16_t, float>(src, dst, count, op);
    case DType::f16:
      return reduce_typed<f16_t, float>(src, dst, count, op);
  }
}

void host_reduce(DType dtype, const void* const* src, int nsrc, void* dst, std::size_t count,
                 ReduceOp op) {
  reduce_into(dtype, std::vector<const void*>(src, src + nsrc), dst, count, op);
}

void host_copy(void* dst, const void* src, std::size_t n) {
  std::memcpy(dst, src, n);
}

void* host_scratch(std::size_t bytes) {
  thread_local std::vector<std::byte> scratch;
  if (scratch.size() < bytes) scratch.resize(bytes);
  return scratch.data();
}

void check_data(const Call& c, const void* p, const char* what) {
  if (p == nullptr && c.count > 0) {
    throw ConfigError(fmt::format("{}: {} is null", c.describe(), what));
  }
}

/// What the ranks of one group share.
struct Shared {
  Shared(int n, const CollectiveOps& o)
      : world_size(n), ops(o), calls(static_cast<std::size_t>(n)) {}

  /// Blocks until every rank has arrived. With `post`, the rank's call is published first and the
  /// last rank to arrive compares all calls; a mismatch then throws CommError on every rank.
  /// Throws CommError if the group is (or becomes) aborted before the rendezvous completes.
  void rendezvous(int rank, const Call& call, bool post);
  /// Fails every rendezvous in progress or to come with CommError(reason); the first reason
  /// stays.
  void abort(const std::string& reason);
  /// For a rank whose own share of a collective failed after the opening rendezvous: the others
  /// may still be reading its inputs, so it must not return (and free them) before every rank
  /// has left the collective (each leaves at its next rendezvous, which the abort fails).
  void leave_after_failure(int rank);
  /// Rank `rank` will call no collective again (its thread is done): it counts as departed, and
  /// every collective another rank is in or calls later fails with PeerFailure naming it, since
  /// none can complete without it. A rank that left after the last collective harms nobody: the
  /// others have passed that one's closing rendezvous already.
  void leave(int rank, const std::string& why);

  const int world_size;
  const CollectiveOps& ops;
  std::mutex mutex;
  std::condition_variable arrived_cv;
  int arrived = 0;
  std::vector<char> present = std::vector<char>(static_cast<std::size_t>(world_size), 0);
  std::chrono::milliseconds timeout{0};  // zero: wait forever
  std::uint64_t generation = 0;  // completed rendezvous; lets waiters tell "done" from "spurious"
  std::optional<std::string> abort_reason;
  // Ranks that have left their collective since the abort (each counted once, however many
  // collectives it tries afterwards).
  std::vector<char> departed = std::vector<char>(static_cast<std::size_t>(world_size), 0);
  int departures() const {
    return static_cast<int>(std::count(departed.begin(), departed.end(), 1));
  }
  std::string mismatch;  // verdict of the latest posting rendezvous; empty if the calls agree
  // calls[r] is written by rank r under the mutex before an opening rendezvous, and read by
  // every rank until the closing one; nobody writes it in between.
  std::vector<Call> calls;
};

void Shared::rendezvous(int rank, const Call& call, bool post) {
  std::unique_lock lock(mutex);
  // Leaving because of an abort. At a closing rendezvous (!post) every rank is inside this
  // collective and may still be reading this rank's inputs: wait until all have left before
  // unwinding (and freeing them). At an opening one nobody reads them yet.
  auto aborted = [&] {
    departed[static_cast<std::size_t>(rank)] = 1;
    arrived_cv.notify_all();
    if (!post) arrived_cv.wait(lock, [&] { return departures() == world_size; });
    // Not this rank's fault: the reason names the rank (or the timeout) that was.
    return PeerFailure(
        fmt::format("{}: rank {} aborted: {}", call.describe(), rank, *abort_reason));
  };
  if (abort_reason) throw aborted();
  if (post) calls[static_cast<std::size_t>(rank)] = call;
  const std::uint64_t gen = generation;
  present[static_cast<std::size_t>(rank)] = 1;
  if (++arrived == world_size) {
    arrived = 0;
    std::fill(present.begin(), present.end(), 0);
    ++generation;
    mismatch.clear();
    if (post) {
      for (int q = 1; q < world_size; ++q) {
        const Call& a = calls[0];
        const Call& b = calls[static_cast<std::size_t>(q)];
        if (!b.same_as(a)) {
          mismatch = fmt::format("InProcessGroup: rank {} called {} while rank 0 called {}", q,
                                 b.describe(), a.describe());
          break;
        }
      }
    }
    arrived_cv.notify_all();
  } else {
    const auto done = [&] { return generation != gen || abort_reason.has_value(); };
    if (timeout.count() > 0) {
      if (!arrived_cv.wait_for(lock, timeout, done)) {
        // Nobody else will: name the absent ranks once, for every rank, and release the others.
        std::string missing;
        for (int q = 0; q < world_size; ++q)
          if (!present[static_cast<std::size_t>(q)])
            missing += fmt::format("{}{}", missing.empty() ? "" : ", ", q);
        const std::string why =
            fmt::format("{}: timed out after {} ms waiting for rank(s) {} (rank {} waited)",
                        call.describe(), timeout.count(), missing, rank);
        if (!abort_reason) abort_reason = why;
        departed[static_cast<std::size_t>(rank)] = 1;
        arrived_cv.notify_all();
        throw CommError(why);
      }
    } else {
      arrived_cv.wait(lock, done);
    }
    // A rendezvous that completed before the abort counts as done; the abort shows at the next.
    if (generation == gen) throw aborted();
  }
  // Read under the lock: the next rendezvous cannot complete (and overwrite it) without us.
  if (!mismatch.empty()) throw CommError(mismatch);
}

void Shared::abort(const std::string& reason) {
  std::lock_guard lock(mutex);
  if (!abort_reason) abort_reason = reason;  // the first cause is the useful one
  arrived_cv.notify_all();
}

void Shared::leave(int rank, const std::string& why) {
  std::lock_guard lock(mutex);
  departed[static_cast<std::size_t>(rank)] = 1;
  if (!abort_reason) abort_reason = fmt::format("rank {} {}", rank, why);
  arrived_cv.notify_all();
}

void Shared::leave_after_failure(int rank) {
  std::unique_lock lock(mutex);
  departed[static_cast<std::size_t>(rank)] = 1;
  arrived_cv.notify_all();
  arrived_cv.wait(lock, [&] { return departures() == world_size; });
}

class RankComm final : public Communicator {
 public:
  RankComm(Shared& s, int rank) : s_(s), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return s_.world_size; }
  DeviceKind device() const override { return s_.ops.device; }

  void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op) override {
    // Phase 1: rank r reduces chunk r of every rank's data into a scratch of about count/N.
    // Phase 2 (after everyone has read all inputs): each rank copies every chunk into its data.
    const std::size_t esize = dtype_size(dtype);
    const std::size_t begin = chunk_begin(count, rank_), end = chunk_begin(count, rank_ + 1);
    void* scratch = s_.ops.scratch((end - begin) * esize);
    Call c{{Kind::all_reduce, count, dtype, op, 0}, data, data, scratch};
    check_data(c, data, "data");
    open(c);
    reduce_chunk(dtype, begin * esize, scratch, end - begin, op);
    step(c);
    for (int q = 0; q < s_.world_size; ++q) {
      const std::size_t b = chunk_begin(count, q), e = chunk_begin(count, q + 1);
      copy_bytes(bytes(data) + b * esize, call(q).scratch, (e - b) * esize);
    }
    step(c);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op) override {
    // Rank r reads only chunk r of each send buffer, so writing recv == chunk r of its own send
    // buffer (in place) never touches what another rank reads.
    Call c{{Kind::reduce_scatter, recv_count, dtype, op, 0}, send, recv, nullptr};
    check_data(c, send, "send");
    check_data(c, recv, "recv");
    open(c);
    const std::size_t offset = static_cast<std::size_t>(rank_) * recv_count * dtype_size(dtype);
    reduce_chunk(dtype, offset, recv, recv_count, op);
    step(c);
  }

  void reduce(void* data, std::size_t count, DType dtype, ReduceOp op, int root) override {
    Call c{{Kind::reduce, count, dtype, op, root}, data, data, nullptr};
    check_root(c);
    check_data(c, data, "data");
    open(c);
    if (rank_ == root) reduce_chunk(dtype, 0, data, count, op);
    step(c);
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) override {
    // Rank r writes only its own recv; others read only their send chunks, which in place are
    // chunk q of rank q's recv, skipped by copy_bytes when r == q.
    Call c{{Kind::all_gather, send_count, dtype, ReduceOp::sum, 0}, send, recv, nullptr};
    check_data(c, send, "send");
    check_data(c, recv, "recv");
    open(c);
    const std::size_t chunk = send_count * dtype_size(dtype);
    for (int q = 0; q < s_.world_size; ++q) {
      copy_bytes(bytes(recv) + static_cast<std::size_t>(q) * chunk, call(q).send, chunk);
    }
    step(c);
  }

  void broadcast(void* data, std::size_t count, DType dtype, int root) override {
    Call c{{Kind::broadcast, count, dtype, ReduceOp::sum, root}, data, data, nullptr};
    check_root(c);
    check_data(c, data, "data");
    open(c);
    if (rank_ != root) copy_bytes(data, call(root).send, count * dtype_size(dtype));
    step(c);
  }

  void barrier() override { open(Call{}); }

 private:
  // This rank's queued device work must be complete before others read its buffers.
  void open(const Call& c) {
    current_ = c;
    guarded([&] { s_.ops.sync(); }, /*peers_reading=*/false);
    s_.rendezvous(rank_, c, /*post=*/true);
  }

  /// Runs this rank's own share of the current collective. If it throws, the others would wait
  /// for us forever at the next rendezvous: abort the group first, naming the collective and
  /// the cause, then let the original error go on up this rank.
  /// `peers_reading`: the opening rendezvous is done, so the other ranks may be reading this
  /// rank's inputs; it then waits for them to leave before its error unwinds (and frees) them.
  template <class F>
  void guarded(F&& work, bool peers_reading = true) {
    try {
      work();
    } catch (const std::exception& e) {
      s_.abort(fmt::format("rank {} failed in {}: {}", rank_, current_.describe(), e.what()));
      if (peers_reading) s_.leave_after_failure(rank_);
      throw;
    }
  }

  void reduce_chunk(DType dtype, std::size_t offset, void* dst, std::size_t count, ReduceOp op) {
    if (count == 0) return;
    const auto src = sources(offset);
    guarded(
        [&] { s_.ops.reduce(dtype, src.data(), static_cast<int>(src.size()), dst, count, op); });
  }

  /// Copies unless source and destination are the same memory (an in-place chunk): writing it
  /// anyway would race with other ranks reading it.
  void copy_bytes(void* dst, const void* src, std::size_t n) {
    if (dst != src && n > 0) guarded([&] { s_.ops.copy(dst, src, n); });
  }
  void step(const Call& c) { s_.rendezvous(rank_, c, /*post=*/false); }
  const Call& call(int q) const { return s_.calls[static_cast<std::size_t>(q)]; }

  /// Every rank's send buffer advanced by `offset` bytes, in rank order.
  std::vector<const void*> sources(std::size_t offset) const {
    std::vector<const void*> src;
    src.reserve(s_.calls.size());
    for (const Call& c : s_.calls) src.push_back(bytes(c.send) + offset);
    return src;
  }

  /// Balanced split of [0, count) into world_size chunks; some are empty when count < N.
  std::size_t chunk_begin(std::size_t count, int q) const {
    return count * static_cast<std::size_t>(q) / static_cast<std::size_t>(s_.world_size);
  }

  void check_root(const Call& c) const {
    if (c.root < 0 || c.root >= s_.world_size) {
      throw ConfigError(fmt::format("{}: root {} is out of range for world size {}", c.describe(),
                                    c.root, s_.world_size));
    }
  }

  Shared& s_;
  const int rank_;
  Call current_;  // the collective in progress on this rank, for error messages
};

}  // namespace

const CollectiveOps& host_collective_ops() {
  static const CollectiveOps ops{"host", DeviceKind::host, host_reduce, host_copy, [] {}, host_scratch};
  return ops;
}

struct InProcessGroup::State {
  State(int n, const CollectiveOps& ops) : shared(n, ops) {
    for (int r = 0; r < n; ++r) ranks.push_back(std::make_unique<RankComm>(shared, r));
  }
  Shared shared;
  std::vector<std::unique_ptr<RankComm>> ranks;
};

InProcessGroup::InProcessGroup(int world_size, const CollectiveOps& ops) {
  if (world_size < 1) {
    throw ConfigError(
        fmt::format("InProcessGroup: world_size must be at least 1, got {}", world_size));
  }
  state_ = std::make_unique<State>(world_size, ops);
}

InProcessGroup::InProcessGroup(int world_size, const Backend& backend)
    : InProcessGroup(world_size, collective_ops(backend)) {}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::world_size() const {
  return state_->shared.world_size;
}

Communicator& InProcessGroup::rank(int r) {
  if (r < 0 || r >= world_size()) {
    throw ConfigError(fmt::format("InProcessGroup::rank: rank {} is out of range for world size {}",
                                  r, world_size()));
  }
  return *state_->ranks[static_cast<std::size_t>(r)];
}

void InProcessGroup::abort(const std::string& reason) {
  state_->shared.abort(reason);
}

void InProcessGroup::leave(int rank) {
  (void)this->rank(rank);  // range check
  state_->shared.leave(rank, "left the group: its thread is done with collectives");
}

void InProcessGroup::set_timeout(std::chrono::milliseconds timeout) {
  Shared& s = state_->shared;
  std::lock_guard lock(s.mutex);
  s.timeout = timeout.count() > 0 ? timeout : std::chrono::milliseconds{0};
}

void run_ranks(int world_size, const std::function<void(int rank, Communicator& comm)>& fn,
               const CollectiveOps& ops, std::chrono::milliseconds timeout) {
  InProcessGroup group(world_size, ops);
  group.set_timeout(timeout);
  std::mutex mutex;
  // Every rank's failure, in the order they arrived: the first to arrive is often not the cause
  // (a rank that fails in its own work is the last to leave the collective it aborted, and the
  // ranks that learn of a failure from agree-style checks may unwind faster than the failing
  // one), so the root cause is picked once all have joined.
  std::vector<std::exception_ptr> errors;
  auto run = [&](int r) {
    try {
      fn(r, group.rank(r));
      // A rank that is done while another still waits in (or later calls) a collective would
      // leave that one waiting forever, whatever the timeout: it fails instead, naming this rank.
      group.leave(r);
    } catch (...) {
      std::string what = "unknown exception";
      try {
        throw;
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      {
        std::lock_guard lock(mutex);
        errors.push_back(std::current_exception());
        if (errors.size() > 1) {  // the group is aborted already
          group.leave(r);
          return;
        }
      }
      group.abort(fmt::format("run_ranks: rank {} failed: {}", r, what));
      group.leave(r);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world_size));
  try {
    for (int r = 0; r < world_size; ++r) threads.emplace_back(run, r);
  } catch (const std::exception& e) {
    // Could not start every rank: release the started ones before reporting.
    group.abort(fmt::format("run_ranks: could not start {} threads: {}", world_size, e.what()));
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
  if (const auto cause = root_cause(errors)) std::rethrow_exception(cause);
}

void run_ranks(int world_size, const std::function<void(int rank, Communicator& comm)>& fn,
               const Backend& backend, std::chrono::milliseconds timeout) {
  run_ranks(world_size, fn, collective_ops(backend), timeout);
}

}  // namespace shardswap
