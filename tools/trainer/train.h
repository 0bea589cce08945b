// `shardswap train`: a JSON-configured run of the built-in decoder (tools/model/decoder.h) over token
// files or a file's bytes, with world_size ranks: threads over in-process collectives (cpu, or all
// on one GPU), or one GPU per rank over NCCL.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "shardswap/backend.h"
#include "shardswap/batch_sizes.h"
#include "shardswap/communicator.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine_config.h"
#include "shardswap/schedule.h"
#include "shardswap/lr_schedule.h"
#include "trainer/device_budget.h"
#include "trainer/process_launch.h"
#include "trainer/run_data.h"
#include "trainer/run_model.h"
#include "trainer/tensorboard.h"

namespace shardswap {

enum class CommKind {
  in_process,  ///< ranks as threads over in-process collectives (host memory or one GPU)
  nccl,        ///< one GPU per rank (GPUs 0..world_size-1), a thread each, over NCCL
};

/// Config key shardswap.backend, read once: where the ranks' memory and compute live. Checked by
/// spelling only: whether the GPU exists is known when a run opens it (open_backend), and `plan`
/// must work for a GPU config on a machine without one.
struct BackendChoice {
  DeviceKind kind = DeviceKind::host;
  int device = -1;           ///< the CUDA device ("cuda" is device 0); -1 for the cpu
  std::string name = "cpu";  ///< as the config spells it: cpu, cuda, cuda:N
};
/// The backend of the choice. Throws ConfigError "shardswap.backend = \"cuda:N\": ..." for a
/// CUDA device that does not exist, BackendUnavailable in a build without CUDA.
Backend open_backend(const BackendChoice& choice);

/// Config section `checkpoint` (docs/checkpoints.md).
struct CheckpointConfig {
  std::string dir;         ///< checkpoint.dir: holds step-NNNNNNNN checkpoints; "" saves none
  std::int64_t every = 0;  ///< checkpoint.every: save after every this many steps (and the last)
  int keep = 3;            ///< checkpoint.keep: the newest this many are kept
  /// checkpoint.load: a checkpoint to resume from, or "latest" (the newest under dir; none
  /// there: a fresh start); "" starts fresh.
  std::string load;
};

struct TrainConfig;
/// Every file a run reads: its token files (data.train and data.val, globs expanded) and the
/// model's (RunModel::input_files): what its outputs must never replace.
std::vector<std::filesystem::path> run_input_files(const TrainConfig& t);

struct TrainConfig {
  EngineConfig engine;
  BatchSizes batches;
  LrSchedule lr;
  /// model.*: the model, read and checked with the config (read_run_model) and shared by every
  /// run made from it.
  std::shared_ptr<const RunModel> model;
  /// data.*: where the tokens come from, the model's vocabulary and the run's seed set.
  TokenDataSpec data_spec;
  int world_size = 1;
  std::int64_t steps = 100;
  std::uint64_t seed = 1;
  int log_interval = 10;
  int eval_interval = 100;  ///< validation every this many steps (and before the first, after the last)
  /// logging.eval_batches: validation batches per evaluation (of the micro-batch size, the last
  /// one maybe partial), split over ranks; "all" resolved to the count that covers the set.
  int eval_batches = 4;
  BackendChoice backend;    ///< shardswap.backend
  CommKind comm = CommKind::in_process;
  /// shardswap.comm_timeout_s: how long a rank waits in a collective for the others before every
  /// rank fails with a CommError naming it (in-process ranks: InProcessGroup::set_timeout; NCCL:
  /// the communicators' watchdog); zero waits forever.
  std::chrono::milliseconds comm_timeout{0};
  /// logging.timing: wait for the device after the model's forward/backward and after
  /// engine.step(), so the step time splits into the two honestly (costs a little overlap).
  bool timing = false;
  /// shardswap.max_consecutive_skips: the run fails (exit 1, no checkpoint of the step) after this
  /// many skipped steps in a row, naming the cause; 0 never fails.
  int max_consecutive_skips = 20;
  /// shardswap.weight_decay_on: "weights" (false), as the Hugging Face Trainer: biases and norm
  /// weights (RunModel::no_decay_params) are not decayed; "all" (true): every param, as a plain
  /// torch AdamW over model.parameters().
  bool decay_all_params = false;
  /// layer_switching, checked against the model's groups when the config is read: the run's one
  /// schedule (set by train_config_from_json; plan, train and eval read it).
  std::optional<LayerSchedule> schedule;
  /// The data train and eval draw from, opened once when the config is read for a run and
  /// shared by its ranks; none for a plan (ConfigFor::plan), which needs the shapes alone.
  std::shared_ptr<const RunData> data;
  nlohmann::json source;           ///< the config as read, recorded in checkpoints
  CheckpointConfig checkpoint;
  /// Set (by attach_process_launch) when this process is one rank of a job of one process per
  /// rank (mpirun, srun): train() then runs that rank alone; rank 0 writes the outputs.
  std::optional<ProcessLaunch> process;
  TensorBoardConfig tensorboard;  ///< DeepSpeed's tensorboard section (tools/trainer/tensorboard.h)
  /// shardswap.device_memory: the budget and the arrangement chosen for it (already set in
  /// engine and model); every rank's space is capped at budget->budget.per_rank().
  std::optional<BudgetChoice> budget;
  /// shardswap.host_memory: the host memory this machine's ranks may take together (absent, the
  /// machine's or its cgroup's); 0 in a config built in code: the machine's.
  std::int64_t host_memory = 0;
  /// shardswap.offload_threads was given; else engine.offload_threads is this machine's cores
  /// shared by the ranks on it (share_of_cores).
  bool offload_threads_given = false;
};

/// What a config is read for: a run (train, eval) opens its data; a plan opens none.
enum class ConfigFor { run, plan };
/// Reads every key of the run and checks it (batch sizes, schedule against the model's groups;
/// for a run, every data file, opened into TrainConfig::data) before anything is allocated;
/// unknown keys in ShardSwap's own sections are errors. Throws ConfigError naming the key and the
/// file. DeepSpeed keys that are not implemented are left for config_warnings(reader).
TrainConfig train_config_from_json(ConfigReader& reader, ConfigFor purpose = ConfigFor::run);

/// Bytes of one rank (rank 0, or the largest over ranks) before anything is allocated.
struct PlannedMemory {
  MemoryPlan engine;               ///< what the engine takes for the groups active at step 0
  std::int64_t activation = 0;     ///< the model's working memory (Tag::activation)
  std::int64_t total() const { return engine.total() + activation; }
  std::int64_t host_total() const { return engine.host_total(); }  ///< the engine's host memory
};
/// The plan of `rank` for the config's `model` (the engine's plan with the active set of step 0,
/// plus the model's activations), from the model's declarations: no Engine, nothing allocated.
PlannedMemory plan_memory(const TrainConfig& config, const RunModel& model, int rank);
/// `shardswap plan`: a table of predicted bytes by tag for every rank.
void print_plan(const TrainConfig& config, std::ostream& out);
/// Throws Error when the ranks in this process would need more host memory than the machine (or
/// its cgroup) has, by rank 0's plan (on the cpu backend all of it, on cuda the engine's host
/// memory): train and eval refuse such a model before anything is allocated, rather than end in
/// std::bad_alloc or the OOM killer gigabytes later.
void check_plan_fits(const TrainConfig& config, const PlannedMemory& rank0);

struct TrainSummary {
  double first_loss = 0.0;      ///< mean over ranks, first step
  double final_loss = 0.0;      ///< mean over ranks and over the last log interval
  double first_val_loss = 0.0;  ///< before the first step
  double final_val_loss = 0.0;  ///< after the last step
  std::int64_t steps = 0;       ///< the run's steps done, resumed ones included
  std::int64_t start_step = 0;  ///< the step this process resumed at (0: a fresh run)
  /// Resumed at or past `steps`: nothing was trained, evaluated or written.
  bool already_finished = false;
  std::int64_t skipped = 0;
  std::int64_t switches = 0;  ///< layer switches made
  double tokens_per_s = 0.0;  ///< tokens per second over all ranks, this run's steps 2..N
  /// This process ran one step: tokens_per_s is its rate, one-off work (allocation, warm-up)
  /// included.
  bool rate_of_first_step = false;
  std::int64_t predicted_bytes = 0;  ///< rank 0's plan (engine + activations), step 0's set
  std::int64_t peak_bytes = 0;       ///< rank 0's largest requested bytes over the run
  /// With timing: the share of step time spent in engine.step() (reduction, optimizer,
  /// all-gather) against the model's forward and backward; NaN otherwise.
  double engine_step_share = 0.0;
  double model_tflops = 0.0;  ///< with timing, on cuda: GEMM TFLOP/s of forward and backward
  /// With timing, on cuda: cuBLAS's rate for a GEMM of the model's largest shape (micro-batch x
  /// hidden x width), measured in the same run before training.
  double cublas_tflops = 0.0;
  /// With timing, on cuda: rank 0's seconds per step (steps 2..N) of the model's GPU phases
  /// (RankModel::take_phase_seconds), engine.step() and the host's part ("host and gaps").
  std::vector<std::pair<std::string, double>> phase_seconds;
  /// On cuda: the device memory rank 0's GPU lost between the start and step 1
  /// (cudaMemGetInfo) minus the plans of the ranks on it; 0 on the cpu.
  std::int64_t device_outside_plan_bytes = 0;
  /// The signal that stopped the run early (TrainOutput::stop_signal), 0 if it ran to the end.
  int stopped_by = 0;
  /// Where the stopped run saved its last step ("" if it ran to the end or has no checkpoint.dir).
  std::string stop_checkpoint;
};

class MetricsLog;  // tools/trainer/metrics_log.h

struct TrainOutput {
  std::ostream& log;
  /// One JSON object per step; train() calls its begin() with where it resumed, if it did,
  /// before the first step's line.
  MetricsLog* metrics = nullptr;
  std::ostream* report = nullptr;   ///< rank 0's memory report after build
  bool terminal = false;            ///< log is a terminal: a progress bar instead of lines
  int columns = 0;                  ///< its width (0: unknown)
  /// Asks the run to stop early: a signal number (the CLI's SIGINT, SIGTERM and SIGHUP handlers
  /// store theirs), 0 while it should go on. Read at the end of every step; the ranks agree
  /// (one all-reduce) so that all stop after the same step, which is finished, logged and, with
  /// checkpoint.dir set, saved before train() returns. Null: never asked, no all-reduce.
  const std::atomic<int>* stop_signal = nullptr;
};

/// Runs the training.
TrainSummary train(const TrainConfig& config, const TrainOutput& out);

struct EvalSummary {
  double val_loss = 0.0;     ///< mean over the eval batches
  int batches = 0;           ///< logging.eval_batches
  int sequences_per_batch = 0;  ///< the micro-batch
  std::int64_t step = -1;    ///< the checkpoint's step; -1: the initial weights
  ValLogits logits;          ///< validation batch 0's, when asked for
};
/// `shardswap eval`: the mean validation loss over logging.eval_batches micro-batches of the
/// weights of `checkpoint` (a checkpoint directory; empty: the config's initial weights, as
/// model.path or the seed gives them), on config.world_size in-process ranks.
/// With `logits`, also validation batch 0's inputs and logits (RankModel::val_logits).
EvalSummary evaluate(const TrainConfig& config, const std::filesystem::path& checkpoint,
                     bool logits = false);

/// The mean validation loss over validation batches [0, batches) of `data`, rank `rank` of
/// `world` evaluating batches rank, rank + world, ...: every sequence weighs the same (a partial
/// last batch by its sequences). A collective: every rank calls it.
double validation_loss(RankModel& model, Engine& engine, const RunData& data, int batches,
                       int rank, int world);

/// The data of a config read for a run (TrainConfig::data); Error for one read for a plan.
const RunData& data_of(const TrainConfig& config);

/// "SIGINT", "SIGTERM", "SIGHUP" (the signals the CLI stops on), else "a signal".
const char* stop_signal_name(int signal);

/// What train() runs its in-process ranks with: fn(rank, comm) on config.world_size threads over
/// one InProcessGroup on `backend`, with config.comm_timeout applied. As run_ranks: a rank that
/// throws aborts the group, and the root cause (the first error that is not a PeerFailure) is
/// rethrown once every thread has joined.
void run_in_process_ranks(const TrainConfig& config, const Backend& backend,
                          const std::function<void(int rank, Communicator& comm)>& fn);

}  // namespace shardswap
