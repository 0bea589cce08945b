// A device budget (shardswap.device_memory, tools/trainer/device_budget.h): sizes as written,
// the search over what the config leaves free against plans made independently, the refusal
// naming the smallest budget that fits (and that budget fitting), and a run held to its share.
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "shardswap/config_reader.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "trainer/device_budget.h"
#include "trainer/train.h"

using namespace shardswap;

namespace {

// A small decoder on the cpu backend, 2 ranks: every plan here is made in milliseconds.
nlohmann::json small_run() {
  return nlohmann::json::parse(R"({
    "world_size": 2, "steps": 4, "seed": 5, "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.005, "weight_decay": 0.01}},
    "bf16": {"enabled": true}, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000},
    "model": {"type": "decoder", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "tie_word_embeddings": true},
    "data": {"tokenizer": "bytes", "train": "/usr/share/common-licenses/GPL-3", "seq_len": 32},
    "logging": {"interval": 2, "eval_interval": 100, "eval_batches": 2}
  })");
}

TrainConfig load(const nlohmann::json& j, ConfigFor purpose = ConfigFor::plan) {
  ConfigReader reader(j, "test.json");
  return train_config_from_json(reader, purpose);
}

// The largest rank's device plan of `j` as written (no budget): made by plan_memory, the
// trainer's own planner, independently of the search.
std::int64_t largest_plan(const nlohmann::json& j) {
  const TrainConfig t = load(j);
  std::int64_t most = 0;
  for (int r = 0; r < t.world_size; ++r) most = std::max(most, plan_memory(t, *t.model, r).total());
  return most;
}

nlohmann::json with(nlohmann::json j, const char* placement, int recompute) {
  j["zero_optimization"]["offload_optimizer"] = {{"device", placement}};
  j["model"]["recompute_layers"] = recompute;
  return j;
}

}  // namespace

