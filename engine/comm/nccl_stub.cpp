// Linked when CUDA is off: the NCCL factories with the same symbols, failing with a clear error.
#include "shardswap/nccl.h"
#include "shardswap/error.h"

namespace shardswap {

std::unique_ptr<Communicator> make_nccl_communicator_mpi(int*, char***, CommTimeout) {
  throw BackendUnavailable("make_nccl_communicator_mpi: ShardSwap was built without CUDA/NCCL");
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<int>&,
                                                                   CommTimeout) {
  throw BackendUnavailable("make_nccl_communicators: ShardSwap was built without CUDA/NCCL");
}

}  // namespace shardswap
