#include "trainer/train.h"
#include "support/quoted.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <exception>
#include <iostream>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>


#include "shardswap/backend.h"
#include "shardswap/checkpoint.h"
#include "shardswap/checkpoint_dir.h"
#include "shardswap/config_json.h"
#include "shardswap/error.h"
#include "shardswap/nccl.h"
#include "model/hf_config.h"
#include "trainer/run_model.h"
#include "trainer/trainer.h"

namespace shardswap {

namespace {

CommKind comm_kind_from_name(ConfigReader& c, const std::string& name) {
  if (name == "in_process") return CommKind::in_process;
  if (name == "nccl") return CommKind::nccl;
  c.fail("shardswap.communicator", quote_value(name), "expected in_process or nccl");
}

// shardswap.backend, checked by spelling only: whether the GPU exists is known when a run opens
// it, and `plan` must work for a GPU config on a machine without one.
BackendChoice backend_choice_from_name(ConfigReader& c, const std::string& name) {
  if (name == "cpu") return {DeviceKind::host, -1, name};
  if (name == "cuda") return {DeviceKind::cuda, 0, name};
  const auto digits = name.rfind("cuda:", 0) == 0 ? name.substr(5) : "";
  if (digits.empty() || digits.size() > 4 ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    c.fail("shardswap.backend", quote_value(name), "expected cpu, cuda or cuda:N");
  return {DeviceKind::cuda, std::stoi(digits), name};
}

// shardswap.backend, .communicator and .comm_timeout_s: where the ranks run and how they talk.
void read_devices(ConfigReader& c, TrainConfig& t) {
  t.backend = backend_choice_from_name(c, c.string("shardswap.backend", "cpu"));
  t.comm = comm_kind_from_name(c, c.string("shardswap.communicator", "in_process"));
  if (t.comm == CommKind::nccl && t.backend.kind == DeviceKind::host)
    c.fail("shardswap.communicator", "\"nccl\"", "needs shardswap.backend = \"cuda\"");
  constexpr double kMaxCommTimeoutS = 1e7;  // 115 days: anything longer is a mistake
  const double timeout_s = c.number("shardswap.comm_timeout_s", 0.0);
  if (!(timeout_s >= 0.0 && timeout_s <= kMaxCommTimeoutS))
    c.fail(
        "shardswap.comm_timeout_s", fmt::format("{}", timeout_s),
        fmt::format("must lie in [0, {:g}] seconds (0 or absent waits forever)", kMaxCommTimeoutS));
  // Rounded up, so that a small positive timeout never becomes 0 (forever).
  t.comm_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(timeout_s * 1e3)));
}

}  // namespace

void check_plan_fits(const TrainConfig& config, const PlannedMemory& rank0) {
  // On the cpu backend every rank of this process holds its buffers in host memory; on cuda
  // the devices' part is their allocator's to refuse, and the engine's host memory is checked.
  const std::int64_t per_rank =
      rank0.host_total() + (config.backend.kind == DeviceKind::host ? rank0.total() : 0);
  if (per_rank == 0) return;
  const bool given = config.host_memory > 0;
  const std::int64_t memory = given ? config.host_memory : machine_memory_bytes();
  const int ranks = config.process ? 1 : config.world_size;
  // Ranks hold near-equal shares; in doubles, so that no product overflows.
  const double needed = static_cast<double>(per_rank) * ranks;
  if (memory <= 0 || needed <= static_cast<double>(memory)) return;
  throw Error(fmt::format(
      "the plan needs {:.1f} GiB of host memory ({} on rank 0 x {} rank{} in this process; "
      "`shardswap plan` lists it by tag), more than the {:.1f} GiB {}: refused "
      "before anything is allocated",
      needed / 1073741824.0, mib(per_rank), ranks, ranks == 1 ? "" : "s",
      static_cast<double>(memory) / 1073741824.0,
      given ? "it may take (shardswap.host_memory)" : "this machine has"));
}

