// Frozen groups' bit16 weights in host memory (EngineConfig::frozen_weight_placement = host),
// brought to the device for use: two device windows, each as large as the largest group.
//
// fetch(g) puts group g's weights in a window: the one that holds them already (a fill ahead,
// or a use not yet overwritten), else the window not in use that was used longest ago, filled
// from the host on the backend's copy queue (DeviceOps::queue_copy: after the work the model's
// stream has queued so far, so a window the model read a moment ago is not overwritten under
// it). The model's stream waits for the fill, the host does not. Then the other window, when it
// is not in use, is filled ahead with the next frozen group on the host in the direction the
// fetches go (ascending indices: forward; descending: backward; at the last group, the other
// way, as backward turns back), so that its copy overlaps the model's use of this one. release(g) ends the use: the window keeps the weights as a cache
// until it is filled again. A window's Views go stale when it is released or refilled.
//
// The windows hold copies: the host home is the weights' one place while a group is frozen. So
// anything that writes a home (deactivate, restore, re-form) must forget the group's windows
// first; the Engine refuses those calls while a window of the group is in use.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/group.h"
#include "optimizer/optimizer.h"

namespace shardswap {

class WeightWindows {
 public:
  /// Two windows of `bytes` each (tag param16) from `space`, the device.
  WeightWindows(MemorySpace& space, const DeviceOps& ops, std::size_t bytes);
  /// Waits for the fills in flight: they read the host homes.
  ~WeightWindows();
  WeightWindows(const WeightWindows&) = delete;
  WeightWindows& operator=(const WeightWindows&) = delete;

  std::size_t bytes() const { return bytes_; }
  /// Window 0 as device scratch for build's broadcast of the homes, before any fetch.
  const Buffer& scratch() const { return windows_[0].buffer; }
  /// Group g (frozen, its weights in g.param16 on the host) in a window, in use until release;
  /// `groups` is every group, for the fill ahead (those frozen with their weights on the host are
  /// candidates). Throws StateError naming the groups in use when both windows are.
  void fetch(const Group& g, const std::vector<Group>& groups);
  /// Ends g's use of its window; StateError unless g is in use.
  void release(const Group& g);
  /// The window holding g's weights (flat, as g.param16) while g is in use; null otherwise.
  const Buffer* window_of(const Group& g) const;
  /// Whether a window holds g's weights in use.
  bool in_use(const Group& g) const { return window_of(g) != nullptr; }
  /// The groups in use, for error messages ("'layers.3', 'layers.4'"); empty if none.
  std::string in_use_names() const;
  /// Drops every window's copy of g (in use or not: the caller checked), waiting for fills.
  void forget(const Group& g, const std::string& event);
  /// Drops every copy (the groups were re-formed or restored).
  void forget_all(const std::string& event);

 private:
  struct Window {
    Buffer buffer;
    const Group* group = nullptr;  // whose weights it holds; null: none
    std::string name;              // that group's name (the Group may move in a re-form)
    bool used = false;             // between fetch and release
    std::uint64_t fill_mark = 0;   // the copy queue's mark of its fill
    std::int64_t last_use = 0;
  };
  void fill(Window& w, const Group& g);
  void drop(Window& w, const std::string& event);

  MemorySpace& space_;
  const DeviceOps& ops_;
  std::size_t bytes_;
  Window windows_[2];
  std::int64_t uses_ = 0;
  std::int64_t last_index_ = -1;  // the last fetched group's index: the fetches' direction
};

}  // namespace shardswap
