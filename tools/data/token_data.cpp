#include "data/token_data.h"

#include <fmt/format.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string_view>
#include <utility>

#include "shardswap/error.h"
#include "support/quoted.h"
#include "files/output_file.h"

namespace shardswap {

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint32_t read_le32(const std::uint8_t* p) {
  return std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 |
         std::uint32_t{p[3]} << 24;
}

std::uint32_t token_at(const std::uint8_t* tokens, int width, std::int64_t i) {
  const std::uint8_t* p = tokens + i * width;
  switch (width) {
    case 1:
      return p[0];
    case 2:
      return std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8;
    default:
      return read_le32(p);
  }
}

// The index of the first of `count` little-endian T at `tokens` that is not below `vocab`, or -1.
// Blocks are scanned for their maximum first (a loop the compiler vectorizes): a file of
// billions of tokens is checked at memory speed.
template <class T>
std::int64_t first_not_below(const std::uint8_t* tokens, std::int64_t count, int vocab) {
  const auto limit = static_cast<std::uint32_t>(vocab);
  if constexpr (std::endian::native != std::endian::little) {
    for (std::int64_t i = 0; i < count; ++i)
      if (token_at(tokens, static_cast<int>(sizeof(T)), i) >= limit) return i;
    return -1;
  }
  constexpr std::int64_t kBlock = 1 << 16;
  for (std::int64_t start = 0; start < count; start += kBlock) {
    const std::int64_t n = std::min(kBlock, count - start);
    const std::uint8_t* p = tokens + start * static_cast<std::int64_t>(sizeof(T));
    T top = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, p + i * static_cast<std::int64_t>(sizeof(T)), sizeof(T));
      top = std::max(top, v);
    }
    if (top < limit) continue;
    for (std::int64_t i = 0; i < n; ++i)
      if (token_at(tokens, static_cast<int>(sizeof(T)), start + i) >= limit) return start + i;
  }
  return -1;
}

[[noreturn]] void refuse(const std::string& where, std::string_view why) {
  throw ConfigError(fmt::format("{}: {}", where, why));
}

bool has_glob_characters(const std::string& pattern) {
  return pattern.find_first_of("*?[") != std::string::npos;
}

// The files a data.* value names: itself when it has no glob characters (so that a missing file
// reads "no such file" and not "no match"), else its matches sorted by name, bytewise (glob's
// own order follows the locale).
std::vector<std::string> expand(const std::string& key, const std::string& pattern) {
  if (pattern.empty()) throw ConfigError(fmt::format("{}: is empty", key));
  if (!has_glob_characters(pattern)) return {pattern};
  glob_t found{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR | GLOB_NOSORT, nullptr, &found);
  const int glob_errno = errno;  // what stopped a GLOB_ABORTED walk, before globfree
  std::vector<std::string> paths;
  if (rc == 0)
    for (std::size_t i = 0; i < found.gl_pathc; ++i) paths.emplace_back(found.gl_pathv[i]);
  ::globfree(&found);
  if (rc == GLOB_NOMATCH || (rc == 0 && paths.empty()))
    throw ConfigError(fmt::format("{} = {}: no file matches", key, quote_value(pattern)));
  if (rc == GLOB_ABORTED)
    throw ConfigError(fmt::format("{} = {}: a folder on the way cannot be read: {}", key,
                                  quote_value(pattern), std::strerror(glob_errno)));
  if (rc != 0)
    throw ConfigError(
        fmt::format("{} = {}: cannot be expanded (glob error {})", key, quote_value(pattern), rc));
  std::sort(paths.begin(), paths.end());
  return paths;
}

