#include "model/hf_checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <fstream>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string_view>

#include "shardswap/checkpoint.h"
#include "shardswap/elements.h"
#include "shardswap/error.h"
#include "shardswap/json_reader.h"
#include "support/durable_file.h"
#include "support/file_kind.h"
#include "support/quoted.h"

namespace shardswap {

namespace fs = std::filesystem;
using lm::dec::ParamId;
using lm::dec::ParamKind;
using nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and is copied as it is");

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr std::size_t kMaxIndexBytes = std::size_t{64} << 20;

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Buffers transformers registers on the model and older versions saved with the weights: not
// params, computed from the config.
bool is_known_buffer(std::string_view name) {
  return name.ends_with(".rotary_emb.inv_freq");
}

// Whether `path` exists as anything (a dangling link too).
bool exists_entry(const fs::path& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// A failed fsync of a directory (support/durable_file.h), as write_hf_folder says it.
Error fsync_failure(const fs::path& dir, const IoStatus& status) {
  return Error(fmt::format("write_hf_folder: cannot {} '{}': {}", status.call, dir.string(),
                           status.why()));
}

}  // namespace


std::optional<NonFinite> first_nonfinite(const SafetensorsTensor& t) {
  // The stored bits, not decoded: an all-ones exponent is Inf (zero mantissa) or NaN.
  const auto scan = [&]<class Bits>(Bits exponent, Bits mantissa) -> std::optional<NonFinite> {
    const auto n = static_cast<std::size_t>(t.numel());
    for (std::size_t i = 0; i < n; ++i) {
      Bits v;
      std::memcpy(&v, t.data + i * sizeof v, sizeof v);  // the data need not be aligned
      if ((v & exponent) == exponent)
        return NonFinite{static_cast<std::int64_t>(i), (v & mantissa) != 0 ? "NaN" : "Inf"};
    }
    return std::nullopt;
  };
  if (t.dtype == "BF16") return scan(std::uint16_t{0x7F80}, std::uint16_t{0x007F});
  if (t.dtype == "F16") return scan(std::uint16_t{0x7C00}, std::uint16_t{0x03FF});
  if (t.dtype == "F32") return scan(std::uint32_t{0x7F800000}, std::uint32_t{0x007FFFFF});
  return std::nullopt;  // convert_tensor refuses the others
}

void convert_tensor(const SafetensorsTensor& src, const fs::path& file, DType dtype,
                    std::span<std::byte> out) {
  const auto refuse = [&](std::string_view why) {
    return ConfigError(fmt::format("convert_tensor: tensor {} in '{}': {}", quote_value(src.name),
                                   file.string(), why));
  };
  const auto from = dtype_of_safetensors(src.dtype);
  if (!from || *from == DType::f64)
    throw refuse(fmt::format("stored as {}; supported: BF16, F16, F32", src.dtype));
  if (dtype == DType::f64)
    throw refuse("fp64 is no destination dtype; supported: bf16, fp16, fp32");
  const auto n = static_cast<std::size_t>(src.numel());
  if (out.size() != n * dtype_size(dtype))
    throw refuse(fmt::format("{} elements of {} are {} bytes, the destination holds {}", n,
                             dtype_name(dtype), n * dtype_size(dtype), out.size()));
  if (*from == dtype) {
    if (!out.empty()) std::memcpy(out.data(), src.data, out.size());  // an empty one may be null
    return;
  }
  // A chunk at a time through an aligned buffer: a tensor's data in a safetensors file need not
  // be aligned to its element size. Through fp32 (exact from bf16 and fp16), rounded once to
  // nearest even.
  constexpr std::size_t kChunk = 4096;
  std::vector<float> staged(kChunk), wide(kChunk), half(kChunk), narrowed(kChunk);
  const std::size_t in_width = dtype_size(*from), out_width = dtype_size(dtype);
  const auto each_chunk = [&](const auto& body) {
    for (std::size_t k0 = 0; k0 < n; k0 += kChunk) {
      const std::size_t m = std::min(kChunk, n - k0);
      std::memcpy(staged.data(), src.data + k0 * in_width, m * in_width);
      body(k0, m);
    }
  };
  if (dtype == DType::f16) {
    // Checked before anything is written: a refused copy leaves `out` as it was.
    each_chunk([&](std::size_t k0, std::size_t m) {
      convert_elements(wide.data(), DType::f32, staged.data(), *from, m);
      convert_elements(half.data(), DType::f16, wide.data(), DType::f32, m);
      convert_elements(narrowed.data(), DType::f32, half.data(), DType::f16, m);
      for (std::size_t k = 0; k < m; ++k)
        if (std::isfinite(wide[k]) && std::isinf(narrowed[k]))
          throw refuse(fmt::format("element {} = {} is beyond fp16's range", k0 + k, wide[k]));
    });
  }
  each_chunk([&](std::size_t k0, std::size_t m) {
    convert_elements(out.data() + k0 * out_width, dtype, staged.data(), *from, m);
  });
}

ConfigError HfCheckpoint::refusal(std::string_view why) const {
  return ConfigError(fmt::format("Hugging Face model folder '{}': {}", folder_.string(), why));
}

HfCheckpoint HfCheckpoint::open(const fs::path& folder, const HfSeqLen& seq_len) {
  HfCheckpoint ck;
  ck.folder_ = folder;
  struct stat st {};
  if (::stat(folder.c_str(), &st) != 0)
    throw ck.refusal(errno == ENOENT ? std::string("no such folder")
                                     : fmt::format("cannot be read: {}", std::strerror(errno)));
  if (!S_ISDIR(st.st_mode))
    throw ck.refusal(fmt::format("not a folder ({})", file_kind(st.st_mode)));
  ck.config_ = read_hf_config(folder / "config.json", seq_len);
  const Places stored = ck.map_weights();
  ck.take_params(stored);
  ck.refuse_leftovers(stored);
  return ck;
}

HfCheckpoint::Places HfCheckpoint::map_weights() {
  const bool single = exists_entry(folder_ / kSingleFile);
  const bool index = exists_entry(folder_ / kIndexFile);
  if (single && index)
    throw refusal(fmt::format("holds both {} and {}: which one is the model is ambiguous",
                              kSingleFile, kIndexFile));
  if (!single && !index)
    throw refusal(fmt::format("holds neither {} nor {} (only safetensors weights are read)",
                              kSingleFile, kIndexFile));
  if (!single) return map_index(folder_ / kIndexFile);
  Places stored;  // every tensor of the file
  files_.push_back(SafetensorsFile::open(folder_ / kSingleFile));
  const auto& tensors = files_[0].tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) stored.emplace(tensors[t].name, Place{0, t});
  return stored;
}

