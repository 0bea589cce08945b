// Memory figures in the vocabulary of PyTorch's caching allocator:
//   requested: bytes callers asked for;
//   allocated: bytes the allocator handed out for them (requested rounded up to its granularity);
//   reserved:  bytes the allocator holds from the system, its cache included.
// Each has a current value and a peak since the last reset_peaks().
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace shardswap {

/// What a buffer is for. Every buffer has exactly one tag. `activation`: a model's forward and
/// backward working memory (not the engine's; the built-in model allocates through the same
/// MemorySpace so that its bytes are counted and planned too).
enum class Tag : std::uint8_t { param16, grad, master32, optim_state, comm, activation, other };
inline constexpr std::size_t kTagCount = 7;
inline constexpr std::array<Tag, kTagCount> kAllTags = {
    Tag::param16, Tag::grad, Tag::master32, Tag::optim_state, Tag::comm, Tag::activation,
    Tag::other};

const char* tag_name(Tag tag);

struct Counter {
  std::int64_t current = 0;
  std::int64_t peak = 0;

  void add(std::int64_t bytes) {
    current += bytes;
    if (current > peak) peak = current;
  }
  void sub(std::int64_t bytes) { current -= bytes; }
  void reset_peak() { peak = current; }
};

struct TagStats {
  Counter requested;
  Counter allocated;
  std::int64_t buffers = 0;  ///< live buffers of this tag
};

/// One rank's memory. Reserved bytes are per rank only: a cached block belongs to no tag.
struct MemoryStats {
  int rank = 0;
  std::array<TagStats, kTagCount> tags{};
  Counter requested;  ///< all tags; its peak is the peak of the sum, not the sum of peaks
  Counter allocated;
  Counter reserved;
  std::int64_t buffers = 0;  ///< blocks still holding memory (owned or only pinned)
  std::int64_t views = 0;    ///< live registered Views (copies of one View count once)
  std::int64_t pins = 0;     ///< live Pins

  const TagStats& tag(Tag t) const { return tags[static_cast<std::size_t>(t)]; }
  TagStats& tag(Tag t) { return tags[static_cast<std::size_t>(t)]; }
};

}  // namespace shardswap
