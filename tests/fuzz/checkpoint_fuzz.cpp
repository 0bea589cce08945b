// Fuzz target: bytes -> the files of a checkpoint directory -> read_checkpoint_metadata and
// read_checkpoint_tensors (bit16 weights, then fp32 masters from the rank files), the readers of
// `shardswap ckpt inspect|export`. Bad files must end in ConfigError naming the file; any other
// exception escapes and aborts, which libFuzzer reports as a crash.
//
// Input layout (tests/fuzz/make_checkpoint_seeds.py writes it from a real checkpoint):
//   byte 0: mode; bit 0 set = "fix up": the harness adds the checksums, so that mutations reach
//           the parsers behind them (FNV-1a cannot be matched by mutation); clear = raw files,
//           which exercises the checksum and size checks themselves.
//   then sections separated by kSeparator: metadata, weights.bin, then the rank files
//           (rank-0000r-of-0000W.bin, W = the number of rank sections).
//   In fix-up mode the metadata section is the metadata value only (the harness wraps it as
//   save_checkpoint does, with its FNV-1a), and each binary section lacks its 8-byte trailer;
//   where the metadata parses and lists a file, the harness also writes that file's actual size
//   and checksum into it (format 2 records both), so that a mutated file is judged by its
//   header and save id, not refused by the recorded checksum alone.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "shardswap/checkpoint.h"
#include "shardswap/error.h"
#include "shardswap/json_reader.h"

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSeparator = "\n--ssfz-file--\n";

// One directory per process, emptied before each input (libFuzzer runs inputs one at a time).
const fs::path& scratch_dir() {
  static const fs::path dir = [] {
    std::string tmpl = (fs::temp_directory_path() / "shardswap-fuzz-ckpt-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) std::abort();
    return fs::path(tmpl);
  }();
  return dir;
}

void write_file(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) std::abort();  // the harness's own failure, not a finding in the reader
}

std::string with_trailer(std::string_view body) {
  std::string out(body);
  const std::uint64_t hash = shardswap::fnv1a64(body.data(), body.size());
  out.append(reinterpret_cast<const char*>(&hash), sizeof hash);  // little-endian (x86-64)
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool fix_up = (data[0] & 1) != 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::vector<std::string_view> sections;
  for (std::size_t begin = 0;;) {
    const std::size_t end = input.find(kSeparator, begin);
    sections.push_back(input.substr(begin, end == std::string_view::npos ? end : end - begin));
    if (end == std::string_view::npos) break;
    begin = end + kSeparator.size();
  }
  if (sections.size() > 10) return 0;  // bounded work per input; more ranks add nothing new

  const fs::path& dir = scratch_dir();
  for (const auto& entry : fs::directory_iterator(dir)) fs::remove(entry.path());
  const int world = static_cast<int>(sections.size()) - 2;
  const auto name_of = [&](std::size_t i) -> std::string {
    return i == 0   ? "metadata.json"
           : i == 1 ? "weights.bin"
                    : fmt::format("rank-{:05}-of-{:05}.bin", static_cast<int>(i) - 2, world);
  };
  std::vector<std::string> files(sections.size());
  for (std::size_t i = 1; i < sections.size(); ++i)
    files[i] = fix_up ? with_trailer(sections[i]) : std::string(sections[i]);
  std::string meta(sections[0]);
  if (fix_up) {
    // Bounded as the reader is: nlohmann's own parse would accept any depth, and dump() below
    // would then overflow the harness's stack, not the reader's.
    nlohmann::json parsed;
    try {
      parsed = shardswap::parse_json(meta, "metadata", {});
    } catch (const shardswap::JsonError&) {
    }
    if (parsed.is_object() && parsed.contains("files") && parsed["files"].is_array()) {
      for (auto& record : parsed["files"]) {
        if (!record.is_object() || !record.contains("name")) continue;
        for (std::size_t i = 1; i < files.size(); ++i)
          if (record["name"] == name_of(i)) {
            std::uint64_t trailer = 0;
            std::memcpy(&trailer, files[i].data() + files[i].size() - 8, 8);
            record["bytes"] = files[i].size();
            record["fnv1a64"] = fmt::format("{:016x}", trailer);
          }
      }
      meta = parsed.dump(1);
    }
    meta = fmt::format(
        "{{\"format\":\"shardswap-checkpoint\",\"fnv1a64\":\"{:016x}\","
        "\"metadata\":{}}}\n",
        shardswap::fnv1a64(meta.data(), meta.size()), meta);
  }
  files[0] = std::move(meta);
  for (std::size_t i = 0; i < files.size(); ++i) write_file(dir / name_of(i), files[i]);
  try {
    (void)shardswap::read_checkpoint_metadata(dir);
    (void)shardswap::read_checkpoint_tensors(dir, /*master=*/false);
    (void)shardswap::read_checkpoint_tensors(dir, /*master=*/true);
  } catch (const shardswap::ConfigError&) {
  }
  return 0;
}
