// Owning buffers and their registered aliases.
//
// A Buffer owns one block of a MemorySpace. Any pointer into it that outlives one call is a
// registered alias with a label:
//   View: non-owning (buffer, byte offset, count, dtype, label). Once the buffer is released,
//         every access through the View throws StaleView naming the View and the event that
//         released the buffer; it never reads freed memory.
//   Pin:  owning and labelled, for code outside the engine that must keep memory alive. A
//         release that meets a Pin fails, listing the Pins and changing nothing, unless the
//         caller explicitly allows it; then the block lives on, visibly, until the last Pin goes.
// MemorySpace::report() lists every block with its tag, bytes and holders: nothing holds memory
// silently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shardswap/allocator.h"
#include "shardswap/dtype.h"
#include "shardswap/stats.h"

namespace shardswap {

namespace detail {
struct SpaceState;
struct Storage;
struct ViewRecord;
struct PinRecord;
}  // namespace detail

class Pin;

class View {
 public:
  View() = default;

  /// Checked access: throws StaleView if the buffer was released, Error if T is not the dtype.
  template <class T>
  T* data() const {
    check_type(dtype_of<T>());
    return static_cast<T*>(raw());
  }
  template <class T>
  std::span<T> span() const {
    return {data<T>(), count()};
  }
  void* raw() const;

  std::size_t count() const;
  DType dtype() const;
  std::size_t byte_offset() const;
  std::size_t bytes() const { return count() * dtype_size(dtype()); }
  const std::string& label() const;
  std::uint64_t buffer_id() const;
  bool stale() const;
  bool empty() const { return record_ == nullptr; }

  /// A View of part of this one, registered under its own label.
  View sub(std::size_t first, std::size_t count, std::string label) const;
  /// An owning Pin on the whole buffer this View looks into. Throws StaleView if it is stale.
  Pin pin(std::string label) const;

 private:
  friend class Buffer;
  explicit View(std::shared_ptr<detail::ViewRecord> record) : record_(std::move(record)) {}
  void check_type(DType wanted) const;
  std::shared_ptr<detail::ViewRecord> record_;  // copies share one registration
};

class Pin {
 public:
  Pin();
  Pin(Pin&&) noexcept;
  Pin& operator=(Pin&&) noexcept;
  Pin(const Pin&) = delete;
  Pin& operator=(const Pin&) = delete;
  ~Pin();

  void* data() const;
  std::size_t bytes() const;
  const std::string& label() const;
  std::uint64_t buffer_id() const;
  bool empty() const { return record_ == nullptr; }
  /// Drops the reference now (the destructor does the same).
  void reset();

 private:
  friend class Buffer;
  friend class View;
  explicit Pin(std::unique_ptr<detail::PinRecord> record);
  std::unique_ptr<detail::PinRecord> record_;
};

enum class ReleasePolicy {
  fail_if_pinned,  ///< throw PinnedMemory listing the Pins, change nothing
  allow_pinned,    ///< release anyway; Pins keep the block until they go (reported)
};

class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept = default;
  /// Releases what this one held first, as the destructor does.
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  /// Releases with ReleasePolicy::allow_pinned (a destructor cannot fail); logs a warning
  /// naming the Pins if any still hold the block.
  ~Buffer();

  bool valid() const { return storage_ != nullptr; }
  void* data() const;  ///< throws Error on an empty Buffer
  template <class T>
  T* as() const {
    return static_cast<T*>(data());
  }
  std::size_t bytes() const;  ///< requested bytes
  Tag tag() const;
  const std::string& label() const;
  std::uint64_t id() const;

  /// Registers a View of `count` elements of `dtype` at `byte_offset`. Throws Error if it does not
  /// fit in the buffer or the offset is not a multiple of the element size.
  View view(std::size_t byte_offset, std::size_t count, DType dtype, std::string label) const;
  /// Registers an owning Pin.
  Pin pin(std::string label) const;
  std::vector<std::string> view_labels() const;
  std::vector<std::string> pin_labels() const;

  /// Gives the buffer a new label (reports and error messages use it from now on): used when
  /// the engine hands a block straight from one owner to another of the same size and tag.
  void relabel(std::string label);

  /// Makes every View made so far stale (they throw StaleView naming `event`) while the buffer
  /// lives on: used when its contents are repurposed (a gradient bucket reused, a re-form).
  void invalidate_views(const std::string& event);

  /// Gives the buffer up: every View becomes stale with `event` as the reason. Returns the bytes
  /// still held by Pins (0 when the block went back to the allocator).
  std::size_t release(const std::string& event,
                      ReleasePolicy policy = ReleasePolicy::fail_if_pinned);

 private:
  friend class MemorySpace;
  explicit Buffer(std::shared_ptr<detail::Storage> storage) : storage_(std::move(storage)) {}
  /// release(event, allow_pinned) for the destructor and move-assignment, which cannot throw:
  /// warns naming the buffer if Pins still hold the block; a failure to build a message is
  /// swallowed.
  void drop(const char* event, const char* verb) noexcept;
  std::shared_ptr<detail::Storage> storage_;
};

/// What report() says of one block still holding memory.
struct BufferReport {
  std::uint64_t id = 0;
  Tag tag = Tag::other;
  std::string label;
  std::size_t requested = 0;
  std::size_t allocated = 0;
  bool owned = true;  ///< false: released by its owner, kept alive by Pins
  std::vector<std::string> views;
  std::vector<std::string> pins;
};

/// One rank's memory: an allocator, the stats, and the registry of every live block and alias.
/// Thread-safe. Buffers, Views and Pins may outlive the MemorySpace object safely.
class MemorySpace {
 public:
  MemorySpace(int rank, std::unique_ptr<Allocator> allocator);
  ~MemorySpace();
  MemorySpace(const MemorySpace&) = delete;
  MemorySpace& operator=(const MemorySpace&) = delete;

  /// A new buffer of `bytes` (may be 0). Contents are unspecified. Throws OutOfMemory.
  Buffer allocate(std::size_t bytes, Tag tag, std::string label);

  /// Caps the bytes requested and not yet released at `bytes`: an allocate() that would pass it
  /// throws OutOfMemory naming its label, tag and size, the cap and `why` (what set it: a device
  /// budget), and allocates nothing. What is held already is left as it is. Negative: no cap
  /// (the default).
  void set_limit(std::int64_t bytes, std::string why);
  /// The cap set_limit() set; -1: none.
  std::int64_t limit() const;

  MemoryStats stats() const;
  void reset_peaks();
  std::vector<BufferReport> report() const;
  /// The report as text, one block per line, for logs and the CLI.
  std::string report_text() const;

  int rank() const;
  DeviceKind device() const;
  /// A fresh allocator of host memory this space copies to and from fastest.
  std::unique_ptr<Allocator> host_staging_allocator() const;

  /// Copies between host memory and this space's memory (a View's or a Buffer's bytes).
  void upload(void* dst, const void* host_src, std::size_t bytes) const;
  void download(void* host_dst, const void* src, std::size_t bytes) const;
  /// A View's elements, copied to the host.
  template <class T>
  std::vector<T> read(const View& v) const {
    std::vector<T> out(v.count());
    download(out.data(), v.data<T>(), v.bytes());
    return out;
  }
  /// Copies host values into a View (sizes must match; throws Error otherwise).
  template <class T>
  void write(const View& v, std::span<const T> values) const {
    check_write(v, values.size());
    upload(v.data<T>(), values.data(), v.bytes());
  }

 private:
  void check_write(const View& v, std::size_t count) const;
  std::shared_ptr<detail::SpaceState> state_;
};

}  // namespace shardswap