namespace {

// The run's data, every file opened and checked once (a run without validation data is refused).
std::shared_ptr<const RunData> open_run_data(ConfigReader& c, const TrainConfig& t) {
  try {
    auto data = std::make_shared<const RunData>(t.data_spec, t.batches.train_samples,
                                                t.batches.micro_samples);
    if (!data->has_val())
      c.fail("data.val", "no validation set: give data.val (or data.tokenizer \"bytes\")");
    return data;
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);
  }
}

// logging.eval_batches: a count of batches, or "all": the batches of micro-batch size that cover
// the validation set, the last one maybe partial. Never past the set: batches that wrapped
// around it would count its samples twice. A plan (no data open) takes a count as given and
// "all" as 0.
template <class Positive>
int read_eval_batches(ConfigReader& c, const TrainConfig& t, const Positive& positive) {
  const char* key = "logging.eval_batches";
  const std::int64_t held = t.data ? t.data->val_batches() : 0;
  const nlohmann::json::json_pointer at("/logging/eval_batches");
  if (c.json().contains(at) && c.json().at(at).is_string()) {
    const std::string all = c.string(key, "");
    if (all != "all") c.fail(key, quote_value(all), "expected a count of batches or \"all\"");
    return static_cast<int>(std::min<std::int64_t>(held, 1 << 30));
  }
  const auto n = positive(key, 4, 1 << 20);
  if (t.data && n > held)
    c.fail(key, fmt::format("{}", n),
           fmt::format("the validation set's {} sequences make {} batch{} of up to {} (the "
                       "micro-batch); give at most {}, or \"all\": a batch past the set would "
                       "count its sequences twice",
                       t.data->val_samples(), held, held == 1 ? "" : "es",
                       t.batches.micro_samples, held));
  return static_cast<int>(n);
}

}  // namespace

std::vector<std::filesystem::path> run_input_files(const TrainConfig& t) {
  // The token files by name alone: the run's data (open_run_data) has opened and scanned them.
  std::vector<std::filesystem::path> files;
  for (const auto& f : token_data_files(t.data_spec)) files.emplace_back(f);
  for (auto& f : t.model->input_files()) files.push_back(std::move(f));
  return files;
}

