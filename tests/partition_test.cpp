// Specification of partition/: FlatLayout packing, Shard fragments and owners_of, by worked
// examples, by properties over thousands of random shapes, and by the errors bad input raises.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "partition/flat_layout.h"
#include "tests/catch_compat.h"

using namespace shardswap;

namespace {

LayoutOptions options_of(std::size_t element_bytes, std::size_t alignment_bytes, int world_size,
                         LayoutOrder order = LayoutOrder::declaration) {
  LayoutOptions options;
  options.element_bytes = element_bytes;
  options.alignment_bytes = alignment_bytes;
  options.world_size = world_size;
  options.order = order;
  return options;
}

std::vector<Shard> all_shards(const FlatLayout& layout) {
  std::vector<Shard> shards;
  for (int rank = 0; rank < layout.world_size(); ++rank) shards.push_back(Shard::of(layout, rank));
  return shards;
}

// ---- random shapes -----------------------------------------------------------------------------

struct RandomShape {
  std::vector<std::int64_t> numels;
  LayoutOptions options;

  std::string describe() const {
    std::string text =
        "element_bytes " + std::to_string(options.element_bytes) + ", alignment_bytes " +
        std::to_string(options.alignment_bytes) + ", world_size " +
        std::to_string(options.world_size) +
        (options.order == LayoutOrder::round_robin ? ", round_robin" : ", declaration") +
        ", numels {";
    for (std::int64_t numel : numels) text += " " + std::to_string(numel);
    return text + " }";
  }
};

constexpr int kRandomLayouts = 5000;

// A mix of shapes that stress the edges: fewer params than ranks, params of one to three elements,
// odd sizes, and one huge param among small ones. World sizes 1..9, alignments 2..4096 bytes.
RandomShape random_shape(std::mt19937_64& rng) {
  auto uniform = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  RandomShape shape;
  const int world_size = static_cast<int>(uniform(1, 9));
  const int element_log2 = static_cast<int>(uniform(0, 3));  // 1, 2, 4 or 8 bytes
  const int alignment_log2 = static_cast<int>(uniform(std::max(1, element_log2), 12));
  shape.options =
      options_of(std::size_t{1} << element_log2, std::size_t{1} << alignment_log2, world_size,
                 uniform(0, 1) ? LayoutOrder::round_robin : LayoutOrder::declaration);

  const auto count = static_cast<std::size_t>(uniform(1, 3 * world_size + 3));
  // Kinds: 0 tiny (1..3 elements), 1 odd sizes, 2 small, 3 mixed up to 100k, 4 small plus one
  // huge param at a random position.
  const int kind = static_cast<int>(uniform(0, 4));
  const std::int64_t largest[] = {3, 2500, 300, 100'000, 17};
  for (std::size_t i = 0; i < count; ++i) {
    const std::int64_t numel = uniform(1, largest[kind]);
    shape.numels.push_back(kind == 1 ? 2 * numel - 1 : numel);
  }
  if (kind == 4) {
    shape.numels[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(count) - 1))] =
        uniform(1'000'000, 10'000'000'000);
  }
  return shape;
}

// Calls check(shape, layout) for the same kRandomLayouts shapes in every test case.
template <class Check>
void for_each_random_layout(Check&& check) {
  std::mt19937_64 rng(20240611);
  for (int i = 0; i < kRandomLayouts; ++i) {
    const RandomShape shape = random_shape(rng);
    INFO("random layout " << i << ": " << shape.describe());
    check(shape, FlatLayout::build(shape.numels, shape.options));
  }
}

}  // namespace

// ---- examples ----------------------------------------------------------------------------------

