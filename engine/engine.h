// The public C++ API: one Engine per rank. Declare params, build, then per step: write gradients
// into grad slots, signal them ready, step(). ZeRO-1/2 over any Communicator.
//
// Typical use (each rank, e.g. a thread of run_ranks or a process under mpirun):
//   Engine engine(config, comm, space);
//   engine.add_param("layers.0.fc1.weight", {256, 64}, "layers.0");
//   ...
//   engine.build(init);                       // same init on every rank
//   View w = engine.weight("layers.0.fc1.weight");   // bit16, read in forward
//   // backward: for each param, in any order, the same on every rank:
//   View g = engine.grad_slot("layers.0.fc1.weight");
//   add this micro-batch's gradient (times loss_scale()) into g;
//   engine.grad_ready("layers.0.fc1.weight");
//   StepResult r = engine.step();             // reduce, clip, update, all-gather
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/engine_config.h"
#include "memory/buffer.h"
#include "optimizer/optimizer.h"

namespace shardswap {

struct ParamInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;
  std::string group;
};

/// Fills a param's initial values (fp32; rounded to bit16). Must give the same values on every
/// rank.
using WeightInit = std::function<void(const ParamInfo& param, std::span<float> values)>;

struct StepResult {
  bool applied = false;     ///< false: skipped (Inf/NaN gradients)
  double grad_norm = 0.0;   ///< global norm of the averaged, unscaled gradients (Inf/NaN if so)
  double clip_coef = 1.0;   ///< applied to the gradients (1 when not clipped)
  double loss_scale = 1.0;  ///< the scale the gradients of this step carried
};

/// What deactivation does with a group's fp32 master and optimizer state.
enum class DeactivatePolicy {
  drop,         ///< LISA: freed; reactivation starts from the bit16 weights, zero moments, step 0
  keep_host,    ///< moved to host memory, restored exactly on reactivation
  keep_device,  ///< left on the device, restored exactly on reactivation
};
/// "drop", "keep_host", "keep_device". Throws ConfigError naming `key` otherwise.
DeactivatePolicy deactivate_policy_from_name(std::string_view name, std::string_view key);
const char* deactivate_policy_name(DeactivatePolicy policy);

/// What one set_active() call did.
struct SwitchReport {
  std::vector<std::string> activated;
  std::vector<std::string> deactivated;
  std::int64_t bytes_freed = 0;      ///< device bytes (requested) given back
  std::int64_t bytes_allocated = 0;  ///< device bytes (requested) newly taken
  double seconds = 0.0;
};

/// Planned bytes per tag for this rank, computed from the declarations alone.
struct MemoryPlan {
  std::array<std::int64_t, kTagCount> bytes{};
  std::int64_t total() const;
  std::int64_t of(Tag t) const { return bytes[static_cast<std::size_t>(t)]; }
};

/// A piece of a param's fp32 master held by this rank.
struct MasterPiece {
  std::int64_t param_offset = 0;
  std::vector<float> values;
};

/// One group's fp32 training state on this rank, for checkpoints: flat over this rank's shard
/// (Shard::of(layout(group), rank())), alignment padding included.
struct GroupTrainingState {
  std::string group;
  bool active = false;
  /// Frozen with kept state: keep_host or keep_device (never drop). Unset: active, or frozen
  /// with nothing kept.
  std::optional<DeactivatePolicy> kept;
  std::int64_t step = 0;
  std::vector<float> master;  ///< shard numel values; empty when the group holds no state
  std::vector<float> state;   ///< optimizer state: state_slots() x shard numel, slot after slot
};

/// Everything an Engine changes while it trains, as a checkpoint saves and restores it (the
/// declarations and the config are the model, not state).
struct TrainingState {
  std::vector<GroupTrainingState> groups;  ///< one per group, in the order of groups()
  LossScalerState scaler;
  double lr = 0.0;
  /// The bit16 weights, raw (config().dtype), one per param in declaration order; empty when
  /// not asked for (they are the same on every rank).
  std::vector<std::vector<std::byte>> weights;
};

struct Group;

class Engine {
 public:
  /// Throws ConfigError if the config is invalid. `comm` and `space` must outlive the Engine.
  Engine(EngineConfig config, Communicator& comm, MemorySpace& space,
         const OptimizerKernels& kernels = cpu_kernels());
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- declaration ----
  /// Throws ConfigError for an empty or duplicate name, an empty group name, a shape with a
  /// non-positive extent (zero elements), or a call after build().
  void add_param(std::string name, std::vector<std::int64_t> shape, std::string group);
  /// Overrides the optimizer's weight decay for one group (e.g. norms and biases: 0).
  void set_group_weight_decay(const std::string& group, double weight_decay);
  /// Device bytes this rank holds, per tag: before build(), what build() will allocate; after,
  /// what the current active set and kept-on-device states take. The stats equal it exactly
  /// after every build and lifecycle call. Before build, `active_at_build` plans
  /// build(init, active_at_build) instead of build(init) (throws StateError after build,
  /// ConfigError for a group that does not exist).
  MemoryPlan plan(const std::optional<std::vector<std::string>>& active_at_build = {}) const;
  /// Allocates every buffer, fills the bit16 weights from `init` and seeds the fp32 masters of
  /// the `active` groups from them (all groups when not given; the others start frozen). On
  /// failure nothing stays allocated and the Engine can be built again.
  void build(const WeightInit& init,
             const std::optional<std::vector<std::string>>& active = std::nullopt);

