#include "trainer/trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>

#include "shardswap/error.h"
#include "shardswap/nccl.h"
#include "model/cublas_rate.h"
#include "trainer/metrics_log.h"
#include "trainer/process_launch.h"

namespace shardswap {

namespace {

using Phases = std::vector<std::pair<std::string, double>>;

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Over processes, rank 0's choice for every rank (a collective); in-process ranks share it.
CheckpointChoice checkpoints_of_rank0(const TrainRun& run, Communicator& comm) {
  CheckpointChoice choice = run.checkpoints;
  if (run.config.process) {
    choice.latest = text_of_rank0(comm, choice.latest.string());
    choice.run_id = text_of_rank0(comm, choice.run_id);
  }
  return choice;
}

// "in-process", "nccl", "mpi, a process per rank", ...: the start-up line's part.
const char* comm_description(const TrainConfig& config) {
  if (config.process)
    return config.comm == CommKind::nccl ? "nccl over mpi, a process per rank"
                                         : "mpi, a process per rank";
  return config.comm == CommKind::nccl ? "nccl" : "in-process";
}

}  // namespace

std::string mib(std::int64_t bytes) {
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / 1048576.0);
}

std::int64_t trainer_field(const LoadedCheckpoint& loaded, const std::filesystem::path& dir,
                           const char* key) {
  const std::string file = (dir / "metadata.json").string();
  const auto it = loaded.extra.find(key);
  if (it == loaded.extra.end())
    throw ConfigError(
        fmt::format("{}: extra.{}: missing; not a checkpoint that shardswap train "
                    "wrote (it saves extra.step and extra.updates)",
                    file, key));
  if (!it->is_number_integer() || (!it->is_number_unsigned() && it->get<std::int64_t>() < 0) ||
      (it->is_number_unsigned() && it->get<std::uint64_t>() > INT64_MAX)) {
    // Decoded strings may hold any bytes: shown with replacement characters.
    const auto shown = it->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    throw ConfigError(fmt::format("{}: extra.{} = {}: must be an integer >= 0", file, key,
                                  shown.size() > 64 ? shown.substr(0, 64) + "..." : shown));
  }
  return it->get<std::int64_t>();
}

struct Trainer::Step {
  std::optional<SwitchReport> switched;
  StepResult result;
  double loss = 0.0;        // the mean over ranks
  double model_s = 0.0;     // the model's forward and backward
  double engine_s = 0.0;    // engine.step()
  double seconds = 0.0;     // the whole step, validation included
  Phases phases;            // the model's GPU phases, engine.step() and the rest (timing, cuda)
  bool stopping = false;    // a stop signal ends the run after this step
  bool evaluating = false;  // validated after this step
  bool no_targets = false;  // the global batch counts no target: nothing run, nothing updated
  double val = 0.0;
  MemoryStats mem;
  MemoryStats host;  // the engine's host memory (state placed there, or kept under keep_host)
  std::int64_t plan_on_gpu = 0;  // the plans of every rank on rank 0's GPU (first step, cuda)
};

Trainer::Trainer(TrainRun& run, int rank, Communicator& comm, std::unique_ptr<Allocator> allocator)
    : run_(run),
      config_(run.config),
      rank_(rank),
      world_(run.config.world_size),
      checkpoints_(checkpoints_of_rank0(run, comm)),
      space_(rank, std::move(allocator)),
      // Under a device budget a rank holds no more than its share, as on a GPU of the budget's
      // size: capped before the engine allocates anything.
      engine_(config_.engine, comm, cap_to_budget(space_, config_.budget), run.backend),
      planned_(run.predicted_bytes) {
  run_.model.declare(engine_);
  if (!config_.decay_all_params)
    for (const auto& name : run_.model.no_decay_params()) engine_.set_param_weight_decay(name, 0.0);
  // Rank 0's values are broadcast to every rank by build: the others need not draw them.
  engine_.build(rank_ == 0 ? run_.model.initial_values()
                           : WeightInit([](const ParamInfo&, std::span<float>) {}),
                config_.schedule->active_at(0));
  model_ = run_.model.make_rank_model(config_.batches.micro_samples, config_.engine.dtype, space_);
  // With timing on a GPU, rank 0's model times its phases (CUDA events; the split printed at
  // the end and in each metrics line).
  if (rank_ == 0 && config_.timing && space_.device() == DeviceKind::cuda)
    model_->time_phases(true);
}

