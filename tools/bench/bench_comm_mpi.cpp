// Collective bandwidth inside ShardSwap against plain NCCL calls on the same buffers, in one run,
// one process per GPU:   mpirun -np N shardswap_bench_comm [--sizes 64M,256M,1G] [--iters 20]
//                                                          [--json FILE]
// Rows, for each total size S (bf16):
//   reduce_scatter  plain ncclReduceScatter   vs  Communicator::reduce_scatter (stage 1's call)
//   stage-2 bucket  -                         vs  Engine::finish_backward on one full bucket of
//                                                 S bytes (BucketReducer: one reduce per owner)
//   all_gather      plain ncclAllGather       vs  Communicator::all_gather (the engine's call
//                                                 after every step)
// Bus bandwidth as nccl-tests defines it: S / time * (N - 1) / N. Rank 0 prints the table.
#include <cuda_runtime.h>
#include <nccl.h>
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardswap/nccl.h"
#include "shardswap/engine.h"
#include "shardswap/allocator.h"
#include "shardswap/buffer.h"

using namespace shardswap;

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check_nccl(ncclResult_t e, const char* what) {
  if (e != ncclSuccess)
    throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(e));
}

std::size_t parse_size(const std::string& s) {
  const char unit = s.empty() ? '\0' : s.back();
  const std::size_t mult = unit == 'G' ? 1u << 30 : unit == 'M' ? 1u << 20 : unit == 'K' ? 1u << 10 : 1;
  return static_cast<std::size_t>(std::stoull(mult == 1 ? s : s.substr(0, s.size() - 1))) * mult;
}

/// Mean seconds of fn() over `iters` runs after 3 warm-up runs, timed with events on
/// cudaStreamPerThread (where the engine's and the communicator's callers queue their work),
/// the maximum over ranks (a collective ends when its slowest rank does).
double time_on_stream(const std::function<void()>& fn, int iters) {
  for (int i = 0; i < 3; ++i) fn();
  check_cuda(cudaStreamSynchronize(cudaStreamPerThread), "sync");
  MPI_Barrier(MPI_COMM_WORLD);
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "event");
  check_cuda(cudaEventCreate(&stop), "event");
  check_cuda(cudaEventRecord(start, cudaStreamPerThread), "record");
  for (int i = 0; i < iters; ++i) fn();
  check_cuda(cudaEventRecord(stop, cudaStreamPerThread), "record");
  check_cuda(cudaEventSynchronize(stop), "sync");
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, start, stop), "elapsed");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  double seconds = ms / 1e3 / iters, worst = 0;
  MPI_Allreduce(&seconds, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

struct Row {
  std::string what;
  std::size_t bytes;
  double plain_s;  // 0: no plain counterpart
  double ours_s;
};

struct Args {
  std::vector<std::size_t> sizes;
  int iters = 20;
  std::string json;
};

Args parse_args(int argc, char** argv) {
  Args args;
  std::string size_list = "64M,256M,1G";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--sizes") size_list = argv[i + 1];
    else if (a == "--iters") args.iters = std::atoi(argv[i + 1]);
    else if (a == "--json") args.json = argv[i + 1];
    else throw std::runtime_error("unknown argument " + a);
  }
  for (std::size_t at = 0; at <= size_list.size();) {
    const auto comma = std::min(size_list.find(',', at), size_list.size());
    args.sizes.push_back(parse_size(size_list.substr(at, comma - at)));
    at = comma + 1;
  }
  return args;
}

// reduce_scatter and all_gather of `count` bf16 elements, plain NCCL's and ours.
void time_collectives(std::vector<Row>& rows, MemorySpace& space, Communicator& comm,
                      ncclComm_t plain, std::size_t count, int iters) {
  const std::size_t chunk = count / static_cast<std::size_t>(comm.world_size());
  const std::size_t total = count * 2;
  Buffer send = space.allocate(total, Tag::other, "bench send");
  Buffer recv = space.allocate(total, Tag::other, "bench recv");
  check_cuda(cudaMemset(send.data(), 0x3c, total), "memset");  // 0x3c3c: a bf16 ~0.011
  const double plain_rs = time_on_stream(
      [&] {
        check_nccl(ncclReduceScatter(send.data(), recv.data(), chunk, ncclBfloat16, ncclSum, plain,
                                     cudaStreamPerThread),
                   "ncclReduceScatter");
      },
      iters);
  const double ours_rs = time_on_stream(
      [&] { comm.reduce_scatter(send.data(), recv.data(), chunk, DType::bf16, ReduceOp::sum); },
      iters);
  const double plain_ag = time_on_stream(
      [&] {
        check_nccl(ncclAllGather(send.data(), recv.data(), chunk, ncclBfloat16, plain,
                                 cudaStreamPerThread),
                   "ncclAllGather");
      },
      iters);
  const double ours_ag =
      time_on_stream([&] { comm.all_gather(send.data(), recv.data(), chunk, DType::bf16); }, iters);
  rows.push_back({"reduce_scatter", total, plain_rs, ours_rs});
  rows.push_back({"all_gather", total, plain_ag, ours_ag});
}

