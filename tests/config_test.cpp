// DeepSpeed-compatible JSON configs: real DeepSpeed and Hugging Face configs load with exactly the
// expected warnings, every class of bad input is refused naming the key (and the file), batch
// sizes resolve as DeepSpeed resolves them, and lr schedules match values computed independently.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardswap/batch_sizes.h"
#include "shardswap/config_json.h"
#include "shardswap/error.h"
#include "shardswap/lr_schedule.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "trainer/train.h"

using namespace shardswap;

namespace {

const std::string kConfigs = SHARDSWAP_TEST_DIR "/configs/";

// |got - want| <= rel |want| + abs: lr values against float64 references (Catch's Approx is
// spelt differently in Catch2 v2 and v3).
bool close(double got, double want, double rel = 1e-12, double abs = 1e-15) {
  return std::fabs(got - want) <= rel * std::fabs(want) + abs;
}

// Everything a trainer reads from a DeepSpeed config, in the order a trainer reads it.
struct Loaded {
  BatchSizes batches;
  EngineConfig engine;
  LrSchedule schedule;
  std::vector<std::string> warnings;
};

Loaded load(ConfigReader& reader, int world_size) {
  Loaded l;
  l.batches = resolve_batch_sizes(reader, world_size);
  l.engine = engine_config_from_json(reader, l.batches);
  l.schedule = lr_schedule_from_json(reader, l.engine.optimizer.lr);
  reject_unknown_keys(reader, kShardSwapSections);
  l.warnings = config_warnings(reader);
  return l;
}

Loaded load(const nlohmann::json& j, int world_size = 2) {
  ConfigReader reader(j, "test.json");
  return load(reader, world_size);
}

std::string error_of(const nlohmann::json& j, int world_size = 2) {
  return test::message_of<ConfigError>([&] { load(j, world_size); });
}

// The key a warning names: "FILE: KEY = VALUE: what" or "FILE: KEY: what" -> "KEY"; a warning of
// another shape gives a string that names the problem, so the comparison shows it.
std::string key_of(const std::string& warning, const std::string& source) {
  const std::string head = source + ": ";
  if (warning.rfind(head, 0) != 0) return "<no 'FILE: ' prefix: " + warning + ">";
  const auto rest = warning.substr(head.size());
  const auto key = rest.substr(0, rest.find_first_of(" :"));
  if (!test::config_shaped(warning, source, key)) return "<not 'FILE: KEY ...: ': " + warning + ">";
  return key;
}

std::vector<std::string> keys_of(const std::vector<std::string>& warnings,
                                 const std::string& source) {
  std::vector<std::string> keys;
  for (const auto& w : warnings) keys.push_back(key_of(w, source));
  return keys;
}

// A small, valid DeepSpeed config to vary one key at a time.
nlohmann::json base() {
  return nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}
  })");
}

nlohmann::json with(const char* pointer, nlohmann::json value) {
  auto j = base();
  j[nlohmann::json::json_pointer(pointer)] = std::move(value);
  return j;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Real configs

TEST_CASE("a Hugging Face ZeRO-2 config full of auto values loads with one warning per auto key",
          "[config]") {
  auto reader = ConfigReader::from_file(kConfigs + "hf_zero2_auto.json");
  const auto l = load(reader, 4);
  const std::string source = kConfigs + "hf_zero2_auto.json";
  CAPTURE(l.warnings);
  // Each "auto" key once, in the order they are read, then each unimplemented DeepSpeed key once
  // (offload_optimizer is implemented: read, no warning).
  const std::vector<std::string> expected = {
      "train_micro_batch_size_per_gpu",
      "gradient_accumulation_steps",
      "train_batch_size",
      "fp16.enabled",
      "bf16.enabled",
      "optimizer.params.lr",
      "optimizer.params.weight_decay",
      "optimizer.params.betas",
      "optimizer.params.eps",
      "gradient_clipping",
      "zero_optimization.allgather_bucket_size",  // a number: has no effect in ShardSwap
      "scheduler.params.warmup_num_steps",
      "scheduler.params.warmup_min_lr",
      "scheduler.params.warmup_max_lr",
      "scheduler.params.total_num_steps",
      "steps_per_print",
      "wall_clock_breakdown",
  };
  REQUIRE(keys_of(l.warnings, source) == expected);
  for (std::size_t i = 0; i < 15; ++i)
    if (i != 10) REQUIRE(test::contains(l.warnings[i], "\"auto\""));
  REQUIRE(test::contains(l.warnings[2], "uses 32 = 8 x 1 x world size 4"));
  REQUIRE(test::contains(l.warnings[14], "uses 2000 = the run's steps"));
  // offload_optimizer {"device": "cpu", "pin_memory": true}: the state on the host, pinned.
  REQUIRE(l.engine.optimizer_placement == Placement::host);
  REQUIRE(l.engine.pin_host_memory);

  // "auto" takes what Hugging Face's Trainer fills in from its defaults; its fp32 (fp16 and bf16
  // false) is bf16 here.
  REQUIRE(l.batches.micro_samples == 8);
  REQUIRE(l.batches.gradient_accumulation_steps == 1);
  REQUIRE(l.batches.train_samples == 32);
  REQUIRE(l.engine.dtype == DType::bf16);
  REQUIRE(l.engine.optimizer.type == OptimizerType::adamw);
  REQUIRE(l.engine.optimizer.lr == 5e-5);
  REQUIRE(l.engine.optimizer.beta2 == 0.999);
  REQUIRE(l.engine.gradient_clipping == 1.0);
  REQUIRE(l.engine.stage == 2);
  REQUIRE(l.engine.reduce_bucket_bytes == 400'000'000u);     // 2e8 bf16 elements
  REQUIRE(l.engine.overlap_comm);
  REQUIRE(l.schedule.type == LrScheduleType::warmup_decay);
  REQUIRE(l.schedule.peak_lr == 5e-5);  // warmup_max_lr "auto": the optimizer's lr
  REQUIRE(l.schedule.warmup_min_lr == 0.0);
  REQUIRE(l.schedule.warmup_num_steps == 0);  // the Trainer's warmup_steps: 2 updates, as DeepSpeed
  REQUIRE(l.schedule.total_num_steps == 2000);
}

TEST_CASE("a DeepSpeed project's fp16 ZeRO-2 config loads with exactly the expected warnings",
          "[config]") {
  auto reader = ConfigReader::from_file(kConfigs + "ds_zero2_fp16.json");
  const auto l = load(reader, 4);
  const std::string source = kConfigs + "ds_zero2_fp16.json";
  CAPTURE(l.warnings);
  const std::vector<std::string> expected = {
      "optimizer.type",  // "Adam" with weight decay: decoupled, as in DeepSpeed
      "zero_optimization.allgather_bucket_size",  // no gather bucket in ShardSwap
      "zero_optimization.reduce_scatter",         // false: ShardSwap reduce-scatters anyway
      "activation_checkpointing",          // six leaves, one warning
      "checkpoint.tag_validation",         // DeepSpeed's key in ShardSwap's section: a warning
      "flops_profiler",
      "optimizer.params.torch_adam",
      "steps_per_print",
      "tensorboard",
      "wall_clock_breakdown",
      "zero_allow_untested_optimizer",
      "zero_optimization.offload_param",
  };
  REQUIRE(keys_of(l.warnings, source) == expected);

  REQUIRE(l.batches.micro_samples == 8);
  REQUIRE(l.batches.gradient_accumulation_steps == 8);  // 256 / (8 x 4)
  REQUIRE(l.engine.gradient_accumulation_steps == 8);
  REQUIRE(l.engine.dtype == DType::f16);
  REQUIRE(l.engine.loss_scale.dynamic);
  REQUIRE(l.engine.loss_scale.initial_scale == 4096.0);
  REQUIRE(l.engine.loss_scale.window == 500);
  REQUIRE(l.engine.optimizer.type == OptimizerType::adamw);
  REQUIRE(l.engine.optimizer.beta2 == 0.95);
  REQUIRE(l.engine.optimizer.weight_decay == 0.1);
  REQUIRE(l.engine.gradient_clipping == 1.0);
  REQUIRE(l.engine.reduce_bucket_bytes == 1'000'000'000u);
  REQUIRE(!l.engine.overlap_comm);
  REQUIRE(l.schedule.type == LrScheduleType::warmup_cosine);
  REQUIRE(l.schedule.peak_lr == 2e-4);
  REQUIRE(l.schedule.warmup_type == WarmupCurve::linear);
}

TEST_CASE("the example configs load without a single warning", "[config]") {
  for (const char* name : {"quickstart.json", "lisa.json", "soak.json", "gpu-300m.json"}) {
    auto reader = ConfigReader::from_file(std::string(SHARDSWAP_TEST_DIR "/../configs/") + name);
    const auto t = train_config_from_json(reader);
    lr_schedule_from_json(reader, t.engine.optimizer.lr);
    reject_unknown_keys(reader, kShardSwapSections);
    CAPTURE(name);
    REQUIRE(config_warnings(reader).empty());
  }
}

// ---------------------------------------------------------------------------------------------
// Bad input: every class is a ConfigError naming the key and the file

TEST_CASE("malformed JSON is refused with the file and the line and column of the error",
          "[config]") {
  const auto msg = test::message_of<ConfigError>(
      [] { ConfigReader::from_file(kConfigs + "trailing_comma.json"); });
  CAPTURE(msg);
  REQUIRE(test::contains(msg, "trailing_comma.json:3:33:"));  // the '}' after the comma

  // Positions on random texts: a stray character placed at a known line and column.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int lines = 1 + static_cast<int>(rng() % 6);
    std::string text = "{\n";
    for (int i = 0; i < lines; ++i) text += fmt::format("  \"k{}\": {},\n", i, rng() % 1000);
    const auto indent = static_cast<std::size_t>(rng() % 5);
    text += std::string(indent, ' ') + "@\n}";
    const std::size_t line = lines + 2, column = indent + 1;
    const auto m = test::message_of<ConfigError>([&] { ConfigReader::from_text(text, "r.json"); });
    CAPTURE(text, m);
    REQUIRE(test::contains(m, fmt::format("r.json:{}:{}:", line, column)));
  }
  // Text that ends early: the position is one past its last character.
  const auto early = test::message_of<ConfigError>(
      [] { ConfigReader::from_text("{\"a\": 1,\n \"b\": ", "e.json"); });
  CAPTURE(early);
  REQUIRE(test::contains(early, "e.json:2:7:"));
}

TEST_CASE("a key given twice in one object is refused naming the key and where it is", "[config]") {
  const auto msg = test::message_of<ConfigError>(
      [] { ConfigReader::from_file(kConfigs + "duplicate_key.json"); });
  CAPTURE(msg);
  REQUIRE(test::contains(msg, "duplicate_key.json"));
  REQUIRE(test::contains(msg, "'lr' appears twice in optimizer.params"));
  // Where the second one is: line 2, column 53 (its opening quote).
  REQUIRE(test::config_shaped(msg, kConfigs + "duplicate_key.json:2:53", "optimizer.params.lr"));
  // The same key in different objects is fine.
  ConfigReader::from_text(R"({"a": {"x": 1}, "b": {"x": 2}, "l": [{"x": 1}, {"x": 2}]})", "ok");
}

TEST_CASE("a value of the wrong type is refused naming the key", "[config]") {
  const std::pair<nlohmann::json, const char*> cases[] = {
      {with("/train_micro_batch_size_per_gpu", "16"), "train_micro_batch_size_per_gpu"},
      {with("/gradient_accumulation_steps", 1.5), "gradient_accumulation_steps"},
      {with("/bf16/enabled", 1), "bf16.enabled"},
      {with("/bf16", true), "bf16"},
      {with("/zero_optimization", true), "zero_optimization"},
      {with("/optimizer/params/betas", "0.9, 0.999"), "optimizer.params.betas"},
      {with("/zero_optimization/overlap_comm", "yes"), "zero_optimization.overlap_comm"},
      {with("/zero_optimization/allgather_bucket_size", "big"),
       "zero_optimization.allgather_bucket_size"},
      {with("/gradient_clipping", nullptr), "gradient_clipping"},
      {with("/scheduler", nlohmann::json::array()), "scheduler"},
      {with("/scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", "ten"}}}}),
       "scheduler.params.warmup_num_steps"},
  };
  for (const auto& [config, key] : cases) {
    const auto msg = error_of(config);
    CAPTURE(key, msg);
    REQUIRE(test::config_shaped(msg, "test.json", key));
  }
}

