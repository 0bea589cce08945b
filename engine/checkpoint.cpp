// Checkpoint files (format in docs/checkpoints.md). Saving: every rank writes its file into a
// temporary directory, the ranks agree that all succeeded, rank 0 writes the metadata and renames
// the directory into place. Loading: every rank reads and verifies every file (so every rank
// fails the same way on bad input), keeps the pieces that fall in its own shard at the current
// world size, and only then hands the engine one TrainingState to restore.
//
// Policy on the directory of checkpoints: a complete copy of every checkpoint exists at every
// instant of a save or a prune (so a kill anywhere loses at most the save in progress), a name
// that could list as complete only ever appears by a rename of a complete, fsynced directory, and
// nothing deletes a checkpoint that another run wrote. recover_checkpoints() turns what a kill
// left into that state again.
#include "engine/engine_internals.h"
#include "optimizer/optimizer.h"
#include "shardswap/checkpoint.h"
#include "support/durable_file.h"
#include "support/file_kind.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>

#include "partition/flat_layout.h"
#include "shardswap/error.h"
#include "shardswap/json_reader.h"

#ifndef SHARDSWAP_VERSION
#define SHARDSWAP_VERSION "unknown"
#endif

namespace shardswap {

namespace fs = std::filesystem;
using nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "checkpoint files are little-endian and written with memcpy");

namespace {

constexpr char kMagic[8] = {'S', 'S', 'C', 'K', 'P', 'T', '0', '1'};
constexpr std::size_t kHeadBytes = 16;   // magic + header length
constexpr std::size_t kTrailBytes = 8;   // FNV-1a 64 of everything before it
// 2: save ids in every file, per-file checksums, lineage and save sequence in the metadata.
constexpr int kFormatVersion = 2;
constexpr const char* kMetadataName = "metadata.json";
constexpr const char* kWeightsName = "weights.bin";
// metadata.json: this prefix, 16 hex digits of the FNV-1a 64 of the metadata text, kMiddle, the
// metadata text, "}\n". The whole file is JSON; the checksum covers the exact bytes written.
constexpr std::string_view kPrefix = "{\"format\":\"shardswap-checkpoint\",\"fnv1a64\":\"";
constexpr std::string_view kMiddle = "\",\"metadata\":";

std::string rank_file_name(int rank, int world) {
  return fmt::format("rank-{:05}-of-{:05}.bin", rank, world);
}

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }

bool is_lower_hex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// A name under a checkpoint root: "step-" digits, optionally "-" and 8 hex digits of a run id.
std::optional<std::int64_t> checkpoint_step(std::string_view name) {
  if (!name.starts_with("step-")) return std::nullopt;
  name.remove_prefix(5);
  const std::size_t digits = name.find_first_not_of("0123456789");
  const std::string_view number = name.substr(0, digits);
  if (number.empty() || number.size() > 18) return std::nullopt;
  const std::string_view rest = digits == std::string_view::npos ? "" : name.substr(digits);
  if (!rest.empty() && !(rest.size() == 9 && rest[0] == '-' && is_lower_hex(rest.substr(1))))
    return std::nullopt;
  return std::stoll(std::string(number));
}

fs::path sibling(const fs::path& dir, std::string_view suffix) {
  return dir.parent_path() / (dir.filename().string() + std::string(suffix));
}

// ---- writing ----

// The CheckpointFile of open_checkpoint_file: a DurableFile (tests hand save_checkpoint others).
class PosixFile final : public CheckpointFile {
 public:
  explicit PosixFile(fs::path path) : file_(std::move(path)) {}
  void write(const void* data, std::size_t bytes) override { file_.write(data, bytes); }
  void commit() override { file_.commit(); }

 private:
  DurableFile file_;
};

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

// Runs `body` writing `path`; any failure becomes an Error naming the file.
template <class F>
void writing(const fs::path& path, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    throw Error(fmt::format("save_checkpoint: writing '{}': {}", path.string(), e.what()));
  }
}

// Every rank learns whether any rank failed the phase; a failed rank rethrows its own error, the
// others say that another rank failed (every rank must leave the collective sequence together),
// as a PeerFailure: whoever collects the ranks' errors (run_ranks) shows the failing rank's.
void agree(Engine& engine, const std::exception_ptr& error, const char* what,
           const std::function<void()>& on_failure = {}) {
  const double failed = engine.sum_across_ranks(error ? 1.0 : 0.0);
  if (failed == 0.0) return;
  if (on_failure) on_failure();
  if (error) std::rethrow_exception(error);
  throw PeerFailure(fmt::format("{}: {} other rank(s) failed (their error names the file)", what,
                                static_cast<int>(failed)));
}

template <class F>
void attempt(std::exception_ptr& error, F&& f) {
  if (error) return;
  try {
    f();
  } catch (...) {
    error = std::current_exception();
  }
}

// The params of `group` in the order its flat layout numbers them (declaration order).
std::vector<const ParamInfo*> params_of(const Engine& engine, const std::string& group) {
  std::vector<const ParamInfo*> out;
  for (const auto& p : engine.params())
    if (p.group == group) out.push_back(&p);
  return out;
}

const char* holding_name(const GroupTrainingState& s) {
  if (s.active) return "active";
  if (s.kept) return deactivate_policy_name(*s.kept);
  return "none";
}

fs::path normalized(const fs::path& dir, const char* fn) {
  fs::path d = dir.lexically_normal();
  if (!d.has_filename()) d = d.parent_path();
  if (d.empty() || d.filename() == "." || d.filename() == "..")
    throw ConfigError(fmt::format("{}: '{}' cannot be a checkpoint directory", fn, dir.string()));
  return d;
}

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
constexpr std::uint64_t kMaxMetadataBytes = 256ull << 20;
constexpr std::uint64_t kMaxHeaderBytes = 64ull << 20;
// metadata.json: the outer object is level 1, the metadata level 2, `extra` and `config` level 3.
// save_checkpoint refuses an extra or config that would be stored deeper, so every checkpoint it
// writes reads back; 1024 leaves a config of the reader's 256 levels room for the encoding of
// byte strings (encode_byte_strings).
constexpr std::size_t kMaxMetadataDepth = 1024;
constexpr JsonLimits kMetadataLimits{kMaxMetadataDepth, kMaxMetadataBytes,
                                     "a checkpoint's metadata"};
// A binary file's header is ShardSwap's own: a few levels.
constexpr JsonLimits kHeaderLimits{16, kMaxHeaderBytes, "a checkpoint file's header"};

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

// What the metadata records of one file of the save: its size and the FNV-1a 64 of its bytes
// before the trailer (which is the trailer's own value).
struct FileRecord {
  std::uint64_t bytes = 0;
  std::uint64_t fnv1a64 = 0;
};