// What errors about `path` start with: the key, its value and, for a glob, the file.
// A file matched by both data.train and data.val (by identity: another spelling of the path,
// or a hard link, is the same file) would be trained on and then validated on.
void refuse_overlap(const TokenDataSpec& spec, const std::vector<std::string>& train,
                    const std::vector<std::string>& val) {
  struct stat st {};
  std::map<std::pair<dev_t, ino_t>, std::string> trained;
  for (const auto& path : train)
    if (::stat(path.c_str(), &st) == 0) trained.emplace(std::pair{st.st_dev, st.st_ino}, path);
  for (const auto& path : val) {
    if (::stat(path.c_str(), &st) != 0) continue;  // the opening names what is wrong with it
    const auto it = trained.find({st.st_dev, st.st_ino});
    if (it != trained.end())
      throw ConfigError(fmt::format(
          "data.val = {}: {} is also a training file (data.train = {} matches {}): the "
          "validation loss would be measured on data the model trains on",
          quote_value(spec.val), quote_value(path), quote_value(spec.train),
          quote_value(it->second)));
  }
}

std::string where_of(const std::string& key, const std::string& pattern, const std::string& path) {
  if (pattern == path) return fmt::format("{} = {}", key, quote_value(pattern));
  return fmt::format("{} = {}: {}", key, quote_value(pattern), quote_value(path));
}

}  // namespace

TokenFile TokenFile::open_llmc(const std::string& path, int vocab, const std::string& where_arg) {
  const std::string where = where_arg.empty() ? quote_value(path) : where_arg;
  if (vocab < 1) throw ConfigError(fmt::format("TokenFile::open_llmc: vocab {} < 1", vocab));
  auto mapping = MappedFile::open(path, where);
  const auto size = static_cast<std::int64_t>(mapping->size());
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(mapping->data());
  if (size < kTokenFileHeaderBytes)
    refuse(where, fmt::format("not a token file ({} bytes, shorter than the {}-byte header)", size,
                              kTokenFileHeaderBytes));
  const auto magic = static_cast<std::int32_t>(read_le32(bytes));
  if (magic != kTokenFileMagic)
    refuse(where, fmt::format("not a token file (magic {}, expected {})", magic, kTokenFileMagic));
  const auto version = static_cast<std::int32_t>(read_le32(bytes + 4));
  if (version != 1 && version != 2)
    refuse(where, fmt::format("token file version {}: supported are 1 (uint16 tokens) and 2 "
                              "(uint32 tokens)",
                              version));
  const auto count = static_cast<std::int32_t>(read_le32(bytes + 8));
  if (count < 0) refuse(where, fmt::format("token count {} in the header is negative", count));
  const auto flags = static_cast<std::int32_t>(read_le32(bytes + 12));
  if ((flags & ~kTokenFileMaskFlag) != 0)
    refuse(where, fmt::format("header[3] = {}: flags this reader does not know (1: a loss mask)",
                              flags));
  const bool masked = (flags & kTokenFileMaskFlag) != 0;
  const int width = version == 1 ? 2 : 4;
  const std::int64_t expected =
      kTokenFileHeaderBytes + std::int64_t{count} * width + (masked ? std::int64_t{count} : 0);
  if (size != expected)
    refuse(where, fmt::format("{}: {} bytes, but the header's {} tokens of {} bytes{} make {}",
                              size < expected ? "truncated" : "trailing bytes", size, count, width,
                              masked ? " and their mask bytes" : "", expected));
  const std::uint8_t* tokens = bytes + kTokenFileHeaderBytes;
  // Every id is checked here, once, so that a batch never carries one the model cannot embed.
  mapping->advise(MADV_SEQUENTIAL);
  const std::int64_t bad = width == 2 ? first_not_below<std::uint16_t>(tokens, count, vocab)
                                      : first_not_below<std::uint32_t>(tokens, count, vocab);
  if (bad >= 0)
    refuse(where, fmt::format("token {} (at index {}) is not below the vocab size {}",
                              token_at(tokens, width, bad), bad, vocab));
  // Shuffled samples touch pages in no order: read-ahead would fetch pages no sample uses.
  mapping->advise(MADV_RANDOM);
  TokenFile f;
  f.path_ = path;
  f.tokens_ = tokens;
  f.mask_ = masked ? tokens + std::int64_t{count} * width : nullptr;
  f.count_ = count;
  f.width_ = width;
  f.file_ = std::move(mapping);
  return f;
}