TEST_CASE("zero or negative or out-of-range values are refused naming the key", "[config]") {
  const std::pair<nlohmann::json, const char*> cases[] = {
      {with("/train_micro_batch_size_per_gpu", 0), "train_micro_batch_size_per_gpu"},
      {with("/gradient_accumulation_steps", -1), "gradient_accumulation_steps"},
      {with("/train_batch_size", 0), "train_batch_size"},
      {with("/zero_optimization/reduce_bucket_size", 0), "zero_optimization.reduce_bucket_size"},
      {with("/zero_optimization/reduce_bucket_size", -5e8), "zero_optimization.reduce_bucket_size"},
      {with("/zero_optimization/allgather_bucket_size", -1),
       "zero_optimization.allgather_bucket_size"},
      {with("/fp16", {{"loss_scale_window", -1}}), "fp16.loss_scale_window"},
      {with("/fp16", {{"loss_scale_window", 1e12}}), "fp16.loss_scale_window"},
      {with("/fp16", {{"hysteresis", 0}}), "fp16.hysteresis"},
      {with("/fp16", {{"loss_scale", -1}}), "fp16.loss_scale"},
      {with("/fp16", {{"min_loss_scale", 0}}), "fp16.min_loss_scale"},
      {with("/fp16", {{"initial_scale_power", 65}}), "fp16.initial_scale_power"},
      {with("/gradient_clipping", -1.0), "gradient_clipping"},
      {with("/optimizer/params/lr", -1e-3), "optimizer.params.lr"},
      {with("/scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", -3}}}}),
       "scheduler.params.warmup_num_steps"},
      {with("/scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", -0.1}}}}),
       "scheduler.params.warmup_max_lr"},
      {with("/scheduler", {{"type", "WarmupCosineLR"},
                           {"params", {{"total_num_steps", 100}, {"cos_min_ratio", 2}}}}),
       "scheduler.params.cos_min_ratio"},
      {with("/scheduler", {{"type", "WarmupCosineLR"},
                           {"params", {{"total_num_steps", 100}, {"warmup_num_steps", 100}}}}),
       "scheduler.params.total_num_steps"},
      {with("/scheduler", {{"type", "WarmupDecayLR"},
                           {"params", {{"total_num_steps", 50}, {"warmup_num_steps", 100}}}}),
       "scheduler.params.total_num_steps"},
  };
  for (const auto& [config, key] : cases) {
    const auto msg = error_of(config);
    CAPTURE(key, msg);
    REQUIRE(test::config_shaped(msg, "test.json", key));
  }
}

TEST_CASE("ZeRO-3 and stage 0 are refused saying which stages ShardSwap supports", "[config]") {
  for (int stage : {3, 0}) {
    const auto msg = error_of(with("/zero_optimization/stage", stage));
    CAPTURE(msg);
    REQUIRE(test::contains(msg, "zero_optimization.stage"));
    REQUIRE(test::contains(msg, "stages 1 and 2"));
    if (stage == 3) REQUIRE(test::contains(msg, "ZeRO-3"));
  }
  REQUIRE(load(with("/zero_optimization/stage", 1)).engine.stage == 1);
}