void Trainer::run() {
  open_log();
  measure_cublas();
  resume();
  if (start_ >= config_.steps) {  // resuming a finished run: nothing is evaluated or written
    if (rank_ == 0) {
      std::lock_guard lock(run_.mu);
      run_.summary.already_finished = true;
      run_.summary.steps = start_;
      progress_->finish();
    }
    return;
  }
  begin_training();
  step_clock_ = std::chrono::steady_clock::now();
  for (std::int64_t step = start_; step < config_.steps; ++step) {
    const Step s = train_step(step);
    // Rank 0's reports of the step, its metrics line first: a checkpoint of the step is saved
    // only after its line is in the file, so a kill between the two never leaves a resume
    // point the metrics have not reached.
    if (rank_ == 0) report(step, s);
    refuse_skips(step, s);
    if (saves_after(step, s.stopping)) {
      save(step, s.stopping);
      step_clock_ = std::chrono::steady_clock::now();  // a save is no step's time
    }
    if (s.stopping) {
      stop(step);
      break;
    }
  }
  finish();
}

void Trainer::say(const std::string& text) {
  if (rank_ != 0) return;
  std::lock_guard lock(run_.mu);
  progress_->message(text);
}

// Rank 0: the start-up lines, the memory report and the progress display.
void Trainer::open_log() {
  if (rank_ != 0) return;
  std::lock_guard lock(run_.mu);
  const TrainOutput& out = run_.out;
  const int micro = config_.batches.micro_samples;
  out.log << fmt::format(
      "shardswap train: {} ({} groups); world size {} ({}, {}), ZeRO stage {}, {}, {}; "
      "batch {} = {} x {} x {}; {}\n",
      run_.model.describe(run_.backend.kind()), engine_.groups().size(), world_,
      run_.backend.name(),
      comm_description(config_), config_.engine.stage, dtype_name(config_.engine.dtype),
      optimizer_type_name(config_.engine.optimizer.type), config_.batches.train_samples, micro,
      config_.batches.gradient_accumulation_steps, world_, run_.data.describe());
  if (run_.data.documents_apart())
    if (const std::string how = run_.model.documents_apart_attention(run_.backend.kind(), micro);
        !how.empty())
      out.log << "documents apart: attention through " << how << " (docs/data.md)\n";
  if (config_.budget)
    for (const auto& line : config_.budget->lines()) out.log << line << "\n";
  const LayerSchedule& schedule = *config_.schedule;
  if (schedule.enabled())
    out.log << fmt::format("layer switching: {} every {} steps, policy {}; active now: {}\n",
                           switching_type_name(schedule.config().type), schedule.config().interval,
                           deactivate_policy_name(schedule.policy()),
                           fmt::join(engine_.active_groups(), ", "));
  if (out.report) *out.report << engine_.memory_report();
  progress_.emplace(out.log, ProgressOptions{.total_steps = config_.steps,
                                             .terminal = out.terminal,
                                             .interval = config_.log_interval,
                                             .columns = out.columns,
                                             .throughput_unit = "tokens/s"});
}

// With timing on a GPU, rank 0 measures cuBLAS's rate for the model's reference GEMM: the
// yardstick of the model's own rate in the summary.
void Trainer::measure_cublas() {
  if (rank_ != 0 || !config_.timing || space_.device() != DeviceKind::cuda) return;
  const auto gemm = run_.model.reference_gemm(config_.batches.micro_samples);
  const double rate =
      measure_cublas_gemm_tflops(gemm.at(0), gemm.at(1), gemm.at(2), config_.engine.dtype);
  std::lock_guard lock(run_.mu);
  run_.summary.cublas_tflops = rate;
  progress_->message(fmt::format("cuBLAS {} GEMM {} x {} x {}: {:.1f} TFLOP/s",
                                 dtype_name(config_.engine.dtype), gemm.at(0), gemm.at(1),
                                 gemm.at(2), rate));
}