TEST_CASE("a budget's size is read in decimal and binary units, and anything else is refused") {
  REQUIRE(parse_byte_size("24GiB", "k") == std::int64_t{24} << 30);
  REQUIRE(parse_byte_size("24 GiB", "k") == std::int64_t{24} << 30);
  REQUIRE(parse_byte_size("1.5GB", "k") == 1'500'000'000);
  REQUIRE(parse_byte_size("512MiB", "k") == std::int64_t{512} << 20);
  REQUIRE(parse_byte_size("80kB", "k") == 80'000);
  REQUIRE(parse_byte_size("4096", "k") == 4096);
  REQUIRE(parse_byte_size("4096B", "k") == 4096);
  REQUIRE(parse_byte_size("2TiB", "k") == std::int64_t{2} << 40);
  for (const char* bad : {"", "GiB", "24gb", "24 G", "-1GiB", "1.2.3GB", "0", "0.1", "1e9",
                          "24GiB ", "99999999999TB"}) {
    CAPTURE(bad);
    const auto msg = test::message_of<ConfigError>([&] { parse_byte_size(bad, "shardswap.x"); });
    REQUIRE(msg.find("shardswap.x") != std::string::npos);
    REQUIRE(msg.find("24GiB") != std::string::npos);  // says what is expected
  }
}

TEST_CASE("without a budget nothing changes, and a budget the config fits keeps its arrangement") {
  const auto j = small_run();
  REQUIRE_FALSE(load(j).budget.has_value());
  auto roomy = j;
  roomy["shardswap"]["device_memory"] = "1GiB";
  const TrainConfig t = load(roomy);
  REQUIRE(t.budget.has_value());
  REQUIRE(t.budget->budget.memory == std::int64_t{1} << 30);
  REQUIRE(t.budget->budget.reserve == 0);  // the cpu backend holds nothing outside the plan
  REQUIRE(t.budget->chosen.optimizer == Placement::device);
  REQUIRE(t.budget->chosen.recompute_layers == 0);
  REQUIRE(t.budget->chosen.plan_bytes == largest_plan(j));
  REQUIRE(t.engine.optimizer_placement == Placement::device);
  REQUIRE(t.model->recompute_layers() == 0);
  // 2 placements x 5 recompute counts (0..4 layers), all within 1 GiB.
  REQUIRE(t.budget->arrangements == 10);
  REQUIRE(t.budget->fitting == 10);
}

TEST_CASE(
    "under a budget the config does not fit, the search picks the fastest arrangement "
    "that fits by its estimate, and the run is planned as that arrangement written out") {
  const auto j = small_run();
  const std::int64_t as_written = largest_plan(j);
  // Every arrangement's plan, made independently: the budget's choice must fit, and no
  // arrangement estimated faster may fit.
  struct Option {
    const char* placement;
    int recompute;
    std::int64_t bytes;
  };
  std::vector<Option> options;
  for (const char* placement : {"none", "cpu"})
    for (int r = 0; r <= 4; ++r)
      options.push_back({placement, r, largest_plan(with(j, placement, r))});
  REQUIRE(options.front().bytes == as_written);
  for (const std::int64_t budget :
       {as_written - 1, as_written - 4096, as_written * 3 / 4, as_written * 2 / 3}) {
    auto b = j;
    b["shardswap"]["device_memory"] = budget;
    CAPTURE(budget);
    const TrainConfig t = load(b);
    const BudgetChoice& c = *t.budget;
    REQUIRE(c.chosen.plan_bytes <= budget);
    REQUIRE(c.configured.plan_bytes == as_written);
    // The plan of the chosen arrangement, written out in the config, is the chosen plan; and
    // the budgeted config plans exactly that.
    const char* placement = c.chosen.optimizer == Placement::host ? "cpu" : "none";
    REQUIRE(largest_plan(with(j, placement, c.chosen.recompute_layers)) == c.chosen.plan_bytes);
    std::int64_t budgeted = 0;
    for (int r = 0; r < t.world_size; ++r)
      budgeted = std::max(budgeted, plan_memory(t, *t.model, r).total());
    REQUIRE(budgeted == c.chosen.plan_bytes);
    int fitting = 0;
    for (const auto& o : options) fitting += o.bytes <= budget;
    REQUIRE(c.fitting == fitting);
    // Every arrangement that fits is estimated no faster than the choice.
    for (const auto& o : options) {
      if (o.bytes > budget) continue;
      auto written = with(j, o.placement, o.recompute);
      written["shardswap"]["device_memory"] = budget;
      const TrainConfig fixed = load(written);  // nothing free: its own arrangement's estimate
      REQUIRE(fixed.budget->arrangements == 1);
      REQUIRE(fixed.budget->chosen.step_s() >= c.chosen.step_s());
    }
    const std::string text = fmt::format("{}", fmt::join(c.lines(), "\n"));
    REQUIRE(text.find("does not fit") != std::string::npos);  // the config as written
    REQUIRE(text.find("chosen (") != std::string::npos);
    // What the choice was weighed against: the fastest with the state placed the other way,
    // when one of those fits.
    bool other_fits = false;
    for (const auto& o : options)
      other_fits |= o.bytes <= budget &&
                    (std::string(o.placement) == "cpu") != (c.chosen.optimizer == Placement::host);
    REQUIRE(c.other_placement.has_value() == other_fits);
    if (c.other_placement) {
      REQUIRE(c.other_placement->optimizer != c.chosen.optimizer);
      REQUIRE(c.other_placement->plan_bytes <= budget);
      REQUIRE(c.other_placement->step_s() >= c.chosen.step_s());
      REQUIRE(text.find("the fastest with the state placed otherwise") != std::string::npos);
    } else {
      REQUIRE(text.find("no arrangement fits") != std::string::npos);
    }
  }
}

TEST_CASE("a budget no arrangement fits is refused naming the smallest budget, which fits") {
  const auto j = small_run();
  std::int64_t smallest = largest_plan(with(j, "cpu", 4));
  auto tight = j;
  tight["shardswap"]["device_memory"] = 4096;
  const std::string msg = test::message_of<ConfigError>([&] { load(tight); });
  CAPTURE(msg);
  REQUIRE(test::config_shaped(msg, "test.json", "shardswap.device_memory"));
  REQUIRE(msg.find("no arrangement fits") != std::string::npos);
  REQUIRE(msg.find("state on the host, 4 of 4 layers recomputed") != std::string::npos);
  REQUIRE(msg.find(fmt::format("at least {} bytes", smallest)) != std::string::npos);
  REQUIRE(msg.find("refused before anything is allocated") != std::string::npos);
  tight["shardswap"]["device_memory"] = smallest;
  const TrainConfig t = load(tight);
  REQUIRE(t.budget->chosen.plan_bytes == smallest);
  REQUIRE(t.budget->fitting == 1);
  tight["shardswap"]["device_memory"] = smallest - 1;
  REQUIRE_THROWS_AS(load(tight), ConfigError);
}

TEST_CASE("what the config sets the search leaves alone, and the refusal says so") {
  auto j = with(small_run(), "none", 0);
  j["shardswap"]["device_memory"] = largest_plan(j) - 1;
  const std::string msg = test::message_of<ConfigError>([&] { load(j); });
  CAPTURE(msg);
  REQUIRE(msg.find(fmt::format("at least {} bytes", largest_plan(with(small_run(), "none", 0)))) !=
          std::string::npos);
  REQUIRE(msg.find("leaving them out lets the search vary them") != std::string::npos);
  // The placement fixed, the layers free: only recompute counts are searched.
  auto placed = small_run();
  placed["zero_optimization"]["offload_optimizer"] = {{"device", "none"}};
  placed["shardswap"]["device_memory"] = largest_plan(placed) - 1;
  const TrainConfig t = load(placed);
  REQUIRE(t.budget->arrangements == 5);
  REQUIRE(t.budget->chosen.optimizer == Placement::device);
  REQUIRE(t.budget->chosen.recompute_layers > 0);
}

TEST_CASE("a budget's keys are checked, naming them") {
  struct Bad {
    const char* key;
    nlohmann::json memory, reserve;
    const char* says;
  };
  for (const auto& [key, memory, reserve, says] : std::vector<Bad>{
           {"shardswap.device_memory", "lots", nullptr, "expected a size"},
           {"shardswap.device_memory", -3, nullptr, "whole number of bytes"},
           {"shardswap.device_memory", 1.5, nullptr, "whole number of bytes"},
           {"shardswap.device_memory", true, nullptr, ""},
           {"shardswap.device_reserve", nullptr, "1GiB", "give shardswap.device_memory too"},
           {"shardswap.device_reserve", "1GiB", "12 gigs", "expected a size"},
           {"shardswap.device_memory", "1GiB", "1GiB", "leaves nothing for the plan"},
       }) {
    auto j = small_run();
    if (!memory.is_null()) j["shardswap"]["device_memory"] = memory;
    if (!reserve.is_null()) j["shardswap"]["device_reserve"] = reserve;
    const auto msg = test::message_of<ConfigError>([&] { load(j); });
    CAPTURE(key, msg);
    REQUIRE(test::config_shaped(msg, "test.json", key));
    REQUIRE(msg.find(says) != std::string::npos);
  }
}

TEST_CASE(
    "a run under a budget is the run of the arrangement it chose, held to its plan to the "
    "byte") {
  const auto j = small_run();
  auto b = j;
  b["shardswap"]["device_memory"] = largest_plan(j) - 1;
  b["shardswap"]["device_reserve"] = 0;
  const TrainConfig budgeted = load(b, ConfigFor::run);
  const BudgetChoice& c = *budgeted.budget;
  REQUIRE(c.chosen.plan_bytes < largest_plan(j));
  const char* placement = c.chosen.optimizer == Placement::host ? "cpu" : "none";
  const TrainConfig written = load(with(j, placement, c.chosen.recompute_layers), ConfigFor::run);
  std::ostringstream budget_log, written_log;
  const TrainSummary s = train(budgeted, TrainOutput{budget_log});
  const TrainSummary w = train(written, TrainOutput{written_log});
  CAPTURE(budget_log.str());
  REQUIRE(budget_log.str().find("device budget ") != std::string::npos);
  REQUIRE(s.first_loss == w.first_loss);
  REQUIRE(s.final_loss == w.final_loss);
  REQUIRE(s.final_val_loss == w.final_val_loss);
  REQUIRE(s.peak_bytes <= c.budget.per_rank());
  REQUIRE(s.peak_bytes == w.peak_bytes);
  // A budget of exactly the chosen plan runs: the plan is the peak, and the cap lets it be.
  auto exact = with(j, placement, c.chosen.recompute_layers);
  exact["shardswap"]["device_memory"] = c.chosen.plan_bytes;
  std::ostringstream exact_log;
  const TrainSummary e = train(load(exact, ConfigFor::run), TrainOutput{exact_log});
  REQUIRE(e.final_loss == w.final_loss);
  REQUIRE(e.peak_bytes == c.chosen.plan_bytes);
  // eval holds its ranks to the same cap, and its plan fits it too.
  const TrainConfig exact_config = load(exact, ConfigFor::run);
  REQUIRE(evaluate(exact_config, {}).val_loss == evaluate(written, {}).val_loss);
}

TEST_CASE("a budget holds every active set a schedule can switch to, not only step 0's") {
  auto j = with(small_run(), "none", 0);
  j["steps"] = 4;
  j["layer_switching"] = nlohmann::json::parse(R"({"type": "explicit", "schedule": [
      {"step": 0, "active": ["embed", "layers.0"]},
      {"step": 2, "active": ["embed", "layers.0", "layers.1", "layers.2", "head"]}]})");
  auto later = j;
  later["layer_switching"]["schedule"] = nlohmann::json::parse(
      R"([{"step": 0, "active": ["embed", "layers.0", "layers.1", "layers.2", "head"]}])");
  const std::int64_t first = largest_plan(j), largest = largest_plan(later);
  REQUIRE(first < largest);  // largest_plan is step 0's
  j["shardswap"]["device_memory"] = largest - 1;
  const std::string msg = test::message_of<ConfigError>([&] { load(j); });
  CAPTURE(msg);
  REQUIRE(msg.find(fmt::format("at least {} bytes", largest)) != std::string::npos);
  // At exactly that bound the run trains through the switch to the larger set, under its cap.
  j["shardswap"]["device_memory"] = largest;
  std::ostringstream log;
  const TrainSummary s = train(load(j, ConfigFor::run), TrainOutput{log});
  CAPTURE(log.str());
  REQUIRE(s.switches == 1);
  REQUIRE(s.peak_bytes <= largest);
}

