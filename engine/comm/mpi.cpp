// MPI communicator on host memory: one rank per process (shardswap/mpi.h).
//
// Policy: MPI moves bytes, ShardSwap does the arithmetic. A reduction never uses MPI_Reduce or
// MPI_Allreduce (whose order of summation is the implementation's): each rank gathers its own
// chunk from every rank, in rank order, and reduces it with the in-process backend's element loop
// (host_collective_ops().reduce), so the bits equal the in-process ranks' for the same inputs.
// Every collective opens with an exchange of what each rank called, so a mismatch is an error on
// every rank instead of a hang or corrupt data. Operations are non-blocking and polled, so that a
// timeout can end a wait that MPI itself would never end.
#define OMPI_SKIP_MPICXX 1  // the C API is all we use
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/comm/collective_call.h"
#include "engine/comm/collective_ops.h"
#include "engine/comm/mpi_session.h"
#include "shardswap/error.h"
#include "shardswap/mpi.h"

namespace shardswap {

namespace {

using Kind = CollectiveKind;
using Call = CollectiveCall;

// A call as MPI sends it: five words, the same on every rank of a job of one binary.
using CallWire = std::array<std::int64_t, 5>;
CallWire wire_of(const Call& c) {
  return {static_cast<std::int64_t>(c.kind), static_cast<std::int64_t>(c.count),
          static_cast<std::int64_t>(c.dtype), static_cast<std::int64_t>(c.op), c.root};
}
Call call_from_wire(const CallWire& w) {
  return {static_cast<Kind>(w[0]), static_cast<std::size_t>(w[1]), static_cast<DType>(w[2]),
          static_cast<ReduceOp>(w[3]), static_cast<int>(w[4])};
}

std::string mpi_error_text(int status) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS)
    return fmt::format("error {}", status);
  return std::string(text, static_cast<std::size_t>(length));
}

void mpi_check(int status, const char* where, const char* statement) {
  if (status == MPI_SUCCESS) return;
  throw CommError(fmt::format("{}: {} failed: {}", where, statement, mpi_error_text(status)));
}