void Trainer::resume() {
  for (const auto& note : checkpoints_.notes) say(note);
  const CheckpointConfig& checkpoint = config_.checkpoint;
  resume_from_ =
      checkpoint.load == "latest" ? checkpoints_.latest : std::filesystem::path(checkpoint.load);
  if (!resume_from_.empty()) {
    const LoadedCheckpoint loaded = load_checkpoint(engine_, resume_from_);
    start_ = trainer_field(loaded, resume_from_, "step");
    parent_ = CheckpointParent{loaded.run_id, start_};
    updates_ = trainer_field(loaded, resume_from_, "updates");
    planned_ =
        engine_.plan().total() + run_.model.activation_bytes(config_.batches.micro_samples,
                                                             config_.engine.dtype, space_.device());
    say(fmt::format("resumed from {} (saved at world size {}): step {}, {} updates",
                    resume_from_.string(), loaded.world_size, start_, updates_));
    if (config_.schedule->enabled())
      say(fmt::format("active after the resume: {}", fmt::join(engine_.active_groups(), ", ")));
  } else if (checkpoint.load == "latest") {
    say(fmt::format("no checkpoint under {} yet: starting at step 0", checkpoint.dir));
  }
  if (rank_ == 0) run_.summary.start_step = start_;
}

// Validation of the weights training starts from (the fresh model's, or the resumed
// checkpoint's), then the metrics' start.
void Trainer::begin_training() {
  const double val = validate();
  say(start_ == 0 ? fmt::format("validation loss before training: {:.4f}", val)
                  : fmt::format("validation loss at step {} (resumed): {:.4f}", start_, val));
  if (rank_ == 0) run_.summary.first_val_loss = val;
  if (rank_ == 0 && run_.out.metrics) {  // before the first step's line: a resume appends
    std::lock_guard lock(run_.mu);
    run_.out.metrics->begin(resume_from_.empty()
                                ? std::nullopt
                                : std::optional<ResumePoint>(ResumePoint{start_, resume_from_}));
  }
  space_.reset_peaks();
  engine_.reset_host_peaks();
}

double Trainer::validate() {
  return validation_loss(*model_, engine_, run_.data, config_.eval_batches, rank_, world_);
}

std::optional<SwitchReport> Trainer::switch_layers(std::int64_t step) {
  const LayerSchedule& schedule = *config_.schedule;
  if (step == 0 || !schedule.boundary(step)) return std::nullopt;
  const auto wanted = schedule.active_at(step);
  if (wanted == engine_.active_groups()) return std::nullopt;
  std::optional<SwitchReport> switched = engine_.set_active(wanted, schedule.policy());
  planned_ =
      engine_.plan().total() + run_.model.activation_bytes(config_.batches.micro_samples,
                                                           config_.engine.dtype, space_.device());
  // The check after this step compares the plan of the new active set with what is held from
  // here on: a window from before the switch would include the bytes of the groups it let go (a
  // false excess after a switch that shrinks the set).
  space_.reset_peaks();
  engine_.reset_host_peaks();
  return switched;
}

