// The MPI communicator and the NCCL communicator's mpirun bootstrap in one process share one MPI
// session (engine/comm/mpi_session.h): MPI is finalized once, when the last communicator of
// either kind goes, whichever was made first and whichever is freed first.
//   mpirun -np N shardswap_mpi_session_check mpi-first|nccl-first
// mpi-first: an MPI communicator, then an NCCL one; the MPI one is freed first and the NCCL one
// must still work. nccl-first: the other way round, and the MPI one must still work after the
// NCCL one is gone (with a session per factory, the NCCL factory owned MPI and finalized it under
// the MPI communicator). Where no GPU can make an NCCL communicator (a CPU machine), the NCCL
// factory's refusal must leave the MPI communicator working. Either way MPI must be finalized
// when the last communicator goes, and the program exits 0 when every check held, 1 otherwise.
#define OMPI_SKIP_MPICXX 1  // the C API is all we use
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "shardswap/backend.h"
#include "shardswap/buffer.h"
#include "shardswap/error.h"
#include "shardswap/mpi.h"
#include "shardswap/nccl.h"

using namespace shardswap;

namespace {

int failures = 0;
int rank = -1;

void check(bool ok, const std::string& what) {
  std::printf("rank %d: %s: %s\n", rank, ok ? "ok" : "FAILED", what.c_str());
  if (!ok) ++failures;
}

// The sum over ranks of (rank + 1), through `comm` (host memory).
bool mpi_sums(Communicator& comm) {
  double v = comm.rank() + 1;
  comm.all_reduce(&v, 1, DType::f64, ReduceOp::sum);
  const int n = comm.world_size();
  return v == n * (n + 1) / 2.0;
}

// The same through an NCCL communicator (device memory, through the rank's own space).
bool nccl_sums(Communicator& comm) {
  const Backend backend = cuda_backend(cuda_current_device());
  MemorySpace space(comm.rank(), backend.make_allocator(comm.rank()));
  Buffer buffer = space.allocate(sizeof(double), Tag::comm, "session check");
  double v = comm.rank() + 1;
  space.upload(buffer.data(), &v, sizeof v);
  comm.all_reduce(buffer.data(), 1, DType::f64, ReduceOp::sum);
  space.download(&v, buffer.data(), sizeof v);
  comm.check();
  const int n = comm.world_size();
  return v == n * (n + 1) / 2.0;
}

bool finalized() {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

// An NCCL communicator, or nothing where this machine cannot make one (said why).
std::unique_ptr<Communicator> try_nccl(int* argc, char*** argv) {
  try {
    return make_nccl_communicator_mpi(argc, argv);
  } catch (const Error& e) {
    // No CUDA (BackendUnavailable), no GPU for this rank (ConfigError), or another rank without
    // one (CommError): every rank refuses alike.
    std::printf("rank %d: no NCCL communicator here: %s\n", rank, e.what());
  }
  return nullptr;
}

}  // namespace

int main(int argc, char* argv[]) {
  const std::string order = argc > 1 ? argv[1] : "";
  if (order != "mpi-first" && order != "nccl-first") {
    std::fprintf(stderr, "usage: %s mpi-first|nccl-first\n", argv[0]);
    return 2;
  }
  try {
    if (order == "mpi-first") {
      auto mpi = make_mpi_communicator();
      rank = mpi->rank();
      check(mpi_sums(*mpi), "the MPI communicator sums");
      auto nccl = try_nccl(&argc, &argv);
      check(mpi_sums(*mpi), "the MPI communicator sums after the NCCL factory ran");
      mpi.reset();
      if (nccl) {
        check(!finalized(), "MPI is not finalized while a communicator made over it lives");
        check(nccl_sums(*nccl), "the NCCL communicator sums after the MPI one is gone");
        nccl.reset();
      }
    } else {
      auto nccl = try_nccl(&argc, &argv);
      if (!nccl) {
        std::printf("nccl-first needs a GPU per rank: not run\n");
        return 77;
      }
      rank = nccl->rank();
      auto mpi = make_mpi_communicator();
      check(mpi_sums(*mpi), "the MPI communicator sums beside the NCCL one");
      nccl.reset();
      check(!finalized(), "MPI is not finalized while a communicator made over it lives");
      check(mpi_sums(*mpi), "the MPI communicator sums after the NCCL one is gone");
      mpi.reset();
    }
    check(finalized(), "MPI is finalized once the last communicator is gone");
  } catch (const std::exception& e) {
    std::printf("rank %d: FAILED: %s\n", rank, e.what());
    ++failures;
  }
  return failures == 0 ? 0 : 1;
}