TokenFile TokenFile::open_bytes(const std::string& path, const std::string& where_arg) {
  const std::string where = where_arg.empty() ? quote_value(path) : where_arg;
  auto mapping = MappedFile::open(path, where);
  // An llm.c token file read as bytes would train on its header and its tokens' bytes: refused
  // when the whole header agrees (magic, version, and a size that its count explains).
  const auto size = static_cast<std::int64_t>(mapping->size());
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(mapping->data());
  if (size >= kTokenFileHeaderBytes &&
      static_cast<std::int32_t>(read_le32(bytes)) == kTokenFileMagic) {
    const auto version = static_cast<std::int32_t>(read_le32(bytes + 4));
    const auto count = static_cast<std::int32_t>(read_le32(bytes + 8));
    const bool masked = static_cast<std::int32_t>(read_le32(bytes + 12)) == kTokenFileMaskFlag;
    if ((version == 1 || version == 2) && count >= 0 &&
        size == kTokenFileHeaderBytes + std::int64_t{count} * (version == 1 ? 2 : 4) +
                    (masked ? std::int64_t{count} : 0))
      refuse(where, fmt::format("an llm.c token file (version {}, {} tokens), but "
                                "data.tokenizer = \"bytes\" would train on its bytes, header "
                                "included: set data.tokenizer \"llmc\"",
                                version, count));
  }
  mapping->advise(MADV_RANDOM);
  TokenFile f;
  f.path_ = path;
  f.tokens_ = bytes;
  f.count_ = static_cast<std::int64_t>(mapping->size());
  f.width_ = 1;
  f.file_ = std::move(mapping);
  return f;
}

std::int32_t TokenFile::operator[](std::int64_t i) const {
  return static_cast<std::int32_t>(token_at(tokens_, width_, i));
}

void TokenFile::copy(std::int64_t begin, std::int64_t count, std::int32_t* out) const {
  if (begin < 0 || count < 0 || begin > count_ - count)
    throw ConfigError(fmt::format("TokenFile::copy: tokens [{}, {}) of {} in {}", begin,
                                  begin + count, count_, quote_value(path_)));
  for (std::int64_t i = 0; i < count; ++i)
    out[i] = static_cast<std::int32_t>(token_at(tokens_, width_, begin + i));
}

namespace {
// Whether the loss is on a token as a target, from its mask byte.
bool counted_byte(std::uint8_t m, bool apart) {
  return (m & kMaskTarget) != 0 && !(apart && (m & kMaskDocumentStart) != 0);
}
}  // namespace

std::int64_t TokenFile::counted_targets(std::int64_t begin, std::int64_t count, bool apart) const {
  if (begin < 0 || count < 0 || begin > count_ - count)
    throw ConfigError(fmt::format("TokenFile::counted_targets: tokens [{}, {}) of {} in {}", begin,
                                  begin + count, count_, quote_value(path_)));
  if (mask_ == nullptr) return count;
  std::int64_t counted = 0;
  for (std::int64_t i = begin; i < begin + count; ++i) counted += counted_byte(mask_[i], apart);
  return counted;
}

void TokenFile::copy_targets(std::int64_t begin, std::int64_t count, std::int32_t* out,
                             bool apart) const {
  copy(begin, count, out);
  if (mask_ == nullptr) return;
  for (std::int64_t i = 0; i < count; ++i)
    if (!counted_byte(mask_[begin + i], apart)) out[i] = lm::dec::kIgnoredTarget;
}

void TokenFile::copy_positions(std::int64_t begin, std::int64_t count, std::int32_t* out) const {
  if (begin < 0 || count < 0 || begin > count_ - count || mask_ == nullptr)
    throw ConfigError(fmt::format("TokenFile::copy_positions: tokens [{}, {}) of {} in {}{}",
                                  begin, begin + count, count_, quote_value(path_),
                                  mask_ == nullptr ? ", which marks no documents" : ""));
  for (std::int64_t i = 0; i < count; ++i)
    out[i] = i == 0 || (mask_[begin + i] & kMaskDocumentStart) != 0 ? 0 : out[i - 1] + 1;
}

