// Smoke check of the NCCL communicator under mpirun, one process per GPU:
//   mpirun -np N shardswap_nccl_mpi_check
// Every rank all-reduces, reduce-scatters and all-gathers known float32 data (small integers, so
// the sums are exact), prints PASS or FAIL per collective, and exits non-zero if any check
// failed. An exception aborts the whole job (MPI_Abort) so no rank waits forever.
#include <cuda_runtime.h>
#define OMPI_SKIP_MPICXX 1  // the C API is all we use
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <vector>

#include "shardswap/nccl.h"
#include "shardswap/allocator.h"

using namespace shardswap;

namespace {

/// Counts the elements of `got` that differ from expected(i) and prints one line for this rank.
template <class Expected>
bool report(int rank, int world, int device, const char* what, const std::vector<float>& got,
            Expected expected) {
  std::size_t wrong = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != expected(i) && wrong++ == 0) first = i;
  }
  if (wrong == 0) {
    std::printf("nccl_mpi_check: rank %d/%d device %d: %s PASS (%zu elements)\n", rank, world,
                device, what, got.size());
  } else {
    std::printf(
        "nccl_mpi_check: rank %d/%d device %d: %s FAIL: %zu of %zu elements wrong, first "
        "at %zu: %g, expected %g\n",
        rank, world, device, what, wrong, got.size(), first, static_cast<double>(got[first]),
        static_cast<double>(expected(first)));
  }
  std::fflush(stdout);
  return wrong == 0;
}

bool run(Communicator& comm) {
  const int rank = comm.rank(), world = comm.world_size();
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) throw std::runtime_error("cudaGetDevice failed");
  auto allocator = make_cuda_allocator(device);
  const float ranks_sum = static_cast<float>(world * (world + 1) / 2);  // sum of r + 1
  bool ok = true;

  // all_reduce: rank r holds (r + 1) * (i % 13); the sum is ranks_sum * (i % 13).
  {
    const std::size_t n = (std::size_t{1} << 20) + 5;
    std::vector<float> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<float>((rank + 1) * (i % 13));
    const Block block = allocator->allocate(n * sizeof(float));
    allocator->upload(block.ptr, data.data(), n * sizeof(float));
    comm.all_reduce(block.ptr, n, DType::f32, ReduceOp::sum);
    allocator->download(data.data(), block.ptr, n * sizeof(float));
    allocator->deallocate(block);
    ok &= report(rank, world, device, "all_reduce(sum)", data,
                 [&](std::size_t i) { return ranks_sum * static_cast<float>(i % 13); });
  }

  // reduce_scatter in place, then all_gather in place: rank r holds (r + 1) * (j % 13) over the
  // whole buffer; after both, every rank holds ranks_sum * (j % 13).
  {
    const std::size_t chunk = 100003, total = chunk * static_cast<std::size_t>(world);
    const std::size_t mine = chunk * static_cast<std::size_t>(rank);
    std::vector<float> data(total);
    for (std::size_t j = 0; j < total; ++j) data[j] = static_cast<float>((rank + 1) * (j % 13));
    const Block block = allocator->allocate(total * sizeof(float));
    float* full = static_cast<float*>(block.ptr);
    allocator->upload(full, data.data(), total * sizeof(float));
    comm.reduce_scatter(full, full + mine, chunk, DType::f32, ReduceOp::sum);
    std::vector<float> part(chunk);
    allocator->download(part.data(), full + mine, chunk * sizeof(float));
    ok &= report(rank, world, device, "reduce_scatter(sum, in place)", part,
                 [&](std::size_t i) { return ranks_sum * static_cast<float>((mine + i) % 13); });
    comm.all_gather(full + mine, full, chunk, DType::f32);
    allocator->download(data.data(), full, total * sizeof(float));
    allocator->deallocate(block);
    ok &= report(rank, world, device, "all_gather(in place)", data,
                 [&](std::size_t j) { return ranks_sum * static_cast<float>(j % 13); });
  }

  comm.barrier();
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<Communicator> comm;
  bool ok = false;
  try {
    comm = make_nccl_communicator_mpi(&argc, &argv);
    ok = run(*comm);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_mpi_check: FAIL: %s\n", e.what());
    std::fflush(stderr);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
  const int rank = comm->rank(), world = comm->world_size();
  comm.reset();  // destroys the NCCL communicator, then finalizes MPI
  std::printf("nccl_mpi_check: rank %d/%d: %s\n", rank, world, ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
