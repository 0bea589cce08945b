#include "tools/lm/text_data.h"
#include "memory/quoted.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "shardswap/error.h"

namespace shardswap {

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A uniform integer in [0, n) from 64 random bits (the high half of a 128-bit product).
std::int64_t below(std::uint64_t bits, std::int64_t n) {
  return static_cast<std::int64_t>(
      (static_cast<unsigned __int128>(bits) * static_cast<std::uint64_t>(n)) >> 64);
}

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status))
    throw ConfigError(fmt::format("data.path = {}: no such file", quote_value(path)));
  if (!std::filesystem::is_regular_file(status))
    throw ConfigError(fmt::format("data.path = {}: not a regular file", quote_value(path)));
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError(
        fmt::format("data.path = {}: cannot be opened: {}", quote_value(path), std::strerror(errno)));
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
  if (in.bad()) throw ConfigError(fmt::format("data.path = {}: could not be read", quote_value(path)));
  return bytes;
}

}  // namespace

ByteCorpus::ByteCorpus(const std::string& path, int context, double val_fraction,
                       std::uint64_t seed)
    : path_(path), context_(context), seed_(seed) {
  if (context < 1)
    throw ConfigError(fmt::format("model.context = {}: must be at least 1", context));
  if (!(val_fraction > 0.0 && val_fraction < 1.0))
    throw ConfigError(fmt::format("data.val_fraction = {}: must be in (0, 1)", val_fraction));
  bytes_ = read_file(path);
  const auto total = static_cast<std::int64_t>(bytes_.size());
  const auto val = static_cast<std::int64_t>(std::floor(static_cast<double>(total) * val_fraction));
  train_size_ = total - val;
  if (train_size_ < context + 1 || val < context + 1)
    throw ConfigError(fmt::format(
        "data.path = {}: too small: {} bytes split into {} bytes for training and {} bytes "
        "for validation (data.val_fraction = {}); each needs at least model.context + 1 = {} "
        "bytes",
        quote_value(path), total, train_size_, val, val_fraction, context + 1));
}

void ByteCorpus::append(TokenBatch& batch, std::int64_t at) const {
  const auto* p = bytes_.data() + at;
  batch.context.insert(batch.context.end(), p, p + context_);
  batch.target.push_back(p[context_]);
  ++batch.size;
}

TokenBatch ByteCorpus::train_batch(int rank, std::int64_t step, int micro, int size) const {
  if (size < 1 || rank < 0 || step < 0 || micro < 0)
    throw ConfigError(fmt::format(
        "ByteCorpus::train_batch: rank {}, step {}, micro {}, size {}: size must be at least 1 "
        "and the others not negative",
        rank, step, micro, size));
  std::uint64_t state = splitmix64(seed_);
  for (const std::uint64_t key :
       {static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step),
        static_cast<std::uint64_t>(micro)})
    state = splitmix64(state ^ key);
  const std::int64_t positions = train_size_ - context_;  // starts whose target is in the split
  TokenBatch batch;
  batch.context.reserve(static_cast<std::size_t>(size) * static_cast<std::size_t>(context_));
  batch.target.reserve(static_cast<std::size_t>(size));
  for (int i = 0; i < size; ++i) {
    state += 0x9e3779b97f4a7c15ull;  // the splitmix64 stream
    append(batch, below(splitmix64(state), positions));
  }
  return batch;
}

TokenBatch ByteCorpus::val_batch(int index, int size) const {
  if (size < 1 || index < 0)
    throw ConfigError(fmt::format(
        "ByteCorpus::val_batch: index {}, size {}: size must be at least 1, index not negative",
        index, size));
  const std::int64_t windows = val_windows();
  TokenBatch batch;
  batch.context.reserve(static_cast<std::size_t>(size) * static_cast<std::size_t>(context_));
  batch.target.reserve(static_cast<std::size_t>(size));
  for (int i = 0; i < size; ++i) {
    const std::int64_t k = (static_cast<std::int64_t>(index) * size + i) % windows;
    append(batch, train_size_ + k * (context_ + 1));
  }
  return batch;
}

}  // namespace shardswap