TrainConfig train_config_from_json(ConfigReader& c, ConfigFor purpose) {
  TrainConfig t;
  const auto positive = [&](std::string_view key, std::int64_t fallback, std::int64_t max) {
    const auto v = c.integer(key, fallback);
    if (v < 1 || v > max)
      c.fail(key, fmt::format("{}", v), fmt::format("must lie in [1, {}]", max));
    return v;
  };
  // --strict sets it (tools/cli/main.cpp): every warning below becomes an error, at the end.
  const bool strict = c.boolean("shardswap.strict", false);
  t.world_size = static_cast<int>(positive("world_size", 1, 1024));
  t.batches = resolve_batch_sizes(c, t.world_size);
  t.steps = positive("steps", 100, std::int64_t{1} << 40);
  t.seed = static_cast<std::uint64_t>(c.integer("seed", 1));

  // model.type first (an old config is told what it is before any key it lacks is missed), then
  // the data's keys, then the model's, which need the sequence length, then the engine's:
  // Hugging Face's "auto" reduce bucket is the model's hidden size squared.
  read_model_type(c);
  t.data_spec = token_data_spec_from_json(c);
  t.model = read_run_model(c, t.data_spec.seq_len, t.seed);
  t.data_spec.vocab = t.model->vocab_size();
  // A model with weights of its own (model.path) reads token ids of its tokenizer: bytes as ids
  // are another language to it. Legitimate for a benchmark, hence a warning, not an error.
  if (t.data_spec.bytes && !t.model->input_files().empty())
    c.warn("data.tokenizer", "\"bytes\"",
           "byte values 0-255 are fed as token ids to the pretrained model of model.path, whose "
           "tokenizer means other things by them: use token files of its tokenizer "
           "(tools/data/tokenize_data.py) and data.tokenizer \"llmc\"");
  t.data_spec.seed = t.seed;
  // The data's one opening in a run, checked before any later key as it always was.
  if (purpose == ConfigFor::run) t.data = open_run_data(c, t);
  t.engine = engine_config_from_json(c, t.batches, t.model->hidden_size());
  // In-process ranks share this machine's cores (attach_process_launch shares them between the
  // processes of a launch instead).
  t.offload_threads_given = c.has("shardswap.offload_threads");
  if (!t.offload_threads_given) t.engine.offload_threads = share_of_cores(t.world_size);
  try {
    // A dtype or shape no checkpoint's export could hold is refused now, not at the first save.
    (void)t.model->checkpoint_extra(t.engine.dtype);
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);
  }
  t.lr = lr_schedule_from_json(c, t.engine.optimizer.lr);

  t.log_interval = static_cast<int>(positive("logging.interval", 10, 1 << 30));
  t.eval_interval = static_cast<int>(positive("logging.eval_interval", 100, 1 << 30));
  t.eval_batches = read_eval_batches(c, t, positive);
  t.timing = c.boolean("logging.timing", false);
  const auto max_skips = c.integer("shardswap.max_consecutive_skips", t.max_consecutive_skips);
  if (max_skips < 0 || max_skips > (1 << 30))
    c.fail("shardswap.max_consecutive_skips", fmt::format("{}", max_skips),
           "must lie in [0, 1073741824] (0: never fail)");
  t.max_consecutive_skips = static_cast<int>(max_skips);
  const auto decay_on = c.string("shardswap.weight_decay_on", "weights");
  if (decay_on != "weights" && decay_on != "all")
    c.fail("shardswap.weight_decay_on", quote_value(decay_on),
           "expected \"weights\" (biases and norm weights not decayed, as the Hugging Face "
           "Trainer) or \"all\"");
  t.decay_all_params = decay_on == "all";

  read_devices(c, t);

  t.checkpoint.dir = c.string("checkpoint.dir", "");
  t.checkpoint.every = c.integer("checkpoint.every", 0);
  if (t.checkpoint.every < 0)
    c.fail("checkpoint.every", fmt::format("{}", t.checkpoint.every), "must be >= 0 (steps)");
  if (t.checkpoint.every > 0 && t.checkpoint.dir.empty())
    c.fail("checkpoint.every", fmt::format("{}", t.checkpoint.every), "needs checkpoint.dir");
  t.checkpoint.keep = static_cast<int>(positive("checkpoint.keep", 3, 1 << 20));
  t.checkpoint.load = c.string("checkpoint.load", "");
  if (t.checkpoint.load == "latest" && t.checkpoint.dir.empty())
    c.fail("checkpoint.load", "\"latest\"", "needs checkpoint.dir");
  if (!t.checkpoint.load.empty() && t.checkpoint.load != "latest") {
    try {
      read_checkpoint_metadata(t.checkpoint.load);  // checked now, before anything is written
    } catch (const ConfigError& e) {
      c.fail("checkpoint.load", quote_value(t.checkpoint.load), e.what());
    }
  }
  t.tensorboard = tensorboard_config_from_json(c);

  LayerSwitchingConfig switching = layer_switching_from_json(c);
  // LISA and BAdam switch the model's layers: absent lists are the model's (SwitchingGroups).
  const SwitchingGroups groups = t.model->switching_groups();
  const bool switches_layers =
      (switching.type == SwitchingType::lisa || switching.type == SwitchingType::badam);
  if (switches_layers && !c.has("layer_switching.layers")) switching.layers = groups.layers;
  if (switches_layers && switching.type == SwitchingType::lisa &&
      !c.has("layer_switching.always_active"))
    switching.always_active = groups.lisa_always_active;
  try {
    t.schedule.emplace(std::move(switching), groups.all);  // validates; allocates nothing
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);  // "layer_switching.KEY = ...: what": add the file
  }
  // Last, once the model, engine, batches, schedule and backend are known: what it changes
  // (where the state lives, the layers recomputed) every later reader sees.
  t.host_memory = read_host_memory(c);
  t.budget = apply_device_budget(c, t);
  if (t.budget && t.budget->chosen.micro != t.budget->configured.micro) {
    // The search chose a smaller micro-batch: the data's batches and the evaluation's count
    // follow it.
    if (purpose == ConfigFor::run) t.data = open_run_data(c, t);
    t.eval_batches = read_eval_batches(c, t, positive);
  }
  reject_unknown_keys(c, kShardSwapSections);
  reject_unread_overrides(c);
  if (strict) refuse_warnings(c, config_warnings(c));
  t.source = c.json();
  return t;
}

