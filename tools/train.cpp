#include "tools/train.h"
#include "support/quoted.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <exception>
#include <fstream>
#include <iostream>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>

#include <unistd.h>

#include "shardswap/backend.h"
#include "shardswap/checkpoint.h"
#include "shardswap/checkpoint_dir.h"
#include "shardswap/config_json.h"
#include "shardswap/error.h"
#include "shardswap/nccl.h"
#include "tools/lm/cublas_rate.h"
#include "tools/lm/decoder.h"
#include "tools/lm/hf_config.h"
#include "tools/run_model.h"
#include "tools/metrics_log.h"
#include "tools/progress.h"

namespace shardswap {

namespace {

CommKind comm_kind_from_name(ConfigReader& c, const std::string& name) {
  if (name == "in_process") return CommKind::in_process;
  if (name == "nccl") return CommKind::nccl;
  c.fail("shardswap.communicator", quote_value(name), "expected in_process or nccl");
}

DeviceKind device_of(const std::string& backend) {
  return backend == "cpu" ? DeviceKind::host : DeviceKind::cuda;
}

std::string mib(std::int64_t bytes) {
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / 1048576.0);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The memory this process may use: the machine's, or its cgroup's limit where lower (a
// container's). 0 when neither can be read.
std::int64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  std::int64_t bytes = pages > 0 && page > 0 ? std::int64_t{pages} * page : 0;
  std::ifstream limit("/sys/fs/cgroup/memory.max");
  std::int64_t cgroup = 0;
  if (limit >> cgroup && cgroup > 0 && (bytes == 0 || cgroup < bytes)) bytes = cgroup;
  return bytes;
}

// A field of the trainer's state that the loop saves in a checkpoint's `extra` (step, updates):
// an integer >= 0, or a ConfigError "DIR/metadata.json: extra.KEY ...". The library keeps
// `extra` as the trainer gave it, so a checkpoint of another trainer (docs/api.md invites custom
// ones) or an edited one reaches here with anything in it. Every rank calls this: a rank that
// threw alone would leave the others in the next collective.
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

}  // namespace

void check_plan_fits(const TrainConfig& config, const PlannedMemory& rank0) {
  // On the cpu backend every rank of this process holds its buffers in host memory; on cuda
  // they are on the devices, whose allocator names what does not fit.
  if (device_of(config.backend) != DeviceKind::host) return;
  const std::int64_t memory = host_memory_bytes();
  const int ranks = config.process ? 1 : config.world_size;
  // Ranks hold near-equal shares; in doubles, so that no product overflows.
  const double needed = static_cast<double>(rank0.total()) * ranks;
  if (memory <= 0 || needed <= static_cast<double>(memory)) return;
  throw Error(fmt::format(
      "the plan needs {:.1f} GiB of host memory ({} on rank 0 x {} rank{} in this process; "
      "`shardswap plan` lists it by tag), more than the {:.1f} GiB this machine has: refused "
      "before anything is allocated",
      needed / 1073741824.0, mib(rank0.total()), ranks, ranks == 1 ? "" : "s",
      static_cast<double>(memory) / 1073741824.0));
}

TrainConfig train_config_from_json(ConfigReader& c) {
  TrainConfig t;
  const auto positive = [&](std::string_view key, std::int64_t fallback, std::int64_t max) {
    const auto v = c.integer(key, fallback);
    if (v < 1 || v > max)
      c.fail(key, fmt::format("{}", v), fmt::format("must lie in [1, {}]", max));
    return v;
  };
  // --strict sets it (tools/main.cpp): every warning below becomes an error, at the end.
  const bool strict = c.boolean("shardswap.strict", false);
  t.world_size = static_cast<int>(positive("world_size", 1, 1024));
  t.batches = resolve_batch_sizes(c, t.world_size);
  t.steps = positive("steps", 100, std::int64_t{1} << 40);
  t.seed = static_cast<std::uint64_t>(c.integer("seed", 1));

  // One built-in model family: model.type may be left out. The byte-level MLP LM it once chose
  // between was removed; its configs are refused rather than read as a decoder's with the
  // LM's keys ignored.
  const auto type = c.string("model.type", "decoder");
  if (type == "byte_lm")
    c.fail("model.type", "\"byte_lm\"",
           "the byte-level MLP LM was removed: use model.type \"decoder\" with data.tokenizer "
           "\"bytes\" (configs/quickstart.json)");
  if (type != "decoder")
    c.fail("model.type", quote_value(type), "expected \"decoder\" (Llama / Qwen2 / Mistral)");
  for (const char* key : {"model.context", "model.width", "model.hidden", "model.depth", "data.path"})
    if (c.has(key))
      c.fail("model.type", fmt::format("{} is a key of the byte-level MLP LM, which was removed: "
                                       "use the decoder's (docs/config.md) with data.tokenizer "
                                       "\"bytes\" (configs/quickstart.json)",
                                       key));
  // The model before the engine: Hugging Face's "auto" reduce bucket is the hidden size squared.
  decoder_config_from_json(c, t);
  t.engine = engine_config_from_json(c, t.batches, t.decoder.shape.hidden);
  try {
    t.decoder.hf_config = hf_config_to_json(t.decoder.shape, t.engine.dtype);
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);
  }
  t.lr = lr_schedule_from_json(c, t.engine.optimizer.lr);

