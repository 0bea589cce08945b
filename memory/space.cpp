// The registry behind Buffer, View and Pin.
//
// Lifetimes: a Storage is the shared record of one block. The owning Buffer and each Pin hold
// it; the block goes back to the allocator when the owner has released it and no Pin remains.
// ViewRecords hold the Storage too, but only to keep its metadata readable (label, the event that
// freed it): they never keep the block. Every mutation happens under the space's mutex; Views
// read an atomic `live` flag so a checked access costs one load.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#include "shardswap/buffer.h"
#include "shardswap/error.h"

namespace shardswap {

const char* tag_name(Tag tag) {
  switch (tag) {
    case Tag::param16:
      return "param16";
    case Tag::grad:
      return "grad";
    case Tag::master32:
      return "master32";
    case Tag::optim_state:
      return "optim_state";
    case Tag::comm:
      return "comm";
    case Tag::activation:
      return "activation";
    case Tag::other:
      return "other";
  }
  return "?";
}

namespace detail {

struct SpaceState {
  int rank = 0;
  std::unique_ptr<Allocator> allocator;
  mutable std::mutex mu;
  MemoryStats stats;
  std::uint64_t next_id = 1;
  std::map<std::uint64_t, Storage*> holding;  // blocks still holding memory, by id
  std::int64_t limit = -1;                     // set_limit: requested bytes held at most
  std::string limit_why;
};

struct Storage {
  std::shared_ptr<SpaceState> space;
  std::uint64_t id = 0;
  Tag tag = Tag::other;
  std::string label;
  std::size_t requested = 0;
  Block block;
  std::atomic<bool> live{true};              // false once the owner released it: Views are stale
  std::atomic<std::uint64_t> generation{0};  // bumped by invalidate_views: older Views are stale
  bool owned = true;
  std::vector<ViewRecord*> views;
  std::vector<PinRecord*> pins;
};

struct ViewRecord {
  std::shared_ptr<Storage> storage;
  std::size_t byte_offset = 0;
  std::size_t count = 0;
  DType dtype = DType::f32;
  std::uint64_t generation = 0;  // the storage's generation when this View was made
  std::string label;
  std::string buffer_label;  // the buffer's label when this View was made: its owner then
  // Why this View went stale, stamped (under the space's mutex, before the generation or
  // liveness changes) by the release or invalidation that ended its generation; a block handed
  // to another owner later and invalidated again does not overwrite it.
  std::string stale_event;

  ~ViewRecord() {
    auto space = storage->space;
    std::lock_guard lock(space->mu);
    std::erase(storage->views, this);
    --space->stats.views;
  }
};

namespace {

// Stamps the Views of the current generation with the event that ends it. Caller holds mu.
void stamp_stale_views(Storage& s, const std::string& event) {
  const auto generation = s.generation.load();
  for (ViewRecord* v : s.views)
    if (v->generation == generation && v->stale_event.empty()) v->stale_event = event;
}

// Returns the block to the allocator and updates the stats. Caller holds space->mu.
void return_block(Storage& s) {
  SpaceState& space = *s.space;
  if (s.block.ptr != nullptr) space.allocator->deallocate(s.block);
  auto& tag = space.stats.tag(s.tag);
  tag.requested.sub(static_cast<std::int64_t>(s.requested));
  tag.allocated.sub(static_cast<std::int64_t>(s.block.bytes));
  --tag.buffers;
  space.stats.requested.sub(static_cast<std::int64_t>(s.requested));
  space.stats.allocated.sub(static_cast<std::int64_t>(s.block.bytes));
  space.stats.reserved.current = static_cast<std::int64_t>(space.allocator->reserved_bytes());
  --space.stats.buffers;
  space.holding.erase(s.id);
  s.block = {};
}

}  // namespace

struct PinRecord {
  std::shared_ptr<Storage> storage;
  std::string label;

