// The safetensors format, read and written: an 8-byte little-endian header size N, N bytes of
// JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the
// tensors' bytes. Hugging Face checkpoints and `shardswap ckpt export` both use it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardswap/dtype.h"
#include "files/mapped_file.h"
#include "files/output_file.h"

namespace shardswap {

/// Bytes per element of a safetensors dtype name ("F32", "BF16", "I64", ...), or 0 for a name
/// the format does not define (or a sub-byte one: F4, F6_*, which this code does not read).
std::size_t safetensors_dtype_size(std::string_view dtype);
/// "BF16", "F16", "F32", "F64".
const char* safetensors_dtype_name(DType t);
/// The DType of "BF16", "F16", "F32" or "F64"; empty for any other name.
std::optional<DType> dtype_of_safetensors(std::string_view dtype);

/// One tensor of a mapped file; `data` points into the mapping (not necessarily aligned).
struct SafetensorsTensor {
  std::string name;
  std::string dtype;  ///< as the file names it
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;
  std::size_t bytes = 0;

  std::int64_t numel() const;
};

/// A safetensors file mapped read-only and validated as a whole on open. Copies share the
/// mapping, which lives until the last copy goes; the file must not shrink meanwhile.
class SafetensorsFile {
 public:
  /// Maps `path` and checks everything before returning: a regular file; the header size within
  /// the file and at most 100 MiB; the header a JSON object without repeated names; each entry
  /// an object of exactly dtype (a name the format defines), shape (integers >= 0) and
  /// data_offsets ([begin, end], end - begin == numel * dtype size); the entries' data in
  /// order, without overlap or gap, filling the file to its end (as the reference
  /// implementation requires); "__metadata__" an object of strings. Throws ConfigError
  /// "safetensors file 'PATH': ...", naming the tensor where one is at fault.
  static SafetensorsFile open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  /// The tensors in the order of their data in the file.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  /// The tensor called `name`, or null.
  const SafetensorsTensor* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// The size of the header (the JSON text, padding included), as stored in the first 8 bytes.
  std::uint64_t header_bytes() const { return header_bytes_; }

 private:
  std::filesystem::path path_;
  std::shared_ptr<const MappedFile> mapping_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
  std::uint64_t header_bytes_ = 0;
};

/// What the header of a tensor to write says.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  ///< a name the format defines ("BF16", "F32", ...)
  std::vector<std::int64_t> shape;
};

/// The bytes of entry `index`, asked for in the order of the entries, just before they are
/// written: a caller can produce one tensor at a time. The span must stay valid until the next
/// call and hold exactly numel * dtype size bytes (little-endian).
using SafetensorsBytes = std::function<std::span<const std::byte>(std::size_t index)>;

/// Writes `entries` through `out` (its temporary, fsynced and renamed over the target by
/// out.commit()): the header lists them in the given order, "__metadata__" first when not
/// empty, padded with spaces so the data starts 8-byte aligned; the data follows in the same
/// order. Entries are checked before anything is written (names non-empty, unique, UTF-8 and
/// not "__metadata__"; dtypes known; shapes >= 0): ConfigError naming the tensor. A failing
/// write throws Error naming the file, and leaves no file; ConfigError when the target was
/// replaced meanwhile by something it must not overwrite.
void write_safetensors(OutputFile& out, const std::vector<SafetensorsEntry>& entries,
                       const SafetensorsBytes& bytes_of,
                       const std::map<std::string, std::string>& metadata);

/// The same for tensors held in memory.
struct SafetensorsData {
  SafetensorsEntry entry;
  std::span<const std::byte> data;
};
void write_safetensors(OutputFile& out, const std::vector<SafetensorsData>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace shardswap
