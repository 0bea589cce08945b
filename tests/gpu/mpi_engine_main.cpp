// The engine over NCCL with one process per GPU, against the float64 reference:
//   mpirun -np N shardswap_mpi_engine_tests
// Every rank runs the same Catch2 cases in the same order (each makes the same collectives); a
// rank's failure is reported by that rank and makes mpirun exit non-zero.
#define CATCH_CONFIG_RUNNER
#include <cstdio>
#include <memory>

#include "shardswap/backend.h"
#include "shardswap/nccl.h"
#include "tests/catch_compat.h"
#include "tests/support/reference_check.h"

using namespace shardswap;

namespace {
Communicator* world_comm = nullptr;
}  // namespace

TEST_CASE("mpirun: ZeRO-1/2 over NCCL, one process per GPU, matches the float64 reference") {
  REQUIRE(world_comm != nullptr);
  const int world = world_comm->world_size();
  std::printf("rank %d of %d: %zu cases\n", world_comm->rank(), world,
              test_support::multi_gpu_cases(world).size());
  for (test_support::Case c : test_support::multi_gpu_cases(world)) {
    c.comm = world_comm;
    test_support::check_against_reference(c, cuda_backend(cuda_current_device()));
  }
}

int main(int argc, char* argv[]) {
  std::unique_ptr<Communicator> comm = make_nccl_communicator_mpi(&argc, &argv);
  world_comm = comm.get();
  const int failed = Catch::Session().run(argc, argv);
  std::printf("rank %d of %d: %s\n", comm->rank(), comm->world_size(),
              failed == 0 ? "PASS" : "FAIL");
  return failed == 0 ? 0 : 1;
}
