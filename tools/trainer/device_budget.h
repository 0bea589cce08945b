// A device budget (shardswap.device_memory): the bytes of a GPU a run may take, as if it ran on a
// card of that size. Before anything is allocated, the planner picks the arrangement the budget
// holds that it estimates fastest among what the config leaves free (where the fp32 master and
// optimizer state live, how many layers run their forward again in backward, whether the norms'
// outputs are kept for backward), or refuses the config naming the smallest budget any
// arrangement fits; then every rank's space is capped at its share, so an allocation past the
// plan fails naming its tag (docs/memory.md, "A device budget").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardswap/buffer.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine_config.h"

namespace shardswap {

struct TrainConfig;

/// "24GiB", "24 GiB", "1.5GB", "512MiB", "4096" (bytes) or a JSON number of bytes: bytes, > 0.
/// Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) of 1024.
/// Throws ConfigError naming `key` for anything else.
std::int64_t parse_byte_size(std::string_view text, std::string_view key);

/// The memory this process may use: the machine's, or its cgroup's limit where lower (a
/// container's). 0 when neither can be read.
std::int64_t machine_memory_bytes();

/// shardswap.host_memory (a size as parse_byte_size reads it, or bytes): the host memory a run's
/// ranks on this machine may take together; absent, machine_memory_bytes(). ConfigError naming
/// the key for anything else.
std::int64_t read_host_memory(ConfigReader& c);

struct DeviceBudget {
  std::int64_t memory = 0;  ///< shardswap.device_memory: the GPU's bytes the run may take
  /// shardswap.device_reserve: what the process holds on the GPU outside the plan (its CUDA
  /// context, NCCL's buffers, the libraries' state and kernel code), counted into the budget.
  std::int64_t reserve = 0;
  int ranks_per_device = 1;  ///< ranks whose plans share one GPU (in-process ranks on one)
  /// The host memory the ranks on this machine may take together (TrainConfig::host_memory; 0:
  /// unknown, not checked), and how many ranks that is (a launch's local size, or the
  /// in-process ranks).
  std::int64_t host_memory = 0;
  int ranks_on_machine = 1;
  std::string memory_text;   ///< as the config wrote it
  /// What each rank's plan may hold: its share of the budget less the reserve.
  std::int64_t per_rank() const { return (memory - reserve) / ranks_per_device; }
};

/// One way to lay the run out, with its largest plan over ranks and its estimated step time.
struct Arrangement {
  Placement optimizer = Placement::device;  ///< the fp32 master and optimizer state
  Placement gradients = Placement::device;  ///< the active groups' gradient buffers
  int recompute_layers = 0;
  bool keep_norms = false;  ///< model.keep_norm_outputs
  int micro = 0;         ///< train_micro_batch_size_per_gpu
  int accumulation = 0;  ///< gradient_accumulation_steps (micro x accumulation x ranks: the
                         ///< config's global batch, whichever micro-batch)
  std::int64_t plan_bytes = 0;  ///< the largest rank's device plan (engine + activations)
  /// What the ranks on this machine take of its host memory together: the largest rank's host
  /// plan (on the cpu backend its device plan too, which is host memory there) x those ranks.
  std::int64_t machine_bytes = 0;
  double compute_s = 0.0;       ///< estimated forward and backward of a step
  double update_s = 0.0;        ///< estimated update of a step beyond the device's own
  double gradients_s = 0.0;     ///< estimated gradient windows' copies of a step (host gradients)
  double step_s() const { return compute_s + update_s + gradients_s; }
};

/// What the search saw and chose; printed by `shardswap plan` and at the start of a run.
struct BudgetChoice {
  DeviceBudget budget;
  Arrangement configured;  ///< the config's own arrangement
  Arrangement chosen;
  /// The fastest arrangement that fits with the state placed otherwise than the chosen one's, if
  /// the placement was searched and one fits: what the choice was weighed against.
  std::optional<Arrangement> other_placement;
  bool placement_free = false;  ///< zero_optimization.offload_optimizer not given
  bool recompute_free = false;  ///< model.recompute_layers not given
  /// model.keep_norm_outputs not given, and the model can keep them on the run's device.
  bool keep_norms_free = false;
  /// shardswap.gradient_placement not given, one rank, and the state may go to the host.
  bool gradients_free = false;
  /// train_batch_size given, the micro-batch and the accumulation not: a smaller micro-batch
  /// (the same global batch) is searched when none of the config's fits.
  bool micro_free = false;
  int recomputable = 0;         ///< the model's layers
  int arrangements = 0;         ///< searched
  double streamed_bytes_per_param = 24.0;  ///< over PCIe a step, state on the host, streamed
  int fitting = 0;              ///< of them, within the budget
  /// Arrangements within the device budget left out because the host's memory cannot hold them
  /// (DeviceBudget::host_memory).
  int host_excluded = 0;
  /// shardswap.frozen_weight_placement = host (the config's, not searched): every plan counts
  /// the frozen layers' weights on the host and the two windows, the estimates not their copies.
  bool frozen_weights_on_host = false;
  std::vector<std::string> lines() const;
};

/// Reads shardswap.device_memory and shardswap.device_reserve of a config whose model, engine,
/// batches, schedule and backend are read; without a budget returns nothing. With one, searches,
/// sets the chosen arrangement in `t` (engine.optimizer_placement and gradient_placement, model,
/// and with micro_free
/// batches and engine.gradient_accumulation_steps) and returns what it did; throws ConfigError
/// naming shardswap.device_memory and the smallest budget that would fit when no arrangement
/// does (and the largest smaller micro-batch that would, when the config fixes it), or when the
/// reserve leaves nothing for the plan. A caller whose data was opened for the config's
/// micro-batch opens it again when chosen.micro differs.
std::optional<BudgetChoice> apply_device_budget(ConfigReader& c, TrainConfig& t);

/// Caps `space` (a rank's device memory) at the budget's share of a rank, if there is a budget:
/// an allocation past it fails naming its tag, as on a GPU of the budget's size. Returns `space`.
MemorySpace& cap_to_budget(MemorySpace& space, const std::optional<BudgetChoice>& budget);

}  // namespace shardswap