PlannedMemory plan_memory(const TrainConfig& config, const RunModel& model, int rank) {
  PlannedMemory p;
  p.engine = plan_memory(config.engine, config.world_size, rank, model.declarations(),
                         config.schedule->active_at(0));
  p.activation = model.activation_bytes(config.batches.micro_samples, config.engine.dtype,
                                        config.backend.kind);
  return p;
}

void print_plan(const TrainConfig& config, std::ostream& out) {
  const RunModel& model = *config.model;
  // What the run would refuse before its first step, the plan refuses too (a CUDA-only option on
  // a CPU backend): never a plan of a run that cannot start. A CUDA run is still planned on a
  // build without CUDA (for another machine), where its CUDA choices cannot be checked.
  try {
    model.check_device(config.backend.kind);
  } catch (const BackendUnavailable&) {
  }
  const auto params = model.param_count();
  const int n = config.world_size;
  out << fmt::format(
      "plan: {}, {} params, world size {}, ZeRO stage {}, {}, {}, micro-batch {}, "
      "backend {}\n",
      model.type_name(), params, n, config.engine.stage, dtype_name(config.engine.dtype),
      optimizer_type_name(config.engine.optimizer.type), config.batches.micro_samples,
      config.backend.name);
  if (config.budget)
    for (const auto& line : config.budget->lines()) out << line << "\n";
  const int shown = std::min(n, 8);
  std::vector<PlannedMemory> plans;
  for (int r = 0; r < n; ++r) plans.push_back(plan_memory(config, model, r));
  out << fmt::format("{:<18}", "bytes");
  for (int r = 0; r < shown; ++r) out << fmt::format("{:>16}", fmt::format("rank {}", r));
  out << fmt::format("{:>16}\n", "max over ranks");
  const auto row = [&](const std::string& name, auto bytes_of) {
    out << fmt::format("{:<18}", name);
    std::int64_t most = 0;
    for (int r = 0; r < n; ++r) {
      const std::int64_t b = bytes_of(plans[static_cast<std::size_t>(r)]);
      most = std::max(most, b);
      if (r < shown) out << fmt::format("{:>16}", b);
    }
    out << fmt::format("{:>16}\n", most);
  };
  for (Tag t : kAllTags) {
    if (t == Tag::activation || t == Tag::other) continue;
    row(tag_name(t), [t](const PlannedMemory& p) { return p.engine.of(t); });
  }
  row("activation", [](const PlannedMemory& p) { return p.activation; });
  row("total", [](const PlannedMemory& p) { return p.total(); });
  // The engine's host memory, where it holds any: the state placed there and its staging.
  if (std::any_of(plans.begin(), plans.end(),
                  [](const PlannedMemory& p) { return p.host_total() > 0; })) {
    for (Tag t : kAllTags)
      if (std::any_of(plans.begin(), plans.end(),
                      [t](const PlannedMemory& p) { return p.engine.host_of(t) > 0; }))
        row(fmt::format("host {}", tag_name(t)),
            [t](const PlannedMemory& p) { return p.engine.host_of(t); });
    row("host total", [](const PlannedMemory& p) { return p.host_total(); });
  }
  // The ZeRO paper's count for bit16 params and Adam (no buckets, no padding, all groups active).
  const double psi = static_cast<double>(params);
  const double formula = config.engine.stage == 1 ? 4 * psi + 12 * psi / n : 2 * psi + 14 * psi / n;
  out << fmt::format("ZeRO-{} formula, every group active, Adam: {:.0f} bytes ({})\n",
                     config.engine.stage, formula, mib(static_cast<std::int64_t>(formula)));
}