  t.log_interval = static_cast<int>(positive("logging.interval", 10, 1 << 30));
  t.eval_interval = static_cast<int>(positive("logging.eval_interval", 100, 1 << 30));
  t.eval_batches = static_cast<int>(positive("logging.eval_batches", 4, 1 << 20));
  t.timing = c.boolean("logging.timing", false);

  t.backend = c.string("shardswap.backend", "cpu");
  // Checked by spelling only: whether the GPU exists is known when train() opens the backend, and
  // `plan` must work for a GPU config on a machine without one.
  const auto device_digits = t.backend.rfind("cuda:", 0) == 0 ? t.backend.substr(5) : "";
  const bool cuda_n = !device_digits.empty() && device_digits.size() <= 4 &&
                      device_digits.find_first_not_of("0123456789") == std::string::npos;
  if (t.backend != "cpu" && t.backend != "cuda" && !cuda_n)
    c.fail("shardswap.backend", quote_value(t.backend), "expected cpu, cuda or cuda:N");
  t.comm = comm_kind_from_name(c, c.string("shardswap.communicator", "in_process"));
  if (t.comm == CommKind::nccl && t.backend == "cpu")
    c.fail("shardswap.communicator", "\"nccl\"", "needs shardswap.backend = \"cuda\"");
  constexpr double kMaxCommTimeoutS = 1e7;  // 115 days: anything longer is a mistake
  const double timeout_s = c.number("shardswap.comm_timeout_s", 0.0);
  if (!(timeout_s >= 0.0 && timeout_s <= kMaxCommTimeoutS))
    c.fail(
        "shardswap.comm_timeout_s", fmt::format("{}", timeout_s),
        fmt::format("must lie in [0, {:g}] seconds (0 or absent waits forever)", kMaxCommTimeoutS));
  // Rounded up, so that a small positive timeout never becomes 0 (forever).
  t.comm_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(timeout_s * 1e3)));

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

  t.switching = layer_switching_from_json(c);
  const auto groups = decoder_groups(t.decoder.shape);
  // The decoder's LISA and BAdam switch its layers: absent lists mean every "layers.N" group
  // and, for LISA, the embedding and head always active (the LISA paper's choice; BAdam's is
  // none).
  const bool switches_layers =
      (t.switching.type == SwitchingType::lisa || t.switching.type == SwitchingType::badam);
  if (switches_layers && !c.has("layer_switching.layers"))
    for (const auto& g : groups)
      if (g.starts_with("layers.")) t.switching.layers.push_back(g);
  if (switches_layers && t.switching.type == SwitchingType::lisa &&
      !c.has("layer_switching.always_active"))
    t.switching.always_active = {"embed", "head"};
  try {
    LayerSchedule check(t.switching, groups);  // validates; allocates nothing
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);  // "layer_switching.KEY = ...: what": add the file
  }
  reject_unknown_keys(c, kShardSwapSections);
  reject_unread_overrides(c);
  if (strict) refuse_warnings(c, config_warnings(c));
  t.source = c.json();
  return t;
}

