// Linked when MPI is absent: the MPI communicator's symbols, failing with a clear error.
#include <cstdlib>

#include "shardswap/error.h"
#include "shardswap/mpi.h"

namespace shardswap {

std::unique_ptr<Communicator> make_mpi_communicator(CommTimeout) {
  throw BackendUnavailable(
      "make_mpi_communicator: ShardSwap was built without MPI (install an MPI such as "
      "libopenmpi-dev and reconfigure with SHARDSWAP_MPI=AUTO or ON)");
}

void abort_mpi_job(int exit_code) noexcept {
  std::_Exit(exit_code);
}

}  // namespace shardswap
