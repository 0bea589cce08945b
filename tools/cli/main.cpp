// The shardswap command line. Exit codes: 0 success, 1 runtime failure, 2 bad input; a train
// stopped by SIGINT, SIGTERM or SIGHUP (after its step, saved): 128 + the signal's number.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include <cstring>

#include "shardswap/checkpoint.h"
#include "shardswap/config_json.h"
#include "shardswap/error.h"
#include "bench/bench_offload.h"
#include "bench/bench_optimizer.h"
#include "bench/bench_switch.h"
#include "cli/ckpt.h"
#include "model/safetensors.h"
#include "trainer/metrics_log.h"
#include "trainer/metrics_tee.h"
#include "files/output_file.h"
#include "cli/plot.h"
#include "trainer/progress.h"
#include "trainer/tensorboard.h"
#include "trainer/train.h"

namespace {

constexpr const char* kUsage = R"(usage:
  shardswap train --config FILE [--metrics FILE [--metrics-errors=fail|warn]]
                  [--set key.path=value]... [--strict] [--device-memory SIZE]
                  [--memory-report]
  shardswap plan --config FILE [--set key.path=value]... [--strict] [--device-memory SIZE]
  shardswap eval --config FILE [--checkpoint DIR] [--logits FILE.safetensors] [--set k.path=v]...
                 [--strict] [--device-memory SIZE]

  shardswap bench optimizer [--backend cpu|cuda] [--sizes 64M,256M,1G] [--iters N] [--json FILE]
  shardswap bench offload [--backend cpu|cuda] [--params 256M] [--threads N] [--iters 10]
                          [--json FILE]

  train   runs the built-in model with the JSON config FILE (see docs/config.md)
          --metrics FILE     one JSON object per step (appended to on a resume)
          --metrics-errors=fail|warn
                             a metrics line (or tensorboard event) that cannot be written
                             stops the run (fail, the default), or is counted and reported at
                             the end (warn)
          --set k.path=v     overrides a config key (v is JSON, or a bare string); a key
                             nothing reads is an error
          --strict           (train, plan, eval; or shardswap.strict: true) every config
                             warning is an error: unknown keys, DeepSpeed keys ShardSwap does
                             not implement, keys with no effect, resolved "auto" values; all
                             listed at once, exit 2, nothing written
          --device-memory SIZE
                             (train, plan, eval; or shardswap.device_memory) a budget such
                             as 24GiB: the fastest arrangement that fits is chosen (state on
                             the host, layers recomputed) and each rank is held to it
          --memory-report    prints rank 0's buffers and their holders after build
          SIGINT, SIGTERM, SIGHUP (alike): finishes the step, saves it if checkpoint.dir is
          set, says so and exits 128 + the signal (130, 143, 129); a second signal ends it at
          once, unsaved. Other exits: 0 done, 1 runtime failure, 2 bad input
  plan    prints the bytes every rank will hold, by tag, before anything is allocated
  eval    prints the mean validation loss of the config's model (model.path or from scratch),
          or of checkpoint DIR's weights; --logits writes validation batch 0's inputs and
          logits (decoder)
  shardswap bench switch [--backend cpu|cuda] [--layers 32] [--dim 4096] [--switches 20] [--json FILE]

  bench optimizer
          the fused AdamW shard update against the copy bandwidth of the same run
  bench offload
          optimizer state in host memory: the multi-threaded host update against the host's
          copy bandwidth; with cuda the pinned link, and the update of pinned state on the CPU
          (gradient down, params up) or streamed through the GPU, against the on-device update
          (--threads: all by default)
  bench switch
          the time of a layer switch against the bytes it touches over the copy bandwidth

  shardswap plot METRICS --out FILE.png|FILE.svg [--log-y]
  shardswap ckpt export DIR --out FILE.safetensors [--master]
  shardswap ckpt inspect DIR

  plot    draws loss and val_loss (from before training on; --log-y: on a log axis), and
          memory by tag (MiB), against the step from a train --metrics file, each layer
          switch marked with the groups that came in; needs gnuplot (package gnuplot-nox)
  ckpt export
          a checkpoint's bit16 weights (or with --master its fp32 masters) as safetensors
  ckpt inspect
          what a checkpoint holds: world size, step, groups, active set, files; checksums verified
)";