TEST_CASE("settings that would change the update and cannot be honoured are refused", "[config]") {
  const std::pair<nlohmann::json, const char*> cases[] = {
      {with("/optimizer/params/amsgrad", true), "optimizer.params.amsgrad"},
      {with("/optimizer/params/bias_correction", false), "optimizer.params.bias_correction"},
      {with("/optimizer/params/max_grad_norm", 1.0), "optimizer.params.max_grad_norm"},
      {with("/optimizer/type", "Lamb"), "optimizer.type"},
      {with("/scheduler", {{"type", "OneCycle"}}), "scheduler.type"},
      {with("/scheduler", {{"params", {{"warmup_num_steps", 10}}}}), "scheduler.type"},
      {with("/scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_type", "cosine"}}}}),
       "scheduler.params.warmup_type"},
      {with("/scheduler", {{"type", "WarmupLR"}, {"params", {{"total_num_steps", 10}}}}),
       "scheduler.params.total_num_steps"},
      {with("/scheduler", {{"type", "WarmupCosineLR"},
                           {"params", {{"total_num_steps", 5000}, {"warmup_max_lr", 1e-3}}}}),
       "scheduler.params.warmup_max_lr"},
      {with("/scheduler", {{"type", "WarmupDecayLR"}}), "scheduler.params.total_num_steps"},
      {with("/scheduler", {{"type", "WarmupLR"}, {"params", {{"last_batch_iteration", 100}}}}),
       "scheduler.params.last_batch_iteration"},
      {with("/bfloat16", {{"enabled", true}}), "bfloat16"},
      {with("/fp16", {{"enabled", true}}), "fp16.enabled"},
      {with("/bf16/enabled", false), "bf16.enabled"},
  };
  for (const auto& [config, key] : cases) {
    const auto msg = error_of(config);
    CAPTURE(key, msg);
    REQUIRE(test::config_shaped(msg, "test.json", key));
  }
}

TEST_CASE("an unknown key in ShardSwap's own sections is an error naming it", "[config]") {
  auto j = nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true},
    "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "hiden_size": 32},
    "data": {"tokenizer": "bytes", "train": "/usr/share/common-licenses/GPL-3", "seq_len": 16},
    "logging": {"intreval": 5},
    "checkpoint": {"tag_validation": "Warn"}
  })");
  ConfigReader reader(j, "test.json");
  // train_config_from_json ends with reject_unknown_keys(reader, kShardSwapSections).
  const auto msg = test::message_of<ConfigError>([&] { train_config_from_json(reader); });
  CAPTURE(msg);
  // One line per unknown key, each in the shape of every config error.
  REQUIRE(msg ==
          "test.json: logging.intreval: not a key of ShardSwap's section logging (did you mean "
          "'logging.interval'?)\n"
          "test.json: model.hiden_size: not a key of ShardSwap's section model (did you mean "
          "'model.hidden_size'?)");
  REQUIRE(!test::contains(msg, "tag_validation"));  // DeepSpeed's key: warned, not refused
  // A section that is not an object is named too.
  auto with_scalar = j;
  with_scalar.erase("checkpoint");
  with_scalar["model"].erase("hiden_size");
  with_scalar["logging"] = 3;
  ConfigReader scalar(with_scalar, "s.json");
  REQUIRE(test::message_of<ConfigError>([&] { train_config_from_json(scalar); }) ==
          "s.json: logging = 3: must be an object {...}");
}

TEST_CASE("an unknown key outside ShardSwap's sections is one warning with the likely intended key",
          "[config]") {
  auto j = base();
  j["zero_optimization"]["reduce_bucket_sise"] = 5e8;
  j["gradient_clippping"] = 1.0;
  j["my_project_notes"] = {{"owner", "x"}, {"ticket", 12}};
  const auto l = load(j);
  CAPTURE(l.warnings);
  REQUIRE(keys_of(l.warnings, "test.json") ==
          std::vector<std::string>{"gradient_clippping", "my_project_notes.owner",
                                   "my_project_notes.ticket",
                                   "zero_optimization.reduce_bucket_sise"});
  REQUIRE(test::contains(l.warnings[0], "did you mean 'gradient_clipping'?"));
  REQUIRE(!test::contains(l.warnings[1], "did you mean"));
  REQUIRE(test::contains(l.warnings[3], "did you mean 'zero_optimization.reduce_bucket_size'?"));
}

// ---------------------------------------------------------------------------------------------
// Semantics

TEST_CASE("batch sizes resolve from any two or all three or one as DeepSpeed resolves them",
          "[config]") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t m = 1 + rng() % 64, a = 1 + rng() % 16, w = 1 + rng() % 8;
    const unsigned given = 1 + rng() % 7;  // bits: micro, accumulation, train batch
    const bool gm = given & 1, ga = given & 2, gt = given & 4;
    if (!gm && !gt) continue;                  // nothing to resolve from (covered below)
    if (!gm && !ga && gt && a != 1) continue;  // train batch alone implies accumulation 1
    nlohmann::json j = nlohmann::json::object();
    if (gm) j["train_micro_batch_size_per_gpu"] = m;
    if (ga) j["gradient_accumulation_steps"] = a;
    if (gt) j["train_batch_size"] = m * a * w;
    ConfigReader reader(j, "b.json");
    const auto b = resolve_batch_sizes(reader, static_cast<int>(w));
    CAPTURE(m, a, w, given);
    REQUIRE(b.micro_samples == m);
    REQUIRE(b.gradient_accumulation_steps == (gm && !ga && !gt ? 1 : a));
    REQUIRE(b.train_samples == b.micro_samples * b.gradient_accumulation_steps * w);
    REQUIRE(reader.unread_keys().empty());
    REQUIRE(reader.warnings().empty());
  }
  // Neither micro nor train batch: ShardSwap's default micro batch, 32.
  ConfigReader only_accumulation(nlohmann::json{{"gradient_accumulation_steps", 3}}, "b.json");
  const auto b = resolve_batch_sizes(only_accumulation, 2);
  REQUIRE((b.micro_samples == 32 && b.gradient_accumulation_steps == 3 && b.train_samples == 192));
}

TEST_CASE("batch sizes that do not multiply out are refused showing the arithmetic", "[config]") {
  struct Bad {
    nlohmann::json config;
    const char* shows;
  };
  const Bad cases[] = {
      {{{"train_micro_batch_size_per_gpu", 8},
        {"gradient_accumulation_steps", 2},
        {"train_batch_size", 100}},
       "= 100: but train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size = 8 x "
       "2 x 4 = 64"},
      {{{"train_micro_batch_size_per_gpu", 8}, {"train_batch_size", 100}},
       "= 100: not a multiple of train_micro_batch_size_per_gpu x world size = 8 x 4 = 32"},
      {{{"gradient_accumulation_steps", 3}, {"train_batch_size", 100}},
       "= 100: not a multiple of gradient_accumulation_steps x world size = 3 x 4 = 12"},
      {{{"train_batch_size", 6}},
       "= 6: not a multiple of the world size 4, so train_micro_batch_size_per_gpu = 6 / 4"},
  };
  for (const auto& c : cases) {
    ConfigReader reader(c.config, "b.json");
    const auto msg = test::message_of<ConfigError>([&] { resolve_batch_sizes(reader, 4); });
    CAPTURE(msg);
    REQUIRE(test::config_shaped(msg, "b.json", "train_batch_size"));
    REQUIRE(test::contains(msg, c.shows));
  }
}

