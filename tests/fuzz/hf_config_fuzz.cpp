// Fuzz target: bytes -> a model folder's config.json -> read_hf_config (what eval, train and plan
// read of a Hugging Face model before anything else), then hf_config_to_json of the shape it
// accepted (what `ckpt export --format hf` writes) read back. Bad input must end in ConfigError
// naming the file or the field; any other exception (or a ConfigError from reading back what was
// written) escapes and aborts, which libFuzzer reports as a crash.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "shardswap/error.h"
#include "model/hf_config.h"

namespace {

namespace fs = std::filesystem;

const fs::path& scratch_file() {
  static const fs::path file = [] {
    std::string tmpl = (fs::temp_directory_path() / "shardswap-fuzz-hf-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) std::abort();
    return fs::path(tmpl) / "config.json";
  }();
  return file;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  {
    std::ofstream out(scratch_file(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!out) std::abort();  // the harness's own failure, not a finding in the reader
  }
  const shardswap::HfSeqLen seq_len{64, "data.seq_len"};
  nlohmann::json written;
  try {
    const auto config = shardswap::read_hf_config(scratch_file(), seq_len);
    // Some shapes no config.json can describe (a qwen2 without q/k/v biases): ConfigError too.
    written =
        shardswap::hf_config_to_json(config.shape, config.dtype.value_or(shardswap::DType::bf16));
  } catch (const shardswap::ConfigError&) {
    return 0;
  }
  // What an export writes for an accepted shape must read back: a refusal here escapes (a
  // finding: `ckpt export --format hf` would write a folder that its own reader refuses).
  (void)shardswap::hf_config_from_json(written, shardswap::HfConfigSource{{}, "written."},
                                       shardswap::HfSeqLen{});
  return 0;
}
