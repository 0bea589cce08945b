// Fuzz target: bytes -> a .safetensors file -> SafetensorsFile::open (the reader of every model
// folder: eval, train, plan, ckpt export's checks), then every tensor's bytes read. Bad files must
// end in ConfigError naming the file; any other exception escapes and aborts, and a read outside
// the mapping is an ASan report: both are findings.
//
// Input layout:
//   byte 0: mode; bit 0 set = "fix up": the rest is the header's JSON text, kSeparator, then the
//           data, and the harness writes the 8-byte header size in front (mutations of the JSON
//           then reach the parser and the entry checks instead of the size check); clear = the
//           rest is the file as it is, size included.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "shardswap/error.h"
#include "model/safetensors.h"

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSeparator = "\n--ssfz-data--\n";

// One file per process, rewritten for each input (libFuzzer runs inputs one at a time).
const fs::path& scratch_file() {
  static const fs::path file = [] {
    std::string tmpl = (fs::temp_directory_path() / "shardswap-fuzz-st-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) std::abort();
    return fs::path(tmpl) / "model.safetensors";
  }();
  return file;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool fix_up = (data[0] & 1) != 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string bytes;
  if (fix_up) {
    const auto cut = input.find(kSeparator);
    const std::string_view header = input.substr(0, cut);
    const std::string_view rest =
        cut == std::string_view::npos ? std::string_view() : input.substr(cut + kSeparator.size());
    for (int i = 0; i < 8; ++i)
      bytes.push_back(static_cast<char>((static_cast<std::uint64_t>(header.size()) >> (8 * i)) & 0xff));
    bytes.append(header);
    bytes.append(rest);
  } else {
    bytes.assign(input);
  }
  {
    std::ofstream out(scratch_file(), std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) std::abort();  // the harness's own failure, not a finding in the reader
  }
  try {
    const auto file = shardswap::SafetensorsFile::open(scratch_file());
    // Every byte the reader vouches for must lie in the mapping.
    unsigned sum = 0;
    for (const auto& t : file.tensors()) {
      for (std::size_t i = 0; i < t.bytes; ++i) sum += std::to_integer<unsigned>(t.data[i]);
      if (file.find(t.name) != &t) std::abort();  // a tensor not found by its own name
    }
    volatile unsigned keep = sum;
    (void)keep;
  } catch (const shardswap::ConfigError&) {
  }
  return 0;
}
