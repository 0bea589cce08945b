#include "engine/host_gradient_reducer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "shardswap/error.h"

namespace shardswap {

HostGradientReducer::HostGradientReducer(MemorySpace& space, const DeviceOps& ops,
                                         DType grad_dtype, std::int64_t window,
                                         std::size_t param_count)
    : ops_(ops), dtype_(grad_dtype), capacity_(window), slots_(param_count) {
  for (int i = 0; i < 2; ++i)
    windows_[i].buffer =
        space.allocate(static_cast<std::size_t>(window) * dtype_size(grad_dtype), Tag::grad,
                       fmt::format("grad window {}", i));
}

HostGradientReducer::~HostGradientReducer() {
  try {
    ops_.finish_copies();
  } catch (...) {  // a failing device: nothing left to protect
  }
}

std::string HostGradientReducer::grad_label(const Group& g) const {
  return fmt::format("group {} grads (host)", g.name);
}

std::vector<HostGradientReducer::Range>& HostGradientReducer::written(std::size_t index) {
  if (written_.size() <= index) written_.resize(index + 1);
  return written_[index];
}

void HostGradientReducer::attach(Group& g, const std::vector<Param>& params) {
  for (auto i : g.params) {
    const Param& p = params[i];
    const auto& entry = g.layout.entry_of(p.index_in_group);
    slots_[i] = Slot{p.info.name, entry.offset, entry.offset + entry.numel};
  }
  written(g.index).clear();  // a fresh buffer: nothing in it is gradient yet
  if (attached_.size() <= g.index) attached_.resize(g.index + 1, nullptr);
  attached_[g.index] = &g;
}

void HostGradientReducer::detach(Group& g) {
  ops_.finish_copies();  // the group's host buffer is about to go
  for (int w = 0; w < 2; ++w)
    if (windows_[w].group == &g) discard(w, fmt::format("group '{}' deactivated", g.name));
  for (auto i : g.params) slots_[i] = Slot{};
  written(g.index).clear();
  if (g.index < attached_.size()) attached_[g.index] = nullptr;
  if (last_group_ == &g) last_group_ = nullptr;
}

std::string HostGradientReducer::unready(int w) const {
  return slot_readiness::unready(slots_, [&](std::size_t i) { return slots_[i].window == w; });
}

void HostGradientReducer::mark_written(std::size_t index, Range r) {
  auto& ranges = written(index);
  ranges.push_back(r);
  std::sort(ranges.begin(), ranges.end());
  std::vector<Range> merged;
  for (const Range& x : ranges)
    if (!merged.empty() && x.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, x.second);
    else
      merged.push_back(x);
  ranges = std::move(merged);
}

void HostGradientReducer::close(int w) {
  Window& win = windows_[w];
  if (win.group == nullptr) return;
  const std::string missing = unready(w);
  if (!missing.empty())
    throw Error("Engine: grad_slot was handed out but grad_ready never called for " + missing);
  // Untouched since its fill, it holds what the host holds: nothing goes down.
  if (win.touched) {
    const auto esize = dtype_size(dtype_);
    win.free_mark = ops_.queue_copy(
        win.group->grad.as<std::byte>() + static_cast<std::size_t>(win.begin) * esize,
        win.buffer.data(), static_cast<std::size_t>(win.end - win.begin) * esize);
    mark_written(win.group->index, {win.begin, win.end});
  }
  discard(w, "grad window written back to the host");
}

void HostGradientReducer::discard(int w, const std::string& event) {
  Window& win = windows_[w];
  win.buffer.invalidate_views(event);
  win.group = nullptr;
  win.free_mark = std::max(win.free_mark, win.fill_mark);  // a fill in flight writes into it
  win.awaited = true;
  win.touched = false;
  for (auto& s : slots_)
    if (s.window == w) s.window = -1;
}

bool HostGradientReducer::all_written(std::size_t index, std::int64_t begin, std::int64_t end) {
  for (const Range& r : written(index))
    if (r.first <= begin && end <= r.second) return true;
  return false;
}

void HostGradientReducer::open(int w, Group& g, std::int64_t begin, std::int64_t end,
                               bool descending) {
  Window& win = windows_[w];
  const auto esize = dtype_size(dtype_);
  auto* to = win.buffer.as<std::byte>();
  const auto* from = g.grad.as<std::byte>();
  // What the host holds for [begin, end): gradient where a window wrote since the last clear(),
  // zeros elsewhere. The uploads queue behind the window's last trip down; the zeros are written
  // on the model's stream, which waits for that trip first.
  std::int64_t at = begin;
  bool down = false;
  const auto zero = [&](std::int64_t a, std::int64_t b) {
    if (b <= a) return;
    if (!down) ops_.await_copy(win.free_mark);
    down = true;
    ops_.fill_zero(to + static_cast<std::size_t>(a - begin) * esize,
                   static_cast<std::size_t>(b - a) * esize);
  };
  std::uint64_t filled = 0;
  for (const Range& r : written(g.index)) {
    const std::int64_t a = std::max(r.first, begin), b = std::min(r.second, end);
    if (a >= b) continue;
    zero(at, a);
    filled = ops_.queue_copy(to + static_cast<std::size_t>(a - begin) * esize,
                             from + static_cast<std::size_t>(a) * esize,
                             static_cast<std::size_t>(b - a) * esize);
    at = b;
  }
  zero(at, end);
  win.group = &g;
  win.begin = begin;
  win.end = end;
  win.fill_mark = filled;
  win.awaited = filled == 0;  // else the model writes into it once the fill is done
  win.touched = false;
  win.descending = descending;
}

void HostGradientReducer::rotate(int w) {
  const int o = 1 - w;
  if (windows_[o].group != nullptr) {
    if (!unready(o).empty()) return;  // a slot of it is open (a tied embedding's)
    close(o);
  }
  // The range after w's in its fill direction: in its group, or at the end of the next active
  // group that way.
  const Window& win = windows_[w];
  Group* g = win.group;
  std::int64_t begin = 0, end = 0;
  if (win.descending && win.begin > 0) {
    begin = std::max<std::int64_t>(0, win.begin - capacity_);
    end = win.begin;
  } else if (!win.descending && win.end < g->layout.total_numel()) {
    begin = win.end;
    end = std::min(g->layout.total_numel(), win.end + capacity_);
  } else {
    g = nullptr;
    if (win.descending) {
      for (std::size_t i = win.group->index; i-- > 0 && g == nullptr;)
        if (i < attached_.size()) g = attached_[i];
    } else {
      for (std::size_t i = win.group->index + 1; i < attached_.size() && g == nullptr; ++i)
        g = attached_[i];
    }
    if (g == nullptr) return;
    const std::int64_t total = g->layout.total_numel();
    begin = win.descending ? std::max<std::int64_t>(0, total - capacity_) : 0;
    end = win.descending ? total : std::min(total, capacity_);
  }
  if (end > begin && all_written(g->index, begin, end)) open(o, *g, begin, end, win.descending);
}

View HostGradientReducer::slot(Group& g, std::size_t index, const Param& p) {
  Slot& s = slots_[index];
  int w = -1;
  for (int i = 0; i < 2; ++i)
    if (windows_[i].group == &g && windows_[i].begin <= s.begin && s.end <= windows_[i].end) w = i;
  if (w < 0) {
    // A window of this group overlapping the param must go first (the host would get two
    // copies of its range); otherwise a closed one, or the one without open slots used longest
    // ago.
    for (int i = 0; i < 2; ++i)
      if (windows_[i].group == &g && windows_[i].begin < s.end && s.begin < windows_[i].end)
        w = i;
    if (w < 0) {
      const bool busy0 = !unready(0).empty(), busy1 = !unready(1).empty();
      if (windows_[0].group == nullptr || windows_[1].group == nullptr)
        w = windows_[0].group == nullptr ? 0 : 1;
      else if (busy0 != busy1)
        w = busy0 ? 1 : 0;
      else
        w = windows_[0].used <= windows_[1].used ? 0 : 1;
    }
    close(w);  // Error if it still has slots out
    const int other = 1 - w;
    // The range: the param, extended in the fill direction up to the window's capacity,
    // within the group and clear of the other window's range.
    std::int64_t lo = 0, hi = g.layout.total_numel();
    const Window& o = windows_[other];
    if (o.group == &g) {
      if (o.end <= s.begin) lo = std::max(lo, o.end);
      if (o.begin >= s.end) hi = std::min(hi, o.begin);
    }
    const bool descending = last_group_ == &g && last_offset_ > s.begin;
    if (descending)
      open(w, g, std::max(lo, s.end - capacity_), s.end, true);
    else
      open(w, g, s.begin, std::min(hi, s.begin + capacity_), false);
  }
  Window& used = windows_[w];
  if (!used.awaited) ops_.await_copy(used.fill_mark);
  used.awaited = true;
  if (!used.touched) {
    used.touched = true;
    rotate(w);
  }
  windows_[w].used = ++uses_;
  last_group_ = &g;
  last_offset_ = s.begin;
  s.window = w;
  s.out = true;
  s.ready = false;
  g.holds_grads = true;
  const Window& win = windows_[w];
  return win.buffer.view(static_cast<std::size_t>(s.begin - win.begin) * dtype_size(dtype_),
                         static_cast<std::size_t>(s.end - s.begin), dtype_,
                         fmt::format("{}: grad slot in window {}", p.info.name, w));
}

bool HostGradientReducer::mark_ready(std::size_t index) {
  return slot_readiness::mark_ready(slots_, index);
}

void HostGradientReducer::finish() {
  slot_readiness::require_ready(slots_);
  close(0);
  close(1);
  ops_.finish_copies();  // the step reads the host buffers
  last_group_ = nullptr;
}

void HostGradientReducer::reduce_for_step(std::vector<Group>& groups) {
  const auto esize = dtype_size(dtype_);
  for (auto& g : groups) {
    if (!g.active) continue;
    hand_overs_.push_back({g.index, 0, g.layout.total_numel()});
    std::int64_t at = 0;
    auto* data = g.grad.as<std::byte>();
    const auto zero = [&](std::int64_t a, std::int64_t b) {
      if (b > a)
        std::memset(data + static_cast<std::size_t>(a) * esize, 0,
                    static_cast<std::size_t>(b - a) * esize);
    };
    for (const Range& r : written(g.index)) {
      zero(at, r.first);
      at = r.second;
    }
    zero(at, g.layout.total_numel());
    written(g.index).assign(1, {0, g.layout.total_numel()});
  }
}

std::byte* HostGradientReducer::partition(const Group& g) const {
  return g.grad.as<std::byte>() +
         g.shard.begin * static_cast<std::int64_t>(dtype_size(dtype_));
}

void HostGradientReducer::clear(std::vector<Group>& groups) {
  for (int w = 0; w < 2; ++w) discard(w, "gradients dropped");
  for (auto& g : groups) {
    written(g.index).clear();  // logically zero: nothing is written on the host
    g.holds_grads = false;
  }
  for (auto& s : slots_) s.out = s.ready = false;
  last_group_ = nullptr;
  hand_overs_.clear();
}

std::string HostGradientReducer::pending(const Group& g) const {
  return slot_readiness::pending(g, slots_);
}

void HostGradientReducer::forget_groups() {
  ops_.finish_copies();
  for (int w = 0; w < 2; ++w) discard(w, "groups re-formed");
  written_.clear();
  attached_.clear();
  last_group_ = nullptr;
}

}  // namespace shardswap
