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
//   engine.add_grad("layers.0.fc1.weight", grad);   // or grad_slot + write + grad_ready
//   StepResult r = engine.step();             // reduce, clip, update, all-gather
//
// This header and the ones it includes are the whole public surface: the Engine's state is
// behind a pointer, so nothing internal (layouts, kernels, buckets) shows here.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardswap/backend.h"
#include "shardswap/buffer.h"
#include "shardswap/communicator.h"
#include "shardswap/engine_config.h"
#include "shardswap/loss_scaler.h"
#include "shardswap/stats.h"

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
/// "drop", "keep_host", "keep_device". Throws ConfigError "KEY = \"NAME\": expected ..." otherwise.
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

/// Planned bytes per tag for this rank, computed from the declarations alone: on the device
/// (`bytes`, what memory_stats() measures) and in host memory (`host`, what host_memory_stats()
/// measures: state placed on the host with its staging buffers, state kept under keep_host).
struct MemoryPlan {
  std::array<std::int64_t, kTagCount> bytes{};
  std::array<std::int64_t, kTagCount> host{};
  std::int64_t total() const;
  std::int64_t host_total() const;
  std::int64_t of(Tag t) const { return bytes[static_cast<std::size_t>(t)]; }
  std::int64_t host_of(Tag t) const { return host[static_cast<std::size_t>(t)]; }
};

/// A piece of a param's fp32 master held by this rank.
struct MasterPiece {
  std::int64_t param_offset = 0;
  std::vector<float> values;
};

/// One group's fp32 training state on this rank, for checkpoints: flat over this rank's shard of
/// the group's flat buffer, alignment padding included.
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

class Engine {
 public:
  /// `comm` and `space` must outlive the Engine. Throws ConfigError if the config is invalid, or
  /// if `space` or `comm` works on other memory than `backend` (a CUDA space with the cpu
  /// backend would run host code on device pointers), naming what disagrees.
  Engine(EngineConfig config, Communicator& comm, MemorySpace& space,
         const Backend& backend = cpu_backend());
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- declaration ----
  /// The most elements one param may have (2^58): an element's bytes over every kind of state
  /// (at most 18) stay within an int64, however the layout pads it.
  static constexpr std::int64_t kMaxParamElements = std::int64_t{1} << 58;
  /// Throws ConfigError for an empty or duplicate name, an empty group name, a shape with a
  /// non-positive extent (zero elements) or more than kMaxParamElements elements (checked as the
  /// extents are multiplied, so no product overflows), or a call after build().
  void add_param(std::string name, std::vector<std::int64_t> shape, std::string group);
  /// Overrides the optimizer's weight decay for one group (e.g. norms and biases: 0).
  void set_group_weight_decay(const std::string& group, double weight_decay);
  /// Overrides the weight decay of one param, over its group's (the Hugging Face Trainer's
  /// default leaves biases and norm weights out of decay: 0 for those). Any time; takes effect
  /// at the next step(). The update runs once per stretch of the shard whose params share a
  /// weight decay, with the same arithmetic per element.
  void set_param_weight_decay(const std::string& param, double weight_decay);
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
  /// Active -> frozen. Throws StateError if it is frozen or has gradients pending (see
  /// "Gradients pending" below); PinnedMemory naming the Pins if any of its buffers is pinned
  /// (nothing changed), unless `pins` is allow_pinned: then it proceeds and returns the bytes
  /// the Pins still hold.
  std::size_t deactivate(const std::string& group, DeactivatePolicy policy,
                         ReleasePolicy pins = ReleasePolicy::fail_if_pinned);
  /// Makes exactly `groups` active: deactivates the others (under `policy`), then activates
  /// the new ones, handing blocks given up to incoming groups of the same size and tag. Names
  /// and pending gradients (StateError naming the group) are checked before anything changes;
  /// each deactivation and activation is all or nothing,
  /// but a failure part-way (say, out of memory activating the second group) leaves the groups
  /// handled so far in their new state, and the exception says which call failed.
  SwitchReport set_active(const std::vector<std::string>& groups, DeactivatePolicy policy);
  /// Re-forms groups: moves each named param into the named group (new groups are created,
  /// emptied ones disappear). Every group that changes must be frozen with no kept state. New
  /// flat buffers are built and filled on the device, never through the host; the moved
  /// params' weight Views are rebound (old ones raise StaleView naming the re-form) and the old
  /// buffers are freed. Throws StateError (also while any group has gradients pending: every
  /// group is rebuilt) or ConfigError before changing anything.
  void reform(const std::vector<std::pair<std::string, std::string>>& moves);
  bool is_active(const std::string& group) const;
  std::vector<std::string> active_groups() const;

  // ---- training ----
  //
  // Gradients pending: from the first gradient handed over for a group (grad_slot or add_grad)
  // until step() or zero_grad(), the group's gradients are pending -- in an open reduce bucket,
  // in a reduce issued and not yet settled, or accumulated in its gradient buffer (stage 1, and
  // stage 2 after finish_backward). Meanwhile deactivate, set_active (of that group), reform and
  // restore_training_state throw StateError naming the group and what is pending, and change
  // nothing: no gradient is ever lost or written into freed memory.