FileRecord file_record(const json& meta, const std::string& name, const fs::path& file) {
  for (const auto& f : field<json>(meta, "files", file)) {
    if (field<std::string>(f, "name", file) != name) continue;
    const auto hash = field<std::string>(f, "fnv1a64", file);
    if (hash.size() != 16 || !is_lower_hex(hash))
      throw ConfigError(
          fmt::format("'{}': the checksum of '{}' is not 16 hex digits", file.string(), name));
    return {field<std::uint64_t>(f, "bytes", file), std::stoull(hash, nullptr, 16)};
  }
  throw ConfigError(fmt::format("'{}' does not list '{}'", file.string(), name));
}

ConfigError not_of_this_save(const fs::path& path, const std::string& other,
                             const std::string& save_id) {
  return ConfigError(
      fmt::format("'{}' belongs to save {}, not to this checkpoint's save {} "
                  "(copied from another checkpoint?)",
                  path.string(), other, save_id));
}

// The save id in the header of a binary file whose size is not the recorded one, if it has a
// readable header: says whether it came from another save or was cut short.
std::optional<std::string> header_save_id(const InputFile& in) {
  if (in.size() < kHeadBytes + kTrailBytes) return std::nullopt;
  char head[kHeadBytes];
  in.read(head, sizeof head, 0);
  std::uint64_t length = 0;
  std::memcpy(&length, head + sizeof kMagic, sizeof length);
  if (std::memcmp(head, kMagic, sizeof kMagic) != 0 || length > kMaxHeaderBytes ||
      length > in.size() - kHeadBytes - kTrailBytes)
    return std::nullopt;
  std::string text(static_cast<std::size_t>(length), '\0');
  in.read(text.data(), text.size(), kHeadBytes);
  json header;
  try {
    header = parse_json(text, "", kHeaderLimits);
  } catch (const JsonError&) {
    return std::nullopt;
  }
  if (!header.is_object() || !header.contains("save_id") || !header["save_id"].is_string())
    return std::nullopt;
  return header["save_id"].get<std::string>();
}

// Reads the binary file `name` of the checkpoint in `dir` and checks that it is the file this
// save wrote: a regular file of the recorded size, intact (its trailer), of this save (its
// header's save id) and with the recorded checksum. The one path by which load, inspect and
// export read a binary file.
BinaryFile read_binary(const fs::path& dir, const std::string& name, const json& meta) {
  const fs::path meta_file = dir / kMetadataName;
  const FileRecord record = file_record(meta, name, meta_file);
  const auto save_id = field<std::string>(meta, "save_id", meta_file);
  BinaryFile f;
  f.path = dir / name;
  const std::string path = f.path.string();
  const InputFile in(f.path);
  if (in.size() != record.bytes) {
    const auto other = header_save_id(in);
    if (other && *other != save_id) throw not_of_this_save(f.path, *other, save_id);
    throw ConfigError(
        fmt::format("'{}' holds {} bytes, the metadata says {}: truncated or "
                    "replaced",
                    path, in.size(), record.bytes));
  }
  if (record.bytes < kHeadBytes + kTrailBytes)
    throw ConfigError(fmt::format("'{}' is not a ShardSwap checkpoint file", path));
  f.bytes = in.read_all();
  if (std::memcmp(f.bytes.data(), kMagic, sizeof kMagic) != 0)
    throw ConfigError(fmt::format("'{}' is not a ShardSwap checkpoint file", path));
  std::uint64_t stored = 0, length = 0;
  std::memcpy(&stored, f.bytes.data() + f.bytes.size() - kTrailBytes, kTrailBytes);
  const std::uint64_t computed = fnv1a64(f.bytes.data(), f.bytes.size() - kTrailBytes);
  if (stored != computed)
    throw ConfigError(
        fmt::format("'{}': checksum mismatch (stored {}, computed {}): the file is "
                    "corrupt",
                    path, hex64(stored), hex64(computed)));
  std::memcpy(&length, f.bytes.data() + sizeof kMagic, sizeof length);
  if (length > f.bytes.size() - kHeadBytes - kTrailBytes)
    throw ConfigError(fmt::format("'{}': header length {} exceeds the file", path, length));
  const auto* text = reinterpret_cast<const char*>(f.bytes.data() + kHeadBytes);
  try {
    f.header = parse_json(std::string_view(text, length), path, kHeaderLimits);
  } catch (const JsonError& e) {
    throw ConfigError(fmt::format("'{}': the header is not a JSON object: {}", path, e.located()));
  }
  if (!f.header.is_object())
    throw ConfigError(fmt::format("'{}': the header is not a JSON object", path));
  const auto id = f.header.find("save_id");
  if (id == f.header.end() || !id->is_string())
    throw ConfigError(
        fmt::format("'{}' carries no save id: it is not a file of this checkpoint's "
                    "save {} (copied from a checkpoint of an older format?)",
                    path, save_id));
  if (id->get<std::string>() != save_id)
    throw not_of_this_save(f.path, id->get<std::string>(), save_id);
  if (stored != record.fnv1a64)
    throw ConfigError(
        fmt::format("'{}': checksum {} differs from the {} that the metadata records: "
                    "not the file this save wrote",
                    path, hex64(stored), hex64(record.fnv1a64)));
  f.data_begin = kHeadBytes + length;
  f.data_end = f.bytes.size() - kTrailBytes;
  return f;
}

// One saved param as the metadata declares it.
struct SavedParam {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;
  std::string group;
  bool holds_state = false;  // its group saved a master and optimizer state
};

std::vector<SavedParam> saved_params(const json& meta, const fs::path& file) {
  std::map<std::string, bool> holds;
  for (const auto& g : field<json>(meta, "groups", file))
    holds[field<std::string>(g, "name", file)] = field<std::string>(g, "state", file) != "none";
  std::vector<SavedParam> out;
  for (const auto& p : field<json>(meta, "params", file)) {
    SavedParam s;
    s.name = field<std::string>(p, "name", file);
    s.shape = field<std::vector<std::int64_t>>(p, "shape", file);
    s.group = field<std::string>(p, "group", file);
    s.numel = 1;
    for (auto e : s.shape) s.numel *= e;
    auto it = holds.find(s.group);
    if (it == holds.end())
      throw ConfigError(fmt::format("'{}': param '{}' belongs to group '{}', which is not listed",
                                    file.string(), s.name, s.group));
    s.holds_state = it->second;
    out.push_back(std::move(s));
  }
  return out;
}