TEST_CASE("DeepSpeed's Adam decays decoupled unless adam_w_mode is false", "[config]") {
  auto adam = with("/optimizer/type", "Adam");
  const auto decoupled = load(adam);
  REQUIRE(decoupled.engine.optimizer.type == OptimizerType::adamw);
  REQUIRE(keys_of(decoupled.warnings, "test.json") ==
          std::vector<std::string>{"optimizer.type"});  // weight_decay 0.01 makes it matter

  adam["optimizer"]["params"]["adam_w_mode"] = false;
  const auto l2 = load(adam);
  REQUIRE(l2.engine.optimizer.type == OptimizerType::adam);
  REQUIRE(l2.warnings.empty());

  auto sgd =
      with("/optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}, {"betas", {0.9, 0.99}}}}});
  const auto s = load(sgd);
  REQUIRE(s.engine.optimizer.type == OptimizerType::sgd);
  REQUIRE(keys_of(s.warnings, "test.json") == std::vector<std::string>{"optimizer.params.betas"});
  REQUIRE(test::contains(s.warnings[0], "applies to Adam and AdamW only"));
}

TEST_CASE("ZeRO switches ShardSwap always has on warn only when turned off", "[config]") {
  auto j = base();
  j["zero_optimization"].update({{"contiguous_gradients", true},
                                 {"reduce_scatter", true},
                                 {"allgather_partitions", true},
                                 {"overlap_comm", false},
                                 {"allgather_bucket_size", 3e7}});
  const auto on = load(j);
  REQUIRE(on.warnings.size() == 1);  // allgather_bucket_size: no gather bucket to size
  REQUIRE(on.warnings[0].find("zero_optimization.allgather_bucket_size") != std::string::npos);
  REQUIRE(!on.engine.overlap_comm);
  REQUIRE(load(base()).engine.overlap_comm);  // ShardSwap's default: on

  j["zero_optimization"].update({{"contiguous_gradients", false},
                                 {"reduce_scatter", false},
                                 {"allgather_partitions", false}});
  const auto off = load(j);
  CAPTURE(off.warnings);
  REQUIRE(keys_of(off.warnings, "test.json") ==
          std::vector<std::string>{"zero_optimization.allgather_bucket_size",
                                   "zero_optimization.contiguous_gradients",
                                   "zero_optimization.reduce_scatter",
                                   "zero_optimization.allgather_partitions"});
}

TEST_CASE("a whole unimplemented sub-object is one warning however many leaves it has",
          "[config]") {
  auto j = base();
  j["zero_optimization"]["offload_param"] = {
      {"device", "nvme"}, {"nvme_path", "/local"}, {"pin_memory", true}, {"buffer_count", 4}};
  j["zero_optimization"]["stage3_max_live_parameters"] = 1e9;
  j["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto";
  j["aio"] = {{"block_size", 1048576}, {"queue_depth", 8}};
  const auto l = load(j);
  CAPTURE(l.warnings);
  REQUIRE(keys_of(l.warnings, "test.json") ==
          std::vector<std::string>{"aio", "zero_optimization.offload_param",
                                   "zero_optimization.stage3_max_live_parameters",
                                   "zero_optimization.stage3_prefetch_bucket_size"});
}

TEST_CASE("the constant lr without a scheduler is the optimizer's at every update", "[config]") {
  const auto l = load(base());
  REQUIRE(l.schedule.type == LrScheduleType::constant);
  for (std::int64_t u : {0, 1, 7, 1000000}) REQUIRE(l.schedule.lr_at(u) == 3e-4);
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { l.schedule.lr_at(-1); }), "-1"));
}

namespace {

// How DeepSpeed drives a scheduler, written out as a loop: the lr is set at construction (the
// schedule's start) and again after every applied update from the schedule's value at the
// update count so far minus one. `value` is the schedule's documented formula.
std::vector<double> stepped(double start, const std::function<double(std::int64_t)>& value,
                            int updates) {
  std::vector<double> lrs;
  double lr = start;
  for (std::int64_t iteration = 0; iteration < updates; ++iteration) {
    lrs.push_back(lr);
    lr = value(iteration);
  }
  return lrs;
}

LrSchedule schedule_of(const nlohmann::json& scheduler, double optimizer_lr = 3e-4) {
  ConfigReader reader(nlohmann::json{{"scheduler", scheduler}}, "test.json");
  const auto s = lr_schedule_from_json(reader, optimizer_lr);
  REQUIRE(config_warnings(reader).empty());
  return s;
}

}  // namespace

TEST_CASE("WarmupLR matches hand-computed values and DeepSpeed's stepping", "[config]") {
  const auto s = schedule_of({{"type", "WarmupLR"},
                              {"params",
                               {{"warmup_min_lr", 1e-5},
                                {"warmup_max_lr", 1e-3},
                                {"warmup_num_steps", 100},
                                {"warmup_type", "log"}}}});
  // Computed by hand: update u uses iteration max(u-1, 0); at iteration 9 the log warmup is
  // ln 10 / ln 100 = 1/2 of the way.
  REQUIRE(close(s.lr_at(0), 1e-5, 1e-12));
  REQUIRE(close(s.lr_at(1), 1e-5, 1e-12));
  REQUIRE(close(s.lr_at(2), 1e-5 + 0.99e-3 * std::log(2.0) / std::log(100.0), 1e-12));
  REQUIRE(close(s.lr_at(10), 0.000505, 1e-12));
  REQUIRE(close(s.lr_at(100), 1e-3, 1e-12));
  REQUIRE(s.lr_at(5000) == 1e-3);

  const auto reference = stepped(
      1e-5,
      [](std::int64_t i) {
        return i >= 100
                   ? 1e-3
                   : 1e-5 + (1e-3 - 1e-5) * std::log1p(static_cast<double>(i)) / std::log(100.0);
      },
      300);
  for (int u = 0; u < 300; ++u) REQUIRE(close(s.lr_at(u), reference[u], 1e-12));
}

TEST_CASE("WarmupDecayLR matches hand-computed values and decays to warmup_min_lr", "[config]") {
  const auto s = schedule_of({{"type", "WarmupDecayLR"},
                              {"params",
                               {{"warmup_max_lr", 1e-3},
                                {"warmup_num_steps", 10},
                                {"warmup_type", "linear"},
                                {"total_num_steps", 110}}}});
  const std::pair<std::int64_t, double> by_hand[] = {{0, 0.0},     {5, 4e-4},    {11, 1e-3},
                                                     {12, 9.9e-4}, {60, 5.1e-4}, {110, 1e-5},
                                                     {111, 0.0},   {200, 0.0}};
  for (const auto& [u, lr] : by_hand) {
    CAPTURE(u);
    REQUIRE(close(s.lr_at(u), lr, 0.0, 1e-15));
  }
  const auto reference = stepped(
      0.0,
      [](std::int64_t i) {
        if (i < 10) return 1e-3 * static_cast<double>(i) / 10.0;
        return 1e-3 * std::max(0.0, static_cast<double>(110 - i) / 100.0);
      },
      150);
  for (int u = 0; u < 150; ++u) REQUIRE(close(s.lr_at(u), reference[u], 0.0, 1e-15));
}