// Every rank's part of a step: the switch due before it, forward and backward of its
// micro-batches, engine.step(), the collectives every rank takes part in (the loss, the stop
// decision, validation, the GPU's plans) and the measurements rank 0 reports.
Trainer::Step Trainer::train_step(std::int64_t step) {
  Step s;
  const auto started = std::chrono::steady_clock::now();
  s.switched = switch_layers(step);
  engine_.set_lr(config_.lr.lr_at(updates_));
  const int accumulation = config_.batches.gradient_accumulation_steps;
  // The step's loss is the mean over every counted target of the global batch, whatever the
  // world size and micro-batch split: micro-batch m's mean over its n_m counted targets weighs
  // n_m * world * accumulation / N (Engine::step divides by world * accumulation). Without a
  // loss mask every weight is exactly 1.
  const auto counted = static_cast<double>(run_.data.step_targets(step));
  // A global batch whose mask counts no target has no loss to take the mean of: no forward, no
  // backward and no update (AdamW would still move the weights by its moments and decay). Every
  // rank counts the same global batch, so all skip the same steps; the step is reported skipped.
  s.no_targets = counted == 0.0;
  double loss = 0.0;
  for (int m = 0; m < accumulation && !s.no_targets; ++m) {
    TokenSequences batch = run_.data.train_micro(step, rank_, world_, m);
    const double weight =
        counted == 0.0
            ? 0.0
            : static_cast<double>(batch.counted_targets()) * world_ * accumulation / counted;
    loss += model_->train_micro(engine_, std::move(batch), weight) * weight;
  }
  loss /= accumulation;
  if (config_.timing) run_.backend.synchronize();
  s.model_s = seconds_since(started);
  const auto stepping = std::chrono::steady_clock::now();
  if (s.no_targets)
    s.result.loss_scale = engine_.loss_scale();  // not applied, nothing else changed
  else
    s.result = engine_.step();
  if (config_.timing) run_.backend.synchronize();
  s.engine_s = seconds_since(stepping);
  if (s.result.applied) ++updates_;
  // The model's GPU phases of this step, then engine.step() and what is left of the model's
  // wall time: the host's launches and waits the GPU phases do not cover.
  s.phases = model_->take_phase_seconds();
  if (!s.phases.empty()) {
    double gpu = 0.0;
    for (const auto& p : s.phases) gpu += p.second;
    s.phases.emplace_back("engine.step()", s.engine_s);
    s.phases.emplace_back("host and gaps", std::max(0.0, s.model_s - gpu));
  }
  s.loss = engine_.sum_across_ranks(loss) / world_;
  s.stopping = stop_asked();
  // The last step of a stopped run is evaluated as the last one of a finished run is.
  s.evaluating = (step + 1) % config_.eval_interval == 0 || step + 1 == config_.steps || s.stopping;
  if (s.evaluating) s.val = validate();
  // With one rank nothing above waits for the update (sum_across_ranks has no other rank to wait
  // for): the host goes on to the next step's batch and launches while the GPU ends this step.
  // So a step's seconds run from the end of the step before (the reports between steps
  // included) to its own end, and the GPU is waited for wherever the run's time is read after
  // it: the last step, one the run stops after or saves after.
  if (step + 1 == config_.steps || s.stopping || saves_after(step, s.stopping))
    run_.backend.synchronize();
  const auto ended = std::chrono::steady_clock::now();
  s.seconds = std::chrono::duration<double>(ended - step_clock_).count();
  step_clock_ = ended;
  s.mem = engine_.memory_stats();
  s.host = engine_.host_memory_stats();
  // The plans of every rank on rank 0's GPU (in-process ranks share it; over NCCL a rank has a
  // GPU of its own): a collective, so every rank computes it, on the same step.
  if (step == start_ && space_.device() == DeviceKind::cuda)
    s.plan_on_gpu =
        config_.comm == CommKind::nccl
            ? planned_
            : static_cast<std::int64_t>(engine_.sum_across_ranks(static_cast<double>(planned_)));
  return s;
}

// Skipped steps in a row past shardswap.max_consecutive_skips end the run before the step is
// saved: a run that updates nothing (a NaN weight, inputs the model cannot take) fails instead of
// running to its end and saving checkpoints of it. Every rank sees the same result and the same
// loss (both global), so all throw at the same step.
void Trainer::refuse_skips(std::int64_t step, const Step& s) {
  skips_in_row_ = s.result.applied ? 0 : skips_in_row_ + 1;
  if (config_.max_consecutive_skips == 0 || skips_in_row_ < config_.max_consecutive_skips) return;
  std::string cause;
  if (s.no_targets)
    cause = "no target of the global batch is under the loss mask (the token files' mask "
            "leaves the loss on none of these windows)";
  else if (!std::isfinite(s.loss))
    cause = fmt::format("the loss itself is {} (the forward pass: a weight or an input that is "
                        "not finite, or an overflow)", s.loss);
  else if (config_.engine.dtype == DType::f16)
    cause = fmt::format("the gradients overflow at every loss scale down to {} (fp16)",
                        s.result.loss_scale);
  else
    cause = fmt::format("the gradients are not finite (norm {}) though the loss is {:.6g}",
                        std::isnan(s.result.grad_norm) ? "NaN" : "Inf", s.loss);
  throw Error(fmt::format(
      "step {}: {} steps in a row skipped (shardswap.max_consecutive_skips = {}): {}; stopping "
      "without saving the step",
      step + 1, skips_in_row_, config_.max_consecutive_skips, cause));
}

