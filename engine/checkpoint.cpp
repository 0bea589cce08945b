// Checkpoint files (format in docs/checkpoints.md). Saving: every rank writes its file into a
// temporary directory, the ranks agree that all succeeded, rank 0 writes the metadata and renames
// the directory into place. Loading: every rank reads and verifies every file (so every rank
// fails the same way on bad input), keeps the pieces that fall in its own shard at the current
// world size, and only then hands the engine one TrainingState to restore.
#include "engine/engine_internals.h"
#include "optimizer/optimizer.h"
#include "shardswap/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <system_error>

#include "shardswap/error.h"
#include "partition/flat_layout.h"

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
constexpr const char* kFormat = "shardswap-checkpoint";
constexpr int kFormatVersion = 1;
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

// ---- writing ----

class PosixFile final : public CheckpointFile {
 public:
  explicit PosixFile(fs::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("open");
  }
  ~PosixFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, std::size_t bytes) override {
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd_, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("write");
      p += n;
      bytes -= static_cast<std::size_t>(n);
    }
  }
  void commit() override {
    if (::fsync(fd_) != 0) fail("fsync");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("close");
  }

 private:
  [[noreturn]] void fail(const char* call) const {
    throw Error(fmt::format("{} '{}': {}", call, path_.string(), std::strerror(errno)));
  }
  fs::path path_;
  int fd_ = -1;
};

void fsync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw Error(fmt::format("fsync of directory '{}': {}", dir.string(), std::strerror(err)));
  }
  ::close(fd);
}

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

std::vector<std::byte> read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("cannot open '{}'", path.string()));
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::size_t>(in.tellg());
  in.seekg(0);
  std::vector<std::byte> bytes(size);
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
  if (!in) throw ConfigError(fmt::format("cannot read '{}'", path.string()));
  return bytes;
}

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

BinaryFile read_binary(const fs::path& path, std::uint64_t expected_bytes) {
  if (!fs::exists(path))
    throw ConfigError(fmt::format("'{}' is missing", path.string()));
  BinaryFile f;
  f.path = path;
  f.bytes = read_all(path);
  if (f.bytes.size() != expected_bytes)
    throw ConfigError(fmt::format("'{}' holds {} bytes, the metadata says {}: truncated or "
                                  "replaced",
                                  path.string(), f.bytes.size(), expected_bytes));
  if (f.bytes.size() < kHeadBytes + kTrailBytes ||
      std::memcmp(f.bytes.data(), kMagic, sizeof kMagic) != 0)
    throw ConfigError(fmt::format("'{}' is not a ShardSwap checkpoint file", path.string()));
  std::uint64_t stored = 0, length = 0;
  std::memcpy(&stored, f.bytes.data() + f.bytes.size() - kTrailBytes, kTrailBytes);
  const std::uint64_t computed = fnv1a64(f.bytes.data(), f.bytes.size() - kTrailBytes);
  if (stored != computed)
    throw ConfigError(fmt::format("'{}': checksum mismatch (stored {}, computed {}): the file is "
                                  "corrupt",
                                  path.string(), hex64(stored), hex64(computed)));
  std::memcpy(&length, f.bytes.data() + sizeof kMagic, sizeof length);
  if (length > f.bytes.size() - kHeadBytes - kTrailBytes)
    throw ConfigError(fmt::format("'{}': header length {} exceeds the file", path.string(), length));
  const auto* text = reinterpret_cast<const char*>(f.bytes.data() + kHeadBytes);
  f.header = json::parse(text, text + length, nullptr, false);
  if (f.header.is_discarded() || !f.header.is_object())
    throw ConfigError(fmt::format("'{}': the header is not a JSON object", path.string()));
  f.data_begin = kHeadBytes + length;
  f.data_end = f.bytes.size() - kTrailBytes;
  return f;
}

// Reads a metadata field, turning a missing or mistyped one into an error naming the file.
template <class T>
T field(const json& j, const char* key, const fs::path& file) {
  try {
    return j.at(key).get<T>();
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("'{}': field '{}': {}", file.string(), key, e.what()));
  }
}

