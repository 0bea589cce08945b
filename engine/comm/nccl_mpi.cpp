// make_nccl_communicator_mpi: one NCCL rank per process under mpirun, bootstrapped over MPI
// (rank and world size from MPI_COMM_WORLD, the unique id broadcast from rank 0). Linked where
// CUDA and MPI were both found; nccl_mpi_stub.cpp otherwise.
#define OMPI_SKIP_MPICXX 1  // the C API is all we use
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <string>

#include "engine/comm/mpi_session.h"
#include "engine/comm/nccl_adopt.h"
#include "engine/comm/nccl_check.h"
#include "shardswap/error.h"

namespace shardswap {

namespace {

void mpi_check(int status, const char* statement) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(status, text, &length);
  throw CommError(fmt::format("make_nccl_communicator_mpi: {} failed: {}", statement, text));
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator_mpi(int* argc, char*** argv,
                                                         CommTimeout timeout) {
  require_comm_timeout("make_nccl_communicator_mpi", timeout);
  // The session the MPI communicator shares (engine/comm/mpi_session.h).
  auto session = MpiSession::acquire("make_nccl_communicator_mpi", argc, argv);
  int rank = 0, size = 0;
  mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  // The GPU is the rank's index among the ranks sharing its node.
  MPI_Comm node = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int local_rank = 0, local_size = 0;
  mpi_check(MPI_Comm_rank(node, &local_rank), "MPI_Comm_rank(node)");
  mpi_check(MPI_Comm_size(node, &local_size), "MPI_Comm_size(node)");
  mpi_check(MPI_Comm_free(&node), "MPI_Comm_free");

  const int count = visible_cuda_devices();
  // A process that sees exactly one GPU was given its own (CUDA_VISIBLE_DEVICES per rank).
  const int device = count == 1 ? 0 : local_rank;
  std::string problem;
  if (count == 0) {
    problem = "no CUDA device is visible";
  } else if (device >= count) {
    problem = fmt::format("local rank {} of {} on this node has no GPU of its own ({} visible)",
                          local_rank, local_size, count);
  } else if (const cudaError_t status = cudaSetDevice(device); status != cudaSuccess) {
    cudaGetLastError();
    problem = fmt::format("cudaSetDevice({}) failed: {}", device, cudaGetErrorString(status));
  }
  // Every rank learns whether all have their GPU before any waits in NCCL's bootstrap.
  const int ok = problem.empty() ? 1 : 0;
  int all_ok = 0;
  mpi_check(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
  if (!ok) {
    throw ConfigError(
        fmt::format("make_nccl_communicator_mpi: rank {} of {}: {}", rank, size, problem));
  }
  if (!all_ok) {
    throw CommError(fmt::format(
        "make_nccl_communicator_mpi: rank {} of {}: another rank could not select its GPU", rank,
        size));
  }

  struct {
    int ok = 0;
    ncclUniqueId id{};
  } root;
  ncclResult_t id_status = ncclSuccess;
  if (rank == 0) {
    id_status = ncclGetUniqueId(&root.id);
    root.ok = id_status == ncclSuccess ? 1 : 0;
  }
  mpi_check(MPI_Bcast(&root, static_cast<int>(sizeof root), MPI_BYTE, 0, MPI_COMM_WORLD),
            "MPI_Bcast");
  if (id_status != ncclSuccess) {
    detail::nccl_fail(id_status, "ncclGetUniqueId(&root.id)", __FILE__, __LINE__);
  }
  if (!root.ok) {
    throw CommError(fmt::format(
        "make_nccl_communicator_mpi: rank {} of {}: rank 0 could not create the NCCL unique id",
        rank, size));
  }

  ncclComm_t comm = nullptr;
  SHARDSWAP_NCCL_CHECK(ncclCommInitRank(&comm, size, root.id, rank));
  return adopt_nccl_comm(comm, device, timeout, std::move(session));
}

}  // namespace shardswap