  ~PinRecord() {
    auto space = storage->space;
    std::lock_guard lock(space->mu);
    std::erase(storage->pins, this);
    --space->stats.pins;
    if (!storage->owned && storage->pins.empty()) return_block(*storage);
  }
};

}  // namespace detail

using detail::PinRecord;
using detail::Storage;
using detail::ViewRecord;

// ---- View ---------------------------------------------------------------------------------

void* View::raw() const {
  if (!record_) throw Error("View::raw: empty View");
  const Storage& s = *record_->storage;
  const bool live = s.live.load(std::memory_order_acquire);
  if (live && s.generation.load(std::memory_order_acquire) == record_->generation)
    return static_cast<char*>(s.block.ptr) + record_->byte_offset;
  // Stale: say whose view it was and what ended it, and who holds the block now if it was
  // handed on (set_active gives blocks to incoming groups of the same size).
  std::lock_guard lock(s.space->mu);
  std::string now;
  if (s.live.load() && s.label != record_->buffer_label)
    now = fmt::format("; the block now belongs to '{}'", s.label);
  throw StaleView(fmt::format("View::raw: view '{}' of '{}' (#{}) is stale: {} by '{}'{}",
                              record_->label, record_->buffer_label, s.id,
                              live ? "its contents were repurposed" : "the buffer was released",
                              record_->stale_event, now));
}

void View::check_type(DType wanted) const {
  if (!record_) throw Error("View::data: empty View");
  if (record_->dtype != wanted)
    throw Error(fmt::format("View::data: view '{}' holds {}, accessed as {}", record_->label,
                            dtype_name(record_->dtype), dtype_name(wanted)));
}

std::size_t View::count() const {
  return record_ ? record_->count : 0;
}
DType View::dtype() const {
  return record_ ? record_->dtype : DType::f32;
}
std::size_t View::byte_offset() const {
  return record_ ? record_->byte_offset : 0;
}
const std::string& View::label() const {
  static const std::string none;
  return record_ ? record_->label : none;
}
std::uint64_t View::buffer_id() const {
  return record_ ? record_->storage->id : 0;
}
bool View::stale() const {
  return !record_ || !record_->storage->live.load() ||
         record_->storage->generation.load() != record_->generation;
}

View View::sub(std::size_t first, std::size_t count, std::string label) const {
  if (!record_) throw Error("View::sub: empty View");
  if (first + count > record_->count)
    throw Error(fmt::format("View::sub: [{}, {}) is outside view '{}' of {} elements", first,
                            first + count, record_->label, record_->count));
  auto& s = record_->storage;
  auto record = std::make_shared<ViewRecord>();
  record->storage = s;
  record->byte_offset = record_->byte_offset + first * dtype_size(record_->dtype);
  record->count = count;
  record->dtype = record_->dtype;
  record->generation = record_->generation;
  record->label = std::move(label);
  record->buffer_label = record_->buffer_label;
  std::lock_guard lock(s->space->mu);
  s->views.push_back(record.get());
  ++s->space->stats.views;
  return View(std::move(record));
}

Pin View::pin(std::string label) const {
  (void)raw();  // throws StaleView naming this View if its buffer is gone
  auto& s = record_->storage;
  auto record = std::make_unique<PinRecord>();
  record->storage = s;
  record->label = std::move(label);
  std::lock_guard lock(s->space->mu);
  s->pins.push_back(record.get());
  ++s->space->stats.pins;
  return Pin(std::move(record));
}

// ---- Pin ----------------------------------------------------------------------------------

Pin::Pin() = default;
Pin::Pin(std::unique_ptr<PinRecord> record) : record_(std::move(record)) {}
Pin::Pin(Pin&&) noexcept = default;
Pin& Pin::operator=(Pin&&) noexcept = default;
Pin::~Pin() = default;
void Pin::reset() {
  record_.reset();
}

void* Pin::data() const {
  return record_ ? record_->storage->block.ptr : nullptr;
}
std::size_t Pin::bytes() const {
  return record_ ? record_->storage->requested : 0;
}
const std::string& Pin::label() const {
  static const std::string none;
  return record_ ? record_->label : none;
}
std::uint64_t Pin::buffer_id() const {
  return record_ ? record_->storage->id : 0;
}

// ---- Buffer -------------------------------------------------------------------------------

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    drop("Buffer replaced by assignment", "replaced");
    storage_ = std::move(other.storage_);
  }
  return *this;
}

Buffer::~Buffer() {
  drop("Buffer destroyed", "destroyed");
}

void Buffer::drop(const char* event, const char* verb) noexcept {
  if (!storage_) return;
  try {
    const std::string label = storage_->label;
    const auto held = release(event, ReleasePolicy::allow_pinned);
    if (held > 0)
      spdlog::warn("Buffer: '{}' {} while pinned; {} bytes stay held by its Pins", label, verb,
                   held);
  } catch (...) {
    // release() with allow_pinned only throws on allocation of its message; never propagate.
  }
}

void* Buffer::data() const {
  if (!storage_) throw Error("Buffer::data: empty Buffer");
  return storage_->block.ptr;
}
std::size_t Buffer::bytes() const {
  return storage_ ? storage_->requested : 0;
}
Tag Buffer::tag() const {
  return storage_ ? storage_->tag : Tag::other;
}
const std::string& Buffer::label() const {
  static const std::string none;
  return storage_ ? storage_->label : none;
}
std::uint64_t Buffer::id() const {
  return storage_ ? storage_->id : 0;
}