TEST_CASE("under keep_device the budget counts the state every switchable group leaves behind") {
  auto j = with(small_run(), "none", 0);
  j["layer_switching"] = nlohmann::json::parse(
      R"({"type": "badam", "interval": 1, "layers": ["layers.0", "layers.1", "layers.2",
          "layers.3"], "always_active": ["embed", "head"], "policy": "keep_device"})");
  j["steps"] = 5;  // every block visited, and the first again
  auto drop = j;
  drop["layer_switching"]["policy"] = "drop";
  drop["shardswap"]["device_memory"] = 1 << 30;
  j["shardswap"]["device_memory"] = 1 << 30;
  const std::int64_t dropping = load(drop).budget->chosen.plan_bytes;
  const std::int64_t keeping = load(j).budget->chosen.plan_bytes;
  REQUIRE(keeping > dropping);
  // The bound holds the run: capped at it, it visits every block.
  j["shardswap"]["device_memory"] = keeping;
  std::ostringstream log;
  const TrainSummary s = train(load(j, ConfigFor::run), TrainOutput{log});
  CAPTURE(log.str());
  REQUIRE(s.switches == 4);
  REQUIRE(s.peak_bytes <= keeping);
}

TEST_CASE(
    "the Qwen2.5 configs under the budgets issue 31 names: 7B full and 14B LISA fit 48GiB "
    "with the state on the host, 7B full 24GiB with the gradients there too, while 14B full "
    "under 48GiB needs more than the host's memory") {
  const auto plan = [](const char* config, const char* budget, const char* host = "125GiB",
                       std::vector<std::string> extra = {}) {
    auto reader = ConfigReader::from_file(std::string(SHARDSWAP_TEST_DIR "/../configs/") + config);
    for (const char* set :
         {"data.seq_len=2048", "train_micro_batch_size_per_gpu=3", "gradient_accumulation_steps=8"})
      reader.set(set);
    reader.set(std::string("shardswap.device_memory=\"") + budget + "\"");
    // The H200 machine's host memory, not the one running the test.
    reader.set(std::string("shardswap.host_memory=\"") + host + "\"");
    for (const auto& set : extra) reader.set(set);
    return train_config_from_json(reader, ConfigFor::plan);
  };
  for (const char* config : {"qwen2.5-7b.json", "qwen2.5-14b-lisa.json"}) {
    CAPTURE(config);
    const TrainConfig t = plan(config, "48GiB");
    REQUIRE(t.budget->chosen.optimizer == Placement::host);
    REQUIRE(t.budget->chosen.plan_bytes <= t.budget->budget.per_rank());
    REQUIRE(t.budget->configured.plan_bytes > t.budget->budget.per_rank());
  }
  // The bit16 weights and gradients alone are 28.4 GiB: under 24GiB the gradients go to the host.
  const TrainConfig small = plan("qwen2.5-7b.json", "24GiB");
  REQUIRE(small.budget->chosen.optimizer == Placement::host);
  REQUIRE(small.budget->chosen.gradients == Placement::host);
  REQUIRE(small.engine.gradient_placement == Placement::host);
  REQUIRE(small.budget->chosen.plan_bytes <= small.budget->budget.per_rank());
  // 14B's weights fit 48GiB beside two gradient windows, but its fp32 master, m, v and gradients
  // (192.6 GiB) do not fit the host's 125.
  const auto big = test::message_of<ConfigError>([&] { plan("qwen2.5-14b.json", "48GiB"); });
  REQUIRE(test::contains(big, "no arrangement fits this host"));
  REQUIRE(test::contains(big, "state on the host, gradients on the host"));
  // On a host of 64GiB the 7B's fp32 master, m and v (85 GiB) do not fit, bf16 m and v with the
  // master as low halves (12 bytes a param) do.
  const auto msg = test::message_of<ConfigError>([&] { plan("qwen2.5-7b.json", "48GiB", "64GiB"); });
  REQUIRE(msg.find("no arrangement fits this host") != std::string::npos);
  const TrainConfig light =
      plan("qwen2.5-7b.json", "48GiB", "64GiB",
           {"shardswap.optimizer_state_dtype=\"bf16\"",
            "shardswap.master_weights=\"bf16_remainder\""});
  REQUIRE(light.budget->chosen.optimizer == Placement::host);
  REQUIRE(light.budget->chosen.machine_bytes <= std::int64_t{64} << 30);
}

