// Gradients in host memory (EngineConfig::gradient_placement = host), for a model whose gradient
// buffers do not fit on the device beside its weights: each active group's full gradient buffer
// lives on the host, and the device holds two windows of it.
//
// A grad slot is a View into the window holding the param. A window covers a range of one
// group's flat space and is filled, when it opens, with what the host holds for that range (the
// sum of the micro-batches so far; zeros before the first), so the model accumulates into it in
// place exactly as it would into a device buffer: the same sums in the same order, the same bits.
// When a slot falls outside both windows, the new param's window opens in the closed one if
// there is one (else one goes down first), extended in the direction the slots come in
// (backward's descending offsets, or ascending); then the other, once none of its slots is open,
// goes down to the host (its Views go stale) while the model fills the new one. The copies run
// on the backend's copy queue (DeviceOps::queue_copy), in order; the model's stream waits only
// for a window's fill before writing into it. Two windows also let one slot stay open across the
// others, as a tied embedding's is across backward. When a window hands out its first slot,
// the other goes down and is filled ahead with the next range in the fill direction, when the
// host holds gradient for all of it (from the second micro-batch on): in backward the next
// window's fill overlaps the current one's use.
//
// The host buffers are not zeroed when gradients are dropped: the reducer remembers which ranges
// hold gradient since the last clear() and fills the rest with zeros where it is read (in a
// window as it opens, or on the host before the step reads the partition). A step that touched
// every param (the usual case) zeroes nothing on the host.
//
// World size 1 only: the step reads the host buffer as this rank's partition. Across ranks the
// reduction would need the buffer back on a device (stage 1) or the windows reduced into host
// partitions (stage 2); make_gradient_reducer refuses it, naming the key.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/gradient_reducer.h"

namespace shardswap {

class HostGradientReducer final : public GradientReducer {
 public:
  /// Allocates the two windows of `window` elements of `grad_dtype` (tag grad) from `space`,
  /// the device; the group buffers (grad_numel elements each) are allocated by the Engine in
  /// host memory. `window` must hold the largest param.
  HostGradientReducer(MemorySpace& space, const DeviceOps& ops, DType grad_dtype,
                      std::int64_t window, std::size_t param_count);
  /// Waits for the copies in flight: they name the windows and the host buffers.
  ~HostGradientReducer() override;
  HostGradientReducer(const HostGradientReducer&) = delete;
  HostGradientReducer& operator=(const HostGradientReducer&) = delete;

  bool grads_on_host() const override { return true; }
  std::int64_t grad_numel(const Group& g) const override { return g.layout.total_numel(); }
  std::string grad_label(const Group& g) const override;
  void attach(Group& g, const std::vector<Param>& params) override;
  void detach(Group& g) override;
  View slot(Group& g, std::size_t index, const Param& p) override;
  bool mark_ready(std::size_t index) override;
  /// Every slot handed out must be ready (Error naming the others); both windows go down.
  void finish() override;
  /// Zeroes, on the host, what no window wrote since the last clear().
  void reduce_for_step(std::vector<Group>& groups) override;
  std::byte* partition(const Group& g) const override;
  void clear(std::vector<Group>& groups) override;
  std::string pending(const Group& g) const override;
  void forget_groups() override;

 private:
  using Range = std::pair<std::int64_t, std::int64_t>;  // [begin, end) flat elements
  struct Window {
    Buffer buffer;
    Group* group = nullptr;  // null: closed
    std::int64_t begin = 0, end = 0;
    std::int64_t used = 0;  // when it last handed a slot out (for choosing which one to close)
    std::uint64_t free_mark = 0;  // the copy queue's mark after which its buffer is free
    std::uint64_t fill_mark = 0;  // the mark of its fill from the host
    bool awaited = true;          // the model's stream waits for the fill (at its first slot)
    bool touched = false;         // a slot was handed out since it opened
    bool descending = false;      // the fill direction it was opened in
  };
  struct Slot {
    std::string name;
    std::int64_t begin = 0, end = 0;  // the param's flat range in its group
    int window = -1;                  // where it was last handed out
    bool out = false, ready = false;
  };
  /// Names the slots of window `w` handed out and not ready ("'a', 'b'"); "" if none.
  std::string unready(int w) const;
  /// Queues window `w`'s trip back to the host and closes it; Error naming its unready slots
  /// first, with nothing changed.
  void close(int w);
  /// Closes window `w` without writing it back (the gradients are being dropped).
  void discard(int w, const std::string& event);
  /// Opens window `w` on group `g` around [begin, end), filled from the host; the model's stream
  /// waits for the fill at the window's first slot.
  void open(int w, Group& g, std::int64_t begin, std::int64_t end, bool descending);
  /// Window `w` has just handed out its first slot: the other, once none of its slots is open,
  /// goes down, and is filled ahead with the range after `w`'s in its fill direction when the
  /// host holds gradient for all of it (from the second micro-batch on).
  void rotate(int w);
  /// Whether [begin, end) of group `index` holds gradient on the host, all of it.
  bool all_written(std::size_t index, std::int64_t begin, std::int64_t end);
  /// Records that [begin, end) of group `index` holds gradient.
  void mark_written(std::size_t index, Range r);
  std::vector<Range>& written(std::size_t index);

  const DeviceOps& ops_;
  DType dtype_;
  std::int64_t capacity_;
  Window windows_[2];
  std::vector<Slot> slots_;
  std::vector<std::vector<Range>> written_;  // by Group::index: sorted, disjoint
  std::vector<Group*> attached_;             // by Group::index: the active groups
  std::int64_t uses_ = 0;
  Group* last_group_ = nullptr;  // the previous slot's group and offset: the fill direction
  std::int64_t last_offset_ = -1;
};

}  // namespace shardswap