// Stop after this step? Every rank adds what it saw, so all decide alike even when the signal
// lands between two ranks' reads; the flag never returns to 0, so after the sum every rank
// reads a signal from it.
bool Trainer::stop_asked() {
  const std::atomic<int>* signal = run_.out.stop_signal;
  return signal != nullptr && engine_.sum_across_ranks(signal->load() != 0 ? 1.0 : 0.0) > 0.0;
}

// Rank 0: the step into the summary's counts, losses and times.
void Trainer::account(std::int64_t step, const Step& s) {
  TrainSummary& summary = run_.summary;
  if (step == start_) {
    summary.first_loss = s.loss;
    first_seconds_ = s.seconds;
  }
  if (step > start_) {  // the first step carries one-off work (allocation, cuBLAS warm-up)
    timed_seconds_ += s.seconds;
    model_seconds_ += s.model_s;
    engine_seconds_ += s.engine_s;
    if (summary.phase_seconds.empty())
      summary.phase_seconds = s.phases;
    else
      for (std::size_t i = 0; i < s.phases.size(); ++i)
        summary.phase_seconds[i].second += s.phases[i].second;
  }
  summary.steps = step + 1;
  summary.skipped += s.result.applied ? 0 : 1;
  summary.switches += s.switched ? 1 : 0;
  summary.peak_bytes = std::max(summary.peak_bytes, s.mem.requested.peak);
  if (s.evaluating) summary.final_val_loss = s.val;
  if (!s.no_targets) {  // a step without targets has no loss to average in
    interval_loss_ += s.loss;
    ++interval_steps_;
  }
  if (((step + 1) % config_.log_interval == 0 || step + 1 == config_.steps || s.stopping) &&
      interval_steps_ > 0) {
    summary.final_loss = interval_loss_ / interval_steps_;
    interval_loss_ = 0.0;
    interval_steps_ = 0;
  }
}

// Rank 0: the step's progress messages, metrics line and progress update.
void Trainer::report(std::int64_t step, const Step& s) {
  std::lock_guard lock(run_.mu);
  account(step, s);
  const SwitchReport* sw = s.switched ? &*s.switched : nullptr;
  if (sw)
    progress_->message(
        fmt::format("switch before step {}: in [{}] out [{}], {} freed, {} allocated, {:.3f} ms",
                    step + 1, fmt::join(sw->activated, ", "), fmt::join(sw->deactivated, ", "),
                    mib(sw->bytes_freed), mib(sw->bytes_allocated), sw->seconds * 1e3));
  if (step == start_ || sw) {
    const auto peak = s.mem.requested.peak;
    progress_->message(fmt::format(
        "memory of rank 0 after step {}: predicted {}, measured peak {} ({:+.3f}%)", step + 1,
        mib(planned_), mib(peak), 100.0 * static_cast<double>(peak - planned_) / planned_));
    const std::int64_t host_planned = engine_.plan().host_total();
    if (host_planned > 0 || s.host.requested.peak > 0)
      progress_->message(fmt::format(
          "host memory of rank 0 after step {}: predicted {}, measured peak {} ({:+.3f}%)",
          step + 1, mib(host_planned), mib(s.host.requested.peak),
          host_planned > 0 ? 100.0 * static_cast<double>(s.host.requested.peak - host_planned) /
                                 static_cast<double>(host_planned)
                           : 0.0));
    space_.reset_peaks();  // the next report measures from here
    engine_.reset_host_peaks();
  }
  if (step == start_ && space_.device() == DeviceKind::cuda) {
    const int device = run_.rank0_device;
    const std::int64_t gained =
        run_.device_free_before - static_cast<std::int64_t>(cuda_device_memory(device).free);
    run_.summary.device_outside_plan_bytes = gained - s.plan_on_gpu;
    progress_->message(fmt::format(
        "GPU {} after step {}: the process took {} since its CUDA context was made, the "
        "plan{} is {}: {} outside it (NCCL, cuBLAS's own state, kernel code)",
        device, step + 1, mib(gained),
        world_ > 1 && config_.comm != CommKind::nccl
            ? " of its " + std::to_string(world_) + " ranks"
            : "",
        mib(s.plan_on_gpu), mib(run_.summary.device_outside_plan_bytes)));
    if (config_.budget) check_reserve(step, s.plan_on_gpu);
  }
  if (s.evaluating)
    progress_->message(fmt::format("validation loss after step {}: {:.4f}", step + 1, s.val));
  const double tokens_per_s = run_.tokens_per_step / s.seconds;
  if (run_.out.metrics) run_.out.metrics->write(step + 1, metrics_line(step, s));
  progress_->update({.step = step + 1,
                     .loss = s.no_targets ? std::nan("") : s.loss,
                     .throughput = tokens_per_s,
                     .memory_bytes = s.mem.requested.current});
}