// Reads and verifies every rank file of the checkpoint, calling `piece` for each piece with its
// param, first element, count and values ((1 + slots) x count floats: master, then each slot),
// and checks that the pieces of every param whose group holds state cover it exactly once.
void read_pieces(const fs::path& dir, const json& meta, const std::vector<SavedParam>& params,
                 const std::function<void(std::size_t param, std::int64_t begin,
                                          std::int64_t count, const float* values)>& piece) {
  const fs::path meta_file = dir / kMetadataName;
  const int world = field<int>(meta, "world_size", meta_file);
  const int slots = field<int>(meta, "state_slots", meta_file);
  if (world < 1 || slots < 0 || slots > 2)
    throw ConfigError(fmt::format("'{}': world_size {} or state_slots {} out of range",
                                  meta_file.string(), world, slots));
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < params.size(); ++i) index[params[i].name] = i;
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> covered(params.size());
  for (int r = 0; r < world; ++r) {
    const auto name = rank_file_name(r, world);
    const BinaryFile f = read_binary(dir, name, meta);
    try {
      if (f.header.at("kind") != "rank" || f.header.at("rank") != r ||
          f.header.at("world_size") != world || f.header.at("state_slots") != slots)
        throw ConfigError("its header does not match its name and the metadata");
      for (const auto& p : f.header.at("pieces")) {
        const auto pname = p.at("param").get<std::string>();
        const auto begin = p.at("begin").get<std::int64_t>();
        const auto count = p.at("count").get<std::int64_t>();
        const auto offset = p.at("offset").get<std::int64_t>();
        auto it = index.find(pname);
        if (it == index.end())
          throw ConfigError(fmt::format("a piece of '{}', which the metadata does not declare",
                                        pname));
        const SavedParam& sp = params[it->second];
        if (!sp.holds_state)
          throw ConfigError(fmt::format("a piece of '{}', whose group '{}' holds no state", pname,
                                        sp.group));
        if (begin < 0 || count < 1 || begin + count > sp.numel)
          throw ConfigError(fmt::format("piece [{}, {}) of '{}' lies outside its {} elements",
                                        begin, begin + count, pname, sp.numel));
        const auto* values = f.at(offset, (1 + slots) * count * 4,
                                  fmt::format("piece [{}, {}) of '{}'", begin, begin + count,
                                              pname));
        covered[it->second].emplace_back(begin, begin + count);
        // The header's length is arbitrary, so the values need not be aligned for floats.
        std::vector<float> aligned(static_cast<std::size_t>((1 + slots) * count));
        std::memcpy(aligned.data(), values, aligned.size() * 4);
        piece(it->second, begin, count, aligned.data());
      }
    } catch (const json::exception& e) {
      throw ConfigError(fmt::format("'{}': bad header: {}", f.path.string(), e.what()));
    } catch (const ConfigError& e) {
      if (std::string_view(e.what()).find(f.path.string()) != std::string_view::npos) throw;
      throw ConfigError(fmt::format("'{}': {}", f.path.string(), e.what()));
    }
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].holds_state) continue;
    auto& ranges = covered[i];
    std::sort(ranges.begin(), ranges.end());
    std::int64_t next = 0;
    for (const auto& [b, e] : ranges) {
      if (b != next) break;
      next = e;
    }
    if (next != params[i].numel || ranges.empty() || ranges.back().second != params[i].numel)
      throw ConfigError(fmt::format(
          "checkpoint '{}': the rank files' pieces of '{}' do not cover its {} elements exactly "
          "once",
          dir.string(), params[i].name, params[i].numel));
  }
}

struct Weights {
  DType dtype = DType::bf16;
  std::vector<std::vector<std::byte>> raw;  // per saved param
};

Weights read_weights(const fs::path& dir, const json& meta, const std::vector<SavedParam>& params) {
  const fs::path meta_file = dir / kMetadataName;
  Weights w;
  w.dtype = dtype_from_name(field<std::string>(meta, "dtype", meta_file),
                            (meta_file.string() + " dtype"));
  const BinaryFile f = read_binary(dir, kWeightsName, meta);
  try {
    if (f.header.at("kind") != "weights" || f.header.at("dtype") != dtype_name(w.dtype))
      throw ConfigError("its header does not match the metadata");
    const auto& entries = f.header.at("params");
    if (entries.size() != params.size())
      throw ConfigError(fmt::format("{} params, the metadata declares {}", entries.size(),
                                    params.size()));
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& e = entries[i];
      const auto bytes = params[i].numel * static_cast<std::int64_t>(dtype_size(w.dtype));
      if (e.at("name") != params[i].name || e.at("bytes") != bytes)
        throw ConfigError(fmt::format("entry {} is not '{}' of {} bytes", i, params[i].name, bytes));
      const auto* p = f.at(e.at("offset").get<std::int64_t>(), bytes, params[i].name);
      w.raw.emplace_back(p, p + bytes);
    }
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("'{}': bad header: {}", f.path.string(), e.what()));
  } catch (const ConfigError& e) {
    if (std::string_view(e.what()).find(f.path.string()) != std::string_view::npos) throw;
    throw ConfigError(fmt::format("'{}': {}", f.path.string(), e.what()));
  }
  return w;
}