TEST_CASE("with frozen layers' weights on the host, a 14B LISA run fits 24GiB, which it cannot "
          "with them on the device, and a 7B one recomputes fewer layers") {
  const auto plan = [](const char* config, bool frozen_on_host) {
    auto reader = ConfigReader::from_file(std::string(SHARDSWAP_TEST_DIR "/../configs/") + config);
    for (const char* set :
         {"data.seq_len=2048", "train_micro_batch_size_per_gpu=3", "gradient_accumulation_steps=8",
          "shardswap.device_memory=\"24GiB\"", "shardswap.host_memory=\"125GiB\""})
      reader.set(set);
    if (frozen_on_host) reader.set("shardswap.frozen_weight_placement=\"host\"");
    return train_config_from_json(reader, ConfigFor::plan);
  };
  // 14B's bit16 weights alone are 27.5 GiB.
  const auto refused =
      test::message_of<ConfigError>([&] { plan("qwen2.5-14b-lisa.json", false); });
  REQUIRE(test::contains(refused, "shardswap.device_memory"));
  const TrainConfig big = plan("qwen2.5-14b-lisa.json", true);
  REQUIRE(big.engine.frozen_weight_placement == Placement::host);
  REQUIRE(big.budget->chosen.plan_bytes <= big.budget->budget.per_rank());
  REQUIRE(big.budget->frozen_weights_on_host);
  const auto lines = big.budget->lines();
  REQUIRE(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
    return test::contains(l, "frozen layers' weights on the host");
  }));
  // The plan the search chose is the planner's own for that arrangement (plan_memory).
  REQUIRE(plan_memory(big, *big.model, 0).total() == big.budget->chosen.plan_bytes);
  const TrainConfig on_device = plan("qwen2.5-7b-lisa.json", false);
  const TrainConfig on_host = plan("qwen2.5-7b-lisa.json", true);
  REQUIRE(on_host.budget->chosen.recompute_layers < on_device.budget->chosen.recompute_layers);
  REQUIRE_FALSE(on_device.budget->frozen_weights_on_host);
}

