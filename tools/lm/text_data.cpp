#include "tools/lm/text_data.h"
#include "memory/file_kind.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <string_view>

#include "memory/quoted.h"
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

[[noreturn]] void refuse(const std::string& path, std::string_view why) {
  throw ConfigError(fmt::format("data.path = {}: {}", quote_value(path), why));
}

void require_regular(const std::string& path, const struct stat& st) {
  if (!S_ISREG(st.st_mode))
    refuse(path, fmt::format("not a regular file ({})", file_kind(st.st_mode)));
}

}  // namespace

struct ByteCorpus::Mapping {
  void* data = nullptr;
  std::size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data != nullptr) ::munmap(data, size);
  }
};

ByteCorpus::ByteCorpus(const std::string& path, int context, double val_fraction,
                       std::uint64_t seed)
    : path_(path), context_(context), seed_(seed) {
  if (context < 1)
    throw ConfigError(fmt::format("model.context = {}: must be at least 1", context));
  if (!(val_fraction > 0.0 && val_fraction < 1.0))
    throw ConfigError(fmt::format("data.val_fraction = {}: must be in (0, 1)", val_fraction));
  // A FIFO or device is refused from stat() before it is opened (a FIFO's open blocks until a
  // writer comes, and opening some devices acts), then checked again once open, in case the path
  // was replaced in between.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) refuse(path, "no such file");
    refuse(path, fmt::format("cannot be opened: {}", std::strerror(errno)));
  }
  require_regular(path, st);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) refuse(path, fmt::format("cannot be opened: {}", std::strerror(errno)));
  auto mapping = std::make_shared<Mapping>();
  {
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }  // the mapping outlives the descriptor
    } closer{fd};
    if (::fstat(fd, &st) != 0)
      refuse(path, fmt::format("cannot be opened: {}", std::strerror(errno)));
    require_regular(path, st);
    mapping->size = static_cast<std::size_t>(st.st_size);
    if (mapping->size > 0) {
      void* p = ::mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED)
        refuse(path,
               fmt::format("cannot be mapped ({} bytes): {}", mapping->size, std::strerror(errno)));
      mapping->data = p;
      // Samples start at random positions: read-ahead would fetch pages no sample uses.
      ::madvise(p, mapping->size, MADV_RANDOM);
    }
  }
  bytes_ = static_cast<const std::uint8_t*>(mapping->data);
  size_ = static_cast<std::int64_t>(mapping->size);
  file_ = std::move(mapping);
  const auto total = size_;
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
  const auto* p = bytes_ + at;
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