TEST_CASE("WarmupCosineLR matches hand-computed values and holds its floor after the end",
          "[config]") {
  const auto s = schedule_of({{"type", "WarmupCosineLR"},
                              {"params",
                               {{"total_num_steps", 20000},
                                {"warmup_num_steps", 500},
                                {"warmup_type", "linear"},
                                {"warmup_min_ratio", 0.01},
                                {"cos_min_ratio", 0.1}}}},
                             2e-4);
  // By hand: update 250 is iteration 249: ratio 0.01 + 0.99 x 249/500 = 0.50302; the end of the
  // cosine is cos_min_ratio x lr.
  REQUIRE(close(s.lr_at(0), 2e-6, 1e-12));
  REQUIRE(close(s.lr_at(250), 2e-4 * 0.50302, 1e-12));
  REQUIRE(close(s.lr_at(20000), 2e-5, 1e-12));
  REQUIRE(close(s.lr_at(25000), 2e-5, 1e-12));  // DeepSpeed's would climb again
  const double pi = std::acos(-1.0);
  const auto reference = stepped(
      2e-6,
      [&](std::int64_t i) {
        if (i < 500) return 2e-4 * (0.01 + 0.99 * static_cast<double>(i) / 500.0);
        const double x = static_cast<double>(i - 499) / 19500.0;
        return 2e-4 * (0.1 + 0.45 * (1.0 + std::cos(pi * x)));
      },
      20000);
  for (int u = 0; u < 20000; u += 37) REQUIRE(close(s.lr_at(u), reference[u], 1e-12));
  // A log warmup and the default ratios: starts at 0, reaches the optimizer's lr, ends at 1e-4 of
  // it.
  const auto d = schedule_of({{"type", "WarmupCosineLR"},
                              {"params", {{"total_num_steps", 1000}, {"warmup_num_steps", 10}}}},
                             1e-3);
  REQUIRE(d.lr_at(0) == 0.0);
  REQUIRE(close(d.lr_at(9), 1e-3 * std::log(9.0) / std::log(10.0), 1e-12));
  REQUIRE(d.lr_at(10) == 1e-3);  // log warmup: ln 10 / ln 10 at iteration 9
  REQUIRE(close(d.lr_at(1000), 1e-7, 1e-9));
}

TEST_CASE("a warmup shorter than two updates lasts two with a warning as in DeepSpeed",
          "[config]") {
  auto j = base();
  j["scheduler"] = {
      {"type", "WarmupLR"},
      {"params", {{"warmup_min_lr", 0.1}, {"warmup_max_lr", 0.5}, {"warmup_num_steps", 0}}}};
  const auto l = load(j);
  REQUIRE(keys_of(l.warnings, "test.json") ==
          std::vector<std::string>{"scheduler.params.warmup_num_steps"});
  REQUIRE(l.schedule.lr_at(0) == 0.1);
  REQUIRE(l.schedule.lr_at(1) == 0.1);
  REQUIRE(close(l.schedule.lr_at(2), 0.5, 1e-15));
}

TEST_CASE("warmup_max_lr defaults to the optimizer's lr with a warning where DeepSpeed differs",
          "[config]") {
  auto j = base();
  j["scheduler"] = {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 10}}}};
  const auto l = load(j);
  REQUIRE(l.schedule.peak_lr == 3e-4);
  REQUIRE(keys_of(l.warnings, "test.json") ==
          std::vector<std::string>{"scheduler.params.warmup_max_lr"});
  REQUIRE(test::contains(l.warnings[0], "DeepSpeed would use 0.001"));
}

TEST_CASE("each auto key warns once however often it is read", "[config]") {
  ConfigReader reader(nlohmann::json{{"a", "auto"}, {"b", {{"c", "auto"}}}}, "a.json");
  REQUIRE(reader.number("a", 2.5) == 2.5);
  REQUIRE(reader.number("a", 2.5) == 2.5);
  REQUIRE(reader.boolean("b.c", true));
  REQUIRE(reader.warnings().size() == 2);
  REQUIRE(test::contains(reader.warnings()[0], "a.json: a = \"auto\": "));
  REQUIRE(test::contains(reader.warnings()[0], "default, 2.5"));
  REQUIRE(reader.unread_keys().empty());
}

// ---------------------------------------------------------------------------------------------
// Hugging Face's "auto", --set and strict mode

namespace {

// tests/configs/hf_ds_config_zero2.json has the keys and values of the ZeRO-2 config
// transformers' tests ship (tests/deepspeed/ds_config_zero2.json in huggingface/transformers).
const std::string kHfZero2 = kConfigs + "hf_ds_config_zero2.json";

// configs/tiny_decoder.json as JSON, to vary before a ConfigReader reads it whole.
nlohmann::json tiny_decoder() {
  std::ifstream in(kConfigs + "tiny_decoder.json");
  return nlohmann::json::parse(in);
}

// The warning of `warnings` that names `key`; a text saying none does otherwise.
std::string warning_of(const std::vector<std::string>& warnings, const std::string& source,
                       const std::string& key) {
  for (const auto& w : warnings)
    if (key_of(w, source) == key) return w;
  return "<no warning names " + key + ">";
}

}  // namespace

TEST_CASE("the Trainer's ZeRO-2 config takes its defaults, each auto named with its value",
          "[config]") {
  auto reader = ConfigReader::from_file(kHfZero2);
  const auto l = load(reader, 1);
  CAPTURE(l.warnings);
  const std::vector<std::string> expected = {
      "train_micro_batch_size_per_gpu",
      "gradient_accumulation_steps",
      "train_batch_size",
      "fp16.enabled",
      "bf16.enabled",
      "optimizer.params.lr",
      "optimizer.params.weight_decay",
      "optimizer.params.betas",
      "optimizer.params.eps",
      "gradient_clipping",
      "zero_optimization.allgather_bucket_size",
      "scheduler.params.warmup_num_steps",
      "scheduler.params.warmup_min_lr",
      "scheduler.params.warmup_max_lr",
      "steps_per_print",
      "wall_clock_breakdown",
  };
  REQUIRE(keys_of(l.warnings, kHfZero2) == expected);
  const std::pair<const char*, const char*> named[] = {
      {"train_micro_batch_size_per_gpu",
       "uses 8 (Hugging Face's Trainer default: TrainingArguments.per_device_train_batch_size)"},
      {"gradient_accumulation_steps",
       "uses 1 (Hugging Face's Trainer default: TrainingArguments.gradient_accumulation_steps)"},
      {"train_batch_size", "uses 8 = 8 x 1 x world size 1, as Hugging Face's Trainer computes it"},
      {"fp16.enabled", "uses false (Hugging Face's Trainer default: TrainingArguments.fp16)"},
      {"bf16.enabled",
       "uses true (Hugging Face's Trainer default, TrainingArguments.bf16, is false"},
      {"optimizer.params.lr",
       "uses 5e-05 (Hugging Face's Trainer default: TrainingArguments."
       "learning_rate)"},
      {"optimizer.params.weight_decay", "uses 0.0 (Hugging Face's Trainer default"},
      {"optimizer.params.betas", "uses [0.9,0.999] (Hugging Face's Trainer default"},
      {"optimizer.params.eps", "uses 1e-08 (Hugging Face's Trainer default"},
      {"gradient_clipping",
       "uses 1.0 (Hugging Face's Trainer default: TrainingArguments.max_grad_norm)"},
      {"scheduler.params.warmup_num_steps",
       "uses 0 (Hugging Face's Trainer default: "
       "TrainingArguments.warmup_steps); warmup lasts 2"},
      {"scheduler.params.warmup_min_lr", "uses 0.0"},
      {"scheduler.params.warmup_max_lr", "uses 5e-05 = optimizer.params.lr"},
  };
  for (const auto& [key, text] : named) {
    CAPTURE(key);
    const auto w = warning_of(l.warnings, kHfZero2, key);
    REQUIRE(test::contains(w, text));
    REQUIRE(test::contains(w, std::string(key) + " = \"auto\": ShardSwap uses "));
  }

  REQUIRE(l.batches.micro_samples == 8);
  REQUIRE(l.batches.gradient_accumulation_steps == 1);
  REQUIRE(l.batches.train_samples == 8);
  REQUIRE(l.engine.dtype == DType::bf16);
  REQUIRE(l.engine.optimizer.lr == 5e-5);
  REQUIRE(l.engine.optimizer.beta1 == 0.9);
  REQUIRE(l.engine.optimizer.beta2 == 0.999);
  REQUIRE(l.engine.optimizer.eps == 1e-8);
  REQUIRE(l.engine.optimizer.weight_decay == 0.0);
  REQUIRE(l.engine.gradient_clipping == 1.0);
  REQUIRE(l.schedule.type == LrScheduleType::warmup);
  REQUIRE(l.schedule.warmup_min_lr == 0.0);
  REQUIRE(l.schedule.peak_lr == 5e-5);
  // Warmup 0 lasts two updates, as in DeepSpeed (log warmup over W = 2): 0, 0, then the peak.
  REQUIRE(l.schedule.lr_at(0) == 0.0);
  REQUIRE(l.schedule.lr_at(1) == 0.0);
  REQUIRE(close(l.schedule.lr_at(2), 5e-5));
  REQUIRE(close(l.schedule.lr_at(199), 5e-5));
}

