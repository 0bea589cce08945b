// One process per rank (tools/trainer/process_launch.h): the launcher's environment, the config's
// world size against it, and the run of this process's rank with a failure ending the whole job.
#include "trainer/process_launch.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <thread>
#include <vector>

#include "shardswap/error.h"
#include "shardswap/nccl.h"
#include "trainer/train.h"

namespace shardswap {

namespace {

/// The value of `name` as a non-negative int, or nothing when unset.
std::optional<int> env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr) return std::nullopt;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < 0 || value > (1 << 24))
    throw ConfigError(
        fmt::format("process launch: environment variable {}={} is not a process "
                    "count or rank",
                    name, text));
  return static_cast<int>(value);
}

}  // namespace

std::optional<ProcessLaunch> process_launch_from_env() {
  // Most specific first: an mpirun inside a Slurm allocation has both Open MPI's and Slurm's.
  constexpr std::pair<const char*, const char*> kLaunchers[] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
      {"PMI_RANK", "PMI_SIZE"},
      {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS"},
  };
  for (const auto& [rank_var, size_var] : kLaunchers) {
    const auto size = env_int(size_var);
    if (!size) continue;
    const auto rank = env_int(rank_var);
    if (!rank || *rank >= *size)
      throw ConfigError(fmt::format("process launch: {}={} but {} is {}: not a rank of the job",
                                    size_var, *size, rank_var,
                                    rank ? std::to_string(*rank) : std::string("unset")));
    if (*size == 1) return std::nullopt;  // a job of one process runs its ranks as threads
    ProcessLaunch launch{*rank, *size, 1, fmt::format("{}={}", size_var, *size)};
    // A hint only (how many of the job's processes share this machine's cores): a value that is
    // not a plain count (Slurm's "2(x3)") is passed over, not refused.
    for (const char* local :
         {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
      const char* text = std::getenv(local);
      char* end = nullptr;
      const long n = text ? std::strtol(text, &end, 10) : 0;
      if (text && *text != '\0' && *end == '\0' && n >= 1 && n <= *size) {
        launch.local_size = static_cast<int>(n);
        break;
      }
    }
    return launch;
  }
  return std::nullopt;
}

void apply_launch_world_size(ConfigReader& reader, const std::optional<ProcessLaunch>& launch) {
  if (!launch) return;
  if (!reader.has("world_size") || reader.is_auto("world_size")) {
    reader.set(fmt::format("world_size={}", launch->world_size));
    return;
  }
  const std::int64_t asked = reader.integer("world_size", launch->world_size);
  if (asked != launch->world_size)
    reader.fail_value(
        "world_size",
        fmt::format("this process is one of {} started by a launcher ({}): world_size must be "
                    "{} or \"auto\" (or left out)",
                    launch->world_size, launch->source, launch->world_size));
}

void attach_process_launch(TrainConfig& config, const std::optional<ProcessLaunch>& launch) {
  if (!launch) return;
  if (config.backend.kind != DeviceKind::host && config.comm != CommKind::nccl)
    throw ConfigError(fmt::format(
        "shardswap.communicator = \"in_process\": with one process per rank ({}) the {} "
        "backend's ranks need \"nccl\" (in-process ranks share one process's memory)",
        launch->source, config.backend.name));
  config.process = launch;
  // The host update's threads, unless set: this machine's cores shared by the job's processes
  // on it (train_config_from_json shared them between in-process ranks).
  if (!config.offload_threads_given)
    config.engine.offload_threads = share_of_cores(launch->local_size);
}

unsigned share_of_cores(int ranks_on_machine) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1u, cores / static_cast<unsigned>(std::max(1, ranks_on_machine)));
}

void run_process_rank(const ProcessLaunch& launch, const Backend& backend, bool nccl,
                      CommTimeout timeout, const ProcessRankFn& fn) {
  try {
    std::unique_ptr<Communicator> comm = nccl
                                             ? make_nccl_communicator_mpi(nullptr, nullptr, timeout)
                                             : make_mpi_communicator(timeout);
    if (comm->rank() != launch.rank || comm->world_size() != launch.world_size)
      throw CommError(fmt::format(
          "process launch: the launcher said rank {} of {} ({}), MPI says rank {} of {}: is "
          "ShardSwap built against the MPI that launched it?",
          launch.rank, launch.world_size, launch.source, comm->rank(), comm->world_size()));
    // NCCL's factory made this rank's GPU current: its allocator goes there. The cpu ranks'
    // memory is the backend's.
    std::unique_ptr<Allocator> allocator =
        nccl ? make_cuda_allocator(cuda_current_device()) : backend.make_allocator(launch.rank);
    fn(launch.rank, *comm, std::move(allocator));
    // A collective that failed at the very end (a timeout) left garbage in what was read last.
    comm->check();
  } catch (const std::exception& e) {
    std::cerr << fmt::format("shardswap: rank {} of {} failed: {}\n", launch.rank,
                             launch.world_size, e.what())
              << std::flush;
    // The rank at fault ends the job with its own message; one that only heard of it waits a
    // little so that the other's message is not cut off by its abort.
    if (dynamic_cast<const PeerFailure*>(&e) != nullptr)
      std::this_thread::sleep_for(std::chrono::seconds(2));
    abort_mpi_job(dynamic_cast<const ConfigError*>(&e) != nullptr ? 2 : 1);
  }
}

std::string text_of_rank0(Communicator& comm, const std::string& text) {
  // The length exactly (a double holds every integer below 2^53), then the bytes as 16-bit
  // words, which every backend moves unchanged.
  double length = comm.rank() == 0 ? static_cast<double>(text.size()) : 0.0;
  comm.broadcast(&length, 1, DType::f64, 0);
  const auto n = static_cast<std::size_t>(length);
  std::vector<std::uint16_t> words((n + 1) / 2, 0);
  if (comm.rank() == 0) std::copy(text.begin(), text.end(), reinterpret_cast<char*>(words.data()));
  comm.broadcast(words.data(), words.size(), DType::bf16, 0);
  return std::string(reinterpret_cast<const char*>(words.data()), n);
}

}  // namespace shardswap