EvalSummary evaluate(const TrainConfig& config, const std::filesystem::path& checkpoint,
                     bool logits) {
  const RunData& data = data_of(config);
  const RunModel& run = *config.model;
  const Backend backend = open_backend(config.backend);
  run.check_device(backend.kind());
  check_plan_fits(config, plan_memory(config, run, 0));
  const int world = config.world_size;
  EvalSummary summary;
  summary.batches = config.eval_batches;
  summary.sequences_per_batch = config.batches.micro_samples;
  // In-process ranks on the config's backend (an NCCL config's ranks share one device here):
  // evaluation moves no gradients, and a checkpoint loads at any world size.
  run_in_process_ranks(config, backend, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, backend.make_allocator(rank));
    Engine engine(config.engine, comm, cap_to_budget(space, config.budget), backend);
    run.declare(engine);
    // Rank 0's values are broadcast to every rank by build: the others need not draw them.
    const WeightInit none = [](const ParamInfo&, std::span<float>) {};
    engine.build(rank == 0 ? run.initial_values() : none, config.schedule->active_at(0));
    if (!checkpoint.empty()) {
      const LoadedCheckpoint loaded = load_checkpoint(engine, checkpoint);
      const std::int64_t step = trainer_field(loaded, checkpoint, "step");
      if (rank == 0) summary.step = step;
    }
    auto model = run.make_rank_model(config.batches.micro_samples, config.engine.dtype, space);
    const double mean = validation_loss(*model, engine, data, config.eval_batches, rank, world);
    if (rank == 0) {
      summary.val_loss = mean;
      if (logits) summary.logits = model->val_logits(engine, data.val_batch(0));
    }
  });
  return summary;
}

const char* stop_signal_name(int signal) {
  switch (signal) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "a signal";
  }
}

double validation_loss(RankModel& model, Engine& engine, const RunData& data, int batches,
                       int rank, int world) {
  // Each batch's mean over its counted targets, weighted by their share of a full micro-batch's
  // targets: exactly 1 for a full unmasked batch, so such a set gives the plain mean of the
  // batch means; the whole is the mean over every counted target.
  const double full = static_cast<double>(data.micro()) * data.seq_len();
  double sum = 0.0;
  for (int b = rank; b < batches; b += world) {
    TokenSequences batch = data.val_batch(b);
    const double share = static_cast<double>(batch.counted_targets()) / full;
    sum += model.val_loss(engine, std::move(batch)) * share;
  }
  const auto counted = static_cast<double>(data.val_targets(batches));
  if (counted == 0.0)
    throw ConfigError("the validation batches hold no target the loss is on (data.val's mask)");
  return engine.sum_across_ranks(sum) / (counted / full);
}

const RunData& data_of(const TrainConfig& config) {
  if (!config.data)
    throw Error("the config was read for a plan (ConfigFor::plan): no data is open");
  return *config.data;
}

void run_in_process_ranks(const TrainConfig& config, const Backend& backend,
                          const std::function<void(int rank, Communicator& comm)>& fn) {
  run_ranks(config.world_size, fn, backend, config.comm_timeout);
}