TEST_CASE("WarmupDecayLR with the Trainer's autos falls linearly to 0 at the run's steps",
          "[config]") {
  // hf_zero2_auto.json: WarmupDecayLR, every param "auto", steps 2000.
  auto reader = ConfigReader::from_file(kConfigs + "hf_zero2_auto.json");
  const auto s = load(reader, 4).schedule;
  // By hand: W = max(2, 0) = 2, peak 5e-5, min 0, T = 2000; update k uses iteration k - 1.
  // Iteration 1 ends the warmup (ln 2 / ln 2 = 1); after it 5e-5 x (2000 - i) / 1998.
  const std::pair<std::int64_t, double> by_hand[] = {
      {0, 0.0},
      {1, 0.0},
      {2, 5e-5},
      {3, 5e-5 * 1998.0 / 1998.0},
      {1001, 5e-5 * 1000.0 / 1998.0},
      {2000, 5e-5 * 1.0 / 1998.0},
      {2001, 0.0},
      {3000, 0.0},
  };
  for (const auto& [u, lr] : by_hand) {
    CAPTURE(u);
    REQUIRE(close(s.lr_at(u), lr, 1e-12, 1e-18));
  }
}

TEST_CASE("an auto batch size that a given train_batch_size determines takes the derived value",
          "[config]") {
  auto j = base();
  j["train_batch_size"] = 64;
  j["train_micro_batch_size_per_gpu"] = "auto";
  const auto l = load(j, 2);  // accumulation 2 (base)
  REQUIRE(l.batches.micro_samples == 16);
  REQUIRE(test::contains(warning_of(l.warnings, "test.json", "train_micro_batch_size_per_gpu"),
                         "= \"auto\": ShardSwap uses 16 = 64 / (2 x world size 2)"));
}

TEST_CASE("an auto reduce bucket is the hidden size squared, or ShardSwap's default said so",
          "[config]") {
  auto j = base();
  j["zero_optimization"]["reduce_bucket_size"] = "auto";
  ConfigReader with_model(j, "test.json");
  const auto batches = resolve_batch_sizes(with_model, 2);
  REQUIRE(engine_config_from_json(with_model, batches, 64).reduce_bucket_bytes == 64 * 64 * 2);
  REQUIRE(with_model.warnings().size() == 1);
  REQUIRE(test::contains(with_model.warnings()[0],
                         "zero_optimization.reduce_bucket_size = \"auto\": ShardSwap uses 4096 = "
                         "hidden_size^2 = 64 x 64 elements"));

  ConfigReader without(j, "test.json");
  REQUIRE(engine_config_from_json(without, batches).reduce_bucket_bytes == 500'000'000u * 2);
  REQUIRE(without.warnings().size() == 1);
  REQUIRE(test::contains(without.warnings()[0], "ShardSwap uses its default, 500000000 elements"));
}

TEST_CASE("auto precision trains bf16 where the Trainer's defaults would train fp32", "[config]") {
  SECTION("fp16 auto, no bf16 section") {
    auto j = base();
    j.erase("bf16");
    j["fp16"] = {{"enabled", "auto"}};
    const auto l = load(j);
    REQUIRE(l.engine.dtype == DType::bf16);
    const auto w = warning_of(l.warnings, "test.json", "fp16.enabled");
    REQUIRE(test::contains(w, "= \"auto\": ShardSwap uses false"));
    REQUIRE(test::contains(w, "trains in fp32, which ShardSwap does not"));
    REQUIRE(test::contains(w, "it trains bf16, as bf16.enabled is not set"));
  }
  SECTION("bf16 auto with fp16 on is the Trainer's false") {
    auto j = base();
    j["bf16"] = {{"enabled", "auto"}};
    j["fp16"] = {{"enabled", true}};
    const auto l = load(j);
    REQUIRE(l.engine.dtype == DType::f16);
    REQUIRE(test::contains(warning_of(l.warnings, "test.json", "bf16.enabled"),
                           "ShardSwap uses false (Hugging Face's Trainer default: "
                           "TrainingArguments.bf16)"));
  }
  SECTION("fp16 auto with bf16 turned off is refused: neither would be on") {
    auto j = base();
    j["bf16"] = {{"enabled", false}};
    j["fp16"] = {{"enabled", "auto"}};
    REQUIRE(test::contains(error_of(j), "bf16.enabled = false: this or fp16.enabled must be true"));
  }
}

TEST_CASE("an auto the Trainer does not fill in takes ShardSwap's default, saying so", "[config]") {
  auto j = base();
  j["optimizer"]["params"]["adam_w_mode"] = "auto";
  const auto l = load(j);
  REQUIRE(test::contains(warning_of(l.warnings, "test.json", "optimizer.params.adam_w_mode"),
                         "= \"auto\": not a key Hugging Face's Trainer fills in; ShardSwap uses "
                         "its default, true"));
}

TEST_CASE("a --set key that nothing reads is an error naming it and the likely intended key",
          "[config]") {
  ConfigReader reader(base(), "test.json");
  reader.set("gradient_cliping=1");
  reader.set(R"(zero_optimization={"stage": 2, "overlapp_comm": true})");
  reader.set("steps_per_print=5");
  reader.set("optimizer.params.lr=1e-4");  // read: no line
  load(reader, 2);
  const auto m = test::message_of<ConfigError>([&] { reject_unread_overrides(reader); });
  REQUIRE(m ==
          "--set 'gradient_cliping=1': gradient_cliping: not a key ShardSwap reads (did you mean "
          "'gradient_clipping'?)\n"
          "--set 'zero_optimization={\"stage\": 2, \"overlapp_comm\": true}': "
          "zero_optimization.overlapp_comm: not a key ShardSwap reads (did you mean "
          "'zero_optimization.overlap_comm'?)\n"
          "--set 'steps_per_print=5': steps_per_print: a DeepSpeed setting ShardSwap does not "
          "implement: progress lines come every logging.interval steps");

  ConfigReader read_only(base(), "test.json");
  read_only.set("optimizer.params.lr=1e-4");
  load(read_only, 2);
  reject_unread_overrides(read_only);  // every override read: nothing thrown
}

TEST_CASE("a --set key nothing reads stops the run with or without strict mode", "[config]") {
  for (const bool strict : {false, true}) {
    CAPTURE(strict);
    ConfigReader reader(tiny_decoder(), "tiny.json");
    if (strict) reader.set("shardswap.strict=true");
    reader.set("gradient_cliping=1");
    REQUIRE(test::contains(test::message_of<ConfigError>([&] { train_config_from_json(reader); }),
                           "--set 'gradient_cliping=1': gradient_cliping: not a key ShardSwap "
                           "reads (did you mean 'gradient_clipping'?)"));
  }
}

TEST_CASE("a misspelt top-level key in the file warns with the intended key and is not read",
          "[config]") {
  auto j = tiny_decoder();
  j.erase("gradient_clipping");
  j["gradient_cliping"] = 1.0;
  ConfigReader reader(j, "tiny.json");
  const auto t = train_config_from_json(reader);
  REQUIRE(t.engine.gradient_clipping == 0.0);  // what was read: the key the file misspelt is not
  const auto warnings = config_warnings(reader);
  REQUIRE(warnings ==
          std::vector<std::string>{"tiny.json: gradient_cliping: not a key ShardSwap knows; "
                                   "ignored (did you mean 'gradient_clipping'?)"});
}

