// The NCCL backend of Communicator: one rank per GPU, either one process per GPU under mpirun or
// one process driving several GPUs. CUDA-free on purpose: builds without CUDA link a stub with the
// same symbols that throws BackendUnavailable.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "shardswap/communicator.h"

namespace shardswap {

// What an NCCL communicator does differently from the in-process one:
// - Pointers passed to it are device pointers on its GPU.
// - Ordering, not blocking: callers queue their kernels on cudaStreamPerThread. Each collective
//   makes the rank's GPU current on the calling thread, then runs on the communicator's own
//   stream after everything already queued on the caller's cudaStreamPerThread, and everything
//   queued there later runs after it. (Inside the engine's step with overlap_update, "the
//   caller's stream" is the thread's side stream: support/work_stream.h.) The host does not wait (except in barrier(), which returns
//   once every rank's barrier has completed on the GPU). To read a result on the host,
//   synchronize cudaStreamPerThread.
// - Bit16 reductions are NCCL's: it rounds to the dtype at each step of its ring or tree, in an
//   order it chooses (avg is that sum scaled by 1/world_size afterwards), so results may differ by
//   rounding from the in-process backend's fp32 accumulation and are reproducible only for the
//   same world size, topology, sizes and NCCL version. Sums of small integers are exact.
// - Mismatched calls across ranks are not detected: they hang or corrupt, as with NCCL itself.
//   A peer's failure that NCCL reports asynchronously surfaces as CommError at the next
//   collective or barrier.
// - One thread at a time per communicator; every rank must issue the same collectives in the
//   same order. Collectives with a zero count do nothing (on every rank, as they must agree).
// - Destroying it waits for its queued collectives, then destroys the NCCL communicator (or
//   aborts it after an NCCL error); it never throws.
// - A timeout (the factories' `timeout`; zero, the default, waits forever): a watchdog thread per
//   communicator watches every collective from the moment it is issued on the host, and
//   NCCL's asynchronous error. When the oldest unfinished one has run longer than the timeout (a
//   peer never joined it, or hangs in it), or NCCL reports an error, the watchdog marks the
//   communicator failed and aborts it (ncclCommAbort), which ends its stuck kernels, so that the
//   caller's waits on the GPU return. From then on every collective, barrier() and check() throws
//   CommError naming the collective that timed out, the rank, world size, device and timeout.
//   A wait that returned because of the abort leaves garbage in the collective's buffers: call
//   check() after reading a collective's result on the host (see Communicator::check). The
//   timeout counts from the host's call, so it includes the work queued before the collective:
//   choose it well above a step's time.

/// Milliseconds; zero waits forever. Negative values are refused (ConfigError).
using CommTimeout = std::chrono::milliseconds;

/// One rank per process, for `mpirun -np N`: initializes MPI if the program has not
/// (MPI_THREAD_SERIALIZED), and then finalizes it when the last communicator made over MPI, by
/// this factory or make_mpi_communicator (they share one MPI session), is destroyed; making one
/// after that throws CommError. Rank and world size are MPI_COMM_WORLD's; the GPU is the rank's index among the
/// ranks of its node (or GPU 0 when the process sees exactly one GPU). That GPU is left current
/// on the calling thread. Throws BackendUnavailable in a build without CUDA/NCCL or without MPI,
/// ConfigError when the node has fewer GPUs than ranks, DeviceError/CommError when NCCL fails.
std::unique_ptr<Communicator> make_nccl_communicator_mpi(int* argc, char*** argv,
                                                         CommTimeout timeout = CommTimeout{0});

/// One process, several GPUs (ncclCommInitAll): communicator i is rank i of devices.size() on
/// devices[i]. With more than one rank, drive each communicator from its own thread (an NCCL
/// collective may wait on the host for its peers); world size 1 works from any thread. The
/// calling thread's current GPU is left as it was. Throws ConfigError on an empty list, a device
/// that does not exist or one listed twice; BackendUnavailable in a build without CUDA/NCCL.
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(
    const std::vector<int>& devices, CommTimeout timeout = CommTimeout{0});

}  // namespace shardswap