PlannedMemory plan_memory(const TrainConfig& config, int rank) {
  // Declarations only: the group's ranks never exchange anything and the space never allocates.
  InProcessGroup group(config.world_size);
  MemorySpace space(rank, make_host_allocator());
  Engine engine(config.engine, group.rank(rank), space);
  const auto model = make_run_model(config);
  model->declare(engine);
  const LayerSchedule schedule(config.switching, model->groups());
  PlannedMemory p;
  p.engine = engine.plan(schedule.active_at(0));
  p.activation = model->activation_bytes(config.batches.micro_samples, config.engine.dtype,
                                         device_of(config.backend));
  return p;
}

void print_plan(const TrainConfig& config, std::ostream& out) {
  const auto model = make_run_model(config);
  const auto params = model->param_count();
  const int n = config.world_size;
  out << fmt::format(
      "plan: {}, {} params, world size {}, ZeRO stage {}, {}, {}, micro-batch {}, "
      "backend {}\n",
      model->type_name(), params, n, config.engine.stage, dtype_name(config.engine.dtype),
      optimizer_type_name(config.engine.optimizer.type), config.batches.micro_samples,
      config.backend);
  const int shown = std::min(n, 8);
  std::vector<PlannedMemory> plans;
  for (int r = 0; r < n; ++r) plans.push_back(plan_memory(config, r));
  out << fmt::format("{:<12}", "bytes");
  for (int r = 0; r < shown; ++r) out << fmt::format("{:>16}", fmt::format("rank {}", r));
  out << fmt::format("{:>16}\n", "max over ranks");
  const auto row = [&](const std::string& name, auto bytes_of) {
    out << fmt::format("{:<12}", name);
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
  // The ZeRO paper's count for bit16 params and Adam (no buckets, no padding, all groups active).
  const double psi = static_cast<double>(params);
  const double formula = config.engine.stage == 1 ? 4 * psi + 12 * psi / n : 2 * psi + 14 * psi / n;
  out << fmt::format("ZeRO-{} formula, every group active, Adam: {:.0f} bytes ({})\n",
                     config.engine.stage, formula, mib(static_cast<std::int64_t>(formula)));
}

EvalSummary evaluate(const TrainConfig& config, const std::filesystem::path& checkpoint,
                     bool logits) {
  const auto run = make_run_model(config);
  const Backend backend = backend_from_name(config.backend, "shardswap.backend");
  const LayerSchedule schedule(config.switching, run->groups());
  check_plan_fits(config, plan_memory(config, 0));
  const int world = config.world_size;
  EvalSummary summary;
  summary.batches = config.eval_batches;
  summary.sequences_per_batch = config.batches.micro_samples;
  // In-process ranks on the config's backend (an NCCL config's ranks share one device here):
  // evaluation moves no gradients, and a checkpoint loads at any world size.
  run_in_process_ranks(config, backend, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, backend.make_allocator(rank));
    Engine engine(config.engine, comm, space, backend);
    run->declare(engine);
    // Rank 0's values are broadcast to every rank by build: the others need not draw them.
    engine.build([&](const ParamInfo& p, std::span<float> v) { if (rank == 0) run->init(p, v); },
                 schedule.active_at(0));
    if (!checkpoint.empty()) {
      const LoadedCheckpoint loaded = load_checkpoint(engine, checkpoint);
      const std::int64_t step = trainer_field(loaded, checkpoint, "step");
      if (rank == 0) summary.step = step;
    }
    auto model = run->make_rank_model(config.batches.micro_samples, config.engine.dtype, space);
    double sum = 0.0;
    for (int b = rank; b < config.eval_batches; b += world) sum += model->val_loss(engine, b);
    const double mean = engine.sum_across_ranks(sum) / config.eval_batches;
    if (rank == 0) {
      summary.val_loss = mean;
      if (logits) summary.logits = model->val_logits(engine, 0);
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

void run_in_process_ranks(const TrainConfig& config, const Backend& backend,
                          const std::function<void(int rank, Communicator& comm)>& fn) {
  run_ranks(config.world_size, fn, backend, config.comm_timeout);
}

TrainSummary train(const TrainConfig& config, const TrainOutput& out) {
  // The checkpoint directory first, before anything is read or built: one that cannot take files
  // fails now rather than at the first save, `every` steps of work later; one that another
  // trainer holds is refused (two runs would overwrite each other's saves). Held to the end.
  // With one process per rank, rank 0 alone probes, holds, recovers and scans the directory;
  // it tells the others what it chose once they are connected (text_of_rank0, in per_rank).
  const bool leads = !config.process || config.process->rank == 0;
  std::optional<CheckpointDirLock> dir_lock;
  if (leads && !config.checkpoint.dir.empty()) {
    try {
      probe_checkpoint_dir(config.checkpoint.dir);
    } catch (const ConfigError& e) {
      throw ConfigError(
          fmt::format("checkpoint.dir = {}: {}", quote_value(config.checkpoint.dir), e.what()));
    }
    dir_lock.emplace(config.checkpoint.dir);
  }
  const auto run = make_run_model(config);  // the model and its data
  const Backend backend = backend_from_name(config.backend, "shardswap.backend");
  const LayerSchedule schedule(config.switching, run->groups());
  const PlannedMemory predicted = plan_memory(config, 0);
  check_plan_fits(config, predicted);
  const int world = config.world_size;
  const int micro = config.batches.micro_samples;
  const int accumulation = config.batches.gradient_accumulation_steps;
  const double tokens_per_step =
      static_cast<double>(micro) * accumulation * world * static_cast<double>(run->tokens_per_sample());

  TrainSummary summary;
  summary.predicted_bytes = predicted.total();
  // Checkpoints: this run's id ties what it writes to it (pruning deletes only its own); what a
  // killed save or prune left is completed or rolled back before `latest` is chosen, once, here.
  std::string run_id = new_random_id();
  std::filesystem::path latest;
  std::vector<std::string> checkpoint_notes;
  if (leads && !config.checkpoint.dir.empty()) {
    checkpoint_notes = recover_checkpoints(config.checkpoint.dir);
    if (config.checkpoint.load == "latest") {
      const CheckpointScan scan = scan_checkpoints(config.checkpoint.dir);
      for (const auto& why : scan.skipped)
        checkpoint_notes.push_back("not a complete checkpoint, skipped: " + why);
      if (!scan.complete.empty()) {
        const CheckpointEntry& newest = scan.complete.back();  // the most recently written
        latest = newest.path;
        const auto highest =
            std::max_element(scan.complete.begin(), scan.complete.end(),
                             [](const auto& a, const auto& b) { return a.step < b.step; });
        if (highest->step > newest.step)
          checkpoint_notes.push_back(fmt::format(
              "note: {} (step {}, run {}) is further along than the most recently written {} "
              "(step {}), which is resumed; set checkpoint.load to it to continue that run",
              highest->path.string(), highest->step, highest->run_id.substr(0, 8),
              newest.path.string(), newest.step));
      }
    }
    // Resuming the newest checkpoint of a run continues that run (a preempted job resumed again
    // and again stays one run, whose old checkpoints its prunes may delete); resuming an older
    // one branches off as a new run, which never deletes what the other wrote.
    const std::filesystem::path resuming =
        config.checkpoint.load == "latest" ? latest : std::filesystem::path(config.checkpoint.load);
    if (!resuming.empty()) {
      const auto meta = read_checkpoint_metadata(resuming);
      const auto of_run = meta.at("run_id").get<std::string>();
      const auto sequence = meta.at("save_sequence").get<std::int64_t>();
      const CheckpointScan scan = scan_checkpoints(config.checkpoint.dir);
      const bool newer_of_run = std::any_of(
          scan.complete.begin(), scan.complete.end(), [&](const CheckpointEntry& e) {
            return e.run_id == of_run && e.save_sequence > sequence;
          });
      if (!of_run.empty() && !newer_of_run) run_id = of_run;
    }
  }
  std::mutex mu;  // rank 0 writes the outputs; the lock orders them with the summary's readers
  // Rank 0's GPU as the driver sees it before this run puts anything there (its CUDA context
  // exists from here on, so the context itself is not counted): after step 1 the bytes the
  // process gained since are set against the plans of the ranks on that GPU, and the rest is
  // what NCCL, cuBLAS's own state and the kernels' code keep outside the plan (docs/memory.md).
  const int rank0_device = config.comm == CommKind::nccl ? 0 : backend.device();
  const std::int64_t device_free_before =
      backend.kind() == DeviceKind::cuda
          ? static_cast<std::int64_t>(cuda_device_memory(rank0_device).free)
          : 0;

  auto per_rank = [&](int rank, Communicator& comm, std::unique_ptr<Allocator> allocator) {
    if (config.process) {  // rank 0's choices above, for the ranks of the other processes
      latest = text_of_rank0(comm, latest.string());
      run_id = text_of_rank0(comm, run_id);
    }
    MemorySpace space(rank, std::move(allocator));
    Engine engine(config.engine, comm, space, backend);
    run->declare(engine);
    // Rank 0's values are broadcast to every rank by build: the others need not draw them.
    engine.build([&](const ParamInfo& p, std::span<float> v) { if (rank == 0) run->init(p, v); },
                 schedule.active_at(0));
    auto model = run->make_rank_model(micro, config.engine.dtype, space);
    const auto sync = [&] { backend.synchronize(); };
    // With timing on a GPU, rank 0's model times its phases (CUDA events; the split printed at
    // the end and in each metrics line).
    if (rank == 0 && config.timing && space.device() == DeviceKind::cuda) model->time_phases(true);

    // Validation: batches rank, rank + world, ... of eval_batches, summed over ranks.
    const auto evaluate = [&] {
      double sum = 0.0;
      for (int b = rank; b < config.eval_batches; b += world)
        sum += model->val_loss(engine, b);
      return engine.sum_across_ranks(sum) / config.eval_batches;
    };

    std::optional<ProgressReporter> progress;
    if (rank == 0) {
      std::lock_guard lock(mu);
      out.log << fmt::format(
          "shardswap train: {} ({} groups); world size {} ({}, {}), ZeRO stage {}, {}, {}; "
          "batch {} = {} x {} x {}; {}\n",
          run->describe(), engine.groups().size(), world, backend.name(),
          config.process ? (config.comm == CommKind::nccl ? "nccl over mpi, a process per rank"
                                                          : "mpi, a process per rank")
          : config.comm == CommKind::nccl ? "nccl"
                                          : "in-process",
          config.engine.stage,
          dtype_name(config.engine.dtype), optimizer_type_name(config.engine.optimizer.type),
          config.batches.train_samples, micro, accumulation, world, run->describe_data());
      if (schedule.enabled())
        out.log << fmt::format("layer switching: {} every {} steps, policy {}; active now: {}\n",
                               switching_type_name(config.switching.type),
                               config.switching.interval, deactivate_policy_name(schedule.policy()),
                               fmt::join(engine.active_groups(), ", "));
      if (out.report) *out.report << engine.memory_report();
      progress.emplace(out.log, ProgressOptions{.total_steps = config.steps,
                                                .terminal = out.terminal,
                                                .interval = config.log_interval,
                                                .columns = out.columns,
                                                .throughput_unit = "tokens/s"});
    }
    const auto say = [&](const std::string& text) {
      if (rank != 0) return;
      std::lock_guard lock(mu);
      progress->message(text);
    };

    if (rank == 0 && config.timing && space.device() == DeviceKind::cuda) {
      const auto gemm = run->reference_gemm(micro);
      const double rate = measure_cublas_gemm_tflops(gemm.at(0), gemm.at(1), gemm.at(2),
                                                     config.engine.dtype);
      std::lock_guard lock(mu);
      summary.cublas_tflops = rate;
      progress->message(fmt::format("cuBLAS {} GEMM {} x {} x {}: {:.1f} TFLOP/s", 
                                    dtype_name(config.engine.dtype), gemm.at(0), gemm.at(1),
                                    gemm.at(2), rate));
    }
    std::int64_t planned = predicted.total();  // changes when a switch changes the active set
    std::int64_t updates = 0;                  // applied optimizer steps: the lr schedule's clock
    // Resuming: the engine's state from the checkpoint; the schedule's position and the data's
    // are pure functions of the step, so the step and the update count are all the loop needs.
    std::int64_t start = 0;
    std::optional<CheckpointParent> parent;
    for (const auto& note : checkpoint_notes) say(note);
    const std::filesystem::path resume_from =
        config.checkpoint.load == "latest" ? latest : std::filesystem::path(config.checkpoint.load);
    if (!resume_from.empty()) {
      const LoadedCheckpoint loaded = load_checkpoint(engine, resume_from);
      start = trainer_field(loaded, resume_from, "step");
      parent = CheckpointParent{loaded.run_id, start};
      updates = trainer_field(loaded, resume_from, "updates");
      planned = engine.plan().total() +
                run->activation_bytes(micro, config.engine.dtype, space.device());
      say(fmt::format("resumed from {} (saved at world size {}): step {}, {} updates",
                      resume_from.string(), loaded.world_size, start, updates));
      if (schedule.enabled())
        say(fmt::format("active after the resume: {}", fmt::join(engine.active_groups(), ", ")));
    } else if (config.checkpoint.load == "latest") {
      say(fmt::format("no checkpoint under {} yet: starting at step 0", config.checkpoint.dir));
    }
    if (rank == 0) summary.start_step = start;
    if (start >= config.steps) {  // resuming a finished run: nothing is evaluated or written
      if (rank == 0) {
        std::lock_guard lock(mu);
        summary.already_finished = true;
        summary.steps = start;
        progress->finish();
      }
      return;
    }
    // The weights training starts from: the fresh model's, or the resumed checkpoint's.
    double val = evaluate();
    say(start == 0 ? fmt::format("validation loss before training: {:.4f}", val)
                   : fmt::format("validation loss at step {} (resumed): {:.4f}", start, val));
    if (rank == 0) summary.first_val_loss = val;
    if (rank == 0 && out.metrics) {  // before the first step's line: a resume appends
      std::lock_guard lock(mu);
      out.metrics->begin(resume_from.empty()
                             ? std::nullopt
                             : std::optional<ResumePoint>(ResumePoint{start, resume_from}));
    }
    double interval_loss = 0.0, timed_seconds = 0.0, model_seconds = 0.0, engine_seconds = 0.0,
           first_seconds = 0.0;
    int interval_steps = 0;
    space.reset_peaks();
    std::filesystem::path stop_checkpoint;  // the checkpoint saved on a stop signal, if any
    for (std::int64_t step = start; step < config.steps; ++step) {
      const auto started = std::chrono::steady_clock::now();
      std::optional<SwitchReport> switched;
      if (step > 0 && schedule.boundary(step)) {
        const auto wanted = schedule.active_at(step);
        if (wanted != engine.active_groups()) {
          switched = engine.set_active(wanted, schedule.policy());
          planned = engine.plan().total() +
                    run->activation_bytes(micro, config.engine.dtype, space.device());
          // The check after this step compares the plan of the new active set with what is
          // held from here on: a window from before the switch would include the bytes of the
          // groups it let go (a false excess after a switch that shrinks the set).
          space.reset_peaks();
        }
      }
      engine.set_lr(config.lr.lr_at(updates));
      double loss = 0.0;
      for (int m = 0; m < accumulation; ++m)
        loss += model->train_micro(engine, step, rank, world, m);
      loss /= accumulation;
      if (config.timing) sync();
      const double model_s = seconds_since(started);
      const auto stepping = std::chrono::steady_clock::now();
      const StepResult r = engine.step();
      if (config.timing) sync();
      const double engine_s = seconds_since(stepping);
      if (r.applied) ++updates;
      // The model's GPU phases of this step, then engine.step() and what is left of the model's
      // wall time: the host's launches and waits the GPU phases do not cover.
      std::vector<std::pair<std::string, double>> phases = model->take_phase_seconds();
      if (!phases.empty()) {
        double gpu = 0.0;
        for (const auto& p : phases) gpu += p.second;
        phases.emplace_back("engine.step()", engine_s);
        phases.emplace_back("host and gaps", std::max(0.0, model_s - gpu));
      }
      loss = engine.sum_across_ranks(loss) / world;
      // Stop after this step? Every rank adds what it saw, so all decide alike even when the
      // signal lands between two ranks' reads; the flag never returns to 0, so after the sum
      // every rank reads a signal from it.
      const bool stopping = out.stop_signal != nullptr &&
                            engine.sum_across_ranks(out.stop_signal->load() != 0 ? 1.0 : 0.0) > 0.0;
      // The last step of a stopped run is evaluated as the last one of a finished run is.
      const bool evaluating =
          (step + 1) % config.eval_interval == 0 || step + 1 == config.steps || stopping;
      if (evaluating) val = evaluate();
      const double seconds = seconds_since(started);
      const MemoryStats mem = engine.memory_stats();
      // The plans of every rank on rank 0's GPU (in-process ranks share it; over NCCL a rank
      // has a GPU of its own): a collective, so every rank computes it, on the same step.
      std::int64_t plan_on_gpu = 0;
      if (step == start && space.device() == DeviceKind::cuda)
        plan_on_gpu = config.comm == CommKind::nccl
                          ? planned
                          : static_cast<std::int64_t>(
                                engine.sum_across_ranks(static_cast<double>(planned)));
      // Rank 0's reports of the step, its metrics line first: a checkpoint of the step is saved
      // only after its line is in the file, so a kill between the two never leaves a resume
      // point the metrics have not reached.
      if (rank == 0) {
        std::lock_guard lock(mu);
        if (step == start) {
          summary.first_loss = loss;
          first_seconds = seconds;
        }
        if (step > start) {  // the first step carries one-off work (allocation, cuBLAS warm-up)
          timed_seconds += seconds;
          model_seconds += model_s;
          engine_seconds += engine_s;
          if (summary.phase_seconds.empty()) summary.phase_seconds = phases;
          else
            for (std::size_t i = 0; i < phases.size(); ++i)
              summary.phase_seconds[i].second += phases[i].second;
        }
        summary.steps = step + 1;
        summary.skipped += r.applied ? 0 : 1;
        summary.switches += switched ? 1 : 0;
        summary.peak_bytes = std::max(summary.peak_bytes, mem.requested.peak);
        if (switched)
          progress->message(fmt::format(
              "switch before step {}: in [{}] out [{}], {} freed, {} allocated, {:.3f} ms", step + 1,
              fmt::join(switched->activated, ", "), fmt::join(switched->deactivated, ", "),
              mib(switched->bytes_freed), mib(switched->bytes_allocated), switched->seconds * 1e3));
        if (step == start || switched) {
          const auto peak = mem.requested.peak;
          progress->message(fmt::format(
              "memory of rank 0 after step {}: predicted {}, measured peak {} ({:+.3f}%)", step + 1,
              mib(planned), mib(peak), 100.0 * static_cast<double>(peak - planned) / planned));
          space.reset_peaks();  // the next report measures from here
        }
        if (step == start && space.device() == DeviceKind::cuda) {
          const std::int64_t gained =
              device_free_before -
              static_cast<std::int64_t>(cuda_device_memory(rank0_device).free);
          summary.device_outside_plan_bytes = gained - plan_on_gpu;
          progress->message(fmt::format(
              "GPU {} after step {}: the process took {} since its CUDA context was made, the "
              "plan{} is {}: {} outside it (NCCL, cuBLAS's own state, kernel code)",
              rank0_device, step + 1, mib(gained), world > 1 && config.comm != CommKind::nccl
                                                      ? " of its " + std::to_string(world) + " ranks"
                                                      : "",
              mib(plan_on_gpu), mib(summary.device_outside_plan_bytes)));
        }
        if (evaluating) {
          progress->message(fmt::format("validation loss after step {}: {:.4f}", step + 1, val));
          summary.final_val_loss = val;
        }
        interval_loss += loss;
        ++interval_steps;
        if ((step + 1) % config.log_interval == 0 || step + 1 == config.steps || stopping) {
          summary.final_loss = interval_loss / interval_steps;
          interval_loss = 0.0;
          interval_steps = 0;
        }
        const double tokens_per_s = tokens_per_step / seconds;
        if (out.metrics) {
          nlohmann::json line = {{"step", step + 1},         {"loss", loss},
                                 {"lr", engine.lr()},        {"loss_scale", r.loss_scale},
                                 {"grad_norm", r.grad_norm}, {"clip_coef", r.clip_coef},
                                 {"skipped", !r.applied},    {"tokens_per_s", tokens_per_s},
                                 {"step_seconds", seconds}};
          if (!std::isfinite(r.grad_norm)) line["grad_norm"] = nullptr;  // JSON has no Inf
          if (evaluating) line["val_loss"] = val;
          // The validation loss before training, on a fresh run's first line.
          if (step == 0) line["initial_val_loss"] = summary.first_val_loss;
          if (!phases.empty()) {
            nlohmann::json split;
            for (const auto& [name, s] : phases) split[name] = s;
            line["phase_seconds"] = split;
          }
          nlohmann::json memory;
          for (Tag t : kAllTags) memory[tag_name(t)] = mem.tag(t).requested.current;
          memory["total"] = mem.requested.current;
          memory["peak"] = mem.requested.peak;
          line["memory_bytes"] = memory;
          // The driver's view of the GPU (cudaMemGetInfo, the whole device: what a soak watches
          // for leaks the engine's own counts cannot see), on the same steps as the progress
          // lines. Rank 0's GPU is its thread's current device: the model and the allocator make
          // it current at each call.
          const bool sampled =
              step == start || (step + 1) % config.log_interval == 0 || step + 1 == config.steps;
          if (sampled && space.device() == DeviceKind::cuda) {
            const DeviceMemory device = cuda_device_memory(cuda_current_device());
            line["device_free_bytes"] = device.free;
            line["device_total_bytes"] = device.total;
          }
          line["active_groups"] = engine.active_groups();
          if (switched)
            line["switch"] = {{"in", switched->activated},
                              {"out", switched->deactivated},
                              {"bytes_freed", switched->bytes_freed},
                              {"bytes_allocated", switched->bytes_allocated},
                              {"seconds", switched->seconds}};
          out.metrics->write(step + 1, line);
        }
        progress->update({.step = step + 1,
                          .loss = loss,
                          .throughput = tokens_per_s,
                          .memory_bytes = mem.requested.current});
      }
      if ((config.checkpoint.every > 0 &&
           ((step + 1) % config.checkpoint.every == 0 || step + 1 == config.steps)) ||
          (stopping && !config.checkpoint.dir.empty())) {
        SaveOptions options;
        options.extra = {{"step", step + 1}, {"updates", updates}, {"seed", config.seed}};
        // What `ckpt export --format hf` writes as the folder's config.json.
        options.extra["hf_config"] = config.decoder.hf_config;
        options.config = config.source;
        options.run_id = run_id;
        options.parent = parent;
        const auto path = save_checkpoint(  // collective
            engine, std::filesystem::path(config.checkpoint.dir) / checkpoint_name(step + 1),
            options);
        if (rank == 0) prune_checkpoints(config.checkpoint.dir, config.checkpoint.keep, run_id);
        say(fmt::format("checkpoint saved: {}", path.string()));
        if (stopping) stop_checkpoint = path;
      }
      if (stopping) {
        if (rank == 0) {
          std::lock_guard lock(mu);
          summary.stopped_by = out.stop_signal->load();
          summary.stop_checkpoint = stop_checkpoint.string();
          progress->message(fmt::format(
              "stopping on {} (signal {}) after step {} of {}: {}",
              stop_signal_name(summary.stopped_by), summary.stopped_by, step + 1, config.steps,
              summary.stop_checkpoint.empty() ? "no checkpoint (checkpoint.dir is not set)"
                                              : "checkpoint saved: " + summary.stop_checkpoint));
        }
        break;
      }
    }
    if (rank == 0) {
      std::lock_guard lock(mu);
      progress->finish();
      const auto timed_steps = static_cast<double>(summary.steps - start - 1);  // after the first
      if (timed_steps > 0) {
        summary.tokens_per_s = tokens_per_step * timed_steps / timed_seconds;
        for (auto& p : summary.phase_seconds) p.second /= timed_steps;
        summary.engine_step_share = config.timing
                                        ? engine_seconds / (engine_seconds + model_seconds)
                                        : std::numeric_limits<double>::quiet_NaN();
        if (config.timing && space.device() == DeviceKind::cuda && !schedule.enabled())
          summary.model_tflops = run->micro_flops(micro) * accumulation *
                                 timed_steps / model_seconds / 1e12;
      } else if (summary.steps > start) {  // one step this run: its rate, warm-up and all
        summary.tokens_per_s = tokens_per_step / first_seconds;
        summary.rate_of_first_step = true;
        summary.engine_step_share = std::numeric_limits<double>::quiet_NaN();
      }
    }
  };

  if (config.process) {  // this process's rank alone: the others are processes of the same job
    run_process_rank(*config.process, backend, config.comm == CommKind::nccl, config.comm_timeout,
                     [&](int rank, Communicator& comm, std::unique_ptr<Allocator> allocator) {
                       per_rank(rank, comm, std::move(allocator));
                     });
    return summary;
  }
  if (config.comm == CommKind::in_process) {
    run_in_process_ranks(config, backend, [&](int rank, Communicator& comm) {
      per_rank(rank, comm, backend.make_allocator(rank));
    });
    return summary;
  }
  // One GPU per rank, a thread each. A rank that throws leaves the others waiting in NCCL (until
  // shardswap.comm_timeout_s runs out, where it is set); its error is printed at once so that
  // the cause is known even if the run must then be killed.
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
  return summary;
}

}  // namespace shardswap
