#include "engine/weight_windows.h"

#include <fmt/format.h>

#include "shardswap/error.h"

namespace shardswap {

WeightWindows::WeightWindows(MemorySpace& space, const DeviceOps& ops, std::size_t bytes)
    : space_(space), ops_(ops), bytes_(bytes) {
  for (int i = 0; i < 2; ++i)
    windows_[i].buffer =
        space_.allocate(bytes, Tag::param16, fmt::format("frozen weight window {}", i));
}

WeightWindows::~WeightWindows() {
  try {
    ops_.finish_copies();
  } catch (...) {  // a failed device: nothing is left to wait for
  }
}

const Buffer* WeightWindows::window_of(const Group& g) const {
  for (const auto& w : windows_)
    if (w.group == &g && w.used) return &w.buffer;
  return nullptr;
}

std::string WeightWindows::in_use_names() const {
  std::string out;
  for (const auto& w : windows_)
    if (w.used) out += fmt::format("{}'{}'", out.empty() ? "" : ", ", w.name);
  return out;
}

void WeightWindows::drop(Window& w, const std::string& event) {
  w.buffer.invalidate_views(event);
  w.group = nullptr;
  w.name.clear();
  w.used = false;
}

void WeightWindows::fill(Window& w, const Group& g) {
  drop(w, fmt::format("frozen weight window refilled with group '{}'", g.name));
  w.fill_mark = ops_.queue_copy(w.buffer.data(), g.param16.data(), g.param16.bytes());
  w.group = &g;
  w.name = g.name;
}

void WeightWindows::fetch(const Group& g, const std::vector<Group>& groups) {
  if (g.param16.bytes() > bytes_)  // the Engine sizes the windows for every group
    throw StateError(fmt::format("Engine::fetch_weights: group '{}' holds {} bytes of weights, "
                                 "above the windows' {}",
                                 g.name, g.param16.bytes(), bytes_));
  if (in_use(g))
    throw StateError(fmt::format(
        "Engine::fetch_weights: group '{}' is already fetched; release_weights first", g.name));
  int at = -1;
  for (int i = 0; i < 2; ++i)
    if (windows_[i].group == &g) at = i;
  if (at < 0) {
    for (int i = 0; i < 2; ++i)
      if (!windows_[i].used && (at < 0 || windows_[i].last_use < windows_[at].last_use)) at = i;
    if (at < 0)
      throw StateError(fmt::format(
          "Engine::fetch_weights: group '{}': both weight windows are in use ({}); "
          "release_weights one first",
          g.name, in_use_names()));
    fill(windows_[at], g);
  }
  Window& w = windows_[at];
  ops_.await_copy(w.fill_mark);  // the model's stream reads it once it is there
  w.used = true;
  w.last_use = ++uses_;
  // Ahead: the next frozen group the way the fetches go, into the other window if it is free.
  const bool descending = last_index_ > static_cast<std::int64_t>(g.index);
  last_index_ = static_cast<std::int64_t>(g.index);
  Window& other = windows_[1 - at];
  if (other.used) return;
  // The nearest frozen group that way; at the end of the groups, the nearest the other way (the
  // turn from forward to backward).
  const auto nearest = [&](bool down) -> const Group* {
    if (down) {
      for (std::size_t i = g.index; i-- > 0;)
        if (!groups[i].active) return &groups[i];
    } else {
      for (std::size_t i = g.index + 1; i < groups.size(); ++i)
        if (!groups[i].active) return &groups[i];
    }
    return nullptr;
  };
  const Group* next = nearest(descending);
  if (next == nullptr) next = nearest(!descending);
  if (next != nullptr && other.group != next && next->param16.bytes() <= bytes_)
    fill(other, *next);
}

void WeightWindows::release(const Group& g) {
  for (auto& w : windows_)
    if (w.group == &g && w.used) {
      w.used = false;
      w.buffer.invalidate_views(fmt::format("release_weights('{}')", g.name));
      return;
    }
  throw StateError(
      fmt::format("Engine::release_weights: group '{}' is not fetched", g.name));
}

void WeightWindows::forget(const Group& g, const std::string& event) {
  bool any = false;
  for (auto& w : windows_)
    if (w.group == &g) {
      drop(w, event);
      any = true;
    }
  if (any) ops_.finish_copies();  // a fill in flight may still read the home
}

void WeightWindows::forget_all(const std::string& event) {
  ops_.finish_copies();
  for (auto& w : windows_) drop(w, event);
  last_index_ = -1;
}

}  // namespace shardswap