  // ---- group lifecycle (between steps; every rank makes the same calls) ----
  /// Frozen -> active: gradient partition, fp32 master (seeded from the bit16 weights, or the
  /// kept state restored exactly), optimizer state (zero, or restored) and step count (0, or
  /// restored). Throws StateError if it is active; on any failure nothing changed.
  void activate(const std::string& group);
  /// Active -> frozen. Throws StateError if it is frozen or has gradients pending in a bucket;
  /// PinnedMemory naming the Pins if any of its buffers is pinned (nothing changed), unless
  /// `pins` is allow_pinned: then it proceeds and returns the bytes the Pins still hold.
  std::size_t deactivate(const std::string& group, DeactivatePolicy policy,
                         ReleasePolicy pins = ReleasePolicy::fail_if_pinned);
  /// Makes exactly `groups` active: deactivates the others (under `policy`), then activates
  /// the new ones, handing blocks given up to incoming groups of the same size and tag. Names
  /// are checked before anything changes; each deactivation and activation is all or nothing,
  /// but a failure part-way (say, out of memory activating the second group) leaves the groups
  /// handled so far in their new state, and the exception says which call failed.
  SwitchReport set_active(const std::vector<std::string>& groups, DeactivatePolicy policy);
  /// Re-forms groups: moves each named param into the named group (new groups are created,
  /// emptied ones disappear). Every group that changes must be frozen with no kept state. New
  /// flat buffers are built and filled on the device, never through the host; the moved
  /// params' weight Views are rebound (old ones raise StaleView naming the re-form) and the old
  /// buffers are freed. Throws StateError or ConfigError before changing anything.
  void reform(const std::vector<std::pair<std::string, std::string>>& moves);
  bool is_active(const std::string& group) const;
  std::vector<std::string> active_groups() const;

  // ---- training ----
  /// The param's bit16 weights (registered as "<name>: weight view").
  View weight(const std::string& name) const;
  /// Where to add this micro-batch's gradient of `name` (bit16, pre-scaled by loss_scale()).
  /// Stage 1: a slot of the group's full gradient buffer. Stage 2: a slot in a reduce bucket,
  /// valid until the bucket is reduced (later Views of it throw StaleView).
  View grad_slot(const std::string& name);
  /// Signals that the gradient in the slot is complete for this micro-batch.
  void grad_ready(const std::string& name);
  /// Reduces any bucket still pending (stage 2). step() calls it; call it earlier to end a
  /// micro-batch's backward explicitly.
  void finish_backward();
  /// Reduce, unscale, check for overflow, clip, update, all-gather, zero the gradients.
  StepResult step();
  /// Drops the gradients accumulated so far (and any pending bucket) without stepping.
  void zero_grad();
  double loss_scale() const;
  void set_lr(double lr);
  double lr() const { return config_.optimizer.lr; }

  // ---- inspection ----
  const EngineConfig& config() const { return config_; }
  const std::vector<ParamInfo>& params() const;
  std::vector<std::string> groups() const;
  std::int64_t group_step(const std::string& group) const;
  const FlatLayout& layout(const std::string& group) const;
  std::vector<MasterPiece> master_pieces(const std::string& name) const;
  /// This rank's fp32 master shard of an active group (registered as "group G master shard").
  /// Throws StateError for a frozen group.
  View master(const std::string& group) const;
  /// The param's bit16 weights, copied to the host as floats.
  std::vector<float> read_weight(const std::string& name) const;
  // ---- checkpoints (engine/checkpoint.h builds the file format on these) ----
  /// This rank's training state: every group's master and optimizer state (active, or kept
  /// under keep_host / keep_device), step counts, loss scaler, lr; the bit16 weights too when
  /// `with_weights`. Throws StateError with gradients pending in a reduce bucket.
  TrainingState training_state(bool with_weights) const;
  /// Replaces this rank's training state with `state` (groups become active, kept or frozen as
  /// it says; weights, masters, optimizer states, steps, scaler and lr are overwritten; pending
  /// gradients are dropped). Every size, name and value is checked and every new buffer
  /// allocated before anything changes: on any error (ConfigError for a state that does not fit
  /// the declarations, StateError with gradients pending, PinnedMemory naming the Pins on a
  /// buffer it would free, OutOfMemory) the engine is left as it was. Not a collective.
  void restore_training_state(const TrainingState& state);

  /// Sum of `value` over ranks (a collective: every rank must call it).
  double sum_across_ranks(double value);
  MemorySpace& memory() const { return space_; }
  MemoryStats memory_stats() const { return space_.stats(); }
  std::string memory_report() const { return space_.report_text(); }
  int rank() const { return comm_.rank(); }
  int world_size() const { return comm_.world_size(); }

 private:
  void reduce_scatter_grads(Group& g);
  // Allocates a group's active state into `g` (all or nothing), seeded or restored.
  void allocate_active_state(Group& g);
  // Drops the keep_host memory space once no group is kept on the host, so that what its
  // allocator keeps for reuse (pinned blocks, on CUDA) goes back to the system with it.
  void release_idle_host() noexcept;
  // A buffer for an activating group: a recycled block of the same size and tag, or a new one.
  Buffer take(std::size_t bytes, Tag tag, std::string label);
  // Gives a buffer up: into the recycle list during set_active, else back to the allocator.
  std::size_t give_up(Buffer& b, const std::string& event, ReleasePolicy pins);
  void make_grad_views(Group& g);
  Group& group_named(const std::string& group, const char* caller);
  struct Impl;
  EngineConfig config_;
  Communicator& comm_;
  MemorySpace& space_;
  const OptimizerKernels& kernels_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardswap
