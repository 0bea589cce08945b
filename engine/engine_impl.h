// The Engine's private state, shared by engine.cpp (declarations, build, step) and
// lifecycle.cpp (activate, deactivate, switches, checkpoints). Not part of the public API.
#pragma once

#include <fmt/format.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/gradient_reducer.h"
#include "engine/group.h"
#include "engine/weight_windows.h"
#include "shardswap/loss_scaler.h"
#include "optimizer/host_updater.h"
#include "optimizer/optimizer.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"

namespace shardswap {

struct Engine::Impl {
  Impl(EngineConfig config, Communicator& comm, MemorySpace& space, const Backend& backend);

  EngineConfig config;
  Communicator& comm;
  MemorySpace& space;
  Backend backend;
  const DeviceOps& ops;  // chosen from the backend

  std::vector<Param> params;
  std::vector<ParamInfo> infos;  // the declarations, as params() returns them
  std::unordered_map<std::string, std::size_t> by_name;
  std::vector<std::string> group_names;  // in order of first declaration
  // The groups add_param has seen, for lookups in time independent of their number (the
  // declarations only: reform, after build, keeps group_names alone).
  std::unordered_set<std::string> declared_groups;
  std::map<std::string, double> weight_decay;
  /// set_param_weight_decay's overrides, by param name: they win over their group's.
  std::map<std::string, double> param_weight_decay;
  std::vector<Group> groups;  // after build
  std::unique_ptr<GradientReducer> reducer;  // after build
  Buffer scalars;             // the step's global scalars, in backend memory for the collectives
  std::int64_t capacity = 0;  // bucket (and compressed chunk) capacity in elements
  LossScaler scaler;
  // Host memory: keep_host states, made on first use and dropped when idle; with the state
  // placed on the host (config.optimizer_placement), every master and optimizer state and the
  // two staging buffers below, for the engine's life.
  std::unique_ptr<MemorySpace> host;
  // ---- state on the host ----
  bool streamed() const { return config.offload_update == OffloadUpdate::streamed; }
  bool grads_on_host() const { return config.gradient_placement == Placement::host; }
  // ---- frozen weights on the host (engine/lifecycle.cpp) ----
  bool weights_on_host() const { return config.frozen_weight_placement == Placement::host; }
  std::unique_ptr<WeightWindows> weight_windows;  // after build, with weights on the host
  /// Where g.param16 lives: the host for a frozen group with weights on the host, else the device.
  const MemorySpace& weight_space(const Group& g) const {
    return weights_on_host() && !g.active ? *host : space;
  }
  /// Registers each of g's params' "<name>: weight view" on g.param16.
  void register_weight_views(const Group& g) { register_weight_views(g, params, config.dtype); }
  /// The same for the params `ps` (a re-form's, before it commits them) with weights of dtype.
  static void register_weight_views(const Group& g, std::vector<Param>& ps, DType dtype);
  /// Activation, weights on the host: a device buffer (take()) filled from the home, which moves
  /// to g.home. Undone by weights_down.
  void weights_up(Group& g);
  /// Deactivation, weights on the host: the device weights written to the home, which becomes
  /// g.param16 again; the device buffer given up (give_up()). Nothing fails but the Pins' check,
  /// made by the caller.
  std::size_t weights_down(Group& g, const std::string& event, ReleasePolicy pins);
  // streamed: the device slots of two chunks (master, and the state's slots one after another)
  Buffer slot_master, slot_state;
  // gradients on the host: two chunks of them on the device, for the norm and (streamed) the
  // update
  Buffer slot_grad;
  // cpu: host staging
  Buffer staging_grad;   // one chunk of a gradient partition, brought down for the update
  Buffer staging_param;  // one chunk of updated bit16 weights, on their way up
  std::int64_t chunk = 0;  // elements per chunk: the staging buffers' size, fixed at build()
  std::unique_ptr<HostUpdater> updater;  // the update's threads
  // During set_active only: blocks given up by outgoing groups, handed to incoming groups of
  // the same size and tag instead of a cudaFree + cudaMalloc pair; the rest is released when
  // set_active returns, so nothing is cached between calls.
  std::vector<Buffer> recycled;
  bool recycling = false;
  std::int64_t bytes_given_up = 0;  // by the current set_active
  std::int64_t bytes_taken = 0;
  bool built = false;