TEST_CASE("A small layout has the expected offsets, padding and fragments") {
  // 2-byte elements, 8-byte alignment: params start at multiples of 4 elements.
  const std::vector<std::int64_t> numels = {3, 5, 2};
  const FlatLayout layout = FlatLayout::build(numels, options_of(2, 8, 2));

  REQUIRE(layout.alignment_elements() == 4);
  REQUIRE(layout.entry_of(0).offset == 0);
  REQUIRE(layout.entry_of(1).offset == 4);
  REQUIRE(layout.entry_of(2).offset == 12);
  REQUIRE(layout.param_numel() == 10);
  REQUIRE(layout.shard_numel() == 8);  // params end at 14; two aligned shards of 8 cover it
  REQUIRE(layout.total_numel() == 16);

  const Shard first = Shard::of(layout, 0);
  REQUIRE(first.begin == 0);
  REQUIRE(first.end == 8);
  REQUIRE(first.fragments.size() == 2);
  REQUIRE((first.fragments[0].param == 0 && first.fragments[0].param_offset == 0 &&
           first.fragments[0].shard_offset == 0 && first.fragments[0].count == 3));
  REQUIRE((first.fragments[1].param == 1 && first.fragments[1].param_offset == 0 &&
           first.fragments[1].shard_offset == 4 && first.fragments[1].count == 4));

  const Shard second = Shard::of(layout, 1);
  REQUIRE(second.begin == 8);
  REQUIRE(second.end == 16);
  REQUIRE(second.fragments.size() == 2);
  REQUIRE((second.fragments[0].param == 1 && second.fragments[0].param_offset == 4 &&
           second.fragments[0].shard_offset == 0 && second.fragments[0].count == 1));
  REQUIRE((second.fragments[1].param == 2 && second.fragments[1].param_offset == 0 &&
           second.fragments[1].shard_offset == 4 && second.fragments[1].count == 2));
}

TEST_CASE("Round-robin over two ranks packs params 0, 2, 1") {
  const std::vector<std::int64_t> numels = {3, 5, 2};
  const FlatLayout layout =
      FlatLayout::build(numels, options_of(2, 8, 2, LayoutOrder::round_robin));

  REQUIRE(layout.entries()[0].param == 0);
  REQUIRE(layout.entries()[1].param == 2);
  REQUIRE(layout.entries()[2].param == 1);
  REQUIRE(layout.entry_of(2).offset == 4);
  REQUIRE(layout.entry_of(1).offset == 8);
  REQUIRE(layout.shard_numel() == 8);  // params end at 13
}

TEST_CASE("With world size 1 the single shard is the whole padded buffer") {
  const std::vector<std::int64_t> numels = {7, 1, 130};
  const FlatLayout layout =
      FlatLayout::build(numels, options_of(4, 64, 1, LayoutOrder::round_robin));
  const Shard shard = Shard::of(layout, 0);

  REQUIRE(layout.total_numel() == layout.shard_numel());
  REQUIRE(shard.begin == 0);
  REQUIRE(shard.end == layout.total_numel());
  REQUIRE(shard.fragments.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    REQUIRE(shard.fragments[i].param == i);
    REQUIRE(shard.fragments[i].param_offset == 0);
    REQUIRE(shard.fragments[i].shard_offset == layout.entry_of(i).offset);
    REQUIRE(shard.fragments[i].count == numels[i]);
  }
}

TEST_CASE("A param smaller than the world size leaves the later shards as pure padding") {
  const std::vector<std::int64_t> numels = {1};
  const FlatLayout layout = FlatLayout::build(numels, options_of(2, 2, 4));

  REQUIRE(layout.shard_numel() == 1);
  REQUIRE(layout.total_numel() == 4);
  REQUIRE(Shard::of(layout, 0).fragments.size() == 1);
  for (int rank = 1; rank < 4; ++rank) REQUIRE(Shard::of(layout, rank).fragments.empty());
}