// ---- stopping on a signal (train) ----

// Set once by the first signal, read by train() at the end of every step. Lock-free, so that a
// signal handler may store it.
std::atomic<int> stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

// Async-signal-safe: an atomic exchange, sigaction and raise. The first signal only asks; a
// second one (any of the three) must not wait for the step: the default action, at once.
void on_stop_signal(int signal) {
  if (stop_signal.exchange(signal) == 0) return;
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  sigaction(signal, &action, nullptr);
  raise(signal);  // delivered, and fatal, as the handler returns
}

// SA_RESTART: the run's reads and writes go on through the signal. A signal that was ignored
// when the process started stays ignored (nohup's SIGHUP, a shell's SIGINT for its background
// jobs): whoever started it asked for that.
void install_stop_handlers() {
  for (const int signal : kStopSignals) {
    struct sigaction old {};
    if (sigaction(signal, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    for (const int other : kStopSignals) sigaddset(&action.sa_mask, other);
    sigaction(signal, &action, nullptr);
  }
}

struct BadUsage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The config of `train` and `plan`: --config FILE and --set overrides, read and checked; its
/// warnings (DeepSpeed keys ShardSwap does not implement, "auto" values) printed once each.
struct ConfigArgs {
  std::string path;
  std::vector<std::string> overrides;
  bool strict = false;  ///< --strict: shardswap.strict = true, whatever the file and --set say
  std::string device_memory;  ///< --device-memory SIZE: shardswap.device_memory, likewise

  /// Takes a flag's value (the next argument), refusing a flag given last without one.
  using TakeValue = std::function<const std::string&()>;
  /// A command's own flags: takes `flag` (calling `value` where it has one) and returns true, or
  /// returns false for a flag it does not know.
  using OtherFlag = std::function<bool(const std::string& flag, const TakeValue& value)>;

  /// Reads --config and --set, and every other flag through `other`, so that `train` and `plan`
  /// read and refuse their arguments alike.
  static ConfigArgs parse(const std::vector<std::string>& args, const OtherFlag& other = {});
};

ConfigArgs ConfigArgs::parse(const std::vector<std::string>& args, const OtherFlag& other) {
  ConfigArgs parsed;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const TakeValue value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) throw BadUsage(fmt::format("{} needs a value", args[i]));
      return args[++i];
    };
    const std::string& flag = args[i];
    if (flag == "--config")
      parsed.path = value();
    else if (flag == "--set")
      parsed.overrides.push_back(value());
    else if (flag == "--strict")
      parsed.strict = true;
    else if (flag == "--device-memory")  // shardswap.device_memory, after the file and --set
      parsed.device_memory = value();
    else if (!other || !other(flag, value))
      throw BadUsage(fmt::format("unknown argument '{}'", flag));
  }
  return parsed;
}

shardswap::TrainConfig load_config(const ConfigArgs& args,
                                   shardswap::ConfigFor purpose = shardswap::ConfigFor::run) {
  if (args.path.empty()) throw BadUsage("needs --config FILE");
  auto reader = shardswap::ConfigReader::from_file(args.path);
  for (const auto& o : args.overrides) reader.set(o);
  if (args.strict) reader.set("shardswap.strict=true");  // after --set: the flag wins
  if (!args.device_memory.empty())
    reader.set("shardswap.device_memory=" + nlohmann::json(args.device_memory).dump());
  // Started as one process per rank (mpirun, srun)? Then world_size is the job's.
  const auto launch = shardswap::process_launch_from_env();
  shardswap::apply_launch_world_size(reader, launch);
  auto config = shardswap::train_config_from_json(reader, purpose);
  shardswap::attach_process_launch(config, launch);
  // Every rank reads the same config: rank 0 alone says what is wrong with it (errors are
  // thrown on every rank, which each ends with its own message).
  if (!launch || launch->rank == 0)
    for (const auto& w : shardswap::config_warnings(reader)) spdlog::warn("{}", w);
  return config;
}

shardswap::MetricsErrors metrics_errors_from(const std::string& value) {
  if (value == "fail") return shardswap::MetricsErrors::fail;
  if (value == "warn") return shardswap::MetricsErrors::warn;
  throw BadUsage(fmt::format("--metrics-errors '{}': expected fail or warn", value));
}