void Trainer::check_reserve(std::int64_t step, std::int64_t plan_on_gpu) {
  // What the GPU held before the run (its CUDA context; anything else there) and what the
  // process took outside the plan since: on a GPU of the budget's size all of it counts.
  const DeviceBudget& b = config_.budget->budget;
  const std::int64_t outside = run_.device_held_before + run_.summary.device_outside_plan_bytes;
  progress_->message(fmt::format(
      "device budget {}: held outside the plan {} ({} before the run: the CUDA context and "
      "anything else on the GPU; {} since), shardswap.device_reserve {}",
      b.memory_text, mib(outside), mib(run_.device_held_before),
      mib(run_.summary.device_outside_plan_bytes), mib(b.reserve)));
  if (outside > b.reserve)
    progress_->message(fmt::format(
        "warning: after step {} the GPU holds {} outside the plan, more than the {} "
        "shardswap.device_reserve counts: with the plan's {} that is {}, {} the budget of {}; "
        "set shardswap.device_reserve to at least {} bytes so that the plan is made for what "
        "a GPU of the budget's size has left",
        step + 1, mib(outside), mib(b.reserve), mib(plan_on_gpu), mib(plan_on_gpu + outside),
        plan_on_gpu + outside > b.memory ? "past" : "within", b.memory_text, outside));
}

nlohmann::json Trainer::metrics_line(std::int64_t step, const Step& s) const {
  const StepResult& r = s.result;
  nlohmann::json line = {
      {"step", step + 1},         {"loss", s.loss},
      {"lr", engine_.lr()},       {"loss_scale", r.loss_scale},
      {"grad_norm", r.grad_norm}, {"clip_coef", r.clip_coef},
      {"skipped", !r.applied},    {"tokens_per_s", run_.tokens_per_step / s.seconds},
      {"step_seconds", s.seconds}};
  if (s.no_targets) {  // no loss to report: null, as plot and TensorBoard read a missing value
    line["loss"] = nullptr;
    line["no_targets"] = true;
  }
  if (!std::isfinite(r.grad_norm)) line["grad_norm"] = nullptr;  // JSON has no Inf
  if (s.evaluating) line["val_loss"] = s.val;
  // The validation loss before training, on a fresh run's first line.
  if (step == 0) line["initial_val_loss"] = run_.summary.first_val_loss;
  if (!s.phases.empty()) {
    nlohmann::json split;
    for (const auto& [name, seconds] : s.phases) split[name] = seconds;
    line["phase_seconds"] = split;
  }
  nlohmann::json memory;
  for (Tag t : kAllTags) memory[tag_name(t)] = s.mem.tag(t).requested.current;
  memory["total"] = s.mem.requested.current;
  memory["peak"] = s.mem.requested.peak;
  line["memory_bytes"] = memory;
  if (s.host.requested.peak > 0) {  // the same for the engine's host memory, where it holds any
    nlohmann::json host;
    for (Tag t : kAllTags) host[tag_name(t)] = s.host.tag(t).requested.current;
    host["total"] = s.host.requested.current;
    host["peak"] = s.host.requested.peak;
    line["host_memory_bytes"] = host;
  }
  // The driver's view of the GPU (cudaMemGetInfo, the whole device: what a soak watches for
  // leaks the engine's own counts cannot see), on the same steps as the progress lines. Rank 0's
  // GPU is its thread's current device: the model and the allocator make it current at each call.
  const bool sampled =
      step == start_ || (step + 1) % config_.log_interval == 0 || step + 1 == config_.steps;
  if (sampled && space_.device() == DeviceKind::cuda) {
    const DeviceMemory device = cuda_device_memory(cuda_current_device());
    line["device_free_bytes"] = device.free;
    line["device_total_bytes"] = device.total;
  }
  line["active_groups"] = engine_.active_groups();
  if (s.switched)
    line["switch"] = {{"in", s.switched->activated},
                      {"out", s.switched->deactivated},
                      {"bytes_freed", s.switched->bytes_freed},
                      {"bytes_allocated", s.switched->bytes_allocated},
                      {"seconds", s.switched->seconds}};
  return line;
}

