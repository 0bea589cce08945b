// Collectives between the ranks of one data-parallel group. Backends: in-process threads (here),
// NCCL (CUDA issue). Every rank must call the same collectives in the same order with the same
// counts; the in-process backend checks this and fails every rank with a CommError otherwise.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "shardswap/allocator.h"
#include "shardswap/backend.h"
#include "shardswap/dtype.h"

namespace shardswap {

enum class ReduceOp { sum, avg, max };

const char* reduce_op_name(ReduceOp op);

/// One rank's endpoint. Reductions of bit16 data accumulate in fp32 and round once; fp32 in fp32;
/// fp64 in fp64. Ranks are summed in rank order 0..N-1, so results are reproducible bit for bit.
/// `avg` divides the sum by the world size before rounding. Arguments that can never work (a root
/// outside [0, world_size), a null buffer with a non-zero count) throw ConfigError on the calling
/// rank before it waits for the others.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// The memory its collectives read and write: host memory, or CUDA device memory. The Engine
  /// checks that it matches its Backend.
  virtual DeviceKind device() const = 0;

  /// In place on `count` elements.
  virtual void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op) = 0;
  /// `send` holds world_size * recv_count elements; rank r receives the reduction of chunk r.
  /// In place is allowed: recv == send + rank * recv_count (in elements).
  virtual void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                              ReduceOp op) = 0;
  /// In place on `count` elements; the result is defined on `root` only (other ranks' data is
  /// left unchanged).
  virtual void reduce(void* data, std::size_t count, DType dtype, ReduceOp op, int root) = 0;
  /// `recv` receives world_size * send_count elements, rank r's `send` at chunk r.
  /// In place is allowed: send == recv + rank * send_count (in elements).
  virtual void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) = 0;
  /// In place: every rank's `data` receives root's.
  virtual void broadcast(void* data, std::size_t count, DType dtype, int root) = 0;
  virtual void barrier() = 0;

  /// Throws CommError if this rank's communicator has failed (a timeout, a peer's error that
  /// the backend detected); does nothing otherwise, and never waits for the other ranks. Where
  /// collectives complete asynchronously (NCCL) a failure can be found after a collective was
  /// issued and its wait on the device returned, with garbage in its buffers: call it after
  /// reading a collective's result on the host, before trusting the value. Every collective
  /// checks it on entry too. In-process collectives fail as they are called, hence the no-op.
  virtual void check() {}

  /// Overlap of communication with the caller's work. By default every collective orders the
  /// caller's later work after it (on a GPU: the caller's stream waits for the collective). While
  /// deferred, collectives still run after the caller's earlier work, but the caller's later work
  /// does not wait for them: it may run alongside (the caller must not touch their buffers) until
  /// join() orders it after every collective issued so far. Backends whose collectives complete
  /// before they return (in-process ranks) need neither, hence the no-op defaults.
  virtual void set_deferred(bool deferred) { (void)deferred; }
  virtual void join() {}

  /// Collectives between group_start() and group_end() may run concurrently (NCCL launches them
  /// as one): say, reduces of a bucket's pieces to their different owners, which then share the
  /// links the way a reduce-scatter does instead of each taking its turn. Only sum and max
  /// inside a group; barrier() is not allowed there. Groups do not nest. A no-op where
  /// collectives complete as they are called.
  virtual void group_start() {}
  virtual void group_end() {}
};

/// The element work of in-process collectives on one backend's memory (internal; a Backend
/// names one).
struct CollectiveOps;

/// N ranks as threads of one process, on the memory of `backend` (one GPU shared by all ranks
/// for a CUDA backend).
class InProcessGroup {
 public:
  /// Throws ConfigError if world_size < 1.
  explicit InProcessGroup(int world_size, const Backend& backend = cpu_backend());
  /// The same over an operation table of one's own (tests inject faults through it).
  InProcessGroup(int world_size, const CollectiveOps& ops);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int world_size() const;
  Communicator& rank(int r);
  /// Fails every collective in progress or to come with CommError(reason). Used when one rank
  /// throws, so the others do not wait forever. A rank whose own share of a collective throws
  /// (its copy or reduction failing) aborts the group itself, naming the collective.
  void abort(const std::string& reason);
  /// How long a rank waits at a collective for the others; zero (the default) waits forever.
  /// When it runs out the group is aborted: the waiting ranks get CommError naming the
  /// collective and the ranks that never arrived, and those ranks get it when they arrive.
  /// Set it before the ranks start (it is read under the group's lock, so later is safe too).
  void set_timeout(std::chrono::milliseconds timeout);
  /// Says that rank `r` will call no collective again (its thread is done). Every collective
  /// another rank is in, or calls later, can then never complete: it fails with PeerFailure
  /// naming rank `r`, whatever the timeout. run_ranks calls it when a rank's function returns or
  /// throws; a thread of one's own over rank(r) should call it when it is done. Throws ConfigError
  /// if `r` is out of range.
  void leave(int r);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Runs fn(rank, comm) on world_size threads over one InProcessGroup. A rank whose function
/// returns leaves the group (InProcessGroup::leave): a rank still in a collective, or calling one
/// later, gets PeerFailure naming it instead of waiting forever. If any rank throws, the
/// group is aborted (so no rank waits forever) and, once every thread has joined, the root cause
/// is rethrown here: the first exception (by time) that is not a PeerFailure (the other ranks'
/// "another rank failed"), else the first. `timeout` is the group's (set_timeout), applied
/// before any rank starts; zero waits forever.
void run_ranks(int world_size, const std::function<void(int rank, Communicator& comm)>& fn,
               const Backend& backend = cpu_backend(),
               std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
/// The same over an operation table of one's own.
void run_ranks(int world_size, const std::function<void(int rank, Communicator& comm)>& fn,
               const CollectiveOps& ops, std::chrono::milliseconds timeout);

}  // namespace shardswap