std::uint64_t file_bytes(const json& meta, const std::string& name, const fs::path& file) {
  for (const auto& f : field<json>(meta, "files", file))
    if (field<std::string>(f, "name", file) == name) return field<std::uint64_t>(f, "bytes", file);
  throw ConfigError(fmt::format("'{}' does not list '{}'", file.string(), name));
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
    const BinaryFile f = read_binary(dir / name, file_bytes(meta, name, meta_file));
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
  const BinaryFile f = read_binary(dir / kWeightsName, file_bytes(meta, kWeightsName, meta_file));
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
  out.extra = field<json>(meta, "extra", meta_file);
  out.world_size = field<int>(meta, "world_size", meta_file);
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

void save_checkpoint(Engine& engine, const fs::path& dir_in, const SaveOptions& options) {
  const fs::path dir = normalized(dir_in, "save_checkpoint");
  if (!options.extra.is_object())
    throw ConfigError("save_checkpoint: SaveOptions::extra must be a JSON object");
  const int rank = engine.rank(), world = engine.world_size();
  const int slots = engine.config().optimizer.state_slots();
  const fs::path tmp = dir.parent_path() / (dir.filename().string() + ".tmp-save");
  const fs::path old = dir.parent_path() / (dir.filename().string() + ".old-save");
  const TrainingState state = engine.training_state(rank == 0);
  const auto remove_tmp = [&] {
    std::error_code ec;
    if (rank == 0) fs::remove_all(tmp, ec);
  };

  std::exception_ptr error;
  attempt(error, [&] {
    if (rank != 0) return;
    writing(tmp, [&] {
      fs::remove_all(tmp);  // a leftover of an interrupted save
      if (!dir.parent_path().empty()) fs::create_directories(dir.parent_path());
      fs::create_directory(tmp);
    });
  });
  agree(engine, error, "save_checkpoint", remove_tmp);

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
      const json header = {{"kind", "rank"},
                           {"rank", rank},
                           {"world_size", world},
                           {"state_slots", slots},
                           {"pieces", pieces}};
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
    const auto add_file = [&](const std::string& name) {
      files.push_back({{"name", name}, {"bytes", fs::file_size(tmp / name)}});
    };
    add_file(kWeightsName);
    for (int r = 0; r < world; ++r) add_file(rank_file_name(r, world));
    meta["files"] = files;
    meta["config"] = options.config;
    meta["extra"] = options.extra;
    const std::string text = meta.dump(1);
    const std::string whole = fmt::format("{}{}{}{}}}\n", kPrefix,
                                          hex64(fnv1a64(text.data(), text.size())), kMiddle, text);
    const fs::path meta_path = tmp / kMetadataName;
    writing(meta_path, [&] {
      auto file = options.open(meta_path);
      file->write(whole.data(), whole.size());
      file->commit();
    });
    writing(dir, [&] {
      fsync_directory(tmp);
      // An older checkpoint of the same name goes aside only now that the new one is complete.
      fs::remove_all(old);
      const bool replacing = fs::exists(dir);
      if (replacing) fs::rename(dir, old);
      fs::rename(tmp, dir);
      fsync_directory(dir.parent_path().empty() ? fs::path(".") : dir.parent_path());
      if (replacing) fs::remove_all(old);
    });
  });
  agree(engine, error, "save_checkpoint", remove_tmp);
}

json read_checkpoint_metadata(const fs::path& dir) {
  const fs::path file = dir / kMetadataName;
  if (!fs::is_directory(dir))
    throw ConfigError(fmt::format("checkpoint '{}' is not a directory", dir.string()));
  if (!fs::exists(file))
    throw ConfigError(fmt::format("'{}' is not a ShardSwap checkpoint: '{}' is missing",
                                  dir.string(), file.string()));
  const auto bytes = read_all(file);
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
  json meta = json::parse(inner, nullptr, false);
  if (meta.is_discarded() || !meta.is_object())
    throw ConfigError(fmt::format("'{}': the metadata is not a JSON object", file.string()));
  const int version = field<int>(meta, "format_version", file);
  if (version != kFormatVersion)
    throw ConfigError(fmt::format("'{}': format version {}; this build reads version {}",
                                  file.string(), version, kFormatVersion));
  return meta;
}

LoadedCheckpoint load_checkpoint(Engine& engine, const fs::path& dir_in) {
  LoadedCheckpoint out;
  TrainingState state;
  std::exception_ptr error;
  attempt(error, [&] {
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

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<std::int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const auto name = entry.path().filename().string();
    if (!name.starts_with("step-") || name.find('.') != std::string::npos) continue;
    if (!fs::exists(entry.path() / kMetadataName)) continue;
    try {
      found.emplace_back(std::stoll(name.substr(5)), entry.path());
    } catch (const std::exception&) {
      // not one of ours
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [step, path] : found) out.push_back(std::move(path));
  return out;
}

void prune_checkpoints(const fs::path& root, int keep) {
  if (keep < 1)
    throw ConfigError(fmt::format("prune_checkpoints: keep = {} must be >= 1", keep));
  const auto all = list_checkpoints(root);
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < all.size(); ++i)
    fs::remove_all(all[i]);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const auto name = entry.path().filename().string();
    // A .old-save directory is left alone: a save interrupted between its two renames leaves
    // the only complete copy there.
    if (name.starts_with("step-") && name.ends_with(".tmp-save")) fs::remove_all(entry.path());
  }
}

}  // namespace shardswap