TEST_CASE("strict mode refuses every key it would warn about, all listed in one message",
          "[config]") {
  auto reader = ConfigReader::from_file(kHfZero2);
  const auto l = load(reader, 1);
  const auto m = test::message_of<ConfigError>([&] { refuse_warnings(reader, l.warnings); });
  std::string expected = kHfZero2 +
                         ": strict mode (--strict or shardswap.strict): 16 keys would only be "
                         "warned about; each is an error:";
  for (const auto& w : l.warnings) expected += "\n" + w;
  REQUIRE(m == expected);
  refuse_warnings(reader, {});  // nothing to refuse: nothing thrown

  // From train_config_from_json, with shardswap.strict in the file: an unknown key, a DeepSpeed
  // key ShardSwap does not implement, a key with no effect and a resolved "auto" alike.
  auto j = tiny_decoder();
  j["shardswap"]["strict"] = true;
  j["gradient_cliping"] = 1.0;
  j["steps_per_print"] = 10;
  j["zero_optimization"]["allgather_bucket_size"] = 5e8;
  j["optimizer"]["params"]["lr"] = "auto";
  ConfigReader strict(j, "tiny.json");
  const auto refused = test::message_of<ConfigError>([&] { train_config_from_json(strict); });
  CAPTURE(refused);
  REQUIRE(test::contains(refused, "tiny.json: strict mode (--strict or shardswap.strict): 4 keys"));
  for (const char* line :
       {"\ntiny.json: optimizer.params.lr = \"auto\": ShardSwap uses 5e-05",
        "\ntiny.json: zero_optimization.allgather_bucket_size = 500000000.0: no effect",
        "\ntiny.json: gradient_cliping: not a key ShardSwap knows; ignored (did you mean "
        "'gradient_clipping'?)",
        "\ntiny.json: steps_per_print: a DeepSpeed setting ShardSwap does not implement"})
    REQUIRE(test::contains(refused, line));

  j["shardswap"]["strict"] = false;  // the same file without strict mode: warnings only
  ConfigReader lenient(j, "tiny.json");
  train_config_from_json(lenient);
  REQUIRE(config_warnings(lenient).size() == 4);
}

// ---------------------------------------------------------------------------------------------
// Hostile input: nesting, size and file type are bounded before anything large is built

namespace {

constexpr auto kDepth = ConfigReader::kMaxDepth;

// A key path as messages show it: keys joined with '.', list indices as "[i]".
std::string joined(const std::vector<std::string>& steps, std::size_t from, std::size_t to) {
  std::string out;
  for (std::size_t i = from; i < to; ++i)
    out += (steps[i][0] == '[' || out.empty()) ? steps[i] : "." + steps[i];
  return out;
}

// How messages shorten a long key path: its first six and last three steps.
std::string shortened(const std::vector<std::string>& steps) {
  if (steps.size() <= 10) return joined(steps, 0, steps.size());
  const auto tail = joined(steps, steps.size() - 3, steps.size());
  return joined(steps, 0, 6) + " ... " + (tail[0] == '[' ? tail : "." + tail);
}

// A config whose key "tensorboard" (a DeepSpeed key ShardSwap only warns about) holds objects and
// lists nested at random, with random keys, list elements before the nested one and line breaks,
// so that its containers reach level `levels` (the top-level object is level 1).
struct Nested {
  std::string text;
  // Where the container of level kDepth + 1 opens ("LINE:COLUMN"), and the steps of its key
  // path; empty where the text stays within the limit.
  std::string position;
  std::vector<std::string> steps;
};

Nested nested(std::mt19937& rng, std::size_t levels) {
  Nested n;
  n.text = "{\n  \"steps\": 3,\n  \"tensorboard\": ";
  std::vector<std::string> steps{"tensorboard"};
  std::string closing = "}";
  std::size_t line = 3;
  for (std::size_t level = 2; level <= levels; ++level) {
    if (level == kDepth + 1) {
      const auto column = n.text.size() - n.text.rfind('\n');
      n.position = fmt::format("{}:{}", line, column);
      n.steps = steps;
    }
    if (rng() % 2 == 0) {
      const auto key = fmt::format("k{}", rng() % 1000);
      n.text += fmt::format("{{\"{}\": ", key);
      steps.push_back(key);
      closing += '}';
    } else {
      const std::size_t before = rng() % 3;
      n.text += '[';
      for (std::size_t i = 0; i < before; ++i) n.text += fmt::format("{}, ", rng() % 100);
      steps.push_back(fmt::format("[{}]", before));
      closing += ']';
    }
    if (rng() % 8 == 0) {
      n.text += "\n  ";
      ++line;
    }
  }
  n.text += "0";
  n.text.append(closing.rbegin(), closing.rend());
  return n;
}

}  // namespace

TEST_CASE("a config nested deeper than the limit is refused naming the file, position and key path",
          "[config]") {
  std::mt19937 rng(15);
  for (int trial = 0; trial < 10; ++trial) {
    const std::size_t levels = kDepth + 1 + rng() % 2000;
    const Nested n = nested(rng, levels);
    const auto m =
        test::message_of<ConfigError>([&] { ConfigReader::from_text(n.text, "r.json"); });
    CAPTURE(levels, m);
    REQUIRE(n.steps.size() == kDepth);  // the key path of the container on level kDepth + 1
    REQUIRE(test::config_shaped(m, "r.json:" + n.position, shortened(n.steps)));
    REQUIRE(test::contains(m, fmt::format("deeper than {} levels", kDepth)));
  }
}

TEST_CASE("a config nested exactly to the limit loads and its keys are listed", "[config]") {
  std::mt19937 rng(16);
  for (int trial = 0; trial < 5; ++trial) {
    const std::size_t levels = kDepth - rng() % 3;
    const Nested n = nested(rng, levels);
    auto reader = ConfigReader::from_text(n.text, "r.json");
    REQUIRE(reader.integer("steps", 0) == 3);
    const auto unread = reader.unread_keys();
    REQUIRE(!unread.empty());
    for (const auto& key : unread) REQUIRE(key.rfind("tensorboard", 0) == 0);
    // However many leaves, the DeepSpeed key ShardSwap only warns about is one warning.
    const auto warnings = config_warnings(reader);
    REQUIRE(keys_of(warnings, "r.json") == std::vector<std::string>{"tensorboard"});
  }
}

TEST_CASE("a config thirty thousand levels deep under a warned key is refused, not a crash",
          "[config]") {
  std::string text = R"({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true}, )"
                     R"("tensorboard": )";
  constexpr int kLevels = 30'000;
  for (int i = 0; i < kLevels; ++i) text += R"({"a": )";
  text += "1" + std::string(kLevels + 1, '}');
  const auto m = test::message_of<ConfigError>([&] {
    auto reader = ConfigReader::from_text(text, "deep.json");
    load(reader, 1);
  });
  CAPTURE(m.substr(0, 500));
  REQUIRE(test::contains(m, "deep.json:1:"));
  REQUIRE(test::contains(m, ": tensorboard.a.a.a.a.a ... .a.a.a: "));
  REQUIRE(m.size() < 300);
}

TEST_CASE("a long key in a path too deep is shortened in the message", "[config]") {
  const std::string key(5000, 'x');
  std::string text = "{\"" + key + "\": ";
  for (std::size_t i = 0; i < kDepth; ++i) text += "[";
  text += std::string(kDepth, ']') + "}";
  const auto m = test::message_of<ConfigError>([&] { ConfigReader::from_text(text, "k.json"); });
  CAPTURE(m);
  REQUIRE(test::contains(m, "k.json:1:"));
  REQUIRE(test::contains(m, std::string(32, 'x') + "...[0][0]"));
  REQUIRE(m.size() < 300);
}

