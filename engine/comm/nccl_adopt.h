// What the NCCL communicator's factories share (internal, CUDA builds): nccl.cpp makes the
// communicator; nccl_mpi.cpp bootstraps one over MPI, or nccl_mpi_stub.cpp says MPI is absent
// (a link-time choice, as for every backend, instead of an #ifdef).
#pragma once

#include <nccl.h>

#include <memory>

#include "shardswap/nccl.h"

namespace shardswap {

/// Takes `comm` over (rank and world size are its own) on `device`: destroyed by the returned
/// communicator, or here if making that throws. `keep_alive` is released only after the NCCL
/// communicator is gone (an mpirun rank's MPI session). A positive `timeout` starts a watchdog.
std::unique_ptr<Communicator> adopt_nccl_comm(ncclComm_t comm, int device, CommTimeout timeout,
                                              std::shared_ptr<void> keep_alive);
/// Number of visible GPUs; 0 when CUDA finds none (or no driver).
int visible_cuda_devices();
/// Throws ConfigError naming `factory` for a negative timeout.
void require_comm_timeout(const char* factory, CommTimeout timeout);

}  // namespace shardswap