namespace {

// The checkpoint directory, before anything is read or built: one that cannot take files fails
// now rather than at the first save, `every` steps of work later; one that another trainer holds
// is refused (two runs would overwrite each other's saves). Held to the end of the run.
std::optional<CheckpointDirLock> hold_checkpoint_dir(const std::string& dir) {
  try {
    probe_checkpoint_dir(dir);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("checkpoint.dir = {}: {}", quote_value(dir), e.what()));
  }
  return CheckpointDirLock(dir);
}

// checkpoint.load "latest": the most recently written complete checkpoint under the directory,
// with notes on what was skipped and on a further one that is not resumed.
void find_latest(const std::string& dir, CheckpointChoice& choice) {
  const CheckpointScan scan = scan_checkpoints(dir);
  for (const auto& why : scan.skipped)
    choice.notes.push_back("not a complete checkpoint, skipped: " + why);
  if (scan.complete.empty()) return;
  const CheckpointEntry& newest = scan.complete.back();  // the most recently written
  choice.latest = newest.path;
  const auto highest =
      std::max_element(scan.complete.begin(), scan.complete.end(),
                       [](const auto& a, const auto& b) { return a.step < b.step; });
  if (highest->step > newest.step)
    choice.notes.push_back(fmt::format(
        "note: {} (step {}, run {}) is further along than the most recently written {} "
        "(step {}), which is resumed; set checkpoint.load to it to continue that run",
        highest->path.string(), highest->step, highest->run_id.substr(0, 8), newest.path.string(),
        newest.step));
}

// Resuming the newest checkpoint of a run continues that run (a preempted job resumed again and
// again stays one run, whose old checkpoints its prunes may delete); resuming an older one
// branches off as a new run, which never deletes what the other wrote.
void continue_run(const std::string& dir, const std::filesystem::path& resuming,
                  CheckpointChoice& choice) {
  const auto meta = read_checkpoint_metadata(resuming);
  const auto of_run = meta.at("run_id").get<std::string>();
  const auto sequence = meta.at("save_sequence").get<std::int64_t>();
  const CheckpointScan scan = scan_checkpoints(dir);
  const bool newer_of_run =
      std::any_of(scan.complete.begin(), scan.complete.end(), [&](const CheckpointEntry& e) {
        return e.run_id == of_run && e.save_sequence > sequence;
      });
  if (!of_run.empty() && !newer_of_run) choice.run_id = of_run;
}

// What rank 0 decides about checkpoints: what a killed save or prune left is completed or rolled
// back before `latest` is chosen, once, here; then the checkpoint resumed and the run's id.
CheckpointChoice choose_checkpoints(const TrainConfig& config, bool leads) {
  CheckpointChoice choice;
  choice.run_id = new_random_id();
  const CheckpointConfig& c = config.checkpoint;
  if (!leads || c.dir.empty()) return choice;
  choice.notes = recover_checkpoints(c.dir);
  if (c.load == "latest") find_latest(c.dir, choice);
  const std::filesystem::path resuming =
      c.load == "latest" ? choice.latest : std::filesystem::path(c.load);
  if (!resuming.empty()) continue_run(c.dir, resuming, choice);
  return choice;
}

// One GPU per rank, a thread each. A rank that throws leaves the others waiting in NCCL (until
// shardswap.comm_timeout_s runs out, where it is set); its error is printed at once so that the
// cause is known even if the run must then be killed.
void run_nccl_ranks(const TrainConfig& config, std::mutex& mu, const ProcessRankFn& per_rank) {
  const int world = config.world_size;
  std::vector<int> devices(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) devices[static_cast<std::size_t>(r)] = r;
  auto comms = make_nccl_communicators(devices, config.comm_timeout);
  std::vector<std::exception_ptr> errors;  // in the order they arrived; root_cause picks one
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        cuda_set_device(r);
        per_rank(r, *comms[static_cast<std::size_t>(r)], make_cuda_allocator(r));
        // A collective the watchdog aborted at the very end left garbage in what was read last.
        comms[static_cast<std::size_t>(r)]->check();
      } catch (const std::exception& e) {
        std::lock_guard lock(mu);
        std::cerr << fmt::format("rank {} failed: {}\n", r, e.what()) << std::flush;
        errors.push_back(std::current_exception());
      }
    });
  for (auto& t : threads) t.join();
  // The failing rank's own error, not another rank's "other rank(s) failed" or the CommError of
  // a collective its failure aborted.
  if (const auto cause = root_cause(errors)) std::rethrow_exception(cause);
}

