// The files of a checkpoint (format in docs/checkpoints.md): the names, writing a file durably,
// reading a binary file with every check, and the metadata file (read_checkpoint_metadata).
#include "engine/checkpoint_format.h"
#include "support/durable_file.h"

#include <bit>
#include <optional>
#include <system_error>

namespace shardswap {

namespace checkpoint_detail {

static_assert(std::endian::native == std::endian::little,
              "checkpoint files are little-endian and written with memcpy");

std::string rank_file_name(int rank, int world) {
  return fmt::format("rank-{:05}-of-{:05}.bin", rank, world);
}

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }

bool is_lower_hex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

fs::path sibling(const fs::path& dir, std::string_view suffix) {
  return dir.parent_path() / (dir.filename().string() + std::string(suffix));
}

namespace {

// The CheckpointFile of open_checkpoint_file: a DurableFile (tests hand save_checkpoint others).
class PosixFile final : public CheckpointFile {
 public:
  explicit PosixFile(fs::path path) : file_(std::move(path)) {}
  void write(const void* data, std::size_t bytes) override { file_.write(data, bytes); }
  void commit() override { file_.commit(); }

 private:
  DurableFile file_;
};

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

}  // namespace

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

}  // namespace checkpoint_detail

using namespace checkpoint_detail;

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

// Every field a reader (load, inspect, export, a trainer) takes as given, checked once here,
// so each failure is a ConfigError naming the field.
void check_reader_fields(const json& meta, const fs::path& file) {
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
  // name; tools/trainer/train.cpp checks those of ShardSwap's own trainer).
  const json& extra = field<json>(meta, "extra", file);
  if (!extra.is_object())
    throw ConfigError(fmt::format("'{}': field 'extra': expected an object, got {}", file.string(),
                                  extra.dump().substr(0, 64)));
}

}  // namespace

json read_checkpoint_metadata(const fs::path& dir) {
  const fs::path file = dir / kMetadataName;
  // The non-throwing forms: a path the system refuses (too long, not searchable) is bad input,
  // said as such, not a filesystem_error.
  std::error_code error;
  if (!fs::is_directory(dir, error))
    throw ConfigError(fmt::format("checkpoint '{}' is not a directory{}", dir.string(),
                                  error ? fmt::format(" ({})", error.message()) : ""));
  if (!fs::exists(fs::symlink_status(file, error)))
    throw ConfigError(fmt::format("'{}' is not a ShardSwap checkpoint: '{}' is missing{}",
                                  dir.string(), file.string(),
                                  error ? fmt::format(" ({})", error.message()) : ""));
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
  check_reader_fields(meta, file);
  return meta;
}

}  // namespace shardswap