void write_token_file(const std::string& path, std::span<const std::uint32_t> tokens, int version,
                      std::span<const std::uint8_t> mask) {
  if (!mask.empty() && mask.size() != tokens.size())
    throw ConfigError(fmt::format("write_token_file {}: {} mask bytes for {} tokens",
                                  quote_value(path), mask.size(), tokens.size()));
  if (version != 1 && version != 2)
    throw ConfigError(
        fmt::format("write_token_file {}: version {}: must be 1 (uint16) or 2 "
                    "(uint32)",
                    quote_value(path), version));
  if (tokens.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    throw ConfigError(fmt::format("write_token_file {}: {} tokens: the header counts at most {}",
                                  quote_value(path), tokens.size(),
                                  std::numeric_limits<std::int32_t>::max()));
  const int width = version == 1 ? 2 : 4;
  std::vector<std::uint8_t> bytes(
      static_cast<std::size_t>(kTokenFileHeaderBytes) + tokens.size() * width + mask.size(), 0);
  const auto put32 = [&](std::size_t at, std::uint32_t v) {
    for (int b = 0; b < 4; ++b) bytes[at + b] = static_cast<std::uint8_t>(v >> (8 * b));
  };
  put32(0, static_cast<std::uint32_t>(kTokenFileMagic));
  put32(4, static_cast<std::uint32_t>(version));
  put32(8, static_cast<std::uint32_t>(tokens.size()));
  if (!mask.empty()) put32(12, static_cast<std::uint32_t>(kTokenFileMaskFlag));
  std::copy(mask.begin(), mask.end(),
            bytes.begin() + kTokenFileHeaderBytes + static_cast<std::int64_t>(tokens.size()) * width);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::uint32_t id = tokens[i];
    if (version == 1 && id > 0xffffu)
      throw ConfigError(
          fmt::format("write_token_file {}: token {} (at index {}) does not fit "
                      "version 1's uint16; use version 2",
                      quote_value(path), id, i));
    const std::size_t at = static_cast<std::size_t>(kTokenFileHeaderBytes) + i * width;
    for (int b = 0; b < width; ++b) bytes[at + b] = static_cast<std::uint8_t>(id >> (8 * b));
  }
  OutputFile out("write_token_file", path);
  out.write(bytes.data(), bytes.size());
  out.commit();
}

std::int64_t shuffled_index(std::uint64_t seed, std::uint64_t epoch, std::int64_t p,
                            std::int64_t n) {
  if (n < 1 || p < 0 || p >= n)
    throw ConfigError(fmt::format("shuffled_index: p {} of n {}: needs 0 <= p < n", p, n));
  if (n == 1) return 0;
  // A balanced Feistel network permutes [0, 4^half) whatever its round function; the smallest
  // such domain holding n is below 4n, so cycle-walking (apply again until the value is below n,
  // which restricts the permutation to [0, n)) takes fewer than 4 rounds on average.
  int bits = 0;
  while (bits < 64 && (std::uint64_t{1} << bits) < static_cast<std::uint64_t>(n)) ++bits;
  const int half = (bits + 1) / 2;
  const std::uint64_t mask = (std::uint64_t{1} << half) - 1;
  const std::uint64_t key = splitmix64(splitmix64(seed) ^ epoch);
  constexpr int kRounds = 6;
  std::uint64_t round_key[kRounds];
  for (int r = 0; r < kRounds; ++r) round_key[r] = splitmix64(key + static_cast<std::uint64_t>(r));
  auto x = static_cast<std::uint64_t>(p);
  do {
    std::uint64_t left = x >> half, right = x & mask;
    for (int r = 0; r < kRounds; ++r) {
      const std::uint64_t mixed = left ^ (splitmix64(right ^ round_key[r]) & mask);
      left = right;
      right = mixed;
    }
    x = left << half | right;
  } while (x >= static_cast<std::uint64_t>(n));
  return static_cast<std::int64_t>(x);
}

void TokenDataset::add(Split& split, TokenFile file, std::int64_t begin,
                       std::int64_t length) const {
  // Sample j reads tokens [j L, j L + L + 1): (length - 1) / L of them fit.
  const std::int64_t samples = length > 0 ? (length - 1) / seq_len_ : 0;
  split.first.push_back(split.samples);
  split.samples += samples;
  split.streams.push_back(Stream{std::move(file), begin, length});
}

