// `shardswap train` started as one process per rank, the way DeepSpeed and Hugging Face jobs are
// (`mpirun -np N`, `srun`): how the CLI tells it was, what it changes in the config, and the run
// of this process's one rank (docs/launch.md).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "shardswap/allocator.h"
#include "shardswap/backend.h"
#include "shardswap/communicator.h"
#include "shardswap/config_reader.h"
#include "shardswap/mpi.h"

namespace shardswap {

struct TrainConfig;  // tools/trainer/train.h

/// This process is rank `rank` of a job of `world_size` processes (world_size > 1).
struct ProcessLaunch {
  int rank = 0;
  int world_size = 1;
  /// Processes of the job on this machine (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS,
  /// SLURM_NTASKS_PER_NODE), 1 when the launcher does not say: they share its cores.
  int local_size = 1;
  /// The launcher's environment that said so, for messages: "OMPI_COMM_WORLD_SIZE=4".
  std::string source;
};

/// Reads the launcher's environment: OMPI_COMM_WORLD_RANK/SIZE (Open MPI's mpirun), PMI_RANK /
/// PMI_SIZE (MPICH's and Intel MPI's), then SLURM_PROCID / SLURM_STEP_NUM_TASKS (srun; not
/// SLURM_NTASKS, which the batch script itself also has, where `shardswap train` is one process).
/// Nothing (every rank a thread of this process, as without a launcher) when none is set or the
/// job has one process. Throws ConfigError naming the variable when one is not a rank below the
/// size.
std::optional<ProcessLaunch> process_launch_from_env();

/// Before the config is read: under a launch of N processes, world_size absent or "auto" becomes
/// N; any other value must be N, else ConfigError naming world_size and the launch. Without a
/// launch it changes nothing ("auto" is then read as the config reader reads it).
void apply_launch_world_size(ConfigReader& reader, const std::optional<ProcessLaunch>& launch);

/// Threads for each of `ranks_on_machine` ranks' host updates: the machine's cores shared
/// evenly, at least 1.
unsigned share_of_cores(int ranks_on_machine);

/// After the config is read: records the launch in config.process (train() then runs this
/// process's rank only) and refuses what one process per rank cannot run: the cuda backend with
/// shardswap.communicator "in_process" (ranks of other processes share no memory; "nccl" is
/// the one for GPUs). Unless the config sets shardswap.offload_threads, the host update's threads
/// become the machine's cores shared by the job's processes on it (local_size). Throws
/// ConfigError naming the key.
void attach_process_launch(TrainConfig& config, const std::optional<ProcessLaunch>& launch);

/// What train() runs for this process's rank.
using ProcessRankFn =
    std::function<void(int rank, Communicator& comm, std::unique_ptr<Allocator> allocator)>;

/// Runs this process's rank of the job: makes its communicator (the MPI one on the cpu backend,
/// NCCL over MPI with `nccl`, one GPU per local rank), checks that MPI's world agrees with the
/// launch, and calls fn. A rank that fails prints "shardswap: rank R of N failed: ..." on stderr
/// and ends the whole job (abort_mpi_job) with the CLI's exit code for the error (2 bad input,
/// 1 otherwise), so that no rank waits for it forever; a rank that failed only because another
/// did (PeerFailure) first gives the failing rank a moment to print its own message.
void run_process_rank(const ProcessLaunch& launch, const Backend& backend, bool nccl,
                      CommTimeout timeout, const ProcessRankFn& fn);

/// Rank 0's `text` on every rank (collective): what only rank 0 decides before the ranks start
/// (which checkpoint to resume, the run's id) when the ranks are processes.
std::string text_of_rank0(Communicator& comm, const std::string& text);

}  // namespace shardswap