HfCheckpoint::Places HfCheckpoint::map_index(const fs::path& index_path) {
  const auto refuse_index = [&](std::string_view why) {
    return ConfigError(fmt::format("{}: {}", index_path.string(), why));
  };
  struct stat st {};
  if (::stat(index_path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw refuse_index("not a regular file");
  // An index lists every tensor once: tens of thousands of names in the largest models, a
  // few MiB; a bigger one is refused before it is read.
  json index_json = read_json_file(index_path, JsonLimits{64, kMaxIndexBytes, "a safetensors index"},
                                   "safetensors index");
  if (!index_json.is_object() || !index_json.contains("weight_map") ||
      !index_json["weight_map"].is_object())
    throw refuse_index("not an object with a \"weight_map\" object");
  // total_size is not checked: writers disagree on what it counts (some count padding or
  // parameters); the files' own headers are what the weights are read from.
  const json& weight_map = index_json["weight_map"];
  std::map<std::string, std::size_t> file_ids;
  std::vector<std::pair<std::string, std::string>> mapped;  // tensor, file
  for (const auto& [name, file] : weight_map.items()) {
    if (!file.is_string())
      throw refuse_index(
          fmt::format("weight_map {} = {}: not a file name", quote_value(name), file.dump()));
    const auto f = file.get<std::string>();
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos)
      throw refuse_index(fmt::format("weight_map {} = {}: not a file name in the folder",
                                     quote_value(name), quote_value(f)));
    mapped.emplace_back(name, f);
    file_ids.emplace(f, 0);
  }
  for (auto& [f, id] : file_ids) {
    id = files_.size();
    files_.push_back(SafetensorsFile::open(folder_ / f));
  }
  Places stored;  // every tensor of every file
  for (const auto& [name, f] : mapped) {
    const std::size_t id = file_ids.at(f);
    const auto* t = files_[id].find(name);
    if (t == nullptr)
      throw refuse_index(fmt::format("tensor {} is mapped to '{}', whose header does not hold it",
                                     quote_value(name), f));
    stored.emplace(name, Place{id, static_cast<std::size_t>(t - files_[id].tensors().data())});
  }
  for (const auto& [f, id] : file_ids)
    for (const auto& t : files_[id].tensors()) {
      const auto it = weight_map.find(t.name);
      if (it == weight_map.end())
        throw refuse_index(fmt::format("'{}' holds tensor {}, which the weight_map does not list",
                                       f, quote_value(t.name)));
      if (it->get<std::string>() != f)
        throw refuse_index(fmt::format("'{}' holds tensor {}, which the weight_map puts in '{}'",
                                       f, quote_value(t.name), it->get<std::string>()));
    }
  return stored;
}

void HfCheckpoint::take_params(const Places& stored) {
  std::vector<std::string> missing;
  for (const auto& spec : decoder_params(shape())) {
    const auto it = stored.find(spec.name);
    if (it == stored.end()) {
      missing.push_back(quote_value(spec.name));
      continue;
    }
    const auto& file = files_[it->second.file];
    const auto& t = file.tensors()[it->second.tensor];
    if (t.shape != spec.shape)
      throw refusal(fmt::format("tensor {} in '{}': shape {}, config.json makes it {}",
                                quote_value(spec.name), file.path().string(), shape_text(t.shape),
                                shape_text(spec.shape)));
    const auto dtype = dtype_of_safetensors(t.dtype);
    if (!dtype || *dtype == DType::f64)
      throw refusal(fmt::format("tensor {} in '{}': stored as {}; supported: BF16, F16, F32",
                                quote_value(spec.name), file.path().string(), t.dtype));
    params_.emplace(spec.name, it->second);
  }
  if (!missing.empty()) {
    const std::size_t shown = std::min<std::size_t>(missing.size(), 4);
    throw refusal(fmt::format(
        "{} tensor{} of the model missing: {}{}", missing.size(), missing.size() == 1 ? "" : "s",
        fmt::join(missing.begin(), missing.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
        missing.size() > shown ? ", ..." : ""));
  }
}

void HfCheckpoint::refuse_leftovers(const Places& stored) const {
  for (const auto& [name, p] : stored) {
    if (params_.contains(name) || is_known_buffer(name)) continue;
    const std::string file = files_[p.file].path().string();
    if (shape().tied && name == decoder_param_name({ParamKind::head})) {
      // Some converters store a tied head as well. Loaded tied, the embedding is the head, so
      // a stored head is accepted only when it is the embedding to the byte: anything else
      // would be a different model silently reduced to a tied one.
      const auto& head = files_[p.file].tensors()[p.tensor];
      const auto& embed = tensor(decoder_param_name({ParamKind::embed}));
      if (head.dtype != embed.dtype || head.shape != embed.shape ||
          (head.bytes > 0 && std::memcmp(head.data, embed.data, head.bytes) != 0))
        throw refusal(fmt::format("tensor {} in '{}': config.json ties the head to the "
                                  "embedding, but this head is not a copy of it",
                                  quote_value(name), file));
      continue;
    }
    throw refusal(fmt::format("tensor {} in '{}' is no param of the model config.json describes "
                              "({} layers, {}, {} head)",
                              quote_value(name), file, shape().layers,
                              shape().qkv_bias  ? "q/k/v biases"
                              : shape().qk_norm ? "q/k norms, no biases"
                                                : "no biases",
                              shape().tied ? "a tied" : "an untied"));
  }
}

std::vector<fs::path> HfCheckpoint::files() const {
  std::vector<fs::path> out;
  for (const auto& f : files_) out.push_back(f.path());
  return out;
}

const HfCheckpoint::Place& HfCheckpoint::place(std::string_view name) const {
  const auto it = params_.find(name);
  if (it == params_.end())
    throw ConfigError(fmt::format("HfCheckpoint: {} is not a param of the model in '{}'",
                                  quote_value(name), folder_.string()));
  return it->second;
}

const SafetensorsTensor& HfCheckpoint::tensor(std::string_view name) const {
  const auto& p = place(name);
  return files_[p.file].tensors()[p.tensor];
}

const fs::path& HfCheckpoint::file_of(std::string_view name) const {
  return files_[place(name).file].path();
}

void HfCheckpoint::copy(std::string_view name, DType dtype, std::span<std::byte> out) const {
  const auto& p = place(name);
  const SafetensorsTensor& tensor = files_[p.file].tensors()[p.tensor];
  if (const auto at = first_nonfinite(tensor))
    throw ConfigError(fmt::format(
        "model.path: tensor {} in '{}': element {} is {}: a weight that is not finite makes every "
        "step's loss NaN; the folder's weights are damaged",
        quote_value(tensor.name), files_[p.file].path().string(), at->index, at->what));
  convert_tensor(tensor, files_[p.file].path(), dtype, out);
}

namespace {

// An export's temporary folder is FOLDER.tmp-export-HOST-PID-RANDOM: the host and process that
// write it, so that the next export of FOLDER can tell one left by a writer that died
// (SIGKILL, a crash) from one being written now, here or on another machine sharing the
// filesystem.
std::string export_temporary_prefix(const fs::path& folder) {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string name;
  for (const char* c = host; *c != '\0'; ++c)
    name += (std::isalnum(static_cast<unsigned char>(*c)) != 0 || *c == '.') ? *c : '_';
  if (name.empty()) name = "host";
  return fmt::format("{}.tmp-export-{}-", folder.filename().string(), name);
}

// Removes the temporary folders of FOLDER's exports from this host whose process is gone. One of
// a live process, of another host or of another user is left alone.
void remove_dead_exports(const fs::path& parent, const fs::path& folder) {
  const std::string prefix = export_temporary_prefix(folder);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(prefix)) continue;
    const std::string_view rest = std::string_view(name).substr(prefix.size());
    const auto dash = rest.find('-');
    if (dash == 0 || dash == std::string_view::npos || dash > 9 ||
        rest.substr(0, dash).find_first_not_of("0123456789") != std::string_view::npos)
      continue;
    const auto pid = static_cast<pid_t>(std::stol(std::string(rest.substr(0, dash))));
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())
      continue;
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    std::error_code removed;
    fs::remove_all(entry.path(), removed);
  }
}