// Everything this rank's engine needs from the checkpoint, verified against its declarations.
TrainingState read_state_for(const Engine& engine, const fs::path& dir, LoadedCheckpoint& out) {
  const json meta = read_checkpoint_metadata(dir);
  const fs::path meta_file = dir / kMetadataName;
  const auto& config = engine.config();
  const auto differs = [&](const char* what, const std::string& saved, const std::string& here) {
    if (saved != here)
      throw ConfigError(fmt::format("load_checkpoint: '{}' is a checkpoint of a different model: "
                                    "{} '{}' saved, '{}' here",
                                    meta_file.string(), what, saved, here));
  };
  differs("bit16 type", field<std::string>(meta, "dtype", meta_file), dtype_name(config.dtype));
  differs("optimizer", field<std::string>(meta, "optimizer", meta_file),
          optimizer_type_name(config.optimizer.type));
  const auto params = saved_params(meta, meta_file);
  const auto& mine = engine.params();
  differs("param count", std::to_string(params.size()), std::to_string(mine.size()));
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto label = fmt::format("param {}", i);
    differs(label.c_str(),
            fmt::format("{} {} in {}", params[i].name, fmt::join(params[i].shape, "x"),
                        params[i].group),
            fmt::format("{} {} in {}", mine[i].name, fmt::join(mine[i].shape, "x"), mine[i].group));
  }
  const int slots = config.optimizer.state_slots();
  differs("optimizer state slots", std::to_string(field<int>(meta, "state_slots", meta_file)),
          std::to_string(slots));

  // This rank's shard of each group at the current world size, and where each of its params'
  // fragments lands.
  const int rank = engine.rank();
  TrainingState state;
  struct Target {
    std::size_t group;
    std::int64_t param_offset, shard_offset, count;
  };
  std::vector<std::vector<Target>> targets(mine.size());
  std::map<std::string, std::size_t> param_index;
  for (std::size_t i = 0; i < mine.size(); ++i) param_index[mine[i].name] = i;
  std::map<std::string, json> saved_groups;
  for (const auto& g : field<json>(meta, "groups", meta_file))
    saved_groups[field<std::string>(g, "name", meta_file)] = g;
  std::vector<std::int64_t> shard_numel;
  for (const auto& name : engine.groups()) {
    auto it = saved_groups.find(name);
    if (it == saved_groups.end()) differs("group", "(none)", name);
    GroupTrainingState s;
    s.group = name;
    const auto holding = field<std::string>(it->second, "state", meta_file);
    s.step = field<std::int64_t>(it->second, "step", meta_file);
    if (holding == "active") {
      s.active = true;
    } else if (holding == "keep_host" || holding == "keep_device") {
      s.kept = deactivate_policy_from_name(holding, meta_file.string() + " groups.state");
    } else if (holding != "none") {
      throw ConfigError(fmt::format("'{}': group '{}' has state '{}'", meta_file.string(), name,
                                    holding));
    }
    const Shard shard = Shard::of(EngineInternals::layout(engine, name), rank);
    if (s.active || s.kept) {
      s.master.assign(static_cast<std::size_t>(shard.numel()), 0.0f);
      s.state.assign(static_cast<std::size_t>(slots * shard.numel()), 0.0f);
      const auto members = params_of(engine, name);
      for (const auto& f : shard.fragments)
        targets[param_index.at(members[f.param]->name)].push_back(
            {state.groups.size(), f.param_offset, f.shard_offset, f.count});
    }
    shard_numel.push_back(shard.numel());
    state.groups.push_back(std::move(s));
  }
  if (saved_groups.size() != state.groups.size())
    differs("group count", std::to_string(saved_groups.size()),
            std::to_string(state.groups.size()));

  read_pieces(dir, meta, params, [&](std::size_t param, std::int64_t begin, std::int64_t count,
                                     const float* values) {
    for (const auto& t : targets[param]) {
      const std::int64_t lo = std::max(begin, t.param_offset);
      const std::int64_t hi = std::min(begin + count, t.param_offset + t.count);
      if (lo >= hi) continue;
      auto& g = state.groups[t.group];
      const std::int64_t shard = shard_numel[t.group];
      const std::int64_t to = t.shard_offset + (lo - t.param_offset);
      std::memcpy(g.master.data() + to, values + (lo - begin), (hi - lo) * 4);
      for (int k = 0; k < slots; ++k)
        std::memcpy(g.state.data() + k * shard + to, values + (1 + k) * count + (lo - begin),
                    (hi - lo) * 4);
    }
  });
  state.weights = read_weights(dir, meta, params).raw;
  const json& scaler = field<json>(meta, "loss_scaler", meta_file);
  state.scaler.scale = field<double>(scaler, "scale", meta_file);
  state.scaler.clean_steps = field<std::int64_t>(scaler, "clean_steps", meta_file);
  state.scaler.hysteresis_left = field<int>(scaler, "hysteresis_left", meta_file);
  state.lr = field<double>(meta, "lr", meta_file);
  try {
    out.extra = decode_byte_strings(field<json>(meta, "extra", meta_file));
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("'{}': extra: {}", meta_file.string(), e.what()));
  }
  out.world_size = field<int>(meta, "world_size", meta_file);
  out.save_id = field<std::string>(meta, "save_id", meta_file);
  out.run_id = field<std::string>(meta, "run_id", meta_file);
  out.save_sequence = field<std::int64_t>(meta, "save_sequence", meta_file);
  return state;
}

}  // namespace

std::uint64_t fnv1a64(const void* data, std::size_t bytes, std::uint64_t hash) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    hash ^= p[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}

std::unique_ptr<CheckpointFile> open_checkpoint_file(const fs::path& path) {
  return std::make_unique<PosixFile>(path);
}

namespace {

// A value only rank 0 knows, given to every rank (exactly: below 2^53, and the others add 0).
std::uint64_t from_rank0(Engine& engine, std::uint64_t value) {
  return static_cast<std::uint64_t>(
      engine.sum_across_ranks(engine.rank() == 0 ? static_cast<double>(value) : 0.0));
}

// "" when `dir` is a complete checkpoint (every file verified), else why not.
std::string incomplete_because(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir, ec))) return "absent";
  try {
    (void)read_checkpoint_tensors(dir, false);
    return "";
  } catch (const ConfigError& e) {
    return e.what();
  }
}

// What a kill during a save of `dir` can leave, made whole again (see recover_checkpoints).
void recover_name(const fs::path& dir, std::vector<std::string>& actions) {
  const fs::path tmp = sibling(dir, ".tmp-save"), old = sibling(dir, ".old-save");
  std::error_code ec;
  const bool has_tmp = fs::exists(fs::symlink_status(tmp, ec));
  const bool has_old = fs::exists(fs::symlink_status(old, ec));
  if (!has_tmp && !has_old) return;
  const std::string dir_why = incomplete_because(dir);
  const std::string tmp_why = has_tmp ? incomplete_because(tmp) : "absent";
  const std::string old_why = has_old ? incomplete_because(old) : "absent";
  const auto remove = [&](const fs::path& p, const std::string& why) {
    fs::remove_all(p);
    actions.push_back(fmt::format("removed '{}' ({})", p.string(), why));
  };
  const auto promote = [&](const fs::path& from, const char* what) {
    if (dir_why != "absent") remove(dir, "incomplete: " + dir_why);
    fs::rename(from, dir);
    fsync_directory(parent_directory(dir));
    actions.push_back(fmt::format("{}: '{}' -> '{}'", what, from.string(), dir.string()));
  };
  bool tmp_left = has_tmp, old_left = has_old;
  if (!dir_why.empty()) {
    if (has_tmp && tmp_why.empty()) {
      promote(tmp, "completed an interrupted save");
      tmp_left = false;
    } else if (has_old && old_why.empty()) {
      promote(old, "rolled back an interrupted save");
      old_left = false;
    }
  }
  const auto leftover_why = [&](const std::string& why) {
    return why.empty()
               ? fmt::format("a copy left by an interrupted save; '{}' is complete", dir.string())
               : "incomplete: " + why;
  };
  if (tmp_left) remove(tmp, leftover_why(tmp_why));
  if (old_left) remove(old, leftover_why(old_why));
  fsync_directory(parent_directory(dir));
}

bool written_by(const fs::path& dir, const std::string& run_id) {
  try {
    return read_checkpoint_metadata(dir).at("run_id") == run_id;
  } catch (const ConfigError&) {
    return false;
  }
}

// Where a save asked for `asked` goes: `asked`, unless a run id is given and `asked` holds
// anything but a checkpoint of that run; then `asked`-<the run id's first 8 digits>, which must be
// free or the run's own. Leftovers of interrupted saves of a name are recovered before it is
// judged, so that the complete copy decides (and is never deleted).
fs::path save_target(const fs::path& asked, const std::string& run_id) {
  std::vector<std::string> actions;
  recover_name(asked, actions);
  const auto free_or_own = [&](const fs::path& dir) {
    return !fs::exists(fs::symlink_status(dir)) || run_id.empty() || written_by(dir, run_id);
  };
  if (free_or_own(asked)) return asked;
  const fs::path own = sibling(asked, "-" + run_id.substr(0, 8));
  recover_name(own, actions);
  if (free_or_own(own)) return own;
  throw Error(
      fmt::format("'{}' and '{}' both hold something other than a checkpoint of run {}: "
                  "refusing to replace either",
                  asked.string(), own.string(), run_id));
}