// A Trainer on every rank of the run: this process's rank alone under a launcher (the others are
// processes of the same job), else every rank a thread of this process.
void start_ranks(TrainRun& run) {
  const TrainConfig& config = run.config;
  const ProcessRankFn per_rank = [&](int rank, Communicator& comm,
                                     std::unique_ptr<Allocator> allocator) {
    Trainer(run, rank, comm, std::move(allocator)).run();
  };
  if (config.process)
    run_process_rank(*config.process, run.backend, config.comm == CommKind::nccl,
                     config.comm_timeout, per_rank);
  else if (config.comm == CommKind::in_process)
    run_in_process_ranks(config, run.backend, [&](int rank, Communicator& comm) {
      per_rank(rank, comm, run.backend.make_allocator(rank));
    });
  else
    run_nccl_ranks(config, run.mu, per_rank);
}

}  // namespace

Backend open_backend(const BackendChoice& choice) {
  if (choice.kind == DeviceKind::host) return cpu_backend();
  if (choice.name == "cuda") return cuda_backend(0);
  // A device that does not exist is a mistake in the key: said in the key's shape.
  try {
    return cuda_backend(choice.device);
  } catch (const ConfigError& e) {
    const std::string_view what = e.what();
    const auto colon = what.find(": ");
    throw ConfigError(fmt::format("shardswap.backend = {}: {}", quote_value(choice.name),
                                  colon == std::string_view::npos ? what : what.substr(colon + 2)));
  }
}

TrainSummary train(const TrainConfig& config, const TrainOutput& out) {
  // With one process per rank, rank 0 alone probes, holds, recovers and scans the checkpoint
  // directory; it tells the others what it chose once they are connected (Trainer).
  const bool leads = !config.process || config.process->rank == 0;
  const std::optional<CheckpointDirLock> dir_lock =
      leads && !config.checkpoint.dir.empty() ? hold_checkpoint_dir(config.checkpoint.dir)
                                              : std::nullopt;
  const RunData& data = data_of(config);
  const RunModel& model = *config.model;
  const Backend backend = open_backend(config.backend);
  model.check_device(backend.kind());
  const PlannedMemory predicted = plan_memory(config, model, 0);
  check_plan_fits(config, predicted);
  TrainRun run(config, out, model, data, backend);
  run.predicted_bytes = predicted.total();
  run.tokens_per_step = static_cast<double>(config.batches.micro_samples) *
                        config.batches.gradient_accumulation_steps * config.world_size *
                        static_cast<double>(model.tokens_per_sample());
  run.summary.predicted_bytes = predicted.total();
  run.checkpoints = choose_checkpoints(config, leads);
  // Rank 0's GPU as the driver sees it before this run puts anything there (its CUDA context
  // exists from here on, so the context itself is not counted): after step 1 the bytes the
  // process gained since are set against the plans of the ranks on that GPU, and the rest is
  // what NCCL, cuBLAS's own state and the kernels' code keep outside the plan (docs/memory.md).
  run.rank0_device = config.comm == CommKind::nccl ? 0 : backend.device();
  if (backend.kind() == DeviceKind::cuda) {
    const DeviceMemory gpu = cuda_device_memory(run.rank0_device);
    run.device_free_before = static_cast<std::int64_t>(gpu.free);
    run.device_held_before = static_cast<std::int64_t>(gpu.total - gpu.free);
  }
  start_ranks(run);
  return run.summary;
}

}  // namespace shardswap