TEST_CASE("the budget's streamed estimate counts the master's and the state's bytes as stored") {
  const auto bytes = [](const char* state, const char* master) {
    auto j = small_run();
    j["shardswap"]["device_memory"] = largest_plan(small_run()) - 1;
    j["shardswap"]["optimizer_state_dtype"] = state;
    j["shardswap"]["master_weights"] = master;
    const TrainConfig t = load(j);
    const std::string text = fmt::format("{}", fmt::join(t.budget->lines(), "\n"));
    REQUIRE(text.find(fmt::format("({} bytes a param)", t.budget->streamed_bytes_per_param)) !=
            std::string::npos);
    return t.budget->streamed_bytes_per_param;
  };
  // Up and down, AdamW: master + m + v.
  REQUIRE(bytes("fp32", "fp32") == 24.0);
  REQUIRE(bytes("bf16", "fp32") == 16.0);
  REQUIRE(bytes("fp32", "bf16_remainder") == 20.0);
  REQUIRE(bytes("bf16", "bf16_remainder") == 12.0);
}

namespace {

// small_run with its global batch given alone (16 samples on 2 ranks: micro 8, accumulation 1,
// as DeepSpeed derives them), or with the micro-batch and accumulation written out.
nlohmann::json global_batch_run(int micro = 0, int accumulation = 0) {
  auto j = small_run();
  j.erase("train_micro_batch_size_per_gpu");
  j.erase("gradient_accumulation_steps");
  if (micro > 0) {
    j["train_micro_batch_size_per_gpu"] = micro;
    j["gradient_accumulation_steps"] = accumulation;
  } else {
    j["train_batch_size"] = 16;
  }
  return j;
}

// The smallest plan of any arrangement at one micro-batch, made independently.
std::int64_t smallest_plan(const nlohmann::json& j) {
  std::int64_t least = std::numeric_limits<std::int64_t>::max();
  for (const char* placement : {"none", "cpu"})
    for (int r = 0; r <= 4; ++r) least = std::min(least, largest_plan(with(j, placement, r)));
  return least;
}

}  // namespace