std::int64_t next_save_sequence(const fs::path& root) {
  std::int64_t highest = 0;
  for (const auto& c : scan_checkpoints(root).complete)
    highest = std::max(highest, c.save_sequence);
  return highest + 1;
}

}  // namespace

fs::path save_checkpoint(Engine& engine, const fs::path& dir_in, const SaveOptions& options) {
  const fs::path asked = normalized(dir_in, "save_checkpoint");
  if (!options.extra.is_object())
    throw ConfigError("save_checkpoint: SaveOptions::extra must be a JSON object");
  // What load would refuse is refused before anything is written. The values are checked before
  // encode_byte_strings walks them (recursively) and again as they would be stored.
  for (const auto& [name, value] : {std::pair<const char*, const json*>{"extra", &options.extra},
                                    {"config", &options.config}}) {
    constexpr std::size_t kStoredDepth = kMaxMetadataDepth - 2;  // below the outer and metadata
    auto deep = json_deeper_than(*value, kStoredDepth);
    if (!deep) deep = json_deeper_than(encode_byte_strings(*value), kStoredDepth);
    if (deep)
      throw ConfigError(fmt::format(
          "save_checkpoint: SaveOptions::{}: {}: nested deeper than {} levels of objects and "
          "lists (as stored), the most a checkpoint's metadata holds there",
          name, json_path_text(*deep), kStoredDepth));
  }
  if (!options.run_id.empty() && (options.run_id.size() < 8 || !is_lower_hex(options.run_id)))
    throw ConfigError(
        fmt::format("save_checkpoint: SaveOptions::run_id '{}' must be empty or at "
                    "least 8 lowercase hex digits (new_random_id())",
                    options.run_id));
  const int rank = engine.rank(), world = engine.world_size();
  const int slots = engine.config().optimizer.state_slots();
  // Refused in the save's own name, on every rank alike: a rank with gradients pending must
  // not leave the others in the save's collectives.
  TrainingState state;
  std::exception_ptr pending;
  attempt(pending, [&] {
    EngineInternals::require_none_pending(engine, "save_checkpoint");
    state = engine.training_state(rank == 0);
  });
  agree(engine, pending, "save_checkpoint");

  // Rank 0 recovers what an interrupted save of the name left, chooses the directory (the name
  // asked, or the run's suffixed one) and makes the temporary one. A failure here removes
  // nothing: a leftover it did not get to may be the only complete copy.
  fs::path dir = asked;
  std::string save_id;
  std::int64_t sequence = 0;
  std::exception_ptr error;
  attempt(error, [&] {
    if (rank != 0) return;
    writing(asked, [&] {
      if (!asked.parent_path().empty()) fs::create_directories(asked.parent_path());
      dir = save_target(asked, options.run_id);
      sequence = next_save_sequence(parent_directory(dir));
      save_id = new_random_id();
      if (!fs::create_directory(sibling(dir, ".tmp-save")))
        throw Error(fmt::format("'{}' appeared during the save: refusing to write into it",
                                sibling(dir, ".tmp-save").string()));
    });
  });
  agree(engine, error, "save_checkpoint");
  // Every rank writes into rank 0's directory, with rank 0's save id.
  if (from_rank0(engine, dir != asked ? 1 : 0) != 0)
    dir = sibling(asked, "-" + options.run_id.substr(0, 8));
  std::uint64_t id_parts[3] = {};
  for (int i = 0; i < 3; ++i)
    id_parts[i] =
        from_rank0(engine, rank == 0 ? std::stoull(save_id.substr(i * 11, 11), nullptr, 16) : 0);
  save_id = fmt::format("{:011x}{:011x}{:010x}", id_parts[0], id_parts[1], id_parts[2]);
  const fs::path tmp = sibling(dir, ".tmp-save");
  const fs::path old = sibling(dir, ".old-save");
  const auto remove_tmp = [&] {
    std::error_code ec;
    if (rank == 0) fs::remove_all(tmp, ec);
  };

  // Each rank's pieces: per param, the element range it holds, master then each slot.
  const auto groups = engine.groups();
  attempt(error, [&] {
    const fs::path path = tmp / rank_file_name(rank, world);
    writing(path, [&] {
      json pieces = json::array();
      std::int64_t offset = 0;
      struct Source {
        const GroupTrainingState* s;
        std::int64_t shard_offset, count, shard;
      };
      std::vector<Source> sources;
      for (std::size_t gi = 0; gi < groups.size(); ++gi) {
        const auto& s = state.groups[gi];
        if (!s.active && !s.kept) continue;
        const Shard shard = Shard::of(EngineInternals::layout(engine, groups[gi]), rank);
        const auto members = params_of(engine, groups[gi]);
        for (const auto& f : shard.fragments) {
          pieces.push_back({{"param", members[f.param]->name},
                            {"begin", f.param_offset},
                            {"count", f.count},
                            {"offset", offset}});
          offset += (1 + slots) * f.count * 4;
          sources.push_back({&s, f.shard_offset, f.count, shard.numel()});
        }
      }
      const json header = {{"kind", "rank"},      {"save_id", save_id},   {"rank", rank},
                           {"world_size", world}, {"state_slots", slots}, {"pieces", pieces}};
      BinaryWriter out(options.open, path, header);
      for (const auto& src : sources) {
        out.write(src.s->master.data() + src.shard_offset, src.count * 4);
        for (int k = 0; k < slots; ++k)
          out.write(src.s->state.data() + k * src.shard + src.shard_offset, src.count * 4);
      }
      out.finish();
    });
    if (rank != 0) return;
    // The bit16 weights are the same on every rank: saved once.
    const fs::path weights = tmp / kWeightsName;
    writing(weights, [&] {
      json entries = json::array();
      std::int64_t offset = 0;
      for (std::size_t i = 0; i < engine.params().size(); ++i) {
        const auto bytes = static_cast<std::int64_t>(state.weights[i].size());
        entries.push_back(
            {{"name", engine.params()[i].name}, {"offset", offset}, {"bytes", bytes}});
        offset += bytes;
      }
      BinaryWriter out(options.open, weights,
                       {{"kind", "weights"},
                        {"save_id", save_id},
                        {"dtype", dtype_name(engine.config().dtype)},
                        {"params", entries}});
      for (const auto& w : state.weights) out.write(w.data(), w.size());
      out.finish();
    });
  });
  agree(engine, error, "save_checkpoint", remove_tmp);

  // Rank 0: the metadata, then the directory into place.
  attempt(error, [&] {
    if (rank != 0) return;
    const auto& config = engine.config();
    json meta;
    meta["format_version"] = kFormatVersion;
    meta["shardswap_version"] = SHARDSWAP_VERSION;
    meta["save_id"] = save_id;
    meta["save_sequence"] = sequence;
    meta["run_id"] = options.run_id;
    meta["parent"] = options.parent
                         ? json{{"run_id", options.parent->run_id}, {"step", options.parent->step}}
                         : json(nullptr);
    meta["world_size"] = world;
    meta["dtype"] = dtype_name(config.dtype);
    meta["stage"] = config.stage;
    meta["alignment_bytes"] = config.alignment_bytes;
    meta["optimizer"] = optimizer_type_name(config.optimizer.type);
    meta["state_slots"] = slots;
    meta["lr"] = state.lr;
    meta["loss_scaler"] = {{"scale", state.scaler.scale},
                           {"clean_steps", state.scaler.clean_steps},
                           {"hysteresis_left", state.scaler.hysteresis_left}};
    json params = json::array();
    for (const auto& p : engine.params())
      params.push_back({{"name", p.name}, {"shape", p.shape}, {"group", p.group}});
    meta["params"] = params;
    json gs = json::array();
    for (const auto& s : state.groups)
      gs.push_back({{"name", s.group}, {"state", holding_name(s)}, {"step", s.step}});
    meta["groups"] = gs;
    meta["active"] = engine.active_groups();
    json files = json::array();
    // Each file as it lies on disk: its size, and its trailer (the checksum of the rest).
    const auto add_file = [&](const std::string& name) {
      writing(tmp / name, [&] {
        const InputFile in(tmp / name);
        std::uint64_t trailer = 0;
        if (in.size() < kTrailBytes) throw Error("shorter than its trailer");
        in.read(&trailer, sizeof trailer, in.size() - kTrailBytes);
        files.push_back({{"name", name}, {"bytes", in.size()}, {"fnv1a64", hex64(trailer)}});
      });
    };
    add_file(kWeightsName);
    for (int r = 0; r < world; ++r) add_file(rank_file_name(r, world));
    meta["files"] = files;
    const fs::path meta_path = tmp / kMetadataName;
    writing(meta_path, [&] {
      // Strings that are not UTF-8 (a path may hold any bytes) cannot be JSON text as they are.
      meta["config"] = encode_byte_strings(options.config);
      meta["extra"] = encode_byte_strings(options.extra);
      const std::string text = meta.dump(1);
      const std::string whole = fmt::format(
          "{}{}{}{}}}\n", kPrefix, hex64(fnv1a64(text.data(), text.size())), kMiddle, text);
      auto file = options.open(meta_path);
      file->write(whole.data(), whole.size());
      file->commit();
    });
    writing(dir, [&] {
      fsync_directory(tmp);
      // Renames only, until the new copy is in place: at every instant one complete copy lies
      // under a name recover_checkpoints() knows (DIR, then DIR.old-save or DIR.tmp-save).
      // save_target() recovered every leftover of the name, so an .old-save here is not ours.
      if (fs::exists(fs::symlink_status(old)))
        throw Error(
            fmt::format("'{}' appeared during the save: refusing to touch it", old.string()));
      const bool replacing = fs::exists(fs::symlink_status(dir));
      if (replacing) fs::rename(dir, old);
      try {
        fs::rename(tmp, dir);
      } catch (...) {
        std::error_code ec;
        if (replacing) fs::rename(old, dir, ec);
        throw;
      }
      fsync_directory(parent_directory(dir));
      if (replacing) fs::remove_all(old);
    });
  });
  agree(engine, error, "save_checkpoint", remove_tmp);
  return dir;
}