TEST_CASE("owners_of splits a range that crosses shards at the shard boundaries") {
  const std::vector<std::int64_t> numels = {10, 10, 10};
  const FlatLayout layout = FlatLayout::build(numels, options_of(2, 4, 3));  // shards of 10
  const std::vector<OwnedRange> pieces = owners_of(layout, 5, 25);

  REQUIRE(pieces.size() == 3);
  REQUIRE((pieces[0].rank == 0 && pieces[0].begin == 5 && pieces[0].end == 10));
  REQUIRE((pieces[1].rank == 1 && pieces[1].begin == 10 && pieces[1].end == 20));
  REQUIRE((pieces[2].rank == 2 && pieces[2].begin == 20 && pieces[2].end == 25));
}

TEST_CASE("owners_of of an empty range has no pieces") {
  const std::vector<std::int64_t> numels = {10, 10, 10};
  const FlatLayout layout = FlatLayout::build(numels, options_of(2, 4, 3));

  REQUIRE(owners_of(layout, 0, 0).empty());
  REQUIRE(owners_of(layout, 17, 17).empty());
  REQUIRE(owners_of(layout, layout.total_numel(), layout.total_numel()).empty());
}

// ---- properties over random shapes -------------------------------------------------------------

TEST_CASE("Every param keeps its numel and entry_of finds its entry") {
  for_each_random_layout([](const RandomShape& shape, const FlatLayout& layout) {
    REQUIRE(layout.param_count() == shape.numels.size());
    for (std::size_t param = 0; param < shape.numels.size(); ++param) {
      REQUIRE(layout.entry_of(param).param == param);
      REQUIRE(layout.entry_of(param).numel == shape.numels[param]);
    }
    REQUIRE(layout.param_numel() ==
            std::accumulate(shape.numels.begin(), shape.numels.end(), std::int64_t{0}));
  });
}

TEST_CASE("Every param starts at an aligned offset") {
  for_each_random_layout([](const RandomShape& shape, const FlatLayout& layout) {
    const auto alignment =
        static_cast<std::int64_t>(shape.options.alignment_bytes / shape.options.element_bytes);
    REQUIRE(layout.alignment_elements() == alignment);
    for (const LayoutEntry& entry : layout.entries()) REQUIRE(entry.offset % alignment == 0);
  });
}

TEST_CASE("Params never overlap and are packed at the first aligned offset after the previous") {
  for_each_random_layout([](const RandomShape&, const FlatLayout& layout) {
    const std::int64_t alignment = layout.alignment_elements();
    std::int64_t previous_end = 0;
    for (const LayoutEntry& entry : layout.entries()) {
      REQUIRE(entry.offset >= previous_end);
      REQUIRE(entry.offset - previous_end < alignment);  // no gap beyond alignment padding
      previous_end = entry.offset + entry.numel;
    }
    REQUIRE(previous_end <= layout.total_numel());
  });
}

TEST_CASE("Declaration order keeps params in the order they were given") {
  for_each_random_layout([](const RandomShape& shape, const FlatLayout& layout) {
    if (shape.options.order != LayoutOrder::declaration) return;
    for (std::size_t i = 0; i < layout.param_count(); ++i) REQUIRE(layout.entries()[i].param == i);
  });
}

TEST_CASE("Round-robin order concatenates buckets i % world_size in rank order") {
  for_each_random_layout([](const RandomShape& shape, const FlatLayout& layout) {
    if (shape.options.order != LayoutOrder::round_robin) return;
    // Expected permutation: indices stably sorted by their bucket.
    std::vector<std::size_t> expected(shape.numels.size());
    std::iota(expected.begin(), expected.end(), std::size_t{0});
    const auto world = static_cast<std::size_t>(shape.options.world_size);
    std::stable_sort(expected.begin(), expected.end(),
                     [&](std::size_t a, std::size_t b) { return a % world < b % world; });
    for (std::size_t i = 0; i < expected.size(); ++i) {
      REQUIRE(layout.entries()[i].param == expected[i]);
    }
  });
}

