#include "tools/train.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <mutex>
#include <optional>

#include "engine/config_json.h"
#include "memory/error.h"

namespace shardswap {

TrainConfig train_config_from_json(ConfigReader& c) {
  TrainConfig t;
  t.engine = engine_config_from_json(c);
  const auto positive = [&](std::string_view key, std::int64_t fallback, std::int64_t max) {
    const auto v = c.integer(key, fallback);
    if (v < 1 || v > max) c.fail(key, fmt::format("= {} must lie in [1, {}]", v, max));
    return v;
  };
  t.world_size = static_cast<int>(positive("world_size", 1, 1024));
  t.steps = positive("steps", 100, std::int64_t{1} << 40);
  t.micro_batch = static_cast<int>(positive("train_micro_batch_size_per_gpu", 32, 1 << 20));
  if (c.has("train_batch_size")) {
    const auto total = c.integer("train_batch_size", 0);
    const auto expected =
        std::int64_t{t.micro_batch} * t.engine.gradient_accumulation_steps * t.world_size;
    if (total != expected)
      c.fail("train_batch_size", fmt::format("= {} but train_micro_batch_size_per_gpu x "
                                             "gradient_accumulation_steps x world_size = {}",
                                             total, expected));
  }
  t.seed = static_cast<std::uint64_t>(c.integer("seed", 1));
  const auto type = c.string("model.type", "residual_mlp");
  if (type != "residual_mlp")
    c.fail("model.type", fmt::format("= '{}': the built-in models are: residual_mlp", type));
  t.model.input_dim = static_cast<int>(positive("model.input_dim", t.model.input_dim, 1 << 16));
  t.model.width = static_cast<int>(positive("model.width", t.model.width, 1 << 16));
  t.model.hidden = static_cast<int>(positive("model.hidden", t.model.hidden, 1 << 16));
  t.model.depth = static_cast<int>(positive("model.depth", t.model.depth, 4096));
  t.model.output_dim = static_cast<int>(positive("model.output_dim", t.model.output_dim, 1 << 16));
  const auto data = c.string("data.type", "teacher_regression");
  if (data != "teacher_regression")
    c.fail("data.type", fmt::format("= '{}': the built-in data is: teacher_regression", data));
  t.noise = c.number("data.noise", t.noise);
  if (!(t.noise >= 0.0)) c.fail("data.noise", fmt::format("= {} must be >= 0", t.noise));
  t.log_interval = static_cast<int>(positive("logging.interval", 10, 1 << 30));
  t.switching = layer_switching_from_json(c);
  try {
    LayerSchedule check(t.switching, model_groups(t.model));  // validates; nothing is allocated
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("config {}: {}", c.source(), e.what()));
  }
  return t;
}

std::vector<std::string> model_groups(const MlpShape& shape) {
  std::vector<std::string> groups{"input"};
  for (int i = 0; i < shape.depth; ++i) groups.push_back(fmt::format("layers.{}", i));
  groups.push_back("head");
  return groups;
}

namespace {

std::string mib(std::int64_t bytes) {
  return fmt::format("{:.2f} MiB", bytes / 1048576.0);
}

}  // namespace