json read_checkpoint_metadata(const fs::path& dir) {
  const fs::path file = dir / kMetadataName;
  if (!fs::is_directory(dir))
    throw ConfigError(fmt::format("checkpoint '{}' is not a directory", dir.string()));
  if (!fs::exists(fs::symlink_status(file)))
    throw ConfigError(fmt::format("'{}' is not a ShardSwap checkpoint: '{}' is missing",
                                  dir.string(), file.string()));
  const InputFile in(file);
  if (in.size() > kMaxMetadataBytes)
    throw ConfigError(
        fmt::format("'{}' holds {} bytes, more than a checkpoint's metadata may "
                    "({})",
                    file.string(), in.size(), kMaxMetadataBytes));
  const auto bytes = in.read_all();
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  const std::size_t body = kPrefix.size() + 16 + kMiddle.size();
  if (text.size() < body + 2 || text.substr(0, kPrefix.size()) != kPrefix ||
      text.substr(kPrefix.size() + 16, kMiddle.size()) != kMiddle || !text.ends_with("}\n"))
    throw ConfigError(
        fmt::format("'{}' is not a ShardSwap checkpoint metadata file", file.string()));
  const std::string_view inner = text.substr(body, text.size() - body - 2);
  const std::string stored(text.substr(kPrefix.size(), 16));
  const std::string computed = hex64(fnv1a64(inner.data(), inner.size()));
  if (stored != computed)
    throw ConfigError(fmt::format("'{}': checksum mismatch (stored {}, computed {}): the file is "
                                  "corrupt",
                                  file.string(), stored, computed));
  // The whole file is parsed (it is JSON as a whole), so a line and column count in the file.
  // Bounded in depth: `extra` is the trainer's own and may nest, but nothing deeper than what
  // save_checkpoint writes is read (a hostile one 100,000 levels deep would overflow the stack in
  // every recursive walk of it: dump, copy, decode_byte_strings).
  json whole = parse_json(text, file.string(), kMetadataLimits);
  // The prefix puts "format", "fnv1a64" and "metadata" first; any other key would be text after
  // the metadata that the checksum covers but the reader would not see as metadata.
  if (!whole.is_object() || whole.size() != 3 || !whole.contains("metadata"))
    throw ConfigError(
        fmt::format("'{}' is not a ShardSwap checkpoint metadata file", file.string()));
  json meta = std::move(whole["metadata"]);
  if (!meta.is_object())
    throw ConfigError(fmt::format("'{}': the metadata is not a JSON object", file.string()));
  const int version = field<int>(meta, "format_version", file);
  if (version == 1)
    throw ConfigError(
        fmt::format("'{}': format version 1, written before checkpoints recorded "
                    "their save id and lineage; this build reads version {} only "
                    "(resume it with the shardswap that wrote it)",
                    file.string(), kFormatVersion));
  if (version != kFormatVersion)
    throw ConfigError(fmt::format("'{}': format version {}; this build reads version {}",
                                  file.string(), version, kFormatVersion));
  const auto save_id = field<std::string>(meta, "save_id", file);
  if (save_id.size() != 32 || !is_lower_hex(save_id))
    throw ConfigError(
        fmt::format("'{}': save_id '{}' is not 32 hex digits", file.string(), save_id));
  (void)field<std::string>(meta, "run_id", file);
  if (field<std::int64_t>(meta, "save_sequence", file) < 1)
    throw ConfigError(fmt::format("'{}': save_sequence must be >= 1", file.string()));
  const json& parent = field<json>(meta, "parent", file);
  if (!parent.is_null()) {
    (void)field<std::string>(parent, "run_id", file);
    (void)field<std::int64_t>(parent, "step", file);
  }
  // Every field a reader (load, inspect, export, a trainer) takes as given, checked once here,
  // so each failure is a ConfigError naming the field.
  (void)field<std::string>(meta, "shardswap_version", file);
  (void)field<int>(meta, "world_size", file);
  (void)field<int>(meta, "stage", file);
  (void)field<int>(meta, "state_slots", file);
  (void)field<std::string>(meta, "dtype", file);
  (void)field<std::string>(meta, "optimizer", file);
  (void)field<double>(meta, "lr", file);
  (void)field<std::vector<std::string>>(meta, "active", file);
  const json& scaler = field<json>(meta, "loss_scaler", file);
  (void)field<double>(scaler, "scale", file);
  (void)field<std::int64_t>(scaler, "clean_steps", file);
  (void)field<int>(scaler, "hysteresis_left", file);
  const auto list_of_objects = [&](const char* key) -> const json& {
    const json& list = meta.at(key);
    if (!list.is_array() ||
        !std::all_of(list.begin(), list.end(), [](const json& e) { return e.is_object(); }))
      throw ConfigError(fmt::format("'{}': field '{}': expected a list of objects, got {}",
                                    file.string(), key, list.dump().substr(0, 64)));
    return list;
  };
  (void)field<json>(meta, "params", file);
  for (const auto& p : list_of_objects("params")) {
    (void)field<std::string>(p, "name", file);
    (void)field<std::vector<std::int64_t>>(p, "shape", file);
    (void)field<std::string>(p, "group", file);
  }
  (void)field<json>(meta, "groups", file);
  for (const auto& g : list_of_objects("groups")) {
    (void)field<std::string>(g, "name", file);
    (void)field<std::string>(g, "state", file);
    (void)field<std::int64_t>(g, "step", file);
  }
  (void)field<json>(meta, "files", file);
  for (const auto& f : list_of_objects("files")) {
    (void)field<std::string>(f, "name", file);
    (void)field<std::uint64_t>(f, "bytes", file);
    (void)field<std::string>(f, "fnv1a64", file);
  }
  // The trainer's state: an object, as save_checkpoint requires (a trainer reads its fields by
  // name; tools/train.cpp checks those of ShardSwap's own trainer).
  const json& extra = field<json>(meta, "extra", file);
  if (!extra.is_object())
    throw ConfigError(fmt::format("'{}': field 'extra': expected an object, got {}", file.string(),
                                  extra.dump().substr(0, 64)));
  return meta;
}