// A new, empty temporary folder for FOLDER, made as mkdir(1) makes one (0777 less the umask), so
// that the renamed export is as readable as any folder the user makes, not 0700 as mkdtemp's.
fs::path make_export_temporary(const fs::path& parent, const fs::path& folder) {
  const std::string prefix = export_temporary_prefix(folder);
  std::random_device random;
  for (int attempt = 0;; ++attempt) {
    const fs::path tmp = parent / fmt::format("{}{}-{:08x}", prefix, ::getpid(), random());
    if (::mkdir(tmp.c_str(), 0777) == 0) return tmp;
    if (errno != EEXIST || attempt == 100)
      throw Error(fmt::format("write_hf_folder '{}': cannot create a temporary folder '{}': {}",
                              folder.string(), tmp.string(), std::strerror(errno)));
  }
}

}  // namespace

fs::path check_hf_folder(const fs::path& folder_arg, std::string_view label) {
  // "out/" names the folder "out".
  const fs::path folder = folder_arg.has_filename() ? folder_arg : folder_arg.parent_path();
  const auto refuse = [&](std::string_view why) {
    return ConfigError(fmt::format("{} '{}': {}", label, folder.string(), why));
  };
  if (folder.empty()) throw refuse("an empty path");
  const fs::path parent = folder.has_parent_path() ? folder.parent_path() : fs::path(".");
  struct stat st {};
  if (::stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw refuse(fmt::format("the folder '{}' does not exist", parent.string()));
  if (::lstat(folder.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode))
      throw refuse(fmt::format("{}; refusing to replace it", file_kind(st.st_mode)));
    std::error_code ec;
    if (!fs::is_empty(folder, ec) || ec) throw refuse("not empty; refusing to write into it");
  } else if (errno != ENOENT) {
    throw refuse(std::strerror(errno));
  }
  return folder;
}