TokenDataSpec token_data_spec_from_json(ConfigReader& c) {
  TokenDataSpec spec;
  const auto seq_len = c.integer("data.seq_len", 128);
  if (seq_len < 1 || seq_len > (1 << 20))
    c.fail("data.seq_len", fmt::format("{}", seq_len), "must lie in [1, 1048576]");
  spec.seq_len = static_cast<int>(seq_len);
  const auto tokenizer = c.string("data.tokenizer", "llmc");
  if (tokenizer != "llmc" && tokenizer != "bytes")
    c.fail("data.tokenizer", quote_value(tokenizer),
           "expected \"llmc\" (token files in llm.c's format) or \"bytes\"");
  spec.bytes = tokenizer == "bytes";
  spec.train = c.string("data.train", "");
  if (spec.train.empty()) c.fail("data.train", "is required for model.type \"decoder\"");
  spec.val = c.string("data.val", "");
  spec.val_fraction = c.number("data.val_fraction", spec.val_fraction);
  if (c.has("data.documents")) {
    const auto documents = c.string("data.documents", "");
    if (documents != "apart" && documents != "packed")
      c.fail("data.documents", quote_value(documents),
             "expected \"apart\" (attention and positions restart at each document) or "
             "\"packed\" (one stream per sequence)");
    spec.documents_apart = documents == "apart";
  }
  return spec;
}

std::vector<std::string> token_data_files(const TokenDataSpec& spec) {
  std::vector<std::string> files = expand("data.train", spec.train);
  if (!spec.val.empty())
    for (auto& f : expand("data.val", spec.val)) files.push_back(std::move(f));
  return files;
}

TokenDataset::TokenDataset(const TokenDataSpec& spec)
    : seq_len_(spec.seq_len), vocab_(spec.vocab), seed_(spec.seed) {
  if (spec.seq_len < 1)
    throw ConfigError(fmt::format("TokenDataset: seq_len {}: must be at least 1", spec.seq_len));
  if (spec.vocab < 1)
    throw ConfigError(fmt::format("TokenDataset: vocab {}: must be at least 1", spec.vocab));
  const auto open = [&](const std::string& key, const std::string& pattern,
                        const std::string& path) {
    const std::string where = where_of(key, pattern, path);
    return spec.bytes ? TokenFile::open_bytes(path, where)
                      : TokenFile::open_llmc(path, spec.vocab, where);
  };
  if (spec.bytes && spec.vocab < 256)
    throw ConfigError(
        fmt::format("data.tokenizer = \"bytes\": byte tokens need a vocab of 256, "
                    "the model's vocab size is {}",
                    spec.vocab));
  const std::vector<std::string> train_paths = expand("data.train", spec.train);
  const bool split_tail = spec.bytes && spec.val.empty();
  if (split_tail) {
    if (!(spec.val_fraction > 0.0 && spec.val_fraction < 1.0))
      throw ConfigError(
          fmt::format("data.val_fraction = {}: must be in (0, 1)", spec.val_fraction));
    if (train_paths.size() != 1)
      throw ConfigError(fmt::format(
          "data.train = {}: {} files match; the byte tokenizer takes its validation tail from "
          "one file: name one, or set data.val",
          quote_value(spec.train), train_paths.size()));
    TokenFile file = open("data.train", spec.train, train_paths[0]);
    const std::int64_t total = file.size();
    const auto val =
        static_cast<std::int64_t>(std::floor(static_cast<double>(total) * spec.val_fraction));
    const std::int64_t train = total - val;
    if (train < seq_len_ + 1 || val < seq_len_ + 1)
      throw ConfigError(
          fmt::format("{}: too small: {} bytes split into {} for training and {} for validation "
                      "(data.val_fraction = {}); each needs at least seq_len + 1 = {}",
                      where_of("data.train", spec.train, train_paths[0]), total, train, val,
                      spec.val_fraction, seq_len_ + 1));
    add(train_, file, 0, train);
    add(val_, std::move(file), train, val);
    if (spec.documents_apart.value_or(false))
      throw ConfigError(
          "data.documents = \"apart\": data.tokenizer = \"bytes\" reads no document starts; "
          "token files from tools/data/tokenize_data.py --chat mark them");
    return;
  }
  const auto too_short = [&](const char* key, const std::string& pattern, const Split& split) {
    std::int64_t tokens = 0;
    for (const auto& s : split.streams) tokens += s.length;
    return ConfigError(fmt::format(
        "{} = {}: {} tokens in {} file(s) make no sample: each reads seq_len + 1 = {} tokens of "
        "one file",
        key, quote_value(pattern), tokens, split.streams.size(), seq_len_ + 1));
  };
  const std::vector<std::string> val_paths =
      spec.val.empty() ? std::vector<std::string>{} : expand("data.val", spec.val);
  refuse_overlap(spec, train_paths, val_paths);
  for (const auto& path : train_paths) {
    TokenFile file = open("data.train", spec.train, path);
    const std::int64_t length = file.size();
    add(train_, std::move(file), 0, length);
  }
  if (train_.samples == 0) throw too_short("data.train", spec.train, train_);
  if (!spec.val.empty()) {
    for (const auto& path : val_paths) {
      TokenFile file = open("data.val", spec.val, path);
      const std::int64_t length = file.size();
      add(val_, std::move(file), 0, length);
    }
    if (val_.samples == 0) throw too_short("data.val", spec.val, val_);
  }
  // Documents apart need every file's document starts (its mask).
  const Stream* unmarked = nullptr;
  for (const Split* split : {&train_, &val_})
    for (const Stream& s : split->streams)
      if (unmarked == nullptr && !s.file.has_mask()) unmarked = &s;
  if (spec.documents_apart.value_or(false) && unmarked != nullptr)
    throw ConfigError(fmt::format(
        "data.documents = \"apart\": {} marks no document starts (no loss mask); token files "
        "from tools/data/tokenize_data.py --chat mark them, or set data.documents = \"packed\"",
        quote_value(unmarked->file.path())));
  apart_ = spec.documents_apart.value_or(unmarked == nullptr);
}