TEST_CASE("Every shard has the same aligned size and starts at an aligned offset") {
  for_each_random_layout([](const RandomShape& shape, const FlatLayout& layout) {
    const std::int64_t alignment = layout.alignment_elements();
    REQUIRE(layout.shard_numel() % alignment == 0);
    REQUIRE(layout.total_numel() == layout.shard_numel() * shape.options.world_size);
    std::int64_t expected_begin = 0;
    for (const Shard& shard : all_shards(layout)) {
      REQUIRE(shard.begin == expected_begin);
      REQUIRE(shard.begin % alignment == 0);
      REQUIRE(shard.numel() == layout.shard_numel());
      expected_begin = shard.end;
    }
    REQUIRE(expected_begin == layout.total_numel());
  });
}

TEST_CASE("The shard size is the smallest aligned size whose shards cover every param") {
  for_each_random_layout([](const RandomShape& shape, const FlatLayout& layout) {
    const LayoutEntry& last = layout.entries().back();
    const std::int64_t params_end = last.offset + last.numel;
    const int world = shape.options.world_size;
    REQUIRE(layout.shard_numel() * world >= params_end);
    REQUIRE((layout.shard_numel() - layout.alignment_elements()) * world < params_end);
  });
}

TEST_CASE("Fragments lie inside their shard, in flat order, at their param's flat position") {
  for_each_random_layout([](const RandomShape&, const FlatLayout& layout) {
    for (const Shard& shard : all_shards(layout)) {
      std::int64_t previous_end = 0;  // within the shard
      for (const Fragment& fragment : shard.fragments) {
        const LayoutEntry& entry = layout.entry_of(fragment.param);
        REQUIRE(fragment.count > 0);
        REQUIRE(fragment.shard_offset >= previous_end);
        REQUIRE(fragment.shard_offset + fragment.count <= shard.numel());
        REQUIRE(fragment.param_offset >= 0);
        REQUIRE(fragment.param_offset + fragment.count <= entry.numel);
        REQUIRE(shard.begin + fragment.shard_offset == entry.offset + fragment.param_offset);
        previous_end = fragment.shard_offset + fragment.count;
      }
    }
  });
}

TEST_CASE("The fragments of all shards tile every param exactly once") {
  for_each_random_layout([](const RandomShape& shape, const FlatLayout& layout) {
    std::vector<std::vector<Fragment>> pieces(shape.numels.size());
    for (const Shard& shard : all_shards(layout)) {
      for (const Fragment& fragment : shard.fragments) pieces[fragment.param].push_back(fragment);
    }
    for (std::size_t param = 0; param < pieces.size(); ++param) {
      auto& list = pieces[param];
      std::sort(list.begin(), list.end(), [](const Fragment& a, const Fragment& b) {
        return a.param_offset < b.param_offset;
      });
      std::int64_t covered = 0;  // [0, covered) of the param is tiled so far
      for (const Fragment& fragment : list) {
        REQUIRE(fragment.param_offset == covered);
        covered += fragment.count;
      }
      REQUIRE(covered == shape.numels[param]);
    }
  });
}

