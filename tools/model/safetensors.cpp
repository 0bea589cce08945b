#include "model/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "shardswap/error.h"
#include "shardswap/json_reader.h"
#include "support/quoted.h"

namespace shardswap {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

namespace {

// A bigger header is no checkpoint's: the reference implementation refuses the same size, and a
// corrupt size must not make the reader parse gigabytes.
constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;
// The format's header is three levels deep ({name: {shape: [...]}}); a little room beyond that
// lets a deeper one be refused naming its field rather than for its depth.
constexpr std::size_t kMaxHeaderDepth = 8;
// Its lists are a shape (a dimension each) and data_offsets (two): a longer list is refused as
// soon as it grows past this, before a hostile one (a million {}) is built.
constexpr std::size_t kMaxHeaderListItems = 1024;

struct DTypeInfo {
  std::string_view name;
  std::size_t size;
};
// Every dtype of the format whose elements are whole bytes.
constexpr DTypeInfo kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
    {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8},     {"C64", 8},
};

[[noreturn]] void refuse(const fs::path& path, std::string_view why) {
  throw ConfigError(fmt::format("safetensors file '{}': {}", path.string(), why));
}

[[noreturn]] void refuse_tensor(const fs::path& path, std::string_view name, std::string_view why) {
  throw ConfigError(
      fmt::format("safetensors file '{}': tensor {}: {}", path.string(), quote_value(name), why));
}

// numel of `shape`, or empty when it does not fit in 63 bits.
std::optional<std::uint64_t> count_of(const std::vector<std::int64_t>& shape) {
  unsigned __int128 n = 1;
  for (const auto d : shape) {
    if (d == 0) return 0;
    n *= static_cast<std::uint64_t>(d);
    if (n > static_cast<unsigned __int128>(INT64_MAX)) {
      // A later zero still makes it empty.
      return std::any_of(shape.begin(), shape.end(), [](auto e) { return e == 0; })
                 ? std::optional<std::uint64_t>(0)
                 : std::nullopt;
    }
  }
  return static_cast<std::uint64_t>(n);
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// A tensor's entry with where its data lies in the data section.
struct Placed {
  std::uint64_t begin, end;
  SafetensorsTensor tensor;
};

// The header's `n` bytes of JSON at `text`.
nlohmann::json parse_header(const fs::path& path, const char* text, std::uint64_t n) {
  // The bounded reader: linear in the header's size (nlohmann's callback parser is quadratic in
  // a list of many objects), at most kMaxHeaderDepth deep, and a repeated name refused (which
  // entry counts would otherwise be the parser's choice). Order is not needed: the tensors are
  // sorted by their offsets below.
  nlohmann::json header;
  try {
    header = parse_json(
        std::string_view(text, n), "",
        JsonLimits{kMaxHeaderDepth, kMaxHeaderBytes, "a safetensors header", kMaxHeaderListItems});
  } catch (const JsonError& e) {
    if (e.kind() == JsonError::Kind::repeated_key && e.path().size() == 1)
      refuse_tensor(path, e.path().front().key, "named twice in the header");
    // Its line and column count in the header's text, which starts at byte 8 of the file.
    refuse(path, fmt::format("the header, at {}", e.located()));
  }
  return header;
}

// Tensor `name`'s entry, checked against the `data_size` bytes of data at `data`.
Placed tensor_entry(const fs::path& path, const std::string& name, const nlohmann::json& entry,
                    const std::byte* data, std::uint64_t data_size) {
  if (!entry.is_object()) refuse_tensor(path, name, "its entry is not an object");
  for (const auto& [key, value] : entry.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      refuse_tensor(path, name, fmt::format("unknown field {}", quote_value(key)));
  SafetensorsTensor t;
  t.name = name;
  if (!entry.contains("dtype") || !entry["dtype"].is_string())
    refuse_tensor(path, name, "dtype missing or not a string");
  t.dtype = entry["dtype"].get<std::string>();
  const std::size_t width = safetensors_dtype_size(t.dtype);
  if (width == 0)
    refuse_tensor(path, name,
                  fmt::format("dtype {} is not one this reader knows", quote_value(t.dtype)));
  if (!entry.contains("shape") || !entry["shape"].is_array())
    refuse_tensor(path, name, "shape missing or not an array");
  for (const auto& d : entry["shape"]) {
    if (!d.is_number_integer() ||
        (d.is_number_unsigned() && d.get<std::uint64_t>() > INT64_MAX) ||
        (!d.is_number_unsigned() && d.get<std::int64_t>() < 0))
      refuse_tensor(path, name,
                    fmt::format("shape {}: not all integers >= 0", entry["shape"].dump()));
    t.shape.push_back(d.get<std::int64_t>());
  }
  const auto& offsets = entry.contains("data_offsets") ? entry["data_offsets"] : nlohmann::json();
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    refuse_tensor(
        path, name,
        fmt::format("data_offsets {}: not [begin, end] of integers >= 0", offsets.dump()));
  const auto begin = offsets[0].get<std::uint64_t>();
  const auto end = offsets[1].get<std::uint64_t>();
  if (end < begin)
    refuse_tensor(path, name, fmt::format("data_offsets [{}, {}]: end before begin", begin, end));
  if (end > data_size)
    refuse_tensor(path, name,
                  fmt::format("data_offsets [{}, {}]: beyond the {} bytes of data in the file",
                              begin, end, data_size));
  const auto count = count_of(t.shape);
  if (!count || *count > (end - begin) / width || *count * width != end - begin)
    refuse_tensor(path, name,
                  fmt::format("shape {} of {} ({} bytes an element) does not fill "
                              "data_offsets [{}, {}] ({} bytes)",
                              shape_text(t.shape), t.dtype, width, begin, end, end - begin));
  t.data = data + begin;
  t.bytes = static_cast<std::size_t>(end - begin);
  return {begin, end, std::move(t)};
}

// The entries sorted by offset must tile the data section exactly: no overlap, no gap.
void check_tiling(const fs::path& path, std::vector<Placed>& placed, std::uint64_t data_size) {
  std::stable_sort(placed.begin(), placed.end(), [](const Placed& a, const Placed& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t at = 0;
  const std::string* previous = nullptr;
  for (const auto& p : placed) {
    if (p.begin < at)
      refuse_tensor(path, p.tensor.name,
                    fmt::format("data_offsets [{}, {}] overlap those of {} (ending at {})", p.begin,
                                p.end, quote_value(*previous), at));
    if (p.begin > at)
      refuse_tensor(path, p.tensor.name,
                    fmt::format("data_offsets [{}, {}] leave bytes [{}, {}) of the data unused",
                                p.begin, p.end, at, p.begin));
    at = p.end;
    previous = &p.tensor.name;
  }
  if (at != data_size)
    refuse(path, fmt::format("the tensors' data ends at byte {} of the {} bytes after the header",
                             at, data_size));
}

}  // namespace

std::size_t safetensors_dtype_size(std::string_view dtype) {
  for (const auto& d : kDTypes)
    if (d.name == dtype) return d.size;
  return 0;
}

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
  }
  return "?";
}

std::optional<DType> dtype_of_safetensors(std::string_view dtype) {
  for (const DType t : {DType::bf16, DType::f16, DType::f32, DType::f64})
    if (dtype == safetensors_dtype_name(t)) return t;
  return std::nullopt;
}

std::int64_t SafetensorsTensor::numel() const {
  std::int64_t n = 1;
  for (const auto d : shape) n *= d;  // validated on open: fits
  return n;
}

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
  SafetensorsFile file;
  file.path_ = path;
  auto mapping = MappedFile::open(path, fmt::format("safetensors file '{}'", path.string()));
  if (mapping->size() < 8)
    refuse(path, fmt::format("{} bytes: too short for the 8-byte header size", mapping->size()));
  const std::byte* base = mapping->data();
  const std::uint64_t size = mapping->size();
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(base[i]);
  if (n > kMaxHeaderBytes)
    refuse(path, fmt::format("header size {} is above the limit of {} bytes", n, kMaxHeaderBytes));
  if (n > size - 8)
    refuse(path,
           fmt::format("header size {} is beyond the file ({} bytes after the size)", n, size - 8));
  const nlohmann::json header = parse_header(path, reinterpret_cast<const char*>(base + 8), n);
  if (!header.is_object()) refuse(path, "the header is not a JSON object");

  const std::uint64_t data_size = size - 8 - n;
  std::vector<Placed> placed;
  for (const auto& [name, entry] : header.items()) {
    if (name != "__metadata__") {
      placed.push_back(tensor_entry(path, name, entry, base + 8 + n, data_size));
      continue;
    }
    if (!entry.is_object()) refuse(path, "__metadata__ is not an object of strings");
    for (const auto& [key, value] : entry.items()) {
      if (!value.is_string())
        refuse(path, fmt::format("__metadata__ {} is not a string", quote_value(key)));
      file.metadata_[key] = value.get<std::string>();
    }
  }
  check_tiling(path, placed, data_size);
  for (auto& p : placed) {
    file.index_.emplace(p.tensor.name, file.tensors_.size());
    file.tensors_.push_back(std::move(p.tensor));
  }
  file.header_bytes_ = n;
  file.mapping_ = std::move(mapping);
  return file;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void write_safetensors(OutputFile& out, const std::vector<SafetensorsEntry>& entries,
                       const SafetensorsBytes& bytes_of,
                       const std::map<std::string, std::string>& metadata) {
  const auto target = out.target().string();
  const auto refuse_entry = [&](const std::string& name, std::string_view why) {
    return ConfigError(
        fmt::format("write_safetensors '{}': tensor {}: {}", target, quote_value(name), why));
  };
  // Strict UTF-8: a name the JSON could only hold with replaced bytes would be another name.
  const auto utf8 = [](const std::string& s) {
    try {
      (void)ordered_json(s).dump();
      return true;
    } catch (const ordered_json::exception&) {
      return false;
    }
  };
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    for (const auto& [key, value] : metadata)
      if (!utf8(key) || !utf8(value))
        throw ConfigError(fmt::format("write_safetensors '{}': metadata {} is not UTF-8", target,
                                      quote_value(key)));
    header["__metadata__"] = metadata;
  }
  std::vector<std::size_t> sizes;
  std::uint64_t offset = 0;
  for (const auto& e : entries) {
    if (e.name.empty() || e.name == "__metadata__")
      throw refuse_entry(e.name, "not a name a tensor can have");
    if (!utf8(e.name)) throw refuse_entry(e.name, "the name is not UTF-8");
    if (header.contains(e.name)) throw refuse_entry(e.name, "named twice");
    const std::size_t width = safetensors_dtype_size(e.dtype);
    if (width == 0)
      throw refuse_entry(e.name, fmt::format("unknown dtype {}", quote_value(e.dtype)));
    if (std::any_of(e.shape.begin(), e.shape.end(), [](auto d) { return d < 0; }))
      throw refuse_entry(e.name, fmt::format("shape {} has a negative size", shape_text(e.shape)));
    const auto count = count_of(e.shape);
    if (!count || *count > (UINT64_MAX >> 4) / width)
      throw refuse_entry(e.name, fmt::format("shape {} is too large", shape_text(e.shape)));
    const std::uint64_t bytes = *count * width;
    header[e.name] = {
        {"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(static_cast<std::size_t>(bytes));
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::byte length[8];
  for (int i = 0; i < 8; ++i)
    length[i] = static_cast<std::byte>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xff);
  try {
    out.write(length, sizeof length);
    out.write(text);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const auto data = bytes_of(i);
      if (data.size() != sizes[i])
        throw Error(fmt::format("tensor {}: {} bytes given, its header says {}",
                                quote_value(entries[i].name), data.size(), sizes[i]));
      out.write(data.data(), data.size());
    }
    out.commit();
  } catch (const ConfigError&) {
    throw;  // the target refused at the last check, or the bytes' provider: its message says why
  } catch (const std::exception& e) {
    throw Error(fmt::format("write_safetensors '{}': {}", target, e.what()));
  }
}

void write_safetensors(OutputFile& out, const std::vector<SafetensorsData>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& t : tensors) entries.push_back(t.entry);
  write_safetensors(
      out, entries, [&](std::size_t i) { return tensors[i].data; }, metadata);
}

}  // namespace shardswap
