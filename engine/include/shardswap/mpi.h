// The MPI backend of Communicator, on host memory: one rank per process, for CPU training under
// `mpirun -np N` or `srun`. MPI-free on purpose: builds without MPI link a stub with the same
// symbols that throws BackendUnavailable.
#pragma once

#include <chrono>
#include <memory>

#include "shardswap/communicator.h"

namespace shardswap {

// What the MPI communicator promises, beyond Communicator's contract:
// - The same bits as the in-process backend for the same inputs on the same world size: every
//   reduction gathers the chunk a rank owns from every rank (MPI_Ialltoall / Ialltoallv /
//   Igather) and sums it in rank order 0..N-1 with the in-process backend's own element loop, so
//   MPI's reduction order (which MPI_Allreduce leaves to the implementation) never enters.
// - Calls that disagree across ranks (collective, count, dtype, op, root) are detected: every
//   collective first exchanges a small description of itself, and a mismatch throws CommError on
//   every rank, naming the rank and both calls, before any data moves.
// - A timeout (zero waits forever): a collective that has not completed after `timeout` throws
//   CommError naming it, the rank and the timeout; from then on the communicator has failed (the
//   operation cannot be withdrawn from MPI) and every collective and check() throws. A dead peer
//   is the launcher's to notice (mpirun ends the job when a process dies); a peer that hangs or
//   stops is the timeout's.
// - One thread at a time per communicator; collectives complete before they return, so
//   set_deferred, join and group_start/end are the default no-ops.
// - Counts are limited by MPI's int: a collective moving more than INT_MAX elements in one buffer
//   throws ConfigError naming it.

/// Milliseconds; zero waits forever. Negative values are refused (ConfigError).
using CommTimeout = std::chrono::milliseconds;

/// This process's rank of MPI_COMM_WORLD (over a duplicate of it, so its traffic never mixes with
/// another library's). Initializes MPI if the program has not (MPI_THREAD_SERIALIZED), and then
/// finalizes it when the last communicator made over MPI, by this factory or
/// make_nccl_communicator_mpi (they share one MPI session), is destroyed; making one after that
/// throws CommError. Throws BackendUnavailable in a build without MPI, CommError when MPI fails.
std::unique_ptr<Communicator> make_mpi_communicator(CommTimeout timeout = CommTimeout{0});

/// Ends every process of the MPI job with `exit_code` (MPI_Abort on MPI_COMM_WORLD): for a rank
/// whose failure would otherwise leave the others waiting in a collective. Where MPI is absent or
/// not initialized it ends this process alone (std::_Exit). Never returns.
[[noreturn]] void abort_mpi_job(int exit_code) noexcept;

}  // namespace shardswap