TEST_CASE("An element-by-element walk of small layouts agrees with the fragments") {
  // Independent oracle: label every flat element with (param, element) from the entries, then
  // check each fragment element against the label and that each is visited once.
  constexpr std::int64_t kMaxWalk = 1 << 16;
  int walked = 0;
  for_each_random_layout([&](const RandomShape&, const FlatLayout& layout) {
    if (layout.total_numel() > kMaxWalk) return;
    ++walked;
    const auto total = static_cast<std::size_t>(layout.total_numel());
    std::vector<std::int64_t> param_of(total, -1);
    std::vector<std::int64_t> element_of(total, -1);
    for (const LayoutEntry& entry : layout.entries()) {
      for (std::int64_t k = 0; k < entry.numel; ++k) {
        param_of[static_cast<std::size_t>(entry.offset + k)] =
            static_cast<std::int64_t>(entry.param);
        element_of[static_cast<std::size_t>(entry.offset + k)] = k;
      }
    }
    std::vector<int> visits(total, 0);
    bool consistent = true;
    for (const Shard& shard : all_shards(layout)) {
      for (const Fragment& fragment : shard.fragments) {
        for (std::int64_t k = 0; k < fragment.count; ++k) {
          const auto flat = static_cast<std::size_t>(shard.begin + fragment.shard_offset + k);
          consistent = consistent && flat < total &&
                       param_of[flat] == static_cast<std::int64_t>(fragment.param) &&
                       element_of[flat] == fragment.param_offset + k;
          if (flat < total) ++visits[flat];
        }
      }
    }
    REQUIRE(consistent);
    for (std::size_t flat = 0; flat < total; ++flat) {
      // Param elements are visited exactly once; padding never.
      if (visits[flat] != (param_of[flat] >= 0 ? 1 : 0)) FAIL("flat element " << flat);
    }
  });
  REQUIRE(walked >= 1000);  // the oracle really ran on a good share of the shapes
}

TEST_CASE("owners_of returns contiguous, exact pieces, one per rank touched, each in its shard") {
  std::mt19937_64 rng(7);
  for_each_random_layout([&](const RandomShape&, const FlatLayout& layout) {
    const std::int64_t total = layout.total_numel();
    // Random ranges, plus ones that start or end exactly on a shard boundary.
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges = {
        {0, total}, {layout.shard_numel(), total}, {0, layout.shard_numel()}};
    for (int i = 0; i < 4; ++i) {
      std::int64_t a = std::uniform_int_distribution<std::int64_t>(0, total)(rng);
      std::int64_t b = std::uniform_int_distribution<std::int64_t>(0, total)(rng);
      ranges.emplace_back(std::min(a, b), std::max(a, b));
    }
    for (const auto& [begin, end] : ranges) {
      const std::vector<OwnedRange> pieces = owners_of(layout, begin, end);
      if (begin == end) {
        REQUIRE(pieces.empty());
        continue;
      }
      REQUIRE(!pieces.empty());
      REQUIRE(pieces.front().begin == begin);
      REQUIRE(pieces.back().end == end);
      REQUIRE(pieces.front().rank == begin / layout.shard_numel());
      for (std::size_t i = 0; i < pieces.size(); ++i) {
        const OwnedRange& piece = pieces[i];
        REQUIRE(piece.begin < piece.end);
        REQUIRE(piece.begin >= piece.rank * layout.shard_numel());
        REQUIRE(piece.end <= (piece.rank + 1) * layout.shard_numel());
        if (i > 0) {
          REQUIRE(piece.begin == pieces[i - 1].end);
          REQUIRE(piece.rank == pieces[i - 1].rank + 1);
        }
      }
    }
  });
}

// ---- errors ------------------------------------------------------------------------------------

TEST_CASE("An alignment that is not a power of two is rejected") {
  const std::vector<std::int64_t> numels = {4};
  const std::string message =
      test::message_of<ConfigError>([&] { FlatLayout::build(numels, options_of(2, 100, 1)); });
  REQUIRE(test::contains(message, "FlatLayout::build"));
  REQUIRE(test::contains(message, "alignment_bytes 100 is not a power of two"));
}

TEST_CASE("An alignment of zero bytes is rejected") {
  const std::vector<std::int64_t> numels = {4};
  const std::string message =
      test::message_of<ConfigError>([&] { FlatLayout::build(numels, options_of(2, 0, 1)); });
  REQUIRE(test::contains(message, "alignment_bytes 0"));
}

TEST_CASE("An alignment smaller than the element size is rejected") {
  const std::vector<std::int64_t> numels = {4};
  const std::string message =
      test::message_of<ConfigError>([&] { FlatLayout::build(numels, options_of(4, 2, 1)); });
  REQUIRE(test::contains(message, "FlatLayout::build"));
  REQUIRE(test::contains(message, "alignment_bytes 2 is smaller than element_bytes 4"));
}

