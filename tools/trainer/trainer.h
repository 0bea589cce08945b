// One rank of `shardswap train` (Trainer) and what the ranks of one run share (TrainRun). train()
// (tools/trainer/train.cpp) sets the run up once, starts the ranks and makes a Trainer on each.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardswap/backend.h"
#include "shardswap/checkpoint.h"
#include "shardswap/communicator.h"
#include "shardswap/engine.h"
#include "trainer/progress.h"
#include "trainer/run_model.h"
#include "trainer/train.h"

namespace shardswap {

/// "12.34 MiB".
std::string mib(std::int64_t bytes);

/// A field of the trainer's state that it saves in a checkpoint's `extra` (step, updates): an
/// integer >= 0, or a ConfigError "DIR/metadata.json: extra.KEY ...". The library keeps `extra`
/// as the trainer gave it, so a checkpoint of another trainer (docs/api.md invites custom ones)
/// or an edited one reaches here with anything in it. Every rank calls this: a rank that threw
/// alone would leave the others in the next collective.
std::int64_t trainer_field(const LoadedCheckpoint& loaded, const std::filesystem::path& dir,
                           const char* key);

/// What rank 0 decides about checkpoints before the ranks start: the run's id (it ties what the
/// run writes to it: pruning deletes only its own) and, for checkpoint.load "latest", the
/// checkpoint found. The ranks of other processes are told (Trainer's constructor).
struct CheckpointChoice {
  std::string run_id;
  std::filesystem::path latest;    ///< "" when none was found or none was asked for
  std::vector<std::string> notes;  ///< what recovery and the scan found, for rank 0's log
};

/// What the ranks of one train() run share, set up before they start. Rank 0 alone writes the
/// summary and the outputs, under `mu` (the launcher's error lines take it too).
struct TrainRun {
  TrainRun(const TrainConfig& config, const TrainOutput& out, const RunModel& model,
           const RunData& data, const Backend& backend)
      : config(config), out(out), model(model), data(data), backend(backend) {}

  const TrainConfig& config;
  const TrainOutput& out;
  const RunModel& model;
  const RunData& data;  ///< opened once; every rank draws its micro-batches from it
  const Backend& backend;
  std::int64_t predicted_bytes = 0;  ///< rank 0's plan, step 0's active set
  double tokens_per_step = 0.0;      ///< over all ranks
  CheckpointChoice checkpoints;
  /// Rank 0's GPU and its free bytes before the run put anything there (cuda only): after step
  /// 1 what the process gained since is set against the plans of the ranks on that GPU.
  int rank0_device = 0;
  std::int64_t device_free_before = 0;
  /// On cuda: what rank 0's GPU held then (its total less device_free_before): this process's
  /// CUDA context and whatever else is on the GPU, counted against a device budget.
  std::int64_t device_held_before = 0;
  std::mutex mu;
  TrainSummary summary;
};

/// One rank of the run: its engine and model, the loop over the steps, and (rank 0) the log,
/// the progress display, the metrics lines and the summary.
class Trainer {
 public:
  /// Builds this rank's engine and model: a collective, every rank of the run makes its Trainer
  /// at the same time.
  Trainer(TrainRun& run, int rank, Communicator& comm, std::unique_ptr<Allocator> allocator);
  /// From step 0 or the resumed checkpoint's step to config.steps, or until a stop signal ends
  /// the run after a step (saved, with checkpoint.dir).
  void run();

 private:
  struct Step;  // what one step did, for the reports and the save after it

  void open_log();
  /// Under a device budget, on cuda after step 1: what the GPU holds outside the plan against
  /// shardswap.device_reserve, said, with a warning when it is more.
  void check_reserve(std::int64_t step, std::int64_t plan_on_gpu);
  void measure_cublas();
  void resume();
  void begin_training();
  double validate();
  std::optional<SwitchReport> switch_layers(std::int64_t step);
  Step train_step(std::int64_t step);
  bool stop_asked();
  void account(std::int64_t step, const Step& s);
  void refuse_skips(std::int64_t step, const Step& s);
  void report(std::int64_t step, const Step& s);
  nlohmann::json metrics_line(std::int64_t step, const Step& s) const;
  bool saves_after(std::int64_t step, bool stopping) const;
  void save(std::int64_t step, bool stopping);
  void stop(std::int64_t step);
  void finish();
  void say(const std::string& text);

  TrainRun& run_;
  const TrainConfig& config_;
  const int rank_;
  const int world_;
  const CheckpointChoice checkpoints_;  // this rank's copy: rank 0's, over processes too
  MemorySpace space_;
  Engine engine_;
  std::unique_ptr<RankModel> model_;
  std::optional<ProgressReporter> progress_;  // rank 0's
  std::int64_t planned_ = 0;  // the plan of the active set: changes when a switch changes it
  std::int64_t updates_ = 0;
  int skips_in_row_ = 0;      // steps skipped since the last applied one  // applied optimizer steps: the lr schedule's clock
  // Resuming: the engine's state from the checkpoint; the schedule's position and the data's are
  // pure functions of the step, so the step and the update count are all the loop needs.
  std::int64_t start_ = 0;
  std::filesystem::path resume_from_;
  std::optional<CheckpointParent> parent_;
  std::filesystem::path stop_checkpoint_;  // the checkpoint saved on a stop signal, if any
  // Rank 0's sums for the summary: the loss over the log interval, and the times of the steps
  // after the first (which carries one-off work: allocation, cuBLAS warm-up).
  double interval_loss_ = 0.0;
  int interval_steps_ = 0;
  double timed_seconds_ = 0.0, model_seconds_ = 0.0, engine_seconds_ = 0.0, first_seconds_ = 0.0;
  std::chrono::steady_clock::time_point step_clock_;  // where the next step's seconds start
};

}  // namespace shardswap
