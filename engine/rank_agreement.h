// Checks that every rank of an Engine holds the same sequence (its declarations, the gradient
// reductions it issued since the last step), and when they differ finds the first entry that
// does, with the same answer on every rank (internal).
//
// Why: the communicators compare only what a collective carries (kind, count, dtype, op, root),
// and NCCL compares nothing. Two ranks that reduce equal-sized windows of different params would
// add one param's gradient to another's without a word. Every rank hashes its sequence; one
// all-reduce (max of h and of -h: equal everywhere iff max(h) == -max(-h)) compares the hashes,
// and every rank sees the same verdict, so all of them fail together. Only on a mismatch does it
// spend more collectives: a binary search over prefix hashes for the first differing entry,
// then the entry's description from rank 0 and from the lowest rank that differs, so the error
// names both. Hashes keep 52 bits, exact in the doubles the collectives carry.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardswap/buffer.h"
#include "shardswap/checkpoint.h"
#include "shardswap/communicator.h"

namespace shardswap {

/// fnv1a64 (shardswap/checkpoint.h) over the bytes of each value in order, continuing from `h`
/// (start from kFnvOffset). The hashes compared across ranks live only as long as the run.
std::uint64_t fnv1a_words(std::uint64_t h, std::initializer_list<std::int64_t> words);

class RankAgreement {
 public:
  /// The doubles it exchanges at once: the size of `scratch` it needs.
  static constexpr std::size_t kScratchDoubles = 4;
  /// `scratch` is kScratchDoubles doubles of the communicator's memory (the Engine's step
  /// scalars); `space` moves values in and out of it.
  RankAgreement(Communicator& comm, MemorySpace& space, void* scratch)
      : comm_(comm), space_(space), scratch_(scratch) {}

  /// Whether every rank passed the same hashes (a collective: every rank calls it with as many
  /// as the others, at most kScratchDoubles / 2). Element i of the result is true iff hashes[i]
  /// is equal on every rank; every rank gets the same answer.
  std::vector<bool> same_everywhere(std::span<const std::uint64_t> hashes);

  struct Difference {
    std::size_t index = 0;  ///< the first entry at which some rank differs from rank 0
    int rank = 0;           ///< the lowest rank that differs there
    std::string at_rank0;   ///< rank 0's description of its entry `index`
    std::string at_rank;    ///< that rank's description of its entry `index`
  };
  /// `entries` are this rank's per-entry hashes, `describe(i)` describes its entry i (i may be
  /// past the end: say what is missing). Collective; every rank gets the same answer: nothing
  /// if all ranks' sequences are equal (length included).
  std::optional<Difference> first_difference(const std::vector<std::uint64_t>& entries,
                                             const std::function<std::string(std::size_t)>& describe);

 private:
  /// Element-wise max over ranks, in place (at most kScratchDoubles values).
  void max_across(std::span<double> values);
  /// Rank `root`'s `text` on every rank (every rank passes its own).
  std::string text_from(int root, const std::string& text);

  Communicator& comm_;
  MemorySpace& space_;
  void* scratch_;
};

/// The 52 low bits of `h`, exactly representable as a double.
inline double hash_as_double(std::uint64_t h) {
  return static_cast<double>(h & ((std::uint64_t{1} << 52) - 1));
}

}  // namespace shardswap