TEST_CASE("An alignment that is not a multiple of the element size is rejected") {
  const std::vector<std::int64_t> numels = {4};
  const std::string message =
      test::message_of<ConfigError>([&] { FlatLayout::build(numels, options_of(3, 4, 1)); });
  REQUIRE(test::contains(message, "alignment_bytes 4 is not a multiple of element_bytes 3"));
}

TEST_CASE("An element size of zero is rejected") {
  const std::vector<std::int64_t> numels = {4};
  const std::string message =
      test::message_of<ConfigError>([&] { FlatLayout::build(numels, options_of(0, 4, 1)); });
  REQUIRE(test::contains(message, "FlatLayout::build: element_bytes is 0"));
}

TEST_CASE("A world size below one is rejected") {
  const std::vector<std::int64_t> numels = {4};
  for (int world_size : {0, -3}) {
    const std::string message = test::message_of<ConfigError>(
        [&] { FlatLayout::build(numels, options_of(2, 8, world_size)); });
    REQUIRE(test::contains(message, "FlatLayout::build"));
    REQUIRE(test::contains(message, "world_size " + std::to_string(world_size)));
  }
}

TEST_CASE("A param with zero elements is rejected, naming its index") {
  const std::vector<std::int64_t> numels = {4, 8, 0, 2};
  const std::string message =
      test::message_of<ConfigError>([&] { FlatLayout::build(numels, options_of(2, 8, 2)); });
  REQUIRE(test::contains(message, "FlatLayout::build"));
  REQUIRE(test::contains(message, "param 2 has numel 0"));
}

TEST_CASE("A param with a negative element count is rejected, naming its index") {
  const std::vector<std::int64_t> numels = {-5, 8};
  const std::string message =
      test::message_of<ConfigError>([&] { FlatLayout::build(numels, options_of(2, 8, 2)); });
  REQUIRE(test::contains(message, "param 0 has numel -5"));
}

TEST_CASE("A layout without params is rejected") {
  const std::vector<std::int64_t> numels;
  const std::string message =
      test::message_of<ConfigError>([&] { FlatLayout::build(numels, options_of(2, 8, 2)); });
  REQUIRE(test::contains(message, "FlatLayout::build: no params"));
}

TEST_CASE("A layout too large for int64 elements is rejected instead of wrapping") {
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  const std::vector<std::int64_t> one_huge = {max};  // fits, but two padded shards do not
  const std::vector<std::int64_t> two_halves = {max / 2 + 1, max / 2 + 1};
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { FlatLayout::build(one_huge, options_of(2, 8, 2)); }),
      "FlatLayout::build"));
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { FlatLayout::build(two_halves, options_of(2, 8, 1)); }),
      "param 1"));
}

TEST_CASE("Shard::of rejects a rank outside the world") {
  const std::vector<std::int64_t> numels = {4, 8};
  const FlatLayout layout = FlatLayout::build(numels, options_of(2, 8, 4));
  for (int rank : {-1, 4, 100}) {
    const std::string message = test::message_of<ConfigError>([&] { Shard::of(layout, rank); });
    REQUIRE(test::contains(message, "Shard::of: rank " + std::to_string(rank)));
  }
}

TEST_CASE("owners_of rejects a range outside the layout or reversed") {
  const std::vector<std::int64_t> numels = {10, 10, 10};
  const FlatLayout layout = FlatLayout::build(numels, options_of(2, 4, 3));  // total 30
  for (auto range : {std::pair<std::int64_t, std::int64_t>{-1, 5}, {5, 3}, {0, 31}, {31, 31}}) {
    const std::string message =
        test::message_of<ConfigError>([&] { owners_of(layout, range.first, range.second); });
    REQUIRE(test::contains(message, "owners_of: range [" + std::to_string(range.first) + ", " +
                                        std::to_string(range.second) + ")"));
  }
}
