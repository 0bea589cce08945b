// Policy for a DeepSpeed config in ShardSwap: a key ShardSwap implements means what it means in
// DeepSpeed; a value ShardSwap cannot honour and that would change the numbers (ZeRO-3, amsgrad)
// is an error; a setting it cannot honour but whose result is the same (reduce_scatter false,
// offload, logging) is a warning; "auto" takes the value Hugging Face's Trainer fills in from its
// defaults, with a warning naming it. Unread keys of ShardSwap's own sections are errors; in strict
// mode every warning is.
#include "shardswap/config_json.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <optional>
#include <string_view>

#include "shardswap/error.h"

namespace shardswap {

namespace {

// DeepSpeed keys ShardSwap knows and does not implement, with what it does instead. A key ending
// in '*' stands for every key it begins (one warning per such key). A leaf below a listed key
// belongs to it: the whole sub-object is one warning.
struct KnownKey {
  std::string_view key;
  std::string_view instead;
};

constexpr std::string_view kNoOffload =
    "ShardSwap keeps params on the training device (the fp32 master and optimizer state move to "
    "the host with zero_optimization.offload_optimizer.device = \"cpu\")";
constexpr std::string_view kOffloadSpelling =
    "DeepSpeed's older spelling; write zero_optimization.offload_optimizer.device = \"cpu\" "
    "and offload_optimizer.pin_memory";
constexpr std::string_view kNoNvme = "an NVMe-offload setting; ShardSwap offloads to host memory";
constexpr std::string_view kMetrics =
    "use `shardswap train --metrics FILE` (one JSON line per step)";
constexpr std::string_view kOwnCheckpoints =
    "a DeepSpeed checkpoint option; ShardSwap's checkpoints always store per-param, "
    "world-size-independent state (docs/checkpoints.md)";
constexpr std::string_view kNoZero3 = "a ZeRO-3 setting; ShardSwap implements stages 1 and 2";

constexpr KnownKey kUnimplemented[] = {
    {"steps_per_print", "progress lines come every logging.interval steps"},
    {"wall_clock_breakdown", kMetrics},
    {"memory_breakdown", "use `shardswap train --memory-report`"},
    {"dump_state", "not implemented"},
    {"flops_profiler", kMetrics},
    // `shardswap train` reads the tensorboard section (tools/trainer/tensorboard.h): this is what a
    // program of its own that loads the config through the engine's API is told.
    {"tensorboard", "the engine writes no event files; `shardswap train` does (docs/config.md)"},
    {"wandb", kMetrics},
    {"csv_monitor", kMetrics},
    {"comet", kMetrics},
    {"comms_logger", kMetrics},
    {"timers", kMetrics},
    {"activation_checkpointing",
     "the decoder recomputes its lowest layers with model.recompute_layers (docs/models.md)"},
    {"prescale_gradients",
     "ShardSwap sums gradients in the reduction and divides by ranks x micro-batches in the "
     "update"},
    {"gradient_predivide_factor",
     "ShardSwap sums gradients in the reduction and divides by ranks x micro-batches in the "
     "update"},
    {"sparse_gradients", "gradients are dense"},
    {"amp", "mixed precision is bf16.enabled or fp16.enabled"},
    {"zero_allow_untested_optimizer", "every ShardSwap optimizer is sharded"},
    {"zero_force_ds_cpu_optimizer", kNoOffload},
    {"disable_allgather", "updated shards are always all-gathered"},
    {"sparse_attention", "not implemented"},
    {"elasticity", "not implemented"},
    {"autotuning", "not implemented"},
    {"data_efficiency", "not implemented"},
    {"curriculum_learning", "not implemented"},
    {"compression_training", "not implemented"},
    {"quantize_training", "not implemented"},
    {"weight_quantization", "not implemented"},
    {"progressive_layer_drop", "layer switching is configured in layer_switching"},
    {"eigenvalue", "not implemented"},
    {"pipeline", "ShardSwap is data-parallel only"},
    {"hybrid_engine", "not implemented"},
    {"aio", kNoOffload},
    {"nebula", "not implemented"},
    {"compile", "not implemented"},
    {"dataloader_drop_last",
     "a step's batch is drawn across epoch boundaries, never partial (docs/data.md)"},
    {"seq_parallel_comm_data_type", "ShardSwap is data-parallel only"},
    {"use_data_before_expert_parallelism", "ShardSwap is data-parallel only"},
    {"checkpoint.tag_validation", kOwnCheckpoints},
    {"checkpoint.load_universal", kOwnCheckpoints},
    {"checkpoint.use_node_local_storage", kOwnCheckpoints},
    {"checkpoint.parallel_write", kOwnCheckpoints},
    {"optimizer.legacy_fusion", "ShardSwap's update is always one fused pass per shard"},
    {"optimizer.params.torch_adam",
     "ShardSwap runs its own fused kernel; the update rule is the same"},
    {"optimizer.params.set_grad_none", "gradient buffers are owned by the engine"},
    {"bf16.immediate_grad_update", "not implemented"},
    {"fp16.auto_cast", "inputs are the model's business, not the engine's"},
    {"fp16.fp16_master_weights_and_grads", "master weights are always fp32"},
    {"zero_optimization.offload_optimizer.nvme_path", kNoNvme},
    {"zero_optimization.offload_optimizer.buffer_count", kNoNvme},
    {"zero_optimization.offload_optimizer.ratio",
     "the whole optimizer state is offloaded or none of it"},
    {"zero_optimization.offload_optimizer.fast_init", kNoNvme},
    {"zero_optimization.offload_param", kNoOffload},
    {"zero_optimization.cpu_offload", kOffloadSpelling},
    {"zero_optimization.cpu_offload_param", kNoOffload},
    {"zero_optimization.cpu_offload_params", kNoOffload},
    {"zero_optimization.cpu_offload_use_pin_memory", kOffloadSpelling},
    {"zero_optimization.sub_group_size", kNoZero3},
    {"zero_optimization.stage3_*", kNoZero3},
    {"zero_optimization.zero_hpz_partition_size", kNoZero3},
    {"zero_optimization.zero_quantized_weights", kNoZero3},
    {"zero_optimization.zero_quantized_nontrainable_weights", kNoZero3},
    {"zero_optimization.zero_quantized_gradients", "gradients travel in communication_data_type"},
    {"zero_optimization.zeropp_loco_param", "gradients travel in communication_data_type"},
    {"zero_optimization.mics_shard_size", kNoZero3},
    {"zero_optimization.mics_hierarchical_params_gather", kNoZero3},
    {"zero_optimization.memory_efficient_linear", kNoZero3},
    {"zero_optimization.module_granularity_threshold", kNoZero3},
    {"zero_optimization.use_all_reduce_for_fetch_params", kNoZero3},
    {"zero_optimization.pipeline_loading_checkpoint", kNoZero3},
    {"zero_optimization.override_module_apply", kNoZero3},
    {"zero_optimization.log_trace_cache_warnings", kNoZero3},
    {"zero_optimization.ignore_unused_parameters", "every declared param gets a gradient slot"},
    {"zero_optimization.legacy_stage1", "stage 1 has one implementation"},
    {"zero_optimization.elastic_checkpoint", kOwnCheckpoints},
    {"zero_optimization.load_from_fp32_weights", kOwnCheckpoints},
    {"zero_optimization.use_multi_rank_bucket_allreduce",
     "stage-2 gradients are reduce-scattered in buckets"},
};

// The known key that `leaf` is (or lies under), spelt as in the config; empty if none.
std::string known_key_of(std::string_view leaf, const KnownKey** entry) {
  for (const auto& k : kUnimplemented) {
    std::string_view key = k.key;
    if (key.back() == '*') {
      key.remove_suffix(1);
      if (leaf.substr(0, key.size()) != key) continue;
      // The whole key at that level: "zero_optimization.stage3_max_live_parameters".
      const auto end = leaf.find_first_of(".[", key.size());
      *entry = &k;
      return std::string(leaf.substr(0, end));
    }
    if (leaf == key || (leaf.size() > key.size() && leaf.substr(0, key.size()) == key &&
                        (leaf[key.size()] == '.' || leaf[key.size()] == '['))) {
      *entry = &k;
      return std::string(key);
    }
  }
  return {};
}

// The end of the warning for an "auto" that takes the default of one of the Trainer's arguments
// (transformers' HfTrainerDeepSpeedConfig fills each such key from TrainingArguments).
std::string trainer_default(std::string_view argument) {
  return fmt::format("(Hugging Face's Trainer default: TrainingArguments.{})", argument);
}

std::string did_you_mean(const ConfigReader& c, const std::string& key) {
  const auto guess = c.closest_read_key(key);
  return guess ? fmt::format(" (did you mean '{}'?)", *guess) : std::string();
}

// An integer key that ends up in an int: range-checked before the cast, so 1e12 is an error, not
// a wrapped negative.
int bounded_int(ConfigReader& c, std::string_view key, std::int64_t fallback, std::int64_t lo,
                std::int64_t hi = INT_MAX) {
  const auto v = c.integer(key, fallback);
  if (v < lo || v > hi)
    c.fail(key, fmt::format("{}", v), fmt::format("must lie in [{}, {}]", lo, hi));
  return static_cast<int>(v);
}

// A DeepSpeed bucket size in elements of `type`, as bytes.
std::size_t bucket_bytes(ConfigReader& c, std::string_view key, DType type) {
  constexpr std::int64_t kMaxElements = std::int64_t{1} << 40;
  const auto elements = c.integer(key, 500'000'000);
  if (elements < 1)
    c.fail(key, fmt::format("{} elements", elements), "must be >= 1 (it counts elements)");
  if (elements > kMaxElements)
    c.fail(key, fmt::format("{} elements", elements), "must be <= 2^40 elements");
  return static_cast<std::size_t>(elements) * dtype_size(type);
}

// A switch whose DeepSpeed default is the only behaviour ShardSwap has: the other value is
// accepted with a warning saying what happens instead.
void only_default(ConfigReader& c, std::string_view key, bool shardswap_does,
                  std::string_view instead) {
  if (c.boolean(key, shardswap_does) != shardswap_does)
    c.warn(key, fmt::format("{}", !shardswap_does), fmt::format("not implemented; {}", instead));
}

void read_precision(ConfigReader& c, EngineConfig& cfg) {
  if (c.has("bf16") && c.has("bfloat16"))
    c.fail("bfloat16", "DeepSpeed's older name of bf16: give one of the two");
  const std::string bf16_key = c.has("bfloat16") ? "bfloat16.enabled" : "bf16.enabled";
  // "auto": the Trainer fills both in from its fp16 and bf16 arguments, false by default, which
  // trains in fp32. ShardSwap trains bit16 params only: where the Trainer's defaults would give
  // fp32 (neither key true, one of them "auto", bf16 not turned off), it trains bf16 and the
  // "auto" key's warning says so.
  const bool fp16_auto = c.is_auto("fp16.enabled");
  const bool bf16_auto = c.is_auto(bf16_key);
  const bool fp16_given = !fp16_auto && c.boolean("fp16.enabled", false);
  const bool fp32_by_trainer =
      !fp16_given && (fp16_auto || bf16_auto) && (bf16_auto || !c.has(bf16_key));
  constexpr std::string_view kNoFp32 =
      "; with both false the Trainer trains in fp32, which ShardSwap does not (bit16 params only)";
  c.resolve_auto("fp16.enabled", false,
                 trainer_default("fp16") +
                     (fp32_by_trainer && !bf16_auto
                          ? fmt::format("{}: it trains bf16, as {} is not set", kNoFp32, bf16_key)
                          : std::string()));
  c.resolve_auto(bf16_key, fp32_by_trainer,
                 fp32_by_trainer
                     ? fmt::format("(Hugging Face's Trainer default, TrainingArguments.bf16, is "
                                   "false{}: it trains bf16)",
                                   kNoFp32)
                     : trainer_default("bf16"));
  const bool fp16 = c.boolean("fp16.enabled", false);
  const bool bf16 = c.boolean(bf16_key, fp32_by_trainer);
  if (bf16 && fp16)
    c.fail("fp16.enabled", "true", fmt::format("{} is true too: enable one of the two", bf16_key));
  if (!bf16 && !fp16)
    c.fail(bf16_key, "false",
           "this or fp16.enabled must be true: ShardSwap trains bit16 params only");
  cfg.dtype = bf16 ? DType::bf16 : DType::f16;
  cfg.grad_dtype = dtype_from_name(c.string("data_types.grad_accum_dtype", dtype_name(cfg.dtype)),
                                   "data_types.grad_accum_dtype");
  cfg.comm_dtype = dtype_from_name(c.string("communication_data_type", dtype_name(cfg.grad_type())),
                                   "communication_data_type");

  // The fp16 section is read and checked even when bf16 is on: Hugging Face's configs carry both
  // sections, and a bad value is a mistake whichever is enabled.
  LossScaleConfig scale;
  const double loss_scale = c.number("fp16.loss_scale", 0.0);
  if (!(loss_scale >= 0.0) || !std::isfinite(loss_scale))
    c.fail("fp16.loss_scale", fmt::format("{}", loss_scale),
           "must be 0 (dynamic scaling) or a finite static scale > 0");
  scale.dynamic = loss_scale == 0.0;
  if (!scale.dynamic) scale.static_scale = loss_scale;
  scale.initial_scale = std::ldexp(1.0, bounded_int(c, "fp16.initial_scale_power", 16, 0, 64));
  scale.window = bounded_int(c, "fp16.loss_scale_window", 1000, 1);
  scale.hysteresis = bounded_int(c, "fp16.hysteresis", 2, 1);
  scale.min_scale = c.number("fp16.min_loss_scale", 1.0);
  only_default(c, "fp16.consecutive_hysteresis", false,
               "the hysteresis is restored only when the scale grows");
  scale.validate("fp16");
  if (fp16) cfg.loss_scale = scale;
}

void read_optimizer(ConfigReader& c, EngineConfig& cfg) {
  constexpr std::string_view p = "optimizer.params.";
  const auto key = [&](std::string_view name) { return fmt::format("{}{}", p, name); };
  if (c.has(key("max_grad_norm")))
    c.fail_value(key("max_grad_norm"), "not an optimizer parameter: clip with gradient_clipping");
  // "auto": the Trainer's defaults. Registered for every rule: SGD's warnings about Adam's keys
  // show the value too.
  c.resolve_auto(key("lr"), 5e-5, trainer_default("learning_rate"));
  c.resolve_auto(key("betas"), nlohmann::json::array({0.9, 0.999}),
                 trainer_default("adam_beta1, adam_beta2"));
  c.resolve_auto(key("eps"), 1e-8, trainer_default("adam_epsilon"));
  c.resolve_auto(key("weight_decay"), 0.0, trainer_default("weight_decay"));
  auto& o = cfg.optimizer;
  o.type = optimizer_type_from_name(c.string("optimizer.type", "AdamW"), "optimizer.type");
  constexpr std::string_view kStateDtype = "shardswap.optimizer_state_dtype";
  const std::string state_dtype = c.string(kStateDtype, "fp32");
  if (state_dtype != "fp32" && state_dtype != "bf16")
    c.fail_value(kStateDtype, "expected \"fp32\" or \"bf16\" (Adam's m and v, SGD's momentum)");
  o.state_dtype = state_dtype == "bf16" ? DType::bf16 : DType::f32;
  constexpr std::string_view kMaster = "shardswap.master_weights";
  const std::string master = c.string(kMaster, "fp32");
  if (master != "fp32" && master != "bf16_remainder")
    c.fail_value(kMaster, "expected \"fp32\" or \"bf16_remainder\" (the fp32 master as the bf16 "
                          "weight and its low 16 bits)");
  o.master = master == "bf16_remainder" ? MasterStorage::bf16_remainder : MasterStorage::fp32;
  o.lr = c.number(key("lr"), 1e-3);
  o.weight_decay = c.number(key("weight_decay"), 0.0);
  // Parameters of the other rule are not silently dropped: each gets a warning.
  const auto not_for = [&](std::initializer_list<std::string_view> names, std::string_view rule) {
    for (const auto name : names)
      if (c.has(key(name))) {
        c.warn(
            key(name), *c.written(key(name)),
            fmt::format("applies to {} only; ignored for {}", rule, optimizer_type_name(o.type)));
        c.mark_read(key(name));
      }
  };
  if (o.type == OptimizerType::sgd) {
    o.momentum = c.number(key("momentum"), 0.0);
    o.dampening = c.number(key("dampening"), 0.0);
    o.nesterov = c.boolean(key("nesterov"), false);
    not_for({"betas", "eps", "adam_w_mode", "amsgrad", "bias_correction"}, "Adam and AdamW");
    return;
  }
  not_for({"momentum", "dampening", "nesterov"}, "SGD");
  const auto betas = c.numbers(key("betas"), {0.9, 0.999});
  if (betas.size() != 2) c.fail_value(key("betas"), "must hold two numbers");
  o.beta1 = betas[0];
  o.beta2 = betas[1];
  o.eps = c.number(key("eps"), 1e-8);
  if (c.boolean(key("amsgrad"), false))
    c.fail(key("amsgrad"), "true", "not implemented: ShardSwap's Adam keeps no max of v");
  if (!c.boolean(key("bias_correction"), true))
    c.fail(key("bias_correction"), "false", "not implemented: ShardSwap's Adam always corrects");
  // DeepSpeed runs "Adam" with decoupled decay unless adam_w_mode is false; "AdamW" always.
  const bool explicit_mode = c.has(key("adam_w_mode")) && !c.is_auto(key("adam_w_mode"));
  const bool adam_w_mode = c.boolean(key("adam_w_mode"), true);
  if (o.type == OptimizerType::adamw && !adam_w_mode)
    c.warn(key("adam_w_mode"), "false",
           "ignored for AdamW, as in DeepSpeed: decay stays decoupled");
  if (o.type == OptimizerType::adam && adam_w_mode) {
    o.type = OptimizerType::adamw;
    if (!explicit_mode && o.weight_decay > 0)
      c.warn("optimizer.type", "\"Adam\"",
             "decays weights decoupled (AdamW), as DeepSpeed does by default; set "
             "optimizer.params.adam_w_mode = false for L2 decay in the gradient");
  }
}

// DeepSpeed's offload_optimizer: device "none" or "cpu" (the host), and pin_memory, whose default
// is DeepSpeed's (false) when the section is given.
void read_offload(ConfigReader& c, EngineConfig& cfg) {
  constexpr std::string_view kSection = "zero_optimization.offload_optimizer";
  c.expect_object(kSection);
  const std::string device_key = std::string(kSection) + ".device";
  const std::string device = c.string(device_key, "none");
  if (device == "cpu") {
    cfg.optimizer_placement = Placement::host;
  } else if (device == "nvme") {
    c.fail_value(device_key, kNoNvme);
  } else if (device != "none") {
    c.fail_value(device_key, "expected \"none\" or \"cpu\"");
  }
  if (c.has(kSection))
    cfg.pin_host_memory = c.boolean(std::string(kSection) + ".pin_memory", false);
  const auto chunk = c.integer("shardswap.offload_chunk_elements",
                               static_cast<std::int64_t>(cfg.offload_chunk_elements));
  if (chunk < 1 || chunk > (std::int64_t{1} << 40))
    c.fail("shardswap.offload_chunk_elements", fmt::format("{} elements", chunk),
           "must lie in [1, 2^40] elements");
  cfg.offload_chunk_elements = static_cast<std::size_t>(chunk);
  cfg.offload_update = offload_update_from_name(
      c.string("shardswap.offload_update", offload_update_name(cfg.offload_update)),
      "shardswap.offload_update");
  const auto threads = c.integer("shardswap.offload_threads", 0);
  if (threads < 0 || threads > 4096)
    c.fail("shardswap.offload_threads", fmt::format("{}", threads),
           "must lie in [0, 4096] (0: every core)");
  cfg.offload_threads = static_cast<unsigned>(threads);
  const std::string grads = c.string("shardswap.gradient_placement", "device");
  if (grads == "host")
    cfg.gradient_placement = Placement::host;
  else if (grads != "device")
    c.fail_value("shardswap.gradient_placement", "expected \"device\" or \"host\"");
  cfg.overlap_update = c.boolean("shardswap.overlap_update", false);
  const std::string frozen = c.string("shardswap.frozen_weight_placement", "device");
  if (frozen == "host")
    cfg.frozen_weight_placement = Placement::host;
  else if (frozen != "device")
    c.fail_value("shardswap.frozen_weight_placement", "expected \"device\" or \"host\"");
}

void read_zero(ConfigReader& c, EngineConfig& cfg, std::optional<std::int64_t> hidden_size) {
  cfg.stage = bounded_int(c, "zero_optimization.stage", 2, INT_MIN);
  if (cfg.stage == 3)
    c.fail("zero_optimization.stage", "3",
           "ZeRO-3 (partitioned params) is not supported by ShardSwap; stages 1 and 2 are");
  if (cfg.stage == 0)
    c.fail("zero_optimization.stage", "0",
           "no sharding is not implemented by ShardSwap; stages 1 and 2 are");
  constexpr std::string_view kReduceBucket = "zero_optimization.reduce_bucket_size";
  // "auto": the Trainer fills in the model's hidden_size squared.
  if (hidden_size)
    c.resolve_auto(std::string(kReduceBucket), *hidden_size * *hidden_size,
                   fmt::format("= hidden_size^2 = {} x {} elements, as Hugging Face's Trainer "
                               "computes it",
                               *hidden_size, *hidden_size));
  else if (c.is_auto(kReduceBucket))
    c.warn(kReduceBucket, "\"auto\"",
           "Hugging Face's Trainer fills in the model's hidden_size^2, which this reader is not "
           "given; ShardSwap uses its default, 500000000 elements");
  cfg.reduce_bucket_bytes = bucket_bytes(c, kReduceBucket, cfg.grad_type());
  if (c.has("zero_optimization.allgather_bucket_size")) {
    bucket_bytes(c, "zero_optimization.allgather_bucket_size", cfg.dtype);  // still validated
    c.warn("zero_optimization.allgather_bucket_size",
           *c.written("zero_optimization.allgather_bucket_size"),
           "no effect: ShardSwap all-gathers each group's updated shards in place, with no "
           "gather bucket to size");
  }
  cfg.overlap_comm = c.boolean("zero_optimization.overlap_comm", true);
  only_default(c, "zero_optimization.contiguous_gradients", true,
               "ShardSwap's stage-2 gradient partitions are always contiguous");
  only_default(c, "zero_optimization.reduce_scatter", true,
               "ShardSwap always reduce-scatters gradients (DeepSpeed would all-reduce); the "
               "result is the same");
  only_default(c, "zero_optimization.allgather_partitions", true,
               "ShardSwap always all-gathers updated shards (DeepSpeed would broadcast them); the "
               "result is the same");
  cfg.order = c.boolean("zero_optimization.round_robin_gradients", false)
                  ? LayoutOrder::round_robin
                  : LayoutOrder::declaration;
  read_offload(c, cfg);
}

EngineConfig read(ConfigReader& c, const BatchSizes& batches,
                  std::optional<std::int64_t> hidden_size) {
  for (const char* section :
       {"optimizer", "optimizer.params", "scheduler", "scheduler.params", "fp16", "bf16",
        "bfloat16", "zero_optimization", "data_types", "shardswap"})
    c.expect_object(section);
  EngineConfig cfg;
  read_precision(c, cfg);
  read_optimizer(c, cfg);
  c.resolve_auto("gradient_clipping", 1.0, trainer_default("max_grad_norm"));
  cfg.gradient_clipping = c.number("gradient_clipping", 0.0);
  cfg.gradient_accumulation_steps = batches.gradient_accumulation_steps;
  read_zero(c, cfg, hidden_size);
  const auto alignment = c.integer("shardswap.alignment_bytes", 256);
  if (alignment < 1 || alignment > (std::int64_t{1} << 30))
    c.fail("shardswap.alignment_bytes", fmt::format("{} bytes", alignment),
           "must lie in [1, 2^30] bytes");
  cfg.alignment_bytes = static_cast<std::size_t>(alignment);
  cfg.nonfinite = nonfinite_policy_from_name(
      c.string("shardswap.nonfinite", nonfinite_policy_name(cfg.nonfinite)), "shardswap.nonfinite");
  cfg.validate("");  // the JSON keys, not the C++ fields
  return cfg;
}

// Errors from validators below the reader ("KEY = VALUE: what") know the key but not the file:
// add it.
template <class F>
auto naming_the_file(const ConfigReader& c, F&& f) {
  try {
    return f();
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);
  }
}

}  // namespace

