#include "engine/rank_agreement.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "shardswap/error.h"

namespace shardswap {

std::uint64_t fnv1a_words(std::uint64_t h, std::initializer_list<std::int64_t> words) {
  for (const std::int64_t w : words) h = fnv1a64(&w, sizeof w, h);
  return h;
}

void RankAgreement::max_across(std::span<double> values) {
  space_.upload(scratch_, values.data(), values.size_bytes());
  comm_.all_reduce(scratch_, values.size(), DType::f64, ReduceOp::max);
  space_.download(values.data(), scratch_, values.size_bytes());
  comm_.check();  // an aborted collective leaves garbage in the buffer: say so before using it
}

std::vector<bool> RankAgreement::same_everywhere(std::span<const std::uint64_t> hashes) {
  double values[kScratchDoubles];
  const std::size_t n = hashes.size();
  if (2 * n > kScratchDoubles)
    throw Error(fmt::format("RankAgreement::same_everywhere: {} hashes at once, at most {}", n,
                            kScratchDoubles / 2));
  for (std::size_t i = 0; i < n; ++i) {
    values[2 * i] = hash_as_double(hashes[i]);
    values[2 * i + 1] = -values[2 * i];
  }
  max_across({values, 2 * n});
  std::vector<bool> same(n);
  for (std::size_t i = 0; i < n; ++i) same[i] = values[2 * i] == -values[2 * i + 1];
  return same;
}

std::string RankAgreement::text_from(int root, const std::string& text) {
  // Six bytes a double (48 bits: exact), kScratchDoubles doubles a broadcast; the length first.
  // Descriptions are short: clipped to 240 bytes, at most ten broadcasts.
  constexpr std::size_t kMaxBytes = 240, kPerDouble = 6;
  const std::string mine = text.substr(0, kMaxBytes);
  double values[kScratchDoubles] = {static_cast<double>(mine.size())};
  const auto broadcast = [&] {
    space_.upload(scratch_, values, sizeof values);
    comm_.broadcast(scratch_, kScratchDoubles, DType::f64, root);
    space_.download(values, scratch_, sizeof values);
    comm_.check();
  };
  broadcast();
  const auto length = static_cast<std::size_t>(std::clamp(values[0], 0.0, double(kMaxBytes)));
  std::string out(length, '\0');
  for (std::size_t at = 0; at < length; at += kScratchDoubles * kPerDouble) {
    for (std::size_t d = 0; d < kScratchDoubles; ++d) {
      std::uint64_t word = 0;
      for (std::size_t b = 0; b < kPerDouble; ++b) {
        const std::size_t i = at + d * kPerDouble + b;
        const auto byte = i < mine.size() ? static_cast<unsigned char>(mine[i]) : 0u;
        word |= std::uint64_t{byte} << (8 * b);
      }
      values[d] = static_cast<double>(word);
    }
    broadcast();
    for (std::size_t d = 0; d < kScratchDoubles; ++d) {
      const auto word = static_cast<std::uint64_t>(values[d]);
      for (std::size_t b = 0; b < kPerDouble; ++b) {
        const std::size_t i = at + d * kPerDouble + b;
        if (i < length) out[i] = static_cast<char>((word >> (8 * b)) & 0xff);
      }
    }
  }
  return out;
}

std::optional<RankAgreement::Difference> RankAgreement::first_difference(
    const std::vector<std::uint64_t>& entries,
    const std::function<std::string(std::size_t)>& describe) {
  // Prefix k: the first k entries, an entry past this rank's end reading as "absent" (so two
  // sequences of which one is the other's beginning differ at the shorter one's end).
  constexpr std::uint64_t kAbsent = 0x9e3779b97f4a7c15ull;
  const auto prefix = [&](std::size_t k) {
    std::uint64_t h = kFnvOffset;
    for (std::size_t i = 0; i < k; ++i) {
      const std::uint64_t e = i < entries.size() ? entries[i] : kAbsent;
      h = fnv1a64(&e, sizeof e, h);
    }
    return h;
  };
  double longest[2] = {static_cast<double>(entries.size()), 0.0};
  max_across({longest, 2});
  const auto n = static_cast<std::size_t>(longest[0]);
  const std::uint64_t whole = prefix(n);
  if (same_everywhere({&whole, 1})[0]) return std::nullopt;
  // Prefix lo agrees everywhere, prefix hi does not: every rank takes the same branches.
  std::size_t lo = 0, hi = n;
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    const std::uint64_t h = prefix(mid);
    (same_everywhere({&h, 1})[0] ? lo : hi) = mid;
  }
  Difference d;
  d.index = lo;
  // Rank 0's entry, then the lowest rank whose entry differs from it (max of -rank).
  double entry0[kScratchDoubles] = {};
  const std::uint64_t mine = lo < entries.size() ? entries[lo] : kAbsent;
  entry0[0] = hash_as_double(mine);
  space_.upload(scratch_, entry0, sizeof entry0);
  comm_.broadcast(scratch_, kScratchDoubles, DType::f64, 0);
  space_.download(entry0, scratch_, sizeof entry0);
  comm_.check();
  double differing[2] = {hash_as_double(mine) != entry0[0] ? -static_cast<double>(comm_.rank())
                                                           : -std::numeric_limits<double>::max(),
                         0.0};
  max_across({differing, 2});
  d.rank = differing[0] == -std::numeric_limits<double>::max()
               ? 0  // equal to rank 0 everywhere at this entry: unreachable when prefixes differ
               : static_cast<int>(-differing[0]);
  const std::string own = describe(lo);
  d.at_rank0 = text_from(0, own);
  d.at_rank = text_from(d.rank, own);
  return d;
}

}  // namespace shardswap