  Param& param(const std::string& name, const char* caller) {
    auto it = by_name.find(name);
    if (it == by_name.end())
      throw ConfigError(fmt::format("Engine::{}: no param named '{}'", caller, name));
    return params[it->second];
  }
  std::size_t index_of(const Param& p) const { return static_cast<std::size_t>(&p - params.data()); }
  /// StateError naming `caller` unless built; then settle_update(): every public call that
  /// reads or writes the engine's buffers starts here, but weight, fetch_weights and
  /// release_weights (require_built_only), which wait for their own group's update alone, and
  /// sum_across_ranks, which touches no buffer an update does.
  void require_built(const char* caller) const {
    require_built_only(caller);
    settle_update();
  }
  void require_built_only(const char* caller) const {
    if (!built) throw StateError(fmt::format("Engine::{}: call build() first", caller));
  }

  // ---- the update step() left running beside the caller's work (config.overlap_update) ----
  /// Side marks (DeviceOps::mark_side) of the last step's update: per group, by index in
  /// `groups`, its update and all-gather (0: none pending); and the whole update with the
  /// gradients' clearing (0: none pending).
  mutable std::vector<std::uint64_t> update_marks;
  mutable std::uint64_t update_end = 0;
  /// The thread's later work goes on its side stream (DeviceOps::begin_side).
  void begin_side_update();
  /// Marks the whole update (update_end) and puts the thread's work back on its stream, also
  /// when the step failed part-way.
  void end_side_update();
  /// Orders the calling thread's stream after group g's pending update, if any.
  void await_update(const Group& g) const;
  /// Orders it after the whole pending update, if any; none is pending after.
  void settle_update() const;
  // ---- what every rank must hold alike (RankAgreement; no-ops at world size 1) ----
  /// One hash per declaration: the EngineConfig's layout-relevant fields, then each param
  /// (name, shape, group) in declaration order; and the words that describe entry i.
  std::vector<std::uint64_t> declaration_entries() const;
  /// Sets declarations_hash from declaration_entries(): after build() and every reform().
  void hash_declarations();
  std::uint64_t declarations_hash = 0;
  std::string describe_declaration(std::size_t i) const;
  /// "group 'G' elements [B, E) ('p', 'q')": the reducer's i-th reduction since the last step.
  std::string describe_hand_over(std::size_t i) const;
  /// Collective through `scratch` (RankAgreement::kScratchDoubles doubles): throws CommError
  /// "Engine::<caller>: the ranks declared different params: ... ; <outcome>" on every rank,
  /// naming rank 0's and the first differing rank's declaration, unless all are the same.
  void require_same_declarations(void* scratch, const char* caller, const char* outcome);
  /// Collective, in step() before the reduced gradients are used: throws CommError on every
  /// rank (after dropping the gradients) if the ranks' declarations or the reductions their
  /// reducers issued since the last step differ, naming the first reduction that does on rank 0
  /// and on the first rank that differs.
  void require_same_hand_overs();
  /// grad_slot(name), with errors naming `caller` (add_grad calls it too).
  View grad_slot(const std::string& name, const char* caller);
  /// The built group named `group`; ConfigError naming `caller` if there is none.
  Group& group_named(const std::string& group, const char* caller);
  const Group& group_named(const std::string& group, const char* caller) const {
    return const_cast<Impl*>(this)->group_named(group, caller);
  }
  /// Throws StateError if `g` has gradients pending: "Engine::<caller>: group 'G' has <what is
  /// pending>; call step() or zero_grad() first; nothing was changed".
  void require_no_pending(const Group& g, const char* caller) const;
  /// The same for every group, with the message starting "<who>: " (the call the user made:
  /// "Engine::reform", "save_checkpoint").
  void require_none_pending(std::string_view who) const;
  /// Lists the Pins on `buffers` ("'pin' on 'buffer'", comma separated); empty if none.
  static std::string pins_on(const std::vector<const Buffer*>& buffers);