TEST_CASE("with only the global batch given, a budget no arrangement of its micro-batch fits "
          "takes the largest smaller micro-batch that fits, the same global batch, and runs as "
          "it written out") {
  const std::int64_t at8 = smallest_plan(global_batch_run(8, 1));
  const std::int64_t at4 = smallest_plan(global_batch_run(4, 2));
  REQUIRE(at4 < at8);
  auto j = global_batch_run();
  j["shardswap"]["device_memory"] = at8 - 1;  // nothing at micro 8 fits; micro 4 does
  j["shardswap"]["device_reserve"] = 0;
  const TrainConfig t = load(j, ConfigFor::run);
  const BudgetChoice& c = *t.budget;
  REQUIRE(c.micro_free);
  REQUIRE(c.configured.micro == 8);
  REQUIRE(c.chosen.micro == 4);
  REQUIRE(c.chosen.accumulation == 2);
  REQUIRE(t.batches.micro_samples == 4);
  REQUIRE(t.batches.gradient_accumulation_steps == 2);
  REQUIRE(t.engine.gradient_accumulation_steps == 2);
  REQUIRE(t.batches.train_samples == 16);
  REQUIRE(c.chosen.plan_bytes <= at8 - 1);
  const std::string text = fmt::format("{}", fmt::join(c.lines(), "\n"));
  CAPTURE(text);
  REQUIRE(text.find("chosen (micro-batch 4 x 2 accumulated, ") != std::string::npos);
  REQUIRE(text.find("the micro-batch (the same global batch") != std::string::npos);
  // The choice is the fastest at micro 4, planned as that arrangement written out; it runs as
  // that config does, loss for loss and byte for byte.
  const char* placement = c.chosen.optimizer == Placement::host ? "cpu" : "none";
  const auto written_json = with(global_batch_run(4, 2), placement, c.chosen.recompute_layers);
  REQUIRE(largest_plan(written_json) == c.chosen.plan_bytes);
  std::ostringstream budget_log, written_log;
  const TrainSummary s = train(t, TrainOutput{budget_log});
  const TrainSummary w = train(load(written_json, ConfigFor::run), TrainOutput{written_log});
  REQUIRE(s.first_loss == w.first_loss);
  REQUIRE(s.final_loss == w.final_loss);
  REQUIRE(s.final_val_loss == w.final_val_loss);
  REQUIRE(s.peak_bytes == w.peak_bytes);
  // With micro 8 fitting, micro 8 is kept.
  j["shardswap"]["device_memory"] = at8;
  REQUIRE(load(j).budget->chosen.micro == 8);
  // Below every micro-batch's smallest, the refusal names the smallest at micro 1.
  j["shardswap"]["device_memory"] = 4096;
  const std::string msg = test::message_of<ConfigError>([&] { load(j); });
  CAPTURE(msg);
  REQUIRE(msg.find("micro-batch 1 x 8 accumulated, state on the host, 4 of 4 layers "
                   "recomputed") != std::string::npos);
  REQUIRE(msg.find(fmt::format("at least {} bytes", smallest_plan(global_batch_run(1, 8)))) !=
          std::string::npos);
}

TEST_CASE("with the micro-batch given, a budget only a smaller one fits is refused, naming the "
          "micro-batch and accumulation that would fit") {
  const std::int64_t at4 = smallest_plan(global_batch_run(4, 2));
  REQUIRE(smallest_plan(global_batch_run(2, 4)) < at4);
  auto j = global_batch_run(4, 2);
  j["shardswap"]["device_memory"] = at4 - 1;
  const std::string msg = test::message_of<ConfigError>([&] { load(j); });
  CAPTURE(msg);
  REQUIRE(test::config_shaped(msg, "test.json", "shardswap.device_memory"));
  REQUIRE(msg.find(fmt::format("at least {} bytes", at4)) != std::string::npos);
  REQUIRE(msg.find("at train_micro_batch_size_per_gpu = 2 with gradient_accumulation_steps = 4 "
                   "(the same global batch)") != std::string::npos);
  REQUIRE(msg.find("give train_batch_size alone") != std::string::npos);
}

namespace {

// What the in-process ranks of `j` (the cpu backend: device plans are host memory too) take of
// this machine's memory together, planned independently.
std::int64_t machine_need(const nlohmann::json& j) {
  const TrainConfig t = load(j);
  std::int64_t most = 0;
  for (int r = 0; r < t.world_size; ++r) {
    const PlannedMemory p = plan_memory(t, *t.model, r);
    most = std::max(most, p.total() + p.host_total());
  }
  return most * t.world_size;
}

}  // namespace