TrainSummary train(const TrainConfig& config, std::ostream& log, std::ostream* metrics,
                   std::ostream* report) {
  TrainSummary summary;
  std::mutex mu;  // rank 0 writes; the lock only orders its writes with the summary read
  run_ranks(config.world_size, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine engine(config.engine, comm, space);
    ResidualMlp model(config.model);
    model.declare(engine);
    const LayerSchedule schedule(config.switching, model_groups(config.model));
    engine.build([&](const ParamInfo& p, std::span<float> v) { model.init(p, v, config.seed); },
                 schedule.active_at(0));
    const TeacherTask task(config.model, config.seed, config.noise);
    if (rank == 0) {
      std::int64_t params = 0;
      for (const auto& p : engine.params()) params += p.numel;
      std::lock_guard lock(mu);
      log << fmt::format(
          "shardswap train: {} params in {} groups, world size {}, ZeRO stage {}, "
          "{}, {}\n",
          params, engine.groups().size(), config.world_size, config.engine.stage,
          dtype_name(config.engine.dtype), optimizer_type_name(config.engine.optimizer.type));
      if (schedule.enabled())
        log << fmt::format("layer switching: {} every {} steps, policy {}; active now: {}\n",
                           config.switching.type, config.switching.interval,
                           deactivate_policy_name(schedule.policy()),
                           fmt::join(engine.active_groups(), ", "));
      if (report) *report << engine.memory_report();
    }
    Eigen::MatrixXf x, target;
    double interval_loss = 0.0;
    int interval_steps = 0;
    auto interval_start = std::chrono::steady_clock::now();
    for (std::int64_t step = 0; step < config.steps; ++step) {
      const auto started = std::chrono::steady_clock::now();
      // Switches happen at step boundaries, the same on every rank (the schedule is a pure
      // function of the step).
      std::optional<SwitchReport> switched;
      if (step > 0 && schedule.boundary(step)) {
        const auto wanted = schedule.active_at(step);
        if (wanted != engine.active_groups())
          switched = engine.set_active(wanted, schedule.policy());
      }
      double loss = 0.0;
      for (int micro = 0; micro < config.engine.gradient_accumulation_steps; ++micro) {
        task.batch(rank, step * config.engine.gradient_accumulation_steps + micro,
                   config.micro_batch, x, target);
        loss += model.train_step(engine, x, target);
      }
      loss /= config.engine.gradient_accumulation_steps;
      const StepResult r = engine.step();
      loss = engine.sum_across_ranks(loss) / config.world_size;
      if (rank != 0) continue;

      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      const double samples = static_cast<double>(config.micro_batch) *
                             config.engine.gradient_accumulation_steps * config.world_size;
      std::lock_guard lock(mu);
      if (step == 0) summary.first_loss = loss;
      summary.steps = step + 1;
      summary.skipped += r.applied ? 0 : 1;
      summary.switches += switched ? 1 : 0;
      if (switched)
        log << fmt::format(
            "switch at step {}: in [{}] out [{}], {} freed, {} allocated, {:.3f} ms\n", step,
            fmt::join(switched->activated, ", "), fmt::join(switched->deactivated, ", "),
            mib(switched->bytes_freed), mib(switched->bytes_allocated), switched->seconds * 1e3);
      interval_loss += loss;
      ++interval_steps;
      const MemoryStats mem = engine.memory_stats();
      if (metrics) {
        nlohmann::json line = {{"step", step + 1},           {"loss", loss},
                               {"grad_norm", r.grad_norm},   {"clip_coef", r.clip_coef},
                               {"loss_scale", r.loss_scale}, {"skipped", !r.applied},
                               {"lr", engine.lr()},          {"samples_per_s", samples / seconds}};
        nlohmann::json memory;
        for (Tag t : kAllTags) memory[tag_name(t)] = mem.tag(t).requested.current;
        memory["total"] = mem.requested.current;
        memory["peak"] = mem.requested.peak;
        line["memory_bytes"] = memory;
        line["active_groups"] = engine.active_groups();
        if (switched)
          line["switch"] = {{"in", switched->activated},
                            {"out", switched->deactivated},
                            {"bytes_freed", switched->bytes_freed},
                            {"bytes_allocated", switched->bytes_allocated},
                            {"seconds", switched->seconds}};
        if (!std::isfinite(r.grad_norm)) line["grad_norm"] = nullptr;  // JSON has no Inf
        *metrics << line.dump() << '\n';
      }
      if ((step + 1) % config.log_interval == 0 || step + 1 == config.steps) {
        const double elapsed =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - interval_start)
                .count();
        summary.final_loss = interval_loss / interval_steps;
        log << fmt::format(
            "step {:>6}/{}  loss {:.6f}  grad_norm {:.4f}  scale {}  skipped {}  "
            "memory {}  {:.0f} samples/s\n",
            step + 1, config.steps, summary.final_loss, r.grad_norm, r.loss_scale, summary.skipped,
            mib(mem.requested.current), samples * interval_steps / elapsed);
        log.flush();
        interval_loss = 0.0;
        interval_steps = 0;
        interval_start = std::chrono::steady_clock::now();
      }
    }
  });
  return summary;
}

}  // namespace shardswap
