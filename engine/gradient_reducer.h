// The one gradient path of an Engine. A GradientReducer owns everything about gradients between
// two steps: the slots handed out, their readiness, reductions issued and not yet settled, and
// the compression buffer. Stage 1 (FullGradientReducer: full gradients kept until the step) and
// stage 2 (BucketReducer: reduced in buckets into the owners' partitions as they come) are its
// two implementations; the Engine never asks which stage it runs.
//
// It also says what is pending for a group (pending()), from the first slot handed out for it
// until clear(): the lifecycle calls refuse to free a group's gradient buffer while anything is,
// so a deferred reduce can never write into freed memory and no gradient is dropped unnoticed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/group.h"
#include "optimizer/optimizer.h"
#include "shardswap/buffer.h"
#include "shardswap/communicator.h"
#include "shardswap/engine_config.h"
#include "shardswap/error.h"

namespace shardswap {

/// One reduction a reducer issued: elements [begin, end) of group `group`'s flat space (stage 2:
/// a bucket's window; stage 1: the whole group). Every rank must issue the same ones in the same
/// order, or one param's gradient is added to another's.
struct HandOver {
  std::size_t group = 0;  // Group::index
  std::int64_t begin = 0, end = 0;
};

class GradientReducer {
 public:
  virtual ~GradientReducer() = default;

  /// The reductions issued since the last clear() or forget_groups(), in order, for the Engine
  /// to compare across ranks before it uses their results.
  const std::vector<HandOver>& hand_overs() const { return hand_overs_; }

  /// Whether the Engine allocates the groups' gradient buffers in host memory (the windows on
  /// the device are the reducer's own).
  virtual bool grads_on_host() const { return false; }
  /// Elements of an active group's gradient buffer (stage 1: the full flat buffer; stage 2:
  /// this rank's partition), and the label it is allocated under.
  virtual std::int64_t grad_numel(const Group& g) const = 0;
  virtual std::string grad_label(const Group& g) const = 0;
  /// `g` became active (its gradient buffer allocated and zeroed) or is about to be frozen.
  virtual void attach(Group& g, const std::vector<Param>& params) = 0;
  virtual void detach(Group& g) = 0;

  /// The slot for param `index` (of active group `g`) to add this micro-batch's gradient into.
  virtual View slot(Group& g, std::size_t index, const Param& p) = 0;
  /// Records that the slot's gradient is complete. False: no slot of it is handed out.
  virtual bool mark_ready(std::size_t index) = 0;
  /// Ends a backward: every slot handed out must be ready (Error naming the others); stage 2
  /// reduces what is still open and settles every reduce.
  virtual void finish() = 0;
  /// Before the update: stage 1 reduce-scatters every active group's gradients.
  virtual void reduce_for_step(std::vector<Group>& groups) = 0;
  /// This rank's partition of the group's reduced gradients (after reduce_for_step).
  virtual std::byte* partition(const Group& g) const = 0;
  /// Drops every gradient (reduces in flight are settled first, so nothing lands later) and
  /// zeroes the active groups' buffers: after a step, or for zero_grad().
  virtual void clear(std::vector<Group>& groups) = 0;
  /// Where `g`'s pending gradients are, in words ("in the open reduce bucket: 'x'"); "" when
  /// nothing is pending.
  virtual std::string pending(const Group& g) const = 0;
  /// Forgets every group (after a re-form rebuilt them; nothing may be pending).
  virtual void forget_groups() = 0;

 protected:
  std::vector<HandOver> hand_overs_;  // appended as reductions are issued; cleared with them
};

/// Whether gradients accumulate in place in each group's full buffer (stage 1's reducer) rather
/// than go through stage 2's reduce buckets: stage 1, or any stage at world size 1, where a
/// group's partition is the whole group and a bucket would only copy every gradient into it
/// (zero the bucket, write, reduce to itself, add into the partition: about 16 bytes moved a
/// bf16 gradient element a micro-step instead of the GEMM's 4, 15 GB of gradients at
/// Qwen2.5-7B) and hold two buckets of memory.
inline bool accumulates_in_place(const EngineConfig& config, int world_size) {
  return config.stage == 1 || world_size == 1;
}

// The readiness bookkeeping of the reducers that keep one slot per param (stage 1's and the host
// one), over a vector indexed by param whose elements have `name`, `out` and `ready`.
namespace slot_readiness {

/// "'a', 'b'": the slots handed out and not ready whose param index `pick` accepts.
template <class Slots, class Pick>
std::string unready(const Slots& slots, Pick pick) {
  std::string names;
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (slots[i].out && !slots[i].ready && pick(i))
      names += (names.empty() ? "'" : ", '") + slots[i].name + "'";
  return names;
}

/// GradientReducer::mark_ready.
template <class Slots>
bool mark_ready(Slots& slots, std::size_t index) {
  if (!slots[index].out) return false;
  slots[index].ready = true;
  return true;
}

/// The Error of GradientReducer::finish, naming every slot handed out and not ready.
template <class Slots>
void require_ready(const Slots& slots) {
  const std::string missing = unready(slots, [](std::size_t) { return true; });
  if (!missing.empty())
    throw Error("Engine: grad_slot was handed out but grad_ready never called for " + missing);
}

/// GradientReducer::pending.
template <class Slots>
std::string pending(const Group& g, const Slots& slots) {
  if (!g.holds_grads) return "";
  std::string open;
  for (auto i : g.params)
    if (slots[i].out && !slots[i].ready) open += (open.empty() ? "'" : ", '") + slots[i].name + "'";
  if (!open.empty()) return "grad_slot handed out without grad_ready: " + open;
  return "accumulated since the last step";
}

}  // namespace slot_readiness

/// ConfigError naming shardswap.gradient_placement when it is host at a world size above 1.
void require_gradient_placement(const EngineConfig& config, int world_size);

/// The host reducer under gradient_placement = host (ConfigError naming the key at a world size
/// above 1); else stage 1's reducer where accumulates_in_place, else stage 2's. `capacity` is
/// the bucket (stage 2), window (host) or compressed chunk (stage 1) size in elements; buffers
/// are allocated from `space` (tags grad and comm).
std::unique_ptr<GradientReducer> make_gradient_reducer(const EngineConfig& config,
                                                       Communicator& comm, MemorySpace& space,
                                                       const DeviceOps& ops,
                                                       std::int64_t capacity,
                                                       std::size_t param_count);

}  // namespace shardswap