View Buffer::view(std::size_t byte_offset, std::size_t count, DType dtype,
                  std::string label) const {
  if (!storage_) throw Error(fmt::format("Buffer::view: '{}' on an empty Buffer", label));
  const std::size_t size = dtype_size(dtype);
  if (byte_offset % size != 0 || byte_offset + count * size > storage_->requested)
    throw Error(fmt::format(
        "Buffer::view: '{}' ({} x {} at byte {}) does not fit buffer '{}' of "
        "{} bytes",
        label, count, dtype_name(dtype), byte_offset, storage_->label, storage_->requested));
  auto record = std::make_shared<ViewRecord>();
  record->storage = storage_;
  record->byte_offset = byte_offset;
  record->count = count;
  record->dtype = dtype;
  record->label = std::move(label);
  std::lock_guard lock(storage_->space->mu);
  record->buffer_label = storage_->label;
  record->generation = storage_->generation.load();
  storage_->views.push_back(record.get());
  ++storage_->space->stats.views;
  return View(std::move(record));
}

Pin Buffer::pin(std::string label) const {
  if (!storage_) throw Error(fmt::format("Buffer::pin: '{}' on an empty Buffer", label));
  auto record = std::make_unique<PinRecord>();
  record->storage = storage_;
  record->label = std::move(label);
  std::lock_guard lock(storage_->space->mu);
  storage_->pins.push_back(record.get());
  ++storage_->space->stats.pins;
  return Pin(std::move(record));
}

std::vector<std::string> Buffer::view_labels() const {
  std::vector<std::string> out;
  if (!storage_) return out;
  std::lock_guard lock(storage_->space->mu);
  for (const auto* v : storage_->views) out.push_back(v->label);
  return out;
}

std::vector<std::string> Buffer::pin_labels() const {
  std::vector<std::string> out;
  if (!storage_) return out;
  std::lock_guard lock(storage_->space->mu);
  for (const auto* p : storage_->pins) out.push_back(p->label);
  return out;
}

void Buffer::relabel(std::string label) {
  if (!storage_) throw Error(fmt::format("Buffer::relabel: '{}' on an empty Buffer", label));
  std::lock_guard lock(storage_->space->mu);
  storage_->label = std::move(label);
}

void Buffer::invalidate_views(const std::string& event) {
  if (!storage_)
    throw Error(fmt::format("Buffer::invalidate_views: '{}' on an empty Buffer", event));
  std::lock_guard lock(storage_->space->mu);
  detail::stamp_stale_views(*storage_, event);
  storage_->generation.fetch_add(1, std::memory_order_release);
}

std::size_t Buffer::release(const std::string& event, ReleasePolicy policy) {
  if (!storage_) return 0;
  auto space = storage_->space;  // keeps the mutex alive past storage_.reset()
  std::size_t held = 0;
  {
    std::lock_guard lock(space->mu);
    Storage& s = *storage_;
    if (!s.pins.empty()) {
      if (policy == ReleasePolicy::fail_if_pinned) {
        std::string names;
        for (const auto* p : s.pins)
          names += fmt::format("{}'{}'", names.empty() ? "" : ", ", p->label);
        throw PinnedMemory(fmt::format("Buffer::release: '{}' ({} bytes) is held by {} Pin(s): {}",
                                       s.label, s.requested, s.pins.size(), names));
      }
      held = s.requested;
    }
    detail::stamp_stale_views(s, event);
    s.live.store(false, std::memory_order_release);
    s.owned = false;
    if (s.pins.empty()) detail::return_block(s);
  }
  storage_.reset();
  return held;
}

// ---- MemorySpace --------------------------------------------------------------------------

MemorySpace::MemorySpace(int rank, std::unique_ptr<Allocator> allocator)
    : state_(std::make_shared<detail::SpaceState>()) {
  if (!allocator) throw ConfigError("MemorySpace: no allocator given");
  state_->rank = rank;
  state_->allocator = std::move(allocator);
  state_->stats.rank = rank;
}

MemorySpace::~MemorySpace() = default;