TokenDataset::Place TokenDataset::place_of(const Split& split, std::int64_t sample) const {
  // The stream holding the sample: the last whose first sample is not above it. Streams without
  // samples share their successor's first index and are skipped by upper_bound.
  const auto it = std::upper_bound(split.first.begin(), split.first.end(), sample);
  const auto s = static_cast<std::size_t>(it - split.first.begin()) - 1;
  const Stream& stream = split.streams[s];
  return {&stream, stream.begin + (sample - split.first[s]) * seq_len_};
}

void TokenDataset::append(const Split& split, std::int64_t sample, TokenSequences& out) const {
  const auto [stream_ptr, at] = place_of(split, sample);
  const Stream& stream = *stream_ptr;
  const std::size_t row = out.inputs.size();
  out.inputs.resize(row + static_cast<std::size_t>(seq_len_));
  out.targets.resize(row + static_cast<std::size_t>(seq_len_));
  stream.file.copy(at, seq_len_, out.inputs.data() + row);
  stream.file.copy_targets(at + 1, seq_len_, out.targets.data() + row, apart_);
  if (apart_) {
    out.positions.resize(row + static_cast<std::size_t>(seq_len_));
    stream.file.copy_positions(at, seq_len_, out.positions.data() + row);
  }
  ++out.sequences;
}

bool TokenDataset::val_masked() const {
  return std::any_of(val_.streams.begin(), val_.streams.end(),
                     [](const Stream& s) { return s.file.has_mask(); });
}

std::int64_t TokenDataset::counted_targets(std::int64_t step, int global_batch) const {
  const bool masked = std::any_of(train_.streams.begin(), train_.streams.end(),
                                  [](const Stream& s) { return s.file.has_mask(); });
  if (!masked) return std::int64_t{global_batch} * seq_len_;  // (apart needs masks)
  // The mask bytes of the global batch's targets alone: no token is copied.
  if (step < 0 || global_batch < 1 ||
      step > (std::numeric_limits<std::int64_t>::max() - global_batch) / global_batch)
    throw ConfigError(fmt::format(
        "TokenDataset::counted_targets: step {}, global batch {}: needs step >= 0, a global "
        "batch >= 1 and a draw count that fits int64",
        step, global_batch));
  std::int64_t counted = 0;
  for (std::int64_t g = step * global_batch; g < (step + 1) * global_batch; ++g) {
    const auto [stream, at] = place_of(train_, sample_of_draw(g));
    counted += stream->file.counted_targets(at + 1, seq_len_, apart_);
  }
  return counted;
}

