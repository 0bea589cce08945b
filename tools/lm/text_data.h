// Training data of the byte LM: any file as a sequence of bytes, split into a training part and
// a validation tail. Batches are pure functions of their arguments, so a resumed run (or another
// rank, or a rerun) sees exactly the same samples.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tools/lm/byte_lm.h"

namespace shardswap {

class ByteCorpus {
 public:
  /// Maps the file at `path` (config key data.path) read-only: nothing is read here, so a corpus
  /// is cheap to construct (and construct again), and a file larger than memory costs address
  /// space, its pages read as samples touch them. Its last floor(size * val_fraction) bytes are
  /// the validation split, the rest the training split. Throws ConfigError naming data.path and
  /// the file when it is missing, not a regular file (a FIFO, device or directory: refused
  /// without being opened), cannot be opened or mapped, or is too small (either split shorter
  /// than context + 1 bytes); naming data.val_fraction when val_fraction is not in (0, 1); for
  /// context < 1. The file must not shrink while the corpus exists (a mapped page past its end
  /// reads as SIGBUS). Copies share the mapping.
  ByteCorpus(const std::string& path, int context, double val_fraction = 0.1,
             std::uint64_t seed = 1);

  /// `size` samples at positions drawn uniformly from the training split by a splitmix64 stream
  /// seeded from (seed, rank, step, micro): the same batch for the same arguments on every
  /// platform. Throws ConfigError for size < 1 or a negative rank, step or micro.
  TokenBatch train_batch(int rank, std::int64_t step, int micro, int size) const;
  /// A fixed slice of the validation split: the split is cut into val_windows() non-overlapping
  /// windows of context + 1 bytes; sample i of batch `index` is window (index * size + i) mod
  /// val_windows(), so batches 0, 1, ... walk through the split in order and wrap around.
  /// Throws ConfigError for size < 1 or index < 0.
  TokenBatch val_batch(int index, int size) const;

  std::int64_t size() const { return size_; }
  std::int64_t train_size() const { return train_size_; }
  std::int64_t val_size() const { return size() - train_size_; }
  std::int64_t val_windows() const { return val_size() / (context_ + 1); }
  int context() const { return context_; }
  const std::string& path() const { return path_; }

 private:
  // Appends the sample starting at byte `at` to the batch.
  void append(TokenBatch& batch, std::int64_t at) const;

  struct Mapping;  // the file's read-only mapping, unmapped when the last corpus using it goes

  std::string path_;
  int context_;
  std::uint64_t seed_;
  std::shared_ptr<const Mapping> file_;
  const std::uint8_t* bytes_ = nullptr;
  std::int64_t size_ = 0;
  std::int64_t train_size_ = 0;
};

}  // namespace shardswap
