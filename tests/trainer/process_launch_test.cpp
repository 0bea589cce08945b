// The launcher's environment as process_launch_from_env reads it, and the host update's threads
// shared between the ranks on a machine (in-process ranks, or a launch's processes on it).
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardswap/config_reader.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "trainer/process_launch.h"
#include "trainer/train.h"

using namespace shardswap;

namespace {

// Sets the variables for the scope and removes them after (none of them is set in a test run).
class LaunchEnv {
 public:
  explicit LaunchEnv(std::vector<std::pair<const char*, const char*>> vars)
      : vars_(std::move(vars)) {
    for (const auto& [name, value] : vars_) ::setenv(name, value, 1);
  }
  ~LaunchEnv() {
    for (const auto& [name, value] : vars_) ::unsetenv(name);
  }

 private:
  std::vector<std::pair<const char*, const char*>> vars_;
};

TrainConfig small(int world, bool threads_given) {
  auto j = nlohmann::json::parse(R"({
    "steps": 2, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64},
    "data": {"tokenizer": "bytes", "train": "/usr/share/common-licenses/GPL-3", "seq_len": 32}
  })");
  j["world_size"] = world;
  if (threads_given) j["shardswap"]["offload_threads"] = 3;
  ConfigReader reader(j, "test.json");
  return train_config_from_json(reader, ConfigFor::plan);
}

}  // namespace

TEST_CASE("a launch's processes on this machine are read from the launcher's environment") {
  REQUIRE_FALSE(process_launch_from_env().has_value());
  {
    LaunchEnv env({{"OMPI_COMM_WORLD_RANK", "1"},
                   {"OMPI_COMM_WORLD_SIZE", "8"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
    const auto launch = process_launch_from_env();
    REQUIRE(launch.has_value());
    REQUIRE(launch->rank == 1);
    REQUIRE(launch->world_size == 8);
    REQUIRE(launch->local_size == 4);
  }
  {
    LaunchEnv env(
        {{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "2"}});
    REQUIRE(process_launch_from_env()->local_size == 2);
  }
  {
    // Unsaid, more than the job, or not a plain count: every core is this process's.
    LaunchEnv env({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"MPI_LOCALNRANKS", "9"}});
    REQUIRE(process_launch_from_env()->local_size == 1);
  }
  {
    LaunchEnv env({{"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "6"},
                   {"SLURM_NTASKS_PER_NODE", "2(x3)"}});
    REQUIRE(process_launch_from_env()->local_size == 1);
  }
}

TEST_CASE(
    "the host update's threads are the machine's cores shared by the ranks on it, unless "
    "set") {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  REQUIRE(share_of_cores(1) == cores);
  REQUIRE(share_of_cores(static_cast<int>(cores) * 4) == 1);
  REQUIRE(small(1, false).engine.offload_threads == cores);
  REQUIRE(small(2, false).engine.offload_threads == std::max(1u, cores / 2));
  REQUIRE(small(2, true).engine.offload_threads == 3);
  // Under a launch, the processes on this machine share it, whatever the job's size.
  TrainConfig launched = small(8, false);
  attach_process_launch(launched, ProcessLaunch{3, 8, 2, "OMPI_COMM_WORLD_SIZE=8"});
  REQUIRE(launched.engine.offload_threads == std::max(1u, cores / 2));
  TrainConfig given = small(8, true);
  attach_process_launch(given, ProcessLaunch{3, 8, 2, "OMPI_COMM_WORLD_SIZE=8"});
  REQUIRE(given.engine.offload_threads == 3);
}