std::int64_t TokenDataset::sample_of_draw(std::int64_t g) const {
  if (g < 0) throw ConfigError(fmt::format("TokenDataset::sample_of_draw: draw {} < 0", g));
  const std::int64_t n = train_.samples;
  return shuffled_index(seed_, static_cast<std::uint64_t>(g / n), g % n, n);
}

TokenSequences TokenDataset::train_sample(std::int64_t index) const {
  if (index < 0 || index >= train_.samples)
    throw ConfigError(
        fmt::format("TokenDataset::train_sample: sample {} of {}", index, train_.samples));
  TokenSequences out;
  out.seq_len = seq_len_;
  append(train_, index, out);
  return out;
}

TokenSequences TokenDataset::train_batch(std::int64_t step, int global_batch, int rank, int world,
                                         int micro_index, int micro_size) const {
  const bool valid = step >= 0 && global_batch >= 1 && world >= 1 && global_batch % world == 0 &&
                     rank >= 0 && rank < world && micro_size >= 1 && micro_index >= 0 &&
                     (std::int64_t{micro_index} + 1) * micro_size <= global_batch / world;
  if (!valid)
    throw ConfigError(fmt::format(
        "TokenDataset::train_batch: step {}, global batch {}, rank {} of world {}, micro-batch "
        "{} of size {}: needs step >= 0, a world size dividing the global batch, 0 <= rank < "
        "world, and micro-batch (index + 1) * size <= global batch / world",
        step, global_batch, rank, world, micro_index, micro_size));
  if (step > (std::numeric_limits<std::int64_t>::max() - global_batch) / global_batch)
    throw ConfigError(fmt::format(
        "TokenDataset::train_batch: step {} of global batch {}: the draw count overflows", step,
        global_batch));
  const std::int64_t first = step * global_batch + std::int64_t{rank} * (global_batch / world) +
                             std::int64_t{micro_index} * micro_size;
  TokenSequences out;
  out.seq_len = seq_len_;
  out.inputs.reserve(static_cast<std::size_t>(micro_size) * static_cast<std::size_t>(seq_len_));
  out.targets.reserve(out.inputs.capacity());
  for (int i = 0; i < micro_size; ++i) append(train_, sample_of_draw(first + i), out);
  return out;
}

TokenSequences TokenDataset::val_sequences(std::int64_t first, int count) const {
  if (!has_val()) throw ConfigError("data.val: not set: this dataset has no validation set");
  if (count < 1 || first < 0 || first > val_.samples - count)
    throw ConfigError(fmt::format(
        "TokenDataset::val_sequences: samples [{}, {} + {}) do not lie in the validation set's "
        "{} samples",
        first, first, count, val_.samples));
  TokenSequences out;
  out.seq_len = seq_len_;
  out.inputs.reserve(static_cast<std::size_t>(count) * static_cast<std::size_t>(seq_len_));
  out.targets.reserve(out.inputs.capacity());
  for (int i = 0; i < count; ++i) append(val_, first + i, out);
  return out;
}

std::int64_t TokenDataset::epoch_of(std::int64_t step, int global_batch) const {
  if (step < 0 || global_batch < 1 ||
      step > std::numeric_limits<std::int64_t>::max() / global_batch)
    throw ConfigError(
        fmt::format("TokenDataset::epoch_of: step {}, global batch {}", step, global_batch));
  return step * global_batch / train_.samples;
}

std::vector<std::string> TokenDataset::train_files() const {
  std::vector<std::string> paths;
  for (const auto& s : train_.streams) paths.push_back(s.file.path());
  return paths;
}

}  // namespace shardswap