// What a train run reads, which its metrics file must never replace.
std::vector<shardswap::InputFile> train_inputs(const ConfigArgs& args,
                                               const shardswap::TrainConfig& config) {
  std::vector<shardswap::InputFile> inputs = {{"the config file", args.path}};
  for (const auto& file : shardswap::run_input_files(config))
    inputs.push_back({"an input of the run", file});
  std::filesystem::path checkpoint = config.checkpoint.load;
  if (config.checkpoint.load == "latest") {
    const auto found = shardswap::latest_checkpoint(config.checkpoint.dir);
    checkpoint = found ? found->path : std::filesystem::path();
  }
  if (!checkpoint.empty())
    for (auto& input : shardswap::checkpoint_inputs(checkpoint)) inputs.push_back(input);
  return inputs;
}

int train_command(const std::vector<std::string>& args) {
  std::string metrics_path;
  std::optional<shardswap::MetricsErrors> metrics_errors;
  bool memory_report = false;
  const auto config_args =
      ConfigArgs::parse(args, [&](const std::string& flag, const ConfigArgs::TakeValue& value) {
        if (flag == "--metrics")
          metrics_path = value();
        else if (flag == "--metrics-errors")
          metrics_errors = metrics_errors_from(value());
        else if (flag.starts_with("--metrics-errors="))
          metrics_errors = metrics_errors_from(flag.substr(flag.find('=') + 1));
        else if (flag == "--memory-report")
          memory_report = true;
        else
          return false;
        return true;
      });
  // Everything is checked before anything is written: a refused config leaves no metrics file.
  const auto config = load_config(config_args);
  // The policy covers the tensorboard event files too.
  if (metrics_errors && metrics_path.empty() && !config.tensorboard.enabled)
    throw BadUsage("--metrics-errors needs --metrics FILE (or tensorboard.enabled)");
  // One process per rank (mpirun, srun): rank 0 writes the metrics and the summary.
  const bool writes_outputs = !config.process || config.process->rank == 0;
  if (!writes_outputs) metrics_path.clear();
  std::optional<shardswap::MetricsFile> metrics;
  if (!metrics_path.empty())
    metrics.emplace(metrics_path, train_inputs(config_args, config),
                    metrics_errors.value_or(shardswap::MetricsErrors::fail), std::cerr);
  std::optional<shardswap::TensorBoardLog> tensorboard;  // makes its file when the run begins
  if (config.tensorboard.enabled && writes_outputs)
    tensorboard.emplace(config.tensorboard.log_dir(),
                        metrics_errors.value_or(shardswap::MetricsErrors::fail), std::cerr);
  shardswap::MetricsTee logs(
      {metrics ? &*metrics : nullptr, tensorboard ? &*tensorboard : nullptr});
  // A launcher's terminal is a pseudo-terminal of its own (Open MPI's), often logged to a file:
  // one process per rank prints lines, not a progress bar.
  const bool terminal = isatty(fileno(stdout)) != 0 && !config.process;
  shardswap::TrainOutput out{std::cout, logs.empty() ? nullptr : &logs,
                             memory_report ? &std::cout : nullptr, terminal,
                             terminal ? shardswap::terminal_columns(fileno(stdout)) : 0};
  out.stop_signal = &stop_signal;
  install_stop_handlers();
  const auto summary = shardswap::train(config, out);
  if (metrics) metrics->finish();
  if (tensorboard) tensorboard->finish();
  if (!writes_outputs) return 0;
  if (summary.already_finished) {
    std::cout << fmt::format(
        "already finished: the checkpoint resumed is at step {} of steps = {}; nothing trained "
        "or written (raise steps to train further)\n",
        summary.steps, config.steps);
    return 0;
  }
  const std::string ending =
      summary.stopped_by != 0
          ? fmt::format("stopped by {}", shardswap::stop_signal_name(summary.stopped_by))
          : std::string("done");
  const std::int64_t ran = summary.steps - summary.start_step;
  // Steps this process ran, and where the run stands (a resumed run counts the steps before).
  const std::string steps =
      summary.start_step == 0
          ? fmt::format("{} of {} steps", summary.steps, config.steps)
          : fmt::format("{} steps this run ({} to {}), {} of {} in all", ran,
                        summary.start_step + 1, summary.steps, summary.steps, config.steps);
  std::cout << fmt::format(
      "{}: {}, {} skipped, {} switches; loss {:.4f} -> {:.4f}; validation loss {:.4f} -> "
      "{:.4f}; {:.0f} tokens/s{}; rank 0 peak {:.2f} MiB, predicted {:.2f} MiB\n",
      ending, steps, summary.skipped, summary.switches, summary.first_loss, summary.final_loss,
      summary.first_val_loss, summary.final_val_loss, summary.tokens_per_s,
      summary.rate_of_first_step ? " (one step: with its one-off warm-up)" : "",
      summary.peak_bytes / 1048576.0, summary.predicted_bytes / 1048576.0);
  if (config.timing) {
    if (std::isnan(summary.engine_step_share))
      std::cout << "step time: the share of engine.step() not measured (one step, warm-up only)";
    else
      std::cout << fmt::format("step time: {:.1f}% in engine.step() (reduce, optimizer, gather)",
                               100.0 * summary.engine_step_share);
    // The model's GEMM rate is measured on cuda for a run without layer switching (the FLOPs
    // of a step with frozen groups are not counted), and only with two steps or more.
    if (summary.model_tflops > 0) {
      std::cout << fmt::format("; model forward+backward {:.1f} TFLOP/s of GEMM work",
                               summary.model_tflops);
      if (summary.cublas_tflops > 0)
        std::cout << fmt::format(" ({:.0f}% of cuBLAS's {:.1f} TFLOP/s in this run)",
                                 100.0 * summary.model_tflops / summary.cublas_tflops,
                                 summary.cublas_tflops);
    } else {
      std::cout << "; model GEMM rate not measured (it is on cuda, without layer switching, "
                   "over two steps or more)";
    }
    std::cout << "\n";
    if (!summary.phase_seconds.empty()) {
      double total = 0.0;
      std::string parts;
      for (const auto& [name, s] : summary.phase_seconds) {
        total += s;
        parts += fmt::format("{}{} {:.2f}", parts.empty() ? "" : ", ", name, s * 1e3);
      }
      std::cout << fmt::format("time per step, rank 0 (ms): {}; total {:.2f}\n", parts,
                               total * 1e3);
    }
  }
  return summary.stopped_by != 0 ? 128 + summary.stopped_by : 0;
}