// The stage-2 path: one param filling one bucket exactly; finish_backward reduces it into the
// owners' partitions (one ncclReduce per owner, then the accumulate).
void time_bucket(std::vector<Row>& rows, MemorySpace& space, Communicator& comm, int device,
                 std::size_t count, int iters) {
  const std::size_t total = count * 2;
  EngineConfig cfg;
  cfg.stage = 2;
  cfg.dtype = DType::bf16;
  cfg.reduce_bucket_bytes = total;
  cfg.optimizer.type = OptimizerType::sgd;  // the smallest state: 0 moments
  Engine engine(cfg, comm, space, cuda_backend(device));
  engine.add_param("w", {static_cast<std::int64_t>(count)}, "g");
  engine.build([](const ParamInfo&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); });
  const double ours = time_on_stream(
      [&] {
        // The slot's contents do not change the collective's speed; the bucket's zero fill and
        // the accumulate into the partition are the engine's own costs.
        engine.grad_slot("w");
        engine.grad_ready("w");
        engine.finish_backward();
      },
      iters);
  engine.zero_grad();
  rows.push_back({"stage-2 bucket", total, 0.0, ours});
}

// Rank 0's table, and the same rows as JSON into `json` when given.
void print_rows(const std::vector<Row>& rows, int world, int iters, const std::string& json) {
  const double f = static_cast<double>(world - 1) / world;
  std::printf("collective bandwidth, %d ranks (one process per GPU), bf16, %d iterations\n", world,
              iters);
  std::printf("%-16s %10s %14s %14s %8s\n", "collective", "size", "plain busbw", "ours busbw",
              "ours/plain");
  std::string out = "[";
  for (const Row& r : rows) {
    const double ours = r.bytes / r.ours_s * f / 1e9;
    const double plain = r.plain_s > 0 ? r.bytes / r.plain_s * f / 1e9 : 0.0;
    char plain_text[32] = "-", ratio_text[32] = "-";
    if (plain > 0) {
      std::snprintf(plain_text, sizeof plain_text, "%.1f GB/s", plain);
      std::snprintf(ratio_text, sizeof ratio_text, "%.3f", ours / plain);
    }
    std::printf("%-16s %8.0f MB %14s %9.1f GB/s %8s\n", r.what.c_str(), r.bytes / 1048576.0,
                plain_text, ours, ratio_text);
    char line[256];
    std::snprintf(line, sizeof line,
                  "%s{\"collective\":\"%s\",\"bytes\":%zu,\"world\":%d,\"plain_busbw_gbs\":%.3f,"
                  "\"ours_busbw_gbs\":%.3f}",
                  out.size() > 1 ? "," : "", r.what.c_str(), r.bytes, world, plain, ours);
    out += line;
  }
  out += "]\n";
  if (json.empty()) return;
  std::ofstream file(json);
  file << out;
  file.flush();
  // A figure file that silently came out empty or short would pass for a run that measured.
  if (!file) throw std::runtime_error("bench_comm_mpi: cannot write '" + json + "'");
}

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<Communicator> comm;
  try {
    comm = make_nccl_communicator_mpi(&argc, &argv);
    const Args args = parse_args(argc, argv);
    const int rank = comm->rank(), world = comm->world_size();
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");

    // A plain NCCL communicator of the same ranks, for the baseline.
    ncclUniqueId id;
    if (rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t plain;
    check_nccl(ncclCommInitRank(&plain, world, id, rank), "ncclCommInitRank");

    MemorySpace space(rank, make_cuda_allocator(device));
    std::vector<Row> rows;
    for (const std::size_t bytes : args.sizes) {
      const std::size_t count = bytes / 2 / static_cast<std::size_t>(world) * world;  // bf16
      time_collectives(rows, space, *comm, plain, count, args.iters);
      time_bucket(rows, space, *comm, device, count, args.iters);
    }
    ncclCommDestroy(plain);
    if (rank == 0) print_rows(rows, world, args.iters, args.json);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardswap_bench_comm: %s\n", e.what());
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
  comm.reset();
  return 0;
}