LoadedCheckpoint load_checkpoint(Engine& engine, const fs::path& dir_in) {
  LoadedCheckpoint out;
  TrainingState state;
  std::exception_ptr error;
  attempt(error, [&] {
    EngineInternals::require_none_pending(engine, "load_checkpoint");
    const fs::path dir = normalized(dir_in, "load_checkpoint");
    try {
      state = read_state_for(engine, dir, out);
    } catch (const ConfigError& e) {
      if (std::string_view(e.what()).starts_with("load_checkpoint")) throw;
      throw ConfigError(fmt::format("load_checkpoint: {}", e.what()));
    }
  });
  agree(engine, error, "load_checkpoint");
  engine.restore_training_state(state);
  return out;
}

std::vector<CheckpointTensor> read_checkpoint_tensors(const fs::path& dir, bool master) {
  const json meta = read_checkpoint_metadata(dir);
  const auto params = saved_params(meta, dir / kMetadataName);
  const Weights weights = read_weights(dir, meta, params);
  std::vector<CheckpointTensor> out;
  for (std::size_t i = 0; i < params.size(); ++i) {
    CheckpointTensor t{params[i].name, params[i].shape, weights.dtype, weights.raw[i]};
    if (master) {
      // Widened bit16 weights, overwritten below by the saved masters where a group has them.
      t.dtype = DType::f32;
      t.data.resize(static_cast<std::size_t>(params[i].numel) * 4);
      cpu_device_ops().cast(t.data.data(), DType::f32, weights.raw[i].data(), weights.dtype,
                         static_cast<std::size_t>(params[i].numel));
    }
    out.push_back(std::move(t));
  }
  if (master)
    read_pieces(dir, meta, params,
                [&](std::size_t param, std::int64_t begin, std::int64_t count,
                    const float* values) {
                  std::memcpy(out[param].data.data() + begin * 4, values, count * 4);
                });
  else
    read_pieces(dir, meta, params, [](std::size_t, std::int64_t, std::int64_t, const float*) {});
  return out;
}

std::string checkpoint_name(std::int64_t step) { return fmt::format("step-{:08}", step); }

namespace {

// Throws ConfigError unless every file `meta` lists is in `dir`, regular, of the recorded size.
void require_files_present(const fs::path& dir, const json& meta) {
  const fs::path meta_file = dir / kMetadataName;
  for (const auto& f : field<json>(meta, "files", meta_file)) {
    const auto name = field<std::string>(f, "name", meta_file);
    const auto bytes = field<std::uint64_t>(f, "bytes", meta_file);
    if (name.empty() || name.find('/') != std::string::npos || name == "..")
      throw ConfigError(
          fmt::format("'{}': file name '{}' is not a name", meta_file.string(), name));
    std::error_code ec;
    const auto st = fs::status(dir / name, ec);
    if (!fs::exists(st)) throw ConfigError(fmt::format("'{}' is missing", (dir / name).string()));
    if (!fs::is_regular_file(st))
      throw ConfigError(fmt::format("'{}' is not a regular file", (dir / name).string()));
    const auto size = fs::file_size(dir / name, ec);
    if (ec || size != bytes)
      throw ConfigError(fmt::format("'{}' holds {} bytes, the metadata says {}",
                                    (dir / name).string(), size, bytes));
  }
}

template <class F>
auto in_root(const char* fn, const fs::path& root, F&& body) {
  try {
    return body();
  } catch (const fs::filesystem_error& e) {
    throw Error(fmt::format("{}: under '{}': {}", fn, root.string(), e.what()));
  }
}

}  // namespace