  // ---- a group's state: allocated, labelled and released here only ----
  /// A buffer for an activating group: a recycled block of the same size and tag, or a new one.
  Buffer take(std::size_t bytes, Tag tag, std::string label);
  /// Gives a buffer up: into the recycle list during set_active, else back to the allocator.
  std::size_t give_up(Buffer& b, const std::string& event, ReleasePolicy pins);
  /// Allocates a group's active state into `g` (all or nothing), seeded or restored.
  void allocate_active_state(Group& g);
  /// Drops the keep_host memory space once no group is kept on the host, so that what its
  /// allocator keeps for reuse (pinned blocks, on CUDA) goes back to the system with it.
  void release_idle_host() noexcept;
  MemorySpace& host_space();
  /// What the host space allocates from: pinned (config.pin_host_memory) or pageable memory.
  std::unique_ptr<Allocator> host_allocator() const;
  bool state_on_host() const { return config.optimizer_placement == Placement::host; }
  /// Where a group's master and state live, `active` or kept under `kept`; null: it holds none.
  MemorySpace* state_space(bool active, std::optional<DeactivatePolicy> kept);
  const MemorySpace* state_space(const Group& g) const;
  /// A buffer for master or state in `where`: take() on the device, a fresh block on the host.
  Buffer take_state(MemorySpace& where, std::size_t bytes, Tag tag, std::string label);
  /// Gives a master or state buffer up: give_up() on the device, released on the host.
  std::size_t give_up_state(Buffer& b, const std::string& event, ReleasePolicy pins);
  /// A group's gradient buffer, not zeroed: take() on the device; with gradients on the host a
  /// fresh host block (the reducer reads it as zeros until a window writes it).
  Buffer take_grad(const Group& g);
  /// Zeroes a device gradient buffer; host ones are zero to the reducer once attached.
  void zero_grad_buffer(Buffer& grad);
  /// Gives a gradient buffer up: give_up() on the device, released on the host.
  std::size_t give_up_grad(Buffer& b, const std::string& event, ReleasePolicy pins);
  /// The slots (streamed) or staging buffers (cpu) of the update of state on the host, for
  /// `planned` groups: allocated by build(), kept for the engine's life.
  void allocate_staging(const std::vector<Group>& planned);
  /// Seeds a host master from the group's bit16 shard, a chunk at a time through a slot or the
  /// staging buffer.
  void seed_master_on_host(const Group& g, Buffer& master);
  /// The update of `count` elements from shard element `at`, with master and state on the host,
  /// a chunk at a time: streamed through the device slots, or (cpu) on the CPU, the gradient
  /// coming down and the bit16 result going up.
  void update_on_host(Group& g, const StepArgs& args, std::int64_t at, std::int64_t count);
  /// streamed: queues the piece; flush_host_updates() streams every queued piece in one
  /// pipeline (chunks of one group's shard travel while another's are updated).
  void update_streamed(Group& g, const StepArgs& args, std::int64_t at, std::int64_t count);
  void flush_host_updates();
  /// step()'s update of active group g, span by span of its weight decay: queued on the device,
  /// or on the host (update_on_host) with the state there.
  void update_group(Group& g, StepArgs args);
  /// The sum of (scale * gradient)^2 over the active groups' partitions: each partition in
  /// pieces of offload_chunk_elements summed in order, the groups' sums in group order. The
  /// same pieces wherever the gradients live, so the norm has the same bits; on the device every
  /// piece's reduction is queued before one wait, gradients on the host go up a piece at a time
  /// into a slot.
  double gradient_squares(double scale);
  std::vector<StreamedPiece> streaming;  // the step's queued pieces
  void update_on_cpu(Group& g, const StepArgs& args, std::int64_t at, std::int64_t count);
  /// Host buffers for a group's state kept under keep_host (labelled "... (kept on host)").
  KeptState kept_on_host(MemorySpace& host, const Group& g, std::int64_t step) const;
  /// "group G master", "group G AdamW state"; "group G master (kept on host)" and "group G
  /// state (kept on host)" for state a frozen group keeps on the host.
  std::string master_label(const Group& g, bool kept_on_host = false) const;
  std::string state_label(const Group& g, bool kept_on_host = false) const;