// `plan` and `eval` compute every rank in one process (threads): under a launcher (mpirun,
// srun) rank 0 runs the whole command and the other processes, having checked the same config
// and inputs, end at once (N copies of the command would print N times and share the GPUs).
bool runs_whole_command(const shardswap::TrainConfig& config) {
  return !config.process || config.process->rank == 0;
}

int eval_command(const std::vector<std::string>& args) {
  std::string checkpoint, logits_path;
  const auto config_args =
      ConfigArgs::parse(args, [&](const std::string& flag, const ConfigArgs::TakeValue& value) {
        if (flag == "--checkpoint")
          checkpoint = value();
        else if (flag == "--logits")
          logits_path = value();
        else
          return false;
        return true;
      });
  const auto config = load_config(config_args);
  if (!checkpoint.empty()) shardswap::read_checkpoint_metadata(checkpoint);  // checked first
  if (!runs_whole_command(config)) return 0;
  std::optional<shardswap::OutputFile> logits_file;
  if (!logits_path.empty()) {
    std::vector<shardswap::InputFile> inputs = {{"the config file", config_args.path}};
    if (!checkpoint.empty())
      for (auto& input : shardswap::checkpoint_inputs(checkpoint)) inputs.push_back(input);
    logits_file.emplace("--logits", logits_path, inputs);
  }
  const auto summary = shardswap::evaluate(config, checkpoint, logits_file.has_value());
  if (logits_file) {
    const auto& l = summary.logits;
    const std::vector<std::int64_t> tokens = {l.sequences, l.seq_len};
    shardswap::write_safetensors(
        *logits_file,
        {{{"inputs", "I32", tokens}, std::as_bytes(std::span(l.inputs))},
         {{"logits", "F32", {l.sequences, l.seq_len, l.vocab}}, std::as_bytes(std::span(l.logits))}},
        {{"source", "shardswap eval --logits: validation batch 0"}});
  }
  std::cout << fmt::format("validation loss {:.6f} ({} batches of {} sequences; {})\n",
                           summary.val_loss, summary.batches, summary.sequences_per_batch,
                           summary.step < 0 ? std::string("initial weights")
                                            : fmt::format("checkpoint {} at step {}", checkpoint,
                                                          summary.step));
  return 0;
}

