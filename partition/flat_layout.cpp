// Packing and sharding arithmetic behind FlatLayout, Shard and owners_of (contract in
// flat_layout.h). All quantities are in elements unless their name says bytes.
#include "partition/flat_layout.h"

#include <algorithm>
#include <bit>
#include <limits>

#include <fmt/format.h>

#include "shardswap/error.h"

namespace shardswap {
namespace {

constexpr std::int64_t kMaxNumel = std::numeric_limits<std::int64_t>::max();

std::int64_t ceil_div(std::int64_t value, std::int64_t divisor) {
  return value / divisor + (value % divisor != 0);
}

// Smallest multiple of `multiple` that is >= value. Only build() calls it: a layout too large for
// int64 is reported as bad input rather than silently wrapped.
std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  const std::int64_t quotient = ceil_div(value, multiple);
  if (quotient > kMaxNumel / multiple) {
    throw ConfigError(fmt::format(
        "FlatLayout::build: padding {} elements to a multiple of {} exceeds the int64 range", value,
        multiple));
  }
  return quotient * multiple;
}

void validate(std::span<const std::int64_t> numels, const LayoutOptions& options) {
  const std::size_t element_bytes = options.element_bytes;
  const std::size_t alignment_bytes = options.alignment_bytes;
  if (element_bytes == 0) throw ConfigError("FlatLayout::build: element_bytes is 0");
  if (!std::has_single_bit(alignment_bytes)) {
    throw ConfigError(fmt::format("FlatLayout::build: alignment_bytes {} is not a power of two",
                                  alignment_bytes));
  }
  if (alignment_bytes < element_bytes) {
    throw ConfigError(
        fmt::format("FlatLayout::build: alignment_bytes {} is smaller than element_bytes {}",
                    alignment_bytes, element_bytes));
  }
  // Only possible when element_bytes is not a power of two (e.g. 3 bytes, 4-byte alignment).
  if (alignment_bytes % element_bytes != 0) {
    throw ConfigError(
        fmt::format("FlatLayout::build: alignment_bytes {} is not a multiple of element_bytes {}",
                    alignment_bytes, element_bytes));
  }
  if (alignment_bytes / element_bytes > static_cast<std::size_t>(kMaxNumel)) {
    throw ConfigError(
        fmt::format("FlatLayout::build: alignment_bytes {} is too large", alignment_bytes));
  }
  if (options.world_size < 1) {
    throw ConfigError(
        fmt::format("FlatLayout::build: world_size {} must be at least 1", options.world_size));
  }
  if (numels.empty())
    throw ConfigError("FlatLayout::build: no params; a layout needs at least one");
  for (std::size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] <= 0) {
      throw ConfigError(fmt::format(
          "FlatLayout::build: param {} has numel {}; every param needs at least one element", i,
          numels[i]));
    }
  }
}

}  // namespace

FlatLayout FlatLayout::build(std::span<const std::int64_t> numels, const LayoutOptions& options) {
  validate(numels, options);

  FlatLayout layout;
  layout.options_ = options;
  const std::int64_t alignment = layout.alignment_elements();
  const std::size_t count = numels.size();

  // Flat order of params. Round-robin deals param i into bucket i % world_size; with one bucket
  // (declaration order, or world_size 1) this is the identity.
  const std::size_t buckets =
      options.order == LayoutOrder::round_robin ? static_cast<std::size_t>(options.world_size) : 1;
  std::vector<std::size_t> order;
  order.reserve(count);
  for (std::size_t bucket = 0; bucket < buckets; ++bucket) {
    for (std::size_t param = bucket; param < count; param += buckets) order.push_back(param);
  }

  // Each param starts at the first aligned offset after the previous one.
  layout.entries_.reserve(count);
  layout.position_.resize(count);
  std::int64_t end = 0;
  for (std::size_t param : order) {
    const std::int64_t offset = round_up(end, alignment);
    const std::int64_t numel = numels[param];
    if (numel > kMaxNumel - offset) {
      throw ConfigError(
          fmt::format("FlatLayout::build: param {} (numel {}) at offset {} exceeds the int64 range",
                      param, numel, offset));
    }
    layout.position_[param] = layout.entries_.size();
    layout.entries_.push_back({param, offset, numel});
    layout.param_numel_ += numel;
    end = offset + numel;
  }

  // The smallest aligned shard size whose world_size copies cover every param. Aligning the shard
  // size (not just the total) makes every shard start aligned too.
  const std::int64_t world = options.world_size;
  layout.shard_numel_ = round_up(ceil_div(end, world), alignment);
  if (layout.shard_numel_ > kMaxNumel / world) {
    throw ConfigError(
        fmt::format("FlatLayout::build: {} shards of {} elements exceed the int64 range", world,
                    layout.shard_numel_));
  }
  return layout;
}

std::int64_t FlatLayout::alignment_elements() const {
  return static_cast<std::int64_t>(options_.alignment_bytes / options_.element_bytes);
}

Shard Shard::of(const FlatLayout& layout, int rank) {
  if (rank < 0 || rank >= layout.world_size()) {
    throw ConfigError(
        fmt::format("Shard::of: rank {} is outside [0, {})", rank, layout.world_size()));
  }
  Shard shard;
  shard.rank = rank;
  shard.begin = rank * layout.shard_numel();
  shard.end = shard.begin + layout.shard_numel();

  // Entries are sorted by offset and disjoint: skip those ending before the shard, then take
  // every entry that starts inside it.
  const auto& entries = layout.entries();
  auto it = std::partition_point(entries.begin(), entries.end(), [&](const LayoutEntry& e) {
    return e.offset + e.numel <= shard.begin;
  });
  for (; it != entries.end() && it->offset < shard.end; ++it) {
    const std::int64_t first = std::max(it->offset, shard.begin);
    const std::int64_t last = std::min(it->offset + it->numel, shard.end);
    shard.fragments.push_back({it->param, first - it->offset, first - shard.begin, last - first});
  }
  return shard;
}

std::vector<OwnedRange> owners_of(const FlatLayout& layout, std::int64_t begin, std::int64_t end) {
  const std::int64_t total = layout.total_numel();
  if (begin < 0 || begin > end || end > total) {
    throw ConfigError(fmt::format(
        "owners_of: range [{}, {}) does not satisfy 0 <= begin <= end <= total_numel {}", begin,
        end, total));
  }
  const std::int64_t shard_numel = layout.shard_numel();
  std::vector<OwnedRange> pieces;
  for (std::int64_t position = begin; position < end;) {
    const std::int64_t rank = position / shard_numel;
    const std::int64_t piece_end = std::min(end, (rank + 1) * shard_numel);
    pieces.push_back({static_cast<int>(rank), position, piece_end});
    position = piece_end;
  }
  return pieces;
}

}  // namespace shardswap