  // ---- restore_training_state's steps (engine/lifecycle.cpp) ----
  /// A group's part of a restore: new buffers (invalid where one is reused or not needed), what
  /// is reused, and the buffers given back at commit.
  struct GroupRestore {
    Buffer grad, master, state;  // master and state in `to`, when not reused
    /// Weights on the host: the device weights of a group the restore activates (its home's
    /// contents until the restored weights are written).
    Buffer param16;
    MemorySpace* to = nullptr;   // where the restored master and state go; null: none
    bool reuse_grad = false, reuse_state = false;
    std::vector<const Buffer*> freed;
    /// The state's values in the engine's state dtype, when it is not fp32 (rounded here, where a
    /// failure changes nothing); empty: the TrainingState's fp32 values are uploaded as they are.
    std::vector<std::byte> state_values;
    /// MasterStorage::bf16_remainder: the TrainingState's masters split into the low halves (the
    /// master buffer's bytes) and the bf16 weights of the shard (written over the param's).
    std::vector<std::uint16_t> master_low, master_weight;
  };
  struct RestorePlan {
    std::vector<GroupRestore> groups;  // as `groups`
    std::unique_ptr<MemorySpace> new_host;  // the keep_host space, when the restore makes it
  };
  /// Throws ConfigError "<fn>: ..." unless `state` fits this engine; changes nothing.
  void check_restorable(const TrainingState& state, const char* fn) const;
  /// The fp32 master values of shard elements [at, at + count) of group `g`, whose master (its
  /// active one, or the one it keeps) is `master`: as stored, or joined from the low halves and
  /// the bf16 weights (MasterStorage::bf16_remainder).
  std::vector<float> master_values(const Group& g, const Buffer& master, std::int64_t at,
                                   std::int64_t count) const;
  /// Allocates what `state` needs that the groups do not hold already; changes nothing of the
  /// engine (a failure, or dropping the plan, frees what it took).
  RestorePlan plan_restore(const TrainingState& state);
  /// Moves the plan's buffers in, copies `state` into them and gives back what they replace.
  void commit_restore(const TrainingState& state, RestorePlan& plan);
};

/// Points `t` at the master of shard element `at` on in `master` (a group's master buffer): fp32
/// values, or their low halves under MasterStorage::bf16_remainder.
inline void set_master(ShardTensors& t, const OptimizerConfig& optimizer, const Buffer& master,
                       std::size_t at) {
  if (optimizer.master == MasterStorage::bf16_remainder)
    t.master_low = master.as<std::uint16_t>() + at;
  else
    t.master = master.as<float>() + at;
}

/// Elements per chunk of an update with the state on the host: the configured chunk, capped at
/// the largest shard of `groups` (at least 1).
std::int64_t offload_chunk(const EngineConfig& config, const std::vector<Group>& groups);

/// Groups with their layouts and shards (no buffers) for `names`, each holding the params whose
/// info.group is its name; sets each param's group and index_in_group.
std::vector<Group> plan_groups(const EngineConfig& config, const std::vector<std::string>& names,
                               std::vector<Param>& params,
                               const std::map<std::string, double>& weight_decay, int world_size,
                               int rank);

}  // namespace shardswap