int plan_command(const std::vector<std::string>& args) {
  // A plan needs the model's shapes alone: the data is never opened (nor needs to exist).
  const auto config = load_config(ConfigArgs::parse(args), shardswap::ConfigFor::plan);
  if (runs_whole_command(config)) shardswap::print_plan(config, std::cout);
  return 0;
}

// The command named by args[0]; exceptions become the exit codes above, with the message.
int run_command(const std::vector<std::string>& args) {
  try {
    const bool help = std::any_of(args.begin(), args.end(), [](const std::string& a) {
      return a == "--help" || a == "-h";
    });
    if (args.empty() || help) {  // `shardswap --help`, `shardswap train --help`, ...
      std::cout << kUsage;
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "train") return train_command({args.begin() + 1, args.end()});
    if (args[0] == "plan") return plan_command({args.begin() + 1, args.end()});
    if (args[0] == "eval") return eval_command({args.begin() + 1, args.end()});
    if (args[0] == "bench" && args.size() > 1 && args[1] == "optimizer")
      return shardswap::bench_optimizer({args.begin() + 2, args.end()}, std::cout);
    if (args[0] == "bench" && args.size() > 1 && args[1] == "offload")
      return shardswap::bench_offload({args.begin() + 2, args.end()}, std::cout);
    if (args[0] == "bench" && args.size() > 1 && args[1] == "switch")
      return shardswap::bench_switch({args.begin() + 2, args.end()}, std::cout);
    if (args[0] == "ckpt")
      return shardswap::ckpt_command({args.begin() + 1, args.end()}, std::cout);
    if (args[0] == "plot")
      return shardswap::plot_command({args.begin() + 1, args.end()}, std::cout);
    throw BadUsage(fmt::format("unknown command '{}'", args[0]));
  } catch (const BadUsage& e) {
    std::cerr << "shardswap: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const shardswap::ConfigError& e) {
    // One mistake a line (reject_unknown_keys names each unknown key on its own): each line
    // gets the prefix, so every line reads "shardswap: FILE: KEY ...".
    const std::string what = e.what();
    for (std::size_t start = 0; start <= what.size();) {
      const auto end = std::min(what.find('\n', start), what.size());
      std::cerr << "shardswap: " << std::string_view(what).substr(start, end - start) << "\n";
      start = end + 1;
    }
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shardswap: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Every cuBLAS handle ShardSwap makes is given a workspace from the engine's plan
  // (cublasSetWorkspace); without this cuBLAS would also keep a pool of its own per handle
  // (64 MiB on an H200, cuBLAS 13), outside the plan (docs/memory.md). Before any thread and
  // any CUDA call; a value the user set wins.
  setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0", /*overwrite=*/0);
  // Results and progress on stdout, line-buffered even into a file or pipe: `shardswap train >
  // run.log` shows each line as it comes (a file is otherwise block-buffered), and a run that is
  // killed keeps what it printed. Every command's output is a result: one that could not be
  // written whole (a full disk, a closed stdout) ends the command with exit 1 naming stdout;
  // train still runs to its end (its checkpoints and metrics are written on their own).
  shardswap::DescriptorOutput stdout_buffer(STDOUT_FILENO);
  std::streambuf* const stdio_buffer = std::cout.rdbuf(&stdout_buffer);
  // Warnings and errors on stderr: `train > run.log` keeps the run's lines apart from what went
  // wrong.
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "", std::make_shared<spdlog::sinks::stderr_color_sink_mt>()));
  int code = run_command({argv + 1, argv + argc});
  std::cout.flush();
  if (const int error = stdout_buffer.finish(); error != 0) {
    std::cerr << "shardswap: error: stdout: " << std::strerror(error) << "\n";
    if (code == 0) code = 1;
  }
  std::cout.rdbuf(stdio_buffer);  // before stdout_buffer goes: std::cout outlives main
  return code;
}