TEST_CASE("the budget leaves out arrangements the host's memory cannot hold, and says so") {
  const auto j = small_run();
  const std::int64_t budget = largest_plan(j) - 1;
  auto b = j;
  b["shardswap"]["device_memory"] = budget;
  const BudgetChoice free = *load(b).budget;
  REQUIRE(free.host_excluded == 0);
  // The host just too small for the unconstrained choice.
  const char* placement = free.chosen.optimizer == Placement::host ? "cpu" : "none";
  const std::int64_t chosen_need = machine_need(with(j, placement, free.chosen.recompute_layers));
  REQUIRE(free.chosen.machine_bytes == chosen_need);
  b["shardswap"]["host_memory"] = chosen_need - 1;
  int excluded = 0, fitting = 0;
  for (const char* where : {"none", "cpu"})
    for (int r = 0; r <= 4; ++r) {
      const auto w = with(j, where, r);
      if (largest_plan(w) > budget) continue;
      (machine_need(w) > chosen_need - 1 ? excluded : fitting) += 1;
    }
  REQUIRE(excluded >= 1);
  if (fitting > 0) {
    const BudgetChoice c = *load(b).budget;
    REQUIRE(c.host_excluded == excluded);
    REQUIRE(c.fitting == fitting);
    REQUIRE(c.chosen.machine_bytes <= chosen_need - 1);
    REQUIRE(c.chosen.plan_bytes <= budget);
    const std::string text = fmt::format("{}", fmt::join(c.lines(), "\n"));
    REQUIRE(text.find(fmt::format("left out: {} arrangement", excluded)) != std::string::npos);
  }
  // A host that holds none: refused, saying what the host lacks.
  b["shardswap"]["host_memory"] = "1KiB";
  const std::string msg = test::message_of<ConfigError>([&] { load(b); });
  CAPTURE(msg);
  REQUIRE(test::config_shaped(msg, "test.json", "shardswap.device_memory"));
  REQUIRE(msg.find("no arrangement fits this host: ") != std::string::npos);
  REQUIRE(msg.find("within the device budget need more host memory than the 0.00 GiB its 2 "
                   "ranks may take (shardswap.host_memory") != std::string::npos);
  // And its key is checked.
  b["shardswap"]["host_memory"] = "plenty";
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { load(b); }),
                         "test.json: shardswap.host_memory = \"plenty\": expected a size"));
}

TEST_CASE("a run whose plan needs more host memory than shardswap.host_memory is refused before "
          "anything is allocated, naming the key") {
  auto j = small_run();
  j["shardswap"]["host_memory"] = machine_need(j) - 1;
  std::ostringstream log;
  const TrainConfig t = load(j, ConfigFor::run);
  REQUIRE(t.host_memory == machine_need(j) - 1);
  const std::string msg = test::message_of<Error>([&] { train(t, TrainOutput{log}); });
  CAPTURE(msg);
  REQUIRE(msg.find("it may take (shardswap.host_memory): refused before anything is "
                   "allocated") != std::string::npos);
  j["shardswap"]["host_memory"] = machine_need(j);
  REQUIRE_NOTHROW(train(load(j, ConfigFor::run), TrainOutput{log}));
}

