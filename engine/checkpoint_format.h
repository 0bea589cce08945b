// The files of a checkpoint (format in docs/checkpoints.md) as saving, loading and the directory
// scan share them: names and limits, the binary file writer and reader, and the metadata's fields
// read with checks (internal; engine/checkpoint_format.cpp).
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardswap/checkpoint.h"
#include "shardswap/error.h"
#include "shardswap/json_reader.h"
#include "support/file_kind.h"

namespace shardswap::checkpoint_detail {

namespace fs = std::filesystem;
using nlohmann::json;

inline constexpr char kMagic[8] = {'S', 'S', 'C', 'K', 'P', 'T', '0', '1'};
inline constexpr std::size_t kHeadBytes = 16;   // magic + header length
inline constexpr std::size_t kTrailBytes = 8;   // FNV-1a 64 of everything before it
// 2: save ids in every file, per-file checksums, lineage and save sequence in the metadata.
inline constexpr int kFormatVersion = 2;
inline constexpr const char* kMetadataName = "metadata.json";
inline constexpr const char* kWeightsName = "weights.bin";
// metadata.json: this prefix, 16 hex digits of the FNV-1a 64 of the metadata text, kMiddle, the
// metadata text, "}\n". The whole file is JSON; the checksum covers the exact bytes written.
inline constexpr std::string_view kPrefix = "{\"format\":\"shardswap-checkpoint\",\"fnv1a64\":\"";
inline constexpr std::string_view kMiddle = "\",\"metadata\":";

std::string rank_file_name(int rank, int world);
std::string hex64(std::uint64_t v);
bool is_lower_hex(std::string_view s);
fs::path sibling(const fs::path& dir, std::string_view suffix);

// ---- writing ----

// A binary checkpoint file: magic, header length (u64), header JSON, data, FNV-1a 64 of all that.
class BinaryWriter {
 public:
  BinaryWriter(const OpenCheckpointFile& open, const fs::path& path, const json& header)
      : file_(open(path)) {
    const std::string text = header.dump();
    const std::uint64_t length = text.size();
    write(kMagic, sizeof kMagic);
    write(&length, sizeof length);
    write(text.data(), text.size());
  }
  void write(const void* data, std::size_t bytes) {
    hash_ = fnv1a64(data, bytes, hash_);
    file_->write(data, bytes);
  }
  void finish() {
    const std::uint64_t hash = hash_;
    file_->write(&hash, sizeof hash);
    file_->commit();
  }

 private:
  std::unique_ptr<CheckpointFile> file_;
  std::uint64_t hash_ = kFnvOffset;
};

// ---- reading ----

// A checkpoint file opened for reading only once it is known to be a regular file: a directory,
// FIFO or device in its place is named and never read (O_NONBLOCK: opening a FIFO must not wait
// for a writer). Its size is known before anything is allocated.
class InputFile {
 public:
  explicit InputFile(const fs::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd_ < 0) {
      if (errno == ENOENT) throw ConfigError(fmt::format("'{}' is missing", path.string()));
      throw ConfigError(fmt::format("cannot open '{}': {}", path.string(), std::strerror(errno)));
    }
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      const int err = errno;
      ::close(fd_);
      throw ConfigError(fmt::format("cannot stat '{}': {}", path.string(), std::strerror(err)));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw ConfigError(fmt::format("'{}' is {}, not a regular file: a checkpoint file must be one",
                                    path.string(), file_kind(st.st_mode)));
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  std::uint64_t size() const { return size_; }
  void read(void* out, std::size_t bytes, std::uint64_t offset) const {
    auto* p = static_cast<char*>(out);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0)
        throw ConfigError(
            fmt::format("cannot read '{}': {}", path_.string(), std::strerror(errno)));
      if (n == 0)
        throw ConfigError(
            fmt::format("'{}' ended early: it changed while it was read", path_.string()));
      p += n;
      offset += static_cast<std::uint64_t>(n);
      bytes -= static_cast<std::size_t>(n);
    }
  }
  std::vector<std::byte> read_all() const {
    std::vector<std::byte> bytes(static_cast<std::size_t>(size_));
    read(bytes.data(), bytes.size(), 0);
    return bytes;
  }

 private:
  fs::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// Bounds what a reader allocates for a file whose size no metadata vouches for.