/// The element type MPI moves: bit16 values travel as 16-bit words (MPI has no bf16), which is
/// all a byte-exact transport needs.
MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::bf16:
    case DType::f16:
      return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::shared_ptr<MpiSession> session, CommTimeout timeout)
      : session_(std::move(session)), timeout_(timeout) {
    constexpr const char* where = "make_mpi_communicator";
    mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), where, "MPI_Comm_dup");
    // Errors come back as codes (turned into CommError) instead of ending the job unexplained.
    mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), where, "MPI_Comm_set_errhandler");
    mpi_check(MPI_Comm_rank(comm_, &rank_), where, "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(comm_, &size_), where, "MPI_Comm_size");
    buffers_->calls.resize(static_cast<std::size_t>(size_));
  }

  ~MpiCommunicator() override {
    // Never throws. After a timeout an operation may still be in flight: freeing the
    // communicator (or finalizing) under it could block, so both are left to the process's end.
    if (pending_ != MPI_REQUEST_NULL) {
      int done = 0;
      if (MPI_Test(&pending_, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) {
        session_->leak();
        // MPI may still write into them whenever the other ranks arrive: kept, on purpose.
        static_cast<void>(buffers_.release());
        return;
      }
    }
    MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  DeviceKind device() const override { return DeviceKind::host; }

  void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op) override {
    const Call c{Kind::all_reduce, count, dtype, op, 0};
    require_data(c, data, "data");
    require_int(c, count);
    open(c);
    if (count == 0) return;
    // Rank r reduces chunk r (the in-process backend's balanced split) of every rank's data,
    // then every rank gathers all reduced chunks back into its data.
    const std::size_t esize = dtype_size(dtype);
    std::vector<int> counts(static_cast<std::size_t>(size_)), begins(counts.size());
    for (int q = 0; q < size_; ++q) {
      const std::size_t b = chunk_begin(count, q);
      begins[static_cast<std::size_t>(q)] = static_cast<int>(b);
      counts[static_cast<std::size_t>(q)] = static_cast<int>(chunk_begin(count, q + 1) - b);
    }
    const int mine = counts[static_cast<std::size_t>(rank_)];
    std::vector<int> from_counts(counts.size(), mine), from_begins(counts.size());
    for (int q = 0; q < size_; ++q) from_begins[static_cast<std::size_t>(q)] = q * mine;
    std::byte* gathered = scratch(static_cast<std::size_t>(mine) * size_ * esize);
    const MPI_Datatype type = mpi_type(dtype);
    MPI_Request request = MPI_REQUEST_NULL;
    issue(c, "MPI_Ialltoallv",
          MPI_Ialltoallv(data, counts.data(), begins.data(), type, gathered, from_counts.data(),
                         from_begins.data(), type, comm_, &request),
          request);
    // The exchange is complete: this rank's chunk of `data` has been sent and may be overwritten.
    std::byte* own =
        static_cast<std::byte*>(data) + static_cast<std::size_t>(begins[rank_]) * esize;
    reduce_gathered(dtype, gathered, static_cast<std::size_t>(mine), own, op);
    issue(c, "MPI_Iallgatherv",
          MPI_Iallgatherv(MPI_IN_PLACE, 0, type, data, counts.data(), begins.data(), type, comm_,
                          &request),
          request);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op) override {
    const Call c{Kind::reduce_scatter, recv_count, dtype, op, 0};
    require_data(c, send, "send");
    require_data(c, recv, "recv");
    require_int(c, recv_count * static_cast<std::size_t>(size_));
    open(c);
    if (recv_count == 0) return;
    // Into scratch, never into recv: in place, recv is this rank's chunk of send, which the
    // exchange is still reading.
    std::byte* gathered = scratch(recv_count * size_ * dtype_size(dtype));
    const MPI_Datatype type = mpi_type(dtype);
    const int n = static_cast<int>(recv_count);
    MPI_Request request = MPI_REQUEST_NULL;
    issue(c, "MPI_Ialltoall", MPI_Ialltoall(send, n, type, gathered, n, type, comm_, &request),
          request);
    reduce_gathered(dtype, gathered, recv_count, recv, op);
  }

  void reduce(void* data, std::size_t count, DType dtype, ReduceOp op, int root) override {
    const Call c{Kind::reduce, count, dtype, op, root};
    require_root(c);
    require_data(c, data, "data");
    require_int(c, count * static_cast<std::size_t>(size_));
    open(c);
    if (count == 0) return;
    std::byte* gathered = rank_ == root ? scratch(count * size_ * dtype_size(dtype)) : nullptr;
    const MPI_Datatype type = mpi_type(dtype);
    const int n = static_cast<int>(count);
    MPI_Request request = MPI_REQUEST_NULL;
    issue(c, "MPI_Igather", MPI_Igather(data, n, type, gathered, n, type, root, comm_, &request),
          request);
    if (rank_ == root) reduce_gathered(dtype, gathered, count, data, op);
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) override {
    const Call c{Kind::all_gather, send_count, dtype, ReduceOp::sum, 0};
    require_data(c, send, "send");
    require_data(c, recv, "recv");
    require_int(c, send_count * static_cast<std::size_t>(size_));
    open(c);
    if (send_count == 0) return;
    const MPI_Datatype type = mpi_type(dtype);
    const int n = static_cast<int>(send_count);
    // In place (send is this rank's chunk of recv): MPI's own in-place form, which reads it there.
    const bool in_place =
        send == static_cast<const std::byte*>(recv) +
                    static_cast<std::size_t>(rank_) * send_count * dtype_size(dtype);
    MPI_Request request = MPI_REQUEST_NULL;
    issue(c, "MPI_Iallgather",
          MPI_Iallgather(in_place ? MPI_IN_PLACE : send, in_place ? 0 : n, type, recv, n, type,
                         comm_, &request),
          request);
  }

  void broadcast(void* data, std::size_t count, DType dtype, int root) override {
    const Call c{Kind::broadcast, count, dtype, ReduceOp::sum, root};
    require_root(c);
    require_data(c, data, "data");
    require_int(c, count);
    open(c);
    if (count == 0) return;
    MPI_Request request = MPI_REQUEST_NULL;
    issue(c, "MPI_Ibcast",
          MPI_Ibcast(data, static_cast<int>(count), mpi_type(dtype), root, comm_, &request),
          request);
  }

  void barrier() override {
    // The opening exchange is itself a rendezvous of every rank.
    open(Call{});
  }

  void check() override {
    if (failed_) throw CommError(*failed_);
  }

 private:
  /// Throws if the communicator has failed; then exchanges every rank's call and throws
  /// CommError on every rank if they differ (all see the same calls, so all agree).
  void open(const Call& c) {
    check();
    CallWire& mine = buffers_->mine;
    std::vector<CallWire>& all = buffers_->calls;
    mine = wire_of(c);
    MPI_Request request = MPI_REQUEST_NULL;
    issue(c, "MPI_Iallgather",
          MPI_Iallgather(mine.data(), static_cast<int>(mine.size()), MPI_INT64_T, all.data(),
                         static_cast<int>(mine.size()), MPI_INT64_T, comm_, &request),
          request);
    for (int q = 0; q < size_; ++q) {
      if (all[static_cast<std::size_t>(q)] != all[0]) {
        throw CommError(fmt::format("MpiCommunicator: rank {} called {} while rank 0 called {}", q,
                                    call_from_wire(all[static_cast<std::size_t>(q)]).describe(),
                                    call_from_wire(all[0]).describe()));
      }
    }
  }

  /// Checks the status of a non-blocking call, then polls its request until it completes or the
  /// timeout runs out. Busy for a moment (most collectives of a step are short), then sleeping
  /// between polls, so that waiting ranks leave the cores to the ranks still computing (several
  /// ranks often share a machine's few cores).
  void issue(const Call& c, const char* statement, int status, MPI_Request& request) {
    if (status != MPI_SUCCESS)
      fail(c, fmt::format("{} failed: {}", statement, mpi_error_text(status)));
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0;; ++polls) {
      int done = 0;
      status = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (status != MPI_SUCCESS)
        fail(c, fmt::format("{}: MPI_Test failed: {}", statement, mpi_error_text(status)));
      if (done) return;
      if (timeout_.count() > 0 && std::chrono::steady_clock::now() - start > timeout_) {
        pending_ = request;  // still in flight: the destructor must not free what it uses
        fail(c, fmt::format("timed out after {} ms waiting for the other ranks "
                            "(shardswap.comm_timeout_s); a rank that stopped, hangs or called "
                            "other collectives never joined",
                            timeout_.count()));
      }
      if (polls < 2000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  [[noreturn]] void fail(const Call& c, const std::string& why) {
    failed_ =
        fmt::format("MpiCommunicator: rank {} of {}: {}: {}", rank_, size_, c.describe(), why);
    throw CommError(*failed_);
  }

  /// dst = op over ranks q = 0..N-1 of chunk q of `gathered` (`count` elements each), in rank
  /// order and rounded once, by the in-process backend's loop: the same bits as its ranks get.
  void reduce_gathered(DType dtype, const std::byte* gathered, std::size_t count, void* dst,
                       ReduceOp op) {
    std::vector<const void*> src(static_cast<std::size_t>(size_));
    for (int q = 0; q < size_; ++q)
      src[static_cast<std::size_t>(q)] =
          gathered + static_cast<std::size_t>(q) * count * dtype_size(dtype);
    host_collective_ops().reduce(dtype, src.data(), size_, dst, count, op);
  }

  std::byte* scratch(std::size_t bytes) {
    std::vector<std::byte>& scratch = buffers_->scratch;
    if (scratch.size() < bytes) scratch.resize(bytes);
    return scratch.data();
  }

  /// Balanced split of [0, count) into world_size chunks, as the in-process backend splits.
  std::size_t chunk_begin(std::size_t count, int q) const {
    return count * static_cast<std::size_t>(q) / static_cast<std::size_t>(size_);
  }

  void require_data(const Call& c, const void* p, const char* what) const {
    if (p == nullptr && c.count > 0)
      throw ConfigError(fmt::format("MpiCommunicator: {}: {} is null", c.describe(), what));
  }
  void require_root(const Call& c) const {
    if (c.root < 0 || c.root >= size_)
      throw ConfigError(
          fmt::format("MpiCommunicator: {}: root {} is out of range for world size {}",
                      c.describe(), c.root, size_));
  }
  void require_int(const Call& c, std::size_t elements) const {
    if (elements > static_cast<std::size_t>(INT_MAX))
      throw ConfigError(
          fmt::format("MpiCommunicator: {}: {} elements in one buffer exceed MPI's int count ({})",
                      c.describe(), elements, INT_MAX));
  }

  std::shared_ptr<MpiSession> session_;
  CommTimeout timeout_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  // Every buffer of ours an operation reads or writes: the opening exchange's calls and the
  // reductions' gathered chunks. A timeout leaves an operation in flight that MPI completes into
  // them when the other ranks arrive (a later collective of any communicator progresses it), so
  // they live as long as this communicator, and past it while that operation never completed.
  // After a failure no call reaches them again (each checks failed_ first), so none is resized
  // under MPI.
  struct Buffers {
    CallWire mine{};
    std::vector<CallWire> calls;
    std::vector<std::byte> scratch;
  };
  std::unique_ptr<Buffers> buffers_ = std::make_unique<Buffers>();
  std::optional<std::string> failed_;       // set once; every later call throws it
  MPI_Request pending_ = MPI_REQUEST_NULL;  // an operation a timeout left in flight
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(CommTimeout timeout) {
  if (timeout.count() < 0)
    throw ConfigError(
        fmt::format("make_mpi_communicator: timeout {} ms is negative", timeout.count()));
  return std::make_unique<MpiCommunicator>(MpiSession::acquire("make_mpi_communicator"),
                                           timeout);
}

void abort_mpi_job(int exit_code) noexcept {
  int initialized = 0, finalized = 0;
  if (MPI_Initialized(&initialized) == MPI_SUCCESS && initialized &&
      MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized)
    MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

}  // namespace shardswap