TEST_CASE("a JSON value nested deeper than the limit is refused by the reader built from it",
          "[config]") {
  std::mt19937 rng(17);
  const std::size_t levels = kDepth + 1 + rng() % 100;
  nlohmann::json root = nlohmann::json::object();
  nlohmann::json* node = &root;
  std::vector<std::string> steps;
  for (std::size_t level = 2; level <= levels; ++level) {
    const auto key = fmt::format("k{}", rng() % 1000);
    if (level <= kDepth + 1) steps.push_back(key);
    node = &((*node)[key] = nlohmann::json::object());
  }
  const auto m = test::message_of<ConfigError>([&] { ConfigReader(root, "j.json"); });
  CAPTURE(levels, m);
  REQUIRE(test::config_shaped(m, "j.json", shortened(steps)));
  steps.pop_back();  // one level less deep: accepted
  nlohmann::json shallow = nlohmann::json::object();
  node = &shallow;
  for (const auto& key : steps) node = &((*node)[key] = nlohmann::json::object());
  REQUIRE_NOTHROW(ConfigReader(shallow, "j.json"));
}

TEST_CASE("a --set value or key path deeper than the limit is refused and changes nothing",
          "[config]") {
  std::mt19937 rng(18);
  ConfigReader reader(nlohmann::json{{"steps", 3}, {"a", {{"b", 1}}}}, "s.json");
  const auto before = reader.json();
  const auto value_of = [](std::size_t levels) {
    return std::string(levels, '[') + "1" + std::string(levels, ']');
  };
  for (int trial = 0; trial < 5; ++trial) {
    // "a.b" puts its value on level 3: a list inside it may go kDepth - 2 levels deep.
    const std::size_t ok = kDepth - 2;
    reader.set("a.b=" + value_of(ok));
    REQUIRE(reader.json()["a"]["b"].is_array());
    reader.set("a.b=1");
    const std::size_t levels = ok + 1 + rng() % 5000;
    const auto m = test::message_of<ConfigError>([&] { reader.set("a.b=" + value_of(levels)); });
    CAPTURE(levels, m);
    std::vector<std::string> steps{"a", "b"};
    for (std::size_t i = 0; i + 2 < kDepth; ++i) steps.push_back("[0]");
    REQUIRE(test::contains(m, "--set 'a.b=[[[["));
    REQUIRE(test::contains(m, ": " + shortened(steps) + ": "));
    REQUIRE(m.size() < 400);
    REQUIRE(reader.json() == before);
  }
  // A --set value is held to a file's rules: a key repeated in one of its objects is refused.
  const auto repeated =
      test::message_of<ConfigError>([&] { reader.set(R"(a.b={"x": 1, "y": {"z": 2, "z": 3}})"); });
  CAPTURE(repeated);
  REQUIRE(test::contains(repeated, "a.b.y.z: the key appears twice"));
  REQUIRE(reader.json() == before);
  // A key path alone may name kDepth keys (the last holds a value, not an object).
  std::vector<std::string> keys;
  for (std::size_t i = 0; i < kDepth; ++i) keys.push_back(fmt::format("k{}", rng() % 10));
  reader.set(joined(keys, 0, keys.size()) + "=1");
  reader = ConfigReader(before, "s.json");
  keys.push_back("z");
  const auto m =
      test::message_of<ConfigError>([&] { reader.set(joined(keys, 0, keys.size()) + "=1"); });
  CAPTURE(m);
  keys.pop_back();
  REQUIRE(test::contains(m, ": " + shortened(keys) + ": "));
  REQUIRE(reader.json() == before);
}

TEST_CASE("a config that is not a regular file is refused naming it, without blocking",
          "[config]") {
  const test_support::ScratchFolder dir("shardswap-config-files");
  const auto fifo = (dir / "fifo.json").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // Should the reader wait for a writer, this one comes after a while and feeds it a valid
  // config, which the reader would then accept: the test fails instead of hanging.
  std::atomic<bool> done{false};
  std::thread writer([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (!done && std::chrono::steady_clock::now() < until) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) {
        [[maybe_unused]] const auto written = ::write(fd, "{}", 2);
        ::close(fd);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  struct Joined {  // also when the assertion below fails and unwinds
    std::atomic<bool>& done;
    std::thread& writer;
    ~Joined() {
      done = true;
      writer.join();
    }
  } joined{done, writer};
  const auto m = test::message_of<ConfigError>([&] { ConfigReader::from_file(fifo); });
  CAPTURE(m);
  REQUIRE(m.rfind(fifo + ": not a regular file (a FIFO)", 0) == 0);

  const auto folder = dir.path().string();
  REQUIRE(test::message_of<ConfigError>([&] {
            ConfigReader::from_file(folder);
          }).rfind(folder + ": not a regular file (a directory)", 0) == 0);
  REQUIRE(test::message_of<ConfigError>([&] {
            ConfigReader::from_file("/dev/null");
          }).rfind("/dev/null: not a regular file (a character device)", 0) == 0);
}

TEST_CASE("a config file larger than the limit is refused naming it, one at the limit loads",
          "[config]") {
  const test_support::ScratchFolder dir("shardswap-config-size");
  // Exactly the limit: an object whose one string fills it.
  const auto at_limit = (dir / "at.json").string();
  const std::string head = "{\"steps\": 3, \"tensorboard\": \"";
  std::mt19937 rng(19);
  std::string text = head;
  while (text.size() < ConfigReader::kMaxFileBytes - 2) text += static_cast<char>('a' + rng() % 26);
  text += "\"}";
  REQUIRE(text.size() == ConfigReader::kMaxFileBytes);
  std::ofstream(at_limit, std::ios::binary) << text;
  auto reader = ConfigReader::from_file(at_limit);
  REQUIRE(reader.integer("steps", 0) == 3);
  // One byte more (a space before the closing brace), and a sparse file far larger.
  const auto over = (dir / "over.json").string();
  text.insert(text.size() - 1, " ");
  std::ofstream(over, std::ios::binary) << text;
  const auto huge = (dir / "huge.json").string();
  const int fd = ::open(huge.c_str(), O_WRONLY | O_CREAT, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, off_t{1} << 36) == 0);  // 64 GiB of holes: costs no disk
  ::close(fd);
  for (const auto& path : {over, huge}) {
    const auto m = test::message_of<ConfigError>([&] { ConfigReader::from_file(path); });
    CAPTURE(m);
    REQUIRE(m.rfind(path + ": larger than 16 MiB (16777216 bytes)", 0) == 0);
  }
}

TEST_CASE("a config whose spelt-out key paths would exceed the limit is refused, not built",
          "[config]") {
  // 240 levels of 32-byte keys, then 2,500 leaves: an 80 KiB file whose unread leaves' paths
  // would take 2,500 x 7.9 KiB = 19.7 MiB; at 16 MiB the file limit's worth of them it stops.
  const std::string key(32, 'k');
  std::string text = "{\"tensorboard\": ";
  for (int i = 0; i < 240; ++i) text += "{\"" + key + "\": ";
  text += "{";
  for (int i = 0; i < 2500; ++i) text += fmt::format("{}\"leaf{}\": {}", i ? ", " : "", i, i);
  text += "}";
  for (int i = 0; i < 240; ++i) text += "}";
  text += "}";
  const auto reader = ConfigReader::from_text(text, "wide.json");
  const auto m = test::message_of<ConfigError>([&] { (void)reader.unread_keys(); });
  CAPTURE(m);
  REQUIRE(test::contains(m, "wide.json"));
  REQUIRE(test::contains(m, "exceed 16 MiB"));
  REQUIRE(test::contains(m, "tensorboard." + key));
}
