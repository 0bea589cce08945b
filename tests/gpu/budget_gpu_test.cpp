// A device budget on the CUDA backend (tools/trainer/device_budget.h): a run under a budget is
// the run of the arrangement it chose written out, bit for bit on the GPU, held to its plan to
// the byte; an allocation past a space's cap allocates nothing on the device.
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include "shardswap/allocator.h"
#include "shardswap/buffer.h"
#include "shardswap/config_reader.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/gpu/device_memory_check.h"
#include "trainer/train.h"

using namespace shardswap;

namespace {

nlohmann::json small_cuda_run() {
  return nlohmann::json::parse(R"({
    "world_size": 1, "steps": 4, "seed": 5, "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.005, "weight_decay": 0.01}},
    "bf16": {"enabled": true}, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 50000},
    "model": {"type": "decoder", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": true},
    "data": {"tokenizer": "bytes", "train": "/usr/share/common-licenses/GPL-3", "seq_len": 64},
    "logging": {"interval": 2, "eval_interval": 100, "eval_batches": 2},
    "shardswap": {"backend": "cuda", "communicator": "in_process", "device_reserve": 0}
  })");
}

TrainConfig load(const nlohmann::json& j, ConfigFor purpose) {
  ConfigReader reader(j, "test.json");
  return train_config_from_json(reader, purpose);
}

std::int64_t step0_plan(const nlohmann::json& j) {
  const TrainConfig t = load(j, ConfigFor::plan);
  return plan_memory(t, *t.model, 0).total();
}

}  // namespace

TEST_CASE("cuda: a run under a budget is the run of its arrangement written out, bit for bit, "
          "held to its plan") {
  auto j = small_cuda_run();
  auto unbudgeted = j;
  unbudgeted["shardswap"].erase("device_reserve");
  const std::int64_t as_written = step0_plan(unbudgeted);
  j["shardswap"]["device_memory"] = as_written - 1;
  const TrainConfig budgeted = load(j, ConfigFor::run);
  const BudgetChoice& c = *budgeted.budget;
  REQUIRE(c.chosen.plan_bytes < as_written);
  auto written = unbudgeted;
  written["zero_optimization"]["offload_optimizer"] = {
      {"device", c.chosen.optimizer == Placement::host ? "cpu" : "none"}, {"pin_memory", true}};
  written["model"]["recompute_layers"] = c.chosen.recompute_layers;
  std::ostringstream budget_log, written_log;
  const TrainSummary s = train(budgeted, TrainOutput{budget_log});
  const TrainSummary w = train(load(written, ConfigFor::run), TrainOutput{written_log});
  CAPTURE(budget_log.str(), written_log.str());
  REQUIRE(s.first_loss == w.first_loss);
  REQUIRE(s.final_loss == w.final_loss);
  REQUIRE(s.final_val_loss == w.final_val_loss);
  REQUIRE(s.peak_bytes == c.chosen.plan_bytes);
  REQUIRE(s.peak_bytes <= c.budget.per_rank());
  REQUIRE(budget_log.str().find("held outside the plan") != std::string::npos);
}

TEST_CASE("cuda: an allocation past a space's cap allocates nothing on the device") {
  MemorySpace space(0, make_cuda_allocator(0));
  space.set_limit(std::int64_t{64} << 20, "a test cap of 64 MiB");
  Buffer held = space.allocate(std::size_t{48} << 20, Tag::param16, "weights");
  const std::int64_t free_before = test::device_free_bytes();
  const auto msg = test::message_of<OutOfMemory>(
      [&] { (void)space.allocate(std::size_t{32} << 20, Tag::grad, "gradients"); });
  CAPTURE(msg);
  REQUIRE(msg.find("'gradients'") != std::string::npos);
  REQUIRE(msg.find("a test cap of 64 MiB") != std::string::npos);
  REQUIRE(test::device_free_bytes() == free_before);
  REQUIRE(space.stats().tag(Tag::grad).buffers == 0);
  Buffer fits = space.allocate(std::size_t{16} << 20, Tag::grad, "gradients");
  REQUIRE(space.stats().requested.current == std::int64_t{64} << 20);
}
