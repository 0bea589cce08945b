// Training data of the byte LM: any file as a sequence of bytes, split into a training part and
// a validation tail. Batches are pure functions of their arguments, so a resumed run (or another
// rank, or a rerun) sees exactly the same samples.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tools/lm/byte_lm.h"

namespace shardswap {

class ByteCorpus {
 public:
  /// Reads the whole file at `path` (config key data.path). Its last
  /// floor(size * val_fraction) bytes are the validation split, the rest the training split.
  /// Throws ConfigError naming data.path and the file when it is missing, not a regular file,
  /// unreadable, or too small (either split shorter than context + 1 bytes); naming
  /// data.val_fraction when val_fraction is not in (0, 1); for context < 1.
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

  std::int64_t size() const { return static_cast<std::int64_t>(bytes_.size()); }
  std::int64_t train_size() const { return train_size_; }
  std::int64_t val_size() const { return size() - train_size_; }
  std::int64_t val_windows() const { return val_size() / (context_ + 1); }
  int context() const { return context_; }
  const std::string& path() const { return path_; }

 private:
  // Appends the sample starting at byte `at` to the batch.
  void append(TokenBatch& batch, std::int64_t at) const;

  std::string path_;
  int context_;
  std::uint64_t seed_;
  std::vector<std::uint8_t> bytes_;
  std::int64_t train_size_ = 0;
};

}  // namespace shardswap