EngineConfig engine_config_from_json(ConfigReader& c, const BatchSizes& batches,
                                     std::optional<std::int64_t> model_hidden_size) {
  return naming_the_file(c, [&] { return read(c, batches, model_hidden_size); });
}

LrSchedule lr_schedule_from_json(ConfigReader& c, double optimizer_lr) {
  return naming_the_file(c, [&] {
    LrSchedule s;
    s.peak_lr = optimizer_lr;
    if (!c.has("scheduler")) return s;
    c.expect_object("scheduler");
    c.expect_object("scheduler.params");
    if (!c.has("scheduler.type") || c.is_auto("scheduler.type"))
      c.fail("scheduler.type",
             "missing: WarmupLR, WarmupDecayLR or WarmupCosineLR "
             "(leave out the scheduler section for a constant lr)");
    s.type = lr_schedule_type_from_name(c.string("scheduler.type", ""), "scheduler.type");
    const auto name = lr_schedule_type_name(s.type);
    constexpr std::string_view p = "scheduler.params.";
    const auto key = [&](std::string_view k) { return fmt::format("{}{}", p, k); };
    if (c.has(key("last_batch_iteration")))
      c.fail_value(key("last_batch_iteration"),
                   "not supported: the lr is a function of the update count, which a resumed run "
                   "carries itself");
    // Parameters of the other schedules are not silently dropped: DeepSpeed refuses them.
    const auto refuse = [&](std::initializer_list<std::string_view> names) {
      for (const auto k : names)
        if (c.has(key(k))) c.fail_value(key(k), fmt::format("not a parameter of {}", name));
    };

    // "auto": what the Trainer fills in. Its warmup is TrainingArguments.warmup_steps (or
    // warmup_ratio x the steps), both 0 by default.
    c.resolve_auto(
        key("warmup_num_steps"), 0,
        trainer_default("warmup_steps") + "; warmup lasts 2 updates at least, as in DeepSpeed");
    c.resolve_auto(key("warmup_min_lr"), 0.0, "(what Hugging Face's Trainer always fills in)");
    c.resolve_auto(key("warmup_max_lr"), optimizer_lr,
                   "= optimizer.params.lr (Hugging Face's Trainer fills in its learning_rate)");
    s.warmup_num_steps = c.integer(key("warmup_num_steps"), 1000);
    if (c.has(key("warmup_num_steps")) && s.warmup_num_steps >= 0 && s.warmup_num_steps < 2)
      c.warn(key("warmup_num_steps"), fmt::format("{}", s.warmup_num_steps),
             "warmup lasts 2 updates at least, as in DeepSpeed");
    s.warmup_type = warmup_curve_from_name(c.string(key("warmup_type"), "log"), key("warmup_type"));
    if (s.type == LrScheduleType::warmup_cosine) {
      refuse({"warmup_min_lr", "warmup_max_lr"});
      s.warmup_min_ratio = c.number(key("warmup_min_ratio"), 0.0);
      s.cos_min_ratio = c.number(key("cos_min_ratio"), 1e-4);
    } else {
      refuse({"warmup_min_ratio", "cos_min_ratio"});
      s.warmup_min_lr = c.number(key("warmup_min_lr"), 0.0);
      if (!c.has(key("warmup_max_lr")) && optimizer_lr != 1e-3)
        c.warn(key("warmup_max_lr"),
               fmt::format("not set: ShardSwap warms up to optimizer.params.lr = {} (DeepSpeed "
                           "would use 0.001)",
                           optimizer_lr));
      s.peak_lr = c.number(key("warmup_max_lr"), optimizer_lr);
    }
    if (s.type == LrScheduleType::warmup) {
      refuse({"total_num_steps"});
    } else {
      // The run's length is the natural end of a decay; DeepSpeed has no default for it.
      const auto total = key("total_num_steps");
      if (!c.has(total) || c.is_auto(total)) {
        if (!c.has("steps") || c.is_auto("steps"))
          c.fail(total,
                 fmt::format("missing: {} needs it (or a top-level `steps` to default to)", name));
        const auto steps = c.integer("steps", 0);
        c.resolve_auto(total, steps,
                       "= the run's steps (Hugging Face's Trainer fills in the run's training "
                       "steps)");
        s.total_num_steps = c.integer(total, steps);
      } else {
        s.total_num_steps = c.integer(total, 0);
      }
    }
    s.validate("scheduler.params");
    return s;
  });
}