// Every checkpoint.every steps and after the last, and after the step a stop signal ends the run
// on (with checkpoint.dir).
bool Trainer::saves_after(std::int64_t step, bool stopping) const {
  const CheckpointConfig& c = config_.checkpoint;
  return (c.every > 0 && ((step + 1) % c.every == 0 || step + 1 == config_.steps)) ||
         (stopping && !c.dir.empty());
}

void Trainer::save(std::int64_t step, bool stopping) {
  SaveOptions options;
  options.extra = run_.model.checkpoint_extra(config_.engine.dtype);
  options.extra.update({{"step", step + 1}, {"updates", updates_}, {"seed", config_.seed}});
  options.config = config_.source;
  options.run_id = checkpoints_.run_id;
  options.parent = parent_;
  const std::filesystem::path dir = config_.checkpoint.dir;
  const auto path =
      save_checkpoint(engine_, dir / checkpoint_name(step + 1), options);  // collective
  if (rank_ == 0) prune_checkpoints(dir, config_.checkpoint.keep, checkpoints_.run_id);
  say(fmt::format("checkpoint saved: {}", path.string()));
  if (stopping) stop_checkpoint_ = path;
}

void Trainer::stop(std::int64_t step) {
  if (rank_ != 0) return;
  std::lock_guard lock(run_.mu);
  TrainSummary& summary = run_.summary;
  summary.stopped_by = run_.out.stop_signal->load();
  summary.stop_checkpoint = stop_checkpoint_.string();
  progress_->message(fmt::format(
      "stopping on {} (signal {}) after step {} of {}: {}", stop_signal_name(summary.stopped_by),
      summary.stopped_by, step + 1, config_.steps,
      summary.stop_checkpoint.empty() ? "no checkpoint (checkpoint.dir is not set)"
                                      : "checkpoint saved: " + summary.stop_checkpoint));
}

// Rank 0: the rates of the summary, over the steps after the first (or of the one step run).
void Trainer::finish() {
  if (rank_ != 0) return;
  std::lock_guard lock(run_.mu);
  TrainSummary& summary = run_.summary;
  progress_->finish();
  const auto timed_steps = static_cast<double>(summary.steps - start_ - 1);  // after the first
  if (timed_steps > 0) {
    summary.tokens_per_s = run_.tokens_per_step * timed_steps / timed_seconds_;
    for (auto& p : summary.phase_seconds) p.second /= timed_steps;
    summary.engine_step_share = config_.timing
                                    ? engine_seconds_ / (engine_seconds_ + model_seconds_)
                                    : std::numeric_limits<double>::quiet_NaN();
    if (config_.timing && space_.device() == DeviceKind::cuda && !config_.schedule->enabled())
      summary.model_tflops = run_.model.micro_flops(config_.batches.micro_samples) *
                             config_.batches.gradient_accumulation_steps * timed_steps /
                             model_seconds_ / 1e12;
  } else if (summary.steps > start_) {  // one step this run: its rate, warm-up and all
    summary.tokens_per_s = run_.tokens_per_step / first_seconds_;
    summary.rate_of_first_step = true;
    summary.engine_step_share = std::numeric_limits<double>::quiet_NaN();
  }
}

}  // namespace shardswap
