// Pure arithmetic of ZeRO partitioning: where each param of a group lives in its flat buffer and
// which rank owns which part. Nothing here allocates device or host buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shardswap/layout_order.h"

namespace shardswap {

struct LayoutOptions {
  std::size_t element_bytes = 2;      ///< bytes per element of the flat buffer (bit16: 2)
  std::size_t alignment_bytes = 256;  ///< power of two, >= element_bytes; every param start and
                                      ///< every shard start is aligned to it
  int world_size = 1;
  LayoutOrder order = LayoutOrder::declaration;
};

/// One param's place in the flat buffer, in elements.
struct LayoutEntry {
  std::size_t param = 0;  ///< index into the numels given to FlatLayout::build
  std::int64_t offset = 0;
  std::int64_t numel = 0;
};

class FlatLayout {
 public:
  /// Throws ConfigError on: world_size < 1, alignment not a power of two or smaller than
  /// element_bytes, element_bytes 0, no params, a param with numel <= 0 (naming its index).
  static FlatLayout build(std::span<const std::int64_t> numels, const LayoutOptions& options);

  const std::vector<LayoutEntry>& entries() const { return entries_; }  ///< flat order
  const LayoutEntry& entry_of(std::size_t param) const { return entries_[position_[param]]; }
  std::size_t param_count() const { return entries_.size(); }

  std::int64_t param_numel() const { return param_numel_; }  ///< sum of params, no padding
  std::int64_t total_numel() const { return shard_numel_ * options_.world_size; }  ///< padded
  std::int64_t shard_numel() const { return shard_numel_; }  ///< same for every rank, aligned
  std::int64_t alignment_elements() const;
  int world_size() const { return options_.world_size; }
  const LayoutOptions& options() const { return options_; }

 private:
  LayoutOptions options_;
  std::vector<LayoutEntry> entries_;
  std::vector<std::size_t> position_;  // param index -> index in entries_
  std::int64_t param_numel_ = 0;
  std::int64_t shard_numel_ = 0;
};

/// A piece of one param that lies inside one rank's shard.
struct Fragment {
  std::size_t param = 0;
  std::int64_t param_offset = 0;  ///< first element of the piece within the param
  std::int64_t shard_offset = 0;  ///< where it lies within the shard
  std::int64_t count = 0;
};

/// A rank's contiguous range [begin, end) of the flat buffer and the fragments in it (flat order).
/// Elements of the range not covered by a fragment are alignment padding.
struct Shard {
  int rank = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::vector<Fragment> fragments;

  std::int64_t numel() const { return end - begin; }
  /// Throws ConfigError if rank is outside [0, world_size).
  static Shard of(const FlatLayout& layout, int rank);
};

/// The part of a flat range owned by one rank.
struct OwnedRange {
  int rank = 0;
  std::int64_t begin = 0;  ///< flat offset
  std::int64_t end = 0;
};

/// Splits the flat range [begin, end) at shard boundaries, in rank order.
std::vector<OwnedRange> owners_of(const FlatLayout& layout, std::int64_t begin, std::int64_t end);

}  // namespace shardswap