CheckpointScan scan_checkpoints(const fs::path& root) {
  CheckpointScan out;
  std::error_code ec;
  if (!fs::exists(root, ec)) return out;
  fs::directory_iterator it(root, ec);
  if (ec)
    throw ConfigError(
        fmt::format("cannot list checkpoint directory '{}': {}", root.string(), ec.message()));
  for (const auto& entry : it) {
    const auto step = checkpoint_step(entry.path().filename().string());
    if (!step) continue;
    try {
      const json meta = read_checkpoint_metadata(entry.path());
      require_files_present(entry.path(), meta);
      out.complete.push_back({entry.path(), *step, meta.at("run_id").get<std::string>(),
                              meta.at("save_sequence").get<std::int64_t>()});
    } catch (const ConfigError& e) {
      out.skipped.push_back(e.what());
    }
  }
  std::sort(out.complete.begin(), out.complete.end(), [](const auto& a, const auto& b) {
    return std::tie(a.save_sequence, a.step, a.path) < std::tie(b.save_sequence, b.step, b.path);
  });
  std::sort(out.skipped.begin(), out.skipped.end());
  return out;
}

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  auto complete = scan_checkpoints(root).complete;
  std::stable_sort(complete.begin(), complete.end(),
                   [](const auto& a, const auto& b) { return a.step < b.step; });
  std::vector<fs::path> out;
  for (auto& c : complete) out.push_back(std::move(c.path));
  return out;
}

std::optional<CheckpointEntry> latest_checkpoint(const fs::path& root) {
  auto complete = scan_checkpoints(root).complete;
  if (complete.empty()) return std::nullopt;
  return complete.back();
}

std::vector<std::string> recover_checkpoints(const fs::path& root) {
  return in_root("recover_checkpoints", root, [&] {
    std::vector<std::string> actions;
    std::error_code ec;
    if (!fs::is_directory(root, ec)) return actions;
    std::set<std::string> saves;
    std::vector<fs::path> prunes;
    for (const auto& entry : fs::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      const auto base = [&](std::string_view suffix) {
        return name.ends_with(suffix) &&
               checkpoint_step(std::string_view(name).substr(0, name.size() - suffix.size()));
      };
      if (base(".tmp-save") || base(".old-save")) saves.insert(name.substr(0, name.size() - 9));
      if (base(".prune")) prunes.push_back(entry.path());
    }
    for (const auto& p : prunes) {
      fs::remove_all(p);
      actions.push_back(fmt::format("removed '{}' (left by an interrupted prune)", p.string()));
    }
    for (const auto& name : saves) recover_name(root / name, actions);
    if (!actions.empty()) fsync_directory(root);
    return actions;
  });
}

void prune_checkpoints(const fs::path& root, int keep, const std::string& run_id) {
  if (keep < 1)
    throw ConfigError(fmt::format("prune_checkpoints: keep = {} must be >= 1", keep));
  in_root("prune_checkpoints", root, [&] {
    recover_checkpoints(root);
    std::vector<fs::path> own;  // oldest first
    for (const auto& c : scan_checkpoints(root).complete)
      if (c.run_id == run_id) own.push_back(c.path);
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < own.size(); ++i) {
      // Out of the checkpoint names first: a kill during the removal leaves a .prune leftover,
      // never a partial checkpoint under a name that lists.
      const fs::path doomed = sibling(own[i], ".prune");
      fs::rename(own[i], doomed);
      fsync_directory(root);
      fs::remove_all(doomed);
    }
  });
}

// ---- strings that are not UTF-8 ----

namespace {

// RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF (what JSON text allows).
bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    std::uint32_t cp = 0;
    if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (std::size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3f);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += len;
  }
  return true;
}

constexpr const char* kBytesHex = "bytes_hex";
constexpr const char* kObjectEntries = "object_entries";

bool looks_encoded(const json& j) {
  return j.is_object() && j.size() == 1 && (j.contains(kBytesHex) || j.contains(kObjectEntries));
}

std::string to_hex(std::string_view s) {
  std::string out;
  out.reserve(2 * s.size());
  for (unsigned char c : s) out += fmt::format("{:02x}", c);
  return out;
}

std::string from_hex(const std::string& hex) {
  if (hex.size() % 2 != 0 || !is_lower_hex(hex))
    throw ConfigError(
        fmt::format("{} '{}' is not an even number of lowercase hex digits", kBytesHex, hex));
  std::string out(hex.size() / 2, '\0');
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return out;
}

}  // namespace

json encode_byte_strings(const json& j) {
  if (j.is_string()) {
    const auto& s = j.get_ref<const std::string&>();
    if (valid_utf8(s)) return j;
    json out = json::object();
    out[kBytesHex] = to_hex(s);
    return out;
  }
  if (j.is_array()) {
    json out = json::array();
    for (const auto& e : j) out.push_back(encode_byte_strings(e));
    return out;
  }
  if (!j.is_object()) return j;
  bool plain = !looks_encoded(j);
  for (const auto& [key, value] : j.items()) plain = plain && valid_utf8(key);
  json out = json::object();
  if (plain) {
    for (const auto& [key, value] : j.items()) out[key] = encode_byte_strings(value);
    return out;
  }
  json entries = json::array();
  for (const auto& [key, value] : j.items())
    entries.push_back(json::array({encode_byte_strings(json(key)), encode_byte_strings(value)}));
  out[kObjectEntries] = std::move(entries);
  return out;
}

// Recursive, and bounded: metadata is read at most kMaxMetadataDepth deep (read_checkpoint_metadata
// refuses deeper), and save_checkpoint refuses to store anything deeper.
json decode_byte_strings(const json& j) {
  if (j.is_array()) {
    json out = json::array();
    for (const auto& e : j) out.push_back(decode_byte_strings(e));
    return out;
  }
  if (!j.is_object()) return j;
  if (looks_encoded(j) && j.contains(kBytesHex)) {
    if (!j[kBytesHex].is_string())
      throw ConfigError(fmt::format("{} holds {}, not a string", kBytesHex, j[kBytesHex].dump()));
    return from_hex(j[kBytesHex].get<std::string>());
  }
  json out = json::object();
  if (looks_encoded(j)) {
    if (!j[kObjectEntries].is_array())
      throw ConfigError(fmt::format("{} is not an array", kObjectEntries));
    for (const auto& e : j[kObjectEntries]) {
      const json key = e.is_array() && e.size() == 2 ? decode_byte_strings(e[0]) : json();
      if (!key.is_string())
        throw ConfigError(
            fmt::format("{} holds {}, not a [key, value] pair", kObjectEntries, e.dump()));
      out[key.get<std::string>()] = decode_byte_strings(e[1]);
    }
    return out;
  }
  for (const auto& [key, value] : j.items()) out[key] = decode_byte_strings(value);
  return out;
}

std::string new_random_id() {
  try {
    std::random_device device;
    std::string id;
    for (int i = 0; i < 4; ++i) id += fmt::format("{:08x}", static_cast<std::uint32_t>(device()));
    return id;
  } catch (const std::exception& e) {
    throw Error(fmt::format("new_random_id: no random device: {}", e.what()));
  }
}

}  // namespace shardswap