inline constexpr std::uint64_t kMaxMetadataBytes = 256ull << 20;
inline constexpr std::uint64_t kMaxHeaderBytes = 64ull << 20;
// metadata.json: the outer object is level 1, the metadata level 2, `extra` and `config` level 3.
// save_checkpoint refuses an extra or config that would be stored deeper, so every checkpoint it
// writes reads back; 1024 leaves a config of the reader's 256 levels room for the encoding of
// byte strings (encode_byte_strings).
inline constexpr std::size_t kMaxMetadataDepth = 1024;
inline constexpr JsonLimits kMetadataLimits{kMaxMetadataDepth, kMaxMetadataBytes,
                                     "a checkpoint's metadata"};
// A binary file's header is ShardSwap's own: a few levels.
inline constexpr JsonLimits kHeaderLimits{16, kMaxHeaderBytes, "a checkpoint file's header"};

struct BinaryFile {
  fs::path path;
  json header;
  std::vector<std::byte> bytes;
  std::size_t data_begin = 0;
  std::size_t data_end = 0;
  // `bytes` bytes at data offset `offset`, checked to lie inside the data.
  const std::byte* at(std::int64_t offset, std::int64_t bytes_wanted, const std::string& what) const {
    if (offset < 0 || bytes_wanted < 0 ||
        static_cast<std::size_t>(offset + bytes_wanted) > data_end - data_begin)
      throw ConfigError(fmt::format("'{}': {} lies outside the file's data", path.string(), what));
    return this->bytes.data() + data_begin + offset;
  }
};

// Reads a metadata field, turning a missing or mistyped one into an error naming the file.
template <class T>
constexpr bool is_integer_field = std::is_integral_v<T> && !std::is_same_v<T, bool>;
template <class T>
struct integer_list : std::false_type {};
template <class T>
struct integer_list<std::vector<T>> : std::bool_constant<is_integer_field<T>> {};

// What a field of type T must hold, as messages say it.
template <class T>
constexpr const char* expected_kind() {
  if constexpr (std::is_same_v<T, bool>) return "true or false";
  if constexpr (is_integer_field<T>) return "an integer";
  if constexpr (integer_list<T>::value) return "a list of integers";
  if constexpr (std::is_floating_point_v<T>) return "a number";
  if constexpr (std::is_same_v<T, std::string>) return "a string";
  if constexpr (std::is_same_v<T, std::vector<std::string>>) return "a list of strings";
  return "a value";
}

// Whether `v` holds a T, in range: nlohmann casts a float or a too-large integer to an integer
// type as it is (1e300 where a shape or count belongs would be undefined behaviour, 2^40 an int
// wrapped), so integers only, and within the type's range.
template <class T>
bool holds(const json& v) {
  if constexpr (is_integer_field<T>) {
    if (!v.is_number_integer()) return false;
    if (v.is_number_unsigned())
      return v.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<T>::max());
    const auto x = v.get<std::int64_t>();
    return std::cmp_greater_equal(x, std::numeric_limits<T>::min()) &&
           std::cmp_less_equal(x, std::numeric_limits<T>::max());
  } else if constexpr (integer_list<T>::value) {
    return v.is_array() && std::all_of(v.begin(), v.end(), [](const json& x) {
             return holds<typename T::value_type>(x);
           });
  } else if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean();
  } else if constexpr (std::is_floating_point_v<T>) {
    return v.is_number();
  } else if constexpr (std::is_same_v<T, std::string>) {
    return v.is_string();
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return v.is_array() &&
           std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_string(); });
  } else {
    return true;
  }
}

// Reads a metadata field, turning a missing or mistyped one into an error naming the file and
// the field (never the JSON library's own message). `j` must be an object.
template <class T>
T field(const json& j, const char* key, const fs::path& file) {
  if (!j.is_object())
    throw ConfigError(fmt::format("'{}': field '{}': it lies in {}, not in an object",
                                  file.string(), key, j.dump().substr(0, 64)));
  const auto it = j.find(key);
  if (it == j.end())
    throw ConfigError(fmt::format("'{}': field '{}' is missing", file.string(), key));
  if (!holds<T>(*it))
    throw ConfigError(fmt::format("'{}': field '{}': expected {}, got {}", file.string(), key,
                                  expected_kind<T>(), it->dump().substr(0, 64)));
  return it->template get<T>();
}

// Reads the binary file `name` of the checkpoint in `dir` and checks that it is the file this
// save wrote: a regular file of the recorded size, intact (its trailer), of this save (its
// header's save id) and with the recorded checksum. The one path by which load, inspect and
// export read a binary file.
BinaryFile read_binary(const fs::path& dir, const std::string& name, const json& meta);

// One saved param as the metadata declares it.
struct SavedParam {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;
  std::string group;
  bool holds_state = false;  // its group saved a master and optimizer state
};

std::vector<SavedParam> saved_params(const json& meta, const fs::path& file);

}  // namespace shardswap::checkpoint_detail