std::vector<std::string> config_warnings(const ConfigReader& c) {
  std::vector<std::string> out = c.warnings();
  std::vector<std::string> warned;
  for (const auto& leaf : c.unread_keys()) {
    const KnownKey* entry = nullptr;
    const auto known = known_key_of(leaf, &entry);
    if (!known.empty()) {
      if (std::find(warned.begin(), warned.end(), known) != warned.end()) continue;
      warned.push_back(known);
      out.push_back(c.naming_file(
          fmt::format("{}: a DeepSpeed setting ShardSwap does not implement; ignored: {}", known,
                      entry->instead)));
    } else {
      out.push_back(c.naming_file(
          fmt::format("{}: not a key ShardSwap knows; ignored{}", leaf, did_you_mean(c, leaf))));
    }
  }
  return out;
}

void reject_unknown_keys(const ConfigReader& c, const std::vector<std::string>& sections) {
  std::vector<std::string> unknown;
  for (const auto& leaf : c.unread_keys()) {
    const KnownKey* entry = nullptr;
    if (!known_key_of(leaf, &entry).empty()) continue;  // DeepSpeed's: a warning, not an error
    for (const auto& section : sections) {
      if (leaf == section) {
        unknown.push_back(c.naming_file(
            fmt::format("{} = {}: must be an object {{...}}", leaf, c.written(leaf).value_or(""))));
        break;
      }
      if (leaf.size() > section.size() && leaf.compare(0, section.size(), section) == 0 &&
          (leaf[section.size()] == '.' || leaf[section.size()] == '[')) {
        unknown.push_back(c.naming_file(fmt::format("{}: not a key of ShardSwap's section {}{}",
                                                    leaf, section, did_you_mean(c, leaf))));
        break;
      }
    }
  }
  if (unknown.empty()) return;
  // One line per key, each in the shape of every other config error.
  throw ConfigError(fmt::format("{}", fmt::join(unknown, "\n")));
}

