// Linked when CUDA was found but MPI was not: the mpirun factory of the NCCL communicator, failing
// with a clear error (make_nccl_communicators works without MPI).
#include "shardswap/error.h"
#include "shardswap/nccl.h"

namespace shardswap {

std::unique_ptr<Communicator> make_nccl_communicator_mpi(int*, char***, CommTimeout) {
  throw BackendUnavailable(
      "make_nccl_communicator_mpi: ShardSwap was built without MPI (install an MPI such as "
      "libopenmpi-dev and reconfigure)");
}

}  // namespace shardswap
