// MPI for every communicator ShardSwap makes over it (internal): the MPI communicator
// (shardswap/mpi.h) and the NCCL communicator's mpirun bootstrap (shardswap/nccl.h) share one
// session, so MPI is initialized once, at one thread level, and finalized once, when the last
// communicator of either kind goes. Two sessions (one per factory) meant that whichever came
// second did not own MPI, and the first one's last communicator finalized it under the other.
#pragma once

#include <memory>

namespace shardswap {

class MpiSession {
 public:
  /// The process's session: made on first use, initializing MPI (MPI_THREAD_SERIALIZED: an
  /// engine's rank may be driven from a thread other than main's, one at a time) unless the
  /// program did it, in which case the program finalizes it too. `who` names the factory in
  /// errors. Throws CommError if MPI was already finalized or fails.
  static std::shared_ptr<MpiSession> acquire(const char* who, int* argc = nullptr,
                                             char*** argv = nullptr);
  /// Whether this session initialized MPI (and so finalizes it).
  bool owns() const { return owns_; }
  /// A communicator failed with an operation still in flight: MPI_Finalize could wait for it
  /// forever, so it is skipped (the process is about to end, or be ended by abort_mpi_job).
  void leak() { leaked_ = true; }

  explicit MpiSession(bool owns) : owns_(owns) {}
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  bool owns_;
  bool leaked_ = false;
};

}  // namespace shardswap