  /// The param's bit16 weights (registered as "<name>: weight view"). With
  /// frozen_weight_placement = host, a frozen group's are in host memory: this is then a View
  /// into the device window fetch_weights filled ("<name>: weight view (window)"), stale after
  /// release_weights; StateError naming the group if it is not fetched.
  View weight(const std::string& name) const;
  /// frozen_weight_placement = host: brings frozen group `group`'s weights into one of two device
  /// windows (queued on the backend's copy queue; the calling thread's stream waits for it, the
  /// host does not), then fills the other window ahead with the next frozen group in the
  /// direction the fetches go (up: forward; down: backward) if it is not in use. A no-op for an
  /// active group and for weights on the device. StateError if the group is fetched already or
  /// both windows are in use (naming their groups).
  void fetch_weights(const std::string& group) const;
  /// Ends fetch_weights' use: the window's Views go stale; it keeps the weights until it is
  /// refilled, so a fetch right after costs no copy. A no-op where fetch_weights is one;
  /// StateError for a group not fetched.
  void release_weights(const std::string& group) const;
  /// Where to add this micro-batch's gradient of `name`, in place: config().grad_type()
  /// elements, pre-scaled by loss_scale(). Add into it, never overwrite: it holds what earlier
  /// grad_slot calls of this step added (accumulation), and in a stage-2 bucket whatever else
  /// reaches the same window. Stage 1: a slot of the group's full gradient buffer. Stage 2: a
  /// slot in a reduce bucket, valid until the bucket is reduced (later uses throw StaleView).
  /// Throws StateError for a param of a frozen group.
  View grad_slot(const std::string& name);
  /// Signals that the gradient in the slot is complete for this micro-batch.
  void grad_ready(const std::string& name);
  /// grad_slot + add + grad_ready in one call, converting to the slot's type: `grad` holds the
  /// param's numel values in host memory, pre-scaled by loss_scale() as for grad_slot. Repeated
  /// calls add up. Throws ConfigError naming the param if the count is not its numel. On a CUDA
  /// backend the values travel through a staging buffer of at most 1 MiB (tag other).
  void add_grad(const std::string& name, std::span<const float> grad);
  /// The same from memory of the engine's backend (a device pointer on CUDA), of any of f32,
  /// bf16 or fp16: what a backward pass computing on the device hands over.
  void add_grad(const std::string& name, const void* grad, DType dtype, std::size_t count);
  /// Reduces any bucket still pending (stage 2). step() calls it; call it earlier to end a
  /// micro-batch's backward explicitly.
  void finish_backward();
  /// Reduce, unscale, check for overflow, clip, update, all-gather, zero the gradients.
  StepResult step();
  /// Drops the gradients accumulated so far (and any pending bucket) without stepping.
  void zero_grad();
  double loss_scale() const;
  void set_lr(double lr);
  double lr() const;

  // ---- inspection ----
  const EngineConfig& config() const;
  const Backend& backend() const;
  const std::vector<ParamInfo>& params() const;
  std::vector<std::string> groups() const;
  std::int64_t group_step(const std::string& group) const;
  std::vector<MasterPiece> master_pieces(const std::string& name) const;
  /// This rank's fp32 master shard of an active group (registered as "group G master shard"), in
  /// host memory when config().optimizer_placement is host. Throws StateError for a frozen group,
  /// and when the master is kept as low halves (MasterStorage::bf16_remainder: master_pieces()
  /// joins them).
  View master(const std::string& group) const;
  /// The param's bit16 weights, copied to the host as floats.
  std::vector<float> read_weight(const std::string& name) const;
  // ---- checkpoints (shardswap/checkpoint.h builds the file format on these) ----
  /// This rank's training state: every group's master and optimizer state (active, or kept
  /// under keep_host / keep_device), step counts, loss scaler, lr; the bit16 weights too when
  /// `with_weights`. Throws StateError while any group has gradients pending.
  TrainingState training_state(bool with_weights) const;
  /// Replaces this rank's training state with `state` (groups become active, kept or frozen as
  /// it says; weights, masters, optimizer states, steps, scaler and lr are overwritten). Every
  /// size, name and value is checked and every new buffer
  /// allocated before anything changes: on any error (ConfigError for a state that does not fit
  /// the declarations, StateError with gradients pending, PinnedMemory naming the Pins on a
  /// buffer it would free, OutOfMemory) the engine is left as it was. Not a collective.
  void restore_training_state(const TrainingState& state);

  /// Sum of `value` over ranks (a collective: every rank must call it).
  double sum_across_ranks(double value);
  MemorySpace& memory() const;
  MemoryStats memory_stats() const;
  /// The engine's host memory (EngineConfig::optimizer_placement = host, keep_host): all zeros
  /// while it holds none. Its requested bytes equal plan().host after build and every lifecycle
  /// call.
  MemoryStats host_memory_stats() const;
  /// Starts the host memory's peaks over from what it holds now (MemorySpace::reset_peaks).
  void reset_host_peaks();
  /// The device memory's report, then, when the engine holds host memory, that memory's
  /// ("rank R memory (pinned host):" on CUDA).
  std::string memory_report() const;
  int rank() const;
  int world_size() const;

 private:
  friend struct EngineInternals;  // engine/engine_internals.h: layouts, for checkpoints and tests
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// One param as Engine::add_param takes it: a model's declarations listed without an Engine.
struct ParamDeclaration {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string group;
};

/// What Engine::plan(active_at_build) returns before build() for an Engine of `config` on `rank`
/// of `world_size` whose params are `params`, added in that order: computed by the same code,
/// without an Engine, a Communicator or a MemorySpace, and allocating nothing (a tool plans every
/// rank of a run this way). Group weight decays change no byte and are not asked for. Throws
/// ConfigError as the Engine's constructor, add_param and plan would, and for a world_size below
/// 1 or a rank outside [0, world_size).
MemoryPlan plan_memory(const EngineConfig& config, int world_size, int rank,
                       const std::vector<ParamDeclaration>& params,
                       const std::optional<std::vector<std::string>>& active_at_build = {});

}  // namespace shardswap