std::string read_whole_file(const fs::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0)
    throw Error(fmt::format("'{}': {}", file.string(), std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    throw Error(fmt::format("'{}': not a regular file ({})", file.string(), file_kind(st.st_mode)));
  std::ifstream in(file, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof())
    throw Error(fmt::format("'{}': cannot be read", file.string()));
  return bytes;
}

std::vector<HfSideFile> hf_side_files(const fs::path& folder) {
  std::vector<HfSideFile> out;
  for (const char* name : kHfSideFiles) {
    struct stat st {};
    if (::stat((folder / name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    const std::string bytes = read_whole_file(folder / name);
    out.push_back({name, bytes.size(), fnv1a64(bytes.data(), bytes.size())});
  }
  return out;
}

void write_hf_folder(const fs::path& folder_arg, const DecoderShape& shape, DType dtype,
                     const HfTensorFill& fill, std::uint64_t max_shard_bytes,
                     const HfFolderExtras& extras) {
  json config = extras.config_fields.is_object() ? extras.config_fields : json::object();
  config.update(hf_config_to_json(shape, dtype));  // refuses the shape and dtype first
  for (const auto& [name, bytes] : extras.files)
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
        name == "config.json" || name.ends_with(".safetensors") ||
        name == kIndexFile)
      throw ConfigError(fmt::format("write_hf_folder '{}': '{}' is no side file of a model folder",
                                    folder_arg.string(), name));
  if (max_shard_bytes < 1)
    throw ConfigError(
        fmt::format("write_hf_folder '{}': the shard size limit must be at least 1 "
                    "byte",
                    folder_arg.string()));
  const fs::path folder = check_hf_folder(folder_arg, "write_hf_folder");
  const fs::path parent = folder.has_parent_path() ? folder.parent_path() : fs::path(".");

  // Shards: params in order, a new file where the next param would pass the limit.
  const auto specs = decoder_params(shape);
  std::vector<std::vector<std::size_t>> shards(1);
  std::vector<std::uint64_t> shard_bytes(1, 0);
  std::uint64_t total = 0;
  std::vector<std::uint64_t> sizes;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    std::uint64_t n = dtype_size(dtype);
    for (const auto e : specs[i].shape) n *= static_cast<std::uint64_t>(e);
    sizes.push_back(n);
    total += n;
    if (!shards.back().empty() && shard_bytes.back() + n > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes.push_back(0);
    }
    shards.back().push_back(i);
    shard_bytes.back() += n;
  }
  const std::size_t count = shards.size();
  const auto shard_name = [&](std::size_t k) {
    return count == 1 ? std::string(kSingleFile)
                      : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, count);
  };

  remove_dead_exports(parent, folder);
  const fs::path tmp = make_export_temporary(parent, folder);
  IoStatus renamed;  // the rename into place, then the fsync of `parent`
  try {
    const auto write_json = [&](const std::string& name, const json& j) {
      OutputFile out("write_hf_folder", tmp / name);
      out.write(j.dump(2));
      out.write("\n");
      out.commit();
    };
    write_json("config.json", config);
    for (const auto& [name, bytes] : extras.files) {
      OutputFile out("write_hf_folder", tmp / name);
      out.write(bytes);
      out.commit();
    }
    std::vector<std::byte> buffer;
    json weight_map = json::object();
    for (std::size_t k = 0; k < count; ++k) {
      std::vector<SafetensorsEntry> entries;
      for (const auto i : shards[k]) {
        entries.push_back({specs[i].name, safetensors_dtype_name(dtype), specs[i].shape});
        weight_map[specs[i].name] = shard_name(k);
      }
      OutputFile out("write_hf_folder", tmp / shard_name(k));
      write_safetensors(out, entries,
                        [&](std::size_t e) {
                          const auto i = shards[k][e];
                          buffer.assign(static_cast<std::size_t>(sizes[i]), std::byte{0});
                          fill(specs[i], buffer);
                          return std::span<const std::byte>(buffer);
                        },
                        {{"format", "pt"}});
    }
    if (count > 1)
      write_json(kIndexFile, {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
    if (const IoStatus status = fsync_directory_status(tmp)) throw fsync_failure(tmp, status);
    // rename(2) replaces an empty directory and fails on one that is not empty: a folder filled
    // meanwhile is never overwritten.
    renamed = rename_durably(tmp, folder);
    if (renamed && std::string_view(renamed.call) == "rename")
      throw Error(fmt::format("write_hf_folder '{}': cannot rename '{}' to it: {}", folder.string(),
                              tmp.string(), renamed.why()));
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  if (renamed) throw fsync_failure(parent, renamed);
}

}  // namespace shardswap