Buffer MemorySpace::allocate(std::size_t bytes, Tag tag, std::string label) {
  auto s = std::make_shared<Storage>();
  s->space = state_;
  s->tag = tag;
  s->label = std::move(label);
  s->requested = bytes;
  std::unique_lock lock(state_->mu);
  if (const std::int64_t held = state_->stats.requested.current;
      state_->limit >= 0 && static_cast<std::int64_t>(bytes) > state_->limit - held) {
    const std::string why = state_->limit_why;
    const std::int64_t limit = state_->limit;
    lock.unlock();  // report_text() takes the lock
    throw OutOfMemory(fmt::format(
        "MemorySpace::allocate: rank {}: '{}' ({} bytes, {}) would hold {} bytes, past the cap "
        "of {} bytes ({}): nothing allocated\n{}",
        state_->rank, s->label, bytes, tag_name(tag), held + static_cast<std::int64_t>(bytes),
        limit, why, report_text()));
  }
  if (bytes > 0) {
    try {
      s->block = state_->allocator->allocate(bytes);
    } catch (const OutOfMemory& e) {
      lock.unlock();  // report_text() takes the lock
      throw OutOfMemory(fmt::format("MemorySpace::allocate: rank {}: '{}' ({} bytes, {}): {}\n{}",
                                    state_->rank, s->label, bytes, tag_name(tag), e.what(),
                                    report_text()));
    }
  }
  s->id = state_->next_id++;
  auto& stats = state_->stats;
  auto& t = stats.tag(tag);
  t.requested.add(static_cast<std::int64_t>(bytes));
  t.allocated.add(static_cast<std::int64_t>(s->block.bytes));
  ++t.buffers;
  stats.requested.add(static_cast<std::int64_t>(bytes));
  stats.allocated.add(static_cast<std::int64_t>(s->block.bytes));
  stats.reserved.current = static_cast<std::int64_t>(state_->allocator->reserved_bytes());
  stats.reserved.peak = std::max(stats.reserved.peak, stats.reserved.current);
  ++stats.buffers;
  state_->holding[s->id] = s.get();
  return Buffer(std::move(s));
}

void MemorySpace::set_limit(std::int64_t bytes, std::string why) {
  std::lock_guard lock(state_->mu);
  state_->limit = bytes < 0 ? -1 : bytes;
  state_->limit_why = std::move(why);
}

std::int64_t MemorySpace::limit() const {
  std::lock_guard lock(state_->mu);
  return state_->limit;
}

MemoryStats MemorySpace::stats() const {
  std::lock_guard lock(state_->mu);
  return state_->stats;
}

void MemorySpace::reset_peaks() {
  std::lock_guard lock(state_->mu);
  auto& stats = state_->stats;
  for (auto& t : stats.tags) {
    t.requested.reset_peak();
    t.allocated.reset_peak();
  }
  stats.requested.reset_peak();
  stats.allocated.reset_peak();
  stats.reserved.reset_peak();
}

std::vector<BufferReport> MemorySpace::report() const {
  std::lock_guard lock(state_->mu);
  std::vector<BufferReport> out;
  for (const auto& [id, s] : state_->holding) {
    BufferReport r;
    r.id = id;
    r.tag = s->tag;
    r.label = s->label;
    r.requested = s->requested;
    r.allocated = s->block.bytes;
    r.owned = s->owned;
    for (const auto* v : s->views) r.views.push_back(v->label);
    for (const auto* p : s->pins) r.pins.push_back(p->label);
    out.push_back(std::move(r));
  }
  return out;
}

std::string MemorySpace::report_text() const {
  std::string text = fmt::format("rank {} memory ({}):\n", rank(), state_->allocator->name());
  for (const auto& r : report()) {
    text += fmt::format("  #{:<5} {:<11} {:>14} B  {}{}\n", r.id, tag_name(r.tag), r.requested,
                        r.label, r.owned ? "" : "  [released by owner, kept by Pins]");
    for (const auto& v : r.views) text += fmt::format("           view: {}\n", v);
    for (const auto& p : r.pins) text += fmt::format("           pin:  {}\n", p);
  }
  return text;
}

int MemorySpace::rank() const {
  return state_->rank;
}
DeviceKind MemorySpace::device() const {
  return state_->allocator->device();
}

}  // namespace shardswap

namespace shardswap {

std::unique_ptr<Allocator> MemorySpace::host_staging_allocator() const {
  return state_->allocator->host_staging();
}

void MemorySpace::upload(void* dst, const void* host_src, std::size_t bytes) const {
  state_->allocator->upload(dst, host_src, bytes);
}

void MemorySpace::download(void* host_dst, const void* src, std::size_t bytes) const {
  state_->allocator->download(host_dst, src, bytes);
}

void MemorySpace::check_write(const View& v, std::size_t count) const {
  if (count != v.count())
    throw Error(fmt::format("MemorySpace::write: {} values for view '{}' of {} elements", count,
                            v.label(), v.count()));
}

}  // namespace shardswap