TEST_CASE("on one rank, a budget that only gradients on the host fit puts them there, and the run "
          "gives the losses of the run with everything on the device") {
  auto j = small_run();
  j["world_size"] = 1;
  const auto with_grads_on_host = [&](int recompute) {
    auto g = with(j, "cpu", recompute);
    g["shardswap"]["gradient_placement"] = "host";
    return g;
  };
  const std::int64_t state_on_host = largest_plan(with(j, "cpu", 4));
  const std::int64_t grads_on_host = largest_plan(with_grads_on_host(4));
  REQUIRE(grads_on_host < state_on_host);
  auto b = j;
  b["shardswap"]["device_memory"] = state_on_host - 1;
  const TrainConfig t = load(b, ConfigFor::run);
  const BudgetChoice& c = *t.budget;
  REQUIRE(c.gradients_free);
  REQUIRE(c.chosen.optimizer == Placement::host);
  REQUIRE(c.chosen.gradients == Placement::host);
  REQUIRE(c.chosen.gradients_s > 0.0);
  REQUIRE(t.engine.gradient_placement == Placement::host);
  // 3 placements (state and gradients on the device; state on the host; both) x 5 recompute
  // counts.
  REQUIRE(c.arrangements == 15);
  REQUIRE(largest_plan(with_grads_on_host(c.chosen.recompute_layers)) == c.chosen.plan_bytes);
  std::string lines;
  for (const auto& l : c.lines()) lines += l + "\n";
  CAPTURE(lines);
  REQUIRE(test::contains(lines, "state on the host, gradients on the host"));
  REQUIRE(test::contains(lines, "where the gradients live"));
  std::ostringstream log, device_log;
  const TrainSummary s = train(t, TrainOutput{log});
  const TrainSummary d =
      train(load(with(j, "none", c.chosen.recompute_layers), ConfigFor::run),
            TrainOutput{device_log});
  CAPTURE(log.str());
  REQUIRE(s.first_loss == d.first_loss);
  REQUIRE(s.final_loss == d.final_loss);
  REQUIRE(s.final_val_loss == d.final_val_loss);
  REQUIRE(s.peak_bytes == c.chosen.plan_bytes);
  // Below even that: refused, naming the smallest arrangement and the budget it needs.
  b["shardswap"]["device_memory"] = grads_on_host - 1;
  const std::string msg = test::message_of<ConfigError>([&] { load(b); });
  REQUIRE(test::contains(msg, "state on the host, gradients on the host, 4 of 4 layers recomputed"));
  REQUIRE(test::contains(msg, fmt::format("at least {} bytes", grads_on_host)));
  // Two ranks: the gradients stay on the device (the search does not offer the host).
  auto two = b;
  two["world_size"] = 2;
  two["shardswap"]["device_memory"] = state_on_host * 2;
  REQUIRE_FALSE(load(two).budget->gradients_free);
}

// On the CUDA backend the search also weighs keeping each layer's norm outputs for backward (the
// same bits, more activation bytes, less of backward's traffic): kept where the budget holds
// them, not where it does not, and never where the config says.
TEST_CASE(
    "on a CUDA run the search keeps the norm outputs where the budget holds them, and "
    "leaves the config's choice alone") {
  auto j = small_run();
  j["world_size"] = 1;
  j["shardswap"]["backend"] = "cuda";
  const auto keeping = [&](bool keep) {
    auto k = j;
    k["model"]["keep_norm_outputs"] = keep;
    return k;
  };
  const std::int64_t plain = largest_plan(keeping(false)), kept = largest_plan(keeping(true));
  REQUIRE(plain == largest_plan(j));  // false is the default
  REQUIRE(kept > plain);
  auto roomy = j;
  roomy["shardswap"]["device_memory"] = kept;
  roomy["shardswap"]["device_reserve"] = 0;  // the plan's share is the whole budget
  const TrainConfig t = load(roomy);
  REQUIRE(t.budget->keep_norms_free);
  REQUIRE(t.budget->chosen.keep_norms);
  REQUIRE(t.budget->chosen.recompute_layers == 0);
  REQUIRE(t.budget->chosen.plan_bytes == kept);
  REQUIRE(t.model->keeps_norms());
  REQUIRE(plan_memory(t, *t.model, 0).total() == kept);  // the run plans what was chosen
  REQUIRE(t.budget->chosen.step_s() < t.budget->configured.step_s());
  const std::string text = fmt::format("{}", fmt::join(t.budget->lines(), "\n"));
  CAPTURE(text);
  REQUIRE(test::contains(text, "0 of 4 layers recomputed, norm outputs kept): plan"));
  REQUIRE(test::contains(text, "whether the norms' outputs are kept"));
  REQUIRE(test::contains(text, "kept norm outputs sparing backward's norms at 3.2 TB/s"));

  // One byte short, with the rest fixed: only the plan without them fits.
  auto tight = with(roomy, "none", 0);
  tight["shardswap"]["gradient_placement"] = "device";
  tight["shardswap"]["device_memory"] = kept - 1;
  const TrainConfig short_one = load(tight);
  REQUIRE(short_one.budget->arrangements == 2);
  REQUIRE(short_one.budget->fitting == 1);
  REQUIRE_FALSE(short_one.budget->chosen.keep_norms);
  REQUIRE_FALSE(short_one.model->keeps_norms());

  // Set by the config, either way, it is not searched: half the arrangements.
  for (const bool keep : {false, true}) {
    CAPTURE(keep);
    auto fixed = keeping(keep);
    fixed["shardswap"]["device_memory"] = kept;
    fixed["shardswap"]["device_reserve"] = 0;
    const TrainConfig f = load(fixed);
    REQUIRE_FALSE(f.budget->keep_norms_free);
    REQUIRE(f.budget->chosen.keep_norms == keep);
    REQUIRE(f.model->keeps_norms() == keep);
    REQUIRE(2 * f.budget->arrangements == t.budget->arrangements);
  }
}