void reject_unread_overrides(const ConfigReader& c) {
  const auto unread = c.unread_keys();
  std::vector<std::string> lines;
  for (const auto& assignment : c.overrides()) {
    const std::string path = assignment.substr(0, assignment.find('='));
    for (const auto& leaf : unread) {
      const bool under =
          leaf == path || (leaf.size() > path.size() && leaf.compare(0, path.size(), path) == 0 &&
                           (leaf[path.size()] == '.' || leaf[path.size()] == '['));
      if (!under) continue;
      const KnownKey* entry = nullptr;
      const auto known = known_key_of(leaf, &entry);
      const auto why =
          known.empty()
              ? fmt::format("not a key ShardSwap reads{}", did_you_mean(c, leaf))
              : fmt::format("a DeepSpeed setting ShardSwap does not implement: {}", entry->instead);
      lines.push_back(fmt::format("--set '{}': {}: {}", assignment, leaf, why));
    }
  }
  if (!lines.empty()) throw ConfigError(fmt::format("{}", fmt::join(lines, "\n")));
}

void refuse_warnings(const ConfigReader& c, const std::vector<std::string>& warnings) {
  if (warnings.empty()) return;
  throw ConfigError(fmt::format(
      "{}\n{}",
      c.naming_file(fmt::format(
          "strict mode (--strict or shardswap.strict): {} {} would only be warned about; each "
          "is an error:",
          warnings.size(), warnings.size() == 1 ? "key" : "keys")),
      fmt::join(warnings, "\n")));
}

}  // namespace shardswap
